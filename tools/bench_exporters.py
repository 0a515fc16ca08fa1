#!/usr/bin/env python
"""Speed of ``qnnpasses run --pipeline htp-llm`` on what users export, against onnxsim and onnxslim.

``tools/bench.py`` measures one export of our own (``tools/make_big_llm.py``).  Here the
model is a random-init LLaMA with transformers' defaults (sdpa attention; hidden 256, 8 heads,
2 KV heads, so the weights stay small while the node count is a real model's), exported the
ways users export a decoder: by TorchScript and by dynamo (``tools/decoder_matrix.py``'s KV-cache
step: ``input_ids``, ``attention_mask``, ``position_ids``, ``past_key_values.*`` with symbolic
batch, sequence and past), by Hugging Face Optimum (``optimum-cli export onnx --task
text-generation-with-past``, in its own venv, ``tools/optimum_export.py``), and by
onnxruntime-genai's model builder (fp32, CPU: its contrib ops, ``GroupQueryAttention`` and
``SimplifiedLayerNormalization``, which htp-llm lowers first; ``tools/genai_models.py``).  For each exporter,
at 32 layers: htp-llm, onnxsim and onnxslim as fresh processes, interleaved round-robin, median
of ``--repeat``; then htp-llm alone at 128 layers for the growth (4.0x the layers).  Writes
``docs/bench_exporters.md`` and ``docs/bench_exporters.json``.

    python tools/bench_exporters.py                         # ts, dynamo, optimum, genai; repeat 3
    python tools/bench_exporters.py --exporters ts --repeat 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import byte_compile, fmt_ratio, node_count, ratio, ratio_above, timed, verdict  # noqa: E402
from bench_memory import load_save_argv, onnxsim_argv, onnxslim_argv, qnnpasses_argv  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
WORKDIR = Path(os.environ.get("QNNPASSES_CACHE", Path.home() / ".cache" / "qnnpasses")) / "exporters"
EXPORTERS = ("ts", "dynamo", "optimum", "genai")
LAYERS = (32, 128)
CONFIG = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
              max_position_embeddings=256)
#: the targets: htp-llm / onnxsim, htp-llm / onnxslim, 128 / 32 layers (wall time)
TARGETS = {"onnxsim": 0.5, "onnxslim": 0.3, "growth": 4.0}


def export(exporter: str, layers: int) -> Path:
    """The cached export of a ``layers``-layer LLaMA by ``exporter`` (written on first use)."""
    path = WORKDIR / f"llama{layers}_{exporter}" / "model.onnx"
    if path.exists():
        return path
    import torch
    import transformers

    import decoder_matrix as dm

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("llama", num_hidden_layers=layers, **CONFIG)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if exporter == "optimum":
        hf_dir = path.parent / "hf"
        model.save_pretrained(hf_dir)
        reason = dm.export_with_optimum(hf_dir, path)
        if reason:
            raise RuntimeError(f"optimum: {reason}")
    elif exporter == "genai":
        import genai_models

        hf_dir = path.parent / "hf"
        genai_models.write_hf_model(hf_dir, config=dict(CONFIG, num_hidden_layers=layers))
        reason = genai_models.run_builder(hf_dir, path.parent, "fp32", path.parent / "builder-cache")
        if reason:
            raise RuntimeError(f"onnxruntime-genai's builder: {reason}")
    else:
        prompt = torch.randint(10, CONFIG["vocab_size"], (1, dm.PROMPT_LEN))
        dm.export_torch(model, prompt, exporter, path)
    return path


def measure_exporter(exporter: str, repeat: int, timeout: float) -> dict:
    models = {n: export(exporter, n) for n in LAYERS}
    work = WORKDIR / "runs" / exporter
    work.mkdir(parents=True, exist_ok=True)
    ref = models[LAYERS[0]]
    jobs = {"qnnpasses": ("qnnpasses run --pipeline htp-llm", qnnpasses_argv(ref, work / "htp.onnx"), work / "htp.onnx"),
            "onnxsim": ("onnxsim", onnxsim_argv(ref, work / "sim.onnx", False), work / "sim.onnx"),
            "onnxslim": ("onnxslim", onnxslim_argv(ref, work / "slim.onnx", False), work / "slim.onnx"),
            # the floor every tool pays: the interpreter, `import onnx`, parsing and writing the file
            "load-save": ("onnx.load + onnx.save", load_save_argv(ref, work / "copy.onnx", False), work / "copy.onnx"),
            "deep": ("qnnpasses run --pipeline htp-llm (128 layers)",
                     qnnpasses_argv(models[LAYERS[1]], work / "htp128.onnx"), work / "htp128.onnx")}
    runs = timed(jobs, repeat, timeout)
    pipe = runs["qnnpasses"]
    return {"exporter": exporter, "nodes": {str(n): node_count(p) for n, p in models.items()}, "runs": runs,
            "ratios": {"onnxsim": {"wall": ratio(pipe, runs["onnxsim"]), "cpu": ratio(pipe, runs["onnxsim"], "cpu_median")},
                       "onnxslim": {"wall": ratio(pipe, runs["onnxslim"]), "cpu": ratio(pipe, runs["onnxslim"], "cpu_median")},
                       "growth": {"wall": ratio(runs["deep"], pipe), "cpu": ratio(runs["deep"], pipe, "cpu_median")},
                       "onnxslim_above_floor": {"wall": ratio_above(pipe, runs["onnxslim"], runs["load-save"], "median"),
                                                "cpu": ratio_above(pipe, runs["onnxslim"], runs["load-save"],
                                                                   "cpu_median")}}}


def seconds(entry: dict) -> str:
    return f"{entry['median']:.2f} ({entry['cpu_median']:.2f})" if entry["ok"] else f"failed: {entry['error'][:60]}"


def render(doc: dict) -> str:
    lines = ["# Speed on what users export: htp-llm against onnxsim and onnxslim", "",
             "Written by `python tools/bench_exporters.py` (figures in `docs/bench_exporters.json`).  A random-init "
             "LLaMA (transformers' default attention; hidden 256, 8 heads, 2 KV heads) exported with a dynamic KV "
             "cache by each exporter (genai: onnxruntime-genai's model builder, fp32, which writes its own "
             f"contrib-op attention); every tool a fresh process, interleaved, median of {doc['repeat']} runs, on "
             f"{doc['cpus']} CPUs.  Seconds: wall (CPU).  The floor is `onnx.load` + `onnx.save` of the same file "
             "in a fresh interpreter: what every tool pays before it changes anything; the column after it divides "
             "what htp-llm and onnxslim each spend above it.", "",
             "| exporter | nodes (32 / 128 layers) | htp-llm | onnxsim | onnxslim | floor | htp-llm 128 layers "
             "| / onnxsim | / onnxslim | / onnxslim above the floor | 128 / 32 |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for e in doc["entries"]:
        r, x = e["runs"], e["ratios"]
        lines.append(f"| {e['exporter']} | {e['nodes']['32']} / {e['nodes']['128']} | {seconds(r['qnnpasses'])} | "
                     f"{seconds(r['onnxsim'])} | {seconds(r['onnxslim'])} | {seconds(r['load-save'])} | "
                     f"{seconds(r['deep'])} | {fmt_ratio(x['onnxsim']['wall'])} | {fmt_ratio(x['onnxslim']['wall'])} | "
                     f"{fmt_ratio(x['onnxslim_above_floor']['wall'])} | {fmt_ratio(x['growth']['wall'])} |")
    lines += ["", "Targets, wall time:", ""]
    for key, name in (("onnxsim", "htp-llm / onnxsim"), ("onnxslim", "htp-llm / onnxslim"), ("growth", "128 / 32 layers")):
        for e in doc["entries"]:
            value = e["ratios"][key]["wall"]
            line = f"- {name} <= {TARGETS[key]} ({e['exporter']}): {fmt_ratio(value)} {verdict(value, TARGETS[key])}"
            peer, floor = e["runs"].get(key), e["runs"]["load-save"]
            if key != "growth" and peer["ok"] and floor["ok"] and TARGETS[key] * peer["median"] < floor["median"]:
                line += (f"; the target, {TARGETS[key] * peer['median']:.2f} s, is below the floor of "
                         f"{floor['median']:.2f} s that loading and saving the file alone take")
            elif key != "growth" and peer["ok"] and floor["ok"] and value is not None and value > TARGETS[key]:
                pipe = e["runs"]["qnnpasses"]["median"]
                line += (f"; the target leaves {TARGETS[key] * peer['median'] - floor['median']:.2f} s above the "
                         f"floor for everything htp-llm does besides loading and saving (importing its modules, "
                         f"the passes, their checks), where it spends {pipe - floor['median']:.2f} s")
            lines.append(line)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exporters", default=",".join(EXPORTERS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, default=DOCS / "bench_exporters.md")
    args = parser.parse_args(argv)
    byte_compile()
    entries = [measure_exporter(name, args.repeat, args.timeout) for name in args.exporters.split(",")]
    doc = {"repeat": args.repeat, "cpus": os.cpu_count(), "targets": TARGETS, "entries": entries}
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    args.out.write_text(render(doc))
    print(render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
