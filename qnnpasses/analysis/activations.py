"""Activation memory: what the tensors computed at run time need, with and without reuse.

Definitions (all over the main graph, batch and sequence as in the model):

* activations are the graph inputs and every node output except Constant nodes' (those
  are weights).  A tensor is *live* from the step of the node that writes it (step 0
  for graph inputs) through the step of its last reader; graph outputs stay live to the
  end.  A node's inputs and outputs are live together while it runs.
* ``peak_bytes_no_reuse``: every activation gets its own buffer for the whole run —
  the sum of all activation sizes.  It does not depend on the schedule.
* ``peak_live_bytes``: the largest sum of sizes live at one step of a schedule.  No
  allocator can do better for that schedule; it is what perfect reuse would reach.
* ``peak_bytes_reuse``: the arena an offline planner needs when buffers of tensors whose
  lifetimes do not overlap share memory.  Tensors are placed largest first, each at the
  lowest offset where it fits in a gap left by the tensors already placed whose lifetimes
  overlap its own (best fit: the smallest such gap), else on top of them — the "greedy by
  size" planner TFLite uses.  Fragmentation can make the arena exceed ``peak_live_bytes``.

Several topological schedules are tried (stored graph order, depth-first from the
outputs, breadth-first, and a greedy memory-aware order that runs next the ready node
that frees the most bytes net); the one with the smallest arena is reported.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

import numpy as np

from qnnpasses.analysis.graph import GraphView

SCHEDULES = ("graph", "dfs", "bfs", "greedy")


@dataclass
class Lifetimes:
    """Per activation: size, first and last live step, for one schedule."""

    names: list[str]
    sizes: np.ndarray
    first: np.ndarray
    last: np.ndarray
    steps: int


# --------------------------------------------------------------------------- schedules


def _indegrees(view: GraphView) -> tuple[list[int], list[list[int]]]:
    """Number of distinct producer nodes per node, and each node's distinct successor nodes."""
    successors: list[set[int]] = [set() for _ in view.nodes]
    indegree = [0] * len(view.nodes)
    for index, names in enumerate(view.reads):
        preds = {view.tensors[n].producer for n in names} - {None, index}
        indegree[index] = len(preds)
        for p in preds:
            successors[p].add(index)
    return indegree, [sorted(s) for s in successors]


def _kahn(view: GraphView, pop, push, first) -> list[int]:
    indegree, successors = _indegrees(view)
    ready = first([i for i, d in enumerate(indegree) if d == 0])
    order = []
    while ready:
        node = pop(ready)
        order.append(node)
        for s in successors[node]:
            indegree[s] -= 1
            if indegree[s] == 0:
                push(ready, s)
    return order


def graph_order(view: GraphView) -> list[int]:
    """Stored order when it is topological, else the topological order closest to it."""
    def first(items):
        heapq.heapify(items)
        return items
    return _kahn(view, heapq.heappop, heapq.heappush, first)


def bfs_order(view: GraphView) -> list[int]:
    return _kahn(view, deque.popleft, deque.append, deque)


def dfs_order(view: GraphView) -> list[int]:
    """Post-order depth-first from the graph outputs: each value is computed just before use."""
    done = [False] * len(view.nodes)
    order: list[int] = []
    producers = [[view.tensors[n].producer for n in names if view.tensors[n].producer is not None]
                 for names in view.reads]
    outputs = [t.producer for t in view.tensors.values() if t.graph_output and t.producer is not None]
    roots = list(dict.fromkeys(outputs)) + list(range(len(view.nodes)))  # then nodes no output needs
    for root in roots:
        stack = [(root, 0)]
        while stack:
            node, child = stack.pop()
            if done[node]:
                continue
            if child < len(producers[node]):
                stack.append((node, child + 1))
                pred = producers[node][child]
                if not done[pred]:
                    stack.append((pred, 0))
            else:
                done[node] = True
                order.append(node)
    return order


def greedy_order(view: GraphView) -> list[int]:
    """List scheduling that runs the ready node with the smallest (bytes written - bytes freed)."""
    indegree, successors = _indegrees(view)
    remaining = {name: len(set(t.consumers)) for name, t in view.tensors.items()}
    outputs = {name for name, t in view.tensors.items() if t.graph_output}

    def delta(node: int) -> int:
        written = sum(view.tensors[n].nbytes for n in view.writes[node])
        freed = sum(view.tensors[n].nbytes for n in view.reads[node] if remaining[n] == 1 and n not in outputs)
        return written - freed

    ready = {i for i, d in enumerate(indegree) if d == 0}
    order = []
    while ready:
        node = min(ready, key=lambda i: (delta(i), i))
        ready.remove(node)
        order.append(node)
        for name in view.reads[node]:
            remaining[name] -= 1
        for s in successors[node]:
            indegree[s] -= 1
            if indegree[s] == 0:
                ready.add(s)
    return order


ORDERS = {"graph": graph_order, "dfs": dfs_order, "bfs": bfs_order, "greedy": greedy_order}


# --------------------------------------------------------------------------- lifetimes and packing


def lifetimes(view: GraphView, order: list[int]) -> Lifetimes:
    step = {node: i for i, node in enumerate(order)}
    end = max(len(order) - 1, 0)
    names, sizes, first, last = [], [], [], []
    for name, t in view.tensors.items():
        if t.producer is not None and t.producer not in step:
            continue  # written by a node no schedule reaches (a cycle): ignore
        begin = 0 if t.producer is None else step[t.producer]
        finish = max([step[c] for c in t.consumers if c in step] + [begin])
        if t.graph_output:
            finish = end
        names.append(name)
        sizes.append(t.nbytes)
        first.append(begin)
        last.append(finish)
    return Lifetimes(names, np.asarray(sizes, dtype=np.int64), np.asarray(first, dtype=np.int64),
                     np.asarray(last, dtype=np.int64), len(order))


def live_profile(life: Lifetimes) -> np.ndarray:
    """Bytes live at each step of the schedule."""
    delta = np.zeros(life.steps + 1, dtype=np.int64)
    np.add.at(delta, life.first, life.sizes)
    np.add.at(delta, life.last + 1, -life.sizes)
    return np.cumsum(delta)[: life.steps] if life.steps else np.zeros(0, dtype=np.int64)


def pack_arena(life: Lifetimes) -> tuple[int, np.ndarray]:
    """Greedy-by-size best-fit offsets; returns (arena bytes, offset per tensor)."""
    count = len(life.names)
    offsets = np.zeros(count, dtype=np.int64)
    placed = np.zeros(count, dtype=bool)
    arena = 0
    for i in sorted(range(count), key=lambda k: (-int(life.sizes[k]), int(life.first[k]))):
        size = int(life.sizes[i])
        if size == 0:
            placed[i] = True
            continue
        concurrent = (life.first <= life.last[i]) & (life.last >= life.first[i])
        overlap = np.flatnonzero(placed & concurrent & (life.sizes > 0))
        best, best_gap, top = None, None, 0
        for j in overlap[np.argsort(offsets[overlap], kind="stable")]:
            gap = int(offsets[j]) - top
            if gap >= size and (best_gap is None or gap < best_gap):
                best, best_gap = top, gap
            top = max(top, int(offsets[j] + life.sizes[j]))
        offsets[i] = top if best is None else best
        placed[i] = True
        arena = max(arena, int(offsets[i]) + size)
    return arena, offsets


# --------------------------------------------------------------------------- the report section


def evaluate(view: GraphView, name: str) -> dict:
    # Constant nodes hold weights: they are not scheduled work and own no activation
    order = [i for i in ORDERS[name](view) if view.nodes[i].op != "Constant"]
    life = lifetimes(view, order)
    profile = live_profile(life)
    arena, offsets = pack_arena(life)
    return {"order": order, "life": life, "profile": profile, "arena": arena, "offsets": offsets,
            "peak_live": int(profile.max()) if profile.size else 0}


def analyze_activations(view: GraphView, schedules=SCHEDULES, top: int | None = None) -> tuple[dict, dict]:
    """The ``activations`` section, and the chosen schedule's raw data (for plotting)."""
    results = {name: evaluate(view, name) for name in schedules}
    best_name = min(results, key=lambda n: (results[n]["arena"], results[n]["peak_live"], schedules.index(n)))
    best = results[best_name]
    life, profile = best["life"], best["profile"]
    no_reuse = int(life.sizes.sum())
    peak_step = int(profile.argmax()) if profile.size else 0
    at_peak = np.flatnonzero((life.first <= peak_step) & (life.last >= peak_step))
    live = [(life.names[i], int(life.sizes[i])) for i in at_peak]
    live.sort(key=lambda kv: -kv[1])
    node_at_peak = view.nodes[best["order"][peak_step]].name if best["order"] else None
    section = {
        "tensors": len(life.names),
        "unknown_size_tensors": view.unknown,
        "shape_source": view.shape_source,
        "peak_bytes_no_reuse": no_reuse,
        "peak_live_bytes": best["peak_live"],
        "peak_bytes_reuse": best["arena"],
        "reuse_saving": 1.0 - best["arena"] / no_reuse if no_reuse else 0.0,
        "schedule": best_name,
        "peak_step": peak_step,
        "node_at_peak": node_at_peak,
        "live_at_peak": [{"name": n, "bytes": b, "layer": view.layer_of_tensor(n)} for n, b in live[:top]],
        "live_at_peak_count": len(live),
        "schedules": {n: {"peak_live_bytes": r["peak_live"], "peak_bytes_reuse": r["arena"]}
                      for n, r in results.items()},
    }
    return section, best
