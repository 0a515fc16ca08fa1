"""Weight memory: bytes by dtype and by layer, and what they would be at fp16 / int8 / int4.

Weights are every stored tensor: initializers plus the values of ``Constant`` nodes (both
ship with the model), reported separately too.  Byte counts come from dtypes and shapes
(:func:`qnnpasses.ir.model.const_nbytes`); no weight values are read.  A weight belongs to the
layer its name names (``model.layers.3.mlp...``), else to the layer of the nodes reading
it when they all agree (``onnx::MatMul_551`` read by ``/model/layers.0/q_proj/MatMul``),
else to "other" (embeddings, final norm, tied or shared tables).  The what-if sizes
convert floating-point weights only (int4 packs two per byte); integer tensors (shape
constants, already-quantized weights) keep their size.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.analysis.graph import OTHER, dtype_name, layer_of, layer_sort_key
from qnnpasses.ir.model import IRModel, const_nbytes, iter_graphs

WHAT_IF = {"at_fp16": 2.0, "at_int8": 1.0, "at_int4": 0.5}


def _weights(ir: IRModel) -> Iterator[tuple[gs.Constant, list[gs.Node], bool]]:
    """``(constant, nodes reading it, is a Constant node value)`` for every stored tensor, once."""
    seen: set[int] = set()
    for graph in iter_graphs(ir.graph):
        for tensor in graph.tensors().values():
            if isinstance(tensor, gs.Constant) and id(tensor) not in seen:
                seen.add(id(tensor))
                yield tensor, list(tensor.outputs), False
        for node in graph.nodes:
            if node.op != "Constant":  # e.g. ConstantOfShape's fill value: an attribute, not a weight
                continue
            for value in node.attrs.values():
                if isinstance(value, gs.Constant) and id(value) not in seen:
                    seen.add(id(value))
                    readers = [c for out in node.outputs for c in out.outputs]
                    yield value, readers, True


def _is_float(tensor: gs.Constant) -> bool:
    try:
        return np.dtype(tensor.dtype).kind == "f"
    except TypeError:  # bfloat16 / float8 kept as ONNX element types
        return "float" in dtype_name(tensor.dtype)


def weight_layer(tensor: gs.Constant, readers: list[gs.Node], node_layer: dict[str, str]) -> str:
    label = layer_of(tensor.name)
    if label is not None:
        return label
    labels = {node_layer.get(n.name, OTHER) for n in readers}
    return labels.pop() if len(labels) == 1 else OTHER


def analyze_weights(ir: IRModel, node_layer: dict[str, str]) -> dict:
    """The ``weights`` section of :func:`qnnpasses.analysis.analyze`."""
    by_dtype: dict[str, int] = defaultdict(int)
    by_layer: dict[str, int] = defaultdict(int)
    what_if = dict.fromkeys(WHAT_IF, 0)
    totals = {"initializer_bytes": 0, "constant_node_bytes": 0}
    count = 0
    for tensor, readers, is_node_value in _weights(ir):
        nbytes = const_nbytes(tensor)
        count += 1
        totals["constant_node_bytes" if is_node_value else "initializer_bytes"] += nbytes
        by_dtype[dtype_name(tensor.dtype)] += nbytes
        by_layer[weight_layer(tensor, readers, node_layer)] += nbytes
        elements = int(np.prod(tensor.shape, dtype=np.int64))
        for key, size in WHAT_IF.items():
            what_if[key] += int(np.ceil(elements * size)) if _is_float(tensor) else nbytes
    return {
        "total_bytes": totals["initializer_bytes"] + totals["constant_node_bytes"],
        **totals,
        "tensors": count,
        "by_dtype": dict(sorted(by_dtype.items(), key=lambda kv: -kv[1])),
        "by_layer": {k: by_layer[k] for k in sorted(by_layer, key=layer_sort_key)},
        **what_if,
    }
