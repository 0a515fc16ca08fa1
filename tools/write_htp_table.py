#!/usr/bin/env python
"""Write ``op_support/tables/htp.json`` from the *build* probe suite.

    python tools/write_htp_table.py            # write the table, then report its fit
    python tools/write_htp_table.py --explain Gather   # per-dtype/rank/knob verdicts of one op
    python tools/write_htp_table.py --htp-arch v75     # htp_v75.json from htp_build.v75.jsonl

What is measured is derived mechanically from ``tools/probe_results/htp_build.jsonl``:
which dtypes each input/output position takes on HTP, the highest rank that ran, the QNN
op(s) a node becomes, and evidence (probe ids) for each.  What needs reading —
attribute constraints, constant-input requirements, dtype combinations — is written
down in ``CONSTRAINTS`` below, each with the reason the backend gave; the script then
checks the finished table against every build probe and prints the misfits, so a wrong
constraint shows up here before the holdout test sees it.

``--htp-arch vNN`` writes ``op_support/tables/htp_vNN.json`` from the same suite probed for a
target of that arch (``python tools/probe_htp.py --suite build --soc ...``); the rules learned
from ONNX's backend node tests (``learn_from_node_tests``) were measured on v73 and are applied
to every arch.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

RESULTS = ROOT / "tools" / "probe_results"
TABLE = ROOT / "op_support" / "tables" / "htp.json"
#: QNN ops the EP adds around a node (layout, int64<->int32 casts); not "the" QNN op.
GLUE_QNN_OPS = {"Cast", "Transpose", "Reshape"}

# Per-input names, for readable reasons.  Ops not listed get "in0", "in1", ...
INPUT_NAMES: dict[str, list[str]] = {
    "Gather": ["data", "indices"], "GatherElements": ["data", "indices"], "GatherND": ["data", "indices"],
    "ScatterND": ["data", "indices", "updates"], "ScatterElements": ["data", "indices", "updates"],
    "Where": ["condition", "X", "Y"], "Reshape": ["data", "shape"], "Expand": ["input", "shape"],
    "Tile": ["input", "repeats"], "Slice": ["data", "starts", "ends", "axes", "steps"],
    "Split": ["input", "split"], "Unsqueeze": ["data", "axes"], "Squeeze": ["data", "axes"],
    "LayerNormalization": ["X", "Scale", "B"], "RMSNormalization": ["X", "scale"],
    "Gemm": ["A", "B", "C"], "MatMul": ["A", "B"], "Conv": ["X", "W", "B"], "Clip": ["input", "min", "max"],
    "TopK": ["X", "K"], "Trilu": ["input", "k"], "CumSum": ["x", "axis"], "Pad": ["data", "pads"],
    "Range": ["start", "limit", "delta"], "ConstantOfShape": ["input"], "Pow": ["X", "Y"],
    "Attention": ["Q", "K", "V"], "RotaryEmbedding": ["input", "position_ids", "cos_cache", "sin_cache"],
}
VARIADIC = {"Max", "Min", "Sum", "Mean", "Concat", "Einsum"}

# --------------------------------------------------------------------------- hand-read constraints
# Each entry: rules (see op_support/checker.py for kinds) and notes.  A rule's "reason" is
# what the checker reports; "evidence" names the knob in the build suite that shows it.
def _const(index: int, reason: str, evidence: str) -> dict[str, Any]:
    return {"check": "constant_input", "index": index, "reason": reason, "evidence": evidence}


def _only(attr: str, values: list[Any], default: Any, reason: str, evidence: str) -> dict[str, Any]:
    return {"check": "attr_in", "attr": attr, "values": values, "default": default, "reason": reason, "evidence": evidence}


def _last_axis(reason: str, evidence: str) -> dict[str, Any]:
    return {"check": "last_axis", "attr": "axis", "default": -1, "input": 0, "reason": reason, "evidence": evidence}


_REDUCE_AXES = _const(1, "reduce axes must be a constant initializer", "axes_const=False")
_SHAPE_CONST = "{} must be a constant initializer (the EP cannot get the output shape otherwise)"

CONSTRAINTS: dict[str, dict[str, Any]] = {
    **{op: {"rules": [_REDUCE_AXES]} for op in ("ReduceMean", "ReduceMax", "ReduceMin", "ReduceSum", "ReduceL2")},
    "LayerNormalization": {"rules": [_last_axis("LayerNorm on HTP normalizes over the last axis only", "axis=-2,1,0")]},
    "RMSNormalization": {"rules": [_last_axis("RMSNorm on HTP normalizes over the last axis only", "axis=-2,0")]},
    "Softmax": {"notes": ["axis other than the last: the EP wraps Softmax in two Transposes (runs, costs data movement)"]},
    "Gemm": {"rules": [
        _only("alpha", [1.0], 1.0, "Gemm alpha must be 1 (QNN FullyConnected)", "alpha=0.5"),
        _only("beta", [1.0, 0.0], 1.0, "Gemm beta must be 1 or 0 (QNN FullyConnected)", "beta=2.0"),
    ]},
    "Einsum": {"rules": [
        {"check": "min_inputs", "count": 2, "reason": "Einsum needs two operands on HTP", "evidence": "equation=bij->bji"},
        {"check": "einsum_matmul", "reason": "Einsum equation is not a batched matrix product", "evidence": "equation=i,j->ij"},
    ]},
    "Cast": {"derive_dtype_pairs": True},
    # Alone, Q/DQ probes only show the EP's I/O policy; inside a QDQ node unit they are taken with
    # the op they wrap.  Checked with Q(graph input) -> DQ -> Mul(DQ weight) -> Q -> DQ(graph output),
    # uint8/int8/uint16/int16 per-tensor: the inner DQ, DQ, Mul, Q became one quantized QNN
    # ElementWiseMultiply; the outer Q and DQ ran on the CPU EP.
    "QuantizeLinear": {"in_units": True, "rules": [
        {"check": "not_graph_input", "reason": "the EP leaves a Q that consumes a graph input on the CPU",
         "evidence": "scale=per_tensor"},
        {"check": "attr_in", "attr": "axis", "values": [None], "reason": "standalone per-channel Q is not supported",
         "evidence": "scale=per_channel"}],
        "notes": ["inside a QDQ node unit the Q is fused with the op it wraps (quantized QNN op)"]},
    "DequantizeLinear": {"in_units": True, "rules": [
        {"check": "not_graph_output", "reason": "the EP leaves a DQ that produces a graph output on the CPU",
         "evidence": "scale=per_tensor"}],
        "notes": [("inside a QDQ node unit the DQ is fused with the op it wraps (quantized QNN op); "
                   "per-channel DQ is for Conv/MatMul/Gemm weights")]},
    "Reshape": {"rules": [{**_const(1, _SHAPE_CONST.format("shape"), "shape_const=False"), "or_static_output": True}]},
    # Expand's builder reads the shape operand's values: computed ones are refused even when
    # onnxruntime knows the output shape ("QNN doesn't support dynamic shape.", node tests
    # test_flexattention_*_expanded) -- unlike Reshape's, which only needs the output shape.
    "Expand": {"rules": [{**_const(1, _SHAPE_CONST.format("shape"), "shape_const=False"),
                          "learned_from": "node tests (the or-static-output exception withdrawn)"}]},
    # Rejected alone, but the EP's own GeluFusion takes Div -> Erf -> Add -> Mul -> Mul as one QNN Gelu
    # (seen in tests/fixtures/bert_ts.onnx: "Validation PASSED for 5 nodes in GeluFusion (Erf)").
    "Erf": {"fusions": [{"pattern": "erf_gelu", "qnn_op": "Gelu",
                         "note": "part of an Erf-based GeLU: the EP fuses Div/Erf/Add/Mul/Mul into one QNN Gelu"}]},
    "Tile": {"rules": [_const(1, _SHAPE_CONST.format("repeats"), "reps_const=False")]},
    "Pad": {"rules": [_const(1, _SHAPE_CONST.format("pads"), "pads_const=False")]},
    "TopK": {"rules": [_const(1, _SHAPE_CONST.format("K"), "k_const=False"),
                       {"check": "axis_not_negative_inner", "attr": "axis", "default": -1,
                        "reason": "TopK with a negative axis other than -1 is rejected (the EP mis-converts it): "
                                  "write the axis as a non-negative number", "evidence": "axis=-2"}]},
    "Slice": {"rules": [_const(i, _SHAPE_CONST.format(n), "const=False")
                        for i, n in ((1, "starts"), (2, "ends"), (3, "axes"), (4, "steps"))]},
    "Split": {"rules": [_const(1, "split sizes must be a constant initializer (no dynamic split)", "split=input")]},
    "Gather": {"conditional_notes": [
        {"when": {"input_constant": {"1": False}},
         "note": "indices computed at run time must be non-negative: HTP Gather does not wrap negative indices "
                 "(the EP fixes up constant ones only; holdout probe failed at execute with 'bad input in "
                 "InputGather2DDMA; weight sel = -1')"}]},
    "ScatterND": {"rules": [_only("reduction", ["none", "add", "mul"], "none", "ScatterND reduction max/min is not supported",
                                  "reduction=max")]},
    "GatherND": {"rules": [_only("batch_dims", [0], 0, "GatherND batch_dims must be 0", "batch_dims=1")]},
    "CumSum": {"rules": [
        _const(1, "CumSum axis must be a constant initializer", "axis_const=False"),
        _only("exclusive", [0], 0, "CumSum exclusive must be 0", "exclusive=1"),
        _only("reverse", [0], 0, "CumSum reverse must be 0", "reverse=1"),
    ]},
    "Clip": {"rules": [_const(1, "Clip min must be a constant initializer", "const=False"),
                       _const(2, "Clip max must be a constant initializer", "const=False")]},
    **{op: {"rules": [_only("select_last_index", [0], 0, f"{op} select_last_index must be 0", "select_last_index=1")]}
       for op in ("ArgMax", "ArgMin")},
}


# --------------------------------------------------------------------------- learned from ONNX's node tests
# ``tools/check_agreement.py probe --suite node`` records the backend's verdict on every node of
# every ONNX backend node test (``tools/probe_results/agreement_node.jsonl``).  Ops the build suite
# never probed get a coarse entry from the single-node tests' verdicts (majority; no dtype or rank
# detail beyond the global limit); constraints read from the failures are listed here with the
# backend's reason.  Entries and rules from this source say so ("learned_from").
NODE_TESTS = RESULTS / "agreement_node.jsonl"
#: ONNX ops the EP builds with another op's builder (test_castlike_*: every one ran on the HTP).
ALIASES = {"CastLike": "Cast"}
NODE_TEST_RULES: dict[str, list[dict[str, Any]]] = {
    "LayerNormalization": [
        {"check": "output_absent", "index": i, "reason": "QNN LayerNorm only supports 1 output (Mean/InvStdDev unused)",
         "source": ["node tests test_layer_normalization_*: cpu (QNN LayerNorm only support 1 output.)"]} for i in (1, 2)],
    "Attention": [
        {"check": "input_absent", "index": 6, "reason": "Attention: nonpad_kv_seqlen is not supported by QNN EP",
         "source": ["node tests test_attention_4d_*nonpad*: cpu"]},
        {"check": "input_dtype_in", "index": 3, "dtypes": ["float32", "float16"],
         "reason": "Attention: boolean attn_mask is not supported; pre-convert to a float additive bias",
         "source": ["node tests test_attention_4d_attn_mask_bool*: cpu"]},
        {"check": "attr_in", "attr": "softmax_precision", "values": [None, 0],
         "reason": "Attention: softmax_precision is not supported by QNN EP",
         "source": ["node tests test_attention_24_qk_matmul_output_mode3_softmax_precision: cpu"]},
    ],
    "BatchNormalization": [
        {"check": "constant_input", "index": i, "reason": "QNN BatchNorm doesn't support dynamic scale, bias, mean or var",
         "source": ["node tests test_batchnorm_*: cpu (QNN BatchNorm doesn't support dynamic scale.)"]} for i in (1, 2, 3, 4)],
    "Resize": [
        {"check": "attr_in", "attr": "coordinate_transformation_mode", "default": "half_pixel",
         "values": ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric"],
         "reason": "Resize: coordinate_transformation_mode tf_crop_and_resize / half_pixel_symmetric is not supported",
         "source": ["node tests test_resize_tf_crop_and_resize*, *_half_pixel_symmetric: cpu"]},
        {"check": "attr_in", "attr": "antialias", "default": 0, "values": [0],
         "reason": "Resize: anti-aliasing is not supported", "source": ["node tests test_resize_*_antialias: cpu"]},
        {"check": "constant_input", "index": 2, "when": {"attr": {"mode": ["cubic"]}},
         "reason": "Resize: cubic mode needs constant scales (or sizes)",
         "source": ["node tests test_resize_*_scales_cubic*: cpu; test_resize_*_sizes_cubic: htp"]},
    ],
    "GridSample": [
        {"check": "attr_in", "attr": "mode", "default": "linear", "values": ["linear", "bilinear", "nearest"],
         "reason": "GridSample: cubic mode is not supported", "source": ["node tests test_gridsample_bicubic*: cpu"]},
        {"check": "input_rank", "input": 0, "max": 4, "reason": "GridSample: volumetric (5-D) input is not supported",
         "source": ["node tests test_gridsample_volumetric_*: session failed"]},
    ],
    "LpNormalization": [
        {"check": "attr_in", "attr": "p", "default": 2, "values": [2], "reason": "LpNormalization: only p=2",
         "source": ["node tests test_l1normalization_*: cpu"]}],
    **{op: [{"check": "attr_all", "attr": "dilations", "value": 1, "reason": f"{op}: dilations other than 1",
             "source": [f"node tests test_{op.lower()}_*dilations*: cpu"]}] for op in ("MaxPool", "AveragePool", "ConvTranspose")},
    **{op: [{"check": "min_inputs", "count": 2, "reason": f"{op} needs at least 2 inputs on HTP",
             "source": [f"node tests test_{op.lower()}_one_input: cpu"]}] for op in ("Max", "Min", "Sum", "Mean")},
    **{op: [{"check": "attr_in", "attr": "layout", "default": 0, "values": [0], "reason": f"{op}: layout=1 is not supported",
             "source": [f"node tests test_{op.lower()}_batchwise: cpu"]}] for op in ("GRU", "LSTM")},
    "RoiAlign": [{"check": "attr_in", "attr": "mode", "default": "avg", "values": ["avg"],
                  "reason": "RoiAlign: only avg pooling mode", "source": ["node tests test_roialign_mode_max: cpu"]}],
    "ScatterElements": [{"check": "attr_in", "attr": "reduction", "default": "none", "values": ["none"],
                         "reason": "ScatterElements: reductions are not supported",
                         "source": ["node tests test_scatter_elements_with_reduction_*, *_duplicate_indices: cpu"]}],
    **{op: [{"check": "attr_in", "attr": "noop_with_empty_axes", "default": 0, "values": [0],
             "reason": f"{op}: noop_with_empty_axes=1 is not supported",
             "source": ["node tests test_reduce_sum_empty_axes_input_noop*: cpu"]}]
       for op in ("ReduceMean", "ReduceMax", "ReduceMin", "ReduceSum", "ReduceL2", "ReduceProd", "ReduceL1",
                  "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp")},
    "Mod": [{"check": "attr_in", "attr": "fmod", "default": 0, "values": [0], "reason": "Mod: only fmod=0",
             "source": ["node tests test_mod_*fmod (fmod=1): cpu"]}],
}

NODE_TEST_RULES["MaxPool"] = [*NODE_TEST_RULES["MaxPool"], {
    "check": "output_absent", "index": 1, "reason": "QNN Pool only supports 1 output (no Indices)",
    "source": ["node tests test_maxpool_with_argmax_*: cpu"]}]
NODE_TEST_RULES["LSTM"] = [*NODE_TEST_RULES["LSTM"], {
    "check": "input_absent", "index": 4, "reason": "LSTM: sequence_lens is not supported",
    "source": ["node tests test_lstm_with_peepholes: cpu (dynamic sequence_length)"]}]


def _single_node_verdicts() -> dict[str, list[tuple[str, str, str]]]:
    """op -> [(test id, verdict, reason)] over the single-node tests (the node is named <op>_0)."""
    import json as _json

    by_op: dict[str, list[tuple[str, str, str]]] = defaultdict(list)
    if not NODE_TESTS.exists():
        return by_op
    for line in NODE_TESTS.read_text().splitlines():
        rec = _json.loads(line)
        if rec["nodes_in_model"] != 1 or len(rec["nodes"]) != 1:
            continue
        (name, (verdict, reason)), = rec["nodes"].items()
        by_op[name.rsplit("_", 1)[0]].append((rec["id"], verdict, reason))
    return by_op


def learn_from_node_tests(table: dict[str, Any]) -> None:
    ops = table["ops"].setdefault("ai.onnx", {})
    for alias, target in ALIASES.items():
        if target in ops and alias not in ops:
            ops[alias] = {**ops[target], "learned_from": f"node tests: built like {target} by the EP"}
    for op, verdicts in sorted(_single_node_verdicts().items()):
        if op in ops:
            continue
        htp = [v for v in verdicts if v[1] == "htp"]
        other = [v for v in verdicts if v[1] != "htp"]
        counts = dict(Counter(v[1] for v in verdicts))
        if len(htp) >= len(other):
            ops[op] = {"supported": True, "qnn_ops": [], "learned_from": "node tests (single-node verdicts, majority)",
                       "probes": counts, "source": [f"{t}: {v}" for t, v, _ in verdicts[:4]]}
        else:
            reason = Counter(r for _, _, r in other).most_common(1)[0][0] or "rejected by the QNN EP"
            ops[op] = {"supported": False, "reason": reason, "learned_from": "node tests (single-node verdicts, majority)",
                       "probes": counts, "source": [f"{t}: {v}" for t, v, _ in verdicts[:4]]}
    for op, rules in NODE_TEST_RULES.items():
        if op in ops and ops[op].get("supported", True):
            learned = [{**rule, "learned_from": "node tests"} for rule in rules]
            ops[op] = {**ops[op], "rules": [*ops[op].get("rules", []), *learned]}
    learn_dtypes_from_node_tests(ops)


def learn_dtypes_from_node_tests(ops: dict[str, Any]) -> None:
    """Widen an entry's I/O dtypes by those of single-node tests that ran on the HTP (e.g. Mod on
    int8/uint16, Max on uint32: the EP converts them); the entry records what it learned."""
    import json as _json

    import numpy as np
    import onnx
    from check_agreement import node_cases

    for op in ops:  # aliases share their target's specs: widen copies
        ops[op] = copy.deepcopy(ops[op])
    ran = set()
    if NODE_TESTS.exists():
        for line in NODE_TESTS.read_text().splitlines():
            rec = _json.loads(line)
            if rec["nodes_in_model"] == 1 and [v[0] for v in rec["nodes"].values()] == ["htp"]:
                ran.add(rec["id"])
    for case in node_cases():
        if case.id not in ran:
            continue
        node = case.model.graph.node[0]
        entry = ops.get(node.op_type)
        if entry is None or not entry.get("supported", True) or (node.domain or "ai.onnx") != "ai.onnx":
            continue
        types = {v.name: v.type.tensor_type.elem_type for v in [*case.model.graph.input, *case.model.graph.output]}
        for kind, names in (("inputs", node.input), ("outputs", node.output)):
            specs = entry.get(kind, [])
            for i, name in enumerate(names):
                spec = specs[i] if i < len(specs) else (specs[-1] if kind == "inputs" and entry.get("variadic") and specs else None)
                if not name or spec is None or spec.get("dtypes") is None or not types.get(name):
                    continue
                dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(types[name])).name
                if dtype not in spec["dtypes"]:
                    spec["dtypes"] = [*spec["dtypes"], dtype]
                    learned = entry.setdefault("learned_dtypes", {"learned_from": "node tests (single-node htp verdicts)"})
                    learned.setdefault(f"{kind} {i}", []).append(f"{dtype} ({case.id})")


# --------------------------------------------------------------------------- loading & grouping


def load(suite: str, suffix: str = "") -> list[dict[str, Any]]:
    path = RESULTS / f"htp_{suite}{suffix}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def op_key(rec: dict[str, Any]) -> tuple[str, str]:
    return ("ai.onnx" if rec["domain"] in ("", "ai.onnx") else rec["domain"], rec["op"])


def max_rank(rec: dict[str, Any]) -> int:
    return max([len(s) for s in rec["shapes"] if s is not None] + [len(s) for s in rec.get("out_shapes") or []] + [0])


def knobs_of(rec: dict[str, Any]) -> dict[str, str]:
    """The knob assignment encoded in the probe id (``...-r3-axis=1,keepdims=0``)."""
    tail = rec["id"].split("/", 2)[2]
    parts = tail.split("-", 2)
    if len(parts) < 3:
        return {}
    return dict(kv.split("=", 1) for kv in parts[2].split(",") if "=" in kv)


def explain(records: list[dict[str, Any]], op: str) -> str:
    """Verdict counts of one op by dtype×rank and by knob value (for reading constraints)."""
    recs = [r for r in records if r["op"] == op]
    out = [f"== {op}: {Counter(r['verdict'] for r in recs)}"]
    grid: dict[tuple, Counter] = defaultdict(Counter)
    for r in recs:
        grid[(r["dtypes"][0], max_rank(r))][r["verdict"]] += 1
    for (dt, rank), c in sorted(grid.items(), key=lambda x: (str(x[0][0]), x[0][1])):
        out.append(f"  {dt!s:8s} r{rank}: {dict(c)}")
    by_knob: dict[tuple, Counter] = defaultdict(Counter)
    for r in recs:
        for k, v in knobs_of(r).items():
            by_knob[(k, v)][r["verdict"]] += 1
    for (k, v), c in sorted(by_knob.items()):
        out.append(f"  {k}={v}: {dict(c)}")
    reasons = Counter(r["reason"][:150] for r in recs if r["verdict"] != "htp")
    for reason, n in reasons.most_common(8):
        out.append(f"  x{n} {reason}")
    return "\n".join(out)


# --------------------------------------------------------------------------- derivation


def node_facts(rec: dict[str, Any]) -> dict[str, Any]:
    """What the checker will see of a probe's node: dtypes per position, constness, rank."""
    import onnx_graphsurgeon as gs
    from qnnpasses.op_support.checker import _tensor
    from qnnpasses.op_support.probe_models import ProbeSpec, build_model

    node = gs.import_onnx(build_model(ProbeSpec.from_record(rec))).nodes[0]
    ins = [_tensor(t) for t in node.inputs]
    outs = [_tensor(t) for t in node.outputs]
    live = [t for t in ins + outs if t is not None and not t.constant]
    return {
        "in": [t.dtype if t else None for t in ins],
        "out": [t.dtype if t else None for t in outs],
        "in_rank": ins[0].rank if ins and ins[0] is not None else None,
        "rank": max([t.rank or 0 for t in live] + [0]),
        "dtypes": sorted({t.dtype for t in live if t.dtype}),
        "tensors": [(t.dtype, t.rank or 0) for t in live if t.dtype],
    }


def _qnn_ops(op: str, htp: list[dict[str, Any]]) -> list[str]:
    """QNN ops the node becomes, most frequent first; EP glue ops only if the op *is* one (Cast)."""
    counts: Counter[str] = Counter()
    for r in htp:
        counts.update(set(r["qnn_ops"]))
    ranked = [q for q, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]  # deterministic ties
    core = [q for q in ranked if q not in GLUE_QNN_OPS or q == op]
    return core or ranked


def _io_specs(op: str, htp: list[dict[str, Any]], facts: dict[str, dict], kind: str) -> list[dict[str, Any]]:
    width = max(len(facts[r["id"]][kind]) for r in htp)
    names = INPUT_NAMES.get(op, []) if kind == "in" else []
    specs = []
    for i in range(width):
        seen = sorted({facts[r["id"]][kind][i] for r in htp if i < len(facts[r["id"]][kind])} - {None})
        default = f"input{i}" if kind == "in" else ("output" if width == 1 else f"output{i}")
        specs.append({"name": names[i] if i < len(names) else default, "dtypes": seen or None})
    if kind == "in" and op in VARIADIC:
        union = sorted({d for s in specs for d in (s["dtypes"] or [])})
        specs = [{"name": "inputs", "dtypes": union}]
    return specs


def _rank_limits(htp: list[dict[str, Any]], facts: dict[str, dict]) -> tuple[int, dict[str, int]]:
    """(op rank limit, lower limits per dtype): the highest rank each dtype's tensors ran at."""
    overall = max(facts[r["id"]]["rank"] for r in htp)
    by_dtype: dict[str, int] = {}
    for r in htp:
        for dtype, rank in facts[r["id"]]["tensors"]:
            by_dtype[dtype] = max(by_dtype.get(dtype, 0), rank)
    return overall, {d: m for d, m in sorted(by_dtype.items()) if m < overall}


def _clean(reason: str, op: str) -> str:
    """Backend reasons name the probe's node; the table states them for any node."""
    return reason.replace(f"probe_{op}", "<node>").replace(f".{op} node", f". {op} node")


def _evidence(recs: list[dict[str, Any]], facts: dict[str, dict], limit: int = 8) -> list[str]:
    """Probe ids that justify the entry: highest-rank HTP probe per dtype, first probe per failure reason."""
    out: list[str] = []
    best: dict[str, dict] = {}
    for r in recs:
        if r["verdict"] == "htp":
            d = facts[r["id"]]["dtypes"][0] if facts[r["id"]]["dtypes"] else "?"
            if d not in best or facts[r["id"]]["rank"] > facts[best[d]["id"]]["rank"]:
                best[d] = r
    out += [f"{r['id']}: htp" for r in best.values()]
    seen_reasons: set[str] = set()
    for r in recs:
        if r["verdict"] != "htp" and r["reason"][:60] not in seen_reasons:
            seen_reasons.add(r["reason"][:60])
            out.append(f"{r['id']}: {r['verdict']} ({_clean(r['reason'], r['op'])[:110]})")
    return out[:limit]


def _glue_notes(htp: list[dict[str, Any]], facts: dict[str, dict], core: list[str]) -> list[str]:
    notes = []
    for glue in sorted(GLUE_QNN_OPS - set(core)):
        hits = [r for r in htp if glue in r["qnn_ops"] and not (glue == "Cast" and "int64" in facts[r["id"]]["dtypes"])]
        if hits:
            notes.append(f"the EP adds QNN {glue} in {len(hits)}/{len(htp)} HTP probes (e.g. {hits[0]['id']})")
    return notes


def _opset_range(rec: dict[str, Any], opsets: list[int]) -> list[int]:
    """The opsets whose schema versions of the op the probes exercised: from the first
    opset of the oldest probed version to the last opset before the next schema change."""
    import onnx

    if rec["domain"] not in ("", "ai.onnx") or not onnx.defs.has(rec["op"]):
        return [min(opsets), max(opsets)]
    latest = onnx.defs.onnx_opset_version()
    since = min(onnx.defs.get_schema(rec["op"], v).since_version for v in opsets)
    newest = onnx.defs.get_schema(rec["op"], max(opsets)).since_version
    hi = max(opsets)
    while hi < latest and onnx.defs.get_schema(rec["op"], hi + 1).since_version == newest:
        hi += 1
    return [since, hi]


def _with_source(rule: dict[str, Any], recs: list[dict[str, Any]]) -> dict[str, Any]:
    """Replace a rule's ``evidence`` (knob values) by the probe ids that show it."""
    rule = dict(rule)
    wanted = []
    for part in rule.pop("evidence", "").split(","):
        if "=" in part:
            knob, values = part.split("=", 1)
            wanted += [(knob, v) for v in values.split(",")]
        elif wanted:
            wanted.append((wanted[-1][0], part))
    rule["source"] = [f"{r['id']}: {r['verdict']}" for r in recs
                      if any(knobs_of(r).get(k) == v for k, v in wanted)][:3]
    return rule


def derive_entry(op: str, recs: list[dict[str, Any]], facts: dict[str, dict]) -> dict[str, Any]:
    extra = CONSTRAINTS.get(op, {})
    htp = [r for r in recs if r["verdict"] == "htp"] or (recs if extra.get("in_units") else [])
    opsets = sorted({r["opset"] for r in recs})
    if not htp:
        reason = _clean(Counter(r["reason"] for r in recs).most_common(1)[0][0], op)
        entry = {"supported": False, "reason": reason, "opsets_probed": opsets, "source": _evidence(recs, facts, 3)}
        if extra.get("fusions"):
            entry["fusions"] = extra["fusions"]
        return entry
    core = _qnn_ops(op, htp)
    overall, by_dtype = _rank_limits(htp, facts)
    entry: dict[str, Any] = {
        "supported": True,
        "qnn_ops": core,
        "opset": _opset_range(recs[0], opsets),
        "opsets_probed": opsets,
        "inputs": _io_specs(op, htp, facts, "in"),
        "outputs": _io_specs(op, htp, facts, "out"),
        "max_rank": overall,
    }
    if op in VARIADIC:
        entry["variadic"] = True
    if by_dtype:
        entry["max_rank_by_dtype"] = by_dtype
    rules = [_with_source(rule, recs) for rule in extra.get("rules", [])]
    if extra.get("derive_dtype_pairs"):
        pair_rank: dict[tuple[str, str], int] = {}
        for r in htp:
            pair = (facts[r["id"]]["in"][0], facts[r["id"]]["out"][0])
            pair_rank[pair] = max(pair_rank.get(pair, 0), facts[r["id"]]["in_rank"] or 0)
        rules.append({"check": "dtype_pairs", "input": 0, "output": 0,
                      "pairs": [[a, b, m] for (a, b), m in sorted(pair_rank.items())],
                      "reason": f"{op} between these dtypes is not supported on HTP"})
    if rules:
        entry["rules"] = rules
    if extra.get("conditional_notes"):
        entry["conditional_notes"] = extra["conditional_notes"]
    notes = list(extra.get("notes", [])) + _glue_notes(htp, facts, core)
    if notes:
        entry["notes"] = notes
    entry["probes"] = dict(Counter(r["verdict"] for r in recs))
    entry["source"] = _evidence(recs, facts)
    return entry


# --------------------------------------------------------------------------- table & fit

GLOBAL: dict[str, Any] = {
    "max_rank": 5,
    "rules": [
        {"check": "static_shapes", "reason": "QNN needs static shapes (fix the input shapes first); "
                                             "the EP answers 'Cannot get shape'",
         "source": [("tests/fixtures/llama_gqa_ts.onnx with dynamic batch: 'Cannot get shape' on every node "
                     "with a symbolic dim")]},
        {"check": "nonempty_outputs", "reason": "QNN tensors cannot have a zero-size dim (the op validator fails)",
         "learned_from": "node tests",
         "source": ["node tests test_layer_normalization_*_axis0_expanded: Slice to an empty shape: cpu "
                    "(validateNativeOps ... StridedSlice failed 3110)"]},
        {"check": "not_all_constant",
         "reason": "constant inputs only, straight into graph outputs: the QNN graph would have no inputs "
                   "and fails to set up; fold the node first (onnxsim / onnxruntime constant folding)",
         "source": ["build/Range/float32-r0-const=True,delta=1: error (Having zero graph inputs is not supported)"]},
    ],
    "int64_note": "int64 is not native on HTP: the EP runs it as int32 and inserts Cast ops at partition "
                  "boundaries (values must fit in int32)",
    "notes": [
        "Rank 6 tensors are rejected by every op ('[...] has incorrect Rank 6').",
        ("Several ops pass EP validation and then fail graph finalize ('could not create op: q::...'): "
         "these count as unsupported here, because the whole partition then fails."),
    ],
}


def build_table(records: list[dict[str, Any]], target: Any = None) -> dict[str, Any]:
    """The table for ``target`` (default: the default target, X Elite / v73) from its probe records."""
    import onnxruntime
    import onnxruntime_qnn
    from qnnpasses.backends.targets import DEFAULT

    target = target or DEFAULT
    facts = {r["id"]: node_facts(r) for r in records}
    by_op: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_op[op_key(r)].append(r)
    ops: dict[str, dict[str, Any]] = defaultdict(dict)
    for (domain, op), recs in sorted(by_op.items()):
        ops[domain][op] = derive_entry(op, recs, facts)
    return {
        "backend": "htp",
        "qnn_version": "2.40",
        "htp_arch": f"v{target.htp_arch}",
        "soc_model": target.soc_model,
        "precision": "fp16 mode (enable_htp_fp16_precision=1): float32 tensors are accepted and computed in fp16",
        "measured_with": f"onnxruntime {onnxruntime.__version__} + onnxruntime-qnn {onnxruntime_qnn.__version__}, "
                         "graph optimizations off, one node per model (tools/probe_htp.py, suite 'build')",
        "other_backends": {
            "cpu": "not measured: onnxruntime-qnn 2.7 ships no QNN CPU backend (libQnnCpu.so)",
            "gpu": "not measured: the QNN GPU backend fails to initialize without an Adreno GPU",
        },
        "dtype_names": ["float32", "float16", "int32", "int64", "int16", "int8", "uint16", "uint8", "bool"],
        "global": GLOBAL,
        "ops": dict(ops),
    }


def fit(table: dict[str, Any], records: list[dict[str, Any]]) -> list[str]:
    """Records where the checker with ``table`` disagrees with the backend."""
    import onnx_graphsurgeon as gs
    from qnnpasses.op_support.checker import check_node
    from qnnpasses.op_support.probe_models import ProbeSpec, build_model

    misfits = []
    for r in records:
        graph = gs.import_onnx(build_model(ProbeSpec.from_record(r)))
        res = check_node(graph.nodes[0], table, opset=graph.opset)
        if res.supported != (r["verdict"] == "htp"):
            misfits.append(f"{r['id']}: backend {r['verdict']} ({r['reason'][:100]}) / table "
                           f"{'htp' if res.supported else 'cpu'} ({'; '.join(res.reasons)[:100]})")
    return misfits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--explain", metavar="OP", help="print verdict breakdowns of one op and exit")
    parser.add_argument("--suite", default="build")
    parser.add_argument("--htp-arch", help="the arch whose probe results to read (default v73: htp.json)")
    args = parser.parse_args(argv)
    from qnnpasses.backends.targets import DEFAULT, resolve

    target = resolve(htp_arch=args.htp_arch) if args.htp_arch else DEFAULT
    suffix = "" if target.htp_arch == DEFAULT.htp_arch else f".v{target.htp_arch}"
    table_path = TABLE if not suffix else TABLE.with_name(f"htp_v{target.htp_arch}.json")
    records = load(args.suite, suffix)
    if args.explain:
        print(explain(records, args.explain))
        return 0
    table = build_table(records, target)
    learn_from_node_tests(table)
    table_path.parent.mkdir(parents=True, exist_ok=True)
    table_path.write_text(json.dumps(table, indent=1) + "\n")
    misfits = fit(table, records)
    print(f"wrote {table_path}: {sum(len(v) for v in table['ops'].values())} ops; "
          f"fit on {args.suite}: {1 - len(misfits) / len(records):.1%} ({len(misfits)} misfits)")
    for m in misfits:
        print("  " + m)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
