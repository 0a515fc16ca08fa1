"""share_external_data: several models, one data file, each distinct weight once, outputs unchanged."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from qnnpasses.errors import BadInputError
from qnnpasses.ir.model import ALIGNMENT
from qnnpasses.ir.shared_data import share_external_data

RNG = np.random.default_rng(0)
W1 = RNG.standard_normal((256, 512)).astype(np.float32)
W2 = RNG.standard_normal((512, 256)).astype(np.float32)
W3 = RNG.standard_normal((256, 256)).astype(np.float32)


def _save(folder, name: str, tokens: int, weights: dict[str, np.ndarray], inline_bias: bool = False):
    """x @ w1 @ w2 (@ w3): every weight in ``name.onnx.data``; a small bias inline when asked."""
    names = list(weights)
    nodes, current = [], "x"
    for i, w in enumerate(names):
        nodes.append(helper.make_node("MatMul", [current, w], [f"h{i}"]))
        current = f"h{i}"
    inits = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    if inline_bias:
        inits.append(numpy_helper.from_array(np.full(4, 0.5, np.float32), "bias"))
        nodes.append(helper.make_node("Add", [current, "bias"], ["y_biased"]))
        current = "y_biased"
    width = weights[names[-1]].shape[1]
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", 1, [tokens, 256])],
                              [helper.make_tensor_value_info(current, 1, [tokens, width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = folder / f"{name}.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location=f"{name}.onnx.data", size_threshold=1024)
    return path


def _outputs(paths, x):
    return [ort.InferenceSession(str(p)).run(None, {"x": x[:4 if "prefill" in p.name else 1]})[0] for p in paths]


def test_one_file_holds_each_distinct_weight_once_and_outputs_are_the_same_bits(tmp_path):
    paths = [_save(tmp_path, "prefill", 4, {"w1": W1, "w2": W2}),
             _save(tmp_path, "decode", 1, {"w1": W1, "w2": W2, "w3": W3})]
    x = RNG.standard_normal((4, 256)).astype(np.float32)
    before = _outputs(paths, x)
    shared = share_external_data(paths, "weights.data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode.onnx", "prefill.onnx", "weights.data"]
    unique = W1.nbytes + W2.nbytes + W3.nbytes
    assert (shared.tensors, shared.unique) == (5, 3)
    assert shared.bytes_before == unique + W1.nbytes + W2.nbytes
    assert unique <= shared.bytes_after == (tmp_path / "weights.data").stat().st_size < unique + 3 * ALIGNMENT
    for got, expected in zip(_outputs(paths, x), before):
        assert np.array_equal(got, expected)
    for path in paths:  # each tensor is one aligned range of the one file
        for tensor in onnx.load(str(path), load_external_data=False).graph.initializer:
            entries = {e.key: e.value for e in tensor.external_data}
            assert entries["location"] == "weights.data" and int(entries["offset"]) % ALIGNMENT == 0


def test_inline_tensors_stay_inline_and_a_second_run_changes_nothing(tmp_path):
    paths = [_save(tmp_path, "prefill", 4, {"w1": W1}, inline_bias=False),
             _save(tmp_path, "decode", 1, {"w1": W1, "w2": W2[:, :4].copy()}, inline_bias=True)]
    share_external_data(paths, "weights.data")
    bias = next(t for t in onnx.load(str(paths[1]), load_external_data=False).graph.initializer if t.name == "bias")
    assert bias.data_location != onnx.TensorProto.EXTERNAL and not bias.external_data
    first = (tmp_path / "weights.data").read_bytes()
    again = share_external_data(paths, "weights.data")
    assert (tmp_path / "weights.data").read_bytes() == first and again.unique == 2


def test_a_failure_leaves_the_folder_as_it_was(tmp_path):
    paths = [_save(tmp_path, "prefill", 4, {"w1": W1}), _save(tmp_path, "decode", 1, {"w1": W1, "w2": W2})]
    (tmp_path / "decode.onnx.data").unlink()  # decode's weights are missing
    listing = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(BadInputError, match="decode.onnx.data' for tensor 'w1' is missing"):
        share_external_data(paths, "weights.data")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == listing


def test_refuses_a_data_file_another_model_of_the_folder_reads(tmp_path):
    other = _save(tmp_path, "other", 1, {"w1": W1})
    onnx.save(onnx.load(str(other)), str(other), save_as_external_data=True, location="weights.data",
              size_threshold=1024)
    (tmp_path / "other.onnx.data").unlink()
    paths = [_save(tmp_path, "prefill", 4, {"w1": W1})]
    with pytest.raises(ValueError, match="another model of the folder reads weights.data"):
        share_external_data(paths, "weights.data")
