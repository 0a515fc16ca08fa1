"""The HTP rounds a 16-bit RmsNorm's output down: add back, after each MatMul reading it, the half step it loses.

On the simulated HTP in integer mode the fused RmsNorm quantizes its uint16 output by rounding
down: its error has a mean of half a step where every other op measured rounds to nearest
(``python tools/probe_htp_rounding.py``, docs/htp_rounding.md).  Half a step is nothing on one
value, but a MatMul sums it over its whole contraction, in the same direction: on trained Gemma 3
it is what separates the w8a16 pair on the HTP from the same graphs on the CPU
(``python tools/probe_norm_rounding.py``, docs/norm_rounding.md).

Matches, in a QDQ model: ``RMSNormalization`` whose output goes to one QuantizeLinear (per
tensor, scale ``s``), then a DequantizeLinear read by a ``MatMul`` as its first operand, whose
second operand is a constant weight ``W`` ``[K, N]`` behind a DequantizeLinear (per tensor, per
output channel, or in blocks along ``K``; a stacked ``[..., K, N]`` per tensor), and whose output
goes to one QuantizeLinear ``q_y``.
Produces, after ``q_y`` (read where ``q_y`` was read)::

    y' = Q(DQ(q_y) + DQ(b)) at q_y's own encoding,   b = s/2 · Σ_k W[k, :]   (uint16 per tensor)

Why it is right on the HTP: the HTP hands the MatMul ``x - e`` with ``e`` in ``[0, s)``, of mean
``s/2`` over the fractions values fall on, so the MatMul's output carries ``-(s/2)·Σ_k W[k, :]``
on every row; ``b`` cancels that mean and leaves zero-mean noise, as rounding to nearest would
(``tests/test_norm_rounding.py`` measures both on the simulated HTP).  On a backend that rounds
to nearest, onnxruntime's CPU among them, ``b`` is itself the error: apply this only to the graphs
the HTP runs.  :func:`htp_model` is what every integer-mode path hands the HTP: ``qnnpasses llm``'s
compile and runner, ``qnnpasses compile --qdq`` and the HTP evaluation of ``qnnpasses quantize``.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qnnpasses.quant.qdq_proto import index_graph

_U16 = 65535


def compensate_norm_rounding(model: onnx.ModelProto, base_dir: str | Path | None = None) -> int:
    """Rewrite ``model`` in place (module docs); external weights are read from ``base_dir``.
    Returns how many MatMuls were compensated."""
    graph = model.graph
    found = index_graph(graph)
    base = str(base_dir or "")

    def array(name: str) -> np.ndarray | None:
        init = found.inits.get(name)
        return None if init is None else numpy_helper.to_array(init, base)

    after: dict[str, list[onnx.NodeProto]] = defaultdict(list)  # out_q's output -> nodes to insert after out_q
    for norm in graph.node:
        if norm.op_type != "RMSNormalization":
            continue
        q = found.only(norm.output[0], "QuantizeLinear")
        scale = array(q.input[1]) if q is not None else None
        if scale is None or scale.size != 1:
            continue
        for dq in found.readers[q.output[0]]:
            if dq.op_type != "DequantizeLinear":
                continue
            for matmul in found.readers[dq.output[0]]:
                if matmul.op_type != "MatMul" or matmul.input[0] != dq.output[0]:
                    continue
                sums = _column_sums(found.producer.get(matmul.input[1]), array)
                out_q = found.only(matmul.output[0], "QuantizeLinear")
                if sums is None or out_q is None or out_q.output[0] in found.outputs or len(out_q.input) < 3:
                    continue
                bias = float(scale) / 2 * sums
                if not np.any(bias):
                    continue
                after[out_q.output[0]] += _add_bias(graph, out_q, bias, found.readers)
    if after:
        nodes = list(graph.node)
        del graph.node[:]
        for node in nodes:
            graph.node.append(node)
            graph.node.extend(after.get(node.output[0], ()) if node.op_type == "QuantizeLinear" else ())
    return sum(len(v) // 4 for v in after.values())


def _column_sums(dq: onnx.NodeProto | None, array) -> np.ndarray | None:
    """``Σ_k W[..., k, :]`` of the weight ``dq`` dequantizes, from its integers, shaped to add to the
    MatMul's output (None: not a form handled).  Per tensor at any rank; per output channel or in
    blocks along ``k`` for a 2-D weight."""
    if dq is None or dq.op_type != "DequantizeLinear":
        return None
    q, scale = array(dq.input[0]), array(dq.input[1])
    zero = array(dq.input[2]) if len(dq.input) > 2 else None
    if q is None or scale is None or q.ndim < 2 or (len(dq.input) > 2 and zero is None):
        return None
    q = q.astype(np.int64)
    zero = np.zeros_like(scale, dtype=np.int64) if zero is None else zero.astype(np.int64)
    scale = scale.astype(np.float64)
    k, n = q.shape[-2:]
    if scale.size == 1:  # a stacked weight's sums keep their axis of length 1 to broadcast over tokens
        return scale * (q.sum(axis=-2, keepdims=q.ndim > 2) - k * zero)
    if q.ndim != 2:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in dq.attribute}
    axis, block = attrs.get("axis", 1) % 2, attrs.get("block_size", 0)
    if scale.ndim == 1 and axis == 1 and scale.size == n:
        return scale * (q.sum(axis=0) - k * zero)
    if block and axis == 0 and scale.shape == (-(-k // block), n):
        rows = np.arange(k) // block
        return (scale[rows] * (q - zero[rows])).sum(axis=0)
    return None


def _add_bias(graph: onnx.GraphProto, out_q: onnx.NodeProto, bias: np.ndarray,
              readers: dict[str, list[onnx.NodeProto]]) -> list[onnx.NodeProto]:
    """``Q(DQ(out_q) + DQ(bias))`` at ``out_q``'s encoding, read where ``out_q``'s output was."""
    lo, hi = min(float(bias.min()), 0.0), max(float(bias.max()), 0.0)
    step = (hi - lo) / _U16
    zero = int(np.clip(round(-lo / step), 0, _U16))
    stem = f"{out_q.output[0]}_norm_rounding"
    graph.initializer.extend([
        numpy_helper.from_array(np.clip(np.rint(bias / step) + zero, 0, _U16).astype(np.uint16), f"{stem}_b"),
        numpy_helper.from_array(np.array(step, np.float32), f"{stem}_b_scale"),
        numpy_helper.from_array(np.array(zero, np.uint16), f"{stem}_b_zero")])
    kept, fixed = out_q.output[0], f"{stem}_out"
    for reader in readers[kept]:
        for i, name in enumerate(reader.input):
            if name == kept:
                reader.input[i] = fixed
    scale, zero_point = out_q.input[1], out_q.input[2]
    return [helper.make_node("DequantizeLinear", [kept, scale, zero_point], [f"{stem}_y"], name=f"{stem}_dq"),
            helper.make_node("DequantizeLinear", [f"{stem}_b", f"{stem}_b_scale", f"{stem}_b_zero"], [f"{stem}_bf"],
                             name=f"{stem}_dq_b"),
            helper.make_node("Add", [f"{stem}_y", f"{stem}_bf"], [f"{stem}_sum"], name=f"{stem}_add"),
            helper.make_node("QuantizeLinear", [f"{stem}_sum", scale, zero_point], [fixed], name=f"{stem}_q")]


#: onnxruntime reads the external weights of a model given as bytes from this folder.
EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"


def htp_model(path: str | Path) -> tuple[str | bytes, dict[str, str], int]:
    """The QDQ model at ``path`` as the HTP should compile it: ``(model, session config, count)``,
    the model compensated (module docs) and serialized, its external weights read from their
    files beside ``path`` (the config says where); ``path`` itself where nothing matches."""
    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    count = compensate_norm_rounding(model, path.parent)
    if not count:
        return str(path), {}, 0
    return model.SerializeToString(), {EXTERNAL_FOLDER: str(path.parent.resolve())}, count
