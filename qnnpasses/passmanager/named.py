"""Named pipelines, kept in their textual form so ``qnnpasses pipelines`` prints what runs."""

from __future__ import annotations

from dataclasses import dataclass

from qnnpasses.errors import PipelineSpecError
from qnnpasses.passmanager.spec import Pipeline, parse_pipeline


@dataclass(frozen=True)
class NamedPipeline:
    name: str
    summary: str
    spec: str


_PIPELINES: dict[str, NamedPipeline] = {}


def register_pipeline(name: str, spec: str, summary: str) -> None:
    """Make a pipeline known by name (plugins may add their own)."""
    _PIPELINES[name] = NamedPipeline(name, summary, spec)


def named_pipelines() -> dict[str, NamedPipeline]:
    return dict(_PIPELINES)


#: How a named pipeline runs for the callers that need it otherwise: variant -> pass -> options
#: on top of the pass's own (a pass the pipeline lacks is left alone).
#:
#: * ``quantized`` (``qnnpasses quantize``, quantized LLM pairs): the Q/K/V projections stay 2-D,
#:   so each gets per-output-channel weight scales (head-major 4-D weights can only be quantized
#:   per tensor on the HTP, :mod:`qnnpasses.quant.policy`, which int4 does not survive); and no
#:   query row is fully masked, as ``quant-mask`` assumes after it (a row test against -1e4 would
#:   never fire once the mask is the calibrated -M).
#: * ``pair`` (fp16 LLM pairs): a fully masked query row is a padding position that no output
#:   reads, so its value need not be the original's (no row tests, no NaN guards).
VARIANTS: dict[str, dict[str, dict[str, object]]] = {
    "quantized": {"layout": {"head_proj": False}, "attention-cleanup": {"assume_unmasked_rows": True}},
    "pair": {"attention-cleanup": {"assume_unmasked_rows": True}},
}


def get_pipeline(name: str, variant: str | None = None) -> Pipeline:
    """The named pipeline, as :data:`VARIANTS` ``variant`` runs it when given."""
    if name not in _PIPELINES:
        raise PipelineSpecError(f"unknown pipeline '{name}' (known: {', '.join(sorted(_PIPELINES))})")
    if variant is not None and variant not in VARIANTS:
        raise PipelineSpecError(f"unknown variant '{variant}' of pipeline '{name}' (known: {', '.join(sorted(VARIANTS))})")
    pipeline = parse_pipeline(_PIPELINES[name].spec)
    for pass_name, options in VARIANTS[variant].items() if variant else ():
        pipeline = pipeline.with_options(pass_name, **options)
    return pipeline


def derive_order(names: list[str], *, first: tuple[str, ...] = (), last: tuple[str, ...] = ()) -> list[str]:
    """The passes ``names`` in an order that satisfies their declarations.

    A pass that ``ensures`` a property runs before every pass that ``requires`` it (a stable
    topological sort: among passes that are ready, the one listed first goes first, so the
    list states preferences and the declarations state rules).  ``first`` and ``last`` are
    the hard rules, asserted: nothing may need to run before a ``first`` pass or after a
    ``last`` one.  A cycle is a :class:`PipelineSpecError` naming the passes in it.
    """
    from qnnpasses.passmanager.api import get_pass

    classes = {name: get_pass(name) for name in names}
    before: dict[str, set[str]] = {name: set() for name in names}  # name -> passes that must precede it
    for a, a_cls in classes.items():
        for b, b_cls in classes.items():
            if a != b and a_cls.ensures & b_cls.requires:
                before[b].add(a)
    for name in first:
        if before.get(name):
            raise PipelineSpecError(f"'{name}' must run first but requires what {sorted(before[name])} ensure")
    for name in last:
        needed_by = sorted(b for b, deps in before.items() if name in deps)
        if needed_by:
            raise PipelineSpecError(f"'{name}' must run last but {needed_by} require what it ensures")
    pinned = set(first) | set(last)
    middle = [n for n in names if n not in pinned]
    order = [n for n in first if n in classes]
    placed = set(order)
    while middle:
        ready = next((n for n in middle if before[n] <= placed), None)
        if ready is None:
            raise PipelineSpecError(f"pass declarations form a cycle among {sorted(middle)}")
        order.append(ready)
        placed.add(ready)
        middle.remove(ready)
    return order + [n for n in last if n in classes]


def pipeline_text(order: list[str], spelled: dict[str, str]) -> str:
    """The textual pipeline for ``order``, with some passes spelled out (options, repeat groups)."""
    return ",".join(spelled.get(name, name) for name in order)


# htp-llm, derived: the declarations (requires/ensures, see `qnnpasses passes`) fix what must
# precede what -- the onnxruntime-op lowerings (model-builder exports) before fix-shapes, since
# shape inference stops at contrib ops and what they become must be shaped with the rest
# (contrib-lowered); fix-shapes before simplify, which cannot fold the Shape of a symbolic dim
# (dims-bound); simplify before the fusions, which match on initializers and folded shapes;
# gathernd before lower-int64 (GatherND takes only int64 indices); finite masks before the
# grouped-attention rewrites; the attention rewrites before layout, which rewrites the
# reshapes they match; fusions before decompositions, so nothing fused is undone; fp16-safety
# after the norms are final, for whatever stayed decomposed.  This list only breaks ties.
# Hard rule: cleanup last.
CONTRIB_LOWERINGS = ("lower-simplified-norm", "lower-gqa", "lower-rotary-embedding", "lower-mha", "lower-matmulnbits")
HTP_LLM_PASSES = [
    *CONTRIB_LOWERINGS, "fix-shapes", "simplify", "fold-conv-affine", "gathernd", "lower-int64", "lower-cast-to-bool",
    "attention-cleanup", "gqa-broadcast", "fuse-rmsnorm", "fuse-layernorm", "decompose-layernorm", "fuse-gelu",
    "decompose-gelu", "fp16-safety", "rotary", "layout", "cleanup",
]
HTP_LLM_LAST = ("cleanup",)
HTP_LLM_SPELLED = {"layout": "repeat{max=3}(layout,simplify)", "mha-to-gqa": "mha-to-gqa{groups=2}"}


def htp_llm_text(extra: dict[str, str] | None = None) -> str:
    """htp-llm's textual form, derived from the pass declarations.

    ``extra`` adds passes to it: name -> the pass it prefers to follow (a tie-break; the
    declarations still decide what must come first).
    """
    names = list(HTP_LLM_PASSES)
    for name, after in (extra or {}).items():
        names.insert(names.index(after) + 1, name)
    return pipeline_text(derive_order(names, last=HTP_LLM_LAST), HTP_LLM_SPELLED)


register_pipeline(
    "htp-llm",
    htp_llm_text(),
    "Put an exported LLM/transformer fully on the QNN HTP: static shapes, folded shape math, no int64, "
    "finite masks, grouped attention, native fused norms and GeLU, fp16-safe normalizations, "
    "rotary without data movement, fewer layout ops.",
)
register_pipeline(
    "htp-llm-gqa",
    # before rotary and layout, which rewrite the head projections it traces
    htp_llm_text({"mha-to-gqa": "attention-cleanup"}),
    "htp-llm plus the lossy MHA->GQA conversion (needs --allow-lossy): halves the KV cache.",
)
#: For graphs the HTP runs in fp16 mode (not integer mode): SiLU and Softmax in the forms it
#: computes closer to fp32 (``tools/probe_fp16_ops.py``), at a few more ops each.
HTP_FP16_FORMS = ("silu-tanh", "softmax-exp")
#: What fp16 mode needs after htp-llm (``qnnpasses llm`` runs it on fp16 pairs): a residual stream
#: past fp16's range carried at a power-of-two smaller scale (measured: a CPU run of the graph),
#: then those forms.
HTP_FP16_FORMS_PIPELINE = f"scale-residual,{','.join(HTP_FP16_FORMS)},cleanup"
register_pipeline(
    "htp-llm-fp16",
    f"{htp_llm_text()},{HTP_FP16_FORMS_PIPELINE}",
    "htp-llm, then a residual stream past fp16's range scaled into it, and SiLU and Softmax in the forms "
    "the HTP computes closer to fp32 in fp16 mode (a few more ops; not for integer mode).",
)
register_pipeline("cleanup", "cleanup", "Dead-code removal and topological sort only.")
