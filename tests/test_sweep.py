"""qnnpasses sweep: the grid's cells, the best-cell rule, the markdown/JSON/PNG outputs, and a real run of
two cells on the HTP through the CLI (the full grid is a tool run: see the report)."""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pytest
from conftest import fixture_path, requires_htp

from qnnpasses.cli import main as cli
from qnnpasses.ir.load import load_model
from qnnpasses.quant import sweep as sweep_module
from qnnpasses.quant.data import token_windows
from qnnpasses.quant.policy import PrecisionPolicy
from qnnpasses.quant.sweep import (
    Cell,
    SweepResult,
    chart,
    grid,
    markdown,
    write_outputs,
)


def test_grid_is_weights_x_activations_x_sensitive_after_the_uniform_baseline():
    cells = grid()
    assert [c.label() for c in cells] == [
        "wuint8-pt a8 s8",
        "wint8-pt a8 s8", "wint8-pt a8 s16", "wint8-pt a16 s8", "wint8-pt a16 s16",
        "wint8-pc a8 s8", "wint8-pc a8 s16", "wint8-pc a16 s8", "wint8-pc a16 s16"]
    assert grid("uint8", kv_bits=8)[0].label() == "wuint8-pt a8 s8 kv8"
    assert len(grid("uint8")) == 8  # the baseline is already a cell


def test_grid_gains_the_int4_and_outlier_axes():
    cells = grid(int4=True, outliers=("", "fold-norm-weights,rotate-residual"))
    labels = [c.label() for c in cells]
    assert len(cells) == 1 + 2 * 9
    assert "wint4-pc a16 s16 mse" in labels and "wint4-pc a16 s16 mse rot" in labels
    assert "wint8-pc a16 s16 rot" in labels and labels.index("wint8-pc a16 s16 rot") > labels.index("wint4-pc a16 s16 mse")


def _cell(policy: PrecisionPolicy, cosine=None, top1=None, partitions=1, cpu=0, status="ok") -> Cell:
    return Cell(policy.label(), asdict(policy), status=status, qnn_partitions=partitions, cpu_nodes=cpu,
                cosine=cosine, max_abs=None if cosine is None else 0.01, top1=top1,
                perplexity=None if top1 is None else 250.0, reference_perplexity=None if top1 is None else 249.0)


def _result() -> SweepResult:
    pt, pc, w16 = (PrecisionPolicy(per_channel=False), PrecisionPolicy(act="uint8"),
                   PrecisionPolicy(weights="int16"))
    cells = [_cell(pt, 0.9990, 0.95), _cell(pc, 0.9995, 0.93), _cell(w16, 0.99999, 1.0),
             _cell(PrecisionPolicy(act="uint8", sensitive_bits=8), 0.99999, 1.0, partitions=3, cpu=5),
             _cell(PrecisionPolicy(act="uint8", per_channel=False), status="refused: could not create op")]
    return SweepResult("m.onnx", cells, 64, 16, [])


def test_best_cell_is_fully_on_htp_with_8_bit_weights_ranked_by_cosine():
    result = _result()
    assert result.best().label == "wint8-pc a8 s16"  # int16 weights and the CPU-placed cell do not count
    assert result.best(weights_bits=None).label == "wint16-pc a16 s16"
    assert result.as_dict()["best_8bit_weight_cell"] == "wint8-pc a8 s16"


def test_outputs_table_json_and_chart(tmp_path):
    result = _result()
    text = markdown(result)
    rows = [line for line in text.splitlines() if line.startswith("| w")]
    assert len(rows) == 5
    assert "| wint8-pc a8 s16 **best** | int8 per-channel | uint8 | 16-bit | none | 1 | 0 | 0.999500 |" in text
    assert "refused: could not create op" in text and "250.00 (249.00)" in text
    files = write_outputs(result, tmp_path)
    assert json.loads(files["json"].read_text())["cells"][4]["status"].startswith("refused")
    assert files["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert chart(SweepResult("m.onnx", result.cells[4:], 1, 1, []), tmp_path / "none.png") is None


@requires_htp
def test_cli_runs_cells_on_the_htp(tmp_path, monkeypatch, capsys):
    ir = load_model(fixture_path("llama_gqa_ts"))
    np.savez(tmp_path / "calib.npz", **token_windows(ir, 16, seed=0, part="calib"))
    np.savez(tmp_path / "eval.npz", **token_windows(ir, 4, seed=0, part="eval"))
    two = [PrecisionPolicy(act="uint8", weights="uint8", per_channel=False, sensitive_bits=8), PrecisionPolicy()]
    monkeypatch.setattr(sweep_module, "grid", lambda *a, **k: two)
    out = tmp_path / "sweep"
    code = cli(["sweep", str(fixture_path("llama_gqa_ts")), "--calib", str(tmp_path / "calib.npz"),
                "--eval", str(tmp_path / "eval.npz"), "-o", str(out), "--keep-models"])
    assert code == 0
    assert "wint8-pc a16 s16 **best**" in capsys.readouterr().out
    report = json.loads((out / "sweep.json").read_text())
    assert report["eval_samples"] == 4 and report["calibration_samples"] == 16
    cells = report["cells"]
    assert [c["label"] for c in cells] == ["wuint8-pt a8 s8", "wint8-pc a16 s16"]
    assert all(c["status"] == "ok" and c["qnn_partitions"] == 1 and c["cpu_nodes"] == 0 for c in cells)
    assert cells[1]["cosine"] > cells[0]["cosine"] and cells[1]["cosine"] > 0.999
    assert (out / "sweep.png").exists() and len(list((out / "cells").glob("*.onnx"))) == 2
    mask = next(p for p in report["prep"] if p["pass"] == "quant-mask")
    assert mask["status"] == "changed"


def test_cli_needs_both_data_sets(capsys):
    with pytest.raises(SystemExit) as info:
        cli(["sweep", str(fixture_path("llama_gqa_ts")), "--calib", "c.npz"])
    assert info.value.code == 2 and "--eval" in capsys.readouterr().err
