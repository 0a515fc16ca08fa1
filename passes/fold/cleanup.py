"""cleanup: remove nodes and tensors that no graph output depends on, then sort topologically.

Safe because nothing that reaches an output is touched; graph inputs stay even when
unused, so the model's interface does not change.
"""

from __future__ import annotations

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import EXACT, Pass, PassContext, PassResult, register_pass
from qnnpasses.passmanager.rewrite import finish


@register_pass
class Cleanup(Pass):
    name = "cleanup"
    summary = "dead-code removal and a topological sort"
    contract = EXACT
    requires = frozenset()
    ensures = frozenset()

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:
        before = len(ir.graph.nodes)
        finish(ir)
        removed = before - len(ir.graph.nodes)
        return PassResult(changed=removed > 0, stats={"removed_nodes": removed})
