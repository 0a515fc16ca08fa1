"""The ONNX operator corpus (onnx's backend node tests) through htp-llm and the busiest passes.

A fixed sample (400) of the ~1,900 single-op (and function-expanded) models from
``tools/op_corpus.py`` runs through the ``htp-llm`` pipeline, the bare load+save, and,
alone, the passes that rewrite most often on arbitrary ops in the full corpus
(``layout``, ``lower-int64``, ``simplify``, ``rotary``); ~50 s on 2 cores.  Nothing may crash (no exception escapes loading, the manager or saving;
the saved model passes the checker and runs) and nothing may come out computing
something else than the original on onnxruntime CPU.  A pass that raises and is rolled
back by the manager is counted by the tool but is not a failure here.

The cases are generated once into ``~/.cache/qnnpasses/op_corpus`` (``QNNPASSES_OP_CORPUS``
moves it).  The full corpus: ``python tools/op_corpus.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import op_corpus

SAMPLE = 400
SEED = 20240601
TARGETS = [op_corpus.BASELINE, "pipeline:htp-llm", "layout", "lower-int64", "simplify", "rotary"]


@pytest.fixture(scope="module")
def results():
    names = op_corpus.sample(op_corpus.generate(), SAMPLE, SEED)
    return op_corpus.run_corpus(names, TARGETS, jobs=2, timeout=60)


def test_every_case_and_target_has_an_outcome(results):
    assert len(results) == SAMPLE * len(TARGETS)
    assert {r["outcome"] for r in results} <= set(op_corpus.OUTCOMES)
    by_target = op_corpus.summarize(results)["per_target"]
    # the sample really exercises the passes: the pipeline rewrites a good share of the ops
    assert by_target["pipeline:htp-llm"].get("rewritten-equal", 0) >= SAMPLE // 10


def test_nothing_crashes_or_mismatches(results):
    failures = [f"{r['outcome']}: {r['target']} on {r['case']}: {r['reason']} {r.get('where', '')}"
                for r in results if r["outcome"] in op_corpus.FAILURES]
    assert not failures, "\n".join(failures)
