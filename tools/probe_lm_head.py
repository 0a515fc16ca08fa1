#!/usr/bin/env python
"""What each form of an fp16 lm_head costs on the HTP: bytes, preparation, run time, resolution.

An lm_head ``logits = x @ W`` with the token embedding tied to it (a Gather of ``W``'s columns,
as ``tied-embedding`` leaves a pair), at the vocabulary and hidden sizes of real models, in the
forms a pair could ship:

* ``plain``: the lm_head as exported (``--plain-logits``);
* ``two weights``: what ``logits-offset`` writes: ``m = max(x @ W)``, then ``[x, -m] @ [W; 1]``,
  the second MatMul reading a copy of ``W`` with a row of ones;
* ``one weight``: the same computation with both MatMuls (``[x, 0]`` for the first) and the
  Gather reading the one ``[W; 1]``;
* ``top-k refined`` (``--topk``): the plain MatMul, then only its ``k`` largest logits recomputed
  against ``m`` from the embedding rows (``TopK``, ``Gather``, a small MatMul, ``ScatterElements``).

Each form is prepared on the simulated HTP (fp16 mode, CPU fallback disabled, compiled to an
EPContext model) in a child process of its own and run on a seeded input whose top logits are
16..32, where fp16's spacing is 0.0156..0.031.  Figures: the context binary's bytes, seconds to
prepare, milliseconds per call (median of 3), and the largest error of the logits within 4 of
their row's maximum against float64 (for the forms with an offset, against the float64 logits
minus the offset the graph returned).

Writes ``docs/lm_head_forms.json`` and ``docs/lm_head_forms.md``.

    python tools/probe_lm_head.py [--shapes smollm2,qwen2.5-0.5b,gemma3-270m] [--tokens 1,16] [--topk]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
DOC_JSON, DOC_MD = ROOT / "docs" / "lm_head_forms.json", ROOT / "docs" / "lm_head_forms.md"
#: (hidden, vocabulary) of the lm_heads measured
SHAPES = {"smollm2": (576, 49152), "qwen2.5-0.5b": (896, 151936), "gemma3-270m": (640, 262144)}
FORMS = ("plain", "two weights", "one weight", "top-k refined")
TOP_K = 8
RUNS = 3
TIMEOUT = 1800.0


def _lm_head_data(hidden: int, vocab: int, tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``W [hidden, vocab]``, ``x [tokens, hidden]`` whose top logits are 16..32 (a few tokens lead
    each row, as in a trained model's output), and token ids; all fp16 values, so the HTP's
    rounding of its inputs adds nothing."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((hidden, vocab)) * (0.6 * np.sqrt(64 / hidden))).astype(np.float32)
    x = np.stack([w[:, rng.choice(vocab, 3)].sum(1) for _ in range(tokens)])
    x = x / np.linalg.norm(x, axis=-1, keepdims=True) * 7.5 + rng.normal(0, 0.3, x.shape)
    ids = rng.integers(0, vocab, (1, tokens)).astype(np.int64)
    return w.astype(np.float16).astype(np.float32), x.astype(np.float16).astype(np.float32), ids


def lm_head_model(form: str, w: np.ndarray, tokens: int) -> onnx.ModelProto:
    """The lm_head and the tied embedding Gather in ``form``: inputs ``x``, ``ids``; outputs
    ``logits``, ``embedded`` and, for the forms with an offset, ``offset``."""
    hidden, vocab = w.shape
    inits: list[onnx.TensorProto] = []
    node = helper.make_node

    def const(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(value, name))
        return name

    axis = const("last_axis", np.array([-1], np.int64))
    if form == "one weight":
        table = const("W_ones", np.concatenate([w, np.ones((1, vocab), np.float32)]))
        nodes = [node("Gather", [table, "ids"], ["gathered"], axis=1),
                 node("Slice", ["gathered", const("zero", np.array([0], np.int64)), const("hidden", np.array([hidden], np.int64)),
                                const("first_axis", np.array([0], np.int64))], ["embedded"]),
                 node("Concat", ["x", const("zeros", np.zeros((tokens, 1), np.float32))], ["x_zero"], axis=-1),
                 node("MatMul", ["x_zero", table], ["first"])]
    else:
        table = const("W", w)
        nodes = [node("Gather", [table, "ids"], ["embedded"], axis=1), node("MatMul", ["x", table], ["first"])]
    if form == "plain":
        nodes[-1].output[0] = "logits"
    elif form in ("two weights", "one weight"):
        second = table if form == "one weight" else const("W_ones", np.concatenate([w, np.ones((1, vocab), np.float32)]))
        nodes += [node("ReduceMax", ["first", axis], ["offset"], keepdims=1), node("Neg", ["offset"], ["minus"]),
                  node("Concat", ["x", "minus"], ["x_shifted"], axis=-1), node("MatMul", ["x_shifted", second], ["logits"])]
    elif form == "top-k refined":
        nodes += [node("ReduceMax", ["first", axis], ["offset"], keepdims=1), node("Neg", ["offset"], ["minus"]),
                  node("TopK", ["first", const("k", np.array([TOP_K], np.int64))], ["top", "top_ids"], axis=-1),
                  node("Gather", [table, "top_ids"], ["rows_t"], axis=1),                            # [hidden, T, k]
                  node("Transpose", ["rows_t"], ["rows"], perm=[1, 2, 0]),                           # [T, k, hidden]
                  node("Concat", ["rows", const("ones", np.ones((tokens, TOP_K, 1), np.float32))], ["rows_one"], axis=-1),
                  node("Concat", ["x", "minus"], ["x_shifted"], axis=-1),
                  node("Unsqueeze", ["x_shifted", axis], ["x_column"]),
                  node("MatMul", ["rows_one", "x_column"], ["fine_column"]),                          # [T, k, 1]
                  node("Squeeze", ["fine_column", axis], ["fine"]),
                  node("Sub", ["first", "offset"], ["coarse"]),
                  node("ScatterElements", ["coarse", "top_ids", "fine"], ["logits"], axis=-1)]
    else:
        raise ValueError(f"unknown form {form!r}")
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [tokens, vocab]),
               helper.make_tensor_value_info("embedded", TensorProto.FLOAT, [hidden, 1, tokens])]
    if form != "plain":
        outputs.append(helper.make_tensor_value_info("offset", TensorProto.FLOAT, [tokens, 1]))
    graph = helper.make_graph(nodes, "lm_head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [tokens, hidden]),
                                                 helper.make_tensor_value_info("ids", TensorProto.INT64, [1, tokens])],
                              outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def measure_form(form: str, hidden: int, vocab: int, tokens: int, work: Path) -> dict:
    """In this process: prepare ``form`` on the HTP as an EPContext model, run it, score it."""
    from qnnpasses.backends.htp import captured_backend_output, htp_session

    w, x, ids = _lm_head_data(hidden, vocab, tokens)
    path = work / "lm_head.onnx"
    onnx.save_model(lm_head_model(form, w, tokens), str(path), save_as_external_data=True,
                    location="lm_head.onnx.data")
    start = time.perf_counter()
    session = htp_session(str(path), fp16=True, disable_cpu_fallback=True,
                          session_config={"ep.context_enable": "1", "ep.context_embed_mode": "0",
                                          "ep.context_file_path": str(work / "lm_head_ctx.onnx")})
    prepare = time.perf_counter() - start
    feed, seconds = {"x": x, "ids": ids}, []
    with captured_backend_output():
        names = [o.name for o in session.get_outputs()]
        session.run(names, feed)
        for _ in range(RUNS):
            start = time.perf_counter()
            got = dict(zip(names, session.run(names, feed)))
            seconds.append(time.perf_counter() - start)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    near = exact >= exact.max(-1, keepdims=True) - 4
    want = exact - got["offset"].astype(np.float64) if "offset" in got else exact
    error = np.abs(got["logits"].astype(np.float64) - want)
    return {"form": form, "hidden": hidden, "vocab": vocab, "tokens": tokens,
            "context_bytes": sum(p.stat().st_size for p in work.glob("*.bin")),
            "prepare_seconds": round(prepare, 2), "run_ms": round(1000 * float(np.median(seconds)), 1),
            "top_logit": float(exact.max()), "near_top_max_error": float(error[near].max()),
            "argmax_agrees": bool((got["logits"].argmax(-1) == exact.argmax(-1)).all())}


def _child(form: str, shape: str, tokens: int) -> dict:
    """One form in a child process of its own (the simulator's memory and a crash stay there)."""
    hidden, vocab = SHAPES[shape]
    with tempfile.TemporaryDirectory(prefix="qnnpasses-lm-head-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", form, shape, str(tokens), tmp, str(out)]
        try:
            proc = subprocess.run(cmd, capture_output=True, timeout=TIMEOUT, check=False)
        except subprocess.TimeoutExpired:
            return {"form": form, "shape": shape, "tokens": tokens, "error": f"timed out after {TIMEOUT:g} s"}
        if out.exists():
            return {"shape": shape, **json.loads(out.read_text())}
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return {"form": form, "shape": shape, "tokens": tokens, "error": tail[0][:300]}


def measure(shapes: list[str], tokens: list[int], forms: list[str]) -> dict:
    import onnxruntime
    import onnxruntime_qnn

    from qnnpasses.backends.targets import active

    rows, load = [], os.getloadavg()[0]
    for shape in shapes:
        for count in tokens:
            for form in forms:
                rows.append(_child(form, shape, count))
                print(json.dumps(rows[-1]), flush=True)
    target = active()
    return {"onnxruntime": onnxruntime.__version__, "onnxruntime_qnn": onnxruntime_qnn.__version__,
            "soc_model": str(target.soc_model), "htp_arch": str(target.htp_arch), "runs": RUNS, "top_k": TOP_K,
            "cpus": os.cpu_count(), "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2),
            "rows": rows}


def render(doc: dict) -> str:
    lines = ["# The forms of an fp16 lm_head on the HTP", "",
             "Written by `python tools/probe_lm_head.py` from `docs/lm_head_forms.json`.  An lm_head `x @ W` with the "
             "token embedding tied to it (a Gather of `W`'s columns, as `tied-embedding` leaves a pair), random "
             "weights at each model's hidden and vocabulary size, top logits 16..32; each form prepared on the "
             f"simulated HTP (fp16 mode, soc_model {doc['soc_model']}, htp_arch v{doc['htp_arch']}, CPU fallback disabled, "
             f"compiled to an EPContext model) in a process of its own; milliseconds per call the median of "
             f"{doc['runs']}; onnxruntime {doc['onnxruntime']}, onnxruntime-qnn {doc['onnxruntime_qnn']}.  Error: the "
             "largest difference of the logits within 4 of their row's maximum from float64 (with an offset, from "
             "float64 minus the offset the graph returned).  The simulator's times are for comparing forms on this "
             f"machine, not device figures" + (f" ({doc['cpus']} CPUs, load average {doc['load_before']} when the run "
             f"started and {doc['load_after']} when it ended)" if "cpus" in doc else "") + ".", "",
             f"The top-k refined form recomputes the {doc['top_k']} largest logits only: where more lie within 4 of "
             "the maximum, the others keep the plain form's error.", "",
             "| lm_head of (hidden x vocabulary) | tokens | form | context MiB | prepare s | ms per call | error near the top | argmax |",
             "|---|---:|---|---:|---:|---:|---:|---|"]
    for r in doc["rows"]:
        size = f" ({r['hidden']} x {r['vocab']:,})" if "vocab" in r else ""
        head = f"| {r['shape']}{size} | {r['tokens']} | {r['form']} |"
        if "error" in r:
            lines.append(f"{head} failed: {r['error']} | | | | |")
            continue
        lines.append(f"{head} {r['context_bytes'] / 2**20:,.1f} | {r['prepare_seconds']:.1f} | {r['run_ms']:,.1f} | "
                     f"{r['near_top_max_error']:.2g} | {'same' if r['argmax_agrees'] else 'differs'} |")
    lines += ["", *_findings(doc)]
    return "\n".join(lines) + "\n"


def _findings(doc: dict) -> list[str]:
    """Per lm_head and token count: what the offset's forms cost against the plain one."""
    rows = {(r["shape"], r["tokens"], r["form"]): r for r in doc["rows"] if "error" not in r}
    found = []
    for shape, tokens in dict.fromkeys((r["shape"], r["tokens"]) for r in doc["rows"]):
        plain, two, one = (rows.get((shape, tokens, f)) for f in FORMS[:3])
        if not (plain and two and one):
            continue
        found.append(f"- {shape}, {tokens} token{'s' if tokens > 1 else ''}: the offset resolves the top logits to "
                     f"{two['near_top_max_error']:.2g} (plain: {plain['near_top_max_error']:.2g}); with two weights the "
                     f"context holds {(two['context_bytes'] - plain['context_bytes']) / 2**20:,.0f} MiB more than plain "
                     f"and a call takes {two['run_ms'] / plain['run_ms']:.1f}x as long; with one weight "
                     f"{(one['context_bytes'] - plain['context_bytes']) / 2**20:,.0f} MiB more, "
                     f"{one['run_ms'] / plain['run_ms']:.1f}x as long, prepared in {one['prepare_seconds']:.0f} s "
                     f"(two weights: {two['prepare_seconds']:.0f} s).")
    if found:
        found.append("")
        found.append("Every form with an offset runs the lm_head's MatMul twice, so a decode step reads its weight "
                     "twice from memory whichever form stores it: on a phone, where a decode step's time is the bytes "
                     "it reads, that is the offset's cost even where its weight is stored once.")
    return found


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if args[:1] == ["--child"]:
        form, shape, tokens, work, out = args[1:6]
        hidden, vocab = SHAPES[shape]
        Path(out).write_text(json.dumps(measure_form(form, hidden, vocab, int(tokens), Path(work))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", default="1,16")
    parser.add_argument("--topk", action="store_true", help="also the top-k refined form")
    parser.add_argument("--doc-only", action="store_true", help="rewrite the Markdown from the JSON")
    options = parser.parse_args(args)
    if not options.doc_only:
        shapes = options.shapes.split(",")
        unknown = sorted(set(shapes) - set(SHAPES))
        if unknown:
            parser.error(f"unknown shapes {unknown} (known: {', '.join(SHAPES)})")
        forms = list(FORMS if options.topk else FORMS[:3])
        DOC_JSON.write_text(json.dumps(measure(shapes, [int(t) for t in options.tokens.split(",")], forms), indent=1) + "\n")
    DOC_MD.write_text(render(json.loads(DOC_JSON.read_text())))
    print(f"wrote {DOC_MD.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
