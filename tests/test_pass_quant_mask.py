"""quant-mask: the additive mask shrinks to -(calibrated score spread + margin); outputs stay equal on CPU,
and a uint8 QDQ model of the attention keeps its accuracy on the HTP where -1e4 wrecks it."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import fixture_inputs, fixture_outputs, fixture_path, requires_htp
from qnnpasses.passes.attention.quant_mask import QuantMask, row_spread

from qnnpasses.backends.cpu import run_cpu
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import PassContext
from qnnpasses.passmanager.manager import PassManager, RunConfig
from qnnpasses.passmanager.named import get_pipeline
from qnnpasses.passmanager.rewrite import constant_value
from qnnpasses.passmanager.spec import parse_pipeline

CAUSAL = ",".join("1" if j <= i else "0" for i in range(4) for j in range(4))
ATTENTION = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,2,4,8] q, float[1,2,4,8] k, float[1,2,4,8] v, bool[1,1,1,4] keep) => (float[1,2,4,8] y)
<float zero = {0.0}, float big = {-10000.0}, float scale = {0.35}, bool[1,1,4,4] causal = {CAUSAL}>
{
    kt = Transpose<perm=[0,1,3,2]>(k)
    s = MatMul(q, kt)
    ss = Mul(s, scale)
    visible = And(keep, causal)
    m = Where(visible, zero, big)
    a = Add(m, ss)
    p = Softmax<axis=-1>(a)
    y = MatMul(p, v)
}
""".replace("{CAUSAL}", "{" + CAUSAL + "}")


def _attention() -> IRModel:
    return load_model(onnx.parser.parse_model(ATTENTION))


def _feeds(seed: int, pad: int = 0, gain: float = 1.0) -> dict[str, np.ndarray]:
    """Random q, k, v; the last ``pad`` keys are padding (right padding: every query row keeps key 0)."""
    rng = np.random.default_rng(seed)
    feeds = {n: (gain * rng.standard_normal((1, 2, 4, 8))).astype(np.float32) for n in "qkv"}
    feeds["keep"] = (np.arange(4) < 4 - pad).reshape(1, 1, 1, 4)
    return feeds


def _mask_value(ir: IRModel) -> float:
    where = next(n for n in ir.graph.nodes if n.op == "Where")
    return float(constant_value(where.inputs[2]))


def test_mask_becomes_calibrated_spread_plus_margin():
    ir = _attention()
    samples = [_feeds(s, gain=2.0) for s in range(4)]
    spreads = [row_spread(run_cpu(_with_scores(ir), f)["a"], -500.0) for f in samples]
    before = [run_cpu(ir, _feeds(9, pad=p))["y"] for p in (0, 1)]
    ops = sorted(n.op for n in ir.graph.nodes)
    result = QuantMask().run(ir, PassContext(calibration=samples))
    assert result.changed and result.stats["mask_constants_replaced"] == 1
    assert _mask_value(ir) == -np.ceil(max(spreads) + 20.0) == result.stats["mask_value"]
    assert sorted(n.op for n in ir.graph.nodes) == ops  # the same graph, one constant changed
    for pad, want in zip((0, 1), before):
        np.testing.assert_allclose(run_cpu(ir, _feeds(9, pad=pad))["y"], want, atol=1e-6)


def _with_scores(ir: IRModel) -> IRModel:
    probe = ir.copy()
    probe.graph.outputs = list(probe.graph.outputs) + [probe.graph.tensors()["a"]]
    return probe


def test_without_calibration_the_fallback_is_used_and_small_masks_are_left_alone():
    ir = _attention()
    result = QuantMask().run(ir, PassContext())
    assert result.stats["score_spread"] == "uncalibrated" and _mask_value(ir) == -500.0
    again = QuantMask().run(ir, PassContext())  # -500 is above the threshold: nothing left to shrink
    assert not again.changed and again.stats["mask_constants_replaced"] == 0
    huge = _attention()
    assert not QuantMask(margin=5000.0).run(huge, PassContext(calibration=[_feeds(0)])).changed  # cannot shrink


def test_row_spread_ignores_masked_entries():
    scores = np.array([[1.0, -2.0, -1e4], [3.0, -9999.0, 0.5]])
    assert row_spread(scores, -500.0) == 3.0


@pytest.fixture(scope="module")
def prepared_llama():
    ir = load_model(fixture_path("llama_gqa_ts"))
    PassManager(get_pipeline("htp-llm")).run(ir)
    return ir


def test_on_a_real_export_outputs_stay_within_1e4(prepared_llama):
    ir = prepared_llama.copy()
    rng = np.random.default_rng(0)
    samples = [{"input_ids": rng.integers(0, 256, (1, 16)), "attention_mask": np.ones((1, 16), np.int64)}
               for _ in range(4)]
    manager = PassManager(parse_pipeline("quant-mask"), RunConfig(verify=True, inputs=fixture_inputs("llama_gqa_ts")),
                          context=PassContext(calibration=samples))
    record = manager.run(ir).records[0]
    # the mask, and each layer's clamp for fully masked rows that attention-cleanup wrote at -5000
    assert record.status == "changed" and record.stats["mask_constants_replaced"] == 3
    assert -60.0 < record.stats["mask_value"] < -20.0
    got = run_cpu(ir, fixture_inputs("llama_gqa_ts"))["logits"]
    assert np.abs(got - fixture_outputs("llama_gqa_ts")["logits"]).max() < 1e-4


@requires_htp
def test_uint8_attention_on_htp_needs_the_small_mask(tmp_path, monkeypatch):
    """All-uint8 QDQ of the attention block on the HTP: -1e4 leaves a 39-unit step for the masked scores."""
    from qnnpasses.quant import driver
    from qnnpasses.quant.calibration import CalibrationData, model_inputs
    from qnnpasses.quant.evaluate import evaluate
    from qnnpasses.quant.policy import PrecisionPolicy

    onnx.save(onnx.parser.parse_model(ATTENTION), tmp_path / "attn.onnx")
    feeds = [_feeds(s, pad=s % 2, gain=2.0) for s in range(24)]
    np.savez(tmp_path / "calib.npz", **{k: np.stack([f[k] for f in feeds[:16]]) for k in feeds[0]})
    np.savez(tmp_path / "eval.npz", **{k: np.stack([f[k] for f in feeds[16:]]) for k in feeds[0]})
    policy = PrecisionPolicy(act="uint8", sensitive_bits=8)
    cosine = {}
    for prep in ("quant-mask,cleanup", "cleanup"):
        monkeypatch.setattr(driver, "QUANT_PREP", prep)
        out = tmp_path / f"{prep.split(',')[0]}.qdq.onnx"
        driver.quantize_model(tmp_path / "attn.onnx", tmp_path / "calib.npz", out, policy)
        data = CalibrationData(tmp_path / "eval.npz", model_inputs(load_model(out)))
        ev = evaluate(tmp_path / "attn.onnx", out, data)
        assert ev.qnn_partitions == 1 and ev.cpu_nodes == []
        cosine[prep] = ev.headline.cosine
    assert cosine["quant-mask,cleanup"] > 0.995
    assert cosine["cleanup"] < cosine["quant-mask,cleanup"] - 0.02
