"""Which backend each node goes to: HTP when it is supported there, else the CPU.

The verdict comes from the measured op-support table (:mod:`qnnpasses.op_support.checker`)
or, with ``real``, from the QNN EP itself (:func:`qnnpasses.backends.htp.probe_placement`, run with
onnxruntime's graph optimizations off so that the nodes it judges are the graph's own);
a node the backend did not report on keeps the table's verdict.  ``cpu_ops`` and
``cpu_nodes`` force nodes onto the CPU: progressive offload of an op that is supported
but wrong or slow on the HTP.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qnnpasses.errors import BadInputError
from qnnpasses.partition.graph import NodeGraph

HTP, CPU = "htp", "cpu"


@dataclass
class Assignment:
    backend: dict[int, str]                          # node index -> "htp" | "cpu" (constant nodes absent)
    reasons: dict[int, str] = field(default_factory=dict)  # why a node is on the CPU
    source: str = "table"
    notes: list[str] = field(default_factory=list)


def assign(ng: NodeGraph, *, placement=None, cpu_ops=(), cpu_nodes=(), table: str = "htp",
           provider_options: dict[str, str] | None = None) -> Assignment:
    """Backend per (non-constant) node; ``placement`` is a :class:`qnnpasses.backends.htp.Placement`;
    ``provider_options`` those of the session that will run the graph."""
    from qnnpasses.op_support.checker import check_graph

    results = check_graph(ng.ir.graph, table, provider_options=provider_options)
    result = Assignment({}, source="real" if placement is not None else "table")
    for index in ng.dag.nodes:
        verdict = results[index]
        backend, reason = (HTP, "") if verdict.supported else (CPU, "; ".join(verdict.reasons))
        if placement is not None:
            real, real_reason = placement.node_verdict(ng.nodes[index].name)
            if real in (HTP, CPU):
                backend, reason = real, real_reason if real == CPU else ""
        result.backend[index] = backend
        if backend == CPU:
            result.reasons[index] = reason or "not supported on the HTP"
    _force_cpu(ng, result, set(cpu_ops), set(cpu_nodes))
    return result


def _force_cpu(ng: NodeGraph, result: Assignment, ops: set[str], names: set[str]) -> None:
    index = ng.index_of()
    unknown = sorted(n for n in names if n not in index)
    if unknown:
        raise BadInputError(f"--cpu-nodes names nodes that are not in the model: {', '.join(unknown[:5])}")
    present = {ng.nodes[i].op for i in result.backend}
    for op in sorted(ops - present):
        result.notes.append(f"--cpu-ops {op}: no such node in the model")
    for i in result.backend:
        node = ng.nodes[i]
        if node.op in ops or node.name in names:
            result.backend[i] = CPU
            result.reasons[i] = "forced onto the CPU (--cpu-ops/--cpu-nodes)"
