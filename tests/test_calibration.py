"""Calibration data: every accepted layout reads back the same samples, one at a time; every mismatch
with the model (names, dtypes, shapes, counts, raw sizes) is a one-line error naming both sides."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import numpy as np
import pytest
from conftest import fixture_path

from qnnpasses.errors import BadInputError
from qnnpasses.ir.load import load_model
from qnnpasses.quant.calibration import (
    LABELS,
    CalibrationData,
    InputSpec,
    load_data,
    model_inputs,
    write_input_list,
)
from qnnpasses.quant.data import token_windows

SPECS = [InputSpec("input_ids", np.dtype(np.int64), (1, 8)), InputSpec("attention_mask", np.dtype(np.int64), (1, 8))]


def _samples(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(0, 256, (1, 8)), "attention_mask": np.ones((1, 8), np.int64)} for _ in range(n)]


def _same(data: CalibrationData, samples: list[dict[str, np.ndarray]]) -> None:
    assert len(data) == len(samples)
    for i, want in enumerate(samples):
        got = data[i]
        assert set(got) == set(want)
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
            np.testing.assert_array_equal(got[k], want[k])


def test_npz_one_sample_stack_and_token_rows(tmp_path):
    samples = _samples(5)
    np.savez(tmp_path / "one.npz", **samples[0])
    _same(CalibrationData(tmp_path / "one.npz", SPECS), samples[:1])
    np.savez(tmp_path / "stack.npz", **{k: np.stack([s[k] for s in samples]) for k in samples[0]})  # (N, 1, 8)
    _same(CalibrationData(tmp_path / "stack.npz", SPECS), samples)
    np.savez(tmp_path / "rows.npz", **{k: np.concatenate([s[k] for s in samples]) for k in samples[0]})  # (N, 8)
    _same(CalibrationData(tmp_path / "rows.npz", SPECS), samples)


def test_stacks_are_memory_mapped_and_read_one_sample_at_a_time(tmp_path):
    samples = _samples(6)
    np.savez(tmp_path / "stack.npz", **{k: np.stack([s[k] for s in samples]) for k in samples[0]})
    data = CalibrationData(tmp_path / "stack.npz", SPECS)
    first = data[0]
    assert len(data.stacks) == 2 and all(isinstance(s.array(), np.memmap) for s in data.stacks)  # never copied whole
    reader = data.reader(limit=4)
    served = list(reader)
    assert len(served) == 4 and reader.get_next() is None
    np.testing.assert_array_equal(served[0]["input_ids"], first["input_ids"])
    reader.rewind()
    assert reader.get_next() is not None


def test_compressed_npz_folder_of_npz_and_per_input_npy(tmp_path):
    samples = _samples(4)
    np.savez_compressed(tmp_path / "c.npz", **{k: np.stack([s[k] for s in samples]) for k in samples[0]})
    _same(CalibrationData(tmp_path / "c.npz", SPECS), samples)
    folder = tmp_path / "many"
    folder.mkdir()
    for i, s in enumerate(samples):
        np.savez(folder / f"s{i:02d}.npz", **s)
    _same(CalibrationData(folder, SPECS), samples)
    per_input = tmp_path / "per_input"
    per_input.mkdir()
    for k in samples[0]:
        np.save(per_input / f"{k}.npy", np.stack([s[k] for s in samples]))
    np.save(per_input / f"{LABELS}.npy", np.stack([s["input_ids"] for s in samples]))
    data = CalibrationData(per_input, SPECS)
    _same(data, samples)
    np.testing.assert_array_equal(data.labels(2), samples[2]["input_ids"])


def test_single_input_npy_and_input_list_round_trip(tmp_path):
    spec = [InputSpec("x", np.dtype(np.float32), (2, 3))]
    values = np.random.default_rng(0).standard_normal((3, 2, 3)).astype(np.float32)
    np.save(tmp_path / "x.npy", values)
    _same(CalibrationData(tmp_path / "x.npy", spec), [{"x": v} for v in values])
    samples = _samples(3)
    listing = write_input_list(samples, tmp_path / "raw")
    assert listing.read_text().splitlines()[0].startswith("input_ids:=00000_input_ids.raw attention_mask:=")
    _same(CalibrationData(listing, SPECS), samples)


def test_labels_travel_with_the_samples_and_extra_arrays_are_ignored(tmp_path):
    samples = _samples(3)
    stacked = {k: np.stack([s[k] for s in samples]) for k in samples[0]}
    np.savez(tmp_path / "d.npz", **stacked, labels=stacked["input_ids"] + 1, kind=np.array("causal-lm"))
    data = CalibrationData(tmp_path / "d.npz", SPECS)
    _same(data, samples)
    np.testing.assert_array_equal(data.labels(1), samples[1]["input_ids"] + 1)


@pytest.mark.parametrize("case, message", [
    ("missing", "no array for model input(s) ['attention_mask'] (the file has ['input_ids', 'mask'])"),
    ("dtype", "input 'input_ids' has dtype int32, the model wants int64"),
    ("shape", "input 'input_ids' has shape [3, 1, 9], the model wants [1, 8]"),
    ("counts", "inputs hold different numbers of samples {'input_ids': 3, 'attention_mask': 2}"),
])
def test_mismatches_are_one_line_errors(tmp_path, case, message):
    stacked = {k: np.stack([s[k] for s in _samples(3)]) for k in ("input_ids", "attention_mask")}
    if case == "missing":
        stacked["mask"] = stacked.pop("attention_mask")
    elif case == "dtype":
        stacked["input_ids"] = stacked["input_ids"].astype(np.int32)
    elif case == "shape":
        stacked["input_ids"] = np.zeros((3, 1, 9), np.int64)
    else:
        stacked["attention_mask"] = stacked["attention_mask"][:2]
    np.savez(tmp_path / "bad.npz", **stacked)
    with pytest.raises(BadInputError) as info:
        CalibrationData(tmp_path / "bad.npz", SPECS)
    text = str(info.value)
    assert message in text and "bad.npz" in text and "\n" not in text


def test_input_list_errors_name_the_line(tmp_path):
    samples = _samples(2)
    listing = write_input_list(samples, tmp_path)
    (tmp_path / "unknown.txt").write_text("input_ids:=00000_input_ids.raw ids:=x.raw\n")
    with pytest.raises(BadInputError, match=r"unknown.txt:1: 'ids' is not a model input"):
        CalibrationData(tmp_path / "unknown.txt", SPECS)
    (tmp_path / "short.txt").write_text("input_ids:=00000_input_ids.raw\n")
    with pytest.raises(BadInputError, match=r"short.txt:1: no file for model input\(s\) \['attention_mask'\]"):
        CalibrationData(tmp_path / "short.txt", SPECS)
    (tmp_path / "00000_input_ids.raw").write_bytes(b"\0" * 32)  # int32-sized, the model wants int64
    data = CalibrationData(listing, SPECS)
    with pytest.raises(BadInputError, match=r"00000_input_ids.raw has 32 bytes; input 'input_ids' \[1, 8\] int64 needs 64"):
        data[0]


def test_unusable_sources(tmp_path):
    with pytest.raises(BadInputError, match="calibration data not found"):
        CalibrationData(tmp_path / "nope.npz", SPECS)
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInputError, match="no .npz or .npy files"):
        CalibrationData(tmp_path / "empty", SPECS)
    np.save(tmp_path / "x.npy", np.zeros((1, 8), np.int64))
    with pytest.raises(BadInputError, match="a .npy file holds one array but the model has 2 inputs"):
        CalibrationData(tmp_path / "x.npy", SPECS)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(BadInputError, match="not an .npz archive"):
        CalibrationData(tmp_path / "junk.npz", SPECS)
    (tmp_path / "data.csv").write_text("1,2")
    with pytest.raises(BadInputError, match="must be .npz, .npy"):
        CalibrationData(tmp_path / "data.csv", SPECS)


def test_token_windows_are_seeded_disjoint_and_fit_the_model(tmp_path):
    ir = load_model(fixture_path("llama_gqa_ts"))
    calib = token_windows(ir, 16, seed=3, part="calib")
    again = token_windows(ir, 16, seed=3, part="calib")
    evals = token_windows(ir, 8, seed=3, part="eval")
    np.testing.assert_array_equal(calib["input_ids"], again["input_ids"])
    assert calib["input_ids"].shape == (16, 1, 16) and calib[LABELS].shape == (16, 1, 16)
    np.testing.assert_array_equal(calib[LABELS][:, :, :-1], calib["input_ids"][:, :, 1:])  # next tokens
    seen = {tuple(w.ravel()) for w in calib["input_ids"]}
    assert not any(tuple(w.ravel()) in seen for w in evals["input_ids"])
    np.savez(tmp_path / "c.npz", **calib)
    data = load_data(tmp_path / "c.npz", ir)
    assert len(data) == 16 and data.labels(0).shape == (1, 16)


def test_kv_windows_carry_a_real_cache():
    ir = load_model(fixture_path("llama_gqa_kv_ts"))
    windows = token_windows(ir, 2, seed=0)
    past = windows["past_key_values.0.key"]
    assert past.shape == (2, 1, 2, 8, 16)
    assert np.all(np.abs(past).sum(axis=-1) > 0)  # every slot filled by the model, none left at zero
    assert windows["attention_mask"].min() == 1 and windows[LABELS].shape == (2, 1, 1)
    assert [s.name for s in model_inputs(ir)][:2] == ["input_ids", "attention_mask"]


def test_cli_writes_windows(tmp_path):
    out = tmp_path / "w.npz"
    proc = subprocess.run([sys.executable, "-m", "qnnpasses.quant.data", str(fixture_path("gpt2_ts")), "-o", str(out),
                           "--count", "4", "--part", "eval"], capture_output=True, text=True, check=True)
    assert "wrote 4 eval windows" in proc.stdout
    with zipfile.ZipFile(out) as archive:
        assert {"input_ids.npy", "attention_mask.npy", "labels.npy"} <= set(archive.namelist())
