"""The outlier rewrites of a quantized pair: one rewrite for both graphs, verified as exact in float64.

``--precision w8a16|w4a16`` runs ``fold-norm-weights,rotate-residual`` (``passes/outliers``)
before calibrating, as ``qnnpasses quantize`` does for one graph (where post-norms keep the
rotation out of the weights, the pair drops the fold and runs :data:`UNTURNED` instead:
:func:`undo_lone_fold`, :func:`post_norms_refused`).  For a prefill + decode pair
:func:`rewrite_pair` applies them here, not per graph inside the quantizer, because of two
things the pass manager's per-graph check cannot know:

* **Both graphs or neither.**  The graphs hold copies of the same weights and pass the KV
  cache to each other; a rewrite kept in one graph and rolled back in the other would give
  them different weights (no shared context, no shared encodings).  Each pass runs on both
  graphs, the constants the two graphs share by name must come out identical, and a pass
  that fails its check on either graph is rolled back on both.
* **Whose rounding the check measures.**  The manager verifies every rewrite in fp32 on
  synthetic inputs: seeded ``N(0, 1)`` past K/V under an all-ones mask, the same scaled
  by 1,000, masked variants.  A trained pair is ill-conditioned on such caches: the
  *original* graph's own fp32 result can differ from its float64 result by more than the
  EXACT bound (``1e-4 + 1e-4·max|ref|``), by orders of magnitude on the scaled cache, and
  moving every weight by one ulp moves the logits past the bound.  Any rewrite that changes where fp32 rounds fails there, so ``fold-norm-weights``
  (EXACT) was rolled back on the pair while it applies on the single-graph model, whose
  only inputs are token ids.

So each pass is verified with its own contract's tolerance (EXACT: the manager's tight
``atol/rtol/min_cosine``) in two ways, on every graph:

1. **float64** -- the graph before and after the pass, converted to double precision
   (:func:`float64_model`; the rewritten constants keep the fp32 values the pass wrote), on
   the manager's synthetic cases and on real calls of the pair.  What is left of the fp32
   arithmetic is the fp32 *storage* of the rewritten weights (up to half an ulp each), and
   on the scaled ("extreme") caches even that is amplified: moving every weight of a trained
   prefill graph by one ulp moves new K/V values by whole units there, in float64 -- the
   output is not determined to any useful bound by fp32 weights.  So an
   output whose one-ulp floor (:func:`ulp_floor`, the larger of two random-sign
   perturbations) exceeds the contract's bound on a case is reported there, not held to it
   (``ill_conditioned``); every other output of every case is held to the contract's bound.
   An exact rewrite uses a small part of it on every case held to it; a wrong one (a misplaced scale, a non-orthogonal matrix,
   a 0.1% change of one weight matrix) does not pass;
2. **fp32 on real calls** -- the graph as deployed (fp32) on the first :data:`REAL_SAMPLES`
   calibration calls of the float pair (real caches the graphs themselves wrote), with the
   contract's tolerance as it is.

The fp32 comparison on the synthetic cases and the original's own fp32-vs-float64 deviation
there are recorded next to the verdict (``synthetic_fp32``, ``fp32_floor``), not enforced.
"""

from __future__ import annotations

import hashlib
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from qnnpasses.backends.cpu import (
    ATOL,
    MIN_COSINE,
    RTOL,
    VerificationCase,
    cosine_similarity,
    cpu_session,
    verification_cases,
)
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import IRModel, derived_from, remove_model, save_model
from qnnpasses.ir.read import constant_value
from qnnpasses.memory import release, spill

#: real calls of each graph the fp32 check runs on (the first calibration samples)
REAL_SAMPLES = 4
CASE_REAL = "given"
#: the rotation a stream gets when it cannot go into the readers' weights (post-norms write the stream,
#: so the fold alone ran): turned back after each norm by a MatMul, every weight left as it was
UNTURNED = "rotate-residual{unturn=true,post_norms=true}"


def float64_model(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with every float32 initializer, constant, value type and Cast target in float64 (in place)."""
    graph = proto.graph
    for init in graph.initializer:
        if init.data_type == TensorProto.FLOAT:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float64), init.name))
    for info in list(graph.input) + list(graph.output) + list(graph.value_info):
        if info.type.tensor_type.elem_type == TensorProto.FLOAT:
            info.type.tensor_type.elem_type = TensorProto.DOUBLE
    for node in graph.node:
        for attr in node.attribute:
            if node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT:
                attr.i = TensorProto.DOUBLE
            elif attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == TensorProto.FLOAT:
                attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float64), attr.t.name))
            elif attr.type == onnx.AttributeProto.GRAPH:
                raise ValueError(f"{node.op_type} '{node.name}' holds a subgraph: not converted to float64")
    return proto


def write_float64(path: Path, out: Path, ulp_seed: int | None = None) -> Path:
    """The model at ``path`` in double precision (:func:`float64_model`), written to ``out`` one weight
    at a time: a weight mapped from external data is widened as it is saved, so the model's weights
    are never all in memory at once.  ``ulp_seed``: each float32 weight of more than one element is
    first moved by one ulp, every element in a random direction (:func:`ulp_floor`)."""
    import onnx_graphsurgeon as gs

    ir = load_model(path)
    constants = [t for t in ir.graph.tensors().values() if isinstance(t, gs.Constant)]
    for index, tensor in enumerate(constants):
        values = tensor.values
        if values.dtype == np.float32:
            seed = (ulp_seed, index) if ulp_seed is not None and values.size > 1 else None
            tensor.values = derived_from(values, partial(_widen, seed=seed), dtype=np.float64)
    save_model(ir, out, external_data=True)
    del ir, constants
    release()
    proto = float64_model(onnx.load(str(out), load_external_data=False))  # types, Casts, attributes
    out.write_bytes(proto.SerializeToString())
    return out


def _widen(values: np.ndarray, seed: tuple[int, int] | None, chunk: int = 1 << 24) -> np.ndarray:
    """``values`` in float64, each first moved one float32 ulp up or down at random when ``seed`` is
    given (``chunk`` elements at a time: the random directions of a whole lm_head are gigabytes)."""
    if seed is None:
        return values.astype(np.float64)
    rng = np.random.default_rng(seed)
    flat, out = values.reshape(-1), np.empty(values.size, np.float64)
    for start in range(0, values.size, chunk):
        part = flat[start:start + chunk]
        up = rng.integers(0, 2, part.size, dtype=np.uint8).view(bool)
        high, low = np.nextafter(part, np.float32(np.inf)), np.nextafter(part, np.float32(-np.inf))
        out[start:start + chunk] = np.where(up, high, low)
    return out.reshape(values.shape)


def run_cases(path: Path, cases: list[VerificationCase], *, float64: bool = False,
              work: Path | None = None, store: Path | None = None) -> list[dict[str, np.ndarray]]:
    """The outputs of the model at ``path`` on every case (``float64``: of its double-precision copy,
    written into ``work``; float inputs are widened, outputs kept in float64).

    ``store``: a folder the outputs are saved into and mapped back from, so that a prefill
    graph's logits on every case stay on disk, not in memory (:func:`discard` removes it)."""
    if not float64:
        return _run(path, cases, widen=False, store=store)
    wide = write_float64(path, Path(work or path.parent) / f"{path.stem}.f64.onnx")
    try:
        return _run(wide, cases, widen=True, store=store)
    finally:
        remove_model(wide)


def _run(path: Path, cases: list[VerificationCase], *, widen: bool, store: Path | None) -> list[dict[str, np.ndarray]]:
    # mapped: the weights stay in their data file (a double copy of a 0.5 B model is 4 GB)
    session = cpu_session(path, mapped=True, optimize=False, quiet=True)
    names = [o.name for o in session.get_outputs()]
    wanted = {i.name for i in session.get_inputs()}
    outputs = []
    for i, case in enumerate(cases):
        feed = {k: (v.astype(np.float64) if widen and v.dtype == np.float32 else v)
                for k, v in case.inputs.items() if k in wanted}
        values = dict(zip(names, session.run(names, feed)))
        outputs.append(values if store is None else spill(values, store, str(i)))
    return outputs


def discard(*stores: Path | None) -> None:
    """Remove folders of outputs that :func:`run_cases` stored."""
    for store in stores:
        if store is not None:
            shutil.rmtree(store, ignore_errors=True)


def _drop_graphs(paths, work: Path) -> None:
    """Remove graphs (and their data files) that an earlier step wrote into ``work``; never the inputs."""
    for path in paths:
        if path.parent == work:
            remove_model(path)


def constant_digests(ir: IRModel) -> dict[str, str]:
    """Name -> digest of the values of every constant tensor (what two graphs' shared weights hold).

    A rewritten weight is a recipe (:func:`qnnpasses.ir.model.derived_from`): it is computed for its
    digest and let go, never kept in the graph (``tensor.values`` would keep every one of them, the
    size of the model, until the graph is saved)."""
    import onnx_graphsurgeon as gs

    out = {}
    for name, tensor in ir.graph.tensors().items():
        if isinstance(tensor, gs.Constant):
            value = np.ascontiguousarray(constant_value(tensor)).reshape(-1)
            digest = hashlib.sha1(str(value.dtype).encode())
            digest.update(memoryview(value.view(np.uint8)))  # hashed where it lies: no copy of a large weight
            out[name] = digest.hexdigest()
    return out


def _deviation(ref: dict[str, np.ndarray], new: dict[str, np.ndarray]) -> dict[str, tuple[float, float]]:
    """Per float output: (max abs difference, cosine) of ``new`` against ``ref``, NaN where ``ref`` is NaN ignored."""
    out = {}
    for k, a in ref.items():
        a = np.asarray(a, np.float64)
        if a.dtype.kind != "f" or a.size == 0:
            continue
        b = np.asarray(new[k], np.float64)
        keep = ~np.isnan(a)
        diff = np.abs(a[keep] - b[keep])
        out[k] = (float(diff.max()) if diff.size else 0.0, cosine_similarity(a[keep], b[keep]))
    return out


def _worst(reference: list[dict[str, np.ndarray]], got: list[dict[str, np.ndarray]], cases: list[VerificationCase],
           tolerance: tuple[float, float, float], which: set[str] | None = None,
           floor: list[dict[str, tuple[float, float]]] | None = None) -> dict[str, Any]:
    """Per case: max abs, the fraction of the bound it uses, cosine, ok; and the overall verdict.

    The bound of an output is ``atol + rtol·max|ref|`` and ``min_cosine``.  With ``floor`` (per
    case and output: how far a ±1-ulp change of every weight moves it), an output whose floor
    exceeds that bound is not held to it on that case (``ill_conditioned``: fp32 weights do not
    determine it to the bound, so no weight-rewriting pass can be judged there); its figures stay
    in the row."""
    atol, rtol, min_cosine = tolerance
    rows, ok, failure = {}, True, ""
    for i, (case, ref, new) in enumerate(zip(cases, reference, got)):
        if which is not None and case.name not in which:
            continue
        label = case.name if case.name != CASE_REAL else f"{case.name} ({case.detail})"
        worst, bad, loose = {"max_abs": 0.0, "of_bound": 0.0, "cosine": 1.0}, [], []
        for k, (max_abs, cosine) in _deviation(ref, new).items():
            bound = atol + rtol * float(np.nanmax(np.abs(ref[k])))
            worst = {"max_abs": max(worst["max_abs"], max_abs), "of_bound": max(worst["of_bound"], max_abs / bound),
                     "cosine": min(worst["cosine"], cosine)}
            if floor is not None and k in floor[i] and floor[i][k][0] > bound:
                loose.append(k)
                continue
            if np.isnan(max_abs) or max_abs > bound or cosine < min_cosine:
                bad.append(f"{k}: max abs {max_abs:.3g} (bound {bound:.3g}), cosine {cosine:.8f}")
        rows[label] = {**{k: round(v, 6) if k == "of_bound" else v for k, v in worst.items()}, "ok": not bad}
        if loose:
            rows[label]["ill_conditioned"] = len(loose)
            rows[label]["floor_of_bound"] = round(max(floor[i][k][0] / (atol + rtol * float(np.nanmax(np.abs(ref[k]))))
                                                      for k in loose), 3)
        if bad and ok:
            ok, failure = False, f"[{label}] " + "; ".join(bad[:4])
    return {"ok": ok, "cases": rows, **({"failure": failure} if failure else {}),
            "tolerance": {"atol": atol, "rtol": rtol, "min_cosine": min_cosine}}


def ulp_floor(path: Path, cases: list[VerificationCase], reference: list[dict[str, np.ndarray]], work: Path,
              seeds: tuple[int, ...] = (1, 2)) -> list[dict[str, tuple[float, float]]]:
    """Per case and output, how far the float64 outputs move when every float32 weight of the graph
    at ``path`` moves by one ulp (random sign; the largest deviation and lowest cosine over ``seeds``).

    A rewrite that recomputes weights in float64 and stores them in fp32 changes each by at most
    half an ulp: on inputs where this floor exceeds the contract's bound, the graph's outputs are
    not determined to that bound by fp32 weights at all, and the floor is the bound."""
    floor: list[dict[str, tuple[float, float]]] = [{} for _ in cases]
    for seed in seeds:
        moved = write_float64(path, work / f"{path.stem}.ulp{seed}.f64.onnx", ulp_seed=seed)
        store, outputs = work / f"{path.stem}.ulp{seed}.outputs", []
        try:
            outputs = _run(moved, cases, widen=True, store=store)
            for i, (ref, out) in enumerate(zip(reference, outputs)):
                for k, (max_abs, cosine) in _deviation(ref, out).items():
                    old = floor[i].get(k, (0.0, 1.0))
                    floor[i][k] = (max(old[0], max_abs), min(old[1], cosine))
        finally:
            del outputs
            remove_model(moved)
            discard(store)
    return floor


def rewrite_pair(paths: dict[str, Path], spec: str, real: dict[str, list[dict[str, np.ndarray]]],
                 work: Path) -> tuple[dict[str, Path], list[dict[str, Any]]]:
    """Run the passes of ``spec`` (a textual pipeline) on the float graphs ``paths`` (name -> .onnx),
    each pass on every graph alike and kept only when every graph passes the checks of the module
    docs.  ``real``: per graph, real inputs of its calls.  Returns the resulting graph files
    (written into ``work``; the originals where nothing changed) and one record per pass."""
    import qnnpasses.passes  # noqa: F401 - registers the passes
    from qnnpasses.passmanager.manager import PassManager, RunConfig
    from qnnpasses.passmanager.spec import format_items, parse_pipeline

    work.mkdir(parents=True, exist_ok=True)
    current = dict(paths)
    cases: dict[str, list[VerificationCase]] = {}
    out32: dict[str, list[dict[str, np.ndarray]]] = {}
    out64: dict[str, list[dict[str, np.ndarray]]] = {}
    digests: dict[str, dict[str, str]] = {}
    floors: dict[str, list[dict[str, tuple[float, float]]]] = {}
    for name, path in current.items():
        ir = load_model(path)
        digests[name] = constant_digests(ir)
        cases[name] = verification_cases(ir, 0) + [
            VerificationCase(CASE_REAL, dict(sample), f"real call {i}") for i, sample in enumerate(real[name][:REAL_SAMPLES])]
        del ir
        release()
        out32[name] = run_cases(path, cases[name], store=work / f"{name}.0.fp32")
        out64[name] = run_cases(path, cases[name], float64=True, work=work, store=work / f"{name}.0.fp64")
        floors[name] = ulp_floor(path, cases[name], out64[name], work)
    records, kept = [], 0  # the outputs of step `kept` are the reference
    for step, item in enumerate(parse_pipeline(spec).passes()):  # options with commas stay whole
        pass_name, contract = format_items([item]), item.contract
        tolerance = contract.tolerance(ATOL, RTOL, MIN_COSINE)
        record: dict[str, Any] = {"pass": pass_name, "status": "unchanged", "stats": {}, "reason": "",
                                  "contract": contract.describe(), "graphs": {}}
        after, new_digests, statuses = {}, {}, {}
        for name, path in current.items():
            ir = load_model(path)
            result = PassManager(parse_pipeline(pass_name), RunConfig()).run(ir)
            rec = result.records[0]
            statuses[name] = rec.status
            record["stats"][name] = rec.stats
            if rec.status == "changed":
                new_digests[name] = constant_digests(ir)
                after[name] = save_model(ir, work / f"{name}.{step + 1}.onnx", external_data=True)
            elif rec.reason or rec.notes:
                record["reason"] = rec.reason or "; ".join(rec.notes)
            del ir, result
            release()
        records.append(record)
        if not after:
            continue
        if set(after) != set(current):
            record.update(status="rolled-back", reason=f"changed {sorted(after)} but not "
                          f"{sorted(set(current) - set(after))} ({statuses}): the graphs would hold different weights")
            _drop_graphs(after.values(), work)
            continue
        shared = _shared(digests, new_digests)
        differ = sorted(n for n in shared if len({d[n] for d in new_digests.values()}) > 1)
        if differ:
            record.update(status="rolled-back", reason=f"{len(differ)} constants the graphs share by name came out "
                          f"different (first: {differ[0]})")
            _drop_graphs(after.values(), work)
            continue
        record["shared_constants_identical"] = len(shared)
        new32, new64, ok = {}, {}, True
        for name, path in after.items():
            new32[name] = run_cases(path, cases[name], store=work / f"{name}.{step + 1}.fp32")
            new64[name] = run_cases(path, cases[name], float64=True, work=work,
                                    store=work / f"{name}.{step + 1}.fp64")
            synthetic = {c.name for c in cases[name] if c.name != CASE_REAL}
            checks = {"float64": _worst(out64[name], new64[name], cases[name], tolerance, floor=floors[name]),
                      "real_fp32": _worst(out32[name], new32[name], cases[name], tolerance, {CASE_REAL})}
            record["graphs"][name] = {**checks,
                                      "synthetic_fp32": _worst(out32[name], new32[name], cases[name], tolerance, synthetic),
                                      "fp32_floor": _worst(out64[name], out32[name], cases[name], tolerance, synthetic)}
            for kind, check in checks.items():
                if not check["ok"] and ok:
                    ok = False
                    record["reason"] = f"{name} graph, {kind}: {check['failure']}"
        if not ok:
            record["status"] = "rolled-back"
            discard(*(work / f"{name}.{step + 1}.{kind}" for name in after for kind in ("fp32", "fp64")))
            _drop_graphs(after.values(), work)
            continue
        record["status"] = "changed"
        discard(*(work / f"{name}.{kept}.{kind}" for name in current for kind in ("fp32", "fp64")))
        _drop_graphs(current.values(), work)  # a full copy of the weights per graph and pass
        current, out32, out64, digests, kept = after, new32, new64, new_digests, step + 1
    return current, records


def post_norms_refused(records: list[dict[str, Any]]) -> bool:
    """True when ``rotate-residual`` found the stream but left it because post-norms write it (its
    stats count them): then :data:`UNTURNED` can turn it."""
    return any(r["pass"] == "rotate-residual" and r["status"] == "unchanged"
               and any(stats.get("post_norms") for stats in r["stats"].values()) for r in records)


def undo_lone_fold(records: list[dict[str, Any]]) -> bool:
    """True (and the fold's record marked "undone") when ``fold-norm-weights`` is the only rewrite of
    ``records`` that changed the graphs: then they are to be quantized as they were.

    The fold exists so that a rotation can pass the norms; alone it moves each norm's per-channel
    scale into the projections that read it, where a few large scales set every output channel's
    int8 step (trained Gemma 3, whose post-norms stop the rotation, lost much of its w8a16 top-1
    agreement to it)."""
    changed = [r for r in records if r["status"] == "changed"]
    if len(changed) != 1 or changed[0]["pass"] != "fold-norm-weights":
        return False
    changed[0].update(status="undone", reason="no rotation followed it: the scales stay in the norms, "
                      "not in the int8 weights")
    return True


def _shared(before: dict[str, dict[str, str]], after: dict[str, dict[str, str]]) -> set[str]:
    """Constants every graph should hold alike after a pass: those they held alike before (same name,
    same values) and those the pass created in every graph."""
    names = set.intersection(*(set(d) for d in after.values()))
    old = set.intersection(*(set(d) for d in before.values()))
    alike = {n for n in old if len({d[n] for d in before.values()}) == 1}
    return {n for n in names if n in alike or n not in old}
