"""``--plot``: activation memory over the schedule, with and without buffer reuse.

matplotlib is optional (the ``test`` extra installs it); without it ``--plot`` fails with
one line.  The Agg backend renders to a file with no display.
"""

from __future__ import annotations

from pathlib import Path

from qnnpasses.errors import BadInputError


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise BadInputError("--plot needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_memory(trace, path: str | Path, title: str = "") -> Path:
    """Write a PNG of bytes over schedule steps: no reuse, live set, and the reuse arena."""
    out = Path(path)
    if out.suffix.lower() != ".png":
        raise BadInputError(f"--plot writes a PNG file; got '{out.name}'")
    plt = _pyplot()
    mib = 1024.0 * 1024.0
    steps = range(len(trace.live))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    try:
        ax.plot(steps, trace.allocated / mib, label="no reuse (every tensor its own buffer)", color="tab:red")
        ax.plot(steps, trace.live / mib, label="live tensors (freed after last use)", color="tab:blue")
        ax.axhline(trace.arena / mib, linestyle="--", color="tab:green",
                   label=f"reuse arena {trace.arena / mib:.3g} MiB")
        ax.set_xlabel(f"schedule step ({trace.schedule} order)")
        ax.set_ylabel("activation memory (MiB)")
        ax.set_title(title or "activation memory over the schedule")
        ax.legend(loc="upper left")
        ax.grid(alpha=0.3)
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            fig.savefig(out, dpi=110, bbox_inches="tight")
        except OSError as exc:
            raise BadInputError(f"cannot write {out}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return out
