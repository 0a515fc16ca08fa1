"""mha-to-gqa (lossy): K/V projection heads mean-pooled per group, grouped attention; exact
against an MHA whose K/V heads were replaced by their group means; fully on the HTP."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from conftest import fixture_inputs, requires_htp
from qnnpasses.ir.attention import find_attentions
from qnnpasses.passes.attention._proj import find_head_split, find_projection
from test_pass_gqa_broadcast import (
    HTP_PREFIX,
    apply,
    cosine,
    on_htp,
    ops,
    parse,
    prepared,
)

from qnnpasses.backends.cpu import run_cpu
from qnnpasses.ir.checks import check_model
from qnnpasses.passmanager.api import PassContext
from qnnpasses.passmanager.manager import PassManager, RunConfig
from qnnpasses.passmanager.rewrite import constant_value
from qnnpasses.passmanager.spec import parse_pipeline

S, E, H, D = 8, 64, 4, 16
RNG = np.random.default_rng(0)
W = {n: RNG.standard_normal((E, E)).astype(np.float32) * 0.2 for n in "qkv"}
B = {n: RNG.standard_normal(E).astype(np.float32) for n in "kv"}


def _fmt(a: np.ndarray) -> str:
    return "{" + ",".join(repr(float(x)) for x in a.ravel()) + "}"


def _tiny(fused: bool):
    """Llama-style MHA without rotary: separate (or fused + Split) projections, explicit head counts."""
    if fused:
        fused_weight = _fmt(np.concatenate([W["q"], W["k"], W["v"]], 1))
        proj = f"float[{E},{3 * E}] wqkv = {fused_weight}, int64[3] sp = {{64,64,64}}"
        head = ("qkv = MatMul(x, wqkv) \n ql, kl0, vl0 = Split<axis=-1>(qkv, sp) \n"
                " kl = Add(kl0, bk) \n vl = Add(vl0, bv)")
    else:
        proj = ", ".join(f"float[{E},{E}] w{n} = {_fmt(W[n])}" for n in "qkv")
        head = "ql = MatMul(x, wq) \n k0 = MatMul(x, wk) \n kl = Add(bk, k0) \n v0 = MatMul(x, wv) \n vl = Add(v0, bv)"
    mask = np.where(np.tril(np.ones((S, S), bool)), 0.0, -1e4)
    body = head + """
        q4 = Reshape(ql, hs) \n k4 = Reshape(kl, hs) \n v4 = Reshape(vl, hs)
        q = Transpose<perm=[0,2,1,3]>(q4) \n k = Transpose<perm=[0,2,1,3]>(k4) \n v = Transpose<perm=[0,2,1,3]>(v4)
        kt = Transpose<perm=[0,1,3,2]>(k)
        s = MatMul(q, kt) \n ss = Mul(s, sc) \n a = Add(ss, mask) \n p = Softmax<axis=-1>(a)
        o = MatMul(p, v) \n ot = Transpose<perm=[0,2,1,3]>(o) \n y = Reshape(ot, os)"""
    inits = (f"<{proj}, float[{E}] bk = {_fmt(B['k'])}, float[{E}] bv = {_fmt(B['v'])},"
             f" int64[4] hs = {{1,{S},{H},{D}}}, int64[3] os = {{1,{S},{E}}}, float sc = {{0.25}},"
             f" float[1,1,{S},{S}] mask = {_fmt(mask)}>")
    return parse(body, f"g (float[1,{S},{E}] x) => (float[1,{S},{E}] y) {inits}")


def _numpy_gqa(x: np.ndarray, groups: int) -> np.ndarray:
    """Independent reference: K/V heads pooled per group, each query head attends with its group's head."""
    def heads(t):
        return t.reshape(S, -1, D).transpose(1, 0, 2)

    def pooled(n):
        w = W[n].reshape(E, H // groups, groups, D).mean(2).reshape(E, -1)
        b = B[n].reshape(H // groups, groups, D).mean(1).reshape(-1)
        return np.repeat(heads(x[0] @ w + b), groups, axis=0)

    q, k, v = heads(x[0] @ W["q"]), pooled("k"), pooled("v")
    s = q @ k.transpose(0, 2, 1) * 0.25 + np.where(np.tril(np.ones((S, S), bool)), 0.0, -1e4)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p @ v).transpose(1, 0, 2).reshape(1, S, E)


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused-qkv-split"])
def test_tiny_mha_becomes_gqa_with_mean_pooled_heads(fused):
    ir = _tiny(fused)
    x = {"x": RNG.standard_normal((1, S, E)).astype(np.float32)}
    record = apply(ir, "mha-to-gqa{groups=2}", lossy=True, inputs=x)
    assert record.stats == {"converted": 1, "groups": 2, "heads_before": 4, "heads_after": 2, "head_dim": 16,
                            "kv_cache_bytes_per_token_saved": 2 * 1 * 2 * 16 * 4, "weight_bytes_saved": 2 * 32 * 65 * 4}
    weights = sorted(tuple(t.shape) for t in ir.graph.tensors().values()
                     if isinstance(t, gs.Constant) and len(t.shape) == 2)
    assert weights == ([(64, 128)] if fused else [(64, 32), (64, 32), (64, 64)])
    if fused:
        split = next(n for n in ir.graph.nodes if n.op == "Split")
        assert constant_value(split.inputs[1]).tolist() == [64, 32, 32]
    assert ops(ir)["Tile"] == 0  # the constant mask is tiled at compile time
    np.testing.assert_allclose(run_cpu(ir, x)["y"], _numpy_gqa(x["x"], 2), atol=1e-5)
    assert record.lossless is False and record.verification["cosine"] < 1.0


def test_runs_only_when_lossy_passes_are_allowed():
    ir = _tiny(False)
    record = PassManager(parse_pipeline("mha-to-gqa")).run(ir).records[-1]
    assert record.status == "skipped" and "allow-lossy" in record.reason and ops(ir)["Split"] == 0


def _prepend_past(ir, consumer: gs.Node, index: int, name: str) -> None:
    """``consumer.inputs[index]`` becomes ``Concat(past, it)`` along the sequence, ``past`` a graph input."""
    past = gs.Variable(name, dtype=np.float32, shape=[1, H, 2, D])
    ir.graph.inputs.append(past)
    concat = gs.Node("Concat", f"cat_{name}", {"axis": 2}, inputs=[past, consumer.inputs[index]],
                     outputs=[gs.Variable(f"{name}_all", dtype=np.float32)])
    ir.graph.nodes.append(concat)
    consumer.inputs[index] = concat.outputs[0]


def test_kv_cache_in_the_interface_is_not_converted():
    ir = _tiny(False)
    _prepend_past(ir, next(n for n in ir.graph.nodes if n.op == "Transpose" and n.attrs["perm"] == [0, 1, 3, 2]), 0,
                  "past_key")
    _prepend_past(ir, next(n for n in ir.graph.nodes if n.op == "MatMul" and n.inputs[0].name == "p"), 1, "past_value")
    add = next(n for n in ir.graph.nodes if n.op == "Add" and n.inputs[1].name == "mask")
    add.inputs[1] = gs.Constant("no_mask", np.zeros((1, 1, 1, 1), np.float32))
    ir.graph.toposort()
    assert check_model(ir, refresh=True) is None
    result = PassManager(parse_pipeline("mha-to-gqa"), RunConfig(allow_lossy=True),
                         context=PassContext(verbose=True, allow_lossy=True)).run(ir).records[-1]
    assert result.stats == {"converted": 0}
    assert any("graph input (KV cache)" in note for note in result.notes)


# --------------------------------------------------------------------------- real fixtures

def _pooled_mha_reference(name: str, groups: int = 2) -> dict:
    """The original MHA fixture with each K/V head replaced by its group mean (heads stay H)."""
    ir = prepared(name)
    for att in find_attentions(ir.graph):
        for side in (att.key, att.value):
            proj = find_projection(find_head_split(side.start, side.head_axis, att.heads, ir.graph))
            targets = [(proj.weight_node, proj.weight_index, 0 if proj.weight_rows else 1, proj.begin, proj.end)]
            if proj.bias_node is not None:
                targets.append((proj.bias_node, proj.bias_index, 0, proj.bias_begin, proj.bias_end))
            for node, index, axis, begin, end in targets:
                values = np.moveaxis(constant_value(node.inputs[index]).copy(), axis, -1)
                block = values[..., begin:end].reshape(values.shape[:-1] + (att.heads // groups, groups, att.head_dim))
                block = np.repeat(block.mean(-2, keepdims=True), groups, axis=-2)
                values[..., begin:end] = block.reshape(values.shape[:-1] + (-1,))
                pooled = np.ascontiguousarray(np.moveaxis(values, -1, axis))
                node.inputs[index] = gs.Constant(f"{node.inputs[index].name}_pooled", pooled)
    return run_cpu(ir, fixture_inputs(name))


@pytest.mark.parametrize("name", ["llama_mha_ts", "llama_mha_dynamo", "gpt2_dynamo", "phi3_ts", "bert_ts"])
def test_fixture_equals_pooled_mha_and_stats_are_exact(name):
    ir = prepared(name)
    record = apply(ir, "mha-to-gqa{groups=2}", lossy=True)
    itemsize = 4  # float32 K/V
    assert record.stats["converted"] == 2 and record.stats["heads_before"] == 4 and record.stats["heads_after"] == 2
    assert record.stats["kv_cache_bytes_per_token_saved"] == 2 * 2 * (4 - 2) * 16 * itemsize
    assert 0.5 < record.verification["cosine"] < 1.0  # the deviation is recorded, not rolled back
    got, reference = run_cpu(ir, fixture_inputs(name)), _pooled_mha_reference(name)
    assert max(float(np.max(np.abs(got[k] - reference[k]))) for k in reference) <= 1e-4


@requires_htp
@pytest.mark.parametrize("name", ["llama_mha_ts", "llama_mha_dynamo"])
def test_converted_model_runs_fully_on_htp(name):
    ir = prepared(name, HTP_PREFIX)
    assert apply(ir, "mha-to-gqa{groups=2}", lossy=True).stats["converted"] == 2
    placement, outputs = on_htp(ir, fixture_inputs(name))
    assert placement.ok and placement.qnn_partitions == 1 and placement.cpu_nodes == []
    cpu = run_cpu(ir, fixture_inputs(name))
    assert cosine(outputs["logits"], cpu["logits"]) >= 0.9999
