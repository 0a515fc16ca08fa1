#!/usr/bin/env python
"""onnxruntime-genai model-builder models as test fixtures, and what ``htp-llm`` makes of them.

onnxruntime-genai's model builder (``python -m onnxruntime_genai.models.builder``) is how most
LLMs reach onnxruntime; its output uses onnxruntime contrib ops (``SimplifiedLayerNormalization``,
``SkipSimplifiedLayerNormalization``, ``GroupQueryAttention`` with rotary fused in,
``MatMulNBits``) and past/present KV as graph I/O.  No hub is reachable here, so ``build``
writes a small random-weight LLaMA config (2 layers, hidden 64, 4 heads / 2 KV heads, vocab
256) with transformers, a word-level tokenizer with ``tokenizers``, and runs the builder on it
for each precision: ``llama_fp32`` and ``llama_int4`` (``MatMulNBits``, block 32), CPU target.

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

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FIXTURES = ROOT / "tests" / "fixtures" / "genai"
PRECISIONS = ("fp32", "int4")
CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
CONTRIB = {"SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "GroupQueryAttention",
           "RotaryEmbedding", "MatMulNBits"}


# ----------------------------------------------------------------------------- build


def write_hf_model(directory: Path, seed: int = 0) -> None:
    """A random-weight LLaMA checkpoint + tokenizer in Hugging Face's layout (no hub access)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).eval().save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(CONFIG["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(directory)


def build(out: Path, precisions=PRECISIONS) -> list[Path]:
    """Run the builder on the random checkpoint for each precision -> ``out/llama_<p>/model.onnx``."""
    made = []
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        write_hf_model(hf)
        for precision in precisions:
            target = out / f"llama_{precision}"
            target.mkdir(parents=True, exist_ok=True)
            command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(target),
                       "-p", precision, "-e", "cpu", "-c", str(Path(tmp) / "cache")]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0 or not (target / "model.onnx").exists():
                raise SystemExit(f"builder failed for {precision}: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
            for extra in ("genai_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
                (target / extra).unlink(missing_ok=True)  # the graph and its weights are the fixture
            made.append(target / "model.onnx")
    return made


# ----------------------------------------------------------------------------- measure


def verification_inputs(model: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs the lowered graph and the original agree on: no padding, mask length = past + new."""
    from qnnpasses.backends.cpu import make_inputs
    from qnnpasses.ir.load import load_model
    from qnnpasses.passmanager.api import PassContext, get_pass

    ir = load_model(model)
    return make_inputs(ir, seed, get_pass("lower-gqa")().planned_input_shapes(ir, PassContext()))


def run_pipeline(model: Path, out: Path, *, lossy: bool) -> dict:
    from qnnpasses.cli import main

    report_dir = out.parent / f"{out.stem}.report"
    args = ["run", "-q", "--pipeline", "htp-llm", str(model), "-o", str(out), "--verify", "--strict",
            "--report-dir", str(report_dir)] + (["--allow-lossy"] if lossy else [])
    if main(args) != 0:
        raise SystemExit(f"htp-llm failed on {model}")
    return json.loads((report_dir / "report.json").read_text())


def htp_placement(model: Path, original: Path, *, fp16: bool = True) -> dict:
    """Run ``model`` on the HTP (CPU fallback allowed, so CPU nodes are counted): partitions, CPU nodes, cosine."""
    from qnnpasses.backends.cpu import adapt_inputs, cosine_similarity, run_cpu
    from qnnpasses.backends.htp import htp_session, parse_profile
    from qnnpasses.ir.load import load_model

    inputs = verification_inputs(original)
    reference = run_cpu(original, inputs)
    with tempfile.TemporaryDirectory() as tmp:
        session = htp_session(model, fp16=fp16, profiling=True, profile_prefix=f"{tmp}/p")
        names = [o.name for o in session.get_outputs()]
        got = dict(zip(names, session.run(names, adapt_inputs(load_model(model), inputs))))
        partitions, cpu_nodes = parse_profile(session.end_profiling())
    return {"qnn_partitions": partitions, "cpu_nodes": len(cpu_nodes), "cpu_ops": dict(Counter(n.split("_qp")[0] for n in cpu_nodes)),
            "cosine": {k: float(cosine_similarity(got[k], reference[k])) for k in names},
            "max_abs": {k: float(np.abs(got[k].astype(np.float64) - reference[k]).max()) for k in names}}


def graph_facts(path: Path) -> dict:
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    ops = Counter(n.op_type for n in proto.graph.node)
    dtypes = Counter(onnx.TensorProto.DataType.Name(t.data_type) for t in proto.graph.initializer)
    dims = lambda v: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]  # noqa: E731
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


def report(fixtures: Path, out: Path) -> dict:
    results: dict = {"config": CONFIG, "models": {}, "weight_dq_probe": probe_weight_dq()}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in PRECISIONS:
            model = fixtures / f"llama_{precision}" / "model.onnx"
            if not model.exists():
                continue
            lowered = Path(tmp) / f"llama_{precision}.htp.onnx"
            run = run_pipeline(model, lowered, lossy=precision == "int4")
            lowerings = {p["name"]: p["stats"] for p in run["passes"] if p["name"].startswith("lower-") and p["status"] == "changed"}
            results["models"][precision] = {
                "before": graph_facts(model), "after": graph_facts(lowered), "lowerings": lowerings,
                "cpu_verification": run.get("final_verification"), "htp_fp16": htp_placement(lowered, model)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    out.with_suffix(".md").write_text(render(results))
    return results


def render(results: dict) -> str:
    lines = ["# onnxruntime-genai model-builder models through `htp-llm`", "",
             "Written by `python tools/genai_models.py report` (figures in `docs/genai.json`).  Fixtures: "
             "`tests/fixtures/genai/llama_{fp32,int4}` made by `python tools/genai_models.py build` -- onnxruntime-genai's "
             f"builder on a random-weight LLaMA ({CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}, "
             f"{CONFIG['num_attention_heads']} heads / {CONFIG['num_key_value_heads']} KV heads, vocab {CONFIG['vocab_size']}), "
             "CPU target, with past/present KV cache.", "",
             "| build | contrib ops before | lowered | after `htp-llm` on the HTP (fp16) | cosine vs original on CPU (logits) |",
             "|---|---|---|---|---|"]
    for precision, m in results["models"].items():
        htp = m["htp_fp16"]
        placed = f"{htp['qnn_partitions']} QNN partition(s), {htp['cpu_nodes']} CPU nodes"
        if htp["cpu_ops"]:
            placed += " (" + ", ".join(f"{op} x{c}" for op, c in htp["cpu_ops"].items()) + ")"
        lowered = "; ".join(f"{name}: {stats.get('lowered', '')}" for name, stats in m["lowerings"].items())
        lines.append(f"| {precision} | {', '.join(m['before']['contrib_ops'])} | {lowered} | {placed} | "
                     f"{htp['cosine'].get('logits', float('nan')):.7f} |")
    lines += ["", "KV cache after lowering (graph I/O, static after `fix-shapes`):", ""]
    for precision, m in results["models"].items():
        kv_in = ", ".join(f"`{k}` {v}" for k, v in list(m["after"]["kv_inputs"].items())[:1])
        kv_out = ", ".join(f"`{k}` {v}" for k, v in list(m["after"]["kv_outputs"].items())[:1])
        dtypes = ", ".join(f"{k} x{v}" for k, v in sorted(m["after"]["initializer_dtypes"].items()))
        lines.append(f"- {precision}: {len(m['after']['kv_inputs'])} past inputs (e.g. {kv_in}), "
                     f"{len(m['after']['kv_outputs'])} present outputs (e.g. {kv_out}); initializers: {dtypes}")
    lines += ["", "## Weight-only quantized weights on the HTP", "",
              "One `DequantizeLinear(weight) -> MatMul` (K=64, N=128, block 32), CPU fallback allowed:", "",
              "| weights | activations | HTP mode | QNN partitions | CPU nodes |", "|---|---|---|---|---|"]
    for row in results["weight_dq_probe"]:
        lines.append(f"| {row['weights']} | {row['activations']} | {row['mode']} | {row['qnn_partitions']} | "
                     f"{len(row['cpu_nodes'])} {'(' + ', '.join(row['cpu_nodes']) + ')' if row['cpu_nodes'] else ''} |")
    lines += ["", "What this means: in fp16 mode the QNN EP leaves a weight's `DequantizeLinear` on the CPU (the "
              "weight is expanded to float there on every run and the MatMul takes it as a dynamic input); with "
              "quantized activations (integer mode) the same 4-bit block-wise weight runs on the HTP in one "
              "partition. `lower-matmulnbits` therefore keeps the builder's int4 blocks as they are (no per-channel "
              "re-quantization, no deviation from the block scales); the int4 build is fully on the HTP once its "
              "activations are quantized, and in fp16 mode its weight DQs are the only CPU nodes.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the fixtures with onnxruntime-genai's model builder")
    b.add_argument("--out", type=Path, default=DEFAULT_FIXTURES)
    r = sub.add_parser("report", help="htp-llm + HTP measurements -> docs/genai.md/.json")
    r.add_argument("--fixtures", type=Path, default=DEFAULT_FIXTURES)
    r.add_argument("--out", type=Path, default=ROOT / "docs" / "genai")
    args = parser.parse_args(argv)
    if args.command == "build":
        for path in build(args.out):
            print(path)
    else:
        report(args.fixtures, args.out)
        print(args.out.with_suffix(".md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
