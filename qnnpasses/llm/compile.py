"""Compile the prefill + decode graphs to EPContext models, weight-shared when the backend allows.

The prefill and decode graphs hold the same weights.  onnxruntime-qnn can put several
graphs in one QNN context whose weights are stored once: session config
``ep.share_ep_contexts=1`` on every session of the group (``ep.stop_share_ep_contexts=1`` on
the last) and the provider option ``enable_htp_weight_sharing=1``, with the binary beside the
models (``ep.context_embed_mode=0``).  Whether a *session* on such a pair then works is a
property of the onnxruntime-qnn build: with 2.7.0 on x86 creating the second graph's session
crashes the process (SIGSEGV).  So the shared pair is compiled and then run in a child
process; if that child fails in any way, the shared files are deleted and every graph is
compiled to its own context (``separate``).  The outcome and the reason go to the manifest.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from qnnpasses.handoff.epcontext import CHILD_TIMEOUT, compile_model, context_summary

SHARE_OPTIONS = {"enable_htp_weight_sharing": "1"}


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
    """``compile``: one process compiles every model into one shared context; ``run``: load and run them."""
    from qnnpasses.backends.htp import htp_session

    parser = argparse.ArgumentParser(prog="python -m qnnpasses.llm.compile")
    parser.add_argument("mode", choices=("compile", "run"))
    parser.add_argument("--pairs", required=True, help="JSON list of [model, compiled] paths")
    parser.add_argument("--result", required=True)
    parser.add_argument("--no-fp16", dest="fp16", action="store_false")
    args = parser.parse_args(argv)
    pairs = json.loads(args.pairs)
    result: dict[str, Any] = {"ok": False, "done": []}
    Path(args.result).write_text(json.dumps(result))
    for index, (model, compiled) in enumerate(pairs):
        config = _share_config(index == len(pairs) - 1)
        if args.mode == "compile":
            config.update({"ep.context_enable": "1", "ep.context_file_path": compiled, "ep.context_embed_mode": "0"})
            htp_session(model, fp16=args.fp16, extra_options=SHARE_OPTIONS, session_config=config)
        else:
            result["stage"] = "session"
            Path(args.result).write_text(json.dumps(result))
            sess = htp_session(compiled, fp16=args.fp16, extra_options=SHARE_OPTIONS, session_config=config,
                               disable_cpu_fallback=True)
            result["stage"] = "run"
            Path(args.result).write_text(json.dumps(result))
            sess.run(None, _zero_inputs(sess))
        result["done"].append(Path(compiled).name)
        Path(args.result).write_text(json.dumps(result))  # progress survives a crash of the next step
    result["ok"] = True
    Path(args.result).write_text(json.dumps(result))
    return 0


def _run_child(mode: str, pairs: list[tuple[Path, Path]], fp16: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="qnnpasses_llm_") as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "qnnpasses.llm.compile", mode, "--result", str(result_path),
               "--pairs", json.dumps([[str(a), str(b)] for a, b in pairs])] + ([] if fp16 else ["--no-fp16"])
        try:
            proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=CHILD_TIMEOUT, check=False)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"shared {mode}: timed out after {CHILD_TIMEOUT:g}s"}
        result = json.loads(result_path.read_text()) if result_path.exists() else {"ok": False, "done": []}
    if proc.returncode != 0 or not result.get("ok"):
        from qnnpasses.backends.htp import _describe_exit

        how = _describe_exit(proc.returncode) or "failed"
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] if proc.stderr else []
        step = len(result.get("done", []))
        stage = f" ({result['stage']})" if result.get("stage") else ""
        result.update(ok=False, error=f"shared {mode}: {how} at graph {step + 1} of {len(pairs)}{stage}"
                      + (f" ({tail[0][:200]})" if tail and proc.returncode > 0 else ""))
    return result


def _remove(paths: list[Path]) -> None:
    for path in paths:
        for stale in [path, *path.parent.glob(f"{path.stem}*_qnn.bin")]:
            if stale.exists():
                stale.unlink()


def compile_graphs(pairs: list[tuple[Path, Path]], *, fp16: bool = True, try_shared: bool = True) -> dict[str, Any]:
    """Compile each ``(model, compiled)`` pair; one weight-shared context if that runs, else one each.

    Returns ``{"weight_sharing": "shared"|"separate", "shared_probe": {...}, "graphs": {name: summary}}``.
    """
    report: dict[str, Any] = {}
    targets = [b for _, b in pairs]
    _remove(targets)
    if try_shared:
        compiled = _run_child("compile", pairs, fp16)
        probe = _run_child("run", pairs, fp16) if compiled.get("ok") else {"ok": False, "error": compiled.get("error")}
        report["shared_probe"] = {"compile": compiled.get("ok", False), "run": probe.get("ok", False),
                                  "error": probe.get("error")}
        if probe.get("ok"):
            report["weight_sharing"] = "shared"
            report["graphs"] = {b.name: context_summary(b) for b in targets}
            report["files"] = sorted(p.name for p in targets[0].parent.glob("*_qnn.bin"))
            return report
        _remove(targets)
    report["weight_sharing"] = "separate"
    graphs = {}
    for model, out in pairs:
        result = compile_model(model, out, fp16=fp16, embed=True)
        if not result.get("ok"):
            raise RuntimeError(f"compiling {Path(model).name} failed: {result.get('error')}")
        graphs[out.name] = context_summary(out)
    report["graphs"] = graphs
    return report


if __name__ == "__main__":  # pragma: no cover - the child process
    sys.exit(_child())
