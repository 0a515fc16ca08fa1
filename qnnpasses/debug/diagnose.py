"""Find the smallest piece of a model that makes the real HTP reject it as a whole.

The QNN HTP may validate every node and then fail to *finalize* (compile) the graph, with
an error that names an internal op (``could not create op: q::ForceFormat_Crouton``) rather
than the ONNX node responsible.  :func:`diagnose` finds that node by compiling sub-models on
the real backend: windows ``[start, end)`` of the topologically ordered (non-constant)
nodes, each extracted with the tensors it reads as graph inputs and the tensors it hands on
as graph outputs (:mod:`qnnpasses.partition.extract`), probed with
:func:`qnnpasses.backends.htp.probe_placement`.

:func:`bisect_failure` is the search: a binary search for the shortest failing prefix
``[0, end)`` (its last node is needed for the failure), then for the latest start that still
fails with that end (its first node is needed too).  About ``2*log2(n)`` probes: 15 for 120
nodes.  It assumes that a window containing a failing window fails too, which holds for
failures caused by a node and its neighbourhood; a failure that needs two far-apart nodes
gives a window spanning both, with both named.
"""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: Backend error lines that name the failing op or node, most telling first.
_ROOT_CAUSE = ("generated:", "could not create op", "Failed to validate op", "preparation failed", "prepare failed")
#: Backend error lines naming an ONNX node, strongest blame first: the node whose op could not
#: be created at finalize ('"X" generated: ...'), then nodes that failed op validation.
_NAMED_NODE = (re.compile(r'"([^"]+)" generated:'), re.compile(r"Failed to validate op (\S+) with error|validator (\S+):qti\.aisw"))


@dataclass
class Probe:
    start: int
    end: int
    fails: bool
    error: str | None
    backend_errors: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class Diagnosis:
    model: str
    ok: bool                                   # the whole model compiled and ran on the HTP
    error: str | None = None
    root_cause: list[str] = field(default_factory=list)     # the backend's own explanation
    named_by_backend: list[str] = field(default_factory=list)
    backend_errors: list[str] = field(default_factory=list)
    cpu_nodes: list[str] = field(default_factory=list)      # nodes the EP left to the CPU (when it compiled)
    culprit: dict[str, str] | None = None  # the node whose presence makes it fail (last of the window)
    window: list[dict[str, str]] = field(default_factory=list)  # the smallest failing window, in order
    confirmed_by_backend: bool = False     # the backend's error lines name the culprit
    culprit_error: str | None = None
    culprit_backend_errors: list[str] = field(default_factory=list)
    lint: list[dict[str, Any]] = field(default_factory=list)    # lint findings on the culprit nodes
    probes: list[Probe] = field(default_factory=list)
    nodes: int = 0
    seconds: float = 0.0
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["probe_count"] = len(self.probes)
        return data


# --------------------------------------------------------------------------- the search


def bisect_failure(n: int, fails: Callable[[int, int], bool]) -> tuple[int, int] | None:
    """The smallest failing window ``[start, end)`` of ``n`` ordered nodes, or None if even
    ``[0, n)`` compiles.  ``fails(start, end)`` compiles that window; calls are not repeated."""
    cache: dict[tuple[int, int], bool] = {}

    def probe(start: int, end: int) -> bool:
        if (start, end) not in cache:
            cache[(start, end)] = fails(start, end)
        return cache[(start, end)]

    if n <= 0:
        return None
    lo, hi = 0, n  # invariant: [0, lo) compiles (empty), [0, hi) fails (checked below if never probed)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if probe(0, mid):
            hi = mid
        else:
            lo = mid
    if not probe(0, hi):
        return None
    end = hi
    if end == 1 or probe(end - 1, end):  # the common case: the last node fails on its own
        return end - 1, end
    lo, hi = 0, end - 1  # invariant: [lo, end) fails, [hi, end) compiles
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if probe(mid, end):
            lo = mid
        else:
            hi = mid
    return lo, end


def failure_kind(error: str | None) -> str | None:
    """What kind of failure an error is, so that a window counts only if it fails the same way."""
    if not error:
        return None
    text = error.lower()
    for kind, keys in (("finalize", ("finalize", "could not create op", "prepare")), ("compose", ("compose",)),
                       ("execute", ("execute error",)), ("crash", ("killed by", "exited with status")),
                       ("timeout", ("timed out",))):
        if any(key in text for key in keys):
            return kind
    return "other"


def named_nodes(backend_errors: list[str]) -> list[str]:
    """ONNX node names the backend's error lines blame, strongest blame first, without repeats."""
    found = [next(g for g in m.groups() if g) for pattern in _NAMED_NODE for line in backend_errors
             for m in pattern.finditer(line)]
    return list(dict.fromkeys(found))


def root_cause(backend_errors: list[str]) -> list[str]:
    """The backend lines that explain a failure (the op it could not create, the node named)."""
    found = [line for key in _ROOT_CAUSE for line in backend_errors if key in line]
    return list(dict.fromkeys(found))


# --------------------------------------------------------------------------- on the backend


class _WindowProber:
    """Extracts windows of the node order as models and probes them on the HTP."""

    def __init__(self, ir, work: Path, kind: str, timeout: float):
        from qnnpasses.partition.graph import build_node_graph

        self.ng = build_node_graph(ir)
        self.order = [i for i in range(len(self.ng.nodes)) if i not in self.ng.constant]
        self.work, self.kind, self.timeout = work, kind, timeout
        self.probes: list[Probe] = []

    def node(self, position: int) -> dict[str, str]:
        node = self.ng.nodes[self.order[position]]
        return {"name": node.name, "op_type": node.op}

    def fails(self, start: int, end: int) -> bool:
        from qnnpasses.backends.htp import probe_placement
        from qnnpasses.partition.cost import boundary
        from qnnpasses.partition.extract import extract, save_partition

        members = set(self.order[start:end])
        inputs, outputs = boundary(self.ng, members)
        if not outputs:  # nothing leaves the window: onnxruntime would prune it all
            self.probes.append(Probe(start, end, False, "window has no outputs"))
            return False
        sub = extract(self.ng, sorted(members | self.ng.constant_closure(members)), inputs, outputs)
        path = save_partition(sub, self.work / f"window_{start}_{end}.onnx")
        from qnnpasses.progress import step

        step(f"bisecting: trying nodes {start}..{end - 1} of {len(self.order)} alone")
        placement = probe_placement(path, timeout=self.timeout)
        failed = failure_kind(placement.error) == self.kind if not placement.ok else False
        self.probes.append(Probe(start, end, failed, placement.error, placement.backend_errors, placement.seconds))
        return failed


def diagnose(model_path: str | Path, *, timeout: float = 120.0, lint: bool = True) -> Diagnosis:
    """Probe the whole model on the HTP; if it fails, bisect for the culprit node(s)."""
    from qnnpasses.backends.htp import probe_placement
    from qnnpasses.ir.load import load_model

    start = time.monotonic()
    ir = load_model(model_path)
    from qnnpasses.progress import step

    step(f"loading the whole model on the HTP (up to {timeout:g} s)")
    whole = probe_placement(model_path, timeout=timeout)
    result = Diagnosis(str(model_path), ok=whole.ok, error=whole.error, backend_errors=whole.backend_errors,
                       root_cause=root_cause(whole.backend_errors))
    result.named_by_backend = named_nodes(whole.backend_errors)
    result.cpu_nodes = list(whole.cpu_nodes)
    result.probes.append(Probe(-1, -1, not whole.ok, whole.error, whole.backend_errors, whole.seconds))
    if whole.ok:
        result.note = f"compiles and runs on the HTP ({whole.qnn_partitions} QNN partition(s), {len(whole.cpu_nodes)} CPU node(s))"
    else:
        _bisect(ir, result, failure_kind(whole.error) or "other", timeout)
        if lint and result.culprit is not None:
            result.lint = _lint_on(model_path, {c["name"] for c in result.window})
    result.seconds = round(time.monotonic() - start, 3)
    return result


def _bisect(ir, result: Diagnosis, kind: str, timeout: float) -> None:
    with tempfile.TemporaryDirectory(prefix="qnnpasses_diagnose_") as tmp:
        prober = _WindowProber(ir, Path(tmp), kind, timeout)
        result.nodes = len(prober.order)
        window = bisect_failure(len(prober.order), prober.fails)
        result.probes.extend(prober.probes)
    if window is None:
        result.note = "no extracted sub-model reproduces the failure (it needs the whole model as loaded)"
        return
    begin, end = window
    result.window = [prober.node(i) for i in range(begin, end)]
    last = next(p for p in reversed(prober.probes) if p.fails and (p.start, p.end) == window)
    result.culprit_error, result.culprit_backend_errors = last.error, root_cause(last.backend_errors) or last.backend_errors[:5]
    in_window = {c["name"]: c for c in result.window}
    blamed = [in_window[n] for n in named_nodes(last.backend_errors) + result.named_by_backend if n in in_window]
    result.culprit = blamed[0] if blamed else result.window[-1]
    result.confirmed_by_backend = bool(blamed)
    size = end - begin
    if size == 1:
        result.note = "a sub-model of this node alone fails the same way"
    else:
        how = "the backend names it" if blamed else "the model up to it fails the same way, without it compiles"
        result.note = (f"{how}; the smallest failing window is {size} nodes, {result.window[0]['name']} .. "
                       f"{result.window[-1]['name']} (without its first or last node it compiles)")


def _lint_on(model_path: str | Path, names: set[str]) -> list[dict[str, Any]]:
    """Lint findings about the window's nodes: often the rule that names the cause and its fix."""
    from qnnpasses.lint import lint_model

    return [f.to_dict() for f in lint_model(model_path).findings if f.node in names]


# --------------------------------------------------------------------------- output


def render_text(d: Diagnosis) -> str:
    if d.ok:
        return f"{d.model}: {d.note}"
    lines = [f"{d.model}: the HTP rejects the model", f"  error: {d.error}"]
    lines += [f"  backend: {line}" for line in d.root_cause[:4]]
    if d.culprit is not None:
        lines.append(f"culprit: {d.culprit['name']} ({d.culprit['op_type']}): {d.note}")
        if len(d.window) > 1:
            lines.append("  window: " + ", ".join(c["name"] for c in d.window[:12]) + (" ..." if len(d.window) > 12 else ""))
        lines.append(f"  sub-model error: {d.culprit_error}")
        lines += [f"  backend: {line}" for line in d.culprit_backend_errors[:3]]
        for f in d.lint:
            lines.append(f"  lint {f['rule']} on {f['node']}: {f['message']} [fix: {f['fix']}]")
    else:
        lines.append(f"no culprit found: {d.note}")
    lines.append(f"probes: {len(d.probes)} on the HTP ({d.nodes} nodes searched), {d.seconds:.1f} s")
    return "\n".join(lines)
