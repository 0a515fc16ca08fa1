"""``qnnpasses llm``: a HF-style KV-cache decoder export -> a static prefill + decode pair for the HTP.

Writes ``DIR/prefill.onnx``, ``DIR/decode.onnx`` (static shapes, htp-llm applied, the cache
outside the graph; their weights in ``DIR/weights.data``), their compiled EPContext models,
``DIR/llm.json`` (the manifest a runner follows, see :mod:`qnnpasses.llm.manifest`) and
``DIR/report.json`` / ``report.md``.
"""

from __future__ import annotations

import json

from qnnpasses.commands.common import add_deprecated, add_format_arg
from qnnpasses.errors import BadInputError
from qnnpasses.llm.manifest import OFFSET_CANDIDATES
from qnnpasses.units import parse_size


def _positive_int(text: str) -> int:
    import argparse

    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None


def register(subparsers) -> None:
    p = subparsers.add_parser("llm", help="turn a KV-cache decoder export into a static prefill + decode pair for the HTP")
    p.add_argument("model", help="decoder exported with past_key_values inputs and present outputs, or the "
                                 "Hugging Face / Optimum folder holding it (never modified)")
    p.add_argument("--out-dir", dest="out_dir", metavar="DIR", help="folder to write (required)")
    add_deprecated(p, "-o", "out_dir", "--out-dir VALUE")
    p.add_argument("--context", type=_positive_int, required=True, metavar="N", help="cache length (context) in tokens")
    p.add_argument("--prefill", type=_positive_int, required=True, metavar="M", help="new tokens per prefill call")
    p.add_argument("--precision", default="fp16", metavar="fp16|w8a16|w4a16",
                   help="fp16 (default) or quantized weights with 16-bit activations (needs --calib)")
    p.add_argument("--calib", metavar="DATA", help="calibration token data for --precision w8a16|w4a16, and for the 8-bit KV cache of --bundle genai "
                        "(default there: a built-in English text through the model's tokenizer)")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--parts", type=_positive_int, metavar="K", help="split each graph into K consecutive parts")
    split.add_argument("--max-part-bytes", metavar="SIZE",
                       help="split each graph into parts of at most SIZE bytes on the HTP (weights in its dtype + "
                            "peak activations; e.g. 1G). Default: 2G, splitting only the graphs larger than that "
                            "(the HTP's 4 GiB address space holds a context and its buffers)")
    p.add_argument("--int4-blocks", dest="int4_blocks", type=_int4_blocks, metavar="B|none",
                   help="w4a16: one int4 weight scale per B input rows of each output channel, or 'none': one per "
                        "output channel. Default: 32 (the most accurate measured) where the HTP prepares the first "
                        "layer so, else one per output channel (docs/int4_blocks.md)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip compiling to EPContext models")
    p.add_argument("--keep-float", dest="keep_float", action="store_true",
                   help="w8a16|w4a16: keep the float pair the quantized graphs were made from (X.float.onnx) in "
                        "the bundle, a reference for accuracy work (every weight again in float32)")
    p.add_argument("--logits-offset", dest="logits_offset", type=_logits_offset, nargs="?", const=0,
                   metavar="N|all|none",
                   help="fp16: output the logits relative to the maximum of the first N tokens' logits, subtracted "
                        "inside the lm_head's accumulation, with a logits_offset output: the logits that decide the "
                        "next token at fp16's fine resolution near 0, for N/V of the lm_head's bytes more "
                        f"(docs/logits_offset.md). Default: {OFFSET_CANDIDATES}, at most an eighth of the "
                        "vocabulary; 'all' (or no value): every token, a second lm_head read on every call; "
                        "'none': plain logits")
    add_deprecated(p, "--plain-logits", "logits_offset", "--logits-offset none", value=PLAIN_LOGITS)
    p.add_argument("--roles", metavar="ROLE=NAME,...",
                   help="name the export's inputs/outputs where the graph leaves them ambiguous "
                        "(roles: input_ids, attention_mask, position_ids, logits)")
    p.add_argument("--tokenizer-dir", "--tokenizer", dest="tokenizer", metavar="DIR",
                   help="folder with the model's tokenizer.json (+ tokenizer_config.json, generation_config.json), "
                        "copied into the bundle for 'generate --prompt' (default: the model's folder, when it has one)")
    p.add_argument("--bundle", default="qnnpasses", choices=("qnnpasses", "genai", "genie"),
                   help="qnnpasses (default): our runner's bundle; genai: also an onnxruntime-genai model "
                        "(genai_config.json, uint8 KV cache with the key transposed, plain logits); genie: also a "
                        "Genie bundle (context binaries, genie_config.json, htp_backend_ext_config.json; the graphs "
                        "take Genie's inputs)")
    add_format_arg(p)
    p.set_defaults(func=main)


#: ``--logits-offset none``
PLAIN_LOGITS = -1


def _logits_offset(text: str) -> int:
    """``--logits-offset``: a number of candidate tokens, ``all`` (0: every token) or ``none`` (-1)."""
    import argparse

    word = text.strip().lower()
    if word in ("all", "none"):
        return 0 if word == "all" else PLAIN_LOGITS
    try:
        count = int(word)
    except ValueError:
        count = 0
    if count <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of tokens, 'all' or 'none', got '{text}'")
    return count


def _int4_blocks(text: str) -> int:
    """``--int4-blocks``: a number of rows, or ``none`` (0: per output channel)."""
    import argparse

    if text.strip().lower() == "none":
        return 0
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of rows or 'none', got '{text}'") from None


def parse_roles(text: str | None) -> dict[str, str]:
    """``input_ids=ids,logits=out`` -> a dict; BadInputError on anything else."""
    roles: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        role, sep, name = item.partition("=")
        if not sep or not role.strip() or not name.strip():
            raise BadInputError(f"--roles: expected ROLE=NAME, got '{item}'")
        if role.strip() in roles:
            raise BadInputError(f"--roles: role '{role.strip()}' given twice")
        roles[role.strip()] = name.strip()
    return roles


def main(args) -> int:
    from qnnpasses.llm.convert import build

    if not args.out_dir:
        raise BadInputError("llm needs --out-dir DIR (the folder to write the prefill + decode pair into)")

    max_part_bytes = parse_size(args.max_part_bytes) if args.max_part_bytes is not None else None
    manifest = build(args.model, args.out_dir, context=args.context, prefill=args.prefill, precision=args.precision,
                     calib=args.calib, parts=args.parts, max_part_bytes=max_part_bytes, compile=args.compile,
                     logits_offset=args.logits_offset != PLAIN_LOGITS,
                     offset_candidates=None if args.logits_offset in (None, PLAIN_LOGITS) else args.logits_offset,
                     roles=parse_roles(args.roles), tokenizer=args.tokenizer,
                     bundle=args.bundle, keep_float=args.keep_float, int4_blocks=args.int4_blocks)
    if args.format == "json":
        print(json.dumps(manifest, indent=2))
        return 0
    print(render_text(manifest))
    return 0


def render_text(manifest: dict) -> str:
    target = manifest.get("target") or {}
    lines = [(f"{manifest['dir']}: {manifest['layers']} layers, context {manifest['context']}, "
              f"prefill {manifest['prefill']}, {manifest['precision']}, weight sharing: {manifest['weight_sharing']}, "
              f"for {target.get('product', '?')} ({target.get('part', '?')}, HTP {target.get('htp_arch', '?')})")]
    for name, graph in manifest["graphs"].items():
        files = ", ".join(p["compiled"] or p["onnx"] for p in graph["parts"])
        lines.append(f"  {name}: {graph['tokens']} token(s) after {graph['past']} cache slots -> {files}")
    device = manifest.get("device")
    if device:
        lines.append("  " + render_device(device, target))
    text = manifest.get("tokenizer")
    if text:
        lines.append(f"  tokenizer: {', '.join(text['files'])} (eos {text['eos_token_ids']}"
                     f"{', chat template' if text['chat_template'] else ''})")
    else:
        lines.append("  tokenizer: none beside the model ('generate --prompt' needs one: give --tokenizer-dir DIR)")
    return "\n".join(lines)


def render_device(device: dict, target: dict) -> str:
    from qnnpasses.units import fmt_bytes, fmt_seconds

    weights = " + ".join(f"{fmt_bytes(g['compiled_bytes'] or g['weight_bytes'])} ({name})"
                         for name, g in device["graphs"].items())
    line = (f"device: weights {weights}, KV cache {fmt_bytes(device['kv_cache_bytes'])}; a decode step reads "
            f"{fmt_bytes(device['decode_step_read_bytes'])}")
    ceiling = device.get("decode_tokens_per_second_ceiling")
    if ceiling:
        line += (f": at most {ceiling:.1f} tokens/s on the {target.get('product')}'s "
                 f"{device['memory_bytes_per_second'] / 1e9:.1f} GB/s")
    else:
        line += f" (the {target.get('product')}'s memory bandwidth is not known here)"
    rows = device.get("ceilings") or []
    if rows:
        line += ("\n  memory-bandwidth ceilings: " + "; ".join(
            f"{r['product']} {r['decode_tokens_per_second']:.1f} tokens/s, prefill call >= "
            f"{fmt_seconds(r['prefill_call_seconds'])}" for r in rows))
    return line
