"""Ready-made instruments: a progress display and per-pass IR dumps with diffs."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

from qnnpasses.ir.canonical import canonical_lines, unified_diff
from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import Pass
from qnnpasses.passmanager.manager import CHANGED, ROLLED_BACK, Instrument, PassRecord
from qnnpasses.passmanager.spec import Pipeline


class ProgressInstrument(Instrument):
    """One line per pass on stderr with elapsed time; a live spinner on terminals."""

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
        elapsed = time.perf_counter() - self._start
        detail = {
            CHANGED: f"{record.nodes_before} -> {record.nodes_after} nodes",
            ROLLED_BACK: f"ROLLED BACK: {record.reason}",
        }.get(record.status, record.reason or record.status)
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


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)
