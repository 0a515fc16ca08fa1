"""Plugins: the example package loads by entry point and by --plugin, and runs like a built-in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from conftest import fixture_inputs, fixture_path

from qnnpasses.backends.cpu import run_cpu

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "plugin"
PLUGIN_FILE = EXAMPLE / "qnnpasses_example_plugin" / "__init__.py"
FIXTURE = "bert_ts"  # its exporter emits an Add of a zero tensor


def _qnnpasses(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "qnnpasses.cli", *map(str, argv)], capture_output=True, text=True,
                          env=env, timeout=300)


def _entry_point_env(tmp_path):
    """An environment where the example is 'installed': a dist-info with its entry point on sys.path."""
    dist = tmp_path / "site" / "qnnpasses_example_plugin-0.1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: qnnpasses-example-plugin\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text("[qnnpasses.passes]\ndrop-neutral-arith = qnnpasses_example_plugin\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), str(EXAMPLE), env.get("PYTHONPATH", "")])
    return env


def _check_run(tmp_path, result):
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    record = report["passes"][0]
    assert record["name"] == "drop-neutral-arith" and record["status"] == "changed"
    assert record["stats"]["removed"] >= 1 and record["op_delta"].get("Add", 0) <= -1
    assert record["verification"]["max_abs"] == 0.0
    inputs = fixture_inputs(FIXTURE)
    expected = run_cpu(fixture_path(FIXTURE), inputs)["last_hidden_state"]
    np.testing.assert_array_equal(run_cpu(tmp_path / "o.onnx", inputs)["last_hidden_state"], expected)


def test_plugin_by_entry_point(tmp_path):
    env = _entry_point_env(tmp_path)
    listing = _qnnpasses("passes", env=env)
    assert "drop-neutral-arith" in listing.stdout and "plugin qnnpasses_example_plugin" in listing.stdout
    result = _qnnpasses("run", fixture_path(FIXTURE), "-o", tmp_path / "o.onnx", "--passes",
                        "drop-neutral-arith,cleanup", "--verify", "--report-dir", tmp_path / "r", env=env)
    _check_run(tmp_path, result)


def test_plugin_by_file(tmp_path):
    listing = _qnnpasses("passes", "--plugin", PLUGIN_FILE)
    assert "drop-neutral-arith" in listing.stdout
    result = _qnnpasses("run", fixture_path(FIXTURE), "-o", tmp_path / "o.onnx", "--plugin", PLUGIN_FILE,
                        "--passes", "drop-neutral-arith{ops=Add:Mul},cleanup", "--verify", "--report-dir", tmp_path / "r")
    _check_run(tmp_path, result)
    assert json.loads((tmp_path / "r" / "report.json").read_text())["pipeline"] == "drop-neutral-arith{ops=Add:Mul},cleanup"


def test_broken_plugin_file_is_one_line_error(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('missing dependency foo')\n")
    result = _qnnpasses("passes", "--plugin", broken)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("qnnpasses: error: plugin file") and "missing dependency foo" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
