"""The user's SoC: ``--soc`` / ``--htp-arch`` resolve through one registry
(:mod:`qnnpasses.backends.targets`), change what the backend compiles for (every target in the
registry compiles a graph here, each into a different context binary that runs and computes the
CPU's outputs), travel into ``llm.json`` and back out to ``generate``, and bad names get one
line and exit 2 on every command that talks to the backend."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import onnx
import pytest
from conftest import fixture_path, requires_htp
from onnx import TensorProto, helper

from qnnpasses.backends.targets import DEFAULT, TARGETS, active, activate, from_dict, resolve
from qnnpasses.cli import BACKEND_COMMANDS
from qnnpasses.cli import main as cli_main
from qnnpasses.errors import BadInputError


@pytest.fixture(autouse=True)
def default_target():
    """Each test starts and ends on the default target (the CLI activates one per command)."""
    activate(DEFAULT)
    yield
    activate(DEFAULT)


@pytest.mark.parametrize("text, part", [
    ("8gen3", "SM8650"), ("SM8650", "SM8650"), ("sm8650", "SM8650"), ("Snapdragon 8 Gen 3", "SM8650"),
    ("8-elite", "SM8750"), ("snapdragon-8-elite", "SM8750"), ("x-elite", "SC8380XP"), ("SA8295P", "SA8295P"),
])
def test_names_and_part_numbers_resolve(text, part):
    assert resolve(text).part == part


def test_arch_alone_and_the_default():
    assert resolve() is DEFAULT and (DEFAULT.soc_model, DEFAULT.htp_arch) == (60, 73)
    assert resolve(htp_arch="v79").part == "SM8750" and resolve(htp_arch="75").part == "SM8650"
    assert resolve("8elite", "v79").part == "SM8750"
    assert from_dict(resolve("8gen3").as_dict()) == resolve("8gen3") and from_dict(None) is DEFAULT


@pytest.mark.parametrize("soc, arch, message", [
    ("8gen9", None, "unknown SoC"), (None, "v99", "unknown HTP arch"), (None, "seventy", "unknown HTP arch"),
    ("8gen3", "v79", "contradicts"),
])
def test_bad_names_are_refused(soc, arch, message):
    with pytest.raises(BadInputError, match=message):
        resolve(soc, arch)


@pytest.mark.parametrize("command", BACKEND_COMMANDS)
@pytest.mark.parametrize("option, message", [(["--soc", "8gen9"], "unknown SoC"),
                                             (["--htp-arch", "v99"], "unknown HTP arch"),
                                             (["--soc", "8gen3", "--htp-arch", "v73"], "contradicts")])
def test_every_backend_command_refuses_a_bad_target(command, option, message, tmp_path, capsys):
    """One line and exit 2, before the command reads its arguments' files (they do not exist)."""
    args = {"compare": ["a.onnx", "b.onnx"], "generate": ["dir", "--prompt-ids", "1"],
            "llm": ["m.onnx", "--out-dir", "o", "--context", "8", "--prefill", "2"],
            "compile": ["m.onnx", "-o", "o.onnx"], "run": ["m.onnx", "-o", "o.onnx"],
            "quantize": ["m.onnx", "-o", "o.onnx", "--calib", "c.npz"],
            "sweep": ["m.onnx", "--calib", "c.npz", "--eval", "e.npz"]}.get(command, ["m.onnx"])
    code = cli_main([command, *[str(tmp_path / a) if a.endswith(".onnx") else a for a in args], *option])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err


def test_cli_activates_the_target_for_child_processes(tmp_path, capsys):
    model = fixture_path("llama_gqa_ts")
    assert cli_main(["check", str(model), "--soc", "8gen2", "--format", "json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    # the 8 Gen 2 is a v73 part: the v73 table, measured on the X Elite, predicts; the check says so
    assert summary["target"]["part"] == "SM8550" and "measured on soc_model 60 / HTP v73" in summary["table_note"]
    assert active().part == "SM8550"
    import os

    from qnnpasses.backends.targets import ENV

    assert os.environ[ENV] == "8gen2"  # what the probe and compile children read


def test_each_arch_checks_against_its_own_table(capsys):
    """``load_table("htp")`` follows the active target's arch; an arch without a table of its own
    uses v73's."""
    from qnnpasses.op_support.table import TABLES_DIR, load_table

    for target in TARGETS:
        activate(target)
        own = TABLES_DIR / f"htp_v{target.htp_arch}.json"
        want = f"v{target.htp_arch}" if own.is_file() else "v73"
        assert load_table("htp")["htp_arch"] == want, target
    assert (TABLES_DIR / "htp_v75.json").is_file()
    assert cli_main(["check", str(fixture_path("llama_gqa_ts")), "--soc", "8gen3", "--format", "json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert summary["target"]["htp_arch"] == "v75" and "table_note" not in summary  # measured on the 8 Gen 3 itself


def tiny_model(path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16])
    w = helper.make_tensor("w", TensorProto.FLOAT, [16, 16], np.random.default_rng(0).random(256, np.float32))
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["m"]),
                               helper.make_node("Softmax", ["m"], ["s"], axis=-1),
                               helper.make_node("Mul", ["s", "x"], ["y"])], "tiny", [x], [y], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, path)


#: SoC models onnxruntime-qnn 2.7.0's backend leaves every node of to the CPU (the 8s Gen 3).
REJECTED_HERE = {"SM8635"}


def compile_for(target, tmp_path, capsys) -> str | None:
    """Compile the tiny model for ``target`` through the CLI: the context binary's hash, or None
    when the backend does not accept the target (then the command must say so: one line, exit 2)."""
    folder = tmp_path / target.name
    folder.mkdir()
    tiny_model(folder / "tiny.onnx")
    out = folder / "tiny_ctx.onnx"
    code = cli_main(["compile", str(folder / "tiny.onnx"), "-o", str(out), "--soc", target.part, "--embed", "yes",
                     "--no-timing", "--format", "json"])
    captured = capsys.readouterr()
    if code == 2:
        assert target.part in REJECTED_HERE and captured.out == "", captured.err
        assert f"does not accept {target}" in captured.err.splitlines()[0] and not out.exists()
        return None
    report = json.loads(captured.out)
    assert code == 0 and report["ok"] and report["target"] == target.as_dict()
    assert all(d["cosine"] >= 0.999 for d in report["accuracy"].values())  # vs fp32 CPU, loaded in a fresh process
    node = next(n for n in onnx.load(out).graph.node if n.op_type == "EPContext")
    return hashlib.sha256(next(a.s for a in node.attribute if a.name == "ep_cache_context")).hexdigest()


@requires_htp
def test_every_target_compiles_its_own_binary(tmp_path, capsys):
    """Every target the backend accepts compiles and runs, each into a different context binary; one
    it does not accept is refused (the 8s Gen 3 with onnxruntime-qnn 2.7.0; a later backend that
    accepts it must compile it)."""
    binaries = {t.part: compile_for(t, tmp_path, capsys) for t in TARGETS}
    compiled = [h for h in binaries.values() if h is not None]
    assert len(compiled) >= len(TARGETS) - len(REJECTED_HERE)
    assert len(set(compiled)) == len(compiled), binaries


@requires_htp
def test_llm_records_the_target_and_generate_uses_it(tmp_path, capsys):
    source = fixture_path("llama_gqa_kv_dyn_ts")
    out = tmp_path / "pair"
    assert cli_main(["llm", str(source), "--out-dir", str(out), "--context", "32", "--prefill", "4",
                     "--soc", "8gen3", "--format", "json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest["target"] == resolve("8gen3").as_dict()
    activate(DEFAULT)  # a later command without --soc must take the bundle's target, not the last one
    run = ["generate", str(out), "--prompt-ids", "5,6,7,8,9", "--max-new-tokens", "4", "--format", "json"]
    assert cli_main([*run, "--on", "cpu"]) == 0
    cpu = json.loads(capsys.readouterr().out)
    assert cli_main([*run, "--on", "htp"]) == 0
    htp = json.loads(capsys.readouterr().out)
    assert htp["target"]["part"] == "SM8650" and htp["tokens"] == cpu["tokens"]
    assert cli_main([*run, "--on", "htp", "--soc", "8elite"]) == 0
    assert json.loads(capsys.readouterr().out)["target"]["part"] == "SM8750"


def test_device_footprint_and_the_bandwidth_ceiling(tmp_path):
    """llm.json's ``device`` entry against sums made here from the graphs' own tensors: weights in
    the HTP's fp16, the cache in its dtype, and the decode ceiling = bandwidth / bytes read."""
    import qnnpasses.passes  # noqa: F401 - registers the passes the llm build runs
    from onnx import numpy_helper

    from qnnpasses.llm.convert import build

    target = activate(resolve("8elite"))
    manifest = build(fixture_path("llama_gqa_kv_dyn_ts"), tmp_path / "pair", context=64, prefill=8, compile=False,
                     probe=False)
    device = manifest["device"]

    def fp16_bytes(name: str) -> int:
        model = onnx.load(str(tmp_path / "pair" / name))
        arrays = [numpy_helper.to_array(t) for t in model.graph.initializer]
        return sum(a.size * (2 if a.dtype.kind == "f" else a.itemsize) for a in arrays)

    assert device["graphs"]["decode"]["weight_bytes"] == fp16_bytes("decode.onnx")
    assert device["graphs"]["prefill"]["weight_bytes"] == fp16_bytes("prefill.onnx")
    item = np.dtype(manifest["kv_dtype"]).itemsize
    per_token = 2 * manifest["layers"] * manifest["kv_heads"] * manifest["head_dim"] * item
    assert device["kv_cache_bytes"] == per_token * 64
    read = fp16_bytes("decode.onnx") + per_token * 64  # 63 cached slots read + 1 new written
    assert device["decode_step_read_bytes"] == read
    assert target.memory_bytes_per_second == 10600e6 * 8
    assert device["decode_tokens_per_second_ceiling"] == round(target.memory_bytes_per_second / read, 1)
    assert device["device_bytes"] == fp16_bytes("decode.onnx") + fp16_bytes("prefill.onnx") + per_token * 64
    # every target of known bandwidth: the same bytes over its bandwidth; a prefill call reads the
    # prefill graph's weights and all 64 slots (56 cached + 8 new)
    prefill_read = fp16_bytes("prefill.onnx") + per_token * 64
    assert device["prefill_call_read_bytes"] == prefill_read
    known = [t for t in TARGETS if t.memory_bytes_per_second]
    assert [r["target"] for r in device["ceilings"]] == [t.name for t in known] and len(known) >= 4
    for row, t in zip(device["ceilings"], known):
        assert row["decode_tokens_per_second"] == round(t.memory_bytes_per_second / read, 1)
        assert row["prefill_call_seconds"] == round(prefill_read / t.memory_bytes_per_second, 5)


def test_docs_targets_md_is_rendered_from_what_the_tool_measured():
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tools"))
    import targets_doc

    data = json.loads((root / "docs" / "targets.json").read_text())
    assert (root / "docs" / "targets.md").read_text() == targets_doc.render(data), "run python tools/targets_doc.py"
    accepted = {name for name, v in data["targets"].items() if v and v["accepted"]}
    assert {t.name for t in TARGETS} - accepted == {"8sgen3"}  # onnxruntime-qnn 2.7.0, as REJECTED_HERE says
