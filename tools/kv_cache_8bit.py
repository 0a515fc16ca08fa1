#!/usr/bin/env python
"""How much an 8-bit KV cache loses, by the granularity of its scales: docs/kv_cache_8bit.md / .json.

The cache of trained SmolLM2-135M (``tools/trained_fixtures.py``, exporter ``hf``), computed by
the original export on onnxruntime CPU (fp32) over held-out English windows, is rounded to 8
bits (symmetric, zero point 128, scales from the same windows' maxima, so nothing saturates)
with one scale per tensor (what ``--bundle genai`` writes, and what Genie's per-tensor encodings
allow), one per KV head, or one per head_dim channel (shared by the heads).  Figure: the RMS of
the rounding error relative to the RMS of the cache, averaged over layers.

    python tools/kv_cache_8bit.py               # 2 windows of 128 tokens (about a minute)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
#: axes a scale is shared over, in the export's [1, kv_heads, slots, head_dim] order
GRANULARITY = {"per tensor": (0, 1, 2, 3), "per KV head": (0, 2, 3), "per head_dim channel": (0, 1, 2)}


def relative_error(x: np.ndarray, axes: tuple[int, ...]) -> float:
    scale = np.maximum(np.abs(x).max(axis=axes, keepdims=True), 1e-12) / 127.0
    rounded = np.clip(np.rint(x / scale), -128, 127) * scale
    return float(np.sqrt(((rounded - x) ** 2).mean()) / np.sqrt((x ** 2).mean()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "kv_cache_8bit.md")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tools"))
    import trained_fixtures as tf

    from qnnpasses.llm.reference import ReferenceModel

    tf.ensure_built("smollm2_135m", tf.HF_EXPORTER)
    reference = ReferenceModel(tf.hf_model_path(tf.SPECS["smollm2_135m"], tf.DEFAULT_CACHE))
    with np.load(tf.DEFAULT_CACHE / "smollm2_135m.eval.npz") as data:
        windows = data["input_ids"][:args.windows, :args.tokens]
    caches = [reference.cache([int(t) for t in row]) for row in windows]
    layers = len(reference.past) // 2
    rows = []
    for kind, names in (("key", reference.past[:layers]), ("value", reference.past[layers:])):
        stacked = [np.concatenate([c[n] for c in caches], axis=2) for n in names]
        row = {"kind": kind}
        for label, axes in GRANULARITY.items():
            row[label] = float(np.mean([relative_error(x, axes) for x in stacked]))
        rows.append(row)
    data = {"model": "SmolLM2-135M (hf export)", "windows": args.windows, "tokens": args.tokens, "layers": layers,
            "rows": rows}
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    lines = ["# An 8-bit KV cache: the error by the granularity of its scales", "",
             f"Written by `python tools/kv_cache_8bit.py --windows {args.windows} --tokens {args.tokens}` "
             "(figures in `docs/kv_cache_8bit.json`).", "",
             f"Trained SmolLM2-135M's cache ({layers} layers) from the original export (fp32, onnxruntime CPU) over "
             f"{args.windows} held-out English windows of {args.tokens} tokens, rounded to 8 bits with scales from the "
             "same windows' maxima (no saturation). Relative RMS error, averaged over layers:", "",
             "| cache | " + " | ".join(GRANULARITY) + " |", "|---|" + "---:|" * len(GRANULARITY)]
    for row in rows:
        lines.append(f"| {row['kind']} | " + " | ".join(f"{row[g]:.4f}" for g in GRANULARITY) + " |")
    lines += ["", "`--bundle genai` writes one scale per tensor (`docs/llm_bundles.md` has what it costs in tokens).", ""]
    args.out.write_text("\n".join(lines))
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
