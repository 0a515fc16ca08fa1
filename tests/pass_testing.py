"""Helpers the per-pass test modules share."""

from __future__ import annotations

from collections import Counter

from qnnpasses.ir.load import load_model
from qnnpasses.passmanager.api import PassContext
from qnnpasses.passmanager.manager import PassManager, PassRecord, RunConfig
from qnnpasses.passmanager.spec import parse_pipeline


def run_strictly(source, spec: str, inputs=None, calibration=None) -> tuple:
    """Run ``spec`` through the pass manager, checked, verified on CPU and strict -> (ir, last record).

    A pass that breaks the graph or moves the outputs raises, so a test cannot pass on a
    rolled-back rewrite.
    """
    ir = load_model(source)
    context = PassContext(verbose=True, calibration=calibration)
    result = PassManager(parse_pipeline(spec), RunConfig(verify=True, strict=True, inputs=inputs), context=context).run(ir)
    record: PassRecord = result.records[-1]
    return ir, record


def op_counts(ir) -> Counter:
    return Counter(n.op for n in ir.graph.nodes)
