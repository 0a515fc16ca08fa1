"""Single-op ONNX models described by small JSON-able records.

The HTP op-support table is measured by running one-node models on the real QNN HTP
backend (``tools/probe_htp.py``).  The same record must rebuild the same model later —
in the agreement test, which checks the table against probes it was *not* built from — so
model construction lives here, in the package, and depends only on the record: constant
tensors are drawn from a generator seeded by the probe id, never from global state.

A record (one line of ``tools/probe_results/htp_<suite>.jsonl``) looks like::

    {"id": "build/Softmax/float32-r3-axis=1", "op": "Softmax", "domain": "", "opset": 13,
     "dtypes": ["float32"], "shapes": [[2, 3, 4]], "attrs": {"axis": 1}, ...}

(``const_inputs``, ``values``, ``attrs``, ``n_outputs``, ``out_dtypes``, ``out_shapes`` are
omitted when empty/default.)

``dtypes[i] is None`` marks an omitted optional input (an empty name in the node).
``values`` maps an input index (as a string, JSON keys being strings) to the exact
contents of that input — shape operands, indices, axes — which matter for validity;
other inputs get seeded random data.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: ONNX element types by the dtype names used in records and tables.
DTYPES: dict[str, int] = {
    "float32": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
    "int64": TensorProto.INT64,
    "int32": TensorProto.INT32,
    "int16": TensorProto.INT16,
    "int8": TensorProto.INT8,
    "uint16": TensorProto.UINT16,
    "uint8": TensorProto.UINT8,
    "bool": TensorProto.BOOL,
}
DTYPE_NAMES: dict[int, str] = {v: k for k, v in DTYPES.items()}



@dataclass
class ProbeSpec:
    """One single-node probe model; see the module docstring for the record format."""

    id: str
    op: str
    opset: int
    dtypes: list[str | None]
    shapes: list[list[int] | None]
    attrs: dict[str, Any] = field(default_factory=dict)
    domain: str = ""
    const_inputs: list[int] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)
    n_outputs: int = 1
    #: Output element types, needed only where ONNX shape inference cannot tell (contrib ops).
    out_dtypes: list[str] | None = None
    out_shapes: list[list[int]] | None = None

    def to_record(self) -> dict[str, Any]:
        """The JSON record; fields at their defaults are left out to keep result files small."""
        record = {"id": self.id, "op": self.op, "domain": self.domain, "opset": self.opset,
                  "dtypes": self.dtypes, "shapes": self.shapes}
        optional = {"const_inputs": self.const_inputs, "values": self.values, "attrs": self.attrs,
                    "n_outputs": self.n_outputs, "out_dtypes": self.out_dtypes, "out_shapes": self.out_shapes}
        defaults = {"const_inputs": [], "values": {}, "attrs": {}, "n_outputs": 1, "out_dtypes": None, "out_shapes": None}
        record.update({k: v for k, v in optional.items() if v != defaults[k]})
        return record

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> ProbeSpec:
        return cls(
            id=rec["id"],
            op=rec["op"],
            domain=rec.get("domain", ""),
            opset=rec["opset"],
            dtypes=list(rec["dtypes"]),
            shapes=[list(s) if s is not None else None for s in rec["shapes"]],
            const_inputs=list(rec.get("const_inputs", [])),
            values=dict(rec.get("values", {})),
            attrs=dict(rec.get("attrs", {})),
            n_outputs=int(rec.get("n_outputs", 1)),
            out_dtypes=rec.get("out_dtypes"),
            out_shapes=rec.get("out_shapes"),
        )


def _rng(spec: ProbeSpec, index: int) -> np.random.Generator:
    """A generator that depends only on the probe id and the input position."""
    return np.random.default_rng(zlib.crc32(f"{spec.id}#{index}".encode()))


def input_array(spec: ProbeSpec, index: int) -> np.ndarray:
    """The data of input ``index``: its explicit value, or seeded random data.

    Random integers are 1 or 2: never a zero divisor (integer Div/Mod by zero kills the
    process), and still a valid index along any dimension of size ≥ 3.  Floats are
    positive (|normal| + 0.1) so Log/Sqrt/Pow see valid operands.
    """
    dtype = spec.dtypes[index]
    shape = spec.shapes[index]
    if dtype is None or shape is None:
        raise ValueError(f"{spec.id}: input {index} is omitted")
    np_dtype = helper.tensor_dtype_to_np_dtype(DTYPES[dtype])
    if str(index) in spec.values:
        return np.array(spec.values[str(index)], dtype=np_dtype).reshape(shape)
    rng = _rng(spec, index)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if np.issubdtype(np_dtype, np.integer):
        return rng.integers(1, 3, size=shape).astype(np_dtype)
    return (np.abs(rng.standard_normal(size=shape)) + 0.1).astype(np_dtype)


def _input_name(index: int) -> str:
    return f"in{index}"


def build_model(spec: ProbeSpec) -> onnx.ModelProto:
    """The one-node model of ``spec``, shape-inferred and checked.

    Raises ``onnx.checker.ValidationError`` / ``onnx.shape_inference.InferenceError`` when
    the record does not describe a valid ONNX node — the probe generator filters on that.
    """
    node_inputs: list[str] = []
    graph_inputs: list[onnx.ValueInfoProto] = []
    initializers: list[onnx.TensorProto] = []
    for i, dtype in enumerate(spec.dtypes):
        if dtype is None:
            node_inputs.append("")
            continue
        name = _input_name(i)
        node_inputs.append(name)
        if i in spec.const_inputs:
            initializers.append(numpy_helper.from_array(input_array(spec, i), name))
        else:
            graph_inputs.append(helper.make_tensor_value_info(name, DTYPES[dtype], spec.shapes[i]))
    while node_inputs and node_inputs[-1] == "":
        node_inputs.pop()  # trailing optional inputs are simply left out

    outputs = [f"out{j}" for j in range(spec.n_outputs)]
    node = helper.make_node(
        spec.op, node_inputs, outputs, name=f"probe_{spec.op}", domain=spec.domain or None,
        **{k: _attr_value(v) for k, v in spec.attrs.items()},
    )
    if spec.out_dtypes is not None:
        out_shapes = spec.out_shapes or [None] * spec.n_outputs
        graph_outputs = [
            helper.make_tensor_value_info(o, DTYPES[t], s) for o, t, s in zip(outputs, spec.out_dtypes, out_shapes)
        ]
    else:
        graph_outputs = [helper.make_empty_tensor_value_info(o) for o in outputs]

    opsets = [helper.make_opsetid("", spec.opset if not spec.domain else 17)]
    if spec.domain:
        opsets.append(helper.make_opsetid(spec.domain, spec.opset))
    graph = helper.make_graph([node], "probe", graph_inputs, graph_outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=opsets, producer_name="qnnpasses-probe")
    model.ir_version = min(model.ir_version, 10)  # onnxruntime 1.2x reads IR ≤ 10
    if not _is_onnx_op(spec):
        return model  # contrib op: neither the checker nor shape inference knows it
    model = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    _copy_inferred_outputs(model)
    if any(not out.type.tensor_type.HasField("shape") for out in model.graph.output):
        _set_output_shapes_by_evaluation(model, spec)
    onnx.checker.check_model(model, full_check=True)
    return model


def _set_output_shapes_by_evaluation(model: onnx.ModelProto, spec: ProbeSpec) -> None:
    """Fill output shapes that inference cannot know (e.g. Squeeze axes fed as a graph input).

    The ONNX reference evaluator runs the node on the probe's own deterministic inputs.
    """
    from onnx.reference import ReferenceEvaluator

    results = ReferenceEvaluator(model).run(None, make_inputs(spec))
    for out, value in zip(model.graph.output, results):
        shape = out.type.tensor_type.shape
        shape.Clear()
        for d in np.asarray(value).shape:
            shape.dim.add().dim_value = d


def _is_onnx_op(spec: ProbeSpec) -> bool:
    """Whether ``onnx.defs`` has a schema for the op (ONNX Runtime contrib ops have none)."""
    return spec.domain in ("", "ai.onnx") and onnx.defs.has(spec.op)


def _copy_inferred_outputs(model: onnx.ModelProto) -> None:
    """Give graph outputs the types shape inference found (they were declared untyped)."""
    inferred = {vi.name: vi for vi in model.graph.value_info}
    for out in model.graph.output:
        if not out.type.HasField("tensor_type") and out.name in inferred:
            out.CopyFrom(inferred[out.name])
    del model.graph.value_info[:]


def _attr_value(value: Any) -> Any:
    """Decode a JSON attribute: ``{"tensor": dtype, "value": [...]}`` becomes a TensorProto."""
    if isinstance(value, dict) and "tensor" in value:
        np_dtype = helper.tensor_dtype_to_np_dtype(DTYPES[value["tensor"]])
        return numpy_helper.from_array(np.array(value["value"], dtype=np_dtype), "value")
    return value


def make_inputs(spec: ProbeSpec) -> dict[str, np.ndarray]:
    """Feeds for the model's graph inputs (the non-constant, non-omitted inputs)."""
    return {
        _input_name(i): input_array(spec, i)
        for i, dtype in enumerate(spec.dtypes)
        if dtype is not None and i not in spec.const_inputs
    }


def node_name(spec: ProbeSpec) -> str:
    """Name of the single node in the probe model (for matching backend logs)."""
    return f"probe_{spec.op}"
