"""The attention recognizer: role finding, analysis, lint and the attention passes all read it.

An attention block is found from its ``Softmax``, whatever the exporter wrote around it:

* **score region**: every node between the Q·Kᵀ ``MatMul`` and the P·V ``MatMul``: the
  scale (``Mul``/``Div``), the mask (``Add`` of an additive mask, or ``Where(cond, s, -big)``),
  casts, soft-capping, the ``Softmax`` over the last axis and the row guard an export puts
  after it for query rows whose keys are all masked (``Where(IsNaN(p), 0, p)`` in SDPA
  exports, ``Where(Equal(ReduceMax(bias), -inf), 0, p)`` in ONNX's Attention function;
  a guard's row maximum of the scores is a row op, as the Softmax is).  The region must be
  closed: none of its tensors is read outside it (an ``output_attentions`` output stops the
  match).  Inputs entering the region from outside are its *operands* (mask, scale constants).
* **key / value side**: the ``MatMul`` input is traced back through layout ops (Transpose,
  Reshape, Unsqueeze/Squeeze, Identity) and scalar Mul/Div (SDPA splits the scale as
  ``sqrt(scale)`` onto Q and K) to the HF ``repeat_kv`` (``Unsqueeze``/``Reshape`` to
  ``[B, kvH, 1, S, D]`` -> ``Expand`` -> ``Reshape``) or, without one, as far back as the
  chain stays a pure permutation.  The chain is verified by running it on an index tensor,
  so TorchScript's ``Transpose(0,1,3,2)``, dynamo-SDPA's ``Reshape[B*H,S,D] -> Transpose ->
  Reshape`` and GPT-2's ``Transpose(0,2,3,1)`` of ``[B, S, H, D]`` all reduce to one
  ``(start tensor, permutation, scalar ops, repeat)`` description.  Rotary embedding sits
  before the repeat (or before the start tensor) and is never touched.

Why this is enough to rewrite safely: the rewrites only rebuild the K/V side as
``scalar_ops(Transpose(start, perm))`` — exactly what the verified chain computes — and
change the shapes inside the closed score region, whose ops are all elementwise or a
last-axis Softmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.layout_chain import chain_permutation, layout_step
from qnnpasses.ir.op_kinds import ELEMENTWISE
from qnnpasses.ir.read import constant_value, is_constant, is_one_element, last_axis, producer, static_shape

# Ops that may sit between Q·Kᵀ and P·V without mixing rows or columns of the scores: the
# elementwise ops exporters write there (scale, mask, casts, soft-capping, guards).
SCORE_OPS = ELEMENTWISE & frozenset({
    "Add", "Sub", "Mul", "Div", "Where", "Max", "Min", "Tanh", "Cast", "Identity", "IsNaN", "IsInf",
    "Neg", "Clip", "Not", "And", "Or", "Equal", "Less", "Greater", "Sigmoid",
})
MAX_CHAIN = 12


def shape_of(tensor: gs.Tensor) -> tuple | None:
    """Shape as a tuple when fully known (ints or symbolic names), else None."""
    shape = getattr(tensor, "shape", None)
    if shape is None or any(d is None for d in shape):
        return None
    return tuple(shape)


def _consumers(tensor: gs.Tensor) -> list[gs.Node]:
    return list(tensor.outputs)


# --------------------------------------------------------------------------- score region


NAN_GUARD, ROW_MAX_GUARD = "nan", "row-max"


@dataclass
class RowGuard:
    """``Where(test, 0, p)`` after the Softmax: what a query row whose keys are all masked gets.

    ``kind`` ``nan``: ``test`` is ``IsNaN(p)`` (SDPA exports; such a row is NaN after a -inf
    mask).  ``row-max``: ``test`` compares a row maximum (``Equal(ReduceMax(bias), -inf)`` in
    ONNX's Attention function, ``Less(ReduceMax(scores), c)`` as attention-cleanup writes it).
    """

    test: gs.Node
    where: gs.Node
    kind: str


@dataclass
class ScoreRegion:
    qk: gs.Node
    pv: gs.Node
    softmax: gs.Node
    nodes: list[gs.Node]
    guard: RowGuard | None = None

    def tensors(self) -> set[int]:
        return {id(t) for n in self.nodes for t in n.outputs} | {id(self.qk.outputs[0])}

    def operands(self) -> list[tuple[gs.Node, int, gs.Tensor]]:
        """(node, input index, tensor) of every region input that comes from outside."""
        inside = self.tensors()
        return [(n, i, t) for n in self.nodes for i, t in enumerate(n.inputs) if id(t) not in inside]


def _is_qk_matmul(node: gs.Node | None) -> bool:
    return node is not None and node.op == "MatMul" and not any(is_constant(t) for t in node.inputs)


def find_qk(softmax: gs.Node) -> gs.Node | str:
    """The Q·Kᵀ MatMul feeding ``softmax`` through elementwise ops (a breadth-first search)."""
    frontier, seen, found = [softmax.inputs[0]], set(), []
    for _ in range(MAX_CHAIN):
        nxt = []
        for tensor in frontier:
            node = producer(tensor)
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            if _is_qk_matmul(node):
                found.append(node)
            elif node.op in SCORE_OPS:
                nxt.extend(t for t in node.inputs if not is_constant(t))
        frontier = nxt
    unique = {id(n): n for n in found}
    if len(unique) != 1:
        return f"{len(unique)} candidate Q·Kᵀ MatMuls before the Softmax (need exactly 1)"
    return next(iter(unique.values()))


def find_score_region(graph: gs.Graph, softmax: gs.Node) -> ScoreRegion | str:
    """The closed region from Q·Kᵀ to P·V around ``softmax``, or why there is none."""
    rank = len(shape_of(softmax.outputs[0]) or ()) or None
    default_axis = -1 if int(graph.opset) >= 13 else 1  # before opset 13: 2-D coercion from axis 1
    if not last_axis(int(softmax.attrs.get("axis", default_axis)), rank):
        return "Softmax is not over the last axis"
    qk = find_qk(softmax)
    if isinstance(qk, str):
        return qk
    graph_outputs = {id(t) for t in graph.outputs}
    nodes, pv, queue, seen = [], None, [qk.outputs[0]], set()
    while queue:
        tensor = queue.pop()
        if id(tensor) in graph_outputs:
            return f"score tensor '{tensor.name}' is a graph output"
        for node in _consumers(tensor):
            if node.op == "MatMul" and node.inputs[0] is tensor and node is not qk:
                if pv is not None and pv is not node:
                    return "scores feed two P·V MatMuls"
                pv = node
                continue
            if node.op not in SCORE_OPS and node is not softmax and not is_row_max(node):
                return f"score tensor '{tensor.name}' is read by {node.op} '{node.name}' (not elementwise)"
            if id(node) not in seen:
                seen.add(id(node))
                nodes.append(node)
                queue.extend(node.outputs)
    if pv is None or softmax not in nodes:
        return "no P·V MatMul after the Softmax"
    if sum(n.op == "Softmax" for n in nodes) != 1:
        return "more than one Softmax between Q·Kᵀ and P·V"
    return ScoreRegion(qk=qk, pv=pv, softmax=softmax, nodes=nodes, guard=find_guard(softmax))


def is_row_max(node: gs.Node) -> bool:
    """A ReduceMax over the last axis alone that keeps it (a row op, as Softmax is): a row
    guard's test of the scores."""
    if node.op != "ReduceMax" or not int(node.attrs.get("keepdims", 1)):
        return False
    axes = node.attrs.get("axes")
    if axes is None and len(node.inputs) > 1:
        axes = constant_value(node.inputs[1])
    if axes is None or np.asarray(axes).size != 1:
        return False
    rank = len(shape_of(node.inputs[0]) or ()) or None
    return last_axis(int(np.asarray(axes).ravel()[0]), rank)


def _is_zero(tensor: gs.Tensor) -> bool:
    """A scalar 0, also through the ``CastLike(0, p)`` ONNX's functions write."""
    node = producer(tensor)
    if not is_constant(tensor) and node is not None and node.op in ("Cast", "CastLike"):
        tensor = node.inputs[0]
    return is_one_element(tensor) and float(constant_value(tensor).ravel()[0]) == 0.0


def _row_max_test(node: gs.Node | None) -> bool:
    return (node is not None and node.op in ("Equal", "Less", "LessOrEqual")
            and any(producer(t) is not None and producer(t).op == "ReduceMax" for t in node.inputs))


def find_guard(softmax: gs.Node) -> RowGuard | None:
    """The row guard after ``softmax`` (its output, or a Cast of it), or None."""
    probs = softmax.outputs[0]
    outputs = [probs] + [n.outputs[0] for n in _consumers(probs) if n.op in ("Cast", "Identity")]
    for out in outputs:
        for where in _consumers(out):
            if where.op != "Where" or where.inputs[2] is not out or not _is_zero(where.inputs[1]):
                continue
            test = producer(where.inputs[0])
            if test is not None and test.op == "IsNaN" and any(test.inputs[0] is o for o in outputs):
                return RowGuard(test=test, where=where, kind=NAN_GUARD)
            if _row_max_test(test):
                return RowGuard(test=test, where=where, kind=ROW_MAX_GUARD)
    return None


# --------------------------------------------------------------------------- key / value side


@dataclass
class Repeat:
    """HF ``repeat_kv``: ``[B, kvH, S, D]`` -> unsqueeze(2) -> expand(G) -> (merged by the chain)."""

    expand: gs.Node
    kv_heads: int
    groups: int


@dataclass
class KVSide:
    """``matmul_input == scalar_ops(transpose(repeat(start), perm))``, verified."""

    start: gs.Tensor
    perm: tuple[int, ...]
    scalar_ops: list[tuple[str, gs.Tensor, int]] = field(default_factory=list)  # (op, constant, its input index)
    repeat: Repeat | None = None
    chain: list[gs.Node] = field(default_factory=list)

    @property
    def head_axis(self) -> int:
        """Axis of ``start`` that holds the heads (it lands on axis 1 of the MatMul input)."""
        return self.perm[1]


def _find_repeat(expand: gs.Node) -> tuple[Repeat, gs.Tensor] | None:
    """``Expand(Unsqueeze|Reshape(x, [B, kvH, 1, S, D]), [B, kvH, G, S, D])`` -> (repeat, x)."""
    x5, out = static_shape(expand.inputs[0]), static_shape(expand.outputs[0])
    maker = producer(expand.inputs[0])
    if x5 is None or out is None or len(x5) != 5 or len(out) != 5 or x5[2] != 1 or maker is None:
        return None
    if maker.op not in ("Unsqueeze", "Reshape"):
        return None
    start = maker.inputs[0]
    if static_shape(start) != x5[:2] + x5[3:] or out[:2] + out[3:] != x5[:2] + x5[3:]:
        return None
    return Repeat(expand=expand, kv_heads=out[1], groups=out[2]), start


def trace_kv(tensor: gs.Tensor, rank: int = 4) -> KVSide | str:
    """Trace a MatMul input back to its key/value head tensor (see the module docstring)."""
    walked: list[tuple[gs.Node, tuple]] = []  # in walk order: nearest to the MatMul first
    current = tensor
    for _ in range(MAX_CHAIN):
        node = producer(current)
        if node is None:
            break
        if node.op == "Expand":
            return _with_repeat(node, walked)
        step = layout_step(node)
        if step is None:
            break
        walked.append((node, step))
        current = node.inputs[1 - step[3]] if step[0] == "scalar" else node.inputs[0]
    return _farthest_permutation(tensor, walked, rank)


def _scalars(walked: list[tuple[gs.Node, tuple]]) -> list[tuple[str, gs.Tensor, int]]:
    """The scalar Mul/Div steps of ``walked`` in the order they are applied."""
    return [step[1:] for _, step in reversed(walked) if step[0] == "scalar"]


def _steps(walked: list[tuple[gs.Node, tuple]]) -> list[tuple]:
    """The layout steps of ``walked`` in the order they are applied."""
    return [step for _, step in reversed(walked) if step[0] != "scalar"]


def _with_repeat(expand: gs.Node, walked) -> KVSide | str:
    found = _find_repeat(expand)
    if found is None:
        return f"Expand '{expand.name}' is not a repeat_kv over the head axis"
    repeat, start = found
    out = static_shape(expand.outputs[0])
    merged = out[:1] + (out[1] * out[2],) + out[3:]  # the [B, H, S, D] that repeat_kv stands for
    perm = chain_permutation(merged, [("reshape", list(out), 1)] + _steps(walked))
    if perm is None or perm[1] != 1:
        return "the layout chain after repeat_kv is not a permutation that keeps the head axis"
    return KVSide(start=start, perm=perm, scalar_ops=_scalars(walked), repeat=repeat,
                  chain=[n for n, _ in walked] + [expand])


def _farthest_permutation(tensor: gs.Tensor, walked, rank: int) -> KVSide | str:
    """Without repeat_kv: the farthest rank-``rank`` tensor of the chain that it permutes exactly."""
    for cut in range(len(walked), -1, -1):
        if cut and walked[cut - 1][1][0] == "scalar":
            continue  # start at a layout op's input; scalar ops stay in the rebuilt chain
        start = walked[cut - 1][0].inputs[0] if cut else tensor
        shape = static_shape(start)
        if shape is None or len(shape) != rank:
            continue
        perm = chain_permutation(shape, _steps(walked[:cut]))
        if perm is not None:
            return KVSide(start=start, perm=perm, scalar_ops=_scalars(walked[:cut]),
                          chain=[n for n, _ in walked[:cut]])
    return "no rank-4 head tensor of which the key/value chain is a pure permutation"


# --------------------------------------------------------------------------- whole block


@dataclass
class Attention:
    region: ScoreRegion
    key: KVSide
    value: KVSide
    batch: object
    heads: int
    q_len: object
    head_dim: int

    @property
    def kv_heads(self) -> int:
        return self.key.repeat.kv_heads if self.key.repeat else self.heads

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads


def match_attention(graph: gs.Graph, softmax: gs.Node) -> Attention | str:
    """The attention block around ``softmax``, or a one-line reason why it does not match."""
    region = find_score_region(graph, softmax)
    if isinstance(region, str):
        return region
    q_shape = shape_of(region.qk.inputs[0])
    if q_shape is None or len(q_shape) != 4 or not isinstance(q_shape[1], (int, np.integer)):
        return f"query is not a [B, H, S, D] tensor with static heads (shape {q_shape})"
    batch, heads, q_len, head_dim = q_shape
    key = trace_kv(region.qk.inputs[1])
    if isinstance(key, str):
        return f"key: {key}"
    value = trace_kv(region.pv.inputs[1])
    if isinstance(value, str):
        return f"value: {value}"
    key_groups = key.repeat.groups if key.repeat else 1
    value_groups = value.repeat.groups if value.repeat else 1
    if key_groups != value_groups:
        return f"key and value are repeated differently ({key_groups} vs {value_groups})"
    att = Attention(region=region, key=key, value=value, batch=batch, heads=int(heads), q_len=q_len,
                    head_dim=int(head_dim))
    if att.kv_heads * att.groups != att.heads:
        return f"{att.heads} query heads are not a multiple of {att.kv_heads} key/value heads"
    return att


def find_attentions(graph: gs.Graph, reasons: list[str] | None = None) -> list[Attention]:
    """Every matching attention block, in graph order; why the others failed goes to ``reasons``."""
    found = []
    for node in list(graph.nodes):
        if node.op != "Softmax":
            continue
        att = match_attention(graph, node)
        if isinstance(att, str):
            if reasons is not None:
                reasons.append(f"Softmax '{node.name}': {att}")
        else:
            found.append(att)
    return found
