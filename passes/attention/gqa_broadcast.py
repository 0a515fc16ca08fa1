"""gqa-broadcast: grouped-query attention without materialising ``repeat_kv``.

Matches: attention blocks (see ``qnnpasses/ir/attention.py``) whose key and value come from HF
``repeat_kv`` — ``Unsqueeze(2)``/``Reshape`` to ``[B, kvH, 1, S, D]`` -> ``Expand`` to
``[B, kvH, G, S, D]`` -> ``Reshape`` — as TorchScript and dynamo export it (eager and SDPA,
with or without a KV cache), followed by any layout chain that the matcher verifies.

Produces: the query reshaped to ``[B, kvH, G*S, D]`` multiplied with the un-repeated key
(``Transpose`` of the ``[B, kvH, S, D]`` head tensor plus the original scalar scale ops),
the softmax over ``[B, kvH, G*S, Skv]``, P·V with the un-repeated value, and a reshape back
to ``[B, H, S, D]``.  A mask shared by all layers is tiled along its rows once per model.
Every tensor stays rank <= 4 (see ``passes/attention/_grouped.py`` for why this form).

Why it is safe: every score and every output element is computed by the same dot products
over the same values, in the same order (exactly equal on CPU); only how rows are laid out
changes, and the closed score region contains only elementwise ops and a last-axis softmax.

Why it matters on the HTP: the ``Expand`` becomes an ``ElementWiseMultiply`` by ones on the
HTP (measured), copying K and V ``G`` times per layer and token; the grouped form reads each
K/V head once.
"""

from __future__ import annotations

from qnnpasses.passes.attention._grouped import GroupedRewriter
from qnnpasses.ir.attention import find_attentions

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import (
    ATTENTION_REWRITTEN,
    EXACT,
    FINITE_MASKS,
    FOLDED,
    Pass,
    PassContext,
    PassResult,
    register_pass,
)
from qnnpasses.passmanager.rewrite import finish


@register_pass
class GqaBroadcast(Pass):
    name = "gqa-broadcast"
    summary = "repeat_kv (Unsqueeze/Expand/Reshape of K,V) + attention => grouped attention, Q as [B,kvH,G*S,D]"
    contract = EXACT
    requires = frozenset({FOLDED, FINITE_MASKS})
    ensures = frozenset({ATTENTION_REWRITTEN})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        reasons: list[str] = []
        rewriter = GroupedRewriter(ir, ctx)
        rewritten, groups = 0, set()
        for att in find_attentions(ir.graph, reasons):
            if att.key.repeat is None:
                reasons.append(f"Softmax '{att.region.softmax.name}': no repeat_kv (multi-head attention)")
                continue
            why = rewriter.rewrite(att, att.groups)
            if why:
                reasons.append(f"Softmax '{att.region.softmax.name}': {why}")
                continue
            rewritten += 1
            groups.add(att.groups)
        if rewritten:
            finish(ir)
        stats = {"rewritten": rewritten, "repeat_kv_removed": 2 * rewritten,
                 "tiled_operands": rewriter.adapted_operands}
        if groups:
            stats["groups"] = ":".join(str(g) for g in sorted(groups))
        return PassResult(changed=rewritten > 0, stats=stats, notes=reasons if ctx.verbose else [])
