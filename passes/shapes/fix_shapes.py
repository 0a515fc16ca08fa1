"""fix-shapes: make every symbolic dimension of the graph inputs static, and the outputs too.

Matches: graph inputs whose shape has symbolic or unknown dims (``batch_size``,
``sequence_length``, ``past_sequence_length + 1``, ``s0``...).

Produces: the same graph with static input shapes taken from ``--shape NAME=D0,D1,...``
(``ctx.shapes``) or, for inputs nobody gave, from the symbols' values: a symbol bound by one
input has that value on every input and output, an expression such as
``past_sequence_length + 1`` is evaluated from its symbols, and anything else gets the
``batch`` / ``seq`` / ``past`` options through :func:`qnnpasses.ir.shapes.resolve_dim` (the rule
the verification inputs use, so a model verified before this pass runs with the same shapes
after it).  Output shapes come from shape inference on the now static inputs, or from the
same symbols.  Stale intermediate shapes are cleared; the pass manager re-infers them.

Why it is safe: only declared shapes change, never a node; the manager's strict shape
inference rejects a shape that contradicts the graph.  The HTP needs static shapes: dynamic
axes break conversion and memory planning.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx_graphsurgeon as gs
from qnnpasses.passes.shapes._symbols import SymbolTable, decode_step, resolve_inputs

from qnnpasses.ir.checks import check_with_output_dims, infer_proto, value_info_dims
from qnnpasses.ir.model import IRModel, export_with_stubs
from qnnpasses.ir.shapes import DEFAULT_BATCH, DEFAULT_PAST, DEFAULT_SEQUENCE, is_static
from qnnpasses.passmanager.api import (
    CONTRIB_LOWERED,
    DIMS_BOUND,
    STATIC_SHAPES,
    Pass,
    PassContext,
    PassResult,
    changes_interface,
    register_pass,
)


@register_pass
class FixShapes(Pass):
    name = "fix-shapes"
    summary = "symbolic input/output dims (batch, sequence, past, 'past + 1') -> static dims"
    contract = changes_interface("symbolic input/output dims become the static dims of its options")
    # after the onnxruntime-op lowerings: shape inference stops at contrib ops, and what they
    # become must get its static shapes with the rest
    requires = frozenset({CONTRIB_LOWERED})
    ensures = frozenset({STATIC_SHAPES, DIMS_BOUND})

    @dataclass
    class Options:
        batch: int = field(default=DEFAULT_BATCH, metadata={"help": "value of batch-like symbols"})
        seq: int | None = field(default=None, metadata={
            "help": f"value of sequence-like symbols (default: the step a KV export bakes in, else {DEFAULT_SEQUENCE})"})
        past: int = field(default=DEFAULT_PAST, metadata={"help": "value of past/cache-length symbols"})

    def _resolve(self, ir: IRModel, ctx: PassContext) -> tuple[SymbolTable, dict[str, gs.Variable], dict[str, list[int]]]:
        inputs = {t.name: t for t in ir.graph.inputs if isinstance(t, gs.Variable)}
        seq = self.options.seq if self.options.seq is not None else (decode_step(inputs) or DEFAULT_SEQUENCE)
        table = SymbolTable(batch=self.options.batch, sequence=seq, past=self.options.past)
        return table, inputs, resolve_inputs(table, inputs, ctx.shapes)

    def planned_input_shapes(self, ir: IRModel, ctx: PassContext) -> dict[str, list[int]] | None:
        try:
            return self._resolve(ir, ctx)[2]
        except ValueError:  # contradictory requests: run() reports them
            return None

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        table, inputs, shapes = self._resolve(ir, ctx)
        notes = [f"input '{n}' has unknown rank; give --shape {n}=..." for n, t in inputs.items() if n not in shapes]
        fixed = 0
        for name, dims in shapes.items():
            tensor = inputs[name]
            fixed += len(dims) if tensor.shape is None else sum(1 for d in tensor.shape if not is_static(d))
            tensor.shape = list(dims)
        if fixed:
            _clear_intermediate_shapes(ir.graph)
        output_dims = _fix_output_shapes(ir, table)
        symbols = ", ".join(f"{k}={v}" for k, v in sorted(table.values.items()))
        stats = {"dims_fixed": fixed, "output_dims_fixed": output_dims}
        if symbols:
            stats["symbols"] = symbols
        return PassResult(changed=bool(fixed or output_dims), stats=stats, notes=notes)


def _clear_intermediate_shapes(graph: gs.Graph) -> None:
    """Forget inferred shapes that still carry the old symbols; inference refills them."""
    io = {id(t) for t in list(graph.inputs) + list(graph.outputs)}
    for tensor in graph.tensors().values():
        if isinstance(tensor, gs.Variable) and id(tensor) not in io:
            tensor.shape = None


def _fix_output_shapes(ir: IRModel, table: SymbolTable) -> int:
    """Static output dims: inferred from the static inputs where possible, else from the symbols."""
    pending = [t for t in ir.graph.outputs if t.shape is None or not all(is_static(d) for d in t.shape)]
    if not pending:
        return 0
    inferred = _inferred_output_dims(ir, {t.name for t in pending})
    fixed = 0
    for tensor in pending:
        dims = list(tensor.shape) if tensor.shape is not None else inferred.get(tensor.name)
        if dims is None:
            continue
        from_inference = inferred.get(tensor.name) or [None] * len(dims)
        new = []
        for index, dim in enumerate(dims):
            value = dim if is_static(dim) else _first_static(from_inference[index] if index < len(from_inference) else None,
                                                            table.known(dim))
            fixed += int(value is not None and not is_static(dim))
            new.append(value if value is not None else dim)
        tensor.shape = new
    return fixed


def _first_static(*candidates):
    return next((c for c in candidates if is_static(c)), None)


def _inferred_output_dims(ir: IRModel, names: set[str]) -> dict[str, list]:
    """Dims of the graph outputs named ``names`` (those still symbolic) by shape inference on
    the now static inputs.

    Taken from the graph check's own strict inference (:func:`check_with_output_dims`), which
    also refreshes every intermediate shape: the manager then finds the graph checked and
    does not infer it a second time (the first inference of the whole, unfolded graph, the
    most costly one of a pipeline).  Where the check fails, by plain inference with the outputs'
    own dims erased (the manager's check then reports the failure).  The proto is exported
    without value infos and inferred in place: inference starts from scratch anyway."""
    problem, dims = check_with_output_dims(ir)
    if problem is None:
        return {name: found for name, found in dims.items() if name in names}
    proto, _ = export_with_stubs(ir, value_infos=False)
    for output in proto.graph.output:
        output.type.tensor_type.ClearField("shape")
    try:
        inferred = infer_proto(proto, copy=False)
    except Exception:  # inference trouble only means we fall back to the symbols
        return {}
    found = {}
    for info in list(inferred.graph.output) + list(inferred.graph.value_info):
        if info.name in names and info.name not in found and (dims := value_info_dims(info)) is not None:
            found[info.name] = dims
    return found
