"""Rule family ``fusion``: decomposed LayerNorm / RMSNorm / GeLU a fusion pass would replace
(QP011-QP013).

Each rule runs its fusion pass on a copy of the model and reports the nodes the pass
replaced, one finding per pattern (a connected group of replaced nodes, anchored on its
last node): exact by construction, every spelling the pass knows is found and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterator

from qnnpasses.lint.context import LintContext
from qnnpasses.lint.registry import ONNX_OPS_DOCS, Finding, Rule, rule


def fused_patterns(ctx: LintContext, r: Rule, spec: str, what: str, target: str) -> Iterator[Finding]:
    for group in ctx.removed_groups(spec):
        anchor = group[-1]
        ops = ", ".join(n.op for n in group)
        yield r.finding(anchor.name, anchor.op, f"decomposed {what} ({len(group)} nodes: {ops}) that {spec} makes one "
                        f"{target}", nodes=[n.name for n in group])


@rule("QP011", "decomposed-rmsnorm", "warning", "RMSNorm written as Pow/ReduceMean/Add/Sqrt/Div/Mul",
      fix="fuse-rmsnorm", help_uri=ONNX_OPS_DOCS.format(op="RMSNormalization"))
def decomposed_rmsnorm(ctx: LintContext, r: Rule) -> Iterator[Finding]:
    """``x * 1/sqrt(mean(x^2) + eps) * w`` as exporters write it: six or seven HTP ops instead
    of one native ``RmsNorm``, and in fp16 the square overflows (65504) for |x| > 256, which
    trained LLMs reach in their residual stream ("massive activations").  ``fuse-rmsnorm``
    makes it one ``RMSNormalization`` (raising the opset to 23 when that is safe)."""
    yield from fused_patterns(ctx, r, "fuse-rmsnorm", "RMSNorm", "RMSNormalization")


@rule("QP012", "decomposed-layernorm", "warning", "LayerNorm written as ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div",
      fix="fuse-layernorm", help_uri=ONNX_OPS_DOCS.format(op="LayerNormalization"))
def decomposed_layernorm(ctx: LintContext, r: Rule) -> Iterator[Finding]:
    """A LayerNorm spelled out in primitives: many small HTP ops with memory traffic between
    them, and an fp16 overflow risk in the variance.  ``fuse-layernorm`` makes it one
    ``LayerNormalization``, which the HTP runs natively over the last axis up to rank 4."""
    yield from fused_patterns(ctx, r, "fuse-layernorm", "LayerNorm", "LayerNormalization")


@rule("QP013", "decomposed-gelu", "warning", "GeLU written with Erf or Tanh primitives",
      fix="fuse-gelu", help_uri=ONNX_OPS_DOCS.format(op="Gelu"))
def decomposed_gelu(ctx: LintContext, r: Rule) -> Iterator[Finding]:
    """``0.5*x*(1+Erf(x/sqrt2))`` or the Tanh approximation in primitives.  The HTP rejects
    ``Erf`` (CPU fallback unless the EP's private fusion recognizes the spelling) and the
    Tanh form costs seven ops; QNN has a native ``Gelu``.  ``fuse-gelu`` makes it one ``Gelu``."""
    yield from fused_patterns(ctx, r, "fuse-gelu", "GeLU", "Gelu")
