"""Symmetric weight scales: the search that round-to-nearest and GPTQ both start from.

For each group (a column of ``w[G, N]``) the scale ``s = α·max|w| / qmax`` minimizing the squared
rounding error ``Σ (w - s·clip(round(w/s)))²`` over α in [0.5, 1] (``STEPS`` values), or α = 1
without the search (``mse=False``).
"""

from __future__ import annotations

import numpy as np

STEPS = 50


def search_scales(w: np.ndarray, qmax: int, mse: bool) -> tuple[np.ndarray, np.ndarray]:
    """Scales for groups along axis 0 of ``w[G, N]`` (each column a group): (scale[N], squared error[N])."""
    peak = np.maximum(np.abs(w).max(axis=0), 1e-12)
    best_s = peak / qmax
    best_e = rounding_error(w, best_s, qmax)
    if mse:
        for alpha in np.linspace(0.5, 1.0, STEPS + 1)[:-1]:
            s = alpha * peak / qmax
            e = rounding_error(w, s, qmax)
            better = e < best_e
            best_s, best_e = np.where(better, s, best_s), np.where(better, e, best_e)
    return best_s, best_e


def rounding_error(w: np.ndarray, s: np.ndarray, qmax: int) -> np.ndarray:
    """Squared error per column of rounding ``w`` to the integer grid of scale ``s``."""
    q = np.clip(np.rint(w / s), -qmax - 1, qmax)
    return ((w - q * s) ** 2).sum(axis=0)
