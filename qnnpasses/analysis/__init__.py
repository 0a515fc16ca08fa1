"""Static analysis of a model for on-device deployment: weights, activations, KV cache, op cost.

``analyze(ir)`` returns one JSON-serialisable dict with the sections ``weights``,
``activations``, ``kv_cache``, ``ops``/``op_types``/``hotspots`` and ``cost`` totals.
Nothing is executed and no weight values are read: everything follows from dtypes,
shapes and graph structure.  Each section's module states its definitions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from qnnpasses.analysis.activations import SCHEDULES, analyze_activations
from qnnpasses.analysis.cost import DEFAULT_RIDGE, analyze_cost
from qnnpasses.analysis.graph import GraphView, build_view
from qnnpasses.analysis.kv_cache import analyze_kv_cache
from qnnpasses.analysis.weights import analyze_weights
from qnnpasses.errors import BadInputError
from qnnpasses.ir.model import IRModel

__all__ = ["DEFAULT_RIDGE", "SCHEDULES", "MemoryTrace", "analyze", "run_analysis"]


@dataclass
class MemoryTrace:
    """Bytes over the chosen schedule, for plotting."""

    schedule: str
    live: np.ndarray            # bytes live at each step (freed after last use)
    allocated: np.ndarray       # bytes allocated so far when nothing is ever freed (no reuse)
    arena: int                  # arena of the reuse plan
    layers: list[str] = field(default_factory=list)  # the layer of the node run at each step
    nodes: list[str] = field(default_factory=list)   # the node run at each step


def run_analysis(ir: IRModel, context: int | None = None, *, top: int = 10, ridge: float = DEFAULT_RIDGE,
                 shapes: dict[str, list[int]] | None = None) -> tuple[dict, MemoryTrace]:
    """The analysis report and the memory trace of its chosen schedule."""
    if context is not None and context <= 0:
        raise BadInputError(f"--context must be a positive number of tokens (got {context})")
    if ridge <= 0:
        raise BadInputError(f"--ridge must be positive (got {ridge})")
    view = build_view(ir, shapes)
    node_layer = {node.name: label for node, label in zip(view.nodes, view.layers)}
    activations, best = analyze_activations(view, top=None)
    cost = analyze_cost(view, top=top, ridge=ridge)
    report = {
        "model": str(ir.path) if ir.path else None,
        "nodes": len(view.nodes),
        "weights": analyze_weights(ir, node_layer),
        "activations": activations,
        "kv_cache": analyze_kv_cache(view, ir.graph, context),
        "ops": cost.pop("ops"),
        "op_types": cost.pop("op_types"),
        "hotspots": cost.pop("hotspots"),
        "cost": cost,
    }
    return report, _trace(view, best, activations["schedule"])


def analyze(ir: IRModel, context: int | None = None, **options) -> dict:
    """The analysis report of ``ir`` (options: ``top``, ``ridge``, ``shapes``); see the module docs."""
    return run_analysis(ir, context, **options)[0]


def _trace(view: GraphView, best: dict, schedule: str) -> MemoryTrace:
    life = best["life"]
    allocated = np.zeros(life.steps, dtype=np.int64)
    if life.steps:
        np.add.at(allocated, life.first, life.sizes)
    order = best.get("order") or []
    return MemoryTrace(schedule, best["profile"], np.cumsum(allocated), best["arena"],
                       [str(view.layers[i]) for i in order], [view.nodes[i].name for i in order])
