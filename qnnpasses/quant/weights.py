"""Weight scales chosen for accuracy, after onnxruntime's quantizer: MSE-optimal clipping and blocks.

onnxruntime's quantizer sets a symmetric weight scale from ``max|w|`` of each output channel.
At 4 bit that wastes the grid on one outlier weight: the MSE-optimal scale clips it.
:func:`refine_weights` rewrites every per-channel weight ``DequantizeLinear`` of a QDQ model
in place of the quantizer's values:

* ``mse``: per output channel (or per block), the clip ratio ``α`` in ``[0.5, 1]``
  (:mod:`qnnpasses.quant.scales`) minimizing ``Σ (w - s·clip(round(w/s)))²`` with
  ``s = α·max|w| / qmax`` (CPU, vectorized over channels; a few seconds for a 135M-parameter model);
* ``block_size=B``: an int4 weight ``W[K, N]`` gets one scale per ``B`` rows of each column
  (``DequantizeLinear(axis=0, block_size=B)``, scale ``[K/B, N]``, opset 21) when ``K`` is a
  multiple of ``B``; others keep per-channel scales and are reported as such.

The float weights come from the float model that was quantized (same initializer names).
Only weights of MatMul/Gemm without a bias input are touched (a bias would be int32 at
``s_x·s_w`` and would have to follow).

``gptq``: the same grids (per-channel scales chosen the same way; a block's scale from its
rows as GPTQ has updated them, except in act-order), rounded by GPTQ
(:mod:`qnnpasses.quant.gptq`) instead of to nearest; the report then carries GPTQ's output
error on the calibration inputs over round-to-nearest's (``output_error_gptq_over_nearest``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qnnpasses.ir.model import INLINE_LIMIT_BYTES, keeps_external_data, save_proto
from qnnpasses.quant.gptq import GptqConfig, column_slices, gptq_round, weight_hessians, weighted_error
from qnnpasses.quant.scales import rounding_error, search_scales

_QMAX = {TensorProto.INT4: 7, TensorProto.INT8: 127, TensorProto.INT16: 32767}
_NUMPY = {TensorProto.INT4: ml_dtypes.int4, TensorProto.INT8: np.int8, TensorProto.INT16: np.int16}


@dataclass
class RefineReport:
    refined: int = 0
    blocked: int = 0
    not_blockable: list[str] = field(default_factory=list)  # per-channel kept (K not a multiple of B)
    mse_gain: float = 1.0  # total squared error after / before
    rounding: str = "nearest"
    gptq: int = 0  # weights rounded by GPTQ
    reused: int = 0  # of which found rounded by another graph (GptqConfig.cache)
    #: GPTQ's calibration output error Σ||X·(W - Ŵ)||² over round-to-nearest's on the same grid
    output_error_gain: float | None = None
    hessian_seconds: float = 0.0
    gptq_seconds: float = 0.0

    def as_dict(self) -> dict:
        out = {"refined": self.refined, "blocked": self.blocked, "not_blockable": self.not_blockable,
               "mse_after_over_before": round(self.mse_gain, 4), "rounding": self.rounding}
        if self.gptq:
            out.update(gptq=self.gptq, gptq_reused=self.reused,
                       output_error_gptq_over_nearest=round(self.output_error_gain, 4),
                       hessian_seconds=round(self.hessian_seconds, 1), gptq_seconds=round(self.gptq_seconds, 1))
        return out


def quantize_weight(w: np.ndarray, axis: int, dtype: int, *, mse: bool, block_size: int | None):
    """(quantized, scale, axis, block) for a 2-D weight; ``block`` is 0 when per-channel."""
    qmax = _QMAX[dtype]
    wt = np.moveaxis(w.astype(np.float64), axis, 1)  # [K, N]: N output channels
    k, n = wt.shape
    if block_size and k % block_size == 0 and k > block_size:
        groups = wt.reshape(k // block_size, block_size, n).transpose(1, 0, 2).reshape(block_size, -1)
        s, e = search_scales(groups, qmax, mse)
        scale = s.reshape(k // block_size, n)
        full = np.repeat(scale, block_size, axis=0)
        q = np.clip(np.rint(wt / full), -qmax - 1, qmax)
        return q, scale, 0 if axis == 1 else 1, block_size, e.sum()
    s, e = search_scales(wt, qmax, mse)
    q = np.clip(np.rint(wt / s), -qmax - 1, qmax)
    return np.moveaxis(q, 1, axis), s, axis, 0, e.sum()


def refine_weights(qdq_path: str | Path, float_model: str | Path, *, mse: bool = True,
                   block_size: int | None = None, gptq: GptqConfig | None = None) -> RefineReport:
    """Rewrite the per-channel weight encodings of ``qdq_path`` (in place); see the module docs.

    ``gptq``: round with GPTQ (:mod:`qnnpasses.quant.gptq`) on the same grid instead of to nearest.
    """
    external = keeps_external_data(qdq_path)
    model = onnx.load(str(qdq_path))
    floats = onnx.load(str(float_model), load_external_data=False)
    float_inits = {i.name: i for i in floats.graph.initializer}
    base = Path(float_model).parent
    inits = {i.name: i for i in model.graph.initializer}
    readers = {}
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, i))
    jobs: dict[str, tuple] = {}  # float weight name -> (DequantizeLinear, axis)
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] not in inits or len(node.input) < 3:
            continue
        qinit, sinit = inits[node.input[0]], inits.get(node.input[1])
        zinit = inits.get(node.input[2])
        axis = next((a.i for a in node.attribute if a.name == "axis"), None)
        users = readers.get(node.output[0], [])
        if sinit is None or zinit is None or axis is None or len(sinit.dims) != 1 or qinit.data_type not in _QMAX \
                or len(qinit.dims) != 2 or not users \
                or any(u.op_type not in ("MatMul", "Gemm") or i != 1 or len(u.input) > 2 for u, i in users):
            continue
        fname = node.input[0].removesuffix("_quantized")
        if fname in float_inits:
            jobs[fname] = (node, axis)
    report = RefineReport(rounding="gptq" + ("-act" if gptq and gptq.act_order else "") if gptq else "nearest")
    totals = {"before": 0.0, "after": 0.0, "out_nearest": 0.0, "out_gptq": 0.0}

    def weight(fname: str) -> tuple[np.ndarray, int, int]:
        """The float weight as ``[K, N]`` (a view), its integer type and block size (0: per channel)."""
        node, axis = jobs[fname]
        dtype = inits[node.input[0]].data_type
        wt = np.moveaxis(numpy_helper.to_array(float_inits[fname], base_dir=str(base)).astype(np.float32, copy=False),
                         axis, 1)
        blocks = block_size if dtype == TensorProto.INT4 else None  # 8-bit weights stay per channel
        return wt, dtype, blocks if blocks and wt.shape[0] % blocks == 0 and wt.shape[0] > blocks else 0

    def rounded(fname: str, wt: np.ndarray, dtype: int, block: int, h: np.ndarray | None):
        """(``q[K, N]``, scales, error figures): to nearest, or by GPTQ with Hessian ``h``; column slices at a time."""
        qmax = _QMAX[dtype]
        k, n = wt.shape
        old_s = numpy_helper.to_array(inits[jobs[fname][0].input[1]]).astype(np.float64)
        figures = dict.fromkeys(totals, 0.0)
        q = np.empty((k, n), dtype=np.int8 if qmax <= 127 else np.int16)
        scales = np.empty((k // block, n) if block else (n,), dtype=np.float32)
        for cols in column_slices((k, n)):
            wc = wt[:, cols].astype(np.float64)
            figures["before"] += float(rounding_error(wc, old_s[cols], qmax).sum())
            qc, sc, _, _, err = quantize_weight(wc, 1, dtype, mse=mse, block_size=block or None)
            q[:, cols], scales[..., cols] = qc, sc
            if h is None:
                figures["after"] += float(err)
            else:
                figures["out_nearest"] += weighted_error(wc, _dequantized(qc, sc, block), h)
        if h is not None:
            q, scales = gptq_round(wt, h, qmax, block_size=block or None, mse=mse, act_order=gptq.act_order,
                                   damp=gptq.damp)
            for cols in column_slices((k, n)):
                wc, got = wt[:, cols].astype(np.float64), _dequantized(q[:, cols], scales[..., cols], block)
                figures["out_gptq"] += weighted_error(wc, got, h)
                figures["after"] += float(((wc - got) ** 2).sum())
        return q, scales, figures

    def write(fname: str, q: np.ndarray, scales: np.ndarray, block: int, figures: dict[str, float]) -> None:
        """Store ``q[K, N]`` and its scales in the weight's own layout, with zero points and axis."""
        node, axis = jobs.pop(fname)
        qinit, sinit, zinit = inits[node.input[0]], inits[node.input[1]], inits[node.input[2]]
        if block_size and qinit.data_type == TensorProto.INT4 and not block:
            report.not_blockable.append(fname)
        for key, value in figures.items():
            totals[key] += value
        if block:  # blocks were cut in [K, N] coordinates: back to the weight's layout
            q, scales, new_axis = (q, scales, 0) if axis == 1 else (q.T, scales.T, 1)
        else:
            q, new_axis = np.moveaxis(q, 1, axis), axis
        npdt = _NUMPY[qinit.data_type]
        qinit.CopyFrom(numpy_helper.from_array(q.astype(npdt), qinit.name))
        sinit.CopyFrom(numpy_helper.from_array(scales.astype(np.float32), sinit.name))
        zinit.CopyFrom(numpy_helper.from_array(np.zeros(scales.shape, dtype=np.int32).astype(npdt), zinit.name))
        for a in node.attribute:
            if a.name == "axis":
                a.i = new_axis
        if block:
            node.attribute.append(helper.make_attribute("block_size", block))
            report.blocked += 1
        report.refined += 1

    def cache_key(fname: str, wt: np.ndarray, dtype: int, block: int) -> str:
        return gptq.cache.key(fname, wt, dtype=dtype, block=block, mse=mse, act_order=gptq.act_order,
                              damp=gptq.damp, source=str(gptq.source))

    def refine(fname: str, h: np.ndarray | None) -> None:
        wt, dtype, block = weight(fname)
        key = cache_key(fname, wt, dtype, block) if h is not None and gptq.cache is not None else None
        q, scales, figures = rounded(fname, wt, dtype, block, h)
        if key is not None:
            gptq.cache.put(key, q, scales, figures)
        report.gptq += h is not None
        write(fname, q, scales, block, figures)

    if gptq is not None:
        from qnnpasses.progress import step

        if gptq.cache is not None and any(gptq.cache.folder.iterdir()):  # rounded for another graph already
            for fname in list(jobs):
                wt, dtype, block = weight(fname)
                found = gptq.cache.get(cache_key(fname, wt, dtype, block))
                if found is not None:
                    report.gptq += 1
                    report.reused += 1
                    write(fname, *found[:2], block, found[2])
        step(f"GPTQ: collecting input Hessians of {len(jobs)} weight(s) on {len(gptq.calib)} sample(s)")
        for chunk in weight_hessians(gptq, float_model, set(jobs)):
            report.hessian_seconds += chunk.seconds
            start = time.monotonic()
            for fname, h in chunk.hessians.items():
                if fname in jobs:
                    refine(fname, h)
            report.gptq_seconds += time.monotonic() - start
    for fname in list(jobs):  # no calibration input found (or nearest rounding)
        refine(fname, None)
    report.mse_gain = totals["after"] / totals["before"] if totals["before"] else 1.0
    if totals["out_nearest"]:
        report.output_error_gain = totals["out_gptq"] / totals["out_nearest"]
    # the weights stay where the quantizer put them: a session maps an external file, but copies
    # an inline one (twice while the protobuf is parsed)
    save_proto(model, qdq_path, external_data=external or model.ByteSize() > INLINE_LIMIT_BYTES)
    return report


def _dequantized(q: np.ndarray, scales: np.ndarray, block: int) -> np.ndarray:
    """``q·scale`` in float64, a block's scale repeated over its rows."""
    scales = scales.astype(np.float64)
    return q * (np.repeat(scales, block, axis=0) if block else scales)
