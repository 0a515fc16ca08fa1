"""``qnnpasses lint``: pre-conversion findings with stable rule ids and the pass that fixes each.

:func:`lint_model` loads a model, runs every registered rule (``QP001``...) on it and
returns a :class:`LintReport`; :mod:`.formats` renders it as text, JSON or SARIF 2.1.0.
Rules live in one small module per family (``rules_*.py``) and never touch the HTP
backend: they read the measured op-support table and run passes on copies of the model.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import IRModel
from qnnpasses.lint.context import LintConfig, LintContext
from qnnpasses.lint.registry import RULES, SEVERITIES, Finding, Rule, severity_rank

RULE_MODULES = ("rules_support", "rules_model", "rules_precision", "rules_fusion", "rules_layout", "rules_attention")
FAIL_ON = ("error", "warning", "never")

__all__ = ["FAIL_ON", "Finding", "LintConfig", "LintReport", "Rule", "all_rules", "lint_model"]


def all_rules() -> list[Rule]:
    """Every registered rule, by id."""
    for module in RULE_MODULES:
        importlib.import_module(f"qnnpasses.lint.{module}")
    return [RULES[k] for k in sorted(RULES)]


@dataclass
class LintReport:
    model: str
    backend: str
    rules: list[Rule]
    findings: list[Finding] = field(default_factory=list)
    rule_failures: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    graph: str = "main_graph"

    def counts(self) -> dict[str, int]:
        return {s: sum(f.severity == s for f in self.findings) for s in SEVERITIES}

    def fails(self, fail_on: str) -> bool:
        """Whether the findings reach ``fail_on`` ("error", "warning" or "never")."""
        if fail_on == "never":
            return False
        worst = severity_rank(fail_on)
        return any(severity_rank(f.severity) <= worst for f in self.findings)

    def summary(self) -> dict[str, Any]:
        by_rule: dict[str, int] = {}
        for f in self.findings:
            by_rule[f.rule] = by_rule.get(f.rule, 0) + 1
        return {"model": self.model, "backend": self.backend, "findings": len(self.findings), **self.counts(),
                "by_rule": dict(sorted(by_rule.items())), "rules_checked": len(self.rules),
                "rule_failures": self.rule_failures, "seconds": round(self.seconds, 3)}

    def to_dict(self) -> dict[str, Any]:
        return {"findings": [f.to_dict() for f in self.findings], "summary": self.summary()}


def lint_model(model: str | Path | IRModel | onnx.ModelProto, config: LintConfig | None = None) -> LintReport:
    """Run every rule not in ``config.ignore`` on ``model`` (a path, a ModelProto, or an IR,
    which is copied).

    A rule that raises does not stop the others: its id and error go to ``rule_failures``.
    """
    start = time.perf_counter()
    config = config or LintConfig()
    ir = model.copy() if isinstance(model, IRModel) else load_model(model)
    path = str(model) if isinstance(model, (str, Path)) else str(ir.path or "<model>")
    ctx = LintContext(ir, config)
    rules = [r for r in all_rules() if r.id not in config.ignore and r.name not in config.ignore]
    report = LintReport(path, config.backend, rules, graph=ir.graph.name or "main_graph")
    for r in rules:
        try:
            report.findings.extend(r.run(ctx))
        except Exception as exc:  # noqa: BLE001 - one broken rule must not hide the others' findings
            report.rule_failures[r.id] = f"{type(exc).__name__}: {exc}"
    order = ctx.order
    report.findings.sort(key=lambda f: (severity_rank(f.severity), f.rule, order.get(f.node or "", -1)))
    report.seconds = time.perf_counter() - start
    return report
