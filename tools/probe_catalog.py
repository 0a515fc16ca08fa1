"""What to probe on the HTP: op families and the two suites drawn from them.

Each :class:`Family` knows how to turn a *case* (dtype, rank, knob values, shape source)
into a single-op :class:`~qnnpasses.op_support.probe_models.ProbeSpec`.  Knobs are
attributes or structural choices (broadcast pattern, which inputs are constant, ...); the
first value of each knob is its default.

* ``build`` — a systematic grid: every dtype × rank with default knobs, then each knob's
  other values one at a time.  Shapes are small dims from seed 0.  The table is written
  from this suite.
* ``holdout`` — random joint draws (seed 1) of dtype × rank × knobs, including knob values
  the build suite never uses (``holdout_knobs``) and larger dims, so agreement with the
  table is measured on models it was not built from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from qnnpasses.op_support.probe_models import ProbeSpec

FLOATS = ("float32", "float16")
NUMERIC = ("float32", "float16", "int32", "int64")
ALL = ("float32", "float16", "int32", "int64", "bool")
CAST_TYPES = ("float32", "float16", "int32", "int64", "bool", "uint8", "int8")
INT_MAX = 2**31 - 1


@dataclass
class Case:
    """The draw a family turns into a probe."""

    dtype: str
    rank: int
    knobs: dict[str, Any]
    rng: np.random.Generator
    dim_range: tuple[int, int]

    def shape(self, rank: int | None = None) -> list[int]:
        """A random shape; dims shrink with rank so tensors stay under ~4k elements."""
        rank = self.rank if rank is None else rank
        lo, hi = self.dim_range
        if rank >= 5:
            hi = min(hi, lo + 2)
        return [int(d) for d in self.rng.integers(lo, hi + 1, size=rank)]

    def __getitem__(self, knob: str) -> Any:
        return self.knobs[knob]


@dataclass
class Out:
    """What a family's maker returns; becomes a ProbeSpec once the id is known."""

    dtypes: list[str | None]
    shapes: list[list[int] | None]
    attrs: dict[str, Any] = field(default_factory=dict)
    const: list[int] = field(default_factory=list)
    values: dict[int, Any] = field(default_factory=dict)
    n_outputs: int = 1
    out_dtypes: list[str] | None = None
    out_shapes: list[list[int]] | None = None
    opset: int | None = None


Maker = Callable[[Case], "Out | None"]


@dataclass
class Family:
    op: str
    opset: int
    make: Maker
    dtypes: tuple[str, ...]
    ranks: tuple[int, ...] = (2, 4, 5, 6)
    #: Ranks the holdout suite draws from (defaults to 1-6 for the default build ranks).
    holdout_ranks: tuple[int, ...] | None = None
    knobs: dict[str, tuple] = field(default_factory=dict)
    holdout_knobs: dict[str, tuple] | None = None
    domain: str = ""
    default_rank: int = 3
    n_holdout: int = 8
    #: How many of ``dtypes`` each non-default knob value is combined with in the build suite.
    knob_dtypes: int = 2
    #: Ranks the build suite varies knobs at (default: ``default_rank`` alone).
    knob_ranks: tuple[int, ...] | None = None
    #: Id label when the op appears in more than one family (e.g. "Softmax@11").
    tag: str | None = None

    def __post_init__(self) -> None:
        if self.holdout_ranks is None:
            self.holdout_ranks = (1, 2, 3, 4, 5, 6) if self.ranks == (2, 4, 5, 6) else self.ranks

    @property
    def label(self) -> str:
        return self.tag or (f"{self.domain}.{self.op}" if self.domain else self.op)

    def spec(self, suite: str, case: Case) -> ProbeSpec | None:
        out = self.make(case)
        if out is None:
            return None
        knob_txt = ",".join(f"{k}={_fmt(v)}" for k, v in case.knobs.items())
        pid = f"{suite}/{self.label}/{case.dtype}-r{case.rank}" + (f"-{knob_txt}" if knob_txt else "")
        return ProbeSpec(
            id=pid, op=self.op, domain=self.domain, opset=out.opset or self.opset,
            dtypes=out.dtypes, shapes=out.shapes, attrs=out.attrs, const_inputs=sorted(out.const),
            values={str(k): v for k, v in out.values.items()}, n_outputs=out.n_outputs,
            out_dtypes=out.out_dtypes, out_shapes=out.out_shapes,
        )


def _fmt(v: Any) -> str:
    return "x".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


# ----------------------------------------------------------------------------- makers


def _unary(extra_attrs: dict[str, Any] | None = None) -> Maker:
    def make(c: Case) -> Out:
        attrs = dict(extra_attrs or {})
        attrs.update({k: v for k, v in c.knobs.items()})
        return Out([c.dtype], [c.shape()], attrs=attrs)

    return make


def _broadcast_pair(c: Case) -> tuple[list[int], list[int]]:
    """(a, b) shapes for a broadcast pattern: same | scalar | row | col | both."""
    s = c.shape()
    kind = c.knobs.get("bcast", "same")
    if kind == "scalar":
        return s, []
    if kind == "row":
        return s, s[-1:]
    if kind == "col":
        return s, s[:-1] + [1]
    if kind == "both":
        if len(s) < 2:
            return s, [1]
        a = list(s)
        a[-2] = 1
        b = [1] + s[1:]
        return a, b
    return s, list(s)


def _binary() -> Maker:
    def make(c: Case) -> Out:
        a, b = _broadcast_pair(c)
        return Out([c.dtype, c.dtype], [a, b], const=[1] if c.knobs.get("const_b") else [])

    return make


def _pow(c: Case) -> Out:
    a, b = _broadcast_pair(c)
    exp_type = c.knobs.get("exp_type", "same")
    eb = c.dtype if exp_type == "same" else exp_type
    vals = {1: np.full(b, 2, dtype=np.int64).tolist()} if c.knobs.get("const_b") else {}
    return Out([c.dtype, eb], [a, b], const=[1] if c.knobs.get("const_b") else [], values=vals)


def _mod(c: Case) -> Out:
    a, b = _broadcast_pair(c)
    fmod = 1 if c.dtype in FLOATS else c.knobs.get("fmod", 0)
    return Out([c.dtype, c.dtype], [a, b], attrs={"fmod": fmod})


def _variadic(c: Case) -> Out:
    s = c.shape()
    n = c.knobs.get("n", 2)
    return Out([c.dtype] * n, [s] * n)


def _where(c: Case) -> Out:
    a, b = _broadcast_pair(c)
    return Out(["bool", c.dtype, c.dtype], [a, a, b], const=[2] if c.knobs.get("const_y") else [])


def _gelu(c: Case) -> Out:
    return Out([c.dtype], [c.shape()], attrs={"approximate": c["approximate"]})


def _leaky(c: Case) -> Out:
    return Out([c.dtype], [c.shape()], attrs={"alpha": c["alpha"]})


def _axes_for(kind: str, rank: int) -> list[int] | None:
    return {
        "last": [-1],
        "first": [0],
        "middle": [rank // 2] if rank > 2 else [0],
        "last2": [-2, -1] if rank >= 2 else [-1],
        "first2": [0, 1] if rank >= 2 else [0],
        "all": None,
    }[kind]


def _reduce(axes_as_input: bool) -> Maker:
    def make(c: Case) -> Out:
        s = c.shape()
        axes = _axes_for(c["axes"], c.rank)
        attrs: dict[str, Any] = {"keepdims": c["keepdims"]}
        if axes is None:
            return Out([c.dtype], [s], attrs=attrs)
        if not axes_as_input:
            return Out([c.dtype], [s], attrs={**attrs, "axes": axes}, opset=13)
        const = [1] if c.knobs.get("axes_const", True) else []
        return Out([c.dtype, "int64"], [s, [len(axes)]], attrs=attrs, const=const, values={1: axes})

    return make


def _softmax(c: Case) -> Out:
    return Out([c.dtype], [c.shape()], attrs={"axis": c["axis"]}, opset=c.knobs.get("opset"))


def _norm_axis_ok(axis: int, rank: int) -> bool:
    return -rank <= axis < rank


def _layernorm(c: Case) -> Out | None:
    s = c.shape()
    axis = c["axis"]
    if not _norm_axis_ok(axis, c.rank):
        return None
    ax = axis % c.rank
    ns = s[ax:]
    const = [1, 2] if c["scale_const"] else []
    if c["bias"]:
        return Out([c.dtype, c.dtype, c.dtype], [s, ns, ns], attrs={"axis": axis}, const=const)
    return Out([c.dtype, c.dtype], [s, ns], attrs={"axis": axis}, const=const[:1])


def _rmsnorm(c: Case) -> Out | None:
    s = c.shape()
    axis = c["axis"]
    if not _norm_axis_ok(axis, c.rank):
        return None
    ns = s[axis % c.rank:]
    return Out([c.dtype, c.dtype], [s, ns], attrs={"axis": axis}, const=[1] if c["scale_const"] else [])


def _simplified_ln(c: Case) -> Out:
    s = c.shape()
    return Out([c.dtype, c.dtype], [s, s[-1:]], attrs={"axis": -1, "epsilon": 1e-5},
               const=[1] if c["scale_const"] else [], out_dtypes=[c.dtype], out_shapes=[s])


def _skip_simplified_ln(c: Case) -> Out:
    s = c.shape()
    return Out([c.dtype, c.dtype, c.dtype], [s, s, s[-1:]], attrs={"epsilon": 1e-5}, const=[2],
               out_dtypes=[c.dtype], out_shapes=[s])


def _contrib_unary(c: Case) -> Out:
    s = c.shape()
    return Out([c.dtype], [s], out_dtypes=[c.dtype], out_shapes=[s])


def _instancenorm(c: Case) -> Out | None:
    if c.rank < 3:
        return None
    s = c.shape()
    return Out([c.dtype] * 3, [s, [s[1]], [s[1]]], const=[1, 2])


def _batchnorm(c: Case) -> Out | None:
    if c.rank < 2:
        return None
    s = c.shape()
    ch = [s[1]]
    return Out([c.dtype] * 5, [s, ch, ch, ch, ch], const=[1, 2, 3, 4])


def _matmul(c: Case) -> Out | None:
    if c.rank < 2:
        return None
    s = c.shape()
    k, n = s[-1], int(c.rng.integers(2, 9))
    kind = c["b"]
    if kind == "weight2d":
        b = [k, n]
    elif kind == "same":
        b = s[:-2] + [k, n]
    elif kind == "bcast":
        b = [1] * (c.rank - 2) + [k, n]
    elif kind == "vec":
        b = [k]
    else:
        return None
    return Out([c.dtype, c.dtype], [s, b], const=[1] if c["b_const"] else [])


def _gemm(c: Case) -> Out:
    m, k, n = (int(x) for x in c.rng.integers(2, 9, size=3))
    a = [k, m] if c["transA"] else [m, k]
    b = [n, k] if c["transB"] else [k, n]
    attrs = {"transA": c["transA"], "transB": c["transB"], "alpha": c["alpha"], "beta": c["beta"]}
    dtypes, shapes, const = [c.dtype, c.dtype], [a, b], [1] if c["b_const"] else []
    bias = {"none": None, "vector": [n], "matrix": [m, n], "scalar": [1]}[c["bias"]]
    if bias is not None:
        dtypes.append(c.dtype)
        shapes.append(bias)
        const.append(2)
    return Out(dtypes, shapes, attrs=attrs, const=const)


_EINSUM_OPERANDS = {
    "bhqd,bhkd->bhqk": ("bhqd", "bhkd"),
    "bhqk,bhkd->bhqd": ("bhqk", "bhkd"),
    "bqhd,bkhd->bhqk": ("bqhd", "bkhd"),
    "ij,jk->ik": ("ij", "jk"),
    "ij,kj->ik": ("ij", "kj"),
    "bij,bjk->bik": ("bij", "bjk"),
    "bij->bji": ("bij",),
    "i,j->ij": ("i", "j"),
    "bshd->bhsd": ("bshd",),
    "bi,bi->b": ("bi", "bi"),
    "bqd,bkd->bqk": ("bqd", "bkd"),
    "bshd,bthd->bhst": ("bshd", "bthd"),
    "bqk,bkd->bdq": ("bqk", "bkd"),
}


def _einsum(c: Case) -> Out:
    eq = c["equation"]
    sizes = {ch: int(c.rng.integers(2, 6)) for ch in "bhqkdijsnt"}
    operands = _EINSUM_OPERANDS[eq]
    return Out([c.dtype] * len(operands), [[sizes[ch] for ch in op] for op in operands], attrs={"equation": eq})


def _conv(c: Case) -> Out | None:
    if c.rank not in (3, 4):
        return None
    n, ch = 1, 4
    spatial = [int(x) for x in c.rng.integers(5, 9, size=c.rank - 2)]
    group = ch if c["group"] == "depthwise" else 1
    ks = c["kernel"]
    out_ch = 4
    w = [out_ch, ch // group] + [ks] * (c.rank - 2)
    attrs = {"group": group, "kernel_shape": [ks] * (c.rank - 2), "strides": [c["stride"]] * (c.rank - 2)}
    dtypes, shapes, const = [c.dtype, c.dtype], [[n, ch] + spatial, w], [1] if c["w_const"] else []
    if c["bias"]:
        dtypes.append(c.dtype)
        shapes.append([out_ch])
        const.append(2)
    return Out(dtypes, shapes, attrs=attrs, const=const)


def _pool(c: Case) -> Out | None:
    if c.rank != 4:
        return None
    s = [1, 3] + [int(x) for x in c.rng.integers(5, 9, size=2)]
    return Out([c.dtype], [s], attrs={"kernel_shape": [2, 2], "strides": [2, 2]})


def _global_pool(c: Case) -> Out | None:
    if c.rank < 3:
        return None
    return Out([c.dtype], [c.shape()])


def _cast(c: Case) -> Out:
    return Out([c.dtype], [c.shape()], attrs={"to": _onnx_type(c["to"])})


def _onnx_type(name: str) -> int:
    from qnnpasses.op_support.probe_models import DTYPES

    return DTYPES[name]


def _reshape(c: Case) -> Out | None:
    s = c.shape()
    total = int(np.prod(s))
    kind = c["target"]
    if kind == "flatten":
        target = [total]
    elif kind == "minus1":
        target = [s[0], -1] if c.rank >= 2 else [-1]
    elif kind == "split_last":
        if s[-1] % 2:
            s[-1] += 1
        target = s[:-1] + [2, s[-1] // 2]
    elif kind == "zero":
        if c.rank < 2:
            return None
        target = [0, -1]
    else:
        return None
    if c["allowzero"] and kind == "zero":
        return None  # allowzero=1 with a 0 dim means an empty tensor: not a transformer case
    const = [1] if c["shape_const"] else []
    return Out([c.dtype, "int64"], [s, [len(target)]], attrs={"allowzero": c["allowzero"]}, const=const,
               values={1: target})


def _perm(kind: str, rank: int) -> list[int]:
    p = list(range(rank))
    if kind == "reverse":
        return p[::-1]
    if kind == "swap_last2":
        return p[:-2] + [p[-1], p[-2]] if rank >= 2 else p
    if kind == "rotate":
        return p[1:] + p[:1]
    if kind == "bhsd":  # (b, s, h, d) -> (b, h, s, d): the attention head split
        return [0, 2, 1] + p[3:] if rank >= 3 else p
    return p


def _transpose(c: Case) -> Out:
    return Out([c.dtype], [c.shape()], attrs={"perm": _perm(c["perm"], c.rank)})


def _expand(c: Case) -> Out | None:
    s = c.shape()
    kind = c["kind"]
    if kind == "ones":
        src = [1] * c.rank
        src[-1] = s[-1]
    elif kind == "add_dims":
        src = s[-1:]
    elif kind == "middle_one":
        if c.rank < 3:
            return None
        src = list(s)
        src[1] = 1
    else:
        return None
    return Out([c.dtype, "int64"], [src, [len(s)]], const=[1] if c["shape_const"] else [], values={1: s})


def _tile(c: Case) -> Out:
    s = c.shape()
    reps = [1] * c.rank
    reps[int(c.rng.integers(0, c.rank))] = 2
    return Out([c.dtype, "int64"], [s, [c.rank]], const=[1] if c["reps_const"] else [], values={1: reps})


def _concat(c: Case) -> Out | None:
    axis = c["axis"]
    if not -c.rank <= axis < c.rank:
        return None
    s = c.shape()
    shapes = []
    for _ in range(c["n"]):
        t = list(s)
        t[axis] = int(c.rng.integers(1, 5))
        shapes.append(t)
    const = [c["n"] - 1] if c["const_last"] else []
    return Out([c.dtype] * c["n"], shapes, attrs={"axis": axis}, const=const)


def _split(c: Case) -> Out | None:
    axis = c["axis"]
    if not -c.rank <= axis < c.rank:
        return None
    s = c.shape()
    d = s[axis]
    if d < 2:
        s[axis] = d = 4
    kind = c["split"]
    if kind == "num_outputs":
        if d % 2:
            s[axis] = d = d + 1
        return Out([c.dtype], [s], attrs={"axis": axis, "num_outputs": 2}, n_outputs=2)
    sizes = [1, d - 1]
    const = [1] if kind == "const" else []
    return Out([c.dtype, "int64"], [s, [2]], attrs={"axis": axis}, const=const, values={1: sizes}, n_outputs=2)


def _slice(c: Case) -> Out | None:
    s = c.shape()
    for i in range(len(s)):
        s[i] = max(s[i], 4)
    axes = _axes_for(c["axes"], c.rank) or list(range(c.rank))
    step = c["step"]
    n = len(axes)
    if step > 0:
        starts, ends = [1] * n, ([INT_MAX] * n if c["ends"] == "max" else [3] * n)
    else:
        starts, ends = [-1] * n, ([-INT_MAX] * n if c["ends"] == "max" else [0] * n)
    const = [1, 2, 3, 4] if c["const"] else []
    return Out([c.dtype, "int64", "int64", "int64", "int64"], [s, [n], [n], [n], [n]], const=const,
               values={1: starts, 2: ends, 3: axes, 4: [step] * n})


def _gather(c: Case) -> Out | None:
    axis = c["axis"]
    if not -c.rank <= axis < c.rank:
        return None
    s = c.shape()
    idx_shape = {"scalar": [], "vec": [3], "mat": [1, 3]}[c["indices"]]
    n = int(np.prod(idx_shape)) if idx_shape else 1
    vals = ([-1] + [0] * (n - 1)) if c["negative"] else list(range(n))
    vals = [v % max(2, s[axis]) if not c["negative"] else v for v in vals]
    if any(v >= s[axis] for v in vals):
        s[axis] = max(vals) + 1
    return Out([c.dtype, c["idx_type"]], [s, idx_shape], attrs={"axis": axis},
               const=[1] if c["idx_const"] else [], values={1: np.array(vals).reshape(idx_shape).tolist()})


def _gather_elements(c: Case) -> Out | None:
    axis = c["axis"]
    if not -c.rank <= axis < c.rank:
        return None
    s = c.shape()
    idx = c.rng.integers(0, s[axis], size=s).tolist()
    return Out([c.dtype, c["idx_type"]], [s, s], attrs={"axis": axis}, const=[1] if c["idx_const"] else [],
               values={1: idx})


def _gather_nd(c: Case) -> Out | None:
    if c.rank < 2:
        return None
    s = c.shape()
    bd = c["batch_dims"]
    k = 1
    idx = [[int(c.rng.integers(0, s[bd]))] for _ in range(2)]
    if bd:
        idx = [[[int(c.rng.integers(0, s[1]))]] for _ in range(s[0])]
        shape = [s[0], 1, k]
    else:
        shape = [2, k]
    return Out([c.dtype, "int64"], [s, shape], attrs={"batch_dims": bd}, const=[1] if c["idx_const"] else [],
               values={1: idx})


def _scatter_nd(c: Case) -> Out | None:
    if c.rank < 2:
        return None
    s = c.shape()
    rows = sorted({int(x) for x in c.rng.integers(0, s[0], size=2)})
    idx = [[r] for r in rows]
    upd = [len(rows)] + s[1:]
    attrs = {} if c["reduction"] == "none" else {"reduction": c["reduction"]}
    return Out([c.dtype, "int64", c.dtype], [s, [len(rows), 1], upd], attrs=attrs,
               const=[1] if c["idx_const"] else [], values={1: idx})


def _scatter_elements(c: Case) -> Out | None:
    s = c.shape()
    axis = -1
    idx_shape = list(s)
    idx_shape[axis] = 1
    idx = c.rng.integers(0, s[axis], size=idx_shape).tolist()
    return Out([c.dtype, "int64", c.dtype], [s, idx_shape, idx_shape], attrs={"axis": axis},
               const=[1] if c["idx_const"] else [], values={1: idx})


def _range(c: Case) -> Out:
    start, limit, delta = (0, 8, 1) if c["delta"] == 1 else (8, 0, -2)
    return Out([c.dtype] * 3, [[], [], []], const=[0, 1, 2] if c["const"] else [],
               values={0: start, 1: limit, 2: delta})


def _shape(c: Case) -> Out:
    attrs = {"start": 1} if c["slice"] == "start1" else {"end": -1} if c["slice"] == "end-1" else {}
    return Out([c.dtype], [c.shape()], attrs=attrs)


def _constant_of_shape(c: Case) -> Out:
    s = c.shape()
    value = {"tensor": c.dtype, "value": [True] if c.dtype == "bool" else [1]}
    return Out(["int64"], [[len(s)]], attrs={"value": value}, const=[0] if c["shape_const"] else [],
               values={0: s})


def _trilu(c: Case) -> Out | None:
    if c.rank < 2:
        return None
    s = c.shape()
    if c["k"] == "none":
        return Out([c.dtype], [s], attrs={"upper": c["upper"]})
    return Out([c.dtype, "int64"], [s, []], attrs={"upper": c["upper"]}, const=[1] if c["k_const"] else [],
               values={1: int(c["k"])})


def _cumsum(c: Case) -> Out:
    axis = -1 if c["axis"] == "last" else 0
    return Out([c.dtype, "int64"], [c.shape(), []], attrs={"exclusive": c["exclusive"], "reverse": c["reverse"]},
               const=[1] if c["axis_const"] else [], values={1: axis})


def _unsqueeze(c: Case) -> Out | None:
    axes = {"first": [0], "last": [-1], "two": [0, 2]}[c["axes"]]
    if c.rank + len(axes) > 8:
        return None
    return Out([c.dtype, "int64"], [c.shape(), [len(axes)]], const=[1] if c["axes_const"] else [],
               values={1: axes})


def _squeeze(c: Case) -> Out | None:
    s = c.shape()
    kind = c["axes"]
    if kind == "first":
        s[0] = 1
        axes = [0]
    elif kind == "last":
        s[-1] = 1
        axes = [-1]
    else:  # "none": squeeze every 1
        s[0] = 1
        return Out([c.dtype], [s])
    return Out([c.dtype, "int64"], [s, [1]], const=[1] if c["axes_const"] else [], values={1: axes})


def _flatten(c: Case) -> Out | None:
    axis = c["axis"]
    if not -c.rank <= axis <= c.rank:
        return None
    return Out([c.dtype], [c.shape()], attrs={"axis": axis})


def _clip(c: Case) -> Out:
    s = c.shape()
    kind = c["bounds"]
    lo, hi = (0, 1) if c.dtype not in FLOATS else (0.5, 1.5)
    if kind == "none":
        return Out([c.dtype], [s])
    if kind == "min":
        return Out([c.dtype, c.dtype], [s, []], const=[1] if c["const"] else [], values={1: lo})
    if kind == "max":
        return Out([c.dtype, None, c.dtype], [s, None, []], const=[2] if c["const"] else [], values={2: hi})
    return Out([c.dtype, c.dtype, c.dtype], [s, [], []], const=[1, 2] if c["const"] else [], values={1: lo, 2: hi})


def _topk(c: Case) -> Out | None:
    axis = c["axis"]
    if not -c.rank <= axis < c.rank:
        return None
    s = c.shape()
    k = min(2, s[axis])
    return Out([c.dtype, "int64"], [s, [1]], attrs={"axis": axis, "largest": c["largest"], "sorted": 1},
               const=[1] if c["k_const"] else [], values={1: [k]}, n_outputs=2)


def _argmax(c: Case) -> Out | None:
    axis = c["axis"]
    if not -c.rank <= axis < c.rank:
        return None
    return Out([c.dtype], [c.shape()],
               attrs={"axis": axis, "keepdims": c["keepdims"], "select_last_index": c["select_last_index"]})


def _pad(c: Case) -> Out:
    s = c.shape()
    pads = [0] * (2 * c.rank)
    pads[c.rank - 1] = 1
    pads[2 * c.rank - 1] = 2
    return Out([c.dtype, "int64"], [s, [2 * c.rank]], attrs={"mode": c["mode"]}, const=[1] if c["pads_const"] else [],
               values={1: pads})


def _attention(c: Case) -> Out | None:
    if c.rank != 4:
        return None
    b, h, q, d = 1, 2, int(c.rng.integers(3, 7)), 8
    kv_h = h if c["kv_heads"] == "same" else 1
    kv = q if c["kv_len"] == "same" else q + 2
    return Out([c.dtype] * 3, [[b, h, q, d], [b, kv_h, kv, d], [b, kv_h, kv, d]], attrs={"is_causal": c["is_causal"]})


def _rotary(c: Case) -> Out | None:
    # com.microsoft RotaryEmbedding: input (b, s, h*d), position_ids (b, s), cos/sin caches (max_s, d/2).
    b, s, h, d = 1, int(c.rng.integers(3, 7)), 2, 8
    x = [b, s, h * d]
    return Out([c.dtype, "int64", c.dtype, c.dtype], [x, [b, s], [16, d // 2], [16, d // 2]],
               attrs={"num_heads": h, "interleaved": c["interleaved"]}, const=[1, 2, 3],
               values={1: [list(range(s))]}, out_dtypes=[c.dtype], out_shapes=[x])


# ----------------------------------------------------------------------------- catalogue

_BCAST = {"bcast": ("same", "scalar", "row", "both"), "const_b": (False, True)}
_BCAST_HOLDOUT = {"bcast": ("same", "scalar", "row", "col", "both"), "const_b": (False, True)}


def _binary_family(op: str, dtypes: tuple[str, ...], opset: int = 17) -> Family:
    return Family(op, opset, _binary(), dtypes, knobs=_BCAST, holdout_knobs=_BCAST_HOLDOUT)


def _unary_family(op: str, dtypes: tuple[str, ...], opset: int = 17, **kw: Any) -> Family:
    return Family(op, opset, _unary(), dtypes, **kw)


_REDUCE_KNOBS = {"axes": ("last", "first", "middle", "last2", "all"), "keepdims": (1, 0), "axes_const": (True, False)}
_REDUCE_HOLDOUT = {"axes": ("last", "first", "middle", "last2", "first2", "all"), "keepdims": (1, 0),
                   "axes_const": (True, False)}


def _reduce_family(op: str, dtypes: tuple[str, ...], opset: int = 18) -> Family:
    return Family(op, opset, _reduce(axes_as_input=True), dtypes, knobs=_REDUCE_KNOBS, holdout_knobs=_REDUCE_HOLDOUT)


FAMILIES: list[Family] = [
    # --- elementwise binary
    *(_binary_family(op, NUMERIC) for op in ("Add", "Sub", "Mul", "Div")),
    Family("Pow", 15, _pow, FLOATS, knobs={**_BCAST, "exp_type": ("same", "int64")},
           holdout_knobs={**_BCAST_HOLDOUT, "exp_type": ("same", "int64", "int32")}),
    Family("Mod", 13, _mod, ("int32", "int64", "float32", "float16"), knobs={"bcast": ("same", "row")}),
    *(_binary_family(op, NUMERIC, 13) for op in ("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual")),
    *(_binary_family(op, ("bool",)) for op in ("And", "Or", "Xor")),
    *(Family(op, 13, _variadic, NUMERIC, knobs={"n": (2, 3)}) for op in ("Max", "Min", "Sum", "Mean")),
    Family("Where", 16, _where, ALL, knobs={"bcast": ("same", "scalar", "row"), "const_y": (False, True)},
           holdout_knobs={"bcast": ("same", "scalar", "row", "col", "both"), "const_y": (False, True)}),
    # --- elementwise unary
    *(_unary_family(op, FLOATS) for op in (
        "Sqrt", "Reciprocal", "Erf", "Tanh", "Sigmoid", "Exp", "Log", "Floor", "Ceil", "Round",
        "Sin", "Cos", "Softplus", "Elu", "HardSigmoid", "HardSwish", "IsNaN", "IsInf")),
    *(_unary_family(op, NUMERIC) for op in ("Neg", "Abs", "Relu", "Sign")),
    _unary_family("Not", ("bool",)),
    _unary_family("Identity", ALL, opset=19),
    Family("LeakyRelu", 16, _leaky, FLOATS, knobs={"alpha": (0.01, 0.2)}, holdout_knobs={"alpha": (0.1, 0.3)}),
    Family("Gelu", 20, _gelu, FLOATS, knobs={"approximate": ("none", "tanh")}),
    Family("Mish", 18, _unary(), FLOATS),
    # --- reductions & normalisation
    *(_reduce_family(op, NUMERIC) for op in ("ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd")),
    _reduce_family("ReduceSum", NUMERIC, opset=13),
    _reduce_family("ReduceL2", FLOATS),
    _reduce_family("ReduceSumSquare", FLOATS),
    Family("ReduceMean", 13, _reduce(axes_as_input=False), FLOATS, knobs={"axes": ("last", "first", "all"), "keepdims": (1, 0)},
           holdout_knobs={"axes": ("last", "middle", "last2", "first2"), "keepdims": (1, 0)}, n_holdout=4,
           tag="ReduceMean@13"),
    Family("Softmax", 13, _softmax, FLOATS, knobs={"axis": (-1, 1, 0, -2)}, holdout_knobs={"axis": (-1, 1, 2, -3)}),
    Family("Softmax", 11, _softmax, FLOATS, ranks=(2, 3, 4), knobs={"axis": (-1, 1)}, holdout_knobs={"axis": (-1, 1, 2)},
           n_holdout=4, tag="Softmax@11"),
    Family("LogSoftmax", 13, _softmax, FLOATS, knobs={"axis": (-1, 1)}, holdout_knobs={"axis": (-1, 0, -2)}),
    Family("LayerNormalization", 17, _layernorm, FLOATS, ranks=(2, 3, 4, 5),
           knobs={"axis": (-1, -2, 1, 0), "bias": (True, False), "scale_const": (True, False)},
           holdout_knobs={"axis": (-1, -2, -3, 1), "bias": (True, False), "scale_const": (True, False)}),
    Family("RMSNormalization", 23, _rmsnorm, FLOATS, ranks=(2, 3, 4, 5), knobs={"axis": (-1, -2, 0), "scale_const": (True, False)},
           holdout_knobs={"axis": (-1, -2, -3, 1), "scale_const": (True, False)}),
    Family("SimplifiedLayerNormalization", 17, _simplified_ln, FLOATS, ranks=(2, 3, 4), knobs={"scale_const": (True, False)},
           n_holdout=4),
    Family("SkipSimplifiedLayerNormalization", 1, _skip_simplified_ln, FLOATS, ranks=(3,), domain="com.microsoft", n_holdout=2),
    Family("InstanceNormalization", 17, _instancenorm, FLOATS, ranks=(3, 4), n_holdout=4),
    Family("BatchNormalization", 15, _batchnorm, FLOATS, ranks=(2, 3, 4), n_holdout=4),
    *(Family(op, 1, _contrib_unary, FLOATS, ranks=(2, 3, 4), domain="com.microsoft", n_holdout=4)
      for op in ("Gelu", "FastGelu", "QuickGelu")),
    # --- matrix products
    Family("MatMul", 13, _matmul, NUMERIC, ranks=(2, 3, 4, 5), knobs={"b": ("weight2d", "same", "bcast", "vec"), "b_const": (True, False)}),
    Family("Gemm", 13, _gemm, FLOATS + ("int32",), ranks=(2,),
           knobs={"transA": (0, 1), "transB": (0, 1), "alpha": (1.0, 0.5), "beta": (1.0, 2.0),
                  "bias": ("vector", "none", "matrix", "scalar"), "b_const": (True, False)},
           holdout_knobs={"transA": (0, 1), "transB": (0, 1), "alpha": (1.0, 0.25), "beta": (1.0, 0.5),
                          "bias": ("vector", "none", "matrix", "scalar"), "b_const": (True, False)}, n_holdout=10),
    Family("Einsum", 12, _einsum, FLOATS, ranks=(0,),
           knobs={"equation": ("bhqd,bhkd->bhqk", "bhqk,bhkd->bhqd", "ij,jk->ik", "bij,bjk->bik", "bij->bji", "i,j->ij",
                              "bqd,bkd->bqk", "bshd,bthd->bhst", "bqk,bkd->bdq")},
           holdout_knobs={"equation": ("bqhd,bkhd->bhqk", "ij,kj->ik", "bshd->bhsd", "bi,bi->b", "bhqd,bhkd->bhqk")}),
    Family("Conv", 11, _conv, FLOATS, ranks=(3, 4),
           knobs={"group": ("one", "depthwise"), "kernel": (3, 1), "stride": (1, 2), "w_const": (True, False), "bias": (True, False)}),
    *(Family(op, 19 if op == "AveragePool" else 12, _pool, FLOATS, ranks=(4,), n_holdout=2) for op in ("MaxPool", "AveragePool")),
    Family("GlobalAveragePool", 17, _global_pool, FLOATS, ranks=(3, 4), n_holdout=3),
    Family("Attention", 23, _attention, FLOATS, ranks=(4,),
           knobs={"is_causal": (0, 1), "kv_heads": ("same", "grouped"), "kv_len": ("same", "longer")}, n_holdout=4),
    Family("RotaryEmbedding", 1, _rotary, FLOATS, ranks=(3,), domain="com.microsoft", knobs={"interleaved": (0, 1)}, n_holdout=2),
    # --- type conversion
    Family("Cast", 19, _cast, CAST_TYPES, ranks=(1, 3, 5), knobs={"to": CAST_TYPES}, n_holdout=24,
           knob_dtypes=len(CAST_TYPES), knob_ranks=(3, 5)),
    # --- data movement
    Family("Reshape", 14, _reshape, ALL, knobs={"target": ("minus1", "flatten", "split_last", "zero"), "allowzero": (0, 1),
                                                 "shape_const": (True, False)}),
    Family("Transpose", 13, _transpose, ALL, ranks=(2, 3, 4, 5, 6), knobs={"perm": ("reverse", "swap_last2", "rotate", "bhsd")},
           n_holdout=12),
    Family("Expand", 13, _expand, ALL, knobs={"kind": ("ones", "add_dims", "middle_one"), "shape_const": (True, False)}),
    Family("Tile", 13, _tile, ALL, knobs={"reps_const": (True, False)}),
    Family("Concat", 13, _concat, ALL, knobs={"axis": (-1, 0, 1), "n": (2, 3), "const_last": (False, True)},
           holdout_knobs={"axis": (-1, -2, 2, 0), "n": (2, 4), "const_last": (False, True)}),
    Family("Split", 18, _split, ALL, knobs={"axis": (-1, 0), "split": ("num_outputs", "const", "input")},
           holdout_knobs={"axis": (-1, 1, -2), "split": ("num_outputs", "const", "input")}),
    Family("Slice", 13, _slice, ALL, knobs={"axes": ("last", "first", "last2"), "step": (1, 2, -1), "ends": ("fixed", "max"),
                                             "const": (True, False)},
           holdout_knobs={"axes": ("middle", "first2", "last"), "step": (1, 3, -1), "ends": ("fixed", "max"), "const": (True, False)}),
    Family("Gather", 13, _gather, NUMERIC + ("bool",),
           knobs={"axis": (0, 1, -1), "idx_type": ("int64", "int32"), "idx_const": (True, False),
                  "indices": ("vec", "scalar", "mat"), "negative": (False, True)},
           holdout_knobs={"axis": (0, -2, 2), "idx_type": ("int64", "int32"), "idx_const": (True, False),
                          "indices": ("vec", "scalar", "mat"), "negative": (False, True)}, n_holdout=12),
    Family("GatherElements", 13, _gather_elements, NUMERIC, knobs={"axis": (-1, 0), "idx_type": ("int64", "int32"),
                                                                    "idx_const": (True, False)}),
    Family("GatherND", 13, _gather_nd, NUMERIC, ranks=(2, 3, 4), knobs={"batch_dims": (0, 1), "idx_const": (True, False)}),
    Family("ScatterND", 18, _scatter_nd, NUMERIC, ranks=(2, 3, 4), knobs={"reduction": ("none", "add", "mul", "max"), "idx_const": (True, False)},
           holdout_knobs={"reduction": ("none", "add", "mul", "max"), "idx_const": (True, False)}),
    Family("ScatterElements", 18, _scatter_elements, NUMERIC, ranks=(2, 3, 4), knobs={"idx_const": (True, False)}, n_holdout=4),
    Family("Pad", 18, _pad, NUMERIC, ranks=(2, 3, 4, 5), knobs={"mode": ("constant", "reflect", "edge"), "pads_const": (True, False)}),
    Family("Unsqueeze", 13, _unsqueeze, ALL, ranks=(1, 2, 3, 4, 5), knobs={"axes": ("first", "last", "two"), "axes_const": (True, False)}),
    Family("Squeeze", 13, _squeeze, ALL, ranks=(2, 3, 4, 5, 6), knobs={"axes": ("first", "last", "none"), "axes_const": (True, False)}),
    Family("Flatten", 13, _flatten, ALL, ranks=(2, 3, 4, 5), knobs={"axis": (1, 0, -1)}, holdout_knobs={"axis": (1, 2, -1)}),
    # --- shape-ish / generators
    Family("Shape", 15, _shape, NUMERIC, knobs={"slice": ("none", "start1", "end-1")}, n_holdout=4),
    Family("ConstantOfShape", 20, _constant_of_shape, ALL, ranks=(1, 3, 4), knobs={"shape_const": (True, False)}),
    Family("Range", 11, _range, ("float32", "int32", "int64"), ranks=(0,), knobs={"const": (True, False), "delta": (1, -2)},
           n_holdout=4),
    Family("Trilu", 14, _trilu, NUMERIC + ("bool",), ranks=(2, 3, 4), knobs={"upper": (1, 0), "k": ("none", "1", "-1"), "k_const": (True, False)}),
    Family("CumSum", 14, _cumsum, NUMERIC, ranks=(1, 2, 3, 4), knobs={"axis": ("last", "first"), "exclusive": (0, 1), "reverse": (0, 1),
                                                                      "axis_const": (True, False)}),
    # --- misc
    Family("Clip", 13, _clip, NUMERIC, knobs={"bounds": ("both", "min", "max", "none"), "const": (True, False)}),
    Family("TopK", 11, _topk, NUMERIC, ranks=(1, 2, 3, 4), knobs={"axis": (-1, 0, -2), "largest": (1, 0), "k_const": (True, False)},
           holdout_knobs={"axis": (-1, 1, -2), "largest": (1, 0), "k_const": (True, False)}),
    *(Family(op, 13, _argmax, NUMERIC, ranks=(1, 2, 3, 4, 5), knobs={"axis": (-1, 0), "keepdims": (1, 0), "select_last_index": (0, 1)},
             holdout_knobs={"axis": (-1, 1, -2), "keepdims": (1, 0), "select_last_index": (0, 1)}) for op in ("ArgMax", "ArgMin")),
]


def _dequantize(c: Case) -> Out:
    s = c.shape()
    per_channel = c["scale"] == "per_channel"
    ch = [s[1]] if per_channel and c.rank >= 2 else []
    attrs = {"axis": 1} if ch else {}
    zp = np.zeros(ch or [], dtype=np.int64).tolist()
    return Out([c.dtype, "float32", c.dtype], [s, ch, ch], attrs=attrs, const=[1, 2],
               values={1: np.full(ch or [], 0.05).tolist(), 2: zp})


def _quantize(c: Case) -> Out:
    s = c.shape()
    per_channel = c["scale"] == "per_channel"
    ch = [s[1]] if per_channel and c.rank >= 2 else []
    attrs = {"axis": 1} if ch else {}
    return Out(["float32", "float32", c.dtype], [s, ch, ch], attrs=attrs, const=[1, 2],
               values={1: np.full(ch or [], 0.05).tolist(), 2: np.zeros(ch or [], dtype=np.int64).tolist()})


QUANT = ("uint8", "int8", "uint16", "int16")
FAMILIES += [
    Family("DequantizeLinear", 21, _dequantize, QUANT, ranks=(2, 4, 5), knobs={"scale": ("per_tensor", "per_channel")},
           holdout_ranks=(1, 2, 3, 4, 5), n_holdout=8),
    Family("QuantizeLinear", 21, _quantize, QUANT, ranks=(2, 4, 5), knobs={"scale": ("per_tensor", "per_channel")},
           holdout_ranks=(1, 2, 3, 4, 5), n_holdout=8),
]


# ----------------------------------------------------------------------------- suites


def _draws_build(fam: Family) -> list[tuple[str, int, dict[str, Any]]]:
    """Every dtype × rank with default knobs, then each knob's other values one at a time."""
    defaults = {k: v[0] for k, v in fam.knobs.items()}
    draws = [(dt, r, dict(defaults)) for dt in fam.dtypes for r in fam.ranks]
    rank = fam.default_rank if fam.default_rank in (fam.holdout_ranks or fam.ranks) else fam.ranks[0]
    for knob_rank in fam.knob_ranks or (rank,):
        for knob, values in fam.knobs.items():
            for v in values[1:]:
                for dt in fam.dtypes[: fam.knob_dtypes]:
                    draws.append((dt, knob_rank, {**defaults, knob: v}))
    return draws


def _draws_holdout(fam: Family, rng: np.random.Generator) -> list[tuple[str, int, dict[str, Any]]]:
    """Random joint draws of dtype, rank and knob values (holdout values where given)."""
    space = fam.holdout_knobs or fam.knobs
    draws = []
    for _ in range(fam.n_holdout):
        knobs = {k: vals[int(rng.integers(len(vals)))] for k, vals in space.items()}
        ranks = fam.holdout_ranks or fam.ranks
        draws.append((fam.dtypes[int(rng.integers(len(fam.dtypes)))], ranks[int(rng.integers(len(ranks)))], knobs))
    return draws


SUITES = {
    "build": {"seed": 0, "dim_range": (2, 5)},
    "holdout": {"seed": 1, "dim_range": (3, 7)},
}


def suite_specs(suite: str) -> list[ProbeSpec]:
    """All valid probe specs of a suite, deduplicated by id, in catalogue order."""
    from qnnpasses.op_support.probe_models import build_model

    cfg = SUITES[suite]
    draw_rng = np.random.default_rng(cfg["seed"] + 1000)
    seen: set[str] = set()
    specs = []
    for fam_index, fam in enumerate(FAMILIES):
        draws = _draws_build(fam) if suite == "build" else _draws_holdout(fam, draw_rng)
        for i, (dtype, rank, knobs) in enumerate(draws):
            case = Case(dtype, rank, knobs, np.random.default_rng([cfg["seed"], fam_index, i]), cfg["dim_range"])
            spec = fam.spec(suite, case)
            if spec is None:
                continue
            if spec.id in seen:
                continue
            try:
                build_model(spec)
            except Exception:  # noqa: BLE001, S112 - not a valid ONNX model for this dtype/attr combination
                continue
            seen.add(spec.id)
            specs.append(spec)
    return specs
