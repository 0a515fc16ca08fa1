"""qnnpasses quantize: the plan finds the sensitive tensors by structure, the QDQ output runs on the real
HTP in integer mode as one partition with no CPU node, mixed precision beats uniform uint8, the KV cache
goes 8-bit at the graph boundary, and the CLI reports bad data in one line."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from conftest import fixture_path, requires_htp
from onnx import numpy_helper
from onnxruntime.quantization import QuantType

from qnnpasses.cli import main as cli
from qnnpasses.ir.load import load_model
from qnnpasses.passmanager.manager import PassManager
from qnnpasses.passmanager.named import get_pipeline
from qnnpasses.quant.calibration import CalibrationData, model_inputs
from qnnpasses.quant.data import token_windows
from qnnpasses.quant.driver import PIPELINE_KEY, QUANT_KEY, quantize_model
from qnnpasses.quant.evaluate import evaluate, next_token_nll
from qnnpasses.quant.policy import (
    PrecisionPolicy,
    find_sensitive,
    kv_tensors,
    make_plan,
)

LLAMA = "llama_gqa_ts"
MIXED = PrecisionPolicy(act="uint8", weights="int8", per_channel=True, sensitive_bits=16)
UNIFORM_U8 = PrecisionPolicy(act="uint8", weights="uint8", per_channel=False, sensitive_bits=8)


def _data(tmp, name: str, calib: int = 32, evals: int = 8):
    ir = load_model(fixture_path(name))
    np.savez(tmp / f"{name}.calib.npz", **token_windows(ir, calib, seed=0, part="calib"))
    np.savez(tmp / f"{name}.eval.npz", **token_windows(ir, evals, seed=0, part="eval"))
    return tmp / f"{name}.calib.npz", tmp / f"{name}.eval.npz"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quantize")
    calib, evals = _data(tmp, LLAMA)
    return tmp, calib, evals


def _prepared(name: str):
    ir = load_model(fixture_path(name))
    PassManager(get_pipeline("htp-llm")).run(ir)
    return ir


def test_plan_finds_sensitive_tensors_by_structure():
    ir = _prepared(LLAMA)
    found = find_sensitive(ir)
    by_category = {c: [n for n, k in found.items() if k == c] for c in set(found.values())}
    gather = next(n for n in ir.graph.nodes if n.op == "Gather")
    assert set(by_category["embedding"]) == {gather.inputs[0].name, gather.outputs[0].name}
    softmaxes = [n for n in ir.graph.nodes if n.op == "Softmax"]
    assert sorted(by_category["softmax"]) == sorted(n.outputs[0].name for n in softmaxes)
    for softmax in softmaxes:  # Q·Kᵀ output through scale and mask to the softmax input
        assert softmax.inputs[0].name in by_category["attention"]
    # Q·Kᵀ, scaled, masked, and clamped for fully masked rows (attention-cleanup)
    assert len(by_category["attention"]) == 4 * len(softmaxes)
    norms = [n for n in ir.graph.nodes if n.op == "RMSNormalization"]
    assert {n.outputs[0].name for n in norms} | {n.inputs[0].name for n in norms} <= set(by_category["norm"])
    head = next(n for n in ir.graph.nodes if n.op == "MatMul" and tuple(n.inputs[1].shape) == (64, 256))
    assert head.outputs[0].name in by_category["lm_head"]
    plan = make_plan(ir, MIXED)
    assert all(plan.overrides[n][0]["quant_type"].name == "QUInt16" for n in found)
    assert plan.per_channel and set(plan.per_channel.values()) == {1}  # 2-D MatMul weights, output axis
    gammas = [n.inputs[1].name for n in norms]  # the norms compute in 16 bit: so do their scales
    assert all(plan.overrides[g] == [{"quant_type": QuantType.QUInt16, "symmetric": True}] for g in gammas)
    plain = make_plan(ir, PrecisionPolicy(act="uint8", weights="int8", per_channel=True, sensitive_bits=8))
    assert all(plain.overrides[g] == [{"quant_type": QuantType.QUInt8, "symmetric": False}] for g in gammas)


def test_kv_cache_tensors_are_found_at_the_boundary():
    ir = _prepared("llama_gqa_kv_ts")
    kv = kv_tensors(ir.graph)
    assert sorted(kv) == sorted([f"past_key_values.{i}.{k}" for i in range(2) for k in ("key", "value")]
                                + [f"present.{i}.{k}" for i in range(2) for k in ("key", "value")])
    assert not kv_tensors(_prepared(LLAMA).graph)


def test_perplexity_helper_matches_a_hand_computation():
    logits = np.log(np.array([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]]))
    nll = next_token_nll(logits, np.array([[0, 2]]))
    np.testing.assert_allclose(nll, -np.log([[0.5, 0.8]]))


@requires_htp
def test_default_recipe_runs_on_htp_as_one_partition_and_keeps_accuracy(llama):
    tmp, calib, evals = llama
    out = tmp / "default.qdq.onnx"
    result = quantize_model(fixture_path(LLAMA), calib, out, keep_prepared=tmp / "default.prepared.onnx")
    assert result.prep.pipeline is not None and result.calibration_samples == 32
    mask = next(r for r in result.prep.records if r["pass"] == "quant-mask")
    assert mask["status"] == "changed" and mask["stats"]["mask_value"] > -100
    props = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert PIPELINE_KEY in props and json.loads(props[QUANT_KEY])["act"] == "uint16"
    ev = evaluate(fixture_path(LLAMA), out, CalibrationData(evals, model_inputs(load_model(out))))
    assert ev.qnn_partitions == 1 and ev.cpu_nodes == []
    head = ev.headline
    assert head.name == "logits" and head.cosine >= 0.999 and head.top1 >= 0.9
    assert abs(head.perplexity - head.reference_perplexity) / head.reference_perplexity < 0.01
    again = quantize_model(tmp / "default.prepared.onnx", calib, tmp / "again.qdq.onnx")
    assert again.prep.pipeline is None  # metadata says htp-llm already ran: not run twice


@requires_htp
def test_mixed_precision_beats_uniform_uint8_on_htp(llama):
    tmp, calib, evals = llama
    scores = {}
    for label, policy in (("mixed", MIXED), ("uniform", UNIFORM_U8)):
        out = tmp / f"{label}.qdq.onnx"
        quantize_model(fixture_path(LLAMA), calib, out, policy)
        ev = evaluate(fixture_path(LLAMA), out, CalibrationData(evals, model_inputs(load_model(out))))
        assert ev.qnn_partitions == 1 and ev.cpu_nodes == []
        scores[label] = ev.headline
    assert scores["mixed"].cosine > scores["uniform"].cosine + 2e-4
    assert scores["mixed"].top1 >= scores["uniform"].top1
    assert scores["mixed"].max_abs < scores["uniform"].max_abs


@requires_htp
def test_kv_cache_at_8_bit_on_htp(tmp_path):
    calib, evals = _data(tmp_path, "llama_gqa_kv_ts", calib=16, evals=8)
    out = tmp_path / "kv8.qdq.onnx"
    quantize_model(fixture_path("llama_gqa_kv_ts"), calib, out, PrecisionPolicy(kv_bits=8))
    model = onnx.load(str(out))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    q_of = {n.input[0]: inits[n.input[2]].dtype for n in model.graph.node if n.op_type == "QuantizeLinear"}
    assert all(q_of[f"past_key_values.{i}.{k}"] == np.uint8 for i in range(2) for k in ("key", "value"))
    present_q = [q_of[name] for name in q_of if name.startswith("present.")]
    assert len(present_q) == 4 and all(t == np.uint8 for t in present_q)
    assert q_of["logits_QuantizeLinear_Input"] == np.uint16
    ev = evaluate(fixture_path("llama_gqa_kv_ts"), out, CalibrationData(evals, model_inputs(load_model(out))))
    assert ev.qnn_partitions == 1 and ev.cpu_nodes == []
    scores = {o.name: o for o in ev.outputs}
    assert scores["logits"].cosine > 0.998 and all(scores[f"present.{i}.key"].cosine > 0.999 for i in range(2))


def test_cli_writes_model_overrides_and_report(llama, tmp_path, capsys):
    _, calib, _ = llama
    out = tmp_path / "cli.qdq.onnx"
    code = cli(["quantize", str(fixture_path(LLAMA)), "--calib", str(calib), "-o", str(out), "--act", "uint8",
                "--no-per-channel", "--overrides", str(tmp_path / "ov.json"), "--report", str(tmp_path / "r.json")])
    assert code == 0
    text = capsys.readouterr().out
    assert "wint8-pt a8 s16" in text and "overrides:" in text
    assert out.exists() and (tmp_path / "cli.qdq.prepared.onnx").exists()
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["policy"]["per_channel"] is False and report["plan"]["per_channel_weights"] == 0
    doc = json.loads((tmp_path / "ov.json").read_text())
    assert doc["quantizer_args"]["activation_bitwidth"] == 8 and doc["version"] == "1.0.0"


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("attention_mask"), "no array for model input(s) ['attention_mask']"),
    (lambda d: d.update(input_ids=d["input_ids"].astype(np.int32)), "has dtype int32, the model wants int64"),
    (lambda d: d.update(input_ids=d["input_ids"][:, :, :8]), "has shape [4, 1, 8], the model wants [1, 16]"),
])
def test_cli_reports_calibration_mismatch_in_one_line(tmp_path, capsys, mutate, message):
    data = token_windows(load_model(fixture_path(LLAMA)), 4, seed=1)
    mutate(data)
    np.savez(tmp_path / "bad.npz", **data)
    code = cli(["quantize", str(fixture_path(LLAMA)), "--calib", str(tmp_path / "bad.npz"), "-o",
                str(tmp_path / "x.onnx")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1
    assert not (tmp_path / "x.onnx").exists()


def test_cli_rejects_bad_options(capsys):
    with pytest.raises(SystemExit) as info:
        cli(["quantize", str(fixture_path(LLAMA)), "--calib", "x.npz", "-o", "y.onnx", "--act", "int4"])
    assert info.value.code == 2
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    code = cli(["quantize", str(fixture_path(LLAMA)), "--calib", "x.npz", "-o", "y.onnx", "--sensitive", "lmhead"])
    assert code == 2 and "unknown sensitive categories ['lmhead']" in capsys.readouterr().err


# --------------------------------------------------------------------------- int4, weight scales, shared plans


def _dq_weight_types(path) -> dict[str, tuple[int, int]]:
    """Weight name -> (ONNX dtype, block_size) of every DequantizeLinear of an initializer."""
    model = onnx.load(str(path))
    inits = {i.name: i for i in model.graph.initializer}
    found = {}
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in inits:
            block = next((a.i for a in node.attribute if a.name == "block_size"), 0)
            found[node.input[0].removesuffix("_quantized")] = (inits[node.input[0]].data_type, block)
    return found


def test_mse_scales_and_blocks_lower_the_weight_error():
    from qnnpasses.quant.weights import quantize_weight

    w = np.random.default_rng(0).standard_t(3, size=(256, 64)).astype(np.float32)  # heavy tails, like LLM weights
    errors = {}
    for label, mse, block in (("minmax", False, None), ("mse", True, None), ("mse-b32", True, 32)):
        q, scale, _, got_block, err = quantize_weight(w, 1, onnx.TensorProto.INT4, mse=mse, block_size=block)
        assert q.min() >= -8 and q.max() <= 7 and got_block == (block or 0)
        full = np.repeat(scale, block, axis=0) if block else scale
        assert np.isclose(((w - q * full) ** 2).sum(), err, rtol=1e-6)  # the reported error is the real one
        errors[label] = err
    assert errors["mse"] < 0.9 * errors["minmax"] and errors["mse-b32"] < errors["mse"]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """8 calibration and 4 evaluation windows: enough for plan/encoding checks, quick to calibrate."""
    tmp = tmp_path_factory.mktemp("small")
    calib, evals = _data(tmp, LLAMA, calib=8, evals=4)
    return tmp, calib, evals


def test_int4_plan_keeps_the_lm_head_at_8_bit(small):
    from qnnpasses.quant import precision_policy

    tmp, calib, _ = small
    out = tmp / "w4.qdq.onnx"
    # per-channel, rounded to nearest: what the MSE scale search alone does to the weights
    policy = precision_policy("w4a16", outliers="", block_size=None, weight_rounding="nearest")
    result = quantize_model(fixture_path(LLAMA), calib, out, policy)
    types = _dq_weight_types(out)
    head = result.plan.weights_8bit
    assert len(head) == 1 and types[head[0]][0] == onnx.TensorProto.INT8
    int4 = [n for n, (t, _) in types.items() if t == onnx.TensorProto.INT4]
    assert len(int4) >= 8  # every 2-D projection of both layers
    assert result.weights["refined"] >= len(int4) and result.weights["mse_after_over_before"] < 1.0
    with pytest.raises(Exception, match="power of two"):
        PrecisionPolicy(weights="int4", block_size=24)


def test_head_bits_16_gives_the_lm_head_16_bit_weights_that_dequantize_to_the_float_ones(small):
    """``head_bits=16`` in an int4 plan: the lm_head alone at int16 (per channel), every projection still
    int4, and the written int16 weights dequantize to the float lm_head within half a 16-bit step
    (after the MSE scale search rewrote them)."""
    from onnx import numpy_helper

    from qnnpasses.quant import precision_policy

    tmp, calib, _ = small
    out = tmp / "w4h16.qdq.onnx"
    # nearest rounding: the written integers are then the float weight's nearest grid points
    policy = precision_policy("w4a16", outliers="", head_bits=16, weight_rounding="nearest")
    result = quantize_model(fixture_path(LLAMA), calib, out, policy)
    types = _dq_weight_types(out)
    int16 = [n for n, (t, _) in types.items() if t == onnx.TensorProto.INT16]
    assert len(int16) == 1 and not result.plan.weights_8bit
    assert sum(t == onnx.TensorProto.INT4 for t, _ in types.values()) >= 8
    model = onnx.load(str(out))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == int16[0] + "_quantized")
    q, scale = inits[dq.input[0]].astype(np.float64), inits[dq.input[1]].astype(np.float64)
    original = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(fixture_path(LLAMA))).graph.initializer}
    assert np.abs(q).max() > 2**14  # 16-bit integers (they once wrapped around through int8)
    assert np.abs(original[int16[0]] - q * scale).max() <= 0.5 * scale.max() * (1 + 1e-6)
    assert PrecisionPolicy(head_bits=16).label().endswith("h16")
    with pytest.raises(Exception, match="head-bits"):
        PrecisionPolicy(head_bits=4)


def test_shared_plan_gives_shared_tensors_one_encoding(small, tmp_path):
    """Two graphs calibrated on different data: every tensor they share gets the union range."""
    from qnnpasses.quant import quantize_graphs
    from qnnpasses.quant.overrides import encodings_from_qdq

    _, calib, evals = small
    outs = {"a": tmp_path / "a.qdq.onnx", "b": tmp_path / "b.qdq.onnx"}
    result = quantize_graphs({"a": fixture_path(LLAMA), "b": fixture_path(LLAMA)}, {"a": calib, "b": evals}, outs,
                             precision="w8a16")
    assert "logits" in result.shared_tensors
    enc = {k: {e.name: e for e in encodings_from_qdq(p)} for k, p in outs.items()}
    common = [n for n in enc["a"] if n in enc["b"] and not enc["a"][n].param]
    assert len(common) > 20
    assert all(enc["a"][n].scale == enc["b"][n].scale and enc["a"][n].offset == enc["b"][n].offset for n in common)
    rot = [r for r in result.results["a"].prep.records if r["pass"] == "rotate-residual"]
    assert rot and rot[0]["status"] == "changed"


def test_sensitivity_ranks_layers_and_raising_them_helps(small, tmp_path):
    """The weakest layers by SQNR, raised to 8-bit weights in an int4 plan, bring the CPU score up."""
    from qnnpasses.ir.model import save_model
    from qnnpasses.quant import precision_policy
    from qnnpasses.quant.driver import ensure_pipeline, quant_prep
    from qnnpasses.quant.sensitivity import raise_until

    _, calib, evals = small
    ir = _prepared(LLAMA)
    ensure_pipeline(ir)
    data = CalibrationData(calib, model_inputs(ir))
    quant_prep(ir, data)
    prepared = save_model(ir, tmp_path / "prepared.onnx")
    search = raise_until(prepared, data, CalibrationData(evals, model_inputs(ir)),
                         precision_policy("w4a16", outliers=""), target_top1=0.999, budget=8, eval_samples=4)
    sqnr = list(search.sqnr.values())
    assert sqnr == sorted(sqnr) and 10 < sqnr[0] < 40  # dB, weakest first
    first, last = search.steps[0], search.steps[-1]
    assert first["raised"] == 0 and last["raised"] == 8 and not last["met"]  # 99.9% is out of reach: budget used
    assert last["cosine"] > first["cosine"] and last["top1"] > first["top1"]
    assert list(search.chosen.raised) == list(search.sqnr)[:8]


@requires_htp
def test_block_wise_int4_runs_on_htp_and_beats_per_channel(small, tmp_path):
    """int4 weights with 32-row blocks (DequantizeLinear block_size, opset 21): one HTP partition, no CPU
    node, and closer to fp32 than per-channel int4 (measured cosine 0.99554 vs 0.99467 on 4 samples)."""
    _, calib, evals = small
    scores = {}
    for block in (None, 32):
        out = tmp_path / f"b{block}.qdq.onnx"
        result = quantize_model(fixture_path(LLAMA), calib, out,
                                PrecisionPolicy(weights="int4", weight_scales="mse", block_size=block))
        assert result.weights["blocked"] == (14 if block else 0)  # lm_head (int8) stays per channel
        ev = evaluate(fixture_path(LLAMA), out, CalibrationData(evals, model_inputs(load_model(out))), limit=4)
        assert ev.qnn_partitions == 1 and ev.cpu_nodes == []
        scores[block] = ev.headline.cosine
    assert scores[32] > scores[None] > 0.99


def test_the_lm_head_of_a_static_cache_graph_is_the_logits_projection_not_the_v_projections():
    """In a static-cache decode graph every V projection reaches a ``new.*.value`` output through
    reshapes, like the lm_head reaches ``logits``: only the vocabulary-wide one is the lm_head."""
    from qnnpasses.llm import convert
    from qnnpasses.quant.policy import head_outputs, head_weights

    model = fixture_path("llama_gqa_kv_dyn_ts")
    ir, _ = convert.static_graph(model, convert.export_roles(load_model(model)), 1, 255, cache_fp16=False)
    matmuls = {n.inputs[1].name: n for n in ir.graph.nodes if n.op == "MatMul" and len(n.inputs) > 1}
    candidates = [w for w, n in matmuls.items() if n.outputs[0].name in set(head_outputs(ir.graph))]
    assert len(candidates) > 1  # the V projections look like heads too
    (head,) = head_weights(ir.graph)
    logits = next(t for t in ir.graph.outputs if t.name == "logits")
    assert matmuls[head].outputs[0].shape[-1] == logits.shape[-1]


def test_ranges_are_onnxruntimes_and_so_is_the_quantized_model(small, tmp_path, monkeypatch):
    """qnnpasses.quant.ranges computes what onnxruntime's MinMax calibrator computes (every tensor, every
    figure, bit for bit), and quantize_model handing them over as the calibration cache writes the
    same QDQ model as letting onnxruntime calibrate."""
    import os

    from onnxruntime.quantization.calibrate import CalibrationMethod, create_calibrator

    from qnnpasses.ir.model import save_model
    from qnnpasses.quant import driver
    from qnnpasses.quant.ranges import calibrate_ranges

    tmp, calib_path, _ = small
    path = save_model(_prepared(LLAMA), tmp_path / "prepared.onnx")
    calib = CalibrationData(calib_path, model_inputs(load_model(path)))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        reference = create_calibrator(path, None, str(tmp_path / "augmented.onnx"), calibrate_method=CalibrationMethod.MinMax)
        reference.collect_data(calib.reader())
        expected = {name: (float(np.min(t.range_value[0])), float(np.max(t.range_value[1])))
                    for name, t in reference.compute_data().items()}
    finally:
        os.chdir(cwd)
    assert calibrate_ranges(path, calib) == expected and len(expected) > 50

    ours = quantize_model(path, calib, tmp_path / "ours.onnx", MIXED)
    monkeypatch.setattr(driver, "_ranges_cache", lambda *args: None)  # onnxruntime calibrates itself
    theirs = quantize_model(path, calib, tmp_path / "theirs.onnx", MIXED)
    a, b = onnx.load(str(ours.output)), onnx.load(str(theirs.output))
    assert [n.op_type for n in a.graph.node] == [n.op_type for n in b.graph.node]
    inits = {i.name: numpy_helper.to_array(i) for i in b.graph.initializer}
    assert {i.name for i in a.graph.initializer} == set(inits)
    assert all(np.array_equal(numpy_helper.to_array(i), inits[i.name]) for i in a.graph.initializer)


def test_overrides_name_only_the_prepared_models_tensors_when_the_qdq_model_is_split(small, tmp_path, capsys):
    """The QDQ output splits the attention's MatMuls of two activations; the converter overrides written
    beside it name only tensors of the prepared float model the converter reads."""
    _, calib, _ = small
    out = tmp_path / "split.qdq.onnx"
    assert cli(["quantize", str(fixture_path(LLAMA)), "--calib", str(calib), "-o", str(out),
                "--overrides", str(tmp_path / "ov.json"), "--report", str(tmp_path / "r.json")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    layers = sum(n.op_type == "Softmax" for n in onnx.load(str(fixture_path(LLAMA))).graph.node)
    assert report["act_matmuls"]["split"] == 2 * layers  # Q·Kᵀ and P·V in every layer
    prepared = onnx.load(str(tmp_path / "split.qdq.prepared.onnx"), load_external_data=False)
    names = {t for n in prepared.graph.node for t in [*n.input, *n.output]} | {i.name for i in prepared.graph.initializer}
    doc = json.loads((tmp_path / "ov.v2.json").read_text())
    assert doc["encodings"] and all(e["name"] in names for e in doc["encodings"])


def test_weights_read_on_demand_give_the_same_quantized_model(small, tmp_path, monkeypatch):
    """onnxruntime's quantizer reading each weight from the prepared model's file when it quantizes it
    (qnnpasses.quant.streamed: a 0.5 B build no longer holds all its float weights and their quantized
    copies at once) writes the same QDQ model, byte for byte, as with every weight loaded first."""
    import contextlib

    from qnnpasses.ir.model import save_model
    from qnnpasses.quant import driver, streamed

    _, calib_path, _ = small
    path = save_model(_prepared(LLAMA), tmp_path / "prepared.onnx", external_data=True)
    calib = CalibrationData(calib_path, model_inputs(load_model(path)))
    read, original = [], streamed.load_external_data_for_tensor
    monkeypatch.setattr(streamed, "load_external_data_for_tensor", lambda t, d: read.append(t.name) or original(t, d))
    quantize_model(path, calib, tmp_path / "on_demand" / "model.onnx", MIXED)
    assert len(read) >= 10  # the weights came from the file, one by one
    monkeypatch.setattr(driver, "weights_on_demand", lambda folder: contextlib.nullcontext())
    quantize_model(path, calib, tmp_path / "loaded" / "model.onnx", MIXED)
    names = sorted(p.name for p in (tmp_path / "loaded").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "on_demand").iterdir()) and "model.onnx" in names
    for name in names:
        assert (tmp_path / "on_demand" / name).read_bytes() == (tmp_path / "loaded" / name).read_bytes(), name
