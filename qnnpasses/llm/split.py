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

from qnnpasses.errors import BadInputError
from qnnpasses.ir.model import IRModel
from qnnpasses.partition import PartitionOptions, make_plan
from qnnpasses.partition.extract import extract, save_partition
from qnnpasses.partition.graph import build_node_graph


def _plan(ir: IRModel, ng, budget: int):
    return make_plan(ir, PartitionOptions(max_part_bytes=budget), node_graph=ng)


def plan_parts(ir: IRModel, *, parts: int | None = None, max_part_bytes: int | None = None):
    """The partition plan for ``parts`` pieces or a ``max_part_bytes`` budget (all on the HTP)."""
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


def write_parts(ir: IRModel, out_dir: Path, stem: str, *, parts: int | None = None,
                max_part_bytes: int | None = None) -> list[dict[str, Any]]:
    """Write ``stem.partN.onnx`` files; returns the manifest's part entries (onnx, inputs, outputs)."""
    ng, plan = plan_parts(ir, parts=parts, max_part_bytes=max_part_bytes)
    index = ng.index_of()
    entries = []
    for number, part in enumerate(plan.partitions):
        members = sorted({index[n] for n in part.nodes} | {index[n] for n in part.constant_nodes})
        sub = extract(ng, members, part.inputs, part.outputs)
        path = save_partition(sub, out_dir / f"{stem}.part{number}.onnx", external_data=False)
        entries.append({"onnx": path.name, "compiled": None, "inputs": list(part.inputs), "outputs": list(part.outputs),
                        "weight_bytes": part.weight_bytes})
    return entries
