#!/usr/bin/env python
"""What the HTP's one-way RmsNorm rounding costs a trained quantized pair, and what compensating it gives back.

The HTP rounds a fused RmsNorm's 16-bit output down (``tools/probe_htp_rounding.py``,
docs/htp_rounding.md); :mod:`qnnpasses.quant.norm_rounding` adds the lost half step back after
each MatMul that reads such an output, in what is compiled for the HTP.  This tool measures both
on a trained model's w8a16 pair: ``qnnpasses llm --precision w8a16`` of Gemma 3 270M (its KV-cache
export by TorchScript, ``tools/trained_fixtures.py``; calibrated on its calibration windows),
context 128, prefill 16, not compiled (``--pair DIR`` takes one already built).  Each run feeds the
held-out evaluation windows of English text through the runner of ``qnnpasses generate`` (the
prompt in prefill calls, then one decode call per token) and counts the positions whose argmax is
the fp32 export's (teacher-forced top-1):

* ``cpu``: the QDQ graphs on onnxruntime's CPU provider as written (graph optimizations off): every
  op rounds to nearest;
* ``cpu, norm rounded down``: the same, each RmsNorm's output shifted half its step down before it
  is quantized -- the HTP's rounding, emulated;
* ``htp, as written``: the simulated HTP (integer mode, graph-boundary Q/DQ on the HTP, no CPU
  fallback) on the graphs without the compensation;
* ``htp``: the HTP as qnnpasses compiles and runs the pair (compensated).

    python tools/probe_norm_rounding.py                 # builds the pair (about 20 minutes), 4 runs
    python tools/probe_norm_rounding.py --pair DIR --windows 8
    python tools/probe_norm_rounding.py --doc-only
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
DOC_JSON, DOC_MD = ROOT / "docs" / "norm_rounding.json", ROOT / "docs" / "norm_rounding.md"
MODEL, CONTEXT, PREFILL = "gemma3_270m", 128, 16
RUNS = ("cpu", "cpu, norm rounded down", "htp, as written", "htp")


def build_pair(out: Path) -> Path:
    import trained_fixtures as tf

    from qnnpasses.llm.convert import build

    tf.ensure_built(MODEL, "kv_ts")
    build(tf.DEFAULT_CACHE / f"{MODEL}_kv_ts.onnx", out, context=CONTEXT, prefill=PREFILL, precision="w8a16",
          calib=tf.DEFAULT_CACHE / f"{MODEL}.calib.npz", compile=False, probe=False)
    return out


def norm_rounded_down(pair: Path, out: Path) -> Path:
    """A copy of ``pair`` whose graphs shift each RmsNorm output by -s/2 before its QuantizeLinear."""
    from qnnpasses.ir.model import save_proto
    from qnnpasses.quant.qdq_proto import index_graph
    shutil.copytree(pair, out, ignore=shutil.ignore_patterns("*.onnx", "*.data"))
    manifest = json.loads((pair / "llm.json").read_text())
    for graph in manifest["graphs"].values():
        for part in graph["parts"]:
            model = onnx.load(str(pair / part["onnx"]))
            found = index_graph(model.graph)
            nodes = []
            for node in list(model.graph.node):
                nodes.append(node)
                if node.op_type != "RMSNormalization":
                    continue
                for q in (r for r in found.readers[node.output[0]] if r.op_type == "QuantizeLinear"):
                    step = float(numpy_helper.to_array(found.inits[q.input[1]]))
                    shift, shifted = f"{q.output[0]}_down", f"{q.output[0]}_down_in"
                    model.graph.initializer.append(numpy_helper.from_array(np.array(-step / 2, np.float32), shift))
                    nodes.append(helper.make_node("Add", [node.output[0], shift], [shifted]))
                    q.input[0] = shifted
            del model.graph.node[:]
            model.graph.node.extend(nodes)
            save_proto(model, out / part["onnx"], external_data=True)
    return out


def teacher_forced(pair: Path, on: str, windows: int, compensate: bool = True) -> dict:
    import trained_fixtures as tf

    from qnnpasses.backends.cpu import cpu_session
    from qnnpasses.llm.runner import Runner, htp_graph_session

    def sessions(path: Path, graph):
        if on == "cpu":  # what the graphs say: onnxruntime's CPU fusions off
            return cpu_session(path, mapped=True, optimize=False)
        return htp_graph_session(path, fp16=graph.fp16, shared=graph.shared, target=graph.target,
                                 compiled=graph.compiled, compensate=compensate)

    data = np.load(tf.DEFAULT_CACHE / f"{MODEL}.eval.npz")
    run = Runner(pair, on=on, sessions=sessions)
    run.open()
    agree = total = 0
    start = time.monotonic()
    for i in range(windows):
        mask = data["attention_mask"][i].astype(bool)
        run.reset()
        logits = run.feed([int(t) for t in data["input_ids"][i][mask]])[0]
        agree += int((logits.argmax(-1) == data["ref_top1"][i][mask]).sum())
        total += int(mask.sum())
    return {"agree": agree, "positions": total, "top1": agree / total, "seconds": round(time.monotonic() - start)}


def measure(pair: Path | None, windows: int) -> dict:
    import onnxruntime as ort
    import onnxruntime_qnn  # noqa: F401 - its version is recorded

    from qnnpasses.quant.norm_rounding import htp_model

    with tempfile.TemporaryDirectory(prefix="probe_norm_rounding.") as tmp:
        pair = pair or build_pair(Path(tmp) / "pair")
        manifest = json.loads((pair / "llm.json").read_text())
        report = json.loads((pair / "report.json").read_text())
        compensated = {name: sum(htp_model(pair / p["onnx"])[2] for p in graph["parts"])
                       for name, graph in manifest["graphs"].items()}
        rows = {"cpu": teacher_forced(pair, "cpu", windows),
                "cpu, norm rounded down": teacher_forced(norm_rounded_down(pair, Path(tmp) / "down"), "cpu", windows),
                "htp, as written": teacher_forced(pair, "htp", windows, compensate=False),
                "htp": teacher_forced(pair, "htp", windows)}
    return {"model": MODEL, "context": manifest["context"], "prefill": manifest["prefill"],
            "precision": manifest["precision"], "recipe": (report.get("quantization") or {}).get("recipe"),
            "windows": windows, "compensated_matmuls": compensated, "onnxruntime": ort.__version__,
            "onnxruntime_qnn": onnxruntime_qnn.__version__, "runs": rows}


def render(doc: dict) -> str:
    runs = doc["runs"]
    lines = ["# The HTP's RmsNorm rounding on a trained quantized pair", "",
             "Written by `python tools/probe_norm_rounding.py` from `docs/norm_rounding.json`.  Trained Gemma 3 270M, "
             f"its {doc['precision']} pair from `qnnpasses llm` (context {doc['context']}, prefill {doc['prefill']}, "
             f"quantization recipe {doc['recipe']}), fed {doc['windows']} held-out windows of English text by the "
             "runner of `qnnpasses generate`; teacher-forced top-1: the share of positions whose argmax is the fp32 "
             f"export's.  onnxruntime {doc['onnxruntime']}, onnxruntime-qnn {doc['onnxruntime_qnn']}.", "",
             "| run | teacher-forced top-1 | positions | seconds |", "|---|---:|---:|---:|"]
    for name in RUNS:
        r = runs[name]
        lines.append(f"| {name} | {100 * r['top1']:.1f}% | {r['positions']} | {r['seconds']} |")
    counts = ", ".join(f"{n} {c}" for n, c in doc["compensated_matmuls"].items())
    lines += ["", "cpu: the QDQ graphs computed as written on onnxruntime's CPU provider (every op rounds to nearest); "
              "cpu, norm rounded down: the same with each RmsNorm output shifted half its 16-bit step down before it "
              "is quantized, which is what the HTP's RmsNorm does (docs/htp_rounding.md); htp, as written: the "
              "simulated HTP on the graphs as quantized; htp: the HTP as qnnpasses compiles and runs them, each "
              "MatMul reading an RmsNorm output given back the half step times its weight's column sums "
              f"(`qnnpasses/quant/norm_rounding.py`; MatMuls compensated: {counts}).", "",
              f"Rounding the norm down costs the CPU {100 * (runs['cpu']['top1'] - runs['cpu, norm rounded down']['top1']):.1f} "
              f"points of top-1, the HTP as written is {100 * (runs['cpu']['top1'] - runs['htp, as written']['top1']):.1f} "
              f"below the CPU, and compensated {100 * (runs['cpu']['top1'] - runs['htp']['top1']):.1f}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from probe_act_matmul import write_docs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", type=Path, help="a w8a16 pair of Gemma 3 270M already built (default: build one)")
    parser.add_argument("--windows", type=int, default=8, help="evaluation windows (default 8)")
    parser.add_argument("--doc-only", action="store_true", help="rewrite docs/norm_rounding.md from the JSON")
    args = parser.parse_args(argv)
    return write_docs(lambda: measure(args.pair, args.windows), render, DOC_JSON, DOC_MD,
                      ["--doc-only"] if args.doc_only else [])


if __name__ == "__main__":
    sys.exit(main())
