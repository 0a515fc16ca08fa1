"""Rule family ``precision``: number formats the HTP does not compute in (QP009, QP010).

int64 has no HTP kernels (the EP runs it as int32 behind Casts), and float32 runs on the
HTP only in fp16 mode or quantized.
"""

from __future__ import annotations

from collections.abc import Iterator

import onnx_graphsurgeon as gs

from qnnpasses.analysis.graph import dtype_name
from qnnpasses.lint.context import LintContext
from qnnpasses.lint.registry import Finding, Rule, rule

QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})


def _int64_reads(graph: gs.Graph) -> dict[str, list[str]]:
    """int64 activation name -> names of the nodes reading it."""
    reads: dict[str, list[str]] = {}
    for node in graph.nodes:
        for tensor in node.inputs:
            if isinstance(tensor, gs.Variable) and tensor.dtype is not None and dtype_name(tensor.dtype) == "int64":
                reads.setdefault(tensor.name, []).append(node.name)
    return reads


@rule("QP009", "int64-compute", "warning", "int64 tensors on the compute path (the HTP has no int64)",
      fix="lower-int64")
def int64_compute(ctx: LintContext, r: Rule) -> Iterator[Finding]:
    """Token/position ids, gather indices, leftover shape math and masks cast to int64.  The
    HTP has no int64: the EP computes such tensors as int32 and inserts Casts where they
    enter and leave a partition (and int64 tensors are limited to rank 4).  ``lower-int64``
    makes the computation int32 where that is provably exact (an int64 graph input stays,
    behind one Cast).  Found by running it on a copy, after ``simplify`` (and ``fix-shapes``
    for symbolic inputs): one finding per int64 tensor whose readers it moved to int32."""
    rw = ctx.rewrite("gathernd,lower-int64", base=ctx.canonical)
    before, after = _int64_reads(rw.before.graph), _int64_reads(rw.after.graph)
    alive = set(rw.after_nodes)
    ops = {n.name: n.op for n in rw.before.graph.nodes}
    for name, readers in before.items():
        lowered = [n for n in readers if n in alive and n not in after.get(name, [])]
        if not lowered:
            continue
        more = f" (and {len(lowered) - 1} more)" if len(lowered) > 1 else ""
        yield r.finding(lowered[0], ops[lowered[0]], f"reads int64 tensor '{name}'{more}: the EP would run it as int32 "
                        "behind Casts; lower-int64 makes it int32 exactly", tensor=name, readers=lowered)


@rule("QP010", "float32-without-plan", "info", "a float32 graph with no fp16 or quantization plan",
      fix="compile in fp16 mode (`qnnpasses compile --fp16`) or quantize (`qnnpasses compile --qdq`)")
def float32_without_plan(ctx: LintContext, r: Rule) -> Iterator[Finding]:
    """The HTP computes in fp16 or integers.  A float32 graph without QuantizeLinear/
    DequantizeLinear nodes fails to finalize unless the EP runs it in fp16 mode
    (``enable_htp_fp16_precision=1``, which ``qnnpasses compile`` sets); quantizing
    (QDQ, ``--qdq``) is faster still but needs calibration data and an accuracy check.
    In fp16 mode, watch for overflow in decomposed norms (see QP011) and -inf masks (QP017)."""
    graph = ctx.graph
    if any(n.op in QDQ_OPS for n in graph.nodes):
        return
    dtypes = {dtype_name(t.dtype) for t in graph.tensors().values() if isinstance(t, gs.Variable) and t.dtype is not None}
    if "float32" in dtypes and "float16" not in dtypes:
        yield r.finding(None, None, "float32 graph without Q/DQ nodes: run the HTP in fp16 mode or quantize it")
