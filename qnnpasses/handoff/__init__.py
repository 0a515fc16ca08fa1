"""The hand-off to QNN: a converter package for the SDK tools, and a real compile without them.

* :func:`qnnpasses.handoff.package.write_package` — ``model.onnx``, ``input_list.txt`` +
  raw calibration files, ``quant_overrides.json``, ``convert.sh`` (and runs the SDK
  tools when an SDK is present);
* :func:`qnnpasses.handoff.compile.compile_and_verify` — an EPContext model holding the
  HTP context binary, verified against the original and timed;
* :func:`emit` — both, for one model, into one folder (what ``qnnpasses run --emit``
  would call after the pipeline).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["emit"]


def emit(ir_path: str | Path, out_dir: str | Path, calib: str | Path | None = None, *,
         overrides: str | Path | None = None, sdk: str | None = None, measure: bool = False) -> dict[str, Any]:
    """Converter package in ``out_dir/qnn_package`` and the compiled ``out_dir/model_ctx.onnx``.

    Returns ``{"package": <write_package report>, "compile": <compile_and_verify report>}``;
    the compile part is ``{"skipped": reason}`` when the HTP backend is not available.
    """
    from qnnpasses.backends.htp import htp_available
    from qnnpasses.handoff.compile import compile_and_verify
    from qnnpasses.handoff.package import write_package

    out = Path(out_dir)
    report: dict[str, Any] = {"package": write_package(ir_path, out / "qnn_package", calib=calib,
                                                       overrides=overrides, sdk=sdk)}
    if htp_available():
        report["compile"] = compile_and_verify(ir_path, out / "model_ctx.onnx", measure=measure)
    else:
        report["compile"] = {"skipped": "onnxruntime-qnn HTP backend not available"}
    return report
