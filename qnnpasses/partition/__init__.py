"""CPU/HTP partitioning: which nodes run where, as which sub-models, in which order.

:func:`make_plan` assigns every node a backend (op-support table or the real backend's
verdict, plus forced CPU ops/nodes), forms cycle-free partitions (:mod:`.regions`), sends
HTP islands not worth their transfers back to the CPU (:mod:`.cost`), splits HTP
partitions over the memory budget into balanced consecutive pieces (:mod:`.memory`) and
measures each (:mod:`.plan`).  :func:`write_partitions` extracts one ONNX model per
partition (:mod:`.extract`), writes ``plan.json`` and a picture (:mod:`.picture`);
:func:`qnnpasses.partition.check.run_chain` runs them in order to prove equivalence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from qnnpasses.ir.model import IRModel
from qnnpasses.partition.assign import CPU, HTP, assign
from qnnpasses.partition.cost import CostModel, boundary_bytes, flops_of
from qnnpasses.partition.extract import extract, save_partition
from qnnpasses.partition.graph import NodeGraph, build_node_graph
from qnnpasses.partition.memory import split_by_memory
from qnnpasses.partition.plan import Partition, Plan, describe
from qnnpasses.partition.regions import form_partitions

__all__ = ["CPU", "HTP", "CostModel", "Partition", "PartitionOptions", "Plan", "make_plan", "write_partitions"]

GIB = 1 << 30
#: Rounds of island demotion (each round can only move nodes HTP -> CPU, so it ends anyway).
_MAX_ROUNDS = 20


@dataclass
class PartitionOptions:
    backend: str = "htp"
    cpu_ops: tuple[str, ...] = ()
    cpu_nodes: tuple[str, ...] = ()
    max_part_bytes: int = 2 * GIB          # 0 disables splitting
    cost: CostModel = field(default_factory=CostModel)
    keep_islands: bool = False
    #: the QNN EP options of the session that will run the plan (some table rules are its defaults)
    provider_options: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["cpu_ops"], data["cpu_nodes"] = list(self.cpu_ops), list(self.cpu_nodes)
        return data


def make_plan(ir: IRModel, options: PartitionOptions | None = None, *, placement=None,
              node_graph: NodeGraph | None = None) -> Plan:
    """The partition plan of ``ir``; ``placement`` (from ``probe_placement``) makes it follow the real backend."""
    options = options or PartitionOptions()
    ng = node_graph or build_node_graph(ir)
    assignment = assign(ng, placement=placement, cpu_ops=options.cpu_ops, cpu_nodes=options.cpu_nodes,
                        table=options.backend, provider_options=options.provider_options)
    plan = Plan(str(ir.path) if ir.path else None, options.backend, assignment.source, [],
                options=options.to_dict(), notes=list(assignment.notes))
    groups = _demote_islands(ng, assignment, options, plan)
    pieces = _apply_budget(ng, groups, options.max_part_bytes, plan)
    plan.partitions = [describe(ng, i, backend, members, assignment.reasons) for i, (backend, members) in enumerate(pieces)]
    return plan


def _demote_islands(ng: NodeGraph, assignment, options: PartitionOptions, plan: Plan) -> list[tuple[str, set[int]]]:
    for _ in range(_MAX_ROUNDS):
        groups = form_partitions(ng.dag, assignment.backend)
        if options.keep_islands or len({backend for backend, _ in groups}) < 2:
            return groups
        islands = [m for backend, m in groups
                   if backend == HTP and not options.cost.worth_it(flops_of(ng, m), boundary_bytes(ng, m))]
        if not islands:
            return groups
        for members in islands:
            flops, moved = flops_of(ng, members), boundary_bytes(ng, members)
            plan.islands_moved_to_cpu.append({
                "nodes": [ng.nodes[i].name for i in sorted(members)], "flops": flops, "boundary_bytes": moved,
                "saving_us": round(options.cost.saving_us(flops), 3), "transfer_us": round(options.cost.transfer_us(moved), 3)})
            for i in members:
                assignment.backend[i] = CPU
                assignment.reasons[i] = "HTP island smaller than its transfer cost (kept on the CPU)"
    return form_partitions(ng.dag, assignment.backend)


def _apply_budget(ng: NodeGraph, groups, budget: int, plan: Plan) -> list[tuple[str, list[int]]]:
    pieces: list[tuple[str, list[int]]] = []
    for backend, members in groups:
        if backend != HTP or budget <= 0:
            pieces.append((backend, sorted(members)))
            continue
        split = split_by_memory(ng, members, budget)
        if len(split.pieces) > 1 or not split.fits:
            plan.memory_splits.append({"pieces": len(split.pieces), "estimated_bytes": split.sizes,
                                       "budget": budget, "fits": split.fits})
        if not split.fits:
            plan.notes.append(f"an HTP partition cannot be split within {budget} bytes "
                              f"(largest piece ~{max(split.sizes)} bytes)")
        pieces.extend((HTP, piece) for piece in split.pieces)
    return pieces


def write_partitions(ir: IRModel, plan: Plan, out_dir: str | Path, *, node_graph: NodeGraph | None = None,
                     picture: bool = True) -> Path:
    """One ONNX model per partition, ``plan.json`` and the picture, into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ng = node_graph or build_node_graph(ir)
    index = ng.index_of()
    for part in plan.partitions:
        members = sorted({index[n] for n in part.nodes} | {index[n] for n in part.constant_nodes})
        sub = extract(ng, members, part.inputs, part.outputs)
        path = save_partition(sub, out / f"part{part.id:02d}_{part.backend}.onnx")
        part.file = path.name
    if picture:
        from qnnpasses.partition.picture import write_picture

        plan.options["picture"] = [p.name for p in write_picture(ng, plan, out / "partitions.svg")]
    return plan.write(out / "plan.json")
