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

In a quantized (QDQ) graph a cut never falls inside a Q/DQ pair: the HTP runs a quantized op
as a node unit ``DQ -> op -> Q``, and a part that received a DequantizeLinear's float output
would run its readers unquantized.  So every DequantizeLinear of an activation first gets one
reader of its own (what onnxruntime does itself when it builds node units: the same
arithmetic), is scheduled just before that reader, and a boundary whose crossing tensor a
QuantizeLinear reads or a DequantizeLinear writes is no boundary: the parts pass the 16-bit
(or 8-bit) tensors between a Q and its DQs, as the graph-boundary Q/DQ of a quantized pair do.

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
from qnnpasses.ir.read import is_constant
from qnnpasses.partition import PartitionOptions, make_plan
from qnnpasses.partition.extract import extract, save_partition
from qnnpasses.partition.graph import NodeGraph, build_node_graph
from qnnpasses.partition.memory import min_max_cuts, profiles
from qnnpasses.partition.plan import Partition, describe


def _dequantizes_activation(node: gs.Node) -> bool:
    return node.op == "DequantizeLinear" and bool(node.inputs) and not is_constant(node.inputs[0])


def dedicate_dequantize(ir: IRModel) -> int:
    """Give every DequantizeLinear of an activation one reader of its own (a copy per further
    reader, next to the original); returns the number of copies."""
    graph = ir.graph
    outputs = {id(t) for t in graph.outputs}
    order: list[gs.Node] = []
    copies = 0
    for node in graph.nodes:
        order.append(node)
        if not _dequantizes_activation(node) or id(node.outputs[0]) in outputs:
            continue
        value = node.outputs[0]
        readers = list({id(r): r for r in value.outputs}.values())
        for number, reader in enumerate(readers[1:], start=1):
            own = gs.Variable(f"{value.name}_r{number}", dtype=value.dtype, shape=value.shape)
            order.append(gs.Node("DequantizeLinear", f"{node.name}_r{number}", dict(node.attrs),
                                 inputs=list(node.inputs), outputs=[own], domain=node.domain))
            for slot, tensor in enumerate(reader.inputs):  # in place: the tensors' reader lists follow
                if tensor is value:
                    reader.inputs[slot] = own
            copies += 1
    graph.nodes = order
    return copies


def schedule_off_stream_late(ir: IRModel, stream_input: str) -> set[str]:
    """Reorder the nodes that do not depend on ``stream_input``, and the DequantizeLinear nodes
    of activations, to just before their first reader, keeping the order of the others;
    returns the names of the nodes that depend on ``stream_input``."""
    graph = ir.graph
    on_stream: set[int] = set()
    for node in graph.nodes:  # topological order: producers are classified first
        if any(t.name == stream_input or (t.inputs and id(t.inputs[0]) in on_stream) for t in node.inputs):
            on_stream.add(id(node))
    late = {id(n) for n in graph.nodes if id(n) not in on_stream or _dequantizes_activation(n)}
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
        if id(node) not in late:
            emit(node)
    for node in graph.nodes:
        emit(node)
    graph.nodes = order
    return {n.name for n in graph.nodes if id(n) in on_stream}


def residual_boundaries(ng: NodeGraph, order: list[int], on_stream: set[str]) -> list[int]:
    """Positions p (1..len-1) of ``order`` where exactly one token-dependent tensor crosses and
    no tensor inside a Q/DQ pair does."""
    position = {index: p for p, index in enumerate(order)}
    delta = np.zeros(len(order) + 1, dtype=np.int64)
    inside = np.zeros(len(order) + 1, dtype=np.int64)
    for p, index in enumerate(order):
        for name in ng.view.writes[index]:
            readers = [c for c in ng.view.tensors[name].consumers if c in position]
            last = max((position[c] for c in readers), default=p)
            if last <= p:
                continue
            if ng.nodes[index].op == "DequantizeLinear" or any(ng.nodes[c].op == "QuantizeLinear" for c in readers):
                inside[p + 1] += 1
                inside[last + 1] -= 1
            if ng.nodes[index].name in on_stream:
                delta[p + 1] += 1
                delta[last + 1] -= 1
    crossing, split_pair = np.cumsum(delta)[: len(order)], np.cumsum(inside)[: len(order)]
    return [p for p in range(1, len(order)) if crossing[p] == 1 and split_pair[p] == 0]


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


def residual_order(ir: IRModel, stream_input: str,
                   provider_options: dict[str, str] | None = None) -> tuple[NodeGraph, list[int], list[int]]:
    """``ir``'s node graph, its run order (node indices, off-stream nodes late) and the residual
    boundaries in that order.  ``ir`` is rescheduled in place; it must be one HTP partition in a
    session with ``provider_options``."""
    dedicate_dequantize(ir)
    on_stream = schedule_off_stream_late(ir, stream_input)
    ng = build_node_graph(ir)
    whole = make_plan(ir, PartitionOptions(max_part_bytes=0, provider_options=dict(provider_options or {})),
                      node_graph=ng)
    if len(whole.partitions) != 1 or whole.partitions[0].backend != "htp":
        raise BadInputError("the graph is not one HTP partition by the op-support table; cannot split it into parts")
    order = sorted(whole.partitions[0].indices)
    return ng, order, residual_boundaries(ng, order, on_stream)


def extract_part(ng: NodeGraph, part: Partition) -> IRModel:
    """A part (consecutive nodes of a run order, :func:`describe`'d) as a stand-alone model with
    the original tensor names on its boundary."""
    index = ng.index_of()
    members = sorted({index[n] for n in part.nodes} | {index[n] for n in part.constant_nodes})
    return extract(ng, members, part.inputs, part.outputs)


def plan_parts(ir: IRModel, stream_input: str, *, parts: int | None = None, max_part_bytes: int | None = None,
               provider_options: dict[str, str] | None = None) -> tuple[NodeGraph, list[Partition]]:
    """The parts of ``ir`` (all on the HTP in a session with ``provider_options``), measured, in run order."""
    ng, order, points = residual_order(ir, stream_input, provider_options)
    weights, _, peak = profiles(ng, order)
    prefix = np.concatenate([[0], np.cumsum(weights)])
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
                max_part_bytes: int | None = None, provider_options: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Write ``stem.partN.onnx`` files; returns the manifest's part entries (onnx, inputs, outputs)."""
    ng, pieces = plan_parts(ir, stream_input, parts=parts, max_part_bytes=max_part_bytes,
                            provider_options=provider_options)
    entries = []
    for number, part in enumerate(pieces):
        path = save_partition(extract_part(ng, part), out_dir / f"{stem}.part{number}.onnx")
        entries.append({"onnx": path.name, "compiled": None, "inputs": list(part.inputs), "outputs": list(part.outputs),
                        "weight_bytes": part.weight_bytes})
    return entries
