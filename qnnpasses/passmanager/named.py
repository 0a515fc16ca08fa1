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


def get_pipeline(name: str) -> Pipeline:
    if name not in _PIPELINES:
        raise PipelineSpecError(f"unknown pipeline '{name}' (known: {', '.join(sorted(_PIPELINES))})")
    return parse_pipeline(_PIPELINES[name].spec)


# Order matters (see each pass's module): simplify first, because the fusions match on
# initializers and folded shapes; attention passes before layout, which rewrites the
# reshapes they match; fusions before decompositions, so nothing fused is undone;
# fp16-safety after the fusions, for whatever stayed decomposed.
# onnxruntime contrib ops (model-builder exports) first: shape inference stops at them
_HTP_LLM_HEAD = "lower-simplified-norm,lower-gqa,lower-matmulnbits,fix-shapes,simplify,gathernd,lower-int64,attention-cleanup"
_HTP_LLM_TAIL = (
    "gqa-broadcast,fuse-rmsnorm,fuse-layernorm,decompose-layernorm,fuse-gelu,decompose-gelu,fp16-safety,"
    "rotary,repeat{max=3}(layout,simplify{use_onnxsim=false}),cleanup"
)

register_pipeline(
    "htp-llm",
    f"{_HTP_LLM_HEAD},{_HTP_LLM_TAIL}",
    "Put an exported LLM/transformer fully on the QNN HTP: static shapes, folded shape math, no int64, "
    "finite masks, grouped attention, native fused norms and GeLU, fp16-safe normalizations, "
    "rotary without data movement, fewer layout ops.",
)
register_pipeline(
    "htp-llm-gqa",
    f"{_HTP_LLM_HEAD},mha-to-gqa{{groups=2}},{_HTP_LLM_TAIL}",
    "htp-llm plus the lossy MHA->GQA conversion (needs --allow-lossy): halves the KV cache.",
)
register_pipeline("cleanup", "cleanup", "Dead-code removal and topological sort only.")
