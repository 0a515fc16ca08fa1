"""No-op removal and canonical operand order for ``simplify``.

* ``Identity``, inference ``Dropout``, ``Cast`` to the type the input already has,
  ``Reshape``/``Expand``/``Squeeze``/``Unsqueeze``/``Flatten`` whose static output shape
  equals their static input shape, and ``Concat`` of a single operand are bypassed.
* A ``Concat`` operand with zero elements (TorchScript exports of partial rotary embeddings
  concatenate ``x[..., 16:]`` of a 16-wide head: shape ``[1, 4, 16, 0]``) adds nothing and
  is dropped while another operand remains.  The HTP rejects zero-sized tensors
  (StridedSlice validation fails and the whole graph fails to compose), so this matters.

* Commutative binary ops (``Add``, ``Mul``, ``And``, ``Or``, ``Xor``, ``Equal``, ``Max``,
  ``Min``, bitwise and/or/xor) get their constant operand second.  Exporters emit
  ``Mul(weight, x)`` for the RMSNorm scale (``self.weight * hidden``); the HTP (fp16,
  the op-support table's backend) then fails to *finalize* the whole graph ("could not create op:
  q::ForceFormat_Crouton" on that Mul), while ``Mul(x, weight)`` runs.  IEEE addition and
  multiplication are commutative, so the swap is bit-exact.

A bypassed node whose output is a graph output hands the output name to its input's
producer; when the input is a graph input or a constant the node stays, so the model's
interface never changes.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.passmanager.rewrite import can_replace, replace_all_uses, static_shape

_SHAPE_PRESERVING_NOPS = frozenset({"Reshape", "Expand", "Squeeze", "Unsqueeze", "Flatten"})
COMMUTATIVE = frozenset({"Add", "Mul", "And", "Or", "Xor", "Equal", "Max", "Min",
                         "BitwiseAnd", "BitwiseOr", "BitwiseXor"})


def _same_dtype(a: gs.Tensor, b: gs.Tensor) -> bool:
    if a.dtype is None or b.dtype is None:
        return False
    try:
        return np.dtype(a.dtype) == np.dtype(b.dtype)
    except TypeError:  # onnx enum dtypes (bfloat16, float8) compare as they are
        return a.dtype == b.dtype


def is_nop(node: gs.Node) -> bool:
    """True when the node's single output always equals its first input."""
    if not node.inputs or not node.inputs[0].name or len(node.outputs) != 1:
        return False
    if node.op == "Identity" or (node.op == "Dropout" and len(node.inputs) < 3):
        return True
    src, out = node.inputs[0], node.outputs[0]
    if node.op == "Concat":
        return len(node.inputs) == 1
    if node.op == "Cast":
        return _same_dtype(src, out)
    if node.op in _SHAPE_PRESERVING_NOPS:
        return static_shape(src) is not None and static_shape(src) == static_shape(out) and _same_dtype(src, out)
    return False


def remove_nops(graph: gs.Graph, report) -> None:
    """Bypass no-op nodes; a graph output keeps its name (its producer's tensor takes it)."""
    for node in list(graph.nodes):
        if not is_nop(node):
            continue
        src, out = node.inputs[0], node.outputs[0]
        if not can_replace(graph, out, src):
            report.skip(node, "bypassing it would rename a graph input/output or make an output constant")
            continue
        replace_all_uses(graph, out, src)
        node.inputs.clear()
        node.outputs.clear()
        report.nops_removed += 1


def _is_empty(tensor: gs.Tensor) -> bool:
    shape = static_shape(tensor)
    return shape is not None and 0 in shape


def prune_empty_concat_inputs(graph: gs.Graph, report) -> None:
    """Drop zero-element operands of ``Concat`` while a non-empty operand remains."""
    for node in graph.nodes:
        if node.op != "Concat" or len(node.inputs) < 2:
            continue
        empty = [i for i, t in enumerate(node.inputs) if _is_empty(t)]
        if empty and len(empty) < len(node.inputs):
            for index in reversed(empty):  # element-wise: graphsurgeon's lists reject slice assignment
                del node.inputs[index]
            report.empty_inputs_dropped += len(empty)


def constants_second(graph: gs.Graph, report) -> None:
    """``op(C, x)`` -> ``op(x, C)`` for commutative binary ops with one constant operand."""
    for node in graph.nodes:
        if node.op not in COMMUTATIVE or len(node.inputs) != 2 or node.domain not in ("", "ai.onnx", None):
            continue
        first, second = node.inputs
        if isinstance(first, gs.Constant) and not isinstance(second, gs.Constant):
            node.inputs[0], node.inputs[1] = second, first
            report.operands_swapped += 1
