"""decompose-gelu: GeLU ops the HTP rejects => Erf-free primitives, exact to ~1e-7."""

from __future__ import annotations

import math

import numpy as np
import onnx.parser
import pytest
from conftest import fixture_inputs, fixture_outputs, fixture_path, requires_htp
from pass_testing import op_counts, run_strictly

from qnnpasses.backends.cpu import compare_outputs, run_cpu
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import save_model

X = {"x": np.linspace(-12.0, 12.0, 1024, dtype=np.float32).reshape(1, 16, 64)}
BIAS = "{" + ",".join(str(0.05 * (i % 5) - 0.1) for i in range(64)) + "}"


def gelu_model(node: str, opset: int = 20, contrib: bool = False):
    imports = f'"" : {opset}' + (', "com.microsoft" : 1' if contrib else "")
    return onnx.parser.parse_model(f"<ir_version: 9, opset_import: [{imports}]> "
                                   f"g (float[1,16,64] x) => (float[1,16,64] y) <float[64] b = {BIAS}> {{ y = {node} }}")


def exact_gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x.astype(np.float64) / math.sqrt(2.0)))


def tanh_gelu(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def rewrite(source, spec: str = "decompose-gelu{when=always}", inputs=None):
    return run_strictly(source, spec, inputs)

ops = op_counts


def test_exact_gelu_without_erf_matches_erf_to_1e6():
    ir, record = rewrite(gelu_model("Gelu(x)"))
    assert record.stats["decomposed"] == 1
    counts = ops(ir)
    assert counts["Gelu"] == 0 and counts["Erf"] == 0 and counts["Exp"] == 1 and counts["Relu"] == 1
    assert np.abs(run_cpu(ir, X)["y"] - exact_gelu(X["x"])).max() < 1e-6


def test_tanh_gelu_is_the_definition():
    ir, _ = rewrite(gelu_model('Gelu<approximate="tanh">(x)'))
    assert ops(ir)["Tanh"] == 1 and ops(ir)["Gelu"] == 0
    assert np.abs(run_cpu(ir, X)["y"] - tanh_gelu(X["x"])).max() < 1e-5


@pytest.mark.parametrize("node, reference", [
    ("com.microsoft.FastGelu(x, b)", lambda x, b: tanh_gelu(x + b)),
    ("com.microsoft.BiasGelu(x, b)", lambda x, b: exact_gelu(x + b)),
], ids=["FastGelu", "BiasGelu"])
def test_contrib_ops_the_htp_rejects_are_decomposed_by_default(node, reference):
    ir, record = rewrite(gelu_model(node, opset=17, contrib=True), "decompose-gelu")
    assert record.stats == {"decomposed": 1, "kept_native": 0}
    bias = np.array([0.05 * (i % 5) - 0.1 for i in range(64)], np.float32)
    assert np.abs(run_cpu(ir, X)["y"] - reference(X["x"], bias)).max() < 1e-5


@pytest.mark.parametrize("node, contrib", [("Gelu(x)", False), ("com.microsoft.Gelu(x)", True)])
def test_native_gelu_is_kept_by_default(node, contrib):
    _, record = rewrite(gelu_model(node, opset=20 if not contrib else 17, contrib=contrib), "decompose-gelu")
    assert not record.changed and record.stats == {"decomposed": 0, "kept_native": 1}


def test_bert_dynamo_gelus_decompose_losslessly():
    ir, record = rewrite(fixture_path("bert_dynamo"), inputs=fixture_inputs("bert_dynamo"))
    assert record.stats["decomposed"] == 2 and ops(ir)["Gelu"] == 0
    comparison = compare_outputs(fixture_outputs("bert_dynamo"), run_cpu(ir, fixture_inputs("bert_dynamo")))
    assert comparison.max_abs <= 1e-4, comparison.failure()


@requires_htp
@pytest.mark.parametrize("node", ["com.microsoft.FastGelu(x, b)", "com.microsoft.BiasGelu(x, b)"])
def test_rejected_contrib_gelu_moves_to_the_htp(tmp_path, node):
    from qnnpasses.backends.htp import probe_placement, run_on_htp

    raw_ir = load_model(gelu_model(node, opset=17, contrib=True))
    raw = save_model(raw_ir, tmp_path / "raw.onnx")
    assert probe_placement(raw, inputs=X).cpu_nodes == [raw_ir.graph.nodes[0].name]
    ir, _ = rewrite(raw, "decompose-gelu")
    fixed = save_model(ir, tmp_path / "fixed.onnx")
    placement = probe_placement(fixed, inputs=X)
    assert placement.ok and placement.qnn_partitions == 1 and placement.cpu_nodes == []
    # fp16 rounding: |y| up to 12 has a resolution of 2^-7; the native HTP Gelu is no closer
    assert np.abs(run_on_htp(fixed, X)["y"] - run_cpu(raw, X)["y"]).max() < 1e-2


@requires_htp
def test_exact_form_stays_right_on_the_htp_where_its_exp_argument_is_very_negative(tmp_path):
    """|x| up to 30 puts exp(-x^2/2)'s argument down to -450, where the HTP's fp16 Exp returns
    garbage unless floored (floored_exp): the decomposed BiasGelu must still be GeLU there."""
    from qnnpasses.backends.htp import run_on_htp

    wide = {"x": np.linspace(-30.0, 30.0, 1024, dtype=np.float32).reshape(1, 16, 64)}
    raw = save_model(load_model(gelu_model("com.microsoft.BiasGelu(x, b)", opset=17, contrib=True)), tmp_path / "raw.onnx")
    ir, _ = rewrite(raw, "decompose-gelu", inputs=wide)
    got = run_on_htp(save_model(ir, tmp_path / "fixed.onnx"), wide)["y"].astype(np.float64)
    want = run_cpu(raw, wide)["y"].astype(np.float64)
    # a few fp16 roundings of |y| (|y| <= 30: resolution 2^-6) or of 1
    assert np.all(np.abs(got - want) <= 4 * np.spacing(np.maximum(np.abs(want), 1.0).astype(np.float16)).astype(np.float64))
