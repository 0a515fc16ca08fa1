"""qnnpasses.quant.norm_rounding: the half step the HTP's RmsNorm loses, given back after its MatMuls."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from conftest import requires_htp

from qnnpasses.quant.norm_rounding import compensate_norm_rounding, htp_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import probe_htp_rounding as probe  # noqa: E402

HIDDEN, TOKENS, OUT = 640, 16, 256


def _norm_then_matmul(rng: np.random.Generator):
    """x -> RMSNormalization -> MatMul(int8 per-channel weight), 16-bit activations; the weight's
    columns lean positive (trained projections' sums are not zero), so the lost half steps add up.
    Returns the graph, its output and the float64 result, and the norm output's step."""
    a = rng.standard_normal((1, TOKENS, HIDDEN))
    gamma = 1 + rng.standard_normal(HIDDEN) * 0.5
    normed = a / np.sqrt((a ** 2).mean(-1, keepdims=True) + 1e-6) * gamma
    w = rng.standard_normal((HIDDEN, OUT)) * 0.05 + 0.03
    scale = np.abs(w).max(0) / 127
    q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
    product = normed @ (q * scale)
    g = probe.Graph()
    y = g.op("RMSNormalization", [g.activation("x", a), g.weight16("gamma", gamma)], "y", normed, axis=-1,
             epsilon=1e-6)
    out = g.op("MatMul", [y, g.weight("w", q, scale.astype(np.float32), np.zeros(OUT, np.int8), axis=1)], "z", product)
    bias = probe._encoding(normed, 16)[0] / 2 * (q * scale).sum(0)
    return g, out, product, bias


def test_the_compensation_adds_half_the_norm_step_times_each_column_sum(tmp_path):
    """On the CPU, which rounds the norm to nearest, the compensated graph's output is the original's
    plus s/2·Σ_k W[k, :], to within the output's own 16-bit step (where that sum stays inside the
    output's encoding, set from the exact result: the HTP, which loses the bias first, stays inside
    it); the count says one MatMul."""
    from qnnpasses.backends.cpu import cpu_session

    g, out, product, bias = _norm_then_matmul(np.random.default_rng(0))
    model = g.model(out)
    onnx.save(model, str(tmp_path / "original.onnx"))
    assert compensate_norm_rounding(model) == 1
    onnx.save(model, str(tmp_path / "compensated.onnx"))
    original, compensated = (cpu_session(tmp_path / f"{n}.onnx", optimize=False).run(None, g.feeds)[0]
                             for n in ("original", "compensated"))
    step = probe._encoding(product, 16)[0]
    assert np.abs(bias).min() > 4 * step  # a shift the check can see
    inside = original + bias < product.max() - step
    assert inside.mean() > 0.9
    assert np.abs(compensated - original - bias)[inside].max() <= 1.5 * step


def test_a_model_without_the_pattern_is_given_as_it_is(tmp_path):
    """No RmsNorm feeding a MatMul of a constant weight: the path itself, no config, nothing counted."""
    g = probe.Graph()
    a = np.random.default_rng(1).standard_normal((1, 4, 8))
    out = g.op("Add", [g.activation("a", a), g.activation("b", a)], "y", 2 * a)
    onnx.save(g.model(out), str(tmp_path / "add.onnx"))
    assert htp_model(tmp_path / "add.onnx") == (str(tmp_path / "add.onnx"), {}, 0)


@requires_htp
def test_on_the_htp_the_matmul_after_the_norm_loses_its_bias(tmp_path):
    """On the simulated HTP (integer mode, graph-boundary Q/DQ on the HTP, no CPU fallback) the
    MatMul after the RmsNorm comes out several of its own steps low on average; compensated, as
    :func:`htp_model` hands it to the backend, its mean error is within half a step."""
    from qnnpasses.backends.htp import htp_session

    g, out, product, bias = _norm_then_matmul(np.random.default_rng(0))
    path = tmp_path / "model.onnx"
    onnx.save(g.model(out), str(path))
    step = probe._encoding(product, 16)[0]
    means = {}
    for label, (model, config) in {"original": (str(path), None), "compensated": htp_model(path)[:2]}.items():
        session = htp_session(model, fp16=False, extra_options={"offload_graph_io_quantization": "0"},
                              optimize=False, disable_cpu_fallback=True, session_config=config or None)
        means[label] = float(((session.run(None, g.feeds)[0] - product) / step).mean())
    assert means["original"] < -0.5 * float((bias / step).mean()), means
    assert abs(means["compensated"]) < 0.5, means


def test_the_doc_is_what_the_tool_writes():
    import json

    import probe_norm_rounding as tool

    doc = json.loads(tool.DOC_JSON.read_text())
    assert tool.render(doc) == tool.DOC_MD.read_text()
    assert list(doc["runs"]) == list(tool.RUNS)


@requires_htp
def test_compiling_a_quantized_model_gives_the_htp_the_compensated_graph(tmp_path):
    """``qnnpasses compile`` (and the quantize evaluation's HTP session) compile a QDQ model as the
    llm path does: the context binary computes the MatMul after the norm within half a step of the
    exact result on average, and the compile says how many MatMuls it compensated."""
    from qnnpasses.handoff.epcontext import compile_model, timed_load

    g, out, product, _ = _norm_then_matmul(np.random.default_rng(0))
    path = tmp_path / "model.onnx"
    onnx.save(g.model(out), str(path))
    compiled = compile_model(path, tmp_path / "model_ctx.onnx", fp16=False)
    assert compiled["ok"] and compiled["norm_rounding_matmuls"] == 1, compiled
    loaded, outputs = timed_load(tmp_path / "model_ctx.onnx", g.feeds, fp16=False)
    assert loaded["ok"], loaded
    step = probe._encoding(product, 16)[0]
    assert abs(float(((outputs[out] - product) / step).mean())) < 0.5
