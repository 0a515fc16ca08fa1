"""What the QNN HTP runs natively, for the norm and GeLU passes (fp16 mode).

Measured with onnxruntime-qnn 2.7 (QNN 2.40, soc 60 / v73, ``enable_htp_fp16_precision``)
on one-node models, graph optimizations off (``tests/test_pass_*`` re-check the ones the
passes rely on).  To be replaced by the op-support table in ``op_support/`` once it exists.

=======================================  ==========================================
LayerNormalization (17)                  HTP ``LayerNorm``: last axis only, rank <= 4
                                         (rank 5: "incorrect Rank 5"; axis 1: "only
                                         supports normalization along the last axis")
RMSNormalization (23)                    HTP ``RmsNorm``: last axis only, rank <= 4
Gelu (20, none|tanh), com.microsoft.Gelu HTP ``Gelu``
Erf, com.microsoft.FastGelu/BiasGelu     rejected ("not supported by QNN EP")
SimplifiedLayerNormalization             ORT contrib op registered in the *default*
                                         domain: HTP ``RmsNorm`` at opset 17, but the
                                         ONNX checker rejects it (not loadable as
                                         com.microsoft) -- hence the opset raise
com.microsoft.SkipSimplifiedLayerNorm.   rejected
=======================================  ==========================================

Numerics (fp16): ``LayerNorm`` and ``RmsNorm`` stay within fp16 rounding of fp32 for
inputs with |x| = 30,000 in one channel; the decomposed ``Pow(x,2)`` forms do not.  The HTP
flushes fp16 subnormals (< 6.1e-5) to zero, e.g. ``x / 30000`` becomes 0.

The QNN EP has private fusions of its own ("GeluFusion", "LayerNormFusion" in its log) for
the exact HF Erf-GeLU and torch LayerNorm spellings only: ``(0.5*x)*(1+erf(..))``, a
LayerNorm squaring with ``Mul(d, d)``, using ``Reciprocal`` or without beta stay decomposed.
"""

from __future__ import annotations

#: Highest input rank of the HTP's LayerNorm / RmsNorm.
MAX_NORM_RANK = 4

_NATIVE_GELU = {("Gelu", ""), ("Gelu", "com.microsoft")}


def htp_runs_norm(axis: int, rank: int | None) -> bool:
    """Whether HTP LayerNorm/RmsNorm run a normalization over ``axis`` of a rank-``rank`` input.

    An ONNX axis ``k`` normalizes over dims ``k..rank-1``; the HTP only does the last one.
    """
    if rank is None:
        return False
    return 1 <= rank <= MAX_NORM_RANK and axis in (-1, rank - 1)


def htp_runs_gelu(op: str, domain: str) -> bool:
    return (op, domain or "") in _NATIVE_GELU
