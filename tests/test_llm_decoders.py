"""Every decoder family a user brings, exported the default way, becomes a correct pair.

The matrix (`tools/decoder_matrix.py`, built on first use into `~/.cache/qnnpasses/decoders`,
a few minutes): tiny random-initialised decoders of 15 Hugging Face families x {sdpa (transformers'
default, attention left alone), eager} x {TorchScript, dynamo}, each exported with a dynamic KV
cache, with transformers' own greedy tokens stored beside it (20 new tokens after a 12-token
prompt: sliding windows of 8 are crossed).  For every fixture, through the command line
(`tools/decoder_eval.py`, which also writes docs/decoders.md): `qnnpasses llm` builds the pair
(context 64, prefill 4; 1 where the export only computes one token at a time), its CPU check
against the original fed by its HF names holds to 1e-4, `qnnpasses generate --on cpu` gives
transformers' tokens, both graphs are 1 HTP partition with 0 CPU nodes in fp16 (the build's own
probe on the backend), and llm.json names the config's sliding layers and their window.

Random tied-embedding families (gemma, gpt2, smollm3) greedily repeat the last prompt token, so
their tokens say little; their CPU check against the export (itself within 1e-6 of torch) does.
"""

from __future__ import annotations

import fcntl
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


def _local_layers(entry: dict) -> dict[str, int]:
    """What llm.json's sliding_window must say: the config's sliding layers and their window."""
    window = entry["sliding_window"]
    if not window:
        return {}
    types = entry["layer_types"] or ["sliding_attention"] * 2
    return {str(i): window for i, kind in enumerate(types) if kind == "sliding_attention"}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_export_of_a_family_generates_transformers_tokens(family, matrix, tmp_path):
    import decoder_eval

    for variant in VARIANTS:
        entry = matrix[f"{family}_{variant}"]
        assert entry["status"] == "ok", (entry["name"], entry["reason"])
        assert entry["onnx_vs_torch_max_abs"] <= 1e-4, entry["name"]
        result = decoder_eval.evaluate(entry, tmp_path)
        assert result["stage"] == "done", result
        assert result["cpu_check_logits_max_abs"] <= 1e-4 and result["reference_fed_by"] == "names", result
        assert result["cpu_check_ok"] and result["kv_dtype"] == "float16", result
        assert result["htp_ok"], (result["name"], result["htp_partitions"], result["htp_cpu_nodes"])
        assert result["tokens"] == entry["hf_tokens"], (result["name"], result["prefill"])
        assert result["sliding_window"] == _local_layers(entry), result["name"]


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_a_post_norm_stream_past_fp16_range_is_scaled_exactly(family, matrix, tmp_path):
    """Gemma's form of the stream (the embedding times sqrt(hidden), post-norms written into it), made loud
    by scaling the embedding table: scale-residual finds every writer and changes no fp32 logit."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from qnnpasses.backends.cpu import run_cpu
    from qnnpasses.ir.load import load_model
    from qnnpasses.ir.model import save_model
    from qnnpasses.passes.outliers._stream import find_stream
    from qnnpasses.passmanager.manager import PassManager
    from qnnpasses.passmanager.named import get_pipeline
    from qnnpasses.passmanager.spec import parse_pipeline

    out = Path(os.environ.get("QNNPASSES_DECODERS", "~/.cache/qnnpasses/decoders")).expanduser()
    entry = matrix[f"{family}_sdpa_ts"]
    model = onnx.load(str(out / entry["onnx"]))
    table = max((i for i in model.graph.initializer if len(i.dims) == 2), key=lambda i: i.dims[0] * i.dims[1])
    table.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(table) * np.float32(2.0 ** 18), table.name))
    onnx.save(model, str(tmp_path / "loud.onnx"))
    ir = load_model(tmp_path / "loud.onnx")
    PassManager(parse_pipeline(get_pipeline("htp-llm").to_text())).run(ir)
    prepared = save_model(ir, tmp_path / "prepared.onnx")
    stream, why = find_stream(ir.graph, scaling=True)
    layers = len(entry["layer_types"] or [0, 0])
    assert stream is not None, why
    assert (len(stream.embedding_scales), len(stream.norm_writers), len(stream.writers)) == (1, 2 * layers, 0)
    result = PassManager(parse_pipeline("scale-residual,cleanup")).run(ir)
    record = result.records[0]
    assert record.status == "changed" and record.stats["shift"] >= 1, record.stats
    scaled = save_model(ir, tmp_path / "scaled.onnx")
    rng = np.random.default_rng(0)
    feed = {t.name: (rng.integers(0, 50, t.shape).astype(np.int64) if np.dtype(t.dtype).kind == "i"
                     else rng.standard_normal(t.shape).astype(t.dtype)) for t in load_model(prepared).graph.inputs}
    want, got = run_cpu(prepared, feed), run_cpu(scaled, feed)
    assert all(np.array_equal(want[k], got[k]) for k in want)
