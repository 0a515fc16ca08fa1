"""The weight products the outlier rewrites compute, in float64 a block at a time.

Each function is a pure function of its weight (a recipe for
:func:`~qnnpasses.passmanager.rewrite.derived_constant`, computed when the weight is saved or
run): the result comes back in the weight's own dtype, computed :data:`BLOCK_ELEMENTS` elements
at a time in float64.  Turning a 152 k x 896 embedding then holds one block in float64, not
three copies of the table (the widened input, the product, the cast result).
"""

from __future__ import annotations

import numpy as np

#: elements of a weight widened to float64 at once (32 MiB)
BLOCK_ELEMENTS = 1 << 22


def times_right(w: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``w·m`` (``m`` square over ``w``'s last axis), row blocks at a time."""
    out = np.empty(w.shape, w.dtype)
    rows, flat = out.reshape(-1, w.shape[-1]), w.reshape(-1, w.shape[-1])
    step = max(1, BLOCK_ELEMENTS // max(1, w.shape[-1]))
    for i in range(0, flat.shape[0], step):
        rows[i:i + step] = flat[i:i + step].astype(np.float64) @ m
    return out


def times_left(m: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``m·w`` (``m`` square over ``w``'s axis -2, any leading axes), column blocks at a time."""
    return _columns(w, lambda block: np.matmul(m, block))


def scale_rows(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``diag(scale)·w``: row ``i`` of ``w`` (axis -2) times ``scale[i]``, column blocks at a time."""
    column = np.asarray(scale, np.float64)[:, None]
    return _columns(w, lambda block: column * block)


def _columns(w: np.ndarray, compute) -> np.ndarray:
    out = np.empty(w.shape, w.dtype)
    step = max(1, BLOCK_ELEMENTS // max(1, w.size // max(1, w.shape[-1])))
    for j in range(0, w.shape[-1], step):
        out[..., j:j + step] = compute(w[..., j:j + step].astype(np.float64))
    return out
