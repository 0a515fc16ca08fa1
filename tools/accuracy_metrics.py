"""Accuracy metrics for trained models, and a probe of the activations an ONNX model carries.

Metrics (numpy only, computed in float64 so that the metric adds no error of its own):

* :func:`token_nll` / :func:`perplexity`: next-token negative log-likelihood from logits and
  labels (``labels[..., i]`` is the token that ``logits[..., i, :]`` should predict);
* :func:`top1_agreement`: how often a run's argmax equals a reference run's argmax — the
  metric that says whether greedy decoding would produce the same text;
* :func:`cosine_rows` and :func:`mean_pool`: sentence-embedding comparison for encoders;
* :func:`round_weights`: a model whose weights are rounded to fp16 (or another float type) while
  it still computes in fp32 — what the weights' precision alone costs.

Activation probe: :func:`norm_inputs` finds the tensors an exported normalization squares
(``Pow(x, 2)`` or ``Mul(x, x)`` feeding a ``ReduceMean``, i.e. the RMSNorm/LayerNorm
inputs = the residual stream) and :func:`activation_maxima` runs the model on onnxruntime
CPU with those tensors exposed as extra outputs.  An fp16 ``x*x`` overflows (max 65,504)
as soon as ``|x| > 255.9``, which trained LLMs exceed by far ("massive activations").
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort

FP16_MAX = 65504.0
FUSED_NORMS = ("LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization")
#: Largest |x| whose square still fits in fp16.
FP16_SQUARE_LIMIT = float(np.sqrt(FP16_MAX))


# --------------------------------------------------------------------------- metrics


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Stable log-softmax over the last axis, in float64."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def token_nll(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of each label token, shape ``labels.shape``.

    Non-finite logits (an overflowed fp16 run) give ``inf`` for the affected tokens.
    """
    logits = np.asarray(logits, dtype=np.float64)
    finite = np.isfinite(logits).all(axis=-1)
    logp = log_softmax(np.where(np.isfinite(logits), logits, 0.0))
    nll = -np.take_along_axis(logp, labels[..., None].astype(np.int64), axis=-1)[..., 0]
    return np.where(finite, nll, np.inf)


def perplexity(nll: np.ndarray) -> float:
    """exp(mean NLL) over all tokens; ``inf`` if any token's NLL is not finite."""
    mean = float(np.mean(nll))
    return float(np.exp(mean)) if np.isfinite(mean) else float("inf")


def top1_agreement(logits: np.ndarray, reference_top1: np.ndarray) -> float:
    """Fraction of positions whose argmax equals the reference argmax."""
    return float(np.mean(np.argmax(logits, axis=-1) == reference_top1))


def mean_pool(hidden: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """Mask-weighted mean over the sequence axis (sentence-transformers' pooling)."""
    mask = np.asarray(attention_mask, dtype=np.float64)[..., None]
    return (np.asarray(hidden, dtype=np.float64) * mask).sum(axis=-2) / np.maximum(mask.sum(axis=-2), 1e-9)


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of corresponding rows (last axis); NaN/inf rows give NaN."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    den = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (a * b).sum(axis=-1) / den


def round_weights(model: onnx.ModelProto, dtype: type = np.float16) -> onnx.ModelProto:
    """``model`` (changed in place) with every float32 weight — initializer of at least one
    dimension — rounded to ``dtype`` and stored back as float32: the graph still computes in fp32,
    on weights of ``dtype``'s precision.  Scalar constants (an epsilon, a mask's fill value of
    float32's minimum, which fp16 cannot hold) are left as they are."""
    for init in model.graph.initializer:
        if init.data_type == onnx.TensorProto.FLOAT and init.dims:
            rounded = onnx.numpy_helper.to_array(init).astype(dtype).astype(np.float32)
            init.CopyFrom(onnx.numpy_helper.from_array(rounded, init.name))
    return model


# --------------------------------------------------------------------------- activations


def _constant_scalars(model: onnx.ModelProto) -> dict[str, float]:
    """Scalar values of initializers and Constant nodes, by tensor name."""
    values: dict[str, float] = {}
    for init in model.graph.initializer:
        if int(np.prod(init.dims)) == 1 and init.data_location != onnx.TensorProto.EXTERNAL:
            values[init.name] = float(onnx.numpy_helper.to_array(init).reshape(()))
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            arr = onnx.numpy_helper.to_array(node.attribute[0].t)
            if arr.size == 1:
                values[node.output[0]] = float(arr.reshape(()))
    return values


def _squares(node: onnx.NodeProto, scalars: dict[str, float]) -> bool:
    """``Pow(x, 2)`` or ``Mul(x, x)``."""
    if node.op_type == "Pow":
        return scalars.get(node.input[1]) == 2.0
    return node.op_type == "Mul" and node.input[0] == node.input[1]


def norm_inputs(model: onnx.ModelProto) -> list[str]:
    """Tensors squared on the way into a ReduceMean — the inputs of exported RMSNorm /
    LayerNorm (``Pow(x, 2)`` or ``Mul(x, x)``), plus the first input of fused
    normalization ops.  In graph order, without duplicates."""
    scalars = _constant_scalars(model)
    consumers: dict[str, list[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node.op_type)
    found: list[str] = []
    for node in model.graph.node:
        squared_into_mean = _squares(node, scalars) and "ReduceMean" in consumers.get(node.output[0], [])
        if node.op_type in FUSED_NORMS or squared_into_mean:
            found.append(node.input[0])
    return list(dict.fromkeys(found))


@dataclass
class ActivationStat:
    """Largest |value| of one tensor over all probed inputs, and where it sits."""

    tensor: str
    max_abs: float
    position: int  # sequence index of the maximum
    channel: int  # last-axis index of the maximum

    @property
    def overflows_fp16_square(self) -> bool:
        return self.max_abs > FP16_SQUARE_LIMIT


def with_extra_outputs(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """A copy of ``model`` that also outputs ``names`` (float32; shapes left to the runtime)."""
    extra = onnx.ModelProto()
    extra.CopyFrom(model)
    present = {o.name for o in extra.graph.output}
    for name in names:
        if name not in present:
            extra.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    return extra


def activation_maxima(model_path: str | os.PathLike, feeds: Iterable[dict[str, np.ndarray]]) -> list[ActivationStat]:
    """Max |x| of every normalization input (:func:`norm_inputs`) over ``feeds``, on CPU.

    The model (with its external data) is loaded into memory, so it must stay < 2 GB.
    """
    model = onnx.load(os.fspath(model_path))
    names = norm_inputs(model)
    session = ort.InferenceSession(with_extra_outputs(model, names).SerializeToString(), providers=["CPUExecutionProvider"])
    del model
    best = {n: ActivationStat(n, -1.0, -1, -1) for n in names}
    for feed in feeds:
        for name, value in zip(names, session.run(names, feed)):
            flat = np.abs(value.reshape(-1, value.shape[-1]))
            idx = int(np.argmax(flat))
            if flat.flat[idx] > best[name].max_abs:
                row, channel = divmod(idx, flat.shape[-1])
                best[name] = ActivationStat(name, float(flat.flat[idx]), row % value.shape[-2], channel)
    return list(best.values())
