"""Group placed nodes into partitions: as few as possible, and never a cycle between them.

A partition runs as one unit (one QNN graph, or one CPU sub-model), so all its inputs must
exist before it starts: the DAG contracted to partitions (the *quotient*) must stay
acyclic.  Nodes are visited in topological order; a node joins the partition of one of
its same-backend producers unless that partition already reaches one of the node's other
producers (joining would close a cycle through them), else it starts a new partition.
Then same-backend partitions are merged pairwise wherever the contracted quotient stays
acyclic — adjacent pairs first, then independent ones (two HTP regions on parallel
branches become one graph).  The result holds the maximal connected HTP regions and
never splits one without need.
"""

from __future__ import annotations

from itertools import combinations

import networkx as nx


class Regions:
    """Partitions (group id -> member node indices) and their quotient DAG."""

    def __init__(self, dag: nx.DiGraph, backend: dict[int, str]):
        self.dag = dag
        self.backend = backend
        self.group: dict[int, int] = {}
        self.members: dict[int, set[int]] = {}
        self.kind: dict[int, str] = {}
        self.quotient = nx.DiGraph()
        self._grow()
        self._merge_all()

    # ----------------------------------------------------------------- growing

    def _grow(self) -> None:
        for v in nx.lexicographical_topological_sort(self.dag):
            preds = list(self.dag.predecessors(v))
            target = self._joinable(v, preds)
            if target is None:
                target = len(self.kind)
                self.kind[target] = self.backend[v]
                self.members[target] = set()
                self.quotient.add_node(target)
            self.group[v] = target
            self.members[target].add(v)
            for u in preds:
                if self.group[u] != target:
                    self.quotient.add_edge(self.group[u], target)

    def _joinable(self, v: int, preds: list[int]) -> int | None:
        candidates = sorted({self.group[u] for u in preds if self.kind[self.group[u]] == self.backend[v]},
                            key=lambda g: -len(self.members[g]))
        for g in candidates:
            others = {self.group[u] for u in preds} - {g}
            if not any(nx.has_path(self.quotient, g, h) for h in others):
                return g
        return None

    # ----------------------------------------------------------------- merging

    def _merge_all(self) -> None:
        changed = True
        while changed:
            changed = self._merge_pass(adjacent_only=True) or self._merge_pass(adjacent_only=False)

    def _merge_pass(self, adjacent_only: bool) -> bool:
        for a, b in combinations(sorted(self.kind), 2):
            if self.kind[a] != self.kind[b]:
                continue
            adjacent = self.quotient.has_edge(a, b) or self.quotient.has_edge(b, a)
            if adjacent_only and not adjacent:
                continue
            if self.can_merge(a, b):
                self.merge(a, b)
                return True
        return False

    def can_merge(self, a: int, b: int) -> bool:
        """Contracting a and b keeps the quotient acyclic: no path between them through others."""
        for src, dst in ((a, b), (b, a)):
            for s in self.quotient.successors(src):
                if s != dst and nx.has_path(self.quotient, s, dst):
                    return False
        return True

    def merge(self, a: int, b: int) -> None:
        """Fold b into a."""
        for v in self.members[b]:
            self.group[v] = a
        self.members[a] |= self.members.pop(b)
        del self.kind[b]
        self.quotient = nx.contracted_nodes(self.quotient, a, b, self_loops=False)

    # ----------------------------------------------------------------- results

    def order(self) -> list[int]:
        """Partitions in an execution order (by their first node, ties by topology)."""
        first = {g: min(m) for g, m in self.members.items()}
        return list(nx.lexicographical_topological_sort(self.quotient, key=lambda g: first[g]))


def form_partitions(dag: nx.DiGraph, backend: dict[int, str]) -> list[tuple[str, set[int]]]:
    """``[(backend, members)]`` in execution order."""
    regions = Regions(dag, backend)
    return [(regions.kind[g], regions.members[g]) for g in regions.order()]
