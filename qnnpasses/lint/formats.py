"""Rendering a :class:`~qnnpasses.lint.LintReport`: text for people, JSON for scripts, SARIF
2.1.0 for code-scanning tools (GitHub code scanning, VS Code's SARIF viewer).

In SARIF the model file is the artifact (a binary, so results carry no line region) and
the node is a *logical location*; rules carry their full description, help link and fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import quote

from qnnpasses.lint.registry import Rule

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
SARIF_LEVEL = {"error": "error", "warning": "warning", "info": "note"}
#: Findings of one rule shown in text before the rest are summed up.
TEXT_PER_RULE = 8


def render(report, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(report.to_dict(), indent=2)
    if fmt == "sarif":
        return json.dumps(to_sarif(report), indent=2)
    return to_text(report)


# --------------------------------------------------------------------------- text


def to_text(report) -> str:
    """A headline, then the findings rule by rule (at most TEXT_PER_RULE each), each with its fix."""
    c = report.counts()
    crashed = f", {len(report.rule_failures)} crashed" if report.rule_failures else ""
    headline = (f"{report.model}: {c['error']} error(s), {c['warning']} warning(s), {c['info']} info "
                f"({len(report.rules)} rules{crashed}, {report.seconds:.1f} s)")
    lines = [headline]
    rules = {r.id: r for r in report.rules}
    shown: dict[str, int] = {}
    for f in report.findings:
        count = shown[f.rule] = shown.get(f.rule, 0) + 1
        if count == TEXT_PER_RULE + 1:
            rest = sum(g.rule == f.rule for g in report.findings) - TEXT_PER_RULE
            lines.append(f"  ... and {rest} more {f.rule} finding(s) (--format json lists all)")
        if count > TEXT_PER_RULE:
            continue
        where = f"{f.node} ({f.op_type})" if f.node else "model"
        lines.append(f"{f.severity:<7} {f.rule} {rules[f.rule].name}: {where}: {f.message}")
        lines.append(f"        fix: {f.fix}")
    fixes: dict[str, int] = {}
    for f in report.findings:
        fixes[f.fix] = fixes.get(f.fix, 0) + 1
    if fixes:
        lines.append("fixes: " + "; ".join(f"{fix} (x{n})" for fix, n in sorted(fixes.items(), key=lambda kv: -kv[1])))
    for rule_id, error in report.rule_failures.items():
        name = rules[rule_id].name if rule_id in rules else ""
        lines.append(f"error: rule {rule_id} {name} crashed and was skipped ({error}): "
                     "its findings are missing from this report")
    return "\n".join(lines)


# --------------------------------------------------------------------------- SARIF


def artifact_uri(model: str) -> str:
    """A relative path stays relative (resolved against the repository root by viewers)."""
    path = Path(model)
    return path.resolve().as_uri() if path.is_absolute() else quote(path.as_posix())


def sarif_rule(rule: Rule) -> dict[str, Any]:
    return {
        "id": rule.id,
        "name": rule.name,
        "shortDescription": {"text": rule.summary},
        "fullDescription": {"text": " ".join(rule.description.split())},
        "helpUri": rule.help_uri,
        "help": {"text": f"Fix: {rule.fix}. {' '.join(rule.description.split())}"},
        "defaultConfiguration": {"level": SARIF_LEVEL[rule.severity]},
        "properties": {"fix": rule.fix, "tags": ["onnx", "qnn-htp"]},
    }


def _result(finding, rule_index: dict[str, int], uri: str, graph: str) -> dict[str, Any]:
    location: dict[str, Any] = {"physicalLocation": {"artifactLocation": {"uri": uri, "index": 0}}}
    if finding.node:
        location["logicalLocations"] = [{"name": finding.node, "fullyQualifiedName": f"{graph}/{finding.node}",
                                         "kind": "member"}]
    properties = {"fix": finding.fix, "op_type": finding.op_type, **finding.details}
    return {
        "ruleId": finding.rule,
        "ruleIndex": rule_index[finding.rule],
        "level": SARIF_LEVEL[finding.severity],
        "message": {"text": f"{finding.message} (fix: {finding.fix})"},
        "locations": [location],
        "partialFingerprints": {"qnnpassesNode/v1": f"{finding.rule}:{finding.node or '<model>'}"},
        "properties": {k: v for k, v in properties.items() if v is not None},
    }


def to_sarif(report) -> dict[str, Any]:
    """One run; the driver lists every rule that ran, results point into the model file."""
    from qnnpasses import __version__

    rule_index = {r.id: i for i, r in enumerate(report.rules)}
    uri = artifact_uri(report.model)
    run: dict[str, Any] = {
        "tool": {"driver": {"name": "qnnpasses-lint", "semanticVersion": __version__, "version": __version__,
                            "rules": [sarif_rule(r) for r in report.rules]}},
        "artifacts": [{"location": {"uri": uri}, "mimeType": "application/octet-stream"}],
        "results": [_result(f, rule_index, uri, report.graph) for f in report.findings],
        "properties": {"backend": report.backend, "summary": report.summary()},
    }
    # a rule that crashed leaves the lint incomplete: the run did not execute successfully
    invocation: dict[str, Any] = {"executionSuccessful": not report.rule_failures}
    if report.rule_failures:
        invocation["toolExecutionNotifications"] = [
            {"level": "error", "message": {"text": f"rule {rid} crashed and was skipped: {err}"},
             "descriptor": {"id": rid, "index": rule_index[rid]} if rid in rule_index else {"id": rid}}
            for rid, err in report.rule_failures.items()]
    run["invocations"] = [invocation]
    return {"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [run]}
