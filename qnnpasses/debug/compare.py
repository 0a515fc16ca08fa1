"""Accuracy of a model B against a reference A, and where B first goes wrong.

:func:`compare_models` runs A on onnxruntime CPU (fp32) and B on CPU or on the real QNN
HTP backend with the same inputs, and reports per output the max abs error, the cosine
and, for logits, how often the top-1 token agrees.  On HTP a float model runs with
``enable_htp_fp16_precision``; a model with QuantizeLinear/DequantizeLinear runs in
integer precision (no fp16 flag).

:func:`bisect` localises the first divergence, as the field guide prescribes: compare
intermediate activations layer by layer.  Tensors are mapped between A and B by name
(the primary mapping: rewrites keep most names), then through nodes present in both
graphs under the same name and op type (a rewrite that replaced a tensor still feeds the
same consumer: input *i* of that node in A corresponds to input *i* in B — this is what
the ``added``/``removed`` lists of a ``report.json`` amount to), then through an
explicit ``mapping``.  Mapped floating-point tensors become extra graph outputs of a
copy of each model; one run of each gives all of them.  A tensor diverges when it
breaks the tolerance of :func:`qnnpasses.backends.cpu.compare_outputs`.  The *first bad
node* is the producer (in A) of the first divergent tensor in A's topological order:
every compared input it reads still agrees, so the error starts there.  Mask sentinels
(float32's lowest value, which fp16 saturates) are not counted as errors.

Bisection only runs when the outputs disagree: with outputs within tolerance there is no
bad node to find, and an intermediate that differs (an intended rewrite) is not a fault.
An intermediate is judged by what it means downstream: values at or below
:data:`MASK_FLOOR` (-1000) in both models mean "masked" (an additive attention mask: after
the softmax's max subtraction ``exp`` of them is 0 in fp32 and fp16 alike), so a -3.4e38
mask and a -1e4 mask agree.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from qnnpasses.analysis.graph import OTHER, node_layers
from qnnpasses.backends.cpu import (
    check_inputs,
    compare_outputs,
    load_inputs,
    make_inputs,
    run_cpu,
)
from qnnpasses.errors import BadInputError, CheckFailedError, QnnPassesError
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import IRModel, to_model_bytes

ModelLike = Union[IRModel, str, "os.PathLike[str]", onnx.ModelProto]

#: (atol, rtol, min_cosine) by where B runs: CPU fp32 must match closely; HTP fp16 cannot.
TOLERANCES = {"cpu": (1e-4, 1e-4, 0.99999), "htp": (1e-2, 1e-2, 0.999)}
_QDQ = {"QuantizeLinear", "DequantizeLinear"}
#: Reference values at least this large are "minus infinity" sentinels (attention masks use
#: float32's lowest value); fp16 saturates them to ±65504 or ±inf, which is not an error.
SENTINEL = float(np.finfo(np.float32).max) / 2
_FP16_MAX = float(np.finfo(np.float16).max)
#: At or below this an additive mask value removes its position from a softmax: against
#: logits of ordinary size (|x| < 900) exp(v - max) underflows to 0 in fp32 (below e^-104)
#: and in fp16, so two such values mean the same (a -1e4 mask plus x stays below it).
MASK_FLOOR = -1e3


@dataclass
class TensorDiff:
    name: str           # in A
    b_name: str         # in B
    producer: str       # A's node writing it
    layer: str
    max_abs: float
    cosine: float
    ok: bool
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class BisectResult:
    """Intermediate comparisons in A's topological order and the first divergence."""

    outputs: dict[str, Any]
    compared: list[TensorDiff]
    first_divergent: TensorDiff | None = None
    first_bad_node: str | None = None
    first_bad_op: str | None = None
    unmapped_inputs: list[str] = field(default_factory=list)
    layers: list[dict[str, Any]] = field(default_factory=list)
    tolerance: dict[str, float] = field(default_factory=dict)
    skipped: str | None = None  # why no bisection ran (the outputs agree)

    def as_dict(self) -> dict[str, Any]:
        return {
            "outputs": self.outputs,
            "skipped": self.skipped,
            "tolerance": self.tolerance,
            "first_bad_node": self.first_bad_node,
            "first_bad_op": self.first_bad_op,
            "first_divergent": self.first_divergent.as_dict() if self.first_divergent else None,
            "unmapped_inputs": self.unmapped_inputs,
            "layers": self.layers,
            "compared": [d.as_dict() for d in self.compared],
        }


# --------------------------------------------------------------------------- running


def as_ir(model: ModelLike) -> IRModel:
    return model if isinstance(model, IRModel) else load_model(model)


def is_quantized(ir: IRModel) -> bool:
    return any(n.op in _QDQ for g in ir.graphs() for n in g.nodes)


def resolve_inputs(a: IRModel, inputs, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs as given (dict or .npz path), or seeded ones made for A; checked against A."""
    if inputs is None:
        return make_inputs(a, seed)
    feeds = load_inputs(inputs) if isinstance(inputs, (str, os.PathLike)) else dict(inputs)
    check_inputs(a, feeds)
    return feeds


def _feeds_for(ir: IRModel, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    wanted = [t.name for t in ir.graph.inputs]
    missing = [n for n in wanted if n not in inputs]
    if missing:
        raise BadInputError(f"model B needs inputs A does not have: {missing}")
    return {n: inputs[n] for n in wanted}


def with_outputs(ir: IRModel, names: list[str]) -> IRModel:
    """A copy of ``ir`` whose graph also outputs the tensors ``names`` (existing outputs kept)."""
    if not names:
        return ir
    copy = ir.copy()
    tensors = copy.graph.tensors()
    present = {t.name for t in copy.graph.outputs}
    copy.graph.outputs = list(copy.graph.outputs) + [tensors[n] for n in names if n not in present]
    return copy


def run_model(ir: IRModel, inputs: dict[str, np.ndarray], on: str = "cpu") -> dict[str, np.ndarray]:
    """Outputs of ``ir`` on onnxruntime CPU, or on the QNN HTP (fp16 unless the model is QDQ)."""
    feeds = _feeds_for(ir, inputs)
    if on == "cpu":
        return run_cpu(ir, feeds)
    if on != "htp":
        raise BadInputError(f"--on must be 'cpu' or 'htp' (got '{on}')")
    from qnnpasses.backends.htp import run_on_htp

    try:
        return run_on_htp(to_model_bytes(ir), feeds, fp16=not is_quantized(ir))
    except QnnPassesError:
        raise
    except Exception as exc:  # the backend refused the graph: a finding about B, reported in one line
        raise CheckFailedError(f"B does not run on the HTP: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : ", "", lines[0]) if lines else ""
    return text[:300] or type(exc).__name__


# --------------------------------------------------------------------------- outputs


def align_sentinels(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    """``got`` with saturated copies of the reference's ±infinity sentinels set equal to them."""
    ref, got = np.asarray(ref), np.asarray(got)
    if ref.dtype.kind != "f" or got.dtype.kind != "f" or ref.shape != got.shape:
        return got
    with np.errstate(invalid="ignore"):
        mask = (np.abs(ref) >= SENTINEL) & (np.sign(got) == np.sign(ref)) & (np.abs(got) >= _FP16_MAX)
    if not mask.any():
        return got
    aligned = got.astype(ref.dtype, copy=True)
    aligned[mask] = ref[mask]
    return aligned


def align_masks(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    """``got`` with values that mask a softmax position in both models (<= MASK_FLOOR) set
    equal to the reference's: -3.4e38 and -1e4 have the same effect downstream."""
    ref, got = np.asarray(ref), np.asarray(got)
    if ref.dtype.kind != "f" or got.dtype.kind != "f" or ref.shape != got.shape:
        return got
    with np.errstate(invalid="ignore"):
        mask = (ref <= MASK_FLOOR) & (got <= MASK_FLOOR)
    if not mask.any():
        return got
    aligned = got.astype(ref.dtype, copy=True)
    aligned[mask] = ref[mask]
    return aligned


def vocab_size(ir: IRModel) -> int | None:
    """Rows of the token-embedding table (a Gather of a 2-D constant by an integer graph input)."""
    inputs = {t.name for t in ir.graph.inputs}
    for node in ir.graph.nodes:
        table = node.inputs[0] if node.op == "Gather" and len(node.inputs) == 2 else None
        if isinstance(table, gs.Constant) and len(table.shape) == 2 and node.inputs[1].name in inputs:
            return int(table.shape[0])
    return None


def is_logits(name: str, array: np.ndarray, vocab: int | None) -> bool:
    if array.dtype.kind != "f" or array.ndim < 2:
        return False
    return "logits" in name.lower() or (vocab is not None and array.shape[-1] == vocab)


def top1_agreement(ref: np.ndarray, got: np.ndarray) -> float:
    return float(np.mean(np.argmax(ref, axis=-1) == np.argmax(got, axis=-1)))


def _tolerance(on: str, atol: float | None, rtol: float | None, min_cosine: float | None) -> dict[str, float]:
    if on not in TOLERANCES:
        raise BadInputError(f"--on must be 'cpu' or 'htp' (got '{on}')")
    d_atol, d_rtol, d_cos = TOLERANCES[on]
    return {"atol": d_atol if atol is None else atol, "rtol": d_rtol if rtol is None else rtol,
            "min_cosine": d_cos if min_cosine is None else min_cosine}


def output_report(a: IRModel, b: IRModel, on: str, ref: dict[str, np.ndarray], got: dict[str, np.ndarray],
                  tol: dict[str, float]) -> dict:
    """Where B ran, the tolerance, and per output max abs, cosine, ok and (logits) top-1 agreement."""
    names = [t.name for t in a.graph.outputs]
    comparison = compare_outputs({n: ref[n] for n in names},
                                 {n: align_sentinels(ref[n], got[n]) for n in names if n in got}, **tol)
    vocab = vocab_size(a)
    rows = []
    for diff in comparison.outputs:
        row = {"name": diff.name, "max_abs": diff.max_abs, "cosine": diff.cosine, "ok": diff.ok, "reason": diff.reason}
        both = diff.name in got and ref[diff.name].shape == got[diff.name].shape
        if both and is_logits(diff.name, ref[diff.name], vocab):
            row["top1_agreement"] = top1_agreement(ref[diff.name], got[diff.name])
        rows.append(row)
    return {"on": on, "fp16": on == "htp" and not is_quantized(b), "tolerance": tol, "outputs": rows,
            "max_abs": comparison.max_abs, "cosine": comparison.cosine, "ok": comparison.ok}


def compare_models(a: ModelLike, b: ModelLike, inputs=None, on: str = "cpu", *, atol: float | None = None,
                   rtol: float | None = None, min_cosine: float | None = None, seed: int = 0) -> dict:
    """Run A on CPU and B on ``on`` with the same inputs; per-output errors (see the module docs)."""
    a_ir, b_ir = as_ir(a), as_ir(b)
    tol = _tolerance(on, atol, rtol, min_cosine)
    feeds = resolve_inputs(a_ir, inputs, seed)
    ref = run_model(a_ir, feeds, "cpu")
    got = run_model(b_ir, feeds, on)
    return output_report(a_ir, b_ir, on, ref, got, tol)


# --------------------------------------------------------------------------- bisection


def _float_activations(ir: IRModel) -> dict[str, gs.Variable]:
    """Node outputs with a floating dtype, by name (Constant nodes' outputs excluded)."""
    found = {}
    for node in ir.graph.nodes:
        if node.op == "Constant":
            continue
        for t in node.outputs:
            if isinstance(t, gs.Variable) and t.name and t.dtype is not None and _is_float(t.dtype):
                found[t.name] = t
    return found


def _is_float(dtype) -> bool:
    try:
        return np.dtype(dtype).kind == "f"
    except TypeError:
        return False


def map_tensors(a: IRModel, b: IRModel, mapping: dict[str, str] | None = None) -> dict[str, str]:
    """A tensor name -> B tensor name for floating-point intermediates of both (module docs)."""
    a_acts, b_acts = _float_activations(a), _float_activations(b)
    pairs = {n: n for n in a_acts if n in b_acts}
    used = set(pairs.values())
    b_nodes = {(n.name, n.op): n for n in b.graph.nodes}
    for node in a.graph.nodes:
        twin = b_nodes.get((node.name, node.op))
        if twin is None:
            continue
        for ours, theirs in list(zip(node.inputs, twin.inputs)) + list(zip(node.outputs, twin.outputs)):
            if ours.name in a_acts and theirs.name in b_acts and ours.name not in pairs and theirs.name not in used:
                pairs[ours.name] = theirs.name
                used.add(theirs.name)
    for ours, theirs in (mapping or {}).items():
        if ours not in a_acts or theirs not in b_acts:
            raise BadInputError(f"mapping {ours!r} -> {theirs!r} names a tensor that is not a float intermediate")
        pairs[ours] = theirs
    return pairs


def _topological_pairs(a: IRModel, pairs: dict[str, str]) -> list[tuple[str, str, int]]:
    """(A name, B name, A producer index) in A's node order (topological, as the checker demands)."""
    order = []
    for index, node in enumerate(a.graph.nodes):
        for t in node.outputs:
            if t.name in pairs:
                order.append((t.name, pairs[t.name], index))
    return order


def bisect(a: ModelLike, b: ModelLike, inputs=None, on: str = "cpu", *, atol: float | None = None,
           rtol: float | None = None, min_cosine: float | None = None, mapping: dict[str, str] | None = None,
           seed: int = 0) -> BisectResult:
    """Compare every mapped intermediate of A (CPU) and B (``on``) and name the first bad node."""
    a_ir, b_ir = as_ir(a), as_ir(b)
    tol = _tolerance(on, atol, rtol, min_cosine)
    feeds = resolve_inputs(a_ir, inputs, seed)
    ordered = _topological_pairs(a_ir, map_tensors(a_ir, b_ir, mapping))
    ref = run_model(with_outputs(a_ir, [p[0] for p in ordered]), feeds, "cpu")
    got = run_model(with_outputs(b_ir, [p[1] for p in ordered]), feeds, on)
    outputs = output_report(a_ir, b_ir, on, ref, got, tol)
    if outputs["ok"]:  # nothing to find: differences inside are intended or harmless
        return BisectResult(outputs=outputs, compared=[], tolerance=tol,
                            skipped="the outputs agree within tolerance, so there is no bad node to find")
    layers = node_layers(a_ir)
    diffs = _diff_pairs(a_ir, ordered, ref, got, tol, layers)
    result = BisectResult(outputs=outputs, compared=diffs, tolerance=tol)
    result.layers = layer_table(diffs)
    bad = next((d for d in diffs if not d.ok), None)
    if bad is not None:
        node = next(n for n in a_ir.graph.nodes if n.name == bad.producer)
        result.first_divergent, result.first_bad_node, result.first_bad_op = bad, node.name, node.op
        compared = {d.name for d in diffs}
        graph_inputs = {t.name for t in a_ir.graph.inputs}
        result.unmapped_inputs = [t.name for t in node.inputs if isinstance(t, gs.Variable) and t.name
                                  and t.name not in compared and t.name not in graph_inputs
                                  and not (t.inputs and t.inputs[0].op == "Constant")]
    return result


def _diff_pairs(a: IRModel, ordered, ref, got, tol, layers: list[str]) -> list[TensorDiff]:
    """Figures per mapped pair; pairs whose shapes differ (a rewrite changed the layout) are skipped."""
    same = [(n, m, i) for n, m, i in ordered if m in got and np.shape(ref[n]) == np.shape(got[m])]
    comparison = compare_outputs({n: ref[n] for n, _, _ in same},
                                 {n: align_masks(ref[n], align_sentinels(ref[n], got[m])) for n, m, _ in same},
                                 **tol)
    return [TensorDiff(name, b_name, a.graph.nodes[index].name, layers[index], d.max_abs, d.cosine, d.ok, d.reason)
            for (name, b_name, index), d in zip(same, comparison.outputs)]


def layer_table(diffs: list[TensorDiff]) -> list[dict[str, Any]]:
    """One row per layer in order of appearance: tensors compared, the first divergent one and
    its figures (None when all agree), and the worst figures in the layer.

    Tensors outside numbered layers are "pre" before the first layer and "post" after.
    """
    first_layer = next((i for i, d in enumerate(diffs) if d.layer != OTHER), len(diffs))
    rows: dict[str, dict[str, Any]] = {}
    for i, d in enumerate(diffs):
        label = d.layer if d.layer != OTHER else ("pre" if i < first_layer else "post")
        row = rows.setdefault(label, {"layer": label, "tensors": 0, "first_tensor": d.name, "first_divergent": None,
                                      "max_abs": None, "cosine": None, "worst_max_abs": 0.0, "worst_cosine": 1.0})
        row["tensors"] += 1
        if not d.ok and row["first_divergent"] is None:
            row.update(first_divergent=d.name, max_abs=d.max_abs, cosine=d.cosine)
        row["worst_max_abs"] = _nan_max(row["worst_max_abs"], d.max_abs)
        row["worst_cosine"] = _nan_min(row["worst_cosine"], d.cosine)
    return list(rows.values())


def _nan_max(x: float, y: float) -> float:
    return y if np.isnan(y) or y > x else x


def _nan_min(x: float, y: float) -> float:
    return y if np.isnan(y) or y < x else x


__all__ = ["TOLERANCES", "BisectResult", "TensorDiff", "bisect", "compare_models", "map_tensors"]
