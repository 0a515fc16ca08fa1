"""The outlier rewrites of a quantized pair (`qnnpasses llm --precision w8a16`), on a random-weight
KV-cache fixture whose norms are given trained-like per-channel scales (the committed fixture's
norm weights are all ones, where fold-norm-weights has nothing to do).

- both rewrites apply to both graphs (not rolled back), with identical weights in the two graphs;
- the rewritten float pair, driven as the runner drives it (prompt in padded prefill chunks, then
  decode steps), matches the original dynamic export on CPU: logits and new K/V within
  1e-4 + 1e-4·max|ref| (the pass manager's EXACT bound; the rotation leaves K/V unchanged);
- each pass is verified in float64 on the manager's synthetic cases (fold-norm-weights within
  1% of the EXACT bound, measured ~0.4%) and in fp32 on real calls;
- a rewrite that is not exact, or that applies to one graph only, is rolled back on both;
- the quantized pair: the rewrites are recorded as applied (and not run again by the quantizer),
  the lm_head has 16-bit weights (closer to the float ones than int8 rounding), every other
  projection int8, and both graphs stay 1 QNN partition with 0 CPU nodes
  on the HTP (when the backend is here).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import fixture_path, htp_backend_available
from onnx import numpy_helper

from qnnpasses.llm.cache_dtype import ROUNDING
from qnnpasses.llm.manifest import load_manifest, part_paths

CONTEXT, PREFILL = 256, 16
HTP = htp_backend_available()
NAME = "llama_gqa_kv_dyn_ts"


def _with_norm_scales(src: Path, dst: Path, seed: int = 0) -> Path:
    """``src`` with every RMSNorm weight (all ones, one shared initializer in the TorchScript export)
    replaced by its own per-channel scale in [0.3, 3] plus one outlier channel at 7 (SmolLM2's
    final-norm scale spans 0.2-7)."""
    model = onnx.load(str(src))
    inits = {i.name: i for i in model.graph.initializer}
    rng = np.random.default_rng(seed)
    count = 0
    for node in model.graph.node:
        for k, name in enumerate(node.input):
            if name in inits and "norm" in name and len(inits[name].dims) == 1:
                gamma = rng.uniform(0.3, 3.0, inits[name].dims[0]).astype(np.float32)
                gamma[rng.integers(0, gamma.size)] = 7.0
                new = numpy_helper.from_array(gamma, f"{name}.{count}")
                model.graph.initializer.append(new)
                node.input[k] = new.name
                count += 1
    assert count >= 5  # 2 layers x 2 norms + the final norm
    onnx.save(model, str(dst))
    return dst


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return _with_norm_scales(fixture_path(NAME), tmp_path_factory.mktemp("scaled") / "scaled.onnx")


@pytest.fixture(scope="module")
def float_pair(export, tmp_path_factory):
    from qnnpasses.llm.convert import build

    out = tmp_path_factory.mktemp("float") / "pair"
    # the lm_head as a quantized pair has it: logits-offset is for fp16 pairs only (its Concat
    # of the stream with the row max is not a linear reader rotate-residual can absorb)
    # and the float32 cache the float graphs of a quantized pair keep (an fp16 pair's is float16)
    build(export, out, context=CONTEXT, prefill=PREFILL, compile=False, probe=False, logits_offset=False,
          cache_fp16=False)
    return load_manifest(out)


@pytest.fixture(scope="module")
def real_calls(float_pair, tmp_path_factory):
    """Per graph, the inputs of real calls of the float pair (caches it wrote itself)."""
    from qnnpasses.ir.load import load_model
    from qnnpasses.llm.quantize import calibration_samples
    from qnnpasses.quant.calibration import CalibrationData, model_inputs

    out = tmp_path_factory.mktemp("calls")
    sequences = np.random.default_rng(4).integers(0, float_pair["vocab"], (2, 48))
    calibration_samples(Path(float_pair["dir"]), float_pair, sequences, out, limit=4)
    calls = {}
    for name in ("prefill", "decode"):
        ir = load_model(part_paths(float_pair, name, compiled=False)[0])
        calls[name] = CalibrationData(out / name, model_inputs(ir)).head(4)
    return calls


def _rewrite(float_pair, real_calls, spec, work):
    from qnnpasses.llm.outliers import rewrite_pair

    paths = {g: part_paths(float_pair, g, compiled=False)[0] for g in ("prefill", "decode")}
    return rewrite_pair(paths, spec, real_calls, work)


def test_outlier_rewrites_apply_to_both_graphs_and_keep_the_pair_exact(export, float_pair, real_calls, tmp_path):
    from qnnpasses.ir.load import load_model
    from qnnpasses.llm.outliers import constant_digests
    from qnnpasses.llm.verify import compare_sequence

    paths, records = _rewrite(float_pair, real_calls, "fold-norm-weights,rotate-residual", tmp_path / "work")
    assert [(r["pass"], r["status"]) for r in records] == [("fold-norm-weights", "changed"),
                                                           ("rotate-residual", "changed")], records
    # what the work folder keeps: the last pass's graphs and outputs (each graph is a copy of the weights)
    assert sorted(p.name for p in (tmp_path / "work").iterdir() if p.suffix in (".onnx", ".data")) == [
        "decode.2.onnx", "decode.2.onnx.data", "prefill.2.onnx", "prefill.2.onnx.data"]
    for record in records:
        for graph in ("prefill", "decode"):
            checks = record["graphs"][graph]
            assert checks["float64"]["ok"] and checks["real_fp32"]["ok"]
            assert {"random", "masked", "extreme", "given (real call 0)"} <= set(checks["float64"]["cases"])
    fold = records[0]
    assert fold["stats"]["prefill"]["folded"] == fold["stats"]["decode"]["folded"] == 5
    assert max(c["of_bound"] for g in ("prefill", "decode") for c in fold["graphs"][g]["float64"]["cases"].values()) < 0.01
    assert records[1]["stats"]["decode"]["rotated"] == 1
    # the two graphs hold the same rewritten weights: every constant the rewrites created is identical in both
    created = {}
    for graph in ("prefill", "decode"):
        before = constant_digests(load_model(part_paths(float_pair, graph, compiled=False)[0]))
        after = constant_digests(load_model(paths[graph]))
        created[graph] = {n: digest for n, digest in after.items() if n not in before}
    assert len(created["prefill"]) >= 2 * 4 + 1 + 5  # projections (4 per layer) + embedding + unit norm scales
    assert created["prefill"] == created["decode"]
    # the rewritten pair, driven like the runner drives it, still computes the original export
    rotated = tmp_path / "rotated"
    rotated.mkdir()
    manifest = json.loads((Path(float_pair["dir"]) / "llm.json").read_text())
    for graph in ("prefill", "decode"):
        target = rotated / f"{graph}.onnx"
        shutil.copy(paths[graph], target)
        if paths[graph].with_name(paths[graph].name + ".data").exists():
            shutil.copy(paths[graph].with_name(paths[graph].name + ".data"), rotated / f"{paths[graph].name}.data")
        manifest["graphs"][graph]["parts"][0]["onnx"] = target.name
    (rotated / "llm.json").write_text(json.dumps(manifest))
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, float_pair["vocab"], 37)]
    result = compare_sequence(rotated, load_manifest(rotated), export, prompt, new_tokens=6)
    assert result["calls"] == 3 + 5
    assert result["logits"] <= 1e-4 + 1e-4 * result["logits_scale"], result
    assert result["kv"] <= 1e-4 + (1e-4 + ROUNDING) * result["kv_scale"], result  # fp16 cache: rounded K/V


def test_a_fold_that_no_rotation_follows_is_undone(float_pair, real_calls, tmp_path):
    """fold-norm-weights is there to let rotate-residual through the norms: a pair it changes alone
    is quantized without it (the norm scales stay in the norms, out of the int8 weights)."""
    from qnnpasses.llm.outliers import undo_lone_fold

    _, records = _rewrite(float_pair, real_calls, "fold-norm-weights", tmp_path / "alone")
    assert records[0]["status"] == "changed" and undo_lone_fold(records)
    assert records[0]["status"] == "undone" and "no rotation" in records[0]["reason"]
    _, records = _rewrite(float_pair, real_calls, "fold-norm-weights,rotate-residual", tmp_path / "both")
    assert not undo_lone_fold(records) and [r["status"] for r in records] == ["changed", "changed"]


def test_a_rewrite_that_is_not_exact_or_not_in_both_graphs_is_rolled_back_on_both(float_pair, real_calls, tmp_path):
    from dataclasses import dataclass

    from qnnpasses.passmanager.api import EXACT, Pass, PassResult, register_pass
    from qnnpasses.passmanager.rewrite import constant_value, make_constant

    def first_projection(ir):
        return next(n for n in ir.graph.nodes if n.op == "MatMul" and constant_value(n.inputs[1]) is not None)

    @register_pass
    class ScaleOneProjection(Pass):  # claims EXACT, changes a projection's weights by 0.1%
        name = "test-scale-one-projection"
        summary = "W -> 1.001·W on the first projection (not exact)"
        contract = EXACT

        @dataclass
        class Options:
            pass

        def run(self, ir, ctx):
            node = first_projection(ir)
            node.inputs[1] = make_constant(ir, ctx, "scaled_w", constant_value(node.inputs[1]) * np.float32(1.001))
            return PassResult(changed=True)

    @register_pass
    class PrefillOnly(Pass):  # an exact rewrite (W -> W·1, renamed) that matches the prefill graph only
        name = "test-prefill-only"
        summary = "renames a projection weight where 16 tokens come in"
        contract = EXACT

        @dataclass
        class Options:
            pass

        def run(self, ir, ctx):
            if ir.graph.inputs[0].shape[-1] != PREFILL:
                return PassResult(changed=False)
            node = first_projection(ir)
            node.inputs[1] = make_constant(ir, ctx, "renamed_w", constant_value(node.inputs[1]).copy())
            return PassResult(changed=True)

    originals = {g: part_paths(float_pair, g, compiled=False)[0] for g in ("prefill", "decode")}
    try:
        paths, records = _rewrite(float_pair, real_calls, "test-scale-one-projection,test-prefill-only", tmp_path / "w")
    finally:  # the test passes are no part of the registry other tests see
        from qnnpasses.passmanager import api

        for name in (ScaleOneProjection.name, PrefillOnly.name):
            api._REGISTRY.pop(name, None)
            api._ORIGINS.pop(name, None)
    assert [r["status"] for r in records] == ["rolled-back", "rolled-back"], records
    assert "float64" in records[0]["reason"] or "real_fp32" in records[0]["reason"]
    assert "but not ['decode']" in records[1]["reason"]
    assert paths == originals


def _weight_types(model: onnx.ModelProto) -> dict[str, int]:
    """Dequantized output -> stored integer type of every 2-D projection weight of a QDQ graph."""
    inits = {i.name: i for i in model.graph.initializer}
    return {n.output[0]: inits[n.input[0]].data_type for n in model.graph.node
            if n.op_type == "DequantizeLinear" and n.input[0] in inits and len(inits[n.input[0]].dims) == 2
            and any(n.output[0] == m.input[1] for m in model.graph.node if m.op_type == "MatMul")}


def test_quantized_pair_applies_the_rewrites_and_stays_on_the_htp(export, tmp_path):
    from qnnpasses.llm.convert import build

    calib = tmp_path / "tokens.npz"
    np.savez(calib, input_ids=np.random.default_rng(4).integers(0, 256, (4, 40)))
    manifest = build(export, tmp_path / "pair", context=CONTEXT, prefill=PREFILL, precision="w8a16",
                     calib=str(calib), compile=False, probe=HTP, keep_float=True)
    report = json.loads((Path(manifest["dir"]) / "report.json").read_text())
    quantization = report["quantization"]
    assert quantization["float_pair"] == "kept"
    assert {r["pass"]: r["status"] for r in quantization["outlier_rewrites"]} == {
        "fold-norm-weights": "changed", "rotate-residual": "changed"}
    for graph in ("prefill", "decode"):  # the quantizer did not run them again on the rewritten graphs
        assert not [p for p in quantization["graphs"][graph]["prep_passes"] if p["pass"] in ("fold-norm-weights",
                                                                                              "rotate-residual")]
        float_graph = onnx.load(str(Path(manifest["dir"]) / manifest["graphs"][graph]["float_onnx"]))
        assert len(float_graph.graph.node) > 0  # the float graph is kept whole (its own weights file)
    # the lm_head alone is raised to 16-bit weights, and they dequantize closer to the float ones than int8 would
    assert quantization["lm_head"] == {"raised_to_16_bit": ["/model/lm_head/MatMul"], "ok": True}
    for graph in ("prefill", "decode"):
        model = onnx.load(str(part_paths(manifest, graph, compiled=False)[0]))
        widths = _weight_types(model)
        head = next(n for n in model.graph.node if n.name == "/model/lm_head/MatMul")
        assert widths.pop(head.input[1]) == onnx.TensorProto.INT16
        assert set(widths.values()) == {onnx.TensorProto.INT8}
    assert report["quantized_verification"]["top1"] >= 0.9  # random weights, CPU
    if HTP:  # integer mode, boundary Q/DQ on the HTP too: one partition, no CPU node (fallback disabled)
        for graph in ("prefill", "decode"):
            part = report["htp"][graph]["parts"][0]
            assert (part["ok"], part["qnn_partitions"], part["cpu_nodes"]) == (True, 1, 0), part


def test_float64_copy_written_weight_by_weight_computes_the_in_memory_conversion(float_pair, real_calls, tmp_path):
    """run_cases' float64 copy, written one mapped weight at a time, gives the outputs of the whole-proto
    conversion bit for bit; stored outputs are mapped from disk and equal the in-memory ones; the
    one-ulp copy moves every weight by exactly one float32 ulp."""
    from qnnpasses.backends.cpu import verification_cases
    from qnnpasses.ir.load import load_model
    from qnnpasses.llm.outliers import discard, float64_model, run_cases, write_float64

    path = part_paths(float_pair, "prefill", compiled=False)[0]
    external = tmp_path / "external.onnx"
    onnx.save(onnx.load(str(path)), str(external), save_as_external_data=True, location="external.onnx.data",
              size_threshold=0)
    cases = verification_cases(load_model(external), 0)[:2]
    whole = tmp_path / "whole.onnx"
    onnx.save(float64_model(onnx.load(str(external))), str(whole))
    want = run_cases(whole, [type(c)(c.name, {k: v.astype(np.float64) if v.dtype == np.float32 else v
                                              for k, v in c.inputs.items()}) for c in cases])
    store = tmp_path / "outputs"
    got = run_cases(external, cases, float64=True, work=tmp_path, store=store)
    assert all(isinstance(v, np.memmap) for case in got for v in case.values())
    assert all(np.array_equal(w[k], g[k]) for w, g in zip(want, got) for k in w)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["external.onnx", "external.onnx.data", "outputs", "whole.onnx"]
    discard(store)
    assert not store.exists()

    moved = write_float64(external, tmp_path / "moved.onnx", ulp_seed=1)
    before = {i.name: numpy_helper.to_array(i, str(tmp_path)) for i in onnx.load(str(external)).graph.initializer}
    after = {i.name: numpy_helper.to_array(i, str(tmp_path)) for i in onnx.load(str(moved)).graph.initializer}
    big = [k for k, v in before.items() if v.dtype == np.float32 and v.size > 1]
    assert big and all(after[k].dtype == np.float64 for k in before if before[k].dtype == np.float32)
    for k in big:
        ulps = np.abs(after[k].astype(np.float32).view(np.int32).astype(np.int64) - before[k].view(np.int32))
        assert np.all((ulps == 1) | ((before[k] == 0) & (np.abs(after[k]) < 1e-44))), k
