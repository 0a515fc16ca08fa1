"""The graph inputs Genie's HTP engine fills: token ids in int32, the rotary cos/sin and the whole mask.

Genie's ``QnnHtp`` engine finds a graph's tensors by name and fills them itself (measured here by
running ``libGenie.so`` on the simulated HTP with its tensor dumps on):

* ``input_ids`` ``[1, S]`` int32 (it refuses 64-bit activations);
* ``position_ids_cos`` / ``position_ids_sin`` ``[1, S, h]``: ``cos`` / ``sin`` of
  ``p * theta ** (-i / h)`` for ``i < h``, computed in double precision from ``rope-theta`` in its
  configuration (``rope-dim`` = h, half the rotary width); a padding position gets position 0;
* ``attention_mask`` ``[1, S, N]`` float: the additive mask itself, 0 where a query sees a key and
  a large negative value where it does not (-1000 in a float32 tensor).  The first N - S columns
  are the cache slots (its cache is left-aligned: slot i holds position i), the last S the new
  tokens, causal among the real ones.

What changes, per graph (after :mod:`qnnpasses.llm.cache_dtype` and :mod:`qnnpasses.llm.io_names`):

* :func:`ids_int32`: the token-id input becomes int32 (its Cast to int32, if any, is dropped);
* :func:`rotary_inputs`: each ``Gather(table, positions)`` that ``rotary-table`` left becomes
  ``Concat(x, x)`` of a new input ``x`` (the table's first half); the positions input goes;
* :func:`full_mask_input`: each tensor computed from the 2-D ``attention_mask`` that the scores read
  (the bias: one for all layers, or one per layer) becomes ``Where(mask > -0.5, 0, masked)`` of the
  new 3-D mask input.

Why it is safe, checked before anything changes (a graph that fails a check is refused):

* the cos and sin tables hold the same values in both halves (the rotate-half layout HF exports
  use), and every row is Genie's formula for one ``theta`` (derived from the table) to float32
  rounding of the angle: what Genie feeds is what the table would have given;
* evaluated on onnxruntime's CPU for several 2-D masks, each bias is exactly 0 where the mask and
  causality let a query see a key and one large negative constant elsewhere: the 3-D mask given
  by Genie then describes the same attention, column for column.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from qnnpasses.errors import BadInputError
from qnnpasses.ir.evaluate import subgraph_session
from qnnpasses.ir.graph_ops import toposort
from qnnpasses.ir.model import IRModel
from qnnpasses.ir.read import constant_value, producer, static_shape
from qnnpasses.passmanager.api import PassContext
from qnnpasses.passmanager.rewrite import emit, emit_reshape, finish, make_constant, swap

COS, SIN = "position_ids_cos", "position_ids_sin"
#: what Genie writes into a float32 ``attention_mask`` for a key a query must not see
MASKED = -1000.0
#: the additive mask's visible value is 0; anything below this is masked
VISIBLE_ABOVE = -0.5


class GenieFormError(BadInputError):
    """The graph cannot take Genie's inputs; one line for the user."""


@dataclass
class Rope:
    """The rotary encoding Genie computes: ``theta`` and ``dim`` (= h, frequencies per position)."""

    theta: float
    dim: int

    def tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin ``[len(positions), dim]`` as Genie computes them (double, then float32)."""
        inv = self.theta ** (-np.arange(self.dim, dtype=np.float64) / self.dim)
        angles = np.outer(np.asarray(positions, np.float64), inv)
        return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _inputs(ir: IRModel) -> dict[str, gs.Variable]:
    return {t.name: t for t in ir.graph.inputs}


def _drop_input(ir: IRModel, name: str) -> None:
    """Remove graph input ``name`` once nothing reads it."""
    tensor = _inputs(ir).get(name)
    if tensor is not None and tensor.outputs:
        raise GenieFormError(f"the graph still reads {name} after the rewrite: "
                             f"{', '.join(n.op for n in tensor.outputs)} (Genie does not give it)")
    ir.graph.inputs = [t for t in ir.graph.inputs if t.name != name]


def ids_int32(ir: IRModel, name: str) -> None:
    """Make token-id input ``name`` int32 (module docstring)."""
    ids = _inputs(ir)[name]
    if np.dtype(ids.dtype) == np.int32:
        return
    ctx = PassContext()
    readers = list(ids.outputs)
    wide = None
    for reader in readers:
        if reader.op == "Cast" and reader.attrs.get("to") == onnx.TensorProto.INT32:
            out = reader.outputs[0]
            for consumer in list(out.outputs):
                swap(consumer.inputs, out, ids)
            reader.inputs.clear()
            reader.outputs.clear()
            continue
        if wide is None:
            wide = emit(ir, ctx, "Cast", [ids], hint=f"{name}.widen", dtype=ids.dtype, shape=ids.shape,
                        attrs={"to": onnx.helper.np_dtype_to_tensor_dtype(np.dtype(ids.dtype))})
        swap(reader.inputs, ids, wide)
    ids.dtype = np.int32
    finish(ir)


def _rotary_gathers(ir: IRModel, positions: gs.Variable) -> list[tuple[gs.Node, np.ndarray]]:
    """The ``Gather(table, positions)`` nodes (positions possibly through a Cast) with their tables."""
    found = []
    for node in ir.graph.nodes:
        if node.op != "Gather" or len(node.inputs) != 2 or int(node.attrs.get("axis", 0)) != 0:
            continue
        index = node.inputs[1]
        source = producer(index)
        if index is not positions and not (source is not None and source.op == "Cast" and source.inputs[0] is positions):
            continue
        table = constant_value(node.inputs[0])
        if table is not None and table.ndim == 2:
            found.append((node, table))
    return found


def derive_rope(cos: np.ndarray, sin: np.ndarray) -> Rope:
    """The ``theta`` whose Genie tables match ``cos``/``sin`` (``[positions, 2h]``), or GenieFormError."""
    width = cos.shape[1]
    if width % 2 or cos.shape != sin.shape:
        raise GenieFormError(f"rotary tables of shape {list(cos.shape)} / {list(sin.shape)}: not cos/sin pairs")
    h = width // 2
    if not (np.array_equal(cos[:, :h], cos[:, h:]) and np.array_equal(sin[:, :h], sin[:, h:])):
        raise GenieFormError("the rotary tables are not in the rotate-half layout (both halves equal): "
                             "Genie gives one half of the cos/sin")
    if cos.shape[0] < 2 or h < 2:
        raise GenieFormError("the rotary tables are too small to read their frequencies from")
    # position 1's angles are the inverse frequencies theta ** (-i / h): fit log(theta) over all of them
    inverse = np.arctan2(sin[1, :h].astype(np.float64), cos[1, :h].astype(np.float64))
    if not np.all(inverse[1:] > 0):
        raise GenieFormError("cannot read the rotary base from the tables")
    i = np.arange(1, h, dtype=np.float64)
    fitted = float(np.exp(-h * np.sum(i * np.log(inverse[1:])) / np.sum(i * i)))
    rope = _matching(cos[:, :h], sin[:, :h], [Rope(float(round(fitted)), h), Rope(fitted, h)])
    if rope is None:
        worst = _distance(cos[:, :h], sin[:, :h], Rope(fitted, h))
        raise GenieFormError(f"the rotary frequencies are not theta ** (-i / {h}) for one theta (off by up to "
                             f"{worst:.2g}; rope scaling is not expressed in the Genie bundle yet)")
    return rope


def _distance(cos: np.ndarray, sin: np.ndarray, rope: Rope) -> float:
    expect_cos, expect_sin = rope.tables(np.arange(cos.shape[0]))
    return float(max(np.abs(expect_cos - cos).max(), np.abs(expect_sin - sin).max()))


def _matching(cos: np.ndarray, sin: np.ndarray, candidates: list[Rope]) -> Rope | None:
    """The first candidate whose tables equal ``cos``/``sin`` to float32 rounding of the export's angle
    ``p * inv_freq`` (half an ulp of p, and of inv_freq, at position p)."""
    bound = 1e-6 + 2.5e-7 * np.arange(cos.shape[0], dtype=np.float64)[:, None]
    for rope in candidates:
        expect_cos, expect_sin = rope.tables(np.arange(cos.shape[0]))
        if np.all(np.abs(expect_cos - cos) <= bound) and np.all(np.abs(expect_sin - sin) <= bound):
            return rope
    return None


def rotary_inputs(ir: IRModel, positions: str) -> Rope:
    """Give the rotary cos/sin as inputs ``position_ids_cos``/``_sin`` ``[1, S, h]`` (module docstring)."""
    inputs = _inputs(ir)
    if positions not in inputs:
        raise GenieFormError(f"no positions input {positions!r}")
    pos = inputs[positions]
    gathers = _rotary_gathers(ir, pos)
    ones = [(n, t) for n, t in gathers if np.array_equal(t[0], np.ones_like(t[0]))]
    zeros = [(n, t) for n, t in gathers if not np.any(t[0])]
    if len(ones) != 1 or len(zeros) != 1 or len(gathers) != 2:
        raise GenieFormError(f"expected one rotary cos and one sin table read at the positions, found {len(gathers)} "
                             "tables (several rotary bases, or positions used otherwise, are not expressed in Genie)")
    (cos_node, cos), (sin_node, sin) = ones[0], zeros[0]
    rope = derive_rope(cos, sin)
    tokens = static_shape(pos)
    if tokens is None or len(tokens) != 2:
        raise GenieFormError(f"the positions input has no static [1, S] shape: {pos.shape}")
    dtype = cos.dtype
    for node, name in ((cos_node, COS), (sin_node, SIN)):
        half = gs.Variable(name, dtype=dtype, shape=[*tokens, rope.dim])
        node.op, node.attrs = "Concat", {"axis": -1}
        node.inputs.clear()
        node.inputs.extend([half, half])
        ir.graph.inputs.append(half)
    finish(ir)
    _drop_input(ir, positions)
    return rope


def _mask_region(ir: IRModel, mask: gs.Variable) -> tuple[list[gs.Node], list[gs.Tensor]]:
    """The nodes computed from ``mask`` and constants only, and the tensors of theirs that other
    nodes (or the graph's outputs) read."""
    toposort(ir.graph)
    region = {id(mask)}
    nodes = []
    for node in ir.graph.nodes:
        tensors = [t for t in node.inputs if t is not None and t.name]
        if any(id(t) in region for t in tensors) and all(id(t) in region or isinstance(t, gs.Constant) for t in tensors):
            nodes.append(node)
            region.update(id(o) for o in node.outputs)
    inside = {id(n) for n in nodes}
    outputs = {id(t) for t in ir.graph.outputs}
    frontier = [o for n in nodes for o in n.outputs
                if id(o) in outputs or any(id(c) not in inside for c in o.outputs)]
    if any(id(c) not in inside for c in mask.outputs) or id(mask) in outputs:
        frontier.insert(0, mask)
    return nodes, frontier


def _visible(mask: np.ndarray, tokens: int) -> np.ndarray:
    """``[tokens, N]``: which key a query sees, for a 2-D 0/1 ``mask`` ``[1, N]`` of past slots then the
    new tokens (the past as the mask says, the new tokens causally)."""
    n = mask.shape[-1]
    past = n - tokens
    rows = np.arange(tokens)[:, None]
    cols = np.arange(n)[None, :]
    return (mask.reshape(1, n) != 0) & ((cols < past) | (cols - past <= rows))


def full_mask_input(ir: IRModel, name: str, tokens: int) -> list[float]:
    """Take the whole additive mask as input ``name`` ``[1, tokens, N]`` float32 instead of the 2-D
    0/1 ``name`` (module docstring); the masked values the graph adds, which it keeps.

    An export may build the bias once for every layer or once per layer: each tensor the scores
    read is checked, and all are computed from the one new input."""
    mask = _inputs(ir).get(name)
    shape = static_shape(mask) if mask is not None else None
    if shape is None or len(shape) != 2:
        raise GenieFormError(f"no static 2-D attention mask input {name!r}")
    n = shape[1]
    nodes, frontier = _mask_region(ir, mask)
    if not frontier or frontier[0] is mask:
        raise GenieFormError(f"the graph reads the attention mask {name!r} itself, not only through an additive bias")
    for bias in frontier:
        bias_shape = static_shape(bias)
        if bias_shape is None or len(bias_shape) < 2 or tuple(bias_shape[-2:]) != (tokens, n) \
                or int(np.prod(bias_shape)) != tokens * n:
            raise GenieFormError(f"the mask added to the scores has shape {bias.shape}, not one [{tokens}, {n}] row "
                                 "per query")
    masked = _masked_values(ir, nodes, mask, frontier, tokens)
    ctx = PassContext()
    mask.name = ctx.unique_name(ir, f"{name}.2d")
    given = gs.Variable(name, dtype=np.float32, shape=[1, tokens, n])
    ir.graph.inputs = [given if t is mask else t for t in ir.graph.inputs]  # in the old one's place
    threshold = make_constant(ir, ctx, f"{name}.visible_above", np.asarray(VISIBLE_ABOVE, np.float32))
    visible = emit(ir, ctx, "Greater", [given, threshold], hint=f"{name}.visible", dtype=np.bool_, shape=[1, tokens, n])
    made: dict[tuple, gs.Tensor] = {}
    inside = {id(x) for x in nodes}
    for bias, value in zip(frontier, masked):
        bias_dtype, bias_shape = np.dtype(bias.dtype), list(static_shape(bias))
        key = (bias_dtype.str, value, tuple(bias_shape))
        if key not in made:
            zero = make_constant(ir, ctx, f"{name}.zero", np.asarray(0, bias_dtype))
            hidden = make_constant(ir, ctx, f"{name}.masked", np.asarray(value, bias_dtype))
            where = emit(ir, ctx, "Where", [visible, zero, hidden], hint=f"{name}.bias", dtype=bias_dtype,
                         shape=[1, tokens, n])
            made[key] = emit_reshape(ir, ctx, where, bias_shape, hint=f"{name}.bias_shape")
        for consumer in [c for c in bias.outputs if id(c) not in inside]:
            swap(consumer.inputs, bias, made[key])
        ir.graph.outputs = [made[key] if t is bias else t for t in ir.graph.outputs]
    finish(ir)
    return sorted(set(masked))


def _masked_values(ir: IRModel, nodes: list[gs.Node], mask: gs.Variable, biases: list[gs.Tensor],
                   tokens: int) -> list[float]:
    """Evaluate each bias on onnxruntime's CPU for several 2-D masks: each must be 0 where the mask
    and causality let a query see a key and one large negative constant elsewhere; those constants."""
    n = int(static_shape(mask)[1])
    session = subgraph_session(ir.graph, nodes, [mask], biases, "attention_bias")
    dtype = np.dtype(mask.dtype)
    rng = np.random.default_rng(0)
    cases = [np.ones((1, n)), (rng.random((1, n)) < 0.6), np.eye(1, n, n - 1)]
    masked: list[float | None] = [None] * len(biases)
    for case in cases:
        visible = _visible(case, tokens)
        for k, got in enumerate(session.run(None, {mask.name: case.astype(dtype)})):
            got = got.reshape(tokens, n)
            if np.any(got[visible] != 0):
                raise GenieFormError("the attention bias is not 0 where the mask lets a query see a key")
            hidden = got[~visible]
            if hidden.size:
                value = float(hidden.flat[0])
                if np.any(hidden != value) or value > 2 * MASKED or masked[k] not in (None, value):
                    raise GenieFormError("the attention bias does not add one large negative constant where the "
                                         "mask hides a key")
                masked[k] = value
    if any(v is None for v in masked):
        raise GenieFormError("cannot read the masked value of the attention bias")
    return [float(v) for v in masked]
