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


def htp_fp16_outputs(irs: dict, inputs: dict, tmp_path) -> dict:
    """Each model in ``irs`` (name -> IR) on the HTP in fp16 mode, entirely (CPU fallback
    disabled): name -> its outputs by name."""
    import numpy as np

    from qnnpasses.backends.htp import probe_placement
    from qnnpasses.ir.model import save_model

    outputs = {}
    for name, ir in irs.items():
        path = save_model(ir, tmp_path / f"{name}.onnx")
        placement = probe_placement(path, inputs=inputs, optimize=False, keep_dir=tmp_path / name)
        assert placement.ok and placement.cpu_nodes == [], (name, placement)
        with np.load(tmp_path / name / "outputs.npz") as out:
            outputs[name] = {k: out[k] for k in out.files}
    return outputs


def htp_fp16_errors(irs: dict, inputs: dict, want, tmp_path, output: str = "y") -> dict:
    """Each model in ``irs`` on the HTP in fp16 mode (:func:`htp_fp16_outputs`): its ``output``'s
    RMS error against ``want`` over ``want``'s RMS."""
    import numpy as np

    errors = {}
    for name, outputs in htp_fp16_outputs(irs, inputs, tmp_path).items():
        got = outputs[output].astype(np.float64)
        errors[name] = float(np.sqrt(np.mean((got - want) ** 2)) / np.sqrt(np.mean(np.asarray(want) ** 2)))
    return errors
