"""``analyze --picture``: activation memory over the schedule, as PNG or SVG.

The picture answers "how much activation memory, and where is the peak?": the live set
(tensors freed after their last use) over the schedule, the reuse arena as a line, the peak
marked and labelled with its size and node, and the transformer layers shaded and named
along the x axis.  The no-reuse total (every tensor its own buffer) grows far above the
rest and would flatten it, so it is stated in the title instead of drawn.

matplotlib is optional (``pip install 'qnnpasses[plot]'``); without it the option fails
with one line before any work.  The Agg backend renders to a file with no display.
"""

from __future__ import annotations

from pathlib import Path

from qnnpasses.errors import BadInputError
from qnnpasses.units import fmt_bytes

SUFFIXES = (".png", ".svg")


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise BadInputError("--picture needs matplotlib (pip install 'qnnpasses[plot]' or pip install matplotlib)") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def check_path(path: str | Path) -> Path:
    out = Path(path)
    if out.suffix.lower() not in SUFFIXES:
        raise BadInputError(f"--picture writes a .png or .svg file; got '{out.name}'")
    return out


def _unit(peak: float) -> tuple[float, str]:
    for scale, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if peak >= scale:
            return float(scale), name
    return 1.0, "B"


def layer_spans(layers: list[str]) -> list[tuple[str, int, int]]:
    """Runs of consecutive steps in one layer: (label, first step, last step + 1)."""
    spans: list[tuple[str, int, int]] = []
    for step, label in enumerate(layers):
        if spans and spans[-1][0] == label:
            spans[-1] = (label, spans[-1][1], step + 1)
        else:
            spans.append((label, step, step + 1))
    return spans


def plot_memory(trace, path: str | Path, title: str = "") -> Path:
    """Write the picture of ``trace`` to ``path`` (.png or .svg)."""
    out = check_path(path)
    plt = _pyplot()
    live = trace.live
    peak_step = int(live.argmax()) if len(live) else 0
    peak = float(live[peak_step]) if len(live) else 0.0
    scale, unit = _unit(max(peak, float(trace.arena)))
    steps = range(len(live))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    try:
        spans = layer_spans(list(trace.layers))
        longest = {}
        for label, start, end in spans:  # each layer is named once, over its longest run
            if end - start > longest.get(label, (0, 0))[1] - longest.get(label, (0, 0))[0]:
                longest[label] = (start, end)
        for label, start, end in spans:
            if label.isdigit():  # numbered layers alternate two shades; the rest stays white
                ax.axvspan(start - 0.5, end - 0.5, color="0.90" if int(label) % 2 else "0.96", zorder=0)
            if longest[label] == (start, end) and end - start >= max(len(live) / 40, 1):
                name = f"layer {label}" if label.isdigit() else label
                ax.text((start + end - 1) / 2, 1.0, name, transform=ax.get_xaxis_transform(), ha="center",
                        va="bottom", fontsize=8, color="0.35")
        ax.plot(steps, live / scale, color="tab:blue", label="live tensors (freed after last use)", zorder=3)
        ax.axhline(trace.arena / scale, linestyle="--", color="tab:green",
                   label=f"arena with buffer reuse: {fmt_bytes(trace.arena)}", zorder=2)
        if len(live):
            node = trace.nodes[peak_step] if peak_step < len(trace.nodes) else f"step {peak_step}"
            ax.plot([peak_step], [peak / scale], "o", color="tab:red", zorder=4)
            ax.annotate(f"peak {fmt_bytes(peak)}\n{node}", (peak_step, peak / scale), textcoords="offset points",
                        xytext=(8, -4), fontsize=8, color="tab:red", va="top",
                        ha="left" if peak_step < len(live) * 0.7 else "right")
        ax.set_ylim(0, max(peak, float(trace.arena)) / scale * 1.15 or 1)
        ax.set_xlim(-0.5, max(len(live) - 0.5, 0.5))
        ax.set_xlabel(f"schedule step ({trace.schedule} order)")
        ax.set_ylabel(f"activation memory ({unit})")
        total = float(trace.allocated[-1]) if len(trace.allocated) else 0.0
        heading = title or "activation memory over the schedule"
        ax.set_title(f"{heading}\nwithout reuse (every tensor its own buffer) it would be {fmt_bytes(total)}",
                     fontsize=10, pad=16)
        ax.legend(loc="lower right", fontsize=8)
        ax.grid(alpha=0.3, axis="y")
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            with plt.rc_context({"svg.fonttype": "none"}):  # SVG text stays text (searchable, selectable)
                fig.savefig(out, dpi=110, bbox_inches="tight")
        except OSError as exc:
            raise BadInputError(f"cannot write {out}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return out
