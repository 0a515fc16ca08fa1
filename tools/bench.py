"""Wall time of ``qnnpasses run --pipeline htp-llm`` against its peers, and how it grows with depth.

On a 32-layer LLaMA export from ``tools/make_big_llm.py`` (the node count of a real 7B,
small hidden size so the weights are tiny), each of these runs as a fresh subprocess,
median of ``--repeat`` (3) runs, interleaved round-robin in one invocation so that load
from other processes spreads evenly over the tools compared:

* ``qnnpasses run --pipeline htp-llm`` (no ``--verify``, no ``--report-dir``: the command a
  user runs to rewrite a model), and the same with ``--report-dir`` (its report.json and
  report.md add a prediction of HTP support and an analysis before and after),
* ``onnxsim`` alone and ``onnxslim`` alone (their command lines, default options),
* plain ``onnx.load`` + ``onnx.save`` (the floor: parsing and writing the file).

Every tool runs with its modules byte-compiled (this project's are compiled first, as
``pip install`` compiles a package's; see :func:`byte_compile`).

Then the pipeline alone at 2, 8, 32 and 128 layers -- the same passes at every size --
with the 128/32 ratio (4.0x is linear), and the seconds of every pass (its graph check
included) from ``report.json`` of the ``--report-dir`` runs at each depth, with each pass's growth next to the
graph's.  Wall and CPU (user + system) seconds are both recorded: on a loaded machine
the CPU seconds are the steadier figure.  Writes ``docs/bench_speed.md`` (the README's
figures are generated from it) and ``docs/bench_speed.json`` with every figure.

    python tools/bench.py                          # everything (several minutes)
    python tools/bench.py --layers 2,8,32 --repeat 1 --out /tmp/speed.md
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_memory import (
    DEFAULT_WORKDIR,
    Measurement,
    ensure_llama,
    load_save_argv,
    measure,
    onnxsim_argv,
    onnxslim_argv,
    qnnpasses_argv,
)

SMALL = ("--hidden", "256", "--intermediate", "512", "--heads", "8", "--kv-heads", "8", "--vocab", "1000",
         "--weights", "random", "--dtype", "float32")
REFERENCE_LAYERS = 32
DOCS = Path(__file__).resolve().parent.parent / "docs"
#: issue #14's targets: htp-llm / onnxsim, htp-llm / onnxslim, 128 / 32 layers
TARGETS = {"onnxsim": 1.0, "onnxslim": 0.5, "growth": 4.5}


def llama(workdir: Path, layers: int) -> Path:
    return ensure_llama(workdir / f"llama{layers}" / "model.onnx", "--layers", str(layers), *SMALL)


def node_count(model: Path) -> int:
    import onnx

    return len(onnx.load(str(model), load_external_data=False).graph.node)


def timed(jobs: dict[str, tuple[str, list[str], Path]], repeat: int, timeout: float,
          reports: dict | None = None) -> dict[str, dict]:
    """Median wall time of ``repeat`` fresh runs per job, interleaved round-robin so that
    load from other processes on the machine spreads evenly over the tools compared.
    ``reports`` maps a job to its report folder: its per-pass seconds are kept per run
    (under ``"passes"``) and summarized by their median."""
    reports = reports or {}
    runs: dict[str, list[Measurement]] = {key: [] for key in jobs}
    passes: dict[str, list[dict[str, float]]] = {key: [] for key in reports}
    for _ in range(repeat):
        for key, (label, argv, out) in jobs.items():
            if runs[key] and not runs[key][-1].ok:
                continue  # a failing tool fails again; do not wait for it twice
            runs[key].append(measure(label, argv, timeout=timeout, outputs=[out], log=out.with_suffix(".log")))
            if key in reports and runs[key][-1].ok and (reports[key] / "report.json").exists():
                passes[key].append(pass_seconds(reports[key]))
    return {key: {"passes": {name: statistics.median(run.get(name, 0.0) for run in passes[key])
                             for name in {n for run in passes.get(key, []) for n in run}},
                  "label": jobs[key][0], "ok": all(r.ok for r in rs), "error": next((r.error for r in rs if r.error), ""),
                  "seconds": [round(r.seconds, 3) for r in rs], "median": statistics.median(r.seconds for r in rs),
                  "cpu_seconds": [round(r.extra.get("cpu_seconds", 0.0), 3) for r in rs],
                  "cpu_median": statistics.median(r.extra.get("cpu_seconds", 0.0) for r in rs),
                  "max_rss_mb": max(r.max_rss_mb for r in rs)} for key, rs in runs.items()}


def pass_seconds(report_dir: Path) -> dict[str, float]:
    """Seconds per pass name (summed over repeats of the same pass) from report.json."""
    report = json.loads((report_dir / "report.json").read_text())
    seconds: dict[str, float] = {}
    for record in report["passes"]:
        seconds[record["name"]] = seconds.get(record["name"], 0.0) + record["seconds"]
    return seconds


def profile(model: Path, out: Path, pipeline: str, top: int = 25) -> str:
    """cProfile of load + pipeline + save in this process: the functions that dominate."""
    from qnnpasses.ir.load import load_model
    from qnnpasses.ir.model import save_model
    from qnnpasses.passmanager.manager import PassManager
    from qnnpasses.passmanager.named import get_pipeline

    profiler = cProfile.Profile()
    profiler.enable()
    ir = load_model(model)
    PassManager(get_pipeline(pipeline)).run(ir)
    save_model(ir, out)
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return text.getvalue()


def pass_calls(model: Path, pipeline: str) -> dict[str, int]:
    """Python function calls per pass name, in this process: each pass's work (its check,
    snapshot and fingerprint included), which, unlike its seconds, neither load from other
    processes nor the heap's size (per-call cost grows with it) changes.  A call into C
    (onnx's checker and shape inference, numpy) counts once, whatever it does inside."""
    from qnnpasses.ir.load import load_model
    from qnnpasses.passmanager.manager import Instrument, PassManager
    from qnnpasses.passmanager.named import get_pipeline

    class Calls(Instrument):
        def __init__(self) -> None:
            self.calls: dict[str, int] = {}
            self.profiler: cProfile.Profile | None = None

        def before_pass(self, pass_, ir, record) -> None:
            self.profiler = cProfile.Profile()
            self.profiler.enable()

        def after_pass(self, pass_, ir, record) -> None:
            self.profiler.disable()
            total = pstats.Stats(self.profiler).total_calls
            self.calls[pass_.name] = self.calls.get(pass_.name, 0) + total

    counter = Calls()
    PassManager(get_pipeline(pipeline), instruments=[counter]).run(load_model(model))
    return counter.calls


def fmt(entry: dict) -> str:
    return f"{entry['median']:.2f}" if entry["ok"] else f"failed ({entry['error'][:80]})"


def ratio(a: dict, b: dict, key: str = "median") -> float | None:
    return a[key] / b[key] if a["ok"] and b["ok"] and b[key] > 0 else None


def byte_compile() -> None:
    """Write the bytecode of this project's modules, as ``pip install`` does for a package.

    An editable install leaves that to the first import, and with ``PYTHONDONTWRITEBYTECODE``
    set (it is on this machine) every run would compile all of ours again (~90 modules), while
    the peers' modules were compiled when pip installed them."""
    import compileall

    root = Path(__file__).resolve().parent.parent
    for folder in ("qnnpasses", "passes", "op_support"):
        compileall.compile_dir(str(root / folder), quiet=1)


def ratio_above(a: dict, b: dict, floor: dict, key: str) -> float | None:
    above_a, above_b = a[key] - floor[key], b[key] - floor[key]
    return above_a / above_b if a.get("ok") and b.get("ok") and above_b > 0 else None


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def verdict(value: float | None, target: float) -> str:
    return "not measured" if value is None else ("met" if value <= target else f"NOT met ({value / target:.2f}x the target)")


def summary(peers: dict, depth: dict) -> dict:
    """The three figures issue #14 asks for, wall and CPU, with the targets."""
    pipe = peers["qnnpasses"]
    out = {}
    for peer in ("onnxsim", "onnxslim"):
        if peer in peers:
            out[peer] = {"wall": ratio(pipe, peers[peer]), "cpu": ratio(pipe, peers[peer], "cpu_median"),
                         "target": TARGETS[peer]}
    floor = peers.get("load-save")
    if floor and "onnxslim" in peers:
        # what each tool spends above the floor every one of them pays: interpreter start,
        # `import onnx` (most of it: its ml_dtypes extension), parsing and writing the file
        out["above_floor"] = {kind: ratio_above(pipe, peers["onnxslim"], floor, key)
                              for kind, key in (("wall", "median"), ("cpu", "cpu_median"))}
        out["above_floor"]["seconds"] = {name: round(peers[name]["cpu_median"] - floor["cpu_median"], 3)
                                         for name in ("qnnpasses", "onnxslim")}
        out["above_floor"]["floor_cpu"] = floor["cpu_median"]
    if REFERENCE_LAYERS in depth and 128 in depth:
        out["growth"] = {"wall": ratio(depth[128], depth[REFERENCE_LAYERS]),
                         "cpu": ratio(depth[128], depth[REFERENCE_LAYERS], "cpu_median"), "target": TARGETS["growth"]}
    return out


def render(peers: dict, depth: dict, nodes: dict, per_pass: dict, figures: dict, calls: dict | None = None) -> str:
    pipe = peers["qnnpasses"]
    lines = [f"{REFERENCE_LAYERS}-layer LLaMA ({nodes[REFERENCE_LAYERS]} nodes), median of {len(pipe['seconds'])} fresh runs, every tool's modules byte-compiled:",
             "", "| tool | wall s (median) | peak RSS | qnnpasses htp-llm / tool | CPU s (median) | CPU ratio |",
             "|---|---:|---:|---:|---:|---:|"]
    for key, entry in peers.items():
        mine = key in ("qnnpasses", "report")
        lines.append(f"| {entry['label']} | {fmt(entry)} | {entry['max_rss_mb']:.0f} MiB | "
                     f"{'-' if mine else fmt_ratio(ratio(pipe, entry))} | {entry['cpu_median']:.2f} | "
                     f"{'-' if mine else fmt_ratio(ratio(pipe, entry, 'cpu_median'))} |")
    layers = sorted(depth)
    lines += ["", "| layers | nodes | htp-llm wall s | per layer (ms) | htp-llm CPU s |", "|---:|---:|---:|---:|---:|"]
    for n in layers:
        lines.append(f"| {n} | {nodes[n]} | {fmt(depth[n])} | {1000 * depth[n]['median'] / n:.0f} | "
                     f"{depth[n]['cpu_median']:.2f} |")
    if "growth" in figures:
        lines.append(f"\n128/32 layers: {fmt_ratio(figures['growth']['wall'])} (linear would be 4.0x; "
                     f"{nodes[128] / nodes[REFERENCE_LAYERS]:.2f}x the nodes); CPU {fmt_ratio(figures['growth']['cpu'])}")
    lines += ["", "Targets (issue #14), wall time / CPU time:", ""]
    names = {"onnxsim": "htp-llm / onnxsim", "onnxslim": "htp-llm / onnxslim", "growth": "128 / 32 layers"}
    for key, fig in figures.items():
        if key not in names:
            continue
        lines.append(f"- {names[key]} <= {fig['target']}: wall {fmt_ratio(fig['wall'])} {verdict(fig['wall'], fig['target'])}; "
                     f"CPU {fmt_ratio(fig['cpu'])} {verdict(fig['cpu'], fig['target'])}")
    above = figures.get("above_floor")
    if above:
        lines += ["", f"Above the floor every tool pays (`onnx.load` + `onnx.save`: interpreter start, `import onnx`, "
                      f"parsing and writing; {above['floor_cpu']:.2f} s CPU), qnnpasses spends "
                      f"{above['seconds']['qnnpasses']:.2f} s CPU and onnxslim {above['seconds']['onnxslim']:.2f} s: "
                      f"wall {fmt_ratio(above['wall'])}, CPU {fmt_ratio(above['cpu'])}."]
    passes = sorted({p for n in layers for p in per_pass.get(n, {})}, key=lambda p: -per_pass.get(layers[-1], {}).get(p, 0.0))
    growth_nodes = nodes[layers[-1]] / nodes[layers[-2]] if len(layers) > 1 else 1.0
    calls = calls or {}
    call_growth = {name: calls[layers[-1]][name] / calls[layers[-2]][name] for name in passes
                   if len(layers) > 1 and calls.get(layers[-2], {}).get(name) and calls.get(layers[-1], {}).get(name)}
    lines += ["", f"Seconds per pass (its graph check included; wall time, median of the `--report-dir` runs), growth from {layers[-2] if len(layers) > 1 else '-'} "
                  f"to {layers[-1]} layers against the graph's {growth_nodes:.2f}x, and the growth of its work (Python "
                  "function calls, counted in-process by cProfile: load and the heap's size leave it alone):", "",
              "| pass (s) | " + " | ".join(f"{n} layers" for n in layers) + " | time growth last/prev | calls growth |",
              "|---|" + "---:|" * (len(layers) + 2)]
    for name in passes:
        cells = [per_pass.get(n, {}).get(name, 0.0) for n in layers]
        growth = f"{cells[-1] / cells[-2]:.1f}x" if len(cells) > 1 and cells[-2] > 0.005 else "-"
        work = f"{call_growth[name]:.2f}x" if name in call_growth else "-"
        lines.append(f"| {name} | " + " | ".join(f"{c:.2f}" for c in cells) + f" | {growth} | {work} |")
    totals = [sum(per_pass.get(n, {}).values()) for n in layers]
    total_calls = [sum(calls.get(n, {}).values()) for n in layers[-2:]] if len(layers) > 1 else []
    lines.append("| all passes | " + " | ".join(f"{t:.2f}" for t in totals) + " | "
                 + (f"{totals[-1] / totals[-2]:.1f}x" if len(totals) > 1 and totals[-2] > 0 else "-") + " | "
                 + (f"{total_calls[1] / total_calls[0]:.2f}x" if len(total_calls) == 2 and total_calls[0] else "-") + " |")
    if call_growth:
        worst = max(call_growth, key=call_growth.get)
        slowest = max((n for n in passes if per_pass.get(layers[-2], {}).get(n, 0.0) > 0.005),
                      key=lambda n: per_pass[layers[-1]].get(n, 0.0) / per_pass[layers[-2]][n], default=None)
        lines += ["", f"Every pass linear (growth <= {TARGETS['growth']} for the graph's {growth_nodes:.2f}x): work "
                      f"{verdict(call_growth[worst], TARGETS['growth'])}, at most {call_growth[worst]:.2f}x ({worst})"
                  + (f"; time at most {per_pass[layers[-1]][slowest] / per_pass[layers[-2]][slowest]:.1f}x ({slowest}): "
                     "with the work linear, the rest is each call's cost on a larger heap and the machine's load"
                     if slowest else "") + "."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    parser.add_argument("--pipeline", default="htp-llm")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layers", default="2,8,32,128", help="depths for the growth table")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--profile", action="store_true", help="also cProfile the deepest model in-process")
    parser.add_argument("--out", type=Path, default=DOCS / "bench_speed.md",
                        help="markdown output (the JSON goes next to it)")
    args = parser.parse_args(argv)
    work = args.workdir / "speed"
    work.mkdir(parents=True, exist_ok=True)
    layers = sorted({int(n) for n in args.layers.split(",")} | {REFERENCE_LAYERS})
    models = {n: llama(args.workdir, n) for n in layers}
    nodes = {n: node_count(m) for n, m in models.items()}
    ref = models[REFERENCE_LAYERS]

    byte_compile()
    load_before = os.getloadavg()
    jobs = {"qnnpasses": (f"qnnpasses run --pipeline {args.pipeline}",
                          qnnpasses_argv(ref, work / "qp.onnx", None, args.pipeline), work / "qp.onnx"),
            "report": (f"qnnpasses run --pipeline {args.pipeline} --report-dir",
                       qnnpasses_argv(ref, work / "qp-r.onnx", work / f"report{REFERENCE_LAYERS}", args.pipeline),
                       work / "qp-r.onnx")}
    if not args.no_peers:
        jobs["onnxsim"] = ("onnxsim (alone)", onnxsim_argv(ref, work / "onnxsim.onnx", False), work / "onnxsim.onnx")
        jobs["onnxslim"] = ("onnxslim (alone)", onnxslim_argv(ref, work / "onnxslim.onnx", False), work / "onnxslim.onnx")
        jobs["load-save"] = ("onnx.load + onnx.save", load_save_argv(ref, work / "load-save.onnx", True),
                             work / "load-save.onnx")
    for n in layers:
        if n != REFERENCE_LAYERS:
            jobs[n] = (f"htp-llm {n} layers", qnnpasses_argv(models[n], work / f"qp{n}.onnx", None, args.pipeline),
                       work / f"qp{n}.onnx")
            jobs[f"report{n}"] = (f"htp-llm {n} layers --report-dir",
                                  qnnpasses_argv(models[n], work / f"qp{n}-r.onnx", work / f"report{n}", args.pipeline),
                                  work / f"qp{n}-r.onnx")
    report_job = {n: "report" if n == REFERENCE_LAYERS else f"report{n}" for n in layers}
    timings = timed(jobs, args.repeat, args.timeout, reports={report_job[n]: work / f"report{n}" for n in layers})
    # the tools at the reference depth; "report<n>" jobs only give the other depths their per-pass table
    peers = {k: v for k, v in timings.items() if isinstance(k, str) and (k == "report" or not k.startswith("report"))}
    depth = {n: timings["qnnpasses" if n == REFERENCE_LAYERS else n] for n in layers}
    per_pass = {n: timings[report_job[n]]["passes"] for n in layers if timings[report_job[n]]["passes"]}
    load_after = os.getloadavg()
    figures = summary(peers, depth) if "qnnpasses" in peers else {}
    # the work of every pass at the two deepest models, in this process
    calls = {n: pass_calls(models[n], args.pipeline) for n in layers[-2:]} if len(layers) > 1 else {}
    table = render(peers, depth, nodes, per_pass, figures, calls)
    table += (f"\n\nload average (1 min) before/after: {load_before[0]:.1f} / {load_after[0]:.1f} "
              f"on {os.cpu_count()} CPUs (other work was running: wall times are noisy, CPU times less so)")
    print(table)
    if args.profile:
        (work / "profile.txt").write_text(profile(models[layers[-1]], work / "profiled.onnx", args.pipeline))
        print(f"\ncProfile of the {layers[-1]}-layer run: {work / 'profile.txt'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(
        {"nodes": nodes, "peers": peers, "depth": depth, "per_pass": per_pass, "pass_calls": calls, "targets": figures,
         "load_average": [load_before[0], load_after[0]], "cpus": os.cpu_count()}, indent=1) + "\n")
    print(f"\nwrote {args.out} and {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
