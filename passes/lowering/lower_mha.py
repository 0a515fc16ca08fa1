"""lower-mha: onnxruntime's ``com.microsoft.MultiHeadAttention`` (3-D Q/K/V) => explicit attention.

Matches ``MultiHeadAttention(query, key, value[, , , attention_bias])`` with ``[B, S, N*D]``
query and ``[B, L, N*D]`` key/value (what onnxruntime-genai's builder writes for its
fp16/CPU graphs, after an explicit ``Concat(past, new)`` and ``repeat_kv``), an optional
additive ``attention_bias`` broadcastable to ``[B, N, S, L]``, ``unidirectional=0``, and only
the ``output`` output.  Not matched (the reason is noted): packed QKV, ``bias``,
``key_padding_mask``, past/present inputs or outputs, ``unidirectional=1``.

Produces ``softmax(Q·Kᵀ·scale + attention_bias)·V`` with Q, K, V split into heads
``[B, N, *, D]`` and the result merged back to ``[B, S, N*D]`` -- the HF form the attention
passes (``attention-cleanup``, ``gqa-broadcast``) work on.

Why safe: the kernel's definition, the same dot products, softmax and sums; verified against
onnxruntime CPU running the original op.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs
from qnnpasses.passes.lowering._contrib import Emitter, is_contrib, last_dim
from qnnpasses.passes.lowering._kv_io import declare_kv_dims, find_kv_interface, planned_kv_shapes

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import CONTRIB_LOWERED, EXACT, Pass, PassContext, PassResult, register_pass
from qnnpasses.passmanager.rewrite import finish


@register_pass
class LowerMHA(Pass):
    name = "lower-mha"
    anchor_ops = frozenset({"MultiHeadAttention"})
    summary = "com.microsoft.MultiHeadAttention (3-D Q/K/V) => softmax(Q·Kᵀ·scale + bias)·V"
    contract = EXACT
    ensures = frozenset({CONTRIB_LOWERED})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        nodes = [n for n in ir.graph.nodes if is_contrib(n, "MultiHeadAttention")]
        outputs = {t.name for t in ir.graph.outputs}
        notes, lowered, head = [], 0, None
        for node in nodes:
            reason = _why_not(node, outputs)
            if reason:
                notes.append(f"{node.name}: not lowered: {reason}")
                continue
            head = _lower(ir, ctx, node)
            lowered += 1
        if lowered:
            kv = find_kv_interface(ir)
            if kv is not None and kv.tokens is not None:
                declare_kv_dims(ir, kv, head, kv.tokens.shape[1])
            finish(ir)
        return PassResult(changed=lowered > 0, stats={"lowered": lowered, "left": len(nodes) - lowered}, notes=notes)

    def planned_input_shapes(self, ir: IRModel, ctx: PassContext) -> dict[str, list[int]] | None:
        """With a KV cache: the mask spans past + sequence (what the explicit Concat needs)."""
        outputs = {t.name for t in ir.graph.outputs}
        nodes = [n for n in ir.graph.nodes if is_contrib(n, "MultiHeadAttention") and not _why_not(n, outputs)]
        kv = find_kv_interface(ir) if nodes else None
        if kv is None or kv.tokens is None:
            return None
        return planned_kv_shapes(ir, ctx, kv, _head(nodes[0]), kv.tokens.shape[1])


def _head(node: gs.Node) -> int | None:
    width = next((w for w in (last_dim(t) for t in node.inputs[:3]) if w), None)
    heads = int(node.attrs["num_heads"])
    return width // heads if width and width % heads == 0 else None


def _why_not(node: gs.Node, graph_outputs: set[str]) -> str:
    inputs = node.inputs
    if len(inputs) < 3 or not inputs[1].name or not inputs[2].name:
        return "packed QKV is not lowered"
    if any(i < len(inputs) and inputs[i].name for i in (3, 4, 6, 7, 8, 9)):
        return "bias, key_padding_mask or past inputs are not lowered"
    if any(t.name and (t.outputs or t.name in graph_outputs) for t in node.outputs[1:]):
        return "present outputs are not lowered"
    if int(node.attrs.get("unidirectional", 0)):
        return "unidirectional=1 is not lowered"
    for t in inputs[:3]:
        if t.shape is not None and len(t.shape) != 3:
            return "only 3-D query/key/value are lowered"
    if _head(node) is None:
        return "head size unknown"
    return ""


def _lower(ir: IRModel, ctx: PassContext, node: gs.Node) -> int:
    e = Emitter(ir, ctx, "mha")
    heads, head = int(node.attrs["num_heads"]), _head(node)
    query, key, value = node.inputs[:3]
    bias = node.inputs[5] if len(node.inputs) > 5 and node.inputs[5].name else None
    out = node.outputs[0]
    dtype = query.dtype or key.dtype or value.dtype or (bias.dtype if bias is not None else None)
    node.outputs.clear()
    node.inputs.clear()
    q, v = e.heads(query, heads, head), e.heads(value, heads, head)
    k_t = e.op("Transpose", [e.op("Reshape", [key, e.const([0, 0, heads, head], np.int64)], dtype=dtype)],
               attrs={"perm": [0, 2, 3, 1]}, dtype=dtype)
    scale = float(node.attrs.get("scale", 0.0) or 0.0) or 1.0 / math.sqrt(head)
    scores = e.op("Mul", [e.op("MatMul", [q, k_t], dtype=dtype), e.const(scale, dtype or np.float32)], dtype=dtype)
    if bias is not None:
        scores = e.op("Add", [scores, bias], dtype=dtype)
    probs = e.op("Softmax", [scores], attrs={"axis": -1}, dtype=dtype)
    merged = e.op("Transpose", [e.op("MatMul", [probs, v], dtype=dtype)], attrs={"perm": [0, 2, 1, 3]}, dtype=dtype)
    e.op("Reshape", [merged, e.const([0, 0, heads * head], np.int64)], outputs=[out])
    return head
