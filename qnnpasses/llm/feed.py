"""The inputs of one call of a bundle graph, as the runtime that loads the bundle builds them.

A graph with ``tokens`` = S and ``past`` = P takes S new tokens after ``valid_len`` cached ones.
Two placements of the valid entries, both computed exactly by the graphs (the mask, not the
slot index, says what a query sees; the rotary reads ``position_ids``):

* ``left`` (our runner's, ``qnnpasses`` bundles): cache slots ``0 .. valid_len - 1``, then the
  new tokens from the first of the S positions, the last chunk padded at its end;
* ``right`` (onnxruntime-genai's windowed cache, ``genai`` bundles): the valid entries fill the
  last ``valid_len`` past slots, and a short chunk is padded at its start (padding at position 0).

``attention_mask`` ``[1, P + S]`` is 1 for the valid cache slots and the real new tokens.

Graphs in Genie's form (:mod:`qnnpasses.llm.genie_io`; the graph's roles name ``position_cos``)
take what Genie's engine gives them, cache left-aligned: the whole additive mask
``attention_mask`` ``[1, S, P + S]`` (0 where a query sees a key, ``MASKED`` elsewhere, padding
rows all masked), and the rotary cos/sin rows ``[1, S, h]`` of the positions (padding at
position 0), computed from the graph's ``rope`` as Genie computes them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qnnpasses.llm.kv_layout import CacheLayout, default

PAD_TOKEN = 0
NUMPY = {"int32": np.int32, "int64": np.int64, "float32": np.float32, "float16": np.float16, "uint8": np.uint8}
ALIGNMENTS = ("left", "right")


def new_slots(graph: dict[str, Any], count: int, right: bool) -> slice:
    """Where the ``count`` real tokens sit among the graph's S positions (and its new K/V outputs)."""
    size = int(graph["tokens"])
    return slice(size - count, size) if right else slice(0, count)


def call_feed(graph: dict[str, Any], ids: list[int], valid_len: int, cache: dict[str, np.ndarray],
              layout: CacheLayout | None = None, right: bool = False) -> dict[str, np.ndarray]:
    """Inputs of one call of manifest graph ``graph`` (``tokens``, ``past``, ``roles``, ``io``):
    ``ids`` after ``valid_len`` cached entries; ``cache`` maps each past input's name to a buffer
    whose slots ``0 .. valid_len - 1`` hold the entries, in ``layout``'s form."""
    layout = layout or default()
    roles, io = graph["roles"], graph["io"]
    size, past, count = int(graph["tokens"]), int(graph["past"]), len(ids)
    if not 0 < count <= size or valid_len > past:
        raise ValueError(f"{count} tokens after {valid_len} cached do not fit tokens={size}, past={past}")
    new = new_slots(graph, count, right)
    tokens = np.full((1, size), PAD_TOKEN, np.int64)
    tokens[0, new] = ids
    mask = np.zeros((1, past + size), np.int64)
    if right:
        mask[0, past - valid_len:past] = 1
    else:
        mask[0, :valid_len] = 1
    mask[0, past + new.start:past + new.stop] = 1
    feed = {roles["input_ids"]: tokens, roles["attention_mask"]: mask}
    if roles.get("position_cos"):
        feed.update(_genie_inputs(graph, mask, new, valid_len))
    elif roles.get("position_ids"):
        positions = np.zeros((1, size), np.int64) if right else (valid_len + np.arange(size, dtype=np.int64))[None]
        positions[0, new] = valid_len + np.arange(count)
        feed[roles["position_ids"]] = positions
    for kind in ("key", "value"):
        for name in roles[f"past_{kind}"]:
            buffer = cache[name]
            if right:
                value = layout.empty(kind, past, like=buffer)
                layout.put(kind, value, past - valid_len, layout.take(kind, buffer, valid_len), valid_len)
            else:
                value = np.ascontiguousarray(layout.take(kind, buffer, past))
            feed[name] = value
    return {k: v.astype(NUMPY.get(io[k]["dtype"], v.dtype), copy=False) for k, v in feed.items() if k in io}


def _genie_inputs(graph: dict[str, Any], mask: np.ndarray, new: slice, valid_len: int) -> dict[str, np.ndarray]:
    """The whole mask and the rotary rows of one call, as Genie's engine writes them."""
    from qnnpasses.llm.genie_io import MASKED, Rope

    roles, size, past = graph["roles"], int(graph["tokens"]), int(graph["past"])
    rows, cols = np.arange(size)[:, None], np.arange(past + size)[None, :]
    real = (rows >= new.start) & (rows < new.stop)
    sees = (mask[0] != 0)[None, :] & ((cols < past) | (cols - past <= rows)) & real
    whole = np.where(sees, np.float32(0), np.float32(MASKED))[None]
    positions = np.zeros(size, np.int64)
    positions[new] = valid_len + np.arange(new.stop - new.start)
    cos, sin = Rope(**graph["rope"]).tables(positions)
    return {roles["attention_mask"]: whole, roles["position_cos"]: cos[None], roles["position_sin"]: sin[None]}


def store_new(graph: dict[str, Any], outputs: dict[str, np.ndarray], count: int, valid_len: int,
              cache: dict[str, np.ndarray], layout: CacheLayout | None = None, right: bool = False) -> None:
    """Write the ``count`` real tokens' new K/V of a call into ``cache`` at slots ``valid_len ..``."""
    layout = layout or default()
    roles, new = graph["roles"], new_slots(graph, count, right)
    for kind in ("key", "value"):
        for past, out in zip(roles[f"past_{kind}"], roles[f"new_{kind}"]):
            layout.put(kind, cache[past], valid_len, layout.take(kind, outputs[out], new.stop, new.start), count)
