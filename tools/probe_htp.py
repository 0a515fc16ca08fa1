#!/usr/bin/env python
"""Measure HTP op support: run every single-op probe of a suite on the real QNN HTP backend.

    python tools/probe_htp.py --suite build      # -> tools/probe_results/htp_build.jsonl
    python tools/probe_htp.py --suite holdout    # -> tools/probe_results/htp_holdout.jsonl
    python tools/probe_htp.py --suite build --only Softmax,Gather --out /tmp/x.jsonl
    python tools/probe_htp.py --suite build --soc 8gen3   # -> tools/probe_results/htp_build.v75.jsonl

Each probe is one ONNX model with one node (see ``tools/probe_catalog.py``), run through
:func:`qnnpasses.backends.htp.probe_placement` in fp16 mode with onnxruntime's own graph
optimizations off (so the EP sees the node as written: no constant folding of Shape or
Range, no fusion).  The record is the probe spec plus ``verdict`` — ``htp`` (the EP took
the node and the graph finalized and ran), ``cpu`` (the EP rejected it; it falls back to
the CPU EP) or ``error`` (the EP took it but finalize/run failed) — with the reason and
the composed QNN ops.  Every probe is its own child process; two run at a time.  ``--soc`` names
the target (:mod:`qnnpasses.backends.targets`; default: Snapdragon X Elite, HTP v73) the probes
are prepared for; results for another target go to ``htp_<suite>.v<arch>.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import onnx
from probe_catalog import SUITES, suite_specs
from qnnpasses.op_support.probe_models import (
    ProbeSpec,
    build_model,
    make_inputs,
    node_name,
)

from qnnpasses.backends.htp import htp_available, probe_placement

RESULTS_DIR = Path(__file__).resolve().parent / "probe_results"
REASON_LIMIT = 200


def probe_one(spec: ProbeSpec, workdir: Path, timeout: float = 60.0) -> dict[str, Any]:
    """Run one probe; the JSONL record."""
    path = workdir / f"{abs(hash(spec.id))}.onnx"
    onnx.save(build_model(spec), path)
    placement = probe_placement(path, make_inputs(spec), fp16=True, optimize=False, timeout=timeout)
    path.unlink(missing_ok=True)
    verdict, reason = placement.node_verdict(node_name(spec))
    if verdict == "unknown":
        verdict = "cpu"
    record = spec.to_record()
    record.update(verdict=verdict, reason=_clip(reason), qnn_ops=placement.qnn_graph_ops["by_type"])
    return record


def _clip(text: str) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= REASON_LIMIT else text[: REASON_LIMIT - 3] + "..."


def run_suite(specs: list[ProbeSpec], out: Path, *, jobs: int) -> list[dict[str, Any]]:
    """Probe ``specs`` with ``jobs`` concurrent child processes; write JSONL in spec order."""
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="qnnpasses_probe_models_") as tmp, ThreadPoolExecutor(jobs) as pool:
        futures = [pool.submit(probe_one, s, Path(tmp)) for s in specs]
        records = []
        for i, fut in enumerate(futures, 1):
            records.append(fut.result())
            if i % 100 == 0 or i == len(futures):
                print(f"  {i}/{len(futures)} probes, {time.monotonic() - start:.0f}s", file=sys.stderr, flush=True)
    with open(out, "w") as fh:
        fh.writelines(json.dumps(rec, separators=(",", ":")) + "\n" for rec in records)
    return records


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _merge(out: Path, fresh: list[dict[str, Any]], *, order: list[str], previous: list[dict[str, Any]]) -> None:
    """Re-probing some ops (``--only``) updates their records in the suite file, in catalogue order."""
    by_id = {r["id"]: r for r in previous}
    by_id.update({r["id"]: r for r in fresh})
    rank = {pid: i for i, pid in enumerate(order)}
    kept = sorted((r for pid, r in by_id.items() if pid in rank), key=lambda r: rank[r["id"]])
    with open(out, "w") as fh:
        fh.writelines(json.dumps(rec, separators=(",", ":")) + "\n" for rec in kept)


def summarize(records: list[dict[str, Any]]) -> str:
    """Per-op verdict counts, one line per op."""
    per_op: dict[str, Counter[str]] = defaultdict(Counter)
    for rec in records:
        per_op[(rec["domain"] + "." if rec["domain"] else "") + rec["op"]][rec["verdict"]] += 1
    lines = [f"{'op':40s} {'htp':>4s} {'cpu':>4s} {'error':>5s}"]
    for op in sorted(per_op):
        c = per_op[op]
        lines.append(f"{op:40s} {c['htp']:4d} {c['cpu']:4d} {c['error']:5d}")
    total = Counter(r["verdict"] for r in records)
    lines.append(f"{'TOTAL':40s} {total['htp']:4d} {total['cpu']:4d} {total['error']:5d}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=[*SUITES, "all"], default="all")
    parser.add_argument("--only", help="comma-separated op labels to probe (e.g. Softmax,com.microsoft.Gelu)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, help="output file (default: tools/probe_results/htp_<suite>.jsonl; "
                        "with --only, records in the default file are updated in place)")
    parser.add_argument("--soc", help="target SoC (default: the X Elite, the bundled table's target)")
    args = parser.parse_args(argv)
    from qnnpasses.backends.targets import DEFAULT, activate, resolve

    target = activate(resolve(args.soc))
    suffix = "" if target == DEFAULT else f".v{target.htp_arch}"
    if not htp_available():
        print("onnxruntime-qnn is not available", file=sys.stderr)
        return 2
    wanted = set(args.only.split(",")) if args.only else None
    for suite in list(SUITES) if args.suite == "all" else [args.suite]:
        all_specs = suite_specs(suite)
        specs = [s for s in all_specs if wanted is None or s.id.split("/")[1].split("@")[0] in wanted]
        out = args.out or RESULTS_DIR / f"htp_{suite}{suffix}.jsonl"
        previous = _read(out) if wanted and args.out is None and out.exists() else None
        print(f"suite {suite}: {len(specs)} probes for {target} -> {out}" + (" (update)" if previous else ""),
              file=sys.stderr)
        records = run_suite(specs, out, jobs=args.jobs)
        if previous:
            _merge(out, records, order=[s.id for s in all_specs], previous=previous)
        print(summarize(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
