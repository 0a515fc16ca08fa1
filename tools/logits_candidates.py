#!/usr/bin/env python
"""How often a trained LLM's next token is among its vocabulary's first N ids: writes
docs/logits_offset.md and docs/logits_offset.json.

``logits-offset{candidates=N}`` (``qnnpasses llm --logits-offset N``) subtracts the maximum of the
first N tokens' logits inside the lm_head's accumulation, so that the logits that decide the next
token come out of the HTP's fp16 rounding near 0, at fp16's fine resolution, for N / V of the
lm_head's bytes instead of a second copy of all of them.  The form is exact whatever N is; how
much resolution it buys depends on how close that maximum is to the row's maximum.  Here, for
each trained model (``tools/trained_fixtures.py``: transformers' own fp32 model from the PyPI
package's GGUF, default attention), on windows of real English text (``english_text.py``; both the
``calib`` and the ``eval`` split), at every position:

* whether fp32's top token is among the first N ids (then the offset is the row's maximum);
* the lead of the row's maximum over the candidates' maximum, where the top logit then sits;
* fp16's spacing where the top two logits are rounded, with the offset and without it (the plain
  lm_head's, at their absolute value), and how many positions have fp32's top-2 margin below half
  of that spacing: near-ties whose order the fp16 rounding of the logits may flip.

    python tools/logits_candidates.py                      # every trained LLM installed
    python tools/logits_candidates.py --models smollm2_135m --windows 8
    python tools/logits_candidates.py --doc-only           # the Markdown from the JSON
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

TOOLS_DIR = Path(__file__).resolve().parent
REPO = TOOLS_DIR.parent
sys.path.insert(0, str(TOOLS_DIR))
sys.path.insert(0, str(REPO))

from qnnpasses.llm.manifest import OFFSET_CANDIDATES  # noqa: E402

MODELS = ("smollm2_135m", "gemma3_270m")
COUNTS = (1024, 2048, 4096, 8192)
SPLITS = ("calib", "eval")
OUT = REPO / "docs" / "logits_offset"


def spacing(values: np.ndarray) -> np.ndarray:
    """fp16's spacing at each value (the distance to the next fp16 number above its magnitude)."""
    return np.spacing(np.abs(values).astype(np.float16)).astype(np.float64)


def measure(name: str, windows: int) -> dict[str, Any]:
    import torch

    import english_text
    import trained_fixtures as tf

    spec = tf.SPECS[name]
    model, tok = tf.load_torch(spec, None)
    text = english_text.split_text(tf.TEXT_SOURCE)
    result: dict[str, Any] = {"title": spec.title, "package": f"{spec.distribution} {spec.version()}", "seq": spec.seq,
                              "windows": windows, "splits": {}}
    for split in SPLITS:
        data = tf.lm_windows(tok, text[split], spec.seq, windows, spec.bos)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(data["input_ids"])).logits.float().numpy()
        logits = logits.reshape(-1, logits.shape[-1]).astype(np.float64)
        result["vocab"] = int(logits.shape[-1])
        top = logits.argmax(-1)
        top2 = np.sort(logits, axis=-1)[:, -2:]
        row_max, margin = top2[:, 1], top2[:, 1] - top2[:, 0]
        plain = spacing(np.abs(top2).max(-1))  # where the plain lm_head rounds the top two
        rows = []
        for count in (*COUNTS, logits.shape[-1]):
            lead = row_max - logits[:, :count].max(-1)
            shifted = spacing(np.maximum(np.abs(lead), np.abs(lead - margin)))  # the top two, offset
            rows.append({"candidates": count, "top_among": float(np.mean(top < count)),
                         "lead_median": float(np.median(lead)), "lead_p90": float(np.percentile(lead, 90)),
                         "lead_max": float(lead.max()), "spacing_median": float(np.median(shifted)),
                         "unresolved": int(np.sum(margin < shifted / 2)), "lm_head_bytes": count / logits.shape[-1]})
        result["splits"][split] = {"positions": int(len(top)), "top_logit_median": float(np.median(row_max)),
                                   "plain_spacing_median": float(np.median(plain)),
                                   "plain_unresolved": int(np.sum(margin < plain / 2)), "rows": rows}
    return result


def render(doc: dict[str, Any]) -> str:
    lines = ["# logits-offset over candidate tokens: how often the next token is among the first ids", "",
             f"Written by `python tools/logits_candidates.py` (figures in `docs/logits_offset.json`). "
             "`qnnpasses llm` takes the offset it subtracts inside an fp16 pair's lm_head accumulation from "
             f"the first N tokens' logits (`--logits-offset N`; by default {OFFSET_CANDIDATES:,}, at most an "
             "eighth of the vocabulary): N / V of the lm_head's bytes more, where every token as candidate "
             "(`--logits-offset all`) reads and stores the lm_head twice. The rewrite is exact "
             "whatever N is; what it buys is fp16's resolution where the next token is decided, and that "
             "depends on how close the candidates' maximum comes to the row's. transformers' fp32 model, "
             "every position of windows of real English text. A near-tie fp16 may flip: fp32's margin between "
             "its top two logits is below half of fp16's spacing where they are rounded (at their absolute "
             "value for plain logits, at their offset value with it).", ""]
    lines += ["| model | split | offset | lm_head bytes more | top token among the candidates | "
              "row max over candidates' max: median / p90 / max | fp16 spacing at the top two (median) | "
              "near-ties fp16 may flip |", "|---|---|---|---:|---:|---|---:|---:|"]
    for name, res in doc["models"].items():
        for split, data in res["splits"].items():
            where = f"| {res['title']} | {split} ({data['positions']} positions) |"
            lines.append(f"{where} none (plain logits) | - | - | - | {data['plain_spacing_median']:.2g} | "
                         f"{data['plain_unresolved']} |")
            for row in data["rows"]:
                every = row["candidates"] == res["vocab"]
                offset = "every token" if every else f"first {row['candidates']:,} of {res['vocab']:,}"
                lines.append(f"{where} {offset} | "
                             f"{row['lm_head_bytes']:.1%} | {row['top_among']:.1%} | {row['lead_median']:.2f} / "
                             f"{row['lead_p90']:.2f} / {row['lead_max']:.2f} | {row['spacing_median']:.2g} | "
                             f"{row['unresolved']} |")
    lines += ["", "Byte-pair and SentencePiece vocabularies number their tokens roughly by frequency (a merge "
              "learned earlier gets a lower id), so the likeliest next token is often among the first ids. Where "
              "it is not, the top logits come out at their lead over the candidates instead of near 0: still "
              "finer than at their absolute value (the plain lm_head's). Either way the logits keep their "
              "order; only how finely fp16 rounds them differs. What it does to generated tokens on the HTP: "
              "`docs/llm.md`.", "",
              "Models: " + "; ".join(f"{r['title']} ({r['package']}, {r['windows']} windows of {r['seq']} tokens "
                                     "per split)" for r in doc["models"].values()) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--windows", type=int, default=16, help="windows of text per split")
    parser.add_argument("--out", type=Path, default=OUT, help="writes OUT.md and OUT.json")
    parser.add_argument("--doc-only", action="store_true", help="rewrite the Markdown from the JSON")
    args = parser.parse_args(argv)
    json_path, md_path = args.out.with_suffix(".json"), args.out.with_suffix(".md")
    if args.doc_only:
        md_path.write_text(render(json.loads(json_path.read_text())))
        return 0
    import trained_fixtures as tf

    doc: dict[str, Any] = {"counts": list(COUNTS), "models": {}}
    for name in args.models.split(","):
        missing = tf.SPECS[name].missing()
        if missing:
            print(f"{name}: skipped ({missing})", file=sys.stderr)
            continue
        doc["models"][name] = measure(name, args.windows)
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    md_path.write_text(render(doc))
    print(md_path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
