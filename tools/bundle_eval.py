#!/usr/bin/env python
"""What the 8-bit bundles cost and whether their runtimes agree: docs/llm_bundles.md / .json.

Trained SmolLM2-135M as a user's Hugging Face folder (``tools/trained_fixtures.py``, exporter
``hf``: transformers' default attention, TorchScript KV export) goes through ``qnnpasses llm``
three times at the same context and prefill: our bundle (float16 cache), ``--bundle genai`` (uint8
cache, key transposed, per-layer scales calibrated on the built-in text) and ``--bundle genie``
(the same cache, Genie's inputs, compiled: Genie loads context binaries).  For each:

* teacher-forced top-1 agreement with the original export (fp32, onnxruntime CPU) on held-out
  English windows (``smollm2_135m.eval.npz``): the first 16 tokens as the prompt, every later
  position scored, on onnxruntime CPU and on the simulated HTP (the ``.onnx`` graphs, fp16 mode,
  CPU fallback off);
* greedy generation of transformers' prompt ("The capital of France is") against transformers'
  own greedy tokens;
* for the genai bundle: onnxruntime-genai itself (CPU provider, the release the test extra pins)
  on the same prompt, against ``qnnpasses generate --on cpu``;
* for the Genie bundle: Genie itself (``libGenie.so`` from onnxruntime-qnn, the simulated HTP) on
  the same prompt, against transformers and ``qnnpasses generate --on htp`` (the same binaries).

    python tools/bundle_eval.py                   # context 64, prefill 16, 4 windows (about 10 min)
    python tools/bundle_eval.py --context 256 --prefill 32 --windows 8
    python tools/bundle_eval.py --bundles genie   # remeasure one bundle, keep the others' rows
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 16
BUNDLES = ("qnnpasses", "genai", "genie")


def _kept_rows(path: Path, args, wanted: list[str]) -> dict:
    """The rows of the bundles not measured now, from the JSON an earlier run wrote with the same settings."""
    rest = [b for b in BUNDLES if b not in wanted]
    if not rest:
        return {}
    data = json.loads(path.read_text()) if path.is_file() else {}
    same = all(data.get(k) == getattr(args, k) for k in ("context", "prefill", "windows"))
    rows = {r["bundle"]: r for r in data.get("rows", [])}
    if not same or any(b not in rows for b in rest):
        raise SystemExit(f"{path} has no rows for {', '.join(rest)} at these settings: measure all bundles")
    return rows


def teacher_forced(runner, reference, windows: np.ndarray, length: int) -> list[float]:
    agree = []
    for row in windows:
        seq = [int(t) for t in row[:length]]
        got = runner.score(seq[:PROMPT_TOKENS], seq[PROMPT_TOKENS:]).argmax(-1)
        want = reference.logits(seq).argmax(-1)
        agree.append(float((got == want).mean()))
    return agree


def measure(folder: Path, bundle: str, args, work: Path, windows: np.ndarray, hf: dict) -> dict:
    from qnnpasses.backends.htp import htp_available
    from qnnpasses.llm import genai, genie
    from qnnpasses.llm.convert import build
    from qnnpasses.llm.reference import ReferenceModel, leading_matches
    from qnnpasses.llm.runner import Runner

    out = work / bundle
    start = time.monotonic()
    compiled = bundle == "genie" and htp_available()  # Genie loads context binaries
    manifest = build(folder, out, context=args.context, prefill=args.prefill, compile=compiled, probe=False,
                     bundle=bundle)
    seconds = time.monotonic() - start
    report = json.loads((out / "report.json").read_text())
    reference = ReferenceModel(folder / "model.onnx")
    length = args.context - 1
    result: dict = {"bundle": bundle, "kv_dtype": manifest["kv_dtype"], "kv_layout": manifest["kv_layout"],
                    "build_seconds": round(seconds, 1), "kv_cache_bytes": manifest["device"]["kv_cache_bytes"],
                    "float_check": {k: report["verification"][k] for k in ("logits", "kv", "ok")}}
    if bundle != "qnnpasses":
        result["calibration"] = report["bundle"]
        result["bundle_check"] = {k: report["bundle_verification"][k] for k in ("logits", "kv", "kv_scale", "top1")}
    ons = ["cpu"] + (["htp"] if htp_available() else [])
    for on in ons:
        runner = Runner(out, on=on)
        agree = teacher_forced(runner, reference, windows, length)
        tokens = runner.generate(hf["prompt_ids"], len(hf["greedy"])).tokens
        result[on] = {"teacher_forced_top1": agree, "teacher_forced_top1_mean": float(np.mean(agree)),
                      "positions": int(len(windows) * (length - PROMPT_TOKENS + 1)),
                      "transformers_leading": leading_matches(tokens, hf["greedy"]), "transformers_tokens": len(hf["greedy"])}
        if on == "cpu" and bundle == "genai":
            theirs = genai.generate(out, runner.manifest, hf["prompt_ids"], len(hf["greedy"]))
            result["onnxruntime_genai"] = {"runtime": theirs["runtime"], "tokens": len(theirs["tokens"]),
                                           "same_as_ours": theirs["tokens"] == tokens[:len(theirs["tokens"])]}
        if on == "htp" and compiled and genie.library_path() is not None:
            theirs = genie.generate(out, runner.manifest, hf["prompt_ids"], len(hf["greedy"]))
            result["genie"] = {"runtime": theirs["runtime"], "tokens": len(theirs["tokens"]),
                               "same_as_ours": theirs["tokens"] == tokens[:len(theirs["tokens"])],
                               "transformers_leading": leading_matches(theirs["tokens"], hf["greedy"])}
    return result


def markdown(data: dict) -> str:
    lines = ["# Bundles for other runtimes: what the 8-bit cache costs", "",
             f"Written by `python tools/bundle_eval.py --context {data['context']} --prefill {data['prefill']} "
             f"--windows {data['windows']}` (all figures in `docs/llm_bundles.json`).", "",
             f"Trained SmolLM2-135M given as a Hugging Face folder (transformers' default attention, TorchScript "
             f"KV export), context {data['context']}, prefill {data['prefill']}.  Teacher-forced top-1: agreement "
             f"of each bundle's argmax with the original export's (fp32, onnxruntime CPU) at every position after "
             f"a {PROMPT_TOKENS}-token prompt, on {data['windows']} held-out English windows; HTP: the simulated "
             "HTP backend, fp16 mode, the `.onnx` graphs, CPU fallback off.  Greedy: leading tokens equal to "
             f"transformers' own greedy generation of \"{data['prompt']}\" (the Genie bundle on the HTP: its "
             "compiled context binaries).", "",
             "| bundle | KV cache | KV bytes | top-1 CPU | top-1 HTP | greedy CPU | greedy HTP |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for row in data["rows"]:
        cpu, htp = row["cpu"], row.get("htp")
        layout = "/".join(sorted(set(row["kv_layout"].values())))
        top1 = [f"{cpu['teacher_forced_top1_mean']:.1%}", f"{htp['teacher_forced_top1_mean']:.1%}" if htp else "-"]
        greedy = [f"{r['transformers_leading']}/{r['transformers_tokens']}" if r else "-" for r in (cpu, htp)]
        lines.append(f"| {row['bundle']} | {row['kv_dtype']} {layout} | {row['kv_cache_bytes']:,} | "
                     + " | ".join(top1 + greedy) + " |")
    genai = next(r for r in data["rows"] if r["bundle"] == "genai")
    og = genai["onnxruntime_genai"]
    cal = genai["calibration"]
    lines += ["", f"The genai bundle's per-layer scales come from the original's cache on {cal['calibration_tokens']} "
              f"tokens of `{cal['calibration']}` calibration (largest key {max(cal['kv_max']['key_max']):.1f}, "
              f"value {max(cal['kv_max']['value_max']):.2f}).  {og['runtime']} on the CPU generated "
              f"{og['tokens']} tokens from the same prompt, {'the same as' if og['same_as_ours'] else 'NOT the same as'} "
              "`qnnpasses generate --on cpu` on the bundle."]
    genie = next((r.get("genie") for r in data["rows"] if r["bundle"] == "genie"), None)
    if genie:
        lines += ["", f"Genie itself ({genie['runtime']}, `libGenie.so` from onnxruntime-qnn, on the simulated HTP with "
                  f"its own cache, mask and rotary, given the prompt's token ids) generated {genie['tokens']} tokens "
                  f"from the same prompt (it ends at the end of sequence without handing that token over), "
                  f"{genie['transformers_leading']} of them leading tokens equal to transformers', "
                  f"{'the same as' if genie['same_as_ours'] else 'NOT the same as'} `qnnpasses generate --on htp` on "
                  "the same binaries."]
    else:
        lines += ["", "Genie was not run (no HTP backend or no libGenie.so)."]
    return "\n".join(lines + [""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=16)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "llm_bundles.md")
    parser.add_argument("--bundles", default=",".join(BUNDLES),
                        help="bundles to measure (comma-separated); the others' rows are kept from the JSON written before")
    args = parser.parse_args(argv)
    wanted = [b for b in args.bundles.split(",") if b]
    if not wanted or any(b not in BUNDLES for b in wanted):
        parser.error(f"--bundles takes some of {', '.join(BUNDLES)}")
    kept = _kept_rows(args.out.with_suffix(".json"), args, wanted)
    sys.path.insert(0, str(ROOT / "tools"))
    import trained_fixtures as tf

    import qnnpasses.passes  # noqa: F401 - registers the passes

    record = tf.ensure_built("smollm2_135m", tf.HF_EXPORTER)
    hf = record["exports"][tf.HF_EXPORTER]["text"]
    folder = tf.hf_model_path(tf.SPECS["smollm2_135m"], tf.DEFAULT_CACHE).parent
    with np.load(tf.DEFAULT_CACHE / "smollm2_135m.eval.npz") as data:
        windows = data["input_ids"][:args.windows]
    with tempfile.TemporaryDirectory() as tmp:
        measured = {bundle: measure(folder, bundle, args, Path(tmp), windows, hf) for bundle in wanted}
    rows = [measured.get(bundle) or kept[bundle] for bundle in BUNDLES]
    data = {"model": "SmolLM2-135M (hf export)", "context": args.context, "prefill": args.prefill,
            "windows": args.windows, "prompt": hf["prompt"], "rows": rows}
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    args.out.write_text(markdown(data))
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
