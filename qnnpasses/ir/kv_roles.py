"""Find the roles of a KV-cache decoder export's inputs and outputs from its graph.

Names vary between exporters, so every role is found from what the graph does with a tensor:

* a *past* input is a float rank-4 graph input that a Concat (through Identity or one-input
  Concats) joins with a computed tensor into a graph output, the *present* output; the
  Concat's axis is the cache's sequence axis;
* key or value: each Softmax's attention (:mod:`qnnpasses.ir.attention`: the closed region from
  Q·Kᵀ to P·V, through the scale, the mask and SDPA's ``Where(IsNaN(p), 0, p)`` guard); the present
  that the Q·Kᵀ MatMul's key operand is computed from is that layer's key, the one behind the P·V
  MatMul's value operand its value; layers are ordered as the graph runs;
* ``input_ids``: the integer input used as indices of a Gather on a float rank-2 constant table;
  where several inputs index tables (GPT-2's learned positions), the table with one row per
  logit (or tied to the lm_head); an ambiguous graph is refused, naming the candidates;
* ``position_ids``: an integer input from which a Cos/Sin (rotary) is computed, or that is (up to
  Cast/Reshape-like moves) the row indices of a rotary table Gather (a float constant
  ``[max_pos, d]`` read at positions, as lowered ``GroupQueryAttention``/``RotaryEmbedding`` do),
  if any -- positions derived from the mask or the past length give none (``expose-positions``
  then adds the input);
* ``attention_mask``: the remaining rank-2 input;
* ``logits``: the output that is not a present output.

Roles the user names (``--roles``) are taken as given; otherwise an input carrying a Hugging Face
role name that the structure gives another role is refused: one of the two readings is wrong.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.errors import BadInputError
from qnnpasses.ir.attention import find_score_region
from qnnpasses.ir.read import DATA_FIRST_OPS, is_constant, numpy_dtype, producer, producer_inputs, readers_outputs, walk

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


def _is_float(tensor: gs.Tensor) -> bool:
    dtype = numpy_dtype(tensor)
    return dtype is not None and dtype in _FLOAT


def _is_int(tensor: gs.Tensor) -> bool:
    dtype = numpy_dtype(tensor)
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


_WALK_LIMIT = 24


def cache_inputs(graph: gs.Graph) -> list[gs.Tensor]:
    """Float rank-4 graph inputs that reach an attention product (a MatMul of two activations)
    within :data:`_WALK_LIMIT` ops, none of them a MatMul or Gemm: the KV cache of a dynamic
    export (through its Concat) and of a static pair (through casts, transposes, head repeats)."""
    def step(t: gs.Tensor) -> list[gs.Tensor]:
        return readers_outputs(t, skip=("MatMul", "Gemm"))

    def product(node: gs.Node) -> bool:
        return node.op == "MatMul" and not any(is_constant(t) for t in node.inputs)

    return [tensor for tensor in graph.inputs
            if _is_float(tensor) and tensor.shape is not None and len(tensor.shape) == 4
            and any(product(n) for t, _ in walk([tensor], step, _WALK_LIMIT) for n in t.outputs)]


def _cache_reached(tensor: gs.Tensor, presents: dict[int, CacheEntry]) -> list[CacheEntry]:
    """The cache entries whose present (past + new) ``tensor`` is computed from, walking back through
    the ops between a cache and an attention MatMul operand (repeat_kv, transposes, scales; never
    across another MatMul, whose output is a new projection)."""
    def step(t: gs.Tensor) -> list[gs.Tensor]:
        node = producer(t)
        if id(t) in presents or node is None or node.op in ("MatMul", "Gemm", "Softmax", "Shape", "Size"):
            return []
        data = node.inputs[:1] if node.op in DATA_FIRST_OPS else node.inputs
        return [x for x in data if not isinstance(x, gs.Constant)]

    return [presents[id(t)] for t, _ in walk([tensor], step, _WALK_LIMIT) if id(t) in presents]


def _classify(graph: gs.Graph, entries: list[CacheEntry]) -> list[str]:
    """Mark each entry key or value from the attention it feeds (:mod:`qnnpasses.ir.attention`):
    a key's present reaches the Q·Kᵀ MatMul, a value's the P·V MatMul of the same Softmax.
    Returns why Softmaxes that are no attention were passed over."""
    tensors = graph.tensors()
    presents = {id(tensors[e.present]): e for e in entries}
    reasons = []
    for node in graph.nodes:
        if node.op != "Softmax":
            continue
        region = find_score_region(graph, node)
        if isinstance(region, str):
            reasons.append(f"Softmax '{node.name}': {region}")
            continue
        for kind, operand in (("key", region.qk.inputs[1]), ("value", region.pv.inputs[1])):
            for entry in _cache_reached(operand, presents):
                entry.kind, entry.softmax = kind, node
    return reasons


def find_roles(graph: gs.Graph, given: dict[str, str] | None = None) -> Roles:
    """The roles of ``graph``'s inputs and outputs; BadInputError when it has no KV cache, when a
    role is ambiguous, or when structure and names disagree (``given``: roles named by the user)."""
    entries = _cache_entries(graph)
    if not entries:
        raise BadInputError("no KV cache: no float rank-4 input is concatenated into a graph output")
    reasons = _classify(graph, entries)
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    keys = [e for e in entries if e.kind == "key"]
    values = {id(e.softmax): e for e in entries if e.kind == "value"}
    if not keys or len(keys) != len(values) or len(keys) * 2 != len(entries):
        why = f"; {reasons[0]}" if reasons else ""
        raise BadInputError("KV cache inputs do not pair into key/value per layer through an attention "
                            f"({len(keys)} keys, {len(values)} values of {len(entries)} cache inputs{why})")
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
    present = {e.present for e in entries}
    given = dict(given or {})
    unknown = sorted(set(given) - set(GIVEN_ROLES))
    if unknown:
        raise BadInputError(f"--roles: unknown role {unknown[0]!r} (roles: {', '.join(GIVEN_ROLES)})")
    for role, name in given.items():
        names = [t.name for t in graph.outputs] if role == "logits" else list(inputs)
        if name not in names or name in past | present:
            raise BadInputError(f"--roles {role}={name}: the graph has no such {'output' if role == 'logits' else 'input'}")
    others = [t for t in graph.inputs if t.name not in past]
    found = _structural_roles(graph, others, past, present, given)
    if not given:
        _check_names(found, inputs)
    shape = inputs[pairs[0][0].past].shape
    logits = {t.name: t for t in graph.outputs}[found["logits"]]
    return Roles(
        input_ids=found["input_ids"], attention_mask=found["attention_mask"], position_ids=found["position_ids"],
        logits=found["logits"],
        past_key=[k.past for k, _ in pairs], past_value=[v.past for _, v in pairs],
        present_key=[k.present for k, _ in pairs], present_value=[v.present for _, v in pairs],
        seq_axis=2, kv_heads=shape[1], head_dim=shape[3],
        vocab=logits.shape[-1] if logits.shape else "?",
    )


#: the roles ``--roles`` may give; the cache's roles are always found from the graph
GIVEN_ROLES = ("input_ids", "attention_mask", "position_ids", "logits")


def _structural_roles(graph: gs.Graph, others: list[gs.Tensor], past: set[str], present: set[str],
                      given: dict[str, str]) -> dict[str, str | None]:
    """input_ids, position_ids, attention_mask and logits from what the graph does with them
    (a role in ``given`` is taken as given)."""
    by_name = {t.name: t for t in others}
    if "input_ids" in given:
        input_ids = by_name[given["input_ids"]]
        if not _tables(input_ids):
            raise BadInputError(f"--roles input_ids={input_ids.name}: that input indexes no embedding table")
    else:
        input_ids = token_ids(graph, others)
        if input_ids is None:
            raise BadInputError("no input_ids: no integer input indexes an embedding table")
    position_ids = given.get("position_ids")
    if position_ids is not None and not _is_int(by_name[position_ids]):
        raise BadInputError(f"--roles position_ids={position_ids}: positions are an integer input")
    if "position_ids" not in given:
        position_ids = next((t.name for t in others if t is not input_ids and _is_int(t) and feeds_rotary(t)), None)
    if position_ids is None and "position_ids" not in given:
        direct = [index_input(g.inputs[1], graph) for g in rotary_gathers(graph)]
        position_ids = next((t.name for t in direct if t is not None and t is not input_ids and t.name not in past), None)
    rest = [t for t in others if t.name not in (input_ids.name, position_ids)]
    if "attention_mask" in given:
        mask = given["attention_mask"]
        if by_name[mask].shape is None or len(by_name[mask].shape) != 2:
            raise BadInputError(f"--roles attention_mask={mask}: the mask is a [batch, length] input")
    else:
        masks = [t for t in rest if t.shape is not None and len(t.shape) == 2]
        if len(masks) != 1 or len(rest) != 1:
            raise BadInputError(f"cannot tell the attention mask among inputs {[t.name for t in rest]}; "
                                "give it with --roles attention_mask=NAME")
        mask = masks[0].name
    if "logits" in given:
        logits = given["logits"]
    else:
        candidates = [t.name for t in graph.outputs if t.name not in present]
        if len(candidates) != 1:
            raise BadInputError(f"expected one output besides the KV cache, found {candidates}; "
                                "give it with --roles logits=NAME")
        logits = candidates[0]
    roles = {"input_ids": input_ids.name, "position_ids": position_ids, "attention_mask": mask, "logits": logits}
    taken = [v for v in roles.values() if v is not None]
    if len(taken) != len(set(taken)):
        raise BadInputError(f"one tensor in two roles: {roles}")
    return roles


def _check_names(found: dict[str, str | None], inputs: dict[str, gs.Tensor]) -> None:
    """Refuse when the graph's structure and its Hugging Face input names disagree on a role:
    one of the two is wrong, and a deployment with swapped inputs computes garbage quietly."""
    for role in ("input_ids", "attention_mask", "position_ids"):
        if role in inputs and found[role] != role:
            raise BadInputError(
                f"roles disagree: the graph's structure makes '{found[role]}' the {role}, but an input is "
                f"named '{role}'; check the export and give the roles with --roles {role}=NAME,...")


def _tables(tensor: gs.Tensor) -> list[gs.Constant]:
    """Float rank-2 constant tables whose rows are gathered at ``tensor``'s values (through
    Cast/Reshape-like index moves)."""
    def step(t: gs.Tensor) -> list[gs.Tensor]:
        return [out for node in t.outputs if node.inputs and node.inputs[0] is t
                and (node.op in _INDEX_MOVES or (node.op == "Concat" and len(node.inputs) == 1)) for out in node.outputs]

    found = []
    for current, _ in walk([tensor], step):
        for node in current.outputs:
            table = node.inputs[0]
            if (node.op == "Gather" and node.inputs[1] is current and int(node.attrs.get("axis", 0)) == 0
                    and isinstance(table, gs.Constant) and len(table.shape) == 2 and _is_float(table)
                    and all(t is not table for t in found)):
                found.append(table)
    return found


def _vocab_sizes(graph: gs.Graph) -> set[int]:
    """The static last dims of the float rank-3 outputs (the logits ``[batch, seq, vocab]``)."""
    return {int(t.shape[-1]) for t in graph.outputs
            if _is_float(t) and t.shape is not None and len(t.shape) == 3 and isinstance(t.shape[-1], (int, np.integer))}


def _lm_head_weights(graph: gs.Graph) -> list[gs.Tensor]:
    """Constant operands of the MatMul/Gemm nodes that compute a rank-3 float output (the lm_head)."""
    weights = []
    for out in graph.outputs:
        current = out
        for _ in range(8):
            node = current.inputs[0] if current.inputs else None
            if node is None:
                break
            if node.op in ("MatMul", "Gemm"):
                weights += [t for t in node.inputs[:2] if isinstance(t, gs.Constant)]
                break
            if node.op not in ("Identity", "Cast", "Reshape", "Add", "Mul", "Div", "Tanh", "Softcap"):
                break
            current = node.inputs[0]
    return weights


def _tied(table: gs.Constant, weights: list[gs.Tensor]) -> bool:
    """Whether the embedding ``table`` [V, d] is the lm_head's weight ([d, V], or [V, d] of a Gemm)."""
    for weight in weights:
        if weight is table:
            return True
        if tuple(weight.shape) in (tuple(table.shape), tuple(table.shape)[::-1]):
            value = np.asarray(weight.values)
            rows = np.asarray(table.values)
            if (value.shape == rows.shape and np.array_equal(value, rows)) or np.array_equal(value.T, rows):
                return True
    return False


def token_ids(graph: gs.Graph, candidates: list[gs.Tensor] | None = None) -> gs.Tensor | None:
    """The integer input that indexes the token embedding, or None.

    Several inputs can index tables (GPT-2 gathers learned positions too): the token embedding is
    the table with one row per vocabulary entry (the logits' last dim) and, where that still leaves
    several, the one tied to the lm_head.  BadInputError names the candidates when it stays ambiguous.
    """
    candidates = list(graph.inputs) if candidates is None else candidates
    indexing = {t.name: (t, _tables(t)) for t in candidates if _is_int(t)}
    indexing = {k: v for k, v in indexing.items() if v[1]}
    if len(indexing) <= 1:
        return next((t for t, _ in indexing.values()), None)
    vocab = _vocab_sizes(graph)
    sized = {k: v for k, v in indexing.items() if any(int(tab.shape[0]) in vocab for tab in v[1])}
    if len(sized) == 1:
        return next(iter(sized.values()))[0]
    weights = _lm_head_weights(graph)
    tied = {k: v for k, v in (sized or indexing).items() if any(_tied(tab, weights) for tab in v[1])}
    if len(tied) == 1:
        return next(iter(tied.values()))[0]
    names = ", ".join(f"'{k}' (table {list(v[1][0].shape)})" for k, v in indexing.items())
    raise BadInputError(f"cannot tell the token ids among inputs that index embedding tables: {names}; "
                        "give them with --roles input_ids=NAME")


def embedding_indices(candidates: list[gs.Tensor]) -> gs.Tensor | None:
    """The first integer tensor among ``candidates`` whose values index an embedding-like table."""
    return next((t for t in candidates if _is_int(t) and _tables(t)), None)


def feeds_rotary(tensor: gs.Tensor, limit: int = 16) -> bool:
    """Whether a Cos or Sin is computed from ``tensor``'s values within ``limit`` nodes (any op
    but Shape/Size, which read only its shape)."""
    def step(t: gs.Tensor) -> list[gs.Tensor]:
        return readers_outputs(t, skip=("Shape", "Size"))

    return any(n.op in ("Cos", "Sin") for t, _ in walk([tensor], step, limit) for n in t.outputs)


_INDEX_MOVES = ("Identity", "Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Expand")


def value_inputs(tensor: gs.Tensor, limit: int = 48) -> set[str]:
    """Names of the graph inputs whose *values* ``tensor`` is computed from (Shape/Size read only a
    shape and are not followed)."""
    def step(t: gs.Tensor) -> list[gs.Tensor]:
        return producer_inputs(t, skip=("Shape", "Size"))

    return {t.name for t, _ in walk([tensor], step, limit) if producer(t) is None and not isinstance(t, gs.Constant)}


def rotary_gathers(graph: gs.Graph) -> list[gs.Node]:
    """Gathers of rows (axis 0) of a float rank-2 constant table at computed or input positions whose
    values do not come from the token ids: the cos/sin tables of a rotary read at the positions (the
    embedding Gather, indexed by the token ids, is not one)."""
    ids = token_ids(graph)
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
