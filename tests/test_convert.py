"""convert: the qnn-onnx-converter package — input_list.txt/raw files that round-trip to the
calibration tensors exactly, convert.sh with documented options only, and the SDK run."""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
from pathlib import Path

import numpy as np
from conftest import fixture_inputs, fixture_path

from qnnpasses.cli import main as cli_main
from qnnpasses.handoff.inputs import read_samples
from qnnpasses.ir.load import load_model

# Options convert.sh may use, each checked against the QNN SDK documentation:
#   qnn-onnx-converter: docs.qualcomm.com/bundle/publicresource/topics/80-63442-50/tools.html#qnn-onnx-converter
#     (--input_network, --output_path and --input_list also in the example commands of
#     docs.qualcomm.com/bundle/publicresource/80-70014-15BY/topics/qnn-port-model.md;
#     --quantization_overrides, --use_native_input_files, --float_bitwidth in the converter's option list)
#   qnn-model-lib-generator: docs.qualcomm.com/bundle/publicresource/80-62010-1KO/topics/generate-qnn.md
#     (-c model.cpp -b model.bin -o DIR -t TARGET)
#   qnn-context-binary-generator: docs.qualcomm.com/bundle/publicresource/80-63442-10/topics/la_gvm.md
#     (--backend libQnnHtp.so --model lib<model>.so --binary_file NAME -> output/NAME.bin)
DOCUMENTED = {
    "qnn-onnx-converter": {"--input_network", "--output_path", "--input_list", "--quantization_overrides",
                           "--use_native_input_files", "--float_bitwidth"},
    "qnn-model-lib-generator": {"-c", "-b", "-o", "-t"},
    "qnn-context-binary-generator": {"--backend", "--model", "--binary_file"},
}


def _script_options(script: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in script.splitlines():
        if line.startswith(("#", "echo")):
            continue
        words = shlex.split(line)
        for i, word in enumerate(words):
            tool = os.path.basename(word)
            if tool in DOCUMENTED:
                found[tool] = [w for w in words[i + 1:] if w.startswith("-")]
    return found


def _stacked(name: str, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """n calibration samples shaped like the fixture's inputs, stacked on a leading axis."""
    rng = np.random.default_rng(seed)
    base = fixture_inputs(name)
    out = {}
    for k, v in base.items():
        if v.dtype.kind == "f":
            out[k] = rng.standard_normal((n, *v.shape)).astype(v.dtype)
        else:
            out[k] = np.stack([rng.integers(0, 200, v.shape).astype(v.dtype) for _ in range(n)])
    return out


def test_multi_input_package_round_trips_exactly(tmp_path, capsys):
    calib = _stacked("llama_gqa_ts", 3)
    np.savez(tmp_path / "calib.npz", **calib)
    out = tmp_path / "pkg"
    assert cli_main(["convert", str(fixture_path("llama_gqa_ts")), "-o", str(out), "--calib", str(tmp_path / "calib.npz")]) == 0
    assert "no QNN SDK found" in capsys.readouterr().out
    lines = (out / "input_list.txt").read_text().splitlines()
    assert len(lines) == 3
    # multi-input lines: "<input_name>:=<path>" entries separated by spaces, paths relative to the package
    for i, line in enumerate(lines):
        entries = dict(e.split(":=") for e in line.split(" "))
        assert list(entries) == ["input_ids", "attention_mask"]
        for name, rel in entries.items():
            # int64 inputs are int32 raw files (QNN narrows 64-bit integers), native layout, no header
            raw = np.fromfile(out / rel, dtype=np.int32).reshape(calib[name].shape[1:])
            assert np.array_equal(raw.astype(np.int64), calib[name][i])
    back = read_samples(out)
    assert len(back) == 3 and all(np.array_equal(back[i][k], calib[k][i]) and back[i][k].dtype == np.int64
                                  for i in range(3) for k in calib)
    # with calibration data the mixed-precision plan goes in by default, in both AIMET layouts
    assert _script_options((out / "convert.sh").read_text())["qnn-onnx-converter"] == [
        "--input_network", "--output_path", "--input_list", "--use_native_input_files", "--quantization_overrides"]
    plan = json.loads((out / "quant_overrides.json").read_text())
    v2 = json.loads((out / "quant_overrides.v2.json").read_text())
    assert plan["version"] == "1.0.0" and v2["version"] == "2.0.0"
    names = {t.name for t in load_model(out / "model.onnx").graph.tensors().values()}
    assert {e["name"] for e in v2["encodings"]} <= names  # the plan names tensors of the packaged model
    assert any(e["bw"] == 16 for e in plan["activation_encodings"])


def test_no_plan_keeps_the_model_as_given(tmp_path):
    np.savez(tmp_path / "calib.npz", **_stacked("llama_gqa_ts", 2))
    out = tmp_path / "pkg"
    assert cli_main(["convert", str(fixture_path("llama_gqa_ts")), "-o", str(out), "--calib", str(tmp_path / "calib.npz"),
                     "--no-plan"]) == 0
    assert not (out / "quant_overrides.json").exists()
    assert "--quantization_overrides" not in _script_options((out / "convert.sh").read_text())["qnn-onnx-converter"]


def test_single_float_input_folder_and_existing_list(tmp_path):
    model = tmp_path / "m.onnx"
    from test_partition import _erf_residual

    _erf_residual(model)
    folder = tmp_path / "calib"
    folder.mkdir()
    rng = np.random.default_rng(1)
    samples = [rng.standard_normal((1, 64, 256)).astype(np.float32) for _ in range(2)]
    for i, x in enumerate(samples):
        np.savez(folder / f"s{i}.npz", x=x)
    assert cli_main(["convert", str(model), "-o", str(tmp_path / "a"), "--calib", str(folder)]) == 0
    lines = (tmp_path / "a" / "input_list.txt").read_text().splitlines()
    assert lines == ["inputs/0000/x.raw", "inputs/0001/x.raw"]          # one path per line for one input
    for line, x in zip(lines, samples):
        assert (tmp_path / "a" / line).read_bytes() == x.tobytes()      # float32 bytes, nothing else
    # an existing input_list.txt is accepted as calibration data and copied into the new package
    assert cli_main(["convert", str(model), "-o", str(tmp_path / "b"), "--calib", str(tmp_path / "a" / "input_list.txt")]) == 0
    again = read_samples(tmp_path / "b")
    assert all(np.array_equal(a["x"], x) for a, x in zip(again, samples))
    opts = _script_options((tmp_path / "b" / "convert.sh").read_text())
    assert "--use_native_input_files" not in opts["qnn-onnx-converter"]


def test_convert_sh_uses_documented_options_only(tmp_path):
    np.savez(tmp_path / "calib.npz", **fixture_inputs("llama_gqa_ts"))
    (tmp_path / "ov.json").write_text(json.dumps({"activation_encodings": {}, "param_encodings": {}}))
    out = tmp_path / "pkg"
    assert cli_main(["convert", str(fixture_path("llama_gqa_ts")), "-o", str(out), "--calib", str(tmp_path / "calib.npz"),
                     "--overrides", str(tmp_path / "ov.json")]) == 0
    assert json.loads((out / "quant_overrides.json").read_text()) == {"activation_encodings": {}, "param_encodings": {}}
    script = (out / "convert.sh").read_text()
    used = _script_options(script)
    assert set(used) == set(DOCUMENTED)
    for tool, options in used.items():
        assert set(options) <= DOCUMENTED[tool], f"{tool} uses undocumented {set(options) - DOCUMENTED[tool]}"
        for option in options:   # and the script cites a doc page for each option
            assert re.search(rf"^#\s+{re.escape(tool)} {re.escape(option)}: https://docs\.qualcomm\.com/", script, re.MULTILINE)
    # without calibration the float model is converted for fp16 (the HTP has no fp32)
    assert cli_main(["convert", str(fixture_path("llama_gqa_ts")), "-o", str(tmp_path / "f")]) == 0
    float_opts = _script_options((tmp_path / "f" / "convert.sh").read_text())["qnn-onnx-converter"]
    assert "--float_bitwidth" in float_opts and "--input_list" not in float_opts


def _fake_sdk(root: Path) -> Path:
    """Stand-ins for the three tools: they log their argv and write the files the real ones would."""
    bin_dir = root / "bin" / "x86_64-linux-clang"
    bin_dir.mkdir(parents=True)
    (root / "lib" / "x86_64-linux-clang").mkdir(parents=True)
    (root / "lib" / "x86_64-linux-clang" / "libQnnHtp.so").write_bytes(b"")
    writes = {"qnn-onnx-converter": "qnn/model.cpp", "qnn-model-lib-generator": "qnn/lib/x86_64-linux-clang/libmodel.so",
              "qnn-context-binary-generator": "output/model.serialized.bin"}
    for tool, target in writes.items():
        path = bin_dir / tool
        path.write_text(
            "#!/usr/bin/env python3\nimport json, os, sys\n"
            f"open('calls.jsonl', 'a').write(json.dumps([{tool!r}] + sys.argv[1:]) + '\\n')\n"
            f"os.makedirs(os.path.dirname({target!r}), exist_ok=True)\nopen({target!r}, 'w').write('x')\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return root


def test_sdk_tools_run_in_order_with_argument_lists(tmp_path, capsys):
    sdk = _fake_sdk(tmp_path / "sdk")
    np.savez(tmp_path / "calib.npz", **fixture_inputs("llama_gqa_ts"))
    out = tmp_path / "pkg"
    assert cli_main(["convert", str(fixture_path("llama_gqa_ts")), "-o", str(out), "--calib", str(tmp_path / "calib.npz"),
                     "--sdk", str(sdk), "--format", "json", "--no-plan"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in report["steps"]] == list(DOCUMENTED) and all(s["returncode"] == 0 for s in report["steps"])
    calls = [json.loads(line) for line in (out / "calls.jsonl").read_text().splitlines()]
    assert [c[0] for c in calls] == list(DOCUMENTED)
    assert calls[0][1:] == ["--input_network", "model.onnx", "--output_path", "qnn/model.cpp",
                            "--input_list", "input_list.txt", "--use_native_input_files"]
    assert calls[2][calls[2].index("--backend") + 1] == str(sdk / "lib" / "x86_64-linux-clang" / "libQnnHtp.so")
    assert report["context_binary"].endswith("output/model.serialized.bin")


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("[1, 2]")
    model = str(fixture_path("llama_gqa_ts"))
    assert cli_main(["convert", model, "-o", str(tmp_path / "p"), "--overrides", str(tmp_path / "bad.json")]) == 2
    big = fixture_inputs("llama_gqa_ts")
    big["input_ids"] = big["input_ids"] + (1 << 40)                       # does not fit QNN's int32
    np.savez(tmp_path / "big.npz", **big)
    assert cli_main(["convert", model, "-o", str(tmp_path / "p"), "--calib", str(tmp_path / "big.npz")]) == 2
    np.savez(tmp_path / "wrong.npz", input_ids=big["input_ids"])
    assert cli_main(["convert", model, "-o", str(tmp_path / "p"), "--calib", str(tmp_path / "wrong.npz")]) == 2
    assert cli_main(["convert", model, "-o", str(tmp_path / "p"), "--sdk", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "JSON object" in err and "int32" in err and "missing ['attention_mask']" in err
