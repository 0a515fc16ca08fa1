"""One test per command-line promise, each running the real command on the bundled example
(examples/tiny_llama.onnx) or a tiny hand-made model and asserting on what it prints or writes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import requires_htp
from onnx import TensorProto, helper, numpy_helper

from qnnpasses.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny_llama.onnx"
LEAKS = re.compile(r"<node>|\b3110\b|unk__\d|fix the input shapes first|\x1b\[")


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def htp_llm(tmp_path_factory):
    """The example after the default pipeline (htp-llm)."""
    out = tmp_path_factory.mktemp("htp_llm") / "tiny.htp.onnx"
    assert main(["run", str(TINY), "-o", str(out), "-q"]) == 0
    return out


# --------------------------------------------------------------------------- check and lint


def test_check_as_written_explains_in_plain_words(capsys):
    code, out, _ = cli(capsys, "check", TINY, "--as-written")
    assert code == 0 and not LEAKS.search(out), LEAKS.search(out)
    assert "unsupported op types:" not in out  # no list of ops the HTP runs
    # the ops the HTP does run (MatMul, Softmax, ...) are filed under their real cause
    assert re.search(r"^  op not supported: ConstantOfShape x6, Shape x2$", out, re.MULTILINE)
    assert re.search(r"^  shape unknown until run time: .*MatMul x4.*Softmax x2", out, re.MULTILINE)
    # static inputs: the advice is to fold the shape arithmetic, not to fix input shapes
    assert "constant folding (`qnnpasses run`" in out


def _has_option(command: str, option: str) -> bool:
    from qnnpasses.cli import build_parser

    action = next(a for a in build_parser()._actions if a.dest == "command")
    return any(option in a.option_strings for a in action.choices[command]._actions)


def test_lint_severities_are_the_listed_ones_and_fail_the_default(tmp_path, capsys):
    _, listing, _ = cli(capsys, "lint", "--list-rules")
    listed = {m.group(1): m.group(2) for m in re.finditer(r"^(QP\d{3})\s+\S+\s+(error|warning|info)\b", listing, re.M)}
    code, out, _ = cli(capsys, "lint", TINY, "--as-written", "--format", "json") if _has_option("lint", "--as-written") \
        else cli(capsys, "lint", TINY, "--format", "json")
    findings = json.loads(out)["findings"]
    assert findings and all(f["severity"] == listed[f["rule"]] for f in findings)
    assert not any(LEAKS.search(f["message"]) for f in findings)
    assert code == (1 if any(f["severity"] == "error" for f in findings) else 0)
    # a node the HTP does not run is an error (as listed), so the default --fail-on error fails the model
    code, out, _ = cli(capsys, "lint", _erf_model(tmp_path / "erf.onnx"), "--format", "json")
    [erf] = [f for f in json.loads(out)["findings"] if f["node"] == "erf"]
    assert code == 1 and (erf["rule"], erf["severity"], listed["QP001"]) == ("QP001", "error", "error")


def test_a_crashing_lint_rule_is_reported_not_hidden(capsys, monkeypatch, tmp_path):
    from qnnpasses.lint import all_rules
    from qnnpasses.lint.registry import RULES

    rule = next(r for r in all_rules() if r.id == "QP011")

    def broken(ctx, r):
        raise RuntimeError("boom")

    monkeypatch.setitem(RULES, "QP011", type(rule)(rule.id, rule.name, rule.severity, rule.summary, rule.fix,
                                                   rule.help_uri, broken))
    sarif = tmp_path / "lint.sarif"
    code, _, err = cli(capsys, "lint", TINY, "--format", "sarif", "-o", sarif, "--fail-on", "never")
    [invocation] = json.loads(sarif.read_text())["runs"][0]["invocations"]
    assert code == 3 and "rule QP011 crashed" in err
    assert invocation["executionSuccessful"] is False
    [note] = invocation["toolExecutionNotifications"]
    assert note["level"] == "error" and note["descriptor"]["id"] == "QP011" and "boom" in note["message"]["text"]
    code, out, _ = cli(capsys, "lint", TINY, "--fail-on", "never")
    assert code == 3 and "error: rule QP011 decomposed-rmsnorm crashed and was skipped (RuntimeError: boom)" in out


def test_lint_sarif_into_a_closed_pipe_ends_quietly():
    proc = subprocess.Popen([sys.executable, "-m", "qnnpasses.cli", "lint", "--format", "sarif", str(TINY)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()  # like `| head -1`
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert "BrokenPipe" not in err and "internal error" not in err and "Traceback" not in err


def test_shape_works_wherever_a_model_is_loaded(tmp_path, capsys):
    model = tmp_path / "dyn.onnx"
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
    original = model.read_bytes()
    _, free, _ = cli(capsys, "lint", model, "--format", "json")
    _, fixed, _ = cli(capsys, "lint", model, "--shape", "x=1,16", "--format", "json")
    assert "x" in {f["node"] for f in json.loads(free)["findings"] if f["rule"] == "QP004"}
    assert not [f for f in json.loads(fixed)["findings"] if f["rule"] == "QP004"]
    code, out, _ = cli(capsys, "analyze", model, "--shape", "x=4,16", "--format", "json")
    assert code == 0 and json.loads(out)["activations"]["unknown_size_tensors"] == []
    code, _, err = cli(capsys, "check", model, "--shape", "nope=1")
    assert code == 2 and "unknown inputs" in err
    assert model.read_bytes() == original  # the input is never modified


# --------------------------------------------------------------------------- compare --bisect


def _masked_model(mask_value: float, scale: float) -> onnx.ModelProto:
    """x + mask -> Softmax -> * w: the mask hides the second half of every row."""
    mask = np.zeros((1, 8), np.float32)
    mask[:, 4:] = mask_value
    nodes = [helper.make_node("Add", ["x", "mask"], ["masked"], name="add_mask"),
             helper.make_node("Softmax", ["masked"], ["probs"], name="softmax", axis=-1),
             helper.make_node("Mul", ["probs", "w"], ["y"], name="scale")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
                              [numpy_helper.from_array(mask, "mask"),
                               numpy_helper.from_array(np.full((1, 8), scale, np.float32), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_bisect_judges_a_mask_by_its_effect_and_names_the_real_fault(tmp_path, capsys):
    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    onnx.save(_masked_model(float(np.finfo(np.float32).min), 1.0), a)
    onnx.save(_masked_model(-1e4, 1.5), b)  # a finite mask (harmless) and a real fault after it
    code, out, _ = cli(capsys, "compare", a, b, "--bisect", "--format", "json")
    report = json.loads(out)
    assert code == 0 and not report["outputs"]["ok"]
    assert report["first_bad_node"] == "scale"  # not add_mask, whose -1e4 masks the same as -3.4e38
    assert next(d for d in report["compared"] if d["name"] == "masked")["ok"]


def test_bisect_raises_no_alarm_when_the_outputs_agree(htp_llm, capsys):
    code, out, _ = cli(capsys, "compare", TINY, htp_llm, "--bisect")
    assert code == 0 and "first bad node" not in out
    assert "bisect: not needed, the outputs agree within tolerance" in out


# --------------------------------------------------------------------------- run


def test_run_summary_fits_80_columns_and_keeps_internals_in_the_report(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    report_dir = tmp_path / "report"
    code, out, err = cli(capsys, "run", TINY, "-o", tmp_path / "o.onnx", "--report-dir", report_dir)
    assert code == 0
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "own_fold_seconds" not in out and "rows2d" not in out and "fold_seconds" not in out
    assert re.search(r"^unchanged: \d+ pass\(es\)", out, re.MULTILINE)
    rows = [line for line in out.splitlines() if re.match(r"^\s*\d+\s+[a-z]", line)]
    report = json.loads((report_dir / "report.json").read_text())
    changed = [p for p in report["passes"] if p["status"] in ("changed", "rolled-back")]
    assert len(rows) == len(changed) < len(report["passes"])  # one row per pass that did something
    assert "opset raised 17 -> 23 by fuse-rmsnorm" in out
    assert any("nodes_before" in p["stats"] for p in report["passes"])  # the counters stay in report.json
    markdown = (report_dir / "report.md").read_text()
    assert "{'" not in markdown and re.search(r"\| weight bytes \| \d+\.\d KiB \|", markdown)
    assert "| predicted partitions | HTP " in markdown


@requires_htp
def test_target_opset_keeps_the_older_form_fp16_safe_and_on_the_htp(tmp_path, capsys):
    from qnnpasses.backends.htp import probe_placement

    out = tmp_path / "o17.onnx"
    code, text, _ = cli(capsys, "run", TINY, "-o", out, "--target-opset", "17")
    model = onnx.load(out)
    assert code == 0 and [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [17]
    assert "above --target-opset 17" in text and "RMSNormalization" not in {n.op_type for n in model.graph.node}
    placement = probe_placement(out)
    assert placement.ok and placement.qnn_partitions == 1 and not placement.cpu_nodes
    code, text, _ = cli(capsys, "compare", TINY, out, "--on", "htp", "--format", "json")
    assert code == 0 and json.loads(text)["ok"]
    code, _, err = cli(capsys, "run", out, "-o", tmp_path / "x.onnx", "--target-opset", "13")
    assert code == 0 or "above --target-opset" in err


def test_emit_without_a_backend_says_so(tmp_path, capsys, monkeypatch):
    import qnnpasses.backends.htp as htp

    monkeypatch.setattr(htp, "htp_available", lambda: False)
    emit = tmp_path / "emit"
    code, out, err = cli(capsys, "run", TINY, "-o", tmp_path / "o.onnx", "-q", "--emit-dir", emit)
    assert code == 0 and (emit / "qnn_package" / "convert.sh").exists()
    assert f"converter package: {emit / 'qnn_package'}" in out
    assert "warning: --emit-dir wrote only the converter package" in err
    code, _, err = cli(capsys, "run", TINY, "-o", tmp_path / "o2.onnx", "-q", "--emit-dir", emit, "--strict")
    assert code == 1 and "no compiled context model" in err


# --------------------------------------------------------------------------- quantize, partition, analyze


def test_quantize_reads_a_relative_calibration_folder(tmp_path, capsys, monkeypatch):
    samples = dict(np.load(ROOT / "examples" / "tiny_llama.inputs.npz"))
    (tmp_path / "cal").mkdir()
    for i in range(3):
        np.savez(tmp_path / "cal" / f"sample_{i}.npz", **samples)
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, "quantize", TINY, "--calib", "cal", "-o", "q.onnx")
    assert code == 0 and (tmp_path / "q.onnx").exists(), err
    assert "calibrated on 3 sample(s) from cal (minmax)" in out and "{'" not in out
    assert "calibrating on 3 sample(s)" in err  # progress


def test_partition_accounts_for_every_node_and_draws_png_and_svg(tmp_path, capsys):
    code, text, _ = cli(capsys, "partition", TINY, "--out-dir", tmp_path / "deployed", "--no-picture")
    # by default the graph every onnxruntime session hands the HTP: shape arithmetic folded, one HTP part
    assert code == 0 and re.search(r"onnxruntime folds \d+ of the 288 nodes", text)
    assert re.search(r"^  (\d+) nodes: \1 in partitions$", text, re.MULTILINE)  # every node it sees is placed
    assert json.loads((tmp_path / "deployed" / "plan.json").read_text())["counts"] == {"htp": 1}
    out = tmp_path / "parts"
    code, text, _ = cli(capsys, "partition", TINY, "--out-dir", out, "--as-written")
    plan = json.loads((out / "plan.json").read_text())
    placed = sum(len(p["nodes"]) for p in plan["partitions"])
    constant = len({n for p in plan["partitions"] for n in p["constant_nodes"]})
    assert code == 0 and placed + constant == 288
    assert f"288 nodes: {placed} in partitions, {constant} compute only constants" in text
    assert not re.search(r"\d MB|\d kB|MFLOP\b", text) and "KiB" in text and not LEAKS.search(text)
    assert (out / "partitions.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = (out / "partitions.svg").read_text()
    assert all(f"#{p['id']} {p['backend'].upper()}" in svg for p in plan["partitions"])


def test_analyze_picture_labels_the_peak_and_the_layers(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    svg = tmp_path / "memory.svg"
    code, out, _ = cli(capsys, "analyze", TINY, "--picture", svg)
    peak = re.search(r"peak live set\s+(\d+\.\d KiB)", out).group(1)
    text = svg.read_text()
    assert code == 0 and f"peak {peak}" in text and "layer 0" in text and "layer 1" in text
    assert re.search(r"weights: \d+\.\d KiB", out)  # one decimal, binary units


# --------------------------------------------------------------------------- the real backend


def _fresh_cli(*argv) -> tuple[int, str, str]:
    """The command in a new process: the backend logs its start-up lines only once per process,
    so an in-process run after other backend tests may have nothing left to summarise."""
    done = subprocess.run([sys.executable, "-m", "qnnpasses.cli", *map(str, argv)], capture_output=True, text=True,
                          timeout=600)
    return done.returncode, done.stdout, done.stderr


@requires_htp
def test_backend_log_is_captured_summarised_and_shown_with_v(htp_llm):
    code, out, err = _fresh_cli("compare", TINY, htp_llm, "--on", "htp")
    assert code == 0 and "\x1b[" not in out + err and "LIBNATIVE" not in out + err
    assert re.search(r"the backend logged \d+ line\(s\).*; -v shows them", err)
    assert "preparing" in err  # progress
    code, out, err = _fresh_cli("compare", TINY, htp_llm, "--on", "htp", "-v")
    assert code == 0 and "\x1b[" not in err and re.search(r"^backend: .*QnnEp", err, re.MULTILINE)


def _erf_model(path: Path) -> Path:
    """MatMul -> Erf -> MatMul: the HTP runs the MatMuls, not the Erf."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Erf", ["h"], ["e"], name="erf"),
             helper.make_node("MatMul", ["e", "w2"], ["y"], name="mm2")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])],
                              [numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), n)
                               for n in ("w1", "w2")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@requires_htp
@pytest.mark.parametrize("case", ["erf", "example", "htp-llm"])
def test_check_lint_diagnose_compile_partition_give_one_verdict(case, htp_llm, tmp_path, capsys):
    """The example as exported (shape arithmetic onnxruntime folds on load), after htp-llm, and
    a model with an Erf: every command names the same nodes off the HTP."""
    model = {"erf": _erf_model(tmp_path / "erf.onnx"), "example": TINY, "htp-llm": htp_llm}[case]
    expected_off = {"erf"} if case == "erf" else set()
    _, out, _ = cli(capsys, "check", model, "--format", "json")
    assert {n["name"] for n in json.loads(out)["nodes"] if not n["supported"]} == expected_off
    # lint's errors are exactly check's CPU nodes (constant-foldable nodes are QP020 warnings)
    code, out, _ = cli(capsys, "lint", model, "--format", "json", "--fail-on", "error")
    findings = json.loads(out)["findings"]
    errors = {f["node"] for f in findings if f["severity"] == "error"}
    assert errors == expected_off and code == (1 if expected_off else 0)
    if case == "example":
        assert any(f["rule"] == "QP020" and f["severity"] == "warning" for f in findings)
    code, out, _ = cli(capsys, "diagnose", model, "--format", "json")
    diagnosis = json.loads(out)
    assert code == 0 and diagnosis["ok"] and set(diagnosis["cpu_nodes"]) == expected_off
    code, out, err = cli(capsys, "compile", model, "-o", tmp_path / "ctx.onnx", "--no-timing", "--format", "json")
    compiled = json.loads(out)
    assert code == 0 and compiled["context"]["other_nodes"] == len(expected_off)
    assert "compiling" in err and "into an HTP context binary" in err  # progress
    # --keep-islands: place by support alone (the cost model would also move tiny HTP islands to the CPU)
    code, out, _ = cli(capsys, "partition", model, "--out-dir", tmp_path / "parts", "--keep-islands", "--format", "json")
    plan = json.loads((tmp_path / "parts" / "plan.json").read_text())
    on_cpu = {n for p in plan["partitions"] if p["backend"] == "cpu" for n in p["nodes"]}
    assert code == 0 and on_cpu == expected_off


@requires_htp
def test_sweep_says_when_its_png_cannot_be_drawn(tmp_path, monkeypatch, capsys):
    from qnnpasses.ir.load import load_model
    from qnnpasses.quant import sweep as sweep_module
    from qnnpasses.quant.data import token_windows
    from qnnpasses.quant.policy import PrecisionPolicy

    ir = load_model(TINY)
    np.savez(tmp_path / "calib.npz", **token_windows(ir, 2, seed=0, part="calib"))
    np.savez(tmp_path / "eval.npz", **token_windows(ir, 1, seed=0, part="eval"))
    monkeypatch.setattr(sweep_module, "grid", lambda *a, **k: [PrecisionPolicy()])  # one cell is enough here
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "sweep"
    code, text, err = cli(capsys, "sweep", TINY, "--calib", tmp_path / "calib.npz", "--eval", tmp_path / "eval.npz",
                          "--out-dir", out)
    assert code == 0 and (out / "sweep.md").exists() and not (out / "sweep.png").exists()
    assert "sweep.png not drawn: matplotlib is not installed" in err and "sweep.png" not in text.splitlines()[-1]
