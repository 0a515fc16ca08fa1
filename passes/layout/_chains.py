"""layout family ``chains``: replace a chain of data-movement ops by the cheapest equivalent.

Matches a linear chain ``x -> op1 -> ... -> opN -> y`` of Reshape / Flatten / Squeeze /
Unsqueeze / Transpose / Expand / Slice / Gather / GatherND / Tile / Identity nodes whose
other inputs are constants and whose intermediate results have no other reader, with
static shapes.  Produces the cheapest op sequence with the same index map
(``_layout_index``, ``_layout_forms``): nothing (identity Reshape/Transpose/Expand/Slice,
Squeeze-Unsqueeze pairs, inverse Transposes, Reshape->Transpose->Reshape identities), one
Reshape (Reshape chains, Transposes that only move size-1 axes, Gathers of ``arange``),
one Transpose (merged Transposes), one Slice, or one Gather (Unsqueeze->Expand->Reshape,
i.e. GQA's repeat_kv, becomes a Gather with constant indices; a Gather never copies
single elements, so a Transpose stays a Transpose).  When the whole chain cannot be
improved, its contiguous sub-chains are tried.

Safe because the replacement's index map is verified element by element against the
chain's: the output is bit-identical for any input.
"""

from __future__ import annotations

import copy

import onnx_graphsurgeon as gs
from qnnpasses.passes.layout._forms import Form, cheapest_form

from qnnpasses.ir.index_map import MOVERS, index_map
from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import PassContext
from qnnpasses.passmanager.rewrite import (
    emit_gather,
    emit_reshape,
    emit_slice,
    emit_transpose,
    input_value,
    is_constant,
    node_key,
    replace_all_uses,
    single_consumer,
    static_shape,
)

#: Longest chain considered (its sub-chains are all simulated when it cannot be improved whole).
MAX_CHAIN = 8
#: Movers the HTP cannot run weigh more, so an equal-length replacement still wins.
EXTRA_COST = {"GatherND": 2}


def _is_mover(node: gs.Node) -> bool:
    """A data-movement node whose only variable input is its first (data) input."""
    if node.op not in MOVERS or node.domain not in ("", "ai.onnx", None) or len(node.outputs) != 1:
        return False
    if not node.inputs or is_constant(node.inputs[0]):
        return False
    return all(not t.name or is_constant(t) for t in node.inputs[1:])


def _chain_from(graph: gs.Graph, start: gs.Node) -> list[gs.Node]:
    chain = [start]
    while len(chain) < MAX_CHAIN:
        nxt = single_consumer(chain[-1].outputs[0], graph)
        if nxt is None or not _is_mover(nxt) or nxt.inputs[0] is not chain[-1].outputs[0]:
            break
        chain.append(nxt)
    return chain


def _is_chain_start(graph: gs.Graph, node: gs.Node) -> bool:
    src = node.inputs[0]
    prev = src.inputs[0] if src.inputs else None
    return prev is None or not _is_mover(prev) or single_consumer(src, graph) is not node


def find_chains(graph: gs.Graph) -> list[list[gs.Node]]:
    return [_chain_from(graph, n) for n in list(graph.nodes) if _is_mover(n) and _is_chain_start(graph, n)]


def _cost(chain: list[gs.Node]) -> int:
    return sum(1 + EXTRA_COST.get(n.op, 0) for n in chain)


def improve(chain: list[gs.Node], opset: int, memo: dict | None = None) -> Form | None:
    """The cheapest replacement of the whole ``chain`` if it saves an op.

    The answer depends only on the chain's nodes (:func:`node_key`) and end shapes: ``memo``
    keeps it per such signature (an LLM repeats each chain once per layer).
    """
    x_shape, y_shape = static_shape(chain[0].inputs[0]), static_shape(chain[-1].outputs[0])
    if x_shape is None or y_shape is None:
        return None
    key = None
    if memo is not None:
        nodes = tuple(node_key(n) for n in chain)
        key = None if None in nodes else (opset, x_shape, y_shape, nodes)
    if key is not None and key in memo:
        return copy.deepcopy(memo[key])  # the emitted constants must not share index arrays
    values = [[input_value(n, i) for i in range(max(len(n.inputs), 5))] for n in chain]
    index = index_map(chain, x_shape, values, opset)
    form = None if index is None or tuple(index.shape) != y_shape else cheapest_form(index, x_shape, _cost(chain))
    if key is not None:
        memo[key] = form
    return form


def emit_form(ir: IRModel, ctx: PassContext, x: gs.Tensor, form: Form, hint: str) -> gs.Tensor:
    """Append the nodes of ``form`` applied to ``x``; returns the result."""
    for op, p in form.steps:
        if op == "Reshape":
            x = emit_reshape(ir, ctx, x, p["shape"], hint=f"{hint}_reshape")
        elif op == "Transpose":
            x = emit_transpose(ir, ctx, x, p["perm"], p["shape"], hint=f"{hint}_transpose")
        elif op == "Slice":
            x = emit_slice(ir, ctx, x, p["starts"], p["ends"], p["axes"], p["steps"], p["shape"], hint=f"{hint}_slice")
        elif op == "Gather":
            x = emit_gather(ir, ctx, x, p["axis"], p["indices"], p["shape"], hint=f"{hint}_gather")
    return x


def _replace(ir: IRModel, ctx: PassContext, chain: list[gs.Node], form: Form) -> None:
    x, y = chain[0].inputs[0], chain[-1].outputs[0]
    new = emit_form(ir, ctx, x, form, hint=chain[-1].name or "chain")
    replace_all_uses(ir.graph, y, new, via_identity=True)
    for node in chain:
        node.inputs.clear()
        node.outputs.clear()


def _best_sub_chain(chain: list[gs.Node], opset: int, memo: dict) -> tuple[list[gs.Node], Form] | None:
    """The contiguous sub-chain whose replacement saves the most ops (then: smallest index tables)."""
    best, best_key = None, None
    for length in range(len(chain), 0, -1):
        for start in range(len(chain) - length + 1):
            sub = chain[start:start + length]
            form = improve(sub, opset, memo)
            if form is None:
                continue
            key = (_cost(sub) - form.cost, -form.gathered, length)
            if best_key is None or key > best_key:
                best, best_key = (sub, form), key
    return best


def rewrite_chains(ir: IRModel, ctx: PassContext, stats: dict, notes: list) -> int:
    """One sweep over all chains; returns how many were replaced."""
    done = 0
    memo: dict = {}
    for chain in find_chains(ir.graph):
        if any(not n.outputs for n in chain):  # touched by an earlier replacement in this sweep
            continue
        found = _best_sub_chain(chain, ir.opset, memo)
        if found is None:
            continue
        sub, form = found
        _replace(ir, ctx, sub, form)
        key = f"chains_to_{form.kind}"
        stats[key] = stats.get(key, 0) + 1
        stats["chains_ops_removed"] = stats.get("chains_ops_removed", 0) + len(sub) - form.cost
        if ctx.verbose:
            notes.append(f"chains: {'->'.join(n.op for n in sub)} ({sub[0].name}) => {form.kind} "
                         f"[{'->'.join(op for op, _ in form.steps) or 'nothing'}]")
        done += 1
    return done
