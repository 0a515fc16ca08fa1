"""two-pass-variance: a Flax/Keras LayerNorm (variance as E[x^2] - E[x]^2) rebuilt so fp16 holds it.

The synthetic norm has rows with a large mean and a tiny spread (the case where the one-pass
variance cancels) and rows whose sum of squares exceeds 65504 (where it overflows fp16).
"""

from __future__ import annotations

import numpy as np
import onnx
from conftest import requires_htp
from onnx import TensorProto, helper, numpy_helper

from qnnpasses.backends.cpu import cosine_similarity, run_cpu
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import to_model_bytes
from qnnpasses.passmanager.api import PassContext
from qnnpasses.passmanager.manager import PassManager, RunConfig
from qnnpasses.passmanager.spec import parse_pipeline

N, C = 256, 64
EPS = 1e-6


def flax_layernorm_model() -> onnx.ModelProto:
    """y = (x - m) * (1/sqrt(max(E[x^2] - m^2, 0) + eps) * gamma) + beta over axis 1 (keepdims 0)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.array([1], np.int64), "axes"),
             numpy_helper.from_array(np.float32(1.0 / N), "inv_n"),
             numpy_helper.from_array(np.float32(0.0), "zero"),
             numpy_helper.from_array(np.float32(EPS), "eps"),
             numpy_helper.from_array(np.array([1, 1, C], np.int64), "bshape"),
             numpy_helper.from_array(rng.uniform(0.5, 1.5, (1, 1, C)).astype(np.float32), "gamma"),
             numpy_helper.from_array(rng.uniform(-0.5, 0.5, (1, 1, C)).astype(np.float32), "beta")]
    nodes = [helper.make_node("ReduceSum", ["x", "axes"], ["s1"], keepdims=0),
             helper.make_node("Mul", ["x", "x"], ["sq"]),
             helper.make_node("ReduceSum", ["sq", "axes"], ["s2"], keepdims=0),
             helper.make_node("Mul", ["s1", "inv_n"], ["mean"]),
             helper.make_node("Mul", ["s2", "inv_n"], ["mean2"]),
             helper.make_node("Mul", ["mean", "mean"], ["mean_sq"]),
             helper.make_node("Sub", ["mean2", "mean_sq"], ["var0"]),
             helper.make_node("Max", ["var0", "zero"], ["var"]),
             helper.make_node("Reshape", ["var", "bshape"], ["var_b"]),
             helper.make_node("Add", ["var_b", "eps"], ["var_eps"]),
             helper.make_node("Sqrt", ["var_eps"], ["std"]),
             helper.make_node("Reciprocal", ["std"], ["rstd"]),
             helper.make_node("Mul", ["rstd", "gamma"], ["scale"]),
             helper.make_node("Reshape", ["mean", "bshape"], ["mean_b"]),
             helper.make_node("Sub", ["x", "mean_b"], ["d"]),
             helper.make_node("Mul", ["d", "scale"], ["y0"]),
             helper.make_node("Add", ["y0", "beta"], ["y"])]
    graph = helper.make_graph(nodes, "flax_ln", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, N, C])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N, C])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, (1, N, C)).astype(np.float32)
    x[..., :16] = 1.0 + 0.01 * x[..., :16]  # mean 1, std 0.01: E[x^2] - E[x]^2 = 1e-4 cancels in fp16
    x[..., 16:32] *= 40.0  # sum of squares ~ 4e5 > 65504
    return {"x": x}


def reference_float64(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    x = feeds["x"].astype(np.float64)
    gamma = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "gamma")).astype(np.float64)
    beta = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "beta")).astype(np.float64)
    d = x - x.mean(axis=1, keepdims=True)
    return d / np.sqrt((d * d).mean(axis=1, keepdims=True) + EPS) * gamma + beta


def rewrite(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict]:
    ir = load_model(model)
    result = PassManager(parse_pipeline("two-pass-variance"), RunConfig(allow_lossy=True),
                         context=PassContext()).run(ir)
    record = result.records[0]
    return onnx.load_from_string(to_model_bytes(ir)), {"status": record.status, "stats": record.stats}


def test_rewritten_norm_is_closer_to_float64_than_the_original_on_cpu(tmp_path):
    model, feeds = flax_layernorm_model(), inputs()
    new, record = rewrite(model)
    assert record["status"] == "changed" and record["stats"]["rewritten"] == 1, record
    assert not any("mean2" in n.input for n in new.graph.node)  # the one-pass variance is gone
    truth = reference_float64(model, feeds)
    onnx.save(model, tmp_path / "old.onnx")
    onnx.save(new, tmp_path / "new.onnx")
    err_old = np.abs(run_cpu(str(tmp_path / "old.onnx"), feeds)["y"] - truth).max()
    err_new = np.abs(run_cpu(str(tmp_path / "new.onnx"), feeds)["y"] - truth).max()
    assert err_new < 1e-4, err_new
    assert err_new < err_old / 10, (err_new, err_old)  # the original cancels in fp32 already


def test_a_norm_that_is_not_one_pass_is_left_alone():
    model = flax_layernorm_model()
    sub = next(n for n in model.graph.node if n.output[0] == "var0")
    sub.input[1] = "mean"  # E[x^2] - E[x]: not a variance
    _, record = rewrite(model)
    assert record["status"] == "unchanged" and record["stats"]["rewritten"] == 0, record


@requires_htp
def test_on_the_htp_fp16_the_rewrite_matches_float64_where_the_original_does_not(tmp_path):
    from qnnpasses.backends.htp import probe_placement

    model, feeds = flax_layernorm_model(), inputs()
    new, _ = rewrite(model)
    truth = reference_float64(model, feeds).ravel()
    cosines = {}
    for name, m in (("original", model), ("rewritten", new)):
        path = tmp_path / f"{name}.onnx"
        onnx.save(m, path)
        probe = probe_placement(path, feeds, keep_dir=tmp_path / name)
        assert probe.ok and probe.qnn_partitions == 1 and not probe.cpu_nodes, probe
        with np.load(tmp_path / name / "outputs.npz") as got:
            cosines[name] = cosine_similarity(got["y"].astype(np.float64).ravel(), truth)
    assert cosines["rewritten"] >= 0.999, cosines
    assert not cosines["original"] >= 0.999, cosines  # the premise: fp16 breaks the one-pass form
