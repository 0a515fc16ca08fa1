"""``qnnpasses compare``: output accuracy and layer-by-layer bisection, on real fixtures."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from conftest import fixture_inputs, fixture_path, requires_htp
from onnx import numpy_helper

from qnnpasses.cli import main
from qnnpasses.debug import compare as compare_mod
from qnnpasses.debug.compare import (
    align_sentinels,
    bisect,
    compare_models,
    is_quantized,
)
from qnnpasses.ir.load import load_model

GOOD = "llama_gqa_ts"


def _layer1_mul_with_weight(proto: onnx.ModelProto) -> tuple[onnx.NodeProto, int, np.ndarray]:
    """The first Mul of layer 1 (by name or dynamo scope metadata) with a float initializer operand."""
    inits = {t.name: t for t in proto.graph.initializer}
    aliases = {n.output[0]: n.input[0] for n in proto.graph.node if n.op_type == "Identity"}
    for node in proto.graph.node:
        scope = "".join(p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes")
        if node.op_type != "Mul" or ("layers.1" not in node.name and "layers.1" not in scope):
            continue
        for index, name in enumerate(node.input):
            source = inits.get(aliases.get(name, name))
            if source is not None and source.data_type == onnx.TensorProto.FLOAT:
                return node, index, numpy_helper.to_array(source)
    raise AssertionError("no Mul with a weight in layer 1")


def perturbed_copy(name: str, path, factor: float = 1.05, rename: str | None = None) -> str:
    """The fixture with one layer-1 Mul's weight scaled by ``factor``; returns that Mul's name.

    With ``rename`` the Mul's output tensor gets a new name in the copy (its consumers follow).
    """
    proto = onnx.load(fixture_path(name))
    node, index, value = _layer1_mul_with_weight(proto)
    proto.graph.initializer.append(numpy_helper.from_array((value * factor).astype(np.float32), "perturbed_weight"))
    node.input[index] = "perturbed_weight"
    if rename:
        old = node.output[0]
        for other in proto.graph.node:
            other.input[:] = [rename if i == old else i for i in other.input]
        node.output[0] = rename
    onnx.save(proto, path)
    return node.name


def _cli(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_identical_models_agree_exactly():
    result = compare_models(fixture_path(GOOD), fixture_path(GOOD), fixture_inputs(GOOD))
    (logits,) = result["outputs"]
    assert result["ok"] and logits["max_abs"] == 0.0 and logits["cosine"] == pytest.approx(1.0)
    assert logits["top1_agreement"] == 1.0


@pytest.mark.parametrize("name", ["llama_gqa_ts", "llama_gqa_dynamo"])
def test_bisect_names_the_perturbed_node(tmp_path, name):
    bad = perturbed_copy(name, tmp_path / "b.onnx")
    result = bisect(fixture_path(name), tmp_path / "b.onnx", fixture_inputs(name))
    assert result.first_bad_node == bad and result.first_bad_op == "Mul"
    assert result.first_divergent.layer == "1" and result.unmapped_inputs == []
    assert not result.outputs["ok"]
    rows = {r["layer"]: r for r in result.layers}
    assert rows["pre"]["first_divergent"] is None and rows["0"]["first_divergent"] is None
    assert rows["0"]["worst_max_abs"] == 0.0  # everything before the perturbation is bit-identical
    assert rows["1"]["first_divergent"] == result.first_divergent.name
    assert len(result.compared) > 100


def test_bisect_maps_renamed_tensors_through_same_named_nodes(tmp_path):
    bad = perturbed_copy(GOOD, tmp_path / "b.onnx", rename="renamed_by_a_pass")
    result = bisect(fixture_path(GOOD), tmp_path / "b.onnx", fixture_inputs(GOOD))
    assert result.first_bad_node == bad
    assert result.first_divergent.b_name == "renamed_by_a_pass" and result.first_divergent.name != "renamed_by_a_pass"


def test_bisect_of_identical_models_finds_nothing():
    result = bisect(fixture_path("llama_gqa_dynamo"), fixture_path("llama_gqa_dynamo"), fixture_inputs("llama_gqa_dynamo"))
    # outputs agree: nothing is bisected, so nothing can be blamed
    assert result.first_bad_node is None and result.compared == [] and result.layers == []
    assert result.outputs["ok"] and "agree" in result.skipped


def test_cli_bisect_text_and_json(tmp_path, capsys):
    bad = perturbed_copy(GOOD, tmp_path / "b.onnx")
    inputs = fixture_path(GOOD).with_suffix(".inputs.npz")
    code, out, _ = _cli(capsys, "compare", fixture_path(GOOD), tmp_path / "b.onnx", "--inputs", inputs, "--bisect")
    assert code == 0 and f"first bad node: {bad} (Mul)" in out and "DIFFERS" in out
    code, out, _ = _cli(capsys, "compare", fixture_path(GOOD), tmp_path / "b.onnx", "--inputs", inputs, "--bisect",
                        "--format", "json", "--atol", "1", "--rtol", "0", "--min-cosine", "0.9")
    report = json.loads(out)
    assert code == 0 and report["tolerance"] == {"atol": 1.0, "rtol": 0.0, "min_cosine": 0.9}
    assert report["first_bad_node"] is None  # a 5% weight change stays within max abs 1
    code, _, err = _cli(capsys, "compare", fixture_path(GOOD), tmp_path / "b.onnx", "--inputs", inputs, "--strict")
    assert code == 1 and "beyond tolerance" in err


def test_cli_explicit_mapping(tmp_path, capsys):
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps({"/model/model/layers.0/mlp/Mul_output_0": "/model/model/layers.0/mlp/act_fn/Mul_output_0"}))
    perturbed_copy(GOOD, tmp_path / "b.onnx")  # a layer-1 fault, so the outputs disagree and bisect runs
    code, out, _ = _cli(capsys, "compare", fixture_path(GOOD), tmp_path / "b.onnx", "--bisect", "--map", mapping,
                        "--format", "json")
    report = json.loads(out)
    # the wrong mapping (layer 0) shows up before the real fault
    assert code == 0 and report["first_bad_node"] == "/model/model/layers.0/mlp/Mul"


@pytest.mark.parametrize("argv, message", [
    (["--map", "m.json"], "--map is used by --bisect only"),
    (["--atol", "-1"], "--atol must not be negative"),
    (["--inputs", "missing.npz"], "inputs file not found"),
])
def test_cli_bad_arguments(tmp_path, capsys, argv, message, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = _cli(capsys, "compare", fixture_path(GOOD), fixture_path(GOOD), *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_models_with_different_inputs_are_refused(capsys):
    code, _, err = _cli(capsys, "compare", fixture_path("llama_gqa_ts"), fixture_path("llama_gqa_kv_ts"))
    assert code == 2 and "model B needs inputs A does not have" in err


def test_qdq_models_run_on_htp_in_integer_mode(monkeypatch):
    seen = {}

    def fake_run_on_htp(model, inputs, **kw):
        seen.update(kw)
        return {}

    monkeypatch.setattr("qnnpasses.backends.htp.run_on_htp", fake_run_on_htp)
    proto = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y) { q = QuantizeLinear(x, s, z)  y = DequantizeLinear(q, s, z) }""")
    proto.graph.initializer.extend([numpy_helper.from_array(np.array(0.1, np.float32), "s"),
                                    numpy_helper.from_array(np.array(0, np.uint8), "z")])
    ir = load_model(proto)
    assert is_quantized(ir) and not is_quantized(load_model(fixture_path(GOOD)))
    compare_mod.run_model(ir, {"x": np.zeros(4, np.float32)}, "htp")
    assert seen == {"fp16": False}


def test_mask_sentinels_saturated_by_fp16_are_not_errors():
    ref = np.array([np.finfo(np.float32).min, 1.0, -2.0], np.float32)
    fp16 = np.array([-np.inf, 1.0, -2.0], np.float32)
    assert np.array_equal(align_sentinels(ref, fp16), ref)
    overflow = np.array([1e9, 1.0, -2.0], np.float32)  # a real fp16 overflow is still an error
    assert not np.array_equal(align_sentinels(overflow, np.array([np.inf, 1.0, -2.0], np.float32)), overflow)


@requires_htp
def test_compare_on_htp_fp16(tmp_path):
    """llama_gqa_ts runs fully on HTP: fp16 logits stay close, and bisect still finds a perturbation."""
    result = compare_models(fixture_path(GOOD), fixture_path(GOOD), fixture_inputs(GOOD), on="htp")
    (logits,) = result["outputs"]
    assert result["fp16"] and logits["cosine"] > 0.99 and logits["top1_agreement"] >= 0.9
    bad = perturbed_copy(GOOD, tmp_path / "b.onnx")
    bisected = bisect(fixture_path(GOOD), tmp_path / "b.onnx", fixture_inputs(GOOD), on="htp")
    assert bisected.first_bad_node == bad


@requires_htp
def test_a_model_the_htp_cannot_finalize_is_a_one_line_finding(capsys):
    # the raw dynamo export fails to finalize on HTP fp16 (q::ForceFormat_Crouton) until passes fix it
    code, _, err = _cli(capsys, "compare", fixture_path("llama_gqa_dynamo"), fixture_path("llama_gqa_dynamo"), "--on", "htp")
    lines = [line for line in err.splitlines() if line.startswith("qnnpasses: error")]
    assert code == 1 and len(lines) == 1 and "B does not run on the HTP" in lines[0]
    assert "Traceback" not in err
