#!/usr/bin/env python
"""onnxruntime-genai model-builder models as test fixtures, and what ``htp-llm`` makes of them.

onnxruntime-genai's model builder (``python -m onnxruntime_genai.models.builder``) is how most
LLMs reach onnxruntime; its output uses onnxruntime contrib ops (``SimplifiedLayerNormalization``,
``SkipSimplifiedLayerNormalization``, ``GroupQueryAttention`` with rotary fused in,
``MatMulNBits``) and past/present KV as graph I/O.  No hub is reachable here, so ``build``
writes a small random-weight LLaMA config (2 layers, hidden 64, 4 heads / 2 KV heads, vocab
256) with transformers, a word-level tokenizer with ``tokenizers``, and runs the builder on it
for each precision: ``llama_fp32``, ``llama_int4`` (``MatMulNBits``, block 32) and
``llama_fp16`` (``RotaryEmbedding`` + ``MultiHeadAttention``), CPU target; and the same config as
Qwen2 (q/k/v biases set to random values so that the builder keeps them), ``qwen2_fp32``.

    pip install onnxruntime-genai        # plus the export extra (torch, transformers)
    python tools/genai_models.py build [--out tests/fixtures/genai]
    python tools/genai_models.py report [--fixtures tests/fixtures/genai] [--out docs/genai]

``report`` runs ``qnnpasses run --pipeline htp-llm`` on every fixture (``--allow-lossy`` for
int4: see ``lower-matmulnbits``), measures the result on onnxruntime-qnn's HTP backend and
writes ``docs/genai.md`` and ``docs/genai.json``: what was lowered, placement (QNN
partitions, CPU nodes), accuracy against the original on onnxruntime CPU, and a probe of how
the backend treats ``DequantizeLinear`` weights (4/8 bit, block-wise/per-channel) with float
or quantized activations.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

from qnnpasses.passmanager.named import CONTRIB_LOWERINGS

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FIXTURES = ROOT / "tests" / "fixtures" / "genai"
#: fixture name -> (architecture, builder precision)
FIXTURES = {"llama_fp32": ("llama", "fp32"), "llama_int4": ("llama", "int4"), "llama_fp16": ("llama", "fp16"),
            "qwen2_fp32": ("qwen2", "fp32")}
# The builder calls FP16+CPU an invalid combination; what it writes anyway (RotaryEmbedding +
# MultiHeadAttention, position_ids input) runs on onnxruntime only with an empty cache (its mask
# subgraph's Expand fails for past > 0), so the fp16 build is measured as a prefill with past = 0.
PREFILL_ONLY = {"fp16"}
FP16_TOLERANCE = ["--atol", "1e-3", "--rtol", "1e-3"]  # rounding of fp16 arithmetic, not of the rewrites
CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
CONTRIB = {"SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "GroupQueryAttention", "MultiHeadAttention",
           "RotaryEmbedding", "MatMulNBits"}


# ----------------------------------------------------------------------------- build


def write_hf_model(directory: Path, arch: str = "llama", seed: int = 0, config: dict | None = None) -> None:
    """A random-weight LLaMA or Qwen2 checkpoint + tokenizer in Hugging Face's layout (no hub
    access); ``config`` replaces :data:`CONFIG`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    config = config or CONFIG
    torch.manual_seed(seed)
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    model = model_cls(config_cls(**config)).eval()
    if arch == "qwen2":  # initialised to zero, which the builder would drop
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(directory)


def build(out: Path, names=tuple(FIXTURES)) -> list[Path]:
    """Run the builder on the random checkpoints -> ``out/<arch>_<precision>/model.onnx``."""
    made = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            arch, precision = FIXTURES[name]
            hf = Path(tmp) / f"hf_{arch}"
            if not hf.exists():
                write_hf_model(hf, arch)
            reason = run_builder(hf, out / name, precision, Path(tmp) / "cache")
            if reason:
                raise SystemExit(f"builder failed for {name}: {reason}")
            made.append(out / name / "model.onnx")
    return made


def run_builder(hf: Path, target: Path, precision: str, cache: Path) -> str | None:
    """onnxruntime-genai's builder on the checkpoint ``hf`` for the CPU -> ``target/model.onnx``
    (the graph and its weights only); ``None``, or the builder's last line when it fails."""
    target.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(target),
               "-p", precision, "-e", "cpu", "-c", str(cache)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not (target / "model.onnx").exists():
        return " ".join((done.stderr or done.stdout).strip().splitlines()[-1:]) or f"exit {done.returncode}"
    for extra in ("genai_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (target / extra).unlink(missing_ok=True)
    return None


# ----------------------------------------------------------------------------- measure


def prefill_shapes(model: Path, sequence: int = 16) -> dict[str, list[int]]:
    """Shapes of a prefill with an empty cache (``--shape`` values)."""
    import onnx

    graph = onnx.load(str(model), load_external_data=False).graph
    shapes = {}
    for value in graph.input:
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
        if value.name.startswith("past_key_values."):
            shapes[value.name] = [1, dims[1], 0, CONFIG["hidden_size"] // CONFIG["num_attention_heads"]]
        else:
            shapes[value.name] = [1, sequence]
    return shapes


def verification_inputs(model: Path, seed: int = 0, shapes: dict[str, list[int]] | None = None) -> dict[str, np.ndarray]:
    """Inputs the lowered graph and the original agree on: no padding, mask length = past + new."""
    from qnnpasses.backends.cpu import make_inputs
    from qnnpasses.ir.load import load_model
    from qnnpasses.passmanager.api import PassContext, get_pass

    ir = load_model(model)
    planned = shapes
    for name in ("lower-gqa", "lower-mha"):
        planned = planned or get_pass(name)().planned_input_shapes(ir, PassContext())
    return make_inputs(ir, seed, planned)


def run_pipeline(model: Path, out: Path, *, lossy: bool, shapes: dict[str, list[int]] | None = None,
                 extra: list[str] | None = None) -> dict:
    from qnnpasses.cli import main

    report_dir = out.parent / f"{out.stem}.report"
    args = ["run", "-q", "--pipeline", "htp-llm", str(model), "-o", str(out), "--verify", "--strict",
            "--report-dir", str(report_dir)] + (["--allow-lossy"] if lossy else []) + list(extra or [])
    for name, dims in (shapes or {}).items():
        args += ["--shape", f"{name}={','.join(map(str, dims))}"]
    if main(args) != 0:
        raise SystemExit(f"htp-llm failed on {model}")
    return json.loads((report_dir / "report.json").read_text())


def htp_placement(model: Path, original: Path, *, fp16: bool = True, shapes=None) -> dict:
    """Run ``model`` on the HTP (CPU fallback allowed, so CPU nodes are counted): partitions, CPU nodes, cosine."""
    from qnnpasses.backends.cpu import adapt_inputs, cosine_similarity, run_cpu
    from qnnpasses.backends.htp import htp_session, parse_profile
    from qnnpasses.ir.load import load_model

    inputs = verification_inputs(original, shapes=shapes)
    reference = run_cpu(original, inputs)
    with tempfile.TemporaryDirectory() as tmp:
        session = htp_session(model, fp16=fp16, profiling=True, profile_prefix=f"{tmp}/p",
                              extra_options=None if fp16 else {"offload_graph_io_quantization": "0"})
        names = [o.name for o in session.get_outputs()]
        feeds = adapt_inputs(load_model(model), {k: v for k, v in inputs.items() if k in {i.name for i in session.get_inputs()}})
        got = dict(zip(names, session.run(names, feeds)))
        partitions, cpu_nodes = parse_profile(session.end_profiling())
    as64 = lambda a: np.asarray(a, dtype=np.float64)
    return {"qnn_partitions": partitions, "cpu_nodes": len(cpu_nodes), "cpu_ops": dict(Counter(n.split("_qp")[0] for n in cpu_nodes)),
            "cosine": {k: float(cosine_similarity(as64(got[k]), as64(reference[k]))) for k in names},
            "max_abs": {k: float(np.abs(as64(got[k]) - as64(reference[k])).max()) for k in names}}


def quantize_int4(lowered: Path, original: Path, out: Path) -> dict:
    """``qnnpasses quantize`` the lowered int4 build (4 calibration samples): 4-bit weights kept? placement, accuracy."""
    import onnx

    from qnnpasses.cli import main

    calib = out.parent / "calib"
    calib.mkdir(exist_ok=True)
    for seed in range(1, 5):
        np.savez(calib / f"{seed}.npz", **verification_inputs(original, seed))
    if main(["quantize", str(lowered), "--calib", str(calib), "-o", str(out)]) != 0:
        raise SystemExit("quantize failed on the int4 build")
    proto = onnx.load(str(out))
    int4 = {t.name for t in proto.graph.initializer if t.data_type == onnx.TensorProto.INT4}
    kept = sum(1 for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in int4)
    return {"int4_weights_kept": kept, "htp_integer": htp_placement(out, original, fp16=False)}


def graph_facts(path: Path) -> dict:
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    ops = Counter(n.op_type for n in proto.graph.node)
    dtypes = Counter(onnx.TensorProto.DataType.Name(t.data_type) for t in proto.graph.initializer)
    dims = lambda v: [d.dim_value if d.HasField("dim_value") else d.dim_param for d in v.type.tensor_type.shape.dim]
    return {"ops": dict(sorted(ops.items())), "contrib_ops": sorted(set(ops) & CONTRIB), "initializer_dtypes": dict(dtypes),
            "kv_inputs": {v.name: dims(v) for v in proto.graph.input if "past" in v.name},
            "kv_outputs": {v.name: dims(v) for v in proto.graph.output if "present" in v.name}}


def probe_weight_dq(seed: int = 0) -> list[dict]:
    """One ``DequantizeLinear(weight) -> MatMul`` on the HTP: 4/8-bit, block-wise/per-channel, float or QDQ activations."""
    import onnx
    from onnx import TensorProto, helper

    from qnnpasses.backends.htp import htp_session, parse_profile

    rng = np.random.default_rng(seed)
    k, n, block = 64, 128, 32
    rows = []
    for bits in (4, 8):
        for granularity in ("block", "channel"):
            for quantized_acts in (False, True):
                q = rng.integers(-8, 8, (k, n))
                inits = [helper.make_tensor("w", TensorProto.INT4, [k, n], q.reshape(-1).tolist()) if bits == 4
                         else onnx.numpy_helper.from_array(q.astype(np.int8), "w")]
                scale_shape = (k // block, n) if granularity == "block" else (n,)
                inits.append(onnx.numpy_helper.from_array((rng.random(scale_shape) * 0.02 + 0.01).astype(np.float32), "s"))
                attrs = {"axis": 0, "block_size": block} if granularity == "block" else {"axis": 1}
                nodes = [helper.make_node("DequantizeLinear", ["w", "s"], ["wf"], **attrs)]
                a, out = "x", "y0"
                if quantized_acts:
                    for name, scale in (("a", 6 / 65535), ("o", 20 / 65535)):
                        inits += [onnx.numpy_helper.from_array(np.array(scale, np.float32), f"{name}s"),
                                  onnx.numpy_helper.from_array(np.array(32768, np.uint16), f"{name}z")]
                    nodes += [helper.make_node("QuantizeLinear", ["x", "as", "az"], ["xq"]),
                              helper.make_node("DequantizeLinear", ["xq", "as", "az"], ["xd"])]
                    a = "xd"
                nodes.append(helper.make_node("MatMul", [a, "wf"], ["y0"]))
                if quantized_acts:
                    nodes += [helper.make_node("QuantizeLinear", ["y0", "os", "oz"], ["yq"]),
                              helper.make_node("DequantizeLinear", ["yq", "os", "oz"], ["y"])]
                    out = "y"
                graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [1, 16, k])],
                                          [helper.make_tensor_value_info(out, 1, [1, 16, n])], inits)
                model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
                model.ir_version = 10
                row = {"weights": f"int{bits} {granularity}", "activations": "uint16 QDQ" if quantized_acts else "float",
                       "mode": "integer" if quantized_acts else "fp16"}
                with tempfile.TemporaryDirectory() as tmp:
                    session = htp_session(model.SerializeToString(), fp16=not quantized_acts, profiling=True,
                                          profile_prefix=f"{tmp}/p",
                                          extra_options={"offload_graph_io_quantization": "0"} if quantized_acts else None)
                    session.run(None, {"x": rng.standard_normal((1, 16, k)).astype(np.float32)})
                    partitions, cpu = parse_profile(session.end_profiling())
                row.update(qnn_partitions=partitions, cpu_nodes=[c for c in cpu])
                rows.append(row)
    return rows


def probe_cast_mul(seed: int = 0) -> dict:
    """Weight-only int8 written as Cast -> Mul (3 MatMul+Relu layers): as is vs ``weight-only-dq``,
    quantized (integer mode) and in fp16 mode on the HTP, against the float original on CPU."""
    import onnx
    from onnx import helper

    from qnnpasses.backends.cpu import cosine_similarity, run_cpu
    from qnnpasses.backends.htp import htp_session, parse_profile
    from qnnpasses.cli import main

    rng = np.random.default_rng(seed)
    nodes, inits, x, k, n = [], [], "x", 64, 128
    for i in range(3):
        inits += [onnx.numpy_helper.from_array(rng.integers(-127, 128, (k, n)).astype(np.int8), f"q{i}"),
                  onnx.numpy_helper.from_array((rng.random((1, n)) * 0.01 + 0.002).astype(np.float32), f"s{i}")]
        nodes += [helper.make_node("Cast", [f"q{i}"], [f"c{i}"], to=1), helper.make_node("Mul", [f"c{i}", f"s{i}"], [f"w{i}"]),
                  helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]), helper.make_node("Relu", [f"m{i}"], [f"r{i}"])]
        x, k = f"r{i}", n
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [1, 16, 64])],
                              [helper.make_tensor_value_info(x, 1, [1, 16, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        onnx.save(model, str(t / "cast_mul.onnx"))
        np.savez(t / "calib.npz", x=rng.standard_normal((1, 16, 64)).astype(np.float32))
        feeds = {"x": rng.standard_normal((1, 16, 64)).astype(np.float32)}
        reference = next(iter(run_cpu(t / "cast_mul.onnx", feeds).values()))
        assert main(["run", "-q", "--passes", "weight-only-dq,cleanup", str(t / "cast_mul.onnx"), "-o", str(t / "dq.onnx")]) == 0
        for form in ("cast_mul", "dq"):
            assert main(["quantize", str(t / f"{form}.onnx"), "--calib", str(t / "calib.npz"), "-o", str(t / f"q_{form}.onnx")]) == 0
            proto = onnx.load(str(t / f"q_{form}.onnx"))
            original = {i: onnx.numpy_helper.to_array(next(x for x in model.graph.initializer if x.name == f"q{i}")) for i in range(3)}
            int8 = [onnx.numpy_helper.to_array(w) for w in proto.graph.initializer if w.data_type == onnx.TensorProto.INT8 and len(w.dims) == 2]
            same = sum(any(w.shape == o.shape and np.array_equal(w, o) for w in int8) for o in original.values())
            row = {"model_int8_weights_kept_bit_exact": same}
            for label, path, fp16 in (("integer", t / f"q_{form}.onnx", False), ("fp16", t / f"{form}.onnx", True)):
                session = htp_session(path, fp16=fp16, profiling=True, profile_prefix=str(t / "p"),
                                      extra_options=None if fp16 else {"offload_graph_io_quantization": "0"})
                got = session.run(None, feeds)[0]
                partitions, cpu = parse_profile(session.end_profiling())
                row[label] = {"qnn_partitions": partitions, "cpu_nodes": len(cpu),
                              "cosine": float(cosine_similarity(got, reference))}
            results[form] = row
    return results


def report(fixtures: Path, out: Path) -> dict:
    results: dict = {"config": CONFIG, "models": {}, "weight_dq_probe": probe_weight_dq(), "cast_mul": probe_cast_mul()}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (arch, precision) in FIXTURES.items():
            model = fixtures / name / "model.onnx"
            if not model.exists():
                continue
            lowered = Path(tmp) / f"{name}.htp.onnx"
            shapes = prefill_shapes(model) if precision in PREFILL_ONLY else None
            run = run_pipeline(model, lowered, lossy=precision == "int4", shapes=shapes,
                               extra=FP16_TOLERANCE if precision == "fp16" else None)
            lowerings = {p["name"]: p["stats"] for p in run["passes"] if p["name"] in CONTRIB_LOWERINGS and p["status"] == "changed"}
            entry = {"arch": arch, "precision": precision, "before": graph_facts(model), "after": graph_facts(lowered),
                     "lowerings": lowerings, "prefill_only": precision in PREFILL_ONLY,
                     "cpu_verification": run.get("final_verification"), "htp_fp16": htp_placement(lowered, model, shapes=shapes)}
            if precision == "int4":
                entry["quantized"] = quantize_int4(lowered, model, Path(tmp) / f"{name}_q.onnx")
            results["models"][name] = entry
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    out.with_suffix(".md").write_text(render(results))
    return results


def render(results: dict) -> str:
    c = results["config"]
    lines = ["# onnxruntime-genai model-builder models through `htp-llm`", "",
             "Written by `python tools/genai_models.py report` (all figures in `docs/genai.json`).  Fixtures "
             "(`tests/fixtures/genai/`, `python tools/genai_models.py build`): onnxruntime-genai's "
             f"model builder on random-weight LLaMA and Qwen2 configs ({c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
             f"{c['num_attention_heads']} heads / {c['num_key_value_heads']} KV heads, vocab {c['vocab_size']}), CPU target, "
             "with past/present KV cache.  Placement: onnxruntime-qnn's HTP backend, CPU fallback allowed so that CPU "
             "nodes are counted; accuracy: against the original graph (contrib ops) on onnxruntime CPU, same inputs.", "",
             "| build | contrib ops in the export | lowered by | HTP (fp16 mode) after `htp-llm` | cosine (logits) |",
             "|---|---|---|---|---|"]
    for name, m in results["models"].items():
        htp = m["htp_fp16"]
        placed = f"{htp['qnn_partitions']} partition(s), {htp['cpu_nodes']} CPU nodes"
        if htp["cpu_ops"]:
            placed += " (" + ", ".join(f"{op.rsplit('/', 1)[-1]} x{n}" for op, n in htp["cpu_ops"].items()) + ")"
        lowered = ", ".join(f"{name} ({stats.get('lowered', '?')})" for name, stats in m["lowerings"].items())
        label = name + (" (prefill, empty cache)" if m["prefill_only"] else "")
        lines.append(f"| {label} | {', '.join(m['before']['contrib_ops'])} | {lowered} | {placed} | "
                     f"{htp['cosine'].get('logits', float('nan')):.7f} |")
    q = results["models"].get("llama_int4", {}).get("quantized")
    if q:
        h = q["htp_integer"]
        lines += ["", f"**int4 build, quantized** (`htp-llm --allow-lossy`, then `qnnpasses quantize`, 4 calibration "
                  f"samples): {q['int4_weights_kept']} of the builder's 4-bit block-wise weights (block 32) kept as "
                  f"`DequantizeLinear(int4)`; on the HTP in integer mode {h['qnn_partitions']} partition(s), "
                  f"{h['cpu_nodes']} CPU nodes, logits cosine {h['cosine']['logits']:.4f} against the int4 original on CPU "
                  "(random weights; activations quantized to 16 bit)."]
    lines += ["", "KV cache after lowering (graph I/O; static after `fix-shapes`, total = past + new):", ""]
    for name, m in results["models"].items():
        kv_in = next(iter(m["after"]["kv_inputs"].items()), ("-", []))
        kv_out = next(iter(m["after"]["kv_outputs"].items()), ("-", []))
        lines.append(f"- {name}: {len(m['after']['kv_inputs'])} past inputs (`{kv_in[0]}` {kv_in[1]}), "
                     f"{len(m['after']['kv_outputs'])} present outputs (`{kv_out[0]}` {kv_out[1]})")
    lines += ["", "Notes:", "",
              "- `lower-matmulnbits` runs only with `--allow-lossy`: the builder writes `accuracy_level=4`, for which "
              "onnxruntime's CPU kernel quantizes the activations to int8; the lowered graph multiplies the same "
              "weights in float (exact against the kernel at `accuracy_level=0`, tests/test_pass_lower_matmulnbits.py).",
              "- The fp16 build: the builder itself calls FP16+CPU an invalid combination; what it writes runs on "
              "onnxruntime only with an empty cache, so it is measured as a prefill (past = 0), with the verification "
              "tolerance of fp16 arithmetic (`--atol 1e-3 --rtol 1e-3`).",
              "- In fp16 mode the int4 build's weight `DequantizeLinear`s are its only CPU nodes: see the next table.",
              "", "## Quantized weights on the HTP", "",
              "One `DequantizeLinear(weight) -> MatMul` (K=64, N=128, block 32):", "",
              "| weights | activations | HTP mode | partitions | CPU nodes |", "|---|---|---|---|---|"]
    for row in results["weight_dq_probe"]:
        lines.append(f"| {row['weights']} | {row['activations']} | {row['mode']} | {row['qnn_partitions']} | "
                     f"{len(row['cpu_nodes'])} |")
    cm = results["cast_mul"]
    lines += ["", "Weight-only int8 written as `Cast(int8) -> Mul(scale) -> MatMul` (3 layers), as exported and after "
              "`weight-only-dq` (-> `DequantizeLinear`), cosine against the float original on CPU:", "",
              "| form | model's int8 weights kept bit-exact by `quantize` | integer mode (quantized) | fp16 mode |",
              "|---|---|---|---|"]
    for form, row in cm.items():
        cells = [f"{row[m]['qnn_partitions']} partition, {row[m]['cpu_nodes']} CPU, cosine {row[m]['cosine']:.6f}"
                 for m in ("integer", "fp16")]
        lines.append(f"| {form.replace('_', ' ')} | {row['model_int8_weights_kept_bit_exact']} / 3 | {cells[0]} | {cells[1]} |")
    lines += ["", "What this means: the QNN EP keeps a weight quantized on the HTP only in integer mode (quantized "
              "activations); there 4-bit block-wise weights run as they are, so `lower-matmulnbits` keeps the builder's "
              "blocks (no per-channel re-quantization, no deviation to record).  In fp16 mode it runs a weight's "
              "`DequantizeLinear` on the CPU, while onnxruntime folds a constant `Cast -> Mul` into a float weight that "
              "the HTP runs: so `htp-llm` (fp16) leaves `Cast -> Mul` alone, and `weight-only-dq` is for the integer "
              "path, where `quantize` then keeps the model's own int8 values instead of re-quantizing folded floats.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the fixtures with onnxruntime-genai's model builder")
    b.add_argument("--out", type=Path, default=DEFAULT_FIXTURES)
    b.add_argument("--only", default=",".join(FIXTURES), help=f"comma-separated, from {','.join(FIXTURES)}")
    r = sub.add_parser("report", help="htp-llm + HTP measurements -> docs/genai.md/.json")
    r.add_argument("--fixtures", type=Path, default=DEFAULT_FIXTURES)
    r.add_argument("--out", type=Path, default=ROOT / "docs" / "genai")
    args = parser.parse_args(argv)
    if args.command == "build":
        for path in build(args.out, tuple(args.only.split(","))):
            print(path)
    else:
        report(args.fixtures, args.out)
        print(args.out.with_suffix(".md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
