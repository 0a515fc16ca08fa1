"""Compile-time facts about integer tensors, for ``lower-int64``: value ranges and int64 regions.

A forward interval analysis over the (topologically sorted) main graph: every integer
tensor gets ``(lo, hi)`` bounding each of its elements in every execution, or no entry
when nothing is known (an int64 graph input, a cast from float, an op not modelled).
Constants give exact ranges, casts from narrow types their type's range, and arithmetic,
reductions and data movement propagate them soundly (conservatively).

A *region* is a maximal set of int64 variables tied together by ops that are defined for
int32 too (``POLY``): if one of them changes type, all of them must.  :class:`Region` says
whether retyping it to int32 is exact, and why not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from qnnpasses.ir.read import is_graph_input, is_graph_output
from qnnpasses.ir.shapes import is_static

Interval = tuple[int, int]
INT32 = (-(2**31), 2**31 - 1)
DIM = (0, 2**31 - 1)  # a dimension or an index into one: shapes of real models stay below 2**31

# Ops whose integer output holds values of input 0 (or of all inputs: Concat/Where).
MOVES = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Expand", "Transpose", "Slice", "Gather",
                   "GatherElements", "GatherND", "Tile", "Identity", "Split", "ReduceMax", "ReduceMin"})
_TYPE_RANGES = {np.dtype(t): (int(np.iinfo(t).min), int(np.iinfo(t).max))
                for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32)}


def fits_int32(interval: Interval | None) -> bool:
    return interval is not None and INT32[0] <= interval[0] and interval[1] <= INT32[1]


def _union(*intervals: Interval | None) -> Interval | None:
    if any(i is None for i in intervals) or not intervals:
        return None
    return min(i[0] for i in intervals), max(i[1] for i in intervals)


def _elements(tensor: gs.Tensor) -> int | None:
    if tensor.shape is None or not all(is_static(d) for d in tensor.shape):
        return None
    return int(np.prod(tensor.shape)) if tensor.shape else 1


def _constant_range(tensor: gs.Constant) -> Interval | None:
    try:
        if np.dtype(tensor.dtype).kind not in "biu":
            return None  # decided from the dtype: a float weight is not read
    except TypeError:
        return None
    values = np.asarray(tensor.values)
    if values.dtype.kind not in "biu":
        return None
    if values.size == 0:
        return (0, 0)
    return int(values.min()), int(values.max())


def _cast_range(node: gs.Node, src: Interval | None) -> Interval | None:
    to = node.attrs.get("to")
    if to not in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
        return None
    dtype = node.inputs[0].dtype
    if dtype is not None and np.dtype(dtype) == np.bool_:
        return (0, 1)
    if dtype is not None and np.dtype(dtype) in _TYPE_RANGES:
        narrow = _TYPE_RANGES[np.dtype(dtype)]
        return src if fits_int32(src) else narrow
    return src if dtype is not None and np.dtype(dtype) == np.int64 else None


def _sum_range(x: Interval | None, count: int | None) -> Interval | None:
    """Range of a sum of 1..count elements each in ``x`` (CumSum, ReduceSum)."""
    if x is None or count is None:
        return None
    return min(x[0], count * x[0]), max(x[1], count * x[1])


def _arith(op: str, a: Interval | None, b: Interval | None) -> Interval | None:
    if a is None or b is None:
        return None
    if op == "Add":
        return a[0] + b[0], a[1] + b[1]
    if op == "Sub":
        return a[0] - b[1], a[1] - b[0]
    if op == "Mul":
        products = [x * y for x in a for y in b]
        return min(products), max(products)
    if op == "Min":
        return min(a[0], b[0]), min(a[1], b[1])
    if op == "Max":
        return max(a[0], b[0]), max(a[1], b[1])
    if op == "Div":  # integer division never grows the magnitude of the dividend
        m = max(abs(a[0]), abs(a[1]))
        return -m, m
    if op == "Mod":
        m = max(abs(b[0]), abs(b[1]))
        return -m, m
    return None


def node_range(node: gs.Node, ranges: dict[int, Interval]) -> Interval | None:
    """The range of ``node``'s (first) integer output from its inputs' ranges."""
    def r(i: int) -> Interval | None:
        return ranges.get(id(node.inputs[i])) if i < len(node.inputs) and node.inputs[i].name else None

    op = node.op
    if op in ("Add", "Sub", "Mul", "Min", "Max", "Div", "Mod", "Sum") and node.inputs:
        acc = r(0)
        for i in range(1, len(node.inputs)):
            acc = _arith("Add" if op == "Sum" else op, acc, r(i))
        return acc
    if op == "Neg":
        return None if r(0) is None else (-r(0)[1], -r(0)[0])
    if op == "Abs":
        return None if r(0) is None else (0, max(abs(r(0)[0]), abs(r(0)[1])))
    if op in MOVES:
        return r(0)
    if op == "Concat":
        return _union(*(r(i) for i in range(len(node.inputs))))
    if op == "Where":
        return _union(r(1), r(2))
    if op in ("CumSum", "ReduceSum"):
        return _sum_range(r(0), _elements(node.inputs[0]))
    if op == "Cast":
        return _cast_range(node, r(0))
    if op in ("Shape", "Size", "ArgMax", "ArgMin", "NonZero"):
        return DIM
    if op == "ConstantOfShape":
        value = node.attrs.get("value")
        return _constant_range(value) if isinstance(value, gs.Constant) else (0, 0)
    if op == "Range":
        return _union(r(0), r(1))
    return None


def value_ranges(graph: gs.Graph, input_ranges: dict[str, Interval] | None = None) -> dict[int, Interval]:
    """``id(tensor) -> (lo, hi)`` for every integer tensor whose values are bounded."""
    ranges: dict[int, Interval] = {}
    for name, interval in (input_ranges or {}).items():
        for tensor in graph.inputs:
            if tensor.name == name:
                ranges[id(tensor)] = interval
    for tensor in graph.tensors().values():
        if isinstance(tensor, gs.Constant):
            interval = _constant_range(tensor)
            if interval is not None:
                ranges[id(tensor)] = interval
    for node in graph.nodes:  # callers toposort first
        interval = node_range(node, ranges)
        if interval is not None:
            for out in node.outputs:
                ranges[id(out)] = interval
    return ranges


# --------------------------------------------------------------------------- int64 regions

# op -> the input ports that share one int type with the int outputs (None: all inputs)
POLY = {**{op: None for op in ("Add", "Sub", "Mul", "Div", "Mod", "Neg", "Abs", "Min", "Max", "Sum", "Concat",
                               "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Range")},
        "Where": (1, 2),
        **{op: (0,) for op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Expand", "Transpose", "Slice", "Gather",
                               "GatherElements", "Tile", "Identity", "Split", "CumSum", "ReduceSum", "ReduceMax",
                               "ReduceMin")}}
# exact modulo 2**32 (no order, no division): wrapped int32 results equal int64 ones mod 2**32
RING = frozenset(POLY) - {"Div", "Mod", "Abs", "Min", "Max", "Equal", "Less", "Greater", "LessOrEqual",
                          "GreaterOrEqual", "Range", "ReduceMax", "ReduceMin"}
INDEX_PORTS = {("Gather", 1), ("GatherElements", 1), ("ScatterElements", 1)}
INT64_ONLY_PORTS = {("Reshape", 1), ("Expand", 1), ("Unsqueeze", 1), ("Squeeze", 1), ("Tile", 1), ("Pad", 1),
                    ("ConstantOfShape", 0), ("TopK", 1), ("Split", 1), ("GatherND", 1), ("ScatterND", 1),
                    ("Resize", 3), ("Trilu", 1), ("CumSum", 1), ("OneHot", 1),
                    *((op, 1) for op in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd")),
                    *(("Slice", i) for i in (1, 2, 3, 4))}
INT64_SOURCES = frozenset({"Shape", "Size", "ArgMax", "ArgMin", "NonZero"})


def is_int64(tensor: gs.Tensor) -> bool:
    try:
        return tensor.dtype is not None and np.dtype(tensor.dtype) == np.dtype(np.int64)
    except TypeError:
        return False


def poly_ports(node: gs.Node) -> list[int]:
    ports = POLY.get(node.op)
    return list(range(len(node.inputs))) if ports is None else [p for p in ports if p < len(node.inputs)]


@dataclass
class Region:
    """Connected int64 variables (through POLY nodes) and how the rest of the graph uses them."""

    members: list[gs.Variable] = field(default_factory=list)
    nodes: list[gs.Node] = field(default_factory=list)
    # reads of members from outside the region: (consumer or None for a graph output, port, member)
    uses: list[tuple[gs.Node | None, int, gs.Variable]] = field(default_factory=list)

    def internal_ports(self) -> set[tuple[int, int]]:
        """``(id(node), port)`` of the region's nodes' POLY ports (they change type with it)."""
        return {(id(n), p) for n in self.nodes for p in poly_ports(n)}

    def constants(self) -> list[gs.Constant]:
        return [n.inputs[p] for n in self.nodes for p in poly_ports(n)
                if isinstance(n.inputs[p], gs.Constant) and is_int64(n.inputs[p])]

    def why_not(self, graph: gs.Graph, ranges: dict[int, tuple], inputs_int32: bool) -> str | None:
        """None when lowering is exact; else the reason it is not."""
        if any(not fits_int32(ranges.get(id(c))) for c in self.constants()):
            return "an int64 constant in it does not fit int32"
        own = {id(n) for n in self.nodes}
        for m in self.members:
            p = m.inputs[0] if m.inputs else None
            if p is not None and id(p) not in own and p.op not in INT64_SOURCES | {"Cast", "ConstantOfShape"}:
                return f"produced by {p.op}, which is not lowered"
            if p is not None and p.op in ("Cast", "ConstantOfShape") and not fits_int32(ranges.get(id(m))):
                return f"{p.op} to int64 of values that may not fit int32"
        interface_change = inputs_int32 and any(is_graph_input(graph, m) for m in self.members)
        indexes = any(c is not None and (c.op, port) in INDEX_PORTS for c, port, _ in self.uses)
        if not self.nodes and not interface_change and not indexes:
            return "no compute use (only casts, int64-only ports or outputs)"
        if all(fits_int32(ranges.get(id(m))) for m in self.members):
            return None
        if any(n.op not in RING for n in self.nodes):
            return "values not provably within int32, and it orders or divides them"
        for consumer, port, member in self.uses:
            if consumer is None:
                return "values not provably within int32, and they reach a graph output"
            direct_input_cast = consumer.op == "Cast" and is_graph_input(graph, member) and not inputs_int32
            if not ((consumer.op, port) in INDEX_PORTS | INT64_ONLY_PORTS or direct_input_cast):
                return "values not provably within int32, and they reach a value use (cast, compare, output)"
        return None


def find_regions(graph: gs.Graph) -> list[Region]:
    """Union int64 variables that POLY nodes tie together; collect each region's external uses."""
    tensors = list(graph.tensors().values())  # the ties below change no tensor
    parent = {id(t): id(t) for t in tensors if isinstance(t, gs.Variable) and is_int64(t)}

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]  # path halving
            x = parent[x]
        return x

    tied_nodes = []
    for node in graph.nodes:
        if node.op in POLY:
            ids = [id(t) for t in [*(node.inputs[p] for p in poly_ports(node)), *node.outputs] if id(t) in parent]
            for other in ids[1:]:
                parent[root(other)] = root(ids[0])
            if ids:
                tied_nodes.append((node, ids[0]))
    regions: dict[int, Region] = {}
    for t in tensors:
        if id(t) in parent:
            regions.setdefault(root(id(t)), Region()).members.append(t)
    for node, key in tied_nodes:
        regions[root(key)].nodes.append(node)
    for region in regions.values():
        internal = region.internal_ports()
        for m in region.members:
            region.uses += [(c, p, m) for c in m.outputs for p, t in enumerate(c.inputs)
                            if t is m and (id(c), p) not in internal]
            if is_graph_output(graph, m):
                region.uses.append((None, 0, m))
    return list(regions.values())
