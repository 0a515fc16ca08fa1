"""``qnnpasses analyze``: weights, activations, KV cache and op cost, checked against figures
computed independently (from the ONNX proto, the fixture config, and onnxruntime's real tensors)."""

from __future__ import annotations

import json
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import LLAMA_FAMILY, fixture_config, fixture_inputs, fixture_path
from onnx import TensorProto, helper

from qnnpasses.analysis import analyze, run_analysis
from qnnpasses.analysis.activations import ORDERS, evaluate
from qnnpasses.analysis.graph import build_view
from qnnpasses.cli import main
from qnnpasses.ir.load import load_model

LLAMAS = [n for n in LLAMA_FAMILY if n.startswith("llama")]


@pytest.fixture(scope="module")
def reports():
    """One analysis per LLaMA-family fixture, shared by the tests (context 4096)."""
    return {name: analyze(load_model(fixture_path(name)), 4096) for name in LLAMA_FAMILY}


def _tensor_bytes(tensor: onnx.TensorProto) -> int:
    return int(np.prod(tensor.dims, dtype=np.int64)) * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def _stored_tensors(name: str):
    """(initializers, Constant-node value tensors) read straight from the proto."""
    proto = onnx.load(fixture_path(name))
    constants = [a.t for n in proto.graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"]
    return list(proto.graph.initializer), constants


# --------------------------------------------------------------------------- weights


@pytest.mark.parametrize("name", LLAMA_FAMILY)
def test_weight_bytes_equal_the_stored_tensor_sizes(reports, name):
    initializers, constants = _stored_tensors(name)
    w = reports[name]["weights"]
    assert w["initializer_bytes"] == sum(_tensor_bytes(t) for t in initializers)
    assert w["constant_node_bytes"] == sum(_tensor_bytes(t) for t in constants)
    assert w["total_bytes"] == w["initializer_bytes"] + w["constant_node_bytes"]
    assert sum(w["by_dtype"].values()) == sum(w["by_layer"].values()) == w["total_bytes"]
    counts = [int(np.prod(t.dims, dtype=np.int64)) for t in initializers + constants if t.data_type == TensorProto.FLOAT]
    others = sum(_tensor_bytes(t) for t in initializers + constants if t.data_type != TensorProto.FLOAT)
    int4 = sum((n + 1) // 2 for n in counts) + others  # two per byte, each tensor padded to a byte
    assert (w["at_fp16"], w["at_int8"], w["at_int4"]) == (2 * sum(counts) + others, sum(counts) + others, int4)


@pytest.mark.parametrize("name", LLAMA_FAMILY)
def test_projection_weights_are_attributed_to_their_layer(reports, name):
    c = fixture_config(name)
    head_dim = c["hidden"] // c["heads"]
    projections = 4 * (2 * c["hidden"] ** 2 + 2 * c["hidden"] * c["kv_heads"] * head_dim + 3 * c["hidden"] * c["intermediate"])
    by_layer = reports[name]["weights"]["by_layer"]
    for layer in range(c["layers"]):
        # projections plus at most norms, biases and small shape constants
        assert projections <= by_layer[str(layer)] <= projections + 2048, (layer, by_layer)


# --------------------------------------------------------------------------- KV cache


@pytest.mark.parametrize("name", LLAMA_FAMILY)
def test_kv_cache_is_two_layers_kvheads_headdim_context_bytes(reports, name):
    c = fixture_config(name)
    head_dim = c["hidden"] // c["heads"]
    kv = reports[name]["kv_cache"]
    assert (kv["layers"], kv["heads"], kv["kv_heads"], kv["head_dim"], kv["context"]) == (
        c["layers"], c["heads"], c["kv_heads"], head_dim, 4096)
    assert kv["bytes_fp16"] == 2 * c["layers"] * c["kv_heads"] * head_dim * 4096 * 2
    assert kv["bytes_int8"] == 2 * c["layers"] * c["kv_heads"] * head_dim * 4096 * 1
    assert kv["bytes_fp16_mha"] == 2 * c["layers"] * c["heads"] * head_dim * 4096 * 2


def test_kv_cache_default_context_is_the_models_key_length():
    kv = analyze(load_model(fixture_path("llama_gqa_kv_ts")))["kv_cache"]
    c = fixture_config("llama_gqa_kv_ts")
    assert kv["context"] == c["past"] + c["seq"]
    assert all(b["kv_heads_source"].startswith("repeat_kv ") for b in kv["blocks"])  # found from the graph, not names


# (layers, heads, kv_heads, head_dim) of tools/export_fixtures.py's KV-cache specs
KV_EXPORTS = {name: (2, 4, 4 if name.startswith("gpt2") else 2, 16) for name in (
    "llama_gqa_kv_ts", "llama_gqa_kv_dynamo", "llama_gqa_kv_dyn_ts", "llama_gqa_kv_dyn_dynamo",
    "llama_gqa_kv_sdpa_dyn_ts", "llama_gqa_kv_sdpa_dyn_dynamo", "mistral_kv_dyn_ts", "mistral_kv_dyn_dynamo",
    "gpt2_kv_dyn_ts", "gpt2_kv_dyn_dynamo")}


def _renamed_inputs(name: str) -> onnx.ModelProto:
    """The export with every graph input renamed to ``in_<i>``: nothing may depend on names."""
    model = onnx.load(fixture_path(name))
    renames = {t.name: f"in_{i}" for i, t in enumerate(model.graph.input)}
    for tensor in model.graph.input:
        tensor.name = renames[tensor.name]
    for node in model.graph.node:
        node.input[:] = [renames.get(n, n) for n in node.input]
    return model


@pytest.mark.parametrize("name", sorted(KV_EXPORTS))
def test_kv_cache_of_every_exporter_comes_from_the_graph_not_names(name):
    layers, heads, kv_heads, head_dim = KV_EXPORTS[name]
    kv = analyze(load_model(_renamed_inputs(name)), 128)["kv_cache"]
    if "sdpa_dyn_ts" in name or name == "mistral_kv_dyn_ts":
        heads = kv_heads  # TorchScript's grouped SDPA scores [B, kv_heads, G·S, D] queries: no query heads to see
    assert (kv["layers"], kv["heads"], kv["kv_heads"], kv["head_dim"]) == (layers, heads, kv_heads, head_dim)
    assert kv["past_inputs"] == 2 * layers and not any("but" in note for note in kv["notes"])
    assert kv["bytes_fp16"] == 2 * layers * kv_heads * head_dim * 128 * 2


def test_kv_cache_of_a_fused_onnx_attention_op():
    q = helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, 8, 6, 32])
    k = helper.make_tensor_value_info("k", TensorProto.FLOAT, [1, 2, 6, 32])
    v = helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, 2, 6, 32])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 6, 32])
    graph = helper.make_graph([helper.make_node("Attention", ["q", "k", "v"], ["y"], name="attn")], "g", [q, k, v], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    kv = analyze(load_model(model), 100)["kv_cache"]
    assert (kv["layers"], kv["heads"], kv["kv_heads"], kv["head_dim"]) == (1, 8, 2, 32)
    assert kv["bytes_fp16"] == 2 * 1 * 2 * 32 * 100 * 2 and kv["gqa_saving"] == pytest.approx(0.75)


# --------------------------------------------------------------------------- activations


def _real_activation_bytes(name: str) -> dict[str, int]:
    """Bytes of every graph input and node output as onnxruntime actually computes them."""
    proto = onnx.load(fixture_path(name))
    inferred = onnx.shape_inference.infer_shapes(proto)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in inferred.graph.value_info}
    present = {o.name for o in proto.graph.output}
    for node in proto.graph.node:
        for out in node.output:
            if node.op_type != "Constant" and out and out not in present and out in types:
                proto.graph.output.append(helper.make_tensor_value_info(out, types[out], None))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = fixture_inputs(name)
    names = [o.name for o in session.get_outputs()]
    sizes = {n: int(a.nbytes) for n, a in zip(names, session.run(names, feeds))}
    sizes.update({n: int(a.nbytes) for n, a in feeds.items()})
    return sizes, proto


@pytest.mark.parametrize("name", LLAMAS)
def test_activation_peaks_are_bounded_by_real_tensor_sizes(reports, name):
    sizes, proto = _real_activation_bytes(name)
    a = reports[name]["activations"]
    assert a["unknown_size_tensors"] == []
    assert a["peak_bytes_no_reuse"] == sum(sizes.values())  # every activation, sized exactly
    # lower bound: while a node runs, its activation inputs and outputs are all live
    lower = max(sum(sizes[t] for t in set(n.input) | set(n.output) if t in sizes) for n in proto.graph.node)
    assert lower <= a["peak_live_bytes"] <= a["peak_bytes_reuse"] <= a["peak_bytes_no_reuse"]
    assert sum(t["bytes"] for t in a["live_at_peak"]) == a["peak_live_bytes"]
    assert a["schedules"][a["schedule"]]["peak_bytes_reuse"] == min(s["peak_bytes_reuse"] for s in a["schedules"].values())
    assert a["reuse_saving"] > 0.5  # reuse beats one buffer per tensor by far


def test_schedules_are_topological_and_the_arena_never_overlaps_live_tensors():
    view = build_view(load_model(fixture_path("llama_gqa_kv_ts")))
    for schedule in ORDERS:
        result = evaluate(view, schedule)
        position = {node: i for i, node in enumerate(result["order"])}
        for node, reads in enumerate(view.reads):
            for name in reads:
                producer = view.tensors[name].producer
                if producer is not None and view.nodes[node].op != "Constant":
                    assert position[producer] < position[node], (schedule, view.nodes[node].name)
        life, offsets = result["life"], result["offsets"]
        ends = offsets + life.sizes
        assert int(ends.max()) == result["arena"]
        live_together = (life.first[:, None] <= life.last[None, :]) & (life.first[None, :] <= life.last[:, None])
        share_memory = (offsets[:, None] < ends[None, :]) & (offsets[None, :] < ends[:, None])
        nonempty = (life.sizes[:, None] > 0) & (life.sizes[None, :] > 0)
        clash = live_together & share_memory & nonempty & ~np.eye(len(offsets), dtype=bool)
        assert not clash.any(), schedule


def test_symbolic_inputs_are_sized_from_shape_arguments():
    ir = load_model(fixture_path("llama_gqa_kv_dyn_ts"))
    report = analyze(ir, shapes={"input_ids": [1, 1], "attention_mask": [1, 9]} | {
        f"past_key_values.{i}.{kv}": [1, 2, 8, 16] for i in range(2) for kv in ("key", "value")})
    static = analyze(load_model(fixture_path("llama_gqa_kv_ts")))
    assert report["activations"]["unknown_size_tensors"] == []
    assert report["kv_cache"]["context"] == static["kv_cache"]["context"] == 9
    assert report["cost"]["total_flops"] == pytest.approx(static["cost"]["total_flops"], rel=0.01)


# --------------------------------------------------------------------------- cost


def _cost_model():
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,16,64] x, int64[1,16] ids) => (float[1,16,32] y, float[16,32] z, float[1,4,16,16] c, float[1,16,8] e) {
        h = MatMul(x, w)
        s = Softmax<axis=-1>(h)
        r = Reshape(s, shape)
        z = Gemm(r, w2, b2)
        y = Reshape(z, shape2)
        c = Conv<kernel_shape=[3,3], pads=[1,1,1,1]>(img, k)
        e = Gather(table, ids)
    }
    """
    model = onnx.parser.parse_model(text)
    rng = np.random.default_rng(0)
    inits = {"w": (64, 32), "w2": (32, 32), "b2": (32,), "img": (1, 3, 16, 16), "k": (4, 3, 3, 3), "table": (100, 8)}
    for name, shape in inits.items():
        model.graph.initializer.append(onnx.numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name))
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([16, 32], np.int64), "shape"))
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([1, 16, 32], np.int64), "shape2"))
    return model


def test_per_op_flops_and_bytes():
    report = analyze(load_model(_cost_model()), top=3, ridge=5.0)
    ops = {o["op_type"]: o for o in report["ops"]}
    assert ops["MatMul"]["flops"] == 2 * 16 * 64 * 32
    assert ops["MatMul"]["bytes"] == 4 * (16 * 64 + 64 * 32 + 16 * 32)
    assert ops["Gemm"]["flops"] == 2 * 16 * 32 * 32 + 16 * 32
    assert ops["Conv"]["flops"] == 2 * (4 * 16 * 16) * (3 * 3 * 3)
    assert ops["Softmax"]["flops"] == 5 * 16 * 32
    assert ops["Reshape"]["flops"] == 0 and ops["Reshape"]["bytes"] == 0
    assert ops["Gather"]["flops"] == 0 and ops["Gather"]["bytes"] == 2 * 16 * 8 * 4 + 16 * 8  # rows, not the table
    assert report["hotspots"] == ["MatMul_0", "Conv_5", "Gemm_3"]
    # intensities: Softmax 0.6, MatMul 4.6, Conv 7.3 FLOPs/byte against a ridge of 5
    assert ops["Softmax"]["memory_bound"] and ops["MatMul"]["memory_bound"] and not ops["Conv"]["memory_bound"]
    assert report["op_types"]["Reshape"]["count"] == 2
    assert report["cost"]["total_flops"] == sum(o["flops"] for o in report["ops"])


# --------------------------------------------------------------------------- command line


def _cli(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_json_has_the_documented_keys(capsys):
    code, out, _ = _cli(capsys, "analyze", fixture_path("llama_gqa_dynamo"), "--format", "json", "--context", "2048")
    report = json.loads(out)
    assert code == 0
    assert {"total_bytes", "by_dtype", "by_layer", "at_fp16", "at_int8", "at_int4"} <= set(report["weights"])
    assert {"peak_bytes_no_reuse", "peak_bytes_reuse", "live_at_peak", "schedule"} <= set(report["activations"])
    assert {"layers", "kv_heads", "heads", "head_dim", "context", "bytes_fp16", "bytes_int8", "bytes_fp16_mha"} <= set(report["kv_cache"])
    assert {"name", "op_type", "flops", "bytes"} <= set(report["ops"][0]) and report["op_types"]["MatMul"]["count"] == 19
    assert report["kv_cache"]["bytes_fp16"] == 2 * 2 * 2 * 16 * 2048 * 2


def test_cli_text_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "mem.png"
    code, out, _ = _cli(capsys, "analyze", fixture_path("llama_gqa_ts"), "--picture", png, "--top", "3")
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "arena with reuse" in out and "kv cache" in out and "/model/lm_head/MatMul" in out


@pytest.mark.parametrize("argv, message", [
    (["--context", "0"], "--context must be a positive"),
    (["--top", "0"], "--top must be positive"),
    (["--shape", "nope=1,2"], "unknown inputs"),
    (["--picture", "out.txt"], "writes a .png or .svg file"),
])
def test_cli_bad_arguments_give_one_line_and_exit_2(tmp_path, capsys, argv, message):
    argv = [a if a != "out.txt" else tmp_path / a for a in argv]
    code, out, err = _cli(capsys, "analyze", fixture_path("llama_gqa_ts"), *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_cli_plot_without_matplotlib_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = _cli(capsys, "analyze", fixture_path("llama_gqa_ts"), "--picture", tmp_path / "m.png")
    assert code == 2 and "needs matplotlib" in err and len(err.strip().splitlines()) == 1


def test_run_analysis_trace_matches_the_report():
    report, trace = run_analysis(load_model(fixture_path("llama_gqa_ts")))
    a = report["activations"]
    assert trace.schedule == a["schedule"] and int(trace.live.max()) == a["peak_live_bytes"]
    assert int(trace.allocated[-1]) == a["peak_bytes_no_reuse"] and trace.arena == a["peak_bytes_reuse"]
