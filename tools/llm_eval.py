#!/usr/bin/env python
"""A trained LLM as a deployed prefill + decode pair on the HTP: writes docs/llm.md and docs/llm.json.

For each KV-cache export of a trained model (``--model``, default SmolLM2-135M; Gemma 3 270M writes
docs/llm_gemma3_270m.md; ``tools/trained_fixtures.py``: ``kv_ts`` by the
TorchScript exporter, ``kv_dynamo`` by the dynamo exporter; trained weights, dynamic KV axes):

1. ``qnnpasses llm EXPORT -o WORK/EXPORT_fp16 --context N --prefill M`` (Python API): the
   static pair, compiled; its report gives each graph's HTP placement, composed QNN op count
   and KV-cache bytes;
2. the original export on onnxruntime CPU in fp32, driven as Hugging Face drives it (greedy,
   cache growing by ``present``): T new tokens after each prompt, and its logits on the prompt
   plus those tokens and on the prompt plus the real continuation of the text;
3. the pair on the HTP (compiled contexts, CPU fallback disabled, fp16): greedy generation
   (identical leading tokens, timings on this host's *simulated* HTP), teacher-forced top-1
   (the prompt + the original's tokens fed through the pair, argmax compared at every position
   whose next token is known) and, on the real text, top-1 agreement with fp32 and perplexity;
4. with ``w8a16`` in ``--precisions``: ``qnnpasses llm --precision w8a16 --calib`` (calibrated on
   windows of documents disjoint from the prompts') and the same teacher-forced figures on the
   HTP in integer mode;
5. the fp16 ceiling, off the HTP on the same prompts and against the same yardstick
   (:data:`CEILINGS`): the original export on onnxruntime CPU with its weights rounded to fp16
   (computing in fp32), and the Hugging Face model in torch float16 / bfloat16 on the CPU, each
   generating greedily with its own growing cache (identical leading tokens) and teacher-forced
   on the prompt + the original's tokens (top-1): whether the target is within reach of fp16 at all;
6. ``fp16`` is the pair as ``qnnpasses llm`` builds it (its logits offset by the first tokens'
   maximum); with ``fp16-offset`` / ``fp16-plain`` in ``--precisions`` also the pair built with
   ``--logits-offset all`` / ``none``, measured as the fp16 pair is, beside it: what each form of the
   logits buys, and its bytes from the builds' footprints.

A quantized pair built by an earlier quantization recipe than the current one says so in the tables
(``--doc-only`` rewrites the Markdown from the JSON with the current code's labels).

Prompts are held-out windows of real English text (``english_text.py``, the ``eval`` windows
of ``trained_fixtures.py``): the first ``--prompt-tokens`` tokens are the prompt, the next
``--new-tokens`` the real continuation.

    python tools/trained_fixtures.py build --only smollm2_135m --exporters kv_ts,kv_dynamo
    python tools/llm_eval.py [--model smollm2_135m] [--exporters kv_ts,kv_dynamo] [--precisions fp16,w8a16] [--context 128]
                             [--prefill 16] [--prompts 4] [--prompt-tokens 16] [--new-tokens 32]
                             [--quantized-prompts K] [--quantized-exporters kv_ts]
                             [--work DIR] [--reuse] [--out docs/llm] [--doc-only]
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

TOOLS_DIR = Path(__file__).resolve().parent
REPO = TOOLS_DIR.parent
sys.path.insert(0, str(TOOLS_DIR))

import accuracy_metrics as am
import trained_fixtures as tf

log = logging.getLogger("llm_eval")
MODEL = "smollm2_135m"
TARGETS = {"identical_leading_mean": 30, "fp16_teacher_forced_top1": 0.98, "w8a16_teacher_forced_top1": 0.93,
           "w8a16_perplexity_ratio": 1.10}
EXPORTER_NAMES = {"kv_ts": "TorchScript", "kv_dynamo": "dynamo"}
SHOWN_MARGINS = 16  # margins listed per table cell (all are in the .json)


# --------------------------------------------------------------------------- inputs


def prompt_counts(text: str, exporters: list[str]) -> dict[str, int]:
    """``--prompts``: one count for every export (``4``) or per export (``kv_ts:4,kv_dynamo:2``)."""
    if ":" not in text:
        return {e: int(text) for e in exporters}
    counts = {k: int(v) for k, v in (part.split(":") for part in text.split(","))}
    missing = [e for e in exporters if e not in counts]
    if missing:
        raise SystemExit(f"--prompts names no count for {missing}")
    return counts


def prompts(count: int, prompt_tokens: int, new_tokens: int) -> list[dict[str, list[int]]]:
    """``count`` held-out text windows, spread over the eval set: prompt, real continuation."""
    with np.load(tf.DEFAULT_CACHE / f"{MODEL}.eval.npz") as data:
        ids, labels = data["input_ids"], data["labels"]
    if prompt_tokens + new_tokens > ids.shape[1]:
        raise SystemExit(f"prompt + new tokens must be <= {ids.shape[1]} (the eval windows' length)")
    rows = np.linspace(0, len(ids) - 1, count).astype(int)
    return [{"window": int(r), "prompt": ids[r, :prompt_tokens].tolist(),
             "text": ids[r, prompt_tokens:prompt_tokens + new_tokens].tolist(),
             "labels": labels[r, :prompt_tokens + new_tokens].tolist()} for r in rows]


def tokenizer() -> Any:
    """The GGUF tokenizer of the weights package (to show the text, not used for scoring)."""
    from transformers import AutoTokenizer

    gguf = tf.SPECS[MODEL].gguf_file()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


# --------------------------------------------------------------------------- the two sides


def reference_run(export: Path, items: list[dict], new_tokens: int) -> list[dict[str, Any]]:
    """The original export on onnxruntime CPU, fp32, growing cache: greedy tokens, the argmax of
    its logits on the prompt + those tokens, and its argmax and NLL on the prompt + real text."""
    from qnnpasses.llm.reference import ReferenceModel

    model, out = ReferenceModel(export), []
    for item in items:
        tokens = model.generate(item["prompt"], new_tokens)
        greedy = model.logits(item["prompt"] + tokens[:-1])
        text = model.logits(item["prompt"] + item["text"])
        out.append({"tokens": tokens, "greedy_top1": greedy.argmax(-1).tolist(), "text_top1": text.argmax(-1).tolist(),
                    "text_nll": am.token_nll(text, np.asarray(item["labels"])).tolist()})
    return out


def near_ties(export: Path, items: list[dict], refs: list[dict]) -> list[dict[str, list[float]]]:
    """Per prompt, at every position of the prompt + the original's tokens: fp32's top-1 minus
    top-2 logit (how decided the original is), its runner-up token and fp16's spacing at its top logit."""
    from qnnpasses.llm.reference import ReferenceModel

    model, out = ReferenceModel(export), []
    for item, ref in zip(items, refs):
        logits = model.logits(item["prompt"] + ref["tokens"][:-1])
        order = np.argsort(logits, axis=-1)[:, -2:]
        top2 = np.take_along_axis(logits, order, axis=-1)
        out.append({"margin": (top2[:, 1] - top2[:, 0]).tolist(), "top1": top2[:, 1].tolist(),
                    "runner_up": order[:, 0].tolist(),
                    "fp16_spacing": np.spacing(np.abs(top2[:, 1]).astype(np.float16)).astype(float).tolist()})
    return out


def divergences(run: dict[str, Any], items: list[dict], refs: list[dict], ties: list[dict]) -> None:
    """Add, per prompt of a greedy run, the generated positions where the pair's argmax is not the
    original's token, with fp32's top-2 margin there."""
    for row, item, ref, tie in zip(run["prompts"], items, refs, ties):
        base = len(item["prompt"]) - 1
        row["differs_at"] = [{"token": j, "pair": int(a), "original": int(b), "fp32_margin": round(tie["margin"][base + j], 4),
                              "fp32_top1": round(tie["top1"][base + j], 2), "fp16_spacing": tie["fp16_spacing"][base + j]}
                             for j, (a, b) in enumerate(zip(row["pair_tokens"], ref["tokens"])) if a != b]
    margins = [d["fp32_margin"] for row in run["prompts"] for d in row["differs_at"]]
    run["differing_generated_positions"] = len(margins)
    run["max_fp32_margin_where_differing"] = max(margins) if margins else None


def leading_from_teacher_forcing(argmax: np.ndarray, prompt_len: int, tokens: list[int]) -> int:
    """Identical leading tokens of the pair's greedy generation, from its teacher-forced argmax on
    the prompt + the original's tokens: up to the first difference both feed the same tokens
    through the same graph calls (prompt in prefill chunks, then one decode per token), so the
    pair generates the original's token j exactly when its argmax there is that token."""
    count = 0
    for j, token in enumerate(tokens):
        if int(argmax[prompt_len - 1 + j]) != token:
            break
        count += 1
    return count


class TorchModel:
    """The Hugging Face model in torch ``dtype`` on the CPU, stepped through the module both
    exports were traced from (:func:`trained_fixtures.kv_wrapper`): greedy with a growing cache."""

    def __init__(self, dtype: str):
        import torch

        model, _ = tf.load_torch(tf.SPECS[MODEL])
        self.torch, self.step = torch, tf.kv_wrapper(model.to(getattr(torch, dtype)))
        cfg = model.config
        shape = (1, cfg.num_key_value_heads, 0, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.empty = tuple(torch.zeros(shape, dtype=model.dtype) for _ in range(2 * cfg.num_hidden_layers))

    def _feed(self, ids: list[int], past: tuple) -> tuple[np.ndarray, tuple]:
        torch, start = self.torch, past[0].shape[2]
        with torch.no_grad():
            out = self.step(torch.tensor([ids]), torch.ones(1, start + len(ids), dtype=torch.int64),
                            torch.arange(start, start + len(ids))[None], past)
        return out[0][0].float().numpy(), tuple(out[1:])

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        logits, past = self._feed(list(prompt_ids), self.empty)
        tokens = [int(logits[-1].argmax())]
        while len(tokens) < max_new_tokens:
            logits, past = self._feed(tokens[-1:], past)
            tokens.append(int(logits[-1].argmax()))
        return tokens

    def logits(self, ids: list[int]) -> np.ndarray:
        return self._feed(list(ids), self.empty)[0]


#: The fp16 pair as ``qnnpasses llm`` builds it by default (``fp16``: logits-offset over the first
#: tokens), with ``--logits-offset all`` (every token) and with ``--logits-offset none`` (plain
#: logits): what each form of the offset buys and costs.  name -> ``build`` keyword arguments.
OFFSET, PLAIN = "fp16-offset", "fp16-plain"
FLOAT = {"fp16": {}, OFFSET: {"offset_candidates": 0}, PLAIN: {"logits_offset": False}}
#: Off-HTP runs of the same prompts that bound what fp16 can do (:func:`ceiling_model`).
CEILINGS = {"fp16-weights": "original export, weights rounded to fp16, computing in fp32 (onnxruntime CPU)",
            "torch-fp16": "Hugging Face model in torch float16 (CPU)",
            "torch-bf16": "Hugging Face model in torch bfloat16 (CPU)"}


def ceiling_model(name: str, export: Path, work: Path) -> Any:
    """A model with ``generate`` and ``logits`` as :class:`ReferenceModel` has, for ``CEILINGS[name]``."""
    from qnnpasses.llm.reference import ReferenceModel

    if name.startswith("torch-"):
        return TorchModel({"fp16": "float16", "bf16": "bfloat16"}[name[6:]])
    import tempfile

    import onnx

    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work) as tmp:  # the session holds the weights once created
        path = Path(tmp) / f"{export.stem}_fp16_weights.onnx"
        onnx.save_model(am.round_weights(onnx.load(str(export))), str(path), save_as_external_data=True,
                        all_tensors_to_one_file=True, location=path.name + ".data")
        return ReferenceModel(path)


def margin_shift(logits: np.ndarray, ref: dict, tie: dict) -> np.ndarray:
    """Per position: a run's logit of fp32's top-1 token minus its logit of fp32's runner-up, less
    fp32's own margin — how far the run moves what decides a near-tie (negative: towards flipping)."""
    at = np.arange(len(logits))
    return logits[at, ref["greedy_top1"]] - logits[at, tie["runner_up"]] - np.asarray(tie["margin"])


def shift_stats(shifts: list[np.ndarray]) -> dict[str, float]:
    shift = np.concatenate(shifts)
    return {"margin_shift_std": float(shift.std()), "margin_shift_max": float(np.abs(shift).max())}


def ceiling_run(model: Any, items: list[dict], refs: list[dict], ties: list[dict]) -> dict[str, Any]:
    """``model``'s own greedy generation (identical leading tokens) and its teacher-forced argmax
    on the prompt + the original's tokens (top-1), as :func:`pair_run` measures the pair; and how
    far its logits move fp32's top-1 minus runner-up margin (what decides a near-tie)."""
    from qnnpasses.llm.reference import leading_matches

    rows, shifts = [], []
    for item, ref, tie in zip(items, refs, ties):
        tokens = model.generate(item["prompt"], len(ref["tokens"]))
        logits = model.logits(item["prompt"] + ref["tokens"][:-1])
        argmax = logits.argmax(-1)
        shifts.append(margin_shift(logits, ref, tie))
        agree, first = argmax == np.asarray(ref["greedy_top1"]), len(item["prompt"]) - 1
        rows.append({"window": item["window"], "tokens": tokens, "identical_leading": leading_matches(tokens, ref["tokens"]),
                     "agree": int(agree.sum()), "positions": int(agree.size), "generated_agree": int(agree[first:].sum()),
                     "pair_tokens": argmax[first:].tolist()})
        log.info("  window %d: %d identical leading, top-1 %d/%d", item["window"], rows[-1]["identical_leading"],
                 rows[-1]["agree"], rows[-1]["positions"])
    return {**summarize({"mode": "greedy", "prompts": rows}, refs), **shift_stats(shifts)}


def pair_run(folder: Path, items: list[dict], refs: list[dict], mode: str, on: str = "htp",
             ties: list[dict] | None = None) -> dict[str, Any]:
    """The pair on the HTP (``on="cpu"``: the same graphs on onnxruntime CPU, a proxy for a
    quantized pair that takes minutes instead of the simulator's tens), one teacher-forced pass per prompt.

    ``mode`` "greedy": the prompt + the original's greedy tokens (identical leading tokens,
    teacher-forced top-1, with ``ties`` the shift of fp32's top-2 margin; continuation through the
    decode graph); "text": the prompt + the real continuation fed in prefill chunks of M (top-1
    agreement with fp32 and perplexity)."""
    from qnnpasses.llm.runner import Runner

    start = time.perf_counter()
    runner = Runner(folder, on=on)
    runner.open()
    result: dict[str, Any] = {"mode": mode, "on": on, "load_seconds": round(time.perf_counter() - start, 2), "prompts": []}
    shifts = []
    for index, (item, ref) in enumerate(zip(items, refs)):
        before = {k: list(v) for k, v in runner.timings.items()}
        fed = ref["tokens"][:-1] if mode == "greedy" else item["text"]
        if mode == "greedy":
            logits = runner.score(item["prompt"], fed)
        else:  # all in prefill chunks of M (the same causal logits, far fewer calls on the simulated HTP)
            runner.reset()
            logits = runner.feed(runner.check_prompt(list(item["prompt"]) + list(fed)))[0]
        argmax = logits.argmax(-1)
        want = np.asarray(ref["greedy_top1"] if mode == "greedy" else ref["text_top1"])
        row: dict[str, Any] = {"window": item["window"], "agree": int((argmax == want).sum()), "positions": int(want.size),
                               "nonfinite": int((~np.isfinite(logits)).sum())}
        calls = {k: (runner.timings[k][0] - before[k][0], runner.timings[k][1] - before[k][1]) for k in before}
        row["prefill_seconds"] = calls["prefill"][1] / max(calls["prefill"][0], 1)
        row["decode_seconds_per_token"] = calls["decode"][1] / max(calls["decode"][0], 1)
        if mode == "greedy":
            row["identical_leading"] = leading_from_teacher_forcing(argmax, len(item["prompt"]), ref["tokens"])
            row["generated_agree"] = int((argmax == want)[len(item["prompt"]) - 1:].sum())
            row["pair_tokens"] = argmax[len(item["prompt"]) - 1:].tolist()
            if ties:
                shifts.append(margin_shift(logits, ref, ties[index]))
        else:
            row["nll"] = am.token_nll(logits, np.asarray(item["labels"])).tolist()
        result["prompts"].append(row)
        log.info("  window %d: %s", item["window"], {k: v for k, v in row.items() if k not in ("nll", "pair_tokens")})
    return {**summarize(result, refs), **(shift_stats(shifts) if shifts else {})}


def summarize(result: dict[str, Any], refs: list[dict]) -> dict[str, Any]:
    rows = result["prompts"]
    total = sum(r["positions"] for r in rows)
    result.update(top1=sum(r["agree"] for r in rows) / total, positions=total)
    if "prefill_seconds" in rows[0]:
        result.update(prefill_seconds_mean=float(np.mean([r["prefill_seconds"] for r in rows])),
                      decode_seconds_per_token_mean=float(np.mean([r["decode_seconds_per_token"] for r in rows])))
    if result["mode"] == "greedy":
        result.update(identical_leading=[r["identical_leading"] for r in rows],
                      identical_leading_mean=float(np.mean([r["identical_leading"] for r in rows])),
                      top1_generated=sum(r["generated_agree"] for r in rows) / sum(len(ref["tokens"]) for ref in refs))
    else:
        result["perplexity"] = am.perplexity(np.concatenate([r["nll"] for r in rows]))
        result["reference_perplexity"] = am.perplexity(np.concatenate([ref["text_nll"] for ref in refs[:len(rows)]]))
        result["perplexity_ratio"] = result["perplexity"] / result["reference_perplexity"]
    return result


# --------------------------------------------------------------------------- building


def build_pair(export: Path, out: Path, precision: str, context: int, prefill: int, reuse: bool,
               compile: bool = True) -> dict[str, Any]:
    """``qnnpasses llm`` (or the folder of an earlier run with ``reuse``): manifest + report.

    An earlier quantized pair is reused only when it was made by the current quantization
    recipe (:data:`qnnpasses.llm.quantize.RECIPE`), an fp16 pair only when its graphs end with
    the current :func:`qnnpasses.llm.convert.fp16_passes`, and, when ``compile``, either only
    when it is compiled."""
    import onnx

    import qnnpasses.passes  # noqa: F401 - registers the passes

    from qnnpasses.llm.convert import build, fp16_passes
    from qnnpasses.llm.manifest import load_manifest
    from qnnpasses.llm.quantize import RECIPE

    manifest_path = out / "llm.json"
    seconds = None
    from qnnpasses.llm.manifest import default_offset_candidates

    form = FLOAT.get(precision, {})  # an fp16 pair's form of the logits (--logits-offset)
    precision = "fp16" if precision in FLOAT else precision
    fresh = reuse and manifest_path.exists()
    if fresh:
        old = load_manifest(out)
        fresh = (old["context"], old["prefill"], old["precision"], old["source"]) == (context, prefill, precision, export.name)
        report = json.loads((out / "report.json").read_text())
        if precision != "fp16":
            fresh = fresh and (report.get("quantization") or {}).get("recipe") == RECIPE
        else:
            first = onnx.load(str(out / old["graphs"]["prefill"]["parts"][0]["onnx"]), load_external_data=False)
            spec = {p.key: p.value for p in first.metadata_props}.get("qnnpasses.passmanager.spec", "")
            candidates = form.get("offset_candidates", default_offset_candidates(old["vocab"]))
            fresh = fresh and spec.endswith("," + fp16_passes(old["source_roles"]["logits"], form.get("logits_offset", True),
                                                              offset_candidates=candidates).to_text())
        if compile:
            fresh = fresh and all(p.get("compiled") for g in old["graphs"].values() for p in g["parts"])
    if not fresh:
        start = time.monotonic()
        calib = tf.DEFAULT_CACHE / f"{MODEL}.calib.npz" if precision != "fp16" else None
        build(export, out, context=context, prefill=prefill, precision=precision, calib=calib, compile=compile,
              **form)
        seconds = round(time.monotonic() - start, 1)
    report = json.loads((out / "report.json").read_text())
    return {"manifest": load_manifest(out), "report": report, "build_seconds": seconds or report.get("seconds")}


def graph_rows(built: dict[str, Any]) -> dict[str, Any]:
    """Placement, composed QNN ops and KV bytes per graph, from the build's report."""
    facts = built["report"].get("htp") or {}
    rows = {}
    for name in ("prefill", "decode"):
        entry = facts.get(name)
        if not entry:
            continue
        parts = entry["parts"]
        rows[name] = {"tokens": entry["tokens"], "past": entry["past"], "parts": len(parts),
                      "nodes": sum(p["nodes"] for p in parts),
                      "qnn_partitions": sum(p.get("qnn_partitions") or 0 for p in parts),
                      "cpu_nodes": sum(p.get("cpu_nodes") or 0 for p in parts),
                      "placement_ok": all(p.get("ok") for p in parts), "qnn_ops": entry.get("qnn_ops"),
                      "kv_cache_bytes": entry["kv_cache_bytes"],
                      "analyze_kv_bytes": (entry.get("analyze") or {}).get("bytes_fp32")}
    m = built["manifest"]
    rows["expected_kv_cache_bytes"] = facts.get("expected_kv_cache_bytes")
    rows["kv_formula"] = {k: m[k] for k in ("layers", "kv_heads", "head_dim", "context", "kv_dtype")}
    return rows


# --------------------------------------------------------------------------- report


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _name(exporter: str) -> str:
    return EXPORTER_NAMES.get(exporter, exporter)


def _accuracy_row(name: str, precision: str, mode: str, r: dict[str, Any]) -> str:
    fed = "prompt + original's greedy tokens" if mode == "greedy" else "prompt + real text"
    if "error" in r:
        return f"| {_name(name)} | {precision} | {fed} | failed: {r['error']} | | |"
    lead, top1, differ = _greedy_cells(r) if mode == "greedy" else ("-", _top1(r), "-")
    ppl = (f"{r['perplexity']:.2f} ({r['reference_perplexity']:.2f}, ×{r['perplexity_ratio']:.3f})"
           if mode == "text" else "-")
    return f"| {_name(name)} | {precision} | {fed} | {lead} | {top1} | {differ} | {ppl} |"


def _top1(r: dict[str, Any]) -> str:
    return f"{_pct(r['top1'])} of {r['positions']} ({len(r['prompts'])} prompts)"


def _greedy_cells(r: dict[str, Any]) -> tuple[str, str, str]:
    """Identical leading tokens, teacher-forced top-1, fp32 margins where the argmax differs."""
    lead = f"{r['identical_leading_mean']:.2f} ({', '.join(map(str, r['identical_leading']))})"
    margins = [f"{d['fp32_margin']:.3f}" for row in r["prompts"] for d in row.get("differs_at", [])]
    shown = ", ".join(margins[:SHOWN_MARGINS]) + (f", … ({len(margins) - SHOWN_MARGINS} more)"
                                                  if len(margins) > SHOWN_MARGINS else "")
    return (lead, f"{_top1(r)} ({_pct(r['top1_generated'])} of the generated)",
            f"{len(margins)}: {shown}" if margins else "none")


def _ceiling_rows(doc: dict[str, Any]) -> list[str]:
    """The HTP fp16 pair next to the off-HTP runs of :data:`CEILINGS`, and what they show."""
    s, target = doc["settings"], TARGETS["identical_leading_mean"]
    rows = [(f"| export | run | identical leading tokens (of {s['new_tokens']}) | teacher-forced top-1 | "
             "generated tokens that differ: fp32 top-2 margin | fp32 top-2 margin moved by: σ (max) |"),
            "|---|---|---|---:|---|---|"]
    figures: dict[str, list[str]] = {"htp": [], **{name: [] for name in CEILINGS}}
    for name, res in doc["exports"].items():
        runs = {"htp": res["runs"].get("fp16:greedy"), **res.get("ceilings", {})}
        for key, r in runs.items():
            if r and "error" not in r:
                label = "fp16 pair on the HTP (this project)" if key == "htp" else CEILINGS[key]
                shift = ("- (argmax only)" if "margin_shift_std" not in r else
                         "- (logits not finite)" if not np.isfinite(r["margin_shift_std"]) else
                         f"{r['margin_shift_std']:.3f} ({r['margin_shift_max']:.3f})")
                rows.append(f"| {_name(name)} | {label} | " + " | ".join(_greedy_cells(r)) + f" | {shift} |")
                figures[key].append(f"{r['identical_leading_mean']:.2f} ({_name(name)})")
    if not any(figures[name] for name in CEILINGS):
        return []
    torch16 = [r for res in doc["exports"].values() for k, r in res.get("ceilings", {}).items() if k == "torch-fp16"]
    # a torch fp16 run whose logits overflow (Gemma) moves no margin it can be compared by
    overflowed = [r for r in torch16 if not np.isfinite(r.get("margin_shift_std", 0.0))]
    torch16 = [r for r in torch16 if r not in overflowed]
    bf16 = [r for res in doc["exports"].values() for k, r in res.get("ceilings", {}).items() if k == "torch-bf16"]
    htp = [r for res in doc["exports"].values() for r in [res["runs"].get("fp16:greedy") or {}] if r.get("prompts")]
    turned = [r["max_fp32_margin_where_differing"] for r in htp if r.get("max_fp32_margin_where_differing")]

    def shift(runs: list[dict]) -> str:
        return (f"σ ≤ {max(r['margin_shift_std'] for r in runs):.3f} (at most "
                f"{max(r['margin_shift_max'] for r in runs):.3f})")

    moved = ""
    if torch16 and all("margin_shift_std" in r for r in torch16):
        moved = f" The margin between fp32's top two tokens moves by {shift(torch16)} in torch fp16"
        moved += f", by {shift(htp)} on the HTP" if htp and all("margin_shift_std" in r for r in htp) else ""
        moved += (f"; the HTP pair lost the original's choice where it led by up to {max(turned):.3f}."
                  if turned else ".")
    verdict = (_overflow_verdict(bf16, htp, turned, target, s["new_tokens"]) if overflowed and not torch16
               else _ceiling_verdict(torch16, htp, turned, target, s["new_tokens"]))
    return rows + ["", (f"The same prompts and yardstick off the HTP: identical leading tokens on average with the "
                        f"weights alone rounded to fp16 {', '.join(figures['fp16-weights']) or '-'}; in torch fp16 "
                        f"{', '.join(figures['torch-fp16']) or '-'} (Hugging Face's modelling code keeps the RMSNorm "
                        "statistics and the attention softmax in fp32), in bfloat16 "
                        f"{', '.join(figures['torch-bf16']) or '-'}; the HTP fp16 pair {', '.join(figures['htp'])} — "
                        f"{verdict}.{moved} Identical leading tokens come from each run's own greedy generation with a "
                        "growing cache, top-1 and the margin's shift from one teacher-forced pass over the prompt + "
                        "the original's tokens.")]


def _fp16_ties(doc: dict[str, Any]) -> str:
    """What the fp32 margins say where an fp16 pair's greedy token differs from the original's."""
    fp16 = [r for res in doc["exports"].values() for key, r in res["runs"].items() if key == "fp16:greedy"]
    differing = [d for r in fp16 for row in r.get("prompts", []) for d in row.get("differs_at", [])]
    if not differing:
        return ""
    top = [abs(d["fp32_top1"]) for d in differing]
    gap = [d["fp16_spacing"] for d in differing]
    spacings = max(d["fp32_margin"] / d["fp16_spacing"] for d in differing)
    below = sum(d["fp32_margin"] < d["fp16_spacing"] / 2 for d in differing)
    shifted = [res.get("builds", {}).get("fp16", {}).get("logits_offset") for res in doc["exports"].values()
               if "fp16:greedy" in res["runs"]]
    text = ("Where the fp16 pair's greedy token differs from the original's, the table gives the original's own "
            f"fp32 margin between its top two logits there. Its top logit is {min(top):.1f}–{max(top):.1f} at those "
            f"positions, where consecutive fp16 values are {min(gap):.4f}–{max(gap):.4f} apart: every such margin "
            f"is within {spacings:.1f} of those spacings")
    if shifted and all(shifted):
        stds = [r.get("margin_shift_std") for r in fp16]
        sigma = max(stds) if None not in stds else None
        counts = [res.get("builds", {}).get("fp16", {}).get("offset_candidates") for res in doc["exports"].values()
                  if "fp16:greedy" in res["runs"]]
        among = ("the maximum of their first tokens' logits (`logits-offset`), which is the row's maximum wherever "
                 "the top token is among them" if any(counts) else "their row's maximum (`logits-offset`)")
        text += (f". The pair's logits come out relative to {among}, where fp16 "
                 f"resolves the runner-up of such a margin to {max(float(np.spacing(np.float16(d['fp32_margin']))) for d in differing):.1g} "
                 "or finer: what flips it is the fp16 error the activations accumulate before the lm_head")
        if sigma is not None:
            text += (f", which moves fp32's top-2 margin by σ {sigma:.3f}: the largest margin lost is "
                     f"{max(d['fp32_margin'] for d in differing) / sigma:.1f}σ")
    elif below:
        text += (f", and {below} of {len(differing)} below half of one: there the two logits can round to the same "
                 "fp16 value, so no computation that ends in fp16 logits can be relied on to order them")
    text += (". After such a near-tie the two continuations differ, and every later token counts as not identical.")
    located = all(sum(row["positions"] - row["agree"] for row in r["prompts"]) == len(
        [d for row in r["prompts"] for d in row.get("differs_at", [])]) for r in fp16)
    if located:
        text += (f" The largest of these margins is {max(d['fp32_margin'] for d in differing):.3f}: at every "
                 "position where the original's top choice leads by more, the fp16 pair's argmax is the same.")
    return text


def _offset_note(doc: dict[str, Any]) -> str:
    """What each form of the logits buys (the fp16 pair built plain, with the default offset over the
    first tokens, with the offset over every token, on the same prompts) and what it costs (device
    bytes and bytes read per decode step, from each build's footprint)."""
    from qnnpasses.backends.targets import resolve

    notes = []
    for name, res in doc["exports"].items():
        forms = []
        for precision in (PLAIN, "fp16", OFFSET):
            run = res["runs"].get(f"{precision}:greedy")
            device = (res.get("builds", {}).get(precision) or {}).get("device") or {}
            if run and "error" not in run and device.get("device_bytes"):
                forms.append((_label(res, precision), run, device))
        if len(forms) < 2:
            continue
        product = resolve(forms[0][2]["target"]).product
        notes.append(f"{_name(name)}: " + "; ".join(
            f"{label}: {run['identical_leading_mean']:.2f} identical leading tokens, top-1 {_pct(run['top1'])}"
            + (f" (fp32's top-2 margin moved by σ {run['margin_shift_std']:.3f})" if "margin_shift_std" in run else "")
            + f", {device['device_bytes'] / 2**20:,.0f} MiB on the device, "
            f"{device['decode_step_read_bytes'] / 2**20:,.0f} MiB read per decode step (a memory-bandwidth ceiling of "
            f"{device['decode_tokens_per_second_ceiling']} tokens/s on the {product})" for label, run, device in forms))
    return ("The logits' forms, what each buys and what it costs (the fp16 pair built with each, on the same "
            "prompts). " + ". ".join(notes) + ".") if notes else ""


def _overflow_verdict(bf16: list[dict], htp: list[dict], turned: list[float], target: int, new_tokens: int) -> str:
    """What the off-HTP runs say when torch fp16 overflows: no fp16 run off the HTP to hold the
    pair against, bfloat16 (fp32's range, 8 bits of mantissa) as the nearest; where the pair
    falls short, how decided fp32 was at the tokens it lost, in units of its own margin shift."""
    text = ("torch fp16 overflows on this model (its logits are not finite on every prompt: Hugging Face's fp16 "
            "path lets the activations leave fp16's range), so no fp16 run off the HTP bounds the pair; bfloat16 "
            "reaches " + ", ".join(f"{r['identical_leading_mean']:.2f}" for r in bf16))
    if htp and min(r["identical_leading_mean"] for r in htp) >= target:
        return text + f", and the HTP pair reaches ≥ {target} of {new_tokens} on these prompts"
    sigma = [r["margin_shift_std"] for r in htp if "margin_shift_std" in r]
    if turned and sigma:
        text += (f"; the HTP pair falls short of {target} of {new_tokens} on these prompts only where fp32 led by at "
                 f"most {max(turned):.3f}, {max(turned) / max(sigma):.1f}σ of the pair's own margin shift: near-ties "
                 "that fp16 rounding may flip either way")
    return text


def _ceiling_verdict(torch16: list[dict], htp: list[dict], turned: list[float], target: int, new_tokens: int) -> str:
    """What the off-HTP runs say about the pair's identical leading tokens.

    The HTP pair at or above the target: it says so, and how its margin shift compares with
    torch fp16's.  Otherwise, torch fp16 below the target: fp16 as torch does it falls short too.
    At or above it, the HTP pair has headroom unless it already moves fp32's top-2 margin no more than torch fp16
    does (σ within 25%) and each token it generates differently is a near-tie, where fp32's lead
    was at most 3σ of torch fp16's own error: which near-ties flip is then down to where the
    roundings fall rather than to a less precise computation.
    """
    reached = [r["identical_leading_mean"] for r in torch16]
    stds = {name: max(r["margin_shift_std"] for r in runs) for name, runs in (("torch", torch16), ("htp", htp))
            if runs and all("margin_shift_std" in r for r in runs)}
    if htp and min(r["identical_leading_mean"] for r in htp) >= target:
        text = f"the HTP pair reaches ≥ {target} of {new_tokens} on these prompts too"
        if len(stds) == 2:
            text += (f", moving fp32's top-2 margin {'less than' if stds['htp'] < stds['torch'] else 'as much as'} "
                     f"torch fp16 does (σ {stds['htp']:.3f} against {stds['torch']:.3f})")
        return text
    if not reached or min(reached) < target:
        return f"so on these prompts fp16 arithmetic as torch does it stays below {target} of {new_tokens} too"
    if len(stds) == 2 and stds["htp"] <= 1.25 * stds["torch"] and turned and max(turned) <= 3 * stds["torch"]:
        return (f"torch fp16 reaches ≥ {target} of {new_tokens} on these prompts, and the HTP pair moves fp32's top-2 "
                f"margin about as much as torch fp16 does (σ {stds['htp']:.3f} against {stds['torch']:.3f}): every "
                f"token it generates differently led in fp32 by at most {max(turned):.3f}, "
                f"{max(turned) / stds['torch']:.1f}σ of torch fp16's own error, so its shortfall is near-ties "
                "that fp16 rounding may flip either way, not a computation less precise than torch's")
    return (f"so fp16 weights and activations (with those two reductions in fp32) reach ≥ {target} of {new_tokens} "
            "on these prompts: the pair's shortfall is not a limit of fp16, and the HTP result has headroom")


def _label(res: dict[str, Any], precision: str) -> str:
    """The precision as the tables name it; a quantized pair built by an earlier quantization
    recipe than the one ``qnnpasses llm`` builds now says so (its figures predate the current one)."""
    from qnnpasses.llm.quantize import RECIPE

    build = res.get("builds", {}).get(precision) or {}
    recipe = (build.get("quantization") or {}).get("recipe")
    label = _float_form(build) if precision in FLOAT else precision
    return label if recipe in (None, RECIPE) else f"{label} (recipe {recipe}; `qnnpasses llm` now builds recipe {RECIPE})"


def _float_form(build: dict[str, Any]) -> str:
    """An fp16 pair's label, from what its build did to the logits (a build that records no candidates
    offset every token: the only form there was)."""
    if not build.get("logits_offset"):
        return "fp16, plain logits"
    count = build.get("offset_candidates")
    return f"fp16, logits-offset (first {count:,} tokens)" if count else "fp16, logits-offset (every token)"


def _accuracy_rows(doc: dict[str, Any]) -> list[str]:
    s = doc["settings"]
    rows = [(f"| export | precision | fed through the pair | identical leading tokens (of {s['new_tokens']}) | "
            "teacher-forced top-1 | generated tokens that differ: fp32 top-2 margin | perplexity (fp32) |"),
            "|---|---|---|---|---:|---|---|"]
    for name, res in doc["exports"].items():
        for key, r in res["runs"].items():
            precision, mode = key.split(":")
            rows.append(_accuracy_row(name, _label(res, precision), mode, r))
        for key, r in res.get("cpu_runs", {}).items():
            precision, mode = key.split(":")
            rows.append(_accuracy_row(name, f"{_label(res, precision)}, CPU proxy", mode, r))
        for precision in res.get("not_run", []):
            rows.append(f"| {_name(name)} | {precision} | not measured in this run | | | | |")
    if any(res.get("cpu_runs") for res in doc["exports"].values()):
        rows += ["", ("CPU proxy: the same quantized (QDQ) graphs run by the same runner on onnxruntime's CPU "
                      "provider instead of the simulated HTP (minutes instead of tens of minutes; onnxruntime "
                      "computes each quantized op in float between Q/DQ pairs, the HTP in integer arithmetic, so "
                      "the two differ by the HTP's own rounding).")]
    return rows


def _graph_rows(doc: dict[str, Any]) -> list[str]:
    rows = [("| export | graph | tokens | past slots | nodes | QNN partitions | CPU nodes | composed QNN ops | "
            "KV-cache bytes (`analyze`) |"), "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, res in doc["exports"].items():
        for g in ("prefill", "decode"):
            row = res.get("graphs", {}).get(g)
            if row:
                rows.append(f"| {_name(name)} | {g} | {row['tokens']} | {row['past']} | {row['nodes']} | "
                            f"{row['qnn_partitions']} | {row['cpu_nodes']} | {row['qnn_ops']} | "
                            f"{row['kv_cache_bytes']:,} ({row['analyze_kv_bytes'] or 0:,}) |")
    first = next((r["graphs"] for r in doc["exports"].values() if r.get("graphs")), {})
    if first.get("expected_kv_cache_bytes"):
        f = first["kv_formula"]
        rows += ["", (f"Expected: 2·L·kv_heads·head_dim·N·bytes = 2·{f['layers']}·{f['kv_heads']}·{f['head_dim']}·"
                      f"{f['context']}·{f['kv_dtype']} = {first['expected_kv_cache_bytes']:,} bytes (a graph's past "
                      "inputs plus its new K/V outputs: the whole cache, no copy of it).")]
    return rows


def _speed_rows(doc: dict[str, Any]) -> list[str]:
    s = doc["settings"]
    rows = [("| export | precision | build (`qnnpasses llm`) | weight sharing | load both graphs | "
            f"prefill ({s['prompt_tokens']} tokens) | decode per token |"), "|---|---|---:|---|---:|---:|---:|"]
    for name, res in doc["exports"].items():
        for key, r in res["runs"].items():
            precision = key.split(":")[0]
            if "error" in r:
                continue
            b = res["builds"][precision]
            rows.append(f"| {_name(name)} | {_label(res, precision)} | {b['build_seconds']} s | "
                        f"{b['weight_sharing']} | "
                        f"{r['load_seconds']} s | {r['prefill_seconds_mean']:.2f} s | "
                        + (f"{r['decode_seconds_per_token_mean']:.2f} s |" if key.endswith(":greedy") else
                           "- (prefill calls only) |"))
    return rows


def _htp_target() -> tuple[str, str]:
    from qnnpasses.backends.targets import active

    return str(active().soc_model), str(active().htp_arch)


def _quant_note(doc: dict[str, Any]) -> str:
    """How each quantized pair was calibrated and built (from its build report)."""
    notes = []
    for name, res in doc["exports"].items():
        for precision, b in res.get("builds", {}).items():
            q = b.get("quantization")
            if q:
                notes.append(f"{_name(name)} {precision}: calibrated (MinMax, one shared calibration: "
                             f"{q['shared_tensors']} tensors share one encoding) on {q['samples']['prefill']} prefill "
                             f"and {q['samples']['decode']} decode calls of the float pair over "
                             f"{q.get('sequences', '?')} windows of English text disjoint from the prompts', built in "
                             f"{b['build_seconds']:.0f} s; outlier rewrites"
                             + (" (applied to both float graphs alike before calibration, each pass checked in "
                                "float64 on the pass manager's cases and in fp32 on real calls: "
                                "`qnnpasses/llm/outliers.py`)" if q.get("recipe", 0) >= 2 else "") + ": "
                             + ", ".join(f"{k} {v}" + (f" ({q['outlier_reasons'][k]})" if k in q.get("outlier_reasons", {})
                                                          else "") for k, v in q.get("outlier_rewrites", {}).items())
                             + (" (rolled back: the pass manager's CPU check found the outputs beyond the pass's "
                                "declared tolerance, so the graph kept its norm weights)"
                                if "rolled-back" in q.get("outlier_rewrites", {}).values() else "")
                             + ("; Q/K/V projections kept 2-D (per-channel int8 scales)" if q.get("recipe", 0) >= 3
                                else "")
                             + (f"; weights rounded by {q['weight_rounding'].upper()}"
                                if q.get("weight_rounding", "nearest") != "nearest" else "")
                             + (("; lm_head weights at 16 bit" if q["lm_head"]["ok"] else
                                 "; lm_head weights at 8 bit (its 16-bit weights failed the build's dequantization "
                                 "check, so the pair was requantized with an 8-bit lm_head)") if q.get("lm_head") else "")
                             + (f"; the decode graph's {q['own_activation_ranges']:,} internal activations calibrated "
                                "on its own calls (only the weights and the KV cache passed between the graphs "
                                "share encodings)" if q.get("own_activation_ranges") else ""))
    return (" " + "; ".join(notes) + ".") if notes else ""


def render(doc: dict[str, Any]) -> str:
    s, m = doc["settings"], doc["model"]
    spec = tf.SPECS[MODEL]
    intro = (f"Trained {spec.title} ({m['layers']} layers, {m['heads']} query / {m['kv_heads']} KV heads, vocab "
             f"{m['vocab']:,}; `{m['distribution']}` {m['version']}), exported with a dynamic KV cache by both exporters "
             f"(`python tools/trained_fixtures.py build --only {MODEL} --exporters {','.join(doc['exports'])}`), turned into "
             f"a static pair by `qnnpasses llm EXPORT -o DIR --context {s['context']} --prefill {s['prefill']}` and run "
             "by the runner of `qnnpasses generate` on onnxruntime-qnn's HTP backend (compiled context models, CPU "
             "fallback disabled; fp16 mode, integer mode for w8a16 with the graph-boundary Q/DQ also on the HTP "
             "(`offload_graph_io_quantization=0`); soc_model %s, htp_arch v%s). " % _htp_target()
             + "; ".join(f"{_name(e)} export: {c} prompts" for e, c in s["prompts"].items())
             + f", each the first {s['prompt_tokens']} tokens of a held-out window of English text (windows spread "
             "evenly over the eval set, `tools/english_text.py`); the yardstick is the original export in fp32 on onnxruntime CPU with "
             f"a growing cache, generating {s['new_tokens']} tokens greedily as Hugging Face does.")
    method = ("Every figure comes from teacher forcing: a sequence is fed through the pair as `generate` feeds it "
              "(the prompt in prefill chunks, then one decode call per token) and the pair's argmax is compared "
              "with the original's at every position whose next token is known. Fed the original's greedy "
              "tokens, the leading positions where the pair's argmax is the original's token are exactly the "
              "tokens the pair generates identically: until the first difference both feed the same tokens "
              "through the same calls (`tests/test_llm_trained.py` also runs `generate` itself). Fed the real "
              f"text (the prompt and the text's next {s['new_tokens']} tokens), the pass gives the perplexity; "
              "that sequence is fed in prefill chunks only (the same causal logits as decode steps, "
              "far fewer calls on the simulated HTP)." + _quant_note(doc))
    targets = (f"Targets: identical leading tokens ≥ {TARGETS['identical_leading_mean']} of 32 on average and "
               f"teacher-forced top-1 ≥ {_pct(TARGETS['fp16_teacher_forced_top1'])} in fp16; teacher-forced top-1 ≥ "
               f"{_pct(TARGETS['w8a16_teacher_forced_top1'])} and perplexity within "
               f"{round(100 * (TARGETS['w8a16_perplexity_ratio'] - 1))}% of fp32 in w8a16.")
    ties = _fp16_ties(doc)
    offset = _offset_note(doc)
    ceilings = _ceiling_rows(doc)
    speed = ("Wall time on this project's 2-core x86 machine, where onnxruntime-qnn *simulates* the HTP (no phone "
             "NPU here) while other jobs shared the cores: for comparing graphs, not as device figures.")
    lines = [f"# {spec.title} as a prefill + decode pair on the HTP", "",
             (f"Written by `{('python tools/llm_eval.py ' + doc['command']).strip()}` ({doc['finished']}); every figure is in "
             f"`docs/{doc.get('out', 'llm')}.json`."), "", intro, "", "## Accuracy", "", *_accuracy_rows(doc), "", targets, "", method, "", ties,
             *(["", offset] if offset else []), "", *(["## How far fp16 gets off the HTP", "", *ceilings, ""] if ceilings else []),
             "## Graphs (fp16)", "", *_graph_rows(doc), "", "## Speed on this host", "", speed, "",
             *_speed_rows(doc)]
    sample = doc.get("sample")
    if sample:
        lines += ["", "## One prompt", "", f"Prompt: “{sample['prompt']}”", "",
                  f"- fp32 original on the CPU: “{sample['reference']}”",
                  (f"- fp16 pair on the HTP ({sample['export']}, {sample['identical']} identical leading tokens): "
                  f"“{sample['htp']}”")]
    lines += ["", "## Rerun", "", "```sh", f"{spec.pip_install()} && pip install {' '.join(spec.needs)}",
              f"python tools/trained_fixtures.py build --only {MODEL} --exporters {','.join(doc['exports'])}",
              f"python tools/llm_eval.py {doc['command']}".strip(), "```", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


RUNS = {"fp16": ("greedy",), OFFSET: ("greedy",), PLAIN: ("greedy",), "w8a16": ("text",), "w4a16": ("text",)}


def _cached(path: Path, key: dict[str, Any], reuse: bool, compute) -> Any:
    """``compute()``, stored in ``path`` with ``key``; with ``reuse`` an earlier result of the same
    key.  ``compute`` None: only an earlier result (None if there is none)."""
    if reuse and path.exists():
        stored = json.loads(path.read_text())
        if stored.get("key") == key:
            return stored["value"]
    if compute is None:
        return None
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "value": value}, default=float) + "\n")
    return value


def evaluate_export(exporter: str, args: argparse.Namespace, items: list[dict]) -> dict[str, Any]:
    record = tf.ensure_built(MODEL, exporter)
    export = tf.DEFAULT_CACHE / f"{MODEL}_{exporter}.onnx"
    key = {"fingerprint": record["fingerprint"], "windows": [i["window"] for i in items],
           "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens}
    log.info("%s: the original on onnxruntime CPU (fp32, growing cache)", exporter)
    refs = _cached(args.work / f"{exporter}_reference.json", key, args.reuse,
                   None if args.render_only else lambda: reference_run(export, items, args.new_tokens))
    if refs is None:
        return {"export": export.name, "builds": {}, "runs": {}, "reference_tokens": [],
                "not_run": args.precisions.split(",")}
    ties = _cached(args.work / f"{exporter}_ties.json", {**key, "ties": 3}, args.reuse,
                   lambda: near_ties(export, items, refs))
    res: dict[str, Any] = {"export": export.name, "export_nodes": record["exports"][exporter]["nodes"], "prompts": items,
                           "reference_tokens": [r["tokens"] for r in refs], "builds": {}, "runs": {}, "not_run": [],
                           "ceilings": {}}
    for name, label in CEILINGS.items():
        log.info("%s: %s", exporter, label)
        value = _cached(args.work / f"{exporter}_ceiling_{name}.json", {**key, "ceiling": name, "ties": 3},
                        args.reuse, None if args.render_only else lambda name=name: ceiling_run(
                            ceiling_model(name, export, args.work), items, refs, ties))
        if value is not None:
            divergences(value, items, refs, ties)
            res["ceilings"][name] = value
    for precision in args.precisions.split(","):
        out = args.work / f"{exporter}_{precision}"
        if precision not in FLOAT and args.quantized_exporters and exporter not in args.quantized_exporters.split(","):
            res["not_run"].append(precision)
            continue
        log.info("%s %s: qnnpasses llm -> %s", exporter, precision, out)
        if args.render_only and not (out / "llm.json").exists():
            res["not_run"].append(precision)
            continue
        try:
            built = build_pair(export, out, precision, args.context, args.prefill, args.reuse, compile="htp" in args.on)
        except Exception as exc:  # noqa: BLE001 - one failed build is a reported result, not the end of the run
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            log.warning("%s %s: build failed: %s", exporter, precision, error)
            res["runs"][f"{precision}:{RUNS[precision][0]}"] = {"error": error}
            continue
        res["builds"][precision] = {"build_seconds": built["build_seconds"],
                                    "weight_sharing": built["manifest"]["weight_sharing"],
                                    "logits_offset": bool(built["manifest"]["graphs"]["decode"]["roles"].get("logits_offset")),
                                    "offset_candidates": (built["report"].get("logits_offset") or {}).get("candidates"),
                                    "device": {k: (built["report"].get("device") or {}).get(k) for k in
                                               ("device_bytes", "decode_step_read_bytes", "decode_tokens_per_second_ceiling",
                                                "target")}}
        if built["report"].get("quantization"):
            q = built["report"]["quantization"]
            with np.load(tf.DEFAULT_CACHE / f"{MODEL}.calib.npz") as calib:
                sequences = int(calib["input_ids"].shape[0])
            passes = q.get("outlier_rewrites") or [p for p in q["graphs"]["prefill"]["prep_passes"]
                                                   if p["pass"] in ("fold-norm-weights", "rotate-residual", "smooth-mlp")]
            outliers = {p["pass"]: p["status"] for p in passes}
            # why a rewrite did not apply: its first reason, as the pass gave it
            refused = {p["pass"]: p["reason"].split("; ")[0] for p in passes if p["status"] != "changed" and p.get("reason")}
            res["builds"][precision]["quantization"] = {**{k: q[k] for k in ("samples", "shared_tensors", "ties")},
                                                        "sequences": sequences, "outlier_rewrites": outliers,
                                                        "outlier_reasons": refused,
                                                        "recipe": q.get("recipe", 1), "lm_head": q.get("lm_head"),
                                                        "weight_rounding": q["graphs"]["prefill"]["policy"].get(
                                                            "weight_rounding", "nearest"),
                                                        "own_activation_ranges": sum(
                                                            (q.get("own_activation_ranges") or {}).values())}
        if precision == "fp16":
            res["graphs"] = graph_rows(built)
        run_items, run_refs, run_ties = items, refs, ties
        if precision not in FLOAT and args.quantized_prompts:
            run_items = prompts(args.quantized_prompts, args.prompt_tokens, args.new_tokens)
            windows = [i["window"] for i in items]
            if any(i["window"] not in windows for i in run_items):
                raise SystemExit("--quantized-prompts must pick a subset of the fp16 prompts' windows")
            run_refs = [refs[windows.index(i["window"])] for i in run_items]
            run_ties = [ties[windows.index(i["window"])] for i in run_items]
        for mode in (RUNS[precision] + (("text",) if precision == "fp16" and args.fp16_text else ())
                     if "htp" in args.on else ()):
            log.info("%s %s: teacher-forced on the HTP (%s)", exporter, precision, mode)
            run_key = {**key, "windows": [i["window"] for i in run_items], "context": args.context,
                       "prefill": args.prefill, "mode": mode, "built": built["report"].get("seconds"),
                       **({"margins": 1} if mode == "greedy" else {})}
            compute = None if args.render_only else (
                lambda out=out, mode=mode, it=run_items, rf=run_refs, rt=run_ties: pair_run(out, it, rf, mode, ties=rt))
            value = _cached(out / f"eval_{mode}.json", run_key, args.reuse, compute)
            if value is None:
                res["not_run"].append(precision)
                continue
            if mode == "greedy":
                divergences(value, run_items, run_refs, ties)
            value["windows"] = [i["window"] for i in run_items]
            res["runs"][f"{precision}:{mode}"] = value
        for mode in (("text", "greedy") if "cpu" in args.on and precision not in FLOAT else ()):
            # the CPU proxy: the same QDQ graphs on onnxruntime CPU (greedy: the continuation through decode)
            log.info("%s %s: teacher-forced on onnxruntime CPU (%s)", exporter, precision, mode)
            run_key = {**key, "windows": [i["window"] for i in run_items], "context": args.context,
                       "prefill": args.prefill, "mode": mode, "on": "cpu", "built": built["report"].get("seconds"),
                       **({"margins": 1} if mode == "greedy" else {})}
            compute = None if args.render_only else (
                lambda out=out, mode=mode, it=run_items, rf=run_refs, rt=run_ties: pair_run(out, it, rf, mode, "cpu", rt))
            value = _cached(out / f"eval_{mode}_cpu.json", run_key, args.reuse, compute)
            if value is not None:
                if mode == "greedy":
                    divergences(value, run_items, run_refs, ties)
                value["windows"] = [i["window"] for i in run_items]
                res.setdefault("cpu_runs", {})[f"{precision}:{mode}"] = value
    return res


def main(argv: list[str] | None = None) -> int:
    global MODEL
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL, choices=[n for n, s in tf.SPECS.items() if s.task == "causal-lm"])
    parser.add_argument("--exporters", default="kv_ts,kv_dynamo")
    parser.add_argument("--precisions", default="fp16,w8a16")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--prefill", type=int, default=16)
    parser.add_argument("--prompts", default="4", help="prompts per export: N, or per export as kv_ts:4,kv_dynamo:2")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--quantized-prompts", type=int,
                        help="fewer prompts for w8a16/w4a16 (a subset of the fp16 prompts' windows)")
    parser.add_argument("--quantized-exporters",
                        help="build and measure w8a16/w4a16 only for these exporters (comma-separated; default all)")
    parser.add_argument("--on", default="htp",
                        help="htp (the simulated HTP), cpu (quantized pairs' QDQ graphs on onnxruntime CPU: a proxy, "
                             "minutes instead of the simulator's tens; builds without compiling) or htp,cpu")
    parser.add_argument("--fp16-text", action="store_true", help="also score the real text in fp16 (perplexity)")
    parser.add_argument("--work", type=Path,
                        help="where the pairs and partial results go (default: next to the trained-fixture cache)")
    parser.add_argument("--reuse", action="store_true",
                        help="reuse pairs and results of earlier runs with the same settings (resume)")
    parser.add_argument("--render-only", action="store_true",
                        help="write the docs from the results stored by earlier runs only (implies --reuse)")
    parser.add_argument("--out", type=Path, help="writes OUT.md and OUT.json (default docs/llm, for a model other "
                                                 "than SmolLM2 docs/llm_MODEL)")
    parser.add_argument("--doc-only", action="store_true", help="rewrite OUT.md from OUT.json (no run)")
    args = parser.parse_args(argv)
    MODEL = args.model
    suffix = "" if MODEL == "smollm2_135m" else f"_{MODEL}"
    args.out = args.out or REPO / "docs" / f"llm{suffix}"
    if args.doc_only:
        args.out.with_suffix(".md").write_text(render(json.loads(args.out.with_suffix(".json").read_text())))
        log.info("wrote %s.md", args.out)
        return 0
    args.work = args.work or tf.DEFAULT_CACHE.parent / f"llm_eval{suffix}"
    args.reuse = args.reuse or args.render_only
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    reason = tf.SPECS[MODEL].missing()
    if reason:
        raise SystemExit(f"cannot evaluate: {reason}")
    args.on = args.on.split(",")
    if not args.on or set(args.on) - {"htp", "cpu"}:
        parser.error("--on takes htp, cpu or htp,cpu")
    unknown = set(args.precisions.split(",")) - set(RUNS)
    if unknown:
        parser.error(f"unknown precisions {sorted(unknown)}")
    exporters = args.exporters.split(",")
    counts = prompt_counts(args.prompts, exporters)
    record = tf.read_manifest(tf.DEFAULT_CACHE)["models"].get(MODEL, {})
    started = time.monotonic()
    exports = {e: evaluate_export(e, args, prompts(counts[e], args.prompt_tokens, args.new_tokens)) for e in exporters}
    shown = [a for a in (argv if argv is not None else sys.argv[1:]) if a not in ("--reuse", "--render-only")]
    drop = {i for i, a in enumerate(shown) if a in ("--work", "--out")}
    command = " ".join(a for i, a in enumerate(shown) if i not in drop and i - 1 not in drop)
    doc: dict[str, Any] = {
        "command": command.strip(), "out": args.out.name,
        "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "seconds": round(time.monotonic() - started, 1),
        # rendered from the results earlier runs stored (their pairs' build seconds from their reports)
        "render_only": bool(args.render_only),
        "host": {"machine": platform.machine(), "python": platform.python_version()},
        "settings": {**{k: getattr(args, k) for k in ("context", "prefill", "prompt_tokens", "new_tokens")},
                     "prompts": counts},
        "model": {k: record.get(k) for k in ("distribution", "version", "layers", "heads", "kv_heads", "vocab", "params")},
        "targets": TARGETS, "prompts": prompts(max(counts.values()), args.prompt_tokens, args.new_tokens),
        "exports": exports,
    }
    doc["sample"] = sample_text(exports)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=float) + "\n")
    args.out.with_suffix(".md").write_text(render(doc))
    log.info("wrote %s.md/.json in %.0f s", args.out, doc["seconds"])
    return 0


def sample_text(exports: dict[str, Any]) -> dict[str, Any] | None:
    """The first prompt, the original's continuation and the pair's (up to its first difference
    the same tokens; after it, the pair's teacher-forced argmax)."""
    for name, res in exports.items():
        run = res["runs"].get("fp16:greedy", {})
        if run.get("prompts"):
            tok, row = tokenizer(), run["prompts"][0]
            same, ref = row["identical_leading"], res["reference_tokens"][0]

            def text(ids: list[int], tok=tok) -> str:
                return tok.decode(ids).replace("\n", " ⏎ ")

            htp = text(ref[:same])
            if same < len(ref):
                margin = row["differs_at"][0]["fp32_margin"] if row.get("differs_at") else None
                htp += (f" [here the pair picks “{text([row['pair_tokens'][same]])}” where fp32 picks "
                        f"“{text([ref[same]])}”" + (f", {margin:.3f} logits ahead" if margin is not None else "") + "]")
            return {"export": _name(name), "identical": same, "prompt": text(res["prompts"][0]["prompt"]),
                    "reference": text(ref), "htp": htp}
    return None


if __name__ == "__main__":
    raise SystemExit(main())
