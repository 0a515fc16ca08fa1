"""`qnnpasses llm` on onnxruntime-genai model-builder exports (tests/fixtures/genai, fp32 LLaMA and Qwen2).

The builder's ``GroupQueryAttention`` hides the Concat of the cache and derives the rotary
positions from ``attention_mask`` (``seqlens_k``); ``qnnpasses llm`` lowers the contrib ops
first, finds the roles on the lowered graph, and ``expose-positions`` replaces the mask-derived
positions by a ``position_ids`` input.  Checked for real: the pair against the original builder
model on onnxruntime CPU (a prompt in chunks of 8, the last one padded, then decode steps;
max abs 1e-4), both graphs on the HTP (fp16, CPU fallback disabled) as 1 partition with no CPU
node, and ``qnnpasses generate --on cpu --compare ORIGINAL`` giving the original's tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import requires_htp

from qnnpasses.llm.cache_dtype import ROUNDING
from qnnpasses.llm.manifest import load_manifest, part_paths
from qnnpasses.llm.verify import PartsRunner, compare_sequence, static_feed

GENAI = Path(__file__).parent / "fixtures" / "genai"
BUILDS = ("llama_fp32", "qwen2_fp32")
CONTEXT, PREFILL = 64, 8


def original(name: str) -> Path:
    return GENAI / name / "model.onnx"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from qnnpasses.llm.convert import build

    cache = {}

    def get(name: str):
        if name not in cache:
            out = tmp_path_factory.mktemp(f"llm_{name}") / "pair"
            build(original(name), out, context=CONTEXT, prefill=PREFILL, compile=False, probe=False)
            cache[name] = load_manifest(out)
        return cache[name]

    return get


@pytest.mark.parametrize("name", BUILDS)
def test_builder_pair_matches_the_original_on_cpu(name, built):
    manifest = built(name)
    roles = manifest["graphs"]["decode"]["roles"]
    assert roles["position_ids"] == "position_ids" and manifest["source_roles"]["position_ids"] is None
    assert (manifest["layers"], manifest["kv_heads"], manifest["head_dim"]) == (2, 2, 16)
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, manifest["vocab"], 21)]
    result = compare_sequence(manifest["dir"], manifest, original(name), prompt, new_tokens=6)
    assert result["calls"] == 3 + 5  # 8 + 8 + 5 (padded to 8), then 5 decode steps
    assert result["logits"] <= 1e-4 and result["kv"] <= 1e-4 + ROUNDING * result["kv_scale"], result  # fp16 cache
    assert result["top1"] == 1.0
    for graph in ("prefill", "decode"):
        nodes = onnx.load(part_paths(manifest, graph, compiled=False)[0]).graph.node
        ops = {n.op_type for n in nodes}
        assert not ops & {"GroupQueryAttention", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"}, ops
        # no position computed from the mask: the only sums left are softmax-exp's, of an Exp
        producers = {out: n.op_type for n in nodes for out in n.output}
        assert [producers.get(n.input[0]) for n in nodes if n.op_type == "ReduceSum"] == ["Exp"] * manifest["layers"]


def test_positions_come_from_the_input_not_the_mask(built):
    """A padded chunk (3 real tokens of 8): the builder's own rule (positions ``seqlens_k + 1 - S + i``)
    would place the real tokens 5 slots early; the pair reads ``position_ids`` instead (which
    test_builder_pair_matches_the_original_on_cpu shows to be right), and moving it moves the logits."""
    manifest = built("llama_fp32")
    graph = manifest["graphs"]["prefill"]
    cache = {n: np.random.default_rng(0).standard_normal((1, 2, CONTEXT, 16)).astype(np.float32)
             for n in graph["roles"]["past_key"] + graph["roles"]["past_value"]}
    runner = PartsRunner(manifest["dir"], graph)
    logits = graph["roles"]["logits"]
    full = runner(static_feed(graph, [5, 9, 13], 10, cache))[logits][0, :3]
    feed = static_feed(graph, [5, 9, 13], 10, cache)
    shifted = dict(feed, position_ids=feed["position_ids"] - 5)  # the mask-derived positions
    assert np.abs(runner(shifted)[logits][0, :3] - full).max() > 1e-3  # the positions do reach the rotary


@requires_htp
@pytest.mark.parametrize("name", BUILDS)
def test_builder_pair_runs_on_the_htp_as_one_partition(name, built, tmp_path):
    from qnnpasses.backends.htp import htp_session, parse_profile

    manifest = built(name)
    for graph_name in ("prefill", "decode"):
        graph = manifest["graphs"][graph_name]
        session = htp_session(str(part_paths(manifest, graph_name, compiled=False)[0]), fp16=True,
                              disable_cpu_fallback=True, profiling=True, profile_prefix=str(tmp_path / graph_name))
        cache = {n: np.random.default_rng(0).standard_normal((1, 2, CONTEXT, 16)).astype(np.float32)
                 for n in graph["roles"]["past_key"] + graph["roles"]["past_value"]}
        feed = static_feed(graph, [5] * graph["tokens"], 7, cache)
        got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feed)))
        assert parse_profile(session.end_profiling()) == (1, []), graph_name
        expected = PartsRunner(manifest["dir"], graph)(feed)
        logits = graph["roles"]["logits"]
        a, b = got[logits].ravel().astype(np.float64), expected[logits].ravel().astype(np.float64)
        assert float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) >= 0.999, graph_name


@pytest.mark.parametrize("name", BUILDS)
def test_generate_on_cpu_gives_the_original_tokens(name, built, capsys):
    from qnnpasses.cli import main

    manifest = built(name)
    capsys.readouterr()
    code = main(["generate", manifest["dir"], "--prompt-ids", "5,17,99,3,42,7,11,200,13,1,8", "--max-new-tokens", "12",
                 "--on", "cpu", "--compare", str(original(name)), "--format", "json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == out["compare"]["original_tokens"] and len(out["tokens"]) == 12
    assert out["compare"]["teacher_forced_top1"] == 1.0


def test_int4_build_is_refused_in_one_line(tmp_path, capsys):
    """The int4 build's MatMulNBits (accuracy_level=4) lowers only lossily (htp-llm --allow-lossy):
    ``qnnpasses llm`` says so, exit 2, and writes nothing."""
    from qnnpasses.cli import main

    out = tmp_path / "pair"
    assert main(["llm", str(original("llama_int4")), "--out-dir", str(out), "--context", "64", "--prefill", "8",
                 "--no-compile"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("qnnpasses: error:") and "MatMulNBits" in err[-1] and "--allow-lossy" in err[-1]
    assert not any("Traceback" in line for line in err)
    assert not out.exists() and not list(tmp_path.iterdir())
