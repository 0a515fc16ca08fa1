"""Running models on onnxruntime's CPU provider and comparing outputs.

Inputs are seeded and respect each input's dtype and shape; integer inputs get
values that are valid for what consumes them (token ids below the embedding's row
count, masks of ones, positions counting up).  Comparison reports max abs error and
cosine per output; the tolerance rule is stated once here.

:func:`verification_cases` adds the inputs that catch what all-ones masks hide: padded
masks (zeros at the end, and at the start -- which masks whole query rows of a causal
model), scattered masked positions, extreme but legal values (large-magnitude floats, the
largest valid token ids) and the user's own samples.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.errors import BadInputError
from qnnpasses.ir.model import IRModel, file_weight_bytes, save_model, to_model_bytes
from qnnpasses.ir.shapes import resolve_dim

#: Weight bytes up to which a session is built from the model serialized in memory.  That holds
#: the weights three times over (the protobuf, its bytes, onnxruntime's copy); a larger model is
#: written to a temporary folder with its weights in a file, which onnxruntime maps instead.
SESSION_INLINE_BYTES = 256 << 20

# A lossless pass may move an output by at most ATOL + RTOL * max|reference| ...
ATOL = 1e-4
RTOL = 1e-4
# ... and must keep its cosine similarity to the reference at least this high.
MIN_COSINE = 0.99999


@dataclass
class OutputDiff:
    name: str
    max_abs: float
    cosine: float
    ok: bool
    reason: str = ""

    def as_dict(self) -> dict:
        return {"name": self.name, "max_abs": self.max_abs, "cosine": self.cosine, "ok": self.ok}


@dataclass
class Comparison:
    outputs: list[OutputDiff]

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outputs)

    @property
    def max_abs(self) -> float:
        return max((o.max_abs for o in self.outputs), default=0.0)

    @property
    def cosine(self) -> float:
        return min((o.cosine for o in self.outputs), default=1.0)

    def summary(self) -> dict:
        return {"max_abs": self.max_abs, "cosine": self.cosine, "outputs": [o.as_dict() for o in self.outputs]}

    def failure(self) -> str:
        bad = [o for o in self.outputs if not o.ok]
        return "; ".join(f"{o.name}: {o.reason}" for o in bad)


def make_inputs(ir: IRModel, seed: int = 0, shapes: dict[str, list[int]] | None = None) -> dict[str, np.ndarray]:
    """Seeded inputs for every graph input, shaped by ``shapes`` or by the declared dims."""
    rng = np.random.default_rng(seed)
    shapes = shapes or {}
    masks = set(mask_inputs(ir))
    inputs = {}
    for tensor in ir.graph.inputs:
        if isinstance(tensor, gs.Constant):
            continue
        shape = shapes.get(tensor.name) or [resolve_dim(d, tensor.name, i) for i, d in enumerate(tensor.shape or [])]
        shape = tuple(int(d) for d in shape)
        if tensor.name in masks:  # nothing masked: the padded verification cases mask on purpose
            inputs[tensor.name] = np.ones(shape, dtype=np.dtype(tensor.dtype))
            continue
        inputs[tensor.name] = _values_for(ir, tensor, shape, rng)
    return inputs


@dataclass
class VerificationCase:
    """One named set of inputs the manager verifies every changed pass on."""

    name: str  # one of qnnpasses.passmanager.api's CASE_* names
    inputs: dict[str, np.ndarray] = field(repr=False)
    detail: str = ""


# "extreme" floats: large magnitudes such as the massive activations of trained LLMs (|h| ~ 1e4)
EXTREME_FLOAT_SCALE = 1e3
_MASK_PATH_OPS = {"Cast", "Unsqueeze", "Reshape", "Expand", "Slice", "Squeeze", "Not", "Identity", "Flatten"}


def mask_inputs(ir: IRModel) -> list[str]:
    """Graph inputs that are masks: integer/bool/float inputs named so, or used as one (a
    ``Where`` condition, ``1 - m``, a logical op) within a few shape/cast ops of the input."""
    found = []
    for tensor in ir.graph.inputs:
        if isinstance(tensor, gs.Constant) or tensor.dtype is None or np.dtype(tensor.dtype).kind not in "biuf":
            continue
        if "mask" in tensor.name.lower() or _used_as_mask(tensor):
            found.append(tensor.name)
    return found


def _used_as_mask(tensor: gs.Variable, depth: int = 4) -> bool:
    for consumer in tensor.outputs:
        if consumer.op == "Where" and consumer.inputs and consumer.inputs[0] is tensor:
            return True
        if consumer.op in ("And", "Or", "Xor"):
            return True
        if consumer.op == "Sub" and len(consumer.inputs) == 2 and consumer.inputs[1] is tensor and _is_one(consumer.inputs[0]):
            return True
        if (consumer.op in _MASK_PATH_OPS and depth > 0 and consumer.outputs
                and _used_as_mask(consumer.outputs[0], depth - 1)):
            return True
    return False


def _is_one(tensor: gs.Tensor) -> bool:
    """A small constant of ones (``1 - m``)."""
    values = getattr(tensor, "_values", None)
    if not isinstance(tensor, gs.Constant) or values is None or int(np.prod(values.shape)) > 16:
        return False
    return bool(np.all(np.asarray(tensor.values) == 1))


def verification_cases(ir: IRModel, seed: int = 0, shapes: dict[str, list[int]] | None = None,
                       given: list[dict[str, np.ndarray]] | None = None) -> list[VerificationCase]:
    """The input sets ``--verify`` runs: seeded random inputs first, then padded and masked
    variants of them (when the model has mask inputs), extreme values, and ``given`` samples.

    Every case has the same shapes (``shapes``, else the declared ones), so one session runs
    them all; ``given`` samples of other shapes or dtypes are left out.
    """
    given = [g for g in (given or []) if g]
    try:
        base = make_inputs(ir, seed, shapes)
    except BadInputError:  # inputs we cannot make (sequences, strings): the given ones only
        if not given:
            raise
        return [VerificationCase("given", dict(sample), f"sample {i}") for i, sample in enumerate(given)]
    cases = [VerificationCase("random", base)]
    masks = [m for m in mask_inputs(ir) if m in base and base[m].ndim >= 1 and base[m].shape[-1] >= 2]
    if masks:
        rng = np.random.default_rng(seed + 1)
        length = {m: base[m].shape[-1] for m in masks}
        cut = {m: max(1, length[m] // 4) for m in masks}
        right, left, scattered = dict(base), dict(base), dict(base)
        for m in masks:
            right[m] = base[m].copy()
            right[m][..., length[m] - cut[m]:] = 0
            left[m] = base[m].copy()
            left[m][..., : cut[m]] = 0
            hidden = rng.random(base[m].shape) < 0.3
            hidden[..., 0] = False  # every query row keeps key 0 visible
            scattered[m] = np.where(hidden, 0, base[m]).astype(base[m].dtype)
        names = ", ".join(masks)
        cases += [VerificationCase("padded-right", right, f"last quarter of {names} zero"),
                  VerificationCase("padded-left", left, f"first quarter of {names} zero: causal models get fully masked rows"),
                  VerificationCase("masked", scattered, f"30% of {names} zero, position 0 kept")]
        grids = [m for m in masks if base[m].ndim >= 2 and base[m].shape[-2] >= 2]  # query x key masks
        if grids:
            row, causal = dict(base), dict(base)
            for m in grids:
                queries, keys = base[m].shape[-2:]
                row[m] = base[m].copy()
                row[m][..., 0, :] = 0
                seen = np.arange(keys)[None, :] <= np.arange(queries)[:, None] + (keys - queries)
                causal[m] = np.where(seen, base[m], 0).astype(base[m].dtype)
            grid_names = ", ".join(grids)
            cases += [VerificationCase("row-masked", row, f"first query row of {grid_names} all masked"),
                      VerificationCase("causal", causal, f"{grid_names} lower-triangular")]
    extreme = _extreme_inputs(ir, base, set(masks), seed + 2)
    if extreme is not None:
        cases.append(VerificationCase("extreme", extreme, f"floats x{EXTREME_FLOAT_SCALE:g}, largest valid ids"))
    for i, sample in enumerate(given):
        fits = set(sample) == set(base) and all(
            not isinstance(v, np.ndarray) or (v.shape == base[k].shape and v.dtype == base[k].dtype)
            for k, v in sample.items())
        if fits:
            cases.append(VerificationCase("given", dict(sample), f"sample {i}"))
    return cases


def _extreme_inputs(ir: IRModel, base: dict[str, np.ndarray], masks: set[str], seed: int) -> dict[str, np.ndarray] | None:
    rng = np.random.default_rng(seed)
    out, changed = dict(base), False
    for tensor in ir.graph.inputs:
        value = base.get(tensor.name)
        if not isinstance(value, np.ndarray) or tensor.name in masks or value.size == 0:
            continue
        if value.dtype.kind == "f":
            out[tensor.name] = (value.astype(np.float64) * EXTREME_FLOAT_SCALE).astype(value.dtype)
            changed = True
        elif value.dtype.kind in "iu":
            high = _index_bound(tensor)
            if high:
                top = high - 1 - rng.integers(0, min(high, 4), value.shape)
                top.flat[0] = high - 1
                out[tensor.name] = top.astype(value.dtype)
                changed = True
    return out if changed else None


def _values_for(ir: IRModel, tensor: gs.Variable, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    dtype = np.dtype(tensor.dtype) if tensor.dtype is not None else np.dtype(np.float32)
    name = tensor.name.lower()
    if dtype == np.bool_:
        return np.ones(shape, dtype=bool) if "mask" in name else rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        if "mask" in name:
            return np.ones(shape, dtype=dtype)
        if "position" in name:
            return np.broadcast_to(np.arange(shape[-1] if shape else 1), shape).astype(dtype).copy() if shape else np.zeros((), dtype)
        if "token_type" in name:
            return np.zeros(shape, dtype=dtype)
        high = _index_bound(tensor) or 2
        return rng.integers(0, high, shape).astype(dtype)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    raise BadInputError(f"cannot make inputs of dtype {dtype} for '{tensor.name}'; pass --inputs FILE.npz")


def _index_bound(tensor: gs.Variable) -> int | None:
    """The largest valid index for an integer input used as Gather indices into a constant table."""
    bounds = []
    for consumer in tensor.outputs:
        if consumer.op == "Gather" and len(consumer.inputs) > 1 and consumer.inputs[1] is tensor:
            data = consumer.inputs[0]
            if data.shape:
                axis = int(consumer.attrs.get("axis", 0))
                dim = data.shape[axis]
                if isinstance(dim, int):
                    bounds.append(dim)
    return min(bounds) if bounds else None


def adapt_inputs(ir: IRModel, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same input values in the dtypes the graph now declares.

    A pass may narrow an integer input (int64 token ids to int32); the values a
    verification run feeds are then cast when they fit, so before/after runs see the
    same numbers.
    """
    adapted = dict(inputs)
    for tensor in ir.graph.inputs:
        value = inputs.get(tensor.name)
        if not isinstance(value, np.ndarray) or tensor.dtype is None:  # sequences, optionals: as given
            continue
        want = np.dtype(tensor.dtype)
        if want == value.dtype or want.kind not in "iub" or value.dtype.kind not in "iub":
            continue
        if want.kind != "b" and value.size and (value.min() < np.iinfo(want).min or value.max() > np.iinfo(want).max):
            continue
        adapted[tensor.name] = value.astype(want)
    return adapted


def load_inputs(path: str | os.PathLike) -> dict[str, np.ndarray]:
    file = Path(path)
    if not file.is_file():
        raise BadInputError(f"inputs file not found: {file}")
    try:
        with np.load(file, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except Exception as exc:
        raise BadInputError(f"cannot read inputs from {file}: {exc}") from None


def check_inputs(ir: IRModel, inputs: dict[str, np.ndarray]) -> None:
    """Refuse inputs whose names or dtypes do not fit the model, naming the mismatch."""
    declared = {t.name: t for t in ir.graph.inputs}
    missing = sorted(set(declared) - set(inputs))
    extra = sorted(set(inputs) - set(declared))
    if missing or extra:
        raise BadInputError(f"inputs do not match the model: missing {missing}, unexpected {extra}")
    for name, array in inputs.items():
        want = declared[name].dtype
        if want is not None and np.dtype(want) != array.dtype:
            raise BadInputError(f"input '{name}' has dtype {array.dtype}, the model wants {np.dtype(want)}")


def cpu_session(path: str | os.PathLike, *, mapped: bool = False, optimize: bool = True, quiet: bool = False):
    """An onnxruntime CPU session of the model file at ``path``.

    ``mapped``: the weights stay in the memory-mapped external-data file instead of being copied
    into packed buffers (onnxruntime's ``session.disable_prepacking``), and each activation goes
    back to the system once read (no memory arena: the arena keeps every buffer it ever grew to,
    a quantized graph's dequantized weights included): the process holds about the live
    activations, not the weights, at the cost of slower MatMuls.  ``optimize=False`` runs
    what the graph says; ``quiet`` keeps onnxruntime's log out of the terminal.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if quiet:
        options.log_severity_level = 4
    if mapped:
        _map_weights(options)
    return ort.InferenceSession(os.fspath(path), options, providers=["CPUExecutionProvider"])


def _map_weights(options) -> None:
    """Session options that leave the weights in their mapped file and give activations back."""
    options.add_session_config_entry("session.disable_prepacking", "1")
    options.enable_cpu_mem_arena = False


def run_cpu(ir_or_path: IRModel | str | os.PathLike, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run on onnxruntime's CPU provider with all graph optimizations off (what the graph says)."""
    return run_cpu_many(ir_or_path, [inputs])[0]


def run_cpu_many(ir_or_path: IRModel | str | os.PathLike, inputs: list[dict[str, np.ndarray]],
                 *, keep_going: bool = False) -> list[dict[str, np.ndarray] | Exception]:
    """:func:`run_cpu` on several input sets with one session (one export, one session build).

    With ``keep_going`` a set that fails yields its exception in place of its outputs.  A model
    above :data:`SESSION_INLINE_BYTES` of weights runs with its weights mapped from a file, not
    packed into private copies (``cpu_session(mapped=True)``).
    """
    return list(run_cpu_each(ir_or_path, inputs, keep_going=keep_going))


def run_cpu_each(ir_or_path: IRModel | str | os.PathLike, inputs: Iterable[dict[str, np.ndarray]],
                 *, keep_going: bool = False) -> Iterator[dict[str, np.ndarray] | Exception]:
    """:func:`run_cpu_many`, one input set's outputs at a time: a caller that reduces each as it comes
    (a probe of every layer's attention scores) never holds all of them."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4  # failures reach the user as one line, not as onnxruntime's log
    large = (ir_or_path.weight_bytes() if isinstance(ir_or_path, IRModel) else file_weight_bytes(ir_or_path)) \
        > SESSION_INLINE_BYTES
    if large:
        _map_weights(options)
    if isinstance(ir_or_path, IRModel):
        if not large:
            session = ort.InferenceSession(to_model_bytes(ir_or_path), options, providers=["CPUExecutionProvider"])
        else:
            with tempfile.TemporaryDirectory(prefix="qnnpasses-") as tmp:
                path = save_model(ir_or_path, Path(tmp) / "model.onnx", external_data=True)
                session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
                for x in inputs:
                    yield _run_one(session, x, keep_going)
                return
    else:
        session = ort.InferenceSession(str(ir_or_path), options, providers=["CPUExecutionProvider"])
    for x in inputs:
        yield _run_one(session, x, keep_going)


def _run_one(session, inputs: dict[str, np.ndarray], keep_going: bool):
    if not keep_going:
        return _run(session, inputs)
    try:
        return _run(session, inputs)
    except Exception as exc:  # noqa: BLE001 - handed back to the caller, which reports it
        return exc


def _run(session, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    wanted = {i.name for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]
    values = session.run(names, {k: v for k, v in inputs.items() if k in wanted})
    return dict(zip(names, values))


def compare_outputs(
    reference: dict[str, np.ndarray],
    candidate: dict[str, np.ndarray],
    *,
    atol: float = ATOL,
    rtol: float = RTOL,
    min_cosine: float = MIN_COSINE,
    nan_is_undefined: bool = False,
) -> Comparison:
    """Compare every reference output; a float output is ok when within ``atol + rtol*max|ref|``
    and its cosine is at least ``min_cosine``; other dtypes must be equal.

    ``nan_is_undefined``: where the reference is NaN the model defines no value (a fully
    masked softmax row with a -inf mask), so the candidate may hold anything there; a NaN
    the reference does not have still fails.
    """
    diffs = []
    for name, ref in reference.items():
        if name not in candidate:
            diffs.append(OutputDiff(name, float("inf"), 0.0, False, "output is missing"))
            continue
        got = candidate[name]
        if not isinstance(ref, np.ndarray) or not isinstance(got, np.ndarray):  # sequence/optional outputs
            diffs.append(_compare_values(name, ref, got))
            continue
        diffs.append(_compare_one(name, ref, got, atol, rtol, min_cosine, nan_is_undefined))
    return Comparison(diffs)


def _compare_values(name: str, ref, got) -> OutputDiff:
    """Sequence and optional outputs: equal element by element (NaN equal to NaN), or not ok."""
    def same(a, b) -> bool:
        if isinstance(a, list) or isinstance(b, list):
            return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
        if a is None or b is None:
            return a is None and b is None
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc" and b.dtype.kind in "fc")
    ok = same(ref, got)
    return OutputDiff(name, 0.0 if ok else float("inf"), 1.0 if ok else 0.0, ok, "" if ok else "sequence/optional output differs")


def _compare_one(name: str, ref: np.ndarray, got: np.ndarray, atol: float, rtol: float, min_cosine: float,
                 nan_is_undefined: bool = False) -> OutputDiff:
    if ref.shape != got.shape:
        return OutputDiff(name, float("inf"), 0.0, False, f"shape {got.shape} differs from {ref.shape}")
    if ref.size == 0:
        return OutputDiff(name, 0.0, 1.0, True)
    if ref.dtype.kind not in "biufc" or got.dtype.kind not in "biufc":  # strings, objects: exactly equal
        ok = ref.dtype == got.dtype and np.array_equal(ref, got)
        return OutputDiff(name, 0.0 if ok else float("inf"), 1.0 if ok else 0.0, ok, "" if ok else "values differ")
    a = ref.astype(np.float64)
    b = got.astype(np.float64)
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    differ = (nan_a & ~nan_b) if not nan_is_undefined else np.zeros_like(nan_a)
    differ = differ | (nan_b & ~nan_a)
    if differ.any():
        return OutputDiff(name, float("nan"), float("nan"), False, f"NaN in {int(differ.sum())} positions that differ")
    finite = ~nan_a
    a, b = a[finite], b[finite]
    max_abs = float(np.max(np.abs(a - b))) if a.size else 0.0
    cosine = cosine_similarity(a, b)
    if ref.dtype.kind not in "fc":
        ok = max_abs == 0.0
        return OutputDiff(name, max_abs, cosine, ok, "" if ok else f"integer output differs by up to {max_abs:g}")
    bound = atol + rtol * float(np.max(np.abs(a))) if a.size else atol
    if max_abs > bound:
        return OutputDiff(name, max_abs, cosine, False, f"max abs error {max_abs:.3g} > {bound:.3g}")
    if cosine < min_cosine:
        return OutputDiff(name, max_abs, cosine, False, f"cosine {cosine:.8f} < {min_cosine}")
    return OutputDiff(name, max_abs, cosine, True)


def cosine_similarity(a: np.ndarray, b: np.ndarray) -> float:
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0.0 and nb == 0.0:
        return 1.0
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(np.clip(np.dot(a, b) / (na * nb), -1.0, 1.0))

