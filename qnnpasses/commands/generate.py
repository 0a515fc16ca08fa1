"""``qnnpasses generate``: greedy generation with a prefill + decode pair written by ``qnnpasses llm``."""

from __future__ import annotations

import json
from typing import Any

from qnnpasses.commands.common import add_format_arg
from qnnpasses.errors import BadInputError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate tokens greedily with the prefill + decode pair in DIR (static KV cache)")
    parser.add_argument("dir", metavar="DIR", help="folder written by 'qnnpasses llm' (holds llm.json)")
    parser.add_argument("--prompt-ids", required=True, metavar="1,2,3", help="prompt token ids, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=32, metavar="T", help="tokens to generate (default 32)")
    parser.add_argument("--on", choices=("htp", "cpu"), default="htp",
                        help="htp: the compiled context models (else the .onnx graphs) on the QNN HTP backend, "
                             "CPU fallback disabled; cpu: the .onnx graphs on onnxruntime CPU")
    parser.add_argument("--compare", metavar="ORIGINAL.onnx",
                        help="also run the original dynamic-KV export greedily on onnxruntime CPU (fp32): "
                             "identical leading tokens and teacher-forced top-1 agreement")
    add_format_arg(parser)
    parser.set_defaults(func=main)


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise BadInputError(f"--prompt-ids must be comma-separated integers (got '{text}')") from None
    if not ids:
        raise BadInputError("--prompt-ids is empty")
    return ids


def compare(runner: Any, reference: Any, prompt: list[int], tokens: list[int]) -> dict[str, Any]:
    """The original export's greedy tokens vs ``tokens``, and teacher-forced top-1 agreement:
    the prompt plus the original's tokens fed through the pair, argmax compared at every
    position whose next token is known (the prompt's and the generated ones)."""
    from qnnpasses.llm.reference import leading_matches

    expected = reference.generate(prompt, len(tokens))
    same = leading_matches(tokens, expected)
    result: dict[str, Any] = {"original": reference.path, "original_tokens": expected, "identical_leading_tokens": same,
                              "generated": len(tokens)}
    if not expected:
        return result
    sequence = prompt + expected[:-1]
    got = runner.score(prompt, expected[:-1]).argmax(-1)
    want = reference.logits(sequence).argmax(-1)
    agree = got == want
    result.update(teacher_forced_positions=int(agree.size), teacher_forced_top1=float(agree.mean()),
                  teacher_forced_top1_generated=float(agree[len(prompt) - 1:].mean()))
    return result


def main(args) -> int:
    from qnnpasses.llm.reference import ReferenceModel
    from qnnpasses.llm.runner import Runner, RunnerError

    prompt = parse_ids(args.prompt_ids)
    if args.max_new_tokens < 0:
        raise BadInputError("--max-new-tokens must not be negative")
    try:
        runner = Runner(args.dir, on=args.on)
        runner.check_prompt(prompt)
        reference = ReferenceModel(args.compare) if args.compare else None
        result = runner.generate(prompt, args.max_new_tokens)
        report = result.as_dict()
        if reference is not None:
            report["compare"] = compare(runner, reference, prompt, result.tokens)
    except RunnerError as exc:
        raise BadInputError(str(exc)) from None
    report.update(context=runner.context, prefill=runner.graphs["prefill"].tokens,
                  precision=runner.manifest.get("precision"), weight_sharing=runner.manifest.get("weight_sharing"))
    if args.format == "json":
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
    return 0


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def render(report: dict[str, Any]) -> str:
    stopped = "" if report["stopped"] == "max_new_tokens" else ", stopped: the context is full"
    lines = [f"new tokens ({len(report['tokens'])}{stopped}): {' '.join(map(str, report['tokens']))}"]
    files = ", ".join(f"{name} {'+'.join(parts)}" for name, parts in report["files"].items())
    lines.append(f"on {report['on']} ({files}; context {report['context']}, prefill {report['prefill']}, "
                 f"{report['precision']})")
    lines.append(f"load {_seconds(report['load_seconds'])}; prompt of {report['prompt_tokens']} tokens in "
                 f"{report['prefill_calls']} call(s): {_seconds(report['prefill_seconds'])}; decode "
                 f"{_seconds(report['decode_seconds_per_token'])}/token over {report['decode_calls']} step(s)")
    cmp = report.get("compare")
    if cmp:
        line = (f"vs {cmp['original']} (onnxruntime CPU, fp32): identical leading tokens "
                f"{cmp['identical_leading_tokens']}/{cmp['generated']}")
        if "teacher_forced_top1" in cmp:
            line += (f"; teacher-forced top-1 {cmp['teacher_forced_top1']:.1%} of {cmp['teacher_forced_positions']} "
                     f"positions ({cmp['teacher_forced_top1_generated']:.1%} of the generated ones)")
        lines.append(line)
    return "\n".join(lines)

