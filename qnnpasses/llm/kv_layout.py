"""How a bundle's graphs hold the KV cache at their boundary: axis order, dtype, 8-bit encodings.

A runner (and the build's check) keeps each layer's cache in the graphs' own form and only needs
to know which axis holds the slots, and how to go to and from float32 ``[1, heads, slots,
head_dim]`` (the original export's form).  ``llm.json`` says which form (``kv_layout``,
``kv_dtype``, ``kv_encodings``):

* ``BHSD`` -- ``[1, heads, slots, head_dim]``, the export's own order (``qnnpasses`` bundles);
* ``HBDS`` -- ``[heads, 1, head_dim, slots]``: the key stored transposed, as onnxruntime-genai's
  windowed cache and Genie take it (the graph's Q.K^T reads it without a transpose);
* ``HBSD`` -- ``[heads, 1, slots, head_dim]``: their value.

``uint8`` caches hold ``round(x / scale) + zero_point`` (saturated, as ONNX ``QuantizeLinear``),
one scale per layer and kind, one zero point for all (onnxruntime-genai fills empty slots with
it, its ``pad_value``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: axis order of each layout, as a permutation of BHSD (the order the export computes in)
LAYOUTS = {"BHSD": (0, 1, 2, 3), "HBDS": (1, 0, 3, 2), "HBSD": (1, 0, 2, 3)}
KINDS = ("key", "value")
DTYPES = {"float32": np.float32, "float16": np.float16, "uint8": np.uint8}


class LayoutError(ValueError):
    """The manifest names a cache form this reader does not know."""


class CacheLayout:
    """The cache form a manifest declares (see the module docstring)."""

    def __init__(self, manifest: dict[str, Any]):
        layout = manifest.get("kv_layout") or {"key": "BHSD", "value": "BHSD"}
        self.orders = {kind: layout.get(kind, "BHSD") for kind in KINDS}
        unknown = [o for o in self.orders.values() if o not in LAYOUTS]
        if unknown:
            raise LayoutError(f"unknown KV layout {unknown[0]} (known: {', '.join(LAYOUTS)})")
        dtype = str(manifest.get("kv_dtype", "float32"))
        if dtype not in DTYPES:
            raise LayoutError(f"unknown KV dtype {dtype} (known: {', '.join(DTYPES)})")
        self.dtype = np.dtype(DTYPES[dtype])
        self.heads, self.head_dim = int(manifest.get("kv_heads", 0)), int(manifest.get("head_dim", 0))
        self.scales: dict[str, list[float]] = {}
        self.zero_point = 0
        if self.dtype == np.uint8:
            enc = manifest.get("kv_encodings") or {}
            try:
                self.zero_point = int(enc["zero_point"])
                self.scales = {kind: [float(s) for s in enc[f"{kind}_scales"]] for kind in KINDS}
            except (KeyError, TypeError, ValueError):
                raise LayoutError("a uint8 KV cache needs kv_encodings with zero_point, key_scales and value_scales") from None

    def seq_axis(self, kind: str) -> int:
        return LAYOUTS[self.orders[kind]].index(2)

    def empty(self, kind: str, slots: int, like: np.ndarray | None = None) -> np.ndarray:
        """A cache buffer of ``slots`` slots, every slot holding zero (the zero point); heads and
        head_dim those of the manifest, or of the buffer ``like``."""
        order = LAYOUTS[self.orders[kind]]
        if like is not None:
            shape = list(like.shape)
            shape[self.seq_axis(kind)] = slots
            return np.full(shape, self.zero_point, like.dtype)
        return np.full([(1, self.heads, slots, self.head_dim)[a] for a in order], self.zero_point, self.dtype)

    def take(self, kind: str, cache: np.ndarray, stop: int, start: int = 0) -> np.ndarray:
        """Slots ``start .. stop - 1`` of a buffer in this form (a view)."""
        index = [slice(None)] * 4
        index[self.seq_axis(kind)] = slice(start, stop)
        return cache[tuple(index)]

    def put(self, kind: str, cache: np.ndarray, start: int, values: np.ndarray, count: int) -> None:
        """Write the first ``count`` slots of ``values`` (a graph's new K/V, this form) at ``start``."""
        self.take(kind, cache, start + count, start)[...] = self.take(kind, values, count)

    def to_float(self, kind: str, layer: int, array: np.ndarray) -> np.ndarray:
        """A tensor in this form -> float32 BHSD (dequantized)."""
        values = np.asarray(array)
        if self.dtype == np.uint8:
            values = (values.astype(np.float32) - self.zero_point) * np.float32(self.scales[kind][layer])
        inverse = np.argsort(LAYOUTS[self.orders[kind]])
        return np.ascontiguousarray(np.transpose(values, inverse), dtype=np.float32)

    def from_float(self, kind: str, layer: int, array: np.ndarray) -> np.ndarray:
        """float BHSD -> this form (quantized as ONNX ``QuantizeLinear`` does)."""
        values = np.transpose(np.asarray(array, np.float32), LAYOUTS[self.orders[kind]])
        if self.dtype == np.uint8:
            q = np.rint(values / np.float32(self.scales[kind][layer])) + self.zero_point
            return np.clip(q, 0, 255).astype(np.uint8)
        return np.ascontiguousarray(values, dtype=self.dtype)


def default() -> CacheLayout:
    """float32 caches in the export's order (what a manifest without cache fields means)."""
    return CacheLayout({})
