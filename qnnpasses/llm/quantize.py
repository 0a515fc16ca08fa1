"""``--precision w8a16|w4a16``: quantize the prefill and decode graphs with one shared calibration.

``--calib DATA`` holds token-id sequences (``.npz`` with an integer array ``[n, T]`` -- named like
the export's token input, or the only array -- or such a ``.npy``).  Each sequence is run
through the float static pair on onnxruntime CPU the way a runner drives it (the first half
in prefill chunks, the rest one token at a time through decode, the cache filled by the
graphs themselves), and the inputs of every call become that graph's calibration samples: the
past K/V the graphs see are real cache contents.  :func:`qnnpasses.quant.shared.quantize_graphs`
then gives every tensor the two graphs share -- the weights, and each layer's new K/V
output tied to the past input it becomes -- one encoding.  Internal activations keep
per-graph ranges (:func:`own_activation_names`), and the outlier rewrites run on both float
graphs at once before (:mod:`qnnpasses.llm.outliers`).
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from qnnpasses.errors import BadInputError
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import IRModel, remove_model, save_model
from qnnpasses.ir.op_kinds import LAYOUT
from qnnpasses.llm.verify import PartsRunner, static_feed
from qnnpasses.memory import release
from qnnpasses.passmanager.rewrite import constant_value

#: calibration samples kept per graph
MAX_SAMPLES = 64
#: what a quantized pair's report records as ``quantization.recipe``; bumped when the way a pair is
#: quantized changes (2: outlier rewrites on both graphs at once, :mod:`qnnpasses.llm.outliers`; 3: 2-D Q/K/V;
#: 4: decode's own activation ranges; 5: 16-bit lm_head; 6: its check allows GPTQ's moves; 7: 16-bit norm
#: scales; a stream the rotation cannot pass into the weights is turned back after each norm instead; 8: the
#: attention's MatMuls of two activations read their second operand in two 8-bit parts, qnnpasses.quant.split_operand;
#: 9: what the HTP compiles gives back the half step its RmsNorm rounds away, qnnpasses.quant.norm_rounding)
RECIPE = 9


def load_token_sequences(path: str | Path, input_ids: str) -> np.ndarray:
    """The ``[n, T]`` integer token sequences in ``path``."""
    path = Path(path)
    if not path.is_file():
        raise BadInputError(f"calibration data not found: {path}")
    try:
        if path.suffix == ".npz":
            with np.load(path) as data:
                names = data.files
                key = input_ids if input_ids in names else (names[0] if len(names) == 1 else None)
                if key is None:
                    raise BadInputError(f"{path.name}: no array '{input_ids}' (and more than one array: {names})")
                array = data[key]
        elif path.suffix == ".npy":
            array = np.load(path)
        else:
            raise BadInputError(f"{path.name}: --calib must be .npz or .npy token ids [sequences, tokens]")
    except (OSError, ValueError) as exc:
        raise BadInputError(f"{path.name}: cannot read it: {exc}") from None
    array = np.asarray(array)
    if array.ndim == 1:
        array = array[None]
    if array.ndim != 2 or array.dtype.kind not in "iu" or array.shape[1] < 2:
        raise BadInputError(f"{path.name}: token ids must be an integer array [sequences, tokens >= 2] "
                            f"(got {array.dtype} {list(array.shape)})")
    return array


def _schedule(manifest: dict[str, Any], sequences: np.ndarray) -> list[list[tuple[str, list[int]]]]:
    """Per sequence, the calls a runner makes on it: the first half in prefill chunks, the rest
    one token at a time through decode (while the cache holds them)."""
    graphs, context, size = manifest["graphs"], manifest["context"], manifest["prefill"]
    plans = []
    for row in sequences:
        tokens = [int(t) % manifest["vocab"] for t in row[: context - 1]]
        prompt = tokens[: max(1, len(tokens) // 2)]
        steps = [("prefill", prompt[i:i + size]) for i in range(0, len(prompt), size)]
        steps += [("decode", [t]) for t in tokens[len(prompt):]]
        valid, plan = 0, []
        for name, chunk in steps:
            if valid > graphs[name]["past"]:
                break
            plan.append((name, chunk))
            valid += len(chunk)
        plans.append(plan)
    return plans


def calibration_samples(folder: Path, manifest: dict[str, Any], sequences: np.ndarray, out: Path,
                        limit: int = MAX_SAMPLES) -> dict[str, int]:
    """Per graph, the inputs of at most ``limit`` calls (evenly spread over all of them) while the
    float pair processes ``sequences``, written as ``out/<graph>/<input>.npy`` stacks.

    Streamed: the calls to keep are chosen before anything runs and each kept feed goes straight
    into a memory-mapped file, so memory holds one cache, not every call's copy of it (every decode call's feed
    carries the whole past K/V).  Of a past K/V input only the ``valid`` filled slots are written: the
    empty ones stay holes of the sparse file, read back as the zeros they are (at context 4096 a
    0.5 B model's 128 kept calls would otherwise take 12 GiB of disk)."""
    graphs = manifest["graphs"]
    plans = _schedule(manifest, sequences)
    calls = {name: [(s, i) for s, plan in enumerate(plans) for i, (n, _) in enumerate(plan) if n == name]
             for name in graphs}
    keep: dict[str, set[tuple[int, int]]] = {}
    for name, found in calls.items():
        if not found:
            raise BadInputError(f"--calib: the sequences give no {name} call (need more than "
                                f"{2 * manifest['prefill'] if name == 'decode' else 1} tokens)")
        picks = np.linspace(0, len(found) - 1, min(limit, len(found))).round().astype(int)
        keep[name] = {found[i] for i in picks}
    runners = {name: PartsRunner(folder, graphs[name]) for name in graphs}
    roles = graphs["decode"]["roles"]
    pasts = {n for graph in graphs.values() for n in graph["roles"]["past_key"] + graph["roles"]["past_value"]}
    stacks: dict[str, dict[str, np.ndarray]] = {name: {} for name in graphs}
    written = {name: 0 for name in graphs}
    for s, plan in enumerate(plans):
        last = max((i for i, (n, _) in enumerate(plan) if (s, i) in keep[n]), default=-1)
        cache = {n: np.zeros((1, manifest["kv_heads"], manifest["context"], manifest["head_dim"]), np.float32)
                 for n in roles["past_key"] + roles["past_value"]}
        valid = 0
        for i, (name, chunk) in enumerate(plan[:last + 1]):
            graph = graphs[name]
            feed = static_feed(graph, chunk, valid, cache)
            if (s, i) in keep[name]:
                if not stacks[name]:
                    (out / name).mkdir(parents=True, exist_ok=True)
                    stacks[name] = {k: np.lib.format.open_memmap(out / name / f"{k}.npy", mode="w+", dtype=v.dtype,
                                                                 shape=(len(keep[name]), *v.shape))
                                    for k, v in feed.items()}
                for k, v in feed.items():
                    if k in pasts:
                        stacks[name][k][written[name], ..., :valid, :] = v[..., :valid, :]
                    else:
                        stacks[name][k][written[name]] = v
                written[name] += 1
            if i == last:
                break
            result = runners[name](feed)
            for kind in ("key", "value"):
                for past, new in zip(graph["roles"][f"past_{kind}"], graph["roles"][f"new_{kind}"]):
                    cache[past][:, :, valid:valid + len(chunk)] = result[new][:, :, :len(chunk)]
            valid += len(chunk)
    for arrays in stacks.values():
        for array in arrays.values():
            array.flush()
    return written


def quantize_pair(folder: Path, manifest: dict[str, Any], options) -> dict[str, Any]:
    """Quantize ``folder/{prefill,decode}.onnx`` in place (the float graphs stay as ``*.float.onnx``).

    The precision's outlier rewrites run first on both float graphs at once
    (:func:`qnnpasses.llm.outliers.rewrite_pair`: the same rewrite in both or in neither,
    verified as exact in float64 and in fp32 on real calls), then
    :func:`~qnnpasses.quant.shared.quantize_graphs` quantizes the rewritten pair without
    running them again."""
    try:
        from qnnpasses.quant.shared import PRECISIONS, quantize_graphs
    except ImportError:
        raise BadInputError(f"{options.precision}: not available yet") from None
    if options.precision not in PRECISIONS:
        raise BadInputError(f"{options.precision}: not available yet")
    from qnnpasses.llm.outliers import REAL_SAMPLES, UNTURNED, post_norms_refused, rewrite_pair, undo_lone_fold
    from qnnpasses.quant.calibration import CalibrationData, model_inputs

    source_ids = manifest["source_roles"]["input_ids"]
    sequences = load_token_sequences(options.calib, source_ids)
    ties = {}
    for graph in manifest["graphs"].values():
        roles = graph["roles"]
        ties.update(zip(roles["new_key"] + roles["new_value"], roles["past_key"] + roles["past_value"]))
    policy = PRECISIONS[options.precision]
    int4 = policy.weight_bits == 4
    if int4:  # before the slow part: the grid the HTP prepares at these shapes
        from qnnpasses.backends.htp import htp_available
        from qnnpasses.llm.int4_blocks import choose_block_rows

        rows, blocks = choose_block_rows(folder, manifest, policy, options.int4_blocks,
                                         backend=options.probe and htp_available())
    models, calib, outputs, floats = {}, {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="qnnpasses-llm-calib-") as tmp:
        samples = calibration_samples(folder, manifest, sequences, Path(tmp))
        real = {}
        for name, graph in manifest["graphs"].items():
            part = graph["parts"][0]
            source = folder / part["onnx"]
            floats[name] = _keep_float(source)
            ir = load_model(floats[name])
            calib[name] = Path(tmp) / name
            real[name] = CalibrationData(calib[name], model_inputs(ir)).head(REAL_SAMPLES)
            outputs[name] = source
            del ir
            release()
        rewritten, records = floats, []
        if policy.outliers:
            rewritten, records = rewrite_pair(floats, policy.outliers, real, Path(tmp) / "outliers")
            if undo_lone_fold(records):
                rewritten = floats
            if post_norms_refused(records):  # turned back after each norm instead, the weights left alone
                rewritten, more = rewrite_pair(floats, UNTURNED, real, Path(tmp) / "unturned")
                records += more
        models = {name: load_model(path) for name, path in rewritten.items()}
        for ir in models.values():  # the tensors a new K/V output is moved from carry its encoding too
            for new, past in list(ties.items()):
                ties.update({moved: past for moved in moved_into(ir, new)})
        private = {name: own_activation_names(ir, name) for name, ir in models.items() if name != "prefill"}
        policy = pair_policy(options.precision, models["prefill"], manifest["graphs"]["prefill"]["roles"]["logits"])
        if int4:
            policy = replace(policy, block_size=rows or None)
        raised = {n.name: constant_value(n.inputs[1]) for n in models["prefill"].graph.nodes if n.name in policy.raised}
        result = quantize_graphs(models, calib, outputs, policy=policy, ties=ties)
        wrong = [name for name, weight in raised.items() if not all(
            _dequantized_weight_matches(outputs[g], name, weight) for g in outputs)]
        lm_head = {"raised_to_16_bit": sorted(raised), "ok": not wrong}
        if wrong:  # a guard: refine_weights once wrote int16 weights through int8 (int8-sized values; fixed)
            lm_head["fallback"] = f"the 16-bit weights of {wrong} do not dequantize to the float ones: requantized at 8 bit"
            models = {name: load_model(path) for name, path in rewritten.items()}
            for name, ir in models.items():
                if name != "prefill":
                    own_activation_names(ir, name)
            base = PRECISIONS[options.precision]
            result = quantize_graphs(models, calib, outputs, policy=replace(policy, raised=base.raised), ties=ties)
    for name, graph in manifest["graphs"].items():
        quantized = load_model(outputs[name])
        names = {t.name for t in list(quantized.graph.inputs) + list(quantized.graph.outputs)}
        if names != set(graph["io"]):
            raise BadInputError(f"quantizing the {name} graph changed its interface: {sorted(names ^ set(graph['io']))}")
        graph["float_onnx"] = floats[name].name
    return {"precision": options.precision, "recipe": RECIPE, "samples": samples,
            **({"int4_block_rows": policy.block_size or "per channel", "int4_blocks": blocks} if int4 else {}),
            "shared_tensors": len(result.shared_tensors), "ties": len(ties), "outlier_rewrites": records,
            "own_activation_ranges": private, "lm_head": lm_head,
            "graphs": {k: r.as_dict() for k, r in result.results.items()}}


def pair_policy(precision: str, prefill: IRModel, logits: str):
    """The precision's policy for the pair: its outlier rewrites already ran (:func:`rewrite_pair`), and
    with 8-bit weights the lm_head (the MatMul computing ``logits``) keeps 16-bit weights (``raised``).

    Why the lm_head: its output is what top-1 reads.  On a trained pair, the lm_head alone back
    in float recovered as much top-1 agreement as every o_proj or every down_proj together, and a
    16-bit lm_head most of that, for one MatMul (the ``h16`` plans of docs/quant_llm.md)."""
    from qnnpasses.quant.shared import PRECISIONS, precision_policy

    base = PRECISIONS[precision]
    changes: dict[str, Any] = {"outliers": ""}
    if base.weight_bits == 8:
        lm_head = _logits_matmul(prefill, logits)
        if lm_head is not None:
            changes["raised"] = tuple(dict.fromkeys([*base.raised, lm_head]))
    return precision_policy(precision, **changes)


def _dequantized_weight_matches(path: Path, node_name: str, weight: np.ndarray) -> bool:
    """True when the QDQ graph's weight of MatMul ``node_name`` dequantizes closer to the float ``weight``
    than per-channel int8 rounding of it would (what a 16-bit weight must beat, GPTQ's moves included)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    inits = {i.name: i for i in model.graph.initializer}
    node = next((n for n in model.graph.node if n.name == node_name), None)
    dq = next((n for n in model.graph.node if node is not None and n.output[0] == node.input[1]), None)
    if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
        return False
    q = numpy_helper.to_array(inits[dq.input[0]]).astype(np.float64)
    scale = numpy_helper.to_array(inits[dq.input[1]]).astype(np.float64)
    zero = numpy_helper.to_array(inits[dq.input[2]]).astype(np.float64) if len(dq.input) > 2 else 0.0
    w = weight.astype(np.float64)
    if q.shape != w.shape or q.ndim != 2:
        return False
    value = (q - zero) * scale if scale.ndim == 0 else (q - np.asarray(zero).reshape(1, -1)) * scale.reshape(1, -1)
    step8 = np.maximum(np.abs(w).max(axis=0, keepdims=True), 1e-30) / 127
    int8_error = np.linalg.norm(np.round(w / step8) * step8 - w)
    return bool(np.linalg.norm(value - w) < int8_error)


def _logits_matmul(ir: IRModel, logits: str) -> str | None:
    """The name of the weighted MatMul that computes the ``logits`` output (through shape-only ops)."""
    from qnnpasses.passmanager.rewrite import constant_value, producer

    tensor = next((t for t in ir.graph.outputs if t.name == logits), None)
    while tensor is not None and (node := producer(tensor)) is not None:
        if node.op == "MatMul":
            return node.name if constant_value(node.inputs[1]) is not None else None
        if node.op not in LAYOUT:
            return None
        tensor = node.inputs[0]
    return None


_MOVES = LAYOUT


def moved_into(ir: IRModel, output: str) -> list[str]:
    """The tensors graph output ``output`` is computed from by data-movement ops alone (nearest
    first): the quantizer gives such an op's output its input's encoding, so they are one tensor."""
    found, tensor = [], next((t for t in ir.graph.outputs if t.name == output), None)
    while tensor is not None and tensor.inputs and tensor.inputs[0].op in _MOVES:
        tensor = tensor.inputs[0].inputs[0]
        found.append(tensor.name)
    return found


def own_activation_names(ir: IRModel, graph_name: str) -> int:
    """Rename the graph's internal activations (``X`` -> ``X__<graph_name>``); its inputs, outputs,
    the tensors joined to them by data-movement ops only, and constants keep their names.
    Returns how many were renamed.

    :func:`~qnnpasses.quant.shared.quantize_graphs` gives a tensor name found in several graphs
    the union of its ranges.  The pair's graphs must agree on the weights (shared) and on the KV
    cache that passes between them (tied), but not on their internal activations, and there one
    range does not fit both: the prefill graph sees the first token of a sequence, where a
    trained LLM puts its massive activation (its residual stream reaches two orders of magnitude
    more in prefill calls than in decode calls), and a decode graph quantized with prefill's
    stream ranges gets steps far coarser than its own values need."""
    import onnx_graphsurgeon as gs

    boundary = {t.name for t in list(ir.graph.inputs) + list(ir.graph.outputs)}
    # the quantizer gives a data-movement op's output its input's encoding: what reaches a graph
    # output, or comes from a graph input, through such ops is the boundary's (tied) tensor too
    for out in ir.graph.outputs:
        boundary.update(moved_into(ir, out.name))
    todo = list(ir.graph.inputs)
    while todo:
        for node in todo.pop().outputs:
            if node.op in _MOVES:
                boundary.update(o.name for o in node.outputs)
                todo += node.outputs
    count = 0
    for tensor in ir.graph.tensors().values():
        if isinstance(tensor, gs.Variable) and tensor.name not in boundary and tensor.name:
            tensor.name = f"{tensor.name}__{graph_name}"
            count += 1
    return count


def _keep_float(path: Path) -> Path:
    """Move the float graph ``X.onnx`` to ``X.float.onnx`` with its own weights file (``X.float.onnx.data``
    when external): the quantized graph written as ``X.onnx`` must not overwrite the float one's data."""
    target = path.with_name(path.name.replace(".onnx", ".float.onnx"))
    ir = load_model(path)
    save_model(ir, target)
    del ir
    release()
    remove_model(path)
    return target
