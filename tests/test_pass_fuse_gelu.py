"""fuse-gelu: every spelling of the Erf and Tanh GeLU => Gelu, and no GeLU node left on the CPU."""

from __future__ import annotations

from collections import Counter

import onnx
import onnx.parser
import pytest
from conftest import fixture_inputs, fixture_outputs, fixture_path, requires_htp
from pass_testing import op_counts, run_strictly

from qnnpasses.backends.cpu import compare_outputs, run_cpu
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import save_model

ERF_HF = "c = Constant<value=float {1.4142135}>() \n d = Div(x, c) \n e = Erf(d) \n o = Constant<value=float {1.0}>() \n" \
         "a = Add(e, o) \n m = Mul(x, a) \n h = Constant<value=float {0.5}>() \n y = Mul(m, h)"
# 0.5*x*(1+erf(x*0.7071)) evaluated left to right: the QNN EP's own Erf fusion misses it
ERF_HALF_FIRST = "c = Constant<value=float {0.70710678}>() \n d = Mul(c, x) \n e = Erf(d) \n o = Constant<value=float {1.0}>() \n" \
                 "a = Add(o, e) \n h = Constant<value=float {0.5}>() \n hx = Mul(h, x) \n y = Mul(a, hx)"
ERF_HALF_INSIDE = "c = Constant<value=float {0.7071}>() \n d = Mul(x, c) \n e = Erf(d) \n o = Constant<value=float {1.0}>() \n" \
                  "a = Add(e, o) \n h = Constant<value=float {0.5}>() \n ha = Mul(a, h) \n y = Mul(x, ha)"
TANH_POW = "h = Constant<value=float {0.5}>() \n hx = Mul(x, h) \n three = Constant<value=float {3.0}>() \n p = Pow(x, three) \n" \
           "c = Constant<value=float {0.044715}>() \n q = Mul(p, c) \n s = Add(x, q) \n k = Constant<value=float {0.7978846}>() \n" \
           "u = Mul(s, k) \n t = Tanh(u) \n o = Constant<value=float {1.0}>() \n a = Add(t, o) \n y = Mul(hx, a)"
# torch's own tanh GeLU as the TorchScript exporter writes it (x*x*x, constants first)
TANH_TORCH = "xx = Mul(x, x) \n x3 = Mul(x, xx) \n c = Constant<value=float {0.044715}>() \n q = Mul(c, x3) \n s = Add(x, q) \n" \
             "k = Constant<value=float {0.7978846}>() \n u = Mul(k, s) \n t = Tanh(u) \n o = Constant<value=float {1.0}>() \n" \
             "a = Add(o, t) \n m = Mul(x, a) \n h = Constant<value=float {0.5}>() \n y = Mul(h, m)"


def model(body: str, opset: int = 17, prologue: str = "x = Identity(x_in)"):
    return onnx.parser.parse_model(f'<ir_version: 8, opset_import: ["" : {opset}]> '
                                   f'g (float[1,8,32] x_in) => (float[1,8,32] y) {{ {prologue} \n {body} }}')


def rewrite(source, spec: str = "fuse-gelu", inputs=None):
    return run_strictly(source, spec, inputs)

ops = op_counts


@pytest.mark.parametrize("body, approximate", [
    (ERF_HF, "none"), (ERF_HALF_FIRST, "none"), (ERF_HALF_INSIDE, "none"), (TANH_POW, "tanh"), (TANH_TORCH, "tanh"),
], ids=["erf-hf", "erf-half-first", "erf-half-inside", "tanh-pow", "tanh-torch"])
def test_spellings_fuse_into_gelu_at_opset_20(body, approximate):
    ir, record = rewrite(model(body))
    assert record.stats == {"fused": 1, "fused_contrib": 0, "left": 0, "opset": "17->20"}
    assert ops(ir) == Counter({"Identity": 1, "Gelu": 1})
    gelu = next(n for n in ir.graph.nodes if n.op == "Gelu")
    assert gelu.attrs["approximate"] == approximate and gelu.inputs[0].name == "x"


def test_variable_is_the_nearest_tensor_not_the_matmul_behind_a_bias():
    """Erf(Div(Add(x, b), sqrt2)): the GeLU input is the biased tensor."""
    ir, _ = rewrite(model(ERF_HF.replace("Div(x, c)", "Div(xb, c)").replace("Mul(x, a)", "Mul(xb, a)"),
                          prologue="x = Identity(x_in) \n b = Constant<value=float {0.25}>() \n xb = Add(x, b)"))
    gelu = next(n for n in ir.graph.nodes if n.op == "Gelu")
    assert gelu.inputs[0].name == "xb"


def test_below_opset_20_without_raising_uses_contrib_gelu_for_erf_and_keeps_tanh():
    ir, record = rewrite(model(ERF_HF), "fuse-gelu{raise_opset=false}")
    assert record.stats["fused_contrib"] == 1 and ir.opset == 17
    assert next(n for n in ir.graph.nodes if n.op == "Gelu").domain == "com.microsoft"
    ir, record = rewrite(model(TANH_POW), "fuse-gelu{raise_opset=false}")
    assert record.stats["left"] == 1 and not record.changed and ops(ir)["Tanh"] == 1


@pytest.mark.parametrize("old, new", [("{0.5}", "{0.6}"), ("{0.044715}", "{0.05}"), ("{1.4142135}", "{1.5}")])
def test_other_functions_are_not_fused(old, new):
    body = TANH_POW if old == "{0.044715}" else ERF_HF
    ir, record = rewrite(model(body.replace(old, new)))
    assert record.stats["fused"] == 0 and "Gelu" not in ops(ir)
    assert record.notes  # says why


def test_gelu_feeding_gelu_both_fuse():
    """The second match names the first one's output, which the first rewrite replaces."""
    first = ERF_HF.replace("y = Mul(m, h)", "g = Mul(m, h)")
    second = "g2 = Mul(g, g) \n g3 = Mul(g, g2) \n c3 = Constant<value=float {0.044715}>() \n q = Mul(c3, g3) \n" \
             "s = Add(g, q) \n k = Constant<value=float {0.7978846}>() \n u = Mul(k, s) \n t = Tanh(u) \n" \
             "o2 = Constant<value=float {1.0}>() \n a2 = Add(o2, t) \n m2 = Mul(g, a2) \n h2 = Constant<value=float {0.5}>() \n" \
             "y = Mul(h2, m2)"
    ir, record = rewrite(model(first + " \n " + second))
    assert record.stats["fused"] == 2 and ops(ir) == Counter({"Identity": 1, "Gelu": 2})


# ------------------------------------------------------------------ real fixtures


@pytest.mark.parametrize("name, fused", [("bert_ts", 2), ("gpt2_ts", 2), ("gpt2_dynamo", 2), ("bert_dynamo", 0)])
def test_fixtures(name, fused):
    ir, record = rewrite(fixture_path(name), inputs=fixture_inputs(name))
    # bert_dynamo's exporter writes Gelu itself: no Erf or Tanh to match, and the pass is not run
    assert record.stats.get("fused", 0) == fused
    assert (record.reason == "no Erf, Tanh in the graph") == (name == "bert_dynamo")
    assert ops(ir)["Gelu"] == 2 and ops(ir)["Erf"] == 0 and ops(ir)["Tanh"] == 0
    comparison = compare_outputs(fixture_outputs(name), run_cpu(ir, fixture_inputs(name)))
    assert comparison.max_abs <= 1e-4, comparison.failure()


# ------------------------------------------------------------------ real HTP


@requires_htp
def test_erf_spelling_the_qnn_ep_misses_leaves_the_cpu_after_fusion(tmp_path):
    from qnnpasses.backends.htp import probe_placement

    raw_ir = load_model(model(ERF_HALF_FIRST))
    raw = save_model(raw_ir, tmp_path / "raw.onnx")
    erf = next(n.name for n in raw_ir.graph.nodes if n.op == "Erf")
    before = probe_placement(raw)
    assert before.cpu_nodes == [erf] and before.qnn_partitions == 2
    ir, _ = rewrite(raw)
    after = probe_placement(save_model(ir, tmp_path / "fused.onnx"))
    assert after.ok and after.qnn_partitions == 1 and after.cpu_nodes == []
    assert after.qnn_graph_ops["by_type"].get("Gelu") == 1


@requires_htp
@pytest.mark.parametrize("name", ["bert_ts", "gpt2_ts", "bert_dynamo", "gpt2_dynamo"])
def test_no_gelu_node_on_the_cpu_for_bert_and_gpt2(tmp_path, name):
    """Placement with onnxruntime's graph optimizations off: what the graph itself says."""
    from qnnpasses.backends.htp import probe_placement

    ir, _ = rewrite(fixture_path(name), inputs=fixture_inputs(name))
    placement = probe_placement(save_model(ir, tmp_path / "fused.onnx"), inputs=fixture_inputs(name), optimize=False)
    gelus = [n.name for n in ir.graph.nodes if n.op == "Gelu"]
    assert len(gelus) == 2 and all(placement.node_verdict(g)[0] == "htp" for g in gelus)
    assert placement.qnn_graph_ops["by_type"].get("Gelu") == 2
