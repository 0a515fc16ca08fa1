"""The one door to the real Qualcomm QNN HTP backend (the onnxruntime-qnn plugin EP).

Everything in qnnpasses that needs the backend — probing op support, ``check --real``,
accuracy checks — goes through this module, so the quirks live in one place:

* the plugin EP library must be registered once per process (a second registration fails);
* float32 graphs need ``enable_htp_fp16_precision=1`` plus a ``soc_model`` to run on HTP;
  without it several float ops (RMSNormalization, Gelu, Gather, ...) pass validation and then
  fail to *finalize* ("could not create op"), because HTP has no float32 kernel for them;
* onnxruntime's Python wrapper silently re-runs a model on the CPU EP when an HTP run fails;
  :func:`htp_session` turns that off, so "HTP outputs" are never CPU outputs;
* the backend logs to the process's stderr file descriptor (not Python's ``sys.stderr``),
  and a failed graph finalize can take the whole process down (seen: SIGSEGV on a rank-5
  int64 Unsqueeze).  :func:`probe_placement`
  therefore runs the session in a child process (``python -m qnnpasses.backends.htp``), captures
  that descriptor to a file, and parses placement, per-node validation verdicts, backend
  errors and the composed QNN graph out of the artefacts.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Union

import numpy as np
import onnxruntime as ort

from qnnpasses.backends.child import run_child, strip_ansi

ModelArg = Union[str, bytes, "os.PathLike[str]"]

EP_NAME = "QNNExecutionProvider"

_register_lock = threading.Lock()
_registered = False


# --------------------------------------------------------------------------- backend log

#: Lines the backend libraries printed (ANSI colour codes removed), oldest first; the command
#: line summarises them, and prints them with ``-v``.
BACKEND_LOG: list[str] = []
#: Off in the probe child, whose parent reads the raw log from the child's stderr.
_capture = True


@contextlib.contextmanager
def captured_backend_output() -> Iterator[None]:
    """Collect what onnxruntime and the QNN libraries write to the process's stdout/stderr
    file descriptors (their log bypasses Python) into :data:`BACKEND_LOG`."""
    if not _capture:
        yield
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with tempfile.TemporaryFile() as sink:
        saved = [os.dup(1), os.dup(2)]
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            yield
        finally:
            _flush_c_stdio()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            sink.seek(0)
            text = sink.read().decode("utf-8", errors="replace")
            BACKEND_LOG.extend(line.strip() for line in strip_ansi(text).splitlines() if line.strip())


def _flush_c_stdio() -> None:
    """Flush C stdio buffers, so the libraries' buffered lines land in the capture."""
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except Exception:  # noqa: BLE001 - best effort: without it a line may appear later
        pass


# --------------------------------------------------------------------------- sessions


def _qnn_module() -> Any:
    from qnnpasses.errors import BackendUnavailableError

    try:
        import onnxruntime_qnn
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise BackendUnavailableError("onnxruntime-qnn is not installed (pip install onnxruntime-qnn)") from exc
    return onnxruntime_qnn


def _qnn_devices() -> list[Any]:
    """The QNN EP devices, registering the plugin library on first use in this process."""
    global _registered
    oq = _qnn_module()
    with _register_lock:
        if not _registered:
            already = any(d.ep_name == EP_NAME for d in ort.get_ep_devices())
            if not already:
                ort.register_execution_provider_library(EP_NAME, oq.get_library_path())
            _registered = True
    return [d for d in ort.get_ep_devices() if d.ep_name == EP_NAME]


NOT_INSTALLED, BROKEN, AVAILABLE = "not-installed", "broken", "available"


def htp_status() -> tuple[str, str]:
    """``(state, reason)``: AVAILABLE; NOT_INSTALLED (onnxruntime-qnn is not there: a
    declared limitation); or BROKEN (installed, but the EP does not load or offers no
    device: an error, never to be mistaken for "not installed")."""
    from qnnpasses.errors import BackendUnavailableError

    try:
        devices = _qnn_devices()
    except BackendUnavailableError as exc:
        return NOT_INSTALLED, str(exc)
    except Exception as exc:  # noqa: BLE001 - whatever it is, it is reported, not swallowed
        return BROKEN, f"onnxruntime-qnn is installed but its EP failed to load: {type(exc).__name__}: {exc}"
    if not devices:
        return BROKEN, "onnxruntime-qnn is installed but its EP registered no QNN device"
    return AVAILABLE, ""


def htp_available() -> bool:
    """True when onnxruntime-qnn imports and its EP registers at least one device (see :func:`htp_status`)."""
    return htp_status()[0] == AVAILABLE


def provider_options(*, fp16: bool = True, backend: str = "htp", extra_options: dict | None = None,
                     target: Any = None) -> dict[str, str]:
    """QNN EP provider options for ``backend``: "htp", or QNN's "cpu" / "gpu" backends (for comparison).

    ``target``: the :class:`~qnnpasses.backends.targets.Target` to name (default: the active one)."""
    from qnnpasses.backends.targets import active

    oq = _qnn_module()
    if backend == "htp":
        # the target is named in both precisions: without it quantized graphs fail to finalize
        # (QNN_COMMON_ERROR_MEM_ALLOC) and context binaries are prepared for no SoC in particular
        target = target or active()
        opts = {"backend_path": oq.get_qnn_htp_path(), "soc_model": str(target.soc_model),
                "htp_arch": str(target.htp_arch)}
        if fp16:
            opts["enable_htp_fp16_precision"] = "1"
    elif backend in ("cpu", "gpu"):
        opts = {"backend_path": oq.get_qnn_cpu_path() if backend == "cpu" else oq.get_qnn_gpu_path()}
    else:
        raise ValueError(f"unknown QNN backend {backend!r} (expected 'htp', 'cpu' or 'gpu')")
    opts.update({k: str(v) for k, v in (extra_options or {}).items()})
    return opts


@functools.lru_cache(maxsize=None)
def _target_refusal(target: Any) -> str | None:
    """None when the HTP backend prepares a three-node float graph for ``target`` with CPU fallback
    off; else the backend's first error line."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8])
    w = helper.make_tensor("w", TensorProto.FLOAT, [8, 8], np.eye(8, dtype=np.float32).ravel())
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["m"]),
                               helper.make_node("Softmax", ["m"], ["s"], axis=-1),
                               helper.make_node("Mul", ["s", "x"], ["y"])], "target_probe", [x], [y], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    try:
        htp_session(model.SerializeToString(), fp16=True, disable_cpu_fallback=True, target=target)
    except Exception as exc:  # noqa: BLE001 - the backend's refusal, reported as one line
        return str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    return None


def check_target(target: Any) -> None:
    """BadInputError when the HTP backend installed here does not accept ``target``; nothing when
    it does, or when there is no backend to ask (the commands that need one say so themselves)."""
    from qnnpasses.backends.targets import DEFAULT
    from qnnpasses.errors import BadInputError

    if target == DEFAULT or not htp_available():
        return
    error = _target_refusal(target)
    if error is not None:
        import importlib.metadata

        version = importlib.metadata.version("onnxruntime-qnn")
        raise BadInputError(f"the HTP backend here (onnxruntime-qnn {version}) does not accept {target}: "
                            "it leaves every node to the CPU")


def htp_session(
    model: ModelArg,
    *,
    fp16: bool = True,
    disable_cpu_fallback: bool = False,
    profiling: bool = False,
    verbose: bool = False,
    extra_options: dict | None = None,
    optimize: bool = True,
    backend: str = "htp",
    profile_prefix: str | None = None,
    session_config: dict[str, str] | None = None,
    target: Any = None,
) -> ort.InferenceSession:
    """An onnxruntime session with the QNN EP first and the CPU EP as fallback.

    ``model`` is a path or serialized model bytes.  ``fp16`` runs float32 tensors in fp16 on
    HTP (without it, float graphs may fail to finalize).  ``disable_cpu_fallback`` turns a
    partial placement into a session error.  ``profiling`` records per-kernel providers
    (call ``end_profiling()``).  ``verbose`` sets session *and process-wide default* logging
    to VERBOSE, which is what makes the EP print per-node "Validation PASSED/FAILED" lines
    (the backend's own ``<E>`` diagnostics appear only if the default logger was already
    verbose when the EP library registered — the probe child does that first).  ``optimize=False`` disables onnxruntime's
    graph optimizations so the EP sees the graph as written (no constant folding/fusion).
    ``session_config`` adds session config entries (e.g. ``ep.context_enable``).  ``target``:
    the device to name (default: the active target, :mod:`qnnpasses.backends.targets`).
    """
    devices = _qnn_devices()
    if not devices:
        from qnnpasses.errors import BackendUnavailableError

        raise BackendUnavailableError("the QNN execution provider registered no device")
    so = ort.SessionOptions()
    if verbose:
        so.log_severity_level = 0
        ort.set_default_logger_severity(0)
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if disable_cpu_fallback:
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    for key, value in (session_config or {}).items():
        so.add_session_config_entry(key, str(value))
    if profiling:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix or os.path.join(tempfile.gettempdir(), "qnnpasses_htp_profile")
    so.add_provider_for_devices(devices, provider_options(fp16=fp16, backend=backend, extra_options=extra_options,
                                                                 target=target))
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    from qnnpasses.progress import step

    step(f"preparing {Path(model).name if isinstance(model, str) else 'the model'} on the {backend.upper()} backend")
    with captured_backend_output():
        sess = ort.InferenceSession(model, sess_options=so)
    # onnxruntime's Python wrapper otherwise answers a failed HTP run by silently re-running
    # the whole model on the CPU EP: outputs that claim to be HTP's would be CPU's.
    sess.disable_fallback()
    return sess


def run_on_htp(model: ModelArg, inputs: dict[str, np.ndarray], **kw: Any) -> dict[str, np.ndarray]:
    """Run ``model`` once on HTP (keywords as :func:`htp_session`); outputs by name."""
    sess = htp_session(model, **kw)
    names = [o.name for o in sess.get_outputs()]
    with captured_backend_output():
        return dict(zip(names, sess.run(names, inputs)))


_NP_BY_ORT_TYPE = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int16)": np.int16,
    "tensor(int8)": np.int8,
    "tensor(uint16)": np.uint16,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


def synthetic_inputs(sess: ort.InferenceSession, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic feeds from the session's input metadata (symbolic dims become 1).

    Floats are standard normal; integers are zero (a valid index everywhere); bools False.
    """
    rng = np.random.default_rng(seed)
    feeds = {}
    for meta in sess.get_inputs():
        shape = [d if isinstance(d, int) and d >= 0 else 1 for d in meta.shape]
        dtype = _NP_BY_ORT_TYPE.get(meta.type)
        if dtype is None:
            raise ValueError(f"cannot synthesize input {meta.name!r} of type {meta.type}")
        if np.issubdtype(dtype, np.floating):
            feeds[meta.name] = rng.standard_normal(shape).astype(dtype)
        else:
            feeds[meta.name] = np.zeros(shape, dtype=dtype)
    return feeds


# --------------------------------------------------------------------------- placement


@dataclass
class NodeValidation:
    """The EP's verdict on one node: "Validation PASSED/FAILED ... REASON : ..."."""

    passed: bool
    reason: str
    op_type: str = ""


@dataclass
class Placement:
    """Where the real backend put a model's nodes, measured in a child process.

    ``ok``: the session was created and ran.  ``error``: one-line backend error, if any
    (also set when the session ran but the QNN backend failed to set up, leaving
    everything on the CPU EP).
    ``qnn_partitions``: QNN kernels (one per HTP partition).  ``cpu_nodes``: nodes run by
    the CPU EP.  ``validation``: node name -> ``{"passed", "reason", "op_type"}`` from the
    EP's last capability pass.  ``qnn_graph_ops``: ``{"total", "by_type", "graphs"}`` of
    the composed QNN graph(s).  ``backend_errors``: the backend's own error lines (such as
    ``could not create op: q::QNN_RmsNorm``), which explain vague EP reasons.
    """

    ok: bool
    error: str | None = None
    qnn_partitions: int = 0
    cpu_nodes: list[str] = field(default_factory=list)
    validation: dict[str, dict[str, Any]] = field(default_factory=dict)
    qnn_graph_ops: dict[str, Any] = field(default_factory=lambda: {"total": 0, "by_type": {}, "graphs": 0})
    backend_errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def node_verdict(self, node: str) -> tuple[str, str]:
        """``("htp" | "cpu" | "error" | "unknown", reason)`` for one node.

        A node the EP rejected is "cpu" even if the session then failed for another reason
        (e.g. no CPU kernel either); a node the EP accepted in a session that failed to
        finalize or run is "error".
        """
        v = self.validation.get(node)
        if v is not None and not v["passed"]:
            return "cpu", v["reason"]
        if not self.ok:
            return "error", self.error or "session failed"
        if node in self.cpu_nodes:
            return "cpu", (v or {}).get("reason") or "placed on the CPU EP"
        if v is not None:
            return "htp", ""
        return "unknown", "node not seen by the QNN EP (folded or fused away?)"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_VALIDATION_RE = re.compile(r"Validation (PASSED|FAILED) for (\d+) nodes in \S+ \((.*)\) :\s*$")
_TIMESTAMP_RE = re.compile(r"^(\x1b\[[0-9;]*m)?\d{4}-\d\d-\d\d ")
_NODE_RE = re.compile(r"^\s*Operator type: (\S+) Node name: (.*) Node index: \d+\s*$")
_REASON_RE = re.compile(r"^\s*REASON : (.*)$")
#: onnxruntime declining the EP for the whole model (e.g. opset < 7: no layout transformer).
_EP_UNUSABLE_RE = re.compile(r"\] (QNNExecutionProvider cannot be used with this model.*?)(?:\x1b\[m)?$")
_QNN_ERROR_RE = re.compile(r"QnnLogging\]\s+<E> (.*)$|::ERROR:(.*)$|\[E:onnxruntime:[^\]]*\] (.*?)(?:\x1b\[m)?$")
_PLACED_RE = re.compile(r"Node\(s\) placed on \[(\w+)\]")
_PLACED_NODE_RE = re.compile(r"VerifyEachNodeIsAssignedToAnEp\]\s{3}(\S+) \((.*)\)\s*$")
#: Backend error lines that appear in every session and explain nothing.
_NOISE = ("unexpected GraphHtpSettings option",)
#: Backend error lines too generic or too long to append to a node's REASON.
_UNINFORMATIVE = ("validateOpConfig failed", "Failed to validate op", "Supported I/O datatype sets", "Please refer to")


@dataclass
class _LogFacts:
    validation: dict[str, dict[str, Any]] = field(default_factory=dict)
    backend_errors: list[str] = field(default_factory=list)
    placed: dict[str, list[str]] = field(default_factory=dict)


def parse_ep_log(lines: Iterable[str]) -> _LogFacts:
    """Per-node validation, backend errors and final node placement from a verbose log.

    The EP validates nodes in two capability passes; the later verdict wins.  A failed
    node's REASON is often generic ("Failed to add node."), so the backend ``<E>`` lines
    logged since the previous verdict (e.g. "has incorrect Rank 6.") are appended to it.
    """
    facts = _LogFacts()
    pending: list[str] = []
    block: dict[str, Any] | None = None
    placed_on: str | None = None
    last_error: int | None = None  # index in ``pending`` of an <E> message that may continue
    for raw in lines:
        line = raw.rstrip("\n")
        if block is not None:
            node = _NODE_RE.match(line)
            reason = _REASON_RE.match(line)
            if node:
                block["nodes"].append(node.group(2))
                block["types"].append(node.group(1))
                continue
            if reason:
                block["reason"] = reason.group(1).strip()
                continue
            _close_block(facts, block, pending)
            block, pending = None, []
        if not _TIMESTAMP_RE.match(line):
            if last_error is not None and line.strip():  # continuation of a multi-line <E> message
                pending[last_error] = _shorten(f"{pending[last_error]} {line.strip()}")
            continue
        if last_error is not None:
            _record_error(facts, pending[last_error])
            last_error = None
        m = _VALIDATION_RE.search(line)
        if m:
            block = {"passed": m.group(1) == "PASSED", "nodes": [], "types": [], "reason": ""}
            continue
        m = _QNN_ERROR_RE.search(line)
        if m:
            msg = (m.group(1) or m.group(2) or m.group(3) or "").strip()
            if msg and not any(n in msg for n in _NOISE):
                pending.append(msg)
                last_error = len(pending) - 1
            continue
        m = _EP_UNUSABLE_RE.search(line)
        if m:
            _record_error(facts, m.group(1))
            continue
        m = _PLACED_RE.search(line)
        if m:
            placed_on = m.group(1)
            facts.placed.setdefault(placed_on, [])
            continue
        m = _PLACED_NODE_RE.search(line)
        if m and placed_on:
            facts.placed[placed_on].append(m.group(2))
    if last_error is not None:
        _record_error(facts, pending[last_error])
    if block is not None:
        _close_block(facts, block, pending)
    return facts


def _shorten(msg: str, limit: int = 400) -> str:
    msg = msg.replace("QNN_DATATYPE_", "")
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def _record_error(facts: _LogFacts, msg: str) -> None:
    if msg not in facts.backend_errors:
        facts.backend_errors.append(msg)


def _close_block(facts: _LogFacts, block: dict[str, Any], pending: list[str]) -> None:
    reason = block["reason"]
    if not block["passed"]:
        detail = [p for p in dict.fromkeys(pending) if not any(s in p for s in _UNINFORMATIVE)]
        if detail:
            reason = f"{reason} [backend: {'; '.join(detail[:3])}]"
    for name, op_type in zip(block["nodes"], block["types"]):
        facts.validation[name] = {"passed": block["passed"], "reason": reason, "op_type": op_type}


def parse_profile(path: str | os.PathLike) -> tuple[int, list[str]]:
    """(number of QNN kernels, names of CPU-EP nodes) from an onnxruntime profile."""
    qnn: set[str] = set()
    cpu: list[str] = []
    for event in json.loads(Path(path).read_text()):
        name = event.get("name", "")
        if event.get("cat") != "Node" or not name.endswith("_kernel_time"):
            continue
        provider = event.get("args", {}).get("provider")
        node = name[: -len("_kernel_time")]
        if provider == EP_NAME:
            qnn.add(node)
        elif provider == "CPUExecutionProvider" and node not in cpu:
            cpu.append(node)
    return len(qnn), cpu


def parse_qnn_graph_dir(directory: str | os.PathLike) -> dict[str, Any]:
    """Op counts of the composed QNN graph(s) dumped by ``dump_json_qnn_graph=1``."""
    by_type: Counter[str] = Counter()
    graphs = 0
    for path in sorted(Path(directory).glob("*.json")):
        if path.name.endswith("_tensor_log.json"):
            continue
        try:
            nodes = json.loads(path.read_text())["graph"]["nodes"]
        except (ValueError, KeyError):
            continue
        graphs += 1
        by_type.update(n.get("type", "?") for n in nodes.values())
    return {"total": sum(by_type.values()), "by_type": dict(sorted(by_type.items())), "graphs": graphs}


def _one_line(text: str) -> str:
    """The first line of an onnxruntime error, without its boilerplate."""
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : ", "", text.strip())
    text = re.sub(r"Non-zero status code returned while running .*? Status Message: ", "", text)
    text = text.replace(", which has not been identified as any other error type.", "")
    return text.splitlines()[0] if text else text


def probe_placement(
    model_path: str | os.PathLike,
    inputs: dict[str, np.ndarray] | None = None,
    *,
    fp16: bool = True,
    optimize: bool = True,
    backend: str = "htp",
    timeout: float = 600.0,
    keep_dir: str | os.PathLike | None = None,
) -> Placement:
    """Create a verbose, profiled session for ``model_path`` in a child process and run it once.

    ``inputs`` default to :func:`synthetic_inputs`.  Never raises for backend trouble: a
    timeout, a crash or a failed finalize gives ``ok=False`` and a one-line ``error``.
    ``keep_dir`` keeps the artefacts (log, profile, QNN graph JSON) there for inspection.
    """
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="qnnpasses_probe_") as tmp:
        work = Path(keep_dir) if keep_dir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        args = [os.fspath(model_path), "--workdir", os.fspath(work), "--backend", backend]
        if inputs is not None:
            np.savez(work / "inputs.npz", **inputs)
            args += ["--inputs", os.fspath(work / "inputs.npz")]
        if not fp16:
            args.append("--no-fp16")
        if not optimize:
            args.append("--no-optimize")
        log_path = work / "backend.log"
        crash = run_child("qnnpasses.backends.htp", args, work / "result.json", timeout=timeout, log_path=log_path).crash
        placement = _collect(work, log_path, crash)
    placement.seconds = round(time.monotonic() - start, 3)
    return placement


def _with_root_cause(error: str, backend_errors: list[str]) -> str:
    """Append the backend line that explains a generic finalize / execute failure."""
    if "Failed to finalize" in error:
        specific = [e for e in backend_errors if "could not create op" in e or "generated:" in e]
    elif "graph execute error" in error:
        specific = backend_errors[:1]  # the first error of the run, e.g. "bad input in InputGather2DDMA"
    else:
        specific = []
    return f"{error} [{specific[0]}]" if specific else error


def _collect(work: Path, log_path: Path, crash: str | None) -> Placement:
    with open(log_path, errors="replace") as fh:
        facts = parse_ep_log(fh)
    result_path = work / "result.json"
    result = json.loads(result_path.read_text()) if result_path.exists() else {}
    ok = bool(result.get("ok")) and crash is None
    error = result.get("error") or (crash if not ok else None)
    if error and crash and crash not in error:
        error = f"{error} ({crash})"
    if error:
        error = _with_root_cause(error, facts.backend_errors)
    if error is None and not facts.validation:
        setup = [e for e in facts.backend_errors if "SetupBackend failed" in e or "cannot be used with this model" in e]
        if setup:  # the session "ran", but entirely on the CPU EP
            error = setup[0]
    placement = Placement(ok=ok, error=error, validation=facts.validation, backend_errors=facts.backend_errors[:20])
    profile = result.get("profile")
    if profile and Path(profile).exists():
        placement.qnn_partitions, placement.cpu_nodes = parse_profile(profile)
    else:  # no run: fall back to the session's own placement report
        placement.qnn_partitions = len(facts.placed.get(EP_NAME, []))
        placement.cpu_nodes = list(facts.placed.get("CPUExecutionProvider", []))
    placement.qnn_graph_ops = parse_qnn_graph_dir(work / "qnn_graph")
    return placement


# --------------------------------------------------------------------------- child process


def _child_main(argv: list[str] | None = None) -> int:
    """Entry of the probe child: session + one run; facts go to ``WORKDIR/result.json``.

    The backend writes its log to this process's stderr, which the parent captured.
    """
    parser = argparse.ArgumentParser(prog="python -m qnnpasses.backends.htp", description="probe one model on the QNN backend")
    parser.add_argument("model")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--inputs")
    parser.add_argument("--backend", default="htp")
    parser.add_argument("--no-fp16", dest="fp16", action="store_false")
    parser.add_argument("--no-optimize", dest="optimize", action="store_false")
    args = parser.parse_args(argv)
    global _capture
    _capture = False  # the parent parses this process's stderr
    # The backend's own log level is fixed when the EP library registers: go verbose first.
    ort.set_default_logger_severity(0)
    work = Path(args.workdir)
    (work / "qnn_graph").mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"ok": False, "stage": "session", "error": None, "profile": None}

    def write() -> None:
        (work / "result.json").write_text(json.dumps(result))

    write()  # a crash below leaves this behind
    try:
        sess = htp_session(
            args.model, fp16=args.fp16, profiling=True, verbose=True, optimize=args.optimize, backend=args.backend,
            profile_prefix=str(work / "profile"),
            extra_options={"dump_json_qnn_graph": "1", "json_qnn_graph_dir": str(work / "qnn_graph")},
        )
        result["stage"] = "run"
        write()
        if args.inputs:
            with np.load(args.inputs) as npz:
                feeds = {k: npz[k] for k in npz.files}
        else:
            feeds = synthetic_inputs(sess)
        names = [o.name for o in sess.get_outputs()]
        outputs = sess.run(names, feeds)
        np.savez(work / "outputs.npz", **dict(zip(names, outputs)))  # for accuracy checks by the caller
        result["profile"] = sess.end_profiling()
        result.update(ok=True, stage="done")
    except Exception as exc:  # noqa: BLE001 - every failure is a probe result
        result["error"] = _one_line(str(exc)) or type(exc).__name__
    write()
    return 0


if __name__ == "__main__":
    raise SystemExit(_child_main())
