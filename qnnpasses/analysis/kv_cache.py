"""KV-cache size from the model's attention structure.

Attention blocks come from the one attention recognizer, :mod:`qnnpasses.ir.attention`: from
each ``Softmax``, the closed score region between Q·Kᵀ and P·V, and the key side traced back to
its head tensor (``repeat_kv`` gives the key/value head count; without one it equals the query
heads).  Its query is ``[batch, heads, q_len, head_dim]``; the key length is the Softmax's.  Fused
attention ops (ONNX ``Attention``, ``com.microsoft`` ``GroupQueryAttention`` /
``MultiHeadAttention``) carry head counts as attributes.  A graph whose cache enters the products
directly, or whose attention the recognizer does not match, is read from its cache inputs
(:func:`qnnpasses.ir.kv_roles.cache_inputs`: float rank-4 inputs that reach an attention product),
taken in Hugging Face's ``[batch, kv_heads, slots, head_dim]`` layout.  Nothing here reads names.

The recognizer needs static shapes: the view's inferred shapes are lent to the graph's tensors
while it runs and taken back after.

Cache bytes (batch 1) = 2 (K and V) × Σ over layers of kv_heads × head_dim × context ×
bytes per element; ``bytes_fp16_mha`` is the same with kv_heads = heads, i.e. what the
model would need without grouped-query attention.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import onnx_graphsurgeon as gs

from qnnpasses.analysis.graph import GraphView
from qnnpasses.ir.attention import find_attentions
from qnnpasses.ir.kv_roles import cache_inputs
from qnnpasses.ir.read import static_shape

_FUSED = {"GroupQueryAttention", "MultiHeadAttention", "Attention"}


def _shape(view: GraphView, name: str) -> tuple | None:
    tensor = view.tensors.get(name)
    return tensor.shape if tensor is not None and tensor.known else None


@contextmanager
def _lent_shapes(view: GraphView, graph: gs.Graph):
    """The view's static shapes on ``graph``'s tensors whose own shape is not static, for the block."""
    lent = []
    for tensor in graph.tensors().values():
        known = _shape(view, tensor.name) if isinstance(tensor, gs.Variable) else None
        if known is not None and static_shape(tensor) is None:
            lent.append((tensor, tensor.shape))
            tensor.shape = list(known)
    try:
        yield
    finally:
        for tensor, shape in lent:
            tensor.shape = shape


def _block(view: GraphView, index: dict[int, int], att) -> dict:
    softmax = att.region.softmax
    scores = _shape(view, softmax.inputs[0].name) or ()
    repeat = att.key.repeat
    return {"node": att.region.qk.name, "layer": view.layers[index[id(att.region.qk)]], "heads": att.heads,
            "kv_heads": att.kv_heads, "head_dim": att.head_dim, "key_len": int(scores[-1]) if scores else None,
            "kv_heads_source": f"repeat_kv {repeat.expand.name}" if repeat else "no repeat_kv: = heads"}


def _cache_blocks(view: GraphView, caches: list[gs.Tensor]) -> list[dict]:
    """Per layer from the cache inputs alone, read as ``[batch, kv_heads, slots, head_dim]`` pairs."""
    shapes = [(key.name, _shape(view, key.name)) for key in caches[::2]]
    return [{"node": None, "layer": str(i), "heads": None, "kv_heads": int(shape[1]), "head_dim": int(shape[3]),
             "key_len": int(shape[2]) + 1, "kv_heads_source": f"cache input {name}"}
            for i, (name, shape) in enumerate(shapes) if shape]


def _fused_block(view: GraphView, node: int) -> dict | None:
    n = view.nodes[node]
    domain = n.domain or ""
    if domain not in ("", "ai.onnx", "com.microsoft") or (n.op == "Attention" and domain == "com.microsoft"):
        return None  # com.microsoft Attention packs Q/K/V weights: no separate K to size
    heads = n.attrs.get("num_heads", n.attrs.get("q_num_heads"))
    kv_heads = n.attrs.get("kv_num_heads", heads)
    q_shape = _shape(view, n.inputs[0].name) if n.inputs else None
    k_shape = _shape(view, n.inputs[1].name) if len(n.inputs) > 1 and n.inputs[1].name in view.tensors else None
    if q_shape is None:
        return None
    if len(q_shape) == 4:  # ONNX Attention with [B, H, S, D] inputs
        heads, head_dim = heads or q_shape[1], q_shape[-1]
        kv_heads = n.attrs.get("kv_num_heads") or (k_shape[1] if k_shape else heads)
    elif heads:
        head_dim = q_shape[-1] // int(heads)
    else:
        return None
    key_len = int(k_shape[-2] if k_shape and len(k_shape) == 4 else (k_shape or q_shape)[1])
    return {"node": n.name, "layer": view.layers[node], "heads": int(heads), "kv_heads": int(kv_heads),
            "head_dim": int(head_dim), "key_len": key_len, "kv_heads_source": f"attributes of {n.op}"}


def attention_blocks(view: GraphView, graph: gs.Graph) -> tuple[list[dict], int]:
    """The attention blocks in graph order, and how many graph inputs are a KV cache."""
    index = {id(node): i for i, node in enumerate(view.nodes)}
    with _lent_shapes(view, graph):
        found = [(index[id(a.region.qk)], _block(view, index, a)) for a in find_attentions(graph)]
        caches = cache_inputs(graph)
    found += [(i, block) for i, node in enumerate(view.nodes) if node.op in _FUSED
              for block in [_fused_block(view, i)] if block]
    blocks = [block for _, block in sorted(found, key=lambda item: item[0])]
    return blocks or _cache_blocks(view, caches), len(caches)


def analyze_kv_cache(view: GraphView, graph: gs.Graph, context: int | None = None) -> dict:
    """The ``kv_cache`` section; figures are None when no attention was recognised."""
    blocks, past = attention_blocks(view, graph)
    notes = []
    if blocks and past and past != 2 * len(blocks):
        notes.append(f"{past} KV-cache inputs but {len(blocks)} attention blocks found")
    usable = [b for b in blocks if b["kv_heads"] and b["head_dim"]]
    if not usable:
        return {"layers": 0, "kv_heads": None, "heads": None, "head_dim": None, "context": context,
                "bytes_fp16": None, "bytes_int8": None, "bytes_fp16_mha": None, "past_inputs": past,
                "blocks": blocks, "notes": notes + ["no attention block recognised"]}
    if context is None:
        context = usable[0]["key_len"]
        notes.append(f"context defaults to the model's key length {context}; pass --context N")
    kv_elements = 2 * sum(b["kv_heads"] * b["head_dim"] for b in usable) * context
    mha_elements = None
    if all(b["heads"] for b in usable):
        mha_elements = 2 * sum(b["heads"] * b["head_dim"] for b in usable) * context

    def common(key):
        return Counter(b[key] for b in usable).most_common(1)[0][0]

    return {
        "layers": len(usable),
        "kv_heads": common("kv_heads"),
        "heads": common("heads"),
        "head_dim": common("head_dim"),
        "uniform": all(b[k] == common(k) for b in usable for k in ("kv_heads", "heads", "head_dim")),
        "context": int(context),
        "batch": 1,
        "bytes_fp32": kv_elements * 4,
        "bytes_fp16": kv_elements * 2,
        "bytes_int8": kv_elements,
        "bytes_fp16_mha": mha_elements * 2 if mha_elements else None,
        "bytes_per_token_fp16": kv_elements * 2 // context if context else 0,
        "gqa_saving": 1.0 - kv_elements / mha_elements if mha_elements else 0.0,
        "past_inputs": past,
        "blocks": blocks,
        "notes": notes,
    }
