"""`qnnpasses llm`: a dynamic-KV export -> a static prefill + decode pair, checked for real.

Random-weight fixtures (`llama_gqa_kv_dyn_ts`: dynamic sequence and past; `llama_gqa_kv_dyn_dynamo`:
dynamic past, new-token count fixed to 1 by the export, so its prefill is 1), context 256.
The static graphs must compute what the original export computes with the unpadded cache
(CPU, max abs 1e-4 over a chunked, padded prompt and decode steps), hold no Concat of the
cache, output only the new K/V, run on the HTP as one partition with no CPU node (CPU
fallback disabled), and size the cache exactly.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from conftest import fixture_path, htp_backend_available, requires_htp

from qnnpasses.ir.load import load_model
from qnnpasses.llm.cache_dtype import ROUNDING
from qnnpasses.llm.manifest import load_manifest, part_paths
from qnnpasses.llm.verify import PartsRunner, compare_sequence, static_feed

CONTEXT = 256
HTP = htp_backend_available()
BUILDS = {  # fixture -> (prefill, build options)
    "llama_gqa_kv_dyn_ts": (16, {"compile": True}),
    "llama_gqa_kv_dyn_dynamo": (1, {"compile": False, "probe": False}),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from qnnpasses.llm.convert import build

    cache = {}

    def get(name: str, **extra):
        key = (name, tuple(sorted(extra.items())))
        if key not in cache:
            prefill, options = BUILDS[name]
            out = tmp_path_factory.mktemp(name.replace("llama_gqa_kv_dyn_", "llm_"))
            build(fixture_path(name), out / "pair", context=CONTEXT, prefill=prefill, **{**options, **extra})
            cache[key] = load_manifest(out / "pair")
        return cache[key]

    return get


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_static_pair_matches_the_original_export_on_cpu(name, built):
    manifest = built(name)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, manifest["vocab"], 37)]
    result = compare_sequence(manifest["dir"], manifest, fixture_path(name), prompt, new_tokens=6)
    expected_calls = (3 if manifest["prefill"] == 16 else 37) + 5  # 16 + 16 + 5 (padded), then 5 decode steps
    assert result["calls"] == expected_calls
    # the new K/V leave fp16 pairs in float16: the float32 values rounded (qnnpasses.llm.cache_dtype)
    kv_rounding = ROUNDING if manifest["kv_dtype"] == "float16" else 0.0
    assert result["logits"] <= 1e-4 and result["kv"] <= 1e-4 + kv_rounding * result["kv_scale"], result
    report = json.loads((manifest_dir(manifest) / "report.json").read_text())
    assert report["verification"]["ok"] and report["verification"]["logits"] <= 1e-4


def test_report_gives_the_builds_memory(built):
    """Peak private memory is sampled while the build runs; resident peaks come from the kernel."""
    manifest = built("llama_gqa_kv_dyn_ts")
    memory = json.loads((manifest_dir(manifest) / "report.json").read_text())["memory"]
    assert 0 < memory["private_peak_bytes"] <= memory["resident_peak_bytes"]
    assert memory["export_weight_bytes"] == load_model(fixture_path("llama_gqa_kv_dyn_ts")).weight_bytes()
    text = (manifest_dir(manifest) / "report.md").read_text()
    assert "peak private memory" in text and "of export weights" in text
    if HTP:  # the compile children sample their own: QNN preparing a graph holds more than its weights
        held = manifest["device"]["graphs"]["prefill"]["weight_bytes"]
        assert memory["compile_private_peak_bytes"] > held and "largest compile child's" in text


def manifest_dir(manifest):
    from pathlib import Path

    return Path(manifest["dir"])


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_cache_is_outside_the_graph_and_outputs_are_new_kv_only(name, built):
    manifest = built(name)
    heads, dim = manifest["kv_heads"], manifest["head_dim"]
    for graph_name, graph in manifest["graphs"].items():
        proto = onnx.load(str(part_paths(manifest, graph_name, compiled=False)[0]))
        roles = graph["roles"]
        past = set(roles["past_key"] + roles["past_value"])
        assert not [n.name for n in proto.graph.node if n.op_type == "Concat" and past & set(n.input)]
        outputs = {o.name: [d.dim_value for d in o.type.tensor_type.shape.dim] for o in proto.graph.output}
        # fp16: the logits relative to the first tokens' maximum by default, which logits_offset holds
        assert roles["logits_offset"] == "logits_offset" and outputs["logits_offset"] == [1, graph["tokens"], 1]
        assert set(outputs) == {roles["logits"], roles["logits_offset"], *roles["new_key"], *roles["new_value"]}
        assert outputs[roles["logits"]] == [1, graph["tokens"], manifest["vocab"]]
        for new in roles["new_key"] + roles["new_value"]:
            assert outputs[new] == [1, heads, graph["tokens"], dim]
        for name_ in past:
            assert graph["io"][name_]["shape"] == [1, heads, graph["past"], dim]
        assert graph["tokens"] + graph["past"] == CONTEXT
        assert graph["io"][roles["attention_mask"]]["shape"] == [1, CONTEXT]
        assert roles["position_ids"] == "position_ids"  # exposed: both exports derived positions from the past length


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_kv_cache_bytes_are_exact_and_analyze_agrees(name, built, capsys):
    from qnnpasses.llm.report import analyze_kv, kv_cache_bytes

    manifest = built(name)
    expected = 2 * manifest["layers"] * manifest["kv_heads"] * manifest["head_dim"] * CONTEXT * 4
    assert expected == 2 * 2 * 2 * 16 * 256 * 4
    assert manifest["kv_dtype"] == "float16" and manifest["device"]["kv_cache_bytes"] == expected // 2
    for graph_name in ("decode", "prefill"):
        assert kv_cache_bytes(manifest["graphs"][graph_name]) == expected // 2  # the fp16 cache
        path = part_paths(manifest, graph_name, compiled=False)[0]
        assert analyze_kv(path, CONTEXT)["bytes_fp32"] == expected
    # without --context, analyze reads the context off the decode graph itself
    from qnnpasses.cli import main

    capsys.readouterr()
    assert main(["analyze", str(part_paths(manifest, "decode", compiled=False)[0]), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_cache"]["bytes_fp32"] == expected


@requires_htp
@pytest.mark.parametrize("graph_name", ["prefill", "decode"])
@pytest.mark.parametrize("name", sorted(BUILDS))
def test_graphs_run_on_the_htp_as_one_partition(name, graph_name, built, tmp_path):
    from qnnpasses.backends.htp import htp_session, parse_profile

    manifest = built(name)
    graph = manifest["graphs"][graph_name]
    path = part_paths(manifest, graph_name, compiled=False)[0]
    session = htp_session(str(path), fp16=True, disable_cpu_fallback=True, profiling=True,
                          profile_prefix=str(tmp_path / "profile"))
    cache = {n: np.random.default_rng(0).standard_normal((1, manifest["kv_heads"], CONTEXT, manifest["head_dim"])).astype(np.float32)
             for n in graph["roles"]["past_key"] + graph["roles"]["past_value"]}
    feed = static_feed(graph, [5] * graph["tokens"], 7, cache)
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feed)))
    assert parse_profile(session.end_profiling()) == (1, [])
    expected = PartsRunner(manifest["dir"], graph)(feed)
    logits = graph["roles"]["logits"]
    a, b = got[logits].ravel().astype(np.float64), expected[logits].ravel().astype(np.float64)
    assert float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) >= 0.999


def test_fp16_pair_has_the_forms_the_htp_computes_closer_to_fp32(built):
    """fp16 pairs get FP16_PIPELINE after htp-llm (scale-residual first): no Softmax or Sigmoid left, each spelled out
    (one floored Exp per layer's attention, one Tanh per layer's SiLU), then logits-offset over the
    first eighth of this small vocabulary's tokens (at most 4096) and tied-embedding; the spec records it."""
    from collections import Counter

    from qnnpasses.llm.convert import FP16_PIPELINE, LOGITS_OFFSET, fp16_passes
    from qnnpasses.llm.manifest import default_offset_candidates

    manifest = built("llama_gqa_kv_dyn_ts")
    layers = manifest["layers"]
    for graph_name in manifest["graphs"]:
        proto = onnx.load(str(part_paths(manifest, graph_name, compiled=False)[0]))
        ops = Counter(n.op_type for n in proto.graph.node)
        assert (ops["Softmax"], ops["Sigmoid"], ops["Exp"], ops["Tanh"]) == (0, 0, layers, layers), ops
        spec = {p.key: p.value for p in proto.metadata_props}["qnnpasses.passmanager.spec"]
        # the decode graph takes the prefill graph's residual shift (0: this stream needs none)
        shift = None if graph_name == "prefill" else 0
        pipeline = FP16_PIPELINE.replace("scale-residual", "scale-residual{shift=0}") if shift == 0 else FP16_PIPELINE
        candidates = default_offset_candidates(manifest["vocab"])
        assert candidates == manifest["vocab"] // 8
        assert spec.endswith(f",{pipeline},{LOGITS_OFFSET}{{output=logits,candidates={candidates}}},tied-embedding")
        assert spec.endswith("," + fp16_passes("logits", True, residual_shift=shift, offset_candidates=candidates).to_text())
        assert manifest["graphs"][graph_name]["roles"]["logits_offset"] == "logits_offset"
        weights = {i.name: list(i.dims) for i in proto.graph.initializer}
        heads = sorted(weights[n.input[1]][-1] for n in proto.graph.node
                       if n.op_type == "MatMul" and weights.get(n.input[1], [0])[-1] in (candidates, manifest["vocab"]))
        assert heads == [candidates, manifest["vocab"]]  # the candidates' slice of the lm_head, and the lm_head


@requires_htp
def test_decode_composes_no_more_qnn_ops_than_prefill(built):
    manifest = built("llama_gqa_kv_dyn_ts")
    facts = json.loads((manifest_dir(manifest) / "report.json").read_text())["htp"]
    for graph_name in ("prefill", "decode"):
        part = facts[graph_name]["parts"][0]
        assert (part["ok"], part["qnn_partitions"], part["cpu_nodes"]) == (True, 1, 0)
    assert 0 < facts["decode"]["qnn_ops"] <= facts["prefill"]["qnn_ops"]


@requires_htp
def test_compiled_pair_runs_and_weight_sharing_probe_is_recorded(built):
    from qnnpasses.backends.htp import htp_session

    manifest = built("llama_gqa_kv_dyn_ts")
    report = json.loads((manifest_dir(manifest) / "report.json").read_text())
    probe = report["compile"]["shared_probe"]
    assert probe["compile"] in (True, False) and (probe["run"] or probe["error"])
    assert manifest["weight_sharing"] == ("shared" if probe["run"] else "separate")
    rng = np.random.default_rng(2)
    for graph_name in ("prefill", "decode"):
        graph = manifest["graphs"][graph_name]
        compiled = part_paths(manifest, graph_name, compiled=True)[0]
        assert {n.op_type for n in onnx.load(str(compiled)).graph.node} == {"EPContext"}
        cache = {n: rng.standard_normal((1, manifest["kv_heads"], CONTEXT, manifest["head_dim"])).astype(np.float32)
                 for n in graph["roles"]["past_key"] + graph["roles"]["past_value"]}
        feed = static_feed(graph, list(range(3, 3 + graph["tokens"])), 11, cache)
        session = htp_session(str(compiled), fp16=True, disable_cpu_fallback=True)
        got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feed)))
        expected = PartsRunner(manifest["dir"], graph)(feed)
        for name in [graph["roles"]["logits"], *graph["roles"]["new_key"]]:
            a, b = got[name].ravel().astype(np.float64), expected[name].ravel().astype(np.float64)
            assert float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) >= 0.999, name


def test_parts_chain_to_the_same_logits(built):
    single = built("llama_gqa_kv_dyn_ts")
    split = built("llama_gqa_kv_dyn_ts", parts=2, compile=HTP, probe=False)
    rng = np.random.default_rng(3)
    for graph_name in ("prefill", "decode"):
        graph = split["graphs"][graph_name]
        assert len(graph["parts"]) == 2
        first, second = graph["parts"]
        assert set(second["inputs"]) <= set(first["inputs"]) | set(first["outputs"]) | set(graph["io"])
        # the cut is on the residual stream: besides the mask and rotary tables (which do not depend
        # on the tokens), only the hidden state [tokens, hidden] crosses it
        part0 = onnx.load(str(manifest_dir(split) / first["onnx"]))
        shapes = {o.name: [d.dim_value for d in o.type.tensor_type.shape.dim] for o in part0.graph.output}
        crossing = [shapes[n] for n in set(second["inputs"]) - set(graph["io"])]
        stream = [s for s in crossing if int(np.prod(s)) == graph["tokens"] * 64]
        assert len(stream) == 1 and len(crossing) - len(stream) <= 3, crossing
        cache = {n: rng.standard_normal((1, split["kv_heads"], CONTEXT, split["head_dim"])).astype(np.float32)
                 for n in graph["roles"]["past_key"] + graph["roles"]["past_value"]}
        feed = static_feed(graph, list(range(1, 1 + graph["tokens"])), 9, cache)
        chained = PartsRunner(split["dir"], graph)(feed)
        whole = PartsRunner(single["dir"], single["graphs"][graph_name])(feed)
        for name in [graph["roles"]["logits"], *graph["roles"]["new_key"], *graph["roles"]["new_value"]]:
            np.testing.assert_allclose(chained[name], whole[name], atol=1e-5, rtol=0, err_msg=name)
        if HTP:  # the compiled parts, chained on the HTP by name, give the same logits
            from qnnpasses.backends.htp import htp_session

            env = dict(feed)
            for path in part_paths(split, graph_name, compiled=True):
                session = htp_session(str(path), fp16=True, disable_cpu_fallback=True)
                names = [o.name for o in session.get_outputs()]
                env.update(zip(names, session.run(names, {i.name: env[i.name] for i in session.get_inputs()})))
            a, b = (x[graph["roles"]["logits"]].ravel().astype(np.float64) for x in (env, whole))
            assert float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) >= 0.999
    report = json.loads((manifest_dir(split) / "report.json").read_text())
    assert report["parts_verification"]["ok"]


@pytest.mark.parametrize("args, message", [
    (["llama_gqa_ts", "--context", "256", "--prefill", "16"], "no KV cache"),
    (["llama_gqa_kv_dyn_ts", "--context", "16", "--prefill", "32"], "must be smaller than --context"),
    (["llama_gqa_kv_dyn_ts", "--context", "16", "--prefill", "16"], "must be smaller than --context"),
    (["llama_gqa_kv_dyn_ts", "--context", "256", "--prefill", "16", "--precision", "int3"], "unknown precision"),
    (["llama_gqa_kv_dyn_ts", "--context", "256", "--prefill", "16", "--precision", "w8a16"], "needs --calib"),
    (["llama_gqa_kv_dyn_dynamo", "--context", "256", "--prefill", "16"], "fixes the new-token count at 1"),
    (["llama_gqa_kv_dyn_ts", "--context", "256", "--prefill", "16", "--max-part-bytes", "lots"],
     "--max-part-bytes expects a size"),
    (["llama_gqa_kv_dyn_ts", "--context", "256", "--prefill", "16", "--int4-blocks", "none"],
     "--int4-blocks is for --precision w4a16"),
    (["llama_gqa_kv_dyn_ts", "--context", "256", "--prefill", "16", "--precision", "w4a16", "--calib", "x.npz",
      "--int4-blocks", "24"], "--int4-blocks must be a power of two"),
    # learned positions: GPT-2's wpe has 64 rows here, position 64 does not exist
    (["gpt2_kv_dyn_ts", "--context", "65", "--prefill", "8"], "a table of 64 rows ('model.transformer.wpe.weight')"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path, capsys):
    from qnnpasses.cli import main

    out = tmp_path / "pair"
    before = fixture_path(args[0]).read_bytes()
    code = main(["llm", str(fixture_path(args[0])), "--out-dir", str(out), "--no-compile", *args[1:]])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("qnnpasses: error")]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err
    assert not out.exists() and not list(tmp_path.glob(".pair.*"))
    assert fixture_path(args[0]).read_bytes() == before


@pytest.mark.parametrize("value", ["0", "half", "-3"])
def test_a_bad_logits_offset_is_one_usage_line_and_exit_2(value, capsys):
    from qnnpasses.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["llm", str(fixture_path("llama_gqa_kv_dyn_ts")), "--out-dir", "unused", "--context", "64", "--prefill", "8",
              "--logits-offset", value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("qnnpasses llm: error: argument --logits-offset: expected a positive number of tokens, "
                          f"'all' or 'none', got '{value}'"), err


@pytest.mark.parametrize("flag, want", [
    ([], (True, None)), (["--logits-offset"], (True, 0)), (["--logits-offset", "all"], (True, 0)),
    (["--logits-offset", "512"], (True, 512)), (["--logits-offset", "none"], (False, None)),
    (["--plain-logits"], (False, None)),
])
def test_logits_offset_flag_reaches_the_build(flag, want, monkeypatch):
    """``--logits-offset`` as ``build`` gets it: the default (None: 4096 at most V / 8), every token,
    a count, or plain logits (``none``; the old ``--plain-logits`` still says it)."""
    import qnnpasses.llm.convert as convert
    from qnnpasses.cli import main

    seen = {}

    def build(*args, **kwargs):
        seen.update(kwargs)
        raise SystemExit(0)

    monkeypatch.setattr(convert, "build", build)
    with pytest.raises(SystemExit):
        main(["llm", str(fixture_path("llama_gqa_kv_dyn_ts")), "--out-dir", "unused", "--context", "64", "--prefill", "8",
              *flag])
    assert (seen["logits_offset"], seen["offset_candidates"]) == want


def _boundary_qparams(path, tensor: str, op: str):
    from onnx import numpy_helper

    model = onnx.load(str(path))
    init = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == op and tensor in (node.output[0] if op == "DequantizeLinear" else node.input[0]):
            return float(init[node.input[1]]), int(init[node.input[2]])
    return None


def test_w8a16_pair_shares_the_kv_encodings(built, tmp_path):
    calib = tmp_path / "tokens.npz"
    np.savez(calib, input_ids=np.random.default_rng(4).integers(0, 256, (4, 40)))
    manifest = built("llama_gqa_kv_dyn_ts", precision="w8a16", calib=str(calib), compile=False, probe=HTP)
    assert manifest["precision"] == "w8a16"
    prefill, decode = (part_paths(manifest, g, compiled=False)[0] for g in ("prefill", "decode"))
    # integer mode: the fp16 formulations are not applied (the Softmax runs on quantized scores)
    assert sum(n.op_type == "Softmax" for n in onnx.load(str(decode)).graph.node) == manifest["layers"]
    roles = manifest["graphs"]["decode"]["roles"]
    assert roles["logits_offset"] is None  # quantized logits: 16-bit steps set by calibration, not fp16's
    for new, past in zip(roles["new_key"] + roles["new_value"], roles["past_key"] + roles["past_value"]):
        written = _boundary_qparams(prefill, new, "DequantizeLinear")  # what prefill writes into the cache
        read = _boundary_qparams(decode, past, "QuantizeLinear")       # what decode reads from it
        assert written is not None and written == read == _boundary_qparams(decode, new, "DequantizeLinear")
    report = json.loads((manifest_dir(manifest) / "report.json").read_text())
    # random weights, CPU: logits of scale ~0.7 leave near-ties everywhere, so top-1 is a coarse
    # sanity bar here (42-46 of 47 positions seen); the trained model's figures are in docs/llm.md
    assert report["quantized_verification"]["top1"] >= 0.85
    # the float pair the graphs were made from is gone once checked (--keep-float keeps it)
    assert report["quantization"]["float_pair"].startswith("removed")
    assert not list(manifest_dir(manifest).glob("*.float.onnx*"))
    assert not [g for g in manifest["graphs"].values() if "float_onnx" in g]
    if HTP:  # integer mode, boundary Q/DQ on the HTP too: one partition, no CPU node (fallback disabled)
        for graph_name in ("prefill", "decode"):
            part = report["htp"][graph_name]["parts"][0]
            assert (part["ok"], part["qnn_partitions"], part["cpu_nodes"]) == (True, 1, 0), part
            # compiled with the MatMuls after each RmsNorm compensated (qnnpasses.quant.norm_rounding)
            assert part["norm_rounding_matmuls"] >= manifest["layers"], part
    assert "compensated on the HTP" in manifest["session"]["norm_rounding"]


def test_int4_blocks_none_gives_one_scale_per_output_channel(built, tmp_path):
    """``--int4-blocks none``: every int4 weight of the w4a16 pair has one scale per output channel
    (no block_size), the report says so; a compile that fails to allocate with blocked weights
    names the option (the prefill at context 4096 / prefill 128 does: docs/bench_sizes.md)."""
    from qnnpasses.llm.convert import _int4_blocks_hint

    calib = tmp_path / "tokens.npz"
    np.savez(calib, input_ids=np.random.default_rng(4).integers(0, 256, (4, 40)))
    manifest = built("llama_gqa_kv_dyn_ts", precision="w4a16", calib=str(calib), int4_blocks=0, compile=False,
                     probe=False)
    report = json.loads((manifest_dir(manifest) / "report.json").read_text())
    assert report["quantization"]["int4_block_rows"] == "per channel"
    for graph_name in ("prefill", "decode"):
        model = onnx.load(str(part_paths(manifest, graph_name, compiled=False)[0]), load_external_data=False)
        inits = {i.name: i.data_type for i in model.graph.initializer}
        int4 = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and inits.get(n.input[0]) == onnx.TensorProto.INT4]
        assert int4 and not [n.name for n in int4 if any(a.name == "block_size" for a in n.attribute)]
    error = "compiling prefill.onnx for the HTP failed: ... QNN_COMMON_ERROR_MEM_ALLOC: Memory allocation related error."
    assert "--int4-blocks none" in _int4_blocks_hint(error, {"quantization": {"int4_block_rows": 32}})
    assert _int4_blocks_hint(error, {"quantization": {"int4_block_rows": "per channel"}}) == ""
    assert _int4_blocks_hint("other failure", {"quantization": {"int4_block_rows": 32}}) == ""


def test_quantized_parts_pass_quantized_tensors_and_compute_the_whole(built, tmp_path):
    """A w8a16 pair split into parts: the cut never falls inside a Q/DQ pair (what crosses is the
    16-bit tensor between a QuantizeLinear and its DequantizeLinear, or a bool mask), every part is
    one HTP partition with no CPU node in the session the pair runs in, and the parts chained
    compute exactly what the unsplit pair computes: on the CPU to float32 rounding, on the HTP
    the same logits bit for bit."""
    from qnnpasses.llm.runner import Runner

    calib = tmp_path / "tokens.npz"
    np.savez(calib, input_ids=np.random.default_rng(4).integers(0, 256, (4, 40)))
    whole = built("llama_gqa_kv_dyn_ts", precision="w8a16", calib=str(calib), compile=HTP, probe=HTP)
    split = built("llama_gqa_kv_dyn_ts", precision="w8a16", calib=str(calib), parts=2, compile=HTP, probe=HTP)
    report = json.loads((manifest_dir(split) / "report.json").read_text())
    assert report["parts_verification"]["ok"] and report["parts_verification"]["against"] == "the unsplit pair"
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16}
    for graph_name, graph in split["graphs"].items():
        assert len(graph["parts"]) == 2
        first, second = graph["parts"]
        part0 = onnx.load(str(manifest_dir(split) / first["onnx"]), load_external_data=False)
        types = {o.name: o.type.tensor_type.elem_type for o in part0.graph.output}
        crossing = set(second["inputs"]) - set(graph["io"])
        assert crossing and not [n for n in crossing if types[n] in floats], crossing
        if HTP:
            for part in report["htp"][graph_name]["parts"]:
                assert (part["qnn_partitions"], part["cpu_nodes"]) == (1, 0), part
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, split["vocab"], 21)]
    for on in ("cpu", "htp") if HTP else ("cpu",):
        got = []
        for pair in (whole, split):
            runner = Runner(manifest_dir(pair), on=on)
            logits, _ = runner.feed(prompt)
            got.append(np.concatenate([logits.ravel(), runner.step("decode", [7]).ravel()]))
        tolerance = 1e-5 if on == "cpu" else 0.0
        np.testing.assert_allclose(got[1], got[0], atol=tolerance, rtol=0, err_msg=on)


def test_the_runner_s_sessions_hook_makes_every_session(built):
    """``Runner(..., sessions=f)``: ``f(part file, graph)`` makes each graph's sessions (what a probe
    uses to run the pair otherwise); here onnxruntime CPU without its fusions, which computes what
    the default CPU sessions compute to float32 rounding."""
    from qnnpasses.backends.cpu import cpu_session
    from qnnpasses.llm.runner import Runner

    manifest = built("llama_gqa_kv_dyn_ts")
    made = []

    def sessions(path, graph):
        made.append((graph.name, path.name))
        return cpu_session(path, mapped=True, optimize=False)

    prompt = [int(t) for t in np.random.default_rng(6).integers(0, manifest["vocab"], 21)]
    got = []
    for runner in (Runner(manifest["dir"], on="cpu", sessions=sessions), Runner(manifest["dir"], on="cpu")):
        logits, _ = runner.feed(prompt)
        got.append(np.concatenate([logits.ravel(), runner.step("decode", [7]).ravel()]))
    assert made == [("prefill", "prefill.onnx"), ("decode", "decode.onnx")]
    np.testing.assert_allclose(got[0], got[1], atol=1e-5, rtol=0)


def test_logits_offset_pair_gives_the_plain_pair_s_logits_plus_its_offset(built):
    """``--logits-offset all`` and the default (the first tokens as candidates): the offset output
    named by the manifest, the spec records the pass; logits plus offset are the plain pair's
    (``--logits-offset none``) logits (CPU, float32 rounding); the offset is the maximum of every
    token's logits, or of the candidates'."""
    from qnnpasses.llm.convert import LOGITS_OFFSET, fp16_passes
    from qnnpasses.llm.manifest import absolute_logits

    every = built("llama_gqa_kv_dyn_ts", offset_candidates=0, compile=False, probe=False)
    plain = built("llama_gqa_kv_dyn_ts", logits_offset=False, compile=False, probe=False)
    default = built("llama_gqa_kv_dyn_ts")
    candidates = json.loads((manifest_dir(default) / "report.json").read_text())["logits_offset"]["candidates"]
    assert json.loads((manifest_dir(every) / "report.json").read_text())["logits_offset"] == {"candidates": 0}
    assert "logits_offset" not in json.loads((manifest_dir(plain) / "report.json").read_text())
    rng = np.random.default_rng(5)
    for graph_name in ("prefill", "decode"):
        plain_graph = plain["graphs"][graph_name]
        assert plain_graph["roles"]["logits_offset"] is None
        cache = {n: rng.standard_normal((1, plain["kv_heads"], CONTEXT, plain["head_dim"])).astype(np.float32)
                 for n in plain_graph["roles"]["past_key"] + plain_graph["roles"]["past_value"]}
        feed = static_feed(plain_graph, list(range(5, 5 + plain_graph["tokens"])), 7, cache)
        want = PartsRunner(plain["dir"], plain_graph)(feed)["logits"]
        for offset, count in ((every, 0), (default, candidates)):
            graph = offset["graphs"][graph_name]
            assert graph["roles"]["logits_offset"] == "logits_offset"
            proto = onnx.load(str(part_paths(offset, graph_name, compiled=False)[0]))
            assert [o.name for o in proto.graph.output].count("logits_offset") == 1
            spec = {p.key: p.value for p in proto.metadata_props}["qnnpasses.passmanager.spec"]
            options = f"output=logits,candidates={count}" if count else "output=logits"
            assert f",{LOGITS_OFFSET}{{{options}}},tied-embedding" in spec
            shift = None if graph_name == "prefill" else 0
            assert spec.endswith("," + fp16_passes("logits", True, residual_shift=shift, offset_candidates=count).to_text())
            got = PartsRunner(offset["dir"], graph)(feed)
            np.testing.assert_allclose(absolute_logits(got, graph["roles"]), want, atol=1e-5, rtol=0)
            np.testing.assert_allclose(got["logits_offset"][..., 0], want[..., :count or None].max(-1), atol=1e-5)


def test_max_part_bytes_budget_gives_parts_within_it(built):
    from qnnpasses.ir.load import load_model
    from qnnpasses.llm.split import plan_parts

    manifest = built("llama_gqa_kv_dyn_ts")
    ir = load_model(part_paths(manifest, "decode", compiled=False)[0])
    weights = sum(int(np.prod(t.shape)) * 4 for t in ir.graph.tensors().values()
                  if t.__class__.__name__ == "Constant" and t.shape and int(np.prod(t.shape)) > 1024)
    _, pieces = plan_parts(ir, manifest["graphs"]["decode"]["roles"]["input_ids"], max_part_bytes=weights // 2)
    assert len(pieces) >= 2
    assert all(p.weight_bytes + p.peak_activation_bytes <= weights // 2 for p in pieces)


def test_calibration_feeds_are_streamed_to_disk_and_equal_the_runner_feeds(built, tmp_path):
    """--calib keeps at most `limit` calls per graph, evenly spread, written to memory-mapped
    stacks; each kept feed is exactly the feed of that call when the float pair runs the sequence."""
    from pathlib import Path

    from qnnpasses.llm.quantize import _schedule, calibration_samples

    manifest = built("llama_gqa_kv_dyn_ts")
    folder = Path(manifest["dir"])
    sequences = np.random.default_rng(5).integers(0, manifest["vocab"], (2, 40))
    written = calibration_samples(folder, manifest, sequences, tmp_path, limit=3)
    assert written == {"prefill": 3, "decode": 3}
    graphs, roles = manifest["graphs"], manifest["graphs"]["decode"]["roles"]
    runners = {g: PartsRunner(folder, graphs[g]) for g in graphs}
    feeds = {"prefill": [], "decode": []}
    for plan in _schedule(manifest, sequences):  # every call's feed, held in memory (small fixture)
        cache = {n: np.zeros((1, manifest["kv_heads"], CONTEXT, manifest["head_dim"]), np.float32)
                 for n in roles["past_key"] + roles["past_value"]}
        valid = 0
        for name, chunk in plan:
            feed = static_feed(graphs[name], chunk, valid, cache)
            feeds[name].append(feed)
            out = runners[name](feed)
            for past, new in zip(roles["past_key"] + roles["past_value"], roles["new_key"] + roles["new_value"]):
                cache[past][:, :, valid:valid + len(chunk)] = out[new][:, :, :len(chunk)]
            valid += len(chunk)
    for name, calls in feeds.items():
        keep = np.linspace(0, len(calls) - 1, 3).round().astype(int)
        for key in calls[0]:
            stored = np.load(tmp_path / name / f"{key}.npy", mmap_mode="r")
            np.testing.assert_array_equal(stored, np.stack([calls[i][key] for i in keep]))


def test_every_graph_and_part_reads_its_weights_from_one_file(tmp_path):
    """The pair's graphs (here split into parts) hold the same weights: the bundle stores them once,
    in ``weights.data``, and the parts still compute what the original does."""
    from qnnpasses.llm.convert import WEIGHTS_FILE, build

    source = tmp_path / "export" / "model.onnx"
    source.parent.mkdir()
    onnx.save(onnx.load(str(fixture_path("llama_gqa_kv_dyn_ts"))), str(source), save_as_external_data=True,
              location="model.onnx.data", size_threshold=1024)
    manifest = build(source, tmp_path / "pair", context=64, prefill=16, parts=2, compile=False, probe=False)
    folder = tmp_path / "pair"
    assert [p.name for p in folder.glob("*.data")] == [WEIGHTS_FILE]
    parts = [folder / p["onnx"] for g in manifest["graphs"].values() for p in g["parts"]]
    assert len(parts) == 4
    for path in parts:
        locations = {e.value for t in onnx.load(str(path), load_external_data=False).graph.initializer
                     for e in t.external_data if e.key == "location"}
        assert locations == {WEIGHTS_FILE}, path.name
    report = json.loads((folder / "report.json").read_text())
    stored = report["weights_file"]
    assert stored["bytes_after"] == (folder / WEIGHTS_FILE).stat().st_size
    assert stored["bytes_after"] <= 0.55 * stored["bytes_before"]  # prefill's and decode's weights, once
    assert report["verification"]["ok"] and report["parts_verification"]["ok"]


def test_graphs_larger_than_the_default_part_budget_are_split_without_being_asked(tmp_path, monkeypatch):
    """Without --parts / --max-part-bytes a graph is split where it holds more than
    DEFAULT_PART_BYTES on the HTP (weights at 2 bytes per float in an fp16 pair)."""
    from qnnpasses.llm import convert
    from qnnpasses.ir.model import file_weight_bytes

    held = file_weight_bytes(fixture_path("llama_gqa_kv_dyn_ts"), float_bytes=2)
    monkeypatch.setattr(convert, "DEFAULT_PART_BYTES", held // 2)
    manifest = convert.build(fixture_path("llama_gqa_kv_dyn_ts"), tmp_path / "pair", context=64, prefill=16,
                             compile=False, probe=False)
    report = json.loads((tmp_path / "pair" / "report.json").read_text())
    assert report["split"] == {"parts": None, "max_part_bytes": held // 2, "default": True}
    for graph in manifest["graphs"].values():
        assert len(graph["parts"]) >= 2
        htp_bytes = [file_weight_bytes(tmp_path / "pair" / p["onnx"], float_bytes=2) for p in graph["parts"]]
        assert max(htp_bytes) <= held // 2
    assert report["parts_verification"]["ok"]
