"""``qnnpasses llm``: a HF-style KV-cache decoder export -> a deployable static prefill + decode pair.

For each graph (prefill: ``tokens`` = M, ``past`` = N - M; decode: 1 and N - 1), from the
original export:

0. the onnxruntime contrib-op lowerings of ``htp-llm`` (``CONTRIB_LOWERINGS``: a model-builder
   export's ``GroupQueryAttention`` becomes explicit attention with ``Concat(past, new)``), before
   the roles are found -- on an HF export they change nothing;
1. ``fix-shapes`` with explicit static shapes (batch 1, S new tokens, P past slots, mask P + S),
   ``expose-positions`` (rotary positions become an input when the export derived them from the
   past length), ``simplify``, ``kv-new-outputs`` (outputs only the new K/V) and
   ``kv-split-concat`` (no Concat of the cache inside the graph), ``rotary-table`` (cos/sin rows
   for the N positions a cache of N slots can hold, gathered instead of computed: exact angles in fp16);
2. the ``htp-llm`` pipeline, then for fp16 pairs :data:`FP16_PIPELINE` (``scale-residual``: a
   residual stream past fp16's range carried at 2^-k, the decode graph given the prefill graph's
   k; ``silu-tanh``, ``softmax-exp``: a SiLU and a Softmax the HTP computes closer to fp32 in
   fp16 mode), ``logits-offset`` on the logits output unless ``logits_offset`` is false
   (``--logits-offset none``): the logits relative to the maximum of the first
   ``offset_candidates`` tokens' logits (by default 4096, at most an eighth of the vocabulary:
   :func:`~qnnpasses.llm.manifest.default_offset_candidates`; 0: every token's, which reads the
   lm_head's weight twice per call: ``docs/lm_head_forms.md``), subtracted
   before the lm_head's fp16 rounding, plus that maximum as ``<logits>_offset``, which the
   manifest's ``logits_offset`` role names (``docs/logits_offset.md``); then ``tied-embedding`` (a
   tied token embedding read from the lm_head's weight, so the bundle stores the table once);
3. a check on onnxruntime CPU against the original dynamic export over a chunked prompt and
   decode steps (the static graph with a padded cache must compute what the original computes
   with the unpadded one);
4. optionally a split into consecutive parts and quantization;
5. every graph's weights in one file (:data:`WEIGHTS_FILE`), each distinct tensor once;
6. compilation to EPContext models (weight-shared if the backend can run that, else separate).

Why a static cache of P slots is exact: with the past fixed at P, the export's causal mask puts
the new tokens at key slots P..P+S-1 and lets every query see all P past slots; the
``attention_mask`` removes the slots at or beyond ``valid_len`` and padded new tokens, and the
rotary reads the absolute ``position_ids``.  Everything is written to a staging folder first and
moved into place at the end: bad input leaves nothing behind.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qnnpasses.backends.targets import active as active_target
from qnnpasses.errors import BadInputError, CheckFailedError
from qnnpasses.ir.kv_roles import Roles
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import IRModel, remove_model, save_model
from qnnpasses.llm.manifest import FORMAT, default_offset_candidates, write_manifest
from qnnpasses.llm.roles import export_roles, lower_contrib, pass_records, roles_dict
from qnnpasses.llm.source import model_file
from qnnpasses.llm.tokenizer import COMPANION_FILES, TOKENIZER_FILE, TokenizerError, check_tokenizer, copy_tokenizer, find_tokenizer_dir
from qnnpasses.memory import PeakMemory, release
from qnnpasses.passmanager.api import get_pass
from qnnpasses.passmanager.manager import PassManager, RunConfig
from qnnpasses.passmanager.named import HTP_FP16_FORMS_PIPELINE, get_pipeline
from qnnpasses.passmanager.spec import Pipeline, parse_pipeline

STATIC_CACHE_PIPELINE = "fix-shapes,expose-positions,simplify,window-positions,kv-new-outputs,kv-split-concat"


def static_cache_pipeline(context: int, positions: str | None = None) -> Pipeline:
    """:data:`STATIC_CACHE_PIPELINE`, then ``rotary-table`` for positions below ``context``: a cache
    of ``context`` slots never sees a larger position, and a table keeps the rotary angles exact in fp16.
    ``positions``: the export's own position input, when it has one under another name."""
    static = parse_pipeline(STATIC_CACHE_PIPELINE)
    if positions and positions != "position_ids":
        static = static.with_options("window-positions", positions=positions)
    return static + Pipeline([get_pass("rotary-table")(positions=context)])


#: After htp-llm, for fp16 pairs only: formulations the HTP computes closer to fp32 in fp16 mode
#: (``silu-tanh``: its fused MatMul -> Sigmoid -> Mul of one-token graphs loses several times
#: fp16's rounding; ``softmax-exp``: its Softmax loses 2-4x an ideal fp16 op's, the spelled-out
#: form 1-1.5x; see tools/probe_fp16_ops.py, docs/fp16_ops.md).
FP16_PIPELINE = HTP_FP16_FORMS_PIPELINE

#: The pass that keeps fp16 logits at fine resolution near the top (fp16 pairs, after FP16_PIPELINE).
LOGITS_OFFSET = "logits-offset"

PRECISIONS = ("fp16", "w8a16", "w4a16")


def fp16_passes(logits: str, logits_offset: bool = False, residual_shift: int | None = None,
                offset_candidates: int = 0) -> Pipeline:
    """What an fp16 pair gets after htp-llm: :data:`FP16_PIPELINE`, then (with ``logits_offset``)
    ``logits-offset`` on the output named ``logits``, then ``tied-embedding``.  (Quantized pairs do
    not share the table: the lm_head's weight is quantized for the lm_head, not for the lookup.)
    ``residual_shift``: the ``scale-residual`` shift to apply instead of measuring one (the decode
    graph takes the prefill graph's, so that the two hold the same weights)."""
    pipeline = parse_pipeline(FP16_PIPELINE)
    if residual_shift is not None:
        pipeline = pipeline.with_options("scale-residual", shift=residual_shift)
    if logits_offset:
        pipeline.items.append(get_pass(LOGITS_OFFSET)(output=logits, candidates=offset_candidates))
    pipeline.items.append(get_pass("tied-embedding")())
    return pipeline


#: max abs of the static fp32 graphs vs the original on CPU (rounding-level rewrites only):
#: CPU_TOLERANCE + CPU_RTOL x the largest reference magnitude of that output (trained models'
#: logits and keys reach tens to hundreds, where float32 rounding alone exceeds 1e-4)
CPU_TOLERANCE = 1e-4
CPU_RTOL = 1e-5
_DTYPES = {np.dtype(np.int32): "int32", np.dtype(np.int64): "int64", np.dtype(np.float32): "float32",
           np.dtype(np.float16): "float16", np.dtype(np.uint8): "uint8"}
#: what ``qnnpasses llm`` writes: our own bundle (``llm.json``), onnxruntime-genai's
#: ``decoder-pipeline`` model (:mod:`qnnpasses.llm.genai`) or a Genie bundle (:mod:`qnnpasses.llm.genie`);
#: the latter two with ``llm.json`` too
BUNDLES = ("qnnpasses", "genai", "genie")
#: the bundles other runtimes load: a uint8 cache with the key transposed, plain logits
FOREIGN = ("genai", "genie")
#: the one external-data file every graph of a bundle reads (:func:`_share_weights`)
WEIGHTS_FILE = "weights.data"
#: The default ``--max-part-bytes``, counted on the HTP (:func:`_part_budgets`).  The HTP is a
#: 32-bit processor: one context's weights, activations, I/O buffers and spill-fill share a 4 GiB
#: address space (ExecuTorch's Qualcomm LLM guide shards models that exceed it); a part may hold half.
DEFAULT_PART_BYTES = 2 << 30


@dataclass
class LlmOptions:
    context: int
    prefill: int
    precision: str = "fp16"
    calib: str | Path | None = None
    parts: int | None = None
    max_part_bytes: int | None = None
    compile: bool = True
    try_shared: bool = True
    verify_tokens: int = 8
    #: ask the HTP (when installed): each graph's placement, and w4a16's int4 grid (qnnpasses.llm.int4_blocks)
    probe: bool = True
    logits_offset: bool = True
    cache_fp16: bool = True
    bundle: str = "qnnpasses"
    keep_float: bool = False
    #: w4a16: input rows per int4 scale (0: one scale per output channel); None: the precision's own (32)
    #: where the HTP prepares the first layer so, else per output channel (qnnpasses.llm.int4_blocks)
    int4_blocks: int | None = None
    #: with logits_offset: the offset is the maximum over the first N tokens' logits (0: every token;
    #: None: :func:`qnnpasses.llm.manifest.default_offset_candidates` of the vocabulary)
    offset_candidates: int | None = None


def validate(model: Path, out_dir: Path, options: LlmOptions) -> None:
    """Refuse bad requests before anything is written (one-line BadInputError each)."""
    if not model.is_file():
        raise BadInputError(f"model not found: {model}")
    if options.precision not in PRECISIONS:
        raise BadInputError(f"unknown precision '{options.precision}' (known: {', '.join(PRECISIONS)})")
    if options.precision != "fp16" and options.calib is None:
        raise BadInputError(f"--precision {options.precision} needs --calib DATA")
    if options.prefill < 1:
        raise BadInputError(f"--prefill must be at least 1 (got {options.prefill})")
    if options.prefill >= options.context:
        raise BadInputError(f"--prefill {options.prefill} must be smaller than --context {options.context}")
    if options.int4_blocks is not None:
        if options.precision != "w4a16":
            raise BadInputError(f"--int4-blocks is for --precision w4a16 (got {options.precision})")
        if options.int4_blocks < 0 or options.int4_blocks == 1 or options.int4_blocks & (options.int4_blocks - 1):
            raise BadInputError(f"--int4-blocks must be a power of two >= 2, or 'none' (got {options.int4_blocks})")
    if options.logits_offset and (options.offset_candidates or 0) < 0:
        raise BadInputError(f"--logits-offset takes a positive number of tokens, 'all' or 'none' "
                            f"(got {options.offset_candidates})")
    if options.parts is not None and options.max_part_bytes is not None:
        raise BadInputError("give --parts or --max-part-bytes, not both")
    if options.parts is not None and options.parts < 1:
        raise BadInputError(f"--parts must be at least 1 (got {options.parts})")
    if options.max_part_bytes is not None and options.max_part_bytes <= 0:
        raise BadInputError(f"--max-part-bytes must be positive (got {options.max_part_bytes})")
    if out_dir.resolve() == model.parent.resolve():
        raise BadInputError("the output folder must not be the input model's folder")
    if options.bundle not in BUNDLES:
        raise BadInputError(f"unknown bundle '{options.bundle}' (known: {', '.join(BUNDLES)})")
    if options.bundle in FOREIGN:
        _bundle_module(options.bundle).check_request(options.context, options.prefill, options.precision)
    if options.bundle == "genie" and (options.parts is not None or options.max_part_bytes is not None):
        raise BadInputError("--bundle genie cannot be split yet: Genie orders a graph's parts by their graph names, "
                            "which onnxruntime-qnn does not let us choose")


def _bundle_module(bundle: str):
    """The module that writes ``bundle``'s form (:data:`FOREIGN`)."""
    from qnnpasses.llm import genai, genie

    return {"genai": genai, "genie": genie}[bundle]


def _static_dim(dim) -> int | None:
    return int(dim) if isinstance(dim, (int, np.integer)) and dim > 0 else None


def _check_tokens(ir: IRModel, roles: Roles, tokens: int, what: str) -> None:
    ids = next(t for t in ir.graph.inputs if t.name == roles.input_ids)
    fixed = _static_dim(ids.shape[-1]) if ids.shape else None
    if fixed is not None and fixed != tokens:
        raise BadInputError(f"the export fixes the new-token count at {fixed}; {what} needs {tokens} "
                            f"(export with a dynamic sequence axis, or use --prefill {fixed})")


def _check_positions(ir: IRModel, context: int) -> None:
    """Refuse a context whose last position (``context - 1``) is beyond a table the export reads
    positions from: learned absolute positions (GPT-2's ``wpe``) or a precomputed rotary cos/sin
    cache (``GroupQueryAttention``'s, once lowered).  Gathering past its last row is an error on
    onnxruntime CPU and reads whatever follows the table on the HTP."""
    from qnnpasses.ir.kv_roles import rotary_gathers

    rows, name = min(((int(g.inputs[0].shape[0]), g.inputs[0].name) for g in rotary_gathers(ir.graph)),
                     default=(context, ""))
    if rows < context:
        raise BadInputError(f"--context {context}: the export reads positions from a table of {rows} rows "
                            f"('{name}'), so positions past {rows - 1} do not exist; use --context {rows} or less")


def _check_computes(model: Path, tokens: int) -> None:
    """Refuse an export that cannot compute ``tokens`` new tokens at once, or one at a time, on
    onnxruntime CPU (an exporter that baked the length it traced into the graph)."""
    from qnnpasses.llm.reference import ReferenceModel

    why = ReferenceModel(model).cannot_compute(tokens)
    if why is not None:
        hint = "use --prefill 1, or export" if "at once" in why else "export"
        raise BadInputError(f"the export does not compute {why}; its exporter fixed the length it traced: "
                            f"{hint} with another exporter or a dynamic sequence axis")


def _shapes(roles: Roles, tokens: int, past: int) -> dict[str, list[int]]:
    shapes = {roles.input_ids: [1, tokens], roles.attention_mask: [1, past + tokens]}
    if roles.position_ids:
        shapes[roles.position_ids] = [1, tokens]
    for name in roles.past_key + roles.past_value:
        shapes[name] = [1, int(roles.kv_heads), past, int(roles.head_dim)]
    return shapes


def static_graph(model: Path, roles: Roles, tokens: int, past: int,
                 quantized: bool = False, logits_offset: bool = False,
                 cache_fp16: bool = True, residual_shift: int | None = None,
                 offset_candidates: int = 0) -> tuple[IRModel, dict[str, Any]]:
    """The static-cache graph with ``tokens`` new tokens after ``past`` cache slots, htp-llm applied
    (fp16: then :data:`FP16_PIPELINE` and, with ``logits_offset``, ``logits-offset`` on the logits,
    and the cache taken and given in float16, :mod:`qnnpasses.llm.cache_dtype`).

    ``quantized``: htp-llm as ``qnnpasses quantize`` runs it (:func:`build_pipeline`)."""
    ir = load_model(model)
    lowered, lowerings = lower_contrib(ir)
    pipeline = build_pipeline(roles, tokens + past, quantized, logits_offset, residual_shift, offset_candidates)
    # one manager for every stage; the build's own check against the export (check_static) verifies
    # the result, so no pass is verified on its own
    manager = PassManager(pipeline, RunConfig(verify=False, strict=True))
    manager.context.shapes = _shapes(roles, tokens, past)
    records = pass_records(manager.run(ir))
    cache_dtype = "float32"
    if not quantized:
        from qnnpasses.llm.cache_dtype import store_cache_in_fp16
        from qnnpasses.passes.kvcache.kv_new_outputs import new_output_name

        new = [new_output_name(n, "present", "new") for n in roles.present_key + roles.present_value]
        if cache_fp16 and store_cache_in_fp16(ir, roles.past_key + roles.past_value, new):
            cache_dtype = "float16"
    # what ran, in textual form (quantization then knows htp-llm was applied)
    prefix = f"{lowerings}," if lowerings else ""
    ir.metadata_props["qnnpasses.passmanager.spec"] = f"{prefix}{pipeline.to_text()}"
    return ir, {"passes": (lowered if lowerings else []) + records, "cache_dtype": cache_dtype}


def build_pipeline(roles: Roles, context: int, quantized: bool = False, logits_offset: bool = False,
                   residual_shift: int | None = None, offset_candidates: int = 0) -> Pipeline:
    """Every pass a graph of the pair runs after the contrib lowerings: the static cache
    (:func:`static_cache_pipeline`), ``htp-llm`` in its ``quantized`` or ``pair`` variant
    (:data:`qnnpasses.passmanager.named.VARIANTS`), and for fp16 :func:`fp16_passes`."""
    htp_llm = get_pipeline("htp-llm", "quantized" if quantized else "pair")
    pipeline = static_cache_pipeline(context, roles.position_ids) + htp_llm
    # a quantized graph runs in integer mode: the fp16 formulations are for fp16 pairs only
    return pipeline if quantized else pipeline + fp16_passes(roles.logits, logits_offset, residual_shift,
                                                             offset_candidates)


def graph_roles(ir: IRModel, roles: Roles) -> dict[str, Any]:
    """The manifest's roles of a static graph, checked against what the graph has."""
    inputs = {t.name for t in ir.graph.inputs}
    outputs = {t.name for t in ir.graph.outputs}
    from qnnpasses.passes.kvcache.kv_new_outputs import new_output_name

    position = roles.position_ids or ("position_ids" if "position_ids" in inputs else None)
    result = {"input_ids": roles.input_ids, "attention_mask": roles.attention_mask, "position_ids": position,
              "past_key": roles.past_key, "past_value": roles.past_value, "logits": roles.logits,
              "new_key": [new_output_name(n, "present", "new") for n in roles.present_key],
              "new_value": [new_output_name(n, "present", "new") for n in roles.present_value]}
    from qnnpasses.passes.logits.logits_offset import offset_name

    offset = offset_name(roles.logits)
    result["logits_offset"] = offset if offset in outputs else None
    missing_in = [n for n in [roles.input_ids, roles.attention_mask, *roles.past_key, *roles.past_value] if n not in inputs]
    missing_out = [n for n in [roles.logits, *result["new_key"], *result["new_value"]] if n not in outputs]
    if missing_in or missing_out:
        raise CheckFailedError(f"static graph lost roles: inputs {missing_in}, outputs {missing_out}")
    if position is None:
        raise BadInputError("cannot find the token positions: no position_ids input and no rotary computed from the past "
                            "length (learned absolute positions are not supported)")
    cache_concats = [n.name for n in ir.graph.nodes if n.op == "Concat"
                     and any(t.name in set(roles.past_key + roles.past_value) for t in n.inputs)]
    if cache_concats:
        raise CheckFailedError(f"the cache is still concatenated inside the graph: {cache_concats[:3]}")
    return result


def _io(ir: IRModel) -> dict[str, dict[str, Any]]:
    io = {}
    for tensor in list(ir.graph.inputs) + list(ir.graph.outputs):
        io[tensor.name] = {"dtype": _DTYPES.get(np.dtype(tensor.dtype), str(np.dtype(tensor.dtype))),
                           "shape": [int(d) for d in tensor.shape]}
    return io


def residual_shift(records: list[dict[str, Any]]) -> int | None:
    """The shift ``scale-residual`` chose for a graph (0 when it measured no need), None when it did not run."""
    found = next((r for r in records if r["name"] == "scale-residual"), None)
    return None if found is None else int(found["stats"].get("shift", 0))


def _local_layers(records: list[dict[str, Any]]) -> dict[str, int]:
    """Layer index (attention order) -> window of the layers whose mask ``window-positions`` rewrote
    (empty: no sliding-window layer)."""
    found = next((r for r in records if r["name"] == "window-positions" and r["status"] == "changed"), None)
    return dict(found["stats"].get("local_layers", {})) if found else {}


def _source_roles(roles: Roles, given: dict[str, str]) -> dict[str, Any]:
    """The original export's roles; ``given`` lists those the user named (``--roles``)."""
    return {**roles_dict(roles), "given": sorted(given)}


def build(model: str | Path, out_dir: str | Path, *, context: int, prefill: int, precision: str = "fp16",
          calib: str | Path | None = None, parts: int | None = None, max_part_bytes: int | None = None,
          compile: bool = True, try_shared: bool = True, verify_tokens: int = 8, probe: bool = True,
          logits_offset: bool = True, roles: dict[str, str] | None = None,
          tokenizer: str | Path | None = None, cache_fp16: bool = True, bundle: str = "qnnpasses",
          keep_float: bool = False, int4_blocks: int | None = None,
          offset_candidates: int | None = None) -> dict[str, Any]:
    """Write the prefill + decode pair, ``llm.json`` and ``report.json``/``report.md`` into ``out_dir``.

    ``model``: the export, or the Hugging Face / Optimum folder holding it.  ``roles``:
    input/output roles the user names (``--roles``), taken over what the graph suggests.
    ``tokenizer``: the folder with ``tokenizer.json`` (default: the model's folder, when it has
    one); its files are copied into ``out_dir`` and the manifest records the special ids.
    ``cache_fp16``: an fp16 pair takes and gives its KV cache in float16 (the HTP's dtype,
    :mod:`qnnpasses.llm.cache_dtype`); false keeps float32.  ``bundle``: ``genai`` writes the
    pair as onnxruntime-genai's model (:mod:`qnnpasses.llm.genai`: uint8 cache, plain logits),
    ``genie`` as a Genie bundle (:mod:`qnnpasses.llm.genie`: the same cache, Genie's inputs,
    context binaries in their own files).  ``keep_float``: a quantized bundle keeps the float pair
    its graphs were made from (``X.float.onnx``, every weight again in float32); by default it is
    removed once the quantized pair has been checked against the export.  ``int4_blocks``: w4a16's
    int4 weight scales, one per that many input rows (0: one per output channel; None: 32 where the
    HTP prepares the first layer so, else per output channel: :mod:`qnnpasses.llm.int4_blocks`).
    ``logits_offset``: an fp16 pair outputs its logits relative to the maximum of the first
    ``offset_candidates`` tokens' logits (0: every token's; None: 4096, at most an eighth of the
    vocabulary: :func:`qnnpasses.llm.manifest.default_offset_candidates`), subtracted inside the
    lm_head's accumulation (``logits-offset``); false: plain logits.

    Returns the manifest.  Raises BadInputError (bad request or export) before writing anything.
    """
    options = LlmOptions(context, prefill, precision, calib, parts, max_part_bytes, compile, try_shared, verify_tokens,
                         probe, logits_offset, cache_fp16, bundle, keep_float, int4_blocks, offset_candidates)
    model, out_dir = model_file(model), Path(out_dir)
    validate(model, out_dir, options)
    start = time.monotonic()
    source = load_model(model)
    given = dict(roles or {})
    roles = export_roles(source, given)
    if options.offset_candidates is None:
        options.offset_candidates = default_offset_candidates(int(roles.vocab))
    try:  # before the slow part: a tokenizer of another model is refused now
        text_dir = find_tokenizer_dir(model, tokenizer)
        if text_dir is not None:
            check_tokenizer(text_dir, int(roles.vocab))
    except TokenizerError as exc:
        raise BadInputError(str(exc)) from None
    if options.bundle in FOREIGN and text_dir is None:
        raise BadInputError(f"--bundle {options.bundle} needs the model's tokenizer.json (a model folder or "
                            "--tokenizer-dir DIR)")
    left = sorted({n.op for n in source.graph.nodes if (n.domain or "") == "com.microsoft"})
    if left:  # e.g. MatMulNBits with accuracy_level=4: its lowering is lossy (htp-llm runs it only with --allow-lossy)
        raise BadInputError(f"the export keeps onnxruntime contrib ops that are not lowered losslessly: {', '.join(left)} "
                            "(htp-llm lowers them only with --allow-lossy, which qnnpasses llm does not take)")
    _check_positions(source, context)
    _check_tokens(source, roles, prefill, f"--prefill {prefill}")
    _check_tokens(source, roles, 1, "the decode graph")
    _check_computes(model, prefill)
    for what in ("kv_heads", "head_dim"):
        if _static_dim(getattr(roles, what)) is None:
            raise BadInputError(f"the KV cache's {what} is not a static dimension")
    _require_precision(options.precision)
    if options.bundle == "genie":  # the export's weights in fp16 tell now what the graphs will hold
        from qnnpasses.ir.model import file_weight_bytes

        held = file_weight_bytes(model, float_bytes=2)
        if held > DEFAULT_PART_BYTES:
            _refuse_genie_parts(held)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        with PeakMemory() as peak:
            manifest, report = _build_into(stage, model, source, roles, options, given, text_dir)
        report["seconds"] = round(time.monotonic() - start, 2)
        report["memory"] = {**peak.figures(), "export_weight_bytes": source.weight_bytes(),
                            "compile_private_peak_bytes": (report.get("compile") or {}).get("child_private_peak_bytes")}
        (stage / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        from qnnpasses.llm.report import report_markdown

        (stage / "report.md").write_text(report_markdown(manifest, report))
        out_dir.mkdir(parents=True, exist_ok=True)
        _remove_previous_pair(out_dir)
        for path in sorted(stage.iterdir()):
            target = out_dir / path.name
            if target.exists():
                target.unlink()
            shutil.move(str(path), target)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    manifest["dir"] = str(out_dir)
    return manifest


def _remove_previous_pair(out_dir: Path) -> None:
    """Files an earlier ``qnnpasses llm`` wrote into ``out_dir`` (it has an llm.json): no stale parts stay."""
    if not (out_dir / "llm.json").is_file():
        return
    for pattern in ("prefill*.onnx*", "decode*.onnx*", WEIGHTS_FILE, "prefill*_qnn.bin", "decode*_qnn.bin", "llm.json",
                    "report.json", "report.md", "genai_config.json", "genie_config.json", "htp_backend_ext_config.json",
                    TOKENIZER_FILE, *COMPANION_FILES):
        for path in out_dir.glob(pattern):
            if path.is_file():
                path.unlink()


def _require_precision(precision: str) -> None:
    """Quantized precisions come from :mod:`qnnpasses.quant.shared`; refuse what it does not offer."""
    if precision == "fp16":
        return
    try:
        from qnnpasses.quant.shared import PRECISIONS
    except ImportError:
        PRECISIONS = {}
    if precision not in PRECISIONS:
        raise BadInputError(f"{precision}: not available yet")


def _build_into(stage: Path, model: Path, source: IRModel, roles: Roles, options: LlmOptions,
                given: dict[str, str], text_dir: Path | None) -> tuple[dict, dict]:
    N, M = options.context, options.prefill
    foreign = options.bundle in FOREIGN
    spec = {"prefill": (M, N - M), "decode": (1, N - 1)}
    graphs: dict[str, Any] = {}
    report: dict[str, Any] = {"source": model.name, "context": N, "prefill": M, "graphs": {}}
    irs, shift = {}, None
    for name, (tokens, past) in spec.items():
        ir, facts = static_graph(model, roles, tokens, past, quantized=options.precision != "fp16",
                                 logits_offset=options.logits_offset and not foreign,
                                 cache_fp16=options.cache_fp16 and not foreign, residual_shift=shift,
                                 offset_candidates=options.offset_candidates)
        shift = residual_shift(facts["passes"]) if shift is None else shift
        if foreign:  # the bundle's own form is made from them
            irs[name] = ir
        graph_role = graph_roles(ir, roles)
        path = save_model(ir, stage / f"{name}.onnx")
        graphs[name] = {"tokens": tokens, "past": past,
                        "parts": [{"onnx": path.name, "compiled": None,
                                   "inputs": [t.name for t in ir.graph.inputs], "outputs": [t.name for t in ir.graph.outputs]}],
                        "roles": graph_role, "io": _io(ir)}
        report["graphs"][name] = {"nodes": len(ir.graph.nodes), "passes": facts["passes"],
                                  "cache_dtype": facts["cache_dtype"]}
        del ir
        release()
    manifest = {
        "format": FORMAT, "source": model.name, "context": N, "prefill": M, "layers": roles.layers,
        "kv_heads": int(roles.kv_heads), "head_dim": int(roles.head_dim), "vocab": int(roles.vocab),
        "precision": options.precision, "target": active_target().as_dict(),
        "kv_layout": {"key": "BHSD", "value": "BHSD"},
        "kv_dtype": graphs["decode"]["io"][roles.past_key[0]]["dtype"], "weight_sharing": "none",
        "graphs": graphs, "source_roles": _source_roles(roles, given),
        "sliding_window": _local_layers(report["graphs"]["decode"]["passes"]),
        # how the graphs were compiled and probed on the HTP (see qnnpasses.llm.compile)
        "session": {"graph_optimization": "disable_all",
                    **({} if options.precision == "fp16" else {"norm_rounding": NORM_ROUNDING})},
    }
    if text_dir is not None:
        manifest["tokenizer"] = copy_tokenizer(text_dir, stage)
    if graphs["decode"]["roles"].get("logits_offset"):  # of how many first tokens (0: every token)
        from qnnpasses.passes.logits.logits_offset import candidate_count

        report["logits_offset"] = {"candidates": candidate_count(options.offset_candidates, int(roles.vocab))}
    report["verification"] = _verify(stage, manifest, model, options)
    release()
    if foreign:
        report["bundle"] = _bundle_form(stage, manifest, irs, model, options, text_dir)
        report["bundle_verification"] = _verify(stage, manifest, model, options, tolerance=None)
        irs.clear()
        release()
    if options.precision != "fp16":
        from qnnpasses.llm.quantize import quantize_pair

        report["quantization"] = quantize_pair(stage, manifest, options)
        release()
        report["quantized_verification"] = _verify(stage, manifest, model, options, tolerance=None)
        release()
        report["quantization"]["float_pair"] = "kept" if options.keep_float else _drop_float_pair(stage, manifest)
    budgets = _part_budgets(stage, manifest, options)
    if budgets is not None:
        by_bytes = options.parts is None
        report["split"] = {"parts": options.parts,
                           "max_part_bytes": (options.max_part_bytes or DEFAULT_PART_BYTES) if by_bytes else None,
                           "default": by_bytes and options.max_part_bytes is None}
        for name in spec:
            ir = load_model(stage / manifest["graphs"][name]["parts"][0]["onnx"])
            entries = _split(stage, ir, name, manifest["graphs"][name], options.parts, budgets[name],
                             quantized=options.precision != "fp16")
            manifest["graphs"][name]["parts"] = entries
            del ir
            release()
        # a quantized or 8-bit-cache pair is measured, not bounded: its parts must measure what it measured
        whole = report.get("quantized_verification") or report.get("bundle_verification")
        if whole is not None:
            report["parts_verification"] = _same_as_whole(_verify(stage, manifest, model, options, tolerance=None),
                                                          whole)
        else:
            report["parts_verification"] = _verify(stage, manifest, model, options, tolerance=CPU_TOLERANCE)
    report["weights_file"] = _share_weights(stage)
    from qnnpasses.backends.htp import htp_available
    from qnnpasses.llm.report import graph_facts

    placement = None
    if options.compile:
        from qnnpasses.llm.compile import compile_graphs

        pairs = [(stage / p["onnx"], stage / p["onnx"].replace(".onnx", "_ctx.onnx"))
                 for name in spec for p in manifest["graphs"][name]["parts"]]
        try:
            compiled = compile_graphs(pairs, fp16=options.precision == "fp16", try_shared=options.try_shared)
        except CheckFailedError as exc:
            raise CheckFailedError(f"{exc}{_int4_blocks_hint(str(exc), report)}") from None
        for name in spec:
            for part in manifest["graphs"][name]["parts"]:
                part["compiled"] = part["onnx"].replace(".onnx", "_ctx.onnx")
                part["binaries"] = compiled["graphs"][part["compiled"]].get("binaries", [])
        manifest["weight_sharing"] = compiled["weight_sharing"]
        report["compile"] = compiled
        placement = compiled["placement"]
    report["htp"] = graph_facts(stage, manifest, probe=options.probe and htp_available(),
                                fp16=options.precision == "fp16", placement=placement)
    from qnnpasses.llm.footprint import footprint

    manifest["device"] = report["device"] = footprint(stage, manifest, active_target())
    write_manifest(stage, manifest)
    if options.bundle == "genai":
        from qnnpasses.llm.genai import write_config

        write_config(stage, manifest)
    if options.bundle == "genie":
        report["bundle"].update(_genie_configs(stage, manifest))
    return manifest, report


#: what a quantized pair's manifest says of the HTP's RmsNorm rounding (qnnpasses.quant.norm_rounding)
NORM_ROUNDING = ("compensated on the HTP: each MatMul reading an RmsNorm output adds back half the norm's 16-bit step "
                 "times its weight's column sums, in what is compiled (qnnpasses.quant.norm_rounding.htp_model)")


def _int4_blocks_hint(error: str, report: dict[str, Any]) -> str:
    """What to do when the HTP cannot prepare a graph with int4 weights in blocks: the first
    layer's probe (:mod:`qnnpasses.llm.int4_blocks`) did not fail, or did not run, or the user
    chose the blocks; one int4 scale per output channel is what the HTP prepared wherever the
    blocks failed to allocate (docs/int4_blocks.md)."""
    rows = (report.get("quantization") or {}).get("int4_block_rows")
    if "QNN_COMMON_ERROR_MEM_ALLOC" not in error or not isinstance(rows, int):
        return ""
    return (f" (int4 weights in blocks of {rows} rows: where the HTP failed to allocate those, it prepared one "
            "scale per output channel: rerun with --int4-blocks none)")


def _drop_float_pair(stage: Path, manifest: dict[str, Any]) -> str:
    """Remove the float graphs a quantized pair was made from: the device never loads them, and
    they hold every weight again in float32 (most of a w4a16 bundle's bytes)."""
    for graph in manifest["graphs"].values():
        remove_model(stage / graph.pop("float_onnx"))
    return "removed (--keep-float keeps it)"


def _share_weights(stage: Path) -> dict[str, Any]:
    """Every graph of the bundle (parts, a quantized pair's float graphs kept by ``--keep-float``)
    reads its weights from one file, :data:`WEIGHTS_FILE`, in which each distinct tensor is stored once."""
    from qnnpasses.ir.shared_data import share_external_data

    return share_external_data(sorted(stage.glob("*.onnx")), WEIGHTS_FILE).as_dict()


def _genie_configs(stage: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Write the Genie configuration files and have Genie check them (when libGenie is installed)."""
    from qnnpasses.llm.genie import library_path, validate_config, write_configs

    config = write_configs(stage, manifest)[0]
    if not all(p.get("binaries") for g in manifest["graphs"].values() for p in g["parts"]):
        return {"genie_validation": "not compiled: genie_config.json lists no context binaries"}
    if library_path() is None:
        return {"genie_validation": "libGenie.so not installed"}
    checked = validate_config(config)
    if not checked.get("ok"):
        raise CheckFailedError(f"Genie refuses the genie_config.json written: {checked.get('error')}")
    return {"genie_validation": f"accepted by Genie API {checked.get('api')}"}


def _bundle_form(stage: Path, manifest: dict[str, Any], irs: dict[str, IRModel], model: Path, options: LlmOptions,
                 text_dir: Path | None) -> dict[str, Any]:
    """The verified float pair -> the form another runtime loads (:data:`FOREIGN`): a uint8 cache
    with the key transposed, scaled from the original's cache on calibration tokens, and the
    bundle's I/O names; a Genie bundle also takes int32 ids, the rotary cos/sin and the whole mask
    (:mod:`qnnpasses.llm.genie_io`) and keeps its cache left-aligned.  The graphs are rewritten in
    place and the manifest follows."""
    from qnnpasses.llm.cache_dtype import store_cache_in_uint8
    from qnnpasses.llm.calibration import cache_scales, calibration_sequences
    from qnnpasses.llm.io_names import rename_io
    from qnnpasses.llm.reference import ReferenceModel

    form = _bundle_module(options.bundle)
    form.check_model(manifest["sliding_window"])
    sequences, origin = calibration_sequences(manifest["vocab"], manifest["context"], options.calib,
                                              manifest["source_roles"]["input_ids"], text_dir)
    reference = ReferenceModel(model)
    encodings = cache_scales(reference, sequences, reference.past[:manifest["layers"]],
                             reference.past[manifest["layers"]:])
    scales = {kind: encodings[f"{kind}_scales"] for kind in ("key", "value")}
    genie = options.bundle == "genie"
    for name, graph in manifest["graphs"].items():
        ir = irs[name]
        store_cache_in_uint8(ir, graph["roles"], form.KV_LAYOUT, scales, form.PAD_VALUE)
        graph["roles"] = rename_io(ir, graph["roles"])
        if genie:
            graph["roles"], graph["rope"] = _genie_inputs(ir, graph["roles"], int(graph["tokens"]))
        save_model(ir, stage / graph["parts"][0]["onnx"])
        graph["parts"][0].update(inputs=[t.name for t in ir.graph.inputs], outputs=[t.name for t in ir.graph.outputs])
        graph["io"] = _io(ir)
    manifest.update(kv_layout=dict(form.KV_LAYOUT), kv_dtype="uint8", kv_alignment="left" if genie else "right",
                    kv_encodings={"zero_point": form.PAD_VALUE,
                                  **{k: v for k, v in encodings.items() if k.endswith("_scales")}})
    if genie:
        manifest["rope"] = manifest["graphs"]["decode"]["rope"]
    return {"format": options.bundle, "calibration": origin, "calibration_tokens": sum(len(s) for s in sequences),
            "kv_max": {k: v for k, v in encodings.items() if k.endswith("_max")}}


def _genie_inputs(ir: IRModel, roles: dict[str, Any], tokens: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Genie's inputs for one graph (:mod:`qnnpasses.llm.genie_io`); its roles and rotary encoding."""
    from qnnpasses.llm import genie_io

    if not roles.get("position_ids"):
        raise BadInputError("--bundle genie needs rotary positions (Genie computes the rotary cos/sin itself); "
                            "this model has none")
    genie_io.ids_int32(ir, roles["input_ids"])
    rope = genie_io.rotary_inputs(ir, roles["position_ids"])
    genie_io.full_mask_input(ir, roles["attention_mask"], tokens)
    renamed = {**roles, "position_ids": None, "position_cos": genie_io.COS, "position_sin": genie_io.SIN}
    return renamed, {"theta": rope.theta, "dim": rope.dim}


def _same_as_whole(parts: dict[str, Any], whole: dict[str, Any]) -> dict[str, Any]:
    """The split pair's check against the unsplit one's (same feeds): running the parts in order
    computes the same graph, so every figure agrees to float32 rounding and the tokens are equal."""
    for key in ("logits", "kv"):
        if abs(parts[key] - whole[key]) > CPU_TOLERANCE + CPU_RTOL * whole[f"{key}_scale"]:
            raise CheckFailedError(f"the parts compute other {key} than the whole graph: max abs {parts[key]:.3g} "
                                   f"against {whole[key]:.3g}")
    if parts["tokens"] != whole["tokens"]:
        raise CheckFailedError("the parts generate other tokens than the whole graph")
    return {**parts, "ok": True, "against": "the unsplit pair"}


def _refuse_genie_parts(held: int) -> None:
    raise BadInputError(f"a graph holds {held / 2**30:.2f} GiB on the HTP, more than one part may "
                        f"({DEFAULT_PART_BYTES / 2**30:.0f} GiB), and Genie bundles cannot be split yet: Genie orders "
                        "a graph's parts by their graph names, which onnxruntime-qnn does not let us choose")


def _part_budgets(stage: Path, manifest: dict[str, Any], options: LlmOptions) -> dict[str, int | None] | None:
    """Per graph, the ``max_part_bytes`` to split it with, in its stored bytes; None: no split.

    ``--max-part-bytes`` (default :data:`DEFAULT_PART_BYTES`) counts bytes on the HTP -- weights in
    the dtype the HTP holds them in (fp16 pairs: 2 bytes per float) plus peak live activations --
    and is scaled here by each graph's stored / HTP weight bytes.  Without ``--parts`` or
    ``--max-part-bytes`` the graphs are split only where one holds more than the default."""
    from qnnpasses.ir.model import file_weight_bytes

    fp16 = options.precision == "fp16"
    paths = {name: stage / graph["parts"][0]["onnx"] for name, graph in manifest["graphs"].items()}
    sizes = {name: (file_weight_bytes(p), file_weight_bytes(p, float_bytes=2 if fp16 else None)) for name, p in paths.items()}
    if options.parts is not None:
        return {name: None for name in paths}
    budget = options.max_part_bytes or DEFAULT_PART_BYTES
    if options.max_part_bytes is None and all(held <= budget for _, held in sizes.values()):
        return None
    if options.bundle == "genie":
        _refuse_genie_parts(max(held for _, held in sizes.values()))
    return {name: int(budget * stored / held) if held else budget for name, (stored, held) in sizes.items()}


def _split(stage: Path, ir: IRModel, name: str, manifest_graph: dict[str, Any], parts: int | None,
           max_part_bytes: int | None, quantized: bool = False) -> list[dict[str, Any]]:
    from qnnpasses.llm.compile import INT_OPTIONS
    from qnnpasses.llm.split import write_parts

    stream = manifest_graph["roles"]["input_ids"]
    # a quantized part runs as the pair does: the graph-boundary Q/DQ on the HTP too
    entries = write_parts(ir, stage, name, stream, parts=parts, max_part_bytes=max_part_bytes,
                          provider_options=INT_OPTIONS if quantized else None)
    for whole in (stage / f"{name}.onnx", stage / f"{name}.onnx.data"):
        whole.unlink(missing_ok=True)
    return entries


def _verify(stage: Path, manifest: dict[str, Any], model: Path, options: LlmOptions,
            tolerance: float | None = CPU_TOLERANCE) -> dict[str, Any]:
    """The static pair vs the original on CPU: a prompt in chunks (last padded), then decode steps.

    ``tolerance`` None: a quantized pair, whose figures are recorded, not held to a bound."""
    from qnnpasses.llm.verify import compare_sequence

    N, M = options.context, options.prefill
    prompt_len = min(2 * M + max(1, M // 2), N - options.verify_tokens - 1) if M > 1 else min(3, N - 2)
    new = max(1, min(options.verify_tokens, N - prompt_len - 1))
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, manifest["vocab"], prompt_len)]
    result = compare_sequence(stage, manifest, model, prompt, new)
    result.update(prompt_tokens=prompt_len, new_tokens=new, tolerance=tolerance)
    if tolerance is None:
        return result
    # a float16 cache: the new K/V outputs are the float32 ones rounded to fp16 (qnnpasses.llm.cache_dtype)
    from qnnpasses.llm.cache_dtype import ROUNDING

    kv_rounding = ROUNDING if manifest.get("kv_dtype") == "float16" else 0.0
    bounds = {"logits": tolerance + CPU_RTOL * result["logits_scale"],
              "kv": tolerance + (CPU_RTOL + kv_rounding) * result["kv_scale"]}
    result["bounds"] = bounds
    result["ok"] = all(result[k] <= bound for k, bound in bounds.items())
    if not result["ok"]:
        worst = max(bounds, key=lambda k: result[k] / bounds[k])
        raise CheckFailedError(f"static pair differs from the original on CPU: {worst} max abs {result[worst]:.3g} "
                               f"> {bounds[worst]:.3g}")
    return result
