"""Compile the prefill + decode graphs to EPContext models, weight-shared when the backend allows.

The prefill and decode graphs hold the same weights.  onnxruntime-qnn can put several
graphs in one QNN context whose weights are stored once: session config
``ep.share_ep_contexts=1`` on every session of the group (``ep.stop_share_ep_contexts=1`` on
the last) and the provider option ``enable_htp_weight_sharing=1``, with the binary beside the
models (``ep.context_embed_mode=0``).  Whether a *session* on such a pair then works is a
property of the onnxruntime-qnn build (the process can crash creating one).  So a toy shared
pair is compiled and run first (:func:`backend_shares_weights`, seconds); only where that runs is
the real pair compiled shared and then run in a child process; if either fails in any way, the shared
files are deleted and every graph is compiled to its own context (``separate``).  Each context
binary is a ``*_qnn.bin`` file beside its EPContext model.  The outcome and the reason go to the
manifest and the report, and so does each graph's placement, read from its compile.

Sessions that compile or probe a graph run with onnxruntime's graph optimizations disabled:
the HTP gets exactly the graph ``htp-llm`` wrote.  (onnxruntime's MatMulAddFusion otherwise
fuses a projection and a residual Add whose other operand is a graph input -- the first layer
of a part -- into a Gemm the HTP rejects.)

Quantized (QDQ) graphs are compiled in integer precision with
``offload_graph_io_quantization=0``: the HTP then also takes the graph-boundary Q/DQ nodes
(onnxruntime otherwise runs them on the CPU), so the compiled model is one EPContext node.
:func:`probe` measures placement (QNN partitions, CPU nodes) and the composed QNN op count
with the same options, in a child process, by compiling the graph into a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from qnnpasses.backends.child import run_child
from qnnpasses.handoff.epcontext import context_summary
from qnnpasses.memory import PeakMemory

SHARE_OPTIONS = {"enable_htp_weight_sharing": "1"}
#: a compile child killed by SIGKILL: what the kernel's out-of-memory killer sends
OUT_OF_MEMORY_HINT = ("; SIGKILL is how the kernel ends a process that ran out of memory: preparing a graph takes "
                      "QNN several times its weight bytes, so compile smaller parts (--max-part-bytes SIZE, e.g. 512M; "
                      "the report of a build that finished gives its largest compile child's peak memory)")
#: integer precision: the HTP takes the boundary Q/DQ too (as qnnpasses.quant.evaluate does)
INT_OPTIONS = {"offload_graph_io_quantization": "0"}


def _share_config(last: bool) -> dict[str, str]:
    config = {"ep.share_ep_contexts": "1"}
    if last:
        config["ep.stop_share_ep_contexts"] = "1"
    return config


def _zero_inputs(sess) -> dict[str, np.ndarray]:
    dtypes = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
              "tensor(int32)": np.int32, "tensor(bool)": np.bool_, "tensor(uint8)": np.uint8,
              "tensor(uint16)": np.uint16, "tensor(int8)": np.int8}
    return {i.name: np.zeros(i.shape, dtypes.get(i.type, np.float32)) for i in sess.get_inputs()}


def _child(argv: list[str] | None = None) -> int:
    """Modes: ``compile`` each model (shared context unless ``--separate``; with ``--facts DIR``
    also dump each composed QNN graph there and record its placement), ``run`` the compiled models.
    The result also gives the child's sampled peak private memory (the backend's own)."""
    parser = argparse.ArgumentParser(prog="python -m qnnpasses.llm.compile")
    parser.add_argument("mode", choices=("compile", "run"))
    parser.add_argument("--pairs", required=True, help="JSON list of [model, compiled] paths")
    parser.add_argument("--result", required=True)
    parser.add_argument("--separate", action="store_true", help="one context per model")
    parser.add_argument("--facts", help="folder for the QNN graph dumps; record placement and op counts")
    parser.add_argument("--int", dest="fp16", action="store_false", help="integer precision (QDQ models)")
    args = parser.parse_args(argv)
    pairs = json.loads(args.pairs)
    result: dict[str, Any] = {"ok": False, "done": [], "facts": {}}

    def write() -> None:  # progress survives a crash of the next step
        Path(args.result).write_text(json.dumps(result))

    write()
    base = {} if args.fp16 else dict(INT_OPTIONS)
    with PeakMemory() as peak:
        _compile_or_run(args, pairs, base, result, write)
    result["private_peak_bytes"] = peak.private_peak
    result["ok"] = True
    write()
    return 0


def _compile_or_run(args, pairs, base, result, write) -> None:
    from qnnpasses.backends.htp import htp_session, parse_qnn_graph_dir
    from qnnpasses.quant.norm_rounding import htp_model

    for index, (model, compiled) in enumerate(pairs):
        shared = {} if args.separate else _share_config(index == len(pairs) - 1)
        options = base if args.separate else {**base, **SHARE_OPTIONS}
        if args.mode == "compile":
            # every binary in its own file beside the EPContext model: no 2 GB protobuf limit, and
            # the EPContext model reads in microseconds
            config = {**shared, "ep.context_enable": "1", "ep.context_file_path": compiled,
                      "ep.context_embed_mode": "0"}
            dump = Path(args.facts) / str(index) if args.facts else None
            if dump is not None:
                options = {**options, "dump_json_qnn_graph": "1", "json_qnn_graph_dir": str(dump)}
            source, count = model, None
            if not args.fp16:  # the HTP's RmsNorm rounds down: compensated where it is compiled
                source, more, count = htp_model(model)
                config = {**config, **more}
            htp_session(source, fp16=args.fp16, extra_options=options, session_config=config, optimize=False)
            if dump is not None:
                summary = context_summary(compiled)
                result["facts"][Path(compiled).name] = {
                    "qnn_partitions": summary["epcontext_nodes"], "cpu_nodes": summary["other_nodes"],
                    "qnn_ops": parse_qnn_graph_dir(dump).get("total"), "norm_rounding_matmuls": count}
        else:
            result["stage"] = "session"
            write()
            sess = htp_session(compiled, fp16=args.fp16, extra_options=options, session_config=shared,
                               disable_cpu_fallback=True)
            result["stage"] = "run"
            write()
            sess.run(None, _zero_inputs(sess))
        result["done"].append(Path(compiled).name)
        write()


def _run_child(mode: str, pairs: list[tuple[Path, Path]], fp16: bool, *, separate: bool = False,
               facts: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="qnnpasses_llm_") as tmp:
        args = [mode, "--result", str(Path(tmp) / "result.json"),
                "--pairs", json.dumps([[str(a), str(b)] for a, b in pairs])]
        args += ([] if fp16 else ["--int"]) + (["--separate"] if separate else [])
        args += ["--facts", str(Path(tmp) / "qnn_graph")] if facts else []
        child = run_child("qnnpasses.llm.compile", args, Path(tmp) / "result.json")
    result = child.result or {"ok": False, "done": []}
    if not child.ok:
        step = len(result.get("done", []))
        stage = f" ({result['stage']})" if result.get("stage") else ""
        what = f"{'separate' if separate else 'shared'} {mode}"
        tail = child.stderr_tail if child.returncode and child.returncode > 0 else []
        result.update(ok=False, error=f"{what}: {child.crash or 'failed'} at graph {step + 1} of {len(pairs)}{stage}"
                      + (f" ({tail[0][:200]})" if tail else ""), killed=child.returncode == -signal.SIGKILL)
    return result


def probe(model: Path, *, fp16: bool = True) -> dict[str, Any]:
    """Placement (QNN partitions: the EPContext nodes of a compile; CPU nodes: the other nodes)
    and composed QNN op count of ``model``, compiled in a child process into a temporary folder.
    Nothing runs: preparing the graph is what the backend must accept."""
    with tempfile.TemporaryDirectory(prefix="qnnpasses_llm_place_") as tmp:
        compiled = Path(tmp) / "probe_ctx.onnx"
        result = _run_child("compile", [(model, compiled)], fp16, separate=True, facts=True)
    facts = (result.get("facts") or {}).get(compiled.name, {})
    return {"ok": bool(result.get("ok")), "error": result.get("error"), **{k: facts.get(k) for k in
            ("qnn_partitions", "cpu_nodes", "qnn_ops", "norm_rounding_matmuls")}}


def _remove(paths: list[Path]) -> None:
    for path in paths:
        for stale in [path, *path.parent.glob(f"{path.stem}*_qnn.bin")]:
            if stale.exists():
                stale.unlink()


#: the verdict of :func:`backend_shares_weights` per target, for this process
_SHARING: dict[str, dict[str, Any]] = {}


def _toy_pair(folder: Path) -> list[tuple[Path, Path]]:
    """Two graphs that read the same two 64 x 64 weights, on 8 tokens and on 1 (prefill and
    decode in miniature), with inline weights."""
    import onnx
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array((rng.standard_normal((64, 64)) / 8).astype(np.float32), f"w{i}")
               for i in range(2)]
    pairs = []
    for name, tokens in (("toy_prefill", 8), ("toy_decode", 1)):
        nodes = [helper.make_node("MatMul", ["x", "w0"], ["h"]), helper.make_node("MatMul", ["h", "w1"], ["y"])]
        graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", 1, [1, tokens, 64])],
                                  [helper.make_tensor_value_info("y", 1, [1, tokens, 64])], weights)
        path = folder / f"{name}.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
        pairs.append((path, folder / f"{name}_ctx.onnx"))
    return pairs


def backend_shares_weights() -> dict[str, Any]:
    """Whether the backend runs a weight-shared context at all, tried on a toy pair (seconds, in
    child processes) before a real pair is compiled that way: a backend that cannot create a
    session on a toy shared context (onnxruntime-qnn 2.7.0's simulated HTP crashes there) cannot
    on a real one, and the real attempt costs two more compiles of the whole model.  Once per
    target and process."""
    from qnnpasses.backends.targets import active

    name = active().name
    if name not in _SHARING:
        with tempfile.TemporaryDirectory(prefix="qnnpasses_share_") as tmp:
            pairs = _toy_pair(Path(tmp))
            compiled = _run_child("compile", pairs, True)
            ran = _run_child("run", pairs, True) if compiled.get("ok") else {"ok": False, "error": compiled.get("error")}
        _SHARING[name] = {"compile": compiled.get("ok", False), "run": ran.get("ok", False), "error": ran.get("error")}
    return _SHARING[name]


def compile_graphs(pairs: list[tuple[Path, Path]], *, fp16: bool = True, try_shared: bool = True) -> dict[str, Any]:
    """Compile each ``(model, compiled)`` pair; one weight-shared context if that runs, else one
    each.  Every context binary is a ``*_qnn.bin`` file beside its EPContext model (what Genie
    loads, and no 2 GB protobuf limit for the others).

    Returns ``{"weight_sharing": "shared"|"separate", "shared_probe": {...}, "graphs": {name:
    summary}, "placement": {name: {qnn_partitions, cpu_nodes, qnn_ops}}, "files": [binaries],
    "child_private_peak_bytes": the largest compile child's sampled private memory}``: the
    placement is the compile's own, so no graph is prepared twice.
    """
    report: dict[str, Any] = {}
    targets = [b for _, b in pairs]
    _remove(targets)
    result: dict[str, Any] = {"ok": False}
    if try_shared:
        toy = backend_shares_weights()
        if toy["run"]:
            result = _run_child("compile", pairs, fp16, facts=True)
            ran = _run_child("run", pairs, fp16) if result.get("ok") else {"ok": False, "error": result.get("error")}
            report["shared_probe"] = {"on": "this pair", "compile": result.get("ok", False),
                                      "run": ran.get("ok", False), "error": ran.get("error")}
            if not ran.get("ok"):
                result = {"ok": False}
                _remove(targets)
        else:
            report["shared_probe"] = {"on": "a toy pair (two graphs reading two 64x64 weights)", **toy}
    report["weight_sharing"] = "shared" if result.get("ok") else "separate"
    if not result.get("ok"):
        from qnnpasses.progress import step

        step(f"compiling {len(pairs)} graph(s) into HTP context binaries")
        result = {"ok": True, "facts": {}, "private_peak_bytes": 0}
        for pair in pairs:  # one child each: the backend's memory is bounded by one graph, not the sum
            one = _run_child("compile", [pair], fp16, separate=True, facts=True)
            if not one.get("ok"):
                from qnnpasses.errors import CheckFailedError

                raise CheckFailedError(f"compiling {pair[0].name} for the HTP failed: {one.get('error')}"
                                       + (OUT_OF_MEMORY_HINT if one.get("killed") else ""))
            result["facts"].update(one.get("facts") or {})
            result["private_peak_bytes"] = max(result["private_peak_bytes"], one.get("private_peak_bytes") or 0)
    report["graphs"] = {b.name: context_summary(b) for b in targets}
    report["placement"] = result.get("facts", {})
    report["child_private_peak_bytes"] = result.get("private_peak_bytes")
    report["files"] = sorted(p.name for p in targets[0].parent.glob("*_qnn.bin"))
    return report


if __name__ == "__main__":  # pragma: no cover - the child process
    sys.exit(_child())
