"""``qnnpasses generate``: text (or token ids) in, text out, with a bundle written by ``qnnpasses llm``.

``--prompt`` is tokenized with the bundle's own tokenizer (``--chat``: through its chat template,
as transformers renders it); tokens are chosen greedily or sampled (:mod:`qnnpasses.llm.sampling`),
generation stops at the model's end-of-sequence ids or ``--max-new-tokens``, and the text streams
to the terminal as it comes.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from qnnpasses.commands.common import add_format_arg
from qnnpasses.errors import BadInputError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate text (or token ids) with the prefill + decode bundle in DIR (static KV cache)")
    parser.add_argument("dir", metavar="DIR", help="folder written by 'qnnpasses llm' (holds llm.json)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="prompt text, tokenized with the bundle's tokenizer")
    prompt.add_argument("--prompt-ids", metavar="1,2,3", help="prompt token ids, comma-separated")
    parser.add_argument("--chat", action="store_true",
                        help="--prompt is a user message: wrap it in the model's chat template (assistant turn opened)")
    parser.add_argument("--system", metavar="TEXT", help="with --chat: a system message before the user's")
    parser.add_argument("--max-new-tokens", type=int, default=32, metavar="T", help="tokens to generate at most (default 32)")
    parser.add_argument("--temperature", type=float, metavar="T",
                        help="sample with this temperature (default 0: greedy; 1 when only --top-k/--top-p are given)")
    parser.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P",
                        help="sample among the most likely tokens holding probability P, in (0, 1] (default 1: all)")
    parser.add_argument("--seed", type=int, metavar="N", help="seed of the sampler: the same seed gives the same tokens")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's end-of-sequence tokens")
    parser.add_argument("--on", choices=("htp", "cpu"), default="htp",
                        help="htp: the compiled context models (else the .onnx graphs) on the QNN HTP backend, "
                             "CPU fallback disabled; cpu: the .onnx graphs on onnxruntime CPU")
    parser.add_argument("--runtime", choices=("qnnpasses", "onnxruntime-genai", "genie"), default="qnnpasses",
                        help="qnnpasses (default): our runner, from llm.json; onnxruntime-genai: onnxruntime-genai "
                             "itself on a bundle built with --bundle genai (its CPU provider: --on cpu); genie: "
                             "Genie itself (libGenie.so from onnxruntime-qnn) on a compiled --bundle genie "
                             "(the HTP: --on htp)")
    parser.add_argument("--compare", metavar="ORIGINAL",
                        help="also run the original dynamic-KV export (a .onnx file or the folder holding it) greedily "
                             "on onnxruntime CPU (fp32) on the same prompt: identical leading tokens and "
                             "teacher-forced top-1 agreement")
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


def sampling_options(args) -> Any:
    from qnnpasses.llm.sampling import SamplingError, SamplingOptions

    temperature = args.temperature
    if temperature is None:
        temperature = 1.0 if (args.top_k or args.top_p != 1.0) else 0.0
    try:
        return SamplingOptions(temperature=temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except SamplingError as exc:
        raise BadInputError(str(exc)) from None


def _check_args(args, sampling: Any) -> None:
    if args.max_new_tokens < 0:
        raise BadInputError("--max-new-tokens must not be negative")
    if args.chat and args.prompt is None:
        raise BadInputError("--chat applies the chat template to --prompt TEXT (not to --prompt-ids)")
    if args.system is not None and not args.chat:
        raise BadInputError("--system is a chat message: give --chat too")
    if args.compare and not sampling.greedy:
        raise BadInputError("--compare checks greedy generation: drop --temperature/--top-k/--top-p")
    if args.runtime == "onnxruntime-genai" and args.on != "cpu":
        raise BadInputError("--runtime onnxruntime-genai runs on --on cpu here: onnxruntime-genai's PyPI wheels "
                            "have no QNN provider (on the device, genai_config.json selects it)")
    if args.runtime == "genie" and args.on != "htp":
        raise BadInputError("--runtime genie runs on --on htp (Genie's engine drives the HTP; --runtime qnnpasses "
                            "--on cpu runs the same graphs on the CPU)")
    if args.runtime != "qnnpasses" and args.compare:
        raise BadInputError("--compare works with --runtime qnnpasses")


def _bundle_tokenizer(runner: Any, needed: bool) -> Any:
    """The bundle's tokenizer (None when it has none and ``needed`` is false)."""
    from pathlib import Path

    from qnnpasses.llm.tokenizer import TextTokenizer, TokenizerError

    entry = runner.manifest.get("tokenizer")
    if not entry:
        if needed:
            raise BadInputError(f"{runner.manifest['dir']}: the bundle has no tokenizer (rebuild it with "
                                "'qnnpasses llm ... --tokenizer-dir DIR', DIR holding the model's tokenizer.json)")
        return None
    try:
        return TextTokenizer(Path(runner.manifest["dir"]))
    except TokenizerError as exc:
        raise BadInputError(f"{runner.manifest['dir']}: {exc}") from None


def _prompt_ids(args, text: Any, given: list[int] | None) -> list[int]:
    """``given`` (``--prompt-ids``), else ``--prompt`` through the bundle's tokenizer."""
    from qnnpasses.llm.tokenizer import TokenizerError

    if given is not None:
        return given
    try:
        ids = text.encode_chat(args.prompt, args.system) if args.chat else text.encode(args.prompt)
    except TokenizerError as exc:
        raise BadInputError(str(exc)) from None
    if not ids:
        raise BadInputError("--prompt encodes to no tokens")
    return ids


def main(args) -> int:
    from qnnpasses.llm.reference import ReferenceModel
    from qnnpasses.llm.runner import Runner, RunnerError
    from qnnpasses.llm.sampling import Sampler
    from qnnpasses.llm.source import model_file
    from qnnpasses.llm.tokenizer import StreamDecoder

    sampling = sampling_options(args)
    _check_args(args, sampling)
    given = parse_ids(args.prompt_ids) if args.prompt_ids is not None else None  # refused before loading anything
    try:
        runner = Runner(args.dir, on=args.on, target=_given_target(args))
        text = _bundle_tokenizer(runner, needed=args.prompt is not None)
        prompt = runner.check_prompt(_prompt_ids(args, text, given))
        reference = ReferenceModel(model_file(args.compare)) if args.compare else None
        stream = StreamDecoder(text) if text is not None and args.format == "text" else None
        on_token = (lambda token: _write(stream.push(token))) if stream is not None else None
        stop = [] if args.ignore_eos or text is None else runner.manifest["tokenizer"]["eos_token_ids"]
        if args.runtime != "qnnpasses":
            result = _runtime_generation(args.runtime, runner, prompt, args.max_new_tokens, stop, sampling, on_token)
        else:
            result = runner.generate(prompt, args.max_new_tokens, choose=Sampler(sampling), stop_ids=stop,
                                     on_token=on_token)
        if stream is not None:
            _write(stream.flush() + "\n")
        report = {"prompt_ids": prompt, **result.as_dict(), "sampling": sampling.as_dict()}
        if text is not None:
            report["text"] = text.decode(result.tokens)
        if reference is not None:
            report["compare"] = compare(runner, reference, prompt, result.tokens)
    except RunnerError as exc:
        raise BadInputError(str(exc)) from None
    report.update(runtime=args.runtime, context=runner.context, prefill=runner.graphs["prefill"].tokens,
                  precision=runner.manifest.get("precision"), weight_sharing=runner.manifest.get("weight_sharing"),
                  target=runner.target.as_dict())
    if args.format == "json":
        print(json.dumps(report, indent=2))
    else:
        print(render(report, streamed=stream is not None))
    return 0


def _runtime_generation(runtime: str, runner: Any, prompt: list[int], max_new_tokens: int, stop: list[int],
                        sampling: Any, on_token: Any) -> Any:
    """The tokens another runtime (onnxruntime-genai, Genie) generates from the bundle, as a Generation
    (its own loop and cache)."""
    from qnnpasses.llm import genai, genie
    from qnnpasses.llm.runner import Generation

    module, error = (genai, genai.GenaiError) if runtime == "onnxruntime-genai" else (genie, genie.GenieError)
    try:
        out = module.generate(runner.manifest["dir"], runner.manifest, prompt, max_new_tokens, stop_ids=stop,
                              sampling=sampling, on_token=on_token)
    except error as exc:
        raise BadInputError(str(exc)) from None
    tokens = out["tokens"]
    stopped = out.get("stopped") or ("eos" if tokens and tokens[-1] in set(stop) else (
        "max_new_tokens" if len(tokens) >= max_new_tokens else "context_full"))
    files = ({n: [b for p in g["parts"] for b in p.get("binaries") or []] for n, g in runner.manifest["graphs"].items()}
             if runtime == "genie" else {n: [p["onnx"] for p in g["parts"]] for n, g in runner.manifest["graphs"].items()})
    return Generation(tokens=tokens, prompt_tokens=len(prompt), stopped=stopped, load_seconds=out["load_seconds"],
                      decode_seconds=out["seconds"], on=runner.on, files=files)


def _given_target(args) -> Any:
    """The target --soc / --htp-arch named (None: the one the bundle records)."""
    from qnnpasses.backends.targets import active

    return active() if getattr(args, "target_given", False) else None


def _write(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


STOPPED = {"max_new_tokens": "", "eos": ", stopped at end of sequence", "context_full": ", stopped: the context is full"}


def _rate(value: float | None) -> str:
    return "- tokens/s" if value is None else f"{value:.1f} tokens/s"


def render(report: dict[str, Any], streamed: bool = False) -> str:
    """The summary after a generation; ``streamed``: the text was already printed, so the ids are not."""
    count = len(report["tokens"])
    lines = [] if streamed else [f"new tokens ({count}{STOPPED[report['stopped']]}): {' '.join(map(str, report['tokens']))}"]
    if streamed:
        lines.append(f"-- {count} new token{'' if count == 1 else 's'}{STOPPED[report['stopped']]}")
    files = ", ".join(f"{name} {'+'.join(parts)}" for name, parts in report["files"].items())
    where = f"{report['on']}, {report['target']['product']}" if report["on"] == "htp" else report["on"]
    lines.append(f"on {where} ({files}; context {report['context']}, prefill {report['prefill']}, "
                 f"{report['precision']})")
    lines.append(f"load {_seconds(report['load_seconds'])}; prompt of {report['prompt_tokens']} tokens in "
                 f"{report['prefill_calls']} call(s): {_seconds(report['prefill_seconds'])}; decode "
                 f"{_seconds(report['decode_seconds_per_token'])}/token over {report['decode_calls']} step(s)")
    lines.append(f"time to first token {_seconds(report['time_to_first_token'])}; decode "
                 f"{_rate(report['tokens_per_second'])} on this host")
    cmp = report.get("compare")
    if cmp:
        line = (f"vs {cmp['original']} (onnxruntime CPU, fp32): identical leading tokens "
                f"{cmp['identical_leading_tokens']}/{cmp['generated']}")
        if "teacher_forced_top1" in cmp:
            line += (f"; teacher-forced top-1 {cmp['teacher_forced_top1']:.1%} of {cmp['teacher_forced_positions']} "
                     f"positions ({cmp['teacher_forced_top1_generated']:.1%} of the generated ones)")
        lines.append(line)
    return "\n".join(lines)

