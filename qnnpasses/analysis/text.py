"""The text form of an analysis report (``qnnpasses analyze --format text``)."""

from __future__ import annotations

from qnnpasses.units import fmt_bytes, fmt_flops


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Left-aligned columns under a header and a rule."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

    return [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]


def _weights(w: dict) -> list[str]:
    out = [(f"weights: {fmt_bytes(w['total_bytes'])} in {w['tensors']} tensors (initializers "
            f"{fmt_bytes(w['initializer_bytes'])}, Constant nodes {fmt_bytes(w['constant_node_bytes'])})"),
           f"  at fp16 {fmt_bytes(w['at_fp16'])}, int8 {fmt_bytes(w['at_int8'])}, int4 {fmt_bytes(w['at_int4'])}",
           "  by dtype: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in w["by_dtype"].items()),
           "  by layer: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in w["by_layer"].items())]
    return out


def _activations(a: dict, top: int) -> list[str]:
    out = [f"activations ({a['tensors']} tensors, best schedule: {a['schedule']}):",
           f"  no reuse (sum of all)   {fmt_bytes(a['peak_bytes_no_reuse'])}",
           f"  peak live set           {fmt_bytes(a['peak_live_bytes'])} at step {a['peak_step']} "
           f"({a['node_at_peak']})",
           f"  arena with reuse        {fmt_bytes(a['peak_bytes_reuse'])}  (saves {a['reuse_saving']:.1%})",
           "  schedules: " + ", ".join(f"{n} {fmt_bytes(s['peak_bytes_reuse'])}" for n, s in a["schedules"].items())]
    if a["unknown_size_tensors"]:
        out.append(f"  note: {len(a['unknown_size_tensors'])} tensors of unknown size count as 0 bytes "
                   "(fix the input shapes with --shape or the fix-shapes pass)")
    out.append(f"  live at the peak ({a['live_at_peak_count']} tensors, largest first):")
    rows = [[t["name"], fmt_bytes(t["bytes"]), t["layer"]] for t in a["live_at_peak"][:top]]
    out += ["    " + r for r in table(["tensor", "bytes", "layer"], rows)]
    return out


def _kv(k: dict) -> list[str]:
    if not k.get("bytes_fp16"):
        return ["kv cache: " + "; ".join(k.get("notes") or ["no attention found"])]
    out = [(f"kv cache (batch 1, context {k['context']}): {k['layers']} layers x {k['kv_heads']} kv heads "
            f"x head dim {k['head_dim']} (query heads {k['heads']})"),
           (f"  fp16 {fmt_bytes(k['bytes_fp16'])}, int8 {fmt_bytes(k['bytes_int8'])}, "
            f"fp32 {fmt_bytes(k['bytes_fp32'])}; {fmt_bytes(k['bytes_per_token_fp16'])} per token at fp16")]
    if k.get("bytes_fp16_mha"):
        out.append(f"  as MHA (kv heads = {k['heads']}): fp16 {fmt_bytes(k['bytes_fp16_mha'])}; "
                   f"the current grouping saves {k['gqa_saving']:.0%}")
    out += [f"  note: {n}" for n in k.get("notes", [])]
    return out


def _cost(report: dict, top: int) -> list[str]:
    cost = report["cost"]
    out = [(f"cost: {fmt_flops(cost['total_flops'])}, {fmt_bytes(cost['total_bytes'])} moved; "
            f"{cost['memory_bound_nodes']} nodes memory bound (intensity < {cost['ridge']:g} FLOPs/byte)")]
    rows = [[op, str(e["count"]), fmt_flops(e["flops"]), f"{e['flops_share']:.1%}", fmt_bytes(e["bytes"])]
            for op, e in list(report["op_types"].items())[:top]]
    out += ["  " + r for r in table(["op type", "count", "FLOPs", "share", "bytes"], rows)]
    by_name = {o["name"]: o for o in report["ops"]}
    out.append(f"  top {min(top, len(report['hotspots']))} nodes by FLOPs:")
    rows = []
    for name in report["hotspots"][:top]:
        o = by_name[name]
        intensity = f"{o['intensity']:.1f}" if o["intensity"] is not None else "-"
        rows.append([name, o["op_type"], fmt_flops(o["flops"]), fmt_bytes(o["bytes"]), intensity,
                     "memory" if o["memory_bound"] else "compute"])
    out += ["    " + r for r in table(["node", "op", "FLOPs", "bytes", "FLOPs/B", "bound"], rows)]
    return out


def render_text(report: dict, top: int = 10) -> str:
    lines = [f"model: {report['model'] or '<in memory>'} ({report['nodes']} nodes)", ""]
    for section in (_weights(report["weights"]), _activations(report["activations"], top), _kv(report["kv_cache"]),
                    _cost(report, top)):
        lines += section + [""]
    return "\n".join(lines)
