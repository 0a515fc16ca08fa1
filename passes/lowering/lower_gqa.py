"""lower-gqa: onnxruntime's ``com.microsoft.GroupQueryAttention`` => explicit attention, KV cache as graph I/O.

Matches ``GroupQueryAttention`` as onnxruntime-genai's model builder writes it: packed QKV
(``key``/``value`` empty) or separate Q, K, V; ``past_key``/``past_value`` ``[B, kvH, P, D]``;
``seqlens_k`` (valid tokens - 1 per row) and ``total_sequence_length``; rotary fused in
(``do_rotary``, ``cos_cache``/``sin_cache`` ``[max_pos, D/2]``, halves or interleaved).  Not
matched (left alone, with the reason): ``local_window_size``, ``softcap``, ``smooth_softmax``,
partial rotary, ``position_ids``/``attention_bias``/``head_sink`` inputs, an extra output.

Produces what Hugging Face exports contain: Q/K/V split into heads ``[B, H, S, D]``, rotary as
``x*cos + (x@R)*sin`` with cos/sin gathered at positions ``seqlens_k + 1 - S + i`` (the
``rotary`` pass's form), ``present_k = Concat(past_k, k)`` along the sequence (the original
``present.*`` outputs, so past in / present out stay graph I/O), ``repeat_kv`` as
``Unsqueeze -> Expand -> Reshape`` (``gqa-broadcast`` un-repeats it), ``softmax(Q·Kᵀ·scale +
mask)·V``.  The mask is causal over ``past + new`` and, when ``seqlens_k`` is computed from a
2-D ``attention_mask`` input (as the builder does), also masks the keys that input marks 0 --
so a prefill/decode pair with a fixed-size, padded cache can be made from the result.  The
symbolic dims are made consistent (``attention_mask``/``present`` length ``past + seq``, the
cache's head dim static) so that ``fix-shapes`` binds them together.

Why safe: the same dot products, softmax and weighted sums as onnxruntime's kernel when the
past buffer holds exactly the tokens already seen (no padding, ``P = seqlens_k + 1 - S``):
verified against onnxruntime CPU running the original op on such inputs.  With padding the
kernel's shared-buffer semantics differ from the HF-style form this produces (stated by the
contract).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs
from qnnpasses.passes.lowering._contrib import Emitter, is_contrib, last_dim
from qnnpasses.passes.lowering._kv_io import declare_kv_dims, find_kv_interface, planned_kv_shapes

from qnnpasses.ir.model import IRModel
from qnnpasses.ir.shapes import is_static
from qnnpasses.passmanager.api import CONTRIB_LOWERED, Pass, PassContext, PassResult, assumes, register_pass
from qnnpasses.passmanager.rewrite import finish, producer

MASK_VALUE = -1.0e4  # what attention-cleanup makes every mask use (see its docstring)
_UNSUPPORTED_ATTRS = {"local_window_size": -1, "softcap": 0.0, "smooth_softmax": 0, "qk_output": 0}


@register_pass
class LowerGQA(Pass):
    name = "lower-gqa"
    anchor_ops = frozenset({"GroupQueryAttention"})
    summary = "com.microsoft.GroupQueryAttention => explicit attention with rotary, past/present KV as graph I/O"
    contract = assumes("no padding: past_key holds exactly the tokens already seen and attention_mask is all ones")
    ensures = frozenset({CONTRIB_LOWERED})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        nodes = [n for n in ir.graph.nodes if is_contrib(n, "GroupQueryAttention")]
        notes, lowered, shared = [], 0, {}
        for node in nodes:
            reason = _why_not(node)
            if reason:
                notes.append(f"{node.name}: not lowered: {reason}")
                continue
            _lower(ir, ctx, node, shared)
            lowered += 1
        if lowered:
            finish(ir)
        return PassResult(changed=lowered > 0, stats={"lowered": lowered, "left": len(nodes) - lowered}, notes=notes)

    def planned_input_shapes(self, ir: IRModel, ctx: PassContext) -> dict[str, list[int]] | None:
        """Consistent verification shapes: ``attention_mask`` length = past + sequence."""
        nodes = [n for n in ir.graph.nodes if is_contrib(n, "GroupQueryAttention") and not _why_not(n)]
        kv = find_kv_interface(ir, _mask_input(ir, nodes[0].inputs[5])) if nodes else None
        if kv is None:
            return None
        return planned_kv_shapes(ir, ctx, kv, _head_size(nodes[0]), nodes[0].inputs[0].shape[1])


def _why_not(node: gs.Node) -> str:
    for key, neutral in _UNSUPPORTED_ATTRS.items():
        if key in node.attrs and node.attrs[key] != neutral:
            return f"{key}={node.attrs[key]} is not lowered"
    inputs = node.inputs
    if len(inputs) < 7 or not inputs[3].name or not inputs[4].name:
        return "no past_key/past_value inputs"
    if any(t.name for t in inputs[9:]):
        return "position_ids/attention_bias/head_sink inputs are not lowered"
    if len([t for t in node.outputs if t.name]) > 3:
        return "the attention-probabilities output is not lowered"
    if bool(node.attrs.get("do_rotary", 0)) and (len(inputs) < 9 or not inputs[7].name or not inputs[8].name):
        return "do_rotary without cos/sin caches"
    head = _head_size(node)
    if head is None:
        return "head size unknown (no static cache or hidden dim)"
    if bool(node.attrs.get("do_rotary", 0)):
        cache = inputs[7].shape
        if cache is None or not is_static(cache[-1]) or 2 * int(cache[-1]) != head:
            return "partial rotary (cos_cache narrower than head_size/2) is not lowered"
    return ""


def _head_size(node: gs.Node) -> int | None:
    """From the cache's last dim, the query's hidden dim or the projection that makes it."""
    heads, kv_heads = int(node.attrs["num_heads"]), int(node.attrs["kv_num_heads"])
    past = node.inputs[3].shape
    if past and len(past) == 4 and is_static(past[3]):
        return int(past[3])
    packed = not (len(node.inputs) > 1 and node.inputs[1].name)
    width = last_dim(node.inputs[0])
    return width // (heads + 2 * kv_heads if packed else heads) if width else None


def _mask_input(ir: IRModel, seqlens: gs.Tensor) -> gs.Variable | None:
    """The 2-D graph input ``seqlens_k`` is computed from (``ReduceSum(mask) - 1``, cast), if any."""
    frontier, inputs = [seqlens], {t.name for t in ir.graph.inputs}
    for _ in range(6):
        found = [t for t in frontier if t.name in inputs and t.shape is not None and len(t.shape) == 2]
        if found:
            return found[0]
        nodes = [producer(t) for t in frontier]
        frontier = [t for n in nodes if n is not None and n.op in ("Cast", "Sub", "Add", "ReduceSum")
                    for t in n.inputs[:1]]
    return None


def _lower(ir: IRModel, ctx: PassContext, node: gs.Node, shared: dict) -> None:
    e = Emitter(ir, ctx, "gqa")
    heads, kv_heads = int(node.attrs["num_heads"]), int(node.attrs["kv_num_heads"])
    head = _head_size(node)
    query, key, value, past_k, past_v, seqlens = node.inputs[:6]
    caches = list(node.inputs[7:9])
    dtype = query.dtype
    out, present_k, present_v = (list(node.outputs) + [None, None])[:3]
    node.outputs.clear()
    node.inputs.clear()

    if key.name:
        q, k, v = query, key, value
    else:
        sizes = e.const([heads * head, kv_heads * head, kv_heads * head], np.int64)
        q, k, v = e.op("Split", [query, sizes], attrs={"axis": -1}, outputs=3, dtype=dtype)
    q, k, v = e.heads(q, heads, head), e.heads(k, kv_heads, head), e.heads(v, kv_heads, head)

    context = _shared(e, ir, node, query, past_k, seqlens, head, dtype, shared)
    if bool(node.attrs.get("do_rotary", 0)):
        interleaved = bool(node.attrs.get("rotary_interleaved", 0))
        cos, sin = context["cos_sin"](caches[0], caches[1], interleaved)
        q, k = e.rotate(q, cos, sin, head, interleaved), e.rotate(k, cos, sin, head, interleaved)

    present_k = _concat(e, past_k, k, present_k, dtype)
    present_v = _concat(e, past_v, v, present_v, dtype)
    keys, values = _repeat(e, present_k, heads, kv_heads, head), _repeat(e, present_v, heads, kv_heads, head)
    scale = float(node.attrs.get("scale", 0.0) or 0.0) or 1.0 / math.sqrt(head)

    keys_t = e.op("Transpose", [keys], attrs={"perm": [0, 1, 3, 2]}, dtype=dtype)
    scores = e.op("MatMul", [q, keys_t], dtype=dtype)
    scores = e.op("Mul", [scores, e.const(scale, dtype)], dtype=dtype)
    scores = e.op("Add", [scores, context["mask"]], dtype=dtype)
    probs = e.op("Softmax", [scores], attrs={"axis": -1}, dtype=dtype)
    attended = e.op("MatMul", [probs, values], dtype=dtype)
    merged = e.op("Transpose", [attended], attrs={"perm": [0, 2, 1, 3]}, dtype=dtype)
    e.op("Reshape", [merged, e.const([0, 0, heads * head], np.int64)], outputs=[out])
    kv = find_kv_interface(ir, _mask_input(ir, seqlens))
    if kv is not None and query.shape:
        declare_kv_dims(ir, kv, head, query.shape[1])


def _concat(e: Emitter, past: gs.Tensor, new: gs.Tensor, present: gs.Variable | None, dtype) -> gs.Variable:
    if present is not None and present.name:
        return e.op("Concat", [past, new], attrs={"axis": 2}, outputs=[present])[0]
    return e.op("Concat", [past, new], attrs={"axis": 2}, dtype=dtype)


def _repeat(e: Emitter, x: gs.Tensor, heads: int, kv_heads: int, head: int) -> gs.Tensor:
    """HF ``repeat_kv``: ``[B, kvH, T, D]`` -> ``[B, H, T, D]`` (head h reads kv head h // group)."""
    if heads == kv_heads:
        return x
    grown = e.op("Unsqueeze", [x, e.const([2], np.int64)], dtype=x.dtype)
    grown = e.op("Expand", [grown, e.const([1, 1, heads // kv_heads, 1, 1], np.int64)], dtype=x.dtype)
    return e.op("Reshape", [grown, e.const([0, heads, -1, head], np.int64)], dtype=x.dtype)


def _shared(e: Emitter, ir: IRModel, node: gs.Node, query: gs.Tensor, past_k: gs.Tensor, seqlens: gs.Tensor,
            head: int, dtype, shared: dict) -> dict:
    """Positions, cos/sin and the mask: made once per model (every layer sees the same ones)."""
    key = seqlens.name
    if key in shared:
        return shared[key]
    i64 = np.int64
    seq = e.dim(query, 1)
    past = e.dim(past_k, 2)
    one, zero = e.const(1, i64), e.const(0, i64)
    # positions of the new tokens: seqlens_k + 1 - S + i (onnxruntime's rule)
    offsets = e.op("Range", [e.op("Sub", [one, seq], dtype=i64, shape=[]), one, one], dtype=i64, shape=[None])
    valid = e.op("Cast", [seqlens], attrs={"to": 7}, dtype=i64)
    positions = e.op("Add", [e.op("Unsqueeze", [valid, e.const([1], i64)], dtype=i64), offsets], dtype=i64)
    caches: dict = {}

    def cos_sin(cos_cache, sin_cache, interleaved):
        slot = (cos_cache.name, sin_cache.name, interleaved)
        if slot not in caches:
            caches[slot] = (e.cos_sin(cos_cache, positions, head, interleaved),
                            e.cos_sin(sin_cache, positions, head, interleaved))
        return caches[slot]

    # causal over past + new: key j is visible to new token i when j <= P + i
    total = e.op("Add", [past, seq], dtype=i64, shape=[])
    keys = e.op("Unsqueeze", [e.op("Range", [zero, total, one], dtype=i64), e.const([0], i64)], dtype=i64)
    rows = e.op("Add", [e.op("Range", [zero, seq, one], dtype=i64), past], dtype=i64)
    rows = e.op("Unsqueeze", [rows, e.const([1], i64)], dtype=i64)
    allowed = e.op("LessOrEqual", [keys, rows], dtype=np.bool_)
    mask_input = _mask_input(ir, seqlens)
    if mask_input is not None:
        seen = e.op("Cast", [mask_input], attrs={"to": 9}, dtype=np.bool_)
        seen = e.op("Unsqueeze", [seen, e.const([1, 2], i64)], dtype=np.bool_)
        allowed = e.op("And", [allowed, seen], dtype=np.bool_)
    mask = e.op("Where", [allowed, e.const(0.0, dtype), e.const(MASK_VALUE, dtype)], dtype=dtype)
    shared[key] = {"cos_sin": cos_sin, "mask": mask}
    return shared[key]
