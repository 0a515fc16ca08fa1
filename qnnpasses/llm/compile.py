"""Compile the prefill + decode graphs to EPContext models, weight-shared when the backend allows.

The prefill and decode graphs hold the same weights.  onnxruntime-qnn can put several
graphs in one QNN context whose weights are stored once: session config
``ep.share_ep_contexts=1`` on every session of the group (``ep.stop_share_ep_contexts=1`` on
the last) and the provider option ``enable_htp_weight_sharing=1``, with the binary beside the
models (``ep.context_embed_mode=0``).  Whether a *session* on such a pair then works is a
property of the onnxruntime-qnn build (the process can crash creating one).  So the shared
pair is compiled and then run in a child process; if that child fails in any way, the shared
files are deleted and every graph is compiled to its own context (``separate``, binary
embedded, or in its own ``*_qnn.bin`` file for runtimes that load binaries, as Genie does).  The outcome and the reason go to the manifest and the report.

Sessions that compile or probe a graph run with onnxruntime's graph optimizations disabled:
the HTP gets exactly the graph ``htp-llm`` wrote.  (onnxruntime's MatMulAddFusion otherwise
fuses a projection and a residual Add whose other operand is a graph input -- the first layer
of a part -- into a Gemm the HTP rejects.)

Quantized (QDQ) graphs are compiled in integer precision with
``offload_graph_io_quantization=0``: the HTP then also takes the graph-boundary Q/DQ nodes
(onnxruntime otherwise runs them on the CPU), so the compiled model is one EPContext node.
:func:`probe` measures placement (QNN partitions, CPU nodes with CPU fallback disabled) and
the composed QNN op count with the same options, in a child process.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from qnnpasses.backends.child import run_child
from qnnpasses.handoff.epcontext import context_summary

SHARE_OPTIONS = {"enable_htp_weight_sharing": "1"}
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
    """Modes: ``compile`` each model (shared context unless ``--separate``), ``run`` the compiled
    models, ``place`` a model once with profiling and a QNN graph dump."""
    from qnnpasses.backends.htp import htp_session, parse_profile, parse_qnn_graph_dir

    parser = argparse.ArgumentParser(prog="python -m qnnpasses.llm.compile")
    parser.add_argument("mode", choices=("compile", "run", "place"))
    parser.add_argument("--pairs", required=True, help="JSON list of [model, compiled] paths")
    parser.add_argument("--result", required=True)
    parser.add_argument("--separate", action="store_true", help="one context per model, embedded")
    parser.add_argument("--external", action="store_true", help="with --separate: each binary in its own file")
    parser.add_argument("--int", dest="fp16", action="store_false", help="integer precision (QDQ models)")
    args = parser.parse_args(argv)
    pairs = json.loads(args.pairs)
    result: dict[str, Any] = {"ok": False, "done": []}

    def write() -> None:  # progress survives a crash of the next step
        Path(args.result).write_text(json.dumps(result))

    write()
    base = {} if args.fp16 else dict(INT_OPTIONS)
    for index, (model, compiled) in enumerate(pairs):
        shared = {} if args.separate else _share_config(index == len(pairs) - 1)
        options = base if args.separate else {**base, **SHARE_OPTIONS}
        if args.mode == "compile":
            config = {**shared, "ep.context_enable": "1", "ep.context_file_path": compiled,
                      "ep.context_embed_mode": "1" if args.separate and not args.external else "0"}
            htp_session(model, fp16=args.fp16, extra_options=options, session_config=config, optimize=False)
        elif args.mode == "run":
            result["stage"] = "session"
            write()
            sess = htp_session(compiled, fp16=args.fp16, extra_options=options, session_config=shared,
                               disable_cpu_fallback=True)
            result["stage"] = "run"
            write()
            sess.run(None, _zero_inputs(sess))
        else:
            work = Path(compiled)
            work.mkdir(parents=True, exist_ok=True)
            options = {**base, "dump_json_qnn_graph": "1", "json_qnn_graph_dir": str(work / "qnn_graph")}
            sess = htp_session(model, fp16=args.fp16, extra_options=options, disable_cpu_fallback=True, profiling=True,
                               profile_prefix=str(work / "profile"), optimize=False)
            sess.run(None, _zero_inputs(sess))
            partitions, cpu = parse_profile(sess.end_profiling())
            result.update(qnn_partitions=partitions, cpu_nodes=len(cpu),
                          qnn_ops=parse_qnn_graph_dir(work / "qnn_graph").get("total"))
        result["done"].append(Path(compiled).name)
        write()
    result["ok"] = True
    write()
    return 0


def _run_child(mode: str, pairs: list[tuple[Path, Path]], fp16: bool, *, separate: bool = False,
               external: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="qnnpasses_llm_") as tmp:
        args = [mode, "--result", str(Path(tmp) / "result.json"),
                "--pairs", json.dumps([[str(a), str(b)] for a, b in pairs])]
        args += ([] if fp16 else ["--int"]) + (["--separate"] if separate else []) + (["--external"] if external else [])
        child = run_child("qnnpasses.llm.compile", args, Path(tmp) / "result.json")
    result = child.result or {"ok": False, "done": []}
    if not child.ok:
        step = len(result.get("done", []))
        stage = f" ({result['stage']})" if result.get("stage") else ""
        what = f"{'separate' if separate else 'shared'} {mode}" if mode != "place" else "placement"
        tail = child.stderr_tail if child.returncode and child.returncode > 0 else []
        result.update(ok=False, error=f"{what}: {child.crash or 'failed'} at graph {step + 1} of {len(pairs)}{stage}"
                      + (f" ({tail[0][:200]})" if tail else ""))
    return result


def probe(model: Path, *, fp16: bool = True) -> dict[str, Any]:
    """Placement (CPU fallback disabled) and composed QNN op count of ``model``, in a child process."""
    with tempfile.TemporaryDirectory(prefix="qnnpasses_llm_place_") as tmp:
        result = _run_child("place", [(model, Path(tmp) / "work")], fp16)
    return {k: result.get(k) for k in ("ok", "error", "qnn_partitions", "cpu_nodes", "qnn_ops")}


def _remove(paths: list[Path]) -> None:
    for path in paths:
        for stale in [path, *path.parent.glob(f"{path.stem}*_qnn.bin")]:
            if stale.exists():
                stale.unlink()


def compile_graphs(pairs: list[tuple[Path, Path]], *, fp16: bool = True, try_shared: bool = True,
                   embed: bool = True) -> dict[str, Any]:
    """Compile each ``(model, compiled)`` pair; one weight-shared context if that runs, else one each
    (``embed``: each binary inside its EPContext model; else in a ``*_qnn.bin`` file beside it, which
    is what Genie loads).

    Returns ``{"weight_sharing": "shared"|"separate", "shared_probe": {...}, "graphs": {name: summary}}``.
    """
    report: dict[str, Any] = {}
    targets = [b for _, b in pairs]
    _remove(targets)
    if try_shared:
        compiled = _run_child("compile", pairs, fp16)
        probe_run = _run_child("run", pairs, fp16) if compiled.get("ok") else {"ok": False, "error": compiled.get("error")}
        report["shared_probe"] = {"compile": compiled.get("ok", False), "run": probe_run.get("ok", False),
                                  "error": probe_run.get("error")}
        if probe_run.get("ok"):
            report["weight_sharing"] = "shared"
            report["graphs"] = {b.name: context_summary(b) for b in targets}
            report["files"] = sorted(p.name for p in targets[0].parent.glob("*_qnn.bin"))
            return report
        _remove(targets)
    report["weight_sharing"] = "separate"
    from qnnpasses.progress import step

    step(f"compiling {len(pairs)} graph(s) into HTP context binaries")
    result = _run_child("compile", pairs, fp16, separate=True, external=not embed)
    if not result.get("ok"):
        from qnnpasses.errors import CheckFailedError

        raise CheckFailedError(f"compiling for the HTP failed: {result.get('error')}")
    report["graphs"] = {b.name: context_summary(b) for b in targets}
    if not embed:
        report["files"] = sorted(p.name for p in targets[0].parent.glob("*_qnn.bin"))
    return report


if __name__ == "__main__":  # pragma: no cover - the child process
    sys.exit(_child())
