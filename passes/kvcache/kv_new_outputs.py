"""kv-new-outputs: a ``present = Concat(past, new)`` graph output -> the ``new`` tensor only.

Matches: graph outputs computed by a Concat of two tensors, the first a graph input (looking
through Identity and one-input Concats), the second computed by the graph: an HF export's
``present.i.key/value = Concat(past_key_values.i.*, new K/V, axis=seq)``.

Produces: the graph outputs the new tensor instead, named like the old output with ``present``
replaced by ``new`` (``present.0.key`` -> ``new.0.key``; a name without ``present`` gets a
``.new`` suffix).  The Concat stays for whatever else reads it (the attention), until
``kv-split-concat`` removes it.

Why it is safe: the new output is exactly the slice ``present[..., past_len:, :]`` of the old
one; nothing else changes.  It changes the interface on purpose: a runner that owns a
static cache writes the new entries itself instead of copying the whole cache out each step.

Verification: the outputs before and after are not the same tensors (not a rename), so the
manager's ``--verify`` cannot compare them; ``qnnpasses llm`` checks the finished pair against
the original export instead (a chunked prompt with padding, then decode steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import Pass, PassContext, PassResult, changes_interface, register_pass
from qnnpasses.passmanager.rewrite import finish, is_graph_input, is_graph_output, producer


def graph_input_behind(tensor: gs.Tensor, graph: gs.Graph) -> gs.Tensor | None:
    """The graph input ``tensor`` is, looking back through Identity and one-input Concats."""
    while not is_graph_input(graph, tensor):
        node = producer(tensor)
        if node is None or not (node.op == "Identity" or (node.op == "Concat" and len(node.inputs) == 1)):
            return None
        tensor = node.inputs[0]
    return tensor


def new_output_name(name: str, old: str, new: str) -> str:
    return name.replace(old, new, 1) if old in name else f"{name}.new"


@register_pass
class KvNewOutputs(Pass):
    name = "kv-new-outputs"
    summary = "graph output Concat(past input, new) -> output only the new K/V"
    lossless = False  # the outputs change on purpose
    contract = changes_interface("present.* outputs become the new K/V only")

    @dataclass
    class Options:
        replace: str = "present"
        by: str = "new"

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        graph = ir.graph
        taken = set(graph.tensors())
        outputs = list(graph.outputs)
        renamed = {}
        for index, out in enumerate(outputs):
            node = producer(out)
            if node is None or node.op != "Concat" or len(node.inputs) != 2:
                continue
            past, new = node.inputs
            if graph_input_behind(past, graph) is None or isinstance(new, gs.Constant) or is_graph_input(graph, new) \
                    or is_graph_output(graph, new) or not new.inputs:
                continue
            name = new_output_name(out.name, self.options.replace, self.options.by)
            if name in taken and name != new.name:
                continue
            taken.add(name)
            new.name = name
            if new.dtype is None:
                new.dtype = out.dtype
            outputs[index] = new
            renamed[out.name] = name
        if not renamed:
            return PassResult(changed=False)
        graph.outputs = outputs
        finish(ir)
        return PassResult(changed=True, stats={"outputs": len(renamed)},
                          notes=[f"{a} -> {b}" for a, b in renamed.items()])
