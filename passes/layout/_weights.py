"""layout families that move data movement into constant projection weights.

``weights``: ``MatMul(A, Transpose(W))`` / ``Gemm(Transpose(A|B))`` with a constant ``W``
-> the transposed constant (MatMul) or the flipped ``transA``/``transB`` flag (Gemm).

``split_proj``: a projection ``x @ W`` (MatMul, or Gemm with its bias) whose every reader
slices the last axis (Slice with constant bounds, Split): fused QKV / gate-up projections
of Phi-3, GPT-2 and the TorchScript MHA exports.  Each slice becomes its own projection
with the sliced weight (and bias): k FullyConnected instead of 1 plus k StridedSlice.
Skipped for MatMul + separate bias Add (it would add k-1 Adds for k-1 slices saved).

``head_proj``: a projection followed by the attention head split, Reshape
``[.., S, H*D] -> [.., S, H, D]`` then Transpose to ``[.., H, S, D]`` (checked through the
index map, so single-Reshape decode forms match too).  Produces one batched
``MatMul(x, W_hm)`` with the head-major constant ``W_hm[h, k, d] = W[k, h*D + d]`` (bias
``b[h, 1, d]`` in an Add): 1 HTP MatMul instead of FullyConnected + Reshape + Transpose.

Safe: each output element is the same dot product of the same numbers (float summation
order inside a MatMul kernel may differ, ~1 ulp; on the HTP in fp16 the outputs measured
bit-identical); regrouping a weight creates a new constant the same size as the old one,
which becomes dead.  Trade-off of ``head_proj``: the weight feeds a batched MatMul, not
a FullyConnected; for per-channel weight quantization keep FullyConnected
(``layout{head_proj=false}``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.index_map import index_map
from qnnpasses.ir.model import IRModel, derived_from
from qnnpasses.passmanager.api import PassContext
from qnnpasses.passmanager.rewrite import (
    constant_shape,
    constant_value,
    emit,
    input_value,
    is_constant,
    is_graph_output,
    make_constant,
    node_key,
    normalize_axis,
    replace_all_uses,
    single_consumer,
    static_shape,
)


@dataclass
class Projection:
    """``y = x @ w (+ bias)``: the nodes computing it and its constant weight ``w`` as ``[K, N]``.

    ``w`` is read only when a rewrite uses it: matching needs only its ``shape``, and reading
    a derived weight recomputes it.
    """

    x: gs.Tensor
    weight: gs.Tensor
    shape: tuple[int, ...]
    bias: np.ndarray | None
    nodes: list
    output: gs.Tensor
    gemm: bool = False
    transposed: bool = False

    @cached_property
    def w(self) -> np.ndarray:
        value = constant_value(self.weight)
        return value.T if self.transposed else value


def _row_bias(bias: np.ndarray, n: int) -> np.ndarray | None:
    """A Gemm ``C`` that adds the same ``[N]`` row to every output row, as ``[N]``."""
    if bias.size == 1:
        return np.full((n,), bias.ravel()[0], dtype=bias.dtype)
    if bias.size == n and bias.shape[-1] == n:
        return bias.reshape(n)
    return None


def projection_of(graph: gs.Graph, tensor: gs.Tensor) -> Projection | None:
    node = tensor.inputs[0] if tensor.inputs else None
    if node is None:
        return None
    if node.op == "Add":
        inner = [t for t in node.inputs if not is_constant(t)]
        if len(inner) != 1 or len(inner) == len(node.inputs) or single_consumer(inner[0], graph) is not node:
            return None
        base = projection_of(graph, inner[0])
        if base is None or base.bias is not None:
            return None
        bias = constant_value(next(t for t in node.inputs if is_constant(t)))
        if bias is None or bias.ndim > 1 and np.prod(bias.shape[:-1]) != 1:
            return None
        return replace(base, bias=bias.reshape(-1), nodes=base.nodes + [node], output=tensor, gemm=False)
    if node.op == "MatMul" and is_constant(node.inputs[1]):
        shape = constant_shape(node.inputs[1])
        return Projection(node.inputs[0], node.inputs[1], shape, None, [node], tensor) if len(shape) == 2 else None
    if node.op == "Gemm" and is_constant(node.inputs[1]) and not node.attrs.get("transA", 0) \
            and node.attrs.get("alpha", 1.0) == 1.0 and node.attrs.get("beta", 1.0) == 1.0:
        transposed = bool(node.attrs.get("transB", 0))
        shape = constant_shape(node.inputs[1])
        shape = shape[::-1] if transposed else shape
        bias = input_value(node, 2)
        if len(node.inputs) > 2 and node.inputs[2].name and bias is None:
            return None
        if bias is not None:
            bias = _row_bias(bias, shape[1])
            if bias is None:
                return None
        return Projection(node.inputs[0], node.inputs[1], shape, bias, [node], tensor, gemm=True, transposed=transposed)
    return None


def emit_projection(ir: IRModel, ctx: PassContext, proj: Projection, transform, bias: np.ndarray | None,
                    shape, hint: str) -> gs.Tensor:
    """``x @ transform(proj.w) (+ bias)``: a Gemm when the source was one (bias inside), else
    MatMul (+ Add).  The new weight stays a lazy recipe when ``proj.w`` is a mapped external
    weight, so a 7B model's rewritten projections are never all in memory at once."""
    dtype = proj.x.dtype
    values = derived_from(proj.w, transform)
    weight = gs.Constant(ctx.unique_name(ir, f"{hint}_w"), values)
    if proj.gemm and len(weight.shape) == 2:
        inputs = [proj.x, weight] + ([make_constant(ir, ctx, f"{hint}_b", bias)] if bias is not None else [])
        return emit(ir, ctx, "Gemm", inputs, hint=hint, dtype=dtype, shape=shape)
    out = emit(ir, ctx, "MatMul", [proj.x, weight], hint=hint, dtype=dtype, shape=shape)
    if bias is not None:
        out = emit(ir, ctx, "Add", [out, make_constant(ir, ctx, f"{hint}_b", bias)], hint=f"{hint}_bias",
                   dtype=dtype, shape=shape)
    return out


# --------------------------------------------------------------------------- split_proj


def _slice_range(node: gs.Node, source: gs.Tensor, n: int) -> list[tuple[gs.Tensor, int, int]] | None:
    """``(output, start, stop)`` for each result of a last-axis Slice/Split of ``source``."""
    rank = len(source.shape)
    if node.inputs[0] is not source:
        return None
    if node.op == "Slice":
        starts, ends, axes, steps = (input_value(node, i) for i in (1, 2, 3, 4))
        if starts is None or ends is None or len(starts) != 1 or (steps is not None and int(steps[0]) != 1):
            return None
        if normalize_axis(int(axes[0]) if axes is not None else 0, rank) != rank - 1:
            return None
        lo, hi, _ = slice(int(starts[0]), int(ends[0])).indices(n)
        return [(node.outputs[0], lo, max(lo, hi))]
    if node.op == "Split" and normalize_axis(node.attrs.get("axis", 0), rank) == rank - 1:
        sizes = input_value(node, 1) if len(node.inputs) > 1 else node.attrs.get("split")
        if sizes is None and len(node.inputs) == 1:  # equal parts (opset 18 num_outputs), the last one smaller
            part = -(-n // len(node.outputs))
            sizes = [min(part, n - i * part) for i in range(len(node.outputs))]
        if sizes is None:
            return None
        bounds = np.cumsum([0] + [int(s) for s in sizes])
        return [(t, int(a), int(b)) for t, a, b in zip(node.outputs, bounds[:-1], bounds[1:])]
    return None


def _projections(ir: IRModel):
    """``(node, projection)`` for every node that ends a constant-weight projection (None if not one)."""
    for node in list(ir.graph.nodes):
        if node.op in ("MatMul", "Gemm", "Add") and node.outputs:
            yield node, projection_of(ir.graph, node.outputs[0])


def rewrite_split_proj(ir: IRModel, ctx: PassContext, stats: dict, notes: list) -> int:
    done = 0
    for node, proj in _projections(ir):
        out = node.outputs[0]
        if proj is None or static_shape(out) is None or is_graph_output(ir.graph, out) or not out.outputs:
            continue
        if proj.bias is not None and not proj.gemm:
            continue
        pieces = [_slice_range(c, out, proj.shape[1]) for c in out.outputs]
        if any(p is None for p in pieces):
            continue
        for target, lo, hi in (piece for group in pieces for piece in group):
            bias = None if proj.bias is None else proj.bias[lo:hi]
            new = emit_projection(ir, ctx, proj, lambda w, lo=lo, hi=hi: w[:, lo:hi], bias, target.shape,
                                  hint=f"{node.name}_{lo}")
            replace_all_uses(ir.graph, target, new, via_identity=True)
        stats["split_proj"] = stats.get("split_proj", 0) + 1
        done += 1
    return done


# --------------------------------------------------------------------------- head_proj


def _movers_after(graph: gs.Graph, tensor: gs.Tensor) -> list[gs.Node]:
    chain = []
    while len(chain) < 4:
        nxt = single_consumer(tensor, graph)
        if nxt is None or nxt.op not in ("Reshape", "Transpose") or nxt.inputs[0] is not tensor:
            break
        if nxt.op == "Reshape" and input_value(nxt, 1) is None:
            break
        chain.append(nxt)
        tensor = nxt.outputs[0]
    return chain


def _head_major(chain: list[gs.Node], p_shape: tuple, opset: int, memo: dict) -> tuple[int, int] | None:
    """(H, D) when ``chain`` maps ``[.., S, H*D]`` to ``[1.., H, S, D]`` (a head split).

    ``memo`` keeps the answer per chain signature (:func:`node_key`; one per layer and projection).
    """
    y_shape = static_shape(chain[-1].outputs[0])
    if y_shape is None or len(y_shape) < 3 or any(d != 1 for d in y_shape[:-3]) or any(d != 1 for d in p_shape[:-2]):
        return None
    h, s, d = y_shape[-3:]
    if h < 2 or s != p_shape[-2] or h * d != p_shape[-1]:
        return None
    nodes = tuple(node_key(n) for n in chain)
    key = None if None in nodes else (nodes, p_shape, y_shape, opset)
    if key is not None and key in memo:
        return memo[key]
    values = [[input_value(n, i) for i in range(5)] for n in chain]
    index = index_map(chain, p_shape, values, opset)
    expected = np.arange(s * h * d).reshape(s, h, d).transpose(1, 0, 2)
    heads = (h, d) if index is not None and np.array_equal(index.ravel(), expected.ravel()) else None
    if key is not None:
        memo[key] = heads
    return heads


def rewrite_head_proj(ir: IRModel, ctx: PassContext, stats: dict, notes: list) -> int:
    done = 0
    memo: dict = {}
    for node, proj in _projections(ir):
        p_shape = None if proj is None else static_shape(node.outputs[0])
        if p_shape is None:
            continue
        chain = _movers_after(ir.graph, node.outputs[0])
        for length in range(len(chain), 0, -1):
            heads = _head_major(chain[:length], p_shape, ir.opset, memo)
            if heads is None:
                continue
            h, d = heads
            y = chain[length - 1].outputs[0]
            lead = (1,) * (len(y.shape) - 3)
            k = proj.shape[0]
            bias = None if proj.bias is None else proj.bias.reshape(lead + (h, 1, d))
            new = emit_projection(ir, ctx, proj,
                                  lambda w, k=k, h=h, d=d, lead=lead: w.reshape(k, h, d).transpose(1, 0, 2).reshape(lead + (h, k, d)),
                                  bias, y.shape, hint=f"{node.name}_heads")
            replace_all_uses(ir.graph, y, new, via_identity=True)
            stats["head_proj"] = stats.get("head_proj", 0) + 1
            done += 1
            break
    return done


# --------------------------------------------------------------------------- weights


def rewrite_weight_transposes(ir: IRModel, ctx: PassContext, stats: dict, notes: list) -> int:
    """Transpose of a constant feeding MatMul (fold) or Gemm (flip the trans flag)."""
    done = 0
    for node in list(ir.graph.nodes):
        if node.op not in ("MatMul", "Gemm"):
            continue
        for index, tensor in enumerate(node.inputs[:2]):
            tnode = tensor.inputs[0] if tensor.inputs else None
            if tnode is None or tnode.op != "Transpose" or not is_constant(tnode.inputs[0]):
                continue
            value = constant_value(tnode.inputs[0])
            perm = tnode.attrs.get("perm") or list(range(value.ndim))[::-1]
            if node.op == "Gemm":
                if value.ndim != 2 or list(perm) != [1, 0]:
                    continue
                flag = "transA" if index == 0 else "transB"
                node.attrs[flag] = 1 - node.attrs.get(flag, 0)
                node.inputs[index] = tnode.inputs[0]
            else:
                node.inputs[index] = make_constant(ir, ctx, f"{tensor.name}_folded", value.transpose(perm))
            stats["weights_folded"] = stats.get("weights_folded", 0) + 1
            done += 1
    return done
