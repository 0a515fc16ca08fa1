"""The layers of the code base, checked from its import statements (no module is executed).

    ir, op_support  ->  backends  ->  passmanager  ->  passes  ->  analyses/tools  ->  commands, cli

A module imports only from its own layer or the ones to its left; the leaf utilities
(errors, units, wording, progress, memory, the package root) import nothing of the project and
may be imported everywhere.  Imports, at module level or inside functions, form no cycle between
modules or between packages.  A pass family imports
no other family's private ``_*`` modules, and no pass module imports another pass module
(a pass never runs another pass: shared rewrites live in the family's helpers or in
``qnnpasses.passmanager.rewrite``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: source folder -> the package it is installed as (setup.cfg's package_dir)
SOURCES = {"qnnpasses": "qnnpasses", "passes": "qnnpasses.passes", "op_support": "qnnpasses.op_support"}
LEAVES = {"qnnpasses", "qnnpasses.errors", "qnnpasses.units", "qnnpasses.wording", "qnnpasses.progress",
          "qnnpasses.memory"}
#: Upward imports that exist today, each with why; the test fails when one is no longer needed.
KNOWN_UPWARD = {
    ("qnnpasses.passmanager.api", "qnnpasses.passes"):
        "the registry discovers the built-in pass families (as it discovers plugins); no pass code is used",
}
LAYERS = [
    ("ir", ("qnnpasses.ir", "qnnpasses.op_support")),
    ("backends", ("qnnpasses.backends",)),
    ("passmanager", ("qnnpasses.passmanager", "qnnpasses.api", "qnnpasses.pass_api")),
    ("passes", ("qnnpasses.passes",)),
    ("analyses/tools", ("qnnpasses.analysis", "qnnpasses.partition", "qnnpasses.handoff", "qnnpasses.lint",
                        "qnnpasses.quant", "qnnpasses.llm", "qnnpasses.debug")),
    ("commands", ("qnnpasses.commands", "qnnpasses.cli")),
]


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in SOURCES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path, *, top_level_only: bool) -> set[str]:
    """Project modules ``name`` imports (``from pkg import mod`` counts as ``pkg.mod`` when that is a module)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `import a.b.c` where c is an attribute
                target = target.rpartition(".")[0]
            if target and target.startswith("qnnpasses"):
                found.add(target)
    found.discard(name)
    return found


def _layer(module: str) -> int | None:
    best, index = "", None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, index = prefix, i
    return index


def test_every_module_has_a_layer():
    assert not [m for m in MODULES if m not in LEAVES and _layer(m) is None]


def test_leaf_modules_import_nothing_of_the_project():
    offending = {leaf: sorted(_imports(leaf, MODULES[leaf], top_level_only=False) - LEAVES) for leaf in LEAVES}
    assert not {k: v for k, v in offending.items() if v}


def test_layers_import_only_downward():
    upward, known = [], set()
    for name, path in MODULES.items():
        if name in LEAVES:
            continue
        mine = _layer(name)
        for target in _imports(name, path, top_level_only=False):
            if target not in LEAVES and _layer(target) > mine:
                if (name, target) in KNOWN_UPWARD:
                    known.add((name, target))
                else:
                    upward.append(f"{name} ({LAYERS[mine][0]}) imports {target} ({LAYERS[_layer(target)][0]})")
    assert not upward, "\n".join(upward)
    assert known == set(KNOWN_UPWARD), f"no longer needed, drop from KNOWN_UPWARD: {set(KNOWN_UPWARD) - known}"


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every elementary cycle of an import graph, as ``a -> b -> a`` lines."""
    import networkx as nx

    digraph = nx.DiGraph()
    digraph.add_edges_from((a, b) for a, targets in graph.items() for b in targets if a != b)
    found = []
    for cycle in nx.simple_cycles(digraph):
        start = cycle.index(min(cycle))  # each cycle from its smallest name, so the text is stable
        cycle = cycle[start:] + cycle[:start]
        found.append(" -> ".join([*cycle, cycle[0]]))
    return sorted(found)


def _module_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports, at module level or inside functions alike (an
    import inside a function is still a dependency; it only hides a cycle from the interpreter)."""
    graph = {name: _imports(name, path, top_level_only=False) for name, path in MODULES.items()}
    # a package's __init__ importing its own submodules is how packages re-export, not a cycle
    return {n: {t for t in targets if not (n == t.rpartition(".")[0] and MODULES[n].name == "__init__.py")}
            for n, targets in graph.items()}


def _package(module: str) -> str:
    """The package a module belongs to (a pass family counts as a package of its own)."""
    parts = module.split(".")
    if parts[:2] == ["qnnpasses", "passes"] and len(parts) > 3:
        return ".".join(parts[:3])
    if (module in MODULES and MODULES[module].name == "__init__.py") or module.count(".") < 2:
        return module  # a package, or a top-level module (cli, errors, units ...) on its own
    return module.rpartition(".")[0]


#: Cycles that exist today, each with why (none).
KNOWN_CYCLES: dict[str, str] = {}


def test_no_module_import_cycle():
    assert [c for c in _cycles(_module_graph()) if c not in KNOWN_CYCLES] == []


def test_no_package_import_cycle():
    packages: dict[str, set[str]] = {}
    for name, targets in _module_graph().items():
        packages.setdefault(_package(name), set()).update(_package(t) for t in targets)
    assert [c for c in _cycles(packages) if c not in KNOWN_CYCLES] == []


def test_a_planted_cycle_is_found():
    planted = {**_module_graph(), "qnnpasses.ir.model": {"qnnpasses.quant.gptq"},
               "qnnpasses.quant.gptq": {"qnnpasses.ir.model"}}
    assert "qnnpasses.ir.model -> qnnpasses.quant.gptq -> qnnpasses.ir.model" in _cycles(planted)


def _family(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["qnnpasses", "passes"] else None


PASS_MODULES = {m: p for m, p in MODULES.items() if _family(m) and len(m.split(".")) == 4}


@pytest.mark.parametrize("name", sorted(PASS_MODULES))
def test_no_family_reaches_into_another_familys_private_modules(name):
    family = _family(name)
    foreign = [t for t in _imports(name, PASS_MODULES[name], top_level_only=False)
               if _family(t) not in (None, family) and t.rpartition(".")[2].startswith("_")]
    assert not foreign


@pytest.mark.parametrize("name", sorted(PASS_MODULES))
def test_no_pass_imports_another_pass(name):
    """Pass modules (public modules of a family) are entry points; nothing in passes/ imports them."""
    public = {m for m in PASS_MODULES if not m.rpartition(".")[2].startswith("_")}
    assert not (_imports(name, PASS_MODULES[name], top_level_only=False) & public)
