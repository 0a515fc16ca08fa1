"""expose-positions: rotary positions computed in the graph -> a ``position_ids`` input.

Matches either form of a rotary whose positions the graph computes instead of reading an input:

* Cos/Sin (the rotary tables) computed, through float ops, from a ``Cast(int -> float)`` of an
  integer tensor that is not a graph input: HF exports without a ``position_ids`` input derive
  the positions as ``arange(past_len, past_len + seq)``;
* rows of a constant cos/sin table gathered (``roles.rotary_gathers``) at computed indices: a
  lowered onnxruntime-genai ``GroupQueryAttention`` derives them from the attention mask
  (``ReduceSum(mask) - 1`` = ``seqlens_k``, positions ``seqlens_k + 1 - S + i``).

Skipped when an integer graph input already feeds the rotary.

Produces: a new graph input ``position_ids`` with the shape of the token-id input (the integer
input indexing the embedding; ``[batch, seq]``), int64; each matched Cast (or table Gather)
reads ``Reshape(position_ids, Shape(X))`` instead of ``X``; what computed ``X`` from the mask
or the past length is then dead (only its shape is read, which ``simplify`` folds once static).  Only the rotary reads the new input: the
causal mask keeps its own positions (past_len + i), which is what a static cache of fixed
length P needs (new tokens at key slots P..P+S-1, invalid slots removed by the mask).

Why it is safe: with ``position_ids = arange(past_len, past_len + seq)`` (one row per batch
entry; for the mask-derived form, with an all-ones mask, exactly what ``seqlens_k + 1 - S + i``
is) the graph computes exactly what it did.  With a padded mask the derived positions would
be wrong (they count the valid entries, not the slots), which is why a static cache needs the
input.  It changes the interface on purpose: a
static-cache runner passes absolute positions that differ from the (fixed) past length.

Verification: the outputs before and after are not the same tensors (not a rename), so the
manager's ``--verify`` cannot compare them; ``qnnpasses llm`` checks the finished pair against
the original export instead (a chunked prompt with padding, then decode steps).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.model import IRModel
from qnnpasses.ir.kv_roles import embedding_indices, feeds_rotary, index_input, rotary_gathers
from qnnpasses.passmanager.api import Pass, PassContext, PassResult, changes_interface, register_pass
from qnnpasses.passmanager.rewrite import emit, finish, is_graph_input

_FLOAT_KINDS = "f"


def _kind(tensor: gs.Tensor) -> str:
    try:
        return np.dtype(tensor.dtype).kind if tensor.dtype is not None else "?"
    except TypeError:
        return "?"


def rotary_position_casts(graph: gs.Graph, limit: int = 24) -> list[gs.Node]:
    """The Cast(int -> float) nodes from which the graph's Cos/Sin are computed."""
    casts, seen = [], set()
    queue = deque((n.inputs[0], 0) for n in graph.nodes if n.op in ("Cos", "Sin"))
    while queue:
        tensor, depth = queue.popleft()
        node = tensor.inputs[0] if tensor.inputs else None
        if node is None or id(node) in seen or depth > limit:
            continue
        seen.add(id(node))
        if node.op == "Cast" and _kind(node.inputs[0]) in "iu" and _kind(node.outputs[0]) in _FLOAT_KINDS:
            casts.append(node)
            continue
        queue.extend((t, depth + 1) for t in node.inputs if not isinstance(t, gs.Constant) and _kind(t) in _FLOAT_KINDS)
    return casts


@register_pass
class ExposePositions(Pass):
    name = "expose-positions"
    summary = "rotary positions derived from the past length or the mask -> a position_ids graph input"
    lossless = False  # the outputs now depend on a new input
    contract = changes_interface("adds a position_ids input that the rotary reads")

    @dataclass
    class Options:
        input_name: str = "position_ids"

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        graph = ir.graph
        if any(_kind(t) in "iu" and feeds_rotary(t) and embedding_indices([t]) is None for t in graph.inputs):
            return PassResult(changed=False, notes=["an integer graph input already feeds the rotary"])
        gathers = rotary_gathers(graph)
        if any(index_input(g.inputs[1], graph) is not None for g in gathers):
            return PassResult(changed=False, notes=["an integer graph input already indexes the rotary tables"])
        ids = embedding_indices(list(graph.inputs))
        casts = [c for c in rotary_position_casts(graph) if not is_graph_input(graph, c.inputs[0])]
        casts += [g for g in gathers if g not in casts]
        if ids is None or not casts:
            return PassResult(changed=False, notes=["no rotary computed from derived positions"])
        if any(t.name == self.options.input_name for t in graph.tensors().values()):
            return PassResult(changed=False, notes=[f"name '{self.options.input_name}' is taken"])
        positions = gs.Variable(self.options.input_name, dtype=np.int64, shape=list(ids.shape) if ids.shape else None)
        graph.inputs.append(positions)
        made: dict[int, gs.Tensor] = {}  # one Reshape per replaced tensor (cos and sin share positions)
        for node in casts:
            slot = 0 if node.op == "Cast" else 1
            old = node.inputs[slot]
            if id(old) not in made:
                source = positions
                if old.dtype is not None and np.dtype(old.dtype) != np.int64:
                    source = emit(ir, ctx, "Cast", [positions], hint="positions_cast", dtype=old.dtype,
                                  shape=positions.shape, attrs={"to": int(_onnx_type(old.dtype))})
                shape = emit(ir, ctx, "Shape", [old], hint="positions_shape", dtype=np.int64, shape=None)
                made[id(old)] = emit(ir, ctx, "Reshape", [source, shape], hint="positions", dtype=old.dtype,
                                     shape=old.shape)
            node.inputs[slot] = made[id(old)]
        finish(ir)
        gathered = sum(1 for n in casts if n.op == "Gather")
        return PassResult(changed=True, stats={"casts_rewired": len(casts) - gathered, "gathers_rewired": gathered})


def _onnx_type(dtype) -> int:
    from onnx import helper

    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
