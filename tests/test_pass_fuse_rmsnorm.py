"""fuse-rmsnorm: exported RMSNorm spellings => RMSNormalization (opset raised to 23), and
the facts that justify the target: the HTP runs it natively and fp16-safely."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx.parser
import pytest
from conftest import (
    FIXTURE_NAMES,
    LLAMA_FAMILY,
    fixture_inputs,
    fixture_outputs,
    fixture_path,
    requires_htp,
)
from pass_testing import op_counts, run_strictly
from qnnpasses.passes.norm._opset import raise_opset

from qnnpasses.backends.cpu import compare_outputs, run_cpu
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import save_model
from qnnpasses.passmanager.api import PassContext
from qnnpasses.passmanager.manager import PassManager, RunConfig
from qnnpasses.passmanager.spec import parse_pipeline

W8 = "{" + ",".join(str(0.5 + 0.1 * i) for i in range(8)) + "}"


def rewrite(model, spec: str = "fuse-rmsnorm", inputs=None):
    return run_strictly(model, spec, inputs)

ops = op_counts


def parse(opset: int, signature: str, body: str, ir_version: int = 8):
    return onnx.parser.parse_model(f'<ir_version: {ir_version}, opset_import: ["" : {opset}]> {signature} {{ {body} }}')


# TorchScript (opset 17) spelling of HF LlamaRMSNorm, plus an unrelated ReduceMean that the
# opset raise must convert (axes attribute -> input).
TS_RMSNORM = parse(17, f"g (float[1,4,8] h) => (float[1,4,8] y, float[1,1,8] other) <float[8] w = {W8}>", """
    x = Cast<to=1>(h)
    two = Constant<value=float {2.0}>()
    p = Pow(x, two)
    m = ReduceMean<axes=[-1]>(p)
    e = Constant<value=float {1e-6}>()
    a = Add(m, e)
    s = Sqrt(a)
    one = Constant<value=float {1.0}>()
    r = Div(one, s)
    n = Mul(x, r)
    c = Cast<to=1>(n)
    y = Mul(w, c)
    other = ReduceMean<axes=[1]>(h)""")


def test_torchscript_spelling_becomes_rmsnormalization_and_opset_23():
    ir, record = rewrite(TS_RMSNORM)
    assert record.stats == {"fused": 1, "not_matched": 0, "opset": "17->23"}
    assert ops(ir) == Counter({"RMSNormalization": 1, "ReduceMean": 1, "Cast": 1})
    node = next(n for n in ir.graph.nodes if n.op == "RMSNormalization")
    assert node.attrs["epsilon"] == pytest.approx(1e-6) and node.attrs["axis"] == -1
    np.testing.assert_allclose(node.inputs[1].values, 0.5 + 0.1 * np.arange(8), rtol=1e-6)
    other = next(n for n in ir.graph.nodes if n.op == "ReduceMean")
    assert "axes" not in other.attrs and list(other.inputs[1].values) == [1]  # opset-18 form
    assert ir.opset == 23 and ir.ir_version >= 11


@pytest.mark.parametrize("body", [
    # dynamo: axes input, Reciprocal, weight first
    "p = Mul(x, x) \n m = ReduceMean(p, ax) \n a = Add(e, m) \n s = Sqrt(a) \n r = Reciprocal(s) \n n = Mul(r, x) \n y = Mul(n, w)",
    # x / sqrt(...) directly
    "p = Pow(x, two) \n m = ReduceMean(p, ax) \n a = Add(m, e) \n s = Sqrt(a) \n y0 = Div(x, s) \n y = Mul(y0, w)",
], ids=["dynamo-reciprocal", "div-by-sqrt"])
def test_other_spellings(body):
    model = parse(20, f"g (float[2,3,8] x) => (float[2,3,8] y) <float[8] w = {W8}, int64[1] ax = {{-1}}, "
                      "float e = {1e-5}, float two = {2.0}>", body, ir_version=9)
    ir, record = rewrite(model)
    assert record.stats["fused"] == 1 and ops(ir) == Counter({"RMSNormalization": 1})


def test_without_weight_gets_unit_scale():
    model = parse(23, "g (float[2,8] x) => (float[2,8] y) <int64[1] ax = {-1}, float e = {1e-5}>",
                  "p = Mul(x, x) \n m = ReduceMean(p, ax) \n a = Add(m, e) \n s = Sqrt(a) \n y = Div(x, s)", ir_version=11)
    ir, record = rewrite(model)
    assert record.stats == {"fused": 1, "not_matched": 0}
    node = next(n for n in ir.graph.nodes if n.op == "RMSNormalization")
    assert np.array_equal(node.inputs[1].values, np.ones(8, np.float32))


def test_fp16_input_with_fp32_compute_fuses_onto_the_fp16_tensor():
    model = parse(18, "g (float16[1,4,8] h) => (float16[1,4,8] y) <float16[8] w = {1,1,1,1,2,2,2,2}, int64[1] ax = {-1}>", """
        x = Cast<to=1>(h)
        p = Mul(x, x)
        m = ReduceMean(p, ax)
        e = Constant<value=float {1e-6}>()
        a = Add(m, e)
        s = Sqrt(a)
        r = Reciprocal(s)
        n = Mul(x, r)
        c = Cast<to=10>(n)
        y = Mul(c, w)""")
    ir, record = rewrite(model)
    assert record.stats["fused"] == 1 and ops(ir) == Counter({"RMSNormalization": 1})
    node = next(n for n in ir.graph.nodes if n.op == "RMSNormalization")
    assert node.inputs[0].name == "h" and node.attrs["stash_type"] == 1 and node.inputs[1].values.dtype == np.float16


@pytest.mark.parametrize("change, reason", [
    ("m = ReduceMean<axes=[1]>(p)", "not the single last axis"),
    ("a = Add(m, m)", "Add(constant eps)"),
    ("n = Mul(h, r)", "does not multiply the squared tensor"),
    ("two = Constant<value=float {3.0}>()", "not Pow(x, 2)"),
])
def test_near_misses_are_left_with_a_reason(change, reason):
    text = onnx.printer.to_text(TS_RMSNORM)
    key = change.split(" = ")[0] + " = "
    line = next(ln for ln in text.splitlines() if ln.strip().startswith(key))
    model = onnx.parser.parse_model(text.replace(line.strip(), change))
    ir = load_model(model)
    result = PassManager(parse_pipeline("fuse-rmsnorm"), RunConfig(strict=True), context=PassContext(verbose=True)).run(ir)
    assert result.records[-1].stats["fused"] == 0 and "RMSNormalization" not in ops(ir)
    assert any(reason in note for note in result.records[-1].notes)


def test_rank_above_four_is_not_fused_htp_rmsnorm_limit():
    model = parse(23, "g (float[1,2,2,3,8] x) => (float[1,2,2,3,8] y) <int64[1] ax = {-1}, float e = {1e-5}>",
                  "p = Mul(x, x) \n m = ReduceMean(p, ax) \n a = Add(m, e) \n s = Sqrt(a) \n y = Div(x, s)", ir_version=11)
    ir, record = rewrite(model)
    assert record.stats["fused"] == 0 and record.changed is False


def test_opset_kept_when_raising_is_disabled():
    ir, record = rewrite(TS_RMSNORM, "fuse-rmsnorm{raise_opset=false}")
    assert record.stats["fused"] == 0 and ir.opset == 17 and any("raise_opset=false" in n for n in record.notes)


def test_opset_kept_when_another_op_would_change_meaning():
    model = parse(17, "g (float[2,8] x, float[1,8,1] z) => (float[2,8] y, float[1,8,2] f) <float e = {1e-5}>",
                  "p = Mul(x, x) \n m = ReduceMean<axes=[-1]>(p) \n a = Add(m, e) \n s = Sqrt(a) \n y = Div(x, s) \n"
                  "f = DFT<onesided=0>(z)")
    ir, record = rewrite(model)
    assert record.stats["fused"] == 0 and ir.opset == 17
    assert any("DFT" in note and "opset 20" in note for note in record.notes)


def test_opset_raise_converts_split_and_reduce_attributes():
    model = parse(17, "g (float[2,8] x) => (float[2,4] a, float[2,4] b, float[2,1] m)",
                  "a, b = Split<axis=1>(x) \n m = ReduceMax<axes=[1]>(x)")
    ir = load_model(model)
    assert raise_opset(ir, PassContext(), 23) is None
    split, rmax = ir.graph.nodes
    assert split.attrs["num_outputs"] == 2 and "axes" not in rmax.attrs and list(rmax.inputs[1].values) == [1]
    x = {"x": np.arange(16, dtype=np.float32).reshape(2, 8)}
    got, want = run_cpu(ir, x), run_cpu(load_model(model), x)
    assert all(np.array_equal(got[k], want[k]) for k in want)


# ------------------------------------------------------------------ real fixtures


@pytest.mark.parametrize("name", LLAMA_FAMILY)
def test_fixture_fused_and_outputs_unchanged(name):
    ir, record = rewrite(fixture_path(name), inputs=fixture_inputs(name))
    assert record.stats["fused"] == 5 and record.stats["not_matched"] == 0  # 2 layers x 2 + final norm
    assert ops(ir)["RMSNormalization"] == 5 and ops(ir)["Sqrt"] == 0 and ops(ir)["Pow"] == 0
    comparison = compare_outputs(fixture_outputs(name), run_cpu(ir, fixture_inputs(name)))
    assert comparison.max_abs <= 1e-4, comparison.failure()


@pytest.mark.parametrize("name", [n for n in FIXTURE_NAMES if n.endswith("_ts")])
def test_opset_raise_17_to_23_keeps_every_ts_fixture_bit_identical(name):
    ir = load_model(fixture_path(name))
    assert raise_opset(ir, PassContext(), 23) is None and ir.opset == 23
    got, want = run_cpu(ir, fixture_inputs(name)), run_cpu(fixture_path(name), fixture_inputs(name))
    assert all(np.array_equal(got[k], want[k]) for k in want)


# ------------------------------------------------------------------ real HTP


@requires_htp
def test_fused_llama_runs_entirely_on_htp_with_native_rmsnorm(tmp_path):
    from qnnpasses.backends.htp import probe_placement

    ir, _ = rewrite(fixture_path("llama_gqa_ts"), inputs=fixture_inputs("llama_gqa_ts"))
    path = save_model(ir, tmp_path / "fused.onnx")
    placement = probe_placement(path, inputs=fixture_inputs("llama_gqa_ts"))
    assert placement.ok, placement.error
    assert placement.qnn_partitions == 1 and placement.cpu_nodes == []
    by_type = placement.qnn_graph_ops["by_type"]
    assert by_type.get("RmsNorm") == 5 and "ElementWisePower" not in by_type


@requires_htp
def test_htp_rmsnorm_is_fp16_safe_for_massive_activations_where_the_decomposed_form_is_not():
    """The measurement behind the target choice: one channel at 30,000 in half the rows."""
    from qnnpasses.backends.htp import run_on_htp

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 8, 64)).astype(np.float32)
    x[0, ::2, 7] = 30000.0
    weight = "{" + ",".join(["1.0"] * 64) + "}"
    native = parse(23, f"g (float[1,8,64] x) => (float[1,8,64] y) <float[64] w = {weight}>",
                   "y = RMSNormalization<epsilon=1e-6>(x, w)", ir_version=11)
    decomposed = parse(17, "g (float[1,8,64] x) => (float[1,8,64] y)", "two = Constant<value=float {2.0}>() \n"
                       "p = Pow(x, two) \n m = ReduceMean<axes=[-1]>(p) \n e = Constant<value=float {1e-6}>() \n"
                       "a = Add(m, e) \n s = Sqrt(a) \n y = Div(x, s)")
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
    got_native = run_on_htp(native.SerializeToString(), {"x": x})["y"]
    got_decomposed = run_on_htp(decomposed.SerializeToString(), {"x": x})["y"]
    assert worst_row_error(got_native, want) < 1e-2  # fp16 rounding
    assert worst_row_error(got_decomposed, want) > 1.0  # x^2 overflowed: the massive rows are off by ~80x


def worst_row_error(got: np.ndarray, want: np.ndarray) -> float:
    """Max over rows of max|got - want| / max|want|: a cosine would hide a wrong row scale."""
    return float((np.abs(got - want).max(-1) / np.abs(want).max(-1)).max())
