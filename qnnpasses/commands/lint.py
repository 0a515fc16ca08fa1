"""``qnnpasses lint``: pre-conversion findings for the HTP, each with a rule id and its fix.

Fast and offline: rules read the measured op-support table and try passes on copies of
the model; the HTP backend is never started (``qnnpasses check --real`` and ``qnnpasses
diagnose`` do that).  Exit code 1 when findings reach ``--fail-on`` (for CI and
pre-commit), 2 for bad input.
"""

from __future__ import annotations

import sys
from pathlib import Path

from qnnpasses.commands.common import add_format_arg, add_shape_arg, load_shaped
from qnnpasses.errors import EXIT_CHECK_FAILED, EXIT_INTERNAL, BadInputError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "lint", help="find what keeps a model off the HTP, and the pass that fixes it",
        description="Check models before conversion: each finding has a rule id, a severity and the pass "
                    "(or manual step) that fixes it.  Exit 1 when a finding reaches --fail-on, 3 when a rule "
                    "crashed (the report is then incomplete).")
    parser.add_argument("model", nargs="*", help="ONNX model(s)")
    parser.add_argument("--backend", choices=("htp",), default="htp", help="accelerator to lint for")
    add_format_arg(parser, ("text", "json", "sarif"))
    parser.add_argument("--fail-on", choices=("error", "warning", "never"), default="error",
                        help="exit 1 when a finding of this severity or worse is found (default: error)")
    parser.add_argument("--ignore", action="append", default=[], metavar="RULE",
                        help="skip a rule, by id (QP010) or name (float32-without-plan); repeatable or comma-separated")
    parser.add_argument("--list-rules", action="store_true", help="print the rules and exit")
    add_shape_arg(parser)
    parser.add_argument("-o", "--output", metavar="FILE", help="write the report to this file instead of stdout")
    parser.set_defaults(func=main)


def main(args) -> int:
    from qnnpasses.lint import LintConfig, all_rules, lint_model
    from qnnpasses.lint.formats import render

    rules = all_rules()
    if args.list_rules:
        for r in rules:
            print(f"{r.id}  {r.name:<26} {r.severity:<8} {r.summary}  [fix: {r.fix}]")
        return 0
    if not args.model:
        raise BadInputError("lint needs at least one MODEL (or --list-rules)")
    ignore = {part.strip() for value in args.ignore for part in value.split(",") if part.strip()}
    unknown = ignore - {r.id for r in rules} - {r.name for r in rules}
    if unknown:
        raise BadInputError(f"--ignore: unknown rule(s) {', '.join(sorted(unknown))} (see --list-rules)")
    config = LintConfig(backend=args.backend, ignore=frozenset(ignore))
    reports = []
    from qnnpasses.progress import step

    for model in args.model:
        step(f"linting {model}", minor=len(args.model) == 1)
        if args.shape:
            ir = load_shaped(args, model)
            ir.path = ir.path or model
            report = lint_model(ir, config)
            report.model = model
        else:
            report = lint_model(model, config)
        reports.append(report)
    text = "\n".join(render(report, args.format) for report in reports) if args.format == "text" or len(reports) == 1 \
        else _merged(reports, args.format)
    if args.output:
        Path(args.output).write_text(text + "\n")
    else:
        sys.stdout.write(text + "\n")
    crashed = [(report.model, rule_id, error) for report in reports for rule_id, error in report.rule_failures.items()]
    for model, rule_id, error in crashed:
        sys.stderr.write(f"qnnpasses: error: {model}: rule {rule_id} crashed and was skipped: {error}\n")
    if crashed:
        return EXIT_INTERNAL
    return EXIT_CHECK_FAILED if any(r.fails(args.fail_on) for r in reports) else 0


def _merged(reports, fmt: str) -> str:
    """Several models in one document: a JSON list, or one SARIF log with a run per model."""
    import json

    from qnnpasses.lint.formats import to_sarif

    if fmt == "json":
        return json.dumps([r.to_dict() for r in reports], indent=2)
    logs = [to_sarif(r) for r in reports]
    return json.dumps({**logs[0], "runs": [run for log in logs for run in log["runs"]]}, indent=2)
