"""How the HTP rounds 16-bit QDQ ops (tools/probe_htp_rounding.py, docs/htp_rounding.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import requires_htp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import probe_htp_rounding as tool  # noqa: E402


def test_the_doc_is_what_the_tool_writes():
    doc = json.loads(tool.DOC_JSON.read_text())
    assert tool.render(doc) == tool.DOC_MD.read_text()
    assert [r["case"] for r in doc["rows"]] == [c[0] for c in tool.cases(np.random.default_rng(0))]


@requires_htp
@pytest.mark.parametrize("target", tool.ARCH_TARGETS)
def test_the_htp_s_rms_norm_rounds_one_way_and_its_decomposition_to_nearest(target, tmp_path):
    """The fact the doc reports, checked on the backend installed for a target of every arch it
    accepts (what the compensation in qnnpasses.quant.norm_rounding relies on): the fused norm's
    errors average half a 16-bit step below the result, the decomposed norm's about zero (both on
    the HTP, integer mode, no CPU fallback)."""
    import onnx

    from qnnpasses.backends.htp import htp_session
    from qnnpasses.backends.targets import resolve

    means = {}
    for label, graph, output, expected in tool.cases(np.random.default_rng(0)):
        if not label.startswith("RMSNormalization"):
            continue
        path = tmp_path / "norm.onnx"
        onnx.save(graph.model(output), str(path))
        session = htp_session(str(path), fp16=False, extra_options={"offload_graph_io_quantization": "0"},
                              optimize=False, disable_cpu_fallback=True, target=resolve(target))
        step = tool._encoding(expected, 16)[0]
        means[label] = float(((session.run(None, graph.feeds)[0] - expected) / step).mean())
    assert means["RMSNormalization, fused"] < -0.4, means
    assert abs(means["RMSNormalization, decomposed"]) < 0.1, means
