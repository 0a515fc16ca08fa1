"""Lint rules and findings: what a rule declares about itself, and the registry of rules.

A rule is a function ``check(ctx) -> Iterable[Finding]`` registered with :func:`rule`,
which gives it a stable id (``QP001``...), a short name, a default severity, a one-line
summary, a help page and the default fix (a pass, a pipeline, or a manual action).  The
function's docstring is the rule's full description (shown by SARIF viewers), so it says
what is matched and why it matters on the HTP.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

#: Severities, most severe first.  SARIF calls "info" "note".
SEVERITIES = ("error", "warning", "info")

QNN_EP_DOCS = "https://onnxruntime.ai/docs/execution-providers/QNN-ExecutionProvider.html"
ONNX_OPS_DOCS = "https://onnx.ai/onnx/operators/onnx__{op}.html"


@dataclass
class Finding:
    """One problem at one place: ``node`` is a node (or tensor, for graph inputs) name,
    ``None`` for model-level findings."""

    rule: str
    severity: str
    node: str | None
    op_type: str | None
    message: str
    fix: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if not data["details"]:
            del data["details"]
        return data


@dataclass(frozen=True)
class Rule:
    id: str
    name: str
    severity: str
    summary: str
    fix: str
    help_uri: str
    check: Callable[[Any, Rule], Iterable[Finding]] = field(compare=False, repr=False)

    @property
    def description(self) -> str:
        """The rule's full description: its check function's docstring."""
        return inspect.cleandoc(self.check.__doc__ or self.summary)

    def run(self, ctx: Any) -> list[Finding]:
        return list(self.check(ctx, self))

    def finding(self, node: str | None, op_type: str | None, message: str, *, fix: str | None = None,
                **details: Any) -> Finding:
        """A finding of this rule, at the rule's severity (the one ``--list-rules`` shows: a
        finding never reports a rule at another severity), with the rule's fix unless given."""
        return Finding(self.id, self.severity, node, op_type, message, fix or self.fix, details)


RULES: dict[str, Rule] = {}


def rule(id: str, name: str, severity: str, summary: str, fix: str, help_uri: str = QNN_EP_DOCS):
    """Decorator registering ``check(ctx, rule) -> Iterable[Finding]`` as a lint rule.

    Ids are unique and stable: a rule that goes away leaves its id unused.
    """
    if severity not in SEVERITIES:
        raise ValueError(f"rule {id}: unknown severity {severity!r}")

    def register(check: Callable) -> Callable:
        existing = RULES.get(id)
        if existing is not None and existing.check.__qualname__ != check.__qualname__:
            raise ValueError(f"lint rule id {id} is already used by {existing.name}")
        RULES[id] = Rule(id, name, severity, summary, fix, help_uri, check)
        return check

    return register


def severity_rank(severity: str) -> int:
    return SEVERITIES.index(severity)
