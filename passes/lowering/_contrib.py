"""What the contrib-op lowerings share: emitting standard ops on dynamic shapes, and the
property they ensure (``contrib-lowered``, declared in the core: ``fix-shapes`` requires it).

The lowerings run before ``fix-shapes`` (contrib ops stop shape inference, so nothing
downstream of them has a shape until they are lowered): what they emit must work on
symbolic shapes -- ``Reshape`` with 0/-1, shape arithmetic through ``Shape``/``Gather`` --
and becomes static and folds once ``fix-shapes`` and ``simplify`` have run.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import PassContext
from qnnpasses.ir.shapes import is_static
from qnnpasses.passmanager.rewrite import constant_value, make_constant, make_node, producer

MICROSOFT = "com.microsoft"


def is_contrib(node: gs.Node, op: str) -> bool:
    return node.op == op and (node.domain or "") == MICROSOFT


class Emitter:
    """Appends standard-ONNX nodes with fresh names for one lowering."""

    def __init__(self, ir: IRModel, ctx: PassContext, hint: str):
        self.ir, self.ctx, self.hint = ir, ctx, hint

    def const(self, value, dtype=None) -> gs.Constant:
        return make_constant(self.ir, self.ctx, f"{self.hint}_c", np.asarray(value, dtype=dtype))

    def op(self, op: str, inputs: list, *, attrs: dict | None = None, dtype=None, shape=None,
           outputs: int | list[gs.Variable] = 1):
        """One node; returns its output, or the list of them when ``outputs`` > 1 or given."""
        if isinstance(outputs, list):
            node = gs.Node(op=op, name=self.ctx.unique_name(self.ir, f"{self.hint}_{op}"), attrs=attrs or {},
                           inputs=list(inputs), outputs=outputs)
            self.ir.graph.nodes.append(node)
            return outputs
        node = make_node(self.ir, self.ctx, op, inputs, name_hint=f"{self.hint}_{op}", attrs=attrs,
                         num_outputs=outputs, dtype=dtype, shape=shape)
        return node.outputs[0] if outputs == 1 else node.outputs

    def dim(self, tensor: gs.Tensor, axis: int) -> gs.Variable:
        """``tensor.shape[axis]`` at run time, as a 0-d int64."""
        shape = self.op("Shape", [tensor], dtype=np.int64, shape=[None])
        return self.op("Gather", [shape, self.const(axis, np.int64)], attrs={"axis": 0}, dtype=np.int64, shape=[])

    def heads(self, x: gs.Tensor, heads: int, head_size: int) -> gs.Variable:
        """``[B, S, heads*head_size]`` -> ``[B, heads, S, head_size]`` (the HF layout)."""
        split = self.op("Reshape", [x, self.const([0, 0, heads, head_size], np.int64)], dtype=x.dtype)
        return self.op("Transpose", [split], attrs={"perm": [0, 2, 1, 3]}, dtype=x.dtype)

    def rotate(self, x: gs.Tensor, cos: gs.Tensor, sin: gs.Tensor, head_size: int, interleaved: bool,
               into: gs.Variable | None = None) -> gs.Variable:
        """``x*cos + (x @ R)*sin``: the form the ``rotary`` pass produces (R a signed permutation)."""
        r = rotation_matrix(head_size, interleaved, np.dtype(x.dtype or cos.dtype or np.float32))
        turned = self.op("MatMul", [x, self.const(r.reshape(1, 1, head_size, head_size))], dtype=x.dtype)
        terms = [self.op("Mul", [x, cos], dtype=x.dtype), self.op("Mul", [turned, sin], dtype=x.dtype)]
        if into is not None:
            return self.op("Add", terms, outputs=[into])[0]
        return self.op("Add", terms, dtype=x.dtype)

    def cos_sin(self, cache: gs.Tensor, positions: gs.Tensor, head_size: int, interleaved: bool) -> gs.Variable:
        """Rows of a ``[max_pos, head_size/2]`` cache at ``positions [B, S]`` -> ``[B, 1, S, head_size]``."""
        half = head_size // 2
        index = np.repeat(np.arange(half), 2) if interleaved else np.concatenate([np.arange(half)] * 2)
        rows = self.op("Gather", [cache, positions], attrs={"axis": 0}, dtype=cache.dtype)
        full = self.op("Gather", [rows, self.const(index, np.int64)], attrs={"axis": -1}, dtype=cache.dtype)
        return self.op("Unsqueeze", [full, self.const([1], np.int64)], dtype=cache.dtype)


def last_dim(tensor: gs.Tensor) -> int | None:
    """A tensor's last dim: declared, or read off the projection that makes it (MatMul weight,
    MatMulNBits ``N``), looking through shape-keeping ops (rotary) -- shapes are not inferred
    past contrib ops."""
    for _ in range(3):
        if tensor.shape and is_static(tensor.shape[-1]):
            return int(tensor.shape[-1])
        node = producer(tensor)
        if node is None:
            return None
        if node.op == "MatMulNBits" and "N" in node.attrs:
            return int(node.attrs["N"])
        operand = constant_value(node.inputs[1]) if node.op in ("MatMul", "Add", "Reshape") and len(node.inputs) > 1 else None
        if node.op == "Reshape":
            return int(operand[-1]) if operand is not None and operand.size and operand[-1] > 0 else None
        if operand is not None and operand.ndim >= 1:
            return int(operand.shape[-1])
        if node.op not in SHAPE_KEEPING:
            return None
        tensor = node.inputs[0]
    return None


#: ops whose output has their first input's last dim
SHAPE_KEEPING = frozenset({"RotaryEmbedding", "Cast", "Identity", "Add", "Mul"})


def rotation_matrix(head_size: int, interleaved: bool, dtype: np.dtype) -> np.ndarray:
    """``R`` with ``x @ R == rotate_half(x)`` (halves) or the pairwise GPT-J rotation (interleaved)."""
    r = np.zeros((head_size, head_size), dtype=dtype)
    half = head_size // 2
    for j in range(head_size):
        if interleaved:
            if j % 2 == 0:
                r[j + 1, j] = -1
            else:
                r[j - 1, j] = 1
        elif j < half:
            r[j + half, j] = -1
        else:
            r[j - half, j] = 1
    return r
