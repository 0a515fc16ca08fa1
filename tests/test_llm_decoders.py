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


def _int8_sqnr(weight):
    """SQNR (dB) of ``weight`` rounded to symmetric per-output-channel int8 (the w8a16 weights)."""
    import numpy as np

    step = np.abs(weight).max(axis=0, keepdims=True) / 127
    error = weight - np.round(weight / step) * step
    return 10 * np.log10(np.sum(weight ** 2) / np.sum(error ** 2))


def _with_trained_like_norm_scales(entry: dict, tmp_path: Path) -> tuple[Path, dict]:
    """The matrix fixture after ``htp-llm`` with every RMSNorm scale drawn from uniform(0.2, 3) but one
    channel at 100 (a trained Gemma's span): (its file, the scales by norm name)."""
    import numpy as np
    import onnx_graphsurgeon as gs

    from qnnpasses.ir.load import load_model
    from qnnpasses.ir.model import save_model
    from qnnpasses.passmanager.manager import PassManager
    from qnnpasses.passmanager.named import get_pipeline
    from qnnpasses.passmanager.rewrite import constant_value

    out = Path(os.environ.get("QNNPASSES_DECODERS", "~/.cache/qnnpasses/decoders")).expanduser()
    ir = load_model(out / entry["onnx"])
    PassManager(get_pipeline("htp-llm")).run(ir)
    rng = np.random.default_rng(0)
    gammas = {}
    for node in ir.graph.nodes:
        if node.op == "RMSNormalization":
            gamma = rng.uniform(0.2, 3.0, constant_value(node.inputs[1]).shape)
            gamma[rng.integers(0, gamma.size)] = 100.0
            node.inputs[1] = gs.Constant(node.inputs[1].name + "_t", gamma.astype(np.float32))
            gammas[node.name] = gamma
    return save_model(ir, tmp_path / "prepared.onnx"), gammas


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_gemma_streams_rotate_through_their_post_norms_exactly(family, matrix, tmp_path):
    """Gemma's stream (embedding times sqrt(hidden), post-norms written into it) turned by a Hadamard
    matrix under the strict runner when asked (``post_norms=true``), with trained-like norm scales (one channel 100x the rest): every
    post-norm's scale moves into a new hidden x hidden MatMul whose per-channel 8-bit weights keep
    >= 5 dB more than diag(gamma)*R would (at hidden 64; a trained Gemma 3's post-norm scales span
    22x their root mean square at hidden 640: ~26 dB), and the outputs stay within the pass's tolerance."""
    import numpy as np
    from pass_testing import run_strictly

    from qnnpasses.passes.outliers._orthogonal import rotation
    from qnnpasses.passmanager.rewrite import constant_value

    entry = matrix[f"{family}_sdpa_ts"]
    prepared, gammas = _with_trained_like_norm_scales(entry, tmp_path)
    _, default = run_strictly(prepared, "fold-norm-weights,rotate-residual")  # only when asked: it adds weights
    assert default.status == "unchanged" and "post_norms=true" in " ".join(default.notes), default.notes
    rotated, record = run_strictly(prepared, "fold-norm-weights,rotate-residual{post_norms=true}")
    layers = len(entry["layer_types"] or [0, 0])
    assert record.status == "changed" and record.verification["ok"], record.reason
    assert (record.stats["writers"], record.stats["post_norms"], record.stats["post_norm_inputs_turned"]) == \
        (0, 2 * layers, 2 * layers), record.stats
    r, _ = rotation(record.stats["hidden"])
    added = [n for n in rotated.graph.nodes if n.op == "MatMul" and "_gamma_rot" in n.name]
    assert len(added) == 2 * layers
    for node in added:
        norm = node.inputs[0].inputs[0]
        assert np.all(constant_value(norm.inputs[1]) == 1)
        spread, plain = constant_value(node.inputs[1]), gammas[norm.name][:, None] * r
        assert _int8_sqnr(spread) >= _int8_sqnr(plain) + 5, (_int8_sqnr(spread), _int8_sqnr(plain))


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_stream_turned_back_after_each_norm_keeps_every_weight(family, matrix, tmp_path):
    """``unturn=true``: the stream is turned (embedding, writers, post-norm outputs) and turned back after
    each norm by a new MatMul ``R^T*diag(scale)``, under the strict runner, with the scales left unfolded:
    the projections keep their weights bit for bit (an int8 grid sees what it saw), and each new weight
    is a rotation whose columns the per-channel scale takes whole (8-bit SQNR >= 40 dB)."""
    import numpy as np
    from pass_testing import run_strictly

    from qnnpasses.ir.load import load_model
    from qnnpasses.passmanager.rewrite import constant_value

    entry = matrix[f"{family}_sdpa_ts"]
    prepared, _ = _with_trained_like_norm_scales(entry, tmp_path)
    before = {n.name: constant_value(n.inputs[1]) for n in load_model(prepared).graph.nodes
              if n.op == "MatMul" and constant_value(n.inputs[1]) is not None}
    rotated, record = run_strictly(prepared, "rotate-residual{unturn=true,post_norms=true}")
    assert record.status == "changed" and record.verification["ok"], record.reason
    stats = record.stats
    assert stats["added_weights"] == (stats["norms"] + stats.get("post_norms", 0)) * stats["hidden"] ** 2
    after = {n.name: n for n in rotated.graph.nodes if n.op == "MatMul" and constant_value(n.inputs[1]) is not None}
    turned = [k for k in before if not np.array_equal(constant_value(after[k].inputs[1]), before[k])]
    assert len(turned) == stats["writers"] and len(before) - len(turned) >= 5 * stats["norms"] // 2  # o/down only
    added = [n for name, n in after.items() if name not in before]
    assert len(added) == stats["norms"] + stats.get("post_norms", 0)
    assert all(n.inputs[0].inputs[0].op == "RMSNormalization" for n in added)
    assert all(_int8_sqnr(constant_value(n.inputs[1]).astype(np.float64)) >= 40 for n in added)


def test_a_gemma_w8a16_pair_turns_its_stream_back_after_each_norm_on_the_htp(matrix, tmp_path):
    """A w8a16 pair of Gemma 3 (post-norms write the stream, so the rotation cannot go into the weights):
    the lone fold of the norm scales is undone and the stream turned back after each norm; the norm
    scales are 16-bit, and both graphs are 1 HTP partition with 0 CPU nodes in integer mode."""
    import json

    import numpy as np
    import onnx

    from qnnpasses.llm.convert import build
    from qnnpasses.llm.manifest import part_paths

    entry = matrix["gemma3_text_sdpa_ts"]
    out = Path(os.environ.get("QNNPASSES_DECODERS", "~/.cache/qnnpasses/decoders")).expanduser()
    config = json.loads((out / entry["hf_dir"] / "config.json").read_text())
    export = onnx.load(str(out / entry["onnx"]))
    readers = {i for n in export.graph.node if n.op_type == "Mul" and "norm" in n.name for i in n.input}
    rng = np.random.default_rng(0)
    for init in export.graph.initializer:  # the scales of the hidden-size norms, trained-like (see above)
        if init.name in readers and list(init.dims) == [config["hidden_size"]]:
            gamma = rng.uniform(0.2, 3.0, config["hidden_size"]).astype(np.float32)
            gamma[7] = 100.0
            init.CopyFrom(onnx.numpy_helper.from_array(gamma, init.name))
    onnx.save(export, str(tmp_path / "export.onnx"))
    calib = tmp_path / "tokens.npz"
    np.savez(calib, input_ids=rng.integers(0, config["vocab_size"], (4, 40)))
    manifest = build(tmp_path / "export.onnx", tmp_path / "pair", context=32, prefill=4, precision="w8a16", calib=str(calib),
                     compile=False, probe=True)
    report = json.loads((Path(manifest["dir"]) / "report.json").read_text())
    records = [(r["pass"], r["status"]) for r in report["quantization"]["outlier_rewrites"]]
    assert records == [("fold-norm-weights", "undone"), ("rotate-residual", "unchanged"),
                       ("rotate-residual{post_norms=true,unturn=true}", "changed")], records
    turned = report["quantization"]["outlier_rewrites"][-1]["stats"]["prefill"]
    assert turned["added_weights"] == (turned["norms"] + turned["post_norms"]) * turned["hidden"] ** 2
    model = onnx.load(str(part_paths(manifest, "prefill", compiled=False)[0]), load_external_data=False)
    inits = {i.name: i for i in model.graph.initializer}
    produced = {o: n for n in model.graph.node for o in n.output}
    gammas = [produced[n.input[1]] for n in model.graph.node if n.op_type == "RMSNormalization"]
    assert gammas and all(inits[g.input[0]].data_type == onnx.TensorProto.UINT16 for g in gammas)
    for graph in ("prefill", "decode"):
        part = report["htp"][graph]["parts"][0]
        assert (part["ok"], part["qnn_partitions"], part["cpu_nodes"]) == (True, 1, 0), part
