"""The KV cache in the HTP's own dtype: an fp16 pair takes and gives its cache in float16.

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
"""

from __future__ import annotations

import numpy as np
import onnx

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import PassContext
from qnnpasses.passmanager.rewrite import finish, make_node, swap

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
