"""GPTQ: weight rounding that pushes each input row's rounding error onto the rows not yet rounded.

Frantar et al., 2022 ("GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers"), for one ``MatMul`` ``y = x·W`` with ``W[K, N]`` (K input channels, N output
channels) and calibration inputs ``X[T, K]``:

1. ``H = Xᵀ·X`` summed over the calibration tokens (the paper's ``2·XᵀX``; the factor cancels),
   dampened by ``damp · mean(diag H)`` (1 %, raised tenfold while the Cholesky fails); input
   channels that are always zero get ``H[i, i] = 1``;
2. ``U`` = the upper Cholesky factor of ``H⁻¹``;
3. the K input rows are rounded in order (``act_order``: by decreasing ``H[i, i]``), each to the
   grid of the written ``DequantizeLinear``, and its error ``e = (w - q)/U[i, i]`` is taken off
   the rows after it: ``W[j] -= U[i, j]·e``.  Updates are applied lazily: within a block of
   :data:`LAZY_BLOCK` rows at once, to the rest of the matrix once per block.

The grid is exactly what :mod:`qnnpasses.quant.weights` writes: symmetric signed integers
``q ∈ [-qmax-1, qmax]`` with zero point 0, times a float32 scale per output channel or per
block of ``B`` input rows.  Per-channel scales (and, with ``act_order``, block scales) are
chosen once from the float weight (max|w| or the MSE-optimal clip); without ``act_order``
a block's scale is chosen when the first of its rows is reached, from the rows as GPTQ has
updated them (the paper's grouped variant).  The dequantized weight of the QDQ model is
``q·scale``: the matrix GPTQ computed, bit for bit.

The inputs ``X`` are the fp32 activations of the float (prepared, e.g. rotated) model on
onnxruntime CPU over the calibration samples: every layer sees unquantized inputs
(non-sequential GPTQ; the paper feeds each layer the outputs of the already-quantized ones).
``H`` is accumulated sample by sample per distinct input tensor (q/k/v share one), never
storing activations; the tensors are probed in chunks of at most ``budget_bytes`` of
Hessians (one pass over the calibration data per chunk).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from qnnpasses.quant.scales import search_scales

#: Rows updated together before the rest of the weight is (the paper's B = 128).
LAZY_BLOCK = 128
#: Hessian dampening, a fraction of the mean diagonal.
DAMP = 0.01
#: Hessians held at once (float64); more tensors take more passes over the calibration data.
BUDGET_BYTES = 256 * 2**20
#: Weight elements rounded at once (float64: 128 MiB a copy); a wider weight goes in column slices.
COLUMN_ELEMENTS = 2**24


@dataclass(frozen=True)
class GptqConfig:
    """How :func:`qnnpasses.quant.weights.refine_weights` rounds with GPTQ.

    ``calib``: the calibration samples; ``source``: the float model whose MatMul inputs are
    probed (default: the model that was quantized).  Several graphs sharing weights pass the
    same ``source``/``calib`` so a shared weight is rounded the same in each, and the same
    ``cache`` so it is rounded once.
    """

    calib: object  # CalibrationData (Sequence of input feeds)
    act_order: bool = False
    damp: float = DAMP
    source: str | Path | None = None
    budget_bytes: int = BUDGET_BYTES
    cache: "GptqCache | None" = None


class GptqCache:
    """GPTQ's roundings kept on disk for the next graph that rounds the same weight the same way.

    A prefill and a decode graph hold the same weights and round them on the same inputs
    (:attr:`GptqConfig.source`): the second graph finds each weight here and neither probes its
    Hessian nor rounds it again.  An entry is keyed by the weight's name, a digest of its float
    values and the grid, so a weight that differs between the graphs is rounded anew.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def key(name: str, w: np.ndarray, **grid) -> str:
        digest = hashlib.blake2b(memoryview(np.ascontiguousarray(w)).cast("B"), digest_size=16)
        digest.update(repr((name, w.dtype.str, w.shape, sorted(grid.items()))).encode())
        return digest.hexdigest()

    def get(self, key: str) -> tuple[np.ndarray, np.ndarray, dict[str, float]] | None:
        path = self.folder / f"{key}.npz"
        if not path.exists():
            return None
        with np.load(path) as data:
            return data["q"], data["scales"], json.loads(str(data["figures"]))

    def put(self, key: str, q: np.ndarray, scales: np.ndarray, figures: dict[str, float]) -> None:
        np.savez(self.folder / f"{key}.npz", q=q, scales=scales, figures=np.array(json.dumps(figures)))


def _search(w: np.ndarray, qmax: int, mse: bool) -> np.ndarray:
    return search_scales(w, qmax, mse)[0]


def inverse_cholesky(h: np.ndarray, damp: float = DAMP) -> np.ndarray:
    """Upper Cholesky factor of ``(H + λI)⁻¹`` with ``λ = damp·mean(diag H)``, raised until it factors."""
    h = h.astype(np.float64, copy=True)
    diag = np.diag(h).copy()
    dead = diag <= 0
    h[dead, dead] = 1.0
    lam = damp * float(np.mean(np.diag(h)))
    for _ in range(6):
        try:
            inv = np.linalg.inv(h + lam * np.eye(len(h)))
            return np.linalg.cholesky((inv + inv.T) / 2).T
        except np.linalg.LinAlgError:
            lam *= 10
    raise np.linalg.LinAlgError("Hessian not positive definite after dampening")


def gptq_round(w: np.ndarray, h: np.ndarray, qmax: int, *, block_size: int | None = None, mse: bool = False,
               act_order: bool = False, damp: float = DAMP) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ of ``w[K, N]`` with Hessian ``h[K, K]``: (integers ``q[K, N]``, float32 scales ``[N]`` or ``[K/B, N]``).

    ``q·scale`` (scales repeated over each block's rows) is the rounded weight.  ``block_size``
    must divide ``K``.  The output columns do not interact (each has its own scales, and a row's
    error moves only its own column), so they are rounded :data:`COLUMN_ELEMENTS` at a time:
    a 136 M-parameter lm_head needs one slice in float64, not the whole matrix several times.
    """
    k, n = w.shape
    if block_size and k % block_size:
        raise ValueError(f"block size {block_size} does not divide {k} rows")
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    u = inverse_cholesky(h[np.ix_(perm, perm)], damp)
    q = np.empty((k, n), dtype=np.int8 if qmax <= 127 else np.int16)
    scales = np.empty((k // block_size, n) if block_size else (n,), dtype=np.float32)
    for cols in column_slices((k, n)):
        q[:, cols], scales[..., cols] = _round_columns(w[:, cols].astype(np.float64), u, perm, qmax,
                                                       block_size, mse, act_order)
    return q, scales


def _round_columns(w: np.ndarray, u: np.ndarray, perm: np.ndarray, qmax: int, block_size: int | None,
                   mse: bool, act_order: bool) -> tuple[np.ndarray, np.ndarray]:
    """:func:`gptq_round` of some columns ``w[K, n]`` (float64), given ``U`` and the row order."""
    k, n = w.shape
    work = w[perm].copy()
    q = np.zeros((k, n))
    lazy = LAZY_BLOCK
    if block_size:
        lazy = max(lazy // block_size, 1) * block_size  # a block's rows sit in one lazy batch
        scales = np.zeros((k // block_size, n))
        if act_order:  # static: the float weight's blocks (the processing order crosses blocks)
            groups = w.reshape(k // block_size, block_size, n).transpose(1, 0, 2).reshape(block_size, -1)
            scales = _search(groups, qmax, mse).reshape(k // block_size, n).astype(np.float32).astype(np.float64)
    else:
        scales = _search(w, qmax, mse).astype(np.float32).astype(np.float64)
    for i1 in range(0, k, lazy):
        i2 = min(i1 + lazy, k)
        batch = work[i1:i2]  # a view: updated in place
        err = np.zeros((i2 - i1, n))
        ub = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            row = perm[i1 + i]
            if block_size:
                if not act_order and row % block_size == 0:
                    fresh = _search(batch[i:i + block_size], qmax, mse)
                    scales[row // block_size] = fresh.astype(np.float32).astype(np.float64)
                s = scales[row // block_size]
            else:
                s = scales
            x = batch[i]
            qi = np.clip(np.rint(x / s), -qmax - 1, qmax)
            q[row] = qi
            e = (x - qi * s) / ub[i, i]
            batch[i:] -= np.outer(ub[i, i:], e)
            err[i] = e
        work[i2:] -= u[i1:i2, i2:].T @ err
    return q, scales.astype(np.float32)


def weighted_error(w: np.ndarray, wq: np.ndarray, h: np.ndarray) -> float:
    """``Σ_t ||x_t·(W - Ŵ)||²`` over the calibration tokens: ``tr(Dᵀ H D)`` with ``D = W - Ŵ``
    (column slices at a time, as :func:`gptq_round`)."""
    total = 0.0
    for cols in column_slices(w.shape):
        d = w[:, cols].astype(np.float64) - wq[:, cols].astype(np.float64)
        total += float(np.einsum("kn,kn->", d, h @ d))
    return total


def column_slices(shape: tuple[int, int]) -> list[slice]:
    """Slices of the ``N`` columns of a ``[K, N]`` weight, :data:`COLUMN_ELEMENTS` elements each."""
    k, n = shape
    step = max(COLUMN_ELEMENTS // max(k, 1), 1)
    return [slice(c0, min(c0 + step, n)) for c0 in range(0, n, step)]


# --------------------------------------------------------------------------- calibration inputs


def weight_inputs(model: onnx.ModelProto, weights: set[str]) -> dict[str, list[str]]:
    """Weight name -> the activation inputs ``x`` of the MatMul/Gemm (``transA=0``) computing ``x·W``."""
    found: dict[str, list[str]] = {}
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2 or node.input[1] not in weights:
            continue
        if node.op_type == "Gemm" and any(a.name == "transA" and a.i for a in node.attribute):
            continue
        found.setdefault(node.input[1], []).append(node.input[0])
    return found


def chunks(tensors: dict[str, int], budget_bytes: int) -> list[list[str]]:
    """Tensor names (width ``K`` each) grouped so each group's float64 Hessians fit ``budget_bytes``."""
    groups: list[list[str]] = [[]]
    used = 0
    for name, k in tensors.items():
        size = 8 * k * k
        if groups[-1] and used + size > budget_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    return [g for g in groups if g]


class HessianProbe:
    """The float model with the wanted tensors as extra outputs, on onnxruntime CPU."""

    def __init__(self, model_path: str | Path, tensors: list[str]):
        import onnxruntime as ort

        model = onnx.load(str(model_path), load_external_data=False)  # the weights stay in their files
        known = {o.name for o in model.graph.output}
        for name in tensors:
            if name not in known:
                model.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
        options = ort.SessionOptions()
        options.log_severity_level = 3
        # the probe is built from bytes and reads the weights where they are: no copy, and no second
        # link to the file (onnx >= 1.23 refuses to read a weight file that has several)
        options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                         str(Path(model_path).resolve().parent))
        options.add_session_config_entry("session.disable_prepacking", "1")  # mapped, not packed copies
        probe = model.SerializeToString()
        del model
        self.session = ort.InferenceSession(probe, options, providers=["CPUExecutionProvider"])

    def hessians(self, calib, names: list[str]) -> tuple[dict[str, np.ndarray], int]:
        """``Σ xᵀx`` per tensor over every calibration sample (float64), and the token count."""
        sums: dict[str, np.ndarray] = {}
        tokens = 0
        for i in range(len(calib)):
            values = self.session.run(names, calib[i])
            for name, value in zip(names, values):
                x = np.asarray(value, dtype=np.float64).reshape(-1, value.shape[-1])
                if name in sums:
                    sums[name] += x.T @ x
                else:
                    sums[name] = x.T @ x
            tokens += int(np.asarray(values[0]).reshape(-1, values[0].shape[-1]).shape[0]) if values else 0
        return sums, tokens

    def close(self) -> None:
        self.session = None


@dataclass
class HessianChunk:
    hessians: dict[str, np.ndarray]  # weight name -> H (summed over the weight's readers)
    seconds: float


def weight_hessians(config: GptqConfig, default_source: str | Path, weights: set[str]) -> Iterator[HessianChunk]:
    """Per chunk of :data:`BUDGET_BYTES`, the Hessians of ``weights`` found in the source model."""
    source = Path(config.source or default_source)
    model = onnx.load(str(source), load_external_data=False)
    readers = weight_inputs(model, weights)
    widths: dict[str, int] = {}
    inits = {i.name: i for i in model.graph.initializer}
    for weight, xs in readers.items():
        init = inits[weight]
        gemm_t = any(n.op_type == "Gemm" and n.input[1] == weight and any(a.name == "transB" and a.i for a in n.attribute)
                     for n in model.graph.node)
        k = init.dims[1] if gemm_t else init.dims[0]
        for x in xs:
            widths[x] = k
    del model
    if not widths:
        return
    start = time.monotonic()
    probe = HessianProbe(source, list(widths))
    try:
        by_tensor: dict[str, list[str]] = {}
        for weight, xs in readers.items():
            for x in dict.fromkeys(xs):
                by_tensor.setdefault(x, []).append(weight)
        partial: dict[str, tuple[np.ndarray, set[str]]] = {}  # weights read by several tensors
        for group in chunks(widths, config.budget_bytes):
            sums, _ = probe.hessians(config.calib, group)
            ready: dict[str, np.ndarray] = {}
            for x, h in sums.items():
                for weight in by_tensor[x]:
                    xs = set(readers[weight])
                    if len(xs) == 1:
                        ready[weight] = h  # shared by q/k/v: one array, no copy
                        continue
                    acc, seen = partial.get(weight, (np.zeros_like(h), set()))
                    acc, seen = acc + h, seen | {x}
                    if seen == xs:
                        ready[weight] = acc
                        partial.pop(weight, None)
                    else:
                        partial[weight] = (acc, seen)
            del sums
            yield HessianChunk(ready, time.monotonic() - start)
            del ready
            start = time.monotonic()
    finally:
        probe.close()
