"""logits-offset: ``logits = x @ W`` => ``logits - m`` and an output ``m``, the row's maximum (or
its maximum over a set of candidate tokens), subtracted inside the MatMul's accumulator.

Matches: a float32 graph output computed by ``MatMul(x, W)`` -- ``W`` a constant float32 ``[K, V]``,
``x`` of static shape ``[..., K]`` -- through shape-only ops that keep the last axis (Reshape,
Squeeze, Unsqueeze, Flatten, Identity), each read by nothing else: a language model's lm_head.
float32 only: the HTP runs such a graph in fp16 with the offset inside the accumulator, while
in a graph that is fp16 itself the rewrite would also change the original's own rounding of the
logits on every backend (finer, but no longer the same function to float rounding).  The
``output`` option names the output to rewrite; by default every output that matches.

Produces, with ``W' = [W; 1]`` (one row of ones appended, ``[K + 1, V]``)::

    y1 = MatMul(x, C)                        # C = W (every token), or W[:, :N] (candidates=N)
    m  = ReduceMax(y1, last axis, keepdims)
    y2 = MatMul(Concat(x, -m), W')           # x @ W - m, the offset subtracted before rounding
    <output>        = shape-only ops(y2)     # the logits relative to m: the top ones near 0
    <output>_offset = Reshape(m)             # [..., 1]: logits = <output> + <output>_offset

Why it is safe: ``[x, -m] @ [W; 1] = x @ W - m`` exactly, whatever ``m`` is, so ``<output> +
<output>_offset`` is the original logits up to float rounding, and ``<output>`` alone differs from
them by one constant per row: argmax, softmax, log-softmax and sampling read it unchanged.  A runner
that needs the absolute logits adds the offset in float32.  It changes the interface on purpose
(one output more, one output shifted); verification maps the original outputs accordingly.

Why: in fp16 the HTP's MatMul accumulates finer than fp16 but rounds its output to fp16, whose
spacing at a logit of 16..32 is 0.0156: a margin of a few thousandths between the two most
likely tokens is below what the rounded logits resolve.  Subtracting (nearly) the row's maximum
inside the accumulation puts the logits that decide the next token near 0, where fp16 resolves
far finer.  ``tests/test_pass_logits_offset.py`` measures it on the HTP in fp16: the logits within
4 of their row's maximum come out well over 10x closer to fp32.

Cost: with every token as a candidate (``candidates=0``), a second lm_head MatMul per call, so
the lm_head's weight is read twice per call and stored twice (``W`` and ``W'``).  One ``W'`` for
both MatMuls (``Concat(x, 0)`` for the first) stores it once but still reads it twice, and the
simulated HTP prepares or runs that form far slower (``python tools/probe_lm_head.py``,
``docs/lm_head_forms.md``).  ``candidates=N`` takes the offset from the first ``N`` tokens only:
``N / V`` of the lm_head's bytes more instead of all of them.  Byte-pair and SentencePiece
vocabularies number their tokens roughly by frequency (a merge learned earlier gets a lower id),
so the most likely next token is often among the first ids; where it is not, ``m`` falls short of
the row's maximum by that token's lead, and the top logits land at that lead instead of at 0:
still finer than at their absolute value, never wrong (``docs/logits_offset.md`` measures how
often and by how much on trained models: ``python tools/logits_candidates.py``).

"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.model import IRModel
from qnnpasses.ir.op_kinds import VIEWS
from qnnpasses.ir.read import numpy_dtype
from qnnpasses.passmanager.api import Pass, PassContext, PassResult, changes_interface, register_pass
from qnnpasses.passmanager.rewrite import (
    constant_value,
    derived_constant,
    emit,
    emit_reshape,
    finish,
    make_reduce,
    producer,
    stacked_constant,
    static_shape,
)

FLOAT32 = np.dtype(np.float32)
#: Ops between the MatMul and the output that move no value across the last axis.
_SHAPE_ONLY = VIEWS


def offset_name(output: str) -> str:
    return f"{output}_offset"


def candidate_count(candidates: int, vocab: int) -> int:
    """The leading tokens the offset is the maximum of for a ``candidates`` option over a vocabulary
    of ``vocab``: 0 (every token) where the option is 0 or covers the whole vocabulary."""
    return candidates if 0 < candidates < vocab else 0


def lm_head(graph: gs.Graph, output: gs.Tensor) -> tuple[gs.Node | None, str]:
    """The ``MatMul(x, W)`` that computes ``output`` through shape-only ops, or None and why not."""
    shape = static_shape(output)
    if shape is None or not shape:
        return None, "output shape not static"
    tensor, seen = output, 0
    while (node := producer(tensor)) is not None and node.op in _SHAPE_ONLY:
        if seen and len(tensor.outputs) != 1:
            return None, "an intermediate of the output is read elsewhere"
        tensor, seen = node.inputs[0], seen + 1
    if node is None or node.op != "MatMul":
        return None, "not computed by a MatMul"
    if seen and len(tensor.outputs) != 1:
        return None, "the MatMul's output is read elsewhere"
    weight = constant_value(node.inputs[1])
    x_shape = static_shape(node.inputs[0])
    if weight is None or weight.ndim != 2 or np.dtype(weight.dtype) != FLOAT32:
        return None, "MatMul weight not a constant float32 matrix"
    if x_shape is None or len(x_shape) < 1 or x_shape[-1] != weight.shape[0]:
        return None, "MatMul input shape not static"
    if shape[-1] != weight.shape[1] or static_shape(node.outputs[0]) is None \
            or static_shape(node.outputs[0])[-1] != shape[-1]:
        return None, "the shape-only ops change the last axis"
    return node, ""


@register_pass
class LogitsOffset(Pass):
    name = "logits-offset"
    summary = "lm_head logits -> logits minus the row max (subtracted inside the MatMul) + an offset output"
    lossless = False  # the outputs change on purpose
    contract = changes_interface("the logits become relative to their row's maximum (over the candidate tokens), "
                                 "given as <output>_offset")

    @dataclass
    class Options:
        output: str = ""  # the output to rewrite; "" = every output computed by an lm_head MatMul
        candidates: int = field(default=0, metadata={
            "help": "take the offset from the first N tokens only (N/V of the lm_head's bytes more "
                    "instead of all of them); 0: every token"})

    def __init__(self, options=None, **values):
        super().__init__(options, **values)
        # output -> (its offset output, the candidates its offset is the maximum of: 0 all), for map_reference
        self._rewritten: dict[str, tuple[str, int]] = {}

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        if self.options.candidates < 0:
            raise ValueError(f"candidates must be 0 (every token) or a positive count, not {self.options.candidates}")
        graph, self._rewritten = ir.graph, {}
        taken = set(graph.tensors())  # every tensor name: the offset output's must be new
        notes = []
        for output in list(graph.outputs):
            if self.options.output and output.name != self.options.output:
                continue
            dtype = numpy_dtype(output)
            if dtype is None or dtype != FLOAT32:
                if self.options.output == output.name:
                    notes.append(f"{output.name} kept: not float32")
                continue
            node, why = lm_head(graph, output)
            if node is None or offset_name(output.name) in taken:
                if self.options.output:
                    notes.append(f"{output.name} kept: {why or 'its offset output name is taken'}")
                continue
            offset, candidates = self._rewrite(ir, ctx, node, output, self.options.candidates)
            graph.outputs.append(offset)
            taken.add(offset.name)
            self._rewritten[output.name] = (offset.name, candidates)
            among = f"the max of its first {candidates} tokens" if candidates else "its row max"
            notes.append(f"{output.name} relative to {among}, offset in {offset.name}")
        if self.options.output and self.options.output not in {t.name for t in graph.outputs}:
            notes.append(f"no output named {self.options.output}")
        if not self._rewritten:
            return PassResult(changed=False, notes=notes)
        finish(ir)
        return PassResult(changed=True, stats={"outputs": len(self._rewritten)}, notes=notes)

    @staticmethod
    def _rewrite(ir: IRModel, ctx: PassContext, node: gs.Node, output: gs.Tensor,
                 candidates: int) -> tuple[gs.Tensor, int]:
        """The offset output, and how many leading tokens it is the maximum of (0: all)."""
        x, w_tensor, y = node.inputs[0], node.inputs[1], node.outputs[0]
        rows, vocab = (int(d) for d in w_tensor.shape)
        candidates = candidate_count(candidates, vocab)
        x_shape, first_shape = static_shape(x), static_shape(y)
        first_w = w_tensor
        # where W is a mapped weight: [W; 1] kept as W and the ones (saved part by part) and W's first
        # columns as a recipe: written, never held
        if candidates:
            first_w = derived_constant(ir, ctx, f"{w_tensor.name}_candidates", w_tensor,
                                       lambda w: w[:, :candidates], shape=(rows, candidates))
            first_shape = [*first_shape[:-1], candidates]
        augmented = stacked_constant(ir, ctx, f"{w_tensor.name}_with_ones", w_tensor,
                                     np.ones((1, vocab), FLOAT32))
        column = (*x_shape[:-1], 1)
        wide = (*x_shape[:-1], x_shape[-1] + 1)
        first = emit(ir, ctx, "MatMul", [x, first_w], hint="logits_first", dtype=y.dtype, shape=first_shape)
        row_max = make_reduce(ir, ctx, "ReduceMax", first, [-1], "logits_row_max")
        row_max.shape = list(column)
        negated = emit(ir, ctx, "Neg", [row_max], hint="logits_neg_max", dtype=x.dtype, shape=column)
        shifted_in = emit(ir, ctx, "Concat", [x, negated], hint="logits_shifted_input", dtype=x.dtype, shape=wide,
                          attrs={"axis": -1})
        node.inputs[0], node.inputs[1] = shifted_in, augmented  # y = x @ W - m, still feeding the output
        offset = emit_reshape(ir, ctx, row_max, [*static_shape(output)[:-1], 1], hint="logits_offset")
        offset.name = offset_name(output.name)
        return offset, candidates

    def map_reference(self, reference: dict, inputs: dict) -> dict:
        mapped = dict(reference)
        for name, (offset, candidates) in self._rewritten.items():
            logits = np.asarray(reference[name])
            row_max = (logits[..., :candidates] if candidates else logits).max(axis=-1, keepdims=True)
            mapped[name], mapped[offset] = logits - row_max, row_max
        return mapped
