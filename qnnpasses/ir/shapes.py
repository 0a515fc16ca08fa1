"""Symbolic dimensions: finding them and choosing concrete values for them.

Exporters name dynamic dimensions freely (``batch_size``, ``sequence_length``,
``past_sequence_length + 1``, ``s0``...).  :func:`resolve_dim` gives the value used when
nobody said otherwise; fix-shapes and the verification inputs share it so that a
model verified before fix-shapes runs with the same shapes after it.
"""

from __future__ import annotations

import re

import onnx_graphsurgeon as gs

DEFAULT_BATCH = 1
DEFAULT_SEQUENCE = 16
DEFAULT_PAST = 16

_BATCH = re.compile(r"batch|^n$|^b$|^N$", re.IGNORECASE)
PAST_SYMBOL = re.compile(r"past|cache", re.IGNORECASE)


def is_static(dim) -> bool:
    return isinstance(dim, int) and dim >= 0


def resolve_dim(dim, input_name: str = "", index: int = 0, *, batch: int = DEFAULT_BATCH,
                sequence: int = DEFAULT_SEQUENCE, past: int = DEFAULT_PAST) -> int:
    """A concrete value for ``dim``: itself when static, else by its name and position."""
    if is_static(dim):
        return int(dim)
    name = str(dim or "").strip()
    if "+" in name:  # 'past_sequence_length + 1', 'past + sequence': the sum of its terms
        return sum(resolve_dim(term.strip(), input_name, index, batch=batch, sequence=sequence, past=past)
                   for term in name.split("+"))
    if name.isdigit():
        return int(name)
    if PAST_SYMBOL.search(name):
        return past
    if _BATCH.search(name) or (not name and index == 0):
        return batch
    return sequence


def symbolic_dims(graph: gs.Graph) -> dict[str, list[str]]:
    """Graph inputs and outputs with at least one non-static dimension, and those dims."""
    found = {}
    for tensor in list(graph.inputs) + list(graph.outputs):
        dims = [str(d) for d in (tensor.shape or []) if not is_static(d)]
        if tensor.shape is None or dims:
            found[tensor.name] = dims or ["<unknown rank>"]
    return found


def has_static_shapes(graph: gs.Graph) -> bool:
    return not any(
        tensor.shape is None or not all(is_static(d) for d in tensor.shape)
        for tensor in graph.inputs
        if isinstance(tensor, gs.Variable)
    )
