"""Compile to an EPContext model, prove it computes the same, and measure what it saves.

``fp16``: the float model compiled with ``enable_htp_fp16_precision``.  ``qdq``: the model
is first quantized to QDQ with onnxruntime's QNN recipe (``get_qnn_qdq_config``: uint16
activations, uint8 weights, calibrated on the given samples) and compiled in integer
precision.  The compiled model is then loaded in a fresh process and its outputs compared
with the original's fp32 CPU outputs (max abs, cosine), and with the original run on the
HTP (same prepared graph: they should agree to the last bit).  Load time is session
creation from the ONNX graph (conversion + HTP graph preparation) versus from the
EPContext model, each in its own cold process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from qnnpasses.backends.cpu import cosine_similarity, make_inputs, run_cpu
from qnnpasses.handoff.epcontext import compile_model, context_summary, timed_load
from qnnpasses.ir.load import load_model

#: minimum cosine of the compiled model's outputs vs fp32 CPU, by precision.  fp16 is held to
#: the fp16 tolerance; a QDQ model's error depends on its calibration data, so there the bar
#: only catches broken outputs (garbage, wrong bindings) and the figures are reported.
MIN_COSINE = {"fp16": 0.999, "qdq": 0.95}


def quantize_qdq(model: str | Path, out: Path, samples: list[dict[str, np.ndarray]]) -> Path:
    """QDQ model for the HTP (onnxruntime's QNN quantization recipe, the peer tool)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    class Reader(CalibrationDataReader):
        def __init__(self):
            self._it = iter(samples)

        def get_next(self):
            return next(self._it, None)

    from qnnpasses.progress import step
    from qnnpasses.quant.driver import quiet_quantizer

    step(f"quantizing to QDQ, calibrating on {len(samples)} sample(s)")
    with quiet_quantizer():
        config = get_qnn_qdq_config(str(model), Reader(), activation_type=QuantType.QUInt16,
                                    weight_type=QuantType.QUInt8)
        quantize(str(model), str(out), config)
    return out


def _compare(reference: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    result = {}
    for name, ref in reference.items():
        if name not in got:
            result[name] = {"max_abs": float("inf"), "cosine": 0.0}
            continue
        a, b = np.asarray(ref, np.float64), np.asarray(got[name], np.float64)
        result[name] = {"max_abs": float(np.max(np.abs(a - b))) if a.size else 0.0, "cosine": cosine_similarity(a, b)}
    return result


def compile_and_verify(model: str | Path, out: str | Path, *, mode: str = "fp16", embed: bool | None = None,
                       inputs: dict[str, np.ndarray] | None = None,
                       calibration: list[dict[str, np.ndarray]] | None = None, measure: bool = True) -> dict[str, Any]:
    out = Path(out)
    ir = load_model(model)
    inputs = inputs if inputs is not None else make_inputs(ir)
    source = Path(model)
    if mode == "qdq":
        samples = calibration or [inputs]
        source = quantize_qdq(model, out.with_name(out.stem + ".qdq.onnx"), samples)
    fp16 = mode == "fp16"
    report: dict[str, Any] = {"model": str(model), "output": str(out), "mode": mode, "compiled_from": str(source)}
    if mode == "qdq":
        report["calibration_samples"] = len(samples)
        report["calibrated_on"] = "calibration data" if calibration else "the check inputs (no --calib given)"
    compiled = compile_model(source, out, fp16=fp16, embed=embed, weight_bytes=ir.weight_bytes())
    report["compile"] = compiled
    if not compiled.get("ok"):
        report["ok"] = False
        return report
    report["context"] = context_summary(out)
    reference = run_cpu(model, inputs)
    ctx_load, ctx_out = timed_load(out, inputs, fp16=fp16)
    report["load_from_context"] = ctx_load
    report["accuracy"] = _compare(reference, ctx_out) if ctx_out else {}
    if measure:
        onnx_load, onnx_out = timed_load(source, inputs, fp16=fp16)
        report["load_from_onnx"] = onnx_load
        if onnx_out and ctx_out:
            report["context_vs_onnx_on_htp"] = _compare(onnx_out, ctx_out)
        if onnx_load.get("ok") and ctx_load.get("ok"):
            report["load_seconds_saved"] = onnx_load["session_seconds"] - ctx_load["session_seconds"]
            report["load_speedup"] = onnx_load["session_seconds"] / max(ctx_load["session_seconds"], 1e-9)
    min_cos = MIN_COSINE[mode]
    report["min_cosine"] = min_cos
    report["ok"] = bool(ctx_load.get("ok")) and bool(report["accuracy"]) and all(
        d["cosine"] >= min_cos for d in report["accuracy"].values())
    return report
