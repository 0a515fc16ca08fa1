"""Finding a pre-norm residual stream and the weights that read and write it.

A pre-norm decoder (LLaMA, Qwen2, Mistral, Phi-3, SmolLM2 after ``htp-llm``) keeps one
running sum ``h``: the token embedding, plus each block's ``o_proj``/``down_proj`` output
(Gemma 2/3: the embedding times ``sqrt(hidden)``, plus each block's post-norm of them).
Every block reads ``h`` only through an ``RMSNormalization`` whose output feeds projection
MatMuls; the final norm feeds the lm_head.  :func:`find_stream` walks it from the embedding
``Gather`` and returns every constant that touches it, or the reason the graph is not of this
shape (then nothing may be rotated).

Shapes the walk accepts: ``Reshape`` that keeps the hidden size as the last dimension
(``htp-llm`` works on ``[S, hidden]`` rows), residual ``Add``, ``RMSNormalization`` over the
last axis.  A writer is ``MatMul(x, W)`` with a constant ``W[..., hidden]`` (optionally
``+ bias`` and ``Reshape``), or an ``RMSNormalization`` with a constant scale (a post-norm),
whose result reaches the residual ``Add`` and nothing else.
A reader is ``MatMul(norm_out, W)`` with a constant ``W[..., hidden, N]``, 2-D or head-major
4-D (``layout{head_proj}``), optionally behind a last-dim-keeping ``Reshape``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.op_kinds import RESHAPES
from qnnpasses.passmanager.rewrite import constant_value, is_graph_output, producer

NORM_OPS = ("RMSNormalization",)
#: normalizations whose output does not change when their input and epsilon are rescaled together
SCALED_NORM_OPS = ("RMSNormalization", "LayerNormalization")


@dataclass
class Stream:
    hidden: int
    embeddings: list[gs.Node] = field(default_factory=list)  # Gather(table[V, hidden], ids)
    norms: list[gs.Node] = field(default_factory=list)  # RMSNormalization reading the stream
    readers: list[gs.Node] = field(default_factory=list)  # MatMul(norm_out, W[..., hidden, N])
    writers: list[gs.Node] = field(default_factory=list)  # MatMul(x, W[..., hidden]) into the stream
    biases: list[tuple[gs.Node, int]] = field(default_factory=list)  # Add(., const[..., hidden]) on the way
    norm_writers: list[gs.Node] = field(default_factory=list)  # a block's post-norm, added into the stream
    embedding_scales: list[tuple[gs.Node, int]] = field(default_factory=list)  # Mul(embedding, const scalar)
    tensors: list[str] = field(default_factory=list)  # every tensor of the stream


def _keeps_last(node: gs.Node, hidden: int) -> bool:
    """A Reshape (or Squeeze/Unsqueeze) whose input and output both end in ``hidden``."""
    if node.op not in ("Reshape", "Squeeze", "Unsqueeze"):
        return False
    src, dst = node.inputs[0].shape, node.outputs[0].shape
    return bool(src) and bool(dst) and src[-1] == hidden and dst[-1] == hidden


def _const_input(node: gs.Node, index: int) -> np.ndarray | None:
    return constant_value(node.inputs[index]) if index < len(node.inputs) else None


def norm_consumers(graph: gs.Graph, norm: gs.Node, hidden: int) -> tuple[list[gs.Node], str]:
    """The weighted MatMuls reading ``norm``'s output (through last-dim-keeping reshapes), or why not."""
    readers, todo = [], [norm.outputs[0]]
    outputs = {t.name for t in graph.outputs}
    while todo:
        t = todo.pop()
        if t.name in outputs:
            return [], f"{norm.name}: its output is a graph output"
        for node in t.outputs:
            if _keeps_last(node, hidden):
                todo.append(node.outputs[0])
                continue
            weight = _const_input(node, 1) if node.op == "MatMul" and node.inputs[0] is t else None
            if weight is None or weight.ndim < 2 or weight.shape[-2] != hidden:
                return [], f"{norm.name}: output read by {node.op} '{node.name}', not a projection MatMul"
            readers.append(node)
    return readers, ""


def trace_projection(graph: gs.Graph, t: gs.Tensor, hidden: int, norm_ops: tuple[str, ...] = ()
                     ) -> tuple[gs.Node | None, list[tuple[gs.Node, int]], str]:
    """The node that computes ``t`` for ``t`` alone: a projection ``MatMul(x, W[..., hidden])`` or, with
    ``norm_ops``, a normalization with a constant scale (Gemma's post-norms), through last-dim-keeping
    reshapes and constant bias ``Add``\\ s (no bias before a normalization).  Returns (node, the
    ``(Add, constant index)`` biases on the way, "") or (None, [], why not)."""
    biases = []
    while True:
        if len(t.outputs) != 1 or is_graph_output(graph, t):
            return None, [], f"'{t.name}' has other readers"
        node = producer(t)
        if node is None:
            return None, [], f"'{t.name}' is not computed by a projection"
        if _keeps_last(node, hidden):
            t = node.inputs[0]
            continue
        if node.op == "Add":
            consts = [i for i, x in enumerate(node.inputs) if constant_value(x) is not None]
            if len(consts) != 1:
                return None, [], f"'{node.name}' adds two activations"
            bias = constant_value(node.inputs[consts[0]])
            if bias.shape[-1:] != (hidden,):
                return None, [], f"'{node.name}' adds a constant of shape {list(bias.shape)}"
            biases.append((node, consts[0]))
            t = node.inputs[1 - consts[0]]
            continue
        scale = _const_input(node, 1) if node.op in norm_ops else None
        if not biases and scale is not None and scale.shape[-1:] == (hidden,) \
                and node.attrs.get("axis", -1) in (-1, len(node.outputs[0].shape or ()) - 1):
            return node, [], ""
        weight = _const_input(node, 1) if node.op == "MatMul" else None
        if weight is None or weight.shape[-1] != hidden:
            return None, [], f"'{t.name}' comes from {node.op} '{node.name}'"
        return node, biases, ""


def _writer(graph: gs.Graph, t: gs.Tensor, hidden: int, stream: Stream, norm_ops: tuple[str, ...]) -> str:
    """Record the writer of a tensor added into the stream (a projection, or a normalization of
    ``norm_ops`` with a constant scale); "" or why it is not one."""
    node, biases, why = trace_projection(graph, t, hidden, norm_ops)
    if node is None:
        return f"added into the residual stream: {why}"
    if node.op == "MatMul":
        stream.writers.append(node)
        stream.biases += biases
    else:
        stream.norm_writers.append(node)
    return ""


def find_stream(graph: gs.Graph, scaling: bool = False) -> tuple[Stream | None, str]:
    """The residual stream fed by the graph's token embedding, or (None, why it does not fit).

    The token embedding is the Gather from a constant 2-D table, indexed by a graph input, whose
    output the walk accepts as a residual stream (a static pair also gathers cos/sin rows by
    ``position_ids``).  Both walks accept a constant scalar ``Mul`` of the embedding before the
    first residual ``Add`` (Gemma's ``sqrt(hidden)``) and normalizations with a constant scale as
    writers (Gemma's post-norms: ``RMSNormalization``).  ``scaling``: the stream as a uniform
    rescaling sees it (``scale-residual``): ``LayerNormalization`` also counts as a reader or
    post-norm, and the walk does not look past the readers' norms."""
    inputs = {t.name for t in graph.inputs}
    gathers = [n for n in graph.nodes if n.op == "Gather" and isinstance(n.inputs[0], gs.Constant)
               and len(n.inputs[0].shape) == 2 and n.attrs.get("axis", 0) == 0
               and _from_input(n.inputs[1], inputs)]
    if not gathers:
        return None, "no token-embedding Gather (of a constant 2-D table, indexed by a graph input)"
    # other tables gathered by an input (a static pair's cos/sin rows, gathered by position_ids) feed
    # no residual stream: the embedding is the one table whose output the walk accepts
    found = [_walk(graph, embed, scaling) for embed in gathers]
    streams = [stream for stream, _ in found if stream is not None]
    if len(streams) == 1:
        return streams[0], ""
    if streams:
        return None, f"{len(streams)} tables gathered by graph inputs each feed a residual stream"
    return None, found[0][1] if len(found) == 1 else "; ".join(
        f"{embed.name}: {why}" for embed, (_, why) in zip(gathers, found))


def _walk(graph: gs.Graph, embed: gs.Node, scaling: bool = False) -> tuple[Stream | None, str]:
    """The residual stream fed by the Gather ``embed``, or (None, why it does not fit)."""
    hidden = int(embed.inputs[0].shape[1])
    stream = Stream(hidden, embeddings=[embed])
    outputs = {t.name for t in graph.outputs}
    seen, todo = set(), [embed.outputs[0]]
    while todo:
        t = todo.pop()
        if t.name in seen:
            continue
        seen.add(t.name)
        if t.name in outputs:
            return None, f"the residual stream '{t.name}' is a graph output"
        stream.tensors.append(t.name)
        for node in t.outputs:
            if _keeps_last(node, hidden):
                todo.append(node.outputs[0])
            elif node.op == "Mul" and not stream.writers and not stream.norm_writers \
                    and (index := _scalar_factor(node, t)) is not None:
                stream.embedding_scales.append((node, index))
                todo.append(node.outputs[0])
            elif node.op == "Add":
                other = node.inputs[1] if node.inputs[0] is t else node.inputs[0]
                if other.name not in seen and not _reaches_from(other, seen):
                    why = _writer(graph, other, hidden, stream, SCALED_NORM_OPS if scaling else NORM_OPS)
                    if why:
                        return None, why
                todo.append(node.outputs[0])
            elif node.op in (SCALED_NORM_OPS if scaling else NORM_OPS) and node.inputs[0] is t:
                axis = node.attrs.get("axis", -1)
                if axis not in (-1, len(t.shape or ()) - 1):
                    return None, f"{node.name} normalizes axis {axis}, not the hidden axis"
                if node not in stream.norms:
                    stream.norms.append(node)
            else:
                return None, f"the residual stream '{t.name}' is read by {node.op} '{node.name}'"
    for norm in stream.norms if not scaling else ():
        readers, why = norm_consumers(graph, norm, hidden)
        if why:
            return None, why
        stream.readers += readers
    if not stream.norms or not (stream.writers or stream.norm_writers):
        return None, "no normalization reads the stream or no projection writes it"
    return stream, ""


def _scalar_factor(node: gs.Node, t: gs.Tensor) -> int | None:
    """The input index of ``Mul(t, c)``'s constant one-element factor ``c``, if it has one."""
    for index, x in enumerate(node.inputs):
        value = constant_value(x) if x is not t else None
        if value is not None and value.size == 1 and len(node.inputs) == 2:
            return index
    return None


def _reaches_from(t: gs.Tensor, seen: set[str]) -> bool:
    """True when ``t`` is itself a stream tensor reached later (an Add of two stream tensors)."""
    node = producer(t)
    return node is not None and node.op == "Add" and any(i.name in seen for i in node.inputs)


def _from_input(t: gs.Tensor, inputs: set[str], depth: int = 4) -> bool:
    for _ in range(depth):
        if t.name in inputs:
            return True
        node = producer(t)
        if node is None or node.op not in RESHAPES | {"Cast"}:
            return False
        t = node.inputs[0]
    return False
