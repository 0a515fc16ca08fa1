"""softmax-exp: Softmax => Exp(x - ReduceMax) / ReduceSum: the same values to fp32 rounding; closer to fp32 on the HTP."""

from __future__ import annotations

import numpy as np
import onnx.parser
import pytest
from conftest import requires_htp
from pass_testing import htp_fp16_errors, op_counts, run_strictly

from qnnpasses.backends.cpu import run_cpu
from qnnpasses.ir.load import load_model

RNG = np.random.default_rng(0)
SCORES = (RNG.standard_normal((1, 4, 16, 64)) * 4.0).astype(np.float32)


def model(body: str, opset: int = 18, dtype: str = "float", shape: str = "[1,4,16,64]", outputs: str = ""):
    outputs = outputs or f"{dtype}{shape} y"
    return onnx.parser.parse_model(f"<ir_version: 9, opset_import: [\"\" : {opset}]> "
                                   f"g ({dtype}{shape} x) => ({outputs}) {{ {body} }}")


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def within_fp32_rounding(got: np.ndarray, want: np.ndarray) -> bool:
    # a few ulps of each value, or of the row's largest (the sum's rounding scales every entry)
    bound = 8 * np.spacing(np.maximum(np.abs(want), 1e-30).astype(np.float32)).astype(np.float64) + 1e-9
    return bool(np.all(np.abs(got.astype(np.float64) - want) <= bound))


@pytest.mark.parametrize("opset", [11, 13, 18])
def test_last_axis_softmax_is_spelled_out_with_the_same_values(opset):
    ir, record = run_strictly(model("y = Softmax <axis = -1> (x)", opset), "softmax-exp")
    assert record.stats == {"softmax": 1, "kept": 0}
    counts = op_counts(ir)
    assert counts["Softmax"] == 0
    spelled = ("ReduceMax", "Sub", "Max", "Exp", "ReduceSum", "Div")
    assert {op: counts[op] for op in spelled} == dict.fromkeys(spelled, 1)
    # the Reduce* axes spelled for the opset: an input from 18 (ReduceSum: 13), an attribute before
    reduce_max = next(n for n in ir.graph.nodes if n.op == "ReduceMax")
    assert (len(reduce_max.inputs) == 2) == (opset >= 18) and ("axes" in reduce_max.attrs) == (opset < 18)
    assert within_fp32_rounding(run_cpu(ir, {"x": SCORES})["y"], softmax(SCORES))


def test_inner_axis_from_opset_13_and_kept_before():
    ir, record = run_strictly(model("y = Softmax <axis = 1> (x)", 13), "softmax-exp")
    assert record.stats["softmax"] == 1
    assert within_fp32_rounding(run_cpu(ir, {"x": SCORES})["y"], softmax(SCORES, axis=1))
    # opset 11 normalizes the flattened axes 1.. together: a different function, kept
    ir, record = run_strictly(model("y = Softmax <axis = 1> (x)", 11), "softmax-exp")
    assert record.stats == {"softmax": 0, "kept": 1} and op_counts(ir)["Softmax"] == 1
    assert "opset 11 Softmax over the flattened axes from 1 on" in record.notes[0]


def test_masked_entries_and_softmax_of_softmax():
    x = SCORES.copy()
    x[..., :5, 10:] = -np.inf  # masked positions
    x[..., 5:8, 20:] = np.finfo(np.float32).min  # a finite mask
    ir, record = run_strictly(model("s = Softmax <axis = -1> (x) y = Softmax <axis = -1> (s)",
                                    outputs="float[1,4,16,64] s, float[1,4,16,64] y"), "softmax-exp", inputs={"x": x})
    assert record.stats["softmax"] == 2 and op_counts(ir)["Softmax"] == 0
    got = run_cpu(ir, {"x": x})
    # a masked entry: exp(-64) of the row's largest instead of 0, far below fp32's rounding of the rest
    masked = np.isinf(x) | (x == np.finfo(np.float32).min)
    assert np.all(got["s"][masked] <= np.exp(-64.0)) and np.all(got["s"][masked] >= 0)
    assert within_fp32_rounding(np.where(masked, 0.0, got["s"]), softmax(x))
    assert within_fp32_rounding(got["y"], softmax(softmax(x)))


def test_softmax_as_graph_output_keeps_the_interface_and_other_outputs():
    ir, _ = run_strictly(model("y = Softmax <axis = -1> (x) z = Add(y, y)",
                               outputs="float[1,4,16,64] y, float[1,4,16,64] z"), "softmax-exp")
    assert [o.name for o in ir.graph.outputs] == ["y", "z"]
    out = run_cpu(ir, {"x": SCORES})
    assert within_fp32_rounding(out["y"], softmax(SCORES)) and within_fp32_rounding(out["z"] / 2, softmax(SCORES))


def test_integer_softmax_input_is_not_matched():
    src = model("f = Cast <to = 1> (x) y = Softmax <axis = -1> (f)", dtype="int32", outputs="float[1,4,16,64] y")
    ir, record = run_strictly(src, "softmax-exp", inputs={"x": (SCORES * 10).astype(np.int32)})
    assert record.stats["softmax"] == 1  # the Cast's output is a float: matched
    ir, record = run_strictly(model("y = Softmax <axis = -1> (x)", dtype="double"), "softmax-exp",
                              inputs={"x": SCORES.astype(np.float64)})
    assert record.stats["softmax"] == 1


def test_fp16_graph_stays_fp16_within_fp16_rounding():
    x16 = {"x": SCORES.astype(np.float16)}
    ir, record = run_strictly(model("y = Softmax <axis = -1> (x)", dtype="float16"), "softmax-exp", inputs=x16)
    assert record.stats["softmax"] == 1
    assert ir.graph.outputs[0].dtype == np.float16
    got = run_cpu(ir, x16)["y"].astype(np.float64)
    want = softmax(x16["x"])
    assert np.all(np.abs(got - want) <= 4 * np.spacing(np.maximum(want, 2.0**-14).astype(np.float16)).astype(np.float64))


@requires_htp
def test_attention_softmax_is_closer_to_fp32_on_the_htp(tmp_path):
    """Attention-like scores (a wide spread per row, a finite mask over part of the keys) on the HTP
    in fp16: the spelled-out Softmax's error against fp32 is well below the native op's.  The
    masks put Exp's argument where the HTP's fp16 Exp is wrong (it returns about +-1.3e5 at
    -100, -1000 and -3e4, 0 at -1e4): the floor at -64 is what keeps those rows right."""
    x = SCORES.copy()
    for head, mask in enumerate((-3.0e4, -1.0e4, -1000.0, -100.0)):  # finite additive masks
        x[:, head, :, 40:] += mask
    src = model("y = Softmax <axis = -1> (x)")
    irs = {"native": load_model(src), "spelled": run_strictly(src, "softmax-exp", inputs={"x": x})[0]}
    errors = htp_fp16_errors(irs, {"x": x}, softmax(x), tmp_path)
    assert errors["spelled"] < 1e-3, errors  # fp16 rounding of the scores and the result
    assert errors["spelled"] < 0.6 * errors["native"], errors
