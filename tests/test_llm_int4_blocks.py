"""w4a16's int4 grid chosen by asking the HTP (qnnpasses/llm/int4_blocks.py, docs/int4_blocks.md).

Before a w4a16 pair is quantized, the first layer of its prefill graph (the graph from its
inputs to the end of the first layer's MLP) is quantized with int4 weights in blocks and
prepared on the HTP: where that fails and one scale per output channel prepares, the pair is
quantized per output channel.  Checked on the backend: a one-layer decoder with Qwen2.5-0.5B's
layer shape at context 1024 / prefill 128 (where the HTP refuses the blocks) builds, compiles
and runs as one partition per graph (a minute or two: under the ``heavy`` marker); the
random-weight fixture at context 256 keeps its blocks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import fixture_path, requires_htp

from qnnpasses.ir.load import load_model
from qnnpasses.ir.read import is_constant
from qnnpasses.quant.shared import PRECISIONS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import probe_int4_blocks as tool  # noqa: E402


def _float_prefill(tmp_path: Path, context: int = 256, prefill: int = 16) -> dict:
    return tool.float_prefill(fixture_path("llama_gqa_kv_dyn_ts"), context, prefill, tmp_path)


def test_the_piece_is_the_graph_up_to_the_end_of_the_first_layer(tmp_path):
    """The piece reads only the prefill graph's own inputs (ids, positions, mask, the first
    layer's cache), writes that layer's new K/V, holds the token embedding and every projection
    of the first layer and nothing of the second."""
    from qnnpasses.llm.int4_blocks import first_layer

    manifest = _float_prefill(tmp_path)
    roles = manifest["graphs"]["prefill"]["roles"]
    ir = load_model(tmp_path / "prefill.onnx")
    graph_inputs = {t.name for t in ir.graph.inputs}
    weights = sum(n.op == "MatMul" and is_constant(n.inputs[1]) for n in ir.graph.nodes)
    piece = first_layer(ir, roles["input_ids"], [roles["past_key"][0], roles["past_value"][0]])
    inputs = {t.name for t in piece.graph.inputs}
    assert inputs <= graph_inputs and {roles["past_key"][0], roles["past_value"][0]} <= inputs
    assert not inputs & {roles["past_key"][1], roles["past_value"][1]}
    outputs = {t.name for t in piece.graph.outputs}
    assert {roles["new_key"][0], roles["new_value"][0]} <= outputs
    assert "Gather" in {n.op for n in piece.graph.nodes}
    held = sum(n.op == "MatMul" and is_constant(n.inputs[1]) for n in piece.graph.nodes)
    # per layer q, k, v, o, gate, up, down and the rotary's two half-turns (MatMuls by a constant
    # [head_dim, head_dim]), then the lm_head: the first layer's nine
    assert (weights, held) == (2 * 9 + 1, 9)


def test_the_user_s_grid_is_kept_and_without_a_backend_the_default(tmp_path):
    from qnnpasses.llm.int4_blocks import choose_block_rows
    from qnnpasses.llm.report import int4_grid_line

    policy = PRECISIONS["w4a16"]
    assert choose_block_rows(tmp_path, {}, policy, 0, backend=True) == (0, {"chosen_by": "--int4-blocks"})
    assert choose_block_rows(tmp_path, {}, policy, 64, backend=True) == (64, {"chosen_by": "--int4-blocks"})
    rows, why = choose_block_rows(tmp_path, {}, policy, None, backend=False)
    assert (rows, why["chosen_by"]) == (policy.block_size, "default") and "no HTP backend" in why["probe"]
    assert int4_grid_line(rows, why) == ("int4 weights: one scale per 32 input rows; "
                                         "the default (not run: no HTP backend here).")
    assert int4_grid_line(0, {"chosen_by": "--int4-blocks"}) == ("int4 weights: one scale per output channel; "
                                                                "as --int4-blocks asked.")


@requires_htp
def test_blocks_stay_where_the_htp_prepares_them(tmp_path):
    """The random-weight fixture (hidden 64) at context 256 / prefill 16: the first layer prepares
    with blocks of 32 rows, so the pair keeps them, and the report keeps the probe's answer."""
    from qnnpasses.llm.int4_blocks import choose_block_rows

    manifest = _float_prefill(tmp_path)
    rows, why = choose_block_rows(tmp_path, manifest, PRECISIONS["w4a16"], None, backend=True)
    assert rows == 32 and why["chosen_by"] == "default", why
    assert why["probe"]["blocks"]["prepared"] is True and "per_channel" not in why["probe"]


@requires_htp
def test_blocks_the_htp_splits_off_to_the_cpu_are_not_prepared(tmp_path):
    """On HTP v68 (SA8295P) the same piece with int4 weights in blocks compiles only as several HTP
    partitions with CPU nodes between them (the compile's summary names no binary for a
    partition that shares the main one's context): the probe answers "not prepared", and one
    scale per output channel is one partition."""
    from qnnpasses.backends.targets import activate, active, resolve
    from qnnpasses.llm.int4_blocks import choose_block_rows

    manifest = _float_prefill(tmp_path)
    before = active()
    activate(resolve("sa8295"))
    try:
        rows, why = choose_block_rows(tmp_path, manifest, PRECISIONS["w4a16"], None, backend=True)
    finally:
        activate(before)
    assert (rows, why["chosen_by"]) == (0, "probe"), why
    assert why["probe"]["blocks"]["prepared"] is False and "HTP partitions" in why["probe"]["blocks"]["error"]
    assert why["probe"]["per_channel"] == {**why["probe"]["per_channel"], "prepared": True, "error": None}


@requires_htp
@pytest.mark.heavy
def test_a_layer_the_htp_cannot_prepare_in_blocks_is_built_per_channel_and_compiles(tmp_path):
    """Qwen2.5-0.5B's layer shape (hidden 896, 14 / 2 heads, MLP 4864; one layer, vocabulary
    1,024), exported by transformers' TorchScript path, at context 1024 / prefill 128: the HTP
    fails to finalize the prefill graph with int4 blocks (MEM_ALLOC) and prepares it per output
    channel.  `qnnpasses llm --precision w4a16` finds that out before quantizing, quantizes per
    output channel, and both graphs compile to one HTP partition with no CPU node."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from qnnpasses.llm.convert import build

    model = tool.one_layer_export("qwen2.5-0.5b", tmp_path / "export")
    calib = tmp_path / "calib.npz"
    np.savez(calib, input_ids=np.random.default_rng(0).integers(0, tool.VOCAB, (4, 300)))
    manifest = build(model, tmp_path / "pair", context=1024, prefill=128, precision="w4a16", calib=calib,
                     try_shared=False)
    report = json.loads((tmp_path / "pair" / "report.json").read_text())
    chosen = report["quantization"]["int4_blocks"]
    assert chosen["chosen_by"] == "probe", chosen
    assert chosen["probe"]["blocks"]["prepared"] is False
    assert "QNN_COMMON_ERROR_MEM_ALLOC" in chosen["probe"]["blocks"]["error"]
    assert chosen["probe"]["per_channel"]["prepared"] is True
    assert report["quantization"]["int4_block_rows"] == "per channel"
    prefill = onnx.load(str(tmp_path / "pair" / "prefill.onnx"), load_external_data=False)
    inits = {i.name: i.data_type for i in prefill.graph.initializer}
    int4 = [n for n in prefill.graph.node
            if n.op_type == "DequantizeLinear" and inits.get(n.input[0]) == onnx.TensorProto.INT4]
    assert len(int4) == 7 and not [n.name for n in int4 if any(a.name == "block_size" for a in n.attribute)]
    for name in ("prefill", "decode"):
        part = report["htp"][name]["parts"][0]
        assert (part["ok"], part["qnn_partitions"], part["cpu_nodes"]) == (True, 1, 0), part
    assert manifest["graphs"]["prefill"]["parts"][0]["compiled"]
    text = (tmp_path / "pair" / "report.md").read_text()
    assert "int4 weights: one scale per output channel; the HTP failed to prepare the first layer in blocks" in text


def test_the_doc_is_what_the_tool_writes():
    doc = json.loads(tool.DOC_JSON.read_text())
    assert tool.render(doc) == tool.DOC_MD.read_text()
    rows = [r for r in doc["rows"] if "build" in r]
    # the probe stands in for the pair's compile: they agree wherever both ran
    assert rows and all(r["build"]["compiled"] == r["blocks"] for r in rows)
    # and wherever the blocks failed, one scale per output channel prepared
    assert all(r["per_channel"] for r in doc["rows"] if r["blocks"] is False)
