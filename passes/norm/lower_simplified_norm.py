"""lower-simplified-norm: onnxruntime's (Skip)SimplifiedLayerNormalization => ONNX ``RMSNormalization``.

Matches ``SimplifiedLayerNormalization(x, scale)`` (an onnxruntime op in the *default*
domain: the ONNX checker does not know it) and ``com.microsoft.SkipSimplifiedLayerNormalization
(x, skip, gamma[, bias])`` whose ``mean``/``inv_std_var`` outputs are unused -- what
onnxruntime-genai's model builder writes for every RMSNorm of LLaMA/Qwen/Mistral/Phi.

Produces ``RMSNormalization(x, scale, axis, epsilon, stash_type=1)`` (opset 23, the op
``fuse-rmsnorm`` makes) and, for the Skip form, the residual sum ``Add(x, skip)[+bias]`` in
front of it, which also replaces the op's ``input_skip_bias_sum`` output.

Why: ``RMSNormalization`` maps to the HTP's native ``RmsNorm``, which does not square ``x``
in fp16 (the overflow ``fp16-safety`` exists for: see ``fuse-rmsnorm``), whereas the QNN EP
does not support ``SkipSimplifiedLayerNormalization`` and the checker rejects
``SimplifiedLayerNormalization``.  Safe: ``x / sqrt(mean(x^2) + eps) * scale`` is the
definition of both ops (fp32 statistics, like ``stash_type=1``); only rounding differs.
The model's opset is raised to 23 when that is safe (``_opset``); otherwise nothing changes.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs
from qnnpasses.passes.norm._opset import fuse_at_opset

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import (CONTRIB_LOWERED, EXACT, Pass, PassContext, PassResult, register_pass,
                                       register_property)
from qnnpasses.passmanager.rewrite import make_node

RMS_OPSET = 23
_SIMPLIFIED = "SimplifiedLayerNormalization"
_SKIP = "SkipSimplifiedLayerNormalization"


def _left(ir: IRModel) -> str:
    left = sorted({n.op for n in ir.graph.nodes if _kind(n)})
    return f"onnxruntime norms left: {', '.join(left)}" if left else ""


ORT_NORMS_LOWERED = register_property(
    "ort-norms-lowered", "onnxruntime's (Skip)SimplifiedLayerNormalization lowered to RMSNormalization", _left).name


def _kind(node: gs.Node) -> str | None:
    domain = node.domain or ""
    if node.op == _SIMPLIFIED and domain in ("", "ai.onnx"):
        return _SIMPLIFIED
    if node.op == _SKIP and domain == "com.microsoft":
        return _SKIP
    return None


@register_pass
class LowerSimplifiedNorm(Pass):
    name = "lower-simplified-norm"
    anchor_ops = frozenset({"SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"})
    summary = "(Skip)SimplifiedLayerNormalization (onnxruntime) => [Add(x, skip) ->] RMSNormalization"
    contract = EXACT
    ensures = frozenset({ORT_NORMS_LOWERED, CONTRIB_LOWERED})  # onnxruntime-only ops gone: fix-shapes after it

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        found = [n for n in ir.graph.nodes if _kind(n)]
        outputs = {t.name for t in ir.graph.outputs}
        notes = [f"{n.name}: not lowered: {_why_not(n, outputs)}" for n in found if _why_not(n, outputs)]
        matches = [n for n in found if not _why_not(n, outputs)]
        stats = {"lowered": 0, "left": len(found) - len(matches)}
        if not matches:
            return PassResult(changed=False, stats=stats, notes=notes)
        result = fuse_at_opset(ir, ctx, matches, _lower, opset=RMS_OPSET, allow_raise=True, stats=stats, notes=notes)
        stats["lowered"] = stats.pop("fused", 0)
        return result


def _why_not(node: gs.Node, graph_outputs: set[str]) -> str:
    used = [i for i, t in enumerate(node.outputs) if t.name and (t.outputs or t.name in graph_outputs)]
    if _kind(node) == _SIMPLIFIED and any(i > 0 for i in used):
        return "its inv_std_var output is used"
    if _kind(node) == _SKIP and any(i in (1, 2) for i in used):
        return "its mean/inv_std_var outputs are used"
    if node.inputs[0].dtype is None:
        return "input dtype unknown"
    return ""


def _lower(ir: IRModel, ctx: PassContext, node: gs.Node, rewired) -> None:
    kind = _kind(node)
    x = node.inputs[0]
    dtype = x.dtype
    outputs = list(node.outputs)
    inputs = list(node.inputs)
    node.outputs.clear()
    node.inputs.clear()
    if kind == _SKIP:
        terms = [inputs[0], inputs[1]] + ([inputs[3]] if len(inputs) > 3 and inputs[3].name else [])
        total = terms[0]
        for index, term in enumerate(terms[1:], start=2):
            last = index == len(terms)
            if last and len(outputs) > 3 and outputs[3].name:  # input_skip_bias_sum: the residual stream
                ir.graph.nodes.append(gs.Node("Add", name=ctx.unique_name(ir, "skip_sum"), inputs=[total, term],
                                              outputs=[outputs[3]]))
                total = outputs[3]
            else:
                total = make_node(ir, ctx, "Add", [total, term], name_hint="skip_sum", dtype=dtype).outputs[0]
        x, scale = total, inputs[2]
        axis, eps = -1, float(node.attrs.get("epsilon", 1e-5))
    else:
        scale = inputs[1]
        axis, eps = int(node.attrs.get("axis", -1)), float(node.attrs.get("epsilon", 1e-5))
    ir.graph.nodes.append(gs.Node("RMSNormalization", name=ctx.unique_name(ir, "rmsnorm"),
                                  attrs={"axis": axis, "epsilon": eps, "stash_type": 1},
                                  inputs=[x, scale], outputs=[outputs[0]]))
