"""Predict, without the backend, whether each node of a graph runs on the QNN HTP.

The prediction comes from the measured op-support table (:mod:`.table`): the node's op
must be in it, its tensors' dtypes and ranks must be allowed, and the entry's rules
(attribute values, constant inputs, dtype combinations) must hold.  A computed tensor with
no shape at all fails like on the backend ("Cannot get shape"), naming ``fix-shapes``; a
tensor without dtype is reported as a note ("unknown").  ``qnnpasses check --on htp`` asks
the backend itself.

float32 tensors count as supported: the tables are measured in fp16 mode
(``enable_htp_fp16_precision=1``), which is how float graphs run on HTP at all.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.gelu import GeluMatch, match_gelu
from qnnpasses.ir.read import is_constant

from .table import load_table, lookup

if TYPE_CHECKING:
    import networkx as nx

#: Ops that never reach an execution provider (onnxruntime turns them into initializers).
FOLDED_OPS = {"Constant"}


@dataclass
class NodeSupport:
    """The verdict on one node.  ``reasons`` explain ``supported=False``; ``notes`` are
    caveats that do not block placement (unknown dtypes/shapes, EP-inserted ops)."""

    supported: bool
    reasons: list[str] = field(default_factory=list)
    qnn_op: str | None = None
    name: str = ""
    op_type: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def placement(self) -> str:
        return "htp" if self.supported else "cpu"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GraphSummary:
    """Counts over a graph's verdicts; ``partitions`` are predicted HTP/CPU partitions."""

    nodes: int
    supported: int
    unsupported: int
    unknown: int
    by_op_type: dict[str, dict[str, int]]
    partitions: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- tensor facts


@dataclass
class _Tensor:
    """What the checker needs to know about one node input/output."""

    dtype: str | None
    shape: list[Any] | None
    constant: bool

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)


def _dtype_name(dtype: Any) -> str | None:
    if dtype is None:
        return None
    if isinstance(dtype, int):  # onnx-graphsurgeon keeps types numpy lacks as ONNX enums
        import onnx

        return onnx.helper.tensor_dtype_to_string(dtype).replace("TensorProto.", "").lower()
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def _tensor(tensor: gs.Tensor | None) -> _Tensor | None:
    """None for an omitted optional input (empty name)."""
    if tensor is None or (isinstance(tensor, gs.Variable) and not tensor.name):
        return None
    shape = tensor.shape
    return _Tensor(_dtype_name(tensor.dtype), list(shape) if shape is not None else None, is_constant(tensor))


@dataclass
class _NodeView:
    node: gs.Node
    inputs: list[_Tensor | None]
    outputs: list[_Tensor | None]
    notes: list[str]

    def attr(self, name: str, default: Any = None) -> Any:
        return self.node.attrs.get(name, default)

    def tensors(self) -> Iterable[tuple[str, _Tensor]]:
        for i, t in enumerate(self.inputs):
            if t is not None:
                yield f"input {i}", t
        for i, t in enumerate(self.outputs):
            if t is not None:
                yield f"output {i}", t

    def rank_of_input(self, index: int) -> int | None:
        t = self.inputs[index] if index < len(self.inputs) else None
        return t.rank if t is not None else None

    def unknown(self, what: str) -> None:
        note = f"unknown: {what}"
        if note not in self.notes:
            self.notes.append(note)


# --------------------------------------------------------------------------- rules

Rule = dict[str, Any]
RuleCheck = Callable[[_NodeView, Rule], "str | None"]


def _axis_is_last(view: _NodeView, rule: Rule) -> str | None:
    rank = view.rank_of_input(rule.get("input", 0))
    axis = view.attr(rule["attr"], rule.get("default", -1))
    if rank is None:
        view.unknown(f"rank of input {rule.get('input', 0)} (needed for {rule['attr']})")
        return None
    if rank == 0 or axis % rank == rank - 1:
        return None
    return rule.get("reason") or f"{rule['attr']}={axis} is not the last axis"


def _attr_in(view: _NodeView, rule: Rule) -> str | None:
    value = view.attr(rule["attr"], rule.get("default"))
    if isinstance(value, bytes):
        value = value.decode()
    if value in rule["values"] or (isinstance(value, float) and any(_close(value, v) for v in rule["values"])):
        return None
    return rule.get("reason") or f"{rule['attr']}={value!r} (HTP takes {rule['values']})"


def _attr_all(view: _NodeView, rule: Rule) -> str | None:
    """A list attribute, when given, has every element equal to ``value`` (dilations all 1)."""
    value = view.attr(rule["attr"])
    if value is None or all(v == rule["value"] for v in value):
        return None
    return rule.get("reason") or f"{rule['attr']}={list(value)} (HTP takes all {rule['value']})"


def _close(a: Any, b: Any) -> bool:
    return isinstance(b, (int, float)) and abs(a - b) <= 1e-6 * max(1.0, abs(b))


def _constant_input(view: _NodeView, rule: Rule) -> str | None:
    """Input ``index`` must be constant (or empty: no values to read).  With
    ``"or_static_output": true`` (shape operands of Reshape/Expand) any value is fine when the
    output shape is static: the EP only needs the output shape, which onnxruntime infers."""
    index = rule["index"]
    t = view.inputs[index] if index < len(view.inputs) else None
    if t is None or t.constant:
        return None
    if t.shape is not None and any(isinstance(d, (int, np.integer)) and d == 0 for d in t.shape):
        return None  # an empty tensor carries no values (e.g. default reduce axes): measured, accepted
    if rule.get("or_static_output"):
        out = view.outputs[0] if view.outputs else None
        if out is not None and out.shape is not None and all(isinstance(d, (int, np.integer)) for d in out.shape):
            return None
    return rule.get("reason") or f"input {index} must be a constant initializer"


def _max_rank(view: _NodeView, rule: Rule) -> str | None:
    dtypes = rule.get("dtypes")
    for where, t in view.tensors():
        if t.constant and not rule.get("constants", False):
            continue
        if dtypes is not None:
            if t.dtype is None:
                continue
            if t.dtype not in dtypes:
                continue
        if t.rank is not None and t.rank > rule["max"]:
            return rule.get("reason") or f"{where} has rank {t.rank} > {rule['max']}"
    return None


def _static_shapes(view: _NodeView, rule: Rule) -> str | None:
    """QNN graphs are static: a tensor with a symbolic dim makes the EP answer "Cannot get shape"."""
    for where, t in view.tensors():
        if t.shape is not None and any(not isinstance(d, (int, np.integer)) or d < 0 for d in t.shape):
            dims = "x".join(str(d) for d in t.shape)
            return f"{where} has a dynamic shape ({dims}): {rule.get('reason') or 'QNN needs static shapes'}"
    return None


def _nonempty_outputs(view: _NodeView, rule: Rule) -> str | None:
    """An output with a zero-size dim (an empty Slice, ...) cannot be a QNN tensor."""
    for i, t in enumerate(view.outputs):
        if t is not None and t.shape is not None and any(isinstance(d, (int, np.integer)) and d == 0 for d in t.shape):
            dims = "x".join(str(d) for d in t.shape)
            return f"output {i} is empty ({dims}): {rule.get('reason') or 'QNN tensors cannot have a zero-size dim'}"
    return None


def _dtype_pairs(view: _NodeView, rule: Rule) -> str | None:
    """(input dtype, output dtype) must be a listed pair; ``[in, out, max_rank]`` also caps the rank."""
    src = view.inputs[rule.get("input", 0)]
    dst = view.outputs[rule.get("output", 0)]
    if src is None or dst is None or src.dtype is None or dst.dtype is None:
        view.unknown("dtype of a Cast operand")
        return None
    base = rule.get("reason") or "not supported"
    for pair in rule["pairs"]:
        if pair[:2] == [src.dtype, dst.dtype]:
            if len(pair) > 2 and src.rank is not None and src.rank > pair[2]:
                return f"{base} ({src.dtype} -> {dst.dtype} at rank {src.rank}; measured up to rank {pair[2]})"
            return None
    return f"{base} ({src.dtype} -> {dst.dtype})"


def _axis_not_negative_inner(view: _NodeView, rule: Rule) -> str | None:
    """A negative axis is only accepted as -1 (the EP mis-converts other negative axes)."""
    axis = view.attr(rule["attr"], rule.get("default", -1))
    if axis >= 0 or axis == -1:
        return None
    return rule.get("reason") or f"{rule['attr']}={axis}: write it as a non-negative axis"


def _min_inputs(view: _NodeView, rule: Rule) -> str | None:
    present = sum(t is not None for t in view.inputs)
    return None if present >= rule["count"] else (rule.get("reason") or f"needs at least {rule['count']} inputs")


def _not_all_constant(view: _NodeView, rule: Rule) -> str | None:
    """A node of constants only that feeds nothing but graph outputs forms a QNN graph
    without inputs, which the EP cannot set up.  (Fed into other nodes, it just joins
    their partition.)"""
    present = [t for t in view.inputs if t is not None]
    if not present or not all(t.constant for t in present):
        return None
    if any(getattr(out, "outputs", None) for out in view.node.outputs):
        return None
    return rule.get("reason") or "all inputs are constant: fold the node before conversion"


def _input_absent(view: _NodeView, rule: Rule) -> str | None:
    index = rule["index"]
    present = index < len(view.inputs) and view.inputs[index] is not None
    return (rule.get("reason") or f"input {index} is not supported") if present else None


def _output_absent(view: _NodeView, rule: Rule) -> str | None:
    index = rule["index"]
    present = index < len(view.outputs) and view.outputs[index] is not None
    return (rule.get("reason") or f"output {index} is not supported") if present else None


def _input_dtype_in(view: _NodeView, rule: Rule) -> str | None:
    """Optional input ``index``, when present, has one of ``dtypes``."""
    index = rule["index"]
    t = view.inputs[index] if index < len(view.inputs) else None
    if t is None or t.dtype is None or t.dtype in rule["dtypes"]:
        return None
    return rule.get("reason") or f"input {index} is {t.dtype}; HTP takes {', '.join(rule['dtypes'])}"


def _input_rank(view: _NodeView, rule: Rule) -> str | None:
    rank = view.rank_of_input(rule.get("input", 0))
    if rank is None:
        return None
    lo, hi = rule.get("min", 0), rule.get("max", 99)
    return None if lo <= rank <= hi else (rule.get("reason") or f"input rank {rank} outside [{lo}, {hi}]")


def _einsum_matmul(view: _NodeView, rule: Rule) -> str | None:
    """Einsum the EP lowers to MatMul: ``<batch><m><k>,<batch><k|n><n|k> -> <batch><m><n>``.

    Two operands, one contracted index, one free index per operand, the shared batch
    indices leading both operands in output order.
    """
    eq = view.attr("equation", "")
    eq = (eq.decode() if isinstance(eq, bytes) else str(eq)).replace(" ", "")
    reason = rule.get("reason") or f"Einsum equation {eq!r} is not a batched matrix product"
    if "->" not in eq:
        return reason
    lhs, out = eq.split("->", 1)
    terms = lhs.split(",")
    if len(terms) != 2:
        return reason
    a, b = terms
    contracted = (set(a) & set(b)) - set(out)
    batch = "".join(c for c in out if c in a and c in b)
    free_a = [c for c in a if c not in b]
    free_b = [c for c in b if c not in a]
    if len(contracted) != 1 or len(free_a) != 1 or len(free_b) != 1:
        return reason
    if not (a.startswith(batch) and b.startswith(batch) and out == batch + free_a[0] + free_b[0]):
        return reason
    return None


def _not_graph_input(view: _NodeView, rule: Rule) -> str | None:
    """Input 0 comes from another node (or is constant), not straight from a graph input."""
    t = view.node.inputs[0] if view.node.inputs else None
    if t is None or is_constant(t) or getattr(t, "inputs", None):
        return None
    return rule.get("reason") or "input 0 is a graph input"


def _not_graph_output(view: _NodeView, rule: Rule) -> str | None:
    """Output 0 feeds another node; one with no consumer is (taken as) a graph output."""
    t = view.node.outputs[0] if view.node.outputs else None
    if t is None or t.outputs:
        return None
    return rule.get("reason") or "output 0 is a graph output"


#: Rules that state a default of the QNN EP's provider options rather than a limit of the
#: backend: a session that sets the option to the value given keeps the node on the HTP
#: (``offload_graph_io_quantization=0`` makes the EP take the graph-boundary Q/DQ too).
WAIVED_BY: dict[str, tuple[str, str]] = {
    "not_graph_input": ("offload_graph_io_quantization", "0"),
    "not_graph_output": ("offload_graph_io_quantization", "0"),
}


def waived_rules(provider_options: dict[str, str] | None) -> frozenset[str]:
    """The rule kinds ``provider_options`` lift (:data:`WAIVED_BY`)."""
    options = provider_options or {}
    return frozenset(kind for kind, (key, value) in WAIVED_BY.items() if str(options.get(key)) == value)


RULES: dict[str, RuleCheck] = {
    "einsum_matmul": _einsum_matmul,
    "axis_not_negative_inner": _axis_not_negative_inner,
    "not_graph_input": _not_graph_input,
    "not_graph_output": _not_graph_output,
    "last_axis": _axis_is_last,
    "attr_in": _attr_in,
    "attr_all": _attr_all,
    "constant_input": _constant_input,
    "max_rank": _max_rank,
    "dtype_pairs": _dtype_pairs,
    "min_inputs": _min_inputs,
    "not_all_constant": _not_all_constant,
    "static_shapes": _static_shapes,
    "nonempty_outputs": _nonempty_outputs,
    "input_absent": _input_absent,
    "output_absent": _output_absent,
    "input_dtype_in": _input_dtype_in,
    "input_rank": _input_rank,
}


def _when_holds(view: _NodeView, when: dict[str, Any] | None) -> bool:
    """A rule's optional precondition: ``{"attr": {name: [values]}, "dtype": [...] (of input 0),
    "input_constant": {index: bool}}``."""
    if not when:
        return True
    for name, values in when.get("attr", {}).items():
        value = view.attr(name)
        if isinstance(value, bytes):
            value = value.decode()
        if value not in values:
            return False
    if "dtype" in when:
        t = view.inputs[0] if view.inputs else None
        if t is None or t.dtype not in when["dtype"]:
            return False
    for index, constant in when.get("input_constant", {}).items():
        i = int(index)
        t = view.inputs[i] if i < len(view.inputs) else None
        if t is None or t.constant != constant:
            return False
    return True


def _apply_rules(view: _NodeView, rules: Iterable[Rule], waived: frozenset[str] = frozenset()) -> list[str]:
    reasons = []
    for rule in rules:
        check = RULES.get(rule["check"])
        if check is None:
            raise ValueError(f"unknown rule kind {rule['check']!r} in the op-support table")
        if rule["check"] in waived or not _when_holds(view, rule.get("when")):
            continue
        reason = check(view, rule)
        if reason and reason not in reasons:
            reasons.append(reason)
    return reasons


# --------------------------------------------------------------------------- dtypes & ranks


def _io_spec(specs: list[dict[str, Any]], index: int, variadic: bool) -> dict[str, Any] | None:
    if index < len(specs):
        return specs[index]
    return specs[-1] if variadic and specs else None


def _check_dtypes(view: _NodeView, entry: dict[str, Any]) -> list[str]:
    reasons = []
    for kind, tensors, specs, variadic in (
        ("input", view.inputs, entry.get("inputs", []), entry.get("variadic", False)),
        ("output", view.outputs, entry.get("outputs", []), False),
    ):
        for i, t in enumerate(tensors):
            spec = _io_spec(specs, i, variadic)
            if t is None or spec is None or spec.get("dtypes") is None:
                continue
            if t.dtype is None:
                view.unknown(f"dtype of {kind} {i}")
            elif t.dtype not in spec["dtypes"]:
                reasons.append(f"{kind} {i} ({spec.get('name', '?')}) is {t.dtype}; HTP takes {', '.join(spec['dtypes'])}")
    return reasons


def _check_rank(view: _NodeView, max_rank: int | None, by_dtype: dict[str, int]) -> list[str]:
    """Every non-constant tensor within its rank limit: the op's, or a lower one for its
    dtype (e.g. int64 tensors, which the EP casts to int32 with an op that stops at rank 4)."""
    for where, t in view.tensors():
        if t.constant:
            continue
        limit = by_dtype.get(t.dtype or "", max_rank)
        if limit is None:
            continue
        if t.rank is None:
            view.unknown(f"rank of {where}")
        elif t.rank > limit:
            qualifier = f" for {t.dtype}" if t.dtype in by_dtype else ""
            return [f"{where} has rank {t.rank}; HTP takes rank <= {limit}{qualifier}"]
    return []


#: The pass that gives every tensor a known, static shape.
FIX_SHAPES = "fix-shapes"


def _unknown_shapes(view: _NodeView) -> list[str]:
    """A computed tensor without any shape (not even a rank): the QNN EP refuses the node
    ("Cannot get shape"), measured; static input shapes make shape inference reach it."""
    for where, t in view.tensors():
        if not t.constant and t.shape is None:
            return [f"{where} has an unknown shape (the QNN EP cannot get it): run {FIX_SHAPES} "
                    f"(static input shapes, e.g. --shape NAME=D0,D1,...)"]
    return []


def _opset_note(entry: dict[str, Any], opset: int | None) -> str | None:
    """Opsets outside the measured schema versions are a caveat, not a failure."""
    rng = entry.get("opset")
    if opset is None or not rng:
        return None
    lo, hi = rng
    return None if lo <= opset <= hi else f"not measured at opset {opset} (table covers {lo}-{hi})"


# --------------------------------------------------------------------------- public API


def check_node(
    node: gs.Node, table: dict[str, Any] | str = "htp", *, opset: int | None = None,
    provider_options: dict[str, str] | None = None,
) -> NodeSupport:
    """Whether ``node`` is predicted to run on the backend of ``table``.

    ``opset`` is the model's opset for the node's domain (``graph.opset``), if known;
    ``provider_options`` the QNN EP options of the session that will run it (:data:`WAIVED_BY`).
    """
    if isinstance(table, str):
        table = load_table(table)
    result = NodeSupport(supported=True, name=node.name, op_type=node.op)
    if node.op in FOLDED_OPS:
        result.notes.append("folded into an initializer by onnxruntime")
        return result
    entry = lookup(table, node.op, node.domain)
    if entry is None:
        return _reject(result, [f"{node.op} is not in the {table.get('backend', '?')} op-support table"])
    if not entry.get("supported", True):
        fusion = _matching_fusion(node, entry)
        if fusion is None:
            return _reject(result, [entry.get("reason") or f"{node.op} is not supported by the QNN EP"])
        result.qnn_op = fusion.get("qnn_op")
        result.notes.append(fusion["note"])
        return result
    view = _NodeView(node, [_tensor(t) for t in node.inputs], [_tensor(t) for t in node.outputs], result.notes)
    note = _opset_note(entry, opset)
    if note:
        result.notes.append(note)
    reasons = _unknown_shapes(view)
    reasons += _check_dtypes(view, entry)
    reasons += _check_rank(view, entry.get("max_rank", table.get("global", {}).get("max_rank")),
                           entry.get("max_rank_by_dtype", {}))
    reasons += _apply_rules(view, [*table.get("global", {}).get("rules", []), *entry.get("rules", [])],
                            waived_rules(provider_options))
    result.qnn_op = (entry.get("qnn_ops") or [None])[0]
    result.notes.extend(n for n in _conditional_notes(view, entry, table) if n not in result.notes)
    return _reject(result, reasons) if reasons else result


def _conditional_notes(view: _NodeView, entry: dict[str, Any], table: dict[str, Any]) -> list[str]:
    """Caveats that apply to this node: entry notes with a ``when``, and int64 I/O."""
    notes = []
    for note in entry.get("conditional_notes", []):
        if _when_holds(view, note.get("when")):
            notes.append(note["note"])
    if any(t.dtype == "int64" and not t.constant for _, t in view.tensors()):
        int64_note = table.get("global", {}).get("int64_note")
        if int64_note:
            notes.append(int64_note)
    return notes


def _single_consumer(tensor: gs.Tensor, op: str) -> gs.Node | None:
    consumers = getattr(tensor, "outputs", [])
    return consumers[0] if len(consumers) == 1 and consumers[0].op == op else None


def _is_erf_gelu(node: gs.Node) -> bool:
    """The spelling the EP fuses, ``x / sqrt(2)`` (or ``x * 1/sqrt(2)``) -> Erf -> Add 1 -> Mul x ->
    Mul 0.5 in either Mul order, that also computes a GeLU (:func:`qnnpasses.ir.gelu.match_gelu`,
    the recognizer ``fuse-gelu`` and ``lint`` use: the constants are checked, not only the shape)."""
    producer = node.inputs[0].inputs[0] if node.inputs and node.inputs[0].inputs else None
    if producer is None or producer.op not in ("Div", "Mul"):
        return False
    add = _single_consumer(node.outputs[0], "Add")
    mul = add and _single_consumer(add.outputs[0], "Mul")
    return bool(mul and _single_consumer(mul.outputs[0], "Mul")) and isinstance(match_gelu(node, None), GeluMatch)


#: Patterns the EP fuses into one node unit, so that an op it rejects alone still runs on HTP.
FUSIONS: dict[str, Callable[[gs.Node], bool]] = {"erf_gelu": _is_erf_gelu}


def _matching_fusion(node: gs.Node, entry: dict[str, Any]) -> dict[str, Any] | None:
    for fusion in entry.get("fusions", []):
        if FUSIONS[fusion["pattern"]](node):
            return fusion
    return None


def _reject(result: NodeSupport, reasons: list[str]) -> NodeSupport:
    result.supported = False
    result.reasons = reasons
    return result


def check_graph(graph: gs.Graph, table: dict[str, Any] | str = "htp", *,
                provider_options: dict[str, str] | None = None) -> list[NodeSupport]:
    """:func:`check_node` for every node, in graph order."""
    if isinstance(table, str):
        table = load_table(table)
    opset = getattr(graph, "opset", None)
    return [check_node(node, table, opset=opset if not node.domain or node.domain == "ai.onnx" else None,
                       provider_options=provider_options)
            for node in graph.nodes]


def node_dag(graph: gs.Graph) -> nx.DiGraph:
    """The node DAG (node index -> consumer node index) of a graphsurgeon graph."""
    import networkx as nx  # imported when used: passes read the tables, not the DAG

    index = {id(n): i for i, n in enumerate(graph.nodes)}
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(graph.nodes)))
    for i, node in enumerate(graph.nodes):
        for out in node.outputs:
            for consumer in out.outputs:
                j = index.get(id(consumer))
                if j is not None:
                    dag.add_edge(i, j)
    return dag


def predicted_partitions(graph: gs.Graph, results: list[NodeSupport]) -> dict[str, int]:
    """Maximal connected groups of same-placement nodes, per placement ("htp", "cpu").

    A lower bound on onnxruntime's partition count: it may split a group further where
    merging it would create a cycle through the other placement.
    """
    import networkx as nx

    dag = node_dag(graph)
    counts = {"htp": 0, "cpu": 0}
    for placement in counts:
        members = [i for i, r in enumerate(results) if r.placement == placement and r.op_type not in FOLDED_OPS]
        counts[placement] = nx.number_weakly_connected_components(dag.subgraph(members)) if members else 0
    return counts


def summarize(graph: gs.Graph, results: list[NodeSupport]) -> GraphSummary:
    """Counts of supported/unsupported nodes, per op type, and predicted partitions."""
    by_op: dict[str, Counter[str]] = {}
    for r in results:
        by_op.setdefault(r.op_type, Counter())["supported" if r.supported else "unsupported"] += 1
    supported = sum(r.supported for r in results)
    return GraphSummary(
        nodes=len(results),
        supported=supported,
        unsupported=len(results) - supported,
        unknown=sum(any(n.startswith("unknown:") for n in r.notes) for r in results),
        by_op_type={op: {"supported": c["supported"], "unsupported": c["unsupported"]} for op, c in sorted(by_op.items())},
        partitions=predicted_partitions(graph, results),
    )
