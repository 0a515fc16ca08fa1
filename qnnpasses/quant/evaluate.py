"""Accuracy of a QDQ model on the deployment backend: fp32 original on CPU vs QDQ on the real HTP.

The QDQ model runs on the QNN HTP in integer precision (no fp16 flag) with
``offload_graph_io_quantization=0``, so the HTP also takes the graph's boundary
Quantize/Dequantize nodes (by default the EP leaves them to the CPU EP, which shows up as
CPU nodes); the same session is profiled, which gives its placement (QNN partitions and
CPU-EP nodes) without a second session.

Per output, over all evaluation samples: cosine and max abs error against the fp32 run.
For logits (see :func:`qnnpasses.debug.compare.is_logits`), also top-1 agreement with the fp32
argmax and the perplexity of both models on the held-out next tokens (``labels`` stored
with the data, else ``input_ids`` shifted by one).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qnnpasses.backends.cpu import cosine_similarity, run_cpu
from qnnpasses.debug.compare import align_sentinels, is_logits, vocab_size
from qnnpasses.errors import CheckFailedError
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import IRModel
from qnnpasses.quant.calibration import CalibrationData

#: Provider options for QDQ models: integer precision, boundary Q/DQ on the HTP too.
HTP_INT_OPTIONS = {"offload_graph_io_quantization": "0"}


@dataclass
class OutputScore:
    name: str
    cosine: float
    max_abs: float
    top1: float | None = None
    perplexity: float | None = None
    reference_perplexity: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class Evaluation:
    outputs: list[OutputScore]
    samples: int
    on: str
    qnn_partitions: int | None = None
    cpu_nodes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def headline(self) -> OutputScore:
        """The logits output when there is one, else the first output."""
        return next((o for o in self.outputs if o.top1 is not None), self.outputs[0])

    def as_dict(self) -> dict[str, Any]:
        return {"on": self.on, "samples": self.samples, "qnn_partitions": self.qnn_partitions,
                "cpu_nodes": self.cpu_nodes, "seconds": round(self.seconds, 2),
                "outputs": [o.as_dict() for o in self.outputs]}


def htp_int_session(model: str | os.PathLike, *, profile_dir: str | None = None):
    """A QNN HTP session for a QDQ model in integer precision (profiled when ``profile_dir`` is given),
    the model as compiling gives it to the HTP (:func:`qnnpasses.quant.norm_rounding.htp_model`)."""
    import onnxruntime as ort

    from qnnpasses.backends.htp import htp_session
    from qnnpasses.quant.norm_rounding import htp_model

    if not os.environ.get("QNNPASSES_DEBUG"):
        ort.set_default_logger_severity(3)  # the EP's per-session warnings say nothing about the model
    kw: dict[str, Any] = {}
    if profile_dir is not None:
        kw = {"profiling": True, "profile_prefix": os.path.join(profile_dir, "profile")}
    source, config, _ = htp_model(model)
    return htp_session(source, fp16=False, extra_options=HTP_INT_OPTIONS, session_config=config or None, **kw)


def next_token_nll(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of each label under ``logits`` (float64; non-finite logits give inf)."""
    x = np.asarray(logits, dtype=np.float64)
    finite = np.isfinite(x).all(axis=-1)
    x = np.where(np.isfinite(x), x, 0.0)
    x = x - x.max(axis=-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    nll = -np.take_along_axis(logp, labels[..., None].astype(np.int64), axis=-1)[..., 0]
    return np.where(finite, nll, np.inf)


def _labels(data: CalibrationData, index: int, sample: dict[str, np.ndarray], logits_shape) -> np.ndarray | None:
    """Next-token labels for a sample, shaped like the logits without the vocab axis (None: unknown)."""
    stored = data.labels(index)
    want = tuple(logits_shape[:-1])
    if stored is not None:
        return stored.reshape(want) if stored.size == int(np.prod(want)) else None
    ids = next((v for k, v in sample.items() if "input_ids" in k), None)
    if ids is None or ids.shape != want or want[-1] < 2:
        return None
    return ids[..., 1:]  # position i predicts token i+1; the last position has no label


def evaluate(original: str | os.PathLike | IRModel, quantized: str | os.PathLike, data: CalibrationData, *,
             on: str = "htp", limit: int | None = None) -> Evaluation:
    """Score ``quantized`` (on the HTP, or on CPU with ``on="cpu"``) against ``original`` on CPU over ``data``."""
    start = time.monotonic()
    ref_ir = original if isinstance(original, IRModel) else load_model(original)
    vocab = vocab_size(ref_ir)
    count = len(data) if limit is None else min(limit, len(data))
    with tempfile.TemporaryDirectory(prefix="qnnpasses-eval-") as tmp:
        session = _session(quantized, on, tmp)
        names = [o.name for o in session.get_outputs()]
        refs: dict[str, list[np.ndarray]] = {n: [] for n in names}
        gots: dict[str, list[np.ndarray]] = {n: [] for n in names}
        nll: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        for index in range(count):
            sample = data[index]
            ref = run_cpu(ref_ir, sample)
            got = dict(zip(names, session.run(names, {i.name: sample[i.name] for i in session.get_inputs()})))
            for name in names:
                refs[name].append(ref[name])
                gots[name].append(align_sentinels(ref[name], got[name]))
                if is_logits(name, ref[name], vocab):
                    labels = _labels(data, index, sample, ref[name].shape)
                    if labels is not None:
                        cut = (..., slice(0, labels.shape[-1]), slice(None))
                        nll.setdefault(name, []).append((next_token_nll(ref[name][cut], labels),
                                                         next_token_nll(got[name][cut], labels)))
        partitions, cpu_nodes = _placement(session, on)
    scores = [_score(n, refs[n], gots[n], nll.get(n), vocab) for n in names]
    return Evaluation(scores, count, on, partitions, cpu_nodes, time.monotonic() - start)


def _session(quantized, on: str, tmp: str):
    if on == "cpu":
        import onnxruntime as ort

        return ort.InferenceSession(os.fspath(quantized), providers=["CPUExecutionProvider"])
    try:
        return htp_int_session(quantized, profile_dir=tmp)
    except Exception as exc:  # noqa: BLE001 - the backend refused the graph: a finding, in one line
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckFailedError(f"the QDQ model does not run on the HTP: {text[:300]}") from None


def _placement(session, on: str) -> tuple[int | None, list[str]]:
    if on != "htp":
        return None, []
    from qnnpasses.backends.htp import parse_profile

    path = session.end_profiling()
    try:
        return parse_profile(path)
    finally:
        Path(path).unlink(missing_ok=True)


def _score(name: str, refs: list[np.ndarray], gots: list[np.ndarray], nll, vocab: int | None) -> OutputScore:
    ref = np.concatenate([r.ravel() for r in refs]).astype(np.float64)
    got = np.concatenate([g.ravel() for g in gots]).astype(np.float64)
    finite = np.isfinite(ref)
    max_abs = float(np.max(np.abs(ref[finite] - got[finite]))) if finite.any() else 0.0
    score = OutputScore(name, cosine_similarity(ref[finite], got[finite]), max_abs)
    if is_logits(name, refs[0], vocab):
        score.top1 = float(np.mean(np.concatenate([(r.argmax(-1) == g.argmax(-1)).ravel() for r, g in zip(refs, gots)])))
    if nll:
        score.reference_perplexity = float(np.exp(np.mean(np.concatenate([a.ravel() for a, _ in nll]))))
        score.perplexity = float(np.exp(np.mean(np.concatenate([b.ravel() for _, b in nll]))))
    return score
