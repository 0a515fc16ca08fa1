"""w4a16: int4 weights in blocks where the HTP prepares them, one scale per output channel where not.

Blocks of 32 input rows per int4 scale are the more accurate grid (docs/quant_llm.md), but the
HTP does not prepare every graph that holds them: the prefill graph of a pair whose layers read
blocked int4 weights fails to finalize (``QNN_COMMON_ERROR_MEM_ALLOC``) at some shapes and
prepares with one int4 scale per output channel (docs/int4_blocks.md).  Which shapes fail is
the backend's to say, not a rule to write down here: so before a w4a16 pair is quantized
(minutes to an hour), :func:`choose_block_rows` quantizes the first layer of its prefill graph
the way the pair will be quantized and has the HTP prepare it (seconds).  When that fails and
one scale per output channel prepares, the pair is quantized per output channel, and the
report says why.

The piece is the static prefill graph from its inputs to the residual boundary after the first
layer's MLP: the token embedding, and the first layer's attention, which reads that layer's
cache, with every projection of the layer, at the pair's shapes.  (The token embedding belongs:
measured, the same layer without it prepares where the graph with it fails.)  Its weights are
rounded to nearest on min/max scales and its activations calibrated on one call of the prefill
graph: the encodings' values do not change what the backend prepares, their widths and block
layout do.
The decode graph (one new token) holds the same weights with the same encodings, so one grid
serves both graphs.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from qnnpasses.errors import BadInputError
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import IRModel, save_model
from qnnpasses.memory import release


def first_layer(ir: IRModel, stream_input: str, cache_inputs: list[str]) -> IRModel | None:
    """The nodes of ``ir`` from its inputs to the residual boundary after the first layer's
    attention (the last reader of ``cache_inputs``, that layer's past K/V) and the block after
    it, as a stand-alone model; None when the graph has no such boundary."""
    from qnnpasses.llm.split import extract_part, residual_order
    from qnnpasses.partition.plan import describe

    ng, order, points = residual_order(ir, stream_input)
    position = {index: p for p, index in enumerate(order)}
    readers = [position[c] for name in cache_inputs if name in ng.view.tensors
               for c in ng.view.tensors[name].consumers if c in position]
    after = [p for p in points if readers and p > max(readers)]
    if not after:
        return None
    stop = after[1] if len(after) > 1 else len(order)
    return extract_part(ng, describe(ng, 0, "htp", order[:stop], {}))


def layer_piece(folder: Path, manifest: dict[str, Any], out: Path) -> tuple[Path, Path] | None:
    """The first layer of ``folder``'s float prefill graph (:func:`first_layer`) saved under ``out``,
    and one call's calibration data for it; None when the graph has no layer to cut out."""
    from qnnpasses.llm.verify import static_feed

    graph = manifest["graphs"]["prefill"]
    roles = graph["roles"]
    ir = load_model(folder / graph["parts"][0]["onnx"])
    try:
        piece = first_layer(ir, roles["input_ids"], [roles["past_key"][0], roles["past_value"][0]])
    except BadInputError:  # not one HTP partition: the pair's own compile says why
        piece = None
    del ir
    release()
    if piece is None:
        return None
    cache = {n: np.zeros((1, manifest["kv_heads"], graph["past"], manifest["head_dim"]), np.float32)
             for n in roles["past_key"] + roles["past_value"]}
    feed = static_feed(graph, [t % manifest["vocab"] for t in range(graph["tokens"])], 0, cache)
    out.mkdir(parents=True, exist_ok=True)
    calib = out / "calib.npz"
    np.savez(calib, **{t.name: feed[t.name][None] for t in piece.graph.inputs})
    return save_model(piece, out / "layer.onnx"), calib


def prepares(piece: tuple[Path, Path], policy) -> dict[str, Any]:
    """Whether the HTP prepares ``piece`` (:func:`layer_piece`) quantized by ``policy`` (its int4
    grid: ``policy.block_size``) as one partition with no CPU node, asked in a child process:
    ``{"prepared", "error", "seconds"}``."""
    from qnnpasses.llm.compile import probe
    from qnnpasses.quant.calibration import CalibrationData, model_inputs
    from qnnpasses.quant.driver import quantize_model

    start = time.monotonic()
    source, calib = piece
    quantized = source.with_name("layer.qdq.onnx")
    data = CalibrationData(calib, model_inputs(load_model(source)))
    quantize_model(source, data, quantized, replace(policy, outliers="", weight_rounding="nearest",
                                                    weight_scales="minmax"))
    release()
    result = probe(quantized, fp16=False)
    # prepared means the whole piece on the HTP: ops the HTP refuses would fall back to the CPU
    whole = (result.get("qnn_partitions"), result.get("cpu_nodes")) == (1, 0)
    error = result.get("error") or (None if whole else f"{result.get('qnn_partitions')} HTP partitions, "
                                                        f"{result.get('cpu_nodes')} CPU nodes")
    return {"prepared": bool(result["ok"]) and whole, "error": error, "seconds": round(time.monotonic() - start, 2)}


def choose_block_rows(folder: Path, manifest: dict[str, Any], policy, asked: int | None,
                      backend: bool) -> tuple[int, dict[str, Any]]:
    """The input rows per int4 scale for the pair (0: one scale per output channel) and how they
    were chosen.

    ``policy``: the precision's (its ``block_size``, the default); ``asked``: the user's
    ``--int4-blocks`` (None: not given), kept as given; ``backend``: whether the HTP backend is
    here to ask.  The default stays unless the HTP fails to prepare the first layer with it and
    prepares it with one scale per output channel."""
    default = policy.block_size or 0
    if asked is not None:
        return asked, {"chosen_by": "--int4-blocks"}
    if not default:
        return 0, {"chosen_by": "default"}
    if not backend:
        return default, {"chosen_by": "default", "probe": "not run: no HTP backend here"}
    from qnnpasses.progress import step

    with tempfile.TemporaryDirectory(prefix="qnnpasses-int4-probe-") as tmp:
        piece = layer_piece(folder, manifest, Path(tmp))
        if piece is None:
            return default, {"chosen_by": "default", "probe": "not run: no first layer between residual boundaries"}
        step(f"asking the HTP whether it prepares the first layer with int4 weights in blocks of {default} rows")
        blocked = prepares(piece, policy)
        if blocked["prepared"]:
            return default, {"chosen_by": "default", "probe": {"blocks": blocked}}
        step("it does not: asking with one int4 scale per output channel")
        channel = prepares(piece, replace(policy, block_size=None))
    found = {"blocks": blocked, "per_channel": channel}
    if not channel["prepared"]:  # blocks are not what fails: the pair's compile says what does
        return default, {"chosen_by": "default", "probe": found}
    step("it does: the pair's int4 weights get one scale per output channel (--int4-blocks B insists on blocks)")
    return 0, {"chosen_by": "probe", "probe": found,
               "why": f"the HTP prepares the first layer at these shapes with one int4 scale per output channel, "
                      f"not in blocks of {default} rows"}
