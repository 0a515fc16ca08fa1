"""Quantization for the QNN HTP: calibration data, the mixed-precision policy, the quantize driver,
accuracy on the real backend, the precision sweep and the converter's overrides file.

``qnnpasses quantize`` and ``qnnpasses sweep`` are the command-line entry points.  From Python,
one graph::

    from qnnpasses.quant import precision_policy, quantize_model
    quantize_model("model.onnx", "calib.npz", "model.qdq.onnx", precision_policy("w4a16"))

and several graphs with ONE calibration plan (an LLM's prefill/decode pair: shared weights,
and the prefill's ``present.*`` outputs become the decode's ``past_key_values.*`` inputs, so
they must share encodings)::

    from qnnpasses.quant import quantize_graphs
    result = quantize_graphs({"prefill": "prefill.onnx", "decode": "decode.onnx"},
                             calib={"prefill": "prefill_calib.npz", "decode": "decode_calib.npz"},
                             outputs={"prefill": "out/prefill.qdq.onnx", "decode": "out/decode.qdq.onnx"},
                             precision="w4a16",  # or "w8a16"; policy=PrecisionPolicy(...) for anything else
                             ties={"present.0.key": "past_key_values.0.key", ...})
    result.results["decode"].output, result.shared_tensors

The modules:

* :mod:`~qnnpasses.quant.calibration` -- samples from .npz/.npy/folders/input_list.txt, streamed;
* :mod:`~qnnpasses.quant.data` -- seeded token windows for models without a dataset;
* :mod:`~qnnpasses.quant.policy` -- which tensors get 16 bit, per-channel weights, int4, KV width;
* :mod:`~qnnpasses.quant.driver` -- htp-llm + quantization-prep + outlier rewrites + onnxruntime's QNN recipe;
* :mod:`~qnnpasses.quant.weights` -- MSE-optimal weight scales and block-wise int4, after the recipe;
* :mod:`~qnnpasses.quant.gptq` -- GPTQ rounding on those grids from the layers' calibration inputs;
* :mod:`~qnnpasses.quant.shared` -- several graphs, one calibration plan; the named precisions;
* :mod:`~qnnpasses.quant.sensitivity` -- per-layer SQNR, raising the weakest layers until a target;
* :mod:`~qnnpasses.quant.evaluate` -- fp32 on CPU vs QDQ on the HTP: cosine, top-1, perplexity;
* :mod:`~qnnpasses.quant.sweep` -- the precision grid, scored on the HTP;
* :mod:`~qnnpasses.quant.overrides` -- AIMET encodings for ``qnn-onnx-converter --quantization_overrides``.
"""

import importlib

# Imported on first use (PEP 562): ``qnnpasses.quant.policy`` is read by the CLI's argument
# parser, and onnxruntime's quantization tooling (seconds to import) must not come with it.
_LAZY = {"QuantizeResult": "driver", "quantize_model": "driver", "PrecisionPolicy": "policy",
         "PRECISIONS": "shared", "SharedResult": "shared", "precision_policy": "shared", "quantize_graphs": "shared"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"qnnpasses.quant.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'qnnpasses.quant' has no attribute '{name}'")


__all__ = ["PRECISIONS", "PrecisionPolicy", "QuantizeResult", "SharedResult", "precision_policy", "quantize_graphs",
           "quantize_model"]
