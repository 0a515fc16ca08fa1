"""``Pass.anchor_ops``: a pass that declares them finds nothing to rewrite in a graph without them.

The manager does not run such a pass on such a graph; here every built-in pass that declares
anchors is run anyway, on every committed export where its anchors are absent, before and after
htp-llm's folding, and must leave the graph as it was (by the manager's own fingerprint)."""

from __future__ import annotations

import pytest
from conftest import FIXTURE_NAMES, fixture_path

from qnnpasses.ir.fingerprint import fingerprint
from qnnpasses.ir.load import load_model
from qnnpasses.passmanager.api import PassContext, registered_passes
from qnnpasses.passmanager.manager import PassManager, RunConfig
from qnnpasses.passmanager.spec import parse_pipeline

# the built-in passes (other test modules register passes of their own)
ANCHORED = sorted(name for name, cls in registered_passes().items()
                  if cls.anchor_ops and cls.__module__.startswith("qnnpasses.passes."))


def _ops(ir) -> set[str]:
    return {node.op for graph in ir.graphs() for node in graph.nodes}


def test_the_htp_llm_lowerings_declare_their_anchors():
    assert {"lower-gqa", "lower-mha", "lower-rotary-embedding", "lower-simplified-norm", "lower-matmulnbits",
            "gathernd", "fold-conv-affine", "decompose-gelu", "fuse-gelu", "fp16-safety"} <= set(ANCHORED)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_an_anchored_pass_changes_nothing_without_its_anchors(name):
    ir = load_model(fixture_path(name))
    stages = [ir.copy()]
    PassManager(parse_pipeline("fix-shapes,simplify"), RunConfig(verify=False)).run(ir)
    stages.append(ir)
    tried = 0
    for stage in stages:
        present = _ops(stage)
        for pass_name in ANCHORED:
            pass_cls = registered_passes()[pass_name]
            if pass_cls.anchor_ops & present:
                continue
            graph = stage.copy()
            before = fingerprint(graph)
            pass_cls().run(graph, PassContext(allow_lossy=True))
            assert before.same_graph(fingerprint(graph)), f"{pass_name} changed {name} without {pass_cls.anchor_ops}"
            tried += 1
    assert tried
