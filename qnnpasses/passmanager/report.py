"""``report.json`` and ``report.md``: what the pipeline did, pass by pass."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.manager import RunResult
from qnnpasses.units import fmt_bytes

REPORT_VERSION = 1


def op_histogram(ir: IRModel) -> dict[str, int]:
    return dict(sorted(Counter(n.op for g in ir.graphs() for n in g.nodes).items()))


def build_report(*, input_path: str, output_path: str | None, pipeline_text: str, result: RunResult,
                 before: dict[str, int], after: dict[str, int], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    report = {
        "version": REPORT_VERSION,
        "input": input_path,
        "output": output_path,
        "pipeline": pipeline_text,
        "nodes_before": sum(before.values()),
        "nodes_after": sum(after.values()),
        "ops_before": before,
        "ops_after": after,
        "passes": [r.as_dict() for r in result.records],
        "final_verification": result.final_verification,
        "verification_cases": result.verification_cases,
    }
    report.update(extra or {})
    return report


def write_report(report: dict[str, Any], directory: str | Path) -> tuple[Path, Path]:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "report.json", out / "report.md"
    json_path.write_text(json.dumps(json_safe(report), indent=2) + "\n")
    md_path.write_text(render_markdown(report))
    return json_path, md_path


def json_safe(value):
    """JSON has no NaN or infinity: write them as strings so every reader can parse the file."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def pass_table_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for p in report["passes"]:
        verification = p.get("verification")
        figures = f"{verification['max_abs']:.2e} / {verification['cosine']:.6f}" if verification else ""
        stats = _compact_stats(p["stats"])
        status = p["status"] + (f" ({p['reason']})" if p["reason"] else "")
        if p.get("misreported"):
            status += " [pass misreported changed]"
        delta = " ".join(f"{op}{n:+d}" for op, n in p["op_delta"].items())
        rows.append([str(p["index"]), p["spec"], CONTRACT_SHORT.get(p.get("contract", {}).get("kind"), "?"), status,
                     f"{p['nodes_before']}→{p['nodes_after']}", delta, stats, figures, f"{p['seconds']:.2f}"])
    return rows


def _compact_stats(stats: dict[str, Any], limit: int = 70) -> str:
    """The counters worth a glance: non-zero, short, not timings or node counts (the table has
    those); report.json keeps them all."""
    shown = [f"{k}={v}" for k, v in stats.items() if v not in (0, 0.0, "", None, False) and len(str(v)) <= 24
             and not k.endswith("_seconds") and k not in ("nodes_before", "nodes_after")]
    text = ", ".join(shown)
    return text if len(text) <= limit else text[: limit - 1] + "…"


TABLE_HEADER = ["#", "pass", "contract", "status", "nodes", "op delta", "stats", "max abs / cosine", "s"]
CONTRACT_SHORT = {"exact": "exact", "approximate": "approx", "assumes": "assumes", "changes-interface": "interface"}


def _parts(partitions: dict[str, int]) -> str:
    """``{'htp': 7, 'cpu': 11}`` -> ``HTP 7, CPU 11``."""
    return ", ".join(f"{k.upper()} {v}" for k, v in partitions.items())


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        "# qnnpasses report",
        "",
        f"- input: `{report['input']}`",
        f"- output: `{report['output']}`",
        f"- pipeline: `{report['pipeline']}`",
        f"- nodes: {report['nodes_before']} → {report['nodes_after']}",
    ]
    final = report.get("final_verification")
    if final:
        verdict = "ok" if final.get("ok", True) else f"**FAILED**: {final.get('failure', '')}"
        lines.append(f"- end-to-end vs input (onnxruntime CPU): max abs {final['max_abs']:.3g}, "
                     f"cosine {final['cosine']:.8f}, {verdict}")
        compared = ", ".join(final.get("cases", {}))
        skipped = ", ".join(final.get("not_compared", {}))
        lines.append(f"- verification cases compared end to end: {compared or 'none'}"
                     + (f"; not compared (an applied contract assumes what they break): {skipped}" if skipped else ""))
    for key, value in report.items():
        if key.startswith("summary_") and isinstance(value, str):
            lines.append(f"- {key[len('summary_'):].replace('_', ' ')}: {value}")
    snapshots = report.get("model_before"), report.get("model_after")
    if all(snapshots):
        lines += ["", "| | before | after |", "|---|---|---|"]
        for key, label in (("weights_bytes", "weight bytes"), ("activation_peak_bytes_reuse", "peak activations (reuse)"),
                           ("kv_cache_bytes_fp16", "KV cache (fp16)")):
            lines.append(f"| {label} | {fmt_bytes(snapshots[0].get(key))} | {fmt_bytes(snapshots[1].get(key))} |")
        support = [s["support"] for s in snapshots]
        lines.append(f"| nodes the HTP table supports | {support[0]['supported']}/{support[0]['nodes']} | "
                     f"{support[1]['supported']}/{support[1]['nodes']} |")
        lines.append(f"| predicted partitions | {_parts(support[0]['partitions'])} | {_parts(support[1]['partitions'])} |")
    lines += ["", "| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
    for row in pass_table_rows(report):
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    contracts = {p["name"]: p["contract"]["text"] for p in report["passes"] if p.get("contract")}
    if contracts:
        lines += ["", "## Contracts", ""] + [f"- `{name}`: {text}" for name, text in contracts.items()]
    lines += ["", "## Op types", "", "| op | before | after |", "|---|---|---|"]
    ops = sorted(set(report["ops_before"]) | set(report["ops_after"]))
    for op in ops:
        lines.append(f"| {op} | {report['ops_before'].get(op, 0)} | {report['ops_after'].get(op, 0)} |")
    return "\n".join(lines) + "\n"
