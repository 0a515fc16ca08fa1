"""Which layers lose most to quantization, and raising them until a target is met.

:func:`layer_sqnr` measures, per weighted MatMul/Gemm of a prepared float model, the
signal-to-quantization-noise ratio of its *output* when only its weight is quantized as the
policy would (int4/int8 per channel, MSE or min/max scales, blocks):

    SQNR = 10·log10( Σ(X·W)² / Σ(X·W - X·Q(W))² )

with ``X`` the layer's real input on calibration samples (fp32 on onnxruntime CPU).  It is
local (no error propagation) and cheap (one fp32 run per sample, then NumPy), and it ranks
what the HTP will suffer from: a low-SQNR layer is one whose weights do not fit the grid.

:func:`raise_until` then quantizes with the ``k`` weakest layers raised (8-bit weights in an
int4 plan, 16-bit outputs in an 8-bit-activation plan; :attr:`PrecisionPolicy.raised`) for
``k = 0, 1, 2, 4, 8, ...`` up to ``budget``, scores each on onnxruntime CPU against fp32 and
stops at the first that meets the target (top-1 agreement, perplexity ratio, output cosine).
In a w8a16 plan the raised layers get 16-bit weights.  The
CPU run of the QDQ graph is a proxy for the HTP (the same encodings; the HTP's integer
kernels round differently); the chosen plan is what ``qnnpasses quantize`` then measures
on the HTP with ``--evaluate``.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from qnnpasses.quant.calibration import CalibrationData
from qnnpasses.quant.policy import PrecisionPolicy, weighted_inputs, weighted_nodes
from qnnpasses.quant.weights import quantize_weight

_TYPES = {4: onnx.TensorProto.INT4, 8: onnx.TensorProto.INT8, 16: onnx.TensorProto.INT16}


def layer_sqnr(prepared: str | Path, calib: CalibrationData, policy: PrecisionPolicy, samples: int = 4) -> dict[str, float]:
    """SQNR (dB) of each weighted MatMul/Gemm output under weight-only quantization, weakest first."""
    import onnxruntime as ort

    from qnnpasses.ir.load import load_model
    from qnnpasses.passmanager.rewrite import constant_value

    ir = load_model(prepared)
    axes = weighted_inputs(ir.graph)
    nodes = {name: n for name, n in weighted_nodes(ir.graph).items() if n.inputs[1].name in axes
             and n.op == "MatMul"}
    model = onnx.load(str(prepared))
    known = {o.name for o in model.graph.output}
    for n in nodes.values():
        if n.inputs[0].name not in known:
            model.graph.output.append(onnx.helper.make_tensor_value_info(n.inputs[0].name, onnx.TensorProto.FLOAT, None))
            known.add(n.inputs[0].name)
    with tempfile.TemporaryDirectory(prefix="qnnpasses-sqnr-") as tmp:
        path = Path(tmp) / "probe.onnx"
        onnx.save(model, str(path), save_as_external_data=True, location="probe.onnx.data")
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        wanted = sorted({n.inputs[0].name for n in nodes.values()})
        signal = {k: 0.0 for k in nodes}
        noise = {k: 0.0 for k in nodes}
        quantized = {}
        for name, n in nodes.items():
            w = constant_value(n.inputs[1]).astype(np.float32)
            bits = 8 if policy.weight_bits == 4 and name in _head_nodes(ir) else policy.weight_bits
            q, scale, _, block, _ = quantize_weight(w, axes[n.inputs[1].name], _TYPES[bits],
                                                       mse=policy.weight_scales == "mse", block_size=policy.block_size)
            full = np.repeat(scale, block, axis=0) if block else scale
            quantized[name] = (w, (q * full).astype(np.float32))
        for i in range(min(samples, len(calib))):
            got = dict(zip(wanted, session.run(wanted, calib[i])))
            for name, n in nodes.items():
                x = got[n.inputs[0].name].astype(np.float32)
                w, wq = quantized[name]
                y = x @ w
                signal[name] += float((y.astype(np.float64) ** 2).sum())
                noise[name] += float(((y - x @ wq).astype(np.float64) ** 2).sum())
    sqnr = {k: 10 * math.log10(signal[k] / noise[k]) if noise[k] > 0 else math.inf for k in nodes}
    return dict(sorted(sqnr.items(), key=lambda kv: kv[1]))


def _head_nodes(ir) -> set[str]:
    from qnnpasses.quant.policy import head_outputs

    heads = set(head_outputs(ir.graph))
    return {n.name for n in ir.graph.nodes if n.outputs and n.outputs[0].name in heads}


@dataclass
class Search:
    sqnr: dict[str, float]
    steps: list[dict[str, Any]] = field(default_factory=list)
    chosen: PrecisionPolicy | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"weakest": [[k, round(v, 2)] for k, v in list(self.sqnr.items())[:10]], "steps": self.steps,
                "raised": list(self.chosen.raised) if self.chosen else None}


def raise_until(prepared: str | Path, calib: CalibrationData, evals: CalibrationData, policy: PrecisionPolicy, *,
                target_top1: float | None = None, target_ppl_ratio: float | None = None,
                target_cosine: float | None = None, budget: int = 16,
                eval_samples: int = 8, quantize: Callable | None = None) -> Search:
    """The smallest ``k`` weakest layers (0, 1, 2, 4, ... <= ``budget``) to raise for the target (module docs)."""
    from qnnpasses.quant.driver import quantize_model
    from qnnpasses.quant.evaluate import evaluate

    quantize = quantize or (lambda path, pol: quantize_model(prepared, calib, path, pol, run_prep=False))
    search = Search(layer_sqnr(prepared, calib, policy))
    order = list(search.sqnr)
    counts = [0] + [2 ** i for i in range(int(math.log2(max(budget, 1))) + 1) if 2 ** i <= budget]
    if target_top1 is None and target_ppl_ratio is None and target_cosine is None:
        counts = [budget]  # a plain layer budget
    with tempfile.TemporaryDirectory(prefix="qnnpasses-raise-") as tmp:
        for k in dict.fromkeys(counts):
            candidate = replace(policy, raised=tuple(order[:k]))
            path = Path(tmp) / f"k{k}.onnx"
            quantize(path, candidate)
            head = evaluate(prepared, path, evals, on="cpu", limit=eval_samples).headline
            ratio = head.perplexity / head.reference_perplexity if head.perplexity else None
            ok = (target_top1 is None or (head.top1 or 0) >= target_top1) and \
                 (target_ppl_ratio is None or (ratio is not None and ratio <= target_ppl_ratio)) and \
                 (target_cosine is None or head.cosine >= target_cosine)
            search.steps.append({"raised": k, "top1": head.top1, "ppl_ratio": ratio, "cosine": head.cosine, "met": ok})
            search.chosen = candidate
            if ok:
                break
    return search
