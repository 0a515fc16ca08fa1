"""compile: a real HTP compile through the ONNX Runtime QNN EP into an EPContext model, checked
against the original (the report also times loading it against compiling from the ONNX graph)."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from conftest import fixture_inputs, fixture_path, requires_htp

from qnnpasses.cli import main as cli_main
from qnnpasses.handoff.compile import compile_and_verify
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import save_model
from qnnpasses.passmanager.api import PassContext
from qnnpasses.passmanager.manager import PassManager, RunConfig
from qnnpasses.passmanager.spec import parse_pipeline

pytestmark = requires_htp


def _simplified(name: str, folder: Path) -> Path:
    ir = load_model(fixture_path(name))
    PassManager(parse_pipeline("simplify"), RunConfig(), [], PassContext()).run(ir)
    return save_model(ir, folder / f"{name}_s.onnx")


@pytest.mark.parametrize("name", ["llama_gqa_ts", "gpt2_ts"])
def test_compiled_context_runs_fully_on_htp_and_matches(name, tmp_path, capsys):
    model = _simplified(name, tmp_path)
    out = tmp_path / f"{name}_ctx.onnx"
    assert cli_main(["compile", str(model), "-o", str(out), "--inputs", str(fixture_path(name).with_suffix(".inputs.npz")),
                     "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # the whole graph became one HTP context binary, embedded in the model
    assert report["context"] == {**report["context"], "epcontext_nodes": 1, "other_nodes": 0, "embed_mode": [1]}
    proto = onnx.load(out)
    assert [n.op_type for n in proto.graph.node] == ["EPContext"]
    # fp16 on the HTP vs the fixture's fp32 reference
    assert report["accuracy"]["logits"]["cosine"] >= 0.999 and report["accuracy"]["logits"]["max_abs"] < 0.05
    # the context is the same prepared graph as a session built from the ONNX model: identical outputs
    assert report["context_vs_onnx_on_htp"]["logits"]["max_abs"] == 0.0
    # loading the context skips graph preparation (timed in the report, never asserted: no wall-clock tests)
    print(f"{name}: session from ONNX {report['load_from_onnx']['session_seconds']:.3f} s, "
          f"from EPContext {report['load_from_context']['session_seconds']:.3f} s")


def test_context_beside_the_model_and_reference_outputs(tmp_path):
    model = _simplified("llama_gqa_ts", tmp_path)
    out = tmp_path / "ext_ctx.onnx"
    report = compile_and_verify(model, out, embed=False, inputs=fixture_inputs("llama_gqa_ts"), measure=False)
    assert report["ok"] and report["context"]["embed_mode"] == [0]
    attrs = {a.name: a for a in onnx.load(out).graph.node[0].attribute}
    beside = tmp_path / attrs["ep_cache_context"].s.decode()
    assert beside.exists() and beside.stat().st_size > out.stat().st_size   # the binary lives beside the model
    assert report["accuracy"]["logits"]["cosine"] >= 0.999 and report["accuracy"]["logits"]["max_abs"] < 0.05


def test_qdq_compile_runs_in_integer_precision(tmp_path):
    model = _simplified("gpt2_ts", tmp_path)
    out = tmp_path / "q_ctx.onnx"
    report = compile_and_verify(model, out, mode="qdq", inputs=fixture_inputs("gpt2_ts"), measure=False)
    assert report["compile"]["ok"] and Path(report["compiled_from"]).name == "q_ctx.qdq.onnx"
    qdq = onnx.load(report["compiled_from"])
    assert sum(n.op_type == "QuantizeLinear" for n in qdq.graph.node) > 10
    assert report["context"]["epcontext_nodes"] == 1
    # uint16 activations / uint8 weights, one calibration sample, random weights: ~0.97
    assert report["ok"] and report["accuracy"]["logits"]["cosine"] >= 0.95
