"""Layout chains of the attention matcher: which Transpose/Reshape/Unsqueeze/Squeeze sequences
(with scalar Mul/Div between them) amount to a pure permutation of their input.

A chain is verified by running it on an index tensor (``arange`` in the start shape): the
result is a permutation ``p`` exactly when it equals ``start.transpose(p)`` element for
element.  That covers every spelling exporters use (e.g. dynamo-SDPA's ``Reshape[B*H, S, D]
-> Transpose(0,2,1) -> Reshape[B, H, D, S]`` is ``Transpose(0,1,3,2)``) without a rule per
spelling.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.read import constant_value, is_one_element, static_shape

MAX_SIMULATED = 1 << 26  # elements of the index tensor used to verify a layout chain


def layout_step(node: gs.Node) -> tuple | None:
    """A node as a simulation step, or None when it is not a pure layout/scalar op."""
    if node.op == "Transpose":
        return ("transpose", node.attrs.get("perm"))
    if node.op == "Reshape":  # the target as written, else (shape arithmetic) the output's static shape
        shape = constant_value(node.inputs[1])
        if shape is None:
            shape = static_shape(node.outputs[0])
            return None if shape is None else ("reshape", list(shape), 1)
        return ("reshape", [int(d) for d in shape], int(node.attrs.get("allowzero", 0)))
    if node.op in ("Unsqueeze", "Squeeze"):
        axes = node.attrs.get("axes")
        if axes is None and len(node.inputs) > 1:
            axes = constant_value(node.inputs[1])
        return (node.op.lower(), None if axes is None else [int(a) for a in np.ravel(axes)])
    if node.op == "Identity":
        return ("identity",)
    if node.op in ("Mul", "Div") and len(node.inputs) == 2:
        idx = [i for i, t in enumerate(node.inputs) if is_one_element(t)]
        if idx and (node.op == "Mul" or idx == [1]):
            return ("scalar", node.op, node.inputs[idx[0]], idx[0])
    return None


def _apply(idx: np.ndarray, step: tuple) -> np.ndarray:
    kind = step[0]
    if kind == "transpose":
        return idx.transpose(step[1]) if step[1] is not None else idx.T
    if kind == "reshape":
        shape = [idx.shape[i] if d == 0 and not step[2] else d for i, d in enumerate(step[1])]
        return idx.reshape(shape)
    if kind == "unsqueeze":
        if step[1] is None:
            raise ValueError("unsqueeze without axes")
        out = idx
        for axis in sorted(a % (idx.ndim + len(step[1])) for a in step[1]):
            out = np.expand_dims(out, axis)
        return out
    if kind == "squeeze":
        return idx.squeeze(tuple(a % idx.ndim for a in step[1]) if step[1] is not None else None)
    return idx


def chain_permutation(start_shape: tuple[int, ...], steps: list[tuple]) -> tuple[int, ...] | None:
    """The permutation ``p`` with ``chain(x) == x.transpose(p)`` for every ``x``, or None."""
    if int(np.prod(start_shape)) > MAX_SIMULATED:
        return None
    base = np.arange(int(np.prod(start_shape)), dtype=np.int64).reshape(start_shape)
    try:
        idx = base
        for step in steps:
            idx = _apply(idx, step)
    except (ValueError, TypeError):
        return None
    if idx.ndim != base.ndim:
        return None
    strides = [int(np.prod(start_shape[a + 1:])) for a in range(len(start_shape))]
    perm, used = [], set()
    for axis, size in enumerate(idx.shape):
        step = int(idx[(0,) * axis + (1,) + (0,) * (idx.ndim - axis - 1)] - idx.flat[0]) if size > 1 else None
        choices = [a for a in range(base.ndim) if a not in used and start_shape[a] == size
                   and (step is None or strides[a] == step)]
        if not choices:
            return None
        perm.append(choices[0])
        used.add(choices[0])
    return tuple(perm) if np.array_equal(idx, base.transpose(perm)) else None
