"""passes/outliers: fold-norm-weights and rotate-residual on real exports, strictly verified on CPU.

Every LLaMA-family fixture (TorchScript and dynamo exports, KV cache, Qwen2, Mistral, Phi-3)
goes through htp-llm, gets random norm scales (the fixtures' are all ones, trained models'
are not), then fold + rotate run under the strict runner: a rewrite that moves an output
beyond the pass's stated tolerance raises.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from pass_testing import run_strictly
from qnnpasses.passes.outliers._orthogonal import hadamard, rotation

from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import save_model
from qnnpasses.passmanager.manager import PassManager
from qnnpasses.passmanager.named import get_pipeline
from qnnpasses.passmanager.rewrite import constant_value

FIXTURES = Path(__file__).parent / "fixtures"
DECODERS = ["llama_gqa_ts", "llama_gqa_dynamo", "llama_gqa_kv_ts", "qwen2_ts", "mistral_dynamo", "phi3_ts"]


def _prepared(name: str, tmp_path: Path, spike: float | None = None) -> Path:
    """htp-llm output of a fixture with random per-channel norm scales (and a residual spike)."""
    ir = load_model(FIXTURES / f"{name}.onnx")
    PassManager(get_pipeline("htp-llm")).run(ir)
    rng = np.random.default_rng(0)
    for node in ir.graph.nodes:
        if node.op == "RMSNormalization":
            gamma = constant_value(node.inputs[1])
            node.inputs[1] = gs.Constant(node.inputs[1].name + "_t", rng.uniform(0.2, 3.0, gamma.shape).astype(np.float32))
        if spike is not None and node.op == "Gather" and isinstance(node.inputs[0], gs.Constant) \
                and len(node.inputs[0].shape) == 2:
            table = constant_value(node.inputs[0]).copy()
            table[:, 3] = spike  # a massive activation in channel 3, as trained LLMs carry
            node.inputs[0] = gs.Constant(node.inputs[0].name + "_t", table)
    return save_model(ir, tmp_path / f"{name}.prepared.onnx")


@pytest.mark.parametrize("name", DECODERS)
def test_fold_and_rotate_keep_the_function(name, tmp_path):
    path = _prepared(name, tmp_path)
    ir, fold = run_strictly(path, "fold-norm-weights")
    norms = sum(n.op == "RMSNormalization" for n in ir.graph.nodes)
    assert fold.status == "changed" and fold.stats["folded"] == norms
    assert all(np.all(constant_value(n.inputs[1]) == 1) for n in ir.graph.nodes if n.op == "RMSNormalization")
    folded = save_model(ir, tmp_path / "folded.onnx")
    ir, rot = run_strictly(folded, "rotate-residual")
    assert rot.status == "changed", rot.reason
    assert rot.stats["norms"] == norms and rot.stats["writers"] == norms - 1
    assert rot.verification["ok"] and rot.verification["cosine"] > 0.999999


def test_fold_and_rotate_leave_mapped_weights_on_disk(tmp_path):
    """On a model whose weights are mapped from a file, every folded and turned projection and the
    turned embedding stay recipes until written (a 0.5 B model's weights are never all in memory),
    and what is written is the float64 product, block by block, in the weight's own dtype."""
    from qnnpasses.ir.model import DerivedValues
    from qnnpasses.passmanager.spec import parse_pipeline

    path = save_model(load_model(_prepared("llama_gqa_ts", tmp_path)), tmp_path / "mapped" / "m.onnx", external_data=True)
    ir = load_model(path)
    table_name = next(n.inputs[0].name for n in ir.graph.nodes if n.op == "Gather" and isinstance(n.inputs[0], gs.Constant))
    table = constant_value(next(t for t in ir.graph.tensors().values() if t.name == table_name)).copy()
    result = PassManager(parse_pipeline("fold-norm-weights,rotate-residual")).run(ir)
    assert [r.status for r in result.records] == ["changed", "changed"]
    turned = [t for t in ir.graph.tensors().values() if isinstance(t, gs.Constant) and len(t.shape) >= 2
              and ("_rot" in t.name or "_gamma" in t.name)]
    stats = result.records[1].stats
    assert len(turned) == stats["readers"] + stats["writers"] + 1 and all(isinstance(t._values, DerivedValues) for t in turned), \
        [t.name for t in turned if not isinstance(t._values, DerivedValues)]
    out = load_model(save_model(ir, tmp_path / "turned.onnx", external_data=True))
    gather = next(n for n in out.graph.nodes if n.op == "Gather" and isinstance(n.inputs[0], gs.Constant))
    r, _ = rotation(table.shape[1], "auto", 0)
    np.testing.assert_array_equal(constant_value(gather.inputs[0]), (table.astype(np.float64) @ r).astype(table.dtype))


def test_block_products_equal_the_whole_products(monkeypatch):
    from qnnpasses.passes.outliers import _products

    rng = np.random.default_rng(0)
    w, m = rng.standard_normal((3, 40, 24)).astype(np.float32), rng.standard_normal((24, 24))
    left, scale = rng.standard_normal((40, 40)), rng.uniform(0.5, 2, 40)
    whole = (_products.times_right(w, m), _products.times_left(left, w), _products.scale_rows(w, scale))
    monkeypatch.setattr(_products, "BLOCK_ELEMENTS", 7)  # many blocks, one not full
    blocks = (_products.times_right(w, m), _products.times_left(left, w), _products.scale_rows(w, scale))
    expected = ((w.astype(np.float64) @ m).astype(np.float32), np.matmul(left, w.astype(np.float64)).astype(np.float32),
                (scale[:, None] * w.astype(np.float64)).astype(np.float32))
    for got_whole, got_blocks, want in zip(whole, blocks, expected):
        assert got_whole.dtype == np.float32
        np.testing.assert_allclose(got_whole, want, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got_blocks, want, rtol=1e-6, atol=1e-6)


def test_rotation_spreads_a_massive_channel(tmp_path):
    """A spike of 1000 in one channel of every embedding row becomes ±1000/√n spread over all n."""
    path = _prepared("llama_gqa_ts", tmp_path, spike=1000.0)
    ir, record = run_strictly(path, "fold-norm-weights,rotate-residual")
    assert record.stats["rotated"] == 1
    table = next(constant_value(n.inputs[0]) for n in ir.graph.nodes if n.op == "Gather"
                 and isinstance(n.inputs[0], gs.Constant) and len(n.inputs[0].shape) == 2)
    n = table.shape[1]
    assert np.abs(table).max() < 1000.0 / np.sqrt(n) * 1.5  # 1000 before


def test_rotate_refuses_post_norm_encoders(tmp_path):
    """BERT's LayerNorm output IS the stream: no unit-scale pre-norm, so nothing is rotated."""
    ir = load_model(FIXTURES / "bert_ts.onnx")
    PassManager(get_pipeline("htp-llm")).run(ir)
    path = save_model(ir, tmp_path / "bert.onnx")
    ir, record = run_strictly(path, "rotate-residual")
    assert record.status == "unchanged" and record.stats["rotated"] == 0


@pytest.mark.parametrize("n", [576, 384, 64, 12])
def test_hadamard_orders_of_real_models(n):
    h = hadamard(n)
    assert h is not None and np.array_equal(h @ h.T, n * np.eye(n, dtype=np.int64))
    r, what = rotation(n)
    assert "Hadamard" in what and np.allclose(np.abs(r), 1 / np.sqrt(n))


def test_rotation_without_a_hadamard_is_still_orthogonal():
    r, what = rotation(896)  # 128 x 7: no Hadamard of order 896 is built here
    assert "random" in what and np.allclose(r @ r.T, np.eye(896), atol=1e-12)


@pytest.mark.parametrize("name", ["llama_gqa_ts", "qwen2_dynamo"])
def test_smooth_mlp_migrates_scales_exactly(name, tmp_path):
    from qnnpasses.backends.cpu import make_inputs

    path = _prepared(name, tmp_path)
    ir0 = load_model(path)
    samples = [make_inputs(ir0, seed=s) for s in range(2)]
    ir, record = run_strictly(path, "smooth-mlp", calibration=samples)
    layers = sum(n.op == "RMSNormalization" for n in ir.graph.nodes) // 2
    assert record.status == "changed" and record.stats["smoothed"] == layers
    assert record.verification["ok"]


def test_smooth_mlp_needs_calibration(tmp_path):
    _, record = run_strictly(_prepared("llama_gqa_ts", tmp_path), "smooth-mlp")
    assert record.status == "unchanged" and record.stats["smoothed"] == 0


@pytest.mark.trained
def test_rotation_shrinks_the_trained_residual_stream(tmp_path):
    """SmolLM2-135M: the residual stream entering the norms peaks at |h| ~ 2.6e4 in one channel; after
    fold + rotate (576-point Hadamard) no channel of it exceeds a tenth of that, with the logits unchanged."""
    import sys

    from qnnpasses.passmanager.probe import intermediate_values

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import trained_fixtures as tf

    try:
        tf.ensure_built("smollm2_135m", "ts")
    except RuntimeError as exc:
        pytest.skip(str(exc))
    ir = load_model(tf.DEFAULT_CACHE / "smollm2_135m_ts.onnx")
    PassManager(get_pipeline("htp-llm")).run(ir)
    sample = tf.graph_feeds(tf.load_npz(tf.DEFAULT_CACHE / "smollm2_135m.calib.npz"), 0, ["input_ids", "attention_mask"])

    def peak(model) -> float:
        names = [n.inputs[0].name for n in model.graph.nodes if n.op == "RMSNormalization"]
        values = next(intermediate_values(model, names, [sample]))
        return max(float(np.abs(v).max()) for v in values.values())

    before = peak(ir)
    path = save_model(ir, tmp_path / "smol.onnx")
    rotated, record = run_strictly(path, "fold-norm-weights,rotate-residual", inputs=sample)
    assert record.stats["rotated"] == 1 and record.stats["readers"] == 151  # 30 x (q, k, v, gate, up) + lm_head
    after = peak(rotated)
    assert before > 10_000 and after < before / 10, (before, after)
