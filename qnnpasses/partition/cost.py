"""Whether a small HTP region is worth its trip: compute saved versus data moved.

Running a region on the HTP instead of the CPU saves ``flops/cpu_rate - flops/htp_rate``
seconds and costs ``boundary_bytes/link_rate + launch`` seconds: every tensor entering or
leaving the region crosses between the CPU's and the HTP's memory (and a graph launch
has a fixed cost).  An HTP *island* — an HTP region in a model that has CPU partitions
anyway — whose saving is below its cost goes back to the CPU, where it merges with its
CPU neighbours.  FLOPs come from :mod:`qnnpasses.analysis.cost`; the default rates are a
phone-class guess (fp32 NEON CPU, fp16 HTP, shared-memory copies) and are options.
"""

from __future__ import annotations

from dataclasses import dataclass

from qnnpasses.partition.graph import NodeGraph


@dataclass(frozen=True)
class CostModel:
    cpu_gflops: float = 50.0      # sustained fp32 GFLOP/s of the CPU cores
    htp_gflops: float = 2000.0    # sustained fp16 GFLOP/s of the HTP
    link_gbps: float = 10.0       # GB/s for moving a tensor between CPU and HTP memory
    launch_us: float = 10.0       # fixed cost of one HTP graph execution, microseconds

    def saving_us(self, flops: int) -> float:
        return flops * (1.0 / self.cpu_gflops - 1.0 / self.htp_gflops) / 1e3

    def transfer_us(self, boundary_bytes: int) -> float:
        return boundary_bytes / self.link_gbps / 1e3 + self.launch_us

    def worth_it(self, flops: int, boundary_bytes: int) -> bool:
        return self.saving_us(flops) >= self.transfer_us(boundary_bytes)


def boundary(ng: NodeGraph, members: set[int]) -> tuple[list[str], list[str]]:
    """Activations a set of nodes reads from outside and writes for outside (graph I/O included).

    Reads of constant nodes' values are not boundary: each partition folds its own copy.
    """
    view = ng.view
    inputs: dict[str, None] = {}
    outputs: dict[str, None] = {}
    for index in sorted(members):
        for name in view.reads[index]:
            producer = view.tensors[name].producer
            if producer is None or (producer not in members and producer not in ng.constant):
                inputs[name] = None
        for name in view.writes[index]:
            tensor = view.tensors[name]
            if tensor.graph_output or any(c not in members and c not in ng.constant for c in tensor.consumers):
                outputs[name] = None
    return list(inputs), list(outputs)


def boundary_bytes(ng: NodeGraph, members: set[int]) -> int:
    inputs, outputs = boundary(ng, members)
    return sum(ng.tensor_bytes(n) for n in inputs + outputs)


def flops_of(ng: NodeGraph, members: set[int]) -> int:
    return sum(ng.flops[i] for i in members)
