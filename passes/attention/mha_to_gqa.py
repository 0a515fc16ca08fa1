"""mha-to-gqa{groups=G}: multi-head attention -> grouped-query attention (LOSSY).

Matches: attention blocks (``qnnpasses/ir/attention.py``) without ``repeat_kv`` (H key/value
heads) whose key and value heads trace back (``passes/attention/_proj.py``) through rotary
and the head-split Reshape to constant projections: ``MatMul``/``Gemm`` weights, optional
bias, optionally fused QKV cut by ``Split``/``Slice``.  Blocks with a KV cache in the graph
interface are skipped: fewer heads would change the model's inputs and outputs.

Produces: K and V projections with ``kvH = H / G`` heads, each the mean of the ``G``
consecutive heads of its group (weights and biases; the checkpoint conversion of the GQA
paper, Ainslie et al. 2023), head-split reshapes and fused-projection cuts resized, and the
grouped attention of gqa-broadcast (query ``[B, kvH, G*S, D]``, rank 4, mask rows tiled).

Why it is lossy, and what it buys: the pooled heads only approximate the originals (the GQA
paper uptrains afterwards); the manager records the output deviation under ``--verify``.
It cuts the KV cache by ``2 x layers x (H - kvH) x head_dim x bytes`` per token (reported
as ``kv_cache_bytes_per_token_saved``) and the K/V projection weights by the same factor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from qnnpasses.passes.attention._grouped import GroupedRewriter
from qnnpasses.ir.attention import Attention, find_attentions
from qnnpasses.passes.attention._pool import (
    Shrink,
    new_column,
    pool_heads,
    shrink_cutter,
    shrink_head_split,
    shrink_last_dim,
)
from qnnpasses.passes.attention._proj import (
    Projection,
    find_head_split,
    find_projection,
)

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import FINITE_MASKS, FOLDED, Pass, PassContext, PassResult, approximate, register_pass
from qnnpasses.passmanager.rewrite import constant_value, finish, make_constant, static_shape


@register_pass
class MhaToGqa(Pass):
    name = "mha-to-gqa"
    summary = "MHA -> GQA: mean-pool K/V projection heads in groups of G, grouped attention (lossy)"
    contract = approximate(why="K/V heads mean-pooled in groups (the GQA paper uptrains afterwards); deviation recorded, "
                               "not bounded", atol=math.inf, min_cosine=-1.0)
    requires = frozenset({FOLDED, FINITE_MASKS})
    ensures = frozenset()

    @dataclass
    class Options:
        groups: int = field(default=2, metadata={"help": "query heads per key/value head (H must be a multiple)"})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        groups = self.options.groups
        if groups < 2:
            raise ValueError(f"groups must be at least 2 (got {groups})")
        reasons: list[str] = []
        plans = [p for p in (self._plan(att, groups, ir, reasons) for att in find_attentions(ir.graph, reasons)) if p]
        if not plans:
            return PassResult(changed=False, stats={"converted": 0}, notes=reasons if ctx.verbose else [])
        make = lambda hint, value: make_constant(ir, ctx, hint, value)  # noqa: E731
        saved_weights = self._pool(plans, groups, make)
        for att, key, value in plans:
            for proj in (key, value):
                shrink_head_split(proj.head_split, att.heads, att.heads // groups, make)
        rewriter = GroupedRewriter(ir, ctx)
        for att, _, _ in plans:
            why = rewriter.rewrite(att, groups)
            if why:  # the graph is half-rewritten: fail the pass so the manager rolls it back
                raise RuntimeError(f"Softmax '{att.region.softmax.name}': {why}")
        finish(ir)
        return PassResult(changed=True, stats=self._stats(plans, groups, saved_weights),
                          notes=reasons if ctx.verbose else [])

    @staticmethod
    def _plan(att: Attention, groups: int, ir: IRModel, reasons: list[str]):
        where = f"Softmax '{att.region.softmax.name}'"
        if att.key.repeat is not None:
            reasons.append(f"{where}: already grouped ({att.kv_heads} key/value heads)")
            return None
        if att.heads % groups:
            reasons.append(f"{where}: {att.heads} heads are not a multiple of groups={groups}")
            return None
        found = []
        for role, side in (("key", att.key), ("value", att.value)):
            split = find_head_split(side.start, side.head_axis, att.heads, ir.graph)
            proj = find_projection(split) if not isinstance(split, str) else split
            if isinstance(proj, str):
                reasons.append(f"{where}: {role}: {proj}")
                return None
            found.append(proj)
        return (att, *found)

    @staticmethod
    def _pool(plans, groups: int, make) -> int:
        """Mean-pool every K/V column range; fused weights and their cuts change once. Returns bytes saved."""
        shrinks: dict[tuple[int, int], Shrink] = {}
        cutters, reshapes = {}, {}
        for _, *projs in plans:
            for proj in projs:
                _add(shrinks, proj.weight_node, proj.weight_index, 0 if proj.weight_rows else 1, proj.begin, proj.end)
                if proj.bias_node is not None:
                    _add(shrinks, proj.bias_node, proj.bias_index, 0, proj.bias_begin, proj.bias_end)
                cutters.update({id(c): (c, proj) for c in proj.cutters})
                reshapes.update({id(r): (r, proj) for r in proj.reshapes})
        saved = 0
        for shrink in shrinks.values():
            values = constant_value(shrink.node.inputs[shrink.index])
            pooled = values
            head_dim = None
            for begin, end in sorted(shrink.ranges, reverse=True):
                head_dim = _head_dim(plans, shrink, begin)
                pooled = pool_heads(pooled, begin, end, shrink.axis, groups, head_dim)
            saved += values.nbytes - pooled.nbytes
            shrink.node.inputs[shrink.index] = make("gqa_pooled", pooled)
        for cutter, proj in cutters.values():
            ranges = shrinks[(id(proj.weight_node), proj.weight_index)].ranges
            why = shrink_cutter(cutter, sorted(ranges), groups, make)
            if why:
                raise RuntimeError(why)
        for reshape, proj in reshapes.values():
            ranges = sorted(shrinks[(id(proj.weight_node), proj.weight_index)].ranges)
            width = static_shape(reshape.outputs[0])[-1]
            shrink_last_dim(reshape, width, new_column(width, ranges, groups), make)
        return saved

    @staticmethod
    def _stats(plans, groups: int, saved_weights: int) -> dict:
        att = plans[0][0]
        heads, head_dim = att.heads, att.head_dim
        kv_heads = heads // groups
        itemsize = np.dtype(att.region.qk.inputs[0].dtype or np.float32).itemsize
        return {
            "converted": len(plans), "groups": groups, "heads_before": heads, "heads_after": kv_heads,
            "head_dim": head_dim,
            "kv_cache_bytes_per_token_saved": 2 * len(plans) * (heads - kv_heads) * head_dim * itemsize,
            "weight_bytes_saved": saved_weights,
        }


def _add(shrinks: dict, node, index: int, axis: int, begin: int, end: int) -> None:
    shrink = shrinks.setdefault((id(node), index), Shrink(node=node, index=index, axis=axis))
    if (begin, end) not in shrink.ranges:
        shrink.ranges.append((begin, end))


def _head_dim(plans, shrink: Shrink, begin: int) -> int:
    """The head size of the attention whose projection owns columns starting at ``begin``."""
    for att, *projs in plans:
        for proj in projs:
            if (proj.weight_node is shrink.node and proj.begin == begin) or \
                    (proj.bias_node is shrink.node and proj.bias_begin == begin):
                return att.head_dim
    raise RuntimeError("no attention owns the pooled columns")


__all__ = ["MhaToGqa", "Projection"]
