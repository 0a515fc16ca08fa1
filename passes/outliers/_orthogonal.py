"""Orthogonal matrices for rotating a residual stream: Hadamard where one exists, else Hadamard x random.

A normalized Hadamard matrix ``H/sqrt(n)`` has every entry equal to ``±1/sqrt(n)``: a spike in
one channel is spread evenly over all ``n`` channels, which is the smallest possible largest
output for a single-channel outlier (any orthogonal matrix has a column of norm 1, so some
entry is at least ``1/sqrt(n)``).  We build ``H`` as a Kronecker product of Sylvester blocks
(``2``) and Paley-I blocks (order ``q+1`` for a prime ``q = 3 mod 4``: 4, 12, 20, 24, 32, 44, ...).
Hidden sizes of real models factor that way: 576 = 12·12·4, 384 = 12·32, 4096 = 2^12.  Where no factorization exists the matrix is ``H_(2^k) ⊗ R_m`` with a
seeded Haar-random orthogonal ``R_m`` for the odd remainder ``m`` (entries spread, not equal).
"""

from __future__ import annotations

from functools import cache

import numpy as np

_PALEY_PRIMES = (3, 7, 11, 19, 23, 31, 43, 47, 59, 67, 71, 79, 83, 103, 107, 127, 131, 139, 151, 163, 167, 179, 191)


def _is_quadratic_residue_table(q: int) -> np.ndarray:
    chi = -np.ones(q, dtype=np.int64)
    chi[0] = 0
    chi[np.unique((np.arange(1, q) ** 2) % q)] = 1
    return chi


@cache
def paley(q: int) -> np.ndarray:
    """The Paley-I Hadamard matrix of order ``q + 1`` (``q`` prime, ``q = 3 mod 4``), entries ±1."""
    chi = _is_quadratic_residue_table(q)
    jacobsthal = chi[(np.arange(q)[None, :] - np.arange(q)[:, None]) % q]  # skew-symmetric
    s = np.zeros((q + 1, q + 1), dtype=np.int64)
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = jacobsthal
    return s + np.eye(q + 1, dtype=np.int64)


def _blocks(n: int) -> list[int] | None:
    """Orders of Hadamard blocks whose product is ``n`` (None when we know no construction)."""
    if n == 1:
        return []
    if n % 2 == 0 and (n & (n - 1)) == 0:
        return [n]
    for q in _PALEY_PRIMES:
        order = q + 1
        if order < n and n % order == 0:
            rest = _blocks(n // order)
            if rest is not None:
                return [order] + rest
        if order == n:
            return [order]
    return None


def _sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1), dtype=np.int64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def hadamard(n: int) -> np.ndarray | None:
    """An ``n×n`` ±1 Hadamard matrix, or None when ``n`` has no factorization we can build."""
    blocks = _blocks(n)
    if blocks is None:
        return None
    h = np.ones((1, 1), dtype=np.int64)
    for order in blocks:
        block = _sylvester(order) if (order & (order - 1)) == 0 else paley(order - 1)
        h = np.kron(h, block)
    return h


def random_orthogonal(n: int, seed: int) -> np.ndarray:
    """A Haar-distributed orthogonal matrix (QR of a seeded Gaussian with the sign fix)."""
    q, r = np.linalg.qr(np.random.default_rng(seed).standard_normal((n, n)))
    return q * np.sign(np.diag(r))[None, :]


def rotation(n: int, kind: str = "auto", seed: int = 0) -> tuple[np.ndarray, str]:
    """An orthogonal ``n×n`` float64 matrix and a description of what it is.

    ``kind``: ``hadamard`` (fail when none is known), ``random`` (Haar), ``auto`` (Hadamard,
    else ``H_(2^k) ⊗ random``).
    """
    if kind not in ("auto", "hadamard", "random"):
        raise ValueError(f"unknown rotation kind '{kind}' (auto, hadamard, random)")
    if kind == "random":
        return random_orthogonal(n, seed), f"random orthogonal {n} (seed {seed})"
    h = hadamard(n)
    if h is not None:
        return h / np.sqrt(n), f"Hadamard {n} ({' x '.join(str(b) for b in _blocks(n))})"
    if kind == "hadamard":
        raise ValueError(f"no Hadamard construction known for order {n}")
    two = n & -n
    m = n // two
    return np.kron(_sylvester(two) / np.sqrt(two), random_orthogonal(m, seed)), \
        f"Hadamard {two} x random orthogonal {m} (seed {seed})"
