"""Declared dependencies match what the package imports (read from its source, nothing executed).

Every third-party module the package imports, at module or function level, is declared in
setup.cfg: in ``install_requires``, or in an extra when the import is optional (inside a function,
where its absence is reported); every ``install_requires`` entry is imported by the package.
"""

from __future__ import annotations

import ast
import configparser
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("qnnpasses", "passes", "op_support")
#: import name -> distribution name, where they differ
DISTRIBUTIONS = {"onnx_graphsurgeon": "onnx-graphsurgeon", "onnxruntime_qnn": "onnxruntime-qnn"}


def _requirements(text: str) -> set[str]:
    names = set()
    for line in text.strip().splitlines():
        line = line.split("#")[0].strip()
        if line:
            names.add(re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0].lower().replace("_", "-"))
    return names


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    extras = {name: _requirements(value) for name, value in config["options.extras_require"].items()}
    return _requirements(config["options"]["install_requires"]), extras


def _imports() -> dict[str, bool]:
    """Third-party distribution -> whether some module imports it at module level."""
    found: dict[str, bool] = {}
    for folder in SOURCES:
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            top = {id(n) for n in tree.body}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    root = name.split(".")[0]
                    if root in sys.stdlib_module_names or root in ("qnnpasses", "__future__"):
                        continue
                    dist = DISTRIBUTIONS.get(root, root).lower().replace("_", "-")
                    found[dist] = found.get(dist, False) or id(node) in top
    return found


def test_every_import_is_declared():
    required, extras = _declared()
    optional = set().union(*extras.values())
    imports = _imports()
    undeclared = sorted(d for d in imports if d not in required and d not in optional)
    assert not undeclared, f"imported but not declared in setup.cfg: {undeclared}"
    module_level = sorted(d for d, top in imports.items() if top and d not in required)
    assert not module_level, f"imported at module level but only an extra: {module_level}"


def test_every_required_dependency_is_imported():
    required, _ = _declared()
    unused = sorted(required - set(_imports()))
    assert not unused, f"install_requires entries the package never imports: {unused}"
