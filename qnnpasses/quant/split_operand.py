"""The HTP reads the second operand of a MatMul of two 16-bit activations at 8 bits: split it in two.

On the simulated HTP in integer mode, ``MatMul(A, B)`` with ``A`` and ``B`` both 16-bit activations
comes out as far from fp32 as the same MatMul with ``B`` quantized to 8 bits on the CPU, while a
16-bit activation times an 8-bit operand is computed as the graph says (``python
tools/probe_act_matmul.py``, docs/act_matmul.md).  In an LLM those MatMuls are the attention's
``Q·Kᵀ`` and ``P·V``: on trained Gemma 3's w8a16 prefill graph they are where the HTP's outputs
first leave the CPU's.

Matches, in a QDQ model: ``MatMul(DQ(a), DQ(b))`` where both are activations (not weights), ``b``
is uint16 per tensor (scale ``s``, zero point ``z``), and the output goes to one QuantizeLinear.
Produces, with ``s8 = 257·s`` (the same range in 255 steps) and ``z8 = round(z / 257)``::

    b1 = DQ(Q(b; s8, z8))                   the coarse part, uint8
    r  = DQ(Q(b - b1; 2·s8/255, 128))       the remainder, uint8 (|b - b1| <= s8/2 < s8)
    y  = MatMul(a, b1) + MatMul(a, r)       each uint16, y at the original output's encoding

Why safe: ``b1 + r`` is ``b`` to within one step of ``r`` (about two 16-bit steps of ``b``), and
each MatMul has an 8-bit second operand, which the HTP computes as the graph says (the split
pair's error on the HTP is in docs/act_matmul.md).  The
remainder's product ``a·r`` is a correction: ``r`` is rounding noise of at most ``s8/2``
(standard deviation ``s8/(2√3)``), so ``|a·r|`` stays within six deviations,
``√3·s8·√K·max|a|`` over a contraction of ``K`` (``max|a|`` from ``a``'s encoding); its uint16
encoding spans that.  Every new encoding is a function of encodings the graph already has, so
graphs that share ``b``'s and the output's encodings (a prefill / decode pair) share these too.
Cost: one more MatMul, a Sub and an Add per match; a match whose ``K`` shape inference cannot
tell is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qnnpasses.quant.qdq_proto import index_graph


@dataclass
class _Match:
    node: onnx.NodeProto
    b: str          # the second operand (a DequantizeLinear output)
    scale: float    # its uint16 encoding
    zero: int
    a_peak: float   # the largest magnitude the first operand's encoding holds
    depth: int      # K, the contraction
    out_q: onnx.NodeProto  # the QuantizeLinear after the MatMul


def _scalar(inits: dict[str, onnx.TensorProto], name: str) -> np.ndarray | None:
    init = inits.get(name)
    if init is None or init.data_location == TensorProto.EXTERNAL:
        return None
    value = numpy_helper.to_array(init)
    return value if value.size == 1 else None


def _depths(model: onnx.ModelProto) -> dict[str, int]:
    """The last dimension of every tensor shape inference knows (no weight data is read)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    out = {}
    for vi in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        dims = vi.type.tensor_type.shape.dim if vi.type.HasField("tensor_type") else []
        if dims and dims[-1].HasField("dim_value"):
            out[vi.name] = dims[-1].dim_value
    return out


def find_matches(model: onnx.ModelProto) -> list[_Match]:
    """Every MatMul of two activations whose second operand is uint16 per tensor (module docs)."""
    graph = index_graph(model.graph)
    inits, producer = graph.inits, graph.producer
    depths: dict[str, int] | None = None
    found = []
    for node in model.graph.node:
        if node.op_type != "MatMul" or len(node.input) != 2:
            continue
        dqs = [producer.get(i) for i in node.input]
        if any(d is None or d.op_type != "DequantizeLinear" or d.input[0] in inits or len(d.input) < 3 for d in dqs):
            continue
        (a_scale, a_zero), (scale, zero) = [(_scalar(inits, d.input[1]), _scalar(inits, d.input[2])) for d in dqs]
        if any(x is None for x in (a_scale, a_zero, scale, zero)) or zero.dtype != np.uint16:
            continue
        out_q = graph.only(node.output[0], "QuantizeLinear")
        if out_q is None or node.output[0] in graph.outputs:
            continue
        depths = _depths(model) if depths is None else depths
        if node.input[0] not in depths:
            continue
        top = float(np.iinfo(a_zero.dtype).max)
        a_peak = float(a_scale) * max(float(a_zero), top - float(a_zero))
        found.append(_Match(node, node.input[1], float(scale), int(zero), a_peak, depths[node.input[0]], out_q))
    return found


def _qdq(nodes: list, inits: list, x: str, scale: float, zero: int, dtype, tag: str) -> str:
    inits += [numpy_helper.from_array(np.array(scale, np.float32), f"{tag}_scale"),
              numpy_helper.from_array(np.array(zero, dtype), f"{tag}_zero_point")]
    nodes += [helper.make_node("QuantizeLinear", [x, f"{tag}_scale", f"{tag}_zero_point"], [f"{tag}_q"], name=f"{tag}_q"),
              helper.make_node("DequantizeLinear", [f"{tag}_q", f"{tag}_scale", f"{tag}_zero_point"], [f"{tag}_dq"],
                               name=f"{tag}_dq")]
    return f"{tag}_dq"


def split_model(model: onnx.ModelProto) -> int:
    """Split every match of ``model`` in place (module docs); returns how many."""
    matches = {id(m.node): m for m in find_matches(model)}
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    for node in model.graph.node:
        match = matches.get(id(node))
        if match is None:
            nodes.append(node)
            continue
        tag = node.output[0] + "_split8"  # after the output tensor: a pair's graphs name their own
        s8, z8 = match.scale * 257.0, int(np.clip(round(match.zero / 257.0), 0, 255))
        coarse = _qdq(nodes, inits, match.b, s8, z8, np.uint8, f"{tag}_coarse")
        nodes.append(helper.make_node("Sub", [match.b, coarse], [f"{tag}_rest"], name=f"{tag}_rest"))
        rest = _qdq(nodes, inits, f"{tag}_rest", 2.0 * s8 / 255.0, 128, np.uint8, f"{tag}_rest")
        a = node.input[0]
        nodes.append(helper.make_node("MatMul", [a, coarse], [f"{tag}_main"], name=f"{tag}_main"))
        out_scale, out_zero = match.out_q.input[1], match.out_q.input[2]
        main = f"{tag}_main_dq"
        nodes += [helper.make_node("QuantizeLinear", [f"{tag}_main", out_scale, out_zero], [f"{tag}_main_q"],
                                   name=f"{tag}_main_q"),
                  helper.make_node("DequantizeLinear", [f"{tag}_main_q", out_scale, out_zero], [main], name=main)]
        nodes.append(helper.make_node("MatMul", [a, rest], [f"{tag}_fine"], name=f"{tag}_fine"))
        peak = max(np.sqrt(3.0) * s8 * np.sqrt(match.depth) * match.a_peak, 1e-12)
        fine = _qdq(nodes, inits, f"{tag}_fine", 2.0 * peak / 65535.0, 32768, np.uint16, f"{tag}_fine")
        nodes.append(helper.make_node("Add", [main, fine], [node.output[0]], name=f"{tag}_sum"))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(inits)
    return len(matches)


def split_second_operands(path: str | Path) -> dict:
    """Rewrite the QDQ model at ``path`` in place (its weight file untouched); see the module docs.
    Returns ``{"split": count}``."""
    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    count = split_model(model)
    if count:
        onnx.save(model, str(path))
    return {"split": count}
