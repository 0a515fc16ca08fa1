"""Mean-pooling K/V projection heads per group (mha-to-gqa) and resizing what follows them.

Columns ``[begin, end)`` of a projection weight (``MatMul`` columns, ``Gemm transB`` rows) and
bias hold ``H`` heads of ``head_dim``; heads ``j*G .. j*G+G-1`` become head ``j``, their mean
(the order in which ``repeat_kv`` would expand them again).  A fused QKV weight shrinks once
for both K and V; its ``Split`` sizes / ``Slice`` bounds and the reshapes on the way to the
head split move to the new column boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs
from qnnpasses.passes.attention._proj import split_sizes

from qnnpasses.passmanager.rewrite import constant_value, static_shape


def pool_heads(values: np.ndarray, begin: int, end: int, axis: int, groups: int, head_dim: int) -> np.ndarray:
    """``values`` with columns ``[begin, end)`` on ``axis`` (H heads of ``head_dim``) mean-pooled per group.

    Heads ``j*G .. j*G+G-1`` become head ``j`` (the order ``repeat_kv`` expands them back in).
    """
    moved = np.moveaxis(np.asarray(values), axis, -1)
    block = moved[..., begin:end].astype(np.float64)
    heads = (end - begin) // head_dim
    pooled = block.reshape(block.shape[:-1] + (heads // groups, groups, head_dim)).mean(axis=-2)
    pooled = pooled.reshape(block.shape[:-1] + (-1,)).astype(values.dtype)
    joined = np.concatenate([moved[..., :begin], pooled, moved[..., end:]], axis=-1)
    return np.ascontiguousarray(np.moveaxis(joined, -1, axis))


@dataclass
class Shrink:
    """Columns ``[begin, end)`` of one weight/bias input shrink ``groups``-fold."""

    node: gs.Node
    index: int
    axis: int
    ranges: list[tuple[int, int]] = field(default_factory=list)


def new_column(column: int, ranges: list[tuple[int, int]], groups: int) -> int:
    """Where an old column boundary lands after every range shrank ``groups``-fold."""
    shift = 0
    for begin, end in ranges:
        if end <= column:
            shift += (end - begin) - (end - begin) // groups
        elif begin < column:
            shift += (column - begin) - (column - begin) // groups
    return column - shift


def shrink_cutter(node: gs.Node, ranges: list[tuple[int, int]], groups: int, make) -> str | None:
    """Move a Split's sizes or a Slice's bounds to the shrunk columns of its (fused) input."""
    width = static_shape(node.inputs[0])[-1]
    if node.op == "Split":
        bounds = np.concatenate([[0], np.cumsum(split_sizes(node))])
        new_sizes = np.diff([new_column(int(b), ranges, groups) for b in bounds]).astype(np.int64)
        if "split" in node.attrs:  # opset < 13
            node.attrs["split"] = [int(s) for s in new_sizes]
            return None
        node.attrs.pop("num_outputs", None)
        sizes = make("split_sizes", new_sizes)
        if len(node.inputs) > 1:
            node.inputs[1] = sizes
        else:
            node.inputs.append(sizes)
        return None
    starts, ends = (np.ravel(constant_value(node.inputs[i])) for i in (1, 2))
    if int(starts[0]) < 0 or int(ends[0]) < 0:
        return f"Slice '{node.name}' with negative bounds"
    new_end = ends[0] if ends[0] >= width else new_column(int(ends[0]), ranges, groups)
    node.inputs[1] = make("slice_starts", np.asarray([new_column(int(starts[0]), ranges, groups)], dtype=starts.dtype))
    node.inputs[2] = make("slice_ends", np.asarray([new_end], dtype=ends.dtype))
    return None


def shrink_last_dim(reshape: gs.Node, width: int, new_width: int, make) -> None:
    """A reshape on the way from a shrunk projection: its explicit last dimension shrinks too."""
    target = np.ravel(constant_value(reshape.inputs[1])).copy()
    if target[-1] == width:
        target[-1] = new_width
        reshape.inputs[1] = make("projection_shape", target)


def shrink_head_split(reshape: gs.Node, heads: int, kv_heads: int, make) -> None:
    """``[B, S, H, D]`` -> ``[B, S, kvH, D]`` in the head-split target (``-1``/``0`` stay)."""
    target = np.ravel(constant_value(reshape.inputs[1])).copy()
    if target[2] == heads:
        target[2] = kv_heads
        reshape.inputs[1] = make("head_split_shape", target)
