"""Activation ranges: the min and max of every float activation over the calibration data.

What onnxruntime's MinMax calibrator computes (the same tensors: every float input or output
of a node that is not a weight; the same figures: ``ReduceMin`` / ``ReduceMax`` of each over
each sample, the least and the greatest over the samples), in bounded memory:

* the weights stay where they are: the model with its reduce nodes is handed to onnxruntime as
  bytes that point at the original weight file, mapped, never packed into private copies
  (onnxruntime's calibrator loads the model with every weight, writes it out again and builds
  a session that copies them once more);
* activations are given back as soon as their reductions ran: the reductions follow their
  tensors in the node order, which onnxruntime then keeps (its priority-based order; its
  default runs the whole model before the first reduction, so every activation lives to the
  end of the call), and no memory arena keeps the freed blocks.  At context 4096 one prefill
  call's attention scores are tens of megabytes per layer; what the build holds is in
  docs/bench_sizes.md.

:func:`tensors_data` hands the ranges to onnxruntime's quantizer as its own ``TensorsData``, so
``quantize_static`` does not calibrate again.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from qnnpasses.quant.calibration import CalibrationData

FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16)
_MIN, _MAX = "ReduceMin", "ReduceMax"


def calibrated_tensors(model: onnx.ModelProto) -> dict[str, int]:
    """The tensors onnxruntime's calibrator calibrates, with their element types: float node inputs
    and outputs, not weights (types from shape inference, which reads no weight data)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {vi.name: vi.type.tensor_type.elem_type
             for vi in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
             if vi.type.HasField("tensor_type")}
    weights = {i.name for i in model.graph.initializer}
    return {t: types[t] for node in model.graph.node for t in [*node.input, *node.output]
            if t and t not in weights and types.get(t) in FLOATS}


def _with_reductions(model: onnx.ModelProto, tensors: dict[str, int]) -> onnx.ModelProto:
    """``model`` with a ReduceMin and a ReduceMax of each of ``tensors`` as extra outputs, each pair
    placed right after the tensor's producer (so no activation lives longer than it did).
    ``keepdims=1`` as onnxruntime's calibrator: a reduction over an empty axis then still runs."""
    nodes, added = [], []

    def reduce(tensor: str) -> None:
        for op in (_MIN, _MAX):
            out = f"{tensor}_{op}"
            nodes.append(helper.make_node(op, [tensor], [out], name=out, keepdims=1))
            added.append(helper.make_tensor_value_info(out, tensors[tensor], None))

    for graph_input in model.graph.input:
        if graph_input.name in tensors:
            reduce(graph_input.name)
    for node in model.graph.node:
        nodes.append(node)
        for out in node.output:
            if out in tensors:
                reduce(out)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    out.graph.output.extend(added)
    return out


def _scalars(values: list[np.ndarray]) -> np.ndarray:
    """One float64 per reduction (NaN for a tensor with no elements)."""
    return np.array([float(v.reshape(-1)[0]) if v.size else np.nan for v in values], np.float64)


def calibrate_ranges(model_path: str | Path, calib: CalibrationData,
                     limit: int | None = None) -> dict[str, tuple[float, float]]:
    """``{tensor: (min, max)}`` of every float activation of the model at ``model_path`` over the
    first ``limit`` samples of ``calib`` (all by default); see the module docs."""
    import onnxruntime as ort

    path = Path(model_path).resolve()
    model = onnx.load(str(path), load_external_data=False)  # the weights stay in their file
    tensors = calibrated_tensors(model)
    names = list(tensors)
    augmented = _with_reductions(model, tensors).SerializeToString()
    del model
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.enable_cpu_mem_arena = False
    # in the default order onnxruntime runs every node of the model before the first reduction (a
    # depth-first walk from the outputs, the model's own first), so every activation lives to the end
    options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    options.log_severity_level = 3
    options.add_session_config_entry("session.disable_prepacking", "1")
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
    session = ort.InferenceSession(augmented, options, providers=["CPUExecutionProvider"])
    outputs = [f"{n}_{op}" for n in names for op in (_MIN, _MAX)]
    inputs = {i.name for i in session.get_inputs()}
    lows = np.full(len(names), np.inf)
    highs = np.full(len(names), -np.inf)
    for sample in calib.reader(limit):
        values = session.run(outputs, {k: v for k, v in sample.items() if k in inputs})
        lows = np.fmin(lows, _scalars(values[0::2]))  # NaN-skipping, as onnxruntime's nanmin
        highs = np.fmax(highs, _scalars(values[1::2]))
    return {n: (float(lo), float(hi)) for n, lo, hi in zip(names, lows, highs)}


def tensors_data(ranges: dict[str, tuple[float, float]]):
    """``ranges`` as onnxruntime's MinMax ``TensorsData`` (float32, as its calibrator gives them)."""
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorsData

    return TensorsData(CalibrationMethod.MinMax, {
        name: (np.array(lo, np.float32), np.array(hi, np.float32)) for name, (lo, hi) in ranges.items()})
