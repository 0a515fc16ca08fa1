"""A picture of the plan that answers "where does the model run?" at a glance.

One strip in execution order: every partition a block as wide as its share of the nodes,
HTP partitions in blues/greens, CPU ones in oranges/reds, labelled with its number, backend
and node count; under it the transformer layers the nodes belong to, so a CPU block reads
as "layer 1's attention leaves the HTP".  The legend lists each partition with its layers,
weights and work, and the title says how many nodes are only constant computations (copied
into the partitions that read them).  Written as SVG (no plotting library needed) and, with
matplotlib installed, as PNG.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from qnnpasses.partition.graph import NodeGraph
from qnnpasses.units import fmt_bytes, fmt_flops

_HTP_COLOURS = ["#4e79a7", "#59a14f", "#76b7b2", "#2f6690", "#8cd17d", "#499894", "#86bcb6", "#3a6ea5"]
_CPU_COLOURS = ["#f28e2b", "#e15759", "#ff9d9a", "#d37295", "#b6992d", "#f1ce63"]
_LAYER_GREYS = ["#d9d9d9", "#b3b3b3"]
_WIDTH, _STRIP_X, _STRIP_W = 900, 90, 790


def colours(plan) -> dict[int, str]:
    counters = {"htp": 0, "cpu": 0}
    result = {}
    for part in plan.partitions:
        palette = _HTP_COLOURS if part.backend == "htp" else _CPU_COLOURS
        result[part.id] = palette[counters[part.backend] % len(palette)]
        counters[part.backend] += 1
    return result


def layout(ng: NodeGraph, plan) -> dict:
    """The strip: blocks per partition and runs of layers, as fractions of the node count."""
    order = [(part, i) for part in plan.partitions for i in sorted(part.indices)]
    total = max(len(order), 1)
    blocks, start = [], 0
    for part in plan.partitions:
        blocks.append((part, start / total, len(part.indices) / total))
        start += len(part.indices)
    layers: list[list] = []  # [label, start, width]
    for position, (_, i) in enumerate(order):
        label = str(ng.view.layers[i])
        if layers and layers[-1][0] == label:
            layers[-1][2] += 1 / total
        else:
            layers.append([label, position / total, 1 / total])
    constant_only = len({n for part in plan.partitions for n in part.constant_nodes})
    return {"blocks": blocks, "layers": layers, "placed": len(order), "constant_only": constant_only}


def title(plan, data: dict) -> str:
    name = Path(plan.model).name if plan.model else "model"
    counts = " + ".join(f"{n} {b.upper()}" for b, n in sorted(plan.counts().items(), reverse=True))
    text = f"{name}: {counts} partition(s), {data['placed']} nodes in execution order (placement from the {plan.source})"
    if data["constant_only"]:
        text += f"; {data['constant_only']} constant-only nodes are copied into the partitions that read them"
    return text


def legend_lines(plan) -> list[str]:
    return [f"#{p.id} {p.backend.upper()}: {len(p.nodes)} nodes, layers {_span(p.layers)}, "
            f"{fmt_bytes(p.weight_bytes)} weights, {fmt_flops(p.flops)}" for p in plan.partitions]


def _span(layers: list[str]) -> str:
    numbered = sorted(int(x) for x in layers if str(x).isdigit())
    text = f"{numbered[0]}-{numbered[-1]}" if len(numbered) > 1 else (str(numbered[0]) if numbered else "")
    if len(numbered) != len(layers):
        text = f"{text} + other" if text else "other"
    return text


def _layer_label(label: str) -> str:
    return f"layer {label}" if label.isdigit() else label


def write_picture(ng: NodeGraph, plan, path: Path) -> list[Path]:
    """``path`` as SVG and, with matplotlib, the same picture as PNG beside it; the files written."""
    data = layout(ng, plan)
    written = [_write_svg(plan, data, path.with_suffix(".svg"))]
    png = _write_png(plan, data, path.with_suffix(".png"))
    if png is not None:
        written.append(png)
    return written


def _write_svg(plan, data: dict, path: Path) -> Path:
    colour = colours(plan)
    legend = legend_lines(plan)
    top = 40
    items = [f'<text x="8" y="18" font-size="13" font-weight="bold">{escape(title(plan, data))}</text>',
             f'<text x="8" y="{top + 24}" font-size="11">partitions</text>',
             f'<text x="8" y="{top + 58}" font-size="11">layers</text>']
    for part, start, width in data["blocks"]:
        x, w = _STRIP_X + _STRIP_W * start, _STRIP_W * width
        items.append(f'<rect x="{x:.1f}" y="{top + 8}" width="{max(w, 1):.1f}" height="26" fill="{colour[part.id]}" '
                     f'stroke="white"><title>#{part.id} {part.backend.upper()}: {len(part.nodes)} nodes</title></rect>')
        if w > 40:
            items.append(f'<text x="{x + 4:.1f}" y="{top + 25}" fill="white" font-size="11">#{part.id} '
                         f'{part.backend.upper()} {len(part.nodes)}</text>')
    for row, (label, start, width) in enumerate(data["layers"]):
        x, w = _STRIP_X + _STRIP_W * start, _STRIP_W * width
        items.append(f'<rect x="{x:.1f}" y="{top + 44}" width="{max(w, 1):.1f}" height="20" '
                     f'fill="{_LAYER_GREYS[row % 2]}"/>')
        if w > 30:
            items.append(f'<text x="{x + 3:.1f}" y="{top + 58}" font-size="10">{escape(_layer_label(label))}</text>')
    for row, line in enumerate(legend):
        y = top + 84 + 16 * row
        part = plan.partitions[row]
        items.append(f'<rect x="8" y="{y - 10}" width="12" height="12" fill="{colour[part.id]}"/>')
        items.append(f'<text x="26" y="{y}" font-size="11">{escape(line)}</text>')
    height = top + 84 + 16 * len(legend)
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" font-family="sans-serif">',
           '<rect width="100%" height="100%" fill="white"/>', *items, "</svg>"]
    path.write_text("\n".join(svg) + "\n")
    return path


def _write_png(plan, data: dict, path: Path) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colour = colours(plan)
    legend = legend_lines(plan)
    fig, ax = plt.subplots(figsize=(11, 2.2 + 0.28 * len(legend)))
    try:
        for part, start, width in data["blocks"]:
            ax.broken_barh([(start, width)], (1.1, 0.8), facecolors=colour[part.id], edgecolor="white")
            if width > 0.05:
                ax.text(start + 0.005, 1.5, f"#{part.id} {part.backend.upper()} {len(part.nodes)}", va="center",
                        color="white", fontsize=9, fontweight="bold")
        for row, (label, start, width) in enumerate(data["layers"]):
            ax.broken_barh([(start, width)], (0.1, 0.8), facecolors=_LAYER_GREYS[row % 2])
            if width > 0.04:
                ax.text(start + 0.004, 0.5, _layer_label(label), va="center", fontsize=8)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 2)
        ax.set_yticks([0.5, 1.5], ["layers", "partitions"])
        ax.set_xticks([0, 0.25, 0.5, 0.75, 1], ["start", "", "execution order", "", "end"])
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
        ax.set_title(title(plan, data), fontsize=9, loc="left", wrap=True)
        handles = [Patch(facecolor=colour[p.id], label=line) for p, line in zip(plan.partitions, legend)]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0, -0.25), frameon=False, fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


__all__ = ["colours", "layout", "write_picture"]
