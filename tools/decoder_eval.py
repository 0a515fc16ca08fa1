#!/usr/bin/env python
"""Put every export of the decoder matrix through ``qnnpasses llm`` and hold it to transformers.

For each ok fixture of ``tools/decoder_matrix.py``'s matrix: ``qnnpasses llm`` builds the pair
(context 64, prefill 4, or 1 where the export computes only one new token at a time), the build's
CPU check against the original export is recorded, the build's fp16 probe of both graphs on the
HTP backend gives partitions and CPU nodes, and ``qnnpasses generate --on cpu`` generates after
the fixture's prompt; its tokens are compared with transformers' own greedy tokens.  Everything
runs through the command line, as a user runs it.

Writes ``docs/decoders.md`` and ``docs/decoders.json`` (``--docs DIR``).

Usage::

    python tools/decoder_matrix.py                     # the matrix, once (needs the export extra)
    python tools/decoder_eval.py [--matrix DIR] [--docs docs]
    python tools/decoder_eval.py --render-only      # decoders.md again from decoders.json
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MATRIX = Path.home() / ".cache" / "qnnpasses" / "decoders"
CONTEXT = 64
PREFILLS = (4, 1)


def load_entries(matrix: Path) -> list[dict[str, Any]]:
    """Every matrix entry (failed exports too), with absolute paths."""
    entries = json.loads((matrix / "matrix.json").read_text())["fixtures"]
    for entry in entries:
        entry["onnx_path"] = str(matrix / entry["onnx"])
    return entries


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qnnpasses.cli", *args], capture_output=True, text=True)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def evaluate(entry: dict[str, Any], work: Path) -> dict[str, Any]:
    """Build, probe and generate one matrix export; a dict of what happened (``ok``: all of it held)."""
    result: dict[str, Any] = {"name": entry["name"], "family": entry["family"], "attn": entry["attn"],
                              "exporter": entry["exporter"], "ok": False}
    if entry["status"] != "ok":
        return {**result, "stage": "export", "error": entry["reason"]}
    out = work / entry["name"]
    for prefill in PREFILLS:
        built = _run("llm", entry["onnx_path"], "--out-dir", str(out), "--context", str(CONTEXT),
                     "--prefill", str(prefill), "--no-compile")
        if built.returncode == 0 or "--prefill 1" not in built.stderr:
            break
    result["prefill"] = prefill
    if built.returncode != 0:
        return {**result, "stage": "build", "error": _last_line(built.stderr)}
    report = json.loads((out / "report.json").read_text())
    manifest = json.loads((out / "llm.json").read_text())
    check = report["verification"]
    parts = [p for graph in ("prefill", "decode") for p in report["htp"][graph]["parts"]]
    result.update(cpu_check_logits_max_abs=check["logits"], cpu_check_kv_max_abs=check["kv"],
                  cpu_check_ok=check["ok"], kv_dtype=manifest["kv_dtype"], reference_fed_by=check.get("reference_fed_by"),
                  htp_partitions=[p["qnn_partitions"] for p in parts], htp_cpu_nodes=[p["cpu_nodes"] for p in parts],
                  htp_ok=all((p["ok"], p["qnn_partitions"], p["cpu_nodes"]) == (True, 1, 0) for p in parts),
                  sliding_window=manifest.get("sliding_window", {}))
    generated = _run("generate", str(out), "--prompt-ids", ",".join(map(str, entry["prompt_ids"])),
                     "--max-new-tokens", str(len(entry["hf_tokens"])), "--on", "cpu", "--format", "json")
    if generated.returncode != 0:
        return {**result, "stage": "generate", "error": _last_line(generated.stderr)}
    tokens = json.loads(generated.stdout)["tokens"]
    leading = next((i for i, (a, b) in enumerate(zip(tokens, entry["hf_tokens"])) if a != b), len(tokens))
    result.update(tokens=tokens, hf_tokens=entry["hf_tokens"], identical_leading=leading,
                  ok=result["htp_ok"] and check["ok"] and tokens == entry["hf_tokens"], stage="done")
    return result


def _optimum_versions() -> str:
    """The pins of the Optimum venv (tools/optimum_export.py), as text."""
    sys.path.insert(0, str(ROOT / "tools"))
    import optimum_export

    return ", ".join(re.sub(r"\[.*?\]", "", r).replace("==", " ")
                     for r in optimum_export.REQUIREMENTS if r.startswith(("optimum", "transformers")))


def render(results: list[dict[str, Any]], versions: dict[str, str], seconds: float) -> str:
    ok = sum(r["ok"] for r in results)
    exporters = sorted({r["exporter"] for r in results})
    optimum = (f" Exporter `optimum`: `optimum-cli export onnx --task text-generation-with-past` in its own venv "
               f"({_optimum_versions()}; `tools/optimum_export.py`), on the same saved models."
               if "optimum" in exporters else "")
    lines = [
        "# Decoder families exported the default way, through `qnnpasses llm`",
        "",
        "Written by `python tools/decoder_eval.py` from the matrix of `python tools/decoder_matrix.py` "
        f"(tiny random-initialised decoders; {', '.join(f'{k} {v}' for k, v in versions.items())}); "
        f"every figure is in `docs/decoders.json`. Exporters: {', '.join(exporters)}.{optimum}",
        "",
        f"Each export (KV cache, Hugging Face names) is built at context {CONTEXT}: `prefill` is the "
        "largest of 4, 1 that the export computes (TorchScript's sdpa with grouped-query attention bakes "
        "its traced length into a Reshape). CPU check: the build's own comparison with the original "
        "export, fed by its Hugging Face names, over a chunked prompt and decode steps: max abs of the "
        "logits, and of the new K/V, which leave the graphs in float16 (the fp32 values rounded: the "
        "build's bound adds 2^-11 of their largest magnitude). HTP: both graphs' "
        "QNN partitions / CPU nodes in the build's fp16 probe. Tokens: `qnnpasses generate --on cpu` "
        "against transformers' greedy tokens after the same 12-token prompt (identical leading of "
        "20; the window of 8 of the sliding-window families is crossed). Local layers: "
        "`llm.json`'s `sliding_window`.",
        "",
        f"{ok} of {len(results)} exports generate transformers' tokens with both graphs entirely on the HTP.",
        "",
        "| export | prefill | CPU check: logits / new K/V max abs | HTP partitions / CPU nodes | tokens | "
        "local layers: window | result |",
        "|---|---:|---:|---|---:|---|---|",
    ]
    for r in results:
        if r.get("stage") in ("export", "build", "generate"):
            lines.append(f"| {r['name']} | {r.get('prefill', '-')} | - | - | - | - | {r['stage']} failed: "
                         f"{r['error'].replace('|', '/')} |")
            continue
        placement = ", ".join(f"{p}/{c}" for p, c in zip(r["htp_partitions"], r["htp_cpu_nodes"]))
        window = ", ".join(f"{k}: {v}" for k, v in r["sliding_window"].items()) or "-"
        check = f"{r['cpu_check_logits_max_abs']:.2g} / {r['cpu_check_kv_max_abs']:.2g}"
        lines.append(f"| {r['name']} | {r['prefill']} | {check} | {placement} | "
                     f"{r['identical_leading']}/{len(r['hf_tokens'])} | {window} | {'ok' if r['ok'] else 'differs'} |")
    lines += ["", "Random tied-embedding families (gemma, gpt2, smollm3) greedily repeat the last prompt token; "
              "their tokens say little, their CPU check against the export (itself within 1e-6 of torch, "
              "`onnx_vs_torch_max_abs` in the matrix) does.",
              "", f"Built and checked in {seconds:.0f} s on this host."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrix", type=Path, default=DEFAULT_MATRIX, help="the matrix folder")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs", help="where decoders.md/.json go")
    parser.add_argument("--render-only", action="store_true", help="rewrite decoders.md from decoders.json")
    args = parser.parse_args(argv)
    if args.render_only:
        stored = json.loads((args.docs / "decoders.json").read_text())
        (args.docs / "decoders.md").write_text(render(stored["results"], stored["versions"], stored["seconds"]))
        return 0
    matrix = args.matrix.expanduser()
    if not (matrix / "matrix.json").is_file():
        print(f"no matrix in {matrix}: run python tools/decoder_matrix.py --out {matrix}", file=sys.stderr)
        return 2
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="decoder-eval-") as work:
        results = [evaluate(entry, Path(work)) for entry in load_entries(matrix)]
    seconds = time.monotonic() - start
    versions = json.loads((matrix / "matrix.json").read_text()).get("versions", {})
    args.docs.mkdir(parents=True, exist_ok=True)
    (args.docs / "decoders.json").write_text(json.dumps({"versions": versions, "context": CONTEXT,
                                                         "seconds": round(seconds, 1), "results": results}, indent=1) + "\n")
    (args.docs / "decoders.md").write_text(render(results, versions, seconds))
    print(f"{sum(r['ok'] for r in results)} of {len(results)} ok; wrote {args.docs / 'decoders.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
