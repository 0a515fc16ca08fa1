"""onnxruntime's ``quantize_static`` reading each float weight when it quantizes it.

``quantize_static`` loads the model with every external weight (``onnx.load``), builds the
quantized copy of each weight beside it, and drops the float ones only when it saves: on a 0.5 B
decoder at context 4096 that held 3.9 GiB, the build's largest stage.  Inside
:func:`weights_on_demand` the quantizer loads the graph without the external data, each
``onnx.numpy_helper.to_array`` of an external tensor reads the tensor's bytes from its file into
a fresh array (the proto keeps only the reference, so the bytes are freed once quantized), and
before the result is written the tensors still referring to the float model's file (those it did
not quantize) are read into it, as the quantizer would have had them.

Why that is safe: the quantizer sees the same values (read from the same bytes) in the same
order; only when they are in memory changes.  ``tests/test_quantize.py`` checks that the QDQ model
written this way is byte for byte the one written with every weight loaded.  The patches hold
only inside the ``with`` block, on this thread's call (the build runs one quantizer at a time).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from pathlib import Path

import onnx
from onnx import numpy_helper
from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data


@contextlib.contextmanager
def weights_on_demand(folder: str | Path) -> Iterator[None]:
    """Inside the block, ``quantize_static`` on a model in ``folder`` (its external data beside it)
    reads each weight when it uses it (module docs)."""
    # by module path: the package's ``quantize`` attribute is a function of that name
    onnx_model, quant_utils, quantize = (importlib.import_module(f"onnxruntime.quantization.{name}")
                                         for name in ("onnx_model", "quant_utils", "quantize"))
    folder = str(folder)
    to_array, load_with_shapes, save = numpy_helper.to_array, quantize.load_model_with_shape_infer, \
        onnx_model.ONNXModel.save_model_to_file

    def read(tensor: onnx.TensorProto, base_dir: str = "") -> object:
        if uses_external_data(tensor) and not tensor.HasField("raw_data"):
            fresh = onnx.TensorProto()
            fresh.CopyFrom(tensor)
            load_external_data_for_tensor(fresh, base_dir or folder)
            return to_array(fresh)
        return to_array(tensor, base_dir)

    def load(model_path: Path) -> onnx.ModelProto:
        inferred = quant_utils.generate_identified_filename(Path(model_path), "-inferred")
        onnx.shape_inference.infer_shapes_path(str(model_path), str(inferred))
        model = onnx.load(str(inferred), load_external_data=False)
        quant_utils.add_infer_metadata(model)
        inferred.unlink()
        return model

    def save_loaded(self, output_path, use_external_data_format=False):
        for tensor in self.model.graph.initializer:
            if uses_external_data(tensor) and not tensor.HasField("raw_data"):
                load_external_data_for_tensor(tensor, folder)
                tensor.data_location = onnx.TensorProto.DEFAULT
                del tensor.external_data[:]
        return save(self, output_path, use_external_data_format)

    numpy_helper.to_array, quantize.load_model_with_shape_infer = read, load
    onnx_model.ONNXModel.save_model_to_file = save_loaded
    try:
        yield
    finally:
        numpy_helper.to_array, quantize.load_model_with_shape_infer = to_array, load_with_shapes
        onnx_model.ONNXModel.save_model_to_file = save
