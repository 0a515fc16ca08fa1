"""Rule family ``attention``: attention blocks as exporters write them (QP015-QP017).

All three run an attention pass on a copy and report what it rewrote: ``gqa-broadcast``
(K/V repeated by Expand/Tile) and ``attention-cleanup`` (NaN guards after the Softmax,
-inf / finfo.min mask constants).  NaN guards the pass cannot prove dead are reported too,
with the option that removes them under a stated assumption.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from qnnpasses.lint.context import LintContext
from qnnpasses.lint.registry import ONNX_OPS_DOCS, Finding, Rule, rule
from qnnpasses.ir.attention import NAN_GUARD, find_guard
from qnnpasses.passmanager.rewrite import constant_value

CLEANUP = "attention-cleanup"
REPEAT_OPS = frozenset({"Expand", "Tile"})


@rule("QP015", "repeat-kv", "warning", "grouped-query attention that materialises K/V per query head (Expand/Tile)",
      fix="gqa-broadcast", help_uri="https://arxiv.org/abs/2305.13245")
def repeat_kv(ctx: LintContext, r: Rule) -> Iterator[Finding]:
    """HF ``repeat_kv`` copies every K/V head G times (Unsqueeze -> Expand -> Reshape) before
    the attention MatMuls: G times the K/V memory traffic and a rank-5 intermediate on the
    HTP, per layer.  ``gqa-broadcast`` computes the same scores with Q viewed as
    ``[B, kvH, G*S, D]`` against the un-repeated K/V (exact).  Found by running it on a copy,
    after ``simplify`` (and ``fix-shapes`` for symbolic inputs): one finding per Expand/Tile
    it removes."""
    rw = ctx.rewrite("gqa-broadcast", base=ctx.canonical)
    groups = rw.stats.get("groups", "?")
    for group in ctx.removed_groups("gqa-broadcast", base=ctx.canonical):
        for node in group:
            if node.op in REPEAT_OPS:
                yield r.finding(node.name, node.op, f"K/V repeated for grouped-query attention ({groups} query heads per "
                                "K/V head) by materialising the copies", nodes=[n.name for n in group])


@rule("QP016", "nan-guard", "warning", "a NaN guard Where(IsNaN(p), 0, p) after an attention Softmax",
      fix=CLEANUP, help_uri=ONNX_OPS_DOCS.format(op="Softmax"))
def nan_guard(ctx: LintContext, r: Rule) -> Iterator[Finding]:
    """SDPA exports guard the Softmax against fully masked rows with ``Where(IsNaN(p), 0, p)``:
    two extra ops over every attention score (B*H*S*S elements) per layer, and an IsNaN whose
    answer in fp16 differs from fp32.  ``attention-cleanup`` removes guards it proves dead (no
    query row fully masked: a causal mask, or scores bounded below).  A guard behind a padding
    mask built from an input becomes a test of the row's largest score against the finite mask
    (exact for fully masked rows, no IsNaN) unless ``assume_unmasked_rows=true`` removes it."""
    rw = ctx.rewrite(CLEANUP)
    for node in ctx.graph.nodes:
        guard = find_guard(node) if node.op == "Softmax" else None
        if guard is None or guard.kind != NAN_GUARD:
            continue
        proven = guard.where.name in rw.removed  # a guard kept for fully masked rows loses only its IsNaN
        if proven:
            message, fix = f"NaN guard after Softmax '{node.name}' is provably dead", CLEANUP
        else:
            message = (f"NaN guard after Softmax '{node.name}': a padding mask from an input may mask whole rows, so "
                       "it cannot be proven dead (attention-cleanup tests the row maximum instead)")
            fix = f"{CLEANUP}{{assume_unmasked_rows=true}} (if every query row sees at least one key)"
        yield r.finding(guard.where.name, "Where", message, fix=fix, softmax=node.name)


@rule("QP017", "infinite-mask", "warning", "an attention mask built from -inf or finfo(float32).min",
      fix=CLEANUP, help_uri=ONNX_OPS_DOCS.format(op="Softmax"))
def infinite_mask(ctx: LintContext, r: Rule) -> Iterator[Finding]:
    """Masks of ``-inf`` or ``finfo(float32).min`` (-3.4e38) are not fp16 or quantization safe:
    in fp16 they are -inf, a fully masked row becomes NaN, and ``scores + mask`` overflows;
    quantized, the mask sets the activation range and crushes every real score (cosine 0.11
    measured on the HTP with uint16 activations).  ``attention-cleanup`` replaces them by a
    finite -1e4 (exact in fp32 for score spreads below ~9,900).  One finding per node that
    reads such a constant (found by running the pass on a copy)."""
    rw = ctx.rewrite(CLEANUP)
    after = rw.after_nodes
    for name in rw.rewired:
        node = ctx.nodes.get(name)
        if node is None or name not in after:
            continue
        for old, new in zip(node.inputs, after[name].inputs):
            value = constant_value(old) if old.name != new.name else None
            if value is None or value.dtype.kind != "f" or value.size == 0:
                continue
            low = float(np.min(value))
            yield r.finding(name, node.op, f"reads mask constant '{old.name}' (min {low:.4g}) on the way to a Softmax",
                            tensor=old.name)
