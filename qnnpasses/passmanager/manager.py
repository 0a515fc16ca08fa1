"""The pass manager: runs a pipeline, guards every change, and keeps a record per pass.

For each pass it enforces the pass's declaration: a contract that needs opting in runs only
with ``allow_lossy``; a required property with a checker must hold (else the pass is
skipped with the reason); a graph with none of the pass's ``anchor_ops`` has nothing it can
match, and the pass is recorded unchanged without running.  It takes a snapshot for
rollback (``snapshot.py``) and runs the pass.  Whether the graph changed is decided by a
structural fingerprint taken before and after (O(nodes), see ``fingerprint.py``), never by
the pass's ``PassResult.changed``: a pass that says "unchanged" and changed the graph is
treated as changed and recorded as misreported.
Every changed graph is checked (ONNX checker + strict shape inference, shapes refreshed)
and, with ``verify``, run on onnxruntime CPU on every verification case
(``backends.cpu.verification_cases``) and compared with the outputs before the pass,
as the pass's contract says: its own tolerance for an approximation, only the cases an
assumption holds on, through the renamed outputs of an interface change.  A pass that
raises, breaks the check or its contract is rolled back and recorded with the reason and
figures; the pipeline goes on, or stops with ``strict``.  Ensured properties with a checker
are checked after the pass (a miss is recorded).  At the end the output is compared with
the input model on the cases every applied contract holds on; with ``strict`` a failure
there is an error too (:class:`CheckFailedError`).

Instruments observe the run through hooks (before/after pipeline and pass), the way
MLIR's PassInstrumentation does: the progress display, IR dumps and per-pass diffs
are instruments, not code in the loop.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qnnpasses.backends.cpu import (
    ATOL,
    MIN_COSINE,
    RTOL,
    Comparison,
    VerificationCase,
    adapt_inputs,
    compare_outputs,
    run_cpu_each,
    verification_cases,
)
from qnnpasses.errors import BadInputError, CheckFailedError
from qnnpasses.ir.checks import check_model, passed_check
from qnnpasses.ir.model import IRModel, has_op, node_count
from qnnpasses.memory import array_bytes, spill, unspill
from qnnpasses.passmanager.api import (
    ALL_CASES,
    APPROXIMATE_KIND,
    CASE_GIVEN,
    Contract,
    Pass,
    PassContext,
    PassResult,
    get_property,
)
from qnnpasses.ir.fingerprint import Fingerprint, fingerprint, out_of_order
from qnnpasses.passmanager.spec import Item, Pipeline, Repeat, format_items
from qnnpasses.passmanager.snapshot import Snapshot

CHANGED, UNCHANGED, ROLLED_BACK, SKIPPED = "changed", "unchanged", "rolled-back", "skipped"
# at most this many --inputs/--calib samples join the verification cases
MAX_GIVEN_SAMPLES = 4
# a case's outputs above this many bytes are kept for comparison in files mapped back, not in memory
SPILL_BYTES = 32 << 20


@dataclass
class PassRecord:
    """What one pass did; the fields of ``report.json``'s ``passes`` entries."""

    index: int
    name: str
    spec: str
    status: str = UNCHANGED
    changed: bool = False
    seconds: float = 0.0
    nodes_before: int = 0
    nodes_after: int = 0
    added: list[dict[str, str]] = field(default_factory=list)
    removed: list[dict[str, str]] = field(default_factory=list)
    op_delta: dict[str, int] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    verification: dict[str, Any] | None = None
    reason: str = ""
    contract: dict[str, Any] = field(default_factory=dict)
    lossless: bool = True  # the contract runs without --allow-lossy
    misreported: bool = False  # PassResult.changed disagreed with the graph
    iteration: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class RunConfig:
    verify: bool = False
    strict: bool = False
    allow_lossy: bool = False
    inputs: dict[str, np.ndarray] | None = None
    seed: int = 0
    atol: float = ATOL
    rtol: float = RTOL
    min_cosine: float = MIN_COSINE


@dataclass
class RunResult:
    records: list[PassRecord]
    final_verification: dict[str, Any] | None = None
    verification_cases: list[dict[str, str]] = field(default_factory=list)

    @property
    def rolled_back(self) -> list[PassRecord]:
        return [r for r in self.records if r.status == ROLLED_BACK]

    @property
    def verified_ok(self) -> bool | None:
        """The end-to-end verification's verdict (None without ``verify``)."""
        return None if self.final_verification is None else bool(self.final_verification["ok"])


class Instrument:
    """Observer hooks; subclass and override what you need."""

    def before_pipeline(self, ir: IRModel, pipeline: Pipeline) -> None: ...

    def before_pass(self, pass_: Pass, ir: IRModel, record: PassRecord) -> None: ...

    def after_pass(self, pass_: Pass, ir: IRModel, record: PassRecord) -> None: ...

    def after_pipeline(self, ir: IRModel, result: RunResult) -> None: ...


def _fill_structural_delta(record: PassRecord, before: list[tuple[str, str]], after: list[tuple[str, str]]) -> None:
    before_set, after_set = set(before), set(after)
    record.added = [{"name": n, "op_type": op} for n, op in after if (n, op) not in before_set]
    record.removed = [{"name": n, "op_type": op} for n, op in before if (n, op) not in after_set]
    delta = Counter(op for _, op in after)
    delta.subtract(Counter(op for _, op in before))
    record.op_delta = {op: count for op, count in sorted(delta.items()) if count}


def _first_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:limit]


class PassManager:
    def __init__(self, pipeline: Pipeline, config: RunConfig | None = None, instruments: list[Instrument] | None = None,
                 context: PassContext | None = None):
        self.pipeline = pipeline
        self.config = config or RunConfig()
        self.instruments = list(instruments or [])
        self.context = context or PassContext()
        self.context.allow_lossy = self.context.allow_lossy or self.config.allow_lossy
        self.records: list[PassRecord] = []
        self.result: RunResult | None = None
        self._cases: list[VerificationCase] = []
        self._reference: list[dict[str, np.ndarray]] = []
        self._spare_snapshot: Snapshot | None = None
        self._last_fingerprint: Fingerprint | None = None
        self._mappings: list[tuple[Pass, dict[str, str]]] = []  # applied output mappings, in order
        self._dropped: list[dict[str, str]] = []  # cases the input model itself cannot run
        self._applied: list[Contract] = []  # contracts of the passes that changed the graph
        self._original: list[dict[str, np.ndarray]] = []  # the input model's outputs on the cases
        self._spill_root: Path | None = None  # where large references are kept (:meth:`_kept`)
        self._spilled = 0

    # ------------------------------------------------------------------ driving

    def run(self, ir: IRModel) -> RunResult:
        try:
            return self._run_pipeline(ir)
        finally:
            if self._spill_root is not None:
                shutil.rmtree(self._spill_root, ignore_errors=True)
                self._spill_root = None

    def _run_pipeline(self, ir: IRModel) -> RunResult:
        self.records, self.result = [], None
        self._spare_snapshot, self._last_fingerprint, self._applied = None, None, []
        self._mappings, self._dropped, self._cases, self._reference, self._original = [], [], [], [], []
        if self.config.verify:
            self._original = self._prepare_cases(ir)
        for instrument in self.instruments:
            instrument.before_pipeline(ir, self.pipeline)
        self._run_items(self.pipeline.items, ir, iteration=None)
        result = self.result = RunResult(self.records, verification_cases=[
            {"name": c.name, "detail": c.detail} for c in self._cases] + self._dropped)
        if self._original:
            result.final_verification = self._final_verification(ir, self._original)
        for instrument in self.instruments:
            instrument.after_pipeline(ir, result)
        if self.config.strict and result.verified_ok is False:
            raise CheckFailedError(f"end-to-end verification failed: {result.final_verification['failure']}")
        return result

    def _prepare_cases(self, ir: IRModel) -> list[dict[str, np.ndarray]]:
        given = [self.config.inputs] if self.config.inputs else []
        calibration = self.context.calibration
        if isinstance(calibration, Sequence):  # never consume a one-shot iterator the passes still need
            given += [dict(calibration[i]) for i in range(min(len(calibration), MAX_GIVEN_SAMPLES))]
        shapes = self._planned_shapes(ir)
        if self.config.inputs:  # the user's inputs set the shapes of every case
            shapes.update({k: list(v.shape) for k, v in self.config.inputs.items() if isinstance(v, np.ndarray)})
        cases = verification_cases(ir, self.config.seed, shapes, given[:MAX_GIVEN_SAMPLES])
        outputs = self._outputs(ir, [c.inputs for c in cases])
        # the user's inputs must run (else the random ones must): the others may be no case for this model
        must = next((i for i, c in enumerate(cases) if c.name == CASE_GIVEN), 0) if self.config.inputs else 0
        if isinstance(outputs[must], Exception):
            shapes = ", ".join(f"{k}{list(v.shape)}" for k, v in cases[must].inputs.items())
            raise BadInputError(f"onnxruntime cannot run the input model on the verification inputs ({shapes}): "
                                f"{_first_line(outputs[must], 200)}; give --shape or --inputs")
        # a case the input model itself cannot run (e.g. ids out of a range it checks) is no case
        kept = [(c, o) for c, o in zip(cases, outputs) if not isinstance(o, Exception)]
        self._dropped = [{"name": c.name, "detail": c.detail, "dropped": f"the input model fails on it: {_first_line(o)}"}
                         for c, o in zip(cases, outputs) if isinstance(o, Exception)]
        self._cases = [c for c, _ in kept]
        self._reference = [o for _, o in kept]
        return list(self._reference)

    def _outputs(self, ir: IRModel, inputs: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray] | Exception]:
        """The outputs on every input set (an exception for a set that fails), each kept by :meth:`_kept`."""
        return [got if isinstance(got, Exception) else self._kept(got)
                for got in run_cpu_each(ir, inputs, keep_going=True)]

    def _kept(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``outputs`` as the run keeps them to compare with later: above :data:`SPILL_BYTES` in files
        mapped back (:func:`qnnpasses.memory.spill`), so that the references of every case, the
        outputs of the pass under check and the input model's own are not all in memory at once."""
        if array_bytes(outputs) <= SPILL_BYTES:
            return outputs
        if self._spill_root is None:
            self._spill_root = Path(tempfile.mkdtemp(prefix="qnnpasses-verify-"))
        self._spilled += 1
        return spill(outputs, self._spill_root, str(self._spilled))

    def _planned_shapes(self, ir: IRModel) -> dict[str, list[int]]:
        """Input shapes for verification: what a shape-fixing pass in the pipeline will set,
        so that inputs made before it still fit after it; ``--shape`` wins."""
        for pass_ in self.pipeline.passes():
            planned = pass_.planned_input_shapes(ir, self.context)
            if planned:
                return {**planned, **self.context.shapes}
        return dict(self.context.shapes)

    def _run_items(self, items: list[Item], ir: IRModel, iteration: int | None) -> bool:
        changed = False
        for item in items:
            if isinstance(item, Repeat):
                for i in range(1, item.max_iterations + 1):
                    if not self._run_items(item.items, ir, iteration=i):
                        break
                    changed = True
            else:
                changed |= self._run_pass(item, ir, iteration)
        return changed

    # ------------------------------------------------------------------ one pass

    def _run_pass(self, pass_: Pass, ir: IRModel, iteration: int | None) -> bool:
        contract = pass_.contract
        record = PassRecord(index=len(self.records) + 1, name=pass_.name, spec=format_items([pass_]),
                            contract=contract.as_dict(), lossless=not contract.needs_opt_in, iteration=iteration)
        # the last fingerprint still describes the graph when it is kept (a walk less per pass)
        last = self._last_fingerprint
        record.nodes_before = record.nodes_after = sum(map(len, last.order)) if last else node_count(ir.graph)
        for instrument in self.instruments:
            instrument.before_pass(pass_, ir, record)
        skip = self._skip_reason(pass_, ir)
        if skip:
            record.status, record.reason = SKIPPED, skip
        elif pass_.anchor_ops and not has_op(ir.graph, pass_.anchor_ops):
            # nothing to match: the graph, its fingerprint and the spare snapshot stay as they are
            record.reason = f"no {', '.join(sorted(pass_.anchor_ops))} in the graph"
            self._check_ensures(pass_, ir, record)
        else:
            self._apply(pass_, ir, record)
        self.records.append(record)
        for instrument in self.instruments:
            instrument.after_pass(pass_, ir, record)
        if record.status == ROLLED_BACK and self.config.strict:
            raise CheckFailedError(f"pass '{pass_.name}' was rolled back: {record.reason}")
        return record.changed

    def _skip_reason(self, pass_: Pass, ir: IRModel) -> str:
        if pass_.contract.needs_opt_in and not self.context.allow_lossy:
            return f"lossy pass ({pass_.contract.describe()}); run with --allow-lossy to apply it"
        for name in sorted(pass_.requires):
            check = get_property(name).check
            reason = check(ir) if check is not None else ""
            if reason:
                return f"requires {name}: {reason}"
        return ""

    def _apply(self, pass_: Pass, ir: IRModel, record: PassRecord) -> None:
        # a copy taken before a pass that then changed nothing is still a copy of the graph
        snapshot, self._spare_snapshot = self._spare_snapshot or Snapshot.take(ir), None
        # the previous pass's "after" still describes the graph when that pass changed nothing
        before, self._last_fingerprint = self._last_fingerprint or fingerprint(ir), None
        renames = {}
        self.context.forget_names()
        start = time.perf_counter()
        try:
            renames = dict(pass_.output_renames(ir, self.context) or {})
            result = pass_.run(ir, self.context)
            if not isinstance(result, PassResult):
                raise TypeError(f"run() returned {type(result).__name__}, not PassResult")
        except Exception as exc:  # a crashing pass must not take the model down with it
            record.seconds = time.perf_counter() - start
            self._roll_back(ir, snapshot, record, f"pass raised {type(exc).__name__}: {exc}")
            return
        record.stats, record.notes = dict(result.stats), list(result.notes)
        after = fingerprint(ir)
        changed = not before.same_graph(after)
        if not changed and after.order != before.order:  # only reordered: that needs no check but the order's
            problem = out_of_order(ir.graph)
            if problem:
                record.seconds = time.perf_counter() - start
                self._roll_back(ir, snapshot, record, f"graph check failed: nodes out of topological order: {problem}")
                return
        if changed != bool(result.changed):
            record.misreported = True
            record.notes.append(f"pass reported changed={bool(result.changed)} but the graph "
                                f"{'changed' if changed else 'did not change'}; the manager went by the graph")
        if not changed:
            record.seconds = time.perf_counter() - start
            self._spare_snapshot = snapshot
            self._last_fingerprint = after if after.order == before.order else None
            self._check_ensures(pass_, ir, record)
            return
        failure = None if passed_check(ir, after) else check_model(ir, refresh=True, now=after)
        record.seconds = time.perf_counter() - start
        if failure:
            self._roll_back(ir, snapshot, record, f"graph check failed: {failure}")
            return
        if self.config.verify and self._cases and not self._verify(pass_, ir, record, renames):
            self._roll_back(ir, snapshot, record, record.reason)
            return
        after_keys = after.node_keys()
        record.status, record.changed, record.nodes_after = CHANGED, True, len(after_keys)
        _fill_structural_delta(record, before.node_keys(), after_keys)
        self._applied.append(pass_.contract)
        self._last_fingerprint = after  # the check's shape refresh touches nothing a fingerprint holds
        if renames or type(pass_).map_reference is not Pass.map_reference:
            self._mappings.append((pass_, renames))
        self._check_ensures(pass_, ir, record)

    def _check_ensures(self, pass_: Pass, ir: IRModel, record: PassRecord) -> None:
        for name in sorted(pass_.ensures):
            check = get_property(name).check
            reason = check(ir) if check is not None else ""
            if reason:
                record.notes.append(f"ensures {name}, which does not hold: {reason}")

    def _verify(self, pass_: Pass, ir: IRModel, record: PassRecord, renames: dict[str, str]) -> bool:
        contract = pass_.contract
        outputs = self._outputs(ir, [adapt_inputs(ir, c.inputs) for c in self._cases])
        if not self._compare_to_reference(pass_, record, renames, outputs):
            for got in outputs:
                if not isinstance(got, Exception):
                    unspill(got)
            return False
        # every case's reference moves on, also those the contract does not speak for
        for old in self._reference:
            if not any(old is first for first in self._original):
                unspill(old)
        self._reference = [got if not isinstance(got, Exception) else {} for got in outputs]
        return True

    def _compare_to_reference(self, pass_: Pass, record: PassRecord, renames: dict[str, str],
                              outputs: list[dict[str, np.ndarray] | Exception]) -> bool:
        contract = pass_.contract
        broken = next((o for c, o in zip(self._cases, outputs)
                       if isinstance(o, Exception) and c.name in contract.holds_on), None)
        if broken is not None:
            record.reason = f"onnxruntime cannot run the rewritten graph: {_first_line(broken)}"
            return False
        atol, rtol, min_cosine = contract.tolerance(self.config.atol, self.config.rtol, self.config.min_cosine)
        comparisons = {}
        for case, reference, got in zip(self._cases, self._reference, outputs):
            if case.name not in contract.holds_on or isinstance(got, Exception):
                continue
            mapped = pass_.map_reference({renames.get(k, k): v for k, v in reference.items()}, case.inputs)
            comparisons.setdefault(case.name, []).append(compare_outputs(
                mapped, got, atol=atol, rtol=rtol, min_cosine=min_cosine, nan_is_undefined=True))
        record.verification = _verification_summary(comparisons, atol, rtol, min_cosine, self._cases)
        if not record.verification["ok"]:
            if contract.kind == APPROXIMATE_KIND:
                what = f"outputs moved beyond the contract's tolerance ({contract.describe()})"
            else:
                what = "outputs changed beyond tolerance"
            record.reason = f"{what}: {record.verification['failure']}"
            return False
        return True

    def _final_verification(self, ir: IRModel, original: list[dict[str, np.ndarray]]) -> dict[str, Any]:
        holds = set(ALL_CASES)
        for contract in self._applied:
            holds &= contract.holds_on
        atol, rtol, min_cosine = self.config.atol, self.config.rtol, self.config.min_cosine
        for contract in self._applied:
            if contract.kind == APPROXIMATE_KIND:
                atol, rtol = max(atol, contract.atol), max(rtol, contract.rtol)
                min_cosine = min(min_cosine, contract.min_cosine)
        # one case's outputs at a time: compared, then let go
        outputs = run_cpu_each(ir, [adapt_inputs(ir, c.inputs) for c in self._cases], keep_going=True)
        comparisons: dict[str, list[Comparison]] = {}
        for case, reference, got in zip(self._cases, original, outputs):
            if case.name not in holds:
                continue
            if isinstance(got, Exception):
                return {"ok": False, "max_abs": float("inf"), "cosine": 0.0, "outputs": [], "cases": {},
                        "failure": f"onnxruntime cannot run the output on case {case.name}: {_first_line(got)}"}
            mapped = dict(reference)
            for pass_, renames in self._mappings:  # every interface change since the input, in order
                mapped = pass_.map_reference({renames.get(k, k): v for k, v in mapped.items()}, case.inputs)
            comparisons.setdefault(case.name, []).append(compare_outputs(
                mapped, got, atol=atol, rtol=rtol, min_cosine=min_cosine, nan_is_undefined=True))
        summary = _verification_summary(comparisons, atol, rtol, min_cosine, self._cases)
        not_compared = sorted({c.name for c in self._cases} - holds)
        if not_compared:
            summary["not_compared"] = {name: "an applied pass's contract assumes what these inputs break"
                                       for name in not_compared}
        return summary

    @staticmethod
    def _roll_back(ir: IRModel, snapshot: Snapshot, record: PassRecord, reason: str) -> None:
        snapshot.restore(ir)
        record.status, record.changed, record.reason = ROLLED_BACK, False, reason


def _verification_summary(comparisons: dict[str, list[Comparison]], atol: float, rtol: float, min_cosine: float,
                          cases: list[VerificationCase]) -> dict[str, Any]:
    """``{ok, max_abs, cosine, outputs, cases, tolerance[, failure]}``: the worst case's per-output
    figures, and max abs / min cosine / ok per case."""
    flat = [(name, c) for name, items in comparisons.items() for c in items]
    if not flat:
        return {"ok": True, "max_abs": 0.0, "cosine": 1.0, "outputs": [], "cases": {},
                "tolerance": {"atol": atol, "rtol": rtol, "min_cosine": min_cosine},
                "note": "no verification case satisfies the contract: not compared"}
    failing = [(n, c) for n, c in flat if not c.ok]
    worst_name, worst = failing[0] if failing else max(flat, key=lambda item: (_finite(item[1].max_abs), -item[1].cosine))
    per_case = {}
    for name, items in comparisons.items():
        per_case[name] = {"ok": all(c.ok for c in items), "max_abs": max(c.max_abs for c in items),
                          "cosine": min(c.cosine for c in items)}
    summary = {"ok": not failing, "max_abs": max(c.max_abs for _, c in flat), "cosine": min(c.cosine for _, c in flat),
               "outputs": worst.summary()["outputs"], "worst_case": worst_name, "cases": per_case,
               "tolerance": {"atol": atol, "rtol": rtol, "min_cosine": min_cosine}}
    if failing:
        detail = {c.name: c.detail for c in cases}
        summary["failure"] = "; ".join(
            f"[{name}{' (' + detail[name] + ')' if detail.get(name) else ''}] {c.failure()}" for name, c in failing[:3])
    return summary


def _finite(value: float) -> float:
    return value if np.isfinite(value) else float("inf")
