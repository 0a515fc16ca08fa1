"""The project's constant folder, used by ``simplify`` (and through it by the analyses).

It works node by node on the graphsurgeon graph, so it never builds a protobuf holding
the weights and scales to models of any size:

* ``Constant`` nodes become initializers (later passes then see ``gs.Constant``);
* ``Shape`` of a tensor whose (selected) dims are static becomes a constant, and so does
  ``Gather``/``Slice`` of a ``Shape`` picking only static dims (dynamic batch, static hidden);
* a node whose inputs are all constants is evaluated with the ONNX reference evaluator at
  the graph's opset and its outputs become constants — unless an output would be larger
  than ``max_bytes`` (a layout op on a weight, e.g. ``Transpose(W)``, may fold whatever its
  size since it does not grow the model), the node is random, quantizes/dequantizes (that
  would undo weight quantization), owns a subgraph, or produces a graph output;
* no-ops and empty ``Concat`` operands go, constant operands of commutative ops go second
  (see ``passes/fold/_nops.py``).

The size of what ``ConstantOfShape``/``Expand``/``Tile``/``Range`` would create is computed
from their inputs *before* evaluating them, so a [1, 1, 32768, 32768] mask is never built.

Values are computed exactly as the runtime would (same op, same opset), so folding is
lossless up to the last ulp of transcendental ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter
from qnnpasses.ir.op_kinds import LAYOUT
from qnnpasses.passes.fold._nops import (
    constants_second,
    prune_empty_concat_inputs,
    remove_nops,
)

from qnnpasses.ir.graph_ops import finish_graph, graph_opsets, toposort
from qnnpasses.ir.model import const_nbytes
from qnnpasses.ir.shapes import is_static
from qnnpasses.passmanager.rewrite import constant_value

NEVER_FOLD = frozenset({
    "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli",
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "If", "Loop", "Scan", "Constant",
})
# Ops that only move a weight's bytes around: they may fold whatever the size.
LAYOUT_OPS = LAYOUT


@dataclass
class FoldReport:
    """What folding did, and why it left candidates alone (for ``ctx.verbose`` notes)."""

    constants_lifted: int = 0
    shapes_folded: int = 0
    nodes_folded: int = 0
    nops_removed: int = 0
    empty_inputs_dropped: int = 0
    operands_swapped: int = 0
    skipped: dict[str, str] = field(default_factory=dict)

    def skip(self, node: gs.Node, reason: str) -> None:
        self.skipped[node.name] = f"{node.op}: {reason}"

    def rewrites(self) -> int:
        """How many rewrites so far (dead-code removal aside, which enables no further fold)."""
        return self.enabling() + self.operands_swapped

    def enabling(self) -> int:
        """Rewrites that can enable another fold (swapping commutative operands cannot)."""
        return self.folds() + self.nops_removed + self.empty_inputs_dropped

    def folds(self) -> int:
        """Rewrites that made new constants."""
        return self.constants_lifted + self.shapes_folded + self.nodes_folded


# --------------------------------------------------------------------------- Constant nodes


def constants_to_initializers(graph: gs.Graph, report: FoldReport) -> None:
    """Turn every ``Constant`` node of the main graph into an initializer of the same name.

    Graph outputs are told by name, as ``tensor in graph.outputs`` tells them (graphsurgeon
    tensors are equal by name), from a set made once: a KV-cache decoder has two outputs
    per layer, and scanning them for every Constant node grew with the square of the layers."""
    outputs = {t.name for t in graph.outputs}
    for node in list(graph.nodes):
        if node.op != "Constant" or node.inputs or len(node.outputs) != 1:
            continue
        out = node.outputs[0]
        if out.name in outputs:
            report.skip(node, "produces a graph output")
            continue
        value = constant_value(out)
        if value is None:  # sparse_value, value_string(s): leave them alone
            report.skip(node, "no dense numeric value")
            continue
        out.to_constant(np.asarray(value))
        node.outputs.clear()
        report.constants_lifted += 1


# --------------------------------------------------------------------------- shape folding


def _shape_of_shape_node(node: gs.Node) -> list | None:
    """The dims a ``Shape`` node reports (``start``/``end`` applied), static or not."""
    shape = node.inputs[0].shape
    if shape is None:
        return None
    rank = len(shape)
    start, end = node.attrs.get("start", 0), node.attrs.get("end", rank)
    start, end = (max(0, min(rank, v + rank if v < 0 else v)) for v in (start, end))
    return list(shape[start:end])


def _static_array(dims: list) -> np.ndarray | None:
    return np.array(dims, dtype=np.int64) if all(is_static(d) for d in dims) else None


def _picked_shape_value(node: gs.Node) -> np.ndarray | None:
    """Value of ``Gather``/``Slice`` over a ``Shape`` output when every picked dim is static."""
    src = node.inputs[0]
    shape_node = src.inputs[0] if src.inputs else None
    if shape_node is None or shape_node.op != "Shape":
        return None
    dims = _shape_of_shape_node(shape_node)
    if dims is None:
        return None
    positions = np.arange(len(dims), dtype=np.int64)
    params = [constant_value(t) if t.name else None for t in node.inputs[1:]]
    if any(p is None for p in params):
        return None
    if node.op == "Gather":
        picked = np.take(positions, params[0], axis=0)
    else:  # Slice(data, starts, ends[, axes[, steps]]) on a 1-D tensor
        starts, ends = int(params[0][0]), int(params[1][0])
        steps = int(params[3][0]) if len(params) > 3 else 1
        if len(params) > 2 and int(params[2][0]) not in (0, -1):
            return None
        picked = positions[slice(starts, ends, steps)]
    values = [dims[i] for i in np.asarray(picked).ravel()]
    array = _static_array(values)
    return None if array is None else array.reshape(np.shape(picked))


#: The ops :func:`fold_shape_value` may fold although an input is computed.
SHAPE_VALUE_OPS = frozenset({"Shape", "Size", "Gather", "Slice"})


def fold_shape_value(node: gs.Node) -> np.ndarray | None:
    """The constant value of a shape-arithmetic node that static dims decide, if any."""
    if node.op == "Shape" and node.inputs:
        dims = _shape_of_shape_node(node)
        return None if dims is None else _static_array(dims)
    if node.op == "Size" and node.inputs and node.inputs[0].shape is not None:
        dims = node.inputs[0].shape
        return np.array(int(np.prod(dims)), dtype=np.int64) if all(is_static(d) for d in dims) else None
    if node.op in ("Gather", "Slice") and node.inputs and int(node.attrs.get("axis", 0)) == 0:
        return _picked_shape_value(node)
    return None


# --------------------------------------------------------------------------- evaluation


def _nbytes(tensor: gs.Tensor) -> int | None:
    if isinstance(tensor, gs.Constant):
        return const_nbytes(tensor)
    if tensor.shape is None or tensor.dtype is None or not all(is_static(d) for d in tensor.shape):
        return None
    try:
        return int(np.prod(tensor.shape)) * np.dtype(tensor.dtype).itemsize
    except TypeError:
        return None


def _itemsize(tensor: gs.Tensor, default: int = 4) -> int:
    try:
        return np.dtype(tensor.dtype).itemsize
    except TypeError:
        return default


def _growth_bytes(node: gs.Node) -> int | None:
    """Output size of the ops that create more than they read, from their constant inputs."""
    values = [constant_value(t) if t.name else None for t in node.inputs]
    try:
        if node.op == "ConstantOfShape" and values[0] is not None:
            fill = node.attrs.get("value")
            itemsize = np.asarray(fill.values).itemsize if isinstance(fill, gs.Constant) else 4
            return int(np.prod(values[0])) * itemsize
        if node.op == "Expand" and values[1] is not None and node.inputs[0].shape is not None:
            shape = np.broadcast_shapes(tuple(node.inputs[0].shape), tuple(int(d) for d in values[1]))
            return int(np.prod(shape)) * _itemsize(node.inputs[0])
        if node.op == "Tile" and values[1] is not None and node.inputs[0].shape is not None:
            return int(np.prod(np.asarray(node.inputs[0].shape) * values[1])) * _itemsize(node.inputs[0])
        if node.op == "Range" and all(v is not None for v in values[:3]):
            start, limit, delta = (float(v) for v in values[:3])
            return max(int(np.ceil((limit - start) / delta)), 0) * _itemsize(node.inputs[0])
    except (TypeError, ValueError, ZeroDivisionError):
        return None
    return None


def _size_ok(node: gs.Node, max_bytes: int) -> tuple[bool, str]:
    """May ``node`` fold without growing the model past ``max_bytes`` per new tensor?"""
    grown = _growth_bytes(node)
    sizes = [_nbytes(t) for t in node.outputs] if grown is None else [grown]
    largest_input = max((const_nbytes(t) for t in node.inputs if isinstance(t, gs.Constant)), default=0)
    for size in sizes:
        if size is None:
            if largest_input > max_bytes:
                return False, "output size unknown and an input is large"
            continue
        if size > max_bytes and not (node.op in LAYOUT_OPS and size <= largest_input):
            return False, f"output would be {size} bytes > max_fold_bytes"
    return True, ""


#: inputs up to this many bytes in all make an evaluation worth remembering (:func:`evaluate`)
MEMO_INPUT_BYTES = 1 << 16


def evaluate(node: gs.Node, opsets: dict[str, int], memo: dict | None = None) -> list[np.ndarray]:
    """Run one node on constant inputs with the ONNX reference evaluator at ``opsets``.

    With ``memo`` (one dict per sweep at the same ``opsets``) a node that is the same op with
    the same attributes on the same input values as one evaluated before gets that one's
    outputs without building another evaluator: exporters repeat the same shape arithmetic
    in every layer.  The caller copies what it keeps (the arrays are shared)."""
    proto = OnnxExporter.export_node(node)
    names = [f"i{k}" if t.name else "" for k, t in enumerate(node.inputs)]
    proto.input[:] = names
    proto.output[:] = [f"o{k}" for k in range(len(node.outputs))]
    feeds = {n: np.asarray(t.values) for n, t in zip(names, node.inputs) if n}
    key = _evaluation_key(proto, feeds) if memo is not None else None
    if key is not None and key in memo:
        return list(memo[key])
    from onnx.reference import ReferenceEvaluator  # imported on the first node that folds

    graph = onnx.helper.make_graph([proto], "fold", [onnx.ValueInfoProto(name=n) for n in names if n],
                                   [onnx.ValueInfoProto(name=o) for o in proto.output])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()])
    values = [np.asarray(v) for v in ReferenceEvaluator(model).run(None, feeds)]
    if key is not None:
        memo[key] = values
    return list(values)


def _evaluation_key(proto: onnx.NodeProto, feeds: dict[str, np.ndarray]) -> tuple | None:
    """Everything an evaluation depends on: the node proto but its name (the evaluator does
    not read it), and each input's dtype, shape and bytes; ``None`` (not remembered) for
    inputs above :data:`MEMO_INPUT_BYTES` or of object dtype, whose bytes are no value."""
    if sum(a.nbytes for a in feeds.values()) > MEMO_INPUT_BYTES or any(a.dtype.hasobject for a in feeds.values()):
        return None
    name, proto.name = proto.name, ""
    spec = proto.SerializeToString()
    proto.name = name
    return spec, tuple((n, a.dtype, a.shape, a.tobytes()) for n, a in feeds.items())


def fold_constant_nodes(graph: gs.Graph, max_bytes: int, report: FoldReport) -> None:
    """Fold, in topological order, every node whose value is known at compile time."""
    opsets = graph_opsets(graph)
    outputs = set(id(t) for t in graph.outputs)
    memo: dict = {}
    toposort(graph)
    for node in list(graph.nodes):
        computed_input = any(t.name and not isinstance(t, gs.Constant) for t in node.inputs)
        if computed_input and node.op not in SHAPE_VALUE_OPS:  # the common case, decided first
            continue
        if node.op in NEVER_FOLD or not node.outputs or any(id(t) in outputs for t in node.outputs):
            continue
        if any(isinstance(v, gs.Graph) for v in node.attrs.values()):
            continue
        value = fold_shape_value(node)
        if value is not None:
            _replace_outputs(node, [value])
            report.shapes_folded += 1
            continue
        if computed_input:
            continue
        ok, why = _size_ok(node, max_bytes)
        if not ok:
            report.skip(node, why)
            continue
        try:
            values = evaluate(node, opsets, memo)
        except Exception as exc:  # an op the evaluator lacks, or a domain it does not know
            report.skip(node, f"cannot evaluate: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}")
            continue
        if any(v.nbytes > max_bytes and node.op not in LAYOUT_OPS for v in values):
            report.skip(node, "output larger than max_fold_bytes")
            continue
        _replace_outputs(node, values)
        report.nodes_folded += 1


def _replace_outputs(node: gs.Node, values: list[np.ndarray]) -> None:
    for tensor, value in zip(node.outputs, values):
        array = np.asarray(value)
        try:  # the evaluator may widen (e.g. float64 scalars); keep the graph's declared dtype
            declared = np.dtype(tensor.dtype) if tensor.dtype is not None else array.dtype
        except TypeError:
            declared = array.dtype
        # np.array, not np.ascontiguousarray: the latter turns 0-d scalars into shape (1,)
        tensor.to_constant(np.array(array, dtype=declared, order="C"))
    node.outputs.clear()
    node.inputs.clear()


def fold_graph(graph: gs.Graph, max_bytes: int, report: FoldReport | None = None) -> FoldReport:
    """One linear sweep: lift constants, fold shape math and constant nodes, drop no-ops,
    empty Concat operands and dead code."""
    report = report or FoldReport()
    constants_to_initializers(graph, report)
    fold_constant_nodes(graph, max_bytes, report)
    prune_empty_concat_inputs(graph, report)
    remove_nops(graph, report)
    constants_second(graph, report)
    finish_graph(graph)
    return report

