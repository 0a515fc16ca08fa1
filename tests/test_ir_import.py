"""Loading builds the graph itself (faster than graphsurgeon's importer): it must be the graph
graphsurgeon builds -- the same objects' state, the same sharing and the same edges both ways."""

from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs
import pytest
from conftest import FIXTURES

from qnnpasses.ir.load import _import_main_graph

EDGE_CASES = """
<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
g (float[2, "n"] x, float[3] w) => (float[2, "n"] y, float[] z) <float[3] w = {1.0, 2.0, 3.0}, float[1] k = {4.0}> {
  a = Mul(x, k)
  b, = Dropout(a, , )
  c = com.microsoft.Gelu(b)
  t = Constant<value = float[2] {5.0, 6.0}>()
  cond = Constant<value = bool {1}>()
  y = If(cond) <then_branch = g1 () => (float[2, "n"] o) { o = Add(c, k) },
                else_branch = g2 () => (float[2, "n"] o) { o = Sub(c, a) }>
  z = Concat<axis = 0>(w, t, k)
}
"""


def _value_infos(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with value infos, one of them repeated (the importer merges repeats)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    if inferred.graph.value_info:
        repeat = onnx.ValueInfoProto(name=inferred.graph.value_info[0].name)
        inferred.graph.value_info.append(repeat)
    return inferred


def _stored_apart(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its first initializer marked external (never read by the import) and
    stored twice under one name (the import keeps the first)."""
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    first = changed.graph.initializer[0]
    first.data_location = onnx.TensorProto.EXTERNAL
    first.external_data.add(key="location", value="weights.bin")
    changed.graph.initializer.append(changed.graph.initializer[1])
    changed.graph.initializer[-1].name = changed.graph.initializer[0].name
    return changed


def _models() -> list[tuple[str, onnx.ModelProto]]:
    edge = onnx.parser.parse_model(EDGE_CASES)
    fixtures = [(path.stem, onnx.load(path, load_external_data=False)) for path in sorted(FIXTURES.glob("*.onnx"))]
    return [("edge_cases", edge), ("edge_cases_value_infos", _value_infos(edge)),
            ("edge_cases_stored_apart", _stored_apart(edge)), *fixtures]


def _state(graph: gs.Graph) -> tuple:
    """A comparable picture of ``graph``: every node and tensor by its ``__dict__`` in order,
    objects named by when they were first met (so sharing and edges must match too)."""
    index: dict[int, int] = {}
    objects: list = []

    def describe(value):
        if isinstance(value, (gs.Node, gs.Tensor)):
            if id(value) not in index:
                index[id(value)] = len(objects)
                objects.append(value)
            return ("ref", index[id(value)])
        if isinstance(value, gs.Graph):
            return ("graph", [describe(getattr(value, k)) for k in
                              ("nodes", "inputs", "outputs", "name", "doc_string", "opset", "producer_name",
                               "producer_version", "ir_version", "functions")], list(value.import_domains))
        if isinstance(value, list):
            return (type(value).__name__, [describe(v) for v in value])
        if isinstance(value, dict):
            return (type(value).__name__, [(k, describe(v)) for k, v in value.items()])
        if hasattr(value, "tensor"):  # LazyValues: the proto it reads
            return (type(value).__name__, value.tensor.SerializeToString())
        return value

    top = describe(graph)
    states = []
    while len(states) < len(objects):
        obj = objects[len(states)]
        states.append((type(obj).__name__, [(k, describe(v)) for k, v in vars(obj).items()]))
    return top, states


@pytest.mark.parametrize("name,model", _models(), ids=[m[0] for m in _models()])
def test_import_builds_graphsurgeons_graph(name, model):
    ours, theirs = _import_main_graph(model), gs.import_onnx(model)
    assert _state(ours) == _state(theirs)
    exported = gs.export_onnx(ours, do_type_check=False).SerializeToString()
    assert exported == gs.export_onnx(theirs, do_type_check=False).SerializeToString()
