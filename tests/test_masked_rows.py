"""Fully masked attention rows: verification tries them, and htp-llm keeps what the original gives them.

A query row whose keys are all masked (left padding, a boolean mask with an empty row) is where
finite-mask rewrites go wrong without a trace on ordinary inputs.  ``--verify`` runs masks with
an empty first query row (``row-masked``) and lower-triangular ones (``causal``) besides the
all-visible, padded and scattered ones; ONNX's own fully masked Attention node tests come out of
``htp-llm`` as the original computes them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from test_pass_gqa_broadcast import ops, parse

from qnnpasses.backends.cpu import run_cpu, verification_cases
from qnnpasses.passes.attention._mask import replace_mask_constants
from qnnpasses.passmanager.api import CASE_CAUSAL, CASE_ROW_MASKED, EXACT, Pass, PassContext, PassResult
from qnnpasses.passmanager.manager import PassManager, RunConfig
from qnnpasses.passmanager.rewrite import finish
from qnnpasses.passmanager.spec import Pipeline, parse_pipeline

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import op_corpus

# ONNX Attention-23's function for a boolean mask, as its expanded node tests spell it
SIG = "g (float[1,2,4,8] q, float[1,2,4,8] k, float[1,2,4,8] v, bool[4,4] attn_mask) => (float[1,2,4,8] y)"
BODY = """
    bias = Where(attn_mask, zero, minf)
    kt = Transpose<perm=[0,1,3,2]>(k)
    s = MatMul(q, kt)
    a = Add(s, bias)
    p = Softmax<axis=-1>(a)
    row_max = ReduceMax<keepdims=1>(bias, axes)
    empty = Equal(row_max, minf)
    pg = Where(empty, zero, p)
    y = MatMul(pg, v)"""
INITS = " <float zero = {0.0}, float minf = {-inf}, int64[1] axes = {-1}>"


def _attention():
    return parse(BODY, SIG + INITS, opset=18)


class FiniteMaskOnly(Pass):
    """Planted: makes the mask finite and claims to be exact, but leaves the row guard testing
    for -inf, so a fully masked row gets softmax(scores) instead of 0."""

    name = "finite-mask-only"
    contract = EXACT

    def run(self, ir, ctx: PassContext) -> PassResult:
        softmaxes = [n for n in ir.graph.nodes if n.op == "Softmax"]
        changed = replace_mask_constants(ir, ctx, softmaxes, -1e4, -3e4).constants
        finish(ir)
        return PassResult(changed=bool(changed))


def test_verification_cases_include_empty_rows_and_causal_masks():
    cases = {c.name: c.inputs["attn_mask"] for c in verification_cases(_attention())}
    assert cases["random"].all()
    assert not cases[CASE_ROW_MASKED][0].any() and cases[CASE_ROW_MASKED][1:].all()
    np.testing.assert_array_equal(cases[CASE_CAUSAL], np.tril(np.ones((4, 4), bool)))


def test_verify_catches_a_pass_wrong_only_on_fully_masked_rows():
    ir = _attention()
    result = PassManager(Pipeline([FiniteMaskOnly()]), RunConfig(verify=True, strict=False)).run(ir)
    (record,) = result.rolled_back
    assert CASE_ROW_MASKED in record.reason and "random" not in record.reason.split("]")[0]
    assert ops(ir)["Where"] == 2 and all(t.name != "minf_finite" for t in ir.graph.tensors().values())


def test_attention_cleanup_keeps_the_empty_row():
    ir = _attention()
    rng = np.random.default_rng(3)
    feeds = {n: rng.standard_normal((1, 2, 4, 8)).astype(np.float32) for n in "qkv"}
    feeds["attn_mask"] = np.tril(np.ones((4, 4), bool))
    feeds["attn_mask"][0] = False
    before = run_cpu(ir, feeds)["y"]
    record = PassManager(parse_pipeline("attention-cleanup"), RunConfig(verify=True, strict=True)).run(ir).records[-1]
    assert record.stats["masked_row_tests"] == 1 and ops(ir)["Equal"] == 0
    after = run_cpu(ir, feeds)["y"]
    assert np.all(before[:, :, 0] == 0)
    np.testing.assert_allclose(after, before, atol=1e-6)


def test_onnx_fully_masked_attention_node_tests_keep_their_outputs():
    """onnx's backend node tests with fully masked rows, through htp-llm, compared on their own inputs."""
    names = [n for n in op_corpus.generate() if "fullymasked" in n]
    if not names:
        pytest.skip("this onnx has no fully masked Attention node tests")
    results = op_corpus.run_corpus(names, ["pipeline:htp-llm"], jobs=1, timeout=60)
    outcomes = {r["case"]: (r["outcome"], r["reason"]) for r in results}
    assert not [c for c, (o, _) in outcomes.items() if o in op_corpus.FAILURES], outcomes
    # the expanded ones are rewritten (finite mask, row test) and still equal
    assert all(outcomes[n][0] == "rewritten-equal" for n in names if n.startswith("test_attention_23")
               and n.endswith("_expanded")), outcomes


def test_attention_cleanup_twice_keeps_the_row_test():
    """On its own output the pass changes nothing: the finite mask no longer proves the row test dead."""
    ir = _attention()
    pipeline = parse_pipeline("attention-cleanup,attention-cleanup")
    records = PassManager(pipeline, RunConfig(verify=True, strict=True)).run(ir).records
    assert records[0].stats["masked_row_tests"] == 1
    assert records[1].stats["nan_guards_removed"] == 0 and records[1].stats["masked_row_tests"] == 0
    assert ops(ir)["Less"] == 1 and ops(ir)["Where"] == 2
