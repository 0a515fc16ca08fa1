"""Per-node cost: FLOPs, bytes moved, arithmetic intensity and a memory-bound flag.

FLOPs count a multiply-add as 2.  ``MatMul``/``Gemm``/``Conv``/``ConvTranspose`` are
exact (``2·M·N·K`` with batch broadcasting, bias adds included); elementwise ops cost
one FLOP per output element; ``Softmax`` and the norms a few per element
(:data:`PER_ELEMENT`); reductions one per input element; data movement (Reshape,
Transpose, Gather, Concat, Slice, ...) none.  Unknown ops are counted as elementwise and
marked ``estimated``.

Bytes moved are the bytes a node reads (activations and weights) plus the bytes it
writes, at the model's dtypes.  Gather and Slice read only what they copy (an embedding
lookup does not read the whole table); Shape reads no data; pure views (Reshape,
Squeeze, Unsqueeze, Flatten, Identity) move none, as runtimes alias them.

Arithmetic intensity is FLOPs per byte moved.  A node whose intensity is below the
target's ridge point (peak FLOP/s ÷ memory bandwidth) cannot keep the compute units
busy and is memory bound.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.analysis.graph import GraphView
from qnnpasses.ir.model import const_nbytes
from qnnpasses.ir.op_kinds import DATA_MOVEMENT
from qnnpasses.ir.op_kinds import ELEMENTWISE as OP_ELEMENTWISE
from qnnpasses.ir.op_kinds import REDUCTIONS as OP_REDUCTIONS
from qnnpasses.ir.op_kinds import VIEWS as OP_VIEWS

#: Default ridge point in FLOPs/byte.  Hexagon HTP (v73) peaks at tens of TOPS on tens of
#: GB/s of LPDDR5x, i.e. a few hundred ops/byte at int8 and fewer at fp16; 100 is a
#: deliberately conservative fp16 figure.  Pass --ridge for your target.
DEFAULT_RIDGE = 100.0

VIEWS = OP_VIEWS | {"Dropout"}  # Dropout is an identity at inference
READS_WHAT_IT_WRITES = frozenset({"Gather", "GatherND", "GatherElements", "Slice"})
PER_ELEMENT = {
    "Softmax": 5, "LogSoftmax": 5, "LayerNormalization": 8, "RMSNormalization": 6,
    "SimplifiedLayerNormalization": 6, "SkipLayerNormalization": 9, "SkipSimplifiedLayerNormalization": 7,
    "GroupNormalization": 8, "InstanceNormalization": 8, "BatchNormalization": 2, "Gelu": 8, "FastGelu": 8,
    "BiasGelu": 9, "Erf": 4, "HardSwish": 3, "Swish": 3, "Mish": 5, "Softplus": 3,
}
REDUCTIONS = OP_REDUCTIONS | {"ArgMax", "ArgMin"}
ELEMENTWISE = OP_ELEMENTWISE | {"QuantizeLinear", "DequantizeLinear"}  # one op per element, like them


def _shape_of(view: GraphView, tensor: gs.Tensor) -> tuple | None:
    if isinstance(tensor, gs.Constant):
        return tuple(tensor.shape)
    t = view.tensors.get(tensor.name)
    return t.shape if t is not None and t.known else None


def _nbytes(view: GraphView, tensor: gs.Tensor) -> int:
    if isinstance(tensor, gs.Constant):
        return const_nbytes(tensor)
    t = view.tensors.get(tensor.name)
    return t.nbytes if t is not None else 0


def _elements(shape) -> int:
    return int(np.prod(shape, dtype=np.int64)) if shape is not None else 0


def _matmul_flops(a, out) -> int | None:
    """2·K per output element, K the contracted dim (batch dims are in the output)."""
    if a is None or out is None or not a:
        return None
    return 2 * _elements(out) * int(a[-1])


def _gemm_flops(node: gs.Node, view: GraphView, out) -> int | None:
    a = _shape_of(view, node.inputs[0])
    if a is None or out is None or len(a) != 2:
        return None
    k = a[0] if node.attrs.get("transA", 0) else a[1]
    bias = _elements(out) if len(node.inputs) > 2 and node.inputs[2].name else 0
    return 2 * _elements(out) * int(k) + bias


def _conv_flops(node: gs.Node, view: GraphView, out) -> int | None:
    w = _shape_of(view, node.inputs[1]) if len(node.inputs) > 1 else None
    x = _shape_of(view, node.inputs[0])
    if w is None or out is None or x is None:
        return None
    bias = _elements(out) if len(node.inputs) > 2 and node.inputs[2].name else 0
    # Conv weights are [Cout, Cin/group, k...]; ConvTranspose weights [Cin, Cout/group, k...]
    if node.op == "ConvTranspose":  # every input element is scattered through Cout/group kernels
        return 2 * _elements(x) * int(w[1]) * _elements(w[2:]) + bias
    return 2 * _elements(out) * int(w[1]) * _elements(w[2:]) + bias


def node_flops(node: gs.Node, view: GraphView) -> tuple[int, bool]:
    """(FLOPs, estimated) of one node."""
    out = _shape_of(view, node.outputs[0]) if node.outputs else None
    op = node.op
    exact = None
    if op in ("MatMul", "MatMulInteger", "FusedMatMul"):
        exact = _matmul_flops(_shape_of(view, node.inputs[0]), out)
    elif op == "Gemm":
        exact = _gemm_flops(node, view, out)
    elif op in ("Conv", "ConvTranspose"):
        exact = _conv_flops(node, view, out)
    elif op in DATA_MOVEMENT:
        return 0, False
    elif op in REDUCTIONS:
        return _elements(_shape_of(view, node.inputs[0])), False
    elif op in PER_ELEMENT:
        return PER_ELEMENT[op] * _elements(out), False
    elif op in ("If", "Loop", "Scan"):
        return 0, True
    else:
        return _elements(out), op not in ELEMENTWISE
    return (exact, False) if exact is not None else (0, True)



def node_bytes(node: gs.Node, view: GraphView) -> int:
    if node.op in VIEWS:
        return 0
    written = sum(_nbytes(view, t) for t in node.outputs if t.name)
    if node.op == "Shape" or node.op == "Size":
        return written
    if node.op in READS_WHAT_IT_WRITES:
        indices = sum(_nbytes(view, t) for t in node.inputs[1:] if t.name)
        return 2 * written + indices
    inputs = {t.name: t for t in node.inputs if t.name}
    return sum(_nbytes(view, t) for t in inputs.values()) + written


def analyze_cost(view: GraphView, *, top: int = 10, ridge: float = DEFAULT_RIDGE) -> dict:
    """``ops`` (per node), ``op_types``, ``hotspots`` and totals."""
    ops, by_type = [], defaultdict(lambda: {"count": 0, "flops": 0, "bytes": 0})
    for index, node in enumerate(view.nodes):
        if node.op == "Constant":
            continue
        flops, estimated = node_flops(node, view)
        moved = node_bytes(node, view)
        intensity = flops / moved if moved else (float("inf") if flops else 0.0)
        ops.append({"name": node.name, "op_type": node.op, "layer": view.layers[index], "flops": int(flops),
                    "bytes": int(moved), "intensity": intensity if np.isfinite(intensity) else None,
                    "memory_bound": bool(moved) and intensity < ridge, "estimated": estimated})
        entry = by_type[node.op]
        entry["count"] += 1
        entry["flops"] += int(flops)
        entry["bytes"] += int(moved)
    total_flops = sum(o["flops"] for o in ops)
    total_bytes = sum(o["bytes"] for o in ops)
    for entry in by_type.values():
        entry["flops_share"] = entry["flops"] / total_flops if total_flops else 0.0
        entry["intensity"] = entry["flops"] / entry["bytes"] if entry["bytes"] else None
    hot = sorted(ops, key=lambda o: (-o["flops"], -o["bytes"]))[:top]
    return {
        "ops": ops,
        "op_types": dict(sorted(by_type.items(), key=lambda kv: (-kv[1]["flops"], -kv[1]["bytes"]))),
        "hotspots": [o["name"] for o in hot],
        "total_flops": total_flops,
        "total_bytes": total_bytes,
        "ridge": ridge,
        "memory_bound_nodes": sum(o["memory_bound"] for o in ops),
        "estimated_nodes": sum(o["estimated"] for o in ops),
    }

