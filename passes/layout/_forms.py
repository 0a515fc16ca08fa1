"""The cheapest op sequence with a given index map (see ``_layout_index``).

:func:`cheapest_form` searches small canonical families (identity, Reshape, Slice,
Transpose, Gather, with optional Reshapes around them) for a sequence with exactly the
index map ``I``; every candidate is verified element by element before it is returned.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

#: Largest index table a Gather form may carry: element-wise gathers of big tensors are
#: slow on the HTP and bloat the weights (a Transpose is never replaced by one).
MAX_GATHER_INDICES = 4096


@dataclass
class Form:
    """A sequence of steps ``(op, params)`` that maps ``x`` to ``y``; ``len(steps)`` is its cost."""

    kind: str
    steps: list[tuple[str, dict]] = field(default_factory=list)

    @property
    def cost(self) -> int:
        return len(self.steps)

    @property
    def gathered(self) -> int:
        """Entries in the index tables this form carries (fewer is cheaper at equal cost)."""
        return sum(int(np.size(p["indices"])) for op, p in self.steps if op == "Gather")


def _with_reshape(kind: str, steps: list, produced: tuple, y_shape: tuple) -> Form:
    if tuple(produced) != tuple(y_shape):
        steps = steps + [("Reshape", {"shape": tuple(y_shape)})]
    return Form(kind, steps)


def _non_unit_perms(shape: tuple[int, ...]):
    """Permutations that keep size-1 axes in place (moving them never changes memory order)."""
    movable = [i for i, d in enumerate(shape) if d != 1]
    for order in itertools.permutations(movable):
        if list(order) == movable:
            continue
        perm = list(range(len(shape)))
        for slot, src in zip(movable, order):
            perm[slot] = src
        yield perm


def _transpose_forms(flat: np.ndarray, x_shape: tuple, y_shape: tuple):
    base = np.arange(flat.size, dtype=np.int64)
    if len(x_shape) <= 6:
        xa = base.reshape(x_shape)
        for perm in _non_unit_perms(x_shape):
            if np.array_equal(xa.transpose(perm).ravel(), flat):
                produced = tuple(x_shape[p] for p in perm)
                yield _with_reshape("transpose", [("Transpose", {"perm": perm, "shape": produced})], produced, y_shape)
    if len(y_shape) <= 6:
        for perm in _non_unit_perms(y_shape):
            inner = [0] * len(y_shape)
            for i, p in enumerate(perm):
                inner[p] = y_shape[i]
            if np.array_equal(base.reshape(inner).transpose(perm).ravel(), flat):
                steps = [] if tuple(inner) == tuple(x_shape) else [("Reshape", {"shape": tuple(inner)})]
                yield Form("reshape-transpose", steps + [("Transpose", {"perm": perm, "shape": tuple(y_shape)})])


def _progression(values: np.ndarray) -> tuple[int, int] | None:
    """(start, step) when ``values`` is an arithmetic progression with a non-zero step."""
    if values.size == 1:
        return int(values[0]), 1
    step = int(values[1] - values[0])
    if step != 0 and np.array_equal(values, values[0] + step * np.arange(values.size)):
        return int(values[0]), step
    return None


def _slice_form(flat: np.ndarray, x_shape: tuple, y_shape: tuple) -> Form | None:
    coords = np.unravel_index(flat, x_shape)
    picks = [c[np.sort(np.unique(c, return_index=True)[1])] for c in coords]
    if math.prod(len(p) for p in picks) != flat.size:
        return None
    progressions = [_progression(p) for p in picks]
    if any(p is None for p in progressions):
        return None
    if not np.array_equal(np.arange(math.prod(x_shape)).reshape(x_shape)[np.ix_(*picks)].ravel(), flat):
        return None
    starts, ends, axes, steps = [], [], [], []
    for axis, ((start, step), p, dim) in enumerate(zip(progressions, picks, x_shape)):
        if len(p) == dim and step == 1:
            continue
        end = start + step * len(p)
        starts.append(start), axes.append(axis), steps.append(step)
        ends.append(end if end >= 0 else -dim - 1)  # a negative end would count from the back
    produced = tuple(len(p) for p in picks)
    params = {"starts": starts, "ends": ends, "axes": axes, "steps": steps, "shape": produced}
    return _with_reshape("slice", [("Slice", params)], produced, y_shape)


def _gather_form(flat: np.ndarray, x_shape: tuple, y_shape: tuple, axis: int) -> Form | None:
    pre, dim, post = math.prod(x_shape[:axis]), x_shape[axis], math.prod(x_shape[axis + 1:])
    if flat.size % (pre * post):
        return None
    m = flat.size // (pre * post)
    if m > MAX_GATHER_INDICES:
        return None
    cube = flat.reshape(pre, m, post)
    idx = cube[0, :, 0] // post
    if np.any(idx >= dim):
        return None
    expected = (np.arange(pre)[:, None, None] * dim + idx[None, :, None]) * post + np.arange(post)[None, None, :]
    if not np.array_equal(expected, cube):
        return None
    head, tail = tuple(x_shape[:axis]), tuple(x_shape[axis + 1:])
    middle = tuple(y_shape[len(head):len(y_shape) - len(tail)])
    if y_shape[:len(head)] == head and (not tail or y_shape[-len(tail):] == tail) and math.prod(middle) == m:
        return Form("gather", [("Gather", {"axis": axis, "indices": idx.reshape(middle), "shape": tuple(y_shape)})])
    produced = head + (m,) + tail
    return _with_reshape("gather", [("Gather", {"axis": axis, "indices": idx, "shape": produced})], produced, y_shape)


def _merged_gather_forms(flat: np.ndarray, x_shape: tuple, y_shape: tuple):
    """Merge axes ``a..b`` of x with a Reshape, then gather on the merged axis (GatherND's general form).

    The last axis is never merged: gathering single elements is how a Transpose would
    look as a Gather, and that is slow on the HTP and needs an index table as big as the data.
    """
    rank = len(x_shape)
    for a in range(rank - 1):
        for b in range(a + 1, rank - 1):
            merged = x_shape[:a] + (math.prod(x_shape[a:b + 1]),) + x_shape[b + 1:]
            form = _gather_form(flat, merged, y_shape, a)
            if form is not None:
                yield Form("reshape-gather", [("Reshape", {"shape": merged})] + form.steps)


def cheapest_form(index: np.ndarray, x_shape: tuple[int, ...], budget: int) -> Form | None:
    """The cheapest form for ``y = x.flat[index]`` costing less than ``budget`` ops, if any."""
    y_shape, flat = tuple(index.shape), index.ravel()
    size = math.prod(x_shape)
    if flat.size == 0 or size == 0:  # empty results are the identity family's business
        return None
    if flat.size == size and np.array_equal(flat, np.arange(size)):
        form = Form("identity") if y_shape == tuple(x_shape) else Form("reshape", [("Reshape", {"shape": y_shape})])
        return form if form.cost < budget else None
    best: Form | None = None

    def consider(form: Form | None) -> None:
        nonlocal best
        if form is not None and form.cost < budget and (best is None or form.cost < best.cost):
            best = form

    if flat.size < size or (flat.size == size and flat[0] != 0):  # a slice drops elements (or reverses)
        consider(_slice_form(flat, x_shape, y_shape))
    if budget > 1:
        if flat.size == size:
            for form in _transpose_forms(flat, tuple(x_shape), y_shape):
                consider(form)
        for axis in range(len(x_shape)):
            consider(_gather_form(flat, tuple(x_shape), y_shape, axis))
    if budget > 2 and (best is None or best.cost > 2):
        for form in _merged_gather_forms(flat, tuple(x_shape), y_shape):
            consider(form)
    return best
