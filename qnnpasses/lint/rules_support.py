"""Rule family ``support``: nodes the op-support table predicts off the HTP (QP001-QP004, QP020).

The verdicts come from :func:`qnnpasses.op_support.check_graph` (the measured table).  A
node that constant folding alone fixes (it is folded away, or its shapes become known) is
QP020, a warning: onnxruntime folds it when it creates a session and the QNN converter
simplifies by default, so it never leaves the HTP — the verdict ``check``, ``compile``,
``diagnose`` and ``partition`` give.  Every other reason is sorted into the error rule
that names its cause: the op itself (QP001), a tensor rank above the limit (QP002), an
operand that must be a constant (QP003), or a dynamic shape (QP004, together with
symbolic graph inputs).  The fix is the first pass (or pipeline) that, tried on a copy,
removes the node or makes it supported while leaving fewer unsupported nodes overall;
with none, the finding names the manual action.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from qnnpasses.ir.shapes import symbolic_dims
from qnnpasses.lint.context import SIMPLIFY, LintContext
from qnnpasses.lint.registry import Finding, Rule, rule
from qnnpasses.op_support import lookup
from qnnpasses.wording import explain

#: Pipelines tried, in order, as the fix of an unsupported node.
FIXERS = (SIMPLIFY, "gathernd", "fuse-gelu", "decompose-gelu", "decompose-layernorm", "fuse-layernorm",
          "lower-int64", "layout", ("gathernd", SIMPLIFY), ("lower-int64", SIMPLIFY))
SHAPE_FIXERS = (SIMPLIFY, "fix-shapes", (SIMPLIFY, "fix-shapes"))

_DYNAMIC = re.compile(r"has a dynamic shape")
_RANK = re.compile(r"has rank \d+|rank \d+ outside|incorrect Rank")


def classify(reason: str, entry: dict[str, Any] | None) -> str:
    """``"dynamic" | "rank" | "constant" | "op"``: which rule a check_graph reason belongs to."""
    if _DYNAMIC.search(reason):
        return "dynamic"
    rules = (entry or {}).get("rules", [])
    if _RANK.search(reason) or reason in {r.get("reason") for r in rules if r["check"] in ("max_rank", "input_rank")}:
        return "rank"
    constant = {r.get("reason") or f"input {r['index']} must be a constant initializer"
                for r in rules if r["check"] == "constant_input"}
    return "constant" if reason in constant else "op"


def node_problems(ctx: LintContext, kind: str) -> Iterator[tuple[Any, list[str]]]:
    """(verdict, reasons of ``kind``) for every unsupported node with such reasons that
    constant folding does not fix (those are QP020's)."""
    for verdict, reasons in _unsupported(ctx, kind):
        if not folds_away(ctx, verdict.name):
            yield verdict, reasons


def _unsupported(ctx: LintContext, kind: str | None = None) -> Iterator[tuple[Any, list[str]]]:
    """(verdict, explained reasons of ``kind``, all kinds when None) per unsupported node."""
    inputs = {t.name for t in ctx.graph.inputs}
    static = not any(name in inputs for name in symbolic_dims(ctx.graph))
    for verdict in ctx.support:
        if verdict.supported:
            continue
        node = ctx.nodes[verdict.name]
        entry = lookup(ctx.table, node.op, node.domain)
        mine = [explain(r, node.name, static_inputs=static) for r in verdict.reasons
                if kind is None or classify(r, entry) == kind]
        if mine:
            yield verdict, mine


def _node_fix(ctx: LintContext, name: str, fixers) -> str | None:
    return ctx.fix_for(lambda rw: rw.resolves_node(name), fixers, key=("node", name))


def folds_away(ctx: LintContext, name: str) -> bool:
    """Constant folding alone (``simplify``) removes node ``name`` or makes it supported."""
    return _node_fix(ctx, name, (SIMPLIFY,)) is not None


def node_finding(ctx: LintContext, r: Rule, verdict: Any, message: str, fixers, fallback: str | None = None) -> Finding:
    """A finding on an unsupported node, with its fix, at the rule's severity."""
    return r.finding(verdict.name, verdict.op_type, message, fix=_node_fix(ctx, verdict.name, fixers) or fallback)


@rule("QP001", "unsupported-op", "error", "an op the HTP does not run (predicted from the measured op-support table)",
      fix="manual: replace it with supported ops, or leave it on the CPU EP (`qnnpasses partition`)")
def unsupported_op(ctx: LintContext, r: Rule) -> Iterator[Finding]:
    """A node whose op, dtypes or attributes the QNN HTP rejects (measured, per op, with
    onnxruntime-qnn in fp16 mode).  The QNN EP leaves it to the CPU EP: the graph splits into
    several HTP partitions with CPU work and tensor copies between them.  The fix names the
    pass that removes it (constant folding, GatherND lowering, GeLU fusion...), when one does."""
    for verdict, reasons in node_problems(ctx, "op"):
        yield node_finding(ctx, r, verdict, "; ".join(reasons), FIXERS)


@rule("QP002", "rank-limit", "error", "a tensor of higher rank than the HTP op accepts (4 for most ops, 5 for some)",
      fix="manual: reshape to rank <= 4 around the op")
def rank_limit(ctx: LintContext, r: Rule) -> Iterator[Finding]:
    """A node with an input or output of higher rank than the HTP implementation of its op
    accepts: most elementwise ops stop at rank 4, data movement at rank 5, int64 tensors at
    rank 4 (the EP's int64->int32 Cast), and rank 6 is rejected everywhere.  The node runs on
    the CPU EP.  Models with rank-5 attention (``[B, kvH, G, S, D]``) hit this."""
    for verdict, reasons in node_problems(ctx, "rank"):
        yield node_finding(ctx, r, verdict, "; ".join(reasons), FIXERS)


@rule("QP003", "non-constant-operand", "error",
      "an operand the HTP needs as a constant initializer (shape, axes, starts/ends, repeats, K...) is computed",
      fix="manual: make the operand a constant (export with static shapes)")
def non_constant_operand(ctx: LintContext, r: Rule) -> Iterator[Finding]:
    """The QNN EP must know output shapes when it builds the graph, so operands such as a
    Reshape/Expand shape, Slice starts/ends, Tile repeats, TopK's K or Split sizes must be
    constant initializers (the table lists them per op).  Exporters compute them with
    Shape/Gather/Concat chains; constant folding (``simplify``, after ``fix-shapes`` for
    symbolic inputs) turns them into constants."""
    for verdict, reasons in node_problems(ctx, "constant"):
        yield node_finding(ctx, r, verdict, "; ".join(reasons), SHAPE_FIXERS + FIXERS)


@rule("QP004", "dynamic-shape", "error", "a symbolic or unknown dimension: QNN graphs are static",
      fix="fix-shapes (or `qnnpasses run --shape NAME=D0,D1,...`)")
def dynamic_shape(ctx: LintContext, r: Rule) -> Iterator[Finding]:
    """QNN builds static graphs: a symbolic dimension makes the EP answer "Cannot get shape"
    for every node it reaches.  Symbolic graph inputs/outputs are bound by ``fix-shapes``
    (``--shape`` to choose values).  With static inputs, a node whose shape is still unknown
    sits behind shape arithmetic that shape inference cannot follow (TorchScript's
    Shape/ConstantOfShape/Expand chains); ``simplify`` folds it.  Findings on nodes are
    reported only when the graph inputs are static (else the input finding covers them)."""
    symbolic = symbolic_dims(ctx.graph)
    inputs = {t.name for t in ctx.graph.inputs}
    for name, dims in symbolic.items():
        where = "graph input" if name in inputs else "graph output"
        yield r.finding(name, where, f"{where} '{name}' has symbolic dimension(s) {', '.join(dims)}")
    if any(name in inputs for name in symbolic):
        return
    for verdict, reasons in node_problems(ctx, "dynamic"):
        where = reasons[0].split(":")[0]
        yield node_finding(ctx, r, verdict, f"{where}, although the graph inputs are static: shape inference "
                               "cannot follow the shape arithmetic before it", SHAPE_FIXERS,
                               fallback="manual: make the shape computation static")


@rule("QP020", "constant-foldable", "warning",
      "a node off the HTP only until constant folding, which onnxruntime and the QNN converter apply",
      fix="simplify")
def constant_foldable(ctx: LintContext, r: Rule) -> Iterator[Finding]:
    """A node the op-support table rejects as written (an op such as Shape or
    ConstantOfShape, a computed Expand/Reshape shape, a shape unknown behind shape
    arithmetic) that constant folding alone removes or makes supported: TorchScript exports
    are full of them.  A warning, not an error, because it never leaves the HTP: onnxruntime
    folds it when it creates a session (so the QNN EP never sees it, and ``check``,
    ``compile``, ``diagnose`` and ``partition`` place the model whole on the HTP), and
    qnn-onnx-converter simplifies the model the same way unless given
    ``--no_simplification``.  Folding it explicitly (``simplify``, part of every pipeline)
    still pays: the converter package and the analyses (memory, partition, lint's own
    pattern rules) then see the graph that really runs, with every shape known."""
    for verdict, reasons in _unsupported(ctx):
        if folds_away(ctx, verdict.name):
            yield r.finding(verdict.name, verdict.op_type,
                            f"{'; '.join(reasons)} (until constant folding, which onnxruntime does on load)")
