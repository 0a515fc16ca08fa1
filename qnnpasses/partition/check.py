"""Proof of equivalence: run the partitions in plan order and compare with the original.

Tensors pass between sub-models by name.  CPU partitions run on onnxruntime's CPU
provider with graph optimizations off (exactly what the graph says), so an all-CPU chain
must reproduce the original to float rounding.  HTP partitions run on the real QNN HTP
backend in fp16 (when ``on="htp"`` and the backend is available), so that chain is held to
the fp16 tolerance of :data:`qnnpasses.debug.compare.TOLERANCES`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qnnpasses.backends.cpu import compare_outputs, run_cpu

#: (atol, rtol, min_cosine) of the chained outputs by where HTP partitions ran.
CHAIN_TOLERANCES = {"cpu": (1e-5, 1e-5, 0.99999), "htp": (1e-2, 1e-2, 0.999)}


@dataclass
class ChainResult:
    on: str                                   # where HTP partitions ran: "htp" or "cpu"
    outputs: dict[str, dict[str, Any]]        # per model output: max_abs, cosine, ok
    ran: list[dict[str, Any]] = field(default_factory=list)   # per partition: id, backend, ran_on
    ok: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"on": self.on, "ok": self.ok, "outputs": self.outputs, "partitions": self.ran}


def run_chain(plan, out_dir: str | Path, inputs: dict[str, np.ndarray], *, on: str = "htp") -> dict[str, np.ndarray]:
    """Run every partition in order; returns every tensor computed (model outputs included)."""
    env = dict(inputs)
    for part in plan.partitions:
        feeds = {name: env[name] for name in part.inputs}
        path = Path(out_dir) / part.file
        if part.backend == "htp" and on == "htp":
            from qnnpasses.backends.htp import run_on_htp

            outputs = run_on_htp(str(path), feeds)
        else:
            outputs = run_cpu(path, feeds)
        env.update(outputs)
    return env


def check_plan(plan, out_dir: str | Path, model_path: str | Path, inputs: dict[str, np.ndarray], *,
               on: str = "htp", reference: dict[str, np.ndarray] | None = None) -> ChainResult:
    """Chain the partitions and compare the model outputs with the original's on CPU."""
    if on == "htp":
        from qnnpasses.backends.htp import htp_available

        if not htp_available():
            on = "cpu"
    reference = reference if reference is not None else run_cpu(model_path, inputs)
    env = run_chain(plan, out_dir, inputs, on=on)
    atol, rtol, min_cos = CHAIN_TOLERANCES["htp" if on == "htp" and plan.counts().get("htp") else "cpu"]
    comparison = compare_outputs(reference, {k: env[k] for k in reference if k in env},
                                 atol=atol, rtol=rtol, min_cosine=min_cos)
    outputs = {d.name: {"max_abs": d.max_abs, "cosine": d.cosine, "ok": d.ok, "reason": d.reason}
               for d in comparison.outputs}
    ran = [{"id": p.id, "backend": p.backend, "ran_on": "htp" if p.backend == "htp" and on == "htp" else "cpu"}
           for p in plan.partitions]
    return ChainResult(on, outputs, ran, all(d.ok for d in comparison.outputs))


__all__ = ["CHAIN_TOLERANCES", "ChainResult", "check_plan", "run_chain"]
