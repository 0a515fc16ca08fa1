"""The converter package: everything ``qnn-onnx-converter`` and friends need, in one folder.

``model.onnx`` (weights external when the input's were), ``input_list.txt`` + raw files +
``inputs.json`` (:mod:`.inputs`), ``quant_overrides.json`` (given, or by default with
calibration data the mixed-precision plan made by :func:`_plan`), and ``convert.sh``
(:mod:`.sdk`).  When an SDK is found the same steps run right away.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from qnnpasses.errors import BadInputError
from qnnpasses.handoff import inputs as inputs_mod
from qnnpasses.handoff import sdk as sdk_mod
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import save_model

OVERRIDES = "quant_overrides.json"
_ENCODING_SECTIONS = ("activation_encodings", "param_encodings")


def validate_overrides(path: str | Path) -> dict[str, Any]:
    """A quantization-overrides JSON: an object; AIMET-style sections, when present, are objects
    (or lists, the newer AIMET layout) of encodings."""
    source = Path(path)
    try:
        data = json.loads(source.read_text())
    except FileNotFoundError:
        raise BadInputError(f"--overrides not found: {source}") from None
    except ValueError as exc:
        raise BadInputError(f"--overrides {source.name} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadInputError(f"--overrides {source.name} must hold a JSON object")
    for section in _ENCODING_SECTIONS:
        if section in data and not isinstance(data[section], (dict, list)):
            raise BadInputError(f"--overrides {source.name}: '{section}' must be an object or a list")
    return data


def write_package(model: str | Path, out: str | Path, *, calib: str | Path | None = None,
                  overrides: str | Path | None = None, sdk: str | None = None, run: bool = True,
                  plan: bool = True, policy=None) -> dict[str, Any]:
    """Write the package into ``out``; run the SDK steps when an SDK is found and ``run``.

    With ``calib`` and no ``overrides``, the mixed-precision plan goes in too (``plan``):
    the model is quantized as ``qnnpasses quantize`` does (``policy``, default w8a16), the
    prepared float model it was made from becomes ``model.onnx`` (the tensor names the plan
    uses) and its encodings ``quant_overrides.json`` (AIMET 1.0.0, with the 2.0.0 layout next
    to it as ``quant_overrides.v2.json``).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ir = load_model(model)
    specs = inputs_mod.input_specs(ir)
    samples = inputs_mod.load_calibration(calib, specs) if calib else []
    if overrides:
        validate_overrides(overrides)
    planned = None
    if calib and not overrides and plan:
        planned = _plan(model, calib, out, policy)
        ir = load_model(out / "model.onnx")
    else:
        save_model(ir, out / "model.onnx")
    report: dict[str, Any] = {"package": str(out), "model": "model.onnx", "samples": len(samples),
                              "inputs": [{"name": s.name, "raw_dtype": s.file_dtype.name} for s in specs]}
    if planned:
        overrides = out / OVERRIDES
        report["plan"] = planned
    if samples:
        inputs_mod.write_samples(out, samples, specs)
        report["input_list"] = inputs_mod.INPUT_LIST
    if overrides:
        if Path(overrides).resolve() != (out / OVERRIDES).resolve():
            shutil.copyfile(overrides, out / OVERRIDES)
        report["overrides"] = OVERRIDES
    step_list = sdk_mod.steps(calibrated=bool(samples), native_inputs=inputs_mod.needs_native_files(specs),
                              overrides=bool(overrides))
    script = out / "convert.sh"
    script.write_text(sdk_mod.render_script(step_list))
    script.chmod(0o755)
    report["script"] = script.name
    report["options"] = sdk_mod.used_options(step_list)
    root = sdk_mod.find_sdk(sdk)
    if root is None:
        report["sdk"] = None
        report["sdk_message"] = "no QNN SDK found (set QNN_SDK_ROOT or pass --sdk DIR): package written, conversion not run"
    elif run:
        report["sdk"] = str(root)
        report["steps"] = sdk_mod.run_steps(step_list, out, root)
        binary = out / "output" / f"{sdk_mod.CONTEXT_NAME}.bin"
        report["context_binary"] = str(binary) if binary.exists() else None
    return report


def _plan(model: str | Path, calib: str | Path, out: Path, policy) -> dict[str, Any]:
    """Quantize ``model`` on ``calib``; write the prepared float model and its encodings into ``out``."""
    import tempfile

    from qnnpasses.quant.driver import quantize_model
    from qnnpasses.quant.overrides import write_overrides
    from qnnpasses.quant.shared import precision_policy

    # the overrides name the packaged float model's tensors: no QDQ-only rewrite of the attention's
    # MatMuls (qnnpasses.quant.split_operand), whose new tensors the float model does not have
    policy = replace(policy or precision_policy("w8a16"), split_act_matmul=False)
    with tempfile.TemporaryDirectory(prefix="qnnpasses-plan-") as tmp:
        qdq = Path(tmp) / "model.qdq.onnx"
        result = quantize_model(model, calib, qdq, policy, keep_prepared=out / "model.onnx")
        write_overrides(qdq, out / OVERRIDES, quantizer_args=policy.quantizer_args())
        write_overrides(qdq, out / OVERRIDES.replace(".json", ".v2.json"), version="2.0.0")
    return {"policy": policy.label(), "plan": result.plan.summary(), "calibration_samples": result.calibration_samples,
            "v2": OVERRIDES.replace(".json", ".v2.json")}
