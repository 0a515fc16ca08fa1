"""Rule family ``model``: whole-model facts the HTP cares about (QP005, QP007, QP008).

Zero-sized tensors, the opset, and the total size of the weights.  These need no pattern
matching: the graph says them directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.shapes import is_static
from qnnpasses.ir.read import is_constant
from qnnpasses.lint.context import SIMPLIFY, LintContext, Rewrite
from qnnpasses.lint.registry import Finding, Rule, rule
from qnnpasses.units import fmt_bytes

#: Below this the EP declines the whole model (onnxruntime has no layout transformer for it).
MIN_EP_OPSET = 7
#: The passes assume opset-13 forms (axes as inputs of Squeeze/Unsqueeze/ReduceSum, Split sizes...).
MIN_PASS_OPSET = 13


def _is_empty(tensor: gs.Tensor) -> bool:
    shape = tensor.shape
    return shape is not None and all(is_static(d) for d in shape) and 0 in list(shape)


def _empty_data(tensor: gs.Tensor) -> bool:
    """A computed tensor with zero elements; empty 1-D int64 tensors are shape/axes operands
    (``ConstantOfShape([])`` makes a scalar) and constants are folded by onnxruntime."""
    if isinstance(tensor, gs.Constant) or is_constant(tensor, through_identity=True) or not _is_empty(tensor):
        return False
    return not (len(tensor.shape) == 1 and tensor.dtype is not None and np.dtype(tensor.dtype) == np.int64)


def _empty_resolved(name: str) -> Callable[[Rewrite], bool]:
    def resolved(rw: Rewrite) -> bool:
        tensor = rw.after.graph.tensors().get(name)
        return tensor is None or not tensor.outputs or not _is_empty(tensor)

    return resolved


@rule("QP005", "zero-sized-tensor", "error", "a tensor with zero elements (the HTP rejects it)",
      fix="manual: remove the empty operand")
def zero_sized(ctx: LintContext, r: Rule) -> Iterator[Finding]:
    """A tensor with a 0 dimension read by a node.  The HTP rejects zero-sized tensors (e.g.
    StridedSlice validation fails and the whole graph fails to compose).  TorchScript exports
    of partial rotary embeddings concatenate an empty ``x[..., d:]``; ``simplify`` drops empty
    Concat operands."""
    for name, tensor in ctx.graph.tensors().items():
        if not tensor.outputs or not _empty_data(tensor):
            continue
        reader = tensor.outputs[0]
        shape = "x".join(str(d) for d in tensor.shape)
        fix = ctx.fix_for(_empty_resolved(name), (SIMPLIFY, "layout"))
        yield r.finding(reader.name, reader.op, f"reads zero-sized tensor '{name}' (shape {shape})", fix=fix,
                        tensor=name)


@rule("QP007", "old-opset", "warning", "an opset older than the passes need (13)",
      fix="manual: re-export with opset >= 17 (torch.onnx.export(..., opset_version=17))",
      help_uri="https://onnx.ai/onnx/repo-docs/Versioning.html")
def old_opset(ctx: LintContext, r: Rule) -> Iterator[Finding]:
    """Below opset 13 the rewrite passes do not apply: they assume the opset-13 forms (axes as
    inputs of Squeeze/Unsqueeze/ReduceSum, Split sizes as an input, Softmax over one axis
    instead of a 2-D coercion).  Below opset 7 the model is QP019 (error) instead."""
    opset = ctx.ir.opset
    if MIN_EP_OPSET <= opset < MIN_PASS_OPSET:
        yield r.finding(None, None, f"opset {opset} < {MIN_PASS_OPSET}: the rewrite passes assume opset-13 forms")


@rule("QP019", "opset-below-ep", "error", "an opset older than the QNN EP accepts (7): nothing runs on the HTP",
      fix="manual: re-export with opset >= 17 (torch.onnx.export(..., opset_version=17))",
      help_uri="https://onnx.ai/onnx/repo-docs/Versioning.html")
def opset_below_ep(ctx: LintContext, r: Rule) -> Iterator[Finding]:
    """Below opset 7 onnxruntime declines the QNN EP for the whole model (everything runs on
    the CPU)."""
    opset = ctx.ir.opset
    if opset < MIN_EP_OPSET:
        yield r.finding(None, None, f"opset {opset} < {MIN_EP_OPSET}: the QNN EP declines the whole model")


@rule("QP008", "weights-too-large", "error", "more weights than one HTP graph can hold (2 GiB)",
      fix="qnnpasses partition --max-part-bytes 2G")
def weights_too_large(ctx: LintContext, r: Rule) -> Iterator[Finding]:
    """One QNN graph (and one context binary) holds at most about 2 GiB of weights, and a
    protobuf cannot exceed 2 GiB either.  Larger models must be cut into parts that each fit:
    ``qnnpasses partition --max-part-bytes`` splits at layer boundaries."""
    total = ctx.ir.weight_bytes()
    limit = ctx.config.max_graph_weight_bytes
    if total > limit:
        yield r.finding(None, None, f"{fmt_bytes(total)} of weights > {fmt_bytes(limit)} per HTP graph",
                        weight_bytes=total)
