"""Split a static graph into consecutive parts at residual-stream boundaries.

The partitioner (:mod:`qnnpasses.partition`) gives the node graph, the weight bytes each
position of the node order brings (:func:`qnnpasses.partition.memory.profiles`), the
measurement of a piece (:func:`qnnpasses.partition.plan.describe`) and its extraction as a
stand-alone model with the original tensor names on its boundary.  What it cannot know is
which cuts are residual-stream boundaries in an LLM graph: the mask and the rotary tables are
read by every layer, so they cross every cut between layers and its "fewest bytes" rule then
prefers a cut before the first layer.  Here:

1. nodes that do not depend on the token ids (mask, rotary tables, cache reshapes) are
   scheduled just before their first reader;
2. a *residual boundary* is a position in that order where exactly one tensor that depends on
   the token ids crosses the cut (the hidden state between layers, or between attention and
   MLP);
3. ``--parts K`` picks K-1 of those boundaries minimising the largest part's weight bytes;
   ``--max-part-bytes B`` the fewest parts whose weights plus peak live activations fit B.

Running the parts in order and passing tensors by name reproduces the graph.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.errors import BadInputError
from qnnpasses.ir.model import IRModel
from qnnpasses.partition import PartitionOptions, make_plan
from qnnpasses.partition.extract import extract, save_partition
from qnnpasses.partition.graph import NodeGraph, build_node_graph
from qnnpasses.partition.memory import min_max_cuts, profiles
from qnnpasses.partition.plan import Partition, describe


def schedule_off_stream_late(ir: IRModel, stream_input: str) -> set[str]:
    """Reorder the nodes that do not depend on ``stream_input`` to just before their first
    reader, keeping the order of the others; returns the names of the nodes that do."""
    graph = ir.graph
    on_stream: set[int] = set()
    for node in graph.nodes:  # topological order: producers are classified first
        if any(t.name == stream_input or (t.inputs and id(t.inputs[0]) in on_stream) for t in node.inputs):
            on_stream.add(id(node))
    emitted: set[int] = set()
    order: list[gs.Node] = []

    def emit(node: gs.Node) -> None:
        if id(node) in emitted:
            return
        emitted.add(id(node))
        for tensor in node.inputs:
            if tensor.inputs:
                emit(tensor.inputs[0])
        order.append(node)

    for node in graph.nodes:
        if id(node) in on_stream:
            emit(node)
    for node in graph.nodes:
        emit(node)
    graph.nodes = order
    return {n.name for n in graph.nodes if id(n) in on_stream}


def residual_boundaries(ng: NodeGraph, order: list[int], on_stream: set[str]) -> list[int]:
    """Positions p (1..len-1) of ``order`` where exactly one token-dependent tensor crosses."""
    position = {index: p for p, index in enumerate(order)}
    delta = np.zeros(len(order) + 1, dtype=np.int64)
    for p, index in enumerate(order):
        if ng.nodes[index].name not in on_stream:
            continue
        for name in ng.view.writes[index]:
            last = max((position[c] for c in ng.view.tensors[name].consumers if c in position), default=p)
            if last > p:
                delta[p + 1] += 1
                delta[last + 1] -= 1
    crossing = np.cumsum(delta)[: len(order)]
    return [p for p in range(1, len(order)) if crossing[p] == 1]


def _balanced(points: list[int], prefix: np.ndarray, parts: int) -> list[int]:
    """``parts - 1`` cuts among ``points`` minimising the largest piece's weight."""
    cuts, _ = min_max_cuts([0, *points, len(prefix) - 1], parts, lambda a, b: float(prefix[b] - prefix[a]))
    return cuts


def _within(points: list[int], prefix: np.ndarray, peak: np.ndarray, budget: int) -> list[int] | None:
    """The fewest cuts among ``points`` whose pieces each fit ``budget`` (greedy, latest fitting cut)."""
    def size(a: int, b: int) -> int:
        return int(prefix[b] - prefix[a] + peak[a:b].max())

    cuts, start, end = [], 0, len(peak)
    while True:
        if size(start, end) <= budget:
            return cuts
        fitting = [p for p in points if p > start and size(start, p) <= budget]
        if not fitting:
            return None
        start = fitting[-1]
        cuts.append(start)


def plan_parts(ir: IRModel, stream_input: str, *, parts: int | None = None,
               max_part_bytes: int | None = None) -> tuple[NodeGraph, list[Partition]]:
    """The parts of ``ir`` (all on the HTP), measured, in run order."""
    on_stream = schedule_off_stream_late(ir, stream_input)
    ng = build_node_graph(ir)
    whole = make_plan(ir, PartitionOptions(max_part_bytes=0), node_graph=ng)
    if len(whole.partitions) != 1 or whole.partitions[0].backend != "htp":
        raise BadInputError("the graph is not one HTP partition by the op-support table; cannot split it into parts")
    order = sorted(whole.partitions[0].indices)
    weights, _, peak = profiles(ng, order)
    prefix = np.concatenate([[0], np.cumsum(weights)])
    points = residual_boundaries(ng, order, on_stream)
    if max_part_bytes is not None:
        cuts = _within(points, prefix, peak, max_part_bytes)
        if cuts is None:
            largest = max(int(prefix[b] - prefix[a]) for a, b in pairwise([0, *points, len(order)]))
            raise BadInputError(f"--max-part-bytes {max_part_bytes}: a part between residual-stream boundaries "
                                f"needs more (its weights alone: up to {largest:,} bytes)")
    else:
        if parts - 1 > len(points):
            raise BadInputError(f"--parts {parts}: the graph has only {len(points) + 1} residual-stream segments")
        cuts = _balanced(points, prefix, parts) if parts > 1 else []
    pieces = [order[a:b] for a, b in pairwise([0, *cuts, len(order)])]
    return ng, [describe(ng, i, "htp", piece, {}) for i, piece in enumerate(pieces)]


def write_parts(ir: IRModel, out_dir: Path, stem: str, stream_input: str, *, parts: int | None = None,
                max_part_bytes: int | None = None) -> list[dict[str, Any]]:
    """Write ``stem.partN.onnx`` files; returns the manifest's part entries (onnx, inputs, outputs)."""
    ng, pieces = plan_parts(ir, stream_input, parts=parts, max_part_bytes=max_part_bytes)
    index = ng.index_of()
    entries = []
    for number, part in enumerate(pieces):
        members = sorted({index[n] for n in part.nodes} | {index[n] for n in part.constant_nodes})
        sub = extract(ng, members, part.inputs, part.outputs)
        path = save_partition(sub, out_dir / f"{stem}.part{number}.onnx")
        entries.append({"onnx": path.name, "compiled": None, "inputs": list(part.inputs), "outputs": list(part.outputs),
                        "weight_bytes": part.weight_bytes})
    return entries
