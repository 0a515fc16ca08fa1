"""Graph well-formedness: the ONNX checker, strict shape inference, and known operators.

Runs on the stubbed ``ModelProto`` (see :mod:`qnnpasses.ir.model`), so it costs the same for
a 10 GB model as for a 1 MB one.  :func:`refresh_shapes` writes the inferred dtypes
and shapes back into the graph so that passes can read them from tensors.
"""

from __future__ import annotations

import functools

import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

from qnnpasses.ir.fingerprint import Fingerprint, fingerprint
from qnnpasses.ir.model import (
    SUBGRAPH_OPS,
    IRModel,
    export_for_check,
    export_with_stubs,
    length_delimited,
    node_entry,
    stub_index,
)

# Domains whose operators onnxruntime knows even where onnx has no schema for them.
KNOWN_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "com.microsoft", "ai.onnx.preview.training", "com.microsoft.nchwc"})


def check_model(ir: IRModel, *, refresh: bool = False, now: Fingerprint | None = None) -> str | None:
    """One line describing why the model is not well-formed, or ``None`` when it is.

    With ``refresh`` the inferred dtypes and shapes are written back into the graph, and
    the graph's fingerprint is kept in ``ir.checked`` (``now`` when the caller has just
    taken it: the refresh changes nothing a fingerprint holds): :func:`passed_check` then
    knows the graph it describes is well-formed without checking it again.
    """
    return _check(ir, refresh, now)[0]


def check_with_output_dims(ir: IRModel) -> tuple[str | None, dict[str, list[int | None]]]:
    """:func:`check_model` with ``refresh``, also returning the dims strict inference gives
    each graph output (an int where static, else ``None``): a pass that needs them (fix-shapes)
    takes them from the one inference the check runs anyway, and the manager, finding the
    graph checked, does not run it again."""
    problem, inferred = _check(ir, True, None)
    if inferred is None:
        return problem, {}
    return problem, {info.name: dims for info in inferred.graph.output if (dims := value_info_dims(info)) is not None}


def value_info_dims(info: onnx.ValueInfoProto) -> list[int | None] | None:
    """A tensor's dims as inference gives them (an int where static, else ``None``); ``None``
    without a shape."""
    ttype = info.type.tensor_type
    if not ttype.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else None for d in ttype.shape.dim]


def _check(ir: IRModel, refresh: bool, now: Fingerprint | None) -> tuple[str | None, onnx.ModelProto | None]:
    data = _serialized_for_check(ir)
    problem, inferred = (data, None) if isinstance(data, str) else _check_serialized(data)
    if problem is None and refresh:
        _apply_inferred(ir, inferred)
        ir.checked = now or fingerprint(ir)
    return problem, inferred


def passed_check(ir: IRModel, now: Fingerprint) -> bool:
    """Whether the graph ``now`` describes is one :func:`check_model` already passed, node
    order included (the checker requires a topological order), shapes refreshed since.

    A pass that checks its own intermediate graphs (``simplify`` re-infers shapes between
    folding rounds) often ends on a graph it has just checked; checking it again would
    find what that check found."""
    then = ir.checked
    return then is not None and then.order == now.order and then.same_graph(now)


def check_proto(proto: onnx.ModelProto, *, copy: bool = True) -> tuple[str | None, onnx.ModelProto | None]:
    """The checker, then strict shape inference; returns the problem or the inferred model.

    ``copy=False`` lets the check rewrite ``proto`` itself (a proto made only for it)."""
    proto = stubs_as_inputs(proto, copy=copy)
    local_functions = {(f.domain, f.name) for f in proto.functions}
    unknown, runtime = _unknown_operator_or_move_runtime_ops(proto.graph.node, local_functions)
    if unknown:
        return unknown, None
    if runtime:
        proto.opset_import.append(onnx.helper.make_opsetid(_RUNTIME_DOMAIN, 1))
    return _check_serialized(proto.SerializeToString())


def _check_serialized(data: bytes) -> tuple[str | None, onnx.ModelProto | None]:
    """The checker, then strict shape inference, on a serialized model (each would serialize
    a ``ModelProto`` again)."""
    try:
        onnx.checker.check_model(data)
    except Exception as exc:  # ValidationError, or other types the C++ checker raises on odd protos
        return _first_line(exc), None
    try:
        return None, onnx.shape_inference.infer_shapes(data, strict_mode=True, data_prop=True)
    except Exception as exc:
        return f"shape inference failed: {_first_line(exc)}", None


def _serialized_for_check(ir: IRModel) -> bytes | str:
    """The serialized model :func:`check_proto` would check for ``export_with_stubs(ir)``, built
    from :func:`export_for_check`'s parts (most nodes already serialized by the last check);
    or the problem, for a node of an unknown domain."""
    proto, nodes = export_for_check(ir)
    graph = proto.graph
    rest = []
    for node, item in nodes:  # stubbed Constants go where stubs_as_inputs makes them typed inputs
        if isinstance(item, bytes) or _stubbed_constant(item) is None:
            rest.append((node, item))
        else:
            graph.node.append(item)
    stubs_as_inputs(proto, copy=False)  # they and the stubbed initializers are inputs now
    local_functions = {(f.domain, f.name) for f in proto.functions}
    entries, runtime = [], False
    for node, item in rest:
        if isinstance(item, bytes):  # plain attributes only: no subgraph, no tensor
            domain = node.domain or ""
            if domain in ("", "ai.onnx"):
                if _runtime_only(node.op):
                    moved = OnnxExporter.export_node(node)
                    moved.domain = _RUNTIME_DOMAIN
                    item, runtime = node_entry(moved), True
            elif domain not in KNOWN_DOMAINS and (domain, node.op) not in local_functions:
                return f"node '{node.name}' uses operator '{node.op}' of unknown domain '{domain}'"
            entries.append(item)
            continue
        _drop_subgraph_stubs(item)
        unknown, moved = _unknown_operator_or_move_runtime_ops([item], local_functions)
        if unknown:
            return unknown
        runtime |= moved
        entries.append(node_entry(item))
    if runtime:
        proto.opset_import.append(onnx.helper.make_opsetid(_RUNTIME_DOMAIN, 1))
    graph_bytes = graph.SerializeToString() + b"".join(entries)
    proto.ClearField("graph")
    return proto.SerializeToString() + length_delimited(_MODEL_GRAPH_FIELD, graph_bytes)


# ModelProto.graph's field number (onnx.proto)
_MODEL_GRAPH_FIELD = onnx.ModelProto.DESCRIPTOR.fields_by_name["graph"].number


def _drop_subgraph_stubs(node: onnx.NodeProto) -> None:
    """Remove the stubbed initializers of ``node``'s subgraphs (theirs' too).  Graphsurgeon exports
    every constant a subgraph reads as one of its initializers, those of the outer graph too,
    where the check has made the stubbed ones typed graph inputs the subgraph sees by outer
    scope; a stub left in a subgraph fails the checker (no such file), so a model whose If or
    Loop branch read a weight of the main graph could not be loaded."""
    for sub in _subgraphs(node):
        kept = [t for t in sub.initializer if stub_index(t) is None]
        if len(kept) != len(sub.initializer):
            del sub.initializer[:]
            sub.initializer.extend(kept)
        for inner in sub.node:
            _drop_subgraph_stubs(inner)


def _stubbed_constant(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """The value of a ``Constant`` node when it is a stub, else ``None``."""
    if node.op_type != "Constant":
        return None
    value = next((a.t for a in node.attribute if a.name == "value" and a.type == onnx.AttributeProto.TENSOR), None)
    return value if value is not None and stub_index(value) is not None else None


def _unknown_operator_or_move_runtime_ops(nodes, local_functions: set[tuple[str, str]]) -> tuple[str | None, bool]:
    """The first node of ``nodes`` (NodeProtos, their subgraphs included) of an unknown domain,
    described; else ``None``, with every default-domain op that only onnxruntime knows moved to
    :data:`_RUNTIME_DOMAIN` (one walk for both), and whether there was one."""
    runtime_nodes = []
    for node in _walk_all(nodes):
        if node.domain in ("", "ai.onnx"):
            if _runtime_only(node.op_type):
                runtime_nodes.append(node)
        elif node.domain not in KNOWN_DOMAINS and (node.domain, node.op_type) not in local_functions:
            return f"node '{node.name}' uses operator '{node.op_type}' of unknown domain '{node.domain}'", False
    for node in runtime_nodes:
        node.domain = _RUNTIME_DOMAIN
    return None, bool(runtime_nodes)


# Where the checker sees a default-domain op that onnx has no schema for but onnxruntime
# runs (SimplifiedLayerNormalization, ...), the check moves it to this domain, which the
# checker and shape inference skip like any contrib op; the graph itself keeps it.
_RUNTIME_DOMAIN = "qnnpasses.onnxruntime"


def runtime_only_ops(proto: onnx.ModelProto) -> dict[str, int]:
    """Default-domain operators onnx does not know but onnxruntime runs -> how many nodes use each."""
    found: dict[str, int] = {}
    for node in _walk_all(proto.graph.node):
        if node.domain in ("", "ai.onnx") and _runtime_only(node.op_type):
            found[node.op_type] = found.get(node.op_type, 0) + 1
    return found


@functools.cache
def _runtime_only(op_type: str) -> bool:
    # onnx's schemas first: onnxruntime's (an import of seconds) only for an op onnx does not know
    return not onnx.defs.has(op_type) and op_type in _onnxruntime_default_ops()


_ORT_DEFAULT_OPS: frozenset[str] | None = None


def _onnxruntime_default_ops() -> frozenset[str]:
    global _ORT_DEFAULT_OPS
    if _ORT_DEFAULT_OPS is None:
        try:
            from onnxruntime.capi.onnxruntime_pybind11_state import get_all_operator_schema

            schemas = get_all_operator_schema()
        except Exception:  # a build without schemas: nothing is treated as runtime-only
            schemas = []
        _ORT_DEFAULT_OPS = frozenset(s.name for s in schemas if s.domain in ("", "ai.onnx"))
    return _ORT_DEFAULT_OPS


def _walk_all(nodes):
    """Every node of ``nodes`` and of their subgraphs."""
    for node in nodes:
        yield node
        for sub in _subgraphs(node):
            yield from _walk_all(sub.node)


def _subgraphs(node: onnx.NodeProto):
    """The graphs in ``node``'s attributes.  Only a node that can own one has its attributes
    read: the check walks every node after every pass."""
    if node.op_type not in SUBGRAPH_OPS and node.domain in ("", "ai.onnx"):
        return
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def stubs_as_inputs(proto: onnx.ModelProto, *, copy: bool = True) -> onnx.ModelProto:
    """A copy (``proto`` itself with ``copy=False``) in which stubbed initializers are typed graph inputs instead.

    The checker insists that external data files exist; stubs point nowhere on
    purpose.  As inputs (stubbed Constant nodes too) they keep dtype and shape,
    which is all checking needs.
    Intermediate value infos are dropped so inference starts from scratch and stale
    infos left by a rewrite cannot poison it.
    """
    clone = proto
    if copy:
        clone = onnx.ModelProto()
        clone.CopyFrom(proto)
    graph = clone.graph
    del graph.value_info[:]
    input_names = {i.name for i in graph.input}

    def as_input(name: str, tensor: onnx.TensorProto) -> None:
        if name not in input_names:
            graph.input.append(_input_info(name, tensor.data_type, tuple(tensor.dims)))
            input_names.add(name)

    kept = []
    for tensor in graph.initializer:
        if stub_index(tensor) is None:
            kept.append(tensor)
        else:
            as_input(tensor.name, tensor)
    del graph.initializer[:]
    graph.initializer.extend(kept)
    nodes = []
    for node in graph.node:
        value = _stubbed_constant(node)
        if value is not None:
            as_input(node.output[0], value)
        else:
            _drop_subgraph_stubs(node)
            nodes.append(node)
    if len(nodes) != len(graph.node):
        del graph.node[:]
        graph.node.extend(nodes)
    return clone


@functools.lru_cache(maxsize=1 << 16)
def _input_info(name: str, data_type: int, dims: tuple[int, ...]) -> onnx.ValueInfoProto:
    """A stub's graph input (the same few hundred after every pass; ``append`` copies it)."""
    return onnx.helper.make_tensor_value_info(name, data_type, list(dims))


def infer_proto(proto: onnx.ModelProto, *, copy: bool = True) -> onnx.ModelProto:
    """Shape inference of ``proto`` with its stubs as inputs and no intermediate value infos;
    ``copy=False`` lets it rewrite ``proto`` itself (a proto made only for it)."""
    return onnx.shape_inference.infer_shapes(stubs_as_inputs(proto, copy=copy), data_prop=True)


def refresh_shapes(ir: IRModel) -> None:
    """Re-run shape inference and set dtype and shape on every intermediate tensor."""
    proto, _ = export_with_stubs(ir, value_infos=False)  # inferred from scratch anyway
    _apply_inferred(ir, onnx.shape_inference.infer_shapes(stubs_as_inputs(proto, copy=False), data_prop=True))


def fill_unknown_shapes(ir: IRModel) -> bool:
    """:func:`refresh_shapes` only when a computed tensor has no dtype or shape; returns whether it ran.

    For a rewrite that gives every tensor it creates its dtype and shape (``rewrite.emit``,
    ``make_node(..., dtype=, shape=)``) and replaces tensors by equal-shaped ones, whole-graph
    inference would change nothing: on every fixture the htp-llm result is the same with it
    and without it.  The pass manager's check after the pass re-infers everything anyway.
    """
    for node in ir.graph.nodes:
        for tensor in node.outputs:
            if isinstance(tensor, gs.Variable) and tensor.name and (tensor.dtype is None or tensor.shape is None):
                refresh_shapes(ir)
                return True
    return False


def _apply_inferred(ir: IRModel, inferred: onnx.ModelProto) -> None:
    types = {vi.name: vi.type for vi in inferred.graph.value_info}
    graph_io = {t.name for t in ir.graph.inputs} | {t.name for t in ir.graph.outputs}
    # most tensors share one of a few types: each distinct one is decoded once, by its bytes
    decoded: dict[bytes, tuple | None] = {}
    seen: set[int] = set()
    for node in ir.graph.nodes:  # every intermediate tensor, without building graph.tensors()'s name map
        for tensor in node.outputs:  # what inference can type: computed tensors
            if id(tensor) in seen or not isinstance(tensor, gs.Variable) or not tensor.name or tensor.name in graph_io:
                continue
            seen.add(id(tensor))
            type_proto = types.get(tensor.name)
            if type_proto is None:
                continue
            key = type_proto.SerializeToString()
            if key not in decoded:
                decoded[key] = _decode_type(type_proto)
            typed = decoded[key]
            if typed is not None:
                dtype, shape = typed
                # graphsurgeon's __setattr__ only special-cases the edge lists: set the fields directly
                state = tensor.__dict__
                if dtype is not None:
                    state["dtype"] = dtype
                state["shape"] = None if shape is None else list(shape)


def _decode_type(type_proto) -> tuple | None:
    """``(dtype or None, shape tuple or None)`` of a tensor type; ``None`` for other types."""
    if not type_proto.HasField("tensor_type"):
        return None
    ttype = type_proto.tensor_type
    dtype = None
    if ttype.elem_type:
        dtype = (ttype.elem_type if ttype.elem_type in _NON_NUMPY
                 else onnx.helper.tensor_dtype_to_np_dtype(ttype.elem_type))
    return dtype, tuple(_dim(d) for d in ttype.shape.dim) if ttype.HasField("shape") else None


def _dim(dim) -> int | str | None:
    which = dim.WhichOneof("value")
    return dim.dim_value if which == "dim_value" else (dim.dim_param or None)


_NON_NUMPY = {onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT8E4M3FN, onnx.TensorProto.FLOAT8E5M2}


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:400]
