"""attention-cleanup: row guards removed only where mask analysis allows it; -inf/finfo.min masks
made finite (-1e4); fully masked query rows keep the original's value; identical softmax on CPU,
and the QNN quantization recipe works on the HTP."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from conftest import fixture_inputs, fixture_outputs, requires_htp
from onnx import TensorProto, helper, numpy_helper
from qnnpasses.passes.attention.attention_cleanup import AttentionCleanup
from test_pass_gqa_broadcast import (
    HTP_PREFIX,
    apply,
    cosine,
    max_abs_vs,
    on_htp,
    ops,
    parse,
    prepared,
)

from qnnpasses.backends.cpu import run_cpu
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import save_model
from qnnpasses.passmanager.api import PassContext

FMIN = float(np.finfo(np.float32).min)
SIG = "g (float[1,2,4,8] q, float[1,2,4,8] k, float[1,2,4,8] v{extra}) => (float[1,2,4,8] y)"
ATTENTION = """
    kt = Transpose<perm=[0,1,3,2]>(k)
    s = MatMul(q, kt)
    a = Add(s, m)
    p = Softmax<axis=-1>(a)
    y0 = MatMul(p, v)"""
GUARD = """
    nan = IsNaN(p)
    pg = Where(nan, zero, p)
    y = MatMul(pg, v)"""
CAUSAL = "{" + ",".join("1" if j <= i else "0" for i in range(4) for j in range(4)) + "}"


def _model(mask_body: str, extra: str = "", inits: str = "", guard: bool = True):
    body = mask_body + ATTENTION + (GUARD if guard else "\n y = Identity(y0)")
    return parse(body, SIG.format(extra=extra) + f" <float zero = {{0.0}}, bool[1,1,4,4] causal = {CAUSAL}{inits}>")


def _feeds(pad: int = 0) -> dict:
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((1, 2, 4, 8), np.float32) for n in "qkv"}
    feeds["pad"] = np.arange(4).reshape(1, 1, 1, 4) >= pad
    feeds["keep"] = feeds["pad"].astype(np.float32)
    return feeds


def _inputs(ir, feeds):
    return {t.name: feeds[t.name] for t in ir.graph.inputs}


def _run(ir, spec: str, feeds: dict):
    record = apply(ir, spec, inputs=_inputs(ir, feeds))
    return record, run_cpu(ir, _inputs(ir, feeds))["y"]


def test_folded_causal_mask_proves_every_row_keeps_a_key():
    ir = _model("m = Where(causal, zero, minf)", inits=", float minf = {-inf}")
    feeds = _feeds()
    before = run_cpu(ir, _inputs(ir, feeds))["y"]
    record, after = _run(ir, "attention-cleanup", feeds)
    assert record.stats == {"nan_guards_removed": 1, "nan_guards_kept": 0, "masked_row_tests": 0,
                            "mask_constants_replaced": 1, "mask_values_replaced": 1}
    assert ops(ir)["IsNaN"] == 0 and ops(ir)["Where"] == 1
    where = next(n for n in ir.graph.nodes if n.op == "Where")
    assert np.ravel(where.inputs[2].values).tolist() == [-1e4]
    np.testing.assert_allclose(after, before, atol=1e-6)


def test_padding_mask_from_an_input_keeps_the_guard_unless_assumed():
    """The guard stays, testing the row maximum (IsNaN never fires on a finite mask): fully masked
    rows give the original's 0, every other row is unchanged."""
    mask = "c = And(causal, pad) \n m = Where(c, zero, minf)"
    ir = _model(mask, extra=", bool[1,1,1,4] pad", inits=", float minf = {-inf}")
    feeds = _feeds(pad=2)  # rows 0 and 1 see no key at all
    before = run_cpu(ir, _inputs(ir, feeds))["y"]
    record, after = _run(ir, "attention-cleanup", feeds)
    assert record.stats["nan_guards_kept"] == 1 and record.stats["nan_guards_removed"] == 0
    assert record.stats["masked_row_tests"] == 1 and record.stats["mask_constants_replaced"] == 1
    assert ops(ir)["IsNaN"] == 0 and ops(ir)["Less"] == 1 and ops(ir)["ReduceMax"] == 1
    assert np.all(before[:, :, :2] == 0)
    np.testing.assert_allclose(after, before, atol=1e-6)
    ir = _model(mask, extra=", bool[1,1,1,4] pad", inits=", float minf = {-inf}")
    record, _ = _run(ir, "attention-cleanup{assume_unmasked_rows=true}", _feeds())
    assert record.stats["nan_guards_removed"] == 1 and ops(ir)["IsNaN"] == 0 and ops(ir)["Less"] == 0


def test_unguarded_finfo_min_rows_stay_uniform():
    """No guard, finfo.min: a fully masked row is uniform (all its inputs round to finfo.min); the
    clamp Max(x, -5000) keeps it so, at one op."""
    mask = "c = And(causal, pad) \n m = Where(c, zero, fmin)"
    ir = _model(mask, extra=", bool[1,1,1,4] pad", inits=f", float fmin = {{{FMIN!r}}}", guard=False)
    feeds = _feeds(pad=2)
    before = run_cpu(ir, _inputs(ir, feeds))["y"]
    record, after = _run(ir, "attention-cleanup", feeds)
    assert record.stats["masked_row_tests"] == 1 and ops(ir)["Max"] == 1 and ops(ir)["Where"] == 1
    np.testing.assert_allclose(before[:, :, :2], np.broadcast_to(feeds["v"].mean(axis=2, keepdims=True),
                                                                 (1, 2, 2, 8)), atol=1e-6)
    np.testing.assert_allclose(after, before, atol=1e-6)


def test_unguarded_minus_inf_rows_are_undefined():
    """No guard, -inf: a fully masked row is NaN in the original; no row test is added."""
    mask = "c = And(causal, pad) \n m = Where(c, zero, minf)"
    ir = _model(mask, extra=", bool[1,1,1,4] pad", inits=", float minf = {-inf}", guard=False)
    feeds = _feeds(pad=2)
    before = run_cpu(ir, _inputs(ir, feeds))["y"]
    record, after = _run(ir, "attention-cleanup", feeds)
    assert record.stats["masked_row_tests"] == 0 and record.stats["mask_constants_replaced"] == 1
    assert np.isnan(before[:, :, :2]).all() and np.isfinite(after).all()
    np.testing.assert_allclose(after[:, :, 2:], before[:, :, 2:], atol=1e-6)


def test_bool_mask_input_with_an_empty_row_and_symbolic_keys():
    """A boolean query x key mask given as an input, keys of unknown length."""
    sig = "g (float[1,2,4,8] q, float[1,2,N,8] k, float[1,2,N,8] v, bool[4,N] am) => (float[1,2,4,8] y)"
    body = "m = Where(am, zero, fmin)" + ATTENTION + "\n y = Identity(y0)"
    ir = parse(body, sig + f" <float zero = {{0.0}}, float fmin = {{{FMIN!r}}}>")
    feeds = _feeds()
    feeds["am"] = np.tril(np.ones((4, 4), bool))
    feeds["am"][1] = False  # query row 1 sees no key
    before = run_cpu(ir, {k: feeds[k] for k in ("q", "k", "v", "am")})["y"]
    record = apply(ir, "attention-cleanup", inputs={k: feeds[k] for k in ("q", "k", "v", "am")})
    after = run_cpu(ir, {k: feeds[k] for k in ("q", "k", "v", "am")})["y"]
    assert record.stats["masked_row_tests"] == 1 and ops(ir)["Max"] == 1
    np.testing.assert_allclose(after, before, atol=1e-6)


@pytest.mark.parametrize("mask_body,inits", [
    ("t = Sub(one, keep) \n m = Mul(t, fmin)", f", float one = {{1.0}}, float fmin = {{{FMIN!r}}}"),
    ("c = And(causal, pad) \n m = Where(c, zero, big)", ", float big = {-1e9}"),
], ids=["(1-mask)*finfo.min", "where-minus-1e9"])
def test_additive_mask_spellings_become_finite(mask_body, inits):
    extra = ", float[1,1,1,4] keep" if "keep" in mask_body else ", bool[1,1,1,4] pad"
    ir = _model(mask_body, extra=extra, inits=inits, guard=False)
    feeds = _feeds(pad=1)  # key 0 masked: row 0 sees no key
    before = run_cpu(ir, _inputs(ir, feeds))["y"]
    record = apply(ir, "attention-cleanup", inputs=_inputs(ir, _feeds()))
    after = run_cpu(ir, _inputs(ir, feeds))["y"]
    assert record.stats["mask_constants_replaced"] == 1
    constants = [float(np.ravel(t.values)[0]) for t in ir.graph.tensors().values()
                 if isinstance(t, gs.Constant) and t.values.dtype == np.float32 and t.values.size == 1]
    assert -1e4 in constants and min(constants) == -1e4
    np.testing.assert_allclose(after, before, atol=1e-6)  # row 0 too


def test_moderate_masks_and_clamps_are_left_alone():
    ir = _model("m = Where(causal, zero, big)", inits=", float big = {-10000.0}", guard=False)
    record, _ = _run(ir, "attention-cleanup", _feeds())
    assert not record.changed and record.stats["mask_constants_replaced"] == 0


def test_mask_value_must_fit_fp16():
    ir = _model("m = Where(causal, zero, big)", inits=", float big = {-1e9}", guard=False)
    with pytest.raises(ValueError, match="fp16"):
        AttentionCleanup(mask_value=-70000.0).run(ir, PassContext())


# --------------------------------------------------------------------------- real fixtures

@pytest.mark.parametrize("name,spec,removed,kept,tests,constants", [
    ("llama_gqa_sdpa_ts", "attention-cleanup", 0, 2, 2, 2),  # -inf mask with padding: unprovable
    ("llama_gqa_sdpa_ts", "attention-cleanup{assume_unmasked_rows=true}", 2, 0, 0, 2),
    ("llama_gqa_sdpa_dynamo", "attention-cleanup", 2, 0, 2, 1),  # finfo.min: never NaN, rows may be uniform
    ("llama_gqa_ts", "attention-cleanup", 0, 0, 2, 1),
    ("llama_gqa_kv_dynamo", "attention-cleanup", 0, 0, 2, 1),
    ("mistral_ts", "attention-cleanup", 0, 0, 2, 1),
    ("phi3_dynamo", "attention-cleanup", 0, 0, 2, 1),
    ("gpt2_ts", "attention-cleanup", 0, 0, 2, 1),
    ("bert_dynamo", "attention-cleanup", 0, 0, 2, 1),
])
def test_fixture_outputs_unchanged(name, spec, removed, kept, tests, constants):
    """Verified by the manager on every case, padded-left (fully masked rows) included unless assumed."""
    ir = prepared(name)
    record = apply(ir, spec)
    assert record.stats["nan_guards_removed"] == removed and record.stats["nan_guards_kept"] == kept
    assert record.stats["masked_row_tests"] == tests and record.stats["mask_constants_replaced"] == constants
    assert ops(ir)["IsNaN"] == 0
    assert max_abs_vs(ir, fixture_outputs(name), fixture_inputs(name)) <= 1e-4


def test_left_padded_rows_keep_the_originals_values():
    name = "llama_gqa_ts"
    inputs = fixture_inputs(name)
    inputs["attention_mask"] = inputs["attention_mask"].copy()
    inputs["attention_mask"][:, :4] = 0  # left padding: query rows 0..3 see no key
    original = prepared(name)
    reference = run_cpu(original, inputs)["logits"]
    apply(original, "attention-cleanup")
    got = run_cpu(original, inputs)["logits"]
    assert np.max(np.abs(got - reference)) <= 1e-4


@requires_htp
def test_sdpa_fixture_runs_on_htp_without_guards():
    name = "llama_gqa_sdpa_ts"
    ir = prepared(name, HTP_PREFIX)
    apply(ir, "attention-cleanup{assume_unmasked_rows=true}")
    placement, outputs = on_htp(ir, fixture_inputs(name))
    assert placement.ok and placement.qnn_partitions == 1 and placement.cpu_nodes == []
    assert "IsNan" not in placement.qnn_graph_ops["by_type"]
    assert cosine(outputs["logits"], fixture_outputs(name)["logits"]) >= 0.9999


# --------------------------------------------------------------------------- quantized on the HTP

S, H, D = 64, 4, 32


def _attention_block(mask_value: float) -> onnx.ModelProto:
    """One attention block with a causal+padding mask Where(c, 0, mask_value), as HF exports it."""
    causal = np.tril(np.ones((S, S), bool))[None, None]
    node = helper.make_node
    nodes = [node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), node("MatMul", ["q", "kt"], ["s"]),
             node("Mul", ["s", "scale"], ["ss"]), node("And", ["causal", "pad"], ["c"]),
             node("Where", ["c", "zero", "neg"], ["m"]), node("Add", ["ss", "m"], ["a"]),
             node("Softmax", ["a"], ["p"], axis=-1), node("MatMul", ["p", "v"], ["y"])]
    values = {"scale": np.array(D ** -0.5, np.float32), "causal": causal, "zero": np.array(0, np.float32),
              "neg": np.array(mask_value, np.float32)}
    inits = [numpy_helper.from_array(value, name) for name, value in values.items()]
    info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, H, S, D]) for n in "qkv"]
    info.append(helper.make_tensor_value_info("pad", TensorProto.BOOL, [1, 1, 1, S]))
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, H, S, D])
    graph = helper.make_graph(nodes, "attn", info, [output], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _block_feeds(rng) -> dict:
    scale = np.sqrt(10 / 3)  # trained-like score spread (~10), unlike random-init fixtures (~0.1)
    feeds = {n: (rng.standard_normal((1, H, S, D)) * (scale if n != "v" else 1)).astype(np.float32) for n in "qkv"}
    feeds["pad"] = np.ones((1, 1, 1, S), bool)
    return feeds


@requires_htp
def test_quantized_attention_on_htp_needs_a_finite_mask():
    """onnxruntime's QNN QDQ recipe (uint16 activations): finfo.min puts the masked-score scale at 5e33."""
    from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    from qnnpasses.backends.htp import htp_session

    rng = np.random.default_rng(0)
    calibration, test = [_block_feeds(rng) for _ in range(4)], _block_feeds(rng)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter(calibration)

        def get_next(self):
            return next(self.items, None)

    original = load_model(_attention_block(FMIN))
    reference = run_cpu(original, test)["y"]
    cleaned = load_model(_attention_block(FMIN))
    assert apply(cleaned, "attention-cleanup", inputs=test).stats["mask_constants_replaced"] == 1
    cosines = {}
    with tempfile.TemporaryDirectory(prefix="attn_qdq_") as tmp:
        for label, ir in (("finfo.min", original), ("cleaned", cleaned)):
            src, dst = Path(tmp) / f"{label}.onnx", Path(tmp) / f"{label}.qdq.onnx"
            save_model(ir, src)
            config = get_qnn_qdq_config(str(src), Reader(), activation_type=QuantType.QUInt16,
                                        weight_type=QuantType.QUInt8)
            quantize(str(src), str(dst), config)
            got = htp_session(str(dst), fp16=False, disable_cpu_fallback=True).run(None, test)[0]
            cosines[label] = cosine(got, reference)
    assert cosines["finfo.min"] < 0.5  # masked-score scale 5e33: every score quantizes to 0
    assert cosines["cleaned"] >= 0.999
