"""A picture of the plan: the graph coloured by partition, written as plain SVG.

Small graphs (up to :data:`DETAILED_LIMIT` nodes) are drawn node by node: one row per
depth of the DAG (longest path from the inputs), a box per node labelled with its op type
and filled with its partition's colour (HTP partitions in blues/greens, CPU ones in
oranges/reds), producer->consumer edges as lines.  Larger graphs are summarised per layer:
one row per transformer layer, a bar split by how many of its nodes each partition holds.
No plotting library is needed; any browser shows the file.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from html import escape
from pathlib import Path

import networkx as nx

from qnnpasses.analysis.graph import layer_sort_key
from qnnpasses.partition.graph import NodeGraph

DETAILED_LIMIT = 400
_HTP_COLOURS = ["#4e79a7", "#59a14f", "#76b7b2", "#2f6690", "#8cd17d", "#499894", "#86bcb6", "#3a6ea5"]
_CPU_COLOURS = ["#f28e2b", "#e15759", "#ff9d9a", "#d37295", "#b6992d", "#f1ce63"]
_BOX_W, _BOX_H, _COL, _ROW = 86, 18, 96, 30


def colours(plan) -> dict[int, str]:
    counters = {"htp": 0, "cpu": 0}
    result = {}
    for part in plan.partitions:
        palette = _HTP_COLOURS if part.backend == "htp" else _CPU_COLOURS
        result[part.id] = palette[counters[part.backend] % len(palette)]
        counters[part.backend] += 1
    return result


def write_picture(ng: NodeGraph, plan, path: Path) -> Path:
    owner = {i: part.id for part in plan.partitions for i in part.indices}
    colour = colours(plan)
    body, width, height = (_detailed if len(owner) <= DETAILED_LIMIT else _per_layer)(ng, owner, colour)
    legend, legend_h = _legend(plan, colour, width)
    header = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + legend_h}" '
              f'font-family="sans-serif" font-size="9">')
    svg = [header, '<rect width="100%" height="100%" fill="white"/>',
           *legend, f'<g transform="translate(0,{legend_h})">', *body, "</g>", "</svg>"]
    path.write_text("\n".join(svg) + "\n")
    return path


def _legend(plan, colour: dict[int, str], width: int) -> tuple[list[str], int]:
    title = f"{escape(Path(plan.model).name if plan.model else 'model')}: " + ", ".join(
        f"{n} {b.upper()}" for b, n in sorted(plan.counts().items())) + f" partition(s) (from the {plan.source})"
    items = [f'<text x="8" y="16" font-size="12" font-weight="bold">{title}</text>']
    for row, part in enumerate(plan.partitions):
        y = 26 + 14 * row
        items.append(f'<rect x="8" y="{y}" width="12" height="10" fill="{colour[part.id]}"/>')
        items.append(f'<text x="26" y="{y + 9}">#{part.id} {part.backend.upper()}: {len(part.nodes)} nodes, '
                     f'layers {escape(_span(part.layers))}, {part.weight_bytes / 1e6:.2f} MB weights, '
                     f'{part.flops / 1e6:.2f} MFLOP</text>')
    return items, 34 + 14 * len(plan.partitions)


def _span(layers: list[str]) -> str:
    numbered = [int(x) for x in layers if x.isdigit()]
    text = f"{min(numbered)}-{max(numbered)}" if numbered else ""
    if len(numbered) != len(layers):
        text = f"{text} + other" if text else "other"
    return text


def _detailed(ng: NodeGraph, owner: dict[int, int], colour: dict[int, str]):
    depth: dict[int, int] = {}
    for v in nx.topological_sort(ng.dag):
        depth[v] = max((depth[u] + 1 for u in ng.dag.predecessors(v)), default=0)
    rows: dict[int, list[int]] = defaultdict(list)
    for v in sorted(depth):
        rows[depth[v]].append(v)
    pos = {v: (8 + _COL * col, 8 + _ROW * d) for d, vs in rows.items() for col, v in enumerate(vs)}
    width = 16 + _COL * max((len(vs) for vs in rows.values()), default=1)
    height = 16 + _ROW * (len(rows) or 1)
    lines = [f'<line x1="{pos[u][0] + _BOX_W / 2}" y1="{pos[u][1] + _BOX_H}" x2="{pos[v][0] + _BOX_W / 2}" '
             f'y2="{pos[v][1]}" stroke="#999" stroke-width="0.6"/>' for u, v in ng.dag.edges]
    boxes = []
    for v, (x, y) in pos.items():
        node = ng.nodes[v]
        boxes.append(f'<g><title>{escape(node.name)} (partition {owner.get(v)})</title>'
                     f'<rect x="{x}" y="{y}" width="{_BOX_W}" height="{_BOX_H}" rx="3" fill="{colour.get(owner.get(v), "#ccc")}"/>'
                     f'<text x="{x + 4}" y="{y + 12}" fill="white">{escape(node.op[:14])}</text></g>')
    return lines + boxes, width, height


def _per_layer(ng: NodeGraph, owner: dict[int, int], colour: dict[int, str]):
    per_layer: dict[str, Counter] = defaultdict(Counter)
    for v, pid in owner.items():
        per_layer[ng.view.layers[v]][pid] += 1
    labels = sorted(per_layer, key=layer_sort_key)
    bar_w, width = 600, 760
    items = []
    for row, label in enumerate(labels):
        y = 8 + 18 * row
        items.append(f'<text x="8" y="{y + 11}">layer {escape(label)}</text>')
        total, x = sum(per_layer[label].values()), 90.0
        for pid, count in sorted(per_layer[label].items()):
            w = bar_w * count / total
            items.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="14" fill="{colour[pid]}">'
                         f'<title>partition {pid}: {count} nodes</title></rect>')
            x += w
        items.append(f'<text x="{92 + bar_w}" y="{y + 11}">{total} nodes</text>')
    return items, width, 16 + 18 * len(labels)
