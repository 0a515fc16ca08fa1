"""The pass manager: runs a pipeline, guards every change, and keeps a record per pass.

For each pass it enforces the pass's declaration (lossy passes need ``allow_lossy``;
``requires`` must hold), keeps a rollback copy, runs the pass, and, when the graph
changed, checks it (ONNX checker + strict shape inference, shapes refreshed) and with
``verify`` compares the outputs before and after on onnxruntime CPU.  A pass that
raises, breaks the check or the tolerance is rolled back and recorded with the
reason and figures; the pipeline goes on, or stops with ``strict``.

Instruments observe the run through hooks (before/after pipeline and pass), the way
MLIR's PassInstrumentation does: the progress display, IR dumps and per-pass diffs
are instruments, not code in the loop.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qnnpasses.backends.cpu import (
    ATOL,
    MIN_COSINE,
    RTOL,
    adapt_inputs,
    compare_outputs,
    make_inputs,
    run_cpu,
)
from qnnpasses.errors import BadInputError, CheckFailedError
from qnnpasses.ir.checks import check_model
from qnnpasses.ir.model import IRModel
from qnnpasses.ir.shapes import has_static_shapes
from qnnpasses.passmanager.api import STATIC_SHAPES, Pass, PassContext, PassResult
from qnnpasses.passmanager.spec import Item, Pipeline, Repeat, format_items

CHANGED, UNCHANGED, ROLLED_BACK, SKIPPED = "changed", "unchanged", "rolled-back", "skipped"


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
    lossless: bool = True
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

    @property
    def rolled_back(self) -> list[PassRecord]:
        return [r for r in self.records if r.status == ROLLED_BACK]


class Instrument:
    """Observer hooks; subclass and override what you need."""

    def before_pipeline(self, ir: IRModel, pipeline: Pipeline) -> None: ...

    def before_pass(self, pass_: Pass, ir: IRModel, record: PassRecord) -> None: ...

    def after_pass(self, pass_: Pass, ir: IRModel, record: PassRecord) -> None: ...

    def after_pipeline(self, ir: IRModel, result: RunResult) -> None: ...


def _node_keys(ir: IRModel) -> list[tuple[str, str]]:
    return [(n.name, n.op) for g in ir.graphs() for n in g.nodes]


def _fill_structural_delta(record: PassRecord, before: list[tuple[str, str]], after: list[tuple[str, str]]) -> None:
    before_set, after_set = set(before), set(after)
    record.added = [{"name": n, "op_type": op} for n, op in after if (n, op) not in before_set]
    record.removed = [{"name": n, "op_type": op} for n, op in before if (n, op) not in after_set]
    delta = Counter(op for _, op in after)
    delta.subtract(Counter(op for _, op in before))
    record.op_delta = {op: count for op, count in sorted(delta.items()) if count}


class PassManager:
    def __init__(self, pipeline: Pipeline, config: RunConfig | None = None, instruments: list[Instrument] | None = None,
                 context: PassContext | None = None):
        self.pipeline = pipeline
        self.config = config or RunConfig()
        self.instruments = list(instruments or [])
        self.context = context or PassContext()
        self.context.allow_lossy = self.context.allow_lossy or self.config.allow_lossy
        self.records: list[PassRecord] = []
        self._inputs: dict[str, np.ndarray] | None = None
        self._reference: dict[str, np.ndarray] | None = None
        self._spare_snapshot: IRModel | None = None

    # ------------------------------------------------------------------ driving

    def run(self, ir: IRModel) -> RunResult:
        self.records = []
        self._spare_snapshot = None
        original_outputs = None
        if self.config.verify:
            self._inputs = self.config.inputs or make_inputs(ir, self.config.seed, self._planned_shapes(ir))
            try:
                original_outputs = self._reference = run_cpu(ir, self._inputs)
            except Exception as exc:
                shapes = ", ".join(f"{k}{list(v.shape)}" for k, v in self._inputs.items())
                raise BadInputError(f"onnxruntime cannot run the input model on the verification inputs ({shapes}): "
                                    f"{str(exc).strip().splitlines()[0][:200]}; give --shape or --inputs") from None
        for instrument in self.instruments:
            instrument.before_pipeline(ir, self.pipeline)
        self._run_items(self.pipeline.items, ir, iteration=None)
        result = RunResult(self.records)
        if original_outputs is not None:
            final = compare_outputs(original_outputs, run_cpu(ir, adapt_inputs(ir, self._inputs)), atol=self.config.atol,
                                    rtol=self.config.rtol, min_cosine=self.config.min_cosine)
            result.final_verification = final.summary()
        for instrument in self.instruments:
            instrument.after_pipeline(ir, result)
        return result

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
        record = PassRecord(index=len(self.records) + 1, name=pass_.name, spec=format_items([pass_]),
                            lossless=pass_.lossless, iteration=iteration)
        before_keys = _node_keys(ir)
        record.nodes_before = record.nodes_after = len(before_keys)
        for instrument in self.instruments:
            instrument.before_pass(pass_, ir, record)
        skip = self._skip_reason(pass_, ir)
        if skip:
            record.status, record.reason = SKIPPED, skip
        else:
            self._apply(pass_, ir, record, before_keys)
        self.records.append(record)
        for instrument in self.instruments:
            instrument.after_pass(pass_, ir, record)
        if record.status == ROLLED_BACK and self.config.strict:
            raise CheckFailedError(f"pass '{pass_.name}' was rolled back: {record.reason}")
        return record.changed

    def _skip_reason(self, pass_: Pass, ir: IRModel) -> str:
        if not pass_.lossless and not self.context.allow_lossy:
            return "lossy pass; run with --allow-lossy to apply it"
        if STATIC_SHAPES in pass_.requires and not has_static_shapes(ir.graph):
            return "needs static input shapes; give --shape NAME=D0,D1,... or run fix-shapes first"
        return ""

    def _apply(self, pass_: Pass, ir: IRModel, record: PassRecord, before_keys: list[tuple[str, str]]) -> None:
        # a copy taken before a pass that then changed nothing is still a copy of the graph
        snapshot, self._spare_snapshot = self._spare_snapshot or ir.copy(), None
        self.context.forget_names()
        start = time.perf_counter()
        try:
            result = pass_.run(ir, self.context)
            if not isinstance(result, PassResult):
                raise TypeError(f"run() returned {type(result).__name__}, not PassResult")
        except Exception as exc:  # a crashing pass must not take the model down with it
            record.seconds = time.perf_counter() - start
            self._roll_back(ir, snapshot, record, f"pass raised {type(exc).__name__}: {exc}")
            return
        record.stats, record.notes = dict(result.stats), list(result.notes)
        if not result.changed:
            record.seconds = time.perf_counter() - start
            self._spare_snapshot = snapshot
            return
        failure = check_model(ir, refresh=True)
        record.seconds = time.perf_counter() - start
        if failure:
            self._roll_back(ir, snapshot, record, f"graph check failed: {failure}")
            return
        if self.config.verify and not self._verify(pass_, ir, record):
            self._roll_back(ir, snapshot, record, record.reason)
            return
        after_keys = _node_keys(ir)
        record.status, record.changed, record.nodes_after = CHANGED, True, len(after_keys)
        _fill_structural_delta(record, before_keys, after_keys)

    def _verify(self, pass_: Pass, ir: IRModel, record: PassRecord) -> bool:
        try:
            outputs = run_cpu(ir, adapt_inputs(ir, self._inputs))
        except Exception as exc:
            record.reason = f"onnxruntime cannot run the rewritten graph: {str(exc).strip().splitlines()[0][:300]}"
            return False
        comparison = compare_outputs(self._reference, outputs, atol=self.config.atol, rtol=self.config.rtol,
                                     min_cosine=self.config.min_cosine)
        record.verification = comparison.summary()
        if not comparison.ok and pass_.lossless:
            record.reason = f"outputs changed beyond tolerance: {comparison.failure()}"
            return False
        self._reference = outputs
        return True

    @staticmethod
    def _roll_back(ir: IRModel, snapshot: IRModel, record: PassRecord, reason: str) -> None:
        ir.restore(snapshot)
        record.status, record.changed, record.reason = ROLLED_BACK, False, reason
