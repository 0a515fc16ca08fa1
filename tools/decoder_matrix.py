#!/usr/bin/env python
"""Build a matrix of tiny Hugging Face decoders exported to ONNX with a dynamic KV cache.

Every family below is built from a tiny config (never downloaded), seeded, and exported the
way users export decoders: a ``ts`` (TorchScript, ``dynamo=False``, opset 17, ``dynamic_axes``)
and a ``dynamo`` (``dynamo=True``, ``dynamic_shapes``) export of one forward step with inputs
``input_ids``, ``attention_mask``, ``position_ids``, ``past_key_values.{i}.key|value`` and
outputs ``logits``, ``present.{i}.key|value`` (batch, sequence and past length all symbolic),
through ``tools/export_fixtures.py``'s wrapper and exporters, traced on a step of 4 new tokens
after an 8-token past (a full-length past in every layer).  Two attention variants:

* ``sdpa``  -- transformers' default: ``from_config(config)``, attn_implementation untouched;
* ``eager`` -- ``from_config(config, attn_implementation="eager")``.

Model configs are never changed to make an export pass: a failing export is recorded as
``"status": "failed"`` with the exception's first line.  The optional ``optimum`` exporter
calls ``tools/optimum_export.py``'s ``export_optimum(hf_dir, out_path)``.

For each fixture ``{family}_{attn}_{exporter}`` the output directory gets ``NAME.onnx``
(weights inline), ``hf/{family}_{attn}/`` (``save_pretrained`` of the torch model, shared by
the exporters) and an entry in ``matrix.json`` holding the seeded 12-token prompt,
transformers' greedy tokens (``generate(max_new_tokens=20, do_sample=False)``) and the max
abs difference between onnxruntime (CPU) and torch logits over a prefill from an empty
(0-length) past and one decode step.  ``onnx_tokens`` are onnxruntime's argmax tokens when
fed transformers' tokens one step at a time (equal to ``hf_tokens`` for a right export).

Usage::

    python tools/decoder_matrix.py                          # -> ~/.cache/qnnpasses/decoders
    python tools/decoder_matrix.py --out /tmp/decoders --only llama gemma2 \\
        --attn sdpa --exporters ts,dynamo,optimum

From Python: ``load_matrix(out_dir)`` lists the ok fixtures (``include_failed=True``: all).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
import transformers
from torch.export import Dim
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

TOOLS_DIR = Path(__file__).resolve().parent
if str(TOOLS_DIR) not in sys.path:
    sys.path.insert(0, str(TOOLS_DIR))
import export_fixtures as ef  # noqa: E402  (sibling module)

SEED = ef.SEED
PROMPT_LEN = 12
NEW_TOKENS = 20
EXAMPLE_PAST = 8  # export example: the past of the prompt's first tokens, the rest as new input
SLIDING_WINDOW = 8
LAYERS, HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, VOCAB, MAX_POS = 2, 64, 4, 2, 128, 256, 128
HEAD_DIM = HIDDEN // HEADS
WIDE_HEAD_DIM = 2 * HEAD_DIM  # gemma3: head_dim != hidden / heads
SPECIAL_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

ATTNS = ("sdpa", "eager")
EXPORTERS = ("ts", "dynamo")
OPTIONAL_EXPORTERS = ("optimum",)
DEFAULT_OUT = Path.home() / ".cache" / "qnnpasses" / "decoders"
MATRIX = "matrix.json"
VERSION_KEYS = ("torch", "transformers", "onnx", "onnxscript")

# Symbolic axes, named as Optimum names them (dynamo Dims must be identifiers).
BATCH, SEQ, PAST, TOTAL = "batch_size", "sequence_length", "past_sequence_length", "total_sequence_length"
TS_TOTAL = f"{PAST} + {SEQ}"

ANSI = re.compile(r"\x1b\[[0-9;]*m")
log = logging.getLogger("decoder_matrix")

_MHA = dict(num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
            num_attention_heads=HEADS, vocab_size=VOCAB, max_position_embeddings=MAX_POS, **SPECIAL_TOKENS)
_GQA = dict(_MHA, num_key_value_heads=KV_HEADS)

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": _GQA,
    "qwen2": _GQA,
    "qwen3": dict(_GQA, head_dim=HEAD_DIM),  # q/k norm
    "mistral": dict(_GQA, head_dim=HEAD_DIM, sliding_window=SLIDING_WINDOW),
    "gemma": dict(_GQA, head_dim=HEAD_DIM),
    "gemma2": dict(_GQA, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, sliding_window=SLIDING_WINDOW),
    "gemma3_text": dict(_GQA, head_dim=WIDE_HEAD_DIM, query_pre_attn_scalar=WIDE_HEAD_DIM,
                        sliding_window=SLIDING_WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "phi3": _GQA,  # fused qkv / gate_up
    "phi": _MHA,  # Phi-2: partial rotary, parallel attention + MLP
    "stablelm": _GQA,  # partial rotary
    "gpt_neox": _MHA,  # partial rotary, parallel residual
    "gpt2": dict(n_layer=LAYERS, n_embd=HIDDEN, n_inner=INTERMEDIATE, n_head=HEADS, vocab_size=VOCAB,
                 n_positions=MAX_POS, **SPECIAL_TOKENS),  # learned positions
    "granite": dict(_GQA, embedding_multiplier=12.0, residual_multiplier=0.22,
                    attention_multiplier=1.0 / HEAD_DIM, logits_scaling=8.0),
    "olmo2": _GQA,  # q/k norm
    "smollm3": dict(_GQA, no_rope_layer_interval=LAYERS),  # the last layer has no rotary
}


# --------------------------------------------------------------------------- torch side


def build_model(family: str, attn: str) -> PreTrainedModel:
    """The seeded tiny model; ``sdpa`` leaves the attention implementation to transformers."""
    torch.manual_seed(SEED)
    config = AutoConfig.for_model(family, **FAMILIES[family])
    kwargs = {} if attn == "sdpa" else {"attn_implementation": attn}
    return AutoModelForCausalLM.from_config(config, **kwargs).eval()


def make_prompt() -> torch.Tensor:
    """PROMPT_LEN seeded ids above the special tokens, shape [1, PROMPT_LEN]."""
    gen = torch.Generator().manual_seed(SEED)
    low = max(SPECIAL_TOKENS.values()) + 1
    return torch.randint(low, VOCAB, (1, PROMPT_LEN), generator=gen, dtype=torch.int64)


def hf_generate(model: PreTrainedModel, prompt: torch.Tensor) -> list[int]:
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                             do_sample=False)
    return out[0, prompt.shape[1]:].tolist()


def cache_kwarg(model: PreTrainedModel) -> str:
    return ef.ExportWrapper(model, kv_spec(model)).cache_kwarg


def torch_steps(model: PreTrainedModel, prompt: torch.Tensor, token: int) -> tuple[list[np.ndarray], list[tuple]]:
    """Torch logits of the prefill and of one decode step of ``token``; the cache's K/V shapes."""
    n = prompt.shape[1]
    with torch.no_grad():
        first = model(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                      position_ids=torch.arange(n)[None], use_cache=True)
        cache = first.cache if getattr(first, "cache", None) is not None else first.past_key_values
        shapes = [tuple(t.shape) for layer in cache.layers for t in (layer.keys, layer.values)]
        second = model(input_ids=torch.tensor([[token]]), attention_mask=torch.ones(1, n + 1, dtype=torch.int64),
                       position_ids=torch.tensor([[n]]), use_cache=True, **{cache_kwarg(model): cache})
    return [first.logits.numpy(), second.logits.numpy()], shapes


# --------------------------------------------------------------------------- exporting


def kv_spec(model: PreTrainedModel) -> ef.ModelSpec:
    """The export_fixtures spec its ExportWrapper reads: a KV-cache step with position_ids."""
    return ef.ModelSpec(model.config.model_type, model.config.model_type, {}, kv_cache=True,
                        position_ids=True, dynamic=True)


def example_io(model: PreTrainedModel, prompt: torch.Tensor) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Export example: the past of the prompt's first EXAMPLE_PAST tokens, the rest as input."""
    n = prompt.shape[1]
    with torch.no_grad():  # a plain cache: every layer's past is full length, as the wrapper's
        out = model(input_ids=prompt[:, :EXAMPLE_PAST], use_cache=True,
                    **{cache_kwarg(model): transformers.DynamicCache()})
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    inputs = {"input_ids": prompt[:, EXAMPLE_PAST:], "attention_mask": torch.ones(1, n, dtype=torch.int64),
              "position_ids": torch.arange(EXAMPLE_PAST, n)[None]}
    outputs = ["logits"]
    for i, layer in enumerate(cache.layers):
        inputs[f"past_key_values.{i}.key"], inputs[f"past_key_values.{i}.value"] = layer.keys, layer.values
        outputs += [f"present.{i}.key", f"present.{i}.value"]
    return inputs, outputs


def ts_axes(inputs: dict[str, torch.Tensor], outputs: list[str]) -> dict[str, dict[int, str]]:
    axes: dict[str, dict[int, str]] = {}
    for name in list(inputs) + outputs:
        if name.startswith("past_key_values."):
            axes[name] = {0: BATCH, 2: PAST}
        elif name.startswith("present."):
            axes[name] = {0: BATCH, 2: TS_TOTAL}
        else:
            axes[name] = {0: BATCH, 1: TS_TOTAL if name == "attention_mask" else SEQ}
    return axes


def dynamo_shapes(inputs: dict[str, torch.Tensor]) -> tuple:
    batch, seq = Dim(BATCH, min=1, max=MAX_POS), Dim(SEQ, min=1, max=MAX_POS)
    past, total = Dim(PAST, min=0, max=MAX_POS), Dim(TOTAL, min=1, max=MAX_POS)
    shapes = [{0: batch, 2: past} if name.startswith("past_key_values.")
              else {0: batch, 1: total if name == "attention_mask" else seq} for name in inputs]
    # ExportWrapper.forward(input_ids, attention_mask, *rest): the rest is one nested tuple
    return shapes[0], shapes[1], tuple(shapes[2:])


def export_torch(model: PreTrainedModel, prompt: torch.Tensor, exporter: str, path: Path) -> None:
    wrapper = ef.ExportWrapper(model, kv_spec(model)).eval()
    inputs, outputs = example_io(model, prompt)
    dynamic = ts_axes(inputs, outputs) if exporter == "ts" else dynamo_shapes(inputs)
    with ef.quiet(), torch.no_grad():
        ef.EXPORTERS[exporter](wrapper, inputs, outputs, path, dynamic)
    ef.strip_machine_paths(path)


def export_with_optimum(hf_dir: Path, path: Path) -> str | None:
    """``tools/optimum_export.export_optimum``; a failure reason if it is missing or fails."""
    try:
        from optimum_export import export_optimum
    except ImportError:
        return "optimum exporter not available"
    reason = export_optimum(hf_dir, path)
    if reason is None:
        ef.strip_machine_paths(path)
    return reason


def export_fixture(exporter: str, model: PreTrainedModel, prompt: torch.Tensor, hf_dir: Path,
                   path: Path) -> str | None:
    """Write ``path`` with ``exporter``; None on success, else the one-line failure reason."""
    try:
        if exporter == "optimum":
            return export_with_optimum(hf_dir, path)
        export_torch(model, prompt, exporter, path)
    except Exception as exc:  # an exporter that cannot export this model
        return first_line(exc)
    return None


# --------------------------------------------------------------------------- onnxruntime side


def onnx_steps(path: Path, prompt: torch.Tensor, hf_tokens: list[int],
               kv_shapes: list[tuple]) -> tuple[list[np.ndarray], list[int], list[str], list[str]]:
    """Prefill from an empty past, then decode transformers' tokens one by one.

    Returns the logits of the prefill and of the first decode step, the argmax token of
    every step (teacher-forced), and the graph's input and output names.
    """
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    in_names = [i.name for i in session.get_inputs()]
    out_names = [o.name for o in session.get_outputs()]
    past_names = [n for n in in_names if n.startswith("past_key_values.")]
    past = [np.zeros((shape[0], shape[1], 0, shape[3]), np.float32) for shape in kv_shapes]
    ids, done = prompt.numpy(), 0
    logits_seen: list[np.ndarray] = []
    tokens: list[int] = []
    for token in [None, *hf_tokens[:-1]]:
        if token is not None:
            ids = np.array([[token]], np.int64)
        seq = ids.shape[1]
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, done + seq), np.int64),
                 "position_ids": np.arange(done, done + seq, dtype=np.int64)[None], **dict(zip(past_names, past))}
        missing = [n for n in in_names if n not in feeds]
        if missing:
            raise RuntimeError(f"graph inputs the HF feeds lack: {missing}")
        result = dict(zip(out_names, session.run(out_names, {n: feeds[n] for n in in_names})))
        past = [result[n.replace("past_key_values.", "present.")] for n in past_names]
        done += seq
        tokens.append(int(result["logits"][0, -1].argmax()))
        if len(logits_seen) < 2:
            logits_seen.append(result["logits"])
    return logits_seen, tokens, in_names, out_names


def max_abs(got: list[np.ndarray], expected: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(g - e))) for g, e in zip(got, expected, strict=True))


# --------------------------------------------------------------------------- the matrix


def first_line(exc: BaseException) -> str:
    """The exception's first line; a wrapping exporter error also names its cause's."""
    line = ANSI.sub("", ef.exporter_error(exc).splitlines()[0])
    if exc.__cause__ is not None:
        line += " <- " + first_line(exc.__cause__)
    return line


def new_entry(family: str, attn: str, exporter: str) -> dict[str, Any]:
    """A matrix entry with every key, as a failure until filled in."""
    name = f"{family}_{attn}_{exporter}"
    return {"name": name, "family": family, "attn": attn, "exporter": exporter, "status": "failed",
            "reason": None, "onnx": f"{name}.onnx", "hf_dir": None, "hf_attn_implementation": None,
            "sliding_window": None, "layer_types": None, "prompt_ids": [], "hf_tokens": [],
            "onnx_vs_torch_max_abs": None, "onnx_tokens": [], "onnx_inputs": [], "onnx_outputs": []}


def build_fixture(family: str, attn: str, exporter: str, model: PreTrainedModel, prompt: torch.Tensor,
                  hf_tokens: list[int], reference: list[np.ndarray], kv_shapes: list[tuple],
                  hf_dir: Path, out_dir: Path) -> dict[str, Any]:
    """Export one fixture and check it on onnxruntime; returns its matrix entry."""
    entry = new_entry(family, attn, exporter)
    name, path = entry["name"], out_dir / entry["onnx"]
    entry.update(hf_dir=hf_dir.relative_to(out_dir).as_posix(),
                 hf_attn_implementation=model.config._attn_implementation,
                 sliding_window=getattr(model.config, "sliding_window", None),
                 layer_types=getattr(model.config, "layer_types", None),
                 prompt_ids=prompt[0].tolist(), hf_tokens=hf_tokens)
    start = time.perf_counter()
    reason = export_fixture(exporter, model, prompt, hf_dir, path)
    if reason is not None:  # record and move on
        path.unlink(missing_ok=True)
        entry.update(onnx=None, reason=reason)
        log.warning("%-26s FAILED (export, %.0f s): %s", name, time.perf_counter() - start, entry["reason"])
        return entry
    try:
        logits, tokens, in_names, out_names = onnx_steps(path, prompt, hf_tokens, kv_shapes)
    except Exception as exc:
        entry.update(reason=f"onnxruntime: {first_line(exc)}")
        log.warning("%-26s FAILED (onnxruntime): %s", name, entry["reason"])
        return entry
    entry.update(status="ok", onnx_vs_torch_max_abs=max_abs(logits, reference[:len(logits)]),
                 onnx_tokens=tokens, onnx_inputs=in_names, onnx_outputs=out_names)
    log.info("%-26s ok  max_abs %.2e  tokens %2d/%d  %.0f s", name, entry["onnx_vs_torch_max_abs"],
             sum(a == b for a, b in zip(tokens, hf_tokens)), len(hf_tokens), time.perf_counter() - start)
    return entry


def build_family(family: str, attn: str, exporters: list[str], out_dir: Path) -> list[dict[str, Any]]:
    """Build, save and run one family+attn, then export it with every exporter."""
    hf_dir = out_dir / "hf" / f"{family}_{attn}"
    try:
        model = build_model(family, attn)
        model.save_pretrained(hf_dir)
        prompt = make_prompt()
        hf_tokens = hf_generate(model, prompt)
        reference, kv_shapes = torch_steps(model, prompt, hf_tokens[0])
    except Exception as exc:  # the family cannot even run in torch: fail all its exporters
        reason = f"torch: {first_line(exc)}"
        log.warning("%s_%s FAILED in torch: %s", family, attn, reason)
        return [new_entry(family, attn, e) | {"reason": reason, "onnx": None} for e in exporters]
    return [build_fixture(family, attn, e, model, prompt, hf_tokens, reference, kv_shapes, hf_dir, out_dir)
            for e in exporters]


def versions() -> dict[str, str]:
    every = ef.versions()
    return {key: every[key] for key in VERSION_KEYS}


def write_matrix(entries: list[dict[str, Any]], out_dir: Path) -> Path:
    """Merge ``entries`` into ``matrix.json`` (a partial rebuild keeps the other fixtures)."""
    path = out_dir / MATRIX
    old = json.loads(path.read_text())["fixtures"] if path.exists() else []
    merged = {e["name"]: e for e in old} | {e["name"]: e for e in entries}
    matrix = {"versions": versions(), "seed": SEED, "fixtures": [merged[k] for k in sorted(merged)]}
    path.write_text(json.dumps(matrix, indent=1) + "\n")
    return path


def load_matrix(out_dir: Path | str = DEFAULT_OUT, include_failed: bool = False) -> list[dict[str, Any]]:
    """The matrix entries (ok ones only unless ``include_failed``), each with absolute
    ``onnx_path`` / ``hf_path`` added (those are not stored in the file)."""
    out_dir = Path(out_dir).expanduser()
    entries = json.loads((out_dir / MATRIX).read_text())["fixtures"]
    chosen = [dict(e) for e in entries if include_failed or e["status"] == "ok"]
    for e in chosen:
        e["onnx_path"] = out_dir / e["onnx"] if e.get("onnx") else None
        e["hf_path"] = out_dir / e["hf_dir"] if e.get("hf_dir") else None
    return chosen


# --------------------------------------------------------------------------- CLI


def csv(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        items = [t for t in text.split(",") if t]
        bad = sorted(set(items) - set(allowed))
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {list(allowed)}")
        return items
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default: %(default)s)")
    parser.add_argument("--only", nargs="+", metavar="FAMILY", choices=list(FAMILIES), help="families to build")
    parser.add_argument("--attn", type=csv(ATTNS), default=list(ATTNS), help="comma list of sdpa,eager")
    parser.add_argument("--exporters", type=csv(EXPORTERS + OPTIONAL_EXPORTERS), default=list(EXPORTERS),
                        help="comma list of ts,dynamo[,optimum]")
    return parser.parse_args(argv)


def summarize(entries: list[dict[str, Any]], seconds: float) -> None:
    for e in entries:
        diff = e.get("onnx_vs_torch_max_abs")
        same = sum(a == b for a, b in zip(e.get("onnx_tokens", []), e.get("hf_tokens", [])))
        detail = f"max_abs {diff:.2e}  tokens {same}/{len(e['hf_tokens'])}" if e["status"] == "ok" else e["reason"]
        log.info("%-26s %-6s %s", e["name"], e["status"], detail)
    ok = sum(e["status"] == "ok" for e in entries)
    log.info("%d ok, %d failed, %.0f s", ok, len(entries) - ok, seconds)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ef.setup_logging(log)
    transformers.logging.disable_progress_bar()
    out_dir = args.out.expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    entries = [entry for family in (args.only or FAMILIES) for attn in args.attn
               for entry in build_family(family, attn, args.exporters, out_dir)]
    path = write_matrix(entries, out_dir)
    summarize(entries, time.perf_counter() - start)
    log.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
