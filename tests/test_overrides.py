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
    assert len(per_channel) == 9 and all(e.is_sym and e.bw == 8 and set(e.offset) == {-128} for e in per_channel)


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
        build_overrides([], version="2.0.0")
