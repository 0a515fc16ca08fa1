"""The mixed-precision policy: which tensors get more bits, and how weights are quantized.

LLMs lose most accuracy in a few places (the field guide; measured on our fixtures in
``qnnpasses sweep``): the embedding output, the lm_head, the attention Q·Kᵀ product and
its softmax, and the normalization outputs that feed every projection.  The policy finds
them by structure in the prepared (``htp-llm``) graph, not by name:

``embedding``  output of a Gather from a 2-D constant table indexed by a graph input
               (the table is quantized like its output, so this is the table's width too);
``lm_head``    output of the MatMul/Gemm with a constant weight that produces a graph
               output through shape-only ops (the logits of a causal LM);
``attention``  the activation×activation MatMul feeding a Softmax and every tensor on the
               way (scale Mul/Div, mask Add, Where), i.e. Q·Kᵀ and the softmax input;
``softmax``    Softmax outputs (attention probabilities);
``norm``       RMSNormalization / LayerNormalization outputs and their data inputs (the
               residual stream, back through shape-only ops): a 16-bit norm of an 8-bit
               input only re-encodes the 8-bit error, and the HTP's RmsNorm refuses an input
               narrower than its output ("could not create op: q::QNN_RmsNorm", measured
               for every u8/u16 mix; LayerNorm accepts all of them).

Those tensors get ``sensitive_bits`` (16 by default), everything else the ``act`` width.

Weights of MatMul/Gemm are quantized per output channel, symmetric, when they are 2-D
(measured: the HTP accepts per-channel int8/uint8 weights on 2-D MatMul and Gemm and its
results match onnxruntime's to cosine 0.99999).  Head-major 4-D projection weights
``[1, H, K, D]`` (``layout{head_proj}``) stay per-tensor: their output channels span two
axes, and the HTP rejects a per-channel axis other than the last on a batched MatMul
("expected equal to 3"); run the pipeline with ``layout{head_proj=false}`` to get them 2-D.
Constants of other ops are per tensor.  Norm scales (gamma) are per tensor, symmetric uint16
where the norms compute in 16 bit, asymmetric uint8 otherwise: measured on the HTP, LayerNorm
rejects an int8 gamma ("None of the combinations match" -- which is what onnxruntime's own QNN
recipe produces with int8 weights) and a uint16 one unless symmetric; uint8 works with 8- and
16-bit activations, but one 8-bit step per tensor rounds a trained gamma's small channels away
(a trained Gemma 3's scales span two orders of magnitude).

``kv_bits`` quantizes the KV cache at the graph boundary (``past_key_values.*`` inputs and
the ``present.*`` outputs that extend them).  onnxruntime's QNN configuration inserts the
Convert ops the HTP needs where an 8-bit tensor meets a 16-bit op.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs
from onnxruntime.quantization import QuantType

from qnnpasses.errors import BadInputError
from qnnpasses.ir.model import IRModel
from qnnpasses.ir.op_kinds import LAYOUT
from qnnpasses.ir.read import is_constant, producer

CATEGORIES = ("embedding", "lm_head", "attention", "softmax", "norm")
ACTIVATION_TYPES = {"uint8": QuantType.QUInt8, "uint16": QuantType.QUInt16, "int8": QuantType.QInt8,
                    "int16": QuantType.QInt16}
WEIGHT_TYPES = {"int8": QuantType.QInt8, "uint8": QuantType.QUInt8, "int16": QuantType.QInt16,
                "uint16": QuantType.QUInt16, "int4": QuantType.QInt4}
#: Weight scale search (:mod:`qnnpasses.quant.weights`): min/max, or the per-channel MSE-optimal clip.
WEIGHT_SCALES = ("minmax", "mse")
#: Weight rounding on those grids: to nearest, or GPTQ (:mod:`qnnpasses.quant.gptq`; ``gptq-act``:
#: input channels in decreasing order of their calibration energy, the paper's act-order).
WEIGHT_ROUNDINGS = ("nearest", "gptq", "gptq-act")
_SHAPE_OPS = LAYOUT
_SCORE_OPS = {"Add", "Mul", "Div", "Sub", "Where", "Max", "Reshape", "Transpose", "Cast"}  # Max: a masked-row clamp
_NORMS = {"RMSNormalization", "LayerNormalization", "SimplifiedLayerNormalization"}


@dataclass
class PrecisionPolicy:
    """What ``qnnpasses quantize`` does; the defaults are the best cell of the sweep for LLMs.

    ``sensitive_bits``: width of the sensitive tensors (16, 8, or None = the same as ``act``).
    """

    act: str = "uint16"
    weights: str = "int8"
    per_channel: bool = True
    sensitive_bits: int | None = 16
    sensitive: tuple[str, ...] = CATEGORIES
    kv_bits: int | None = None
    calibrate_method: str = "minmax"
    block_size: int | None = None
    weight_scales: str = "minmax"
    #: ``nearest`` or GPTQ (``gptq``, ``gptq-act``) on calibration data: see :data:`WEIGHT_ROUNDINGS`.
    weight_rounding: str = "nearest"
    #: MatMul/Gemm nodes raised above the plan: 8-bit weights in an int4 plan, 16-bit outputs in an a8 one,
    #: 16-bit weights in a w8a16 one.
    raised: tuple[str, ...] = ()
    #: Outlier rewrites run on the prepared graph before planning (a textual pipeline, "" for none).
    outliers: str = ""
    #: Width of the other float constants (biases, norm scales/shifts, position tables...): 8 or 16.
    const_bits: int = 8
    #: Weight width of the lm_head (the MatMul/Gemm producing the logits): 8 or 16.  Top-1 agreement
    #: reads its output directly; 16 bits cost 2 bytes per weight of one layer.
    head_bits: int = 8
    #: With 16-bit activations, a MatMul of two activations (attention's Q·Kᵀ, P·V) computes its second
    #: operand as an 8-bit coarse part plus an 8-bit remainder: the HTP reads it at 8 bits otherwise
    #: (:mod:`qnnpasses.quant.split_operand`).
    split_act_matmul: bool = True

    def __post_init__(self) -> None:
        if self.act not in ("uint8", "uint16"):
            raise BadInputError(f"--act must be uint8 or uint16 (got '{self.act}')")
        if self.weights not in ("int8", "uint8", "int16", "int4"):
            raise BadInputError(f"--weights must be int4, int8, uint8 or int16 (got '{self.weights}')")
        if self.block_size is not None and (self.block_size < 2 or self.block_size & (self.block_size - 1)):
            raise BadInputError(f"--block-size must be a power of two >= 2 (got {self.block_size})")
        if self.block_size is not None and not self.per_channel:
            raise BadInputError("--block-size needs per-channel weights")
        if self.weight_scales not in WEIGHT_SCALES:
            raise BadInputError(f"--weight-scales must be one of {', '.join(WEIGHT_SCALES)} (got '{self.weight_scales}')")
        if self.weight_rounding not in WEIGHT_ROUNDINGS:
            raise BadInputError(f"--weight-rounding must be one of {', '.join(WEIGHT_ROUNDINGS)} "
                                f"(got '{self.weight_rounding}')")
        if self.weight_rounding != "nearest" and (not self.per_channel or self.weights == "uint8"):
            raise BadInputError("--weight-rounding gptq needs per-channel symmetric weights (int4, int8 or int16)")
        self.raised = tuple(self.raised)
        unknown = set(self.sensitive) - set(CATEGORIES)
        if unknown:
            raise BadInputError(f"unknown sensitive categories {sorted(unknown)} (known: {', '.join(CATEGORIES)})")
        if self.sensitive_bits not in (None, 8, 16):
            raise BadInputError(f"sensitive bits must be 8 or 16 (got {self.sensitive_bits})")
        if self.kv_bits not in (None, 8, 16):
            raise BadInputError(f"--kv-bits must be 8 or 16 (got {self.kv_bits})")
        if self.head_bits not in (8, 16):
            raise BadInputError(f"--head-bits must be 8 or 16 (got {self.head_bits})")

    @property
    def act_bits(self) -> int:
        return 16 if self.act == "uint16" else 8

    @property
    def weight_bits(self) -> int:
        return int(self.weights.lstrip("uint"))

    def quantizer_args(self) -> dict[str, Any]:
        """The ``quantizer_args`` block of an AIMET encodings file for this policy."""
        return {"activation_bitwidth": self.act_bits, "param_bitwidth": self.weight_bits, "dtype": "int",
                "is_symmetric": self.weights.startswith("int"), "per_channel_quantization": self.per_channel,
                "quant_scheme": self.calibrate_method}

    @property
    def act_type(self) -> QuantType:
        return ACTIVATION_TYPES[self.act]

    @property
    def weight_type(self) -> QuantType:
        return WEIGHT_TYPES[self.weights]

    @property
    def sensitive_type(self) -> QuantType:
        bits = self.sensitive_bits or self.act_bits
        return QuantType.QUInt16 if bits == 16 else QuantType.QUInt8

    def label(self) -> str:
        """``w<weights>-<pc|pt> a<bits> s<bits>[ kv<bits>]``, e.g. ``wint8-pc a8 s16``."""
        sens = self.sensitive_bits or self.act_bits
        kv = f" kv{self.kv_bits}" if self.kv_bits else ""
        gran = f"b{self.block_size}" if self.block_size else ("pc" if self.per_channel else "pt")
        extra = (" mse" if self.weight_scales == "mse" else "") + (f" +{len(self.raised)}" if self.raised else "") \
            + (f" {self.weight_rounding}" if self.weight_rounding != "nearest" else "") \
            + (" h16" if self.head_bits == 16 else "") \
            + (" rot" if "rotate" in self.outliers else " smooth" if self.outliers else "")
        return f"w{self.weights}-{gran} a{self.act_bits} s{sens}{kv}{extra}"


@dataclass
class Plan:
    """The policy applied to one graph: tensor overrides for onnxruntime, and why each was chosen."""

    overrides: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    sensitive: dict[str, str] = field(default_factory=dict)  # tensor -> category
    per_channel: dict[str, int] = field(default_factory=dict)  # weight -> axis
    kv: list[str] = field(default_factory=list)
    weights_8bit: list[str] = field(default_factory=list)  # int4 plans: lm_head and raised layers

    def summary(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for category in self.sensitive.values():
            counts[category] = counts.get(category, 0) + 1
        return {"sensitive": counts, "per_channel_weights": len(self.per_channel), "kv_tensors": len(self.kv),
                "weights_8bit": len(self.weights_8bit)}


# --------------------------------------------------------------------------- finding tensors


def _from_graph_input(t: gs.Tensor, graph_inputs: set[str], depth: int = 6) -> bool:
    """True when ``t`` is a graph input or computed from one through a few index/shape ops."""
    for _ in range(depth):
        if t.name in graph_inputs:
            return True
        node = producer(t)
        if node is None or node.op not in _SHAPE_OPS | {"Cast", "Add", "Sub", "Mul", "Clip"}:
            return False
        t = next((i for i in node.inputs if not is_constant(i)), None)
        if t is None:
            return False
    return False


def embedding_tensors(graph: gs.Graph) -> list[str]:
    """Token-embedding tables and their Gather outputs (the output shares the table's quantization)."""
    inputs = {t.name for t in graph.inputs}
    found = []
    for n in graph.nodes:
        if n.op == "Gather" and isinstance(n.inputs[0], gs.Constant) and len(n.inputs[0].shape) == 2 \
                and _from_graph_input(n.inputs[1], inputs):
            found += [n.inputs[0].name, n.outputs[0].name]
    return found


def head_outputs(graph: gs.Graph) -> list[str]:
    """Outputs of weighted MatMul/Gemm that reach a graph output through shape ops only (and those shape tensors)."""
    found = []
    for out in graph.outputs:
        chain, t = [], out
        while (node := producer(t)) is not None and node.op in _SHAPE_OPS:
            chain.append(t.name)
            t = node.inputs[0]
        node = producer(t)
        if node is not None and node.op in ("MatMul", "Gemm") and any(isinstance(i, gs.Constant) for i in node.inputs[1:2]):
            found += [t.name] + chain
    return found


def attention_tensors(graph: gs.Graph) -> tuple[list[str], list[str]]:
    """(Q·Kᵀ-to-softmax-input tensors, softmax outputs) for every Softmax fed by an activation MatMul."""
    scores, probs = [], []
    for softmax in (n for n in graph.nodes if n.op == "Softmax"):
        path = _path_to_scores_matmul(softmax.inputs[0])
        if path:
            scores += [t for t in path if t not in scores]
            probs.append(softmax.outputs[0].name)
    return scores, probs


def _path_to_scores_matmul(t: gs.Tensor, depth: int = 8) -> list[str] | None:
    """Tensor names from an activation×activation MatMul to ``t`` through score ops, or None."""
    node = producer(t)
    if node is None or depth == 0:
        return None
    if node.op == "MatMul":
        return [t.name] if not any(is_constant(i) for i in node.inputs) else None
    if node.op not in _SCORE_OPS:
        return None
    for operand in node.inputs:
        if is_constant(operand) or operand.dtype is None or np.dtype(operand.dtype).kind != "f":
            continue
        below = _path_to_scores_matmul(operand, depth - 1)
        if below:
            return below + [t.name]
    return None


def norm_tensors(graph: gs.Graph) -> list[str]:
    """Norm outputs, and norm data inputs back through shape-only ops."""
    found = []
    for node in (n for n in graph.nodes if n.op in _NORMS):
        found.append(node.outputs[0].name)
        t = node.inputs[0]
        while not is_constant(t):
            found.append(t.name)
            node = producer(t)
            if node is None or node.op not in _SHAPE_OPS:
                break
            t = node.inputs[0]
    return list(dict.fromkeys(found))


def kv_tensors(graph: gs.Graph) -> list[str]:
    """Float graph inputs that a Concat extends into a graph output, and those outputs (the KV cache)."""
    outputs = {t.name for t in graph.outputs}
    found = []
    for t in graph.inputs:
        if t.dtype is None or np.dtype(t.dtype).kind != "f":
            continue
        for node in t.outputs:
            if node.op == "Concat" and node.outputs[0].name in outputs:
                found += [t.name, node.outputs[0].name]
    return found


def norm_scales(graph: gs.Graph) -> list[str]:
    """Constant scales (gamma) of RMSNormalization / LayerNormalization."""
    return [n.inputs[1].name for n in graph.nodes if n.op in _NORMS and len(n.inputs) > 1 and is_constant(n.inputs[1])]


def head_weights(graph: gs.Graph) -> list[str]:
    """Constant weights of the MatMul/Gemm producing a graph output through shape ops (the lm_head).

    In a static-cache graph the V projections reach their ``new.*.value`` outputs through
    reshapes too; of several such weights the lm_head is the widest (vocabulary-sized) output.
    """
    names = set(head_outputs(graph))
    found = [n for n in graph.nodes if n.op in ("MatMul", "Gemm") and n.outputs[0].name in names
             and isinstance(n.inputs[1], gs.Constant)]

    def width(node: gs.Node) -> int:
        shape = node.outputs[0].shape
        return int(shape[-1]) if shape and isinstance(shape[-1], int) else 0

    widest = max(map(width, found), default=0)
    return [n.inputs[1].name for n in found if width(n) == widest]


def weighted_nodes(graph: gs.Graph) -> dict[str, gs.Node]:
    """MatMul/Gemm nodes with a constant weight, by node name."""
    return {n.name: n for n in graph.nodes if n.op in ("MatMul", "Gemm") and len(n.inputs) > 1
            and isinstance(n.inputs[1], gs.Constant)}


def weighted_inputs(graph: gs.Graph) -> dict[str, int]:
    """Constant weights of MatMul/Gemm and their output-channel axis (None when not per-channel-able)."""
    axes = {}
    for node in graph.nodes:
        if node.op == "MatMul" and isinstance(node.inputs[1], gs.Constant) and len(node.inputs[1].shape) == 2:
            axes[node.inputs[1].name] = 1
        elif node.op == "Gemm" and isinstance(node.inputs[1], gs.Constant):
            axes[node.inputs[1].name] = 0 if node.attrs.get("transB", 0) else 1
    return axes


# --------------------------------------------------------------------------- the plan


def find_sensitive(ir: IRModel, categories: tuple[str, ...] = CATEGORIES) -> dict[str, str]:
    graph = ir.graph
    scores, probs = attention_tensors(graph)
    found = {"embedding": embedding_tensors(graph), "lm_head": head_outputs(graph), "attention": scores,
             "softmax": probs, "norm": norm_tensors(graph)}
    sensitive: dict[str, str] = {}
    for category in CATEGORIES:
        if category in categories:
            for name in found[category]:
                sensitive.setdefault(name, category)
    return sensitive


def make_plan(ir: IRModel, policy: PrecisionPolicy) -> Plan:
    """Tensor overrides (onnxruntime's ``TensorQuantOverrides`` form) for ``policy`` on ``ir``."""
    plan = Plan()
    plan.sensitive = find_sensitive(ir, policy.sensitive)
    if policy.sensitive_type != policy.act_type:
        for name in plan.sensitive:
            plan.overrides[name] = [{"quant_type": policy.sensitive_type}]
    if policy.kv_bits:
        plan.kv = kv_tensors(ir.graph)
        kv_type = QuantType.QUInt8 if policy.kv_bits == 8 else QuantType.QUInt16
        for name in plan.kv:
            plan.overrides[name] = [{"quant_type": kv_type}]
    symmetric = policy.weights.startswith("int")
    nodes = weighted_nodes(ir.graph)
    unknown = [n for n in policy.raised if n not in nodes]
    if unknown:
        raise BadInputError(f"raised layers {unknown[:3]} are not weighted MatMul/Gemm nodes of this graph")
    raised_weights = {nodes[n].inputs[1].name for n in policy.raised}
    raised_16 = set(head_weights(ir.graph)) if policy.head_bits == 16 else set()
    if policy.weight_bits == 4:  # the lm_head (and the embedding, an activation here) stay at 8 bit or more
        plan.weights_8bit = sorted((set(head_weights(ir.graph)) | raised_weights) - raised_16)
    elif policy.act_bits == 8 and policy.raised:
        for n in policy.raised:
            plan.overrides.setdefault(nodes[n].outputs[0].name, [{"quant_type": QuantType.QUInt16}])
    elif policy.weight_bits == 8:  # w8a16: the weakest layers get 16-bit weights
        raised_16 |= raised_weights
    for name, axis in weighted_inputs(ir.graph).items():
        wtype = QuantType.QInt8 if name in plan.weights_8bit else QuantType.QInt16 if name in raised_16 \
            else policy.weight_type
        entry: dict[str, Any] = {"quant_type": wtype, "symmetric": symmetric}
        if policy.per_channel:
            entry["axis"] = axis
            plan.per_channel[name] = axis
        plan.overrides[name] = [entry]
    for name in norm_scales(ir.graph):  # the HTP's LayerNorm rejects int8 and asymmetric uint16 gammas
        plan.overrides[name] = [{"quant_type": QuantType.QUInt16, "symmetric": True}
                                if 16 in (policy.const_bits, policy.sensitive_bits or policy.act_bits)
                                else {"quant_type": QuantType.QUInt8, "symmetric": False}]
    if policy.const_bits == 16:  # biases and the like at the activations' 16-bit grid
        for node in ir.graph.nodes:
            for t in node.inputs:
                if isinstance(t, gs.Constant) and np.dtype(t.dtype).kind == "f" and t.name not in plan.overrides:
                    plan.overrides[t.name] = [{"quant_type": QuantType.QUInt16}]
    if policy.weight_bits == 4:  # int4 is for projection weights only: rotary tables, scales... stay int8
        for node in ir.graph.nodes:
            for t in node.inputs:
                if isinstance(t, gs.Constant) and np.dtype(t.dtype).kind == "f" and t.name not in plan.overrides:
                    plan.overrides[t.name] = [{"quant_type": QuantType.QInt8, "symmetric": True}]
    return plan
