"""What the QNN HTP runs natively, asked by the norm and GeLU passes before they rewrite.

Read from the op-support table (``op_support/tables/htp.json``, measured on the real
backend; the table records the backend and target it was measured on), the same data ``qnnpasses check``
and the partitioner use, so a pass never keeps its own list.  The facts the passes rely on,
as the table states them:

* ``LayerNormalization`` (17) and ``RMSNormalization`` (23) become HTP ``LayerNorm`` /
  ``RmsNorm`` for inputs of rank <= 4 normalized over the last axis only;
* ``Gelu`` (20) and ``com.microsoft.Gelu`` become HTP ``Gelu``; ``Erf``,
  ``com.microsoft.FastGelu`` and ``SkipSimplifiedLayerNormalization`` are rejected;
* ``SimplifiedLayerNormalization`` (an onnxruntime op in the default domain) becomes
  ``RmsNorm`` at opset 17, but the ONNX checker rejects it -- hence the opset raise.

Numerics (fp16): ``LayerNorm`` and ``RmsNorm`` stay within fp16 rounding of fp32 for
inputs with |x| = 30,000 in one channel; the decomposed ``Pow(x,2)`` forms do not.  The HTP
flushes fp16 subnormals (< 6.1e-5) to zero, e.g. ``x / 30000`` becomes 0.

The QNN EP has private fusions of its own ("GeluFusion", "LayerNormFusion" in its log) for
the exact HF Erf-GeLU and torch LayerNorm spellings only: ``(0.5*x)*(1+erf(..))``, a
LayerNorm squaring with ``Mul(d, d)``, using ``Reciprocal`` or without beta stay decomposed.
"""

from __future__ import annotations

from typing import Any

from .table import load_table, lookup

_NORMS = ("LayerNormalization", "RMSNormalization")


def _entry(op: str, domain: str = "") -> dict[str, Any] | None:
    return lookup(load_table("htp"), op, domain)


def max_rank(op: str, domain: str = "") -> int:
    """Highest input rank the HTP runs ``op`` at (the table's per-op limit, else its global one)."""
    entry = _entry(op, domain) or {}
    return int(entry.get("max_rank", load_table("htp")["global"]["max_rank"]))


#: Highest input rank of the HTP's LayerNorm / RmsNorm.
MAX_NORM_RANK = min(max_rank(op) for op in _NORMS)


def htp_runs_norm(axis: int, rank: int | None, op: str = "LayerNormalization") -> bool:
    """Whether the HTP runs ``op`` (LayerNormalization / RMSNormalization) normalizing over
    ``axis`` of a rank-``rank`` input.

    An ONNX axis ``k`` normalizes over dims ``k..rank-1``; the table's ``last_axis`` rule
    says the HTP only does the last one.  A rule this predicate cannot evaluate without
    the node counts as "does not run" (the pass then leaves the graph as it is).
    """
    entry = _entry(op)
    if rank is None or entry is None or not entry.get("supported"):
        return False
    if not 1 <= rank <= max_rank(op):
        return False
    for rule in entry.get("rules", []):
        if rule.get("check") == "output_absent":
            continue  # Mean/InvStdDev outputs: the norms the passes write have one output
        if rule.get("check") != "last_axis" or axis not in (-1, rank - 1):
            return False
    return True


def htp_runs_gelu(op: str, domain: str) -> bool:
    """Whether the HTP runs a GeLU node (``Gelu``, ``com.microsoft.Gelu``, ``FastGelu`` ...) natively."""
    entry = _entry(op, domain)
    return bool(entry and entry.get("supported") and "Gelu" in entry.get("qnn_ops", []))
