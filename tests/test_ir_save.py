"""Saving copies weights from the input's data file inside the kernel where it can: the files
written must be the ones streaming writes, byte for byte, and holes must stay holes."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from conftest import fixture_path

from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import export_with_stubs, resolve_stubs, save_model

SIZE = 1 << 18  # float32 elements: 1 MB per weight, above the alignment threshold


def _external_model(folder, *, hole: bool):
    """x + w1 + w2 with both weights in model.onnx.data; w2 is a hole in the file when ``hole``."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal(SIZE).astype(np.float32)
    data = folder / "model.onnx.data"
    with open(data, "wb") as fh:
        fh.write(w1.tobytes())
        if hole:
            fh.truncate(2 * w1.nbytes)  # w2: zeros the file system does not store
        else:
            fh.write(rng.standard_normal(SIZE).astype(np.float32).tobytes())
    weights = []
    for index, name in enumerate(("w1", "w2")):
        tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[SIZE])
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", data.name), ("offset", index * w1.nbytes), ("length", w1.nbytes)):
            tensor.external_data.add(key=key, value=str(value))
        weights.append(tensor)
    graph = helper.make_graph([helper.make_node("Add", ["x", "w1"], ["a"]), helper.make_node("Add", ["a", "w2"], ["y"])],
                              "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [SIZE])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [SIZE])], weights)
    path = folder / "model.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _saved(model, out_dir, monkeypatch, *, kernel_copy: bool):
    out_dir.mkdir()
    with monkeypatch.context() as patch:
        if not kernel_copy:
            patch.delattr(os, "copy_file_range")
        out = save_model(load_model(model), out_dir / "out.onnx", external_data=True)
    return out.read_bytes(), (out_dir / "out.onnx.data").read_bytes(), os.stat(out_dir / "out.onnx.data")


@pytest.mark.skipif(not hasattr(os, "copy_file_range"), reason="no copy_file_range on this platform")
@pytest.mark.parametrize("hole", [False, True])
def test_kernel_copy_writes_what_streaming_writes(tmp_path, monkeypatch, hole):
    (tmp_path / "in").mkdir()
    model = _external_model(tmp_path / "in", hole=hole)
    streamed = _saved(model, tmp_path / "streamed", monkeypatch, kernel_copy=False)
    copied = _saved(model, tmp_path / "copied", monkeypatch, kernel_copy=True)
    assert copied[:2] == streamed[:2]
    source = (tmp_path / "in" / "model.onnx.data").read_bytes()
    assert copied[1].find(source[:4 * SIZE]) >= 0  # w1's bytes, unchanged
    if hole and os.stat(tmp_path / "in" / "model.onnx.data").st_blocks * 512 < 2 * 4 * SIZE:  # the fs keeps holes
        stat = copied[2]
        assert stat.st_blocks * 512 < stat.st_size - 4 * SIZE // 2  # w2 stayed a hole


def test_save_proto_rewrites_a_loaded_model_in_place(tmp_path):
    """A model read whole and written back over itself: external, its data file is written anew
    (the same bytes, not appended); inline, the old data file goes."""
    from qnnpasses.ir.model import keeps_external_data, save_proto

    (tmp_path / "in").mkdir()
    path = _external_model(tmp_path / "in", hole=False)
    want = (tmp_path / "in" / "model.onnx.data").read_bytes()
    save_proto(onnx.load(str(path)), path, external_data=True)
    assert keeps_external_data(path)
    assert (tmp_path / "in" / "model.onnx.data").read_bytes() == want  # both weights aligned at 0 and 1 MB
    save_proto(onnx.load(str(path)), path, external_data=False)
    assert not keeps_external_data(path) and not (tmp_path / "in" / "model.onnx.data").exists()
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    assert np.frombuffer(want, np.float32).tolist() == np.concatenate([weights["w1"], weights["w2"]]).tolist()
    assert sorted(os.listdir(tmp_path / "in")) == ["model.onnx"]  # no temporary file left


def _filled_in_memory(ir) -> bytes:
    """What an inline save held whole before it streamed: every stub filled into the proto, serialized."""
    proto, sources = export_with_stubs(ir)
    resolve_stubs(proto, sources, None)
    return proto.SerializeToString()


INLINE_CASES = """
<ir_version: 10, opset_import: ["" : 21]>
g (float[4, 512] x, bool c) => (float[4, 512] y, float[4, 512] z) {
  k = Constant<value = float[512] {%s}>()
  a = Add(x, k)
  y = Add(a, w)
  q = DequantizeLinear(w4, s)
  z = If(c) <then_branch = t () => (float[4, 512] u) { u = Mul(a, q) }, else_branch = e () => (float[4, 512] v) { v = Sub(a, x) }>
}
""" % ",".join(["0.5"] * 512)


@pytest.mark.parametrize("name", ["llama_gqa_kv_ts", "gpt2_dynamo", "bert_ts", "attributes"])
def test_an_inline_save_streams_the_bytes_the_filled_proto_serializes_to(tmp_path, name):
    if name == "attributes":  # a stubbed Constant node, an int4 weight, a subgraph
        proto = onnx.parser.parse_model(INLINE_CASES)
        rng = np.random.default_rng(0)
        proto.graph.initializer.extend([
            onnx.numpy_helper.from_array(rng.standard_normal((4, 512)).astype(np.float32), "w"),
            helper.make_tensor("w4", TensorProto.INT4, [4, 512], rng.integers(-8, 8, 2048).tolist()),
            onnx.numpy_helper.from_array(np.float32(0.1), "s")])
        ir = load_model(proto)
    else:
        ir = load_model(fixture_path(name))
    save_model(ir, tmp_path / "model.onnx", external_data=False)
    assert (tmp_path / "model.onnx").read_bytes() == _filled_in_memory(ir)
    assert not (tmp_path / "model.onnx.data").exists()
    if name == "attributes":  # the int4 weight given as int32_data is written packed, as raw_data holds it
        import onnxruntime as ort

        feeds = {"x": np.random.default_rng(1).standard_normal((4, 512)).astype(np.float32), "c": np.array(True)}
        want = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
        got = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)
        for a, b in zip(want, got):
            np.testing.assert_array_equal(a, b)
