"""Loading a model file into the IR, treating it as untrusted input.

Every problem (missing or unreadable file, bytes that are not a model, a graph the
checker rejects, missing or short external data, unknown operators) becomes one
:class:`~qnnpasses.errors.BadInputError` line.  Weights stored as external data are
attached as lazy memory maps, never read here.
"""

from __future__ import annotations

import os
import sys
from collections import OrderedDict
from pathlib import Path

import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.importers.onnx_importer import OnnxImporter
from onnx_graphsurgeon.ir.tensor import LazyValues

from qnnpasses.errors import BadInputError
from qnnpasses.ir.checks import check_model, runtime_only_ops
from qnnpasses.ir.graph_ops import edge_list
from qnnpasses.ir.model import (
    ExternalSource,
    ExternalValues,
    IRModel,
    _all_initializers,
    _constants_with_attributes,
    _external_key,
    _one_line,
    _tensor_nbytes,
    iter_graphs,
)


def load_model(model: str | os.PathLike | onnx.ModelProto) -> IRModel:
    """Load a path or ``ModelProto`` into the IR, validating it as untrusted input.

    Raises :class:`BadInputError` with a one-line message for anything that is not a
    usable ONNX model: missing or unreadable file, bytes that are not a model, a graph
    the checker rejects, missing or short external data, unknown operators.
    """
    if isinstance(model, onnx.ModelProto):
        proto, base_dir, path = model, Path.cwd(), None
    else:
        path = Path(model)
        proto = _read_model_file(path)
        base_dir = path.resolve().parent
    _validate_model_proto(proto, str(path or "<model>"))
    sources = _external_sources(proto, base_dir, str(path or "<model>"))
    graph = _import_graph(proto, str(path or "<model>"))
    _attach_external_values(graph, sources)
    _name_unnamed_nodes(graph)
    ir = IRModel(
        graph=graph,
        path=path,
        ir_version=proto.ir_version,
        producer_name=proto.producer_name,
        producer_version=proto.producer_version,
        domain=proto.domain,
        model_version=proto.model_version,
        doc_string=proto.doc_string,
        metadata_props={p.key: p.value for p in proto.metadata_props},
        had_external_data=bool(sources),
    )
    try:
        problem = check_model(ir, refresh=True)
    except Exception as exc:  # graphsurgeon cannot export it (optional types, invalid UTF-8 strings, ...)
        raise BadInputError(f"{path or 'model'}: the graph cannot be represented: {type(exc).__name__}: {_one_line(exc)}") from None
    if problem:
        raise BadInputError(f"{path or 'model'} fails the ONNX checker: {problem}")
    if path is not None:  # a user's file, not a model built or reloaded in memory by a tool
        _report_runtime_only_ops(proto, str(path))
    return ir


def _report_runtime_only_ops(proto: onnx.ModelProto, where: str) -> None:
    """One stderr line naming the default-domain ops only onnxruntime knows (loaded, not refused)."""
    found = runtime_only_ops(proto)
    if found:
        listed = ", ".join(f"{op} ({count})" for op, count in sorted(found.items()))
        print(f"note: {where} uses operators onnxruntime runs but the ONNX checker does not know: {listed}; "
              "the htp-llm pipeline lowers them (lower-simplified-norm)", file=sys.stderr)


def _read_model_file(path: Path) -> onnx.ModelProto:
    if not path.exists():
        raise BadInputError(f"no such file: {path}")
    if path.is_dir():
        raise BadInputError(f"{path} is a directory, not an ONNX model file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BadInputError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not data:
        raise BadInputError(f"{path} is empty")
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except Exception as exc:  # protobuf raises DecodeError or RuntimeWarning-ish errors
        raise BadInputError(f"{path} is not an ONNX model (protobuf parse failed: {_one_line(exc)}); truncated or corrupt file?") from None
    return proto


def _validate_model_proto(proto: onnx.ModelProto, where: str) -> None:
    if not proto.HasField("graph") or proto.ir_version <= 0 or not proto.opset_import:
        raise BadInputError(f"{where} is not an ONNX model (no graph, IR version or opset import); truncated or corrupt file?")
    known = onnx.defs.onnx_opset_version()
    for imp in proto.opset_import:
        if imp.domain in ("", "ai.onnx") and imp.version > known:
            raise BadInputError(
                f"{where} imports ONNX opset {imp.version}, newer than the {known} this onnx {onnx.__version__} knows; upgrade onnx"
            )
    if len(proto.graph.node) == 0:
        raise BadInputError(f"{where} has an empty graph (no nodes)")
    for side, values in (("input", proto.graph.input), ("output", proto.graph.output)):
        for value in values:
            kind = value.type.WhichOneof("value")
            if kind not in (None, "tensor_type"):  # the IR (graphsurgeon) would export it as a tensor
                raise BadInputError(f"{where}: graph {side} '{value.name}' is a {kind.replace('_type', '')}; "
                                    "only tensor inputs and outputs are supported")
    if proto.ir_version > onnx.IR_VERSION:
        raise BadInputError(f"{where} has IR version {proto.ir_version}, newer than {onnx.IR_VERSION} that onnx {onnx.__version__} knows")


def _external_sources(proto: onnx.ModelProto, base_dir: Path, where: str) -> dict[tuple, ExternalSource]:
    """Check every external-data reference and map each tensor to its bytes on disk."""
    sources: dict[tuple, ExternalSource] = {}
    sizes: dict[Path, int] = {}
    files: dict[str, Path] = {}  # location -> resolved file: resolving is a syscall per path component
    folder = base_dir.resolve()
    for tensor in _all_initializers(proto.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location")
        if not location:
            raise BadInputError(f"{where}: tensor '{tensor.name}' is external but names no data file")
        file = files.get(location)
        if file is None:
            file = files[location] = (base_dir / location).resolve()
            if not file.is_relative_to(folder):
                # onnxruntime refuses these too; reading them would let a model pull in any file
                raise BadInputError(f"{where}: external data location '{location}' of tensor '{tensor.name}' "
                                    "points outside the model's folder")
        if file not in sizes:
            if not file.is_file():
                raise BadInputError(f"{where}: external data file '{location}' for tensor '{tensor.name}' is missing")
            sizes[file] = file.stat().st_size
        offset = _external_int(info, "offset", 0, tensor, where)
        expected = _tensor_nbytes(tensor)
        length = _external_int(info, "length", expected if expected >= 0 else sizes[file] - offset, tensor, where)
        if expected >= 0 and length < expected:
            raise BadInputError(f"{where}: tensor '{tensor.name}' declares {length} bytes of external data but needs {expected}")
        if offset + length > sizes[file]:
            raise BadInputError(
                f"{where}: external data file '{location}' is too short for tensor '{tensor.name}' "
                f"(needs bytes up to {offset + length}, file has {sizes[file]})"
            )
        sources[_external_key(tensor)] = ExternalSource(file, offset, length)
    return sources


def _external_int(info: dict[str, str], key: str, default: int, tensor: onnx.TensorProto, where: str) -> int:
    """An external-data ``offset``/``length`` as a non-negative integer, or a one-line refusal."""
    try:
        value = int(info.get(key, default))
    except ValueError:
        raise BadInputError(f"{where}: tensor '{tensor.name}' has external data {key} '{info[key]}', not an integer") from None
    if value < 0:
        raise BadInputError(f"{where}: tensor '{tensor.name}' has a negative external data {key} ({value})")
    return value


def _import_graph(proto: onnx.ModelProto, where: str) -> gs.Graph:
    try:
        if proto.functions or proto.graph.sparse_initializer:
            return gs.import_onnx(proto)
        return _import_main_graph(proto)
    except Exception as exc:
        raise BadInputError(f"{where}: cannot import the graph: {_one_line(exc)}") from None


def _import_main_graph(model: onnx.ModelProto) -> gs.Graph:
    """``gs.import_onnx`` of a model without functions or sparse initializers, the same graph
    (tests/test_ir_import.py compares them) in about half the time: initializers, nodes and
    the tensors nodes create are built directly, not through graphsurgeon's synchronizing
    setters, which were most of a load.  Value infos, graph inputs and outputs, and
    attributes (subgraphs included) still go through graphsurgeon's importer, in its order."""
    graph = model.graph
    opset = OnnxImporter.get_opset(model)
    tensors: dict[str, gs.Tensor] = {}

    def get(onnx_tensor, overwrite: bool = False) -> gs.Tensor:
        known = tensors.get(onnx_tensor.name)
        if known is None:
            known = tensors[onnx_tensor.name] = OnnxImporter.import_tensor(onnx_tensor)
        elif overwrite:  # a repeated value info may add what the first one lacked
            fresh = OnnxImporter.import_tensor(onnx_tensor)
            if isinstance(known, gs.Variable):
                known.dtype = known.dtype or fresh.dtype
                known.shape = known.shape or fresh.shape
        return known

    for initializer in graph.initializer:
        if initializer.name not in tensors:
            tensors[initializer.name] = _constant(initializer)
    for info in graph.value_info:
        get(info, overwrite=True)
    initializer_names = {t.name for t in graph.initializer}
    inputs = [get(t) for t in graph.input if t.name not in initializer_names]
    outputs = [get(t) for t in graph.output]
    nodes = [_import_node(node, tensors, opset, model.opset_import) for node in graph.node]
    return gs.Graph(nodes=nodes, inputs=inputs, outputs=outputs, name=graph.name, doc_string=graph.doc_string,
                    producer_name=model.producer_name, producer_version=model.producer_version, opset=opset,
                    import_domains=model.opset_import, functions=[], ir_version=model.ir_version)


def _import_node(proto: onnx.NodeProto, tensors: dict[str, gs.Tensor], opset, domains) -> gs.Node:
    """graphsurgeon's ``import_node`` for a main-graph node: the state ``gs.Node`` and
    ``gs.Variable`` set in their constructors, and both sides of every edge."""
    attrs = (OnnxImporter.import_attributes(proto.attribute, {}, tensors, opset, domains) if proto.attribute
             else OrderedDict())  # what graphsurgeon gives for none, without its per-node setup
    node = object.__new__(gs.Node)
    inputs, outputs = edge_list(node, "outputs"), edge_list(node, "inputs")
    node.__dict__.update(op=proto.op_type, name=proto.name, attrs=attrs, inputs=inputs, outputs=outputs,
                         domain=proto.domain if proto.HasField("domain") else None)
    for names, edges, back in ((proto.input, inputs, "outputs"), (proto.output, outputs, "inputs")):
        for name in names:
            tensor = tensors.get(name)
            if tensor is None:  # an omitted optional one (no name) is not tracked
                tensor = gs.Variable.empty() if not name else tensors.setdefault(name, _variable(name))
            list.append(edges, tensor)
            list.append(getattr(tensor, back), node)
    return node


def _constant(proto: onnx.TensorProto) -> gs.Constant:
    """graphsurgeon's import of an initializer (values read lazily), without its setters."""
    tensor = object.__new__(gs.Constant)
    location = int(proto.data_location) if proto.HasField("data_location") else None
    tensor.__dict__.update(name=proto.name, inputs=edge_list(tensor, "outputs"), outputs=edge_list(tensor, "inputs"),
                           _values=LazyValues(proto), data_location=location, _export_dtype=None)
    return tensor


def _variable(name: str) -> gs.Variable:
    """``gs.Variable(name)``, without its setters."""
    tensor = object.__new__(gs.Variable)
    tensor.__dict__.update(name=name, inputs=edge_list(tensor, "outputs"), outputs=edge_list(tensor, "inputs"),
                           dtype=None, shape=None, type="tensor_type")
    return tensor


def _attach_external_values(graph: gs.Graph, sources: dict[tuple, ExternalSource]) -> None:
    if not sources:
        return
    for g in iter_graphs(graph):
        for tensor in _constants_with_attributes(g):
            values = tensor._values
            if isinstance(values, LazyValues) and values.tensor.data_location == onnx.TensorProto.EXTERNAL:
                tensor._values = ExternalValues(values.tensor, sources[_external_key(values.tensor)])
                # where the bytes go is decided when saving; a stale EXTERNAL mark would
                # follow the values into an inline tensor once they are loaded
                tensor.data_location = None


def _name_unnamed_nodes(graph: gs.Graph) -> None:
    """Give every node a unique name: per-pass records and diffs refer to nodes by name."""
    seen: set[str] = set()
    for g in iter_graphs(graph):
        for index, node in enumerate(g.nodes):
            name = node.name or f"{node.op}_{index}"
            candidate, suffix = name, 1
            while candidate in seen:
                candidate = f"{name}__{suffix}"
                suffix += 1
            node.name = candidate
            seen.add(candidate)
