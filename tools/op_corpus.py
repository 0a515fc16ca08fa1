"""Run every pass, and the ``htp-llm`` pipeline, on every ONNX backend node test.

The onnx wheel ships the generators of its backend node tests
(``onnx.backend.test.case.node``): ~1,900 small models — one operator each, plus the
function-expanded multi-node forms (``*_expanded``) — with inputs and expected outputs.
They are generated once into a cache directory.  Each case is then run through the
pass manager once per *target*:

* ``load-save``: no pass at all, only load + save (separates IR round-trip bugs from pass bugs);
* every registered pass alone (``test-*`` plugins excluded; lossy ones with ``allow_lossy``);
* ``pipeline:htp-llm``.

with ``RunConfig(verify=True, inputs=<the case's inputs>)`` whenever onnxruntime can run
the original.  Independently of the manager, the final model is saved, checked and run
on onnxruntime CPU and its outputs compared with the original's (dtype, shape, NaN/inf
positions, values within ``atol + rtol * max|ref|``).  Each (case, target) gets one outcome:

================== =============================================================
unchanged          no pass changed the graph, and the saved model still computes the same
rewritten-equal    the graph changed and the outputs are equal
rewritten-checked  the graph changed; onnxruntime cannot run the original, so only the
                   checker applies (and held)
refused            load_model raised BadInputError, or the pass was skipped with a reason
rolled-back        the manager caught a crash (``raised``), a broken graph (``check``) or
                   changed outputs (``verify``) and restored the graph; ``raised`` is a bug
                   even when contained
crashed            an exception escaped (load_model with anything but BadInputError, the
                   manager, save_model), the worker died, or the saved model no longer
                   passes the checker / no longer runs
mismatched         final outputs differ from the original's without a rollback
silent-change      outputs equal, but a pass reported ``changed=False`` and still modified the
                   graph (so the manager skipped its checks): a bug, reported, not a failure
rewritten-lossy    a lossy pass changed outputs (by design; not a failure)
timeout            the target exceeded ``--timeout``
================== =============================================================

Cases run in a pool of worker processes (default 2) with a per-target timeout; a worker
that hangs in native code or dies is replaced and the case goes on with the next target.

    python tools/op_corpus.py                          # everything; writes op_corpus.json
    python tools/op_corpus.py --sample 300 --seed 0 --targets pipeline:htp-llm,cleanup
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter, defaultdict
from multiprocessing import connection, get_context
from pathlib import Path
from typing import Any

import numpy as np
import onnx

DEFAULT_CACHE = Path(os.environ.get("QNNPASSES_OP_CORPUS", Path.home() / ".cache" / "qnnpasses" / "op_corpus"))
DEFAULT_PIPELINE = "htp-llm"
BASELINE = "load-save"
ATOL = 1e-4
RTOL = 1e-4
FAILURES = ("crashed", "mismatched", "timeout")
OUTCOMES = ("unchanged", "rewritten-equal", "rewritten-checked", "refused", "rolled-back", "rewritten-lossy",
            "silent-change", "crashed", "mismatched", "timeout")


# --------------------------------------------------------------------------- the cache


def cache_dir(root: Path = DEFAULT_CACHE) -> Path:
    """Cases depend on the onnx version that generated them."""
    return Path(root) / f"onnx-{onnx.__version__}"


def generate(root: Path = DEFAULT_CACHE) -> list[str]:
    """Write every backend node test as ``NAME/model.onnx`` + ``NAME/data.pkl`` once; returns the names."""
    cache = cache_dir(root)
    index = cache / "index.json"
    if index.is_file():
        return json.loads(index.read_text())
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = collect_testcases()
    names = []
    for case in cases:
        folder = cache / case.name
        folder.mkdir(parents=True, exist_ok=True)
        onnx.save_model(case.model, folder / "model.onnx")
        inputs, outputs = case.data_sets[0]
        names_in = [i.name for i in case.model.graph.input]
        names_out = [o.name for o in case.model.graph.output]
        data = {"inputs": dict(zip(names_in, inputs)), "expected": dict(zip(names_out, outputs))}
        (folder / "data.pkl").write_bytes(pickle.dumps(data))
        if all(isinstance(v, np.ndarray) for v in data["inputs"].values()):
            np.savez(folder / "inputs.npz", **data["inputs"])  # for `qnnpasses run --inputs` repros
        names.append(case.name)
    names.sort()
    index.write_text(json.dumps(names))
    return names


def load_inputs(case: Path) -> dict[str, Any]:
    return pickle.loads((case / "data.pkl").read_bytes())["inputs"]


def sample(names: list[str], n: int | None, seed: int) -> list[str]:
    if n is None or n >= len(names):
        return list(names)
    return sorted(random.Random(seed).sample(sorted(names), n))


def default_targets(pipeline: str | None = DEFAULT_PIPELINE) -> list[str]:
    from qnnpasses.passmanager.api import registered_passes

    passes = [name for name in registered_passes() if not name.startswith("test-")]
    return [BASELINE, *passes] + ([f"pipeline:{pipeline}"] if pipeline else [])


# --------------------------------------------------------------------------- one case


class _Timeout(BaseException):
    """Raised by SIGALRM; a BaseException so that the manager's ``except Exception`` lets it through."""


def _on_alarm(signum, frame):
    raise _Timeout()


def _session(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run_ort(path: Path, inputs: dict[str, Any]) -> dict[str, Any]:
    session = _session(path)
    feeds = {i.name: inputs[i.name] for i in session.get_inputs() if i.name in inputs}
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def differences(ref: dict[str, Any], got: dict[str, Any], atol: float = ATOL, rtol: float = RTOL) -> list[str]:
    """Why ``got`` is not ``ref``: names, dtypes, shapes, non-finite positions, values."""
    problems = []
    for name, value in ref.items():
        if name not in got:
            problems.append(f"output '{name}' is missing")
        else:
            problems += [f"{name}: {p}" for p in _value_differences(value, got[name], atol, rtol)]
    return problems


def _value_differences(ref: Any, got: Any, atol: float, rtol: float) -> list[str]:
    if ref is None or got is None:
        return [] if ref is None and got is None else ["optional value present on one side only"]
    if isinstance(ref, list) or isinstance(got, list):
        if not (isinstance(ref, list) and isinstance(got, list)) or len(ref) != len(got):
            return ["sequence length or kind differs"]
        return [p for r, g in zip(ref, got) for p in _value_differences(r, g, atol, rtol)]
    ref, got = np.asarray(ref), np.asarray(got)
    if ref.dtype != got.dtype:
        return [f"dtype {got.dtype} != {ref.dtype}"]
    if ref.shape != got.shape:
        return [f"shape {got.shape} != {ref.shape}"]
    if ref.dtype.kind not in "fc":
        return [] if np.array_equal(ref, got) else ["values differ"]
    a, b = ref.astype(np.float64), got.astype(np.float64)
    finite = np.isfinite(a)
    if not np.array_equal(np.isnan(a), np.isnan(b)) or not np.array_equal(a[np.isinf(a)], b[np.isinf(a)]):
        return ["NaN/inf positions differ"]
    if not np.isfinite(b[finite]).all():
        return ["non-finite values where the original is finite"]
    if not finite.any():
        return []
    error = float(np.max(np.abs(a[finite] - b[finite])))
    bound = atol + rtol * float(np.max(np.abs(a[finite])))
    return [] if error <= bound else [f"max abs error {error:.3g} > {bound:.3g}"]


def _fingerprint(ir) -> tuple:
    """What the graph computes, up to node order (a topological re-sort is not a change)
    and tensor encoding (``int64_data`` vs ``raw_data`` after a constant was read is not either)."""
    proto, _ = ir.to_proto()
    return _canonical_graph(proto.graph), sorted((o.domain, o.version) for o in proto.opset_import)


def _canonical_graph(graph: onnx.GraphProto) -> tuple:
    nodes = sorted(repr(_canonical_node(n)) for n in graph.node)
    tensors = sorted(_canonical_tensor(t).SerializeToString(deterministic=True) for t in graph.initializer)
    io = [v.SerializeToString(deterministic=True) for v in (*graph.input, *graph.output)]
    return tuple(nodes), tuple(tensors), tuple(io)


def _canonical_node(node: onnx.NodeProto) -> tuple:
    attrs = []
    for attr in sorted(node.attribute, key=lambda a: a.name):
        if attr.type == onnx.AttributeProto.GRAPH:
            value: Any = _canonical_graph(attr.g)
        elif attr.type == onnx.AttributeProto.GRAPHS:
            value = tuple(_canonical_graph(g) for g in attr.graphs)
        elif attr.type == onnx.AttributeProto.TENSOR:
            value = _canonical_tensor(attr.t).SerializeToString(deterministic=True)
        else:
            value = attr.SerializeToString(deterministic=True)
        attrs.append((attr.name, value))
    return node.op_type, node.domain, node.name, tuple(node.input), tuple(node.output), tuple(attrs)


def _canonical_tensor(tensor: onnx.TensorProto) -> onnx.TensorProto:
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return tensor
    try:
        return onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(tensor), tensor.name)
    except Exception:  # noqa: BLE001 - an encoding numpy_helper cannot round-trip: compare as stored
        return tensor


def _full_check(path: Path) -> str | None:
    try:
        onnx.checker.check_model(str(path), full_check=True)
        return None
    except Exception as exc:  # noqa: BLE001 - any checker failure is the finding
        return _line(exc)


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


def _where(tb) -> str:
    """The innermost frame in qnnpasses code: who to blame for an escaped exception."""
    frames = [f for f in traceback.extract_tb(tb) if "qnnpasses" in f.filename or "/passes/" in f.filename]
    frame = frames[-1] if frames else traceback.extract_tb(tb)[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"


class CaseRunner:
    """Runs the targets of one case; the original's outputs and checker verdict are computed once."""

    def __init__(self, case: Path):
        self.case = case
        self.model = case / "model.onnx"
        self.inputs = load_inputs(case)
        self.reference, self.ort_error = None, None
        try:
            self.reference = run_ort(self.model, self.inputs)
            again = run_ort(self.model, self.inputs)
            self.deterministic = not differences(self.reference, again, 0.0, 0.0)
        except Exception as exc:  # noqa: BLE001 - onnxruntime cannot run the original: checker only
            self.ort_error, self.deterministic = _line(exc), True
        self.check_error = _full_check(self.model)

    def run(self, target: str) -> dict[str, Any]:
        result: dict[str, Any] = {"case": self.case.name, "target": target, "outcome": "", "reason": ""}
        start = time.perf_counter()
        try:
            self._run(target, result)
        except _Timeout:
            result.update(outcome="timeout", reason="soft timeout")
        except Exception as exc:  # noqa: BLE001 - escaped from load/manager/save: a crash
            result.update(outcome="crashed", reason=_line(exc), where=_where(exc.__traceback__))
        result["seconds"] = round(time.perf_counter() - start, 4)
        return result

    def _run(self, target: str, result: dict[str, Any]) -> None:
        from qnnpasses.errors import BadInputError
        from qnnpasses.ir.load import load_model
        from qnnpasses.ir.model import save_model

        try:
            ir = load_model(self.model)
        except BadInputError as exc:
            result.update(outcome="refused", reason=f"load: {exc}")
            return
        before = _fingerprint(ir)
        records, lossy = self._manage(target, ir)
        result["records"] = [{k: r.get(k) for k in ("name", "status", "reason", "stats")} for r in records
                             if r["status"] != "unchanged" or r.get("stats")]
        changed = any(r["status"] == "changed" for r in records)
        rolled = [r for r in records if r["status"] == "rolled-back"]
        skipped = [r for r in records if r["status"] == "skipped"]
        with tempfile.TemporaryDirectory(prefix="op-corpus-") as tmp:
            out = save_model(ir, Path(tmp) / "out.onnx")
            final = self._final_verdict(out, changed, lossy)
        if not changed and final is None and _fingerprint(ir) != before:
            final = ("silent-change", "no pass reported a change but the graph was modified")
        if final is not None:
            result.update(outcome=final[0], reason=final[1])
        elif rolled:
            result.update(outcome="rolled-back", reason="; ".join(f"{r['name']}: {r['reason']}" for r in rolled),
                          rollback=_rollback_kind(rolled[0]["reason"]))
        elif changed:
            result["outcome"] = "rewritten-equal" if self.reference is not None else "rewritten-checked"
        elif skipped and len(skipped) == len(records):
            result.update(outcome="refused", reason="; ".join(f"{r['name']}: {r['reason']}" for r in skipped))
        else:
            result["outcome"] = "unchanged"

    def _manage(self, target: str, ir) -> tuple[list[dict], bool]:
        from qnnpasses.passmanager.manager import PassManager, RunConfig
        from qnnpasses.passmanager.named import get_pipeline
        from qnnpasses.passmanager.spec import Pipeline, parse_pipeline

        if target == BASELINE:
            return [], False
        pipeline = get_pipeline(target.split(":", 1)[1]) if target.startswith("pipeline:") else parse_pipeline(target)
        lossy = isinstance(pipeline, Pipeline) and not target.startswith("pipeline:") and any(
            not p.lossless for p in pipeline.passes())
        verify = self.reference is not None and self.deterministic
        config = RunConfig(verify=verify, inputs=dict(self.inputs) if verify else None, allow_lossy=lossy)
        run = PassManager(pipeline, config).run(ir)
        return [r.as_dict() for r in run.records], lossy

    def _final_verdict(self, out: Path, changed: bool, lossy: bool) -> tuple[str, str] | None:
        """``(outcome, reason)`` when the saved model is broken or computes something else."""
        problem = _full_check(out)
        if problem and not self.check_error:
            return "crashed", f"saved model fails the checker: {problem}"
        if self.reference is None:
            return None
        try:
            got = run_ort(out, self.inputs)
        except Exception as exc:  # noqa: BLE001
            return "crashed", f"onnxruntime cannot run the saved model: {_line(exc)}"
        diffs = differences(self.reference, got)
        if not self.deterministic:  # random ops: only names, dtypes and shapes can be compared
            diffs = [d for d in diffs if "dtype" in d or "shape" in d or "missing" in d]
        if not diffs:
            return None
        if lossy and changed:
            return "rewritten-lossy", "; ".join(diffs)[:500]
        return "mismatched", "; ".join(diffs)[:500]


def _rollback_kind(reason: str) -> str:
    if reason.startswith("pass raised"):
        return "raised"
    if reason.startswith("graph check failed"):
        return "check"
    return "verify"


# --------------------------------------------------------------------------- the pool


def _worker(conn, cache: str, timeout: float) -> None:
    signal.signal(signal.SIGALRM, _on_alarm)
    warnings.simplefilter("ignore")
    from onnx_graphsurgeon.logger import G_LOGGER

    G_LOGGER.severity = G_LOGGER.CRITICAL  # its warnings about odd dtypes are not findings
    from qnnpasses.passmanager.api import registered_passes

    registered_passes()  # import every pass module once, not inside the first case's timeout
    while True:
        task = conn.recv()
        if task is None:
            return
        name, targets = task
        try:
            runner = CaseRunner(Path(cache) / name)
        except Exception as exc:  # noqa: BLE001 - a broken cache entry
            for target in targets:
                conn.send(("result", {"case": name, "target": target, "outcome": "crashed",
                                      "reason": f"case setup: {_line(exc)}"}))
            conn.send(("done", name))
            continue
        for target in targets:
            conn.send(("start", target))
            signal.setitimer(signal.ITIMER_REAL, timeout)
            try:
                result = runner.run(target)
            except _Timeout:  # fired between run()'s own handlers
                result = {"case": name, "target": target, "outcome": "timeout", "reason": "soft timeout"}
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            conn.send(("result", result))
        conn.send(("done", name))


class _Slot:
    """One worker process and the case it is working on."""

    def __init__(self, ctx, cache: Path, timeout: float):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, str(cache), timeout), daemon=True)
        self.proc.start()
        child.close()
        self.task: tuple[str, list[str]] | None = None
        self.current: str | None = None
        self.done: list[str] = []
        self.deadline = 0.0

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


class _Pool:
    """Worker processes fed one case at a time; the parent enforces a hard timeout per target.

    The worker's own SIGALRM timeout stops Python code; a target stuck in native code
    (or a worker that dies, e.g. a segfault in onnxruntime) gets the worker killed and
    replaced, the target recorded, and the rest of the case queued again.
    """

    GRACE = 30.0

    def __init__(self, cache: Path, jobs: int, timeout: float):
        self.ctx = get_context("fork")
        self.cache, self.timeout = cache, timeout
        self.slots = [_Slot(self.ctx, cache, timeout) for _ in range(max(1, jobs))]
        self.queue: list[tuple[str, list[str]]] = []
        self.results: list[dict[str, Any]] = []
        self.finished = 0

    def run(self, names: list[str], targets: list[str], progress: bool) -> list[dict[str, Any]]:
        self.queue = [(n, list(targets)) for n in reversed(names)]
        shown = -1
        try:
            while self.queue or any(s.task for s in self.slots):
                self._assign()
                busy = [s for s in self.slots if s.task]
                wait = max(0.0, min(s.deadline for s in busy) - time.monotonic())
                ready = connection.wait([s.conn for s in busy], timeout=wait)
                for slot in busy:
                    if slot.conn in ready:
                        self._receive(slot)
                    elif time.monotonic() > slot.deadline:
                        self._replace(slot, "timeout", "hard timeout: worker killed")
                if progress and self.finished != shown:
                    shown = self.finished
                    print(f"\r{shown}/{len(names)} cases", end="", file=sys.stderr, flush=True)
        finally:
            for slot in self.slots:
                slot.stop()
            if progress:
                print(file=sys.stderr)
        return self.results

    def _assign(self) -> None:
        for slot in self.slots:
            if slot.task is None and self.queue:
                slot.task, slot.done, slot.current = self.queue.pop(), [], None
                slot.deadline = time.monotonic() + self.timeout + self.GRACE
                try:
                    slot.conn.send(slot.task)
                except OSError:
                    self._replace(slot, "crashed", f"worker process died (exit code {slot.proc.exitcode})")

    def _receive(self, slot: _Slot) -> None:
        try:
            kind, payload = slot.conn.recv()
        except (EOFError, OSError):
            slot.proc.join(1)
            self._replace(slot, "crashed", f"worker process died (exit code {slot.proc.exitcode})")
            return
        if kind == "start":
            slot.current = payload
            slot.deadline = time.monotonic() + self.timeout + self.GRACE
        elif kind == "result":
            self.results.append(payload)
            slot.done.append(payload["target"])
            slot.current = None
        elif kind == "done":
            slot.task = None
            self.finished += 1

    def _replace(self, slot: _Slot, outcome: str, reason: str) -> None:
        """Kill a worker, record its current target, and queue the rest of its case."""
        name, targets = slot.task
        current = slot.current or next((t for t in targets if t not in slot.done), None)
        if current is not None:
            self.results.append({"case": name, "target": current, "outcome": outcome, "reason": reason})
        rest = [t for t in targets if t not in slot.done and t != current]
        if rest:
            self.queue.append((name, rest))
        else:
            self.finished += 1
        slot.proc.kill()
        slot.proc.join()
        self.slots[self.slots.index(slot)] = _Slot(self.ctx, self.cache, self.timeout)


def run_corpus(names: list[str], targets: list[str], cache: Path | None = None, jobs: int = 2,
               timeout: float = 60.0, progress: bool = False) -> list[dict[str, Any]]:
    """Every (case, target) result of ``names`` (case names in ``cache``)."""
    return _Pool(cache or cache_dir(), jobs, timeout).run(names, targets, progress)


# --------------------------------------------------------------------------- the report


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Outcome counts per target and overall, rollbacks by kind, and contained-crash reasons per pass."""
    per_target: dict[str, Counter] = defaultdict(Counter)
    raised: dict[str, Counter] = defaultdict(Counter)
    examples: dict[tuple[str, str], str] = {}
    for r in results:
        per_target[r["target"]][r["outcome"]] += 1
        if r["outcome"] == "rolled-back":
            per_target[r["target"]][f"rolled-back:{r.get('rollback')}"] += 1
            for rec in r.get("records", []):
                if rec["status"] == "rolled-back" and rec["reason"].startswith("pass raised"):
                    key = _reason_key(rec["reason"])
                    raised[rec["name"]][key] += 1
                    examples.setdefault((rec["name"], key), r["case"])
    overall = Counter()
    for counts in per_target.values():
        overall.update(counts)
    return {
        "per_target": {t: dict(c) for t, c in sorted(per_target.items())},
        "overall": dict(overall),
        "contained_crashes": {p: [{"reason": k, "count": n, "example": examples[(p, k)]} for k, n in c.most_common()]
                              for p, c in sorted(raised.items())},
        "failures": [r for r in results if r["outcome"] in FAILURES],
        "silent_changes": sorted({(r["target"], r["case"]) for r in results if r["outcome"] == "silent-change"}),
    }


def _reason_key(reason: str) -> str:
    """A contained crash's reason without case-specific tensor names, to group equal bugs."""
    import re

    return re.sub(r"'[^']*'", "'…'", reason)[:160]


def render(summary: dict[str, Any], cache: Path) -> str:
    columns = ["unchanged", "rewritten-equal", "rewritten-checked", "refused", "rolled-back:raised",
               "rolled-back:check", "rolled-back:verify", "rewritten-lossy", "silent-change", "crashed", "mismatched",
               "timeout"]
    short = ["unch", "rw=", "rw-chk", "refused", "rb:raised", "rb:check", "rb:verify", "lossy", "silent", "CRASH",
             "MISMATCH", "TIMEOUT"]
    lines = ["| target | " + " | ".join(short) + " |", "|---" * (len(columns) + 1) + "|"]
    rows = list(summary["per_target"].items()) + [("**overall**", summary["overall"])]
    for target, counts in rows:
        lines.append(f"| {target} | " + " | ".join(str(counts.get(c, 0)) for c in columns) + " |")
    if summary["contained_crashes"]:
        lines += ["", "passes that raised (contained by the manager's rollback) — bugs:"]
        for name, reasons in summary["contained_crashes"].items():
            for item in reasons:
                lines.append(f"  {name}: {item['count']}x {item['reason']}  (e.g. {cache / item['example'] / 'model.onnx'})")
    if summary["silent_changes"]:
        lines += ["", "passes that modified the graph but reported changed=False:"]
        by_target = defaultdict(list)
        for target, case in summary["silent_changes"]:
            by_target[target].append(case)
        for target, cases in sorted(by_target.items()):
            lines.append(f"  {target}: {len(cases)} cases, e.g. {cache / cases[0] / 'model.onnx'}")
    if summary["failures"]:
        lines += ["", "failures:"]
        for r in summary["failures"]:
            where = f" at {r['where']}" if r.get("where") else ""
            lines.append(f"  {r['outcome']}: {r['target']} on {cache / r['case'] / 'model.onnx'}: {r['reason']}{where}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"case cache (default {DEFAULT_CACHE})")
    parser.add_argument("--sample", type=int, default=None, metavar="N", help="a fixed random sample of N cases")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", default=None, metavar="SUBSTR", help="only cases whose name contains SUBSTR")
    parser.add_argument("--targets", default=None,
                        help=f"comma list of pass names, 'pipeline:NAME' and '{BASELINE}' (default: all)")
    parser.add_argument("--pipeline", default=DEFAULT_PIPELINE, help="the named pipeline among the default targets")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per (case, target)")
    parser.add_argument("--json", type=Path, default=Path("op_corpus.json"), help="per-case details")
    parser.add_argument("--doc", type=Path, default=None, metavar="MD",
                        help="also write the report as Markdown (docs/op_corpus.md on a full run)")
    args = parser.parse_args(argv)
    names = generate(args.cache)
    if args.cases:
        names = [n for n in names if args.cases in n]
    names = sample(names, args.sample, args.seed)
    targets = args.targets.split(",") if args.targets else default_targets(args.pipeline)
    start = time.perf_counter()
    results = run_corpus(names, targets, cache_dir(args.cache), args.jobs, args.timeout, progress=True)
    summary = summarize(results)
    args.json.write_text(json.dumps({"cases": len(names), "targets": targets, "seconds": time.perf_counter() - start,
                                     "summary": {k: v for k, v in summary.items() if k != "failures"},
                                     "results": results}, indent=1, default=str))
    headline = f"{len(names)} cases x {len(targets)} targets in {time.perf_counter() - start:.0f} s (onnx {onnx.__version__})"
    print(f"{headline}; details in {args.json}")
    print(render(summary, cache_dir(args.cache)))
    if args.doc:
        args.doc.write_text(markdown(headline, summary, results))
    return 1 if summary["failures"] else 0


INTRO = ("Every backend node test the onnx package generates (`python tools/op_corpus.py --doc docs/op_corpus.md`), "
         "run through each registered pass alone, a plain load+save, and the `htp-llm` pipeline, with verification "
         "on onnxruntime CPU. Columns: unchanged; rewritten and equal; rewritten, checker only (onnxruntime cannot "
         "run the original); refused with a one-line reason (graphs onnx itself rejects, sequence/optional graph "
         "I/O); rolled back because the pass raised / broke the check / changed outputs; lossy; changed without "
         "saying so; crashed; mismatched; timed out.")


def markdown(headline: str, summary: dict[str, Any], results: list[dict[str, Any]]) -> str:
    """The report as docs/op_corpus.md has it: the table, then every verification rollback."""
    lines = ["# ONNX operator corpus", "", INTRO, "", headline, render(summary, Path("~/.cache/qnnpasses/op_corpus"))]
    rollbacks = sorted((r["target"], r["case"], r["reason"]) for r in results
                       if r["outcome"] == "rolled-back" and r.get("rollback") == "verify")
    if rollbacks:
        lines += ["", f"The {len(rollbacks)} verification rollbacks (a pass changed outputs beyond its contract; "
                  "the manager kept the graph before it):", ""]
        lines += [f"- {target} on `{case}`: {reason[:200]}" for target, case, reason in rollbacks]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
