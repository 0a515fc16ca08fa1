#!/usr/bin/env python
"""Write ``docs/targets.md`` / ``docs/targets.json``: the devices ``--soc`` / ``--htp-arch`` name,
what the HTP backend here does with each, and how the op-support tables of the archs differ.

    python tools/targets_doc.py                 # measure on the backend, then write both files
    python tools/targets_doc.py --render-only   # targets.md again from targets.json

Measured per target (:mod:`qnnpasses.backends.targets`): whether the backend accepts it
(:func:`qnnpasses.backends.htp.check_target`: a three-node float graph prepared with CPU
fallback off).  Per HTP arch with probe results (``tools/probe_results/htp_build[.vNN].jsonl``,
``python tools/probe_htp.py --suite build --soc NAME``): how many of the build suite's probes
got another verdict than on v73, and which ops they were.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = ROOT / "tools" / "probe_results"
TABLES = ROOT / "op_support" / "tables"


def _verdicts(path: Path) -> dict[str, str]:
    records = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {r["id"]: r["verdict"] for r in records}


def measure() -> dict[str, Any]:
    from qnnpasses.backends.htp import _target_refusal, htp_available
    from qnnpasses.backends.targets import DEFAULT, TARGETS

    accepted = {}
    for target in TARGETS:
        if not htp_available():
            accepted[target.name] = None
            continue
        error = _target_refusal(target)
        accepted[target.name] = {"accepted": error is None, "error": error}
    base = _verdicts(RESULTS / "htp_build.jsonl")
    archs = {}
    for arch in sorted({t.htp_arch for t in TARGETS}):
        path = RESULTS / ("htp_build.jsonl" if arch == DEFAULT.htp_arch else f"htp_build.v{arch}.jsonl")
        if not path.is_file():
            archs[f"v{arch}"] = None
            continue
        verdicts = _verdicts(path)
        differ = sorted(i for i in base if i in verdicts and verdicts[i] != base[i])
        table = "htp.json" if arch == DEFAULT.htp_arch else f"htp_v{arch}.json"
        archs[f"v{arch}"] = {"probes": len(verdicts), "differ_from_v73": len(differ),
                             "ops_that_differ": dict(Counter(i.split("/")[1].split("@")[0] for i in differ)),
                             "on_htp": sum(v == "htp" for v in verdicts.values()),
                             "table": table if (TABLES / table).is_file() else None}
    return {"onnxruntime_qnn": importlib.metadata.version("onnxruntime-qnn"), "targets": accepted, "archs": archs}


def _gbps(target: Any) -> str:
    rate = target.memory_bytes_per_second
    return "-" if rate is None else f"{rate / 1e9:.1f} GB/s (LPDDR5X {target.memory_mts} MT/s, {target.memory_bus_bits}-bit)"


def render(data: dict[str, Any]) -> str:
    from qnnpasses.backends.targets import DEFAULT, TARGETS

    lines = ["# Targets", "",
             "The devices `--soc NAME` / `--htp-arch vNN` name (registry: `qnnpasses/backends/targets.py`, sources in its",
             f"docstring); default: {DEFAULT.product}. Written by `python tools/targets_doc.py` on the simulated HTP of",
             f"onnxruntime-qnn {data['onnxruntime_qnn']}.", "",
             "| name | part | product | soc_model | HTP | memory bandwidth | accepted by the backend here |",
             "|---|---|---|---:|---|---|---|"]
    for t in TARGETS:
        verdict = data["targets"].get(t.name)
        said = ("not measured (no backend)" if verdict is None else "yes" if verdict["accepted"]
                else "no: every node left to the CPU" if "CPU EP" in (verdict["error"] or "")
                else f"no: {verdict['error'][:90]}")
        lines.append(f"| {t.name} | {t.part} | {t.product} | {t.soc_model} | v{t.htp_arch} | {_gbps(t)} | {said} |")
    lines += ["", "## Op support per HTP arch", "",
              "The build suite of single-op probes (`tools/probe_htp.py`) prepared for a target of each arch, against v73's:",
              "", "| HTP | probes | on the HTP | verdicts that differ from v73 | ops | table |", "|---|---:|---:|---:|---|---|"]
    for arch, row in data["archs"].items():
        if row is None:
            lines.append(f"| {arch} | not probed | | | | v73's `htp.json` is used |")
            continue
        ops = ", ".join(f"{op} ({n})" for op, n in sorted(row["ops_that_differ"].items())) or "-"
        table = f"`{row['table']}`" if row["table"] else "v73's `htp.json` is used"
        lines.append(f"| {arch} | {row['probes']} | {row['on_htp']} | {row['differ_from_v73']} | {ops} | {table} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--render-only", action="store_true", help="rewrite targets.md from targets.json")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.render_only:
        data = json.loads((DOCS / "targets.json").read_text())
    else:
        data = measure()
        (DOCS / "targets.json").write_text(json.dumps(data, indent=1) + "\n")
    (DOCS / "targets.md").write_text(render(data))
    print(f"wrote {DOCS / 'targets.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
