"""rotary-table: rotary cos/sin computed from integer positions => rows gathered from a table.

Matches every ``Cos``/``Sin`` whose value depends on exactly one non-constant tensor, an
integer graph input (the positions): HF exports compute the rotary embedding on the fly as
``Cos(Concat(f, f))`` with ``f = Cast(position_ids) * inv_freq`` (a ``MatMul`` or ``Mul``
with the inverse frequencies), times an attention scaling.  Requires static shapes and an
output shaped ``positions.shape + [d]`` (one row of ``d`` values per position).

Produces, for every position ``p < positions`` (the option: the context length of a static
KV cache, the largest position + 1), the rows the original subgraph computes, evaluated once
on onnxruntime CPU in the graph's float type, and replaces each ``Cos``/``Sin`` output by
``Gather(table[positions, d], position_ids, axis=0)``; the angle arithmetic is then dead.

Why: on the HTP in fp16 the angle ``p * inv_freq`` is rounded to 11 significant bits before
its cosine is taken.  At position ``p`` the angle is off by up to ``p * 2^-12`` radians
(0.03 at p = 127, 0.5 at p = 2047): the phase of every rotated query and key drifts with
the position, and attention scores with it.  A table row stores cos/sin themselves, off by at
most half an fp16 step of a value in [-1, 1] (2.4e-4), at every position.

Why it is safe: each row is what the original subgraph computes for that position (same
ops, same float type, onnxruntime CPU), so for positions below ``positions`` the outputs
are the original's bit for bit.  That each output row depends only on its own position is
checked, not assumed: the subgraph is also evaluated on the positions in reverse order and
must give the same rows, else nothing is rewritten.  A position at or beyond ``positions``
has no row: the contract assumes positions in ``[0, positions)``, which a static cache of that
many slots guarantees (``qnnpasses llm`` sets it to the context length).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.evaluate import subgraph_session
from qnnpasses.ir.graph_ops import toposort
from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import (
    CASE_EXTREME,
    CASE_GIVEN,
    CASE_MASKED,
    CASE_PADDED_LEFT,
    CASE_PADDED_RIGHT,
    CASE_RANDOM,
    FOLDED,
    Pass,
    PassContext,
    PassResult,
    assumes,
    register_pass,
)
from qnnpasses.passmanager.rewrite import finish, make_constant, static_shape

#: Tables larger than this are not built (a 128k context with d = 128 in fp32 is 64 MiB).
MAX_TABLE_BYTES = 64 * 2**20
_TRIG = ("Cos", "Sin")


@dataclass
class _Cone:
    """The nodes computing some Cos/Sin outputs from one integer input."""

    positions: gs.Variable
    nodes: list[gs.Node] = field(default_factory=list)
    trig: list[gs.Node] = field(default_factory=list)


def _cone(node: gs.Node, graph_inputs: set[int]) -> tuple[gs.Variable | None, list[gs.Node]]:
    """The graph input ``node`` depends on (None unless exactly one, integer) and the nodes between."""
    found: dict[int, gs.Variable] = {}
    seen: dict[int, gs.Node] = {}
    todo = [node]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        if current.op in ("If", "Loop", "Scan") or current.op.startswith("Random"):
            return None, []
        seen[id(current)] = current
        for tensor in current.inputs:
            if isinstance(tensor, gs.Constant) or not tensor.name:
                continue
            if id(tensor) in graph_inputs:
                found[id(tensor)] = tensor
            elif tensor.inputs:
                todo.append(tensor.inputs[0])
            else:
                return None, []  # a tensor nothing produces: not a cone we can evaluate
        if len(found) > 1:
            return None, []
    if len(found) != 1:
        return None, []
    (positions,) = found.values()
    if positions.dtype is None or np.dtype(positions.dtype).kind not in "iu":
        return None, []
    return positions, list(seen.values())


def find_cones(graph: gs.Graph) -> list[_Cone]:
    graph_inputs = {id(t) for t in graph.inputs}
    cones: dict[int, _Cone] = {}
    for node in graph.nodes:
        if node.op not in _TRIG:
            continue
        positions, nodes = _cone(node, graph_inputs)
        if positions is None:
            continue
        cone = cones.setdefault(id(positions), _Cone(positions))
        known = {id(n) for n in cone.nodes}
        cone.nodes += [n for n in nodes if id(n) not in known]
        cone.trig.append(node)
    return list(cones.values())


def tables(graph: gs.Graph, cone: _Cone, positions: int) -> tuple[list[np.ndarray] | None, str]:
    """One ``[positions, d]`` table per Cos/Sin of ``cone``, or why not."""
    shape = static_shape(cone.positions)
    outs = [static_shape(n.outputs[0]) for n in cone.trig]
    if shape is None or any(o is None for o in outs):
        return None, "shapes not static"
    if any(o[:-1] != shape for o in outs):
        return None, f"outputs {outs} are not one row per position of {list(shape)}"
    width = math.prod(shape)
    if width == 0:
        return None, "no positions"
    itemsize = max(np.dtype(n.outputs[0].dtype or np.float32).itemsize for n in cone.trig)
    if positions * max(o[-1] for o in outs) * itemsize * len(outs) > MAX_TABLE_BYTES:
        return None, f"tables for {positions} positions would exceed {MAX_TABLE_BYTES} bytes"
    session = subgraph_session(graph, cone.nodes, [cone.positions], [n.outputs[0] for n in cone.trig], "rotary_table")
    dtype = np.dtype(cone.positions.dtype)
    rows: list[list[np.ndarray]] = [[] for _ in outs]
    for start in range(0, positions, width):
        ids = np.minimum(np.arange(start, start + width), positions - 1)
        got = session.run(None, {cone.positions.name: ids.astype(dtype).reshape(shape)})
        for k, value in enumerate(got):
            rows[k].append(value.reshape(width, -1)[: min(width, positions - start)])
    result = [np.ascontiguousarray(np.concatenate(r)) for r in rows]
    # each row must depend on its own position only: the same rows for positions in another order
    probe = np.arange(min(width, positions))[::-1]
    ids = np.concatenate([probe, np.full(width - len(probe), probe[0])])
    got = session.run(None, {cone.positions.name: ids.astype(dtype).reshape(shape)})
    for table, value in zip(result, got):
        if not np.array_equal(value.reshape(width, -1), table[ids], equal_nan=True):
            return None, "an output row depends on more than its own position"
    return result, ""


@register_pass
class RotaryTable(Pass):
    name = "rotary-table"
    summary = "rotary Cos/Sin computed from integer positions => Gather from a [positions, d] table (no angle rounded in fp16)"
    contract = assumes("every position is in [0, positions)",
                       holds_on=(CASE_RANDOM, CASE_PADDED_RIGHT, CASE_PADDED_LEFT, CASE_MASKED, CASE_EXTREME,
                                 CASE_GIVEN))
    requires = frozenset({FOLDED})

    @dataclass
    class Options:
        positions: int = field(default=0, metadata={
            "help": "rows per table: the largest position + 1 (a static KV cache's context length); 0 skips"})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        positions = int(self.options.positions)
        if positions <= 0:
            return PassResult(changed=False, notes=["positions=0: give rotary-table{positions=N} (the context length)"])
        graph = ir.graph
        toposort(graph)
        replaced, notes = 0, []
        for cone in find_cones(graph):
            values, why = tables(graph, cone, positions)
            if values is None:
                notes.append(f"{cone.positions.name}: {why}")
                continue
            for node, table in zip(cone.trig, values):
                constant = make_constant(ir, ctx, f"rotary_{node.op.lower()}_table", table)
                node.op, node.attrs = "Gather", {"axis": 0}  # its output keeps its name and consumers
                node.inputs.clear()
                node.inputs.extend([constant, cone.positions])
                replaced += 1
        if replaced:
            finish(ir)
        return PassResult(changed=replaced > 0, stats={"tables": replaced, "positions": positions}, notes=notes)
