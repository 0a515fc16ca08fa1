"""layout: lossless data-movement clean-up for the HTP, one rewrite family per module.

Families (each can be switched off with its option; stats are prefixed by family):

* ``identity`` (``_layout_identity``): Identity/Dropout, Cast to the same type, lossless
  Cast round trips, empty Concat operands, single-input Concat/Split.
* ``chains`` (``_layout_chains``): a chain of Reshape/Transpose/Squeeze/Unsqueeze/Expand/
  Slice/Gather(constant indices)/Tile becomes the cheapest sequence with the same index
  map (verified element by element): merged Reshapes and Transposes, cancelled pairs,
  Reshape->Transpose->Reshape identities, repeat_kv as one Gather.
* ``rows2d`` (``_layout_rows``): a row-wise region on ``[1, S, H]`` tensors (residual stream:
  norms, MatMul with constant weights, elementwise ops) is computed on ``[S, H]`` so
  that every MatMul maps to one HTP FullyConnected without a Reshape around it.
* ``split_proj`` / ``head_proj`` (``_layout_weights``): Slice/Split of a projection output
  becomes a projection with sliced weights; the head split Reshape->Transpose after a
  projection is folded into head-major weights (one batched MatMul).
* ``weights`` (``_layout_weights``): a Transpose of a constant feeding MatMul/Gemm is folded.
* ``sink`` / ``norm_axis`` (``_layout_transpose``): Transposes are pushed through
  elementwise ops and last-axis norms when that lets them merge; a Softmax/LayerNorm whose
  input is a Transpose normalizes over the producer's contiguous last axis instead.

Every rewrite only moves, drops or re-indexes data (or regroups a constant weight), so
the result equals the original up to float summation order where weights are regrouped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qnnpasses.passes.layout._chains import rewrite_chains
from qnnpasses.passes.layout._identity import rewrite_identity
from qnnpasses.passes.layout._rows import rewrite_rows
from qnnpasses.passes.layout._transpose import rewrite_norm_axis, rewrite_sink
from qnnpasses.passes.layout._weights import (
    rewrite_head_proj,
    rewrite_split_proj,
    rewrite_weight_transposes,
)

from qnnpasses.ir.checks import fill_unknown_shapes
from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import (
    ATTENTION_REWRITTEN,
    EXACT,
    FOLDED,
    NORMS_FINAL,
    Pass,
    PassContext,
    PassResult,
    register_pass,
)
from qnnpasses.passmanager.rewrite import finish

#: Family name -> rewrite, in the order a sweep runs them.  Weight folding comes first:
#: ``chains`` would otherwise turn the Slice/Reshape/Transpose it looks for into Gathers.
FAMILIES = {
    "identity": rewrite_identity,
    "weights": rewrite_weight_transposes,
    "split_proj": rewrite_split_proj,
    "head_proj": rewrite_head_proj,
    "rows2d": rewrite_rows,
    "sink": rewrite_sink,
    "norm_axis": rewrite_norm_axis,
    "chains": rewrite_chains,
}


def _switch(text: str) -> bool:
    return field(default=True, metadata={"help": text})


@register_pass
class Layout(Pass):
    name = "layout"
    summary = "cancel/merge Transposes and Reshapes, fold data movement into weights, 2-D row regions"
    contract = EXACT
    requires = frozenset({FOLDED, ATTENTION_REWRITTEN, NORMS_FINAL})
    ensures = frozenset()

    @dataclass
    class Options:
        identity: bool = _switch("drop empty Concat operands, single-input Concat/Split, exact Cast round trips")
        weights: bool = _switch("fold Transposes of constant MatMul/Gemm weights")
        split_proj: bool = _switch("Slice/Split of a projection => projections of weight slices")
        head_proj: bool = _switch("projection + head-split Reshape/Transpose => head-major batched MatMul")
        rows2d: bool = _switch("compute [1,S,H] row-wise regions in 2-D (no FullyConnected Reshapes)")
        sink: bool = _switch("push Transposes through elementwise/last-axis ops so that they merge")
        norm_axis: bool = _switch("Softmax over a transposed axis => over the contiguous last axis")
        chains: bool = _switch("cheapest form of Reshape/Transpose/Expand/Slice/Gather chains")
        max_rounds: int = field(default=4, metadata={"help": "sweeps over all families until nothing changes"})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        stats: dict = {}
        notes: list[str] = []
        total = rounds = 0
        for rounds in range(1, max(1, self.options.max_rounds) + 1):
            changed = sum(self._apply(name, rewrite, ir, ctx, stats, notes) for name, rewrite in FAMILIES.items()
                          if getattr(self.options, name))
            total += changed
            if not changed:
                break
        stats["rounds"] = rounds
        return PassResult(changed=total > 0, stats=stats, notes=notes)

    @staticmethod
    def _apply(name, rewrite, ir: IRModel, ctx: PassContext, stats: dict, notes: list) -> int:
        """One family over the whole graph; shapes are re-inferred after it changed anything, if it left any unknown."""
        count = rewrite(ir, ctx, stats, notes)
        if count:
            finish(ir)
            fill_unknown_shapes(ir)
        return count
