"""Index maps of data-movement ops.

A data-movement op (Reshape, Transpose, Expand, Slice, Gather with constant indices, ...)
only copies elements: ``y = x.flat[I]`` for an integer array ``I`` of ``y``'s shape.
:func:`index_map` computes ``I`` by running the ops' numpy semantics (:func:`apply_op`,
checked against onnxruntime in the tests) on ``arange``; two op sequences with the same
``I`` are interchangeable bit for bit, whatever the data.  ``_layout_forms`` finds the
cheapest sequence for a given ``I``.
"""

from __future__ import annotations

import math

import numpy as np

#: Largest tensor (elements) an index map is computed for.
MAX_ELEMENTS = 1 << 25
MOVERS = frozenset({"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Expand", "Slice", "Gather",
                    "GatherND", "Tile"})


def _axes(node, values, opset: int) -> list[int] | None:
    if "axes" in node.attrs:
        return [int(a) for a in node.attrs["axes"]]
    return None if values[1] is None else [int(a) for a in values[1]]


def _reshape_target(shape: tuple[int, ...], target: np.ndarray, allowzero: int) -> tuple[int, ...]:
    dims = [int(d) for d in target]
    if not allowzero:
        dims = [shape[i] if d == 0 else d for i, d in enumerate(dims)]
    return tuple(dims)


def apply_op(node, a: np.ndarray, values: list, opset: int) -> np.ndarray:
    """``node`` applied to ``a`` (its data input); ``values`` are the constant inputs (None if absent)."""
    op, attrs = node.op, node.attrs
    if op == "Identity":
        return a
    if op == "Reshape":
        return a.reshape(_reshape_target(a.shape, values[1], attrs.get("allowzero", 0)))
    if op == "Flatten":
        axis = attrs.get("axis", 1) % (a.ndim + 1) if a.ndim else 0
        return a.reshape(math.prod(a.shape[:axis]), math.prod(a.shape[axis:]))
    if op == "Squeeze":
        axes = _axes(node, values, opset)
        return np.squeeze(a) if axes is None else np.squeeze(a, axis=tuple(ax % a.ndim for ax in axes))
    if op == "Unsqueeze":
        axes = _axes(node, values, opset)
        rank = a.ndim + len(axes)
        return a.reshape(_unsqueezed(a.shape, sorted(ax % rank for ax in axes)))
    if op == "Transpose":
        return a.transpose(attrs.get("perm") or list(range(a.ndim))[::-1])
    if op == "Expand":
        return np.broadcast_to(a, np.broadcast_shapes(a.shape, tuple(int(d) for d in values[1])))
    if op == "Tile":
        return np.tile(a, [int(r) for r in values[1]])
    if op == "Slice":
        return a[_slices(node, a, values, opset)]
    if op == "Gather":
        axis = attrs.get("axis", 0) % a.ndim
        idx = np.asarray(values[1]).astype(np.int64)
        return np.take(a, np.where(idx < 0, idx + a.shape[axis], idx), axis=axis)
    if op == "GatherND":
        return _gather_nd(a, np.asarray(values[1]).astype(np.int64), attrs.get("batch_dims", 0))
    raise ValueError(f"no index semantics for {op}")


def _unsqueezed(shape: tuple[int, ...], axes: list[int]) -> list[int]:
    out, it = [], iter(shape)
    for i in range(len(shape) + len(axes)):
        out.append(1 if i in axes else next(it))
    return out


def _slices(node, a: np.ndarray, values: list, opset: int) -> tuple:
    if opset < 10:
        starts, ends = node.attrs["starts"], node.attrs["ends"]
        axes, steps = node.attrs.get("axes"), None
    else:
        starts, ends, axes, steps = values[1], values[2], values[3], values[4]
    axes = list(range(len(starts))) if axes is None else [int(x) % a.ndim for x in axes]
    steps = [1] * len(starts) if steps is None else steps
    index = [slice(None)] * a.ndim
    for ax, s, e, st in zip(axes, starts, ends, steps):
        index[ax] = slice(int(s), int(e), int(st))  # numpy clamps exactly as ONNX Slice does
    return tuple(index)


def _gather_nd(data: np.ndarray, indices: np.ndarray, batch_dims: int) -> np.ndarray:
    """ONNX GatherND: the last indices axis addresses ``k`` data axes after ``batch_dims`` shared ones."""
    k = indices.shape[-1]
    batch = data.shape[:batch_dims]
    flat_data = data.reshape((math.prod(batch),) + data.shape[batch_dims:])
    flat_idx = indices.reshape((math.prod(batch), -1, k))
    dims = np.asarray(data.shape[batch_dims:batch_dims + k])
    flat_idx = np.where(flat_idx < 0, flat_idx + dims, flat_idx)
    out = np.stack([flat_data[b][tuple(flat_idx[b].T)] for b in range(flat_data.shape[0])])
    return out.reshape(indices.shape[:-1] + data.shape[batch_dims + k:])


def index_map(nodes: list, x_shape: tuple[int, ...], values: list[list], opset: int) -> np.ndarray | None:
    """``I`` with ``y = x.flat[I]`` for the chain ``nodes`` applied to an ``x`` of ``x_shape``."""
    if math.prod(x_shape) > MAX_ELEMENTS:
        return None
    a = np.arange(math.prod(x_shape), dtype=np.int64).reshape(x_shape)
    try:
        for node, vals in zip(nodes, values):
            a = apply_op(node, a, vals, opset)
            if a.size > MAX_ELEMENTS:
                return None
    except (ValueError, IndexError, TypeError, KeyError):
        return None
    return np.ascontiguousarray(a)
