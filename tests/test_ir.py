"""IR round trips: load/save with and without external data, bit-identical under onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import fixture_inputs, fixture_path

from qnnpasses.backends.cpu import run_cpu
from qnnpasses.errors import BadInputError
from qnnpasses.ir.canonical import canonical_text
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import ExternalValues, save_model

ROUND_TRIP_FIXTURES = ["llama_gqa_ts", "llama_gqa_dynamo", "bert_ts", "gpt2_dynamo"]


def _external_copy(name: str, tmp_path):
    """The fixture re-saved by onnx itself with every weight in an external file."""
    model = onnx.load(fixture_path(name))
    path = tmp_path / "src" / f"{name}.onnx"
    path.parent.mkdir()
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location=f"{name}.weights", size_threshold=0)
    return path


def _outputs(path, name):
    return run_cpu(path, fixture_inputs(name))


@pytest.mark.parametrize("name", ROUND_TRIP_FIXTURES)
@pytest.mark.parametrize("external", [False, True])
def test_round_trip_inline_source_is_bit_identical(tmp_path, name, external):
    ir = load_model(fixture_path(name))
    out = save_model(ir, tmp_path / "out.onnx", external_data=external)
    assert (tmp_path / "out.onnx.data").exists() == external
    expected, got = _outputs(fixture_path(name), name), _outputs(out, name)
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key])


@pytest.mark.parametrize("name", ["llama_gqa_ts", "bert_dynamo"])
def test_round_trip_external_source_keeps_weights_on_disk(tmp_path, name):
    src = _external_copy(name, tmp_path)
    ir = load_model(src)
    constants = [t for t in ir.graph.tensors().values() if hasattr(t, "_values")]
    lazy = [t for t in constants if isinstance(t._values, ExternalValues)]
    assert lazy, "external initializers must stay lazily mapped, not loaded"
    assert isinstance(lazy[0].values, np.memmap)
    out = save_model(ir, tmp_path / "out" / "model.onnx")  # auto: keeps external data
    assert (tmp_path / "out" / "model.onnx.data").stat().st_size > 100_000
    assert out.stat().st_size < 200_000
    expected, got = _outputs(fixture_path(name), name), _outputs(out, name)
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key])
    # and back to one inline file
    inline = save_model(load_model(out), tmp_path / "inline.onnx", external_data=False)
    for key, value in _outputs(inline, name).items():
        np.testing.assert_array_equal(value, expected[key])


def test_model_fields_survive(tmp_path):
    model = onnx.load(fixture_path("llama_gqa_ts"))
    model.doc_string = "documented"
    model.domain = "org.example"
    model.model_version = 7
    del model.metadata_props[:]
    model.metadata_props.add(key="author", value="qnnpasses tests")
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    saved = onnx.load(save_model(load_model(src), tmp_path / "o.onnx"))
    assert saved.doc_string == "documented" and saved.domain == "org.example" and saved.model_version == 7
    assert {p.key: p.value for p in saved.metadata_props} == {"author": "qnnpasses tests"}
    assert saved.ir_version == model.ir_version
    assert [(o.domain, o.version) for o in saved.opset_import] == [(o.domain, o.version) for o in model.opset_import]
    assert [n.name for n in saved.graph.node] == [n.name or n.op_type for n in model.graph.node][: len(saved.graph.node)]
    assert [i.name for i in saved.graph.input] == [i.name for i in model.graph.input]
    assert len(saved.graph.value_info) > 0


def test_canonical_text_is_stable_and_independent_of_node_order(tmp_path):
    model = onnx.load(fixture_path("bert_ts"))
    shuffled = onnx.ModelProto()
    shuffled.CopyFrom(model)
    nodes = list(shuffled.graph.node)
    del shuffled.graph.node[:]
    # another topological order: a node without inputs can move to the front
    last_constant = max(i for i, n in enumerate(nodes) if n.op_type == "Constant")
    nodes.insert(0, nodes.pop(last_constant))
    shuffled.graph.node.extend(nodes)
    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    onnx.save(model, a)
    onnx.save(shuffled, b)
    text_a, text_b = canonical_text(load_model(a)), canonical_text(load_model(b))
    assert text_a == canonical_text(load_model(a))
    assert text_a == text_b


def test_save_refuses_to_overwrite_the_input(tmp_path):
    src = _external_copy("bert_ts", tmp_path)
    before = src.read_bytes()
    ir = load_model(src)
    with pytest.raises(BadInputError, match="refusing to overwrite"):
        save_model(ir, src)
    assert src.read_bytes() == before


def test_failed_save_leaves_no_partial_output(tmp_path, monkeypatch):
    ir = load_model(fixture_path("bert_ts"))
    import qnnpasses.ir.model as ir_module

    def explode(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(ir_module, "resolve_stubs", explode)
    with pytest.raises(RuntimeError):
        save_model(ir, tmp_path / "out.onnx", external_data=True)
    assert list(tmp_path.iterdir()) == []
