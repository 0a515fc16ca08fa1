"""The partition plan: what runs where, in which order, and what it costs.

``plan.json`` lists the partitions in execution order; each names its backend, nodes,
boundary tensors (inputs/outputs by their model names), weight bytes, estimated FLOPs,
boundary bytes and estimated peak activation bytes, and the file of its sub-model.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qnnpasses.analysis.graph import layer_sort_key
from qnnpasses.partition.cost import boundary, flops_of
from qnnpasses.partition.graph import NodeGraph
from qnnpasses.partition.memory import profiles

PLAN_VERSION = 1


@dataclass
class Partition:
    id: int
    backend: str
    nodes: list[str]
    constant_nodes: list[str]
    inputs: list[str]
    outputs: list[str]
    weight_bytes: int
    flops: int
    boundary_bytes: dict[str, int]
    peak_activation_bytes: int
    layers: list[str]
    op_types: dict[str, int]
    cpu_reasons: dict[str, str] = field(default_factory=dict)   # op type -> first reason (CPU partitions)
    file: str | None = None
    indices: list[int] = field(default_factory=list, repr=False)   # node indices (not serialised)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("indices")
        return data


@dataclass
class Plan:
    model: str | None
    backend: str
    source: str                      # "table" or "real"
    partitions: list[Partition]
    options: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    islands_moved_to_cpu: list[dict[str, Any]] = field(default_factory=list)
    memory_splits: list[dict[str, Any]] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return dict(Counter(p.backend for p in self.partitions))

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PLAN_VERSION, "model": self.model, "backend": self.backend, "source": self.source,
            "options": self.options, "counts": self.counts(),
            "partitions": [p.to_dict() for p in self.partitions],
            "islands_moved_to_cpu": self.islands_moved_to_cpu, "memory_splits": self.memory_splits,
            "notes": self.notes,
        }

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path


def describe(ng: NodeGraph, pid: int, backend: str, members: list[int], reasons: dict[int, str]) -> Partition:
    """Measure one partition (members in topological order)."""
    member_set = set(members)
    constants = sorted(ng.constant_closure(member_set))
    inputs, outputs = boundary(ng, member_set)
    _, _, peak_at = profiles(ng, members)
    layers = sorted({ng.view.layers[i] for i in members}, key=layer_sort_key)
    cpu_reasons: dict[str, str] = {}
    for i in members:
        if i in reasons:
            cpu_reasons.setdefault(ng.nodes[i].op, reasons[i])
    return Partition(
        id=pid, backend=backend,
        nodes=[ng.nodes[i].name for i in members],
        constant_nodes=[ng.nodes[i].name for i in constants],
        inputs=inputs, outputs=outputs,
        weight_bytes=ng.weight_bytes(member_set | set(constants)),
        flops=flops_of(ng, member_set),
        boundary_bytes={"in": sum(ng.tensor_bytes(n) for n in inputs), "out": sum(ng.tensor_bytes(n) for n in outputs)},
        peak_activation_bytes=int(peak_at.max()) if len(peak_at) else 0,
        layers=layers,
        op_types=dict(Counter(ng.nodes[i].op for i in members).most_common()),
        cpu_reasons=cpu_reasons if backend == "cpu" else {},
        indices=list(members),
    )


def load_plan(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
