"""KV-cache size from the model's attention structure.

An attention block is found at its score product: the ``MatMul`` of two activations
(Q·Kᵀ) that feeds a ``Softmax`` through scale/mask/cast ops.  Its output is
``[batch, heads, q_len, key_len]`` and Q's last dim is the head dim.  The number of
K/V heads is where K was split into heads: walking back from the K operand (through
RoPE, repeat_kv's Unsqueeze/Expand/Reshape, a past-key Concat) to the Reshape
``[B, S, n*D] -> [B, S, n, D]`` with ``D`` = head dim; or a ``past_key_values`` input
``[B, n, past, D]`` met on the way.  Fused attention ops (ONNX ``Attention``,
``com.microsoft`` ``GroupQueryAttention``/``MultiHeadAttention``) carry head counts as
attributes.  When a model takes ``past_key_values.*`` inputs, those are checked too.

Cache bytes (batch 1) = 2 (K and V) × Σ over layers of kv_heads × head_dim × context ×
bytes per element; ``bytes_fp16_mha`` is the same with kv_heads = heads, i.e. what the
model would need without grouped-query attention.
"""

from __future__ import annotations

import re
from collections import Counter, deque

from qnnpasses.analysis.graph import GraphView
from qnnpasses.ir.read import DATA_FIRST_OPS

# Concat: a static-cache graph scores the past and the new keys separately and joins the scores.
_SCORE_PATH_OPS = {"Add", "Sub", "Mul", "Div", "Where", "Cast", "Tanh", "Max", "Min", "Clip", "Identity", "Concat"}
_PROJECTIONS = {"MatMul", "Gemm", "Conv", "MatMulInteger", "QLinearMatMul", "Softmax", "MatMulNBits"}
_PAST_RE = re.compile(r"past.*?(\d+).*?(key|value)|past_(key|value).*?(\d+)", re.IGNORECASE)
_FUSED = {"GroupQueryAttention", "MultiHeadAttention", "Attention"}
_MAX_WALK = 64


def _shape(view: GraphView, name: str) -> tuple | None:
    tensor = view.tensors.get(name)
    return tensor.shape if tensor is not None and tensor.known else None


def _producer(view: GraphView, name: str) -> int | None:
    tensor = view.tensors.get(name)
    return tensor.producer if tensor is not None else None


def _activation_inputs(view: GraphView, node: int) -> list[str]:
    return [t.name for t in view.nodes[node].inputs if t.name in view.tensors]


def score_matmul(view: GraphView, softmax: int) -> int | None:
    """The Q·Kᵀ MatMul feeding ``softmax`` through elementwise scale/mask ops, if any."""
    queue, seen = deque([softmax]), {softmax}
    while queue:
        node = queue.popleft()
        for name in _activation_inputs(view, node):
            prev = _producer(view, name)
            if prev is None or prev in seen:
                continue
            seen.add(prev)
            op = view.nodes[prev].op
            if op == "MatMul" and len(_activation_inputs(view, prev)) == 2:
                return prev
            if op in _SCORE_PATH_OPS and len(seen) < 16:
                queue.append(prev)
    return None


def kv_heads_from_key(view: GraphView, key: str, head_dim: int) -> tuple[int | None, str]:
    """K/V head count found walking back from the K operand: (count, how it was found)."""
    queue, seen = deque([key]), {key}
    while queue and len(seen) < _MAX_WALK:
        name = queue.popleft()
        tensor = view.tensors[name]
        if tensor.graph_input:
            if tensor.known and len(tensor.shape) == 4 and tensor.shape[-1] == head_dim:
                return int(tensor.shape[1]), f"input {name}"
            continue
        node = tensor.producer
        if node is None or view.nodes[node].op in _PROJECTIONS or view.nodes[node].op in ("Shape", "Size"):
            continue
        heads = _heads_reshape(view, node, head_dim)
        if heads is not None:
            return heads, f"reshape {view.nodes[node].name}"
        data = _activation_inputs(view, node)
        if view.nodes[node].op in DATA_FIRST_OPS:
            first = view.nodes[node].inputs[0].name if view.nodes[node].inputs else None
            data = [first] if first in view.tensors else []
        for prev in data:
            if prev not in seen:
                seen.add(prev)
                queue.append(prev)
    return None, "not found"


def _heads_reshape(view: GraphView, node: int, head_dim: int) -> int | None:
    """n when ``node`` is a Reshape [..., S, n*D] -> [..., S, n, D] with D = head_dim."""
    n = view.nodes[node]
    if n.op != "Reshape" or not n.inputs or not n.outputs:
        return None
    src, dst = _shape(view, n.inputs[0].name), _shape(view, n.outputs[0].name)
    if not src or not dst or len(dst) != len(src) + 1 or dst[-1] != head_dim:
        return None
    return int(dst[-2]) if dst[-2] * dst[-1] == src[-1] and dst[:-2] == src[:-1] else None


def _block(view: GraphView, node: int, softmax: int | None = None) -> dict | None:
    """Heads, KV heads, head dim and key length of the attention at score MatMul ``node``.

    The key length is the Softmax's (when given): with a split cache the MatMul scores only part of the keys.
    """
    query, key = _activation_inputs(view, node)[:2]
    q_shape, out_shape = _shape(view, query), _shape(view, view.nodes[node].outputs[0].name)
    scores = _shape(view, view.nodes[softmax].inputs[0].name) if softmax is not None and view.nodes[softmax].inputs else None
    if out_shape and scores and len(scores) == len(out_shape):
        out_shape = scores
    if not q_shape or not out_shape or len(out_shape) < 3:
        return None
    head_dim = int(q_shape[-1])
    heads = int(out_shape[-3]) if len(out_shape) >= 4 else None
    kv_heads, source = kv_heads_from_key(view, key, head_dim)
    return {"node": view.nodes[node].name, "layer": view.layers[node], "heads": heads, "kv_heads": kv_heads,
            "head_dim": head_dim, "key_len": int(out_shape[-1]), "kv_heads_source": source}


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


def attention_blocks(view: GraphView) -> list[dict]:
    blocks, seen = [], set()
    for index, node in enumerate(view.nodes):
        found = None
        if node.op == "Softmax":
            qk = score_matmul(view, index)
            if qk is not None and qk not in seen:
                seen.add(qk)
                found = _block(view, qk, index)
        elif node.op in _FUSED:
            found = _fused_block(view, index)
        if found:
            blocks.append(found)
    return blocks


def past_inputs(view: GraphView) -> dict[str, dict]:
    """``past_key_values.<i>.key``-style inputs: layer index -> {"key": shape, "value": shape}."""
    layers: dict[str, dict] = {}
    for tensor in view.tensors.values():
        m = _PAST_RE.search(tensor.name) if tensor.graph_input else None
        if m and tensor.known and len(tensor.shape) == 4:
            index, kind = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
            layers.setdefault(index, {})[kind.lower()] = tensor.shape
    return layers


def _blocks_from_past(past: dict[str, dict]) -> list[dict]:
    """Per-layer figures from ``past_key_values`` inputs alone ([B, kv_heads, past, head_dim])."""
    return [{"node": None, "layer": index, "heads": None, "kv_heads": int(shapes["key"][1]),
             "head_dim": int(shapes["key"][3]), "key_len": int(shapes["key"][2]) + 1,
             "kv_heads_source": "past_key_values inputs"}
            for index, shapes in sorted(past.items(), key=lambda kv: int(kv[0])) if "key" in shapes]


def analyze_kv_cache(view: GraphView, context: int | None = None) -> dict:
    """The ``kv_cache`` section; figures are None when no attention was recognised."""
    blocks = attention_blocks(view)
    past = past_inputs(view)
    notes = []
    if past:
        past_kv = Counter(s["key"][1] for s in past.values() if "key" in s)
        for block in blocks:
            if block["kv_heads"] is None and past_kv:
                block["kv_heads"], block["kv_heads_source"] = past_kv.most_common(1)[0][0], "past_key_values inputs"
        if blocks and len(past) != len(blocks):
            notes.append(f"{len(past)} past_key_values layers but {len(blocks)} attention blocks found")
    for block in blocks:
        if block["kv_heads"] is None:
            block["kv_heads"], block["kv_heads_source"] = block["heads"], "assumed = heads (no K head split found)"
    usable = [b for b in blocks if b["kv_heads"] and b["head_dim"]] or _blocks_from_past(past)
    if not usable:
        return {"layers": 0, "kv_heads": None, "heads": None, "head_dim": None, "context": context,
                "bytes_fp16": None, "bytes_int8": None, "bytes_fp16_mha": None, "blocks": blocks,
                "notes": notes + ["no attention block recognised"]}
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
        "past_inputs": len(past),
        "blocks": blocks,
        "notes": notes,
    }
