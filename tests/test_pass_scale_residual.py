"""scale-residual: a residual stream past fp16's range is carried at 2^-k, exactly in fp32, and the HTP's
fp16 then computes what fp32 computes where it saturated before.

The fixture is a random-weight LLaMA-form model (tools/make_big_llm.py) whose embedding table is scaled
by 2^21, which puts its residual stream past fp16's range (trained Gemma 3 270M's stream reaches that range
in its middle layers).  Gemma's own form of the stream (the embedding times a constant, post-norm writers)
is tested on the family matrix's Gemma 2 and Gemma 3 exports (tests/test_llm_decoders.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import requires_htp
from onnx import numpy_helper

from qnnpasses.backends.cpu import cosine_similarity, run_cpu
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import save_model
from qnnpasses.passmanager.manager import PassManager
from qnnpasses.passmanager.named import get_pipeline
from qnnpasses.passmanager.spec import parse_pipeline

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from make_big_llm import LlamaShape, build  # noqa: E402

SHAPE = LlamaShape(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=300, seq=16)
LOUD = 2.0 ** 21


def _model(tmp_path: Path, loud: float) -> Path:
    src = build(SHAPE, tmp_path / "src" / "model.onnx", dtype="float32", weights="random")
    model = onnx.load(str(src))
    for init in model.graph.initializer:
        if init.name == "model.embed_tokens.weight":
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(loud), init.name))
    out = tmp_path / f"loud{int(loud)}.onnx"
    onnx.save(model, str(out))
    return out


def _run(path: Path, spec: str, out: Path):
    ir = load_model(path)
    result = PassManager(parse_pipeline(spec)).run(ir)
    save_model(ir, out)
    return {r.name: r for r in result.records}, out


INPUTS = {"input_ids": (np.arange(SHAPE.seq, dtype=np.int64)[None] * 7) % SHAPE.vocab}


def test_a_stream_past_fp16_range_is_scaled_exactly(tmp_path):
    base, prepared = _run(_model(tmp_path, LOUD), get_pipeline("htp-llm").to_text(), tmp_path / "htp_llm.onnx")
    records, scaled = _run(prepared, "scale-residual,cleanup", tmp_path / "scaled.onnx")
    stats = records["scale-residual"].stats
    assert records["scale-residual"].status == "changed"
    assert stats["stream_max_abs"] > 65504 and stats["shift"] == int(np.ceil(np.log2(stats["stream_max_abs"] / 16376)))
    assert stats["writers"] == 2 * SHAPE.layers and stats["norms"] == 2 * SHAPE.layers + 1
    want, got = run_cpu(prepared, INPUTS)["logits"], run_cpu(scaled, INPUTS)["logits"]
    assert np.array_equal(want, got)  # powers of two: the fp32 function bit for bit
    # the scaled projections stay recipes of the mapped weights until saved
    import onnx_graphsurgeon as gs

    from qnnpasses.ir.model import DerivedValues

    ir = load_model(save_model(load_model(prepared), tmp_path / "external" / "m.onnx", external_data=True))
    PassManager(parse_pipeline("scale-residual")).run(ir)
    weights = [t for t in ir.graph.tensors().values() if isinstance(t, gs.Constant) and "stream_scale" in t.name
               and len(t.shape) == 2]
    assert len(weights) == 2 * SHAPE.layers and all(isinstance(t._values, DerivedValues) for t in weights)


def test_a_stream_within_range_is_left_alone(tmp_path):
    _, prepared = _run(_model(tmp_path, 1.0), get_pipeline("htp-llm").to_text(), tmp_path / "htp_llm.onnx")
    records, _ = _run(prepared, "scale-residual,cleanup", tmp_path / "same.onnx")
    assert records["scale-residual"].status == "unchanged"
    assert 0 < records["scale-residual"].stats["stream_max_abs"] < 16376


@requires_htp
def test_the_htp_computes_the_scaled_stream_in_fp16(tmp_path):
    """fp16 on the HTP saturates the loud stream; scaled, its logits are fp32's within fp16 rounding."""
    from qnnpasses.backends.htp import run_on_htp

    _, prepared = _run(_model(tmp_path, LOUD), get_pipeline("htp-llm").to_text(), tmp_path / "htp_llm.onnx")
    _, scaled = _run(prepared, "scale-residual,cleanup", tmp_path / "scaled.onnx")
    want = run_cpu(prepared, INPUTS)["logits"]
    before = cosine_similarity(want, run_on_htp(prepared, INPUTS)["logits"])
    after = cosine_similarity(want, run_on_htp(scaled, INPUTS)["logits"])
    assert after > 0.9999 and before < 0.999, (before, after)


def test_the_decode_graph_takes_the_prefill_graphs_shift(tmp_path):
    """In a pair the prefill graph measures k and the decode graph is given it: the two hold the same
    scaled weights (stored once), and the build's CPU check against the export holds."""
    import json

    from conftest import fixture_path

    from qnnpasses.llm.convert import build as build_pair

    model = onnx.load(str(fixture_path("llama_gqa_kv_dyn_ts")))
    tables = [i for i in model.graph.initializer if len(i.dims) == 2 and i.dims[0] > 100 and "embed" in i.name]
    assert len(tables) == 1
    tables[0].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tables[0]) * np.float32(LOUD), tables[0].name))
    onnx.save(model, str(tmp_path / "loud.onnx"))
    manifest = build_pair(tmp_path / "loud.onnx", tmp_path / "pair", context=64, prefill=16, compile=False, probe=False)
    report = json.loads((tmp_path / "pair" / "report.json").read_text())
    records = {g: next(r for r in report["graphs"][g]["passes"] if r["name"] == "scale-residual") for g in ("prefill", "decode")}
    shift = records["prefill"]["stats"]["shift"]
    assert records["prefill"]["status"] == "changed" and shift >= 2
    assert records["decode"]["status"] == "changed" and records["decode"]["stats"]["given_shift"] == shift
    assert report["verification"]["ok"]
    scaled = {}
    for g in ("prefill", "decode"):
        graph = onnx.load(str(tmp_path / "pair" / manifest["graphs"][g]["parts"][0]["onnx"])).graph
        scaled[g] = sorted(numpy_helper.to_array(i).tobytes() for i in graph.initializer if "stream_scale" in i.name)
    assert len(scaled["prefill"]) == 2 * 2 + 1 and scaled["prefill"] == scaled["decode"]  # 2 layers' writers, embedding
