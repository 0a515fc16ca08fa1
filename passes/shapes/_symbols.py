"""Binding symbolic dimensions to integers, consistently across all graph inputs and outputs.

Exporters name dynamic dims freely: ``batch_size``, ``sequence_length``, ``s0``, and also
arithmetic on them: TorchScript/Optimum KV exports use ``past_sequence_length + 1``, dynamo
uses ``past + 1``.  A symbol shared by several inputs must get one value everywhere, and an
expression must be evaluated from its symbols (``--shape past_key_values.0.key=1,2,8,16``
makes ``past_sequence_length + 1`` 9).  Symbols nobody bound fall back to
:func:`qnnpasses.ir.shapes.resolve_dim`, the rule the verification inputs use too.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, field

import onnx_graphsurgeon as gs

from qnnpasses.ir.shapes import (
    DEFAULT_BATCH,
    DEFAULT_PAST,
    DEFAULT_SEQUENCE,
    PAST_SYMBOL,
    is_static,
    resolve_dim,
)

#: Dim names that mean "unknown", not a symbol shared with other tensors (paddle2onnx writes "?"
#: for every dim it cannot name: binding it would give one value to unrelated dims).
ANONYMOUS_DIMS = frozenset({"?", "-1"})

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


class ShapeBindingError(ValueError):
    """A requested shape contradicts the model or another requested shape."""


@dataclass
class SymbolTable:
    """Values of symbolic dims: explicit bindings first, then the defaults of ``resolve_dim``."""

    batch: int = DEFAULT_BATCH
    sequence: int = DEFAULT_SEQUENCE
    past: int = DEFAULT_PAST
    values: dict[str, int] = field(default_factory=dict)

    def bind(self, symbol: str, value: int, where: str) -> None:
        old = self.values.get(symbol)
        if old is not None and old != value:
            raise ShapeBindingError(f"dimension '{symbol}' is {old} elsewhere but {value} in {where}")
        self.values[symbol] = value

    def value(self, dim, input_name: str = "", index: int = 0) -> int:
        """The value of one dim: static, bound, an expression of symbols, or the default rule."""
        if is_static(dim):
            return int(dim)
        name = str(dim or "").strip()
        if name in ANONYMOUS_DIMS:
            return resolve_dim(None, input_name, index, batch=self.batch, sequence=self.sequence, past=self.past)
        if name in self.values:
            return self.values[name]
        evaluated = self._evaluate(name) if name else None
        if evaluated is None:
            evaluated = resolve_dim(dim, input_name, index, batch=self.batch, sequence=self.sequence, past=self.past)
        if name:
            self.values[name] = evaluated
        return evaluated

    def known(self, dim) -> int | None:
        """The value of ``dim`` if it is static, bound, or an expression of bound symbols; else None."""
        if is_static(dim):
            return int(dim)
        name = str(dim or "").strip()
        if not name or name in ANONYMOUS_DIMS:
            return None
        return self.values[name] if name in self.values else self._evaluate(name, defaults=False)

    def _evaluate(self, text: str, defaults: bool = True) -> int | None:
        """``text`` as integer arithmetic of symbols (``past_sequence_length + 1``), or None."""
        try:
            tree = ast.parse(text, mode="eval").body
        except SyntaxError:
            return None
        if isinstance(tree, ast.Name):
            return None  # a plain symbol: not an expression
        try:
            return self._eval_node(tree, defaults)
        except (KeyError, TypeError, ZeroDivisionError):
            return None

    def _eval_node(self, node: ast.AST, defaults: bool) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in self.values:
                return self.values[node.id]
            if not defaults:
                raise KeyError(node.id)
            return self.value(node.id)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](self._eval_node(node.left, defaults), self._eval_node(node.right, defaults))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -self._eval_node(node.operand, defaults)
        raise TypeError(f"unsupported dimension expression {ast.dump(node)}")


def bind_requested(table: SymbolTable, inputs: dict[str, gs.Variable], requested: dict[str, list[int]]) -> None:
    """Bind the symbols of inputs whose shapes were given, checking rank and static dims."""
    unknown = sorted(set(requested) - set(inputs))
    if unknown:
        raise ShapeBindingError(f"shapes given for unknown inputs {unknown} (inputs: {sorted(inputs)})")
    for name, dims in requested.items():
        declared = inputs[name].shape
        if declared is None:
            continue
        if len(declared) != len(dims):
            raise ShapeBindingError(f"input '{name}' has rank {len(declared)}, the requested shape {dims} has {len(dims)}")
        for index, (have, want) in enumerate(zip(declared, dims)):
            if is_static(have) and have != want:
                raise ShapeBindingError(f"input '{name}' dim {index} is {have}, the requested shape says {want}")
            if not is_static(have) and have and str(have).strip() not in ANONYMOUS_DIMS:
                table.bind(str(have).strip(), int(want), f"input '{name}'")


def resolve_inputs(table: SymbolTable, inputs: dict[str, gs.Variable], requested: dict[str, list[int]]) -> dict[str, list[int]]:
    """A static shape for every input with a known rank (requested shapes win)."""
    bind_requested(table, inputs, requested)
    shapes = {}
    # plain symbols first, so that expressions on other inputs see their bound values
    ordered = sorted(inputs.items(), key=lambda item: any(_is_expression(d) for d in item[1].shape or []))
    for name, tensor in ordered:
        if name in requested:
            shapes[name] = [int(d) for d in requested[name]]
        elif tensor.shape is not None:
            shapes[name] = [table.value(d, name, i) for i, d in enumerate(tensor.shape)]
    return shapes


_PAST_PLUS_STEP = re.compile(r"^\s*(\w+)\s*\+\s*(\d+)\s*$")


def decode_step(inputs: dict[str, gs.Variable]) -> int | None:
    """The new-token count a KV-cache export bakes in, from a dim like ``past_sequence_length + 1``.

    Such exports (TorchScript/Optimum ``past_sequence_length + 1``, dynamo ``past + 1``)
    size the attention mask as past plus the tokens of this step, so the sequence
    symbol must equal that constant for the shapes to agree.
    """
    for tensor in inputs.values():
        for dim in tensor.shape or []:
            match = _PAST_PLUS_STEP.match(dim) if isinstance(dim, str) else None
            if match and PAST_SYMBOL.search(match.group(1)):
                return int(match.group(2))
    return None


def _is_expression(dim) -> bool:
    return isinstance(dim, str) and not dim.strip().isidentifier()
