"""layout families ``sink`` and ``norm_axis``: move Transposes so they merge or keep norms contiguous.

``sink``: ``Transpose(a, p)`` read only by a path of elementwise ops (their other operands
constants, scalars, or Transposes with the same ``p``) and last-axis ops that ``p`` keeps
last (Softmax/LayerNorm/RMSNorm/last-axis reductions), ending in another Transpose
``q``: the ops run on ``a`` (constants permuted by ``p``'s inverse, broadcast-aware) and the
two Transposes merge into ``Transpose(p then q)``, or vanish when that is the identity.
Also fires when a path op reads two same-``p`` Transposes (one Transpose after it replaces two).

``norm_axis``: ``Softmax(Transpose(x, p), axis=a)`` with ``a`` not the last axis but
``p[a]`` the last axis of ``x``: the HTP normalizes only over the contiguous last axis (the
EP wraps other axes in two Transposes).  Produces ``Transpose(Softmax(x, axis=-1), p)``.

Safe: elementwise ops and per-row normalizations commute with a permutation of the
elements that keeps each normalized row intact; constants are permuted with the data.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.model import IRModel
from qnnpasses.ir.op_kinds import ELEMENTWISE, REDUCTIONS
from qnnpasses.passmanager.api import PassContext
from qnnpasses.passmanager.rewrite import (
    constant_value,
    input_value,
    is_constant,
    make_constant,
    normalize_axis,
    replace_all_uses,
    single_consumer,
    swap,
)

LAST_AXIS = frozenset({"Softmax", "LogSoftmax", "LayerNormalization", "RMSNormalization"}) | REDUCTIONS
MAX_PATH = 8


def _perm(node: gs.Node, rank: int) -> list[int]:
    return [int(p) for p in (node.attrs.get("perm") or list(range(rank))[::-1])]


def _keeps_last(node: gs.Node, perm: list[int], opset: int) -> bool:
    rank = len(perm)
    if perm[-1] != rank - 1:
        return False
    if node.op in REDUCTIONS:
        axes = node.attrs.get("axes", input_value(node, 1))
        keepdims = node.attrs.get("keepdims", 1) == 1
        return axes is not None and keepdims and [normalize_axis(int(a), rank) for a in axes] == [rank - 1]
    default = -1 if node.op not in ("Softmax", "LogSoftmax") or opset >= 13 else 1
    return normalize_axis(int(node.attrs.get("axis", default)), rank) == rank - 1


def _passable(node: gs.Node, t: gs.Tensor, perm: list[int], opset: int) -> bool:
    """``node`` commutes with Transpose(perm) on its input ``t``."""
    if node.op in LAST_AXIS:
        return node.inputs[0] is t and _keeps_last(node, perm, opset) and len([o for o in node.outputs if o.name]) == 1
    if node.op not in ELEMENTWISE or len(node.outputs) != 1:
        return False
    rank = len(perm)
    for other in node.inputs:
        if other is t or not other.name:
            continue
        if is_constant(other):
            if np.ndim(constant_value(other)) > rank:
                return False
        elif not (other.inputs and other.inputs[0].op == "Transpose" and _perm(other.inputs[0], rank) == perm):
            return False
    return True


def _path(graph: gs.Graph, tnode: gs.Node, opset: int) -> tuple[list[gs.Node], gs.Node] | None:
    """Elementwise/last-axis nodes after ``tnode`` and the node ending the path."""
    perm = _perm(tnode, len(tnode.outputs[0].shape or []))
    t, path = tnode.outputs[0], []
    while len(path) < MAX_PATH:
        nxt = single_consumer(t, graph)
        if nxt is None or not _passable(nxt, t, perm, opset):
            return (path, nxt) if path else None
        path.append(nxt)
        t = nxt.outputs[0]
    return None


def _worth_it(path: list[gs.Node], end: gs.Node | None) -> bool:
    merges = end is not None and end.op == "Transpose" and end.inputs[0] is path[-1].outputs[0]
    twins = any(sum(1 for i in n.inputs if i.inputs and i.inputs[0].op == "Transpose") > 1 for n in path)
    return merges or twins


def _permuted_constant(ir: IRModel, ctx: PassContext, tensor: gs.Tensor, perm: list[int]) -> gs.Tensor:
    value = constant_value(tensor)
    if value.ndim == 0:
        return tensor
    full = value.reshape((1,) * (len(perm) - value.ndim) + value.shape)
    return make_constant(ir, ctx, f"{tensor.name}_perm", full.transpose(np.argsort(perm)))


def _sink(ir: IRModel, ctx: PassContext, tnode: gs.Node, path: list[gs.Node], end: gs.Node | None) -> None:
    rank = len(tnode.outputs[0].shape)
    perm = _perm(tnode, rank)
    for node in path:
        for i, inp in enumerate(node.inputs):
            if inp.inputs and inp.inputs[0].op == "Transpose" and _perm(inp.inputs[0], rank) == perm:
                node.inputs[i] = inp.inputs[0].inputs[0]
            elif inp.name and is_constant(inp):
                node.inputs[i] = _permuted_constant(ir, ctx, inp, perm)
        for out in node.outputs:
            out.shape = None
    last = path[-1].outputs[0]
    if end is not None and end.op == "Transpose" and end.inputs[0] is last:
        merged = [perm[i] for i in _perm(end, rank)]
        if merged == list(range(rank)):
            replace_all_uses(ir.graph, end.outputs[0], last, via_identity=True)
            end.inputs.clear()
            end.outputs.clear()
        else:
            end.attrs["perm"] = merged
        return
    moved = gs.Variable(ctx.unique_name(ir, f"{last.name}_pre"), dtype=last.dtype)
    swap(path[-1].outputs, last, moved)
    ir.graph.nodes.append(gs.Node("Transpose", name=ctx.unique_name(ir, "sunk_transpose"),
                                  attrs={"perm": perm}, inputs=[moved], outputs=[last]))


def rewrite_sink(ir: IRModel, ctx: PassContext, stats: dict, notes: list) -> int:
    done, touched = 0, set()
    for tnode in [n for n in ir.graph.nodes if n.op == "Transpose"]:
        if not tnode.outputs or tnode.outputs[0].shape is None or not tnode.inputs or id(tnode) in touched:
            continue
        found = _path(ir.graph, tnode, ir.opset)
        if found is None or not _worth_it(*found) or any(id(n) in touched for n in found[0]):
            continue
        touched.update(id(n) for n in found[0] + [tnode, found[1]])
        _sink(ir, ctx, tnode, *found)  # shapes along the path are None until the next refresh
        stats["sink_transposes"] = stats.get("sink_transposes", 0) + 1
        done += 1
    return done


def rewrite_norm_axis(ir: IRModel, ctx: PassContext, stats: dict, notes: list) -> int:
    done = 0
    for node in [n for n in ir.graph.nodes if n.op in ("Softmax", "LogSoftmax") and ir.opset >= 13]:
        x = node.inputs[0]
        rank = len(x.shape or [])
        axis = normalize_axis(int(node.attrs.get("axis", -1)), rank) if rank else None
        if axis is None or axis == rank - 1:
            continue
        tnode = x.inputs[0] if x.inputs else None
        if tnode is None or tnode.op != "Transpose" or single_consumer(x, ir.graph) is not node:
            if ctx.verbose:
                notes.append(f"norm_axis: {node.name} normalizes axis {axis} of {rank}, not from a Transpose: kept")
            continue
        perm = _perm(tnode, rank)
        if perm[axis] != rank - 1:
            continue
        out = node.outputs[0]
        moved = gs.Variable(ctx.unique_name(ir, f"{out.name}_contig"), dtype=out.dtype)
        node.inputs[0] = tnode.inputs[0]
        node.attrs["axis"] = -1
        swap(node.outputs, out, moved)
        ir.graph.nodes.append(gs.Node("Transpose", name=ctx.unique_name(ir, f"{node.name}_transpose"),
                                      attrs={"perm": perm}, inputs=[moved], outputs=[out]))
        stats["norm_axis"] = stats.get("norm_axis", 0) + 1
        done += 1
    return done
