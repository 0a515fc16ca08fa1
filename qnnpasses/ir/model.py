"""The IR: an onnx-graphsurgeon graph plus the model-level fields graphsurgeon drops.

Weights are never copied into the pass loop.  Initializers stored as external data
stay on disk and are read lazily through a read-only memory map; inline ones stay in
their original ``TensorProto``.  Whenever the graph is turned back into a
``ModelProto`` (for the checker, shape inference or saving), every large constant is
replaced by a small *stub* that refers to its source, so the protobuf never carries
the weights and never hits the 2 GB limit.  Only :func:`save_model` writes weight
bytes, streaming each tensor once into the output.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import operator
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Union

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter, check_duplicate_node_names
from onnx_graphsurgeon.ir.tensor import LazyValues, SparseValues
from onnx_graphsurgeon.logger import G_LOGGER

from qnnpasses.errors import BadInputError
from qnnpasses.ir.graph_ops import copy_graph

# Constants at least this large become stubs when the graph is exported for analysis.
STUB_THRESHOLD_BYTES = 1024
# Constants at least this large go to the external data file when saving with external data.
EXTERNAL_THRESHOLD_BYTES = 1024
# Tensors at least this large are aligned in the data file so they can be memory-mapped.
ALIGN_THRESHOLD_BYTES = 1 << 20
ALIGNMENT = 4096
# Above this many weight bytes a model is always saved with external data.
INLINE_LIMIT_BYTES = 1_800_000_000
_STUB_PREFIX = "qnnpasses-source:"
_COPY_CHUNK = 64 << 20


@dataclass(frozen=True)
class ExternalSource:
    """Bytes ``[offset, offset+length)`` of an external data file."""

    path: Path
    offset: int
    length: int


Source = Union[ExternalSource, np.ndarray, onnx.TensorProto, "DerivedValues"]


class ExternalValues(LazyValues):
    """Lazily loaded values of an external-data initializer: a read-only memory map."""

    def __init__(self, tensor: onnx.TensorProto, source: ExternalSource):
        super().__init__(tensor)
        self.source = source

    def load(self) -> np.ndarray:
        np_dtype = onnx.helper.tensor_dtype_to_np_dtype(self.tensor.data_type)
        shape = tuple(self.tensor.dims)
        if self.source.length == 0 or 0 in shape:
            return np.zeros(shape, dtype=np_dtype)
        if np_dtype.kind not in "biufc":  # bfloat16, float8: let onnx convert them
            return onnx.numpy_helper.to_array(self.tensor, base_dir=str(self.source.path.parent))
        array = np.memmap(self.source.path, dtype=np_dtype, mode="r", offset=self.source.offset, shape=shape)
        array.qnnpasses_source = self.source  # views do not inherit it; see _source_of
        return array


class DerivedValues(LazyValues):
    """Values a pass computed from a mapped weight, kept as a recipe until they are read.

    A pass that permutes or reshapes a 7B model's weights would otherwise hold every
    rewritten weight in memory until the output is written.  The recipe maps its source
    afresh on each read, so saving computes one tensor at a time and lets it go.
    """

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, compute):
        super().__init__(onnx.TensorProto(data_type=onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype)),
                                          dims=list(shape)))
        self.compute = compute

    def load(self) -> np.ndarray:
        return self.compute()


def mapped_source(values) -> ExternalSource | None:
    """The external bytes ``values`` maps, when it is (a plain view of) a whole mapped weight.

    ``np.asarray`` of a memory map is a base-class view that drops our tag; follow ``.base``
    to the tagged map and accept it only if the view covers it exactly.
    """
    current = values
    while isinstance(current, np.ndarray):
        source = getattr(current, "qnnpasses_source", None)
        if source is not None:
            same = (current.__array_interface__["data"][0] == values.__array_interface__["data"][0]
                    and current.shape == values.shape and current.strides == values.strides
                    and current.dtype == values.dtype)
            return source if same else None
        current = current.base
    return None


def derived_from(values: np.ndarray | DerivedValues, transform, *, dtype=None,
                 shape: tuple[int, ...] | None = None) -> np.ndarray | DerivedValues:
    """``transform(values)`` for a new constant: a lazy recipe when ``values`` is a weight
    mapped from an external file or itself a recipe (the two compose), else computed now.
    ``transform`` must be a pure function of its input array (reshape, transpose, slicing,
    arithmetic, a product with a fixed matrix).  ``dtype``: the output dtype of a ``transform``
    whose output keeps the input's shape (a widening ``astype``, ``W·R`` with a square ``R``);
    then the shape is known without running it, else it is learnt on a zero-strided stand-in
    (``shape``: the output's, for a ``transform`` that would allocate it, as a concatenation does)."""
    if isinstance(values, DerivedValues):
        in_shape, in_dtype = tuple(values.shape), np.dtype(values.dtype)
        ghost = np.lib.stride_tricks.as_strided(np.zeros(1, in_dtype), shape=in_shape, strides=(0,) * len(in_shape))
        out_shape = shape or (in_shape if dtype is not None else np.shape(transform(ghost)))
        return DerivedValues(out_shape, dtype or in_dtype, lambda: np.ascontiguousarray(transform(values.load())))
    source = mapped_source(values)
    if source is None:
        return np.ascontiguousarray(transform(values))
    in_shape = values.shape
    # zero strides: the transformed shape without touching (or allocating) any data
    ghost = np.lib.stride_tricks.as_strided(np.zeros(1, values.dtype), shape=in_shape, strides=(0,) * len(in_shape))
    out_shape = shape or (np.shape(transform(ghost)) if dtype is None else in_shape)
    source_dtype, dtype = values.dtype, np.dtype(dtype or values.dtype)

    def compute() -> np.ndarray:
        fresh = np.memmap(source.path, dtype=source_dtype, mode="r", offset=source.offset, shape=in_shape)
        return np.ascontiguousarray(transform(fresh))

    return DerivedValues(out_shape, dtype, compute)


class StackedValues(DerivedValues):
    """Arrays stacked along their first axis, kept as those parts until read (``[W; 1]`` of a
    mapped lm_head weight ``W``).

    In C order a stack's bytes are its parts' bytes one after the other: saving streams each
    part in turn (a mapped one from its file), and a reader of the first rows takes them from
    the first part (:func:`leading_rows`), so neither ever holds the whole stack.
    """

    def __init__(self, parts: list[np.ndarray | DerivedValues]):
        parts = tuple(parts)
        first = parts[0]
        if any(tuple(p.shape[1:]) != tuple(first.shape[1:]) or np.dtype(p.dtype) != np.dtype(first.dtype)
               for p in parts):
            raise ValueError("stacked parts differ in their trailing dims or dtype")
        shape = (sum(int(p.shape[0]) for p in parts), *first.shape[1:])
        super().__init__(shape, np.dtype(first.dtype), lambda: np.concatenate([_loaded(p) for p in parts], axis=0))
        self.parts = parts


def _loaded(values: np.ndarray | DerivedValues) -> np.ndarray:
    return values.load() if isinstance(values, DerivedValues) else np.asarray(values)


def stacked_from(parts: list[np.ndarray | DerivedValues]) -> np.ndarray | StackedValues:
    """``np.concatenate(parts, axis=0)`` for a new constant: kept as its parts
    (:class:`StackedValues`) where one of them is a mapped weight or a recipe, else computed now."""
    if any(isinstance(p, DerivedValues) or mapped_source(p) is not None for p in parts):
        return StackedValues(parts)
    return np.concatenate(parts, axis=0)


def leading_rows(values: np.ndarray | DerivedValues, rows: int) -> np.ndarray:
    """The first ``rows`` rows (first axis) of a constant's values: from the first part of a
    :class:`StackedValues` when it holds them (a mapped part stays mapped, a recipe part is
    computed without the rest of the stack), else from the loaded values."""
    if isinstance(values, StackedValues) and int(values.parts[0].shape[0]) >= rows:
        return _loaded(values.parts[0])[:rows]
    return _loaded(values)[:rows]


class _StubValues(LazyValues):
    """Stands in for a constant's values while exporting: the proto refers to a source index."""


class _LastExport:
    """What one export built, for the next export to reuse: the pass manager exports the
    graph after every pass, and a pass changes little of it.  Keys hold everything the
    built object holds, so an object is reused only where building it afresh would give
    the same.  Only what the last export used is kept: the cache never outgrows a graph.
    Reused protobuf objects are only ever copied into an export, never handed out."""

    def __init__(self) -> None:
        self._previous: dict = {}
        self._current: dict = {}

    def reuse(self, key: tuple, build):
        """The object built for ``key`` by the last export, else ``build(key)``."""
        found = self._previous.get(key)
        if found is None:
            found = build(key)
        self._current[key] = found
        return found

    def finish(self) -> None:
        """An export ended: what it used is what the next one may reuse."""
        self._previous, self._current = self._current, {}


def _make_stub(key: tuple) -> _StubValues:
    name, data_type, dims, index = key
    stub = onnx.TensorProto(name=name, data_type=data_type, dims=dims)
    stub.data_location = onnx.TensorProto.EXTERNAL
    stub.external_data.add(key="location", value=f"{_STUB_PREFIX}{index}")
    return _StubValues(stub)


# Stubs by (name, dtype, dims, source index), NodeProtos by _node_key, main-graph
# ValueInfoProtos by _value_info_key.
_STUBS, _NODE_PROTOS, _VALUE_INFOS = _LastExport(), _LastExport(), _LastExport()
# serialized GraphProto.node entries by _node_key (export_for_check)
_NODE_ENTRIES = _LastExport()


@dataclass
class IRModel:
    """A model under rewrite: the graph and the ``ModelProto`` fields around it."""

    graph: gs.Graph
    path: Path | None = None
    ir_version: int = onnx.IR_VERSION
    producer_name: str = ""
    producer_version: str = ""
    domain: str = ""
    model_version: int = 0
    doc_string: str = ""
    metadata_props: dict[str, str] = field(default_factory=dict)
    had_external_data: bool = False
    #: the fingerprint (:mod:`qnnpasses.ir.fingerprint`) of the graph as it last passed
    #: :func:`qnnpasses.ir.checks.check_model` with its shapes refreshed
    checked: Any = field(default=None, repr=False, compare=False)

    @property
    def opset(self) -> int:
        return int(self.graph.opset)

    def graphs(self) -> Iterator[gs.Graph]:
        """The main graph and every nested subgraph (If/Loop/Scan bodies)."""
        return iter_graphs(self.graph)

    def weight_bytes(self) -> int:
        return sum(const_nbytes(t) for g in self.graphs() for t in _constants_with_attributes(g))

    def to_proto(self) -> tuple[onnx.ModelProto, list[Source]]:
        """Export to a ``ModelProto`` whose large constants are stubs; returns the sources too."""
        return export_with_stubs(self)

    def copy(self) -> "IRModel":
        """A structural copy (to rewrite without touching this one: compare's bisection, pass
        probes); constant arrays are shared, never mutated in place."""
        fields = {f: getattr(self, f) for f in self.__dataclass_fields__}
        graph = copy_graph(self.graph)
        # graphsurgeon's copy shares the opset-import objects: a pass that raises an
        # opset in place must not change the rollback copy too
        graph.import_domains = copy.deepcopy(self.graph.import_domains)
        fields.update(graph=graph, metadata_props=dict(self.metadata_props), checked=None)
        return IRModel(**fields)


#: the default-domain operators with graph attributes (the ONNX spec's control flow); an op of
#: any other domain may have them too
SUBGRAPH_OPS = frozenset({"If", "Loop", "Scan", "SequenceMap"})
_DEFAULT_DOMAINS = frozenset({"", "ai.onnx", None})


def iter_graphs(graph: gs.Graph) -> Iterator[gs.Graph]:
    """``graph`` and every subgraph in its nodes' attributes, depth first.  Runs several times
    per pass (the manager's fingerprint and snapshot walk every graph), so it reads the
    attributes only of a node that can own a subgraph (:data:`SUBGRAPH_OPS`, or an op of
    another domain), each once, and no list item but the first: an ONNX attribute list holds
    one type."""
    yield graph
    for node in graph.nodes:
        attrs = node.attrs
        if not attrs or (node.op not in SUBGRAPH_OPS and node.domain in _DEFAULT_DOMAINS):
            continue
        for value in attrs.values():
            if isinstance(value, gs.Graph):
                yield from iter_graphs(value)
            elif type(value) is list and value and isinstance(value[0], gs.Graph):
                for sub in value:
                    yield from iter_graphs(sub)


def node_count(graph: gs.Graph) -> int:
    """How many nodes ``graph`` and its subgraphs hold."""
    return sum(len(g.nodes) for g in iter_graphs(graph))


def has_op(graph: gs.Graph, ops: frozenset[str]) -> bool:
    """Whether a node of ``graph`` or of a subgraph has one of the op types ``ops``."""
    return any(node.op in ops for g in iter_graphs(graph) for node in g.nodes)


def const_nbytes(tensor: gs.Constant) -> int:
    values = tensor._values
    if isinstance(values, LazyValues):
        return int(values.nbytes)
    return int(values.nbytes)


def _all_initializers(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every stored tensor: initializers, then tensors in node attributes, subgraphs included."""
    for tensor, _ in _stored_tensors(graph):
        yield tensor


def _stored_tensors(graph: onnx.GraphProto) -> Iterator[tuple[onnx.TensorProto, bool]]:
    """``(tensor, is_attribute)`` for every initializer and attribute tensor, recursively."""
    for tensor in graph.initializer:
        yield tensor, False
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t, True
            elif attr.type == onnx.AttributeProto.GRAPH:
                yield from _stored_tensors(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _stored_tensors(g)


def _tensor_nbytes(tensor: onnx.TensorProto) -> int:
    """Bytes of a tensor's data, or -1 for an unknown dtype.  Runs for every stored tensor
    on load and save: integer dims multiply without numpy, the itemsize is looked up once."""
    count = math.prod(tensor.dims)
    itemsize = _itemsize(tensor.data_type)
    if itemsize < 0:
        return -1
    if tensor.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return (count + 1) // 2
    return count * itemsize


@functools.cache
def _itemsize(data_type: int) -> int:
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(data_type).itemsize
    except Exception:  # unknown dtype: fall back to the declared length
        return -1


def _external_key(tensor: onnx.TensorProto) -> tuple:
    """Identifies an external tensor across protobuf wrapper objects (their ids are not stable)."""
    return (tensor.name, tuple((e.key, e.value) for e in tensor.external_data))


def _tensor_lists(graph: gs.Graph) -> Iterator[list[gs.Tensor]]:
    """The graph's inputs, every node's inputs and outputs, and the graph's outputs, in
    the order ``graph.tensors()`` visits them."""
    yield graph.inputs
    for node in graph.nodes:
        yield node.inputs
        yield node.outputs
    yield graph.outputs


def _constants_with_attributes(graph: gs.Graph) -> Iterator[gs.Constant]:
    """Initializers and the tensors held in node attributes (Constant nodes' ``value``).

    One walk over the nodes (``graph.tensors()`` would build a name map each call)."""
    seen: set[int] = set()
    attributes = []
    for tensors in _tensor_lists(graph):
        for tensor in tensors:
            if isinstance(tensor, gs.Constant) and id(tensor) not in seen:
                seen.add(id(tensor))
                yield tensor
    for node in graph.nodes:
        for value in node.attrs.values():
            if isinstance(value, gs.Constant):
                attributes.append(value)
    yield from attributes


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


# --------------------------------------------------------------------------- exporting


def _source_of(tensor: gs.Constant) -> Source:
    values = tensor._values
    if isinstance(values, ExternalValues):
        return values.source
    if isinstance(values, DerivedValues):
        return values
    if isinstance(values, np.ndarray) and mapped_source(values) is not None:
        # a weight a pass has read: stream it from its file; copying it through the
        # mapping would make every page of it resident (RSS = model size)
        return mapped_source(values)
    if isinstance(values, LazyValues):
        return values.tensor
    return values


def _onnx_dtype(tensor: gs.Constant) -> int:
    values = tensor._values
    if isinstance(values, LazyValues):
        return values.tensor.data_type
    export_dtype = getattr(tensor, "export_dtype", None)
    if export_dtype is not None and not isinstance(export_dtype, np.dtype):
        return int(export_dtype)
    return onnx.helper.np_dtype_to_tensor_dtype(values.dtype)


def export_with_stubs(ir: IRModel, threshold: int = STUB_THRESHOLD_BYTES, *,
                      value_infos: bool = True) -> tuple[onnx.ModelProto, list[Source]]:
    """``ModelProto`` of the IR in which constants of ``threshold`` bytes or more are stubs.

    A stub is an external-data tensor whose location is ``qnnpasses-source:<i>``; the
    returned list holds source ``i``.  The checker and shape inference read only dims
    and dtypes of such tensors, so the proto stays small whatever the weight size.
    ``value_infos=False`` leaves out the intermediate tensors' types and shapes (the main
    graph's): what a check that re-infers them from scratch needs, at about half the cost.
    """
    with _stubs_in_place(ir, threshold) as sources:
        proto = _export_model(ir.graph, value_infos, _export_nodes(ir.graph.nodes))
    _set_model_fields(proto, ir)
    return proto, sources


def export_for_check(ir: IRModel) -> tuple[onnx.ModelProto, list[tuple[gs.Node, bytes | onnx.NodeProto]]]:
    """What a graph check serializes, in parts: :func:`export_with_stubs` (no value infos)
    without the main graph's nodes, and each of those nodes with either its serialized
    ``GraphProto.node`` entry (field tag, length, NodeProto bytes: the last export's where the
    node still holds the same, see :func:`_node_key`) or, for a node with a tensor, graph or
    other non-plain attribute, its ``NodeProto`` (constants stubbed as above) for the caller
    to edit and serialize.  Concatenated after the graph's own bytes the entries are the
    graph's nodes in order (protobuf appends a repeated field's occurrences): checking a
    graph after a pass that changed a few nodes costs a dictionary lookup per node instead of
    building and copying every NodeProto, then serializing them twice (checker, inference)."""
    with _stubs_in_place(ir, STUB_THRESHOLD_BYTES):
        proto = _export_model(ir.graph, False, [])
        nodes = []
        for node in ir.graph.nodes:
            key = _node_key(node)
            nodes.append((node, OnnxExporter.export_node(node) if key is None
                          else _NODE_ENTRIES.reuse(key, lambda _, node=node: node_entry(OnnxExporter.export_node(node)))))
        _NODE_ENTRIES.finish()
    _set_model_fields(proto, ir)
    return proto, nodes


def node_entry(node: onnx.NodeProto) -> bytes:
    """``node`` as one serialized occurrence of ``GraphProto.node`` (field 1, length-delimited)."""
    return length_delimited(1, node.SerializeToString())


def length_delimited(field_number: int, payload: bytes) -> bytes:
    """A protobuf length-delimited field: its tag (wire type 2), the payload's length, both as
    varints, then the payload."""
    return _field_header(field_number, len(payload)) + payload


def _field_header(field_number: int, length: int) -> bytes:
    """What precedes a length-delimited field's ``length`` bytes of payload."""
    return _varint(field_number << 3 | 2) + _varint(length)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


@contextlib.contextmanager
def _stubs_in_place(ir: IRModel, threshold: int) -> Iterator[list[Source]]:
    """While open, every constant of ``threshold`` bytes or more (and every external or derived
    one, at any size) holds a stub instead of its values; yields the stubs' sources by index."""
    sources: list[Source] = []
    swapped: list[tuple[gs.Constant, object]] = []
    try:
        for g in ir.graphs():
            for tensor in _constants_with_attributes(g):
                if isinstance(tensor._values, _StubValues):
                    continue
                # external data is always stubbed: its location is relative to the input's folder;
                # so is a recipe, whose placeholder proto holds no values
                if const_nbytes(tensor) < threshold and not isinstance(tensor._values, (ExternalValues, DerivedValues)):
                    continue
                stub = _STUBS.reuse((tensor.name, _onnx_dtype(tensor), tuple(tensor.shape), len(sources)), _make_stub)
                sources.append(_source_of(tensor))
                swapped.append((tensor, tensor._values))
                tensor._values = stub
        yield sources
        _STUBS.finish()
    finally:
        for tensor, values in swapped:
            tensor._values = values


def _set_model_fields(proto: onnx.ModelProto, ir: IRModel) -> None:
    proto.ir_version = ir.ir_version
    proto.producer_name = ir.producer_name
    proto.producer_version = ir.producer_version
    proto.domain = ir.domain
    proto.model_version = ir.model_version
    proto.doc_string = ir.doc_string
    del proto.metadata_props[:]
    for key, value in ir.metadata_props.items():
        proto.metadata_props.add(key=key, value=value)


def _export_model(graph: gs.Graph, value_infos: bool, nodes: list[onnx.NodeProto]) -> onnx.ModelProto:
    """``gs.export_onnx(graph, do_type_check=False)``, byte for byte, with the main graph's
    ``nodes`` (:func:`_export_nodes`'s); ``value_infos=False`` leaves out its intermediate
    value infos (and takes the initializers by name, see :func:`_initializers`)."""
    exporter = OnnxExporter
    inputs = [exporter.export_value_info_proto(t, False) for t in graph.inputs]
    outputs = [exporter.export_value_info_proto(t, False) for t in graph.outputs]
    if value_infos:
        check_duplicate_node_names(graph.nodes, level=G_LOGGER.WARNING)
        tensor_map = graph.tensors()
        constants = [t for t in tensor_map.values() if isinstance(t, gs.Constant)]
        for tensor in graph.inputs + graph.outputs:
            tensor_map.pop(tensor.name, None)
        infos = _export_value_infos(t for t in tensor_map.values()
                                    if isinstance(t, gs.Variable) and (t.dtype is not None or t.shape is not None))
    else:
        constants, infos = list(_initializers(graph)), []
    onnx_graph = onnx.helper.make_graph(
        nodes=nodes,
        name=graph.name,
        inputs=inputs,
        outputs=outputs,
        initializer=[exporter.export_tensor_proto(t) for t in constants if not isinstance(t._values, SparseValues)],
        sparse_initializer=[exporter.export_sparse_tensor_proto(t) for t in constants if isinstance(t._values, SparseValues)],
        doc_string=graph.doc_string,
        value_info=infos,
    )
    model = onnx.helper.make_model(onnx_graph, functions=[exporter.export_function(f) for f in graph.functions],
                                   opset_imports=_opset_imports(graph))
    model.producer_name, model.producer_version = graph.producer_name, graph.producer_version
    if graph.ir_version is not None:
        model.ir_version = graph.ir_version
    return model


def _opset_imports(graph: gs.Graph) -> list[onnx.OperatorSetIdProto]:
    """graphsurgeon's ``update_import_domains``: the graph's opset imports, after adding (at
    version 1) every domain a node of it or of a subgraph uses.  Walks the subgraphs with
    :func:`iter_graphs`, a tenth of the cost of graphsurgeon's generator per node."""
    if graph.import_domains is None:
        graph.import_domains = [onnx.helper.make_opsetid("", graph.opset)]
    used = {node.domain for g in iter_graphs(graph) for node in g.nodes}
    used.discard(None)
    current = {opset.domain for opset in graph.import_domains}
    for domain in used:
        if domain not in current:
            graph.import_domains.append(onnx.helper.make_opsetid(domain, 1))
            current.add(domain)
    return graph.import_domains


_PLAIN_ATTRIBUTES = (int, bool, str, bytes, type)
_PLAIN_ITEMS = frozenset((*_PLAIN_ATTRIBUTES, float))
_NAME = operator.attrgetter("name")


def _export_nodes(nodes: list[gs.Node]) -> list[onnx.NodeProto]:
    """Every node's NodeProto, the last export's where the node still holds the same (building
    them afresh was most of an export's cost)."""
    protos = []
    for node in nodes:
        key = _node_key(node)
        protos.append(OnnxExporter.export_node(node) if key is None
                      else _NODE_PROTOS.reuse(key, lambda _, node=node: OnnxExporter.export_node(node)))
    _NODE_PROTOS.finish()
    return protos


def _export_value_infos(tensors) -> list[onnx.ValueInfoProto]:
    """The main graph's value infos, the last export's where the tensor still has the same
    name, type and shape."""
    infos = []
    for tensor in tensors:
        key = _value_info_key(tensor)
        infos.append(OnnxExporter.export_value_info_proto(tensor, False) if key is None
                     else _VALUE_INFOS.reuse(key, lambda _, t=tensor: OnnxExporter.export_value_info_proto(t, False)))
    _VALUE_INFOS.finish()
    return infos


def _value_info_key(tensor: gs.Tensor) -> tuple | None:
    """All ``export_value_info_proto`` reads from ``tensor`` (dims with their types: a numpy
    integer would fail where an int exports), or ``None`` when that is not hashable."""
    shape = tensor.shape
    key = (type(tensor), tensor.name, type(tensor.dtype), tensor.dtype, getattr(tensor, "type", None),
           None if shape is None else (type(shape), tuple(shape), tuple(map(type, shape))))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _node_key(node: gs.Node) -> tuple | None:
    """All ``export_node`` reads from ``node``, by value: op, domain, name, tensor names and
    attributes (with their Python types, as ``1``, ``1.0`` and ``True`` export differently;
    floats by their bits, as ``-0.0 == 0.0``).  ``None`` for a node with a tensor, graph or
    other non-plain attribute: that one is exported afresh every time.  Runs for every node
    on every export, hence the C-level ``map`` over names and types."""
    attributes = ()
    if node.attrs:
        attributes = []
        for name, value in node.attrs.items():
            kind = type(value)
            if kind in _PLAIN_ATTRIBUTES:
                attributes.append((name, kind, value))
            elif kind is float:
                attributes.append((name, kind, value.hex()))
            elif kind is list or kind is tuple:
                items = _plain_items(value)
                if items is None:
                    return None
                attributes.append((name, kind, items))
            else:
                return None
        attributes = tuple(attributes)
    return (node.op, node.domain, node.name, tuple(map(_NAME, node.inputs)), tuple(map(_NAME, node.outputs)),
            attributes)


def _plain_items(values: list | tuple) -> tuple | None:
    """A list attribute's item types and values (floats by their bits), or ``None`` if an
    item is not plain."""
    kinds = tuple(map(type, values))
    if not _PLAIN_ITEMS.issuperset(kinds):
        return None
    if float in kinds:
        values = [v.hex() if k is float else v for k, v in zip(kinds, values)]
    return kinds, tuple(values)


def _initializers(graph: gs.Graph) -> Iterator[gs.Constant]:
    """The graph's initializers (by name, as graphsurgeon exports them; no attribute tensors)."""
    by_name: dict[str, gs.Constant] = {}
    for tensors in _tensor_lists(graph):
        for tensor in tensors:
            if isinstance(tensor, gs.Constant) and tensor.name:
                by_name[tensor.name] = tensor
    return iter(by_name.values())


def stub_index(tensor: onnx.TensorProto) -> int | None:
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return None
    for entry in tensor.external_data:
        if entry.key == "location" and entry.value.startswith(_STUB_PREFIX):
            return int(entry.value[len(_STUB_PREFIX):])
    return None


def source_bytes(source: Source) -> Iterator[bytes | memoryview]:
    """Stream the bytes of a source in chunks, reading each weight exactly once."""
    if isinstance(source, ExternalSource):
        with open(source.path, "rb") as fh:
            fh.seek(source.offset)
            remaining = source.length
            while remaining > 0:
                chunk = fh.read(min(_COPY_CHUNK, remaining))
                if not chunk:
                    raise BadInputError(f"external data file {source.path.name} ended early")
                remaining -= len(chunk)
                yield chunk
    elif isinstance(source, StackedValues):
        for part in source.parts:  # a mapped part streams from its file, not through its mapping
            yield from source_bytes(mapped_source(part) or part)
    elif isinstance(source, DerivedValues):
        yield memoryview(source.load()).cast("B")
    elif isinstance(source, onnx.TensorProto):
        if source.HasField("raw_data"):
            yield source.raw_data
        else:  # typed fields (int32_data, ...): the array's bytes as raw_data stores them (4-bit packed)
            yield from source_bytes(onnx.numpy_helper.to_array(source))
    elif isinstance(source, np.ndarray) and source.dtype.name in ("int4", "uint4"):
        yield onnx.numpy_helper.from_array(source).raw_data  # ml_dtypes 4-bit values: ONNX packs two per byte
    else:
        array = np.ascontiguousarray(source)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        yield memoryview(array).cast("B")


def resolve_stubs(proto: onnx.ModelProto, sources: list[Source], data_file: Path | None) -> None:
    """Fill every stub: inline as ``raw_data``, or streamed into ``data_file``.

    With a data file, tensors below :data:`EXTERNAL_THRESHOLD_BYTES` are kept inline,
    and so are tensors in node attributes (onnxruntime reads external data only for
    initializers).
    """
    out = open(data_file, "wb") if data_file is not None else None
    try:
        for tensor, is_attribute in _stored_tensors(proto.graph):
            index = stub_index(tensor)
            if index is None:
                big = tensor.HasField("raw_data") and len(tensor.raw_data) >= EXTERNAL_THRESHOLD_BYTES
                if out is not None and big and not is_attribute:
                    _write_external(tensor, [tensor.raw_data], out, data_file)
                continue
            chunks = source_bytes(sources[index])
            if out is None or is_attribute or _tensor_nbytes(tensor) < EXTERNAL_THRESHOLD_BYTES:
                tensor.raw_data = b"".join(bytes(c) for c in chunks)
                del tensor.external_data[:]
                # cleared, not set to DEFAULT: a weight inlined from its lazy source must give
                # the bytes it gives once a pass has read it (which exports no such field)
                tensor.ClearField("data_location")
            else:
                _write_external(tensor, chunks, out, data_file, sources[index])
    finally:
        if out is not None:
            out.truncate(out.tell())  # a trailing hole still needs the file to reach its end
            out.close()


def _all_zero(chunk: bytes | memoryview) -> bool:
    """Whether ``chunk`` holds only zero bytes (numpy scans about ten times faster than
    ``bytes.count``, which made this check cost as much as writing the chunk)."""
    return not np.frombuffer(chunk, dtype=np.uint8).any()


def _write_external(tensor: onnx.TensorProto, chunks, out, data_file: Path, source: Source | None = None) -> None:
    position = out.tell()
    if _tensor_nbytes(tensor) >= ALIGN_THRESHOLD_BYTES and position % ALIGNMENT:
        out.write(b"\0" * (ALIGNMENT - position % ALIGNMENT))
        position = out.tell()
    length = _copy_in_kernel(source, out) if isinstance(source, ExternalSource) else None
    if length is None:
        length = 0
        for chunk in chunks:
            if _all_zero(chunk):
                out.seek(len(chunk), os.SEEK_CUR)  # keep holes: a sparse input stays sparse
            else:
                out.write(chunk)
            length += len(chunk)
    tensor.ClearField("raw_data")
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=data_file.name)
    tensor.external_data.add(key="offset", value=str(position))
    tensor.external_data.add(key="length", value=str(length))


def _copy_in_kernel(source: ExternalSource, out) -> int | None:
    """Copy a weight from its file to ``out``'s position inside the kernel (copy_file_range):
    the bytes never pass through Python, a third of the CPU time of reading and writing them.
    ``None`` -- stream the chunks instead -- where the range has a hole (streaming keeps
    holes) or the kernel cannot copy between these files; a partial copy is then overwritten.
    """
    seek_hole = getattr(os, "SEEK_HOLE", None)
    if seek_hole is None or not hasattr(os, "copy_file_range") or source.length == 0:
        return None
    position = out.tell()
    try:
        with open(source.path, "rb") as src:
            if os.lseek(src.fileno(), source.offset, seek_hole) < source.offset + source.length:
                return None  # the end of the file counts as a hole: a short file streams, and fails there
            out.flush()
            done = 0
            while done < source.length:
                copied = os.copy_file_range(src.fileno(), out.fileno(), source.length - done,
                                            source.offset + done, position + done)
                if copied == 0:
                    return None
                done += copied
    except OSError:  # EXDEV, ENOSYS, EINVAL (filesystems without it), ENXIO (offset past the end)
        return None
    out.seek(position + done)
    return done


# --------------------------------------------------------------------------- saving


def save_model(ir: IRModel, path: str | os.PathLike, *, external_data: bool | None = None) -> Path:
    """Write the IR atomically to ``path`` (and ``path.data`` when weights go external).

    ``external_data=None`` keeps the input's choice, and always goes external above
    :data:`INLINE_LIMIT_BYTES`.  Temporary files are renamed into place only after
    everything was written, so a failure never leaves a half-written output; the input
    model and its data file are never overwritten.
    """
    out = Path(path)
    if external_data is None:
        external_data = ir.had_external_data or ir.weight_bytes() > INLINE_LIMIT_BYTES
    data_file = out.with_name(out.name + ".data") if external_data else None
    _refuse_overwriting_input(ir, out, data_file)
    proto, sources = export_with_stubs(ir)
    _write_files(proto, sources, out, data_file)
    return out


def save_proto(proto: onnx.ModelProto, path: str | os.PathLike, *, external_data: bool) -> Path:
    """Write a fully loaded ``proto`` atomically to ``path``, its large initializers to ``path.data``
    when ``external_data`` (aligned, so a session maps them instead of copying them).

    For a model a tool loaded and changed whole (``onnx.load`` with its data); the proto's
    tensors are moved to the file, so it is spent afterwards.  A file read with its external
    data and written back in place keeps the data file it had: the old one is replaced, never
    appended to or left behind with the weights now inline.
    """
    out = Path(path)
    data_file = out.with_name(out.name + ".data") if external_data else None
    _write_files(proto, [], out, data_file)
    if data_file is None:
        out.with_name(out.name + ".data").unlink(missing_ok=True)
    return out


def _write_files(proto: onnx.ModelProto, sources: list[Source], out: Path, data_file: Path | None) -> None:
    """Resolve ``proto``'s stubs into ``data_file`` (or inline) and write both under temporary
    names, renamed into place only after everything was written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_model = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp_data = data_file.with_name(f".{data_file.name}.tmp-{os.getpid()}") if data_file else None
    try:
        if tmp_data is None:
            _write_inline(proto, sources, tmp_model)
        else:
            resolve_stubs(proto, sources, tmp_data)
            # the proto must name the final data file, not the temporary one
            for tensor in _all_initializers(proto.graph):
                for entry in tensor.external_data:
                    if entry.key == "location" and entry.value == tmp_data.name:
                        entry.value = data_file.name
            with open(tmp_model, "wb") as fh:
                fh.write(proto.SerializeToString())
        if tmp_data is not None:
            os.replace(tmp_data, data_file)
        os.replace(tmp_model, out)
    except BaseException:
        for tmp in (tmp_model, tmp_data):
            if tmp is not None and tmp.exists():
                tmp.unlink()
        raise


def _write_inline(proto: onnx.ModelProto, sources: list[Source], path: Path) -> None:
    """Write ``proto`` to ``path`` with every stub inline: the bytes ``resolve_stubs(proto,
    sources, None)`` then ``SerializeToString()`` would give, in the same canonical field order,
    but with the main graph's stubbed initializers streamed from their sources into the file.
    Filling them into the proto first held every weight three times over at the end (the
    sources' bytes, the proto's copy, the serialized model): a 128-layer TorchScript LLaMA's
    save spent more time in the kernel, faulting those pages in, than writing.  Tensors in node
    attributes and subgraphs are filled in place as before (few, and small in every export seen)."""
    graph = proto.graph
    streamed: dict[int, tuple[int, int]] = {}  # initializer position -> (source index, bytes)
    for position, tensor in enumerate(graph.initializer):
        index = stub_index(tensor)
        size = -1 if index is None or tensor.data_type == onnx.TensorProto.STRING else _tensor_nbytes(tensor)
        if size >= 0 and not tensor.HasField("doc_string") and not tensor.HasField("segment"):
            # as resolve_stubs leaves it, less the raw_data (field 9, after every field a stub sets)
            del tensor.external_data[:]
            tensor.ClearField("data_location")
            streamed[position] = (index, size)
    resolve_stubs(proto, sources, None)  # what is left: attribute and subgraph tensors
    heads = [tensor.SerializeToString() for tensor in graph.initializer]
    del graph.initializer[:]
    graph_bytes = graph.SerializeToString()
    proto.ClearField("graph")
    model_bytes = proto.SerializeToString()
    # canonical order: GraphProto's node (1) and name (2) before the initializers (5), the rest
    # after; ModelProto's fields 1-6 before its graph (7), the rest after
    graph_split, model_split = _first_field_after(graph_bytes, 5), _first_field_after(model_bytes, 7)
    entries = []
    for position, head in enumerate(heads):
        index, size = streamed.get(position, (None, 0))
        raw = _field_header(9, size) if index is not None else b""
        entries.append((_field_header(5, len(head) + len(raw) + size) + head + raw, index, size))
    graph_length = len(graph_bytes) + sum(len(entry) + size for entry, _, size in entries)
    with open(path, "wb") as fh:
        fh.write(model_bytes[:model_split])
        fh.write(_field_header(7, graph_length))
        fh.write(graph_bytes[:graph_split])
        for entry, index, size in entries:
            fh.write(entry)
            if index is None:
                continue
            written = 0
            for chunk in source_bytes(sources[index]):
                written += fh.write(chunk)
            if written != size:
                raise ValueError(f"weight {index} gave {written} bytes where its tensor holds {size}")
        fh.write(graph_bytes[graph_split:])
        fh.write(model_bytes[model_split:])


def _first_field_after(data: bytes, number: int) -> int:
    """Offset in the serialized message ``data`` of its first field numbered above ``number``
    (``len(data)`` if none): where the fields up to ``number`` end in canonical order."""
    position = 0
    while position < len(data):
        tag, after = _read_varint(data, position)
        if tag >> 3 > number:
            return position
        wire = tag & 7
        if wire == 2:
            length, after = _read_varint(data, after)
            position = after + length
        elif wire == 0:
            position = _read_varint(data, after)[1]
        else:  # fixed 64 or 32 bits (no group fields in onnx.proto)
            position = after + (8 if wire == 1 else 4)
    return position


def _read_varint(data: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[position]
        value |= (byte & 0x7F) << shift
        position += 1
        if byte < 0x80:
            return value, position
        shift += 7


#: Bits of an ONNX tensor element type whose numpy itemsize is not its storage (packed 4-bit types).
_PACKED_BITS = {"INT4": 4, "UINT4": 4, "FLOAT4E2M1": 4}


def file_weight_bytes(path: str | Path, *, float_bytes: int | None = None) -> int:
    """Bytes of the initializers of ``path`` (external data is not read); with ``float_bytes``,
    floating-point initializers count at that size per element."""
    import onnx

    total = 0.0
    for tensor in onnx.load(str(path), load_external_data=False).graph.initializer:
        count = int(np.prod(tensor.dims)) if tensor.dims else 1
        name = onnx.TensorProto.DataType.Name(tensor.data_type)
        if name in _PACKED_BITS:
            total += count * _PACKED_BITS[name] / 8
            continue
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
        size = float_bytes if float_bytes and dtype.kind == "f" else dtype.itemsize
        total += count * size
    return int(total)


def keeps_external_data(path: str | os.PathLike) -> bool:
    """Whether the model file at ``path`` keeps initializers in an external-data file (not read)."""
    return any(t.data_location == onnx.TensorProto.EXTERNAL
               for t in _all_initializers(onnx.load(str(path), load_external_data=False).graph))


def remove_model(path: str | os.PathLike) -> None:
    """Delete a model :func:`save_model` wrote: ``path`` and the ``path.data`` beside it, where present."""
    path = Path(path)
    for f in (path, path.with_name(path.name + ".data")):
        f.unlink(missing_ok=True)


def _refuse_overwriting_input(ir: IRModel, out: Path, data_file: Path | None) -> None:
    protected = {path.resolve() for path in {s.path for s in _external_files(ir)}}  # resolve each file once
    if ir.path is not None:
        protected.add(ir.path.resolve())
    for target in (out, data_file):
        if target is not None and target.resolve() in protected:
            raise BadInputError(f"refusing to overwrite the input file {target}; choose another output path")


def _external_files(ir: IRModel) -> list[ExternalSource]:
    return [
        t._values.source
        for g in ir.graphs()
        for t in _constants_with_attributes(g)
        if isinstance(t._values, ExternalValues)
    ]


def to_model_bytes(ir: IRModel) -> bytes:
    """The whole model as one serialized protobuf with inline weights (small models only)."""
    proto, sources = export_with_stubs(ir)
    resolve_stubs(proto, sources, None)
    return proto.SerializeToString()
