"""Measuring a model under rewrite on calibration data, for passes whose decision depends on
real value ranges (fp16-safety's overflow risk, quant-mask's score spread).

``calibration_samples`` takes samples from the pass context; ``intermediate_values`` runs a
copy of the graph on onnxruntime CPU with the named tensors as extra outputs (the model
itself is never touched).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import PassContext


def calibration_samples(ctx: PassContext, limit: int) -> list[dict[str, np.ndarray]]:
    """Up to ``limit`` input dicts from ``ctx.calibration``, keeping a one-shot iterable reusable."""
    if ctx.calibration is None:
        return []
    if not isinstance(ctx.calibration, (list, tuple)):
        ctx.calibration = list(ctx.calibration)  # later passes must still see every sample
    return list(ctx.calibration[:limit])


def intermediate_values(ir: IRModel, names: Iterable[str],
                        samples: list[dict[str, np.ndarray]]) -> Iterator[dict[str, np.ndarray]]:
    """Per sample, the values of the named tensors that exist and have a known dtype."""
    from qnnpasses.backends.cpu import run_cpu_each

    probe = ir.copy()
    tensors = probe.graph.tensors()
    wanted = [tensors[n] for n in dict.fromkeys(names) if n in tensors and tensors[n].dtype is not None]
    probe.graph.outputs = list(probe.graph.outputs) + [t for t in wanted if t not in probe.graph.outputs]
    # one session for all samples: building one per sample re-serialized the whole model each time
    # (seconds per sample for a 135M-parameter LLM); each sample's values handed over as they come
    for outputs in run_cpu_each(probe, list(samples)):
        yield {t.name: outputs[t.name] for t in wanted}
