"""decompose-layernorm: a LayerNormalization the HTP cannot run => ops it can.

Matches ``LayerNormalization(x, scale, bias?, axis=k)`` whose Mean/InvStdDev outputs are
unused.  The HTP's LayerNorm only normalizes the last axis of a rank <= 4 input (measured:
"only supports normalization along the last axis", "incorrect Rank 5"); ONNX's axis ``k``
normalizes dims ``k..rank-1`` jointly.  ``when=unsupported`` (default) rewrites only those
cases, ``when=always`` every LayerNormalization.  Two strategies:

* ``reshape`` (static shapes, constant scale/bias): ``Reshape(x, [prod(dims[:k]),
  prod(dims[k:])]) -> LayerNormalization(axis=-1) -> Reshape(back)``: the same
  normalization, still one native HTP LayerNorm (rank 2) plus two free reshapes;
* ``primitives``: ``d = x - ReduceMean(x, k..r-1)``, ``d / sqrt(mean(d^2) + eps)`` in the
  fp16-safe form of ``_norm_graph.safe_normalize`` (``form=plain``: the exporters'
  spelling, which overflows fp16 for |d| > 256), ``* scale + bias``.

``strategy=auto`` uses ``reshape`` where it applies, else ``primitives``.  Both compute the
same function (fp32 rounding-level differences), so the pass is lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from qnnpasses.op_support.capability import htp_runs_norm
from qnnpasses.passes.norm._graph import (
    Replacements,
    binary,
    plain_normalize,
    rank,
    safe_normalize,
)

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import EXACT, NORMS_FINAL, NORMS_FUSED, Pass, PassContext, PassResult, register_pass
from qnnpasses.passmanager.rewrite import constant_value, finish, is_graph_output, make_constant, make_node, make_reduce


@register_pass
class DecomposeLayerNorm(Pass):
    name = "decompose-layernorm"
    anchor_ops = frozenset({"LayerNormalization"})
    summary = "LayerNormalization (axis not last / rank > 4) => Reshape+LayerNorm(last) or fp16-safe primitives"
    contract = EXACT
    requires = frozenset({NORMS_FUSED})
    ensures = frozenset({NORMS_FINAL})

    @dataclass
    class Options:
        when: str = field(default="unsupported", metadata={"help": "unsupported (what HTP LayerNorm rejects) | always"})
        strategy: str = field(default="auto", metadata={"help": "auto | reshape | primitives"})
        form: str = field(default="safe", metadata={"help": "primitives: safe (fp16 overflow-free) | plain"})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        for key, allowed in (("when", ("unsupported", "always")), ("strategy", ("auto", "reshape", "primitives")),
                             ("form", ("safe", "plain"))):
            if getattr(self.options, key) not in allowed:
                raise ValueError(f"decompose-layernorm: {key} must be one of {allowed}")
        stats, notes = {"reshaped": 0, "decomposed": 0, "kept_native": 0}, []
        rewired = Replacements(ir.graph)
        for node in [n for n in ir.graph.nodes if n.op == "LayerNormalization" and n.domain in (None, "", "ai.onnx")]:
            if any(len(t.outputs) or is_graph_output(ir.graph, t) for t in node.outputs[1:] if t.name):
                notes.append(f"{node.name}: Mean/InvStdDev outputs are used")
                continue
            r, axis = rank(node.inputs[0]), int(node.attrs.get("axis", -1))
            if self.options.when == "unsupported" and htp_runs_norm(axis, r):
                stats["kept_native"] += 1
                continue
            if r is None:
                notes.append(f"{node.name}: input rank unknown")
                continue
            axis = axis % r
            y = self._reshaped(ir, ctx, node, axis) if self.options.strategy != "primitives" else None
            if y is None and self.options.strategy == "reshape":
                notes.append(f"{node.name}: reshape needs static dims and constant scale/bias")
                continue
            stats["reshaped" if y is not None else "decomposed"] += 1
            y = y if y is not None else self._primitives(ir, ctx, node, list(range(axis, r)))
            rewired.replace(node.outputs[0], y)
        changed = stats["reshaped"] + stats["decomposed"] > 0
        if changed:
            finish(ir)
        return PassResult(changed=changed, stats=stats, notes=notes)

    def _primitives(self, ir: IRModel, ctx: PassContext, node, axes: list[int]):
        x, eps = node.inputs[0], float(node.attrs.get("epsilon", 1e-5))
        d = binary(ir, ctx, "Sub", x, make_reduce(ir, ctx, "ReduceMean", x, axes, "layernorm_mean"), "layernorm_centered")
        normalize = safe_normalize if self.options.form == "safe" else plain_normalize
        y = binary(ir, ctx, "Mul", normalize(ir, ctx, d, eps, axes, "layernorm"), node.inputs[1], "layernorm_scaled")
        if len(node.inputs) > 2 and node.inputs[2].name:
            y = binary(ir, ctx, "Add", y, node.inputs[2], "layernorm_shifted")
        return y

    @staticmethod
    def _reshaped(ir: IRModel, ctx: PassContext, node, axis: int):
        """``Reshape -> LayerNormalization(last axis, rank 2) -> Reshape``, or None if not applicable."""
        x = node.inputs[0]
        dims = list(x.shape)
        if not all(isinstance(d, int) and d >= 0 for d in dims):
            return None
        inner = int(np.prod(dims[axis:]))
        params = [constant_value(t, through_identity=True) if t.name else None for t in node.inputs[1:]]
        if any(p is None for p, t in zip(params, node.inputs[1:]) if t.name):
            return None
        flat = [make_constant(ir, ctx, "layernorm_param", np.broadcast_to(p, dims[axis:]).reshape(inner).copy())
                for p in params if p is not None]
        shape2 = make_constant(ir, ctx, "layernorm_2d", np.asarray([int(np.prod(dims[:axis])), inner], dtype=np.int64))
        x2 = make_node(ir, ctx, "Reshape", [x, shape2], name_hint="layernorm_flatten", dtype=x.dtype).outputs[0]
        attrs = {k: v for k, v in node.attrs.items() if k != "axis"} | {"axis": -1}
        y2 = make_node(ir, ctx, "LayerNormalization", [x2] + flat, name_hint="layernorm", attrs=attrs, dtype=x.dtype).outputs[0]
        back = make_constant(ir, ctx, "layernorm_shape", np.asarray(dims, dtype=np.int64))
        return make_node(ir, ctx, "Reshape", [y2, back], name_hint="layernorm_unflatten", dtype=x.dtype).outputs[0]
