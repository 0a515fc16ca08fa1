"""A canonical text form of the IR, one line per input, constant, node and output.

Nodes appear in a stable topological order (ties keep the graph's order), constants
in name order, so the text of two graphs differs only where the graphs do.  Per-pass
diffs are unified diffs of this text.  Large constants print dtype, shape and where
their bytes live, never their values, so printing a 10 GB model reads no weights.
"""

from __future__ import annotations

import difflib
import hashlib
import heapq

import numpy as np
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues

from qnnpasses.ir.model import ExternalValues, IRModel

_INLINE_VALUES = 8  # constants with at most this many elements print their values
_HASH_LIMIT = 1 << 16  # constants up to this many bytes print a digest of their values


def stable_topological_order(graph: gs.Graph) -> list[gs.Node]:
    """Kahn's algorithm, always taking the ready node with the smallest name.

    Ties broken by name, not position, make the order independent of how the
    producer happened to order independent nodes (names are unique in the IR).
    """
    nodes = sorted(graph.nodes, key=lambda n: n.name)
    index = {id(n): i for i, n in enumerate(nodes)}
    producers = {}
    for node in nodes:
        for out in node.outputs:
            producers[id(out)] = node
    pending = [0] * len(nodes)
    consumers: list[list[int]] = [[] for _ in nodes]
    for i, node in enumerate(nodes):
        deps = {index[id(producers[id(t)])] for t in node.inputs if id(t) in producers}
        deps.discard(i)
        pending[i] = len(deps)
        for d in deps:
            consumers[d].append(i)
    ready = [i for i, count in enumerate(pending) if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(nodes[i])
        for j in consumers[i]:
            pending[j] -= 1
            if pending[j] == 0:
                heapq.heappush(ready, j)
    if len(order) < len(nodes):  # a cycle: keep the rest in graph order so nothing is hidden
        seen = {id(n) for n in order}
        order.extend(n for n in nodes if id(n) not in seen)
    return order


def canonical_lines(ir: IRModel) -> list[str]:
    lines = ["opset " + " ".join(f"{d or 'ai.onnx'}={v}" for d, v in sorted(_imports(ir).items()))]
    lines.extend(_graph_lines(ir.graph, ""))
    return lines


def canonical_text(ir: IRModel) -> str:
    return "\n".join(canonical_lines(ir)) + "\n"


def unified_diff(before: list[str], after: list[str], before_name: str, after_name: str) -> str:
    return "\n".join(difflib.unified_diff(before, after, before_name, after_name, lineterm="", n=2)) + "\n"


def _imports(ir: IRModel) -> dict[str, int]:
    imports = {"": ir.opset}
    for entry in getattr(ir.graph, "import_domains", None) or []:
        imports[entry.domain] = entry.version
    return imports


def _graph_lines(graph: gs.Graph, indent: str) -> list[str]:
    lines = [f"{indent}input {t.name} : {_type(t)}" for t in graph.inputs]
    constants = sorted(
        (t for t in graph.tensors().values() if isinstance(t, gs.Constant)), key=lambda t: t.name
    )
    lines += [f"{indent}const {t.name} : {_type(t)} {_describe_values(t)}" for t in constants]
    for node in stable_topological_order(graph):
        lines.append(f"{indent}node {node.name} : {_node_signature(node)}")
        for key, value in sorted(node.attrs.items()):
            if isinstance(value, gs.Graph):
                lines.append(f"{indent}  subgraph {key}:")
                lines.extend(_graph_lines(value, indent + "    "))
    lines += [f"{indent}output {t.name} : {_type(t)}" for t in graph.outputs]
    return lines


def _node_signature(node: gs.Node) -> str:
    op = f"{node.domain}::{node.op}" if node.domain not in (None, "", "ai.onnx") else node.op
    inputs = ", ".join(t.name for t in node.inputs)
    outputs = ", ".join(t.name for t in node.outputs)
    attrs = {k: v for k, v in node.attrs.items() if not isinstance(v, gs.Graph)}
    attr_text = (" {" + ", ".join(f"{k}={_attr(v)}" for k, v in sorted(attrs.items())) + "}") if attrs else ""
    return f"{op}({inputs}) -> ({outputs}){attr_text}"


def _attr(value) -> str:
    if isinstance(value, gs.Constant):
        return f"tensor<{_type(value)} {_describe_values(value)}>"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_attr(v) for v in value) + "]"
    return repr(value) if isinstance(value, str) else str(value)


def _type(tensor: gs.Tensor) -> str:
    dtype = tensor.dtype
    name = np.dtype(dtype).name if dtype is not None and not isinstance(dtype, int) else str(dtype)
    shape = "?" if tensor.shape is None else "[" + ",".join(str(d) for d in tensor.shape) + "]"
    return f"{name}{shape}"


def _describe_values(tensor: gs.Constant) -> str:
    values = tensor._values
    if isinstance(values, ExternalValues):
        return f"@{values.source.path.name}+{values.source.offset}"
    nbytes = values.nbytes
    if nbytes > _HASH_LIMIT:
        return f"<{nbytes} bytes>"
    array = np.asarray(values.load() if isinstance(values, LazyValues) else values)
    if array.size <= _INLINE_VALUES:
        return "= " + np.array2string(array.ravel(), separator=",", precision=6, max_line_width=10**6)
    return "#" + hashlib.sha1(np.ascontiguousarray(array).tobytes()).hexdigest()[:12]
