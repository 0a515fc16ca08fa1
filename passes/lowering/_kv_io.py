"""The KV-cache interface of a model-builder graph: past inputs, present outputs, the mask.

The builder names the dims ``past_sequence_length``, ``sequence_length`` and
``total_sequence_length`` (the mask and the presents) and the cache's head dim
``kv_cache_dim``.  Nothing in those names says that total = past + sequence, so shape
binding by name (``fix-shapes``, verification inputs) would give the mask and the cache
unrelated lengths.  Once an attention is lowered to ``Concat(past, new)`` the graph itself
requires total = past + sequence; these helpers declare that and plan consistent shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.model import IRModel
from qnnpasses.ir.shapes import is_static, resolve_dim
from qnnpasses.passmanager.api import PassContext


@dataclass
class KVInterface:
    past: list[gs.Variable]
    present: list[gs.Variable]
    mask: gs.Variable | None
    tokens: gs.Variable | None  # input_ids (or the first other 2-D integer input): its dim 1 is the sequence


def _rank(t: gs.Tensor, rank: int) -> bool:
    return t.shape is not None and len(t.shape) == rank


def find_kv_interface(ir: IRModel, mask: gs.Variable | None = None) -> KVInterface | None:
    inputs = [t for t in ir.graph.inputs if isinstance(t, gs.Variable)]
    past = [t for t in inputs if _rank(t, 4) and "past" in t.name.lower()]
    if not past:
        return None
    present = [t for t in ir.graph.outputs if _rank(t, 4) and "present" in t.name.lower()]
    integer = [t for t in inputs if _rank(t, 2) and t.dtype is not None and np.dtype(t.dtype).kind in "iu"]
    if mask is None:
        mask = next((t for t in integer if "mask" in t.name.lower()), None)
    tokens = next((t for t in integer if t is not mask and "position" not in t.name.lower()), None)
    return KVInterface(past, present, mask, tokens)


def declare_kv_dims(ir: IRModel, kv: KVInterface, head: int, sequence) -> None:
    """present and mask length = ``past + sequence``; the cache's last dim = ``head``."""
    for tensor in kv.past + kv.present:
        if not is_static(tensor.shape[3]):
            tensor.shape = [*tensor.shape[:3], head]
    past_len = kv.past[0].shape[2]
    if is_static(past_len) or is_static(sequence) or not past_len or not sequence:
        return
    total = f"{past_len} + {sequence}"
    for tensor in kv.present:
        tensor.shape = [tensor.shape[0], tensor.shape[1], total, tensor.shape[3]]
    if kv.mask is not None and not is_static(kv.mask.shape[1]):
        kv.mask.shape = [kv.mask.shape[0], total]


def planned_kv_shapes(ir: IRModel, ctx: PassContext, kv: KVInterface, head: int, sequence) -> dict[str, list[int]]:
    """Verification shapes in which the mask spans past + sequence and the cache has the head dim."""
    values: dict[str, int] = {}
    for tensor in ir.graph.inputs:  # --shape binds symbols
        for dim, value in zip(tensor.shape or [], ctx.shapes.get(tensor.name) or []):
            if not is_static(dim) and dim:
                values[str(dim)] = int(value)

    def value(dim, name: str, index: int) -> int:
        return int(dim) if is_static(dim) else values.setdefault(str(dim), resolve_dim(dim, name, index))

    planned = {t.name: [value(d, t.name, i) for i, d in enumerate(t.shape)]
               for t in ir.graph.inputs if isinstance(t, gs.Variable) and t.shape is not None}
    past = kv.past[0]
    if kv.mask is not None and kv.mask.name not in ctx.shapes:
        planned[kv.mask.name][1] = value(past.shape[2], past.name, 2) + value(sequence, "", 1)
    for tensor in kv.past:
        if tensor.name not in ctx.shapes:
            planned[tensor.name][3] = head
    return planned
