"""Find the roles of a KV-cache decoder export's inputs and outputs from its graph.

Names vary between exporters, so every role is found from what the graph does with a tensor:

* a *past* input is a float rank-4 graph input that a Concat (through Identity or one-input
  Concats) joins with a computed tensor into a graph output, the *present* output; the
  Concat's axis is the cache's sequence axis;
* key or value: a key's concatenation reaches a MatMul whose output flows into a Softmax
  (the scores); a value's reaches a MatMul whose other operand comes from a Softmax; the key
  and value of one layer meet at the same Softmax, and layers are ordered as the graph runs;
* ``input_ids``: the integer input used as indices of a Gather on a rank-2 float initializer
  (the embedding);
* ``position_ids``: an integer input from which a Cos/Sin (rotary) is computed, or that is (up to
  Cast/Reshape-like moves) the row indices of a rotary table Gather (a float constant
  ``[max_pos, d]`` read at positions, as lowered ``GroupQueryAttention``/``RotaryEmbedding`` do),
  if any -- positions derived from the mask or the past length give none (``expose-positions``
  then adds the input);
* ``attention_mask``: the remaining rank-2 input;
* ``logits``: the output that is not a present output.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.errors import BadInputError

_PASS_THROUGH = {"Identity", "Cast", "Transpose", "Reshape", "Unsqueeze", "Squeeze", "Expand", "Concat", "Slice",
                 "Mul", "Div", "Add", "Sub", "Where", "Neg"}
_FLOAT = {np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64)}


@dataclass
class CacheEntry:
    past: str
    present: str
    axis: int
    kind: str = ""  # "key" | "value"
    softmax: gs.Node | None = field(default=None, repr=False)


@dataclass
class Roles:
    input_ids: str
    attention_mask: str
    position_ids: str | None
    logits: str
    past_key: list[str]
    past_value: list[str]
    present_key: list[str]
    present_value: list[str]
    seq_axis: int
    kv_heads: int | str
    head_dim: int | str
    vocab: int | str

    @property
    def layers(self) -> int:
        return len(self.past_key)


def _dtype(tensor: gs.Tensor) -> np.dtype | None:
    try:
        return np.dtype(tensor.dtype) if tensor.dtype is not None else None
    except TypeError:
        return None


def _is_float(tensor: gs.Tensor) -> bool:
    return _dtype(tensor) in _FLOAT


def _is_int(tensor: gs.Tensor) -> bool:
    dtype = _dtype(tensor)
    return dtype is not None and dtype.kind in "iub"


def _through_identities(tensor: gs.Tensor) -> list[gs.Node]:
    """Consumers of ``tensor``, looking through Identity and one-input Concat nodes."""
    found, queue = [], deque(tensor.outputs)
    while queue:
        node = queue.popleft()
        if node.op == "Identity" or (node.op == "Concat" and len(node.inputs) == 1):
            queue.extend(node.outputs[0].outputs)
        else:
            found.append(node)
    return found


def _reaches(start: gs.Tensor, target_ops: set[str], limit: int = 64) -> list[gs.Node]:
    """Nodes of ``target_ops`` reachable forward from ``start`` through per-position ops."""
    found, seen, queue = [], set(), deque([(start, 0)])
    while queue:
        tensor, depth = queue.popleft()
        for node in tensor.outputs:
            if id(node) in seen or depth > limit:
                continue
            seen.add(id(node))
            if node.op in target_ops:
                found.append(node)
            elif node.op in _PASS_THROUGH:
                queue.extend((out, depth + 1) for out in node.outputs)
    return found


def _softmax_after(matmul: gs.Node) -> gs.Node | None:
    hits = _reaches(matmul.outputs[0], {"Softmax"}, limit=8)
    return hits[0] if hits else None


def _softmax_before(tensor: gs.Tensor, limit: int = 8) -> gs.Node | None:
    for _ in range(limit):
        node = tensor.inputs[0] if tensor.inputs else None
        if node is None:
            return None
        if node.op == "Softmax":
            return node
        if node.op not in ("Cast", "Identity", "Dropout", "Where", "Slice"):
            return None
        tensor = node.inputs[0]
    return None


def _cache_entries(graph: gs.Graph) -> list[CacheEntry]:
    outputs = {id(t) for t in graph.outputs}
    entries = []
    for tensor in graph.inputs:
        if not (_is_float(tensor) and tensor.shape is not None and len(tensor.shape) == 4):
            continue
        for node in _through_identities(tensor):
            if node.op == "Concat" and len(node.inputs) >= 2 and id(node.outputs[0]) in outputs:
                rank = 4
                axis = int(node.attrs.get("axis", 0))
                entries.append(CacheEntry(tensor.name, node.outputs[0].name, axis + rank if axis < 0 else axis))
                break
    return entries


def _classify(graph: gs.Graph, entries: list[CacheEntry]) -> None:
    tensors = graph.tensors()
    for entry in entries:
        present = tensors[entry.present]
        for matmul in _reaches(present, {"MatMul"}):
            other = [t for t in matmul.inputs if t is not None]
            if any(_softmax_before(t) for t in other):
                entry.kind, entry.softmax = "value", next(_softmax_before(t) for t in other if _softmax_before(t))
                break
            softmax = _softmax_after(matmul)
            if softmax is not None:
                entry.kind, entry.softmax = "key", softmax
                break


def find_roles(graph: gs.Graph) -> Roles:
    """The roles of ``graph``'s inputs and outputs; BadInputError when it has no KV cache."""
    entries = _cache_entries(graph)
    if not entries:
        raise BadInputError("no KV cache: no float rank-4 input is concatenated into a graph output")
    _classify(graph, entries)
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    keys = [e for e in entries if e.kind == "key"]
    values = {id(e.softmax): e for e in entries if e.kind == "value"}
    if not keys or len(keys) != len(values) or len(keys) * 2 != len(entries):
        raise BadInputError("KV cache inputs do not pair into key/value per layer through an attention "
                            f"({len(keys)} keys, {len(values)} values of {len(entries)} cache inputs)")
    keys.sort(key=lambda e: order.get(id(e.softmax), 0))
    pairs = []
    for key in keys:
        value = values.get(id(key.softmax))
        if value is None:
            raise BadInputError(f"KV cache input '{key.past}' has no value input at the same attention")
        pairs.append((key, value))
    axes = {e.axis for e in entries}
    if axes != {2}:
        raise BadInputError(f"KV cache concatenated along axis {sorted(axes)}; only [batch, heads, seq, dim] is supported")

    inputs = {t.name: t for t in graph.inputs}
    past = {e.past for e in entries}
    others = [t for t in graph.inputs if t.name not in past]
    input_ids = embedding_indices(others)
    if input_ids is None:
        raise BadInputError("no input_ids: no integer input indexes an embedding table")
    position_ids = next((t.name for t in others if t is not input_ids and _is_int(t) and feeds_rotary(t)), None)
    if position_ids is None:
        direct = [index_input(g.inputs[1], graph) for g in rotary_gathers(graph)]
        position_ids = next((t.name for t in direct if t is not None and t is not input_ids and t.name not in past), None)
    rest = [t for t in others if t.name not in (input_ids.name, position_ids)]
    masks = [t for t in rest if t.shape is not None and len(t.shape) == 2]
    if len(masks) != 1 or len(rest) != 1:
        raise BadInputError(f"cannot tell the attention mask among inputs {[t.name for t in rest]}")
    present = {e.present for e in entries}
    logits = [t for t in graph.outputs if t.name not in present]
    if len(logits) != 1:
        raise BadInputError(f"expected one output besides the KV cache, found {[t.name for t in logits]}")
    shape = inputs[pairs[0][0].past].shape
    return Roles(
        input_ids=input_ids.name, attention_mask=masks[0].name, position_ids=position_ids, logits=logits[0].name,
        past_key=[k.past for k, _ in pairs], past_value=[v.past for _, v in pairs],
        present_key=[k.present for k, _ in pairs], present_value=[v.present for _, v in pairs],
        seq_axis=2, kv_heads=shape[1], head_dim=shape[3],
        vocab=logits[0].shape[-1] if logits[0].shape else "?",
    )


def embedding_indices(candidates: list[gs.Tensor]) -> gs.Tensor | None:
    """The integer tensor among ``candidates`` used as indices of a Gather on a float rank-2 initializer."""
    for tensor in candidates:
        if not _is_int(tensor):
            continue
        for node in _through_identities(tensor):
            table = node.inputs[0] if node.op == "Gather" else None
            if isinstance(table, gs.Constant) and len(table.shape) == 2 and _is_float(table):
                return tensor
    return None


def feeds_rotary(tensor: gs.Tensor, limit: int = 16) -> bool:
    """Whether a Cos or Sin is computed from ``tensor``'s values within ``limit`` nodes (any op
    but Shape/Size, which read only its shape)."""
    seen, queue = set(), deque([(tensor, 0)])
    while queue:
        current, depth = queue.popleft()
        for node in current.outputs:
            if id(node) in seen or depth > limit:
                continue
            seen.add(id(node))
            if node.op in ("Cos", "Sin"):
                return True
            if node.op in ("Shape", "Size"):
                continue
            queue.extend((out, depth + 1) for out in node.outputs)
    return False


_INDEX_MOVES = ("Identity", "Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Expand")


def value_inputs(tensor: gs.Tensor, limit: int = 48) -> set[str]:
    """Names of the graph inputs whose *values* ``tensor`` is computed from (Shape/Size read only a
    shape and are not followed)."""
    found, seen, queue = set(), set(), deque([(tensor, 0)])
    while queue:
        current, depth = queue.popleft()
        node = current.inputs[0] if current.inputs else None
        if node is None:
            if not isinstance(current, gs.Constant):
                found.add(current.name)
            continue
        if id(node) in seen or depth > limit or node.op in ("Shape", "Size"):
            continue
        seen.add(id(node))
        queue.extend((t, depth + 1) for t in node.inputs if t is not None and t.name)
    return found


def rotary_gathers(graph: gs.Graph) -> list[gs.Node]:
    """Gathers of rows (axis 0) of a float rank-2 constant table at computed or input positions whose
    values do not come from the token ids: the cos/sin tables of a rotary read at the positions (the
    embedding Gather, indexed by the token ids, is not one)."""
    ids = embedding_indices(list(graph.inputs))
    found = []
    for node in graph.nodes:
        if node.op != "Gather" or int(node.attrs.get("axis", 0)) != 0 or len(node.inputs) < 2:
            continue
        table, index = node.inputs[0], node.inputs[1]
        if not (isinstance(table, gs.Constant) and len(table.shape) == 2 and _is_float(table)):
            continue
        if isinstance(index, gs.Constant) or (ids is not None and ids.name in value_inputs(index)):
            continue
        found.append(node)
    return found


def index_input(tensor: gs.Tensor, graph: gs.Graph) -> gs.Tensor | None:
    """The graph input ``tensor`` is, looking back through Cast/Reshape-like moves (None: computed)."""
    inputs = {id(t) for t in graph.inputs}
    for _ in range(8):
        if id(tensor) in inputs:
            return tensor
        node = tensor.inputs[0] if tensor.inputs else None
        if node is None or node.op not in _INDEX_MOVES:
            return None
        tensor = node.inputs[0]
    return None
