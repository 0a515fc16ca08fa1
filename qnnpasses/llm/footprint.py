"""What a bundle asks of the device: the bytes it holds, the bytes one decode step reads, and
the decode speed the target's memory bandwidth allows at most.

Decoding one token reads every weight of the decode graph and the whole KV cache once, and writes
the new token's K/V; on a phone this traffic, not arithmetic, bounds decode speed.  So the ceiling
is ``bandwidth / bytes read per step``: a device run can be held against it, never above it.

Weights are counted in the dtype the HTP holds them in: the float initializers of an fp16 bundle
at 2 bytes (the HTP computes in fp16 whatever the ``.onnx`` stores), quantized ones at their
bit width (int4 at half a byte).  When the graphs were compiled, their context binaries
(``compiled_bytes``) are what the device loads, and they count instead: they can hold more than the
graph's weights (a table that a Gather and a MatMul share can be stored twice,
``passes/fold/tied_embedding.py``).  ``weights_from`` says which was counted.  ``device_bytes`` is
what the device holds at once: each graph's weights (the pair's contexts are separate unless
``weight_sharing`` is ``shared``) plus the KV cache.  A prefill call reads the prefill graph's
weights and the cache in the same way, so the bandwidth also bounds the time to first token from
below: ``ceilings`` gives both for every target whose bandwidth is known.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from qnnpasses.ir.model import file_weight_bytes

def _compiled_bytes(folder: Path, parts: list[dict[str, Any]]) -> int | None:
    """The compiled files of a graph (EPContext models and their context binaries), if written."""
    if not all(p.get("compiled") for p in parts):
        return None
    total = 0
    for part in parts:
        ctx = folder / part["compiled"]
        total += ctx.stat().st_size
        total += sum(b.stat().st_size for b in folder.glob(ctx.stem + "*_qnn.bin"))
    return total


def footprint(folder: str | Path, manifest: dict[str, Any], target: Any) -> dict[str, Any]:
    """The ``device`` entry of ``llm.json`` and the report (see the module docstring)."""
    folder = Path(folder)
    fp16 = manifest.get("precision", "fp16") == "fp16"
    graphs, held = {}, {}
    for name, graph in manifest["graphs"].items():
        weights = sum(file_weight_bytes(folder / p["onnx"], float_bytes=2 if fp16 else None) for p in graph["parts"])
        compiled = _compiled_bytes(folder, graph["parts"])
        graphs[name] = {"weight_bytes": weights, "compiled_bytes": compiled}
        held[name] = compiled if compiled is not None else weights
    layers, heads, dim, context = (int(manifest[k]) for k in ("layers", "kv_heads", "head_dim", "context"))
    kv_item = np.dtype(str(manifest.get("kv_dtype", "float32"))).itemsize
    per_slot = 2 * layers * heads * dim * kv_item  # key + value of one token, every layer
    decode = manifest["graphs"]["decode"]
    read = held["decode"] + per_slot * int(decode["past"]) + per_slot * int(decode["tokens"])
    shared = manifest.get("weight_sharing") == "shared"
    compiled = all(g["compiled_bytes"] is not None for g in graphs.values())
    result: dict[str, Any] = {
        "graphs": graphs,
        "weights_from": "compiled contexts" if compiled else "graphs, in the HTP's dtype",
        "kv_cache_bytes": per_slot * context,
        "kv_bytes_per_token": per_slot,
        "device_bytes": (max(held.values()) if shared else sum(held.values())) + per_slot * context,
        "decode_step_read_bytes": read,
        "target": target.name,
        "memory_bytes_per_second": target.memory_bytes_per_second,
        "decode_tokens_per_second_ceiling": None,
    }
    if target.memory_bytes_per_second:
        result["decode_tokens_per_second_ceiling"] = round(target.memory_bytes_per_second / read, 1)
    prefill = manifest["graphs"]["prefill"]
    prefill_read = held["prefill"] + per_slot * (int(prefill["past"]) + int(prefill["tokens"]))
    result["prefill_call_read_bytes"] = prefill_read
    result["ceilings"] = ceilings(read, prefill_read)
    return result


def ceilings(decode_read: int, prefill_read: int) -> list[dict[str, Any]]:
    """For every target whose memory bandwidth is known: the decode tokens per second and the
    shortest prefill call (hence time to first token, one call per ``prefill`` prompt tokens) that
    its bandwidth allows for these bytes.  Memory only: compute is not bounded here, as Qualcomm
    publishes no fp16 rate for these HTPs.  The bytes are this bundle's (its contexts were compiled
    for one target; another target's differ little)."""
    from qnnpasses.backends.targets import TARGETS

    rows = []
    for target in TARGETS:
        rate = target.memory_bytes_per_second
        if rate:
            rows.append({"target": target.name, "product": target.product, "memory_bytes_per_second": rate,
                         "decode_tokens_per_second": round(rate / decode_read, 1),
                         "prefill_call_seconds": round(prefill_read / rate, 5)})
    return rows
