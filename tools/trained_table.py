"""Trained-weight tables: a trained model in fp16 on the HTP, raw export vs the pipelines' outputs.

Runs, on the first ``--windows`` held-out windows of ``MODEL.eval.npz`` (built by
``python tools/trained_fixtures.py build --only MODEL``):

* the fp32 reference (the torch run of the original, stored with the windows),
* the raw TorchScript export on the HTP (fp16),
* ``qnnpasses run --pipeline P`` of that export, on the HTP (fp16), for each of ``--pipelines``,

and writes every figure to ``docs/trained_NAME.json`` and the table to ``docs/trained_NAME.md``;
``tools/readme_figures.py`` puts SmolLM2's table into the README.

    python tools/trained_table.py                 # SmolLM2-135M; needs the trained fixtures and onnxruntime-qnn
    python tools/trained_table.py --model gemma3_270m --pipelines htp-llm,htp-llm-fp16 --windows 8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from trained_fixtures import DEFAULT_CACHE, SPECS, evaluate

MODEL = "smollm2_135m"
#: how the tables name the models, and the docs/ file each writes
TITLES = {name: (SPECS[name].title, doc)
          for name, doc in (("smollm2_135m", "trained_smollm2"), ("gemma3_270m", "trained_gemma3"))}


def measure(cache: Path, windows: int, model: str = MODEL, pipelines: tuple[str, ...] = ("htp-llm",)) -> dict:
    raw, data = cache / f"{model}_ts.onnx", cache / f"{model}.eval.npz"
    if not raw.exists() or not data.exists():
        raise SystemExit(f"{raw} or {data} missing: run python tools/trained_fixtures.py build --only {model}")
    rows, results = [], {}
    with tempfile.TemporaryDirectory(prefix="trained_table_") as tmp:
        raw_htp = evaluate(raw, data, "htp", windows)
        raw_htp["model"] = raw.name  # no paths of this machine in docs/
        for pipeline in pipelines:
            out = Path(tmp) / f"{pipeline}.onnx"
            subprocess.run([sys.executable, "-m", "qnnpasses.cli", "run", "--pipeline", pipeline, str(raw), "-o", str(out),
                            "-q"], check=True)
            results[pipeline] = evaluate(out, data, "htp", windows)
            results[pipeline]["model"] = f"qnnpasses run --pipeline {pipeline} {raw.name}"
    rows.append({"variant": "fp32 on CPU (reference)", "perplexity": raw_htp["reference_perplexity"], "top1": 1.0})
    rows.append({"variant": "raw export", "perplexity": raw_htp["perplexity"], "top1": raw_htp["top1_agreement"]})
    for pipeline, ours in results.items():
        rows.append({"variant": f"`{pipeline}` output", "perplexity": ours["perplexity"], "top1": ours["top1_agreement"]})
    result = {"model": model, "windows": raw_htp["windows"], "tokens_per_window": raw_htp["tokens"] // raw_htp["windows"],
              "on": "htp (fp16)", "rows": rows, "raw": raw_htp}
    result.update({pipeline.replace("-", "_"): ours for pipeline, ours in results.items()})
    return result


def render(result: dict) -> str:
    title = TITLES.get(result["model"], (result["model"], ""))[0]
    lines = [f"| {title} on real English text | perplexity | top-1 agreement with fp32 |", "|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['variant']} | {row['perplexity']:,.2f} | {100 * row['top1']:.1f}% |"
                     if row["perplexity"] < 10_000 else
                     f"| {row['variant']} | {row['perplexity']:,.0f} | {100 * row['top1']:.1f}% |")
    command = "python tools/trained_table.py"
    if result["model"] != MODEL:
        shown = ",".join(r["variant"].strip("`").removesuffix("` output") for r in result["rows"][2:])
        command += f" --model {result['model']} --pipelines {shown} --windows {result['windows']}"
    lines += ["", f"({result['windows']} held-out windows of {result['tokens_per_window']} tokens; `{command}`.)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--model", choices=sorted(TITLES), default=MODEL)
    parser.add_argument("--pipelines", default="htp-llm", help="comma-separated pipelines, one row each")
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--out", type=Path, help="docs/trained_NAME (.json and .md); default from --model")
    args = parser.parse_args(argv)
    result = measure(args.cache, args.windows, args.model, tuple(args.pipelines.split(",")))
    args.out = args.out or ROOT / "docs" / TITLES[args.model][1]
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(render(result) + "\n")
    print(render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
