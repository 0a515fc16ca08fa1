"""Split a static graph into consecutive parts at residual-stream boundaries.

Reuses the partitioner's memory split (:func:`qnnpasses.partition.make_plan` with a byte
budget): its cuts go where the fewest bytes cross, which in a decoder is the residual stream
between layers, and it balances the pieces.  ``--parts K`` searches the smallest budget that
gives at most K pieces; ``--max-part-bytes B`` uses B.  Each part keeps the original tensor
names on its boundary, so running the parts in order and passing tensors by name reproduces
the graph.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx_graphsurgeon as gs

from qnnpasses.errors import BadInputError
from qnnpasses.ir.model import IRModel
from qnnpasses.partition import PartitionOptions, make_plan
from qnnpasses.partition.extract import extract, save_partition
from qnnpasses.partition.graph import build_node_graph


def schedule_off_stream_late(ir: IRModel, stream_input: str) -> None:
    """Reorder the nodes that do not depend on ``stream_input`` (the token ids) -- the mask,
    the rotary tables, the cache reshapes -- to just before their first reader, keeping the
    order of every other node.

    The partitioner cuts the node order into consecutive ranges; exported graphs compute
    such nodes early (layer 1's cache reshape before layer 0), which would make them cross
    every cut.  Scheduled on demand, a cut between layers leaves only the residual stream
    and the tensors every layer reads (mask, rotary tables) crossing it.
    """
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


def _plan(ir: IRModel, ng, budget: int):
    return make_plan(ir, PartitionOptions(max_part_bytes=budget), node_graph=ng)


def plan_parts(ir: IRModel, stream_input: str, *, parts: int | None = None, max_part_bytes: int | None = None):
    """The partition plan for ``parts`` pieces or a ``max_part_bytes`` budget (all on the HTP)."""
    schedule_off_stream_late(ir, stream_input)
    ng = build_node_graph(ir)
    whole = _plan(ir, ng, 0)
    if any(p.backend != "htp" for p in whole.partitions) or len(whole.partitions) != 1:
        raise BadInputError("the graph is not one HTP partition by the op-support table; cannot split it into parts")
    if max_part_bytes is not None:
        return ng, _plan(ir, ng, max_part_bytes)
    total = whole.partitions[0].weight_bytes + whole.partitions[0].peak_activation_bytes
    low, high, best = 1, total, whole
    while low <= high:  # smallest budget giving at most `parts` pieces: balanced pieces
        middle = (low + high) // 2
        plan = _plan(ir, ng, middle)
        if len(plan.partitions) <= parts and not plan.notes:
            best, high = plan, middle - 1
        else:
            low = middle + 1
    return ng, best


def write_parts(ir: IRModel, out_dir: Path, stem: str, stream_input: str, *, parts: int | None = None,
                max_part_bytes: int | None = None) -> list[dict[str, Any]]:
    """Write ``stem.partN.onnx`` files; returns the manifest's part entries (onnx, inputs, outputs)."""
    ng, plan = plan_parts(ir, stream_input, parts=parts, max_part_bytes=max_part_bytes)
    index = ng.index_of()
    entries = []
    for number, part in enumerate(plan.partitions):
        members = sorted({index[n] for n in part.nodes} | {index[n] for n in part.constant_nodes})
        sub = extract(ng, members, part.inputs, part.outputs)
        path = save_partition(sub, out_dir / f"{stem}.part{number}.onnx", external_data=False)
        entries.append({"onnx": path.name, "compiled": None, "inputs": list(part.inputs), "outputs": list(part.outputs),
                        "weight_bytes": part.weight_bytes})
    return entries
