"""Several graphs, one quantization: the public entry point for a prefill/decode pair.

:func:`quantize_graphs` quantizes graphs that share weights and hand tensors to each other
(an LLM's prefill graph writes the KV cache its decode graph reads) so that every shared
tensor has ONE encoding:

1. each graph is prepared as :func:`~qnnpasses.quant.driver.quantize_model` prepares it
   (``htp-llm`` unless already run, the quantization-prep passes, the policy's outlier
   rewrites -- deterministic, so the same weights are rewritten the same way in each graph);
2. each graph's activation ranges are calibrated on its own data (MinMax,
   :mod:`qnnpasses.quant.ranges`: the weights mapped, one sample at a time);
3. ranges are merged: a tensor name present in several graphs, and each ``ties`` pair
   (``{"present.0.key": "past_key_values.0.key"}``: the prefill output that becomes the
   decode input), gets the union of its ranges in every graph;
4. every graph is quantized with its merged ranges fixed (weights are quantized from the
   same float values by the same rule, so shared weights get identical encodings; GPTQ
   rounding takes every graph's layer inputs from the first graph and its data, for the same reason).

Precisions (:data:`PRECISIONS`), each the best recipe measured on a trained model in
``docs/quant_llm.md`` (rotation, then GPTQ rounding on the calibration data):
``w8a16`` (int8 per-channel weights, 16-bit activations) and ``w4a16`` (int4 weights in blocks of
32 input rows with MSE-optimal scales, lm_head at 8 bit).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from qnnpasses.errors import BadInputError
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import IRModel, save_model
from qnnpasses.memory import release
from qnnpasses.quant.calibration import CalibrationData, model_inputs
from qnnpasses.quant.driver import (
    QuantizeResult,
    ensure_pipeline,
    outlier_rewrites,
    quant_prep,
    quantize_model,
)
from qnnpasses.quant.gptq import GptqCache
from qnnpasses.quant.policy import PrecisionPolicy
from qnnpasses.quant.ranges import calibrate_ranges

#: The outlier rewrites that keep a pre-norm LLM's residual stream small (see passes/outliers).
ROTATE = "fold-norm-weights,rotate-residual"
PRECISIONS: dict[str, PrecisionPolicy] = {
    "w8a16": PrecisionPolicy(act="uint16", weights="int8", weight_rounding="gptq", outliers=ROTATE),
    "w4a16": PrecisionPolicy(act="uint16", weights="int4", weight_scales="mse", block_size=32,
                             weight_rounding="gptq", outliers=ROTATE),
}


def precision_policy(name: str, **changes: Any) -> PrecisionPolicy:
    """The policy of a named precision (``w8a16``, ``w4a16``), with field ``changes``."""
    if name not in PRECISIONS:
        raise BadInputError(f"unknown precision '{name}' (known: {', '.join(PRECISIONS)})")
    return replace(PRECISIONS[name], **changes)


@dataclass
class SharedResult:
    results: dict[str, QuantizeResult]
    shared_tensors: list[str] = field(default_factory=list)  # names whose range was merged

    def as_dict(self) -> dict[str, Any]:
        return {"graphs": {k: r.as_dict() for k, r in self.results.items()}, "shared_tensors": self.shared_tensors}


def merge_ranges(per_graph: Mapping[str, dict[str, tuple[float, float]]],
                 ties: Mapping[str, str] | None = None) -> tuple[dict[str, dict[str, tuple[float, float]]], list[str]]:
    """Union the ranges of tensors several graphs share (by name, and each ``ties`` pair)."""
    groups: dict[str, set[str]] = {}
    for a, b in (ties or {}).items():
        group = groups.get(a, {a}) | groups.get(b, {b})
        for name in group:
            groups[name] = group
    union: dict[frozenset, tuple[float, float]] = {}
    counts: dict[frozenset, int] = {}
    for ranges in per_graph.values():
        for name, (lo, hi) in ranges.items():
            key = frozenset(groups.get(name, {name}))
            old = union.get(key)
            union[key] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))
            counts[key] = counts.get(key, 0) + 1
    shared = sorted(n for key, c in counts.items() if c > 1 for n in key)
    merged = {g: {n: union[frozenset(groups.get(n, {n}))] for n in ranges} for g, ranges in per_graph.items()}
    return merged, shared


def quantize_graphs(models: Mapping[str, str | os.PathLike | IRModel],
                    calib: Mapping[str, str | os.PathLike | CalibrationData],
                    outputs: Mapping[str, str | os.PathLike], *, precision: str = "w8a16",
                    policy: PrecisionPolicy | None = None, ties: Mapping[str, str] | None = None,
                    pipeline: str = "htp-llm", shapes: Mapping[str, dict[str, list[int]]] | None = None) -> SharedResult:
    """Quantize the graphs ``models`` (name -> model) with one shared calibration plan (module docs).

    ``calib`` and ``outputs`` are keyed like ``models``; ``policy`` overrides ``precision``.
    Returns each graph's :class:`~qnnpasses.quant.driver.QuantizeResult` and the merged tensors.
    """
    if set(calib) != set(models) or set(outputs) != set(models):
        raise BadInputError(f"calib and outputs must name the same graphs as models ({sorted(models)})")
    policy = policy or precision_policy(precision)
    prepared: dict[str, IRModel] = {}
    data: dict[str, CalibrationData] = {}
    ranges: dict[str, dict[str, tuple[float, float]]] = {}
    records: dict[str, list] = {}
    with tempfile.TemporaryDirectory(prefix="qnnpasses-shared-") as tmp:
        for name, model in models.items():
            ir = model if isinstance(model, IRModel) else load_model(model)
            prep = ensure_pipeline(ir, pipeline=pipeline, shapes=(shapes or {}).get(name))
            source = calib[name]
            data[name] = source if isinstance(source, CalibrationData) else CalibrationData(source, model_inputs(ir))
            records[name] = prep.records + quant_prep(ir, data[name])
            if policy.outliers:
                records[name] += outlier_rewrites(ir, policy.outliers, data[name])
            path = save_model(ir, Path(tmp) / f"{name}.prepared.onnx")
            prepared[name] = path
            del ir, prep
            release()
            ranges[name] = calibrate_ranges(path, data[name])
            release()
        merged, shared = merge_ranges(ranges, ties)
        first = next(iter(prepared))  # GPTQ rounds every graph's weights on the first graph's inputs, once
        cache = GptqCache(Path(tmp) / "gptq")
        results = {}
        for name, path in prepared.items():
            results[name] = quantize_model(path, data[name], outputs[name], replace(policy, outliers=""),
                                           run_prep=False, ranges=merged[name],
                                           gptq_source=(prepared[first], data[first]), gptq_cache=cache)
            release()
            results[name].prep.records = records[name] + results[name].prep.records
    return SharedResult(results, shared)
