"""simplify: constant folding, shape-arithmetic folding, no-op and dead-code removal.

Matches what exporters leave for the runtime to compute although it is known at compile
time: ``Constant`` nodes, ``Shape`` of static tensors and the Gather/Concat/Range/
ConstantOfShape/Expand/Equal/Where/Unsqueeze/Slice/Cast chains built on them (the causal
mask and reshape targets of TorchScript exports, rotary tables), nodes whose inputs are
all constants, ``Identity``/``Dropout``, casts to the type a tensor already has and
reshapes/expands to the shape it already has, and dead code.

Produces constants (initializers, so later passes see ``gs.Constant``) in their place.
What depends on a real input (e.g. the padding mask built from ``attention_mask``) stays.

How: for models whose weights fit ``onnxsim_max_bytes`` onnxsim folds first (constant
folding only: its fusions would restructure the graph for the later HTP passes), in an
isolated worker so that a crash or hang cannot take the pass down; our own node-by-node
folder (``passes/fold/_constants.py``) then runs in every case, so larger models and models onnxsim
rejects are folded too.  Both give the same graph on every fixture; ours is linear in the
graph (one shape inference per sweep, never per node) and reads no weight it does not fold:
a 200M-parameter (800 MB) dynamic TorchScript LLaMA folds 2823 -> 736 nodes in 1.3 s, where
the onnxsim round trip takes 50 s.  A folded tensor larger than ``max_fold_bytes`` is only created
by a layout op on a weight (``Transpose(W)``), which does not grow the model.

Safe because every folded value is computed by the op's own definition at the graph's
opset, graph inputs and outputs keep their names and dtypes, and a graph output is
never turned into a constant.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import onnx_graphsurgeon as gs
from qnnpasses.passes.fold._constants import FoldReport, fold_graph

from qnnpasses.ir.checks import check_model
from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import EXACT, FOLDED, Pass, PassContext, PassResult, register_pass

SHAPE_OPS = ("Shape", "ConstantOfShape", "Range", "Size")


def _signature(graph: gs.Graph) -> tuple:
    """Structure of a graph (order-free), to tell honestly whether anything changed."""
    return tuple(sorted((n.op, tuple(t.name for t in n.inputs), tuple(t.name for t in n.outputs)) for n in graph.nodes))


@register_pass
class Simplify(Pass):
    name = "simplify"
    summary = "constant & shape-arithmetic folding (onnxsim + own), Constant->initializer, no-op and dead-code removal"
    contract = EXACT
    requires = frozenset()
    ensures = frozenset({FOLDED})

    @dataclass
    class Options:
        use_onnxsim: bool = field(default=True, metadata={"help": "fold with onnxsim first (small models only)"})
        onnxsim_max_bytes: int = field(default=256 << 20, metadata={
            "help": "weights above this size skip onnxsim (own folding only; onnxsim needs the whole model "
                    "in one protobuf, < 2 GB, and took 50 s vs 1.3 s on an 800 MB model, same result)"})
        onnxsim_timeout: float = field(default=600.0, metadata={"help": "seconds before onnxsim is given up"})
        max_fold_bytes: int = field(default=1 << 20,
                                    metadata={"help": "largest new constant folding may create (layout ops on weights excepted)"})
        max_rounds: int = field(default=4, metadata={"help": "fold / re-infer shapes rounds at most"})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        opts = self.options
        before_ops = Counter(n.op for n in ir.graph.nodes)
        before_sig = _signature(ir.graph)
        stats: dict = {"nodes_before": len(ir.graph.nodes), "onnxsim": "off"}
        notes: list[str] = []
        if opts.use_onnxsim:
            self._run_onnxsim(ir, stats, notes)
        start = time.perf_counter()
        report = self._fold_to_fixed_point(ir)
        stats["own_fold_seconds"] = round(time.perf_counter() - start, 3)
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
        if ctx.verbose:
            notes += [f"not folded: {name} ({why})" for name, why in sorted(report.skipped.items())]
        return PassResult(changed=_signature(ir.graph) != before_sig, stats=stats, notes=notes)

    def _fold_to_fixed_point(self, ir: IRModel) -> FoldReport:
        """Fold; while that changed something, re-infer shapes (a folded reshape target makes
        the next Shape static) and fold again."""
        report = FoldReport()
        for _ in range(self.options.max_rounds):
            signature = _signature(ir.graph)
            fold_graph(ir.graph, self.options.max_fold_bytes, report)
            if _signature(ir.graph) == signature or check_model(ir, refresh=True) is not None:
                break
        return report

    def _run_onnxsim(self, ir: IRModel, stats: dict, notes: list[str]) -> None:
        """Replace the graph by onnxsim's; on any trouble keep it and say why."""
        weights = ir.weight_bytes()
        if weights > self.options.onnxsim_max_bytes:
            stats["onnxsim"] = "skipped"
            notes.append(f"onnxsim skipped: {weights} bytes of weights > onnxsim_max_bytes; own folding only")
            return
        from qnnpasses.passes.fold._onnxsim import onnxsim_graph

        start = time.perf_counter()
        try:
            graph = onnxsim_graph(ir, self.options.max_fold_bytes, self.options.onnxsim_timeout)
            if _signature(graph) != _signature(ir.graph):  # else keep ours: same graph, original values
                ir.graph = graph
            stats["onnxsim"] = "ok"
        except Exception as exc:  # ImportError, OnnxsimFailed, a bad re-import: never fatal
            stats["onnxsim"] = "failed"
            notes.append(f"onnxsim failed, own folding only: {type(exc).__name__}: {exc}")
        stats["onnxsim_seconds"] = round(time.perf_counter() - start, 3)
