"""Facts about a built prefill + decode pair, for report.md and docs/llm.md ("graphs" section).

:func:`graph_facts` measures, per graph, on the real backend and from the graph: HTP placement
(QNN partitions and CPU nodes, CPU fallback off), the composed QNN op count, node count, and
the KV-cache bytes (past inputs + new K/V outputs = the whole cache of ``context`` slots),
next to what ``qnnpasses analyze`` says.  :func:`graphs_markdown` renders them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from qnnpasses.units import fmt_bytes

_BYTES = {"float32": 4, "float16": 2, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2}


def kv_cache_bytes(graph: dict[str, Any], dtype_bytes: int | None = None) -> int:
    """Bytes of the cache a graph touches: its past inputs plus its new K/V outputs."""
    io, roles = graph["io"], graph["roles"]
    total = 0
    for name in roles["past_key"] + roles["past_value"] + roles["new_key"] + roles["new_value"]:
        size = dtype_bytes or _BYTES.get(io[name]["dtype"], 4)
        total += int(np.prod(io[name]["shape"])) * size
    return total


def expected_kv_bytes(manifest: dict[str, Any], dtype_bytes: int) -> int:
    """2 · layers · kv_heads · head_dim · context · bytes."""
    return 2 * manifest["layers"] * manifest["kv_heads"] * manifest["head_dim"] * manifest["context"] * dtype_bytes


def analyze_kv(path: str | Path, context: int) -> dict[str, Any]:
    from qnnpasses.analysis import analyze
    from qnnpasses.ir.load import load_model

    report = analyze(load_model(path), context=context)["kv_cache"]
    return {k: report.get(k) for k in ("layers", "kv_heads", "head_dim", "context", "bytes_fp32", "bytes_fp16")}


def graph_facts(folder: str | Path, manifest: dict[str, Any], *, probe: bool = True, fp16: bool = True,
                placement: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per graph: placement and composed QNN ops on the HTP, node count, KV-cache bytes and
    ``analyze``'s figure.  ``placement``: what the compile found, by compiled file name
    (:func:`qnnpasses.llm.compile.compile_graphs`); else, with ``probe``, each part is compiled
    into a temporary folder to find it."""
    import onnx

    folder = Path(folder)
    facts: dict[str, Any] = {}
    for name, graph in manifest["graphs"].items():
        entry: dict[str, Any] = {"tokens": graph["tokens"], "past": graph["past"], "parts": []}
        for part in graph["parts"]:
            path = folder / part["onnx"]
            proto = onnx.load(str(path), load_external_data=False)
            item: dict[str, Any] = {"onnx": part["onnx"], "nodes": len(proto.graph.node)}
            if placement is not None and part.get("compiled") in placement:
                item.update(ok=True, error=None, **placement[part["compiled"]])
            elif probe:
                from qnnpasses.llm.compile import probe as probe_graph

                item.update(probe_graph(path, fp16=fp16))
            entry["parts"].append(item)
        entry["kv_cache_bytes"] = kv_cache_bytes(graph)
        entry["kv_cache_bytes_fp16"] = kv_cache_bytes(graph, 2)
        # analyze reads past inputs as [1, heads, slots, head_dim]: not the transposed layouts
        if len(graph["parts"]) == 1 and set((manifest.get("kv_layout") or {"key": "BHSD"}).values()) == {"BHSD"}:
            entry["analyze"] = analyze_kv(folder / graph["parts"][0]["onnx"], manifest["context"])
        if probe or placement is not None:
            entry["qnn_ops"] = sum(p.get("qnn_ops") or 0 for p in entry["parts"])
        facts[name] = entry
    facts["expected_kv_cache_bytes"] = expected_kv_bytes(manifest, _BYTES.get(manifest["kv_dtype"], 4))
    facts["kv_dtype"] = manifest["kv_dtype"]
    return facts


def graphs_markdown(manifest: dict[str, Any], facts: dict[str, Any]) -> str:
    lines = ["| graph | tokens | past slots | parts | nodes | QNN partitions | CPU nodes | composed QNN ops | KV-cache bytes |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in ("prefill", "decode"):
        entry = facts.get(name)
        if not entry:
            continue
        parts = entry["parts"]
        partitions = sum(p.get("qnn_partitions") or 0 for p in parts) if "qnn_partitions" in parts[0] else "-"
        cpu = sum(p.get("cpu_nodes") or 0 for p in parts) if "cpu_nodes" in parts[0] else "-"
        lines.append(f"| {name} | {entry['tokens']} | {entry['past']} | {len(parts)} | {sum(p['nodes'] for p in parts)} | "
                     f"{partitions} | {cpu} | {entry.get('qnn_ops', '-')} | {entry['kv_cache_bytes']:,} |")
    lines.append("")
    lines.append(f"Expected KV-cache bytes (2·L·kv_heads·head_dim·N·{manifest['kv_dtype']}): "
                 f"{facts['expected_kv_cache_bytes']:,}.")
    return "\n".join(lines) + "\n"


def report_markdown(manifest: dict[str, Any], report: dict[str, Any]) -> str:
    """report.md of one ``qnnpasses llm`` run."""
    lines = [f"# {manifest['source']}: prefill + decode pair", "",
             (f"context {manifest['context']}, prefill {manifest['prefill']}, {manifest['layers']} layers, "
              f"{manifest['kv_heads']} KV heads x {manifest['head_dim']}, vocab {manifest['vocab']}, "
              f"precision {manifest['precision']}, weight sharing: {manifest['weight_sharing']}"), ""]
    offset = manifest["graphs"]["decode"]["roles"].get("logits_offset")
    if offset:
        count = (report.get("logits_offset") or {}).get("candidates")
        among = f"the maximum of its first {count:,} tokens' logits" if count else "its maximum"
        lines += [(f"`{manifest['graphs']['decode']['roles']['logits']}` holds each row's logits minus {among}, "
                   f"subtracted inside the lm_head's accumulation (logits-offset); `{offset}` holds that value: "
                   "argmax, softmax and sampling read the logits as they are, the absolute logits are their sum."), ""]
    verification = report.get("verification") or {}
    if verification:
        lines.append(f"CPU check vs the original export ({verification['prompt_tokens']} prompt tokens in chunks, "
                     f"{verification['new_tokens']} generated, {verification['calls']} calls): max abs logits "
                     f"{verification['logits']:.3g}, new K/V {verification['kv']:.3g}.")
    quantized = report.get("quantized_verification")
    if quantized:
        q = report.get("quantization") or {}
        lines.append(f"{manifest['precision']} on CPU vs the original (fp32): max abs logits {quantized['logits']:.3g} "
                     f"(largest logit {quantized['logits_scale']:.3g}), top-1 agreement {quantized['top1']:.1%} over "
                     f"{quantized['positions']} positions; calibration calls: {q.get('samples')}, "
                     f"{q.get('shared_tensors')} tensors with one shared encoding.")
        if q.get("int4_blocks"):
            lines.append(int4_grid_line(q["int4_block_rows"], q["int4_blocks"]))
    probe = (report.get("compile") or {}).get("shared_probe")
    if probe:
        lines.append(f"Weight-shared context, tried on {probe.get('on', 'this pair')}: compile "
                     f"{'ok' if probe['compile'] else 'failed'}, run {'ok' if probe['run'] else 'failed'}"
                     + (f" ({probe['error']})" if probe.get("error") else "") + ".")
    memory = report.get("memory")
    if memory:
        lines.append(f"Built in {report.get('seconds', 0):.0f} s from {fmt_bytes(memory['export_weight_bytes'])} of "
                     f"export weights: peak private memory {fmt_bytes(memory['private_peak_bytes'])}; peak resident "
                     f"{fmt_bytes(memory['resident_peak_bytes'])}, largest child process "
                     f"{fmt_bytes(memory['child_resident_peak_bytes'])} (resident counts mapped weight files)"
                     + (f"; the largest compile child's peak private memory {fmt_bytes(compiling)}"
                        if (compiling := memory.get("compile_private_peak_bytes")) else "") + ".")
    if report.get("htp"):
        lines += ["", graphs_markdown(manifest, report["htp"])]
    return "\n".join(lines) + "\n"


def int4_grid_line(rows: int | str, chosen: dict[str, Any]) -> str:
    """report.md's sentence on w4a16's int4 grid and who chose it (qnnpasses.llm.int4_blocks)."""
    grid = f"one scale per {rows} input rows" if isinstance(rows, int) and rows else "one scale per output channel"
    probe = chosen.get("probe")
    if chosen["chosen_by"] == "--int4-blocks":
        why = "as --int4-blocks asked"
    elif isinstance(probe, str) or probe is None:
        why = f"the default ({probe})" if probe else "the default"
    elif chosen["chosen_by"] == "probe":
        why = (f"the HTP failed to prepare the first layer in blocks ({probe['blocks']['error']}) and prepared it "
               "so; --int4-blocks B insists on blocks")
    elif probe["blocks"]["prepared"]:
        why = "the HTP prepared the first layer so"
    else:
        why = ("the default: the HTP prepared the first layer neither in blocks nor per output channel "
               f"({probe['blocks']['error']})")
    return f"int4 weights: {grid}; {why}."


# --------------------------------------------------------------------------- docs/llm_graphs.md


def graphs_section(rows: list[dict[str, Any]]) -> str:
    """docs/llm_graphs.md's table from ``tools/llm_figures.py``'s per-export rows."""
    lines = ["# Prefill + decode graphs on the HTP", "",
             ("Written by `python tools/llm_figures.py --trained`; every figure is in `docs/llm_graphs.json`. "
              "Accuracy and speed of the trained pair: `docs/llm.md` (`tools/llm_eval.py`)."), "",
             ("Each export through `qnnpasses llm` (static cache outside the graph, htp-llm applied). Placement and "
              "composed QNN op counts come from the real HTP backend (fp16, one probe per graph); KV-cache bytes count "
              "the past inputs plus the new K/V outputs of a graph, against 2·L·kv_heads·head_dim·N·bytes (the cache's "
              "dtype: float16 in fp16 pairs, `qnnpasses/llm/cache_dtype.py`); `analyze` is `qnnpasses analyze`'s figure "
              "for the same graph in that dtype. The CPU check runs a prompt in padded "
              "chunks and then decode steps against the original dynamic export."), "",
             ("| export | context | prefill | graph | parts | QNN partitions | CPU nodes | composed QNN ops | KV bytes | "
              "expected | analyze | CPU check max abs (logits / K,V) | weight sharing |"),
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for row in rows:
        facts, verification = row["htp"], row["verification"]
        for graph in ("prefill", "decode"):
            entry = facts[graph]
            parts = entry["parts"]
            partitions = sum(p.get("qnn_partitions") or 0 for p in parts)
            cpu = sum(p.get("cpu_nodes") or 0 for p in parts)
            width = "bytes_fp16" if facts.get("kv_dtype") == "float16" else "bytes_fp32"
            analyze = (entry.get("analyze") or {}).get(width)
            lines.append(
                f"| {row['export']} | {row['context']} | {row['prefill']} | {graph} | {len(parts)} | {partitions} | "
                f"{cpu} | {entry.get('qnn_ops', '-')} | {entry['kv_cache_bytes']:,} | "
                f"{facts['expected_kv_cache_bytes']:,} | {f'{analyze:,}' if analyze else '-'} | "
                f"{verification['logits']:.2g} / {verification['kv']:.2g} | {row['weight_sharing']} |")
    split = [row for row in rows if row.get("parts", 1) > 1]
    if split:
        lines += ["", ("Parts (cut at residual-stream boundaries, balanced by weight bytes; each part one QNN "
                       "partition, chained by tensor name; `analyze` sizes whole graphs only):"), ""]
        for row in split:
            for graph, sizes in row["part_weight_bytes"].items():
                lines.append(f"- {row['export']}, {graph}: weight bytes per part "
                             + ", ".join(f"{s:,}" for s in sizes if s is not None))
    probes = [(row["export"], row["shared_probe"]) for row in rows if row.get("shared_probe")]
    if probes:
        lines += ["", ("Weight-shared context (`ep.share_ep_contexts` + `enable_htp_weight_sharing`), probed in a "
                       "child process before it is used:"), ""]
        for export, probe in probes:
            outcome = "runs" if probe["run"] else f"falls back to separate contexts: {probe.get('error')}"
            lines.append(f"- {export}: shared compile {'ok' if probe['compile'] else 'failed'} "
                         f"(on {probe.get('on', 'this pair')}); {outcome}")
    return "\n".join(lines) + "\n"
