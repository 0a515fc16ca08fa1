"""What lint rules read: the model, the op-support verdicts, and passes tried on copies.

Rules that ask "would pass P rewrite this?" do not re-implement P's pattern matching:
:meth:`LintContext.rewrite` runs P (through the pass manager, so shapes are refreshed and
a failing pass is rolled back, exactly as in ``qnnpasses run``) on a copy of the model and
returns a :class:`Rewrite`, the structural difference before/after.  A finding derived from
it is exact by construction: the pass does rewrite those nodes.  Rewrites are cached, so
several rules sharing one pass pay for it once; lint never touches the HTP backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import networkx as nx
import onnx_graphsurgeon as gs

from qnnpasses.ir.model import IRModel
from qnnpasses.ir.read import is_constant

#: The pipeline lint folds with before reading shapes.
SIMPLIFY = "simplify"
#: The usual weight limit of one HTP graph / context binary (and protobuf's 2 GiB).
DEFAULT_MAX_GRAPH_WEIGHT_BYTES = 2 << 30


@dataclass
class LintConfig:
    backend: str = "htp"
    max_graph_weight_bytes: int = DEFAULT_MAX_GRAPH_WEIGHT_BYTES
    ignore: frozenset[str] = frozenset()


@dataclass
class Rewrite:
    """A pipeline run on a copy, and which nodes it removed, added and rewired (same node,
    other inputs).  Nodes are compared by name: passes keep the names of nodes they keep."""

    spec: str
    before: IRModel
    after: IRModel
    stats: dict[str, Any] = field(default_factory=dict)
    rolled_back: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    rewired: list[str] = field(default_factory=list)
    table: str = "htp"

    @cached_property
    def after_nodes(self) -> dict[str, gs.Node]:
        return {n.name: n for n in self.after.graph.nodes}

    @cached_property
    def _after_support(self) -> dict[str, Any]:
        from qnnpasses.op_support import check_graph

        return {r.name: r for r in check_graph(self.after.graph, self.table)}

    def supported_after(self, name: str) -> bool | None:
        """Predicted HTP support of node ``name`` after the rewrite; None when it is gone."""
        result = self._after_support.get(name)
        return None if result is None else result.supported

    @cached_property
    def _before_unsupported(self) -> int:
        from qnnpasses.op_support import check_graph

        return sum(not r.supported for r in check_graph(self.before.graph, self.table))

    def resolves_node(self, name: str) -> bool:
        """Node ``name`` is gone or predicted on the HTP afterwards, and the rewrite left
        fewer unsupported nodes than it found (it did not move the problem elsewhere)."""
        if self.supported_after(name) is False:
            return False
        return sum(not r.supported for r in self._after_support.values()) < self._before_unsupported


def name_nodes(graph: gs.Graph) -> None:
    """Give unnamed and duplicate-named nodes unique names: findings and diffs go by name."""
    seen: set[str] = set()
    for index, node in enumerate(graph.nodes):
        if not node.name or node.name in seen:
            base = node.name or f"(unnamed {node.op})"
            node.name = f"{base} #{index}"
        seen.add(node.name)


class LintContext:
    """The model under lint (its own copy: unnamed nodes get names) and cached analyses."""

    def __init__(self, ir: IRModel, config: LintConfig | None = None):
        self.ir = ir
        self.config = config or LintConfig()
        name_nodes(ir.graph)
        self._rewrites: dict[tuple[str, str | None], Rewrite] = {}
        self._resolves: dict[tuple[Any, str | tuple[str, str]], bool] = {}

    # ------------------------------------------------------------------ the model

    @property
    def graph(self) -> gs.Graph:
        return self.ir.graph

    @cached_property
    def nodes(self) -> dict[str, gs.Node]:
        return {n.name: n for n in self.graph.nodes}

    @cached_property
    def order(self) -> dict[str, int]:
        return {n.name: i for i, n in enumerate(self.graph.nodes)}

    @cached_property
    def support(self) -> list[Any]:
        """:func:`qnnpasses.op_support.check_graph` verdicts, in node order."""
        from qnnpasses.op_support import check_graph

        return check_graph(self.graph, self.config.backend)

    @cached_property
    def table(self) -> dict[str, Any]:
        from qnnpasses.op_support import load_table

        return load_table(self.config.backend)

    # ------------------------------------------------------------------ rewrites on copies

    @cached_property
    def canonical(self) -> str:
        """The pipeline pattern rules run after: constant folding, after fixing symbolic input
        dims when there are any (several passes need static shapes)."""
        from qnnpasses.ir.shapes import has_static_shapes

        return SIMPLIFY if has_static_shapes(self.graph) else f"fix-shapes,{SIMPLIFY}"

    def rewrite(self, spec: str, base: str | None = None) -> Rewrite:
        """Run pipeline ``spec`` on a copy of the model (of ``rewrite(base).after`` if given)."""
        key = (spec, base)
        if key not in self._rewrites:
            from qnnpasses.progress import step

            step(f"trying {spec} on a copy of the model", minor=True)
            start = self.ir if base is None else self.rewrite(base).after
            self._rewrites[key] = _run_on_copy(spec, start, self.config.backend)
        return self._rewrites[key]

    def fix_for(self, resolved: Callable[[Rewrite], bool], candidates: Iterable[str | tuple[str, str]],
                key: Any = None) -> str | None:
        """The first candidate pipeline whose rewrite ``resolved`` says fixes the problem.

        A candidate is a spec, or ``(spec, base)`` to run it after ``base`` (then the fix
        reads ``base,spec``).  ``key`` names the problem ``resolved`` asks about (e.g.
        ``("node", name)``): each candidate's answer for it is then computed once, however
        many rules ask (the rewrites themselves are always cached).
        """
        for candidate in candidates:
            spec, base = candidate if isinstance(candidate, tuple) else (candidate, None)
            answer = self._resolves.get((key, candidate)) if key is not None else None
            if answer is None:
                result = self.rewrite(spec, base)
                answer = not result.rolled_back and resolved(result)
                if key is not None:
                    self._resolves[(key, candidate)] = answer
            if answer:
                return f"{_display(base)},{_display(spec)}" if base else _display(spec)
        return None

    def removed_groups(self, spec: str, base: str | None = None, *, rewired: bool = False) -> list[list[gs.Node]]:
        """The nodes ``spec`` removes, grouped into connected patterns (nodes of its input graph).

        Nodes that read only constants (Constant, an Identity of a weight) are left out: they
        die with the pattern but are not part of it.  With ``rewired`` the nodes it kept but
        gave other inputs join too, so that e.g. two Transposes cancelled around a Relu form
        one group."""
        rw = self.rewrite(spec, base)
        nodes = {n.name: n for n in rw.before.graph.nodes}
        names = rw.removed + (rw.rewired if rewired else [])
        computed = [name for name in names if any(not is_constant(t, through_identity=True) for t in nodes[name].inputs)]
        return [[nodes[name] for name in group] for group in self.components(computed, graph=rw.before.graph)]

    def components(self, names: Iterable[str], graph: gs.Graph | None = None) -> list[list[str]]:
        """``names`` grouped into connected subgraphs of ``graph`` (default: the model), in node order."""
        return node_components(self.graph if graph is None else graph, names)


def node_components(graph: gs.Graph, names: Iterable[str]) -> list[list[str]]:
    """Nodes ``names`` of ``graph`` grouped by producer/consumer edges among them, each group
    and the groups in node order."""
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    wanted = set(names)
    members = {n.name: n for n in graph.nodes if n.name in wanted}
    links = nx.Graph()
    links.add_nodes_from(members)
    for name, node in members.items():
        for out in node.outputs:
            links.add_edges_from((name, c.name) for c in out.outputs if c.name in members)
    groups = [sorted(c, key=order.__getitem__) for c in nx.connected_components(links)]
    return sorted(groups, key=lambda g: order[g[0]])


def _display(spec: str) -> str:
    """How a fix is written for users: without lint's own option for speed."""
    return spec.replace(SIMPLIFY, "simplify")


def _run_on_copy(spec: str, start: IRModel, table: str) -> Rewrite:
    from qnnpasses.passmanager.api import PassContext
    from qnnpasses.passmanager.manager import PassManager
    from qnnpasses.passmanager.spec import parse_pipeline

    before = start
    after = start.copy()
    result = PassManager(parse_pipeline(spec), context=PassContext()).run(after)
    stats: dict[str, Any] = {}
    for record in result.records:
        stats.update(record.stats)
    rewrite = Rewrite(spec, before, after, stats, [r.name for r in result.rolled_back], table=table)
    _diff(rewrite)
    return rewrite


def _diff(rw: Rewrite) -> None:
    old = {n.name: n for n in rw.before.graph.nodes}
    new = {n.name: n for n in rw.after.graph.nodes}
    rw.removed = [name for name, node in old.items() if name not in new or new[name].op != node.op]
    rw.added = [name for name, node in new.items() if name not in old or old[name].op != node.op]
    rw.rewired = [name for name, node in old.items()
                  if name in new and new[name].op == node.op and _input_names(node) != _input_names(new[name])]


def _input_names(node: gs.Node) -> list[str]:
    return [t.name for t in node.inputs]
