"""Ready-made instruments: a progress display and per-pass IR dumps with diffs."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

from qnnpasses.ir.canonical import canonical_lines, unified_diff
from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import Pass
from qnnpasses.passmanager.manager import CHANGED, ROLLED_BACK, SKIPPED, UNCHANGED, Instrument, PassRecord
from qnnpasses.passmanager.spec import Pipeline
from qnnpasses.units import fmt_seconds


class ProgressInstrument(Instrument):
    """Progress on stderr: a live spinner on terminals (gone when the pass ends, so the
    summary table is not a second copy of it), one line per pass elsewhere (logs, CI)."""

    def __init__(self, stream=None):
        from rich.console import Console

        self.console = Console(file=stream or sys.stderr, highlight=False)
        self._status = None
        self._start = 0.0

    def before_pipeline(self, ir: IRModel, pipeline: Pipeline) -> None:
        self._start = time.perf_counter()
        self._total = len(pipeline.passes())

    def before_pass(self, pass_: Pass, ir: IRModel, record: PassRecord) -> None:
        if self.console.is_terminal:
            self._status = self.console.status(f"[{record.index}] {pass_.name} ...")
            self._status.start()

    def after_pass(self, pass_: Pass, ir: IRModel, record: PassRecord) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
        if self.console.is_terminal and record.status != ROLLED_BACK:
            return  # the summary table says it; a rolled-back pass is worth a line at once
        elapsed = time.perf_counter() - self._start
        detail = {
            CHANGED: f"{record.nodes_before} -> {record.nodes_after} nodes",
            ROLLED_BACK: f"ROLLED BACK: {record.reason}",
        }.get(record.status, record.reason or record.status)
        if record.misreported:
            detail += " (the pass misreported whether it changed the graph)"
        self.console.print(f"[{elapsed:7.1f}s] {record.index:>3} {pass_.name:<22} {record.seconds:6.2f}s  {detail}",
                           markup=False)


class IRDumpInstrument(Instrument):
    """Writes ``NN-<pass>.txt`` (canonical IR after each changed pass) and ``NN-<pass>.diff``."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._lines: list[str] = []

    def before_pipeline(self, ir: IRModel, pipeline: Pipeline) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lines = canonical_lines(ir)
        (self.directory / "00-input.txt").write_text("\n".join(self._lines) + "\n")

    def after_pass(self, pass_: Pass, ir: IRModel, record: PassRecord) -> None:
        if record.status != CHANGED:
            return
        lines = canonical_lines(ir)
        stem = f"{record.index:02d}-{_safe(pass_.name)}"
        (self.directory / f"{stem}.txt").write_text("\n".join(lines) + "\n")
        (self.directory / f"{stem}.diff").write_text(unified_diff(self._lines, lines, f"before/{stem}", f"after/{stem}"))
        self._lines = lines


# --------------------------------------------------------------------------- the run summary


def _delta(op_delta: dict[str, int], limit: int = 5) -> str:
    """The largest op-count changes first, at most ``limit`` (report.json keeps them all)."""
    ranked = sorted(op_delta.items(), key=lambda kv: (-abs(kv[1]), kv[0]))
    text = " ".join(f"{op}{n:+d}" for op, n in ranked[:limit])
    return text + (f" +{len(ranked) - limit} more" if len(ranked) > limit else "")


def opset_changes(report: dict) -> list[str]:
    """Sentences for every opset raise (and refused raise) the passes recorded."""
    lines = []
    for p in report["passes"]:
        change = (p.get("stats") or {}).get("opset")
        if change:
            before, _, after = str(change).partition("->")
            lines.append(f"opset raised {before} -> {after} by {p['name']}: the op it fuses into needs opset {after} "
                         "(converters accept opsets up to a limit: cap it with --target-opset N)")
        for note in p.get("notes") or []:
            if "--target-opset" in note:
                lines.append(f"{p['name']}: {note}")
    return lines


def render_summary(report: dict, width: int | None = None) -> str:
    """The run summary for a terminal ``width`` columns wide (default: the terminal's):
    one row per pass that changed the graph, the unchanged ones named in one line.  Internal
    counters stay in report.json."""
    import io
    import shutil

    from rich.console import Console
    from rich.table import Table

    width = width or shutil.get_terminal_size((100, 24)).columns
    verified = any(p.get("verification") for p in report["passes"])
    title = f"{report['input']} -> {report['output']}: {report['nodes_before']} -> {report['nodes_after']} nodes"
    table = Table(title=title, title_justify="left", box=None, pad_edge=False, show_edge=False)
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("pass", overflow="fold")
    table.add_column("nodes", no_wrap=True)
    table.add_column("what changed", overflow="fold", ratio=1)
    if verified:
        table.add_column("max abs / cosine", overflow="fold")
    table.add_column("time", justify="right", no_wrap=True)
    unchanged, skipped = [], []
    for p in report["passes"]:
        if p["status"] == UNCHANGED:
            unchanged.append(p["name"])
            continue
        if p["status"] == SKIPPED:
            why = "needs --allow-lossy" if "--allow-lossy" in (p.get("reason") or "") else "see report.json"
            skipped.append(f"{p['name']} ({why})")
            continue
        what = _delta(p["op_delta"]) or "attributes/values only"
        if p["status"] == ROLLED_BACK:
            what = f"ROLLED BACK: {p['reason']}"
        elif p["status"] != CHANGED:
            what = f"{p['status']}: {p['reason']}" if p.get("reason") else p["status"]
        row = [str(p["index"]), p["name"], f"{p['nodes_before']}->{p['nodes_after']}", what]
        v = p.get("verification")
        if verified:
            row.append(f"{v['max_abs']:.1e} / {v['cosine']:.6f}" if v else "")
        row.append(fmt_seconds(p["seconds"]))
        table.add_row(*row)
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, highlight=False, color_system=None, force_terminal=False,
                      legacy_windows=False)
    console.print(table)
    if unchanged:
        names = ", ".join(dict.fromkeys(unchanged))
        console.print(f"unchanged: {len(unchanged)} pass(es) ({names})", markup=False)
    if skipped:
        console.print(f"skipped: {', '.join(skipped)}", markup=False)
    for line in opset_changes(report):
        console.print(line, markup=False)
    final = report.get("final_verification")
    if final and final.get("max_abs") is not None:
        console.print(f"end-to-end vs input on onnxruntime CPU: max abs {final['max_abs']:.3g}, "
                      f"cosine {final['cosine']:.8f}", markup=False)
    return "\n".join(line.rstrip() for line in buffer.getvalue().rstrip().splitlines())


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)
