"""Converter overrides: the AIMET encodings written from a QDQ model pass the JSON schema, read back to the
same encodings (1.0.0 and 0.6.1), name tensors of the prepared float model, and mean the same numbers."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import onnx
import pytest
from conftest import fixture_path
from onnx import numpy_helper

from qnnpasses.errors import BadInputError
from qnnpasses.ir.load import load_model
from qnnpasses.quant.data import token_windows
from qnnpasses.quant.driver import quantize_model
from qnnpasses.quant.overrides import (
    SCHEMA_V1,
    SCHEMA_V2,
    build_overrides,
    encodings_from_qdq,
    read_overrides,
    write_overrides,
)
from qnnpasses.quant.policy import PrecisionPolicy

MIXED = PrecisionPolicy(act="uint8", weights="int8", per_channel=True, sensitive_bits=16)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """llama_gqa_ts quantized with the mixed plan (uint8, 16-bit sensitive, per-channel int8 weights)."""
    tmp = tmp_path_factory.mktemp("overrides")
    ir = load_model(fixture_path("llama_gqa_ts"))
    np.savez(tmp / "calib.npz", **token_windows(ir, 16, seed=0))
    qdq, prepared = tmp / "m.qdq.onnx", tmp / "m.prepared.onnx"
    quantize_model(fixture_path("llama_gqa_ts"), tmp / "calib.npz", qdq, MIXED, keep_prepared=prepared)
    return tmp, qdq, prepared


def test_v1_file_passes_the_schema_and_round_trips(quantized):
    tmp, qdq, _ = quantized
    path = write_overrides(qdq, tmp / "ov.json", quantizer_args=MIXED.quantizer_args())
    doc = json.loads(path.read_text())
    jsonschema.validate(doc, SCHEMA_V1)
    assert doc["version"] == "1.0.0" and doc["param_encodings"] and doc["activation_encodings"]
    written = {e.name: e for e in encodings_from_qdq(qdq)}
    back = read_overrides(path)
    assert set(back) == set(written)
    for name, e in written.items():
        assert (back[name].bw, back[name].offset, back[name].is_sym, back[name].param) == (e.bw, e.offset, e.is_sym, e.param)
        np.testing.assert_allclose(back[name].scale, e.scale, rtol=1e-7)


def test_v2_file_is_quantize_linear_shaped_and_round_trips(quantized):
    """2.0.0: one list, each entry an ONNX QuantizeLinear's output_dtype / y_scale / y_zero_point / axis."""
    tmp, qdq, _ = quantized
    path = write_overrides(qdq, tmp / "ov.v2.json", version="2.0.0")
    doc = json.loads(path.read_text())
    jsonschema.validate(doc, SCHEMA_V2)
    entries = {e["name"]: e for e in doc["encodings"]}
    written = {e.name: e for e in encodings_from_qdq(qdq)}
    assert set(entries) == set(written)
    weight = next(e for e in entries.values() if "axis" in e)
    assert weight["output_dtype"] == "int8" and "y_zero_point" not in weight  # symmetric: zero point omitted
    assert any(e["output_dtype"] == "uint16" and isinstance(e["y_scale"], float) for e in entries.values())
    back = read_overrides(path)
    for name, e in written.items():
        assert (back[name].bw, back[name].offset) == (e.bw, e.offset)


def test_int4_and_block_encodings(tmp_path):
    """w4a16 with 32-row blocks: int4 weights carry a [K/32, N] scale and block_size in both layouts."""
    ir = load_model(fixture_path("llama_gqa_ts"))
    np.savez(tmp_path / "calib.npz", **token_windows(ir, 4, seed=0))
    qdq = tmp_path / "w4.qdq.onnx"
    policy = PrecisionPolicy(weights="int4", weight_scales="mse", block_size=32)
    quantize_model(fixture_path("llama_gqa_ts"), tmp_path / "calib.npz", qdq, policy)
    v2 = build_overrides(encodings_from_qdq(qdq), "2.0.0")
    jsonschema.validate(v2, SCHEMA_V2)
    blocked = [e for e in v2["encodings"] if e.get("block_size")]
    assert blocked and all(e["output_dtype"] == "int4" and e["block_size"] == 32 and e["axis"] == 0 for e in blocked)
    assert {len(e["y_scale"]) for e in blocked} == {2, 4}  # K = 64 or 128 rows: 2 or 4 blocks per column
    v1 = build_overrides(encodings_from_qdq(qdq), "1.0.0")
    assert {e["enc_type"] for e in v1["param_encodings"] if e["bw"] == 4} == {"PER_BLOCK"}
    assert all(e["offset"][0] == -8 for e in v1["param_encodings"] if e["bw"] == 4)


def test_legacy_layout_reads_back_the_same(quantized):
    tmp, qdq, _ = quantized
    legacy = write_overrides(qdq, tmp / "legacy.json", version="0.6.1")
    doc = json.loads(legacy.read_text())
    assert isinstance(doc["activation_encodings"], dict) and isinstance(doc["param_encodings"], dict)
    v1 = read_overrides(write_overrides(qdq, tmp / "v1.json"))
    old = read_overrides(legacy)
    assert {n: (e.bw, e.offset, e.scale) for n, e in old.items()} == {n: (e.bw, e.offset, e.scale) for n, e in v1.items()}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, SCHEMA_V1)  # the schema tells the layouts apart


def test_names_are_tensors_of_the_prepared_float_model(quantized):
    _, qdq, prepared = quantized
    model = onnx.load(str(prepared))
    names = ({i.name for i in model.graph.initializer} | {i.name for i in model.graph.input}
             | {o for n in model.graph.node for o in n.output})
    encodings = encodings_from_qdq(qdq)
    assert encodings and all(e.name in names for e in encodings)
    assert {e.name for e in encodings if e.param} <= {i.name for i in model.graph.initializer}


def test_mixed_plan_shows_in_the_bitwidths(quantized):
    _, qdq, prepared = quantized
    float_model = onnx.load(str(prepared))
    norms = [n.output[0] for n in float_model.graph.node if n.op_type == "RMSNormalization"]
    softmax = [n.output[0] for n in float_model.graph.node if n.op_type == "Softmax"]
    by_name = {e.name: e for e in encodings_from_qdq(qdq)}
    assert all(by_name[t].bw == 16 for t in norms + softmax)
    assert sum(e.bw == 8 for e in by_name.values() if not e.param) >= 10  # the rest stays 8-bit
    per_channel = [e for e in by_name.values() if e.param and len(e.scale) > 1]
    assert len(per_channel) == 15 and all(e.is_sym and e.bw == 8 and set(e.offset) == {-128} for e in per_channel)


def test_offsets_mean_what_the_qdq_model_computes(quantized):
    """AIMET: x = scale * (q + offset), q on the unsigned grid; onnxruntime: x = scale * (q - zero_point)."""
    _, qdq, _ = quantized
    model = onnx.load(str(qdq))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    encodings = {e.name: e for e in encodings_from_qdq(qdq)}
    checked = 0
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] not in inits:
            continue
        name = node.input[0].removesuffix("_quantized")
        if name not in encodings:
            continue
        q, scale, zp = inits[node.input[0]], inits[node.input[1]], inits[node.input[2]]
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        shape = [1] * q.ndim
        if scale.size > 1:
            shape[axis] = -1
        ort = (q.astype(np.float64) - zp.reshape(shape)) * scale.reshape(shape)
        e = encodings[name]
        unsigned = q.astype(np.int64) - np.iinfo(q.dtype).min
        aimet = (unsigned + np.array(e.offset).reshape(shape)) * np.array(e.scale).reshape(shape)
        np.testing.assert_allclose(aimet, ort, rtol=1e-6, atol=1e-12)
        checked += 1
    assert checked >= 9


def test_bad_files_are_one_line_errors(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"version": "1.0.0", "activation_encodings": []}))
    with pytest.raises(BadInputError, match="needs activation_encodings and param_encodings"):
        read_overrides(tmp_path / "a.json")
    (tmp_path / "b.json").write_text("{")
    with pytest.raises(BadInputError, match="cannot read overrides"):
        read_overrides(tmp_path / "b.json")
    with pytest.raises(BadInputError, match="overrides version must be one of"):
        build_overrides([], version="3.0.0")
