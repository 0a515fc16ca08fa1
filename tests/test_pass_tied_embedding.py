"""tied-embedding: a tied embedding table read from the lm_head's weight, stored once.

A small tied model (``Gather(E)`` and ``MatMul(x, Eᵀ)`` with ``Eᵀ`` stored as its own initializer,
as the exporters write it): the pass is verified EXACT by the pass manager on CPU, drops ``E``,
leaves an untied model alone, and on the HTP (fp16) the rewritten model's outputs are the
original's bit for bit.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import qnnpasses.passes  # noqa: F401 - registers the passes
from conftest import requires_htp
from onnx import TensorProto, helper, numpy_helper
from pass_testing import htp_fp16_outputs, op_counts, run_strictly

from qnnpasses.ir.load import load_model

VOCAB, HIDDEN, SEQ = 96, 16, 5


def tied_model(path, untie: bool = False, untied_token: int = 7, external: bool = False) -> dict:
    rng = np.random.default_rng(0)
    table = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    head = table.T.copy()
    if untie:
        head[3, untied_token] += 1e-3
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [1, SEQ])
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, SEQ, VOCAB])
    nodes = [helper.make_node("Gather", ["embed.weight", "ids"], ["h"], name="embed"),
             helper.make_node("Mul", ["h", "scale"], ["x"], name="block"),
             helper.make_node("MatMul", ["x", "lm_head.weight_t"], ["logits"], name="lm_head")]
    inits = [numpy_helper.from_array(table, "embed.weight"), numpy_helper.from_array(head, "lm_head.weight_t"),
             numpy_helper.from_array(np.full(HIDDEN, 0.5, np.float32), "scale")]
    model = helper.make_model(helper.make_graph(nodes, "tied", [ids], [logits], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, path, save_as_external_data=external, location=f"{path.name}.data", size_threshold=1024)
    return {"ids": rng.integers(0, VOCAB, (1, SEQ)).astype(np.int64)}


def test_a_tied_table_is_read_from_the_lm_head_and_stored_once(tmp_path):
    inputs = tied_model(tmp_path / "tied.onnx")
    ir, record = run_strictly(tmp_path / "tied.onnx", "tied-embedding", inputs=inputs)
    assert record.status == "changed" and record.verification["ok"] and record.verification["max_abs"] == 0.0
    names = {t.name for t in ir.graph.nodes[0].inputs} | {t.name for n in ir.graph.nodes for t in n.inputs}
    assert "embed.weight" not in names and "lm_head.weight_t" in names
    assert op_counts(ir)["Gather"] == 1 and op_counts(ir)["Transpose"] == 1
    gather = next(n for n in ir.graph.nodes if n.op == "Gather")
    assert gather.inputs[0].name == "lm_head.weight_t" and gather.attrs["axis"] == 1


def test_the_table_is_read_from_logits_offset_s_taller_weight(tmp_path):
    """After ``logits-offset{candidates=N}`` the lm_head reads ``[Wᵀ; 1]`` (``[H + 1, V]``) and no
    ``[H, V]`` weight is left: the table is its first H rows, gathered and sliced, stored once."""
    inputs = tied_model(tmp_path / "tied.onnx")
    ir, record = run_strictly(tmp_path / "tied.onnx", "logits-offset{candidates=8},tied-embedding", inputs=inputs)
    assert record.status == "changed" and record.verification["max_abs"] == 0.0
    gather = next(n for n in ir.graph.nodes if n.op == "Gather")
    assert gather.inputs[0].name.startswith("lm_head.weight_t_with_ones") and list(gather.inputs[0].shape) == [HIDDEN + 1, VOCAB]
    assert op_counts(ir)["Slice"] == 1
    tables = sorted(tuple(t.shape) for t in ir.graph.tensors().values()
                    if getattr(t, "values", None) is not None and t.values.ndim == 2)
    assert tables == [(HIDDEN, 8), (HIDDEN + 1, VOCAB)]  # no [V, H] table, no [H, V] weight


def test_a_mapped_stacked_weight_is_matched_without_computing_it(tmp_path, monkeypatch):
    """Weights mapped from a data file: ``logits-offset`` keeps ``[Wᵀ; 1]`` as ``Wᵀ`` and a row of
    ones, and neither the match (it reads the first part's rows) nor the manager's checks and
    verification (the stack is written part by part) ever computes the whole stack."""
    from qnnpasses.ir.model import StackedValues

    def whole(self):
        raise AssertionError("the stacked weight was computed whole")

    monkeypatch.setattr(StackedValues, "load", whole)
    inputs = tied_model(tmp_path / "tied.onnx", external=True)
    ir, record = run_strictly(tmp_path / "tied.onnx", "logits-offset{candidates=8},tied-embedding", inputs=inputs)
    assert record.status == "changed" and record.verification["max_abs"] == 0.0
    gather = next(n for n in ir.graph.nodes if n.op == "Gather")
    assert isinstance(gather.inputs[0]._values, StackedValues)


@pytest.mark.parametrize("token", [0, 40, VOCAB - 1])
def test_the_comparison_in_blocks_sees_every_token(tmp_path, monkeypatch, token):
    """The weight is compared with the table a few tokens at a time: a difference in the first, a
    middle or the last block still leaves the table alone."""
    from qnnpasses.passes.fold import tied_embedding

    monkeypatch.setattr(tied_embedding, "COMPARE_BLOCK_BYTES", 10 * HIDDEN * 4)  # 10 tokens a block
    inputs = tied_model(tmp_path / "untied.onnx", untie=True, untied_token=token)
    _, record = run_strictly(tmp_path / "untied.onnx", "tied-embedding", inputs=inputs)
    assert record.status == "unchanged"
    inputs = tied_model(tmp_path / "tied.onnx")
    _, record = run_strictly(tmp_path / "tied.onnx", "tied-embedding", inputs=inputs)
    assert record.status == "changed"


def test_an_untied_table_is_left_alone(tmp_path):
    inputs = tied_model(tmp_path / "untied.onnx", untie=True)
    _, record = run_strictly(tmp_path / "untied.onnx", "tied-embedding", inputs=inputs)
    assert record.status == "unchanged"


@requires_htp
def test_on_the_htp_the_shared_table_gives_the_same_bits(tmp_path):
    from qnnpasses.ir.load import load_model as load

    inputs = tied_model(tmp_path / "tied.onnx")
    rewritten, _ = run_strictly(tmp_path / "tied.onnx", "tied-embedding", inputs=inputs)
    outputs = htp_fp16_outputs({"original": load(tmp_path / "tied.onnx"), "shared": rewritten}, inputs, tmp_path)
    assert np.array_equal(outputs["original"]["logits"], outputs["shared"]["logits"])

