"""Split an HTP partition that exceeds a memory budget into consecutive, balanced pieces.

A piece's size is its weight bytes plus its peak live activations.  The partition's nodes
keep their topological order and each piece is a contiguous range of it, so pieces run one
after another and no cycle can appear.  Cuts go where the fewest bytes cross (tensors
written before the cut and read after it): in a decoder stack that is the residual stream
between layers (or between attention and MLP), not the wide tensors inside attention.
Among those cheap cut points, a small dynamic program picks the fewest pieces that fit the
budget and, for that count, the cuts that minimise the largest piece — balanced pieces.

Estimates: a weight counts in the piece of its first reader (a weight shared by two pieces
is reported for both by the plan, which re-measures each piece); the live-activation peak
of a piece is the largest crossing set at any of its positions plus that node's outputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from qnnpasses.partition.graph import NodeGraph

#: A position is a cut candidate when at most this factor above the cheapest crossing.
CUT_SLACK = 1.5
#: Partitions up to this many nodes may be cut anywhere when the cheap cuts do not fit.
MAX_EXHAUSTIVE = 300


@dataclass
class SplitResult:
    pieces: list[list[int]]        # node indices per piece, in order
    sizes: list[int]               # estimated bytes per piece
    fits: bool                     # every piece within the budget


def split_by_memory(ng: NodeGraph, members: set[int], budget: int) -> SplitResult:
    order = sorted(members)
    weights, crossing, peak_at = profiles(ng, order)
    total = _size(weights, peak_at, 0, len(order))
    if total <= budget or len(order) < 2:
        return SplitResult([order], [total], total <= budget)
    attempts = [_cut_candidates(crossing)]
    if len(order) <= MAX_EXHAUSTIVE:  # no cheap cut fits: any position, if that stays affordable
        attempts.append(list(range(1, len(order))))
    for allowed in attempts:
        result = _best_split(order, weights, peak_at, allowed, budget)
        if result.fits:
            break
    return result


def profiles(ng: NodeGraph, order: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per position: first-attributed weight bytes, bytes crossing the cut before it, live peak."""
    position = {index: p for p, index in enumerate(order)}
    seen: set[int] = set()
    weights = np.zeros(len(order), dtype=np.int64)
    for p, index in enumerate(order):
        for node in [index, *sorted(ng.constant_closure({index}))]:
            for key, size in ng.weights[node].items():
                if key not in seen:
                    seen.add(key)
                    weights[p] += size
    delta = np.zeros(len(order) + 1, dtype=np.int64)     # crossing bytes as a difference array
    out_bytes = np.zeros(len(order), dtype=np.int64)
    for p, index in enumerate(order):
        for name in ng.view.writes[index]:
            size = ng.tensor_bytes(name)
            out_bytes[p] += size
            last = max((position[c] for c in ng.view.tensors[name].consumers if c in position), default=p)
            if last > p:
                delta[p + 1] += size
                delta[last + 1] -= size
    crossing = np.cumsum(delta)[: len(order)]           # crossing[p]: written before p, read at >= p
    return weights, crossing, crossing + out_bytes


def _size(weights: np.ndarray, peak_at: np.ndarray, a: int, b: int) -> int:
    return int(weights[a:b].sum() + (peak_at[a:b].max() if b > a else 0))


def _cut_candidates(crossing: np.ndarray) -> list[int]:
    interior = crossing[1:]
    if interior.size == 0:
        return []
    cheapest = int(interior.min())
    return [p for p in range(1, len(crossing)) if crossing[p] <= cheapest * CUT_SLACK]


def _best_split(order, weights, peak_at, allowed: list[int], budget: int) -> SplitResult:
    """Fewest pieces within ``budget`` cutting only at ``allowed``; minimise the largest piece."""
    points = [0, *allowed, len(order)]
    prefix = np.concatenate([[0], np.cumsum(weights)])
    total = int(prefix[-1] + peak_at.max())
    best = None
    for k in range(max(2, math.ceil(total / max(budget, 1))), len(points)):
        cuts, worst = min_max_cuts(points, k, lambda a, b: int(prefix[b] - prefix[a] + peak_at[a:b].max()))
        if cuts is None:
            continue
        best = (cuts, worst)
        if worst <= budget:
            break
    if best is None:
        return SplitResult([order], [total], False)
    cuts, _ = best
    bounds = [0, *cuts, len(order)]
    pieces = [order[a:b] for a, b in pairwise(bounds)]
    sizes = [int(prefix[b] - prefix[a] + peak_at[a:b].max()) for a, b in pairwise(bounds)]
    return SplitResult(pieces, sizes, max(sizes) <= budget)


def min_max_cuts(points: list[int], k: int, size: Callable[[int, int], float]) -> tuple[list[int] | None, float | None]:
    """Split ``points[0]..points[-1]`` into ``k`` consecutive pieces at interior ``points`` so that
    the largest ``size(start, end)`` is smallest: O(k·n²) dynamic program.  Returns the sorted
    cuts and that largest size, or ``(None, None)`` when ``k`` pieces do not fit."""
    n = len(points)
    if k > n - 1:
        return None, None
    inf = float("inf")
    cost = [[inf] * n for _ in range(k + 1)]
    back = [[-1] * n for _ in range(k + 1)]
    cost[0][0] = 0
    for parts in range(1, k + 1):
        for j in range(1, n):
            for i in range(parts - 1, j):
                if cost[parts - 1][i] == inf:
                    continue
                value = max(cost[parts - 1][i], size(points[i], points[j]))
                if value < cost[parts][j]:
                    cost[parts][j], back[parts][j] = value, i
    if cost[k][n - 1] == inf:
        return None, None
    cuts, j = [], n - 1
    for parts in range(k, 0, -1):
        i = back[parts][j]
        if parts > 1:
            cuts.append(points[i])
        j = i
    return sorted(cuts), cost[k][n - 1]
