"""fuse-layernorm: decomposed LayerNorm (as torch exports it below opset 17) => LayerNormalization."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx.parser
import pytest
from conftest import fixture_inputs, fixture_outputs, fixture_path, requires_htp
from pass_testing import op_counts, run_strictly

from qnnpasses.backends.cpu import compare_outputs, run_cpu
from qnnpasses.ir.model import to_model_bytes

G = "{" + ",".join(str(0.5 + 0.01 * i) for i in range(64)) + "}"
B = "{" + ",".join(str(0.1 - 0.002 * i) for i in range(64)) + "}"
# nn.LayerNorm exported by torch.onnx.export(opset_version=16, dynamo=False), node for node
TORCH_OPSET16 = """
    mu = ReduceMean<axes=[-1]>(x)
    d = Sub(x, mu)
    two = Constant<value=float {2.0}>()
    p = Pow(d, two)
    v = ReduceMean<axes=[-1]>(p)
    e = Constant<value=float {1e-5}>()
    a = Add(v, e)
    s = Sqrt(a)
    n = Div(d, s)
    m = Mul(n, g)
    y = Add(m, b)"""


def model(body: str, opset: int = 16, shape: str = "1,8,64"):
    return onnx.parser.parse_model(f'<ir_version: 8, opset_import: ["" : {opset}]> '
                                   f'g (float[{shape}] x) => (float[{shape}] y) <float[64] g = {G}, float[64] b = {B}> {{ {body} }}')


def rewrite(source, spec: str = "fuse-layernorm", inputs=None):
    return run_strictly(source, spec, inputs)

ops = op_counts


def test_torch_opset16_export_becomes_layernormalization_at_opset_17():
    ir, record = rewrite(model(TORCH_OPSET16))
    assert record.stats == {"fused": 1, "not_fused": 0, "opset": "16->17"}
    assert ops(ir) == Counter({"LayerNormalization": 1})
    node = ir.graph.nodes[0]
    assert node.attrs["epsilon"] == pytest.approx(1e-5) and node.attrs["axis"] == -1
    np.testing.assert_allclose(node.inputs[1].values, 0.5 + 0.01 * np.arange(64), rtol=1e-6)
    np.testing.assert_allclose(node.inputs[2].values, 0.1 - 0.002 * np.arange(64), rtol=1e-5)


@pytest.mark.parametrize("old, new, inputs", [
    ("p = Pow(d, two)", "p = Mul(d, d)", 3),
    ("n = Div(d, s)", "r = Reciprocal(s) \n n = Mul(r, d)", 3),
    ("m = Mul(n, g)", "m = Mul(g, n)", 3),
    ("y = Add(m, b)", "y = Identity(m)", 2),  # no beta
], ids=["mul-square", "reciprocal", "gamma-first", "no-beta"])
def test_other_spellings(old, new, inputs):
    ir, record = rewrite(model(TORCH_OPSET16.replace(old, new), opset=17))
    assert record.stats["fused"] == 1
    node = next(n for n in ir.graph.nodes if n.op == "LayerNormalization")
    assert len(node.inputs) == inputs and ops(ir)["ReduceMean"] == 0


def test_axes_as_inputs_at_opset_18():
    body = TORCH_OPSET16.replace("ReduceMean<axes=[-1]>(x)", "ReduceMean(x, ax)").replace("ReduceMean<axes=[-1]>(p)", "ReduceMean(p, ax)")
    text = onnx.printer.to_text(model(body, opset=18)).replace("<float[64] g", "<int64[1] ax = {-1}, float[64] g")
    ir, record = rewrite(onnx.parser.parse_model(text))
    assert record.stats["fused"] == 1 and ops(ir) == Counter({"LayerNormalization": 1}) and ir.opset == 18


def test_rms_pattern_is_not_a_layernorm():
    ir, record = rewrite(model("sq = Mul(x, x) \n v = ReduceMean<axes=[-1]>(sq) \n e = Constant<value=float {1e-5}>() \n"
                               "a = Add(v, e) \n s = Sqrt(a) \n n = Div(x, s) \n y = Mul(n, g)", opset=17))
    assert record.stats["fused"] == 0 and "LayerNormalization" not in ops(ir)


def test_rank5_is_fused_only_with_when_always():
    rank5 = model(TORCH_OPSET16, opset=17, shape="1,2,2,2,64")
    _, record = rewrite(rank5)
    assert record.stats == {"fused": 0, "not_fused": 1} and not record.changed
    ir, record = rewrite(rank5, "fuse-layernorm{when=always}")
    assert record.stats["fused"] == 1 and ops(ir)["LayerNormalization"] == 1


@pytest.mark.parametrize("name", ["bert_ts", "bert_dynamo", "gpt2_ts", "gpt2_dynamo"])
def test_fixture_roundtrip(name):
    """Decompose the fixture's 5 LayerNorms into the exporters' plain spelling, fuse them back."""
    spec = "decompose-layernorm{when=always,strategy=primitives,form=plain},fuse-layernorm"
    ir, record = rewrite(fixture_path(name), spec, inputs=fixture_inputs(name))
    assert record.stats["fused"] == 5 and ops(ir)["LayerNormalization"] == 5 and ops(ir)["Sqrt"] == 0
    comparison = compare_outputs(fixture_outputs(name), run_cpu(ir, fixture_inputs(name)))
    assert comparison.max_abs <= 1e-4, comparison.failure()


@requires_htp
def test_fused_layernorm_runs_on_htp_and_survives_massive_activations():
    """The QNN EP fuses the exact torch spelling itself, but not ``Mul(d, d)``, ``Reciprocal``
    or a missing beta (measured): such a LayerNorm stays decomposed and overflows in fp16."""
    from qnnpasses.backends.htp import run_on_htp

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 8, 64)).astype(np.float32)
    x[0, ::2, 7] = 30000.0
    raw = model(TORCH_OPSET16.replace("p = Pow(d, two)", "p = Mul(d, d)"), opset=17)
    ir, _ = rewrite(raw)
    want = run_cpu(ir, {"x": x})["y"]
    got_fused = run_on_htp(to_model_bytes(ir), {"x": x}, disable_cpu_fallback=True)["y"]
    got_raw = run_on_htp(raw.SerializeToString(), {"x": x}, optimize=False)["y"]
    assert worst_row_error(got_fused, want) < 1e-2 and worst_row_error(got_raw, want) > 0.1


def worst_row_error(got: np.ndarray, want: np.ndarray) -> float:
    return float((np.abs(got - want).max(-1) / np.abs(want).max(-1)).max())
