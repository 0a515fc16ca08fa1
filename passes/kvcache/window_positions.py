"""window-positions: a sliding-window mask folded in cache-slot order -> computed from the positions.

Matches: after ``fix-shapes`` and ``simplify`` on a static-cache graph (P cache slots, then M new
tokens), a constant mask ``[1, .., M, N]`` (N = P + M) that is exactly a sliding window of W < N in
slot order: query j sees slot i iff ``P + j - W < i <= P + j``.  The export computed it from
``cache_position`` and ``arange(kv_len)``, which ``simplify`` folded for the traced layout where the
cache is full.  Boolean masks (sdpa) and additive ones (0 / a large negative value, eager) match.

Produces: the same mask from the ``position_ids`` input: the key positions are ``arange(P)`` for the
cache slots (slot i holds the token at position i) followed by the new tokens' positions, and query
j sees key i iff ``0 <= pos_q[j] - pos_k[i] < W``.

Why: a static runner fills only the first ``valid`` slots and puts the new tokens at slots P..P+M-1,
so slot order is not position order.  A causal mask in slot order still hides exactly the right
keys (padding slots are hidden by ``attention_mask``), but a window in slot order hides every
cached token once P - valid >= W: the pair would attend to the new tokens only.  With a full cache
(valid = P) both forms are the same tensor; otherwise the new one is what the model computes at
those positions (checked against transformers through the matrix of ``tools/decoder_matrix.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import Pass, PassContext, PassResult, changes_interface, register_pass
from qnnpasses.passmanager.rewrite import constant_value, emit, emit_reshape, finish, make_constant, replace_all_uses

#: an additive mask's hidden entries are at or below this (finfo.min, -inf, -1e9, -1e4)
HIDDEN_AT_MOST = -1e4


def slot_window(visible: np.ndarray, past: int) -> int | None:
    """W when ``visible`` ``[M, N]`` is a sliding window of W < N in slot order, else None."""
    tokens, total = visible.shape
    widths = visible.sum(axis=1)
    if tokens == 0 or total != past + tokens or widths.max() >= total or widths.min() < 1:
        return None
    window = int(visible[-1].sum())
    query = past + np.arange(tokens)[:, None]
    key = np.arange(total)[None, :]
    expected = (key <= query) & (key > query - window)
    return window if np.array_equal(visible, expected) else None


def _visible(value: np.ndarray) -> np.ndarray | None:
    """The visible entries of a boolean or additive mask constant (None: not such a mask)."""
    if value.dtype == np.bool_:
        return value
    if value.dtype.kind != "f":
        return None
    hidden = value <= HIDDEN_AT_MOST
    return (value == 0) if np.all(hidden | (value == 0)) else None


def _softmaxes_after(tensor: gs.Tensor, limit: int = 12) -> list[gs.Node]:
    """The Softmax nodes a mask reaches through the ops between it and the scores."""
    found, seen, frontier = [], set(), [tensor]
    for _ in range(limit):
        following = []
        for current in frontier:
            for node in current.outputs:
                if id(node) in seen:
                    continue
                seen.add(id(node))
                if node.op == "Softmax":
                    found.append(node)
                elif node.op != "MatMul":
                    following.extend(node.outputs)
        frontier = following
    return found


@register_pass
class WindowPositions(Pass):
    name = "window-positions"
    summary = "sliding-window mask folded in cache-slot order -> computed from position_ids"
    lossless = False  # equal only while the cache is full; the point is the case where it is not
    contract = changes_interface("a sliding-window mask follows the token positions, not the cache slots")

    @dataclass
    class Options:
        positions: str = "position_ids"

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        graph = ir.graph
        positions = next((t for t in graph.inputs if t.name == self.options.positions), None)
        if positions is None or positions.shape is None or len(positions.shape) != 2 \
                or not isinstance(positions.shape[1], (int, np.integer)):
            return PassResult(changed=False, notes=[f"no static [1, M] input '{self.options.positions}'"])
        tokens = int(positions.shape[1])
        made: dict[tuple[int, int], gs.Tensor] = {}
        windows = []
        layer_of = {id(n): i for i, n in enumerate(n for n in graph.nodes if n.op == "Softmax")}
        local: dict[int, int] = {}
        for tensor in list(graph.tensors().values()):
            if not isinstance(tensor, gs.Constant) or not tensor.outputs or len(tensor.shape) < 2:
                continue
            shape = tuple(int(d) for d in tensor.shape)
            if shape[-2] != tokens or any(d != 1 for d in shape[:-2]) or shape[-1] <= tokens:
                continue
            softmaxes = _softmaxes_after(tensor)
            if not softmaxes:  # not a mask (a weight reaches a MatMul first): its values stay unread
                continue
            value = constant_value(tensor)
            visible = _visible(value.reshape(shape[-2:]))
            window = None if visible is None else slot_window(visible, shape[-1] - tokens)
            if window is None:
                continue
            key = (shape[-1], window)
            if key not in made:
                made[key] = self._window_mask(ir, ctx, positions, shape[-1] - tokens, window)
            mask = emit_reshape(ir, ctx, made[key], shape, "window_mask")
            if value.dtype != np.bool_:
                hidden = make_constant(ir, ctx, "window_hidden", np.asarray(value.min(), value.dtype))
                zero = make_constant(ir, ctx, "window_zero", np.asarray(0, value.dtype))
                mask = emit(ir, ctx, "Where", [mask, zero, hidden], hint="window_additive", dtype=value.dtype,
                            shape=shape)
            local.update(dict.fromkeys((layer_of[id(n)] for n in softmaxes), window))
            replace_all_uses(graph, tensor, mask)
            windows.append(window)
        if not windows:
            return PassResult(changed=False, notes=["no sliding-window mask in cache-slot order"])
        finish(ir)
        return PassResult(changed=True, notes=[f"{len(windows)} window mask(s), window {sorted(set(windows))}"],
                          stats={"masks": len(windows), "local_layers": {str(k): v for k, v in sorted(local.items())}})

    def _window_mask(self, ir: IRModel, ctx: PassContext, positions: gs.Tensor, past: int, window: int) -> gs.Tensor:
        """``[M, P + M]`` bool: query j sees key i iff 0 <= pos_q[j] - pos_k[i] < window."""
        dtype = np.dtype(positions.dtype)
        tokens = int(positions.shape[1])
        query = emit_reshape(ir, ctx, positions, [tokens, 1], "window_query_pos")
        new = emit_reshape(ir, ctx, positions, [tokens], "window_new_pos")
        cached = make_constant(ir, ctx, "window_cached_pos", np.arange(past, dtype=dtype))
        keys = emit(ir, ctx, "Concat", [cached, new], hint="window_key_pos", dtype=dtype, shape=[past + tokens],
                    attrs={"axis": 0})
        distance = emit(ir, ctx, "Sub", [query, keys], hint="window_distance", dtype=dtype, shape=[tokens, past + tokens])
        zero = make_constant(ir, ctx, "window_zero_pos", np.asarray(0, dtype))
        width = make_constant(ir, ctx, "window_width", np.asarray(window, dtype))
        after = emit(ir, ctx, "GreaterOrEqual", [distance, zero], hint="window_causal", dtype=np.bool_,
                     shape=[tokens, past + tokens])
        inside = emit(ir, ctx, "Less", [distance, width], hint="window_inside", dtype=np.bool_,
                      shape=[tokens, past + tokens])
        return emit(ir, ctx, "And", [after, inside], hint="window_visible", dtype=np.bool_, shape=[tokens, past + tokens])
