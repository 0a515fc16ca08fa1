#!/usr/bin/env python
"""What `qnnpasses llm` costs at the sizes users ship: time, memory and bytes at context 4096.

For each shape below (the published configs of Qwen2.5-0.5B, Llama-3.2-1B and Qwen2.5-1.5B,
embeddings tied as in the originals) a random-init model is built with transformers' defaults
(sdpa attention, float32) and exported the way users export a decoder with a KV cache:
TorchScript, ``dynamo=False``, a dynamic past (``tools/decoder_matrix.py``'s wrapper and axes).
Exports are cached under ``~/.cache/qnnpasses/sizes``.  Then ``qnnpasses llm EXPORT --context C
--prefill P`` runs in a child process, and the tool records:

* wall seconds of the build;
* memory: the build's own sampled peak of private memory (``report.json``'s ``memory``), the
  kernel's peak resident set of the build process and of its largest child (an HTP compile or
  probe), all against the export's weight bytes;
* bytes: the bundle on disk (every file the build wrote), what the device must hold (compiled
  contexts and KV cache, ``report.json``'s ``device``), the model's unique parameter bytes in
  the bundle's weight dtype, and the bytes one decode step reads.

Figures go to ``docs/bench_sizes.json`` (one entry per shape, precision, context and prefill,
merged with earlier runs) and ``docs/bench_sizes.md``, written from the JSON.

    python tools/bench_sizes.py --shapes qwen2.5-0.5b                   # fp16, context 4096
    python tools/bench_sizes.py --shapes qwen2.5-0.5b --precision w4a16
    python tools/bench_sizes.py --shapes qwen2.5-0.5b --max-part-bytes 512M  # parts: less build memory
    python tools/bench_sizes.py --shapes qwen2.5-0.5b --memory-limit 1.5   # in a cgroup of 1.5x the export
    python tools/bench_sizes.py --doc-only                              # rewrite the .md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("QNNPASSES_CACHE", Path.home() / ".cache" / "qnnpasses")) / "sizes"
DOC_JSON, DOC_MD = ROOT / "docs" / "bench_sizes.json", ROOT / "docs" / "bench_sizes.md"

# (model_type, config) from the published config.json of each model.
SHAPES: dict[str, tuple[str, dict]] = {
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                   num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                                   max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                   tie_word_embeddings=True)),
    "llama-3.2-1b": ("llama", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                                   num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                                   max_position_embeddings=131072, rms_norm_eps=1e-5, head_dim=64,
                                   tie_word_embeddings=True,
                                   rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0,
                                                        high_freq_factor=4.0, low_freq_factor=1.0,
                                                        original_max_position_embeddings=8192))),
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                                   num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                                   max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                   tie_word_embeddings=True)),
}
GIB = 1024 ** 3


# --------------------------------------------------------------------------- export


def export_path(shape: str) -> Path:
    return CACHE / shape / "model.onnx"


def export(shape: str) -> tuple[Path, dict]:
    """The cached TorchScript export of ``shape`` (written on first use) and its parameter counts."""
    path, facts_path = export_path(shape), export_path(shape).with_name("facts.json")
    if path.exists() and facts_path.exists():
        return path, json.loads(facts_path.read_text())
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "tools"))
    import decoder_matrix as dm
    import export_fixtures as ef

    family, config = SHAPES[shape]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **config)).eval()
    unique = {id(p): p for p in model.parameters()}
    facts = {"model_type": family, "parameters": sum(p.numel() for p in unique.values()),
             "tied_embedding": bool(model.config.tie_word_embeddings),
             "attn_implementation": model.config._attn_implementation}
    path.parent.mkdir(parents=True, exist_ok=True)
    wrapper = ef.ExportWrapper(model, dm.kv_spec(model)).eval()
    prompt = torch.randint(10, config["vocab_size"], (1, dm.PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    inputs, outputs = dm.example_io(model, prompt)
    started = time.perf_counter()
    with ef.quiet(), torch.no_grad():
        ef.export_ts(wrapper, inputs, outputs, path, dm.ts_axes(inputs, outputs))
    facts["export_seconds"] = round(time.perf_counter() - started, 1)
    facts_path.write_text(json.dumps(facts, indent=1) + "\n")
    return path, facts


def weight_bytes_on_disk(onnx_path: Path) -> int:
    """Bytes of the export's weights: every file beside the graph plus the graph file."""
    return sum(p.stat().st_size for p in onnx_path.parent.iterdir() if p.is_file() and p.name != "facts.json")


# --------------------------------------------------------------------------- build


class MemoryCgroup:
    """A memory cgroup (v2, or v1's memory controller) capping the build's child at ``limit`` bytes,
    page cache included: the kernel drops clean pages of mapped weight files before it kills, so a
    build that finishes inside it needed no more than ``limit`` of memory it could not give back.
    No swap here (and v1's swap limit is set too), so nothing private escapes the count."""

    def __init__(self, limit: int):
        self.limit = limit
        root = Path("/sys/fs/cgroup")
        v1 = root / "memory"
        self.version = "v1" if (v1 / "memory.limit_in_bytes").exists() else "v2"
        self.path = (v1 if self.version == "v1" else root) / f"qnnpasses-bench-{os.getpid()}"
        try:
            self.path.mkdir()
            if self.version == "v1":
                (self.path / "memory.limit_in_bytes").write_text(str(limit))
                if (self.path / "memory.memsw.limit_in_bytes").exists():
                    (self.path / "memory.memsw.limit_in_bytes").write_text(str(limit))
            else:
                (self.path / "memory.max").write_text(str(limit))
                (self.path / "memory.swap.max").write_text("0")
        except OSError as exc:
            self.close()
            raise SystemExit(f"bench_sizes: cannot make a memory cgroup at {self.path} ({exc.strerror}): "
                             f"--memory-limit needs a writable cgroup file system (root)") from None

    def enter(self) -> None:
        """Called in the child before it runs the build (``preexec_fn``)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def figures(self) -> dict:
        def read(name: str) -> str:
            f = self.path / name
            return f.read_text() if f.exists() else ""

        events = read("memory.oom_control" if self.version == "v1" else "memory.events")
        kills = next((int(line.split()[1]) for line in events.splitlines() if line.startswith("oom_kill ")), None)
        peak = read("memory.max_usage_in_bytes" if self.version == "v1" else "memory.peak").strip()
        return {"limit_bytes": self.limit, "cgroup": self.version, "max_usage_bytes": int(peak) if peak else None,
                "oom_kills": kills}

    def close(self) -> None:
        if self.path.exists():
            self.path.rmdir()


def build(onnx_path: Path, out_dir: Path, context: int, prefill: int, precision: str,
          compile_: bool, max_part_bytes: str | None = None, memory_limit: int | None = None,
          int4_blocks: str | None = None) -> dict:
    """Run ``qnnpasses llm`` in a child; wall time, the kernel's peak RSS of the child tree; with
    ``memory_limit`` the child runs in a :class:`MemoryCgroup` of that many bytes."""
    command = [sys.executable, "-c", "import sys; from qnnpasses.cli import main; sys.exit(main())", "llm",
               str(onnx_path), "--out-dir", str(out_dir), "--context", str(context), "--prefill", str(prefill),
               "--precision", precision, "--format", "json"]
    if not compile_:
        command.append("--no-compile")
    if max_part_bytes:
        command += ["--max-part-bytes", max_part_bytes]
    if int4_blocks:
        command += ["--int4-blocks", int4_blocks]
    if precision != "fp16":
        command += ["--calib", str(calibration(onnx_path))]
    cgroup = MemoryCgroup(memory_limit) if memory_limit else None
    started = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    try:
        run = subprocess.run(command, capture_output=True, text=True, preexec_fn=cgroup.enter if cgroup else None)
        wall = time.perf_counter() - started
        limited = cgroup.figures() if cgroup else None
    finally:
        if cgroup:
            cgroup.close()
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    result = {"exit": run.returncode, "wall_seconds": round(wall, 1),
              "tree_resident_peak_bytes": peak if peak > before * 1024 else None}
    if limited:
        result["memory_limit"] = limited
    if run.returncode != 0:
        result["error"] = (run.stderr.strip().splitlines() or [f"killed by signal {-run.returncode}"])[-1]
    return result


def calibration(onnx_path: Path) -> Path:
    """Seeded random token ids [4, 256] for a quantized build of a random-init model (it has no
    tokenizer and no text to prefer), written once beside the export."""
    import numpy as np

    path = onnx_path.with_name("calib.npy")
    if not path.exists():
        vocab = SHAPES[onnx_path.parent.name][1]["vocab_size"]
        np.save(path, np.random.default_rng(0).integers(0, vocab, (4, 256), dtype=np.int64))
    return path


def bundle_figures(out_dir: Path) -> dict:
    report = json.loads((out_dir / "report.json").read_text())
    manifest = json.loads((out_dir / "llm.json").read_text())
    files = {p.name: p.stat().st_size for p in out_dir.iterdir() if p.is_file()}
    device = report.get("device") or {}
    return {"bundle_bytes": sum(files.values()), "files": files, "memory": report.get("memory"),
            "parts": {name: len(g["parts"]) for name, g in manifest["graphs"].items()},
            "weights_file": report.get("weights_file"), "weight_sharing": manifest.get("weight_sharing"),
            "device": {k: device.get(k) for k in ("device_bytes", "kv_cache_bytes", "decode_step_read_bytes",
                                                  "prefill_call_read_bytes", "weights_from", "target",
                                                  "decode_tokens_per_second_ceiling")},
            "graph_weight_bytes": {name: g.get("weight_bytes") for name, g in (device.get("graphs") or {}).items()},
            "check": check_figures(report, manifest), "seconds": report.get("seconds"),
            **_int4_grid(report.get("quantization") or {})}


def _int4_grid(quantization: dict) -> dict:
    """A w4a16 build's int4 grid and who chose it (the build's probe of the HTP, or the default)."""
    if "int4_block_rows" not in quantization:
        return {}
    return {"int4": {"block_rows": quantization["int4_block_rows"],
                     "chosen_by": (quantization.get("int4_blocks") or {}).get("chosen_by")}}


def check_figures(report: dict, manifest: dict) -> dict:
    """The build's own CPU check of the static pair against the export (float pair; the quantized one
    is recorded, not bounded): prompt length and prefill calls, worst logits and K/V differences."""
    out = {}
    for kind in ("verification", "quantized_verification"):
        check = report.get(kind)
        if check:
            out[kind] = {"prompt_tokens": check.get("prompt_tokens"), "new_tokens": check.get("new_tokens"),
                         "prefill_calls": -(-check["prompt_tokens"] // manifest["prefill"])
                         if check.get("prompt_tokens") else None,
                         "logits_max_abs": check.get("logits"), "kv_max_abs": check.get("kv"),
                         "bounds": check.get("bounds"), "ok": check.get("ok"), "top1": check.get("top1")}
    return out


def measure(shape: str, context: int, prefill: int, precision: str, compile_: bool, keep: Path | None,
            max_part_bytes: str | None = None, limit_factor: float | None = None, int4_blocks: str | None = None) -> dict:
    onnx_path, facts = export(shape)
    entry = {"shape": shape, "precision": precision, "context": context, "prefill": prefill, "compiled": compile_,
             "max_part_bytes": max_part_bytes, **({"int4_blocks": int4_blocks} if int4_blocks else {}), **facts,
             "export_bytes": weight_bytes_on_disk(onnx_path)}
    limit = None
    if limit_factor:
        entry["memory_limit_factor"] = limit_factor
        limit = int(limit_factor * entry["export_bytes"])
    with tempfile.TemporaryDirectory(prefix="bench_sizes.") as tmp:
        out_dir = keep or Path(tmp) / "bundle"
        entry.update(build(onnx_path, out_dir, context, prefill, precision, compile_, max_part_bytes, limit,
                           int4_blocks))
        if entry["exit"] == 0:
            entry.update(bundle_figures(out_dir))
    return entry


# --------------------------------------------------------------------------- docs


def key(entry: dict) -> tuple:
    return (entry["shape"], entry["precision"], entry["context"], entry["prefill"], entry["compiled"],
            entry.get("max_part_bytes") or "", entry.get("memory_limit_factor") or 0, entry.get("int4_blocks") or "")


def precision(entry: dict) -> str:
    """The precision as the tables show it, with a w4a16 build's int4 grid: ``--int4-blocks`` as
    given, else what the build chose (and whether its probe of the HTP chose it); builds made before
    the grid was recorded had the default of then, blocks of 32."""
    if entry["precision"] != "w4a16":
        return entry["precision"]
    blocks = entry.get("int4_blocks")
    if blocks:
        return f"w4a16 (int4 {'per channel' if blocks == 'none' else 'blocks of ' + blocks})"
    chosen = entry.get("int4") or {"block_rows": 32}
    rows = chosen["block_rows"]
    grid = "per channel" if rows == "per channel" else f"blocks of {rows}"
    by = ": the HTP's choice" if chosen.get("chosen_by") == "probe" else ""
    return f"w4a16 (int4 {grid}{by})"


def merge(entries: list[dict]) -> dict:
    doc = json.loads(DOC_JSON.read_text()) if DOC_JSON.exists() else {"entries": []}
    fresh = {key(e): e for e in entries}
    doc["entries"] = [e for e in doc["entries"] if key(e) not in fresh] + list(fresh.values())
    doc["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version()}
    return doc


def unlimited(doc: dict) -> list[dict]:
    """The entries built without ``--memory-limit`` (those go to :func:`limit_table` only)."""
    return [e for e in sorted(doc["entries"], key=key) if not e.get("memory_limit_factor")]


def gib(value) -> str:
    return f"{value / GIB:.2f}" if value else "-"


def part_count(entry: dict) -> int:
    """The most parts a graph of the build was split into (1: unsplit)."""
    return max((entry.get("parts") or {"": 1}).values())


def parts_cell(entry: dict) -> str:
    """The part count, with the ``--max-part-bytes`` limit the build was given."""
    limit = entry.get("max_part_bytes")
    return f"{part_count(entry)}" + (f" (≤ {limit})" if limit else "")


def write_markdown(doc: dict) -> str:
    lines = ["# Real model sizes: time, memory and bytes of `qnnpasses llm`", "",
             "Written by `python tools/bench_sizes.py` from `docs/bench_sizes.json`.  Random-init models with "
             "the published shapes (tied embeddings as in the originals), transformers' default attention, "
             "exported by TorchScript with a dynamic KV cache, float32.  Peak memory: the build's sampled "
             "private memory, the largest compile child's (QNN preparing one graph or part), and the kernel's "
             "resident peak of the whole build (largest process, mapped weight files included); "
             f"{doc['machine']['cpus']} CPUs.  GiB throughout.", "",
             "| shape | params | precision | context / prefill | compiled | parts | wall min | export GiB | private peak "
             "| compile child private peak | resident peak | peak / export | bundle GiB | .onnx weights / params (fp32) | device GiB "
             "| device / params (fp16) | decode step reads |",
             "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for e in unlimited(doc):
        if e["exit"] != 0:
            lines.append(f"| {e['shape']} | {e['parameters'] / 1e6:.0f} M | {precision(e)} | {e['context']} / "
                         f"{e['prefill']} | {'yes' if e['compiled'] else 'no'} | | {e['wall_seconds'] / 60:.1f} | "
                         f"{gib(e['export_bytes'])} | failed: {e.get('error', '?')} | | | | | | | | | |")
            continue
        memory, device = e.get("memory") or {}, e.get("device") or {}
        resident = max(filter(None, [memory.get("resident_peak_bytes"), e.get("tree_resident_peak_bytes")]), default=0)
        onnx_weights = (e.get("weights_file") or {}).get("bytes_after")
        params_fp32, params_fp16 = e["parameters"] * 4, e["parameters"] * 2
        onnx_ratio = f"{onnx_weights / params_fp32:.2f}×" if onnx_weights else "-"
        held = device.get("device_bytes")
        device_ratio = f"{held / params_fp16:.2f}×" if held else "-"
        lines.append(
            f"| {e['shape']} | {e['parameters'] / 1e6:.0f} M | {precision(e)} | {e['context']} / {e['prefill']} | "
            f"{'yes' if e['compiled'] else 'no'} | {parts_cell(e)} | {e['wall_seconds'] / 60:.1f} | "
            f"{gib(e['export_bytes'])} | {gib(memory.get('private_peak_bytes'))} | "
            f"{gib(memory.get('compile_private_peak_bytes'))} | "
            f"{gib(resident)} | {resident / e['export_bytes']:.2f}× | {gib(e['bundle_bytes'])} | {onnx_ratio} | "
            f"{gib(held)} | {device_ratio} | {gib(device.get('decode_step_read_bytes'))} |")
    lines += limit_table(doc)
    lines += check_table(doc)
    lines += ceilings_table(doc)
    return "\n".join(lines) + "\n"


def limit_table(doc: dict) -> list[str]:
    """Builds run inside a memory cgroup (``--memory-limit``): whether they finished within it."""
    limited = [e for e in sorted(doc["entries"], key=key) if e.get("memory_limit_factor")]
    if not limited:
        return []
    lines = ["", "## Inside a memory limit", "",
             "The build's child in a memory cgroup of the given multiple of the export's weight bytes, page cache "
             "included (`--memory-limit`; no swap on this machine): the kernel drops clean pages of the mapped "
             "weight files before it kills, so a build that finishes needed no more memory than the limit.  A page "
             "is charged to the group that first read it: the export's pages cached by an earlier run count "
             "elsewhere, what the build allocates and the files it writes count here.", "",
             "| shape | precision | context / prefill | compiled | parts | limit × export | limit GiB | outcome | "
             "cgroup peak GiB | private peak | compile child private peak | wall min |",
             "|---|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for e in limited:
        limit = e.get("memory_limit") or {}
        kills = limit.get("oom_kills")
        outcome = "finished" if e["exit"] == 0 else f"failed ({'killed for memory' if kills else e.get('error', '?')})"
        memory = e.get("memory") or {}
        lines.append(f"| {e['shape']} | {precision(e)} | {e['context']} / {e['prefill']} | "
                     f"{'yes' if e['compiled'] else 'no'} | {parts_cell(e)} | {e['memory_limit_factor']:g}× | "
                     f"{gib(limit.get('limit_bytes'))} | {outcome} | {gib(limit.get('max_usage_bytes'))} | "
                     f"{gib(memory.get('private_peak_bytes'))} | {gib(memory.get('compile_private_peak_bytes'))} | "
                     f"{e['wall_seconds'] / 60:.1f} |")
    return lines


def check_table(doc: dict) -> list[str]:
    """The build's CPU check at each size: the static pair against the export over a prompt of several
    prefill calls and then decode steps (a quantized pair's figures are recorded, not held to a bound)."""
    built = [e for e in unlimited(doc) if e["exit"] == 0 and e.get("check")]
    if not built:
        return []
    lines = ["", "## The build's CPU check at this size", "",
             "`qnnpasses llm` runs the static pair against the export on onnxruntime CPU: a prompt of seeded "
             "random ids in prefill calls (the last one padded), then decode steps; logits and new K/V are held "
             "to the float pair's bound (a quantized pair's figures are recorded: its top-1 is the share of "
             "positions whose argmax is the export's).", "",
             "| shape | precision | parts | pair | prompt tokens (prefill calls) | decode steps | logits max abs (bound) "
             "| K/V max abs (bound) | top-1 | ok |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for e in built:
        parts = part_count(e)
        for kind, label in (("verification", "float"), ("quantized_verification", precision(e))):
            c = e["check"].get(kind)
            if not c:
                continue
            bounds = c.get("bounds") or {}
            cell = (lambda k: f"{c[k + '_max_abs']:.2g}" + (f" ({bounds[k]:.2g})" if k in bounds else ""))
            ok = {True: "yes", False: "no", None: "recorded"}[c.get("ok")]
            lines.append(f"| {e['shape']} | {precision(e)} | {parts} | {label} | {c['prompt_tokens']} "
                         f"({c['prefill_calls']}) | {c['new_tokens'] - 1} | {cell('logits')} | {cell('kv')} | "
                         f"{c['top1'] * 100:.1f}% | {ok} |")
    return lines


def ceilings_table(doc: dict) -> list[str]:
    """Per build and Snapdragon of known bandwidth: the decode tokens/s and the shortest prefill
    call its memory bandwidth allows for the bytes the bundle reads (qnnpasses.llm.footprint)."""
    from qnnpasses.llm.footprint import ceilings

    built = [e for e in unlimited(doc) if e["exit"] == 0 and (e.get("device") or {}).get("decode_step_read_bytes")]
    if not built:
        return []
    lines = ["", "## What the memory bandwidth allows on each Snapdragon", "",
             "Ceilings, not measurements: a decode step reads the decode graph's compiled weights and the whole "
             "KV cache, a prefill call the prefill graph's and the cache, at the SoC's peak LPDDR rate "
             "(`qnnpasses/backends/targets.py` cites them).  Compute is not bounded here.", "",
             "| shape | precision | parts | " + " | ".join(r["product"] for r in ceilings(1, 1)) + " |",
             "|---|---|---:|" + "---:|" * len(ceilings(1, 1))]
    for e in built:
        device = e["device"]
        prefill = device.get("prefill_call_read_bytes")
        rows = ceilings(device["decode_step_read_bytes"], prefill or 1)
        cells = [f"{r['decode_tokens_per_second']:.1f} tok/s" + (f", prefill ≥ {r['prefill_call_seconds'] * 1e3:.0f} ms"
                                                                  if prefill else "") for r in rows]
        parts = part_count(e)
        lines.append(f"| {e['shape']} | {precision(e)} | {parts} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["qwen2.5-0.5b"])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--prefill", type=int, default=128)
    parser.add_argument("--precision", choices=("fp16", "w8a16", "w4a16"), default="fp16")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--max-part-bytes", metavar="SIZE", help="passed on to qnnpasses llm (default: its own)")
    parser.add_argument("--memory-limit", type=float, metavar="FACTOR",
                        help="run the build in a memory cgroup of FACTOR x the export's weight bytes (root)")
    parser.add_argument("--int4-blocks", metavar="B|none", help="passed on to qnnpasses llm (w4a16; default: its own)")
    parser.add_argument("--keep", type=Path, help="write the bundle here instead of a temporary folder")
    parser.add_argument("--doc-only", action="store_true", help="rewrite docs/bench_sizes.md from the JSON")
    args = parser.parse_args(argv)
    if not args.doc_only:
        entries = []
        for shape in args.shapes:
            entry = measure(shape, args.context, args.prefill, args.precision, not args.no_compile, args.keep,
                            args.max_part_bytes, args.memory_limit, args.int4_blocks)
            print(json.dumps({k: v for k, v in entry.items() if k != "files"}), flush=True)
            entries.append(entry)
        DOC_JSON.write_text(json.dumps(merge(entries), indent=1) + "\n")
    DOC_MD.write_text(write_markdown(json.loads(DOC_JSON.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
