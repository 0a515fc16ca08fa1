#!/usr/bin/env python
"""How accurately the HTP computes single ops in fp16 mode, on SmolLM2-135M's own activations:
writes docs/fp16_ops.md and docs/fp16_ops.json.

1. The fp16 pair's prefill graph (``qnnpasses llm``, built by ``tools/llm_eval.py``) runs once on
   onnxruntime CPU in fp32 over a held-out prompt (:func:`llm_eval.prompts`), exposing the
   inputs of the ops below at one layer (``--layer``) and at the head;
2. each op becomes a one-node model (its weight, if any, an initializer) run on the HTP in fp16
   mode (``enable_htp_fp16_precision=1``) in a child process (:func:`probe_placement`: a crash
   is a result, not the end of the tool), compiled once;
3. the HTP's output is compared with fp32 (float64 numpy on the same inputs) and with what an
   ideal fp16 op gives: inputs and weights rounded to fp16, exact arithmetic, output rounded to
   fp16 — the least any fp16 implementation must lose.  For MatMul also with an emulation of
   fp16 accumulation (the running sum rounded to fp16 after every product, in K order).

4. with ``--graphs``: whole graphs of fp16 pairs, per layer — one decode call and one prefill
   chunk at the same cache state, on the HTP against onnxruntime CPU fp32, with the residual
   stream exposed after every block (:func:`graph_step_errors`).

Errors are given relative to the output's RMS (``rel_rms``: RMS error / RMS of the fp32 output;
``rel_max``: max |error| / max |fp32 output|) and in fp16 ulps of the fp32 value (median, p99,
max; the ulp floored at fp16's smallest normal).  ``vs_ideal``: the HTP's rel_rms over the
ideal fp16 op's — near 1, the HTP computes as well as fp16 can; far above, precision is lost
inside the op.

    python tools/probe_fp16_ops.py [--pair DIR] [--layer 15] [--window-index 0] [--rows 16,1]
                                   [--graphs LABEL=PAIR_DIR,...] [--known 8] [--out docs/fp16_ops]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

TOOLS_DIR = Path(__file__).resolve().parent
REPO = TOOLS_DIR.parent
sys.path.insert(0, str(TOOLS_DIR))

import accuracy_metrics as am
import llm_eval as le

F16_TINY = float(np.finfo(np.float16).tiny)


# --------------------------------------------------------------------------- activations


def _consumers(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    out: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            out.setdefault(name, []).append(node)
    return out


def find_tensors(model: onnx.ModelProto, layer: int) -> dict[str, Any]:
    """Names (and weights) of the op inputs probed, found by structure in the pair's prefill:
    layer ``layer``'s input RMSNorm, attention Softmax (or what softmax-exp made of it), o_proj,
    MLP SiLU gate (the input of its Sigmoid, or of its ``h = 0.5 x`` where ``silu-tanh`` rewrote
    it) and down_proj; the final RMSNorm and the lm_head MatMul."""
    inits = {i.name: i for i in model.graph.initializer}
    nodes = model.graph.node
    norms = [n for n in nodes if n.op_type == "RMSNormalization"]
    producer = {out: n for n in nodes for out in n.output}
    # a Softmax's input, or where softmax-exp spelled it out, x of Sub(x, ReduceMax(x))
    softmaxes = [n.input[0] for n in nodes if n.op_type == "Softmax" or (
        n.op_type == "Sub" and getattr(producer.get(n.input[1]), "op_type", "") == "ReduceMax"
        and producer[n.input[1]].input[0] == n.input[0])]
    gates = [n.input[0] for n in nodes if n.op_type == "Sigmoid"]
    for tanh in (n for n in nodes if n.op_type == "Tanh"):  # silu-tanh's h = Mul(x, 0.5) -> Tanh(h)
        half = producer.get(tanh.input[0])
        if half is not None and half.op_type == "Mul":
            gates += [name for name in half.input if name not in inits and producer.get(name) is not None
                      and producer[name].op_type != "Constant"]
    mat = [n for n in nodes if n.op_type == "MatMul" and n.input[1] in inits]

    def by_dims(dims: list[int]) -> list[onnx.NodeProto]:
        return [n for n in mat if list(inits[n.input[1]].dims) == dims]

    if len(norms) < 2 * layer + 3 or len(softmaxes) <= layer:
        raise SystemExit(f"--layer {layer}: the graph has {len(softmaxes)} attention layers")
    hidden = int(inits[norms[0].input[1]].dims[0])
    o_proj = by_dims([hidden, hidden])[layer]
    down_proj = [n for n in mat if len(inits[n.input[1]].dims) == 2 and inits[n.input[1]].dims[1] == hidden
                 and inits[n.input[1]].dims[0] > hidden][layer]
    # the lm_head: the widest [hidden, N] weight, first in node order (logits-offset's second MatMul
    # reads [W; 1], K = hidden + 1, after the first, the plain x @ W this probe measures)
    widest = max(int(inits[n.input[1]].dims[-1]) for n in mat)
    head = next(n for n in mat if list(inits[n.input[1]].dims) == [hidden, widest])
    return {"norm": norms[2 * layer], "final_norm": norms[-1], "softmax": softmaxes[layer], "sigmoid": gates[layer],
            "o_proj": o_proj, "down_proj": down_proj, "lm_head": head, "inits": inits}


def capture(pair: Path, layer: int, prompt: list[int]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Run the pair's prefill on onnxruntime CPU (fp32) on ``prompt`` (one chunk, empty cache)
    and return the probed op inputs plus the facts needed to rebuild each op."""
    import onnxruntime as ort

    manifest = json.loads((pair / "llm.json").read_text())
    spec = manifest["graphs"]["prefill"]
    model = onnx.load(str(pair / spec["parts"][0]["onnx"]))
    found = find_tensors(model, layer)
    inits = found.pop("inits")
    names = {"norm_x": found["norm"].input[0], "final_norm_x": found["final_norm"].input[0],
             "softmax_x": found["softmax"], "sigmoid_x": found["sigmoid"],
             "o_proj_x": found["o_proj"].input[0], "down_proj_x": found["down_proj"].input[0],
             "lm_head_x": found["lm_head"].input[0]}
    session = ort.InferenceSession(am.with_extra_outputs(model, names.values()).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    tokens, past = int(spec["tokens"]), int(spec["past"])
    feeds: dict[str, np.ndarray] = {}
    for inp in session.get_inputs():
        dtype = np.int32 if "int32" in inp.type else np.int64 if "int64" in inp.type else np.float32
        if inp.name == "input_ids":
            feeds[inp.name] = np.asarray([prompt[:tokens]], dtype=dtype)
        elif inp.name == "attention_mask":
            feeds[inp.name] = np.concatenate([np.zeros(past), np.ones(tokens)])[None].astype(dtype)
        elif inp.name == "position_ids":
            feeds[inp.name] = np.arange(tokens)[None].astype(dtype)
        else:
            feeds[inp.name] = np.zeros([d if isinstance(d, int) else 1 for d in inp.shape], dtype=dtype)
    values = dict(zip(names, session.run(list(names.values()), feeds)))
    weights = {k: numpy_helper.to_array(inits[found[k].input[1]]) for k in ("o_proj", "down_proj", "lm_head")}
    weights.update({f"{k}_scale": numpy_helper.to_array(inits[found[k].input[1]]) for k in ("norm", "final_norm")})
    eps = {k: next((a.f for a in found[k].attribute if a.name == "epsilon"), 1e-5) for k in ("norm", "final_norm")}
    return values, {"weights": weights, "eps": eps, "opset": model.opset_import[0].version, "ir": model.ir_version}


# --------------------------------------------------------------------------- probes


def _model(nodes: list[onnx.NodeProto], inputs: dict[str, np.ndarray], inits: dict[str, np.ndarray],
           outputs: list[str], opset: int, ir: int) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "probe", [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)) for k, v in inputs.items()],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir)


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


def errors(got: np.ndarray, want: np.ndarray) -> dict[str, float]:
    """Error of ``got`` against the fp32/float64 ``want``: relative to the output's scale and in fp16 ulps."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.abs(got - want)
    ulp = np.maximum(np.spacing(np.abs(want).astype(np.float16)).astype(np.float64), F16_TINY)
    in_ulps = err / ulp
    return {"rel_rms": _rms(err) / max(_rms(want), 1e-30), "rel_max": float(err.max() / max(np.abs(want).max(), 1e-30)),
            "ulp_median": float(np.median(in_ulps)), "ulp_p99": float(np.percentile(in_ulps, 99)),
            "ulp_max": float(in_ulps.max())}


def f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float64)


def rmsnorm(x: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def matmul_fp16_accumulate(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ w with fp16 inputs, each product rounded to fp16 and added to an fp16 running sum in K order."""
    x16, w16 = np.asarray(x, np.float32).astype(np.float16), np.asarray(w, np.float32).astype(np.float16)
    acc = np.zeros((x16.shape[0], w16.shape[1]), np.float16)
    for k in range(x16.shape[1]):
        acc = (acc + (x16[:, k:k + 1] * w16[k:k + 1, :])).astype(np.float16)
    return acc.astype(np.float64)


class Probe:
    """One single-op (or small-formulation) graph, its fp32 truth and its ideal fp16 result."""

    def __init__(self, name: str, what: str, model: onnx.ModelProto, inputs: dict[str, np.ndarray],
                 truth: np.ndarray, ideal: np.ndarray, extra: dict[str, np.ndarray] | None = None):
        self.name, self.what, self.model, self.inputs = name, what, model, inputs
        self.truth, self.ideal, self.extra = truth, ideal, extra or {}


def build_probes(acts: dict[str, np.ndarray], facts: dict[str, Any], only: set[str] | None) -> list[Probe]:
    w, eps, opset, ir = facts["weights"], facts["eps"], facts["opset"], facts["ir"]
    probes: list[Probe] = []

    def add(name: str, what: str, nodes: list[onnx.NodeProto], inputs: dict[str, np.ndarray],
            inits: dict[str, np.ndarray], truth: Callable[..., np.ndarray], ideal: Callable[..., np.ndarray],
            extra: dict[str, Callable[[], np.ndarray]] | None = None) -> None:
        if only and name not in only:
            return
        model = _model(nodes, inputs, inits, ["y"], opset, ir)
        probes.append(Probe(name, what, model, inputs, truth(), f16(ideal()),
                            {k: f() for k, f in (extra or {}).items()}))

    for key, k_name in (("o_proj", "K=576"), ("down_proj", "K=1536"), ("lm_head", "K=576, N=49152")):
        x, wt = acts[f"{key}_x"], w[key]
        x2 = x.reshape(-1, x.shape[-1])
        add(f"matmul_{key}", f"MatMul {k_name} ({key} of the layer / the head)",
            [helper.make_node("MatMul", ["x", "w"], ["y"])], {"x": x2}, {"w": wt},
            lambda x2=x2, wt=wt: x2.astype(np.float64) @ wt.astype(np.float64),
            lambda x2=x2, wt=wt: f16(x2) @ f16(wt),
            {"fp16_accumulate": lambda x2=x2, wt=wt: matmul_fp16_accumulate(x2, wt)})
    for key in ("o_proj", "down_proj"):  # both operands graph inputs, as in attention's Q·Kᵀ and P·V
        x2, wt = acts[f"{key}_x"].reshape(-1, acts[f"{key}_x"].shape[-1]), w[key]
        add(f"matmul_{key}_dynamic", f"MatMul K={wt.shape[0]}, both operands graph inputs",
            [helper.make_node("MatMul", ["x", "w"], ["y"])], {"x": x2, "w": wt}, {},
            lambda x2=x2, wt=wt: x2.astype(np.float64) @ wt.astype(np.float64),
            lambda x2=x2, wt=wt: f16(x2) @ f16(wt),
            {"fp16_accumulate": lambda x2=x2, wt=wt: matmul_fp16_accumulate(x2, wt)})
    s = acts["softmax_x"]
    add("softmax", f"Softmax over {s.shape[-1]} (scaled scores + finite mask)",
        [helper.make_node("Softmax", ["x"], ["y"], axis=-1)], {"x": s}, {},
        lambda: softmax(s), lambda: softmax(f16(s)))
    # the same softmax as the softmax-exp pass writes it (qnnpasses llm's fp16 pairs)
    if not only or "softmax_exp" in only:
        probes.append(Probe("softmax_exp", "Softmax as softmax-exp writes it: Exp(Max(x - ReduceMax, -64)) / ReduceSum",
                            _rewritten(_model([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], {"x": s}, {}, ["y"],
                                              opset, ir), "softmax-exp", {"x": s}),
                            {"x": s}, softmax(s), f16(softmax(f16(s)))))
    g = acts["sigmoid_x"]
    add("sigmoid", "Sigmoid on the MLP gate",
        [helper.make_node("Sigmoid", ["x"], ["y"])], {"x": g}, {}, lambda: sigmoid(g), lambda: sigmoid(f16(g)))
    add("silu", "x * Sigmoid(x) on the MLP gate (as the graph has it)",
        [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])], {"x": g}, {},
        lambda: g * sigmoid(g), lambda: f16(g) * sigmoid(f16(g)))
    one, half = np.asarray(1.0, np.float32), np.asarray(0.5, np.float32)
    alternatives = {
        "sigmoid_tanh": ("Sigmoid as 0.5 * Tanh(0.5 x) + 0.5", [
            helper.make_node("Mul", ["x", "half"], ["h"]), helper.make_node("Tanh", ["h"], ["t"]),
            helper.make_node("Mul", ["t", "half"], ["u"]), helper.make_node("Add", ["u", "half"], ["y"])],
            lambda: sigmoid(g), lambda: sigmoid(f16(g))),
        "sigmoid_exp": ("Sigmoid as 1 / (1 + Exp(-x))", [
            helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Exp", ["n"], ["e"]),
            helper.make_node("Add", ["e", "one"], ["d"]), helper.make_node("Div", ["one", "d"], ["y"])],
            lambda: sigmoid(g), lambda: sigmoid(f16(g))),
        "silu_exp": ("x * Sigmoid(x) as x / (1 + Exp(-x))", [
            helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Exp", ["n"], ["e"]),
            helper.make_node("Add", ["e", "one"], ["d"]), helper.make_node("Div", ["x", "d"], ["y"])],
            lambda: g * sigmoid(g), lambda: f16(g) * sigmoid(f16(g))),
        "silu_tanh": ("x * Sigmoid(x) as (0.5 x) * Tanh(0.5 x) + 0.5 x", [
            helper.make_node("Mul", ["x", "half"], ["h"]), helper.make_node("Tanh", ["h"], ["t"]),
            helper.make_node("Mul", ["h", "t"], ["u"]), helper.make_node("Add", ["u", "h"], ["y"])],
            lambda: g * sigmoid(g), lambda: f16(g) * sigmoid(f16(g))),
    }
    for name, (what, nodes, truth, ideal) in alternatives.items():
        add(name, what, nodes, {"x": g}, {"one": one, "half": half}, truth, ideal)
    for key in ("norm", "final_norm"):
        x, scale = acts[f"{key}_x"], w[f"{key}_scale"]
        x2 = x.reshape(-1, x.shape[-1])
        add(f"rmsnorm_{key}", f"RMSNormalization (fused, stash fp32) on the {'layer' if key == 'norm' else 'final'} residual",
            [helper.make_node("RMSNormalization", ["x", "scale"], ["y"], axis=-1, epsilon=eps[key], stash_type=1)],
            {"x": x2}, {"scale": scale}, lambda x2=x2, s=scale, e=eps[key]: rmsnorm(x2, s, e),
            lambda x2=x2, s=scale, e=eps[key]: rmsnorm(f16(x2), f16(s), e))
    x, scale = acts["norm_x"].reshape(-1, acts["norm_x"].shape[-1]), w["norm_scale"]
    axes = np.asarray([-1], np.int64)
    if not only or "rmsnorm_decomposed" in only:
        nodes = [helper.make_node("Mul", ["x", "x"], ["sq"]), helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
                 helper.make_node("Add", ["ms", "eps"], ["mse"]), helper.make_node("Sqrt", ["mse"], ["r"]),
                 helper.make_node("Div", ["x", "r"], ["n"]), helper.make_node("Mul", ["n", "scale"], ["y"])]
        probes.append(Probe("rmsnorm_decomposed", "RMSNorm as Mul/ReduceMean/Add/Sqrt/Div/Mul (layer residual)",
                            _with_int_init(nodes, {"x": x}, {"axes": axes}, opset, ir,
                                           {"scale": scale, "eps": np.asarray(eps["norm"], np.float32)}),
                            {"x": x}, rmsnorm(x, scale, eps["norm"]), f16(rmsnorm(f16(x), f16(scale), eps["norm"]))))
    return probes


def _rewritten(model: onnx.ModelProto, pipeline: str, inputs: dict[str, np.ndarray]) -> onnx.ModelProto:
    """``model`` after ``pipeline`` (strict, verified on CPU on ``inputs``): what the pass emits."""
    from qnnpasses.ir.load import load_model
    from qnnpasses.ir.model import to_model_bytes
    from qnnpasses.passmanager.manager import PassManager, RunConfig
    from qnnpasses.passmanager.named import parse_pipeline

    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    inferred = {v.name: v for v in model.graph.value_info}
    for output in model.graph.output:  # the loader wants typed, shaped outputs
        if output.name in inferred:
            output.CopyFrom(inferred[output.name])
    ir = load_model(model)
    PassManager(parse_pipeline(pipeline), RunConfig(verify=True, strict=True, inputs=inputs)).run(ir)
    return onnx.load_from_string(to_model_bytes(ir))


def _with_int_init(nodes: list[onnx.NodeProto], inputs: dict[str, np.ndarray], ints: dict[str, np.ndarray], opset: int,
                   ir: int, floats: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:
    model = _model(nodes, inputs, floats or {}, ["y"], opset, ir)
    model.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in ints.items())
    return model


def run_probe(probe: Probe, work: Path) -> dict[str, Any]:
    from qnnpasses.backends.htp import probe_placement

    path = work / f"{probe.name}.onnx"
    onnx.save_model(probe.model, str(path))
    keep = work / probe.name
    placement = probe_placement(path, probe.inputs, fp16=True, optimize=False, keep_dir=keep)
    row: dict[str, Any] = {"probe": probe.name, "what": probe.what, "shape": list(probe.truth.shape),
                           "seconds": placement.seconds, "on_htp": placement.ok and not placement.cpu_nodes,
                           "qnn_ops": placement.qnn_graph_ops.get("by_type", {})}
    row["ideal_fp16"] = errors(probe.ideal, probe.truth)
    for name, value in probe.extra.items():
        row[name] = errors(value, probe.truth)
    if not placement.ok:
        row["error"] = placement.error
        return row
    with np.load(keep / "outputs.npz") as out:
        got = out["y"].astype(np.float64).reshape(probe.truth.shape)
    row["htp"] = errors(got, probe.truth)
    row["vs_ideal"] = row["htp"]["rel_rms"] / max(row["ideal_fp16"]["rel_rms"], 1e-30)
    return row


# --------------------------------------------------------------------------- in the graph


def graph_step_errors(pair: Path, item: dict[str, Any], ref_tokens: list[int], known: int, work: Path) -> dict[str, Any]:
    """Per-layer error of one whole-graph call on the HTP (fp16) against the same graph on CPU (fp32).

    The cache is filled on onnxruntime CPU in fp32 with the prompt and the original's first
    ``known`` tokens; then token ``known`` goes through the decode graph (one token) and tokens
    ``known..known+M-1`` through the prefill graph, each on both sides with every RMSNormalization
    input (the residual stream after each block) exposed.  Errors are rel RMS over the row of token
    ``known`` (the same token and cache in both graphs): where the two graphs differ, the HTP
    computes the same layers differently for one token and for a chunk."""
    import shutil

    import onnxruntime as ort

    from qnnpasses.backends.htp import htp_session
    from qnnpasses.llm.runner import Runner

    runner = Runner(pair, on="cpu")
    runner.feed(item["prompt"])
    runner.feed(ref_tokens[:known])
    feeds: dict[str, dict[str, np.ndarray]] = {}
    for name, ids in (("decode", ref_tokens[known:known + 1]), ("prefill", ref_tokens[known:known + runner.graphs["prefill"].tokens])):
        graph, valid = runner.graphs[name], runner.valid_len
        run = graph.run
        graph.run = lambda f, name=name, run=run: feeds.setdefault(name, f) and run(f)
        runner.step(name, ids)
        graph.run, runner.valid_len = run, valid
    out: dict[str, Any] = {"known_tokens": known}
    for name in ("decode", "prefill"):
        part = runner.manifest["graphs"][name]["parts"][0]["onnx"]
        model = onnx.load(str(pair / part), load_external_data=False)
        names = list(dict.fromkeys(n.input[0] for n in model.graph.node if n.op_type == "RMSNormalization")) + ["logits"]
        path = work / f"{name}_exposed.onnx"
        onnx.save_model(am.with_extra_outputs(model, names), str(path))
        data = next(iter({i.external_data[0].value for i in model.graph.initializer if i.external_data}), None)
        if data and not (work / data).exists():
            shutil.copy(pair / data, work / data)  # a session refuses data outside the model's folder
        cpu = dict(zip(names, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(names, feeds[name])))
        htp = dict(zip(names, htp_session(str(path), fp16=True, disable_cpu_fallback=True, optimize=False).run(names, feeds[name])))
        rel = []
        for n in names:
            a = cpu[n].reshape(-1, cpu[n].shape[-1])[:1].astype(np.float64)
            b = htp[n].reshape(-1, htp[n].shape[-1])[:1].astype(np.float64)
            rel.append(_rms(a - b) / _rms(a))
        out[name] = {"residual_rel_rms": rel[:-1], "logits_rel_rms": rel[-1],
                     "same_argmax": bool(cpu["logits"].reshape(-1, cpu["logits"].shape[-1])[0].argmax()
                                         == htp["logits"].reshape(-1, htp["logits"].shape[-1])[0].argmax())}
        if data:
            (work / data).unlink(missing_ok=True)
    return out


# --------------------------------------------------------------------------- fp16 storage on CPU


def round_activations(model: onnx.ModelProto) -> int:
    """Insert ``Cast(fp32 -> fp16 -> fp32)`` after every node's float32 output (graph outputs keep
    their names): each op still computes in fp32, every tensor between ops is stored in fp16.
    Returns the number of tensors rounded."""
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type
             for v in [*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input]}
    outputs = {o.name for o in model.graph.output}
    nodes, renamed, count = [], {}, 0
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = renamed.get(name, name)
        nodes.append(node)
        for j, name in enumerate(list(node.output)):
            if types.get(name) != TensorProto.FLOAT:
                continue
            count += 1
            half = f"{name}__fp16_{count}"
            if name in outputs:
                node.output[j] = f"{name}__fp32_{count}"
                nodes += [helper.make_node("Cast", [node.output[j]], [half], to=TensorProto.FLOAT16),
                          helper.make_node("Cast", [half], [name], to=TensorProto.FLOAT)]
            else:
                renamed[name] = f"{name}__rounded_{count}"
                nodes += [helper.make_node("Cast", [name], [half], to=TensorProto.FLOAT16),
                          helper.make_node("Cast", [half], [renamed[name]], to=TensorProto.FLOAT)]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return count


def fp16_storage_run(pair: Path, work: Path, items: list[dict], refs: list[dict], ties: list[dict]) -> dict[str, Any]:
    """The pair on onnxruntime CPU with its weights rounded to fp16 and every activation stored in
    fp16 (:func:`round_activations`), ops computing in fp32 — an fp16 deployment with ideal ops —
    scored as ``llm_eval`` scores the HTP pair (greedy, teacher-forced)."""
    import shutil

    manifest = json.loads((pair / "llm.json").read_text())
    work.mkdir(parents=True, exist_ok=True)
    rounded = 0
    for graph in manifest["graphs"].values():
        for part in graph["parts"]:
            part.pop("compiled", None)
            model = am.round_weights(onnx.load(str(pair / part["onnx"])))
            rounded += round_activations(model)
            onnx.save_model(model, str(work / part["onnx"]), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=part["onnx"] + ".data")
    (work / "llm.json").write_text(json.dumps(manifest))
    try:
        run = le.pair_run(work, items, refs, "greedy", on="cpu")
        le.divergences(run, items, refs, ties)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"rounded_tensors": rounded, "identical_leading": run["identical_leading"],
            "identical_leading_mean": run["identical_leading_mean"], "top1": run["top1"], "positions": run["positions"],
            "differs_at": [[{k: d[k] for k in ("token", "fp32_margin")} for d in row["differs_at"]] for row in run["prompts"]]}


# --------------------------------------------------------------------------- report


def render(doc: dict[str, Any]) -> str:
    lines = ["# fp16 accuracy of single ops on the HTP", "",
             f"Written by `{('python tools/probe_fp16_ops.py ' + doc['command']).strip()}` ({doc['finished']}); every figure is "
             "in `docs/fp16_ops.json`.", "",
             (f"Inputs are SmolLM2-135M's own activations (the fp16 pair's prefill on onnxruntime CPU in fp32, layer "
              f"{doc['layer']} and the head, held-out window {doc['window']}). Each op runs alone on the HTP in fp16 mode "
              "(`enable_htp_fp16_precision=1`). *rel RMS*: RMS error / RMS of the fp32 result. *ideal fp16*: inputs and "
              "weights rounded to fp16, exact arithmetic, result rounded to fp16 — what any fp16 op must lose. "
              "*× ideal*: the HTP's rel RMS over the ideal's. *fp16 accum.*: MatMul emulated with an fp16 running sum."),
             "", "| probe | tokens | what | HTP rel RMS | ideal fp16 rel RMS | × ideal | fp16 accum. rel RMS | HTP ulps median / p99 / max |",
             "|---|---:|---|---:|---:|---:|---:|---|"]
    for row in doc["probes"]:
        htp = row.get("htp")
        acc = row.get("fp16_accumulate")
        lines.append(f"| {row['probe']} | {row.get('tokens', '')} | {row['what']} | "
                     + (f"{htp['rel_rms']:.2e}" if htp else f"error: {row.get('error')}")
                     + f" | {row['ideal_fp16']['rel_rms']:.2e} | " + (f"{row['vs_ideal']:.1f}" if htp else "–")
                     + (f" | {acc['rel_rms']:.2e} |" if acc else " | – |")
                     + (f" {htp['ulp_median']:.2f} / {htp['ulp_p99']:.1f} / {htp['ulp_max']:.0f} |" if htp else " – |"))
    if doc.get("findings"):
        lines += ["", "## What this says", "", *doc["findings"]]
    if doc.get("graphs"):
        first = next(iter(doc["graphs"].values()))
        lines += ["", "## In the whole graph: one decode call and one prefill chunk", "",
                  (f"The cache holds the prompt and the original's first {first['known_tokens']} tokens (onnxruntime CPU, "
                   "fp32); the next token then goes through the decode graph alone and at the head of a prefill chunk, on "
                   "the HTP (fp16) and on CPU (fp32), with the residual stream exposed after every block. Rel RMS error of "
                   "that token's row, HTP against CPU:"), "",
                  "| pair | graph | after attention 1 | after MLP 1 | after 10 layers | after 20 layers | after all layers | logits | same argmax |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---|"]
        for label, res in doc["graphs"].items():
            for graph in ("decode", "prefill"):
                r = res[graph]["residual_rel_rms"]
                picks = [r[i] if i < len(r) else None for i in (1, 2, 20, 40)] + [r[-1]]
                lines.append(f"| {label} | {graph} | " + " | ".join("–" if v is None else f"{v:.1e}" for v in picks)
                             + f" | {res[graph]['logits_rel_rms']:.1e} | {'yes' if res[graph]['same_argmax'] else 'no'} |")
    st = doc.get("storage")
    if st:
        flips = [f"prompt {i + 1}: token {d['token']} (fp32 margin {d['fp32_margin']})"
                 for i, row in enumerate(st["differs_at"]) for d in row]
        lines += ["", "## fp16 storage with ideal ops (onnxruntime CPU)", "",
                  (f"The pair with its weights rounded to fp16 and all {st['rounded_tensors']} float tensors between ops "
                   "stored in fp16 (Cast to fp16 and back after every op; every op computes in fp32), scored like the HTP "
                   "pair by `tools/llm_eval.py` (same 4 prompts, greedy, teacher-forced): identical leading tokens "
                   f"{st['identical_leading']} (mean {st['identical_leading_mean']:.2f}), top-1 {st['top1']:.4f} of "
                   f"{st['positions']} positions. Where it differs: {'; '.join(flips) or 'nowhere'}.")]
    lines += ["", "## Rerun", "", "```sh", f"python tools/probe_fp16_ops.py {doc['command']}".rstrip(), "```", ""]
    return "\n".join(lines)


def findings(rows: list[dict[str, Any]]) -> list[str]:
    """Sentences derived from the rows (no typed-in figures)."""
    out = []
    worst = sorted((r for r in rows if r.get("htp")), key=lambda r: -r["vs_ideal"])
    if worst:
        out.append("- Ops by how far the HTP is from an ideal fp16 op (tokens): "
                   + ", ".join(f"{r['probe']} ({r.get('tokens')}) {r['vs_ideal']:.1f}×" for r in worst) + ".")
    for r in rows:
        acc, htp = r.get("fp16_accumulate"), r.get("htp")
        if acc and htp:
            ideal = r["ideal_fp16"]["rel_rms"]
            near = abs(np.log(htp["rel_rms"] / acc["rel_rms"])) < abs(np.log(htp["rel_rms"] / ideal))
            out.append(f"- {r['probe']} ({r.get('tokens')} tokens): the HTP's error {htp['rel_rms']:.2e} is nearer "
                       + (f"an fp16 running sum's {acc['rel_rms']:.2e} than an ideal fp16 op's {ideal:.2e}: it "
                          "accumulates in fp16" if near else
                          f"an ideal fp16 op's {ideal:.2e} than an fp16 running sum's {acc['rel_rms']:.2e}: it "
                          "accumulates in more than fp16") + ".")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", type=Path, default=le.tf.DEFAULT_CACHE.parent / "llm_eval" / "kv_ts_fp16",
                        help="folder of an fp16 pair (llm.json) made by qnnpasses llm")
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--window-index", type=int, default=0, help="which of llm_eval's 4 prompts' windows")
    parser.add_argument("--only", help="comma-separated probe names")
    parser.add_argument("--rows", default="16,1",
                        help="token counts to probe, comma-separated (the last N tokens: 16 as in a prefill chunk, "
                             "1 as in the decode graph)")
    parser.add_argument("--graphs", help="also compare whole graphs, per layer: LABEL=PAIR_DIR[,LABEL=PAIR_DIR...] "
                        "(fp16 pairs made by qnnpasses llm; one decode and one prefill call each)")
    parser.add_argument("--storage", action="store_true",
                        help="also run the pair on CPU with weights and every activation stored in fp16 (ideal fp16 ops)")
    parser.add_argument("--known", type=int, default=8, help="--graphs: the original's tokens already in the cache")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "fp16_ops")
    args = parser.parse_args(argv)
    graphs = {}
    for spec in (args.graphs.split(",") if args.graphs else []):
        label, _, folder = spec.partition("=")
        if not folder or not (Path(folder) / "llm.json").is_file():
            print(f"probe_fp16_ops: --graphs {spec}: expected LABEL=DIR with DIR/llm.json", file=sys.stderr)
            return 2
        graphs[label] = Path(folder)
    if not (args.pair / "llm.json").is_file():
        print(f"probe_fp16_ops: no pair in {args.pair} (run tools/llm_eval.py first)", file=sys.stderr)
        return 2
    from qnnpasses.backends.htp import htp_available

    if not htp_available():
        print("probe_fp16_ops: the QNN HTP backend is not available", file=sys.stderr)
        return 2
    item = le.prompts(4, 16, 32)[args.window_index]
    started = time.monotonic()
    acts, facts = capture(args.pair, args.layer, item["prompt"] + item["text"])
    rows = []
    for count in [int(c) for c in args.rows.split(",")]:  # the last COUNT tokens (1: the decode graph's shapes)
        shaped = {k: v[..., -count:, :] for k, v in acts.items()}
        probes = build_probes(shaped, facts, set(args.only.split(",")) if args.only else None)
        with tempfile.TemporaryDirectory(prefix="probe_fp16_") as tmp:
            for probe in probes:
                rows.append({"tokens": count, **run_probe(probe, Path(tmp))})
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "qnn_ops"}), flush=True)
    in_graph = {}
    if graphs:
        refs = json.loads((le.tf.DEFAULT_CACHE.parent / "llm_eval" / "kv_ts_reference.json").read_text())["value"]
        for label, folder in graphs.items():
            with tempfile.TemporaryDirectory(prefix="probe_fp16_graph_") as tmp:
                in_graph[label] = graph_step_errors(folder, item, refs[args.window_index]["tokens"], args.known, Path(tmp))
            print(label, {g: (round(v["logits_rel_rms"], 5), v["same_argmax"]) for g, v in in_graph[label].items()
                          if isinstance(v, dict)}, flush=True)
    storage = None
    if args.storage:
        eval_dir = le.tf.DEFAULT_CACHE.parent / "llm_eval"
        items = le.prompts(4, 16, 32)
        refs, ties = (json.loads((eval_dir / f"kv_ts_{k}.json").read_text())["value"] for k in ("reference", "ties"))
        with tempfile.TemporaryDirectory(prefix="probe_fp16_storage_") as tmp:
            storage = fp16_storage_run(args.pair, Path(tmp) / "pair", items, refs, ties)
        print("storage", storage, flush=True)
    shown = [a for a in (argv if argv is not None else sys.argv[1:])]
    drop = {i for i, a in enumerate(shown) if a in ("--out", "--pair", "--graphs")}
    doc = {"command": " ".join(a for i, a in enumerate(shown) if i not in drop and i - 1 not in drop),
           "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": round(time.monotonic() - started, 1),
           "layer": args.layer, "window": item["window"], "probes": rows, "findings": findings(rows),
           "graphs": in_graph, "storage": storage}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(render(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
