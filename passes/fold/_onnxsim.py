"""onnxsim for ``simplify``, isolated in a long-lived worker process.

onnxsim is C++: on a model it cannot handle it may raise, hang, or take the whole
process down with a segfault.  It therefore runs in a spawned worker (its 2-6 s import
is paid once per process, not per call); a crash or a timeout kills only the worker,
which is restarted on the next call, and the caller falls back to our own folding.

Only onnxsim's constant folding and shape inference run (``perform_optimization=False``):
its optimizer also fuses (MatMul+Add into Gemm wrapped in Reshapes, QKV concatenation,
...), which would change the structure that the later, HTP-specific passes match.  The
size threshold is ours (``max_fold_bytes``), so both folders agree on what may grow.

The result is re-imported; initializers that onnxsim kept under their name (the weights)
take back their original, possibly memory-mapped, values so that no weight is copied.
"""

from __future__ import annotations

import atexit
import inspect
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from qnnpasses.ir.model import IRModel, to_model_bytes

_lock = threading.Lock()
_worker: subprocess.Popen | None = None


class OnnxsimFailed(RuntimeError):
    """onnxsim raised, crashed, timed out or changed the model's interface."""


def _serve() -> None:
    """Worker loop (``python -m``): one JSON request per stdin line, one JSON reply per line.

    The protocol keeps a private copy of stdout; fd 1 goes to /dev/null so that whatever
    onnxsim prints (from Python or C++) cannot corrupt the replies.
    """
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    # Some onnxsim builds import torch for optional features (2-4 s); folding never needs it.
    sys.modules.setdefault("torch", None)
    import onnxsim  # the expensive import, once per worker

    for line in sys.stdin:
        request = json.loads(line)
        try:
            model, ok = onnxsim.simplify(onnx.load(request["src"]), **_simplify_options(onnxsim, request))
            if not ok:
                raise RuntimeError("onnxsim's own check failed")
            onnx.save(model, request["dst"])
            error = None
        except BaseException as exc:  # report everything; the parent decides
            text = str(exc).strip()
            error = f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"
        replies.write(json.dumps({"error": error}) + "\n")
        replies.flush()


def _simplify_options(onnxsim, request: dict) -> dict:
    """Folding only, no self-check and no proofs, with the options this onnxsim version has."""
    wanted = {"perform_optimization": False, "check_n": 0, "certify": False,
              "tensor_size_threshold": f"{request['threshold']}B"}
    accepted = inspect.signature(onnxsim.simplify).parameters
    return {k: v for k, v in wanted.items() if k in accepted}


def worker_command() -> list[str]:
    """How the worker is started (tests substitute a crashing or hanging one)."""
    return [sys.executable, "-m", __name__]


def _get_worker() -> subprocess.Popen:
    global _worker
    if _worker is None or _worker.poll() is not None:
        _worker = subprocess.Popen(worker_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL, text=True)
        atexit.register(_kill_worker)
    return _worker


def _kill_worker() -> None:
    global _worker
    if _worker is not None:
        _worker.kill()
        _worker.wait(10)
        _worker = None


def simplify_model_bytes(model: bytes, max_fold_bytes: int, timeout: float) -> onnx.ModelProto:
    """Run onnxsim (folding only) on a serialized model in the worker; raise OnnxsimFailed."""
    with _lock, tempfile.TemporaryDirectory(prefix="qnnpasses-onnxsim-") as tmp:
        src, dst = Path(tmp) / "in.onnx", Path(tmp) / "out.onnx"
        src.write_bytes(model)
        worker = _get_worker()
        try:
            worker.stdin.write(json.dumps({"src": str(src), "dst": str(dst), "threshold": int(max_fold_bytes)}) + "\n")
            worker.stdin.flush()
            ready, _, _ = select.select([worker.stdout], [], [], timeout)
            if not ready:
                _kill_worker()
                raise OnnxsimFailed(f"onnxsim timed out after {timeout:g}s")
            line = worker.stdout.readline()
        except (OSError, ValueError):  # broken pipe: the worker is gone
            line = ""
        if not line:
            code = worker.poll()
            _kill_worker()
            raise OnnxsimFailed(f"onnxsim worker died (exit code {code})")
        error = json.loads(line)["error"]
        if error:
            raise OnnxsimFailed(f"onnxsim raised {error}")
        return onnx.load(str(dst))


def onnxsim_graph(ir: IRModel, max_fold_bytes: int, timeout: float) -> gs.Graph:
    """The IR's graph after onnxsim, with the original weights' values reused."""
    proto = simplify_model_bytes(to_model_bytes(ir), max_fold_bytes, timeout)
    graph = gs.import_onnx(proto)
    _check_interface(ir.graph, graph)
    _reuse_weights(ir.graph, graph)
    _name_nodes(graph)
    return graph


def _dtype_name(tensor: gs.Tensor) -> str:
    try:
        return np.dtype(tensor.dtype).name
    except TypeError:  # bfloat16 & co. are onnx enum values
        return str(tensor.dtype)


def _io(graph: gs.Graph) -> tuple[list, list]:
    def sig(tensors):
        return [(t.name, _dtype_name(t)) for t in tensors]
    return sig(graph.inputs), sig(graph.outputs)


def _check_interface(old: gs.Graph, new: gs.Graph) -> None:
    if _io(old) != _io(new):
        raise OnnxsimFailed("onnxsim changed the graph inputs/outputs; result discarded")


def _reuse_weights(old: gs.Graph, new: gs.Graph) -> None:
    """Give constants that kept their name and value back their original (lazy) values."""
    originals = {n: t for n, t in old.tensors().items() if isinstance(t, gs.Constant)}
    for name, tensor in new.tensors().items():
        orig = originals.get(name)
        if not isinstance(tensor, gs.Constant) or orig is None:
            continue
        if tuple(orig.shape) != tuple(tensor.shape) or _dtype_name(orig) != _dtype_name(tensor):
            continue
        if np.array_equal(np.asarray(orig.values), np.asarray(tensor.values)):
            tensor._values = orig._values


def _name_nodes(graph: gs.Graph) -> None:
    seen: set[str] = set()
    for index, node in enumerate(graph.nodes):
        name = node.name or f"{node.op}_sim{index}"
        while name in seen:
            name = f"{name}_"
        node.name = name
        seen.add(name)


if __name__ == "__main__":
    _serve()
