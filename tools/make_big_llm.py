"""Write a LLaMA-shaped ONNX decoder of any size, weights in one external data file.

The graph mirrors what PyTorch's exporters emit for Hugging Face ``LlamaForCausalLM``
with fixed shapes: RMSNorm spelled as Pow/ReduceMean/Add/Sqrt/Div/Mul, rotary
embedding as Slice/Neg/Concat, ``repeat_kv`` as Unsqueeze/Expand/Reshape for grouped
KV heads, an additive causal mask, SwiGLU MLPs.  With ``--weights sparse`` the data
file is created sparse (every weight reads as zero and costs no disk), so a 7B-shaped
model (~13 GB of fp16 weights) can be written in seconds; ``--weights random`` writes
real random values for small configurations that are run numerically.

    python tools/make_big_llm.py --out out/llama7b/model.onnx                 # 7B shape, sparse fp16
    python tools/make_big_llm.py --layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 128 \\
        --vocab 256 --weights random --dtype float32 --out out/tiny/model.onnx
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

INT64_MAX = np.iinfo(np.int64).max


@dataclass(frozen=True)
class LlamaShape:
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 32
    intermediate: int = 11008
    vocab: int = 32000
    seq: int = 128
    eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class _Builder:
    """Collects nodes and initializers; weights are laid out in one external data file."""

    def __init__(self, data_path: Path, dtype: np.dtype, weights: str, seed: int):
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.data_path = data_path
        self.dtype = np.dtype(dtype)
        self.weights = weights
        self.rng = np.random.default_rng(seed)
        self.offset = 0
        self.data = open(data_path, "wb")
        self._count = 0

    def name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def node(self, op: str, inputs: list[str], name: str, **attrs) -> str:
        out = f"{name}_output_0"
        self.nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        return out

    def const(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(onnx.numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, name: str, shape: tuple[int, ...], scale: float = 0.02, center: float = 0.0) -> str:
        """An external-data weight; sparse mode only reserves its byte range."""
        count = int(np.prod(shape))
        length = count * self.dtype.itemsize
        self.offset = (self.offset + 4095) // 4096 * 4096
        self.data.seek(self.offset)
        if self.weights == "random":
            values = (center + self.rng.standard_normal(count) * scale).astype(self.dtype)
            self.data.write(values.tobytes())
        tensor = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(self.dtype), dims=list(shape))
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.data_path.name), ("offset", str(self.offset)), ("length", str(length))):
            tensor.external_data.add(key=key, value=value)
        self.initializers.append(tensor)
        self.offset += length
        return name

    def close(self) -> None:
        self.data.truncate(self.offset)  # extends sparsely in sparse mode
        self.data.close()


def _rms_norm(b: _Builder, x: str, weight: str, prefix: str, eps: float) -> str:
    two = b.const(f"{prefix}/two", np.array(2.0, b.dtype))
    one = b.const(f"{prefix}/one", np.array(1.0, b.dtype))
    epsilon = b.const(f"{prefix}/eps", np.array(eps, b.dtype))
    squared = b.node("Pow", [x, two], f"{prefix}/Pow")
    mean = b.node("ReduceMean", [squared], f"{prefix}/ReduceMean", axes=[-1], keepdims=1)
    std = b.node("Sqrt", [b.node("Add", [mean, epsilon], f"{prefix}/Add")], f"{prefix}/Sqrt")
    normed = b.node("Mul", [x, b.node("Div", [one, std], f"{prefix}/Div")], f"{prefix}/Mul")
    return b.node("Mul", [weight, normed], f"{prefix}/Mul_1")


def _heads(b: _Builder, x: str, heads: int, shape: LlamaShape, prefix: str) -> str:
    target = b.const(f"{prefix}/shape", np.array([1, shape.seq, heads, shape.head_dim], np.int64))
    reshaped = b.node("Reshape", [x, target], f"{prefix}/Reshape")
    return b.node("Transpose", [reshaped], f"{prefix}/Transpose", perm=[0, 2, 1, 3])


def _rotary(b: _Builder, x: str, cos: str, sin: str, half: dict[str, str], prefix: str) -> str:
    first = b.node("Slice", [x, half["zero"], half["half"], half["axis"]], f"{prefix}/Slice")
    second = b.node("Slice", [x, half["half"], half["end"], half["axis"]], f"{prefix}/Slice_1")
    rotated = b.node("Concat", [b.node("Neg", [second], f"{prefix}/Neg"), first], f"{prefix}/Concat", axis=-1)
    return b.node("Add", [b.node("Mul", [x, cos], f"{prefix}/Mul"), b.node("Mul", [rotated, sin], f"{prefix}/Mul_1")],
                  f"{prefix}/Add")


def _repeat_kv(b: _Builder, x: str, shape: LlamaShape, prefix: str) -> str:
    groups = shape.heads // shape.kv_heads
    if groups == 1:
        return x
    axis = b.const(f"{prefix}/axes", np.array([2], np.int64))
    expanded_shape = b.const(f"{prefix}/expand", np.array([1, shape.kv_heads, groups, shape.seq, shape.head_dim], np.int64))
    merged = b.const(f"{prefix}/merged", np.array([1, shape.heads, shape.seq, shape.head_dim], np.int64))
    unsqueezed = b.node("Unsqueeze", [x, axis], f"{prefix}/Unsqueeze")
    expanded = b.node("Expand", [unsqueezed, expanded_shape], f"{prefix}/Expand")
    return b.node("Reshape", [expanded, merged], f"{prefix}/Reshape")


def _layer(b: _Builder, x: str, i: int, shape: LlamaShape, shared: dict[str, str]) -> str:
    p = f"/model/layers.{i}"
    w = f"model.layers.{i}"
    h = _rms_norm(b, x, b.weight(f"{w}.input_layernorm.weight", (shape.hidden,), 0.1, 1.0), f"{p}/input_layernorm", shape.eps)
    kv_width = shape.kv_heads * shape.head_dim
    q = b.node("MatMul", [h, b.weight(f"{w}.self_attn.q_proj.weight", (shape.hidden, shape.hidden))], f"{p}/self_attn/q_proj/MatMul")
    k = b.node("MatMul", [h, b.weight(f"{w}.self_attn.k_proj.weight", (shape.hidden, kv_width))], f"{p}/self_attn/k_proj/MatMul")
    v = b.node("MatMul", [h, b.weight(f"{w}.self_attn.v_proj.weight", (shape.hidden, kv_width))], f"{p}/self_attn/v_proj/MatMul")
    q = _rotary(b, _heads(b, q, shape.heads, shape, f"{p}/self_attn/q"), shared["cos"], shared["sin"], shared, f"{p}/self_attn/q_rot")
    k = _rotary(b, _heads(b, k, shape.kv_heads, shape, f"{p}/self_attn/k"), shared["cos"], shared["sin"], shared, f"{p}/self_attn/k_rot")
    v = _heads(b, v, shape.kv_heads, shape, f"{p}/self_attn/v")
    k = _repeat_kv(b, k, shape, f"{p}/self_attn/repeat_k")
    v = _repeat_kv(b, v, shape, f"{p}/self_attn/repeat_v")
    kt = b.node("Transpose", [k], f"{p}/self_attn/Transpose_k", perm=[0, 1, 3, 2])
    scores = b.node("Div", [b.node("MatMul", [q, kt], f"{p}/self_attn/MatMul"), shared["scale"]], f"{p}/self_attn/Div")
    probs = b.node("Softmax", [b.node("Add", [scores, shared["mask"]], f"{p}/self_attn/Add_mask")], f"{p}/self_attn/Softmax", axis=-1)
    context = b.node("Transpose", [b.node("MatMul", [probs, v], f"{p}/self_attn/MatMul_1")], f"{p}/self_attn/Transpose_o", perm=[0, 2, 1, 3])
    merged = b.node("Reshape", [context, shared["hidden_shape"]], f"{p}/self_attn/Reshape_o")
    attn = b.node("MatMul", [merged, b.weight(f"{w}.self_attn.o_proj.weight", (shape.hidden, shape.hidden))], f"{p}/self_attn/o_proj/MatMul")
    x = b.node("Add", [x, attn], f"{p}/Add")
    h = _rms_norm(b, x, b.weight(f"{w}.post_attention_layernorm.weight", (shape.hidden,), 0.1, 1.0), f"{p}/post_attention_layernorm", shape.eps)
    gate = b.node("MatMul", [h, b.weight(f"{w}.mlp.gate_proj.weight", (shape.hidden, shape.intermediate))], f"{p}/mlp/gate_proj/MatMul")
    up = b.node("MatMul", [h, b.weight(f"{w}.mlp.up_proj.weight", (shape.hidden, shape.intermediate))], f"{p}/mlp/up_proj/MatMul")
    act = b.node("Mul", [gate, b.node("Sigmoid", [gate], f"{p}/mlp/act_fn/Sigmoid")], f"{p}/mlp/act_fn/Mul")
    down = b.node("MatMul", [b.node("Mul", [act, up], f"{p}/mlp/Mul"),
                             b.weight(f"{w}.mlp.down_proj.weight", (shape.intermediate, shape.hidden))], f"{p}/mlp/down_proj/MatMul")
    return b.node("Add", [x, down], f"{p}/Add_1")


def _rotary_tables(shape: LlamaShape, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, shape.head_dim, 2) / shape.head_dim))
    angles = np.outer(np.arange(shape.seq), inv_freq)
    emb = np.concatenate([angles, angles], axis=-1)[None, None]
    return np.cos(emb).astype(dtype), np.sin(emb).astype(dtype)


def build(shape: LlamaShape, out: Path, *, dtype: str = "float16", weights: str = "sparse", seed: int = 0) -> Path:
    """Write ``out`` and ``out.data``; returns the model path."""
    out.parent.mkdir(parents=True, exist_ok=True)
    b = _Builder(out.with_name(out.name + ".data"), np.dtype(dtype), weights, seed)
    cos, sin = _rotary_tables(shape, b.dtype)
    mask = np.triu(np.full((shape.seq, shape.seq), np.finfo(b.dtype).min, b.dtype), k=1)[None, None]
    half = shape.head_dim // 2
    shared = {
        "cos": b.const("rotary.cos", cos),
        "sin": b.const("rotary.sin", sin),
        "mask": b.const("causal_mask", mask),
        "scale": b.const("attn_scale", np.array(np.sqrt(shape.head_dim), b.dtype)),
        "hidden_shape": b.const("hidden_shape", np.array([1, shape.seq, shape.hidden], np.int64)),
        "zero": b.const("rot.zero", np.array([0], np.int64)),
        "half": b.const("rot.half", np.array([half], np.int64)),
        "end": b.const("rot.end", np.array([INT64_MAX], np.int64)),
        "axis": b.const("rot.axis", np.array([-1], np.int64)),
    }
    x = b.node("Gather", [b.weight("model.embed_tokens.weight", (shape.vocab, shape.hidden)), "input_ids"],
               "/model/embed_tokens/Gather")
    for i in range(shape.layers):
        x = _layer(b, x, i, shape, shared)
    x = _rms_norm(b, x, b.weight("model.norm.weight", (shape.hidden,), 0.1, 1.0), "/model/norm", shape.eps)
    logits = b.node("MatMul", [x, b.weight("lm_head.weight", (shape.hidden, shape.vocab))], "/lm_head/MatMul")
    b.nodes.append(helper.make_node("Identity", [logits], ["logits"], name="/output/Identity"))
    b.close()
    elem = helper.np_dtype_to_tensor_dtype(b.dtype)
    graph = helper.make_graph(
        b.nodes, "llama", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, shape.seq])],
        [helper.make_tensor_value_info("logits", elem, [1, shape.seq, shape.vocab])], b.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="qnnpasses.make_big_llm")
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(model.SerializeToString())
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = LlamaShape()
    parser.add_argument("--out", type=Path, required=True)
    for field in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "seq"):
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=getattr(defaults, field))
    parser.add_argument("--dtype", choices=("float16", "float32"), default="float16")
    parser.add_argument("--weights", choices=("sparse", "random"), default="sparse")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shape = LlamaShape(**{f: getattr(args, f) for f in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "seq")})
    path = build(shape, args.out, dtype=args.dtype, weights=args.weights, seed=args.seed)
    data = path.with_name(path.name + ".data")
    print(f"{path}: {shape.layers} layers, {os.path.getsize(data) / 1e9:.2f} GB of weights "
          f"({os.stat(data).st_blocks * 512 / 1e6:.1f} MB on disk)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
