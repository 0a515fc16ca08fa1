"""How much memory a long command holds: its peak private memory, sampled while it runs.

The kernel keeps a process's peak resident set (``ru_maxrss``), but that counts the pages of
files the process maps: onnxruntime sessions that leave the weights in their external-data
file (:func:`qnnpasses.backends.cpu.cpu_session` with ``mapped=True``) touch every weight page
on a run, and those pages are cache the system can drop and read again.  What the build
itself allocates is its *private* (anonymous) memory, ``RssAnon`` in ``/proc/self/status``,
of which Linux keeps no peak: :class:`PeakMemory` samples it on a thread.
"""

from __future__ import annotations

import ctypes
import gc
import resource
import threading
from pathlib import Path

import numpy as np

STATUS = Path("/proc/self/status")
KIB = 1024  # ru_maxrss and /proc's figures are in KiB on Linux


def private_bytes() -> int | None:
    """This process's private (anonymous) resident bytes now, or None where /proc does not say."""
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * KIB
    except OSError:
        return None
    return None


def release() -> None:
    """Give back the memory of what was dropped, between the stages of a long command.

    An IR graph is a web of reference cycles (nodes and tensors point at each other), and so are
    some of onnxruntime's session wrappers: Python frees a cycle only when its cycle collector
    runs, which it schedules by object counts, not bytes.  A dropped graph holding a model's
    weights in memory, or a dropped session holding its arena, can stay for the rest of the
    command.  So: collect now, then ask glibc to return its free heap pages to the system (not an
    error where there is no glibc)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """``with PeakMemory() as peak: ...``; then ``peak.figures()``."""

    def __init__(self, interval: float = 0.1):
        self.interval = interval
        self.private_peak = private_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="qnnpasses-memory", daemon=True)

    def __enter__(self) -> "PeakMemory":
        if self.private_peak is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._note()

    def _note(self) -> None:
        now = private_bytes()
        if now is not None:
            self.private_peak = max(self.private_peak or 0, now)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._note()

    def figures(self) -> dict[str, int | None]:
        """Peak private bytes of this process (sampled), peak resident bytes of this process and of
        its largest child (the kernel's, mapped files included)."""
        return {"private_peak_bytes": self.private_peak,
                "resident_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB,
                "child_resident_peak_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * KIB}


def spill(values: dict[str, np.ndarray], folder: Path, stem: str, *, above: int = 0) -> dict[str, np.ndarray]:
    """``values`` kept on disk: each array written to ``folder/stem.J.npy`` and mapped back read-only,
    when together they hold more than ``above`` bytes (else ``values`` itself).

    For outputs a long command keeps to compare with later (the references of verification cases:
    an LLM graph's logits and caches on ten cases at context 4096 are gigabytes).  Mapped pages are
    file cache the system can drop and read again, not the command's private memory."""
    if array_bytes(values) <= above:
        return values
    arrays = {k: v for k, v in values.items() if isinstance(v, np.ndarray)}
    folder.mkdir(parents=True, exist_ok=True)
    kept = dict(values)
    for j, (name, value) in enumerate(arrays.items()):
        path = folder / f"{stem}.{j}.npy"
        np.save(path, value)
        kept[name] = np.load(path, mmap_mode="r")
    return kept


def unspill(values: dict[str, np.ndarray]) -> None:
    """Remove the files :func:`spill` mapped ``values`` from (their pages stay readable while mapped)."""
    for value in values.values():
        if isinstance(value, np.memmap) and value.filename:
            Path(value.filename).unlink(missing_ok=True)


def array_bytes(values: dict) -> int:
    """Bytes of the arrays among ``values``' values."""
    return sum(v.nbytes for v in values.values() if isinstance(v, np.ndarray))
