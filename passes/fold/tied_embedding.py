"""tied-embedding: the token embedding read from the lm_head's weight, so a tied table is stored once.

Matches: ``Gather(E, ids)`` on axis 0 with ``E`` a constant 2-D ``[V, H]`` table, where a
``MatMul(x, W)`` of the same graph has a constant ``W`` equal to ``Eᵀ`` element for element: a
model whose input embedding and lm_head share one matrix (``tie_word_embeddings``), which the
exporters write twice (TorchScript and dynamo store the lm_head's ``Wᵀ`` as an initializer of its
own; SmolLM2, Gemma, GPT-2, Qwen2.5-0.5B, Llama-3.2-1B are tied).  Also a ``W`` of ``[H + k, V]``
whose first ``H`` rows are ``Eᵀ`` (``logits-offset``'s ``[Wᵀ; 1]``), when no ``[H, V]`` one matches.

Produces: ``Transpose(Gather(W, ids, axis=1), perm=[1, ..., r, 0])`` for the embedding lookup (``r``
the rank of ``ids``), with ``Slice`` of the first ``H`` rows after the Gather for a taller ``W``;
``E`` is no longer read and leaves the model.

Why it is safe: ``Gather(W, ids, axis=1)[h, i...] = W[h, ids[i...]] = E[ids[i...], h]`` for every
``h < H``: the same values, moved, not computed (EXACT).  On the HTP (fp16 mode) the logits are the same bits
(``tests/test_pass_tied_embedding.py``), and a trained decode graph prepares and runs as fast.

What it does not do: make the compiled context smaller.  The simulated HTP has stored the
Gather's table in the context binary on its own: a trained pair's ``.onnx`` graphs shrink by the
table's bytes, its context binaries not.  ``qnnpasses llm`` runs it on fp16 pairs for the
bundle's ``.onnx`` graphs and their weights file, not for what a device holds.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import EXACT, Pass, PassContext, PassResult, register_pass
from qnnpasses.passmanager.rewrite import (constant_rows, constant_value, emit, emit_slice, finish, replace_all_uses,
                                           static_shape)

#: the table's rows (tokens) compared with the lm_head's weight at a time (bytes)
COMPARE_BLOCK_BYTES = 64 << 20


def _matmul_weights(graph: gs.Graph) -> dict[int, list[gs.Constant]]:
    """The constant 2-D MatMul weights of the graph, by their columns (the lm_head's: the vocabulary)."""
    found: dict[int, list[gs.Constant]] = {}
    for node in graph.nodes:
        if node.op == "MatMul" and len(node.inputs) == 2 and isinstance(node.inputs[1], gs.Constant):
            shape = tuple(node.inputs[1].shape or ())
            if len(shape) == 2 and node.inputs[1] not in found.get(shape[1], []):
                found.setdefault(shape[1], []).append(node.inputs[1])
    return found


def _table_of(weights: list[gs.Constant], table: gs.Constant) -> gs.Constant | None:
    """The weight whose first ``H`` rows are the ``[V, H]`` table transposed; an exact ``[H, V]`` one first."""
    hidden = table.shape[1]
    values = None
    for weight in sorted(weights, key=lambda w: w.shape[0] != hidden):
        if weight.shape[0] < hidden or np.dtype(weight.dtype) != np.dtype(table.dtype):
            continue
        values = constant_value(table) if values is None else values
        if _transposed_equal(constant_rows(weight, hidden), values):
            return weight
    return None


def _transposed_equal(rows: np.ndarray, table: np.ndarray) -> bool:
    """``rows == table.T``, compared a block of the table's rows (tokens) at a time: an lm_head-sized
    table is mapped, and a comparison of the whole would hold a temporary of its size (a block of
    tokens reads the table contiguously and the weight in runs of a block's width)."""
    if rows.shape != table.shape[::-1]:
        return False
    step = max(1, COMPARE_BLOCK_BYTES // max(1, rows.shape[0] * rows.itemsize))
    return all(np.array_equal(rows[:, start:start + step], table[start:start + step].T)
               for start in range(0, table.shape[0], step))


@register_pass
class TiedEmbedding(Pass):
    name = "tied-embedding"
    summary = "Gather(E) with E = lm_head weightᵀ -> Transpose(Gather(W, axis=1)): one table instead of two"
    contract = EXACT

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        graph = ir.graph
        weights = _matmul_weights(graph)
        notes, shared = [], 0
        for node in list(graph.nodes):
            if node.op != "Gather" or int(node.attrs.get("axis", 0)) != 0 or not isinstance(node.inputs[0], gs.Constant):
                continue
            table = node.inputs[0]
            if len(table.shape or ()) != 2:
                continue
            vocab, hidden = table.shape
            candidates = weights.get(vocab, [])
            if not candidates:
                continue
            ids_shape = static_shape(node.inputs[1])
            if ids_shape is None:
                notes.append(f"{node.name}: indices of unknown rank")
                continue
            match = _table_of(candidates, table)
            if match is None:
                continue
            rank = len(ids_shape)
            columns = emit(ir, ctx, "Gather", [match, node.inputs[1]], hint=f"{node.name}_tied", dtype=table.dtype,
                           shape=[match.shape[0], *ids_shape], attrs={"axis": 1})
            if match.shape[0] != hidden:  # [Wᵀ; extra rows]: the table's rows are the first H
                columns = emit_slice(ir, ctx, columns, [0], [hidden], [0], [1], [hidden, *ids_shape],
                                     hint=f"{node.name}_table_rows")
            rows = emit(ir, ctx, "Transpose", [columns], hint=f"{node.name}_rows", dtype=table.dtype,
                        shape=[*ids_shape, hidden], attrs={"perm": [*range(1, rank + 1), 0]})
            replace_all_uses(graph, node.outputs[0], rows)  # the Gather of E is left unread: finish drops it
            shared += 1
            notes.append(f"{node.name} reads {match.name} (the lm_head's weight) instead of {table.name}")
        if not shared:
            return PassResult(changed=False, notes=notes)
        finish(ir)
        return PassResult(changed=True, stats={"tables": shared}, notes=notes)
