"""Compile a model for the HTP for real, without the QNN SDK: an EPContext model.

The ONNX Runtime QNN EP can dump the graph it prepared for the HTP as a context binary
wrapped in an ONNX model of ``com.microsoft::EPContext`` nodes.  It does so when the
session is created with the session config entries (ONNX Runtime "EP Context Design"
page, "OnnxRuntime Session Options Related to EP Context Cache Generation"):

* ``ep.context_enable`` = ``1`` — dump the EPContext model;
* ``ep.context_file_path`` — where to write it;
* ``ep.context_embed_mode`` — ``1`` puts the context binary inside the model (protobuf caps
  a model at 2 GB), ``0`` writes ``<name>_qnn.bin`` beside it.

Loading that model skips graph preparation, which is the point ("very slow first run ->
cache the compiled context").  Every session here runs in a fresh child process
(``python -m qnnpasses.handoff.epcontext``): the backend may abort its process on a failed
finalize, and a fair load-time comparison needs a cold process for each side.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from qnnpasses.backends.child import run_child

EMBED_LIMIT_BYTES = 2_000_000_000


# --------------------------------------------------------------------------- child side


def _session(model: str, *, fp16: bool, config: dict[str, str] | None = None) -> tuple[Any, int | None]:
    """The session, and in integer mode how many MatMuls the RmsNorm compensation changed
    (:func:`qnnpasses.quant.norm_rounding.htp_model`: what the HTP is given is compensated)."""
    from qnnpasses.backends.htp import htp_session

    if fp16:
        return htp_session(model, fp16=True, session_config=config), None
    from qnnpasses.quant.norm_rounding import htp_model

    source, more, count = htp_model(model)
    return htp_session(source, fp16=False, session_config={**(config or {}), **more} or None), count


def _child(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qnnpasses.handoff.epcontext")
    parser.add_argument("mode", choices=("compile", "load"))
    parser.add_argument("model")
    parser.add_argument("--result", required=True)
    parser.add_argument("--out")
    parser.add_argument("--embed", default="1")
    parser.add_argument("--no-fp16", dest="fp16", action="store_false")
    parser.add_argument("--inputs")
    parser.add_argument("--outputs")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"ok": False}
    try:
        config = None
        if args.mode == "compile":
            config = {"ep.context_enable": "1", "ep.context_file_path": args.out, "ep.context_embed_mode": args.embed}
        start = time.perf_counter()
        sess, compensated = _session(args.model, fp16=args.fp16, config=config)
        result["session_seconds"] = time.perf_counter() - start
        if compensated is not None:
            result["norm_rounding_matmuls"] = compensated
        if args.inputs:
            with np.load(args.inputs) as data:
                feeds = {k: data[k] for k in data.files}
            names = [o.name for o in sess.get_outputs()]
            start = time.perf_counter()
            values = sess.run(names, {i.name: feeds[i.name] for i in sess.get_inputs()})
            result["run_seconds"] = time.perf_counter() - start
            np.savez(args.outputs, **dict(zip(names, values)))
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        result["error"] = str(exc).strip().splitlines()[0][:400] if str(exc).strip() else type(exc).__name__
    Path(args.result).write_text(json.dumps(result))
    return 0


# --------------------------------------------------------------------------- parent side


def _run_child(args: list[str], work: Path, tag: str) -> dict[str, Any]:
    child = run_child("qnnpasses.handoff.epcontext", [*args, "--result", str(work / f"{tag}.json")], work / f"{tag}.json")
    if child.result is None:
        why = child.crash or f"backend process exited with status {child.returncode}"
        return {"ok": False, "error": f"{tag}: {why} {' '.join(child.stderr_tail)}".strip()}
    return child.result


def compile_model(model: str | Path, out: str | Path, *, fp16: bool = True, embed: bool | None = None,
                  weight_bytes: int | None = None) -> dict[str, Any]:
    """Create the EPContext model ``out`` from ``model``; ``embed=None`` embeds below 2 GB."""
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    if embed is None:
        embed = (weight_bytes or 0) < EMBED_LIMIT_BYTES
    for stale in (out, out.with_name(f"{out.stem}_qnn.bin")):
        if stale.exists():
            stale.unlink()  # the EP refuses to overwrite an existing context model
    from qnnpasses.progress import step

    step(f"compiling {Path(model).name} into an HTP context binary")
    with tempfile.TemporaryDirectory(prefix="qnnpasses_ctx_") as tmp:
        args = ["compile", str(model), "--out", str(out), "--embed", "1" if embed else "0"]
        result = _run_child(args + ([] if fp16 else ["--no-fp16"]), Path(tmp), "compile")
    result["embedded"] = embed
    result["files"] = sorted(p.name for p in out.parent.glob(f"{out.stem}*") if p.is_file())
    if result.get("ok") and not out.exists():
        result.update(ok=False, error="the QNN EP created a session but wrote no EPContext model")
    return result


def timed_load(model: str | Path, inputs: dict[str, np.ndarray], *, fp16: bool = True) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Session-creation time of ``model`` on the HTP in a fresh process, and its outputs."""
    from qnnpasses.progress import step

    step(f"loading {Path(model).name} on the HTP in a fresh process and running it")
    with tempfile.TemporaryDirectory(prefix="qnnpasses_load_") as tmp:
        work = Path(tmp)
        np.savez(work / "inputs.npz", **inputs)
        args = ["load", str(model), "--inputs", str(work / "inputs.npz"), "--outputs", str(work / "outputs.npz")]
        result = _run_child(args + ([] if fp16 else ["--no-fp16"]), work, "load")
        outputs: dict[str, np.ndarray] = {}
        if result.get("ok"):
            with np.load(work / "outputs.npz") as data:
                outputs = {k: data[k] for k in data.files}
    return result, outputs


def context_summary(path: str | Path) -> dict[str, Any]:
    """EPContext nodes vs other nodes (CPU fallback) in a compiled model."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    ctx = [n for n in proto.graph.node if n.op_type == "EPContext"]
    embed = [next((a.i for a in n.attribute if a.name == "embed_mode"), None) for n in ctx]
    # with embed_mode 0 the node names the context binary file (relative to the model); the other
    # nodes of a context split into several graphs (main_context 0) name none: they are in the main one's
    binaries = [a.s.decode() for n, mode in zip(ctx, embed) if mode == 0
                for a in n.attribute if a.name == "ep_cache_context"]
    return {"epcontext_nodes": len(ctx), "other_nodes": len(proto.graph.node) - len(ctx),
            "other_op_types": sorted({n.op_type for n in proto.graph.node if n.op_type != "EPContext"}),
            "embed_mode": embed, "binaries": binaries, "bytes": os.path.getsize(path)}


if __name__ == "__main__":
    raise SystemExit(_child())
