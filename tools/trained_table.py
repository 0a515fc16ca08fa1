"""The README's trained-weight table: SmolLM2-135M in fp16 on the HTP, raw export vs ``htp-llm`` output.

Runs, on the first ``--windows`` held-out windows of ``smollm2_135m.eval.npz`` (built by
``python tools/trained_fixtures.py build``):

* the fp32 reference (the torch run of the original, stored with the windows),
* the raw TorchScript export on the HTP (fp16),
* ``qnnpasses run --pipeline htp-llm`` of that export, on the HTP (fp16),

and writes every figure to ``docs/trained_smollm2.json`` and the table to
``docs/trained_smollm2.md``; ``tools/readme_figures.py`` puts the table into the README.

    python tools/trained_table.py                 # needs the trained fixtures and onnxruntime-qnn
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

from trained_fixtures import DEFAULT_CACHE, evaluate

MODEL = "smollm2_135m"


def measure(cache: Path, windows: int) -> dict:
    raw, data = cache / f"{MODEL}_ts.onnx", cache / f"{MODEL}.eval.npz"
    if not raw.exists() or not data.exists():
        raise SystemExit(f"{raw} or {data} missing: run python tools/trained_fixtures.py build --only {MODEL}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="trained_table_") as tmp:
        out = Path(tmp) / "htp_llm.onnx"
        subprocess.run([sys.executable, "-m", "qnnpasses.cli", "run", "--pipeline", "htp-llm", str(raw), "-o", str(out),
                        "-q"], check=True)
        raw_htp = evaluate(raw, data, "htp", windows)
        ours = evaluate(out, data, "htp", windows)
    # no paths of this machine in docs/
    raw_htp["model"], ours["model"] = raw.name, f"qnnpasses run --pipeline htp-llm {raw.name}"
    rows.append({"variant": "fp32 on CPU (reference)", "perplexity": raw_htp["reference_perplexity"], "top1": 1.0})
    rows.append({"variant": "raw export", "perplexity": raw_htp["perplexity"], "top1": raw_htp["top1_agreement"]})
    rows.append({"variant": "`htp-llm` output", "perplexity": ours["perplexity"], "top1": ours["top1_agreement"]})
    return {"model": MODEL, "windows": raw_htp["windows"], "tokens_per_window": raw_htp["tokens"] // raw_htp["windows"],
            "on": "htp (fp16)", "rows": rows, "raw": raw_htp, "htp_llm": ours}


def render(result: dict) -> str:
    lines = ["| SmolLM2-135M on real English text | perplexity | top-1 agreement with fp32 |", "|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['variant']} | {row['perplexity']:,.2f} | {100 * row['top1']:.1f}% |"
                     if row["perplexity"] < 10_000 else
                     f"| {row['variant']} | {row['perplexity']:,.0f} | {100 * row['top1']:.1f}% |")
    lines += ["", (f"({result['windows']} held-out windows of {result['tokens_per_window']} tokens; "
                   f"`python tools/trained_table.py`.)")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "trained_smollm2")
    args = parser.parse_args(argv)
    result = measure(args.cache, args.windows)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(render(result) + "\n")
    print(render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
