"""Progress of long steps (HTP probes, compiles, calibration), told to whoever listens.

Library code calls :func:`step` with a short sentence ("compiling model.onnx on the HTP");
nothing is printed unless a listener is installed — the command line installs one that
writes the lines to stderr with the elapsed time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

_listener: Callable[..., None] | None = None
#: Minor steps are shown only once the command has run this long (quick runs stay quiet).
MINOR_AFTER_SECONDS = 3.0


def step(message: str, *, minor: bool = False) -> None:
    """Report the start of a step that may take more than a few seconds; ``minor`` steps
    (many short ones) are shown only when the whole command is slow."""
    if _listener is not None:
        _listener(message, minor=minor)


@contextlib.contextmanager
def listening(callback: Callable[..., None]) -> Iterator[None]:
    """Send every :func:`step` to ``callback`` inside the block."""
    global _listener
    previous, _listener = _listener, callback
    try:
        yield
    finally:
        _listener = previous


def stderr_listener(stream, prefix: str = "qnnpasses") -> Callable[[str], None]:
    """A listener writing ``prefix: [  12.3s] message`` lines to ``stream``."""
    start = time.monotonic()

    def write(message: str, minor: bool = False) -> None:
        elapsed = time.monotonic() - start
        if minor and elapsed < MINOR_AFTER_SECONDS:
            return
        stream.write(f"{prefix}: [{elapsed:6.1f}s] {message}\n")
        stream.flush()

    return write


__all__ = ["listening", "stderr_listener", "step"]
