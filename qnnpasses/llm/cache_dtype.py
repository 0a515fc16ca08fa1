"""The KV cache in the HTP's own dtype at the graph boundary: float16, or uint8 with the key transposed.

:func:`store_cache_in_fp16` (fp16 pairs):

What it changes: each past K/V graph input becomes float16, read through one ``Cast`` to float32;
each new K/V graph output is a ``Cast`` of the computed float32 tensor to float16, under the
output's name.  Nothing inside the graph changes.

Why it is safe: the HTP in fp16 mode computes every float32 tensor in fp16, so it rounds a float32
cache to fp16 as it reads it and computes the new K/V in fp16 before widening them on the way
out; a float16 cache holds exactly what it computes with, in half the bytes a runner keeps and
moves across the graph boundary every step.  On onnxruntime's CPU (the build's check), the graph
computes in float32 as before from the same rounded past, so only the new K/V outputs differ from
float32, by fp16's rounding (a relative 2**-11); the check's bound for them says so
(:data:`ROUNDING`).

:func:`store_cache_in_uint8` (the layout of onnxruntime-genai's windowed cache and of Genie,
:mod:`qnnpasses.llm.kv_layout`): each past input becomes uint8 in its layout (key
``[heads, 1, head_dim, slots]``, value ``[heads, 1, slots, head_dim]``), read through
``DequantizeLinear`` and a ``Transpose`` back to the export's order; each new K/V output is
the ``Transpose`` and ``QuantizeLinear`` of the computed tensor, under the output's name.  One
scale per layer and kind, the same in every graph, so what one graph writes the next reads.
It is lossy (8 bits): the build measures what it costs instead of bounding it by rounding.
"""

from __future__ import annotations

import numpy as np
import onnx

from qnnpasses.ir.model import IRModel
from qnnpasses.llm.kv_layout import LAYOUTS
from qnnpasses.passmanager.api import PassContext
from qnnpasses.passmanager.rewrite import emit, emit_transpose, finish, make_constant, make_node, swap

#: Relative rounding of a float16 value (half the spacing of its significand): the bound of a new
#: K/V output stored in float16 against its float32 value.
ROUNDING = 2.0 ** -11


def store_cache_in_fp16(ir: IRModel, past: list[str], new: list[str]) -> int:
    """Make the graph inputs ``past`` and outputs ``new`` float16 (module docstring); the number of
    tensors changed (those already float16 are left alone)."""
    graph, ctx = ir.graph, PassContext()
    inputs = {t.name: t for t in graph.inputs}
    outputs = {t.name: i for i, t in enumerate(graph.outputs)}
    changed = 0
    for name in past:
        tensor = inputs[name]
        if np.dtype(tensor.dtype) != np.float32:
            continue
        readers = list(tensor.outputs)
        cast = make_node(ir, ctx, "Cast", [tensor], name_hint=f"{name}.cast_fp32", attrs={"to": onnx.TensorProto.FLOAT},
                         dtype=np.float32, shape=tensor.shape)
        for reader in readers:
            swap(reader.inputs, tensor, cast.outputs[0])
        tensor.dtype = np.float16
        changed += 1
    graph_outputs = list(graph.outputs)
    for name in new:
        index = outputs[name]
        tensor = graph_outputs[index]
        if np.dtype(tensor.dtype) != np.float32:
            continue
        tensor.name = ctx.unique_name(ir, f"{name}.fp32")
        stored = make_node(ir, ctx, "Cast", [tensor], name_hint=f"{name}.cast_fp16",
                           attrs={"to": onnx.TensorProto.FLOAT16}, dtype=np.float16, shape=tensor.shape).outputs[0]
        stored.name = name  # the output keeps its name; the float32 tensor took a fresh one
        graph_outputs[index] = stored
        changed += 1
    graph.outputs = graph_outputs
    finish(ir)
    return changed


def store_cache_in_uint8(ir: IRModel, roles: dict, layout: dict[str, str], scales: dict[str, list[float]],
                         zero_point: int) -> None:
    """Make the past inputs and new K/V outputs named by ``roles`` (per layer ``past_key`` ...
    ``new_value``) uint8 in ``layout`` (kind -> ``HBDS``/``HBSD``/``BHSD``), with
    ``scales[kind][layer]`` and ``zero_point`` (module docstring)."""
    graph, ctx = ir.graph, PassContext()
    inputs = {t.name: t for t in graph.inputs}
    graph_outputs = list(graph.outputs)
    index = {t.name: i for i, t in enumerate(graph_outputs)}
    zp = make_constant(ir, ctx, "kv_zero_point", np.asarray(zero_point, np.uint8))
    for kind in ("key", "value"):
        perm = list(LAYOUTS[layout[kind]])
        back = [int(a) for a in np.argsort(perm)]
        for layer, (past_name, new_name) in enumerate(zip(roles[f"past_{kind}"], roles[f"new_{kind}"])):
            scale = make_constant(ir, ctx, f"kv_{kind}_{layer}_scale", np.asarray(scales[kind][layer], np.float32))
            past = inputs[past_name]
            export_shape = list(past.shape)
            readers = list(past.outputs)
            stored_shape = [export_shape[a] for a in perm]
            wide = emit(ir, ctx, "DequantizeLinear", [past, scale, zp], hint=f"{past_name}.dequantize",
                        dtype=np.float32, shape=stored_shape)
            value = emit_transpose(ir, ctx, wide, back, export_shape, hint=f"{past_name}.to_export")
            for reader in readers:
                swap(reader.inputs, past, value)
            past.dtype, past.shape = np.uint8, stored_shape
            new = graph_outputs[index[new_name]]
            new.name = ctx.unique_name(ir, f"{new_name}.float")
            moved = emit_transpose(ir, ctx, new, perm, [list(new.shape)[a] for a in perm], hint=f"{new_name}.to_stored")
            stored = emit(ir, ctx, "QuantizeLinear", [moved, scale, zp], hint=f"{new_name}.quantize",
                          dtype=np.uint8, shape=list(moved.shape))
            stored.name = new_name
            graph_outputs[index[new_name]] = stored
    graph.outputs = graph_outputs
    finish(ir)
