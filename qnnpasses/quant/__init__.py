"""Quantization for the QNN HTP: calibration data, the mixed-precision policy, the quantize driver,
accuracy on the real backend, the precision sweep and the converter's overrides file.

``qnnpasses quantize`` and ``qnnpasses sweep`` are the command-line entry points; the modules:

* :mod:`~qnnpasses.quant.calibration` -- samples from .npz/.npy/folders/input_list.txt, streamed;
* :mod:`~qnnpasses.quant.data` -- seeded token windows for models without a dataset;
* :mod:`~qnnpasses.quant.policy` -- which tensors get 16 bit, per-channel weights, KV width;
* :mod:`~qnnpasses.quant.driver` -- htp-llm + quantization-prep passes + onnxruntime's QNN recipe;
* :mod:`~qnnpasses.quant.evaluate` -- fp32 on CPU vs QDQ on the HTP: cosine, top-1, perplexity;
* :mod:`~qnnpasses.quant.sweep` -- the precision grid, scored on the HTP;
* :mod:`~qnnpasses.quant.overrides` -- AIMET encodings for ``qnn-onnx-converter --quantization_overrides``.
"""
