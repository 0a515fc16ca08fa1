"""lower-rotary-embedding: onnxruntime's ``com.microsoft.RotaryEmbedding`` => ``x*cos + (x@R)*sin``.

Matches ``RotaryEmbedding(x, position_ids, cos_cache, sin_cache)`` with ``x`` ``[B, S, hidden]``
(heads of size ``2 * cos_cache.shape[1]``, what onnxruntime-genai's builder writes for its
fp16/CPU graphs) or ``[B, N, S, D]``, ``position_ids`` ``[B, S]``, full rotary
(``rotary_embedding_dim`` 0 or the head size), halves or ``interleaved``, ``scale`` 1.

Produces the form the ``rotary`` pass makes of exported rotary embeddings: cos/sin rows
gathered at the positions and widened to the head size, ``x*cos + MatMul(x, R)*sin`` with
``R`` a signed permutation (``rotate_half`` or the pairwise GPT-J rotation); a 3-D input is
viewed as ``[B, S, N, D]`` for it and reshaped back.

Why safe: ``x @ R`` is exactly ``rotate_half(x)`` (one +-1 per column), so every output is
``x_i*cos + (+-x_j)*sin``, the kernel's formula; verified against onnxruntime CPU.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from qnnpasses.passes.lowering._contrib import Emitter, is_contrib, last_dim

from qnnpasses.ir.model import IRModel
from qnnpasses.ir.shapes import is_static
from qnnpasses.passmanager.api import CONTRIB_LOWERED, EXACT, Pass, PassContext, PassResult, register_pass
from qnnpasses.passmanager.rewrite import finish


@register_pass
class LowerRotaryEmbedding(Pass):
    name = "lower-rotary-embedding"
    anchor_ops = frozenset({"RotaryEmbedding"})
    summary = "com.microsoft.RotaryEmbedding => x*cos + (x@R)*sin (the rotary pass's form)"
    contract = EXACT
    ensures = frozenset({CONTRIB_LOWERED})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        nodes = [n for n in ir.graph.nodes if is_contrib(n, "RotaryEmbedding")]
        notes, lowered = [], 0
        for node in nodes:
            reason = _why_not(node)
            if reason:
                notes.append(f"{node.name}: not lowered: {reason}")
                continue
            _lower(ir, ctx, node)
            lowered += 1
        if lowered:
            finish(ir)
        return PassResult(changed=lowered > 0, stats={"lowered": lowered, "left": len(nodes) - lowered}, notes=notes)


def _head(node: gs.Node) -> int | None:
    cache = node.inputs[2].shape
    return 2 * int(cache[-1]) if cache and is_static(cache[-1]) else None


def _why_not(node: gs.Node) -> str:
    head = _head(node)
    if head is None:
        return "cos_cache width unknown"
    if int(node.attrs.get("rotary_embedding_dim", 0) or 0) not in (0, head):
        return "partial rotary is not lowered"
    if float(node.attrs.get("scale", 1.0)) != 1.0:
        return "scale != 1 is not lowered"
    x, positions = node.inputs[0], node.inputs[1]
    rank = len(x.shape) if x.shape is not None else (3 if last_dim(x) else None)
    if rank not in (3, 4):
        return "input rank unknown"
    if positions.shape is not None and len(positions.shape) != 2:
        return "position_ids must be [batch, sequence]"
    heads = int(node.attrs.get("num_heads", 0) or 0)
    width = last_dim(x)
    if rank == 3 and (width is None or width % head or (heads and heads * head != width)):
        return "hidden size unknown or not a multiple of the head size"
    return ""


def _lower(ir: IRModel, ctx: PassContext, node: gs.Node) -> None:
    e = Emitter(ir, ctx, "rope")
    x, positions, cos_cache, sin_cache = node.inputs[:4]
    out = node.outputs[0]
    head, interleaved = _head(node), bool(node.attrs.get("interleaved", 0))
    three_d = x.shape is None or len(x.shape) == 3
    node.outputs.clear()
    node.inputs.clear()
    cos = e.cos_sin(cos_cache, positions, head, interleaved)  # [B, 1, S, D]
    sin = e.cos_sin(sin_cache, positions, head, interleaved)
    if three_d:  # [B, S, N*D] -> [B, S, N, D]; cos/sin [B, S, 1, D]
        cos = e.op("Transpose", [cos], attrs={"perm": [0, 2, 1, 3]}, dtype=cos.dtype)
        sin = e.op("Transpose", [sin], attrs={"perm": [0, 2, 1, 3]}, dtype=sin.dtype)
        heads = e.op("Reshape", [x, e.const([0, 0, -1, head], np.int64)], dtype=x.dtype)
        turned = e.rotate(heads, cos, sin, head, interleaved)
        e.op("Reshape", [turned, e.const([0, 0, -1], np.int64)], outputs=[out])
    else:
        e.rotate(x, cos, sin, head, interleaved, into=out)
