"""Named pipelines, kept in their textual form so ``qnnpasses pipelines`` prints what runs."""

from __future__ import annotations

from dataclasses import dataclass

from qnnpasses.errors import PipelineSpecError
from qnnpasses.pipeline import Pipeline, parse_pipeline


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


register_pipeline(
    "htp-llm",
    "cleanup",
    "Put an exported LLM/transformer fully on the QNN HTP: static shapes, folded shape math, "
    "fused norms and GeLU, fp16-safe attention, contiguous layouts, then an op-support check.",
)
register_pipeline("cleanup", "cleanup", "Dead-code removal and topological sort only.")
