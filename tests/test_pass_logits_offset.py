"""logits-offset: an lm_head's logits relative to their row's maximum (subtracted inside the
MatMul) plus that maximum as an output: the same logits on CPU, finer top logits on the HTP."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from conftest import requires_htp
from onnx import TensorProto, helper, numpy_helper
from pass_testing import htp_fp16_outputs, op_counts, run_strictly

from qnnpasses.backends.cpu import run_cpu
from qnnpasses.ir.load import load_model
from qnnpasses.passmanager.manager import PassManager, RunConfig
from qnnpasses.passmanager.spec import parse_pipeline

TOKENS, HIDDEN, VOCAB = 8, 64, 2048


def lm_head_model(transpose_out: bool = False, fp16: bool = False) -> tuple[onnx.ModelProto, np.ndarray]:
    """``logits[1, T, V] = Reshape(MatMul(Reshape(x, [T, H]), W))``, as htp-llm leaves an lm_head;
    W scaled so that the largest logits are 20..40 (where fp16's spacing is 0.016..0.03); W and x
    hold fp16 values (the HTP's rounding of its inputs adds nothing, only the output's counts)."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((HIDDEN, VOCAB)) * 0.6).astype(np.float32)
    x = np.stack([w[:, rng.choice(VOCAB, 3)].sum(1) for _ in range(TOKENS)])  # a few tokens lead each row
    x = (x / np.linalg.norm(x, axis=-1, keepdims=True) * 7.5 + rng.normal(0, 0.3, x.shape))[None].astype(np.float32)
    w, x = w.astype(np.float16).astype(np.float32), x.astype(np.float16).astype(np.float32)
    nodes = [helper.make_node("Reshape", ["x", "flat"], ["x2d"]),
             helper.make_node("MatMul", ["x2d", "W"], ["y2d"]),
             helper.make_node("Reshape", ["y2d", "shape3"], ["logits"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, TOKENS, VOCAB])]
    if fp16:  # an fp16 head cast to float32 logits, as fp16 exports end
        nodes = [helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16),
                 helper.make_node("Reshape", ["x16", "flat"], ["x2d"]), nodes[1],
                 helper.make_node("Reshape", ["y2d", "shape3"], ["y16"]),
                 helper.make_node("Cast", ["y16"], ["logits"], to=TensorProto.FLOAT)]
        w = w.astype(np.float16)
    if transpose_out:  # moves values across the last axis: not a per-row shift any more
        nodes[-1] = helper.make_node("Transpose", ["y2d"], ["logits"], perm=[1, 0])
        outputs[0] = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [VOCAB, TOKENS])
    graph = helper.make_graph(nodes, "lm_head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, TOKENS, HIDDEN])],
                              outputs, [numpy_helper.from_array(w, "W"),
                                        numpy_helper.from_array(np.array([TOKENS, HIDDEN], np.int64), "flat"),
                                        numpy_helper.from_array(np.array([1, TOKENS, VOCAB], np.int64), "shape3")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), x


def weight_shapes(ir) -> list[tuple[int, ...]]:
    return sorted(t.values.shape for t in ir.graph.tensors().values()
                  if getattr(t, "values", None) is not None and t.values.shape[-1:] == (VOCAB,))


def test_logits_relative_to_the_row_max_and_the_offset_restores_them():
    proto, x = lm_head_model()
    want = run_cpu(load_model(proto), {"x": x})["logits"].astype(np.float64)
    ir, record = run_strictly(proto, "logits-offset", inputs={"x": x})  # verified through map_reference
    assert record.stats == {"outputs": 1}
    assert [t.name for t in ir.graph.outputs] == ["logits", "logits_offset"]
    assert [int(d) for d in ir.graph.outputs[1].shape] == [1, TOKENS, 1]
    counts = op_counts(ir)
    assert (counts["MatMul"], counts["ReduceMax"], counts["Neg"], counts["Concat"]) == (2, 1, 1, 1)
    # W for the first MatMul, [W; 1] for the second (see the pass on why not one for both)
    assert weight_shapes(ir) == [(HIDDEN, VOCAB), (HIDDEN + 1, VOCAB)]
    got = run_cpu(ir, {"x": x})
    shifted, offset = got["logits"].astype(np.float64), got["logits_offset"].astype(np.float64)
    scale = np.abs(want).max()
    np.testing.assert_allclose(shifted + offset, want, atol=1e-6 * scale, rtol=0)
    np.testing.assert_allclose(offset[..., 0], want.max(-1), atol=1e-6 * scale, rtol=0)
    np.testing.assert_allclose(shifted.max(-1), 0, atol=1e-6 * scale)
    assert (shifted.argmax(-1) == want.argmax(-1)).all()


def test_candidates_take_the_offset_from_the_first_tokens_only():
    """``candidates=N``: the offset is the maximum of the first N tokens' logits, from an [H, N]
    slice of W (N/V of the lm_head's bytes more, where every token as candidate doubles them);
    the relative logits plus the offset are still the original logits."""
    proto, x = lm_head_model()
    want = run_cpu(load_model(proto), {"x": x})["logits"].astype(np.float64)
    n = VOCAB // 8
    ir, record = run_strictly(proto, f"logits-offset{{candidates={n}}}", inputs={"x": x})
    assert record.notes == [f"logits relative to the max of its first {n} tokens, offset in logits_offset"]
    assert weight_shapes(ir) == [(HIDDEN + 1, VOCAB)]  # W itself is no longer read: [W; 1] only
    assert sorted(t.values.shape for t in ir.graph.tensors().values()
                  if getattr(t, "values", None) is not None and t.values.ndim == 2) == [(HIDDEN, n), (HIDDEN + 1, VOCAB)]
    got = run_cpu(ir, {"x": x})
    shifted, offset = got["logits"].astype(np.float64), got["logits_offset"].astype(np.float64)
    scale = np.abs(want).max()
    np.testing.assert_allclose(offset[..., 0], want[..., :n].max(-1), atol=1e-6 * scale, rtol=0)
    np.testing.assert_allclose(shifted + offset, want, atol=1e-6 * scale, rtol=0)
    assert (shifted.argmax(-1) == want.argmax(-1)).all()
    # as many candidates as tokens, or more: the every-token form
    ir, record = run_strictly(proto, f"logits-offset{{candidates={VOCAB}}}", inputs={"x": x})
    assert weight_shapes(ir) == [(HIDDEN, VOCAB), (HIDDEN + 1, VOCAB)]
    with pytest.raises(Exception, match="candidates must be 0"):
        run_strictly(proto, "logits-offset{candidates=-1}", inputs={"x": x})


def test_a_mapped_lm_head_gets_recipes_not_copies_in_memory(tmp_path):
    """W mapped from an external-data file: ``[W; 1]`` and the candidates' columns are recipes,
    computed as the model is written or run, so the pass holds no copy of the lm_head; the
    written model computes the same logits and offset."""
    from qnnpasses.ir.model import DerivedValues, save_model

    proto, x = lm_head_model()
    want = run_cpu(load_model(proto), {"x": x})["logits"].astype(np.float64)
    onnx.save(proto, tmp_path / "head.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="head.data")
    ir, _ = run_strictly(tmp_path / "head.onnx", "logits-offset{candidates=256}", inputs={"x": x})
    made = sorted(tuple(t.shape) for t in ir.graph.tensors().values()
                  if isinstance(t, gs.Constant) and isinstance(t._values, DerivedValues))
    assert made == [(HIDDEN, 256), (HIDDEN + 1, VOCAB)]
    save_model(ir, tmp_path / "out.onnx")
    got = run_cpu(load_model(tmp_path / "out.onnx"), {"x": x})
    np.testing.assert_allclose(got["logits_offset"][..., 0], want[..., :256].max(-1), atol=1e-6 * np.abs(want).max())
    np.testing.assert_allclose(got["logits"] + got["logits_offset"], want, atol=1e-6 * np.abs(want).max(), rtol=0)


def test_an_fp16_head_is_left_as_it_is():
    """In an fp16 graph the shifted logits would be finer than the original's own rounding on
    every backend: not the same function to float rounding, so the pass leaves it (and says why)."""
    proto, x = lm_head_model(fp16=True)
    ir = load_model(proto)
    record = PassManager(parse_pipeline("logits-offset{output=logits}"), RunConfig(verify=False, strict=True)) \
        .run(ir).records[-1]
    assert not record.changed and [t.name for t in ir.graph.outputs] == ["logits"]
    assert record.notes == ["logits kept: not computed by a MatMul"]  # but by the Cast to float32


def test_final_verification_maps_the_original_outputs():
    proto, x = lm_head_model()
    result = PassManager(parse_pipeline("logits-offset,cleanup"), RunConfig(verify=True, strict=True, inputs={"x": x})) \
        .run(load_model(proto))
    assert result.verified_ok, result.final_verification
    assert {o["name"] for o in result.final_verification["outputs"]} >= {"logits", "logits_offset"}


@pytest.mark.parametrize("case, note", [
    ("transpose", "not computed by a MatMul"),
    ("dynamic", "output shape not static"),
    ("name", "no output named missing"),
    ("taken", "its offset output name is taken"),
])
def test_what_does_not_match_is_left_with_a_reason(case, note):
    proto, x = lm_head_model(transpose_out=case == "transpose")
    if case == "dynamic":
        proto.graph.output[0].type.tensor_type.shape.dim[1].dim_param = "tokens"
    if case == "taken":  # an internal tensor already has the offset output's name
        for node in proto.graph.node:
            node.input[:] = ["logits_offset" if n == "x2d" else n for n in node.input]
            node.output[:] = ["logits_offset" if n == "x2d" else n for n in node.output]
    spec = "logits-offset{output=missing}" if case == "name" else "logits-offset{output=logits}"
    ir = load_model(proto)
    record = PassManager(parse_pipeline(spec), RunConfig(verify=False, strict=True)).run(ir).records[-1]
    assert not record.changed and [t.name for t in ir.graph.outputs] == ["logits"]
    assert any(note in n for n in record.notes), record.notes


@requires_htp
def test_top_logits_are_finer_on_the_htp_in_fp16(tmp_path):
    """On the HTP in fp16 the plain lm_head rounds each logit at 16..40 to fp16's 0.016..0.03;
    with the row's maximum subtracted inside the MatMul, the logits within 4 of their row's
    maximum (those a near-tie for the next token is between) come out in [-4, 0], where fp16
    resolves 0.004 or finer: at least 10x closer to fp32 (measured: about 20x here)."""
    proto, x = lm_head_model()
    plain = load_model(proto)
    want = run_cpu(plain, {"x": x})["logits"].astype(np.float64)
    assert 20 <= want.max(-1).min() and want.max() <= 40
    shifted, _ = run_strictly(proto, "logits-offset,cleanup", inputs={"x": x})
    out = htp_fp16_outputs({"plain": plain, "offset": shifted}, {"x": x}, tmp_path)
    near_top = want >= want.max(-1, keepdims=True) - 4
    assert near_top.sum() > TOKENS  # rows with a runner-up within 4

    def error(logits: np.ndarray) -> float:
        return float(np.sqrt(np.mean((logits[near_top] - want[near_top]) ** 2)))

    plain_error = error(out["plain"]["logits"].astype(np.float64))
    offset_error = error(out["offset"]["logits"].astype(np.float64) + out["offset"]["logits_offset"])
    assert offset_error * 10 <= plain_error, (offset_error, plain_error)


@requires_htp
def test_candidates_are_as_fine_where_the_top_token_is_among_them(tmp_path):
    """With the first half of the tokens as candidates, the rows whose top token is among them get
    the every-token form's resolution on the HTP; the others land at their top token's lead over
    the candidates, still finer than plain logits whenever that lead is below the top logit."""
    proto, x = lm_head_model()
    plain = load_model(proto)
    want = run_cpu(plain, {"x": x})["logits"].astype(np.float64)
    n = VOCAB // 2
    inside = want.argmax(-1)[0] < n
    assert 0 < inside.sum() < TOKENS  # rows of both kinds
    shifted, _ = run_strictly(proto, f"logits-offset{{candidates={n}}},cleanup", inputs={"x": x})
    out = htp_fp16_outputs({"plain": plain, "candidates": shifted}, {"x": x}, tmp_path)
    near_top = want >= want.max(-1, keepdims=True) - 4

    def error(logits: np.ndarray, rows: np.ndarray) -> float:
        mask = near_top & rows[None, :, None]
        return float(np.sqrt(np.mean((logits[mask] - want[mask]) ** 2)))

    got = out["candidates"]["logits"].astype(np.float64) + out["candidates"]["logits_offset"]
    plain_got = out["plain"]["logits"].astype(np.float64)
    assert error(got, inside) * 10 <= error(plain_got, inside), (error(got, inside), error(plain_got, inside))
    assert error(got, ~inside) <= error(plain_got, ~inside), (error(got, ~inside), error(plain_got, ~inside))
