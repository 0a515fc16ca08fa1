"""lower-int64: int64 tensors on the compute path become int32 where that is provably exact.

The HTP has no native int64.  Matches, after ``simplify`` (and ``gathernd``: ONNX allows
only int64 GatherND indices, so that pass must remove GatherND first):

* int64 constants used as ``Gather``/``GatherElements``/``ScatterElements`` indices;
* *regions* of int64 tensors computed at run time — token ids, position ids, gather
  indices, leftover shape math, ``Cast`` to int64 of masks — connected through ops that
  are defined for int32 as well (arithmetic, comparisons, Where, Concat, data movement).

Produces int32 regions: ``Cast(to=int64)`` becomes ``Cast(to=int32)``, constants inside
become int32 copies, a graph input stays int64 behind one ``Cast`` to int32 (or becomes
int32 itself with ``inputs=true``, which changes the model's interface), and where a
region feeds an int64-only port (Reshape shape, GatherND indices, ...) or an int64 graph
output a ``Cast`` back to int64 is put in front of it.

Safe because a region is lowered only when (a) an interval analysis proves every value in
it fits int32, or (b) it only adds, subtracts, multiplies and moves values on their way to
index ports: int32 arithmetic wraps modulo 2**32 exactly like int64 arithmetic does, and an
index that is valid (below the gathered dim) is the same number in both.  Constants must
fit int32.  Anything else (a cast from float, an unknown op) leaves the region alone.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from qnnpasses.passes.lowering._ranges import (
    INDEX_PORTS,
    INT32,
    INT64_SOURCES,
    Region,
    find_regions,
    fits_int32,
    is_int64,
    poly_ports,
    value_ranges,
)

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import (
    FOLDED,
    INT32_INDICES,
    NO_GATHERND,
    Pass,
    PassContext,
    PassResult,
    changes_interface,
    register_pass,
)
from qnnpasses.passmanager.rewrite import finish, make_constant, make_node

I64, I32 = np.dtype(np.int64), np.dtype(np.int32)


def _swap(tensors, old: gs.Tensor, new: gs.Tensor) -> None:
    """Replace ``old`` by ``new`` in a node's inputs or outputs (graphsurgeon lists reject slices)."""
    for index, tensor in enumerate(tensors):
        if tensor is old:
            tensors[index] = new


def _takes_int32(consumer: gs.Node, port: int) -> bool:
    """Index ports accept int32 as they are, and a Cast gives the same result for the same value."""
    return (consumer.op, port) in INDEX_PORTS or consumer.op == "Cast"


# --------------------------------------------------------------------------- rewriting


class Lowering:
    """Applies the rewrites to one graph, sharing int32 copies of constants."""

    def __init__(self, ir: IRModel, ctx: PassContext, inputs_int32: bool):
        self.ir, self.ctx, self.inputs_int32 = ir, ctx, inputs_int32
        self._copies: dict[int, gs.Constant] = {}
        self.stats: Counter = Counter()

    def int32_copy(self, const: gs.Constant) -> gs.Constant:
        if id(const) not in self._copies:
            self._copies[id(const)] = make_constant(self.ir, self.ctx, f"{const.name}_i32",
                                                    np.asarray(const.values).astype(np.int32))
            self.stats["constants_lowered"] += 1
        return self._copies[id(const)]

    def cast(self, tensor: gs.Tensor, to: np.dtype, hint: str) -> gs.Variable:
        onnx_to = onnx.TensorProto.INT32 if to == I32 else onnx.TensorProto.INT64
        node = make_node(self.ir, self.ctx, "Cast", [tensor], name_hint=hint, attrs={"to": onnx_to}, dtype=to,
                         shape=tensor.shape)
        self.stats["casts_inserted"] += 1
        return node.outputs[0]

    def lower_index_constants(self) -> None:
        """int64 constant indices of Gather & co. -> int32 copies (when they fit)."""
        for node in self.ir.graph.nodes:
            for port, idx in enumerate(node.inputs):
                if (node.op, port) in INDEX_PORTS and isinstance(idx, gs.Constant) and is_int64(idx):
                    values = np.asarray(idx.values)
                    if values.size == 0 or fits_int32((int(values.min()), int(values.max()))):
                        node.inputs[port] = self.int32_copy(idx)

    def stays_int64(self, member: gs.Variable) -> bool:
        """A graph input (unless ``inputs=true``) or a Shape-like output keeps int64; users get a Cast."""
        producer = member.inputs[0] if member.inputs else None
        return (member in self.ir.graph.inputs and not self.inputs_int32) or (
            producer is not None and producer.op in INT64_SOURCES)

    def lower_region(self, region: Region) -> None:
        for node in region.nodes:
            for p in poly_ports(node):
                if isinstance(node.inputs[p], gs.Constant) and is_int64(node.inputs[p]):
                    node.inputs[p] = self.int32_copy(node.inputs[p])
        for consumer, port, member in region.uses:  # whatever is not an index or a Cast reads int64 again
            if consumer is not None and not _takes_int32(consumer, port) and not self.stays_int64(member):
                consumer.inputs[port] = self.cast(member, I64, f"{member.name}_i64")
        for member in region.members:
            if self.stays_int64(member):
                self._narrow_users(region, member)
            else:
                self._retype(member)
        self.stats["regions_lowered"] += 1
        self.stats["tensors_lowered"] += len(region.members)

    def _narrow_users(self, region: Region, member: gs.Variable) -> None:
        """One Cast to int32 for the region's nodes and index ports; every other user keeps int64."""
        internal = region.internal_ports()
        ports = [(c, p) for c in member.outputs for p, t in enumerate(c.inputs)
                 if t is member and ((id(c), p) in internal or (c.op, p) in INDEX_PORTS)]
        if ports:
            narrow = self.cast(member, I32, f"{member.name}_i32")
            for consumer, port in ports:
                consumer.inputs[port] = narrow

    def _retype(self, member: gs.Variable) -> None:
        producer = member.inputs[0] if member.inputs else None
        if producer is not None and producer.op == "Cast":
            producer.attrs["to"] = onnx.TensorProto.INT32
        elif producer is not None and producer.op == "ConstantOfShape":
            value = producer.attrs["value"]
            producer.attrs["value"] = gs.Constant(value.name, np.asarray(value.values).astype(np.int32))
        if member in self.ir.graph.inputs:
            self.stats["inputs_retyped"] += 1
        elif member in self.ir.graph.outputs:  # keeps its name and int64: a fresh int32 tensor feeds its Cast
            inner = gs.Variable(self.ctx.unique_name(self.ir, f"{member.name}_i32"), dtype=I32, shape=member.shape)
            for c in list(member.outputs):
                _swap(c.inputs, member, inner)
            _swap(producer.outputs, member, inner)
            cast = make_node(self.ir, self.ctx, "Cast", [inner], name_hint=f"{member.name}_i64",
                             attrs={"to": onnx.TensorProto.INT64})
            cast.outputs[0] = member
            self.stats["casts_inserted"] += 1
            return
        member.dtype = I32


@register_pass
class LowerInt64(Pass):
    name = "lower-int64"
    summary = "int64 compute (token/position ids, gather indices, shape math, masks) -> int32 where provably exact"
    contract = changes_interface("int64 compute becomes int32; with inputs=true int64 graph inputs become int32")
    requires = frozenset({FOLDED, NO_GATHERND})
    ensures = frozenset({INT32_INDICES})

    @dataclass
    class Options:
        inputs: bool = field(default=False,
                             metadata={"help": "int64 graph inputs become int32 (changes the model's interface)"})

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        lowering, notes = Lowering(ir, ctx, self.options.inputs), []
        lowering.lower_index_constants()
        before = len(ir.graph.nodes)
        finish(ir)
        if len(ir.graph.nodes) != before:
            lowering.stats["dead_nodes_removed"] = before - len(ir.graph.nodes)
        input_ranges = {t.name: INT32 for t in ir.graph.inputs if is_int64(t)} if self.options.inputs else {}
        ranges = value_ranges(ir.graph, input_ranges)
        for region in find_regions(ir.graph):
            reason = region.why_not(ir.graph, ranges, self.options.inputs)
            if reason is None:
                lowering.lower_region(region)
                continue
            notes.append(f"kept int64: {', '.join(m.name for m in region.members[:3])}: {reason}")
            if self.options.inputs:
                self._widen_inputs(lowering, region)
        finish(ir)
        stats = {k: v for k, v in lowering.stats.items() if v}
        return PassResult(changed=bool(stats), stats=stats, notes=notes if ctx.verbose else [])

    @staticmethod
    def _widen_inputs(lowering: Lowering, region: Region) -> None:
        """``inputs=true`` on a region that stays int64: the input is int32, widened once."""
        for member in region.members:
            if member in lowering.ir.graph.inputs:
                wide = lowering.cast(member, I64, f"{member.name}_i64")
                for c in [c for c in member.outputs if c is not wide.inputs[0]]:
                    _swap(c.inputs, member, wide)
                member.dtype = I32
                lowering.stats["inputs_retyped"] += 1
