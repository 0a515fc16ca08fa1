"""The precision grid: every cell quantized, run on the real HTP backend and scored.

Cells: weights per-tensor | per-channel  x  activations 8 | 16 bit  x  sensitive tensors
(:mod:`qnnpasses.quant.policy`) 8 | 16 bit (optionally also w4a16, each cell with and
without the outlier rewrites of ``passes/outliers``, and the per-channel cells with GPTQ rounding), after a baseline cell: uniform uint8 (uint8
per-tensor weights, every activation 8 bit), the plain form of onnxruntime's QNN recipe.  The graph is prepared once (``htp-llm`` and the
quantization-prep passes, calibrated on the calibration set) and every cell quantizes that
prepared model with its own plan, then runs on the HTP in integer mode
(:func:`qnnpasses.quant.evaluate.evaluate`) against the fp32 original on CPU over the
evaluation set.  A cell the backend refuses is a result, not an error ("refused: ...").

Written to the output folder: ``sweep.json`` (every figure), ``sweep.md`` (the table) and
``sweep.png`` (1 - cosine on a log axis and top-1 agreement per cell).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qnnpasses.errors import QnnPassesError
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import save_model
from qnnpasses.quant.calibration import CalibrationData, model_inputs
from qnnpasses.quant.driver import ensure_pipeline, quant_prep, quantize_model
from qnnpasses.quant.evaluate import evaluate
from qnnpasses.quant.policy import PrecisionPolicy


def grid(weights: str = "int8", kv_bits: int | None = None, baseline: bool = True, *, int4: bool = False,
         outliers: tuple[str, ...] = ("",), rounding: tuple[str, ...] = ("nearest",)) -> list[PrecisionPolicy]:
    """The 8 cells (per-tensor first), after the uniform uint8 baseline (uint8 per-tensor weights) when asked.

    ``int4``: also the w4a16 cells (int4 per-channel weights with MSE scales, 16-bit activations,
    16-bit sensitive tensors), one per outlier rewrite.  ``outliers``: textual pipelines of
    outlier rewrites (``""`` = none); every cell of the grid is repeated for each.  ``rounding``:
    weight roundings (:data:`~qnnpasses.quant.policy.WEIGHT_ROUNDINGS`); each one other than
    ``nearest`` repeats the per-channel symmetric cells (GPTQ needs per-channel grids).
    """
    from qnnpasses.errors import BadInputError
    from qnnpasses.quant.policy import WEIGHT_ROUNDINGS

    bad = [r for r in rounding if r not in WEIGHT_ROUNDINGS]
    if bad or not rounding:
        raise BadInputError(f"--weight-rounding must list {', '.join(WEIGHT_ROUNDINGS)} (got '{','.join(rounding)}')")
    cells = []
    for spec in outliers:
        for mode in rounding:
            gptq = mode != "nearest"
            if not (gptq and weights == "uint8"):
                cells += [PrecisionPolicy(act=act, weights=weights, per_channel=pc, sensitive_bits=sens,
                                          kv_bits=kv_bits, outliers=spec, weight_rounding=mode)
                          for pc in ((True,) if gptq else (False, True)) for act in ("uint8", "uint16")
                          for sens in (8, 16)]
            if int4:
                cells.append(PrecisionPolicy(act="uint16", weights="int4", weight_scales="mse", kv_bits=kv_bits,
                                             outliers=spec, weight_rounding=mode))
    if baseline and weights != "uint8":
        cells.insert(0, PrecisionPolicy(act="uint8", weights="uint8", per_channel=False, sensitive_bits=8,
                                        kv_bits=kv_bits))
    return cells


@dataclass
class Cell:
    label: str
    policy: dict[str, Any]
    status: str = "ok"
    qnn_partitions: int | None = None
    cpu_nodes: int | None = None
    cosine: float | None = None
    max_abs: float | None = None
    top1: float | None = None
    perplexity: float | None = None
    reference_perplexity: float | None = None
    quantize_seconds: float = 0.0
    eval_seconds: float = 0.0
    outputs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def on_htp(self) -> bool:
        return self.status == "ok" and self.qnn_partitions == 1 and self.cpu_nodes == 0


@dataclass
class SweepResult:
    model: str
    cells: list[Cell]
    calibration_samples: int
    eval_samples: int
    prep: list[dict[str, Any]]

    def best(self, weights_bits: int | None = 8) -> Cell | None:
        """The most accurate cell fully on the HTP: highest cosine (top-1 on a few hundred tokens of a
        random-weight model moves by single tokens, cosine does not), top-1 breaking ties."""
        ok = [c for c in self.cells if c.on_htp and c.cosine is not None
              and (weights_bits is None or c.policy["weights"].endswith(str(weights_bits)))]
        return max(ok, key=lambda c: (round(c.cosine, 6), c.top1 if c.top1 is not None else 0.0), default=None)

    def as_dict(self) -> dict[str, Any]:
        best = self.best()
        return {"model": self.model, "calibration_samples": self.calibration_samples, "eval_samples": self.eval_samples,
                "best_8bit_weight_cell": best.label if best else None, "prep": self.prep,
                "cells": [asdict(c) for c in self.cells]}


def run_sweep(model: str | Path, calib: str | Path, eval_data: str | Path, out_dir: str | Path, *,
              policies: list[PrecisionPolicy] | None = None, eval_limit: int | None = None,
              keep_models: bool = False, progress: Callable[[str, int, int], None] | None = None,
              pipeline: str = "htp-llm") -> SweepResult:
    """Quantize and score every policy (default :func:`grid`); figures and files in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    policies = policies or grid()
    ir = load_model(model)
    prep = ensure_pipeline(ir, pipeline=pipeline).records
    calib_data = CalibrationData(calib, model_inputs(ir))
    prep += quant_prep(ir, calib_data)
    eval_set = CalibrationData(eval_data, model_inputs(ir))
    cells = []
    with tempfile.TemporaryDirectory(prefix="qnnpasses-sweep-") as tmp:
        prepared = save_model(ir, Path(tmp) / "prepared.onnx")
        models = out / "cells" if keep_models else Path(tmp)
        for index, policy in enumerate(policies):
            if progress:
                progress(policy.label(), index, len(policies))
            cells.append(_run_cell(model, prepared, calib_data, eval_set, policy, models, eval_limit))
    if progress:
        progress("done", len(policies), len(policies))
    result = SweepResult(str(model), cells, len(calib_data), min(eval_limit or len(eval_set), len(eval_set)), prep)
    write_outputs(result, out)
    return result


def _run_cell(original, prepared: Path, calib: CalibrationData, eval_set: CalibrationData, policy: PrecisionPolicy,
              folder: Path, eval_limit: int | None) -> Cell:
    cell = Cell(policy.label(), asdict(policy))
    path = folder / (policy.label().replace(" ", "_") + ".onnx")
    start = time.monotonic()
    try:
        quantize_model(prepared, calib, path, policy, run_prep=False)
    except QnnPassesError as exc:
        cell.status = f"quantize failed: {exc}"
        return cell
    cell.quantize_seconds = round(time.monotonic() - start, 2)
    try:
        ev = evaluate(original, path, eval_set, limit=eval_limit)
    except QnnPassesError as exc:
        cell.status = f"refused: {str(exc).removeprefix('the QDQ model does not run on the HTP: ')[:200]}"
        return cell
    head = ev.headline
    cell.qnn_partitions, cell.cpu_nodes = ev.qnn_partitions, len(ev.cpu_nodes)
    cell.cosine, cell.max_abs, cell.top1 = head.cosine, head.max_abs, head.top1
    cell.perplexity, cell.reference_perplexity = head.perplexity, head.reference_perplexity
    cell.eval_seconds = round(ev.seconds, 2)
    cell.outputs = [o.as_dict() for o in ev.outputs]
    return cell


# --------------------------------------------------------------------------- outputs


def _f(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(result: SweepResult) -> str:
    best = result.best()
    intro = (f"Calibration samples: {result.calibration_samples}; evaluation samples: {result.eval_samples} "
             "(disjoint). fp32 original on onnxruntime CPU vs QDQ on the QNN HTP backend (integer mode).")
    lines = [f"# Precision sweep: {Path(result.model).name}", "", intro, "",
             ("| cell | weights | act | sensitive | outlier rewrite | QNN partitions | CPU nodes | cosine | max abs | "
              "top-1 | ppl (fp32) | status |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in result.cells:
        p = c.policy
        sens = p["sensitive_bits"] or (16 if p["act"] == "uint16" else 8)
        ppl = "-" if c.perplexity is None else f"{c.perplexity:.2f} ({c.reference_perplexity:.2f})"
        mark = " **best**" if best is not None and c is best else ""
        rounding = p.get("weight_rounding", "nearest")
        lines.append(f"| {c.label}{mark} | {p['weights']} {'per-channel' if p['per_channel'] else 'per-tensor'}"
                     f"{'' if rounding == 'nearest' else ', ' + rounding} | "
                     f"{p['act']} | {sens}-bit | {p.get('outliers') or 'none'} | {_f(c.qnn_partitions, 'd')} | "
                     f"{_f(c.cpu_nodes, 'd')} | "
                     f"{_f(c.cosine, '.6f')} | {_f(c.max_abs, '.4g')} | {_f(c.top1, '.1%')} | {ppl} | {c.status} |")
    return "\n".join(lines) + "\n"


def chart(result: SweepResult, path: Path) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    cells = [c for c in result.cells if c.cosine is not None]
    if not cells:
        return None
    labels = [c.label for c in cells]
    has_top1 = any(c.top1 is not None for c in cells)
    fig, axes = plt.subplots(1, 2 if has_top1 else 1, figsize=(12 if has_top1 else 7, 4.5), squeeze=False)
    try:
        ax = axes[0][0]
        ax.barh(labels, [max(1.0 - c.cosine, 1e-9) for c in cells], color="tab:blue")
        ax.set_xscale("log")
        ax.set_xlabel("1 - cosine vs fp32 (log, lower is better)")
        ax.invert_yaxis()
        if has_top1:
            ax = axes[0][1]
            ax.barh(labels, [100 * (c.top1 or 0.0) for c in cells], color="tab:green")
            ax.set_xlabel("top-1 agreement with fp32 (%)")
            ax.set_xlim(min(80.0, min(100 * (c.top1 or 0) for c in cells) - 2), 100.5)
            ax.invert_yaxis()
        fig.suptitle(f"{Path(result.model).name}: precision grid on the QNN HTP (integer mode)")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def write_outputs(result: SweepResult, out: Path) -> dict[str, Path]:
    from qnnpasses.passmanager.report import json_safe

    files = {"json": out / "sweep.json", "md": out / "sweep.md", "png": out / "sweep.png"}
    files["json"].write_text(json.dumps(json_safe(result.as_dict()), indent=2))
    files["md"].write_text(markdown(result))
    if chart(result, files["png"]) is None:
        del files["png"]
    return files
