"""rotary: rotate_half(x) (Slice/Neg/Concat data movement) => x @ R with a constant signed permutation.

Matches the rotation inside rotary position embeddings, ``x*cos + rotate(x)*sin``, in
any exporter's spelling: ``rotate(x)`` is a small sub-graph whose only variable input is
``x`` and whose ops only move data or flip signs: ``Concat(Neg(Slice(x, d/2:)),
Slice(x, :d/2))`` (LLaMA/Qwen/Mistral/Phi, TorchScript and dynamo; ``Mul(.., -1)`` for
Neg), the interleaved GPT-J/NeoX form ``Reshape(Concat(Unsqueeze(-x[..., 1::2]),
Unsqueeze(x[..., ::2])))``, and other signed permutations of the last axis.  The
candidate is evaluated on a probe input with distinct non-zero values; it is rewritten
only if every output element is ``+-x`` at one fixed position of the same row, i.e.
``rotate(x) == x @ R`` for a ``d x d`` matrix ``R`` with one +-1 per column.

Produces one ``MatMul(x, R)`` with ``R`` shaped ``[1, .., 1, d, d]`` (rank of ``x``: the
QNN EP then emits a single HTP MatMul instead of FullyConnected plus Reshapes).  Four
or more HTP ops (2 StridedSlice, Neg, Concat) become one, with no data movement.

Safe: each output of ``x @ R`` is ``+-x_j`` plus exact zeros, so it is bit-identical
in fp32 (and in fp16 on the HTP) to the original.  Not done: folding ``R`` into the
preceding Q/K projection weights (``x@W@R == x@(W R)``, exact too) saves no HTP op,
because ``x*cos`` still needs the unrotated projection.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.checks import fill_unknown_shapes
from qnnpasses.ir.index_map import MOVERS, apply_op
from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import ATTENTION_REWRITTEN, EXACT, FOLDED, Pass, PassContext, PassResult, register_pass
from qnnpasses.passmanager.rewrite import (
    finish,
    input_value,
    is_constant,
    is_scalar_constant,
    make_constant,
    make_node,
    node_key,
    replace_all_uses,
    single_consumer,
    static_shape,
)

SIGN_OPS = frozenset({"Neg", "Mul", "Div"})
MAX_NODES = 16


class _NotRotation(Exception):
    pass


def _is_negation(node: gs.Node) -> bool:
    if node.op == "Neg":
        return True
    if node.op in ("Mul", "Div") and len(node.inputs) == 2:
        consts = [t for t in node.inputs if is_constant(t)]
        return len(consts) == 1 and is_scalar_constant(consts[0], -1.0) and (node.op == "Mul" or node.inputs[1] is consts[0])
    return False


def _allowed(node: gs.Node) -> bool:
    return node.op == "Concat" or _is_negation(node) or (node.op in MOVERS and node.op != "GatherND")


def _root_of(graph: gs.Graph, tensor: gs.Tensor, nodes: list) -> gs.Tensor:
    """Walk up through single-use allowed nodes; the first shared or foreign tensor is the root."""
    while True:
        node = tensor.inputs[0] if tensor.inputs else None
        if node is None or not _allowed(node) or node.op == "Concat" or single_consumer(tensor, graph) is None:
            return tensor
        if len(nodes) >= MAX_NODES:
            raise _NotRotation("sub-graph too large")
        nodes.append(node)
        tensor = next(t for t in node.inputs if t.name and not is_constant(t))


def _evaluate(tensor: gs.Tensor, x: gs.Tensor, probe: np.ndarray, opset: int, memo: dict) -> np.ndarray:
    if tensor is x:
        return probe
    if id(tensor) in memo:
        return memo[id(tensor)]
    node = tensor.inputs[0]
    data = [_evaluate(t, x, probe, opset, memo) for t in node.inputs if t.name and not is_constant(t)]
    if node.op == "Concat":
        value = np.concatenate(data, axis=node.attrs["axis"])
    elif _is_negation(node):
        value = -data[0]
    elif len(data) == 1:
        value = apply_op(node, data[0], [input_value(node, i) for i in range(max(len(node.inputs), 5))], opset)
    else:
        raise _NotRotation(f"{node.op} mixes several inputs")
    memo[id(tensor)] = value
    return value


def _structure(tensor: gs.Tensor, x: gs.Tensor, memo: dict) -> tuple | None:
    """What :func:`_evaluate` computes ``tensor`` from: the nodes (:func:`node_key`) between it
    and ``x`` and how they connect; None when a node has no key."""
    if tensor is x:
        return ("x",)
    if id(tensor) not in memo:
        node = tensor.inputs[0]
        key = node_key(node)
        inputs = tuple(_structure(t, x, memo) for t in node.inputs if t.name and not is_constant(t))
        memo[id(tensor)] = None if key is None or None in inputs else (key, inputs)
    return memo[id(tensor)]


def signed_permutation(rot: np.ndarray, x_shape: tuple[int, ...]) -> np.ndarray | None:
    """``R`` with ``rot == probe @ R`` when ``rot`` is a row-wise signed permutation of the probe."""
    if rot.shape != x_shape or not np.all(rot != 0):
        return None
    d = x_shape[-1]
    src = np.abs(rot).astype(np.int64).reshape(-1, d) - 1
    rows = np.arange(src.shape[0])[:, None]
    if not np.all(src // d == rows):
        return None
    cols, signs = src % d, np.sign(rot).reshape(-1, d)
    if not (np.all(cols == cols[0]) and np.all(signs == signs[0])):
        return None
    matrix = np.zeros((d, d))
    matrix[cols[0], np.arange(d)] = signs[0]
    return matrix


def _candidate_tops(graph: gs.Graph, concat: gs.Node) -> list[gs.Tensor]:
    """The Concat's output and the results of single-use movers after it (interleaved forms)."""
    tops = [concat.outputs[0]]
    while len(tops) < 4:
        nxt = single_consumer(tops[-1], graph)
        if nxt is None or nxt.op not in ("Reshape", "Flatten", "Squeeze") or nxt.inputs[0] is not tops[-1]:
            break
        tops.append(nxt.outputs[0])
    return tops[::-1]


def match_rotation(graph: gs.Graph, concat: gs.Node, opset: int,
                   seen: dict | None = None) -> tuple[gs.Tensor, gs.Tensor, np.ndarray] | None:
    """(rotated tensor, x, R) for a Concat at the heart of a rotation, else None.

    ``seen`` keeps ``R`` (or None) per rotation structure: every layer repeats the same one.
    """
    nodes: list = []
    roots = {id(r): r for t in concat.inputs if t.name and not is_constant(t) for r in [_root_of(graph, t, nodes)]}
    if len(roots) != 1:
        raise _NotRotation(f"operands come from {len(roots)} different tensors")
    x = next(iter(roots.values()))
    x_shape = static_shape(x)
    if x_shape is None or len(x_shape) < 2:
        raise _NotRotation("input shape is not static, or rank < 2")
    if x.dtype is None or np.dtype(x.dtype).kind != "f":
        raise _NotRotation("not a float tensor (shape arithmetic, not a rotation)")
    seen = {} if seen is None else seen
    for top in _candidate_tops(graph, concat):
        top_shape = static_shape(top)
        if top_shape is not None and tuple(top_shape) != tuple(x_shape):
            continue  # a rotation keeps the shape (a Concat with constant operands grows it)
        structure = _structure(top, x, {})
        key = None if structure is None else (structure, x_shape, opset)
        if key in seen:
            matrix = seen[key]
        else:
            probe = np.arange(1, np.prod(x_shape) + 1, dtype=np.float64).reshape(x_shape)
            matrix = signed_permutation(_evaluate(top, x, probe, opset, {}), x_shape)
            if key is not None:
                seen[key] = matrix
        if matrix is not None:
            return top, x, matrix
    raise _NotRotation("not a signed permutation of the last axis")


@register_pass
class Rotary(Pass):
    name = "rotary"
    summary = "rotate_half(x) = Concat(Neg(Slice), Slice) (any signed last-axis permutation) => MatMul(x, R)"
    contract = EXACT
    requires = frozenset({FOLDED})
    ensures = frozenset({ATTENTION_REWRITTEN})

    @dataclass
    class Options:
        max_head_dim: int = field(default=512, metadata={"help": "largest last axis rewritten (R is d x d)"})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        stats = {"rotations": 0}
        notes: list[str] = []
        seen: dict = {}
        for concat in [n for n in ir.graph.nodes if n.op == "Concat"]:
            try:
                found = match_rotation(ir.graph, concat, ir.opset, seen)
            except (_NotRotation, ValueError, IndexError, KeyError, TypeError) as exc:
                if ctx.verbose:
                    notes.append(f"{concat.name}: {exc}")
                continue
            top, x, matrix = found
            if matrix.shape[0] > self.options.max_head_dim:
                notes.append(f"{concat.name}: head dim {matrix.shape[0]} > max_head_dim")
                continue
            weight = matrix.reshape((1,) * (len(x.shape) - 2) + matrix.shape).astype(np.dtype(x.dtype))
            r = make_constant(ir, ctx, "rotary_R", weight)
            node = make_node(ir, ctx, "MatMul", [x, r], name_hint=f"{concat.name}_rotary", dtype=x.dtype, shape=x.shape)
            replace_all_uses(ir.graph, top, node.outputs[0], via_identity=True)
            stats["rotations"] += 1
        if stats["rotations"]:
            finish(ir)
            fill_unknown_shapes(ir)
        return PassResult(changed=stats["rotations"] > 0, stats=stats, notes=notes)
