"""Seeded calibration and evaluation windows for models without a dataset (random-weight fixtures).

A seeded stream of random token ids stands in for a corpus; calibration and evaluation
windows are cut from disjoint stretches of it (``part="calib"`` from the first half,
``part="eval"`` from the second), so the two sets never share a window.  Each window
keeps the token that follows it, so ``labels`` (the next token at every position) come
with the inputs and perplexity can be measured.

Decoders with a KV cache (``past_key_values.*`` inputs, one new token) get a realistic
cache: the model itself runs over the window token by token on onnxruntime CPU, feeding
its ``present.*`` outputs back as the past (slots not yet filled are masked out), and
the sample is the last step, with every past slot holding a real key/value.

    python -m qnnpasses.quant.data MODEL.onnx -o calib.npz --count 64 --part calib
    python -m qnnpasses.quant.data MODEL.onnx -o eval.npz --count 16 --part eval
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from qnnpasses.debug.compare import vocab_size
from qnnpasses.errors import BadInputError
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import IRModel
from qnnpasses.quant.calibration import LABELS, InputSpec, model_inputs

#: Half of the token stream belongs to each part; windows never cross the middle.
STREAM_TOKENS = 1 << 16
PARTS = ("calib", "eval")


def _is_ids(spec: InputSpec) -> bool:
    return spec.dtype.kind in "iu" and "ids" in spec.name.lower() and "type" not in spec.name.lower() \
        and "position" not in spec.name.lower()


def _kv_inputs(specs: list[InputSpec]) -> list[InputSpec]:
    return [s for s in specs if s.dtype.kind == "f" and ("past" in s.name.lower() or "cache" in s.name.lower())]


def _fill(spec: InputSpec, tokens: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """The value of a non-token input for a window: masks of ones, positions counting up, zeros otherwise."""
    name = spec.name.lower()
    if "mask" in name:
        return (np.ones(spec.shape) if mask is None else mask.reshape(spec.shape)).astype(spec.dtype)
    if "position" in name:
        return np.broadcast_to(np.arange(spec.shape[-1]), spec.shape).astype(spec.dtype).copy()
    if spec.dtype.kind in "iub":
        return np.zeros(spec.shape, dtype=spec.dtype)
    raise BadInputError(f"cannot make values for float input '{spec.name}'; give --calib data")


def token_windows(ir: IRModel, count: int, *, seed: int = 0, part: str = "calib") -> dict[str, np.ndarray]:
    """``count`` windows stacked along axis 0 for every input, plus ``labels``."""
    if part not in PARTS:
        raise BadInputError(f"part must be one of {PARTS} (got '{part}')")
    specs = model_inputs(ir)
    ids = [s for s in specs if _is_ids(s)]
    if len(ids) != 1:
        raise BadInputError(f"need exactly one token-id input to make windows (found {[s.name for s in ids]})")
    kv = _kv_inputs(specs)
    seq = ids[0].shape[-1]
    width = seq + (kv[0].shape[-2] if kv else 0)  # tokens the window covers, past included
    vocab = vocab_size(ir) or 256
    stream = np.random.default_rng(seed).integers(0, vocab, STREAM_TOKENS)
    half = STREAM_TOKENS // 2
    lo, hi = (0, half) if part == "calib" else (half, STREAM_TOKENS)
    if count * (width + 1) > hi - lo:
        raise BadInputError(f"{count} windows of {width} tokens do not fit the {half}-token stream")
    starts = np.random.default_rng(seed + PARTS.index(part) + 1).choice((hi - lo - width - 1) // (width + 1), count,
                                                                        replace=False) * (width + 1) + lo
    windows = [stream[s:s + width + 1] for s in sorted(starts)]
    samples = [_kv_sample(ir, specs, w, kv) if kv else _plain_sample(specs, ids[0], w) for w in windows]
    stacked = {spec.name: np.stack([s[spec.name] for s in samples]) for spec in specs}
    stacked[LABELS] = np.stack([w[-seq:] for w in windows]).reshape(count, *ids[0].shape).astype(np.int64)
    return stacked


def _plain_sample(specs: list[InputSpec], ids: InputSpec, window: np.ndarray) -> dict[str, np.ndarray]:
    tokens = window[:-1]
    return {s.name: tokens.reshape(s.shape).astype(s.dtype) if s is ids else _fill(s, tokens) for s in specs}


def _kv_sample(ir: IRModel, specs: list[InputSpec], window: np.ndarray, kv: list[InputSpec]) -> dict[str, np.ndarray]:
    """Run the decoder over ``window[:-2]`` one token at a time; the sample is the step for ``window[-2]``."""
    from qnnpasses.backends.cpu import run_cpu

    ids = next(s for s in specs if _is_ids(s))
    past_len = kv[0].shape[-2]
    past = {s.name: np.zeros(s.shape, dtype=s.dtype) for s in kv}
    presents = _present_names(ir, kv)
    sample: dict[str, np.ndarray] = {}
    for step in range(past_len + 1):
        mask = np.zeros(past_len + 1)
        mask[past_len - step:] = 1
        sample = {s.name: window[step:step + 1].reshape(s.shape).astype(s.dtype) if s is ids else
                  past[s.name] if s.name in past else _fill(s, window, mask) for s in specs}
        if step == past_len:
            break
        outputs = run_cpu(ir, sample)
        past = {name: outputs[presents[name]][..., 1:, :].astype(np.float32) for name in past}
    return sample


def _present_names(ir: IRModel, kv: list[InputSpec]) -> dict[str, str]:
    """Past input -> the output that extends it (``past_key_values.0.key`` -> ``present.0.key``)."""
    outputs = [t.name for t in ir.graph.outputs]
    mapping = {}
    for spec in kv:
        suffix = spec.name.split(".", 1)[-1]
        match = [o for o in outputs if o != spec.name and o.endswith(suffix) and o.startswith(("present", "past"))]
        if len(match) != 1:
            raise BadInputError(f"cannot tell which output extends the cache input '{spec.name}' (outputs: {outputs})")
        mapping[spec.name] = match[0]
    return mapping


def save_windows(ir: IRModel, path: str | Path, count: int, *, seed: int = 0, part: str = "calib") -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(out, **token_windows(ir, count, seed=seed, part=part))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qnnpasses.quant.data", description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("-o", "--output", required=True, help="output .npz (stacked inputs + labels)")
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--part", choices=PARTS, default="calib")
    args = parser.parse_args(argv)
    out = save_windows(load_model(args.model), args.output, args.count, seed=args.seed, part=args.part)
    print(f"wrote {args.count} {args.part} windows to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
