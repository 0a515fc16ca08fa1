"""docs/weight_sharing.md is what tools/probe_weight_sharing.py writes, and its verdict for the
installed onnxruntime-qnn is what `qnnpasses llm`'s own toy-pair probe finds on this backend."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conftest import requires_htp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import probe_weight_sharing as tool  # noqa: E402


def _entries() -> list[dict]:
    return json.loads(tool.DOC_JSON.read_text())["entries"]


def test_the_doc_is_what_the_tool_writes():
    assert tool.render(_entries()) == tool.DOC_MD.read_text()


def test_the_doc_covers_every_variant_of_every_version():
    entries = _entries()
    versions = {e["version"] for e in entries}
    assert {(e["version"], e["variant"]) for e in entries} == {(v, w) for v in versions for w in tool.VARIANTS}


@requires_htp
def test_the_installed_version_behaves_as_the_doc_says():
    import onnxruntime_qnn

    from qnnpasses.llm.compile import backend_shares_weights

    installed = onnxruntime_qnn.__version__
    documented = {e["variant"]: e for e in _entries() if e["version"] == installed}
    assert documented, f"docs/weight_sharing.json has no entry for onnxruntime-qnn {installed}: rerun the tool"
    verdict = backend_shares_weights()
    assert verdict["compile"] == ("compile 2" in documented["grouped"]["done"])
    assert verdict["run"] == documented["grouped"]["ok"]
