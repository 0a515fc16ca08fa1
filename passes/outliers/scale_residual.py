"""scale-residual: carry a residual stream that outgrows fp16 at a power-of-two smaller scale.

Matches the residual stream of a pre-norm decoder (:func:`~qnnpasses.passes.outliers._stream.find_stream`
in its scaling form): the token embedding (optionally times a constant, Gemma's ``sqrt(hidden)``),
the residual ``Add``\\ s, the projections (``MatMul`` with a constant weight, optional bias) or
post-norms (normalizations with a constant scale, Gemma 2/3) whose output is added into it, and
the normalizations that read it.  It measures the stream's largest magnitude on calibration
samples (``ctx.calibration``) or, without them, on seeded inputs, and acts only when that
exceeds ``limit``: with ``k`` the smallest shift that brings it under ``limit`` (or the ``shift``
given, as the second graph of a pair is given the first one's), it produces

* every writer scaled by ``2^-k``: the embedding's constant factor (else a new ``Mul`` after the
  embedding ``Gather``, whose table the lm_head may share), each projection's weight and bias,
  each post-norm's scale and bias;
* every reading normalization's ``epsilon`` times ``4^-k``.

Why it is safe: a normalization of ``x·s`` with ``epsilon·s²`` computes exactly what it computed
of ``x`` with ``epsilon`` (``RMSNorm``: ``x·s / sqrt(mean(x²)·s² + eps·s²)``; ``LayerNorm``
alike, the mean scales with ``x``), and nothing else reads the stream.  Scaling by a power of two
is exact in binary floating point (barring subnormals), so the fp32 function is unchanged bit for
bit.  What it is for: trained models with post-norms carry ``|h|`` near or past fp16's 65,504
(measured on Gemma 3 270M: one channel reaches 9e4 in its middle layers), which the HTP's fp16
saturates; at ``2^-k`` the same values keep fp16's full relative resolution with headroom.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import numpy as np
from qnnpasses.passes.outliers._stream import find_stream

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import (
    EXACT,
    NORMS_FUSED,
    Pass,
    PassContext,
    PassResult,
    register_pass,
)
from qnnpasses.passmanager.probe import calibration_samples, intermediate_values
from qnnpasses.passmanager.rewrite import constant_value, derived_constant, finish, make_constant, make_node

#: fp16's largest finite value
FP16_MAX = 65504.0


def _times(values: np.ndarray, factor: float) -> np.ndarray:
    """``values·factor`` in their own dtype (a power of two: exact)."""
    return values * values.dtype.type(factor)


@register_pass
class ScaleResidual(Pass):
    name = "scale-residual"
    summary = "residual stream h -> h·2^-k (writers scaled, readers' epsilon·4^-k) where max|h| nears fp16's range"
    contract = EXACT
    requires = frozenset({NORMS_FUSED})
    ensures = frozenset()

    @dataclass
    class Options:
        limit: float = field(default=FP16_MAX / 4, metadata={"help": "largest |h| kept (a quarter of fp16's "
                                                                        "range: headroom for unseen inputs)"})
        max_samples: int = field(default=4, metadata={"help": "calibration samples (or seeded inputs) to measure"})
        shift: int = field(default=-1, metadata={"help": "k to apply without measuring (-1: measure; the "
                                                          "graphs of a pair share their weights, so one k)"})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        stream, why = find_stream(ir.graph, scaling=True)
        if stream is None:
            return PassResult(changed=False, stats={"scaled": 0}, notes=[why] if ctx.verbose else [])
        if self.options.shift >= 0:
            shift, stats = self.options.shift, {"scaled": 0, "given_shift": self.options.shift}
        else:
            peak = self._peak(ir, ctx, stream.tensors)
            stats = {"scaled": 0, "stream_max_abs": round(peak, 1)}
            if not math.isfinite(peak):
                return PassResult(changed=False, stats=stats, notes=["the stream is not finite on the measured inputs"])
            shift = math.ceil(math.log2(peak / self.options.limit)) if peak > self.options.limit else 0
        if shift == 0:
            return PassResult(changed=False, stats=stats)
        scale = 2.0 ** -shift
        self._scale_writers(ir, ctx, stream, scale)
        for norm in stream.norms:
            norm.attrs["epsilon"] = float(norm.attrs.get("epsilon", 1e-5)) * scale * scale
        finish(ir)
        stats.update(scaled=1, shift=shift, writers=len(stream.writers) + len(stream.norm_writers),
                     norms=len(stream.norms))
        return PassResult(changed=True, stats=stats)

    def _peak(self, ir: IRModel, ctx: PassContext, names: list[str]) -> float:
        """Largest |h| over the stream's tensors, on calibration samples or seeded inputs."""
        samples = calibration_samples(ctx, self.options.max_samples)
        if not samples:
            from qnnpasses.backends.cpu import make_inputs

            samples = [make_inputs(ir, seed) for seed in range(min(2, self.options.max_samples))]
        peak = 0.0
        for values in intermediate_values(ir, names, samples):
            for value in values.values():
                if value.size:
                    peak = max(peak, float(np.max(np.abs(value))))
        return peak

    def _scale_writers(self, ir: IRModel, ctx: PassContext, stream, scale: float) -> None:
        def scaled(node, index: int, what: str) -> None:
            # a lazy recipe of a mapped weight: a large model's writers are never all in memory
            tensor = node.inputs[index]
            node.inputs[index] = derived_constant(ir, ctx, f"{tensor.name}_{what}", tensor,
                                                  partial(_times, factor=scale), same_shape=True)

        if stream.embedding_scales:
            for node, index in stream.embedding_scales:
                scaled(node, index, "stream_scale")
        else:  # the table may also be the lm_head's: scale after the Gather
            for embed in stream.embeddings:
                out = embed.outputs[0]
                factor = make_constant(ir, ctx, "stream_scale", np.array(scale, dtype=out.dtype or np.float32))
                readers = list(out.outputs)
                mul = make_node(ir, ctx, "Mul", [out, factor], name_hint=f"{embed.name}_stream_scale",
                                dtype=out.dtype, shape=out.shape)
                for reader in readers:
                    for index, x in enumerate(reader.inputs):
                        if x is out:
                            reader.inputs[index] = mul.outputs[0]
        for node in stream.writers:
            scaled(node, 1, "stream_scale")
        for node, index in stream.biases:
            scaled(node, index, "stream_scale")
        for node in stream.norm_writers:
            for index in (1, 2):
                if index < len(node.inputs) and constant_value(node.inputs[index]) is not None:
                    scaled(node, index, "stream_scale")
