"""Feed a static prefill/decode pair the way a runner does, and check it against the original export.

:func:`static_feed` builds one call's inputs from the manifest semantics (cache slots
0..past-1 with a valid length, padded new tokens, absolute positions).  :func:`compare_sequence`
processes a prompt in chunks of ``prefill`` tokens (the last chunk padded), then decodes
greedily, on onnxruntime CPU, with the static graphs and with the original dynamic export
(which sees the unpadded cache of exactly ``valid_len`` entries), and reports the largest
difference of the logits and of the new K/V over every call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from qnnpasses.llm.manifest import absolute_logits
from qnnpasses.llm.roles import reference_roles

_NP = {"int32": np.int32, "int64": np.int64, "float32": np.float32, "float16": np.float16}


def static_feed(graph: dict[str, Any], tokens: list[int], valid_len: int,
                cache: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Inputs of one call of a manifest graph: ``tokens`` (at most ``graph['tokens']``) after
    ``valid_len`` cached entries; ``cache`` maps past-input names to ``[1, H, >=past, D]`` arrays."""
    roles, io = graph["roles"], graph["io"]
    size, past = graph["tokens"], graph["past"]
    if not 0 < len(tokens) <= size or valid_len > past:
        raise ValueError(f"{len(tokens)} tokens after {valid_len} cached do not fit tokens={size}, past={past}")
    ids = np.zeros((1, size), np.int64)
    ids[0, :len(tokens)] = tokens
    mask = np.zeros((1, past + size), np.int64)
    mask[0, :valid_len] = 1
    mask[0, past:past + len(tokens)] = 1
    feed = {roles["input_ids"]: ids, roles["attention_mask"]: mask}
    if roles.get("position_ids"):
        feed[roles["position_ids"]] = (valid_len + np.arange(size, dtype=np.int64))[None]
    for name in roles["past_key"] + roles["past_value"]:
        feed[name] = np.ascontiguousarray(cache[name][:, :, :past])
    return {k: v.astype(_NP[io[k]["dtype"]]) for k, v in feed.items() if k in io}


class PartsRunner:
    """Run a graph's parts in order on onnxruntime CPU, each fed from everything computed so far."""

    def __init__(self, folder: str | Path, graph: dict[str, Any]):
        self.sessions = [ort.InferenceSession(str(Path(folder) / part["onnx"])) for part in graph["parts"]]

    def __call__(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        env = dict(feed)
        for sess in self.sessions:
            names = [o.name for o in sess.get_outputs()]
            env.update(zip(names, sess.run(names, {i.name: env[i.name] for i in sess.get_inputs()})))
        return env


def _reference_feed(session: ort.InferenceSession, roles: dict[str, Any], tokens: list[int], valid_len: int,
                    cache: dict[str, np.ndarray], source: dict[str, Any]) -> dict[str, np.ndarray]:
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
        for static, original in zip(roles[f"past_{kind}"], source[f"past_{kind}"]):
            feed[original] = np.ascontiguousarray(cache[static][:, :, :valid_len])
    return feed


def _call(runner, reference, ref_outputs, source, graph, chunk, valid, cache, worst) -> np.ndarray:
    """One call of a static graph and of the original; updates ``worst`` and the cache; returns the reference logits."""
    roles = graph["roles"]
    got = runner(static_feed(graph, chunk, valid, cache))
    ref = dict(zip(ref_outputs, reference.run(ref_outputs, _reference_feed(reference, roles, chunk, valid, cache, source))))
    count, logits = len(chunk), absolute_logits(got, roles)
    worst["top1_agree"] += int(np.sum(np.argmax(logits[0, :count], -1) == np.argmax(ref[source["logits"]][0], -1)))
    worst["positions"] += count
    worst["logits"] = max(worst["logits"], float(np.abs(logits[:, :count] - ref[source["logits"]]).max()))
    worst["logits_scale"] = max(worst["logits_scale"], float(np.abs(ref[source["logits"]]).max()))
    for kind in ("key", "value"):
        for layer, (past, new) in enumerate(zip(roles[f"past_{kind}"], roles[f"new_{kind}"])):
            present = ref[source[f"present_{kind}"][layer]][:, :, valid:valid + count]
            worst["kv"] = max(worst["kv"], float(np.abs(got[new][:, :, :count] - present).max()))
            worst["kv_scale"] = max(worst["kv_scale"], float(np.abs(present).max()))
            cache[past][:, :, valid:valid + count] = got[new][:, :, :count]
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
    reference = ort.InferenceSession(str(original))
    ref_outputs = [o.name for o in reference.get_outputs()]
    source = reference_roles([i.name for i in reference.get_inputs()], ref_outputs,
                             lambda: manifest["source_roles"], trust_names=not manifest["source_roles"].get("given"))
    roles = manifest["graphs"]["decode"]["roles"]
    cache = {n: np.zeros((1, manifest["kv_heads"], context, manifest["head_dim"]), np.float32)
             for n in roles["past_key"] + roles["past_value"]}
    worst: dict[str, Any] = {"logits": 0.0, "kv": 0.0, "calls": 0, "top1_agree": 0, "positions": 0,
                             "logits_scale": 0.0, "kv_scale": 0.0}
    valid = 0
    for start in range(0, len(prompt), size):
        chunk = prompt[start:start + size]
        logits = _call(runners["prefill"], reference, ref_outputs, source, manifest["graphs"]["prefill"], chunk, valid,
                       cache, worst)
        valid += len(chunk)
    tokens = [int(np.argmax(logits[0, -1]))]
    while len(tokens) < new_tokens:
        logits = _call(runners["decode"], reference, ref_outputs, source, manifest["graphs"]["decode"], tokens[-1:], valid,
                       cache, worst)
        valid += 1
        tokens.append(int(np.argmax(logits[0, -1])))
    worst["tokens"] = tokens
    worst["reference_fed_by"] = source["fed_by"]
    worst["max_abs"] = max(worst["logits"], worst["kv"])
    worst["top1"] = worst["top1_agree"] / max(1, worst["positions"])
    return worst
