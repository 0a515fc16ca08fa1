"""Raise a model's default-domain opset in place, when that cannot change what it computes.

``RMSNormalization`` needs opset 23 and ``Gelu`` opset 20, while the TorchScript exporter
writes opset 17.  Between 17 and 23 almost every version bump only adds types or optional
inputs/attributes with defaults that keep the old behaviour.  The exceptions:

* Reduce* (not ReduceSum) take ``axes`` as an input from 18: converted here;
* Split without a ``split`` input needs ``num_outputs`` from 18: converted here;
* DFT (20), GridSample (20: mode names) and GroupNormalization (21: per-channel affine)
  change meaning: a graph using them is left alone (the raise is refused with the reason).

Every TorchScript fixture raised 17 -> 23 gives bit-identical onnxruntime CPU outputs
(tests/test_pass_fuse_rmsnorm.py) and, measured, the same HTP placement and partitions.  ``onnx.version_converter``
is not used because it works on a whole ``ModelProto`` (weights included), while this works
on the graph with its lazily loaded weights.

``PassContext.target_opset`` (``run --target-opset N``) caps the raise: above it the raise is
refused with the reason, the fusion does not happen, and the older decomposed form stays
(``fp16-safety`` then keeps it in fp16's range).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import PassContext, PassResult

REDUCE_OPS = ("ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
              "ReduceLogSumExp", "ReduceSumSquare")
#: op -> the opset at which its meaning changed in a way not converted here.
INCOMPATIBLE = {"DFT": 20, "GridSample": 20, "GroupNormalization": 21}


def _ir_version_for(opset: int) -> int:
    """The IR version released together with ``opset`` (onnx's version table)."""
    versions = [ir for _, ir, ops, *_ in onnx.helper.VERSION_TABLE if ops >= opset]
    return min(versions) if versions else onnx.IR_VERSION


def _default_domain(node: gs.Node) -> bool:
    return node.domain in (None, "", "ai.onnx")


def _all_nodes(ir: IRModel):
    for graph in ir.graphs():
        for node in graph.nodes:
            yield graph, node


def why_not_raise(ir: IRModel, target: int) -> str | None:
    """The reason ``ir`` cannot be raised to ``target``, or None when it can."""
    current = ir.opset
    if current >= target:
        return None
    if current < 13:
        return f"opset {current} is older than 13 (attribute-to-input changes not handled)"
    if ir.graph.functions:
        return "the model has local functions with their own opset imports"
    if target > onnx.defs.onnx_opset_version():
        return f"onnx {onnx.__version__} does not know opset {target}"
    for _, node in _all_nodes(ir):
        changed_at = INCOMPATIBLE.get(node.op)
        if _default_domain(node) and changed_at is not None and current < changed_at <= target:
            return f"{node.op} ('{node.name}') changes meaning at opset {changed_at}"
    return None


def raise_opset(ir: IRModel, ctx: PassContext, target: int) -> str | None:
    """Raise ``ir`` to ``target`` (no-op if already there); the reason if refused."""
    reason = why_not_raise(ir, target)
    if reason or ir.opset >= target:
        return reason
    cap = getattr(ctx, "target_opset", None)
    if cap is not None and target > cap:
        return f"it needs opset {target}, above --target-opset {cap}"
    current = ir.opset
    for graph, node in _all_nodes(ir):
        if not _default_domain(node):
            continue
        if current < 18 <= target and node.op in REDUCE_OPS and "axes" in node.attrs:
            axes = np.asarray(node.attrs.pop("axes"), dtype=np.int64)
            node.inputs.append(gs.Constant(ctx.unique_name(ir, f"{node.name}_axes"), axes))
        if current < 18 <= target and node.op == "Split" and (len(node.inputs) < 2 or not node.inputs[1].name):
            node.attrs["num_outputs"] = len(node.outputs)
    for graph in ir.graphs():
        graph.opset = target
        if graph.import_domains is not None:  # new protos: the old ones may be shared with a rollback copy
            graph.import_domains = [onnx.helper.make_opsetid(e.domain, target if e.domain in ("", "ai.onnx") else e.version)
                                    for e in graph.import_domains]
    ir.ir_version = max(ir.ir_version, _ir_version_for(target))
    return None


def fuse_at_opset(ir: IRModel, ctx: PassContext, matches: list, fuse: Callable, *, opset: int, allow_raise: bool,
                  stats: dict, notes: list[str], refused_hint: str = "") -> PassResult:
    """Raise the model to ``opset`` (when ``allow_raise``) and apply ``fuse`` to every match.

    Shared by the norm fusions: their target ops need a newer opset than exporters write,
    and the raise is all-or-nothing for the model.  Refused raises leave the graph as is.
    """
    from qnnpasses.passes.norm._graph import Replacements

    from qnnpasses.passmanager.rewrite import finish

    before = ir.opset
    refused = raise_opset(ir, ctx, opset) if allow_raise else (
        None if before >= opset else f"opset {before} < {opset} and raise_opset=false")
    if refused:
        notes.append(f"not fused: {refused}{refused_hint}")
        return PassResult(changed=False, stats=stats, notes=notes)
    rewired = Replacements(ir.graph)
    for match in matches:
        fuse(ir, ctx, match, rewired)
    finish(ir)
    stats["fused"] = len(matches)
    if ir.opset != before:
        stats["opset"] = f"{before}->{ir.opset}"
    return PassResult(changed=True, stats=stats, notes=notes)
