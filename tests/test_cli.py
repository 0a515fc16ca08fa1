"""The command line: the main job on real fixtures, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from conftest import fixture_inputs, fixture_path
from onnx import TensorProto, helper

from qnnpasses.backends.cpu import run_cpu
from qnnpasses.cli import main

GOOD = "llama_gqa_ts"


def _cli(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _model(nodes, inputs, outputs, initializers=(), opset=17, domains=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    imports = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains]
    return helper.make_model(graph, opset_imports=imports)


def _vi(name, shape=(1, 4)):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def _write(tmp_path, name, content):
    path = tmp_path / name
    if isinstance(content, onnx.ModelProto):
        path.write_bytes(content.SerializeToString())
    else:
        path.write_bytes(content)
    return path


def _external_model(tmp_path, data_bytes=None, drop_file=False):
    weights = np.arange(64, dtype=np.float32).reshape(1, 64)
    model = _model([helper.make_node("Add", ["x", "w"], ["y"])], [_vi("x", (1, 64))], [_vi("y", (1, 64))],
                   [onnx.numpy_helper.from_array(weights, "w")])
    path = tmp_path / "ext.onnx"
    onnx.save_model(model, path, save_as_external_data=True, location="ext.data", size_threshold=0)
    data = tmp_path / "ext.data"
    if drop_file:
        data.unlink()
    elif data_bytes is not None:
        data.write_bytes(data.read_bytes()[:data_bytes])
    return path


def _escaping_external_model(tmp_path):
    """External data whose location climbs out of the model's folder."""
    path = _external_model(tmp_path / "inner")
    model = onnx.load(path, load_external_data=False)
    for entry in model.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = "../outside.data"
    (tmp_path / "outside.data").write_bytes(b"\0" * 256)
    onnx.save(model, path)
    return path


def _bad_inputs(tmp_path):
    good = fixture_path(GOOD).read_bytes()
    x, y = _vi("x"), _vi("y")
    cycle = _model([helper.make_node("Relu", ["b"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
                    helper.make_node("Relu", ["a"], ["y"])], [x], [y])
    duplicate = _model([helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Abs", ["x"], ["y"])], [x], [y])
    dangling = _model([helper.make_node("Add", ["x", "ghost"], ["y"])], [x], [y])
    custom = _model([helper.make_node("Frobnicate", ["x"], ["y"], domain="com.example")], [x], [y], domains=["com.example"])
    future = _model([helper.make_node("Relu", ["x"], ["y"])], [x], [y], opset=onnx.defs.onnx_opset_version() + 5)
    empty = _model([], [x], [x])
    not_a_model = onnx.numpy_helper.from_array(np.ones(4, np.float32), "t").SerializeToString()
    return {
        "missing file": (tmp_path / "nope.onnx", "no such file"),
        "directory": (tmp_path, "is a directory"),
        "empty file": (_write(tmp_path, "empty.onnx", b""), "is empty"),
        "truncated": (_write(tmp_path, "truncated.onnx", good[: len(good) // 2]), "not an ONNX model"),
        "random bytes": (_write(tmp_path, "random.onnx", np.random.default_rng(0).bytes(5000)), "not an ONNX model"),
        "protobuf that is not a model": (_write(tmp_path, "tensor.onnx", not_a_model), "not an ONNX model"),
        "cycle": (_write(tmp_path, "cycle.onnx", cycle), "fails the ONNX checker"),
        "duplicate tensor names": (_write(tmp_path, "dup.onnx", duplicate), "fails the ONNX checker"),
        "dangling input": (_write(tmp_path, "dangling.onnx", dangling), "fails the ONNX checker"),
        "unknown custom op": (_write(tmp_path, "custom.onnx", custom), "unknown domain 'com.example'"),
        "opset newer than onnx": (_write(tmp_path, "future.onnx", future), "newer than"),
        "empty graph": (_write(tmp_path, "emptygraph.onnx", empty), "empty graph"),
        "missing external data": (_external_model(tmp_path / "a", drop_file=True), "is missing"),
        "short external data": (_external_model(tmp_path / "b", data_bytes=100), "too short"),
        "external data outside the folder": (_escaping_external_model(tmp_path / "c"), "points outside the model's folder"),
    }


BAD_INPUT_CASES = [
    "missing file", "directory", "empty file", "truncated", "random bytes", "protobuf that is not a model", "cycle",
    "duplicate tensor names", "dangling input", "unknown custom op", "opset newer than onnx", "empty graph",
    "missing external data", "short external data", "external data outside the folder",
]


@pytest.mark.parametrize("case", BAD_INPUT_CASES)
def test_bad_input_gives_one_line_and_exit_2(tmp_path, capsys, case):
    for sub in ("a", "b", "c/inner"):
        (tmp_path / sub).mkdir(parents=True)
    path, message = _bad_inputs(tmp_path)[case]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    out = tmp_path / "out" / "o.onnx"
    code, stdout, stderr = _cli(capsys, "run", path, "-o", out, "--passes", "cleanup")
    assert code == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qnnpasses: error:") and message in lines[0], stderr
    assert "Traceback" not in stderr
    assert not out.exists() and not (tmp_path / "out").exists()
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--passes", "no-such-pass"], "unknown pass 'no-such-pass'"),
        (["--passes", "cleanup{"], "bad pipeline spec"),
        (["--pipeline", "nope"], "unknown pipeline 'nope'"),
        (["--passes", "cleanup", "--shape", "input_ids"], "--shape expects NAME=D0,D1"),
        (["--passes", "cleanup", "--shape", "nobody=1,2"], "unknown inputs ['nobody']"),
        (["--passes", "cleanup", "--inputs", "missing.npz"], "inputs file not found"),
        (["--passes", "cleanup", "--dump-ir"], "--dump-ir needs --report-dir"),
    ],
)
def test_bad_usage_gives_one_line_and_exit_2(tmp_path, capsys, argv, message):
    out = tmp_path / "o.onnx"
    code, _, stderr = _cli(capsys, "run", fixture_path(GOOD), "-o", out, *argv)
    assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert not out.exists()


def test_mismatched_inputs_file_is_refused(tmp_path, capsys):
    inputs = fixture_inputs(GOOD)
    inputs["input_ids"] = inputs["input_ids"].astype(np.int32)
    np.savez(tmp_path / "x.npz", **inputs)
    code, _, stderr = _cli(capsys, "run", fixture_path(GOOD), "-o", tmp_path / "o.onnx", "--passes", "cleanup",
                           "--inputs", tmp_path / "x.npz", "--verify")
    assert code == 2 and "input 'input_ids' has dtype int32, the model wants int64" in stderr


def test_output_may_not_overwrite_input(tmp_path, capsys):
    src = tmp_path / "m.onnx"
    src.write_bytes(fixture_path(GOOD).read_bytes())
    code, _, stderr = _cli(capsys, "run", src, "-o", src, "--passes", "cleanup")
    assert code == 2 and "refusing to overwrite the input" in stderr
    assert src.read_bytes() == fixture_path(GOOD).read_bytes()


def test_strict_rollback_exits_1_and_writes_no_output(tmp_path, capsys):
    plugin = tmp_path / "wrong.py"
    plugin.write_text(
        "from qnnpasses.passmanager.api import Pass, PassResult, register_pass\n"
        "@register_pass\n"
        "class Wrong(Pass):\n"
        "    name = 'test-cli-wrong'\n"
        "    summary = 'Softmax -> LogSoftmax (deliberately wrong)'\n"
        "    def run(self, ir, ctx):\n"
        "        next(n for n in ir.graph.nodes if n.op == 'Softmax').op = 'LogSoftmax'\n"
        "        return PassResult(changed=True)\n"
    )
    out = tmp_path / "o.onnx"
    code, _, stderr = _cli(capsys, "run", fixture_path(GOOD), "-o", out, "--plugin", plugin, "--passes",
                           "test-cli-wrong", "--verify", "--strict", "--report-dir", tmp_path / "r")
    assert code == 1 and "rolled back" in stderr and not out.exists()
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["passes"][0]["status"] == "rolled-back" and report["output"] is None


def test_run_writes_model_report_and_ir_dumps(tmp_path, capsys):
    out, report_dir = tmp_path / "o.onnx", tmp_path / "r"
    code, stdout, _ = _cli(capsys, "run", fixture_path(GOOD), "-o", out, "--report-dir", report_dir, "--verify",
                           "--dump-ir", "--inputs", fixture_path(GOOD).with_suffix(".inputs.npz"))
    assert code == 0
    report = json.loads((report_dir / "report.json").read_text())
    assert {"input", "output", "pipeline", "passes"} <= set(report)
    for record in report["passes"]:
        assert {"name", "changed", "seconds", "nodes_before", "nodes_after", "added", "removed", "op_delta",
                "stats"} <= set(record)
        if record["changed"]:
            assert record["verification"]["cosine"] > 0.9999
    assert (report_dir / "report.md").read_text().startswith("# qnnpasses report")
    assert (report_dir / "ir" / "00-input.txt").exists()
    assert report["final_verification"]["max_abs"] <= 1e-4
    inputs = fixture_inputs(GOOD)
    np.testing.assert_allclose(run_cpu(out, inputs)["logits"], run_cpu(fixture_path(GOOD), inputs)["logits"], atol=1e-4)
    assert "pass" in stdout  # the per-pass table
    metadata = {p.key: p.value for p in onnx.load(out).metadata_props}
    assert metadata["qnnpasses.passmanager.spec"] == report["pipeline"]


def test_console_script_runs_in_a_fresh_process(tmp_path):
    """The installed entry point, end to end, in its own process: exit code and one-line error."""
    result = subprocess.run([sys.executable, "-m", "qnnpasses.cli", "run", str(tmp_path / "missing.onnx"), "-o",
                             str(tmp_path / "o.onnx")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == f"qnnpasses: error: no such file: {tmp_path / 'missing.onnx'}"


def test_passes_and_pipelines_listings(capsys):
    code, out, _ = _cli(capsys, "passes")
    assert code == 0 and "cleanup" in out
    code, out, _ = _cli(capsys, "pipelines")
    assert code == 0 and "htp-llm:" in out and "--passes '" in out
