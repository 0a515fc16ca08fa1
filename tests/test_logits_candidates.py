"""tools/logits_candidates.py: docs/logits_offset.md is what the tool renders from its JSON, and
the near-tie count it reports follows fp16's spacing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import logits_candidates as lc


def test_the_doc_is_the_render_of_its_json():
    doc = json.loads((ROOT / "docs" / "logits_offset.json").read_text())
    assert (ROOT / "docs" / "logits_offset.md").read_text() == lc.render(doc)


def test_spacing_is_fp16_s_distance_to_the_next_value():
    assert lc.spacing(np.array([20.0, -20.0, 0.5, 0.0])).tolist() == [2 ** -6, 2 ** -6, 2 ** -11, 2 ** -24]


def test_every_offset_form_leaves_no_more_near_ties_than_plain_logits():
    """Measured on trained models: every row of the doc, per split, leaves at most the plain
    logits' near-ties, and offsetting by every token's maximum leaves none."""
    doc = json.loads((ROOT / "docs" / "logits_offset.json").read_text())
    for res in doc["models"].values():
        for data in res["splits"].values():
            assert all(row["unresolved"] <= data["plain_unresolved"] for row in data["rows"])
            assert data["rows"][-1]["candidates"] == res["vocab"] and data["rows"][-1]["unresolved"] == 0
