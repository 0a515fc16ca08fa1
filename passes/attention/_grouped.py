"""Grouped-query attention in rank 4, shared by gqa-broadcast and mha-to-gqa.

Query head ``h`` attends with key/value head ``h // G`` (HF ``repeat_kv`` order).  Instead
of materialising K and V ``G`` times, the query is viewed as ``[B, kvH, G*S, D]`` (a
reshape of ``[B, H, S, D]``: row ``g*S + s`` of kv head ``j`` is query head ``j*G + g`` at
position ``s``) and multiplied with the un-repeated ``K: [B, kvH, D, Skv]``.  Every score is
the same dot product as before, so the result is exactly equal; the P·V output
``[B, kvH, G*S, D]`` is reshaped back to ``[B, H, S, D]``.

Why rank 4 and not the rank-5 broadcast ``[B, kvH, G, S, D] @ [B, kvH, 1, D, Skv]``: the HTP
(v73) runs both (measured), but the rank-5 form needs an extra reshape per K and V and per
layer, while this one needs two reshapes per layer and, for a mask shared by all layers, a
single ``Tile`` of the mask rows (``[.., S, Skv] -> [.., G*S, Skv]``) per model.

Operands of the score region (mask, bias, scale) are adapted to the new row order:
broadcast over heads and rows: unchanged; over heads only: tiled ``G`` times along the rows;
per head: reshaped to ``[B, kvH, G*S, Skv]`` (folded at compile time when constant).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from qnnpasses.ir.attention import Attention, KVSide, shape_of

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import PassContext
from qnnpasses.passmanager.rewrite import constant_value, make_constant


class GroupedRewriter:
    """Rewrites attention blocks to the grouped form; adapted operands are shared between blocks."""

    def __init__(self, ir: IRModel, ctx: PassContext):
        self.ir, self.ctx = ir, ctx
        self._adapted: dict[tuple, tuple[gs.Tensor, gs.Tensor | str]] = {}

    @property
    def adapted_operands(self) -> int:
        """How many distinct operands (masks, biases) had to be tiled or regrouped."""
        return sum(1 for operand, result in self._adapted.values()
                   if not isinstance(result, str) and result is not operand)

    def rewrite(self, att: Attention, groups: int) -> str | None:
        """Rewrite ``att`` for ``groups`` query heads per key/value head; None or why not."""
        if groups < 1 or att.heads % groups:
            return f"{att.heads} heads cannot be split into groups of {groups}"
        kv_heads = att.heads // groups
        region = att.region
        replacements = []
        for node, index, operand in region.operands():
            adapted = self._adapt(operand, att, groups, kv_heads)
            if isinstance(adapted, str):
                return f"operand '{operand.name}' of {node.op} '{node.name}': {adapted}"
            replacements.append((node, index, adapted))
        dtype = region.qk.inputs[0].dtype
        query = self._reshape(region.qk.inputs[0], [0, kv_heads, -1, att.head_dim], "gqa_query", dtype)
        region.qk.inputs[0] = query
        region.qk.inputs[1] = self._rebuild(att.key, "gqa_key", dtype)
        region.pv.inputs[1] = self._rebuild(att.value, "gqa_value", dtype)
        for node, index, adapted in replacements:
            node.inputs[index] = adapted
        for tensor in [region.qk.outputs[0]] + [t for n in region.nodes for t in n.outputs]:
            tensor.shape = None
        self._regroup_output(region.pv, att, "gqa_out")
        return None

    # ------------------------------------------------------------------ pieces

    def _node(self, op: str, inputs: list[gs.Tensor], hint: str, dtype, attrs: dict | None = None,
              outputs: list[gs.Tensor] | None = None) -> gs.Tensor:
        outputs = outputs or [gs.Variable(self.ctx.unique_name(self.ir, f"{hint}_out"), dtype=dtype)]
        node = gs.Node(op=op, name=self.ctx.unique_name(self.ir, hint), attrs=attrs or {}, inputs=inputs,
                       outputs=outputs)
        self.ir.graph.nodes.append(node)
        return outputs[0]

    def _reshape(self, tensor: gs.Tensor, shape: list[int], hint: str, dtype) -> gs.Tensor:
        target = make_constant(self.ir, self.ctx, f"{hint}_shape", np.asarray(shape, dtype=np.int64))
        return self._node("Reshape", [tensor, target], hint, dtype)

    def _rebuild(self, side: KVSide, hint: str, dtype) -> gs.Tensor:
        """``scalar_ops(Transpose(start, perm))``: what the verified K/V chain computed, minus the repeat."""
        tensor = side.start
        if side.perm != tuple(range(len(side.perm))):
            tensor = self._node("Transpose", [tensor], f"{hint}_transpose", dtype, {"perm": list(side.perm)})
        for op, constant, index in side.scalar_ops:
            inputs = [constant, tensor] if index == 0 else [tensor, constant]
            tensor = self._node(op, inputs, f"{hint}_{op.lower()}", dtype)
        return tensor

    def _regroup_output(self, pv: gs.Node, att: Attention, hint: str) -> None:
        """P·V now yields ``[B, kvH, G*S, D]``; a reshape gives the original tensor ``[B, H, S, D]`` back."""
        original = pv.outputs[0]
        grouped = gs.Variable(self.ctx.unique_name(self.ir, f"{hint}_grouped"), dtype=original.dtype)
        pv.outputs.clear()
        pv.outputs.append(grouped)
        target = make_constant(self.ir, self.ctx, f"{hint}_shape",
                               np.asarray([0, att.heads, -1, att.head_dim], dtype=np.int64))
        self._node("Reshape", [grouped, target], hint, original.dtype, outputs=[original])

    def _adapt(self, operand: gs.Tensor, att: Attention, groups: int, kv_heads: int) -> gs.Tensor | str:
        key = (id(operand), groups, att.heads, att.q_len)
        if key not in self._adapted:
            self._adapted[key] = (operand, self._adapt_new(operand, att, groups, kv_heads))
        return self._adapted[key][1]

    def _adapt_new(self, operand: gs.Tensor, att: Attention, groups: int, kv_heads: int) -> gs.Tensor | str:
        shape = shape_of(operand)
        if shape is None:
            return "unknown shape"
        if len(shape) > 4:
            return f"rank {len(shape)} > 4"
        dims = (1,) * (4 - len(shape)) + shape
        heads, rows = dims[1], dims[2]
        if groups == 1 or (heads == 1 and rows == 1):
            return operand
        value = constant_value(operand)
        if heads == 1 and rows == att.q_len:
            repeats = [1] * len(shape)
            repeats[-2] = groups
            if value is not None:
                return make_constant(self.ir, self.ctx, "gqa_tiled", np.tile(value, repeats))
            counts = make_constant(self.ir, self.ctx, "gqa_tile_repeats", np.asarray(repeats, dtype=np.int64))
            return self._node("Tile", [operand, counts], "gqa_tile", operand.dtype)
        if heads == att.heads and len(shape) == 4:
            if value is not None and isinstance(att.q_len, int):
                full = np.broadcast_to(value, (dims[0], heads, att.q_len, dims[3]))
                return make_constant(self.ir, self.ctx, "gqa_per_head",
                                     np.ascontiguousarray(full).reshape(dims[0], kv_heads, -1, dims[3]))
            if rows == att.q_len:
                return self._reshape(operand, [0, kv_heads, -1, 0], "gqa_per_head", operand.dtype)
        return f"cannot regroup an operand of shape {list(shape)} (heads {att.heads}, query length {att.q_len})"
