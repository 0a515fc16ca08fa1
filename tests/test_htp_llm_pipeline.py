"""The main job end to end: every fixture through `htp-llm`, then onto the real HTP backend.

For each real export (both exporters) the pipeline's output must equal the original on
onnxruntime CPU (max abs 1e-4: every pass in htp-llm is lossless), and run on the HTP in
fp16 as exactly one QNN partition with no CPU node (the session is created with CPU
fallback disabled, so a partial placement is an error) with cosine >= 0.9999 against the
fp32 CPU reference.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from conftest import (
    FIXTURE_NAMES,
    MANIFEST,
    fixture_inputs,
    fixture_outputs,
    fixture_path,
    requires_htp,
)

from qnnpasses.backends.cpu import adapt_inputs, cosine_similarity, run_cpu
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import save_model
from qnnpasses.passmanager.manager import PassManager, RunConfig
from qnnpasses.passmanager.named import get_pipeline

DYNAMIC = sorted(MANIFEST.get("dynamic_fixtures", {}))


@functools.lru_cache(maxsize=None)
def _pipeline_output(name: str, tmp_root: str) -> tuple[str, tuple]:
    ir = load_model(fixture_path(name))
    shapes = {k: list(v.shape) for k, v in fixture_inputs(name).items()}
    manager = PassManager(get_pipeline("htp-llm"), RunConfig(verify=False))
    manager.context.shapes = shapes
    result = manager.run(ir)
    path = save_model(ir, f"{tmp_root}/{name}.htp.onnx")
    return str(path), tuple((r.name, r.status, r.reason) for r in result.records)


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("htp_llm"))


@pytest.mark.parametrize("name", FIXTURE_NAMES + DYNAMIC)
def test_pipeline_is_lossless_on_cpu(name, tmp_root):
    path, records = _pipeline_output(name, tmp_root)
    assert not [r for r in records if r[1] == "rolled-back"], records
    ir = load_model(path)
    inputs = adapt_inputs(ir, fixture_inputs(name))
    got = run_cpu(path, inputs)
    for key, expected in fixture_outputs(name).items():
        np.testing.assert_allclose(got[key], expected, atol=1e-4, rtol=0, err_msg=f"{name}:{key}")
    assert not any(d for t in ir.graph.inputs for d in t.shape if not isinstance(d, int)), "static shapes"


@requires_htp
@pytest.mark.parametrize("name", FIXTURE_NAMES + DYNAMIC)
def test_pipeline_output_runs_entirely_on_htp(name, tmp_root):
    from qnnpasses.backends.htp import htp_session, parse_profile

    path, _ = _pipeline_output(name, tmp_root)
    inputs = adapt_inputs(load_model(path), fixture_inputs(name))
    session = htp_session(path, fp16=True, disable_cpu_fallback=True, profiling=True,
                          profile_prefix=f"{tmp_root}/{name}.profile")
    names = [o.name for o in session.get_outputs()]
    got = dict(zip(names, session.run(names, inputs)))
    qnn_kernels, cpu_nodes = parse_profile(session.end_profiling())
    assert (qnn_kernels, cpu_nodes) == (1, [])
    for key, expected in fixture_outputs(name).items():
        assert cosine_similarity(got[key], expected) >= 0.9999, f"{name}:{key}"


def test_pipeline_is_recorded_in_textual_form(tmp_path):
    from qnnpasses.cli import main

    report_dir = tmp_path / "r"
    assert main(["run", "-q", "--pipeline", "htp-llm", str(fixture_path("llama_gqa_ts")), "-o", str(tmp_path / "o.onnx"),
                 "--report-dir", str(report_dir), "--verify"]) == 0
    report = json.loads((report_dir / "report.json").read_text())
    assert report["pipeline"] == get_pipeline("htp-llm").to_text()
    fused = {p["name"]: p["stats"] for p in report["passes"] if p["status"] == "changed"}
    assert fused["fuse-rmsnorm"]["fused"] == 5
    assert report["nodes_after"] < report["nodes_before"] / 3
    assert report["final_verification"]["max_abs"] <= 1e-4
    # the closing op-support check and the analysis figures, before vs after
    assert report["model_after"]["support"]["partitions"] == {"htp": 1, "cpu": 0}
    assert report["model_after"]["support"]["unsupported"] == 0
    assert report["model_after"]["kv_cache_bytes_fp16"] == report["model_before"]["kv_cache_bytes_fp16"] > 0
