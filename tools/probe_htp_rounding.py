#!/usr/bin/env python
"""How the HTP rounds the 16-bit ops of an LLM's quantized graph: the mean and spread of each op's error.

One QDQ op at a time (16-bit activations, each tensor quantized per tensor over its own range,
as onnxruntime's quantizer writes them), on seeded data of an LLM's shapes, run three ways: on
onnxruntime's CPU provider as the graph says (optimizations off: dequantize, compute in float,
quantize), on the same provider with its graph optimizations on (what a plain
``InferenceSession`` does: it fuses QDQ groups into integer kernels), and on the simulated HTP
in integer mode (``offload_graph_io_quantization=0``, no CPU fallback).  Each error is taken
against the float64 result and counted in steps of the output's quantization grid (LSB): the
mean says whether an op rounds to nearest (mean 0) or always one way; round to nearest alone
gives an RMS of 0.29 LSB.  A constant bias is what a long residual stream adds up, and what a
rotation of that stream (``rotate-residual``) gathers into a few channels.

Rows: Add and Mul of two activations; RMSNormalization with a 16-bit weight, fused (one op, the
HTP's RmsNorm) and decomposed into Mul, ReduceMean, Add, Sqrt, Reciprocal, Mul, Mul (each a
16-bit QDQ op); a MatMul of a 16-bit activation and int8 per-channel weights lying on the int8
grid (the weight adds no error of its own); Softmax; Gelu (tanh).

The HTP runs are repeated for a target of every HTP arch the simulator accepts
(:data:`ARCH_TARGETS`): :mod:`qnnpasses.quant.norm_rounding` compensates the fused RmsNorm's
one-way rounding whatever the target, which holds only if every arch rounds it so.

Writes ``docs/htp_rounding.json`` and ``docs/htp_rounding.md``.

    python tools/probe_htp_rounding.py
    python tools/probe_htp_rounding.py --doc-only
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_act_matmul import _encoding, write_docs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOC_JSON, DOC_MD = ROOT / "docs" / "htp_rounding.json", ROOT / "docs" / "htp_rounding.md"
HIDDEN, TOKENS, FFN, KEYS = 640, 16, 1024, 128
RUNS = ("cpu", "cpu_optimized", "htp")
#: one target per HTP arch the simulator here accepts (docs/targets.md), oldest arch first
ARCH_TARGETS = ("sa8295", "xelite", "8gen3", "8elite", "8elitegen5")


class Graph:
    """A QDQ graph under construction: 16-bit activations, initializers, one float input per activation."""

    def __init__(self):
        self.nodes, self.inits, self.inputs, self.feeds = [], [], [], {}

    def activation(self, name: str, values: np.ndarray) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, list(values.shape)))
        self.feeds[name] = values.astype(np.float32)
        return self.qdq(name, values)

    def qdq(self, name: str, values: np.ndarray) -> str:
        """``name`` quantized to uint16 over the range of ``values`` (its float64 result) and dequantized."""
        scale, zero = _encoding(np.asarray(values), 16)
        self.inits += [numpy_helper.from_array(np.array(scale, np.float32), f"{name}_s"),
                       numpy_helper.from_array(np.array(zero, np.uint16), f"{name}_z")]
        self.nodes += [helper.make_node("QuantizeLinear", [name, f"{name}_s", f"{name}_z"], [f"{name}_q"]),
                       helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_z"], [f"{name}_dq"])]
        return f"{name}_dq"

    def weight(self, name: str, q: np.ndarray, scale: np.ndarray, zero: np.ndarray, axis: int | None = None) -> str:
        self.inits += [numpy_helper.from_array(q, f"{name}_q"), numpy_helper.from_array(scale, f"{name}_s"),
                       numpy_helper.from_array(zero, f"{name}_z")]
        self.nodes.append(helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_z"], [f"{name}_dq"],
                                           **({} if axis is None else {"axis": axis})))
        return f"{name}_dq"

    def weight16(self, name: str, values: np.ndarray) -> str:
        scale, zero = _encoding(values, 16)
        q = np.clip(np.round(values / scale) + zero, 0, 65535).astype(np.uint16)
        return self.weight(name, q, np.array(scale, np.float32), np.array(zero, np.uint16))

    def op(self, op: str, inputs: list[str], out: str, expected: np.ndarray, **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return self.qdq(out, expected)

    def model(self, output: str) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "probe", self.inputs,
                                  [helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT, None)], self.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def cases(rng: np.random.Generator):
    """(label, Graph, output name, float64 result) of every row."""
    a, b = (rng.standard_normal((1, TOKENS, HIDDEN)) for _ in range(2))
    gamma = 1 + rng.standard_normal(HIDDEN) * 0.5
    for op, value in (("Add", a + b), ("Mul", a * b)):
        g = Graph()
        yield f"{op} of two activations", g, g.op(op, [g.activation("a", a), g.activation("b", b)], "y", value), value
    mean_sq = (a ** 2).mean(-1, keepdims=True)
    inv = 1 / np.sqrt(mean_sq + 1e-6)
    normed = a * inv * gamma
    g = Graph()
    out = g.op("RMSNormalization", [g.activation("x", a), g.weight16("gamma", gamma)], "y", normed, axis=-1,
               epsilon=1e-6)
    yield "RMSNormalization, fused", g, out, normed
    g = Graph()
    x = g.activation("x", a)
    g.inits.append(numpy_helper.from_array(np.array([-1], np.int64), "axes"))
    sq = g.op("Mul", [x, x], "sq", a ** 2)
    ms = g.op("ReduceMean", [sq, "axes"], "ms", mean_sq, keepdims=1)
    mse = g.op("Add", [ms, g.weight16("eps", np.array([1e-6]))], "mse", mean_sq + 1e-6)
    root = g.op("Sqrt", [mse], "root", np.sqrt(mean_sq + 1e-6))
    recip = g.op("Reciprocal", [root], "recip", inv)
    xn = g.op("Mul", [x, recip], "xn", a * inv)
    yield "RMSNormalization, decomposed", g, g.op("Mul", [xn, g.weight16("gamma", gamma)], "y", normed), normed
    w = rng.standard_normal((HIDDEN, FFN)) * 0.05
    scale = np.abs(w).max(0) / 127
    q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
    product = a @ (q * scale)  # the weights on their int8 grid: only the activations round
    g = Graph()
    weight = g.weight("w", q, scale.astype(np.float32), np.zeros(FFN, np.int8), axis=1)
    yield "MatMul, 16-bit activation x int8 weight", g, g.op("MatMul", [g.activation("x", a), weight], "y", product), product
    scores = rng.standard_normal((1, 4, TOKENS, KEYS)) * 4
    g = Graph()
    yield "Softmax", g, g.op("Softmax", [g.activation("x", scores)], "y", _softmax(scores), axis=-1), _softmax(scores)
    gate = rng.standard_normal((1, TOKENS, FFN)) * 3
    g = Graph()
    out = g.op("Gelu", [g.activation("x", gate)], "y", _gelu_tanh(gate), approximate="tanh")
    yield "Gelu (tanh)", g, out, _gelu_tanh(gate)


def measure() -> dict:
    import onnxruntime as ort
    import onnxruntime_qnn

    from qnnpasses.backends.htp import htp_session
    from qnnpasses.backends.targets import active, resolve

    def error(session, graph, expected, step) -> dict:
        lsb = (session.run(None, graph.feeds)[0].astype(np.float64) - expected) / step
        return {"mean_lsb": round(float(lsb.mean()), 4), "rms_lsb": round(float(np.sqrt((lsb ** 2).mean())), 4)}

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "probe.onnx"
        for label, graph, output, expected in cases(np.random.default_rng(0)):
            onnx.save(graph.model(output), str(path))
            step = _encoding(expected, 16)[0]
            plain = ort.SessionOptions()
            plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            sessions = {"cpu": ort.InferenceSession(str(path), plain, providers=["CPUExecutionProvider"]),
                        "cpu_optimized": ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]),
                        "htp": htp_session(str(path), fp16=False, extra_options={"offload_graph_io_quantization": "0"},
                                           optimize=False, disable_cpu_fallback=True)}
            row = {"case": label, **{run: error(session, graph, expected, step) for run, session in sessions.items()},
                   "htp_by_arch": {}}
            for name in ARCH_TARGETS:
                target = resolve(name)
                session = htp_session(str(path), fp16=False, extra_options={"offload_graph_io_quantization": "0"},
                                      optimize=False, disable_cpu_fallback=True, target=target)
                row["htp_by_arch"][f"v{target.htp_arch}"] = error(session, graph, expected, step)
            rows.append(row)
    return {"onnxruntime": ort.__version__, "onnxruntime_qnn": onnxruntime_qnn.__version__,
            "target": active().as_dict(), "arch_targets": {f"v{resolve(n).htp_arch}": resolve(n).product
                                                           for n in ARCH_TARGETS}, "rows": rows}


def render(doc: dict) -> str:
    lines = ["# How the HTP rounds the 16-bit ops of a quantized LLM", "",
             "Written by `python tools/probe_htp_rounding.py` from `docs/htp_rounding.json`.  One QDQ op at a time, "
             "16-bit activations quantized per tensor over their own ranges, seeded data of an LLM's shapes (hidden "
             f"{HIDDEN}, {TOKENS} tokens); the error of each run against the float64 result, in steps of the output's "
             "16-bit grid (LSB): mean (0 when an op rounds to nearest) and RMS (0.29 from rounding to nearest alone).  "
             "CPU: onnxruntime's CPU provider computing what the QDQ graph says (optimizations off); CPU, optimized: "
             "the same with its graph optimizations on (a plain session: QDQ groups fused into integer kernels); HTP: "
             f"the simulated HTP in integer mode.  onnxruntime {doc['onnxruntime']}, onnxruntime-qnn "
             f"{doc['onnxruntime_qnn']}.", "",
             "| op | CPU mean | CPU RMS | CPU, optimized mean | CPU, optimized RMS | HTP mean | HTP RMS |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in doc["rows"]:
        lines.append(f"| {row['case']} | " + " | ".join(f"{row[run]['mean_lsb']:+.3f} | {row[run]['rms_lsb']:.3f}"
                                                      for run in RUNS) + " |")
    by = {r["case"]: r for r in doc["rows"]}
    fused, split = by["RMSNormalization, fused"]["htp"], by["RMSNormalization, decomposed"]["htp"]
    matmul, gelu, softmax = (by[k] for k in ("MatMul, 16-bit activation x int8 weight", "Gelu (tanh)", "Softmax"))
    lines += ["", f"The HTP's fused RMSNormalization is off by {fused['mean_lsb']:+.3f} LSB on average: it rounds its "
              f"output one way, where the same norm decomposed into 16-bit ops is off by {split['mean_lsb']:+.3f}.  A "
              "decoder adds such a constant to its residual stream after every norm (Gemma 3 has four per layer), and "
              "a rotation of that stream sums it over the hidden channels.  The HTP's Gelu (tanh) is off by "
              f"{gelu['htp']['mean_lsb']:+.3f} on average and {gelu['htp']['rms_lsb']:.1f} RMS, its Softmax by "
              f"{softmax['htp']['mean_lsb']:+.3f} and {softmax['htp']['rms_lsb']:.1f}: coarser than their 16-bit grids.  "
              "The 16-bit x int8 MatMul shows why a plain "
              f"onnxruntime CPU session is no stand-in for the HTP: with its optimizations on it is off by "
              f"{matmul['cpu_optimized']['rms_lsb']:.1f} LSB RMS where the graph computed as written is off by "
              f"{matmul['cpu']['rms_lsb']:.2f} and the HTP by {matmul['htp']['rms_lsb']:.2f}."]
    archs = doc.get("arch_targets") or {}
    if archs:
        lines += ["", "## Per HTP arch", "",
                  "The HTP runs again for a target of every arch the simulator accepts ("
                  + ", ".join(f"{arch}: {product}" for arch, product in archs.items())
                  + f"; the table above: {doc['target']['product']}, {doc['target']['htp_arch']}).  Mean error and "
                  "RMS, LSB:", "",
                  "| op | " + " | ".join(archs) + " |", "|---|" + "---:|" * len(archs)]
        for row in doc["rows"]:
            lines.append(f"| {row['case']} | " + " | ".join(
                f"{row['htp_by_arch'][a]['mean_lsb']:+.3f} / {row['htp_by_arch'][a]['rms_lsb']:.2f}" for a in archs) + " |")
        norm = [by["RMSNormalization, fused"]["htp_by_arch"][a]["mean_lsb"] for a in archs]
        row, arch = max(((r, a) for r in doc["rows"] for a in archs),
                        key=lambda ra: abs(ra[0]["htp_by_arch"][ra[1]]["rms_lsb"] - ra[0]["htp"]["rms_lsb"]))
        lines += ["", f"The fused RmsNorm rounds down on every arch (mean {min(norm):+.3f} to {max(norm):+.3f} LSB), so "
                  "its compensation (`qnnpasses/quant/norm_rounding.py`) is applied whatever the target.  The largest "
                  f"difference from {doc['target']['htp_arch']}: {arch}'s {row['case']} at "
                  f"{row['htp_by_arch'][arch]['rms_lsb']:.2f} LSB RMS against {row['htp']['rms_lsb']:.2f}.  Measured on "
                  "the x86 simulation of the HTP, not on devices."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return write_docs(measure, render, DOC_JSON, DOC_MD, argv)


if __name__ == "__main__":
    sys.exit(main())
