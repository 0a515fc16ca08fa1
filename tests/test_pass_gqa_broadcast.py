"""gqa-broadcast: HF repeat_kv + attention => grouped attention in rank 4, exact on CPU, on the HTP.

Also hosts the helpers the attention-pass tests share (prepared fixtures, HTP runs)."""

from __future__ import annotations

import functools
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import pytest
from conftest import fixture_inputs, fixture_outputs, fixture_path, requires_htp

from qnnpasses.backends.cpu import run_cpu
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import save_model, to_model_bytes
from qnnpasses.passmanager.api import registered_passes
from qnnpasses.passmanager.manager import PassManager, RunConfig
from qnnpasses.passmanager.spec import parse_pipeline

# What runs before the attention passes in htp-llm.  Before the HTP finalizes the dynamo
# fixtures at all, other passes must also lower the padding-mask GatherND (bool GatherND is
# rejected) and fuse RMSNorm (its Mul(weight, x) with the constant first fails to finalize:
# "could not create op ForceFormat_Crouton").  Passes not registered (yet) are left out.
PREFIX = ("simplify",)
HTP_PREFIX = ("simplify", "gathernd", "fuse-rmsnorm", "lower-int64")


@functools.lru_cache(maxsize=None)
def _prepared_bytes(name: str, prefix: tuple[str, ...]) -> bytes:
    ir = load_model(fixture_path(name))
    spec = ",".join(p for p in prefix if p in registered_passes())  # others' passes may not exist yet
    PassManager(parse_pipeline(spec), RunConfig(strict=True)).run(ir)
    return to_model_bytes(ir)


def prepared(name: str, prefix: tuple[str, ...] = PREFIX):
    """A fresh IR of fixture ``name`` after the ``prefix`` passes (cached across tests)."""
    return load_model(onnx.load_from_string(_prepared_bytes(name, prefix)))


def apply(ir, spec: str, lossy: bool = False, inputs=None):
    """Run ``spec`` through the manager (checked, verified on CPU, strict) -> its last record."""
    config = RunConfig(verify=True, strict=True, allow_lossy=lossy, inputs=inputs)
    return PassManager(parse_pipeline(spec), config).run(ir).records[-1]


def parse(body: str, signature: str, opset: int = 17):
    header = f'<ir_version: 8, opset_import: ["" : {opset}]>'
    return load_model(onnx.parser.parse_model(f"{header} {signature} {{ {body} }}"))


def ops(ir) -> Counter:
    return Counter(n.op for n in ir.graph.nodes)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def max_abs_vs(ir, outputs: dict, inputs: dict) -> float:
    got = run_cpu(ir, inputs)
    return max(float(np.max(np.abs(got[k] - outputs[k]))) for k in outputs)


def on_htp(ir, inputs: dict):
    """(placement, outputs) of ``ir`` on the HTP in fp16; outputs come from a no-CPU-fallback session."""
    from qnnpasses.backends.htp import htp_session, probe_placement

    with tempfile.TemporaryDirectory(prefix="attn_htp_") as tmp:
        path = save_model(ir, Path(tmp) / "model.onnx")
        placement = probe_placement(path, inputs)
        sess = htp_session(str(path), fp16=True, disable_cpu_fallback=True)
        names = [o.name for o in sess.get_outputs()]
        return placement, dict(zip(names, sess.run(names, inputs), strict=True))


# --------------------------------------------------------------------------- tiny graphs

SIG = "g (float[1,4,8,16] q, float[1,2,8,16] k, float[1,2,8,16] v, float[1,1,8,8] mask) => (float[1,4,8,16] y)"
INIT = "<int64[1] ax2 = {2}, int64[5] e5 = {1,2,2,8,16}, int64[4] s4 = {1,4,8,16}, float sc = {0.25}>"
TS_REPEAT = """
    ku = Unsqueeze(k, ax2)
    ke = Expand(ku, e5)
    kr = Reshape(ke, s4)
    vu = Unsqueeze(v, ax2)
    ve = Expand(vu, e5)
    vr = Reshape(ve, s4)
    kt = Transpose<perm=[0,1,3,2]>(kr)
    s = MatMul(q, kt)
    ss = Mul(s, sc)
    sm = Add(mask, ss)
    p = Softmax<axis=-1>(sm)
    y = MatMul(p, vr)"""
# dynamo SDPA: repeat merged into a [B*H, S, D] reshape, scale split as sqrt(scale) onto Q and K.
SDPA_INIT = ("<int64[1] ax2 = {2}, int64[5] e5 = {1,2,2,8,16}, int64[3] s3 = {4,8,16}, int64[4] s4 = {1,4,16,8},"
             " int64[4] v4 = {1,4,8,16}, float h = {0.5}, float zero = {0.0}>")
SDPA_REPEAT = """
    ku = Unsqueeze(k, ax2)
    ke = Expand(ku, e5)
    k3 = Reshape(ke, s3)
    kt3 = Transpose<perm=[0,2,1]>(k3)
    kt = Reshape(kt3, s4)
    vu = Unsqueeze(v, ax2)
    ve = Expand(vu, e5)
    vr = Reshape(ve, v4)
    qh = Mul(q, h)
    kh = Mul(kt, h)
    s = MatMul(qh, kh)
    sm = Add(s, mask)
    p = Softmax<axis=-1>(sm)
    nan = IsNaN(p)
    pg = Where(nan, zero, p)
    y = MatMul(pg, vr)"""


def _feeds(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    causal = np.where(np.tril(np.ones((8, 8), bool)), 0.0, -1e4).astype(np.float32)[None, None]
    return {"q": rng.standard_normal((1, 4, 8, 16), np.float32), "k": rng.standard_normal((1, 2, 8, 16), np.float32),
            "v": rng.standard_normal((1, 2, 8, 16), np.float32), "mask": causal}


@pytest.mark.parametrize("init,body", [(INIT, TS_REPEAT), (SDPA_INIT, SDPA_REPEAT)], ids=["torchscript", "dynamo-sdpa"])
def test_repeat_kv_becomes_grouped_attention(init, body):
    ir = parse(body, f"{SIG} {init}")
    feeds = _feeds()
    before = run_cpu(ir, feeds)["y"]
    record = apply(ir, "gqa-broadcast", inputs=feeds)
    assert record.stats == {"rewritten": 1, "repeat_kv_removed": 2, "tiled_operands": 1, "groups": "2"}
    after = ops(ir)
    assert after["Expand"] == after["Unsqueeze"] == 0 and after["Tile"] == 1 and after["MatMul"] == 2
    assert after["Reshape"] == 2 and after["Transpose"] == 1  # query in, output out; K transposed once
    matmuls = {(tuple(n.inputs[0].shape), tuple(n.inputs[1].shape)) for n in ir.graph.nodes if n.op == "MatMul"}
    assert matmuls == {((1, 2, 16, 16), (1, 2, 16, 8)), ((1, 2, 16, 8), (1, 2, 8, 16))}  # [B, kvH, G*S, .]
    assert all(len(t.shape) <= 4 for t in ir.graph.tensors().values() if t.shape is not None)
    np.testing.assert_array_equal(run_cpu(ir, feeds)["y"], before)


def _alibi() -> str:
    slopes = 2.0 ** -np.arange(1, 5, dtype=np.float32)
    distance = -np.abs(np.arange(8)[None, :] - np.arange(8)[:, None]).astype(np.float32)
    return "{" + ",".join(repr(float(v)) for v in (slopes[:, None, None] * distance).ravel()) + "}"


CAUSAL = "{" + ",".join("1" if j <= i else "0" for i in range(8) for j in range(8)) + "}"


@pytest.mark.parametrize("score_ops,inits", [
    ("sm0 = Where(causal, ss, big) \n sm = Add(sm0, mask)", f", bool[1,1,8,8] causal = {CAUSAL}, float big = {{-1e4}}"),
    ("sm0 = Add(ss, alibi) \n sm = Add(mask, sm0)", f", float[1,4,8,8] alibi = {_alibi()}"),
], ids=["where-mask", "per-head-alibi-bias"])
def test_constant_score_operands_are_regrouped_at_compile_time(score_ops, inits):
    """Row-broadcast operands are tiled G times along the rows, per-head ones reshaped to [B, kvH, G*S, Skv]."""
    ir = parse(TS_REPEAT.replace("sm = Add(mask, ss)", score_ops), f"{SIG} {INIT[:-1]}{inits}>")
    feeds = _feeds()
    before = run_cpu(ir, feeds)["y"]
    record = apply(ir, "gqa-broadcast", inputs=feeds)
    assert record.stats["rewritten"] == 1 and record.stats["tiled_operands"] == 2
    assert ops(ir)["Tile"] == 1  # only the mask input needs a runtime Tile; constants are regrouped when folded
    np.testing.assert_array_equal(run_cpu(ir, feeds)["y"], before)


def test_wrong_grouping_order_is_left_alone():
    """Unsqueeze at axis 1 repeats heads as h % kvH (tile, not repeat_interleave): not HF's grouping."""
    body = TS_REPEAT.replace("Unsqueeze(k, ax2)", "Unsqueeze(k, ax1)").replace("Unsqueeze(v, ax2)", "Unsqueeze(v, ax1)")
    init = INIT.replace("int64[5] e5 = {1,2,2,8,16}", "int64[5] e5 = {1,2,2,8,16}, int64[1] ax1 = {1}")
    ir = parse(body, f"{SIG} {init}")
    from qnnpasses.passmanager.api import PassContext

    result = PassManager(parse_pipeline("gqa-broadcast"), context=PassContext(verbose=True)).run(ir).records[-1]
    assert result.stats["rewritten"] == 0 and ops(ir)["Expand"] == 2
    assert any("not a repeat_kv over the head axis" in note for note in result.notes)


def test_probabilities_read_elsewhere_are_left_alone():
    """output_attentions: a score tensor that leaves the region keeps its [B, H, S, Skv] layout."""
    signature = SIG.replace("=> (float[1,4,8,16] y)", "=> (float[1,4,8,16] y, float[1,4,8,8] p)")
    ir = parse(TS_REPEAT, f"{signature} {INIT}")
    record = apply(ir, "gqa-broadcast", inputs=_feeds())
    assert record.stats["rewritten"] == 0 and ops(ir)["Expand"] == 2


# --------------------------------------------------------------------------- real fixtures

GQA_FIXTURES = [f"{m}_{e}" for m in ("llama_gqa", "llama_gqa_sdpa", "llama_gqa_kv", "qwen2", "mistral")
                for e in ("ts", "dynamo")]


@pytest.mark.parametrize("name", GQA_FIXTURES)
def test_fixture_outputs_unchanged(name):
    ir = prepared(name)
    record = apply(ir, "gqa-broadcast")
    decode = "_kv" in name  # one query row: the [1, 1, 1, Skv] mask needs no tiling
    assert record.stats["rewritten"] == 2 and record.stats["repeat_kv_removed"] == 4
    assert record.stats["tiled_operands"] == (0 if decode else 2 if name == "llama_gqa_sdpa_ts" else 1)
    assert ops(ir)["Expand"] == 0
    assert max_abs_vs(ir, fixture_outputs(name), fixture_inputs(name)) <= 1e-4


def test_mha_fixture_is_not_touched():
    ir = prepared("llama_mha_ts")
    assert apply(ir, "gqa-broadcast").stats["rewritten"] == 0


HTP_FIXTURES = [f"{m}_{e}" for m in ("llama_gqa", "llama_gqa_kv", "qwen2", "mistral") for e in ("ts", "dynamo")]


@requires_htp
@pytest.mark.parametrize("name", HTP_FIXTURES)
def test_grouped_attention_runs_fully_on_htp(name):
    ir = prepared(name, HTP_PREFIX)
    assert apply(ir, "gqa-broadcast").stats["rewritten"] == 2
    placement, outputs = on_htp(ir, fixture_inputs(name))
    assert placement.ok and placement.qnn_partitions == 1 and placement.cpu_nodes == []
    assert placement.qnn_graph_ops["by_type"].get("Tile", 0) == (0 if "_kv" in name else 1)
    reference = fixture_outputs(name)
    assert min(cosine(outputs[k], reference[k]) for k in reference) >= 0.9999
