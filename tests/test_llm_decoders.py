"""Every decoder family a user brings, exported the default way, becomes a correct pair.

The matrix (`tools/decoder_matrix.py`, built on first use into `~/.cache/qnnpasses/decoders`,
a few minutes): tiny random-initialised decoders of 15 Hugging Face families x {sdpa (transformers'
default, attention left alone), eager} x {TorchScript, dynamo}, each exported with a dynamic KV
cache, with transformers' own greedy tokens stored beside it (20 new tokens after a 12-token
prompt: sliding windows of 8 are crossed).  For every fixture `qnnpasses llm` builds the pair
(context 64, prefill 4; 1 where the export only computes one token at a time), its CPU check
against the original holds to 1e-4, `qnnpasses generate --on cpu` gives transformers' tokens, and
both graphs are 1 HTP partition with 0 CPU nodes in fp16 (the build's own probe on the backend).

Random tied-embedding families (gemma, gpt2, smollm3) greedily repeat the last prompt token, so
their tokens say little; their CPU check against the export (itself within 1e-6 of torch) does.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import requires_htp

pytestmark = [pytest.mark.decoders, requires_htp]

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ["gemma", "gemma2", "gemma3_text", "gpt2", "gpt_neox", "granite", "llama", "mistral", "olmo2", "phi",
            "phi3", "qwen2", "qwen3", "smollm3", "stablelm"]
VARIANTS = [f"{attn}_{exporter}" for attn in ("sdpa", "eager") for exporter in ("ts", "dynamo")]


@pytest.fixture(scope="session")
def matrix() -> dict[str, dict]:
    """The ok matrix entries by name, built once per machine (a lock keeps xdist workers from racing)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "tools"))
    import decoder_matrix

    out = Path(os.environ.get("QNNPASSES_DECODERS", decoder_matrix.DEFAULT_OUT)).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = decoder_matrix.load_matrix(out, include_failed=True) if (out / decoder_matrix.MATRIX).is_file() else []
        if len(entries) < len(FAMILIES) * len(VARIANTS):
            subprocess.run([sys.executable, str(ROOT / "tools" / "decoder_matrix.py"), "--out", str(out)], check=True,
                           capture_output=True)
            entries = decoder_matrix.load_matrix(out, include_failed=True)
    assert sorted(decoder_matrix.FAMILIES) == FAMILIES
    return {e["name"]: e for e in entries}


def _build(entry: dict, out: Path) -> tuple[subprocess.CompletedProcess, int]:
    for prefill in (4, 1):
        result = subprocess.run(["qnnpasses", "llm", entry["onnx_path"], "--out-dir", str(out), "--context", "64",
                                 "--prefill", str(prefill), "--no-compile"], capture_output=True, text=True)
        if result.returncode == 0 or "--prefill 1" not in result.stderr:
            return result, prefill
    return result, prefill


@pytest.mark.parametrize("family", FAMILIES)
def test_every_export_of_a_family_generates_transformers_tokens(family, matrix, tmp_path):
    for variant in VARIANTS:
        entry = matrix[f"{family}_{variant}"]
        assert entry["status"] == "ok", (entry["name"], entry["reason"])
        assert entry["onnx_vs_torch_max_abs"] <= 1e-4, entry["name"]
        out = tmp_path / entry["name"]
        result, prefill = _build(entry, out)
        assert result.returncode == 0, (entry["name"], result.stderr)
        report = json.loads((out / "report.json").read_text())
        assert report["verification"]["ok"] and report["verification"]["max_abs"] <= 1e-4, entry["name"]
        for graph in ("prefill", "decode"):
            for part in report["htp"][graph]["parts"]:
                assert (part["ok"], part["qnn_partitions"], part["cpu_nodes"]) == (True, 1, 0), (entry["name"], part)
        generated = subprocess.run(["qnnpasses", "generate", str(out), "--prompt-ids",
                                    ",".join(map(str, entry["prompt_ids"])), "--max-new-tokens",
                                    str(len(entry["hf_tokens"])), "--on", "cpu", "--format", "json"],
                                   capture_output=True, text=True)
        assert generated.returncode == 0, (entry["name"], generated.stderr)
        assert json.loads(generated.stdout)["tokens"] == entry["hf_tokens"], (entry["name"], prefill)
