"""Peak memory and wall time of ``qnnpasses run --pipeline htp-llm`` on a 7B-shaped LLaMA, and of the peers.

The model comes from ``tools/make_big_llm.py`` (32 layers, hidden 4096, ~13.5 GB of fp16
weights in a sparse external data file, so it costs no disk).  Every tool runs as a
fresh subprocess in its own session, under ``RLIMIT_AS`` (default 20 GB) and a timeout,
so that a tool that loads every weight fails instead of taking the machine down.
Measured per tool:

* wall time;
* peak RSS of the largest single process (``wait4`` rusage ``ru_maxrss``, which
  includes descendants that were waited for, e.g. the onnxsim worker);
* peak RSS of the whole process tree, sampled every 50 ms (catches a parent and a
  worker holding memory at the same time);
* output size (apparent, and allocated on disk) and the failure mode, if any.

Memory-mapped weight pages that are read count as RSS, so a pass that touches the
weights shows up even though it never copies them.  ``--trace`` re-runs the pipeline
with an instrument that records RSS after every pass, to name the pass that grows it.

    python tools/bench_memory.py                       # 7B: qnnpasses, onnxsim, onnxslim
    python tools/bench_memory.py --trace --skip-peers  # per-pass RSS of the pipeline
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
DEFAULT_WORKDIR = Path(os.environ.get("QNNPASSES_BENCH_DIR", "/tmp/qnnpasses-bench"))
GB = 1 << 30
MB = 1 << 20


# --------------------------------------------------------------------------- measuring a subprocess


@dataclass
class Measurement:
    label: str
    argv: list[str]
    returncode: int | None = None
    seconds: float = 0.0
    max_rss_mb: float = 0.0  # largest single process (rusage of the child and its waited-for descendants)
    tree_peak_mb: float = 0.0  # sampled sum over the live process tree
    output_bytes: int = 0
    output_disk_bytes: int = 0
    error: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.error


def _limit(mem_cap_bytes: int | None):
    def apply() -> None:
        if mem_cap_bytes:
            resource.setrlimit(resource.RLIMIT_AS, (mem_cap_bytes, mem_cap_bytes))
    return apply


def _tree_rss(pid: int) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total


def measure(label: str, argv: list[str], *, timeout: float, mem_cap_gb: float | None = 20.0,
            outputs: list[Path] = (), log: Path | None = None, env: dict | None = None) -> Measurement:
    """Run ``argv`` as a fresh process group; wall time, peak RSS, outputs and the failure mode."""
    m = Measurement(label, [str(a) for a in argv])
    for out in outputs:
        _remove(out)
    log = log or Path(os.devnull)
    cap = int(mem_cap_gb * GB) if mem_cap_gb else None
    with open(log, "wb") as sink:
        start = time.perf_counter()
        proc = subprocess.Popen(m.argv, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_limit(cap), env=env)  # noqa: PLW1509 - no threads here
        status, usage = 0, None
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            m.tree_peak_mb = max(m.tree_peak_mb, _tree_rss(proc.pid) / MB)
            if time.perf_counter() - start > timeout:
                os.killpg(proc.pid, 9)
                _, status, usage = os.wait4(proc.pid, 0)
                m.error = f"timeout after {timeout:.0f} s (killed)"
                break
            time.sleep(0.05)
        m.seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here; Popen must not wait again
    _kill_group(proc.pid)
    m.returncode = proc.returncode
    m.max_rss_mb = usage.ru_maxrss / 1024 if usage else 0.0
    m.extra["cpu_seconds"] = usage.ru_utime + usage.ru_stime if usage else 0.0  # user + system, all waited-for
    m.tree_peak_mb = max(m.tree_peak_mb, m.max_rss_mb)
    for out in outputs:
        for file in (out, out.with_name(out.name + ".data")):
            if file.exists():
                m.output_bytes += file.stat().st_size
                m.output_disk_bytes += file.stat().st_blocks * 512
    if m.returncode != 0 and not m.error:
        m.error = _failure(m.returncode, log)
    elif m.returncode == 0 and outputs and not any(o.exists() for o in outputs):
        m.error = "exit 0 but no output written"
    return m


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, 9)  # stray workers of the tool (its own session, nothing else)
    except ProcessLookupError:
        pass


def _remove(path: Path) -> None:
    for file in (path, path.with_name(path.name + ".data")):
        if file.is_dir():
            shutil.rmtree(file)
        elif file.exists():
            file.unlink()


def _failure(returncode: int, log: Path) -> str:
    """The exit status and the tool's last words (a signal death usually leaves none worth quoting)."""
    if returncode < 0:
        try:
            what = f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            what = f"killed by signal {-returncode}"
    else:
        what = f"exit {returncode}"
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    errors = [line for line in lines if any(k in line.lower() for k in ("error", "memory", "alloc", "exceed", "2gb"))]
    line = (errors or lines or [""])[-1]
    return f"{what}: {line[:240]}" if line else what


def file_size(path: Path) -> tuple[int, int]:
    """(apparent bytes, bytes on disk) of a model and its .data file."""
    total = disk = 0
    for file in (path, path.with_name(path.name + ".data")):
        if file.exists():
            total += file.stat().st_size
            disk += file.stat().st_blocks * 512
    return total, disk


# --------------------------------------------------------------------------- models and commands


def ensure_llama(path: Path, *args: str) -> Path:
    """Write a make_big_llm model once (by its arguments) and reuse it."""
    stamp = path.with_name(path.name + ".args")
    if path.exists() and stamp.exists() and stamp.read_text() == " ".join(args):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(TOOLS / "make_big_llm.py"), "--out", str(path), *args], check=True,
                   stdout=subprocess.DEVNULL)
    stamp.write_text(" ".join(args))
    return path


def qnnpasses_argv(model: Path, out: Path, report: Path | None = None, pipeline: str = "htp-llm") -> list[str]:
    argv = [sys.executable, "-m", "qnnpasses.cli", "run", "--pipeline", pipeline, str(model), "-o", str(out), "-q"]
    return argv + (["--report-dir", str(report)] if report else [])


def onnxsim_argv(model: Path, out: Path, external: bool) -> list[str]:
    exe = shutil.which("onnxsim") or "onnxsim"
    return [exe, str(model), str(out)] + (["--save-as-external-data"] if external else [])


def onnxslim_argv(model: Path, out: Path, external: bool) -> list[str]:
    exe = shutil.which("onnxslim") or "onnxslim"
    return [exe, str(model), str(out)] + (["--save-as-external-data"] if external else [])


def load_save_argv(model: Path, out: Path, external: bool) -> list[str]:
    code = ("import onnx,sys; m=onnx.load(sys.argv[1]); "
            "onnx.save(m, sys.argv[2], save_as_external_data=sys.argv[3]=='1', location=sys.argv[2].split('/')[-1]+'.data')")
    return [sys.executable, "-c", code, str(model), str(out), "1" if external else "0"]


# --------------------------------------------------------------------------- per-pass trace (child mode)


def trace_passes(model: str, out: str, pipeline: str) -> dict:
    """In this process: RSS after loading, after every pass, after saving (the ``--trace`` child)."""
    from qnnpasses.ir.load import load_model
    from qnnpasses.ir.model import save_model
    from qnnpasses.passmanager.manager import Instrument, PassManager
    from qnnpasses.passmanager.named import get_pipeline

    rows = []

    def mark(stage: str, seconds: float, ir) -> None:
        rows.append({"stage": stage, "seconds": round(seconds, 3), "rss_mb": round(_rss_now() / MB, 1),
                     "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                     "workers_rss_mb": round((_tree_rss(os.getpid()) - _rss_now()) / MB, 1), **_constant_kinds(ir)})

    class RssInstrument(Instrument):
        def after_pass(self, pass_, ir, record):
            mark(f"{record.index:02d} {record.name} ({record.status})", record.seconds, ir)

    start = time.perf_counter()
    ir = load_model(model)
    mark("load_model", time.perf_counter() - start, ir)
    PassManager(get_pipeline(pipeline), instruments=[RssInstrument()]).run(ir)
    start = time.perf_counter()
    save_model(ir, out)
    mark("save_model", time.perf_counter() - start, ir)
    return {"stages": rows}


def _constant_kinds(ir) -> dict:
    """How the weights are held: still lazy on disk, memory-mapped (a pass read ``.values``),
    or arrays in memory (new or copied), with their sizes."""
    import numpy as np
    from onnx_graphsurgeon.ir.tensor import LazyValues

    from qnnpasses.ir.model import _constants_with_attributes

    kinds = {"lazy_mb": 0.0, "mapped_mb": 0.0, "in_memory_mb": 0.0}
    for graph in ir.graphs():
        for tensor in _constants_with_attributes(graph):
            values = tensor._values
            key = "lazy_mb" if isinstance(values, LazyValues) else "mapped_mb" if isinstance(values, np.memmap) \
                else "in_memory_mb"
            kinds[key] += values.nbytes / MB
    return {k: round(v, 1) for k, v in kinds.items()}


def _rss_now() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# --------------------------------------------------------------------------- the benchmark


def render(rows: list[Measurement], weights: tuple[int, int]) -> str:
    lines = [f"model weights: {weights[0] / GB:.2f} GiB apparent, {weights[1] / MB:.1f} MiB on disk",
             "", "| tool | status | wall s | peak RSS (max process) | peak RSS (process tree) | output |",
             "|---|---|---:|---:|---:|---|"]
    for m in rows:
        status = "ok" if m.ok else m.error.replace("|", "/")
        output = f"{m.output_bytes / GB:.2f} GiB ({m.output_disk_bytes / MB:.0f} MiB on disk)" if m.output_bytes else "-"
        lines.append(f"| {m.label} | {status} | {m.seconds:.1f} | {m.max_rss_mb:,.0f} MiB | {m.tree_peak_mb:,.0f} MiB "
                     f"| {output} |")
    return "\n".join(lines)


def render_trace(trace: dict) -> str:
    lines = ["| stage | seconds | RSS after | peak RSS so far | live workers' RSS | weights lazy / mapped / in memory |",
             "|---|---:|---:|---:|---:|---|"]
    for row in trace["stages"]:
        lines.append(f"| {row['stage']} | {row['seconds']:.2f} | {row['rss_mb']:,.0f} MiB | {row['max_rss_mb']:,.0f} MiB "
                     f"| {row['workers_rss_mb']:,.0f} MiB | {row['lazy_mb']:,.0f} / {row['mapped_mb']:,.0f} / "
                     f"{row['in_memory_mb']:,.0f} MiB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model to use (default: a 7B-shaped make_big_llm model in --workdir)")
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    parser.add_argument("--pipeline", default="htp-llm")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per tool")
    parser.add_argument("--mem-cap-gb", type=float, default=20.0, help="RLIMIT_AS of every tool (0: none)")
    parser.add_argument("--skip-peers", action="store_true", help="qnnpasses only")
    parser.add_argument("--trace", action="store_true", help="also record RSS after every pass")
    parser.add_argument("--json", type=Path, help="write the measurements here")
    parser.add_argument("--trace-child", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trace_child:
        print(json.dumps(trace_passes(*args.trace_child, args.pipeline)))
        return 0

    work = args.workdir / "memory"
    work.mkdir(parents=True, exist_ok=True)
    model = args.model or ensure_llama(args.workdir / "llama7b" / "model.onnx")
    weights = file_size(model)
    cap = args.mem_cap_gb or None
    rows = [measure("qnnpasses run --pipeline " + args.pipeline, qnnpasses_argv(model, work / "qp.onnx", work / "report",
                                                                               args.pipeline),
                    timeout=args.timeout, mem_cap_gb=cap, outputs=[work / "qp.onnx"], log=work / "qp.log")]
    if not args.skip_peers:
        for label, make in (("onnx.load + onnx.save", load_save_argv), ("onnxsim", onnxsim_argv),
                            ("onnxslim", onnxslim_argv)):
            out = work / f"{label.split()[0].replace('.', '_')}.onnx"
            rows.append(measure(label, make(model, out, True), timeout=args.timeout, mem_cap_gb=cap, outputs=[out],
                                log=work / f"{out.stem}.log"))
            _remove(out)
    print(render(rows, weights))
    trace = None
    if args.trace:
        child = measure("trace", [sys.executable, __file__, "--pipeline", args.pipeline, "--trace-child", str(model),
                                  str(work / "trace.onnx")], timeout=args.timeout, mem_cap_gb=cap,
                        outputs=[work / "trace.onnx"], log=work / "trace.json")
        if child.ok:
            trace = json.loads((work / "trace.json").read_text().strip().splitlines()[-1])
            print("\n" + render_trace(trace))
        else:
            print(f"\ntrace failed: {child.error}")
    if args.json:
        args.json.write_text(json.dumps({"model": str(model), "weights": weights, "rows": [asdict(r) for r in rows],
                                         "trace": trace}, indent=1))
    return 0 if rows[0].ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
