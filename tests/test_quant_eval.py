"""tools/quant_eval.py: GPTQ cells parse into the policy they name, and the report sets each GPTQ cell next to its
nearest-rounding cell and says by how much a missed target is missed (figures from the results, none typed in)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import quant_eval as qe


def test_gptq_cells_parse_into_policy_fields():
    assert qe.precision_fields("w4a16r16b32gptq") == {"act": "uint16", "weights": "int4", "weight_scales": "mse",
                                                      "raise": 16, "block_size": 32, "weight_rounding": "gptq"}
    assert qe.precision_fields("w8a16gptqa")["weight_rounding"] == "gptq-act"
    assert qe.parse_cell("smollm2:w4a16b32gptq+rot") == ("smollm2_135m", "w4a16b32gptq", "rot")
    with pytest.raises(SystemExit, match="bad precision"):
        qe.precision_fields("w4a16gptqb32")


def _window(top1: int, nll_got: float, tokens: int = 100) -> dict:
    return {"dot": 1.0, "rr": 1.0, "gg": 1.0, "max_abs": 0.1, "tokens": tokens, "top1": top1, "nll_ref": 300.0,
            "nll_got": nll_got}


def test_report_compares_gptq_with_nearest_and_states_the_shortfall():
    place = [{"qnn_partitions": 1, "cpu_nodes": 0}]
    weights = {"output_error_gptq_over_nearest": 0.1, "hessian_seconds": 10.0, "gptq_seconds": 5.0}
    results = {"calibration_windows": 8, "cells": {
        "smollm2:w4a16b32+rot": {"windows": {"0": _window(60, 340.0)}, "placements": place},
        "smollm2:w4a16b32gptq+rot": {"windows": {"0": _window(84, 303.0)}, "placements": place,
                                     "record": {"policy": "wint4-b32 a16 s16 mse gptq", "weights": weights}}}}
    text = qe.render(results)
    assert "## What GPTQ rounding changes" in text
    assert "`smollm2:w4a16b32gptq+rot` (HTP, 1 / 1 windows): top-1 60.0% -> 84.0%" in text
    assert "output error ×0.100 of nearest" in text
    assert "top1 0.8400 ± 0.0367 over 100 tokens (short of 0.85 by 0.0100); ppl_ratio 1.0305 (met)" in text
    assert "Why w4a16 still falls short: the best cell (`smollm2:w4a16b32gptq+rot`) misses top1 by 0.0100" in text
