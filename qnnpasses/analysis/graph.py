"""The view of a model that every analysis shares: activation tensors with concrete sizes,
who produces and reads them, and which transformer layer each node belongs to.

Sizes need concrete shapes for every intermediate tensor.  ONNX shape inference leaves
some unknown in real exports (an ``Expand`` whose target shape is computed by
``Where``/``ConstantOfShape``, as TorchScript emits for masks and repeat_kv), so when the
IR's shapes are incomplete we fix the inputs' symbolic dims (``--shape`` or
:func:`qnnpasses.ir.shapes.resolve_dim`) and infer again, with onnxruntime's symbolic shape
inference as the second opinion (it folds such shape arithmetic).  Tensors still unknown
count as 0 bytes and are listed.

Layers come from names (``layers.3``, ``layer.3``, ``h.3``, ``blocks.3``); the dynamo
exporter's node names carry none, but its node metadata (``pkg.torch.onnx.name_scopes``,
``namespace``) does, so that is read from the source file when names are not enough.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from qnnpasses.ir.model import IRModel, iter_graphs
from qnnpasses.ir.shapes import is_static, resolve_dim

OTHER = "other"
LAYER_RE = re.compile(r"(?:^|[./_:\s'])(?:layers?|h|blocks?|decoder_layers?)[._/](\d+)(?=$|[./_:\s'])")
_METADATA_KEYS = ("pkg.torch.onnx.name_scopes", "namespace")
_SUB_BYTE = {onnx.TensorProto.INT4: 0.5, onnx.TensorProto.UINT4: 0.5}


def layer_of(text: str) -> str | None:
    """The layer index named in ``text`` (last match wins: ``h.0/attn/layers.2`` is 2), or None."""
    matches = LAYER_RE.findall(text or "")
    return matches[-1] if matches else None


def layer_sort_key(label: str) -> tuple[int, int]:
    return (0, int(label)) if label.isdigit() else (1, 0)


def itemsize(dtype) -> float:
    """Bytes per element of a numpy dtype or ONNX element type (int4 is half a byte)."""
    if dtype is None:
        return 0.0
    if isinstance(dtype, (int, np.integer)) and not isinstance(dtype, bool):
        if int(dtype) in _SUB_BYTE:
            return _SUB_BYTE[int(dtype)]
        try:
            return float(onnx.helper.tensor_dtype_to_np_dtype(int(dtype)).itemsize)
        except Exception:  # unknown element type
            return 0.0
    try:
        return float(np.dtype(dtype).itemsize)
    except TypeError:
        return 0.0


def dtype_name(dtype) -> str:
    if isinstance(dtype, (int, np.integer)):
        return onnx.TensorProto.DataType.Name(int(dtype)).lower()
    return np.dtype(dtype).name if dtype is not None else "unknown"


def tensor_bytes(shape, dtype) -> int | None:
    """Bytes of a tensor of static ``shape``; None when the shape or dtype is not known."""
    if shape is None or dtype is None or not all(is_static(d) for d in shape):
        return None
    size = itemsize(dtype)
    if size == 0.0:
        return None
    return int(np.ceil(int(np.prod(shape, dtype=np.int64)) * size))


@dataclass
class Tensor:
    """An activation: a graph input or a node output that is not a constant."""

    name: str
    shape: tuple | None
    dtype: object
    nbytes: int
    known: bool
    producer: int | None = None
    consumers: list[int] = field(default_factory=list)
    graph_input: bool = False
    graph_output: bool = False

    @property
    def elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.known else 0


@dataclass
class GraphView:
    """The main graph's nodes (stored order) and activation tensors, sized."""

    nodes: list[gs.Node]
    tensors: dict[str, Tensor]
    reads: list[list[str]]      # activations each node reads (deduplicated, subgraph captures included)
    writes: list[list[str]]     # activations each node writes
    layers: list[str]           # layer label per node ("0", "1", ..., or "other")
    unknown: list[str]          # activations whose size is unknown (counted as 0 bytes)
    shape_source: str           # "graph" (the IR's shapes) or "inferred"

    def layer_of_tensor(self, name: str) -> str:
        tensor = self.tensors.get(name)
        if tensor is None or tensor.producer is None:
            return OTHER
        return self.layers[tensor.producer]


def build_view(ir: IRModel, shapes: dict[str, list[int]] | None = None) -> GraphView:
    """Size every activation of ``ir`` (shapes of symbolic inputs from ``shapes`` or defaults)."""
    graph = ir.graph
    resolved, source = _resolved_shapes(ir, shapes or {})
    tensors: dict[str, Tensor] = {}

    def add(var: gs.Tensor, **flags) -> Tensor:
        if var.name not in tensors:
            shape, dtype = resolved.get(var.name, (None, None))
            shape = shape if shape is not None else (tuple(var.shape) if var.shape is not None else None)
            dtype = dtype if dtype is not None else var.dtype
            nbytes = tensor_bytes(shape, dtype)
            tensors[var.name] = Tensor(var.name, tuple(shape) if shape is not None else None, dtype,
                                       nbytes or 0, nbytes is not None)
        tensor = tensors[var.name]
        for key, value in flags.items():
            setattr(tensor, key, getattr(tensor, key) or value)
        return tensor

    for var in graph.inputs:
        if isinstance(var, gs.Variable):
            add(var, graph_input=True)
    writes: list[list[str]] = []
    for index, node in enumerate(graph.nodes):
        outs = []
        if node.op != "Constant":  # a Constant node's output is a weight, not an activation
            for var in node.outputs:
                if isinstance(var, gs.Variable) and var.name:
                    add(var).producer = index
                    outs.append(var.name)
        writes.append(outs)
    reads = [_node_reads(node, tensors) for node in graph.nodes]
    for index, names in enumerate(reads):
        for name in names:
            tensors[name].consumers.append(index)
    for var in graph.outputs:
        if var.name in tensors:
            tensors[var.name].graph_output = True
    unknown = [t.name for t in tensors.values() if not t.known]
    return GraphView(list(graph.nodes), tensors, reads, writes, node_layers(ir), unknown, source)


def _node_reads(node: gs.Node, tensors: dict[str, Tensor]) -> list[str]:
    """Activations a node reads: its inputs, plus outer tensors its subgraphs capture."""
    names = [t.name for t in node.inputs if t.name in tensors]
    for value in node.attrs.values():
        for sub in value if isinstance(value, list) else [value]:
            if isinstance(sub, gs.Graph):
                for g in iter_graphs(sub):
                    names += [t.name for n in g.nodes for t in n.inputs if t.name in tensors]
    return list(dict.fromkeys(names))


# --------------------------------------------------------------------------- shapes


def _resolved_shapes(ir: IRModel, overrides: dict[str, list[int]]) -> tuple[dict[str, tuple], str]:
    """``name -> (shape, dtype)``; from the IR when complete, else by inference on static inputs.

    ONNX shape inference (with data propagation) runs first; onnxruntime's symbolic
    inference, then our constant folder, fill what is still unknown.  Any may fail
    on an exotic graph: the analysis then degrades to the shapes it has, it does not fail.
    """
    variables = [t for t in ir.graph.tensors().values() if isinstance(t, gs.Variable)]
    complete = all(t.shape is not None and all(is_static(d) for d in t.shape) and t.dtype is not None
                   for t in variables)
    if complete and not overrides:
        return {}, "graph"
    proto = _static_input_proto(ir, overrides)
    found: dict[str, tuple] = {}
    for infer in (_onnx_inference, _ort_symbolic_inference, _folded_inference):
        try:
            found = {**_static_value_infos(infer(proto)), **found}
        except Exception:  # noqa: BLE001 - see the docstring
            continue
        if all(t.name in found for t in variables):
            break
    return found, "inferred"


def _static_input_proto(ir: IRModel, overrides: dict[str, list[int]]) -> onnx.ModelProto:
    """The stubbed model with stubs as inputs and every graph input dim made concrete."""
    from qnnpasses.ir.checks import stubs_as_inputs

    proto = stubs_as_inputs(ir.to_proto()[0])
    declared = {t.name for t in ir.graph.inputs}
    for vi in proto.graph.input:
        if vi.name not in declared:
            continue
        wanted = overrides.get(vi.name)
        for i, dim in enumerate(vi.type.tensor_type.shape.dim):
            value = wanted[i] if wanted and i < len(wanted) else resolve_dim(
                dim.dim_value if dim.HasField("dim_value") else dim.dim_param, vi.name, i)
            dim.Clear()
            dim.dim_value = int(value)
    return proto


def _onnx_inference(proto: onnx.ModelProto) -> onnx.ModelProto:
    return onnx.shape_inference.infer_shapes(proto, data_prop=True)


def _ort_symbolic_inference(proto: onnx.ModelProto) -> onnx.ModelProto:
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    return SymbolicShapeInference.infer_shapes(proto, auto_merge=True, guess_output_rank=True)


def _folded_inference(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Shapes after the project's constant folder (``simplify``'s) folded the shape arithmetic
    (weights are inputs here, never folded).

    Tensors it folded into constants keep their names as initializers; they become
    value infos so their sizes are known too.
    """
    from qnnpasses.ir.checks import infer_proto
    from qnnpasses.ir.load import load_model
    from qnnpasses.passes.fold.simplify import fold_to_fixed_point

    ir = load_model(proto)
    fold_to_fixed_point(ir)
    inferred = infer_proto(ir.to_proto()[0])
    for tensor in inferred.graph.initializer:
        inferred.graph.value_info.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims))
    return inferred


def _static_value_infos(inferred: onnx.ModelProto) -> dict[str, tuple]:
    found = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output) + list(inferred.graph.input):
        ttype = vi.type.tensor_type
        if not ttype.HasField("shape") or not ttype.elem_type:
            continue
        shape = tuple(d.dim_value if d.HasField("dim_value") else None for d in ttype.shape.dim)
        if all(d is not None for d in shape):
            try:
                dtype = onnx.helper.tensor_dtype_to_np_dtype(ttype.elem_type)
            except Exception:  # bfloat16 and friends: keep the ONNX element type
                dtype = ttype.elem_type
            found[vi.name] = (shape, dtype)
    return found


# --------------------------------------------------------------------------- layers


def node_layers(ir: IRModel) -> list[str]:
    """Layer label of every main-graph node: from its name, else from exporter metadata."""
    nodes = ir.graph.nodes
    labels = [layer_of(n.name) for n in nodes]
    if ir.path is not None and sum(label is None for label in labels) > len(nodes) // 2:
        scopes = _metadata_scopes(ir)
        labels = [label or layer_of(scopes.get(n.name, "")) for n, label in zip(nodes, labels)]
    return [label or OTHER for label in labels]


def _metadata_scopes(ir: IRModel) -> dict[str, str]:
    """Node name -> the scope text in its metadata (read from the source file, weights left out)."""
    try:
        proto = onnx.load(str(ir.path), load_external_data=False)
    except Exception:  # noqa: BLE001 - no metadata is not an error
        return {}
    scopes = {}
    for node in proto.graph.node:
        props = {p.key: p.value for p in node.metadata_props}
        text = next((props[k] for k in _METADATA_KEYS if k in props), "")
        if text:
            scopes[node.name] = text
    return scopes
