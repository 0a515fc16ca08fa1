"""The quantize driver: prepare the graph for the HTP, quantize it statically to QDQ, record the plan.

Steps (``qnnpasses quantize``):

1. **Prepare.**  Unless the model's ``metadata_props`` carry ``qnnpasses.passmanager.spec`` (the
   ``htp-llm`` pipeline already ran), run ``htp-llm``; then the quantization-prep passes
   (``QUANT_PREP``): graph fixes that only quantization needs, each a framework pass with
   its record.  ``htp-llm`` itself makes masks finite, removes NaN guards and int64 math.
2. **Plan.**  :func:`qnnpasses.quant.policy.make_plan`: 16-bit sensitive tensors, per-channel
   symmetric weights, the KV cache width.
3. **Quantize.**  onnxruntime's QNN recipe (``get_qnn_qdq_config`` + ``quantize_static``) with the
   plan as its tensor overrides.  MinMax ranges come from :mod:`qnnpasses.quant.ranges` (the
   same figures as onnxruntime's calibrator, with the weights mapped and each activation freed
   after its reduction; its own holds every activation of a call and a copy of the weights), handed
   to ``quantize_static`` as its calibration cache so that it does not calibrate again;
   percentile and entropy use onnxruntime's calibrators, fed by a streaming reader (one
   sample in memory at a time).  ``ForceQuantizeNoInputCheck`` makes ops whose
   other operands are constants (the mask ``Where(cond, 0, -M)``) quantize them too: the
   HTP has no float ``Select`` in integer mode ("could not create op: q::Select").
   Then :func:`~qnnpasses.quant.weights.refine_weights` rewrites the weight encodings when
   the policy asks (MSE scales, int4 blocks, GPTQ rounding on the calibration data), and with
   16-bit activations each MatMul of two activations gets its second operand in two 8-bit
   parts (:mod:`qnnpasses.quant.split_operand`: the HTP reads it at 8 bits).
4. **Record.**  ``qnnpasses.quantization`` in the output's metadata (the policy as JSON),
   and the plan as converter overrides (:mod:`qnnpasses.quant.overrides`) when asked.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnxruntime.quantization import CalibrationMethod, quantize_static
from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

from qnnpasses.errors import BadInputError
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import IRModel, save_model
from qnnpasses.memory import release
from qnnpasses.passmanager.api import PassContext
from qnnpasses.passmanager.manager import PassManager, RunConfig
from qnnpasses.passmanager.named import get_pipeline, named_pipelines
from qnnpasses.passmanager.spec import Pipeline, parse_pipeline
from qnnpasses.quant.calibration import CalibrationData, model_inputs
from qnnpasses.quant.gptq import GptqCache, GptqConfig
from qnnpasses.quant.policy import Plan, PrecisionPolicy, make_plan
from qnnpasses.quant.streamed import weights_on_demand
from qnnpasses.quant.weights import refine_weights

PIPELINE_KEY = "qnnpasses.passmanager.spec"
QUANT_KEY = "qnnpasses.quantization"
#: Quantization-prep passes, after htp-llm.
QUANT_PREP = "quant-mask,cleanup"
#: Samples the prep passes see (they calibrate mask ranges).
PREP_SAMPLES = 8
CALIBRATION_METHODS = {"minmax": CalibrationMethod.MinMax, "percentile": CalibrationMethod.Percentile,
                       "entropy": CalibrationMethod.Entropy}


@dataclass
class PrepResult:
    ir: IRModel
    pipeline: str | None  # what ran (None: the input was already prepared)
    records: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class QuantizeResult:
    output: Path
    policy: PrecisionPolicy
    plan: Plan
    prep: PrepResult
    seconds: float
    calibration_samples: int
    weights: dict[str, Any] = field(default_factory=dict)  # refine_weights' report (mse / blocks)
    act_matmuls: dict[str, Any] = field(default_factory=dict)  # qnnpasses.quant.split_operand's count

    def as_dict(self) -> dict[str, Any]:
        return {"output": str(self.output), "policy": asdict(self.policy), "plan": self.plan.summary(),
                "pipeline": self.prep.pipeline, "prep_passes": self.prep.records, "seconds": round(self.seconds, 2),
                "calibration_samples": self.calibration_samples, "weights": self.weights,
                "act_matmuls": self.act_matmuls}


def resolve_pipeline(pipeline: str) -> Pipeline:
    """A named pipeline (``htp-llm``), as its ``quantized`` variant runs
    (:data:`qnnpasses.passmanager.named.VARIANTS`), or a textual one (``fix-shapes,simplify,...``)."""
    return get_pipeline(pipeline, "quantized") if pipeline in named_pipelines() else parse_pipeline(pipeline)


def ensure_pipeline(ir: IRModel, *, pipeline: str = "htp-llm", shapes: dict[str, list[int]] | None = None) -> PrepResult:
    """Run ``pipeline`` on ``ir`` in place unless its metadata says a qnnpasses pipeline already ran."""
    if PIPELINE_KEY in ir.metadata_props:
        return PrepResult(ir, None)
    spec = resolve_pipeline(pipeline)
    result = PassManager(spec, RunConfig(), context=PassContext(shapes=dict(shapes or {}))).run(ir)
    ir.metadata_props[PIPELINE_KEY] = spec.to_text()
    return PrepResult(ir, spec.to_text(), [_brief(r) for r in result.records])


def quant_prep(ir: IRModel, calib: CalibrationData | None) -> list[dict[str, Any]]:
    """The quantization-prep passes (``QUANT_PREP``), verified on CPU, calibrated on the first samples."""
    samples = calib.head(PREP_SAMPLES) if calib is not None else None
    config = RunConfig(verify=bool(samples), inputs=samples[0] if samples else None)
    result = PassManager(parse_pipeline(QUANT_PREP), config, context=PassContext(calibration=samples)).run(ir)
    return [_brief(r) for r in result.records]


def outlier_rewrites(ir: IRModel, spec: str, calib: CalibrationData | None) -> list[dict[str, Any]]:
    """The policy's outlier rewrites (``fold-norm-weights,rotate-residual`` ...), verified on CPU."""
    samples = calib.head(PREP_SAMPLES) if calib is not None else None
    config = RunConfig(verify=bool(samples), inputs=samples[0] if samples else None)
    result = PassManager(parse_pipeline(spec), config, context=PassContext(calibration=samples)).run(ir)
    return [_brief(r) for r in result.records]


def _brief(record) -> dict[str, Any]:
    return {"pass": record.name, "status": record.status, "stats": record.stats, "reason": record.reason}


def qdq_config(prepared_path: Path, calib: CalibrationData, policy: PrecisionPolicy, plan: Plan,
               limit: int | None = None):
    """onnxruntime's QNN static-quantization config for ``policy`` with ``plan``'s overrides."""
    method = CALIBRATION_METHODS.get(policy.calibrate_method)
    if method is None:
        raise BadInputError(f"unknown calibration method '{policy.calibrate_method}' ({', '.join(CALIBRATION_METHODS)})")
    config = get_qnn_qdq_config(
        str(prepared_path), calib.reader(limit), calibrate_method=method, activation_type=policy.act_type,
        weight_type=policy.weight_type, per_channel=False, init_overrides=plan.overrides or None,
        weight_symmetric=policy.weights.startswith("int"))
    config.extra_options["ForceQuantizeNoInputCheck"] = True
    if method is CalibrationMethod.Percentile:
        config.extra_options.setdefault("CalibPercentile", 99.999)
    return config


def quantize_model(model: str | os.PathLike | IRModel, calib: CalibrationData | str | os.PathLike,
                   output: str | os.PathLike, policy: PrecisionPolicy | None = None, *,
                   shapes: dict[str, list[int]] | None = None, keep_prepared: str | os.PathLike | None = None,
                   run_prep: bool = True, pipeline: str = "htp-llm",
                   ranges: dict[str, tuple[float, float]] | None = None,
                   gptq_source: tuple[str | os.PathLike, CalibrationData] | None = None,
                   gptq_cache: GptqCache | None = None) -> QuantizeResult:
    """Prepare, plan and quantize ``model`` into the QDQ model ``output`` (see the module docs).

    ``pipeline`` (a name or a textual pipeline) runs first unless the model says one already ran.
    ``run_prep=False`` skips the quantization-prep passes (``model`` went through them already,
    as in a sweep); ``keep_prepared`` writes the prepared float model there (the model the
    converter overrides name).  ``ranges`` fixes the calibrated range of activation tensors
    (``{name: (min, max)}``, see :func:`qnnpasses.quant.shared.quantize_graphs`); when it covers
    the graph, calibration reads one sample only.  ``gptq_source`` (float model, calibration data):
    where GPTQ rounding (``policy.weight_rounding``) takes its layer inputs, when not from this
    graph and ``calib`` (graphs sharing weights round them on the same inputs); ``gptq_cache``:
    where such graphs find the weights another one rounded already.
    """
    start = time.monotonic()
    policy = policy or PrecisionPolicy()
    ir = model if isinstance(model, IRModel) else load_model(model)
    prep = ensure_pipeline(ir, pipeline=pipeline, shapes=shapes)
    if not isinstance(calib, CalibrationData):
        calib = CalibrationData(calib, model_inputs(ir))
    _check_same_inputs(ir, calib)
    if run_prep:
        prep.records += quant_prep(ir, calib)
    if policy.outliers:
        prep.records += outlier_rewrites(ir, policy.outliers, calib)
    plan = make_plan(ir, policy)
    for name, (lo, hi) in (ranges or {}).items():
        entry = plan.overrides.setdefault(name, [{}])[0]
        if "axis" not in entry and "scale" not in entry:
            entry.update(rmin=np.float32(lo), rmax=np.float32(hi))
    out = Path(output).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="qnnpasses-quant-") as tmp:
        prepared = save_model(ir, Path(keep_prepared).resolve() if keep_prepared else Path(tmp) / "prepared.onnx")
        config = qdq_config(prepared, calib, policy, plan, limit=1 if ranges else None)
        from qnnpasses.progress import step

        cache = None
        if config.calibrate_method is CalibrationMethod.MinMax:
            cache = _ranges_cache(prepared, calib, ranges, Path(tmp) / "ranges.json")
        else:
            step(f"calibrating on {len(calib)} sample(s) from {calib.source} ({policy.calibrate_method})")
        cwd = os.getcwd()
        os.chdir(tmp)  # onnxruntime's calibrators write augmented_model.onnx into the working directory
        try:
            with quiet_quantizer(), weights_on_demand(prepared.parent):
                quantize_static(str(prepared.resolve()), str(out.resolve()), config.calibration_data_reader,
                                calibrate_method=config.calibrate_method, quant_format=config.quant_format,
                                activation_type=config.activation_type, weight_type=config.weight_type,
                                op_types_to_quantize=config.op_types_to_quantize,
                                nodes_to_quantize=config.nodes_to_quantize, nodes_to_exclude=config.nodes_to_exclude,
                                per_channel=config.per_channel, reduce_range=config.reduce_range,
                                use_external_data_format=config.use_external_data_format,
                                calibration_providers=config.calibration_providers,
                                extra_options=config.extra_options, calibration_cache_path=cache)
        finally:
            os.chdir(cwd)
        # what the quantizer allocated stays with the process after it returns: give it back before
        # the refinement loads the result
        release()
        refined = {}
        if policy.weight_scales == "mse" or policy.block_size or policy.weight_rounding != "nearest":
            gptq = None
            if policy.weight_rounding != "nearest":
                source, data = gptq_source or (prepared, calib)
                gptq = GptqConfig(data, act_order=policy.weight_rounding == "gptq-act", source=source,
                                  cache=gptq_cache)
            refined = refine_weights(out, prepared, mse=policy.weight_scales == "mse",
                                     block_size=policy.block_size, gptq=gptq).as_dict()
    split = {"split": 0}
    if policy.split_act_matmul and policy.act == "uint16":
        from qnnpasses.quant.split_operand import split_second_operands

        split = split_second_operands(out)
    _stamp(out, prep, policy)
    return QuantizeResult(out, policy, plan, prep, time.monotonic() - start, len(calib), refined, split)


def _ranges_cache(prepared: Path, calib: CalibrationData, ranges: dict[str, tuple[float, float]] | None,
                  path: Path) -> Path:
    """The MinMax ranges of ``prepared``'s activations as onnxruntime's calibration cache at ``path``:
    ``ranges`` where given (a pair's merged ranges cover its graphs), the rest calibrated here."""
    from onnxruntime.quantization.calibrate import save_tensors_data

    from qnnpasses.progress import step
    from qnnpasses.quant.ranges import calibrate_ranges, calibrated_tensors, tensors_data

    found = dict(ranges or {})
    missing = set(calibrated_tensors(onnx.load(str(prepared), load_external_data=False))) - set(found)
    if missing:
        limit = 1 if ranges else None  # a few tensors the merged ranges lack: one sample shows them
        step(f"calibrating on {min(limit or len(calib), len(calib))} sample(s) from {calib.source} (minmax)")
        found = {**calibrate_ranges(prepared, calib, limit), **found}
    save_tensors_data(tensors_data(found), path)
    return path


@contextlib.contextmanager
def quiet_quantizer():
    """Silence onnxruntime.quantization's root-logger advice ("consider pre-processing") for one call."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def _check_same_inputs(ir: IRModel, calib: CalibrationData) -> None:
    names = [t.name for t in ir.graph.inputs]
    if [s.name for s in calib.inputs] != names:
        raise BadInputError(f"calibration inputs {[s.name for s in calib.inputs]} differ from the model's {names}")


def _stamp(path: Path, prep: PrepResult, policy: PrecisionPolicy) -> None:
    """Record the pipeline and the policy in the output's metadata (keeps other keys)."""
    model = onnx.load(str(path), load_external_data=False)
    props = {p.key: p.value for p in model.metadata_props}
    props[PIPELINE_KEY] = prep.ir.metadata_props.get(PIPELINE_KEY, prep.pipeline or "")
    props[QUANT_KEY] = json.dumps(asdict(policy), sort_keys=True)
    del model.metadata_props[:]
    for key, value in props.items():
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, str(path))
