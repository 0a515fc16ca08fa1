"""simplify: constant folding, shape-arithmetic folding, no-op and dead-code removal.

Matches what exporters leave for the runtime to compute although it is known at compile
time: ``Constant`` nodes, ``Shape`` of static tensors and the Gather/Concat/Range/
ConstantOfShape/Expand/Equal/Where/Unsqueeze/Slice/Cast chains built on them (the causal
mask and reshape targets of TorchScript exports, rotary tables), nodes whose inputs are
all constants, ``Identity``/``Dropout``, casts to the type a tensor already has and
reshapes/expands to the shape it already has, and dead code.

Produces constants (initializers, so later passes see ``gs.Constant``) in their place.
What depends on a real input (e.g. the padding mask built from ``attention_mask``) stays.

How: the project's one constant folder (``passes/fold/_constants.py``), node by node on
the graph, one shape inference per round that made new constants, never a protobuf holding
the weights. It does the job onnxsim's folding (``perform_optimization=False``) does here:
on every test fixture both leave the same operators (``tests/test_pass_simplify.py``
checks that against onnxsim itself), without serializing the weights (onnxsim's round trip
took 50 s on an 800 MB model where this takes 1.3 s, and needs the model under 2 GB). A
folded tensor larger than ``max_fold_bytes`` is only created by a layout op on a weight
(``Transpose(W)``), which does not grow the model.

Safe because every folded value is computed by the op's own definition at the graph's
opset, graph inputs and outputs keep their names and dtypes, and a graph output is
never turned into a constant.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from qnnpasses.passes.fold._constants import FoldReport, fold_graph

from qnnpasses.ir.checks import check_model
from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import DIMS_BOUND, EXACT, FOLDED, Pass, PassContext, PassResult, register_pass

SHAPE_OPS = ("Shape", "ConstantOfShape", "Range", "Size")


@register_pass
class Simplify(Pass):
    name = "simplify"
    summary = "constant & shape-arithmetic folding, Constant->initializer, no-op and dead-code removal"
    contract = EXACT
    requires = frozenset({DIMS_BOUND})  # ordering only: Shape of a symbolic dim cannot fold
    ensures = frozenset({FOLDED})

    @dataclass
    class Options:
        max_fold_bytes: int = field(default=1 << 20,
                                    metadata={"help": "largest new constant folding may create (layout ops on weights excepted)"})
        max_rounds: int = field(default=4, metadata={"help": "fold / re-infer shapes rounds at most"})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        before_ops = Counter(n.op for n in ir.graph.nodes)
        stats: dict = {"nodes_before": len(ir.graph.nodes)}
        start = time.perf_counter()
        report = fold_to_fixed_point(ir, self.options.max_fold_bytes, self.options.max_rounds)
        stats["fold_seconds"] = round(time.perf_counter() - start, 3)
        after_ops = Counter(n.op for n in ir.graph.nodes)
        stats.update(
            nodes_after=len(ir.graph.nodes),
            constants_lifted=report.constants_lifted,
            shapes_folded=report.shapes_folded,
            nodes_folded=report.nodes_folded,
            nops_removed=report.nops_removed,
            empty_inputs_dropped=report.empty_inputs_dropped,
            operands_swapped=report.operands_swapped,
            shape_ops_before=sum(before_ops[op] for op in SHAPE_OPS),
            shape_ops_after=sum(after_ops[op] for op in SHAPE_OPS),
        )
        notes = [f"not folded: {name} ({why})" for name, why in sorted(report.skipped.items())] if ctx.verbose else []
        changed = report.rewrites() > 0 or before_ops != after_ops
        return PassResult(changed=changed, stats=stats, notes=notes)


def fold_to_fixed_point(ir: IRModel, max_fold_bytes: int = 1 << 20, max_rounds: int = 4) -> FoldReport:
    """Fold; while that rewrote something that can enable another fold, fold again, after
    re-inferring shapes if it made new constants (a folded reshape target makes the next
    Shape static).  The one constant folder of the project."""
    report = FoldReport()
    for _ in range(max_rounds):
        enabling, folds = report.enabling(), report.folds()
        fold_graph(ir.graph, max_fold_bytes, report)
        if report.enabling() == enabling:
            break
        # only new constants can make more dims static; bypassed no-ops change no inferred shape
        if report.folds() != folds and check_model(ir, refresh=True) is not None:
            break
    return report
