"""Feed a static prefill/decode pair the way a runner does, and check it against the original export.

:func:`static_feed` builds one call's inputs from the manifest semantics (cache slots
0..past-1 with a valid length, padded new tokens, absolute positions).  :func:`compare_sequence`
processes a prompt in chunks of ``prefill`` tokens (the last chunk padded), then decodes
greedily, on onnxruntime CPU, with the static graphs and with the original dynamic export
(which sees the unpadded cache of exactly ``valid_len`` entries), and reports the largest
difference of the logits and of the new K/V over every call.  The cache is kept in the graphs'
own form (:mod:`qnnpasses.llm.kv_layout`: order, dtype, 8-bit encodings); the original reads
the same entries as float32, so each call is compared from the same past.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from qnnpasses.backends.cpu import cpu_session
from qnnpasses.llm.feed import call_feed, new_slots, store_new
from qnnpasses.llm.kv_layout import CacheLayout
from qnnpasses.llm.manifest import absolute_logits
from qnnpasses.llm.roles import reference_roles


def static_feed(graph: dict[str, Any], tokens: list[int], valid_len: int,
                cache: dict[str, np.ndarray], layout: CacheLayout | None = None, right: bool = False) -> dict[str, np.ndarray]:
    """Inputs of one call of a manifest graph: ``tokens`` (at most ``graph['tokens']``) after
    ``valid_len`` cached entries (:func:`qnnpasses.llm.feed.call_feed`); ``cache`` maps past-input
    names to buffers of at least ``past`` slots, ``[1, H, slots, D]`` or in ``layout``."""
    return call_feed(graph, tokens, valid_len, cache, layout, right)


class PartsRunner:
    """Run a graph's parts in order on onnxruntime CPU, each fed from everything computed so far."""

    def __init__(self, folder: str | Path, graph: dict[str, Any]):
        self.sessions = [cpu_session(Path(folder) / part["onnx"], mapped=True) for part in graph["parts"]]

    def __call__(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        env = dict(feed)
        for sess in self.sessions:
            names = [o.name for o in sess.get_outputs()]
            env.update(zip(names, sess.run(names, {i.name: env[i.name] for i in sess.get_inputs()})))
        return env


def _reference_feed(session: ort.InferenceSession, roles: dict[str, Any], tokens: list[int], valid_len: int,
                    cache: dict[str, np.ndarray], source: dict[str, Any], layout: CacheLayout) -> dict[str, np.ndarray]:
    """The original's inputs for ``tokens`` after ``valid_len`` cached entries; layer i's past comes
    from the static graph's past input of layer i (so the layer order is checked too)."""
    types = {i.name: i.type for i in session.get_inputs()}

    def int_type(name: str):
        return np.int32 if "int32" in types[name] else np.int64

    feed = {source["input_ids"]: np.asarray([tokens], int_type(source["input_ids"])),
            source["attention_mask"]: np.ones((1, valid_len + len(tokens)), int_type(source["attention_mask"]))}
    if source.get("position_ids"):
        feed[source["position_ids"]] = (valid_len + np.arange(len(tokens), dtype=int_type(source["position_ids"])))[None]
    for kind in ("key", "value"):
        for layer, (static, original) in enumerate(zip(roles[f"past_{kind}"], source[f"past_{kind}"])):
            feed[original] = layout.to_float(kind, layer, layout.take(kind, cache[static], valid_len))
    return feed


def _call(runner, reference, ref_outputs, source, graph, chunk, valid, cache, worst, layout, right) -> np.ndarray:
    """One call of a static graph and of the original; updates ``worst`` and the cache; returns the reference logits."""
    roles = graph["roles"]
    got = runner(call_feed(graph, chunk, valid, cache, layout, right))
    feed = _reference_feed(reference, roles, chunk, valid, cache, source, layout)
    ref = dict(zip(ref_outputs, reference.run(ref_outputs, feed)))
    count, new = len(chunk), new_slots(graph, len(chunk), right)
    logits = absolute_logits(got, roles)[:, new]
    worst["top1_agree"] += int(np.sum(np.argmax(logits[0], -1) == np.argmax(ref[source["logits"]][0], -1)))
    worst["positions"] += count
    worst["logits"] = max(worst["logits"], float(np.abs(logits - ref[source["logits"]]).max()))
    worst["logits_scale"] = max(worst["logits_scale"], float(np.abs(ref[source["logits"]]).max()))
    for kind in ("key", "value"):
        for layer, name in enumerate(roles[f"new_{kind}"]):
            present = ref[source[f"present_{kind}"][layer]][:, :, valid:valid + count]
            computed = layout.to_float(kind, layer, layout.take(kind, got[name], new.stop, new.start))
            worst["kv"] = max(worst["kv"], float(np.abs(computed - present).max()))
            worst["kv_scale"] = max(worst["kv_scale"], float(np.abs(present).max()))
    store_new(graph, got, count, valid, cache, layout, right)
    worst["calls"] += 1
    return ref[source["logits"]]


def compare_sequence(folder: str | Path, manifest: dict[str, Any], original: str | Path, prompt: list[int],
                     new_tokens: int) -> dict[str, Any]:
    """Max abs difference (logits, new K/V) of the static pair vs the original over a generation:
    the prompt in chunks of ``prefill`` (last one padded), then ``new_tokens - 1`` greedy decode
    steps (tokens chosen from the original's logits, so both sides see the same ids)."""
    context, size = manifest["context"], manifest["prefill"]
    if len(prompt) + new_tokens > context:
        raise ValueError(f"{len(prompt)} + {new_tokens} tokens exceed the context of {context}")
    runners = {g: PartsRunner(folder, manifest["graphs"][g]) for g in ("prefill", "decode")}
    reference = cpu_session(original, mapped=True)
    ref_outputs = [o.name for o in reference.get_outputs()]
    source = reference_roles([i.name for i in reference.get_inputs()], ref_outputs,
                             lambda: manifest["source_roles"], trust_names=not manifest["source_roles"].get("given"))
    roles = manifest["graphs"]["decode"]["roles"]
    layout = CacheLayout(manifest)
    right = manifest.get("kv_alignment", "left") == "right"
    cache = {n: layout.empty(kind, context) for kind in ("key", "value") for n in roles[f"past_{kind}"]}
    worst: dict[str, Any] = {"logits": 0.0, "kv": 0.0, "calls": 0, "top1_agree": 0, "positions": 0,
                             "logits_scale": 0.0, "kv_scale": 0.0}
    valid = 0
    for start in range(0, len(prompt), size):
        chunk = prompt[start:start + size]
        logits = _call(runners["prefill"], reference, ref_outputs, source, manifest["graphs"]["prefill"], chunk, valid,
                       cache, worst, layout, right)
        valid += len(chunk)
    tokens = [int(np.argmax(logits[0, -1]))]
    while len(tokens) < new_tokens:
        logits = _call(runners["decode"], reference, ref_outputs, source, manifest["graphs"]["decode"], tokens[-1:], valid,
                       cache, worst, layout, right)
        valid += 1
        tokens.append(int(np.argmax(logits[0, -1])))
    worst["tokens"] = tokens
    worst["reference_fed_by"] = source["fed_by"]
    worst["max_abs"] = max(worst["logits"], worst["kv"])
    worst["top1"] = worst["top1_agree"] / max(1, worst["positions"])
    return worst
