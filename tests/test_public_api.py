"""The public API for pass authors: one import, stable names, old paths still load."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import qnnpasses.api as api

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "examples" / "plugin" / "qnnpasses_example_plugin" / "__init__.py"


def test_every_public_name_is_there_once():
    assert len(api.__all__) == len(set(api.__all__))
    assert [name for name in api.__all__ if not hasattr(api, name)] == []


def test_the_example_plugin_needs_one_import_of_qnnpasses():
    tree = ast.parse(PLUGIN.read_text())
    ours = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qnnpasses")]
    assert [node.module for node in ours] == ["qnnpasses.api"]


def test_the_old_path_warns_and_gives_the_same_names():
    sys.modules.pop("qnnpasses.pass_api", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module("qnnpasses.pass_api")
    assert any(issubclass(w.category, DeprecationWarning) and "qnnpasses.api" in str(w.message) for w in caught)
    assert all(getattr(old, name) is getattr(api, name) for name in api.__all__)


def test_a_plugin_written_against_the_internal_modules_still_loads(tmp_path):
    plugin = tmp_path / "old_plugin.py"
    plugin.write_text(
        "from qnnpasses.passmanager.api import EXACT, Pass, PassResult, register_pass\n"
        "from qnnpasses.passmanager.rewrite import finish\n\n"
        "@register_pass\nclass Nothing(Pass):\n"
        "    name = 'old-style-nothing'\n    summary = 'does nothing'\n    contract = EXACT\n"
        "    def run(self, ir, ctx):\n        finish(ir)\n        return PassResult(changed=False)\n")
    result = subprocess.run([sys.executable, "-m", "qnnpasses.cli", "passes", "--plugin", str(plugin)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "old-style-nothing" in result.stdout
