"""The one harness for backend work in a child process.

A QNN session can take the process down (a SIGSEGV on a weight-shared context, an abort in
graph finalize) or hang; so every probe, compile and load runs in ``python -m MODULE ...``,
which writes what it learned to a JSON file as it goes.  :func:`run_child` starts it with a
timeout and says how it ended; what a caller makes of the result is its own business.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: the longest a child may take (a compile of a 1 B-parameter graph takes minutes here)
CHILD_TIMEOUT = 900.0
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def describe_exit(returncode: int) -> str | None:
    """None for a clean exit; else how the child ended, in words."""
    if returncode == 0:
        return None
    if returncode < 0:
        try:
            return f"backend process killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"backend process killed by signal {-returncode}"
    return f"backend process exited with status {returncode}"


@dataclass
class ChildRun:
    result: dict[str, Any] | None  # the JSON the child wrote, None when it wrote none
    crash: str | None = None  # how it ended when not cleanly (or timed out), else None
    returncode: int | None = None
    stderr_tail: list[str] = field(default_factory=list)  # its last stderr line, when stderr was captured

    @property
    def ok(self) -> bool:
        return self.crash is None and bool(self.result and self.result.get("ok"))


def run_child(module: str, args: list[str], result_path: Path, *, timeout: float = CHILD_TIMEOUT,
              log_path: Path | None = None) -> ChildRun:
    """``python -m module *args`` with ``timeout``; its stdout and stderr go to ``log_path`` when given
    (the backend's log, for the caller to parse), else stderr is kept for its last line."""
    cmd = [sys.executable, "-m", module, *args]
    try:
        if log_path is not None:
            with open(log_path, "wb") as log:
                proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False)
        else:
            proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        result = json.loads(result_path.read_text()) if result_path.exists() else None
        return ChildRun(result, crash=f"timed out after {timeout:g}s")
    result = json.loads(result_path.read_text()) if result_path.exists() else None
    tail = strip_ansi(proc.stderr.decode(errors="replace")).strip().splitlines()[-1:] if proc.stderr else []
    return ChildRun(result, describe_exit(proc.returncode), proc.returncode, tail)
