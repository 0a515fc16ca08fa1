"""onnxruntime-genai model-builder models (tests/fixtures/genai, made by tools/genai_models.py build)
through htp-llm: loaded despite onnxruntime-only ops, lowered to standard ONNX, on the HTP.

- fp32 builds (LLaMA, Qwen2 with q/k/v biases): 1 QNN partition, 0 CPU nodes in fp16 (CPU fallback disabled), cosine >= 0.9999
  against the original (contrib ops) on onnxruntime CPU; past/present KV stay graph I/O.
- int4 build: the builder's 4-bit block weights survive htp-llm and ``qnnpasses quantize``
  unchanged, and the quantized model runs entirely on the HTP in integer mode.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import requires_htp

from qnnpasses.backends.cpu import adapt_inputs, cosine_similarity, run_cpu
from qnnpasses.cli import main
from qnnpasses.ir.load import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from genai_models import DEFAULT_FIXTURES, FP16_TOLERANCE, htp_placement, prefill_shapes, verification_inputs

FP32 = DEFAULT_FIXTURES / "llama_fp32" / "model.onnx"
INT4 = DEFAULT_FIXTURES / "llama_int4" / "model.onnx"
FP16 = DEFAULT_FIXTURES / "llama_fp16" / "model.onnx"
QWEN = DEFAULT_FIXTURES / "qwen2_fp32" / "model.onnx"
FLOAT_BUILDS = {"llama_fp32": FP32, "qwen2_fp32": QWEN}
CONTRIB = {"SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "GroupQueryAttention", "MatMulNBits"}


@pytest.fixture(scope="module")
def lowered(tmp_path_factory):
    """htp-llm outputs of both builds, made once (strict, verified on CPU)."""
    out = tmp_path_factory.mktemp("genai")
    paths = {}
    for name, model, lossy in (("llama_fp32", FP32, False), ("qwen2_fp32", QWEN, False), ("int4", INT4, True)):
        paths[name] = out / f"{name}.onnx"
        args = ["run", "-q", "--pipeline", "htp-llm", str(model), "-o", str(paths[name]), "--verify", "--strict"]
        assert main(args + (["--allow-lossy"] if lossy else [])) == 0
    return paths


def _ops(path) -> set[str]:
    return {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}


def test_builder_model_loads_and_names_its_onnxruntime_only_ops(capsys):
    ir = load_model(FP32)
    assert CONTRIB - {"MatMulNBits"} <= {n.op for n in ir.graph.nodes}
    err = capsys.readouterr().err
    assert "SimplifiedLayerNormalization (1)" in err and err.count("\n") == 1


def test_a_truly_unknown_default_domain_op_is_still_refused(tmp_path, capsys):
    model = onnx.parser.parse_model('<ir_version: 8, opset_import: ["" : 17]> g (float[2] x) => (float[2] y) { y = NoSuchOp(x) }')
    path = tmp_path / "bad.onnx"
    onnx.save(model, str(path))
    assert main(["run", "-q", "--pipeline", "htp-llm", str(path), "-o", str(tmp_path / "o.onnx")]) == 2
    err = capsys.readouterr().err.strip()
    assert "NoSuchOp" in err and err.count("\n") == 0 and not (tmp_path / "o.onnx").exists()


def test_lowered_graphs_are_standard_onnx_with_kv_cache_io(lowered):
    for name, path in lowered.items():
        assert not _ops(path) & CONTRIB, name
        onnx.checker.check_model(onnx.load(str(path)))  # no onnxruntime-only op left
        graph = onnx.load(str(path), load_external_data=False).graph
        past = [i for i in graph.input if i.name.startswith("past_key_values.")]
        present = [o for o in graph.output if o.name.startswith("present.")]
        assert len(past) == len(present) == 4
        dims = lambda v: [d.dim_value for d in v.type.tensor_type.shape.dim]
        mask = next(i for i in graph.input if i.name == "attention_mask")
        # static, and consistent: present = past + new, the mask spans both
        assert dims(present[0])[2] == dims(past[0])[2] + dims(graph.input[0])[1] == dims(mask)[1]


@requires_htp
@pytest.mark.parametrize("name", sorted(FLOAT_BUILDS))
def test_fp32_build_runs_entirely_on_htp(lowered, tmp_path, name):
    from qnnpasses.backends.htp import htp_session, parse_profile

    inputs = verification_inputs(FLOAT_BUILDS[name])
    expected = run_cpu(FLOAT_BUILDS[name], inputs)  # the original, contrib ops and all
    session = htp_session(lowered[name], fp16=True, disable_cpu_fallback=True, profiling=True,
                          profile_prefix=str(tmp_path / "p"))
    names = [o.name for o in session.get_outputs()]
    got = dict(zip(names, session.run(names, adapt_inputs(load_model(lowered[name]), inputs))))
    assert parse_profile(session.end_profiling()) == (1, [])
    for output in names:
        assert cosine_similarity(got[output], expected[output]) >= 0.9999, output


@requires_htp
def test_int4_build_is_quantized_on_htp_with_its_4bit_weights(lowered, tmp_path):
    from qnnpasses.backends.htp import htp_session, parse_profile

    calib = tmp_path / "calib"
    calib.mkdir()
    for seed in range(1, 5):
        np.savez(calib / f"{seed}.npz", **verification_inputs(INT4, seed))
    quantized = tmp_path / "q.onnx"
    assert main(["quantize", str(lowered["int4"]), "--calib", str(calib), "-o", str(quantized)]) == 0
    proto = onnx.load(str(quantized))
    int4 = {t.name for t in proto.graph.initializer if t.data_type == onnx.TensorProto.INT4}
    weight_dqs = [n for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in int4]
    assert len(weight_dqs) == 11  # q/k/v, o, gate, up, down x 2 layers (qkv packed) + lm_head: all still 4-bit
    assert all(next(a.i for a in n.attribute if a.name == "block_size") == 32 for n in weight_dqs)

    inputs = verification_inputs(INT4)
    expected = run_cpu(INT4, inputs)
    session = htp_session(quantized, fp16=False, disable_cpu_fallback=True, profiling=True,
                          profile_prefix=str(tmp_path / "p"), extra_options={"offload_graph_io_quantization": "0"})
    got = session.run(["logits"], adapt_inputs(load_model(quantized), inputs))[0]
    assert parse_profile(session.end_profiling()) == (1, [])
    assert cosine_similarity(got, expected["logits"]) >= 0.99  # measured 0.994 (random weights, 4 samples)


@requires_htp
def test_fp16_build_prefill_is_lowered_and_accurate_on_htp(tmp_path):
    """The builder's fp16/CPU graph (RotaryEmbedding + MultiHeadAttention; runs only with an empty cache)."""
    shapes = prefill_shapes(FP16)
    out = tmp_path / "fp16.onnx"
    args = ["run", "-q", "--pipeline", "htp-llm", str(FP16), "-o", str(out), "--verify", "--strict", *FP16_TOLERANCE]
    for name, dims in shapes.items():
        args += ["--shape", f"{name}={','.join(map(str, dims))}"]
    assert main(args) == 0
    assert not _ops(out) & (CONTRIB | {"RotaryEmbedding", "MultiHeadAttention"})
    placement = htp_placement(out, FP16, shapes=shapes)
    assert placement["cosine"]["logits"] >= 0.9999
    # the builder's mask Cast(float16 -> bool), which the HTP rejects, is lowered too (lower-cast-to-bool)
    assert (placement["qnn_partitions"], placement["cpu_nodes"]) == (1, 0)
