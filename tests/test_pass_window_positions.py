"""window-positions: a sliding-window mask folded in cache-slot order follows the token positions.

`mistral_kv_dyn_*` (tools/export_fixtures.py) is Mistral with sliding_window=8, default attention
and a position_ids input.  The build's CPU check runs a prompt and decode steps past the window
against the original export (which computes the window from positions, like transformers).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import fixture_path

from qnnpasses.errors import CheckFailedError
from qnnpasses.llm import convert
from qnnpasses.passes.kvcache.window_positions import slot_window


def _slot_mask(past: int, tokens: int, window: int) -> np.ndarray:
    query = past + np.arange(tokens)[:, None]
    key = np.arange(past + tokens)[None, :]
    return (key <= query) & (key > query - window)


def test_slot_window_reads_the_window_and_nothing_else():
    assert slot_window(_slot_mask(60, 4, 8), 60) == 8
    assert slot_window(_slot_mask(63, 1, 5), 63) == 5
    assert slot_window(_slot_mask(60, 4, 64), 60) is None  # causal only: slot order is right already
    shifted = _slot_mask(60, 4, 8)
    shifted[2, 40] = True
    assert slot_window(shifted, 60) is None
    assert slot_window(_slot_mask(60, 4, 8), 59) is None  # not [M, past + M]


@pytest.mark.parametrize("name", ["mistral_kv_dyn_ts", "mistral_kv_dyn_dynamo"])
def test_window_pair_matches_the_original_past_the_window(name, tmp_path):
    manifest = convert.build(fixture_path(name), tmp_path / "pair", context=64, prefill=1, compile=False)
    report = (tmp_path / "pair" / "report.json").read_text()
    assert '"window-positions"' in report
    check = convert.json.loads(report)["verification"]
    assert check["prompt_tokens"] + check["new_tokens"] > 8  # the sequence crosses the window of 8
    assert check["ok"] and check["logits"] <= 1e-4  # the new K/V: fp16's rounding (float16 cache), in "ok"
    assert manifest["graphs"]["decode"]["past"] == 63
    assert manifest["sliding_window"] == {"0": 8, "1": 8}


def test_without_the_pass_the_check_refuses_the_pair(tmp_path, monkeypatch):
    """The window in slot order hides every cached token: the CPU check must catch it."""
    monkeypatch.setattr(convert, "STATIC_CACHE_PIPELINE", convert.STATIC_CACHE_PIPELINE.replace("window-positions,", ""))
    with pytest.raises(CheckFailedError, match="differs from the original"):
        convert.build(fixture_path("mistral_kv_dyn_ts"), tmp_path / "pair", context=64, prefill=1, compile=False)
    assert not (tmp_path / "pair").exists()
