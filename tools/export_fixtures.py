"""Export tiny, random-initialised Hugging Face transformers models to ONNX fixtures.

Every model is built from a config (never downloaded), seeded, put in eval mode and
exported with FIXED shapes (batch 1, sequence 16) by two exporters:

* ``ts``     -- the TorchScript exporter: ``torch.onnx.export(..., dynamo=False, opset_version=17)``
* ``dynamo`` -- the dynamo exporter: ``torch.onnx.export(..., dynamo=True)`` at its default opset,
  saved with all weights inline (no external data).

For each fixture ``NAME`` the tool writes, into the output directory:

* ``NAME.onnx``         the model
* ``NAME.inputs.npz``   the inputs, keyed by graph input name
* ``NAME.outputs.npz``  onnxruntime (CPU) reference outputs, keyed by graph output name

plus ``manifest.json`` describing every fixture (and every failed export) and a copy of
the LLaMA-GQA TorchScript fixture as ``examples/tiny_llama.onnx`` (+ ``.inputs.npz``).

Specs marked ``dynamic`` are the exception: they are exported with symbolic batch /
sequence / past dimensions (TorchScript ``dynamic_axes`` named as Optimum names them,
e.g. ``past_sequence_length + 1``; dynamo ``dynamic_shapes`` with ``torch.export.Dim``),
their reference data still uses the fixed example shapes, and the manifest lists them
under ``dynamic_fixtures`` so that tests iterating the static ``fixtures`` are unaffected.

Usage::

    python tools/export_fixtures.py --out tests/fixtures
    python tools/export_fixtures.py --out out/fx --only llama_gqa_ts bert_dynamo
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import inspect
import io
import json
import logging
import shutil
import sys
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
import transformers
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

SEED = 0
BATCH = 1
SEQ = 16
PAST = 8  # past length of the KV-cache fixture (which runs with seq 1)
TS_OPSET = 17
TOLERANCE = 1e-4

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_SOURCE = "llama_gqa_ts"
EXAMPLE_DIR = REPO_ROOT / "examples"
EXAMPLE_STEM = "tiny_llama"

log = logging.getLogger("export_fixtures")

# Shared tiny sizes: 2 layers, hidden 64, 4 heads, intermediate 128, vocab 256.
_LLAMA_LIKE = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=256,
    max_position_embeddings=64,
)


# --------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class ModelSpec:
    """One model family to export (each spec yields one fixture per exporter)."""

    name: str
    model_type: str  # AutoConfig model_type, e.g. "llama"
    config: dict[str, Any]
    task: str = "causal-lm"  # "causal-lm" -> logits, "base" -> last_hidden_state
    attn_implementation: str = "eager"
    kv_cache: bool = False  # export one decode step with past_key_values inputs
    position_ids: bool = False  # a position_ids input, as Optimum's and HF users' KV exports have
    token_type_ids: bool = False
    exporters: tuple[str, ...] = ("ts", "dynamo")
    dynamic: bool = False  # symbolic batch/sequence/past axes instead of fixed shapes


SPECS: list[ModelSpec] = [
    ModelSpec("llama_mha", "llama", dict(_LLAMA_LIKE)),
    ModelSpec("llama_gqa", "llama", dict(_LLAMA_LIKE, num_key_value_heads=2)),
    ModelSpec("llama_gqa_sdpa", "llama", dict(_LLAMA_LIKE, num_key_value_heads=2), attn_implementation="sdpa"),
    ModelSpec("llama_gqa_kv", "llama", dict(_LLAMA_LIKE, num_key_value_heads=2), kv_cache=True),
    # Dynamic-axes variants (listed under "dynamic_fixtures" in the manifest).
    ModelSpec("llama_gqa_dyn", "llama", dict(_LLAMA_LIKE, num_key_value_heads=2), dynamic=True),
    ModelSpec("llama_gqa_kv_dyn", "llama", dict(_LLAMA_LIKE, num_key_value_heads=2), kv_cache=True, dynamic=True),
    # transformers' default attention (sdpa) with a position_ids input: what users export
    ModelSpec("llama_gqa_kv_sdpa_dyn", "llama", dict(_LLAMA_LIKE, num_key_value_heads=2), attn_implementation="sdpa",
              kv_cache=True, dynamic=True, position_ids=True),
    # sliding window 8: a static pair must mask by positions, not cache slots, past the window
    ModelSpec("mistral_kv_dyn", "mistral", dict(_LLAMA_LIKE, num_key_value_heads=2, sliding_window=8),
              attn_implementation="sdpa", kv_cache=True, dynamic=True, position_ids=True),
    # two embedding Gathers (tokens, learned positions) and both indexed by inputs
    ModelSpec("gpt2_kv_dyn", "gpt2", dict(n_layer=2, n_embd=64, n_inner=128, n_head=4, vocab_size=256, n_positions=64),
              attn_implementation="sdpa", kv_cache=True, dynamic=True, position_ids=True),
    ModelSpec("qwen2", "qwen2", dict(_LLAMA_LIKE, num_key_value_heads=2)),
    # sliding_window smaller than SEQ so the sliding-window mask is actually exercised.
    ModelSpec("mistral", "mistral", dict(_LLAMA_LIKE, num_key_value_heads=2, sliding_window=8)),
    # Phi3's default pad_token_id (32000) is outside the tiny vocab.
    ModelSpec("phi3", "phi3", dict(_LLAMA_LIKE, pad_token_id=0)),
    ModelSpec(
        "gpt2",
        "gpt2",
        dict(n_layer=2, n_embd=64, n_inner=128, n_head=4, vocab_size=256, n_positions=64),
    ),
    ModelSpec(
        "bert",
        "bert",
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            vocab_size=256,
            max_position_embeddings=64,
        ),
        task="base",
        token_type_ids=True,
    ),
]


@dataclass
class Fixture:
    """A (spec, exporter) pair and everything learned while exporting it."""

    spec: ModelSpec
    exporter: str
    record: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.spec.name}_{self.exporter}"


# --------------------------------------------------------------------------- model building


def build_model(spec: ModelSpec) -> torch.nn.Module:
    torch.manual_seed(SEED)
    config = AutoConfig.for_model(spec.model_type, **spec.config)
    config._attn_implementation = spec.attn_implementation
    auto = AutoModelForCausalLM if spec.task == "causal-lm" else AutoModel
    model = auto.from_config(config, attn_implementation=spec.attn_implementation)
    model.eval()
    return model


def config_summary(model: torch.nn.Module, spec: ModelSpec) -> dict[str, Any]:
    cfg = model.config
    heads = cfg.num_attention_heads
    return {
        "model_type": cfg.model_type,
        "hf_class": type(model).__name__,
        "attn_implementation": spec.attn_implementation,
        "layers": cfg.num_hidden_layers,
        "hidden": cfg.hidden_size,
        "intermediate": getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None),
        "heads": heads,
        "kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "vocab": cfg.vocab_size,
        "batch": BATCH,
        "seq": 1 if spec.kv_cache else SEQ,
        "past": PAST if spec.kv_cache else 0,
    }


class ExportWrapper(torch.nn.Module):
    """Positional-tensor facade over a HF model, returning a plain tuple of tensors."""

    def __init__(self, model: torch.nn.Module, spec: ModelSpec):
        super().__init__()
        self.model = model
        self.spec = spec
        self.num_layers = model.config.num_hidden_layers
        # transformers >= 5.2x renamed `past_key_values` to `cache` (the old name warns).
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def forward(self, input_ids, attention_mask, *rest):
        kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask, "return_dict": True}
        rest = list(rest)
        if self.spec.token_type_ids:
            kwargs["token_type_ids"] = rest.pop(0)
        if self.spec.position_ids:
            kwargs["position_ids"] = rest.pop(0)
        if self.spec.kv_cache:
            pairs = [(rest[2 * i], rest[2 * i + 1]) for i in range(self.num_layers)]
            kwargs[self.cache_kwarg] = transformers.DynamicCache(pairs)
            kwargs["use_cache"] = True
        elif self.spec.task == "causal-lm":
            kwargs["use_cache"] = False
        out = self.model(**kwargs)
        if self.spec.task != "causal-lm":
            return (out.last_hidden_state,)
        if not self.spec.kv_cache:
            return (out.logits,)
        present = []
        cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        for layer in cache.layers:
            present += [layer.keys, layer.values]
        return (out.logits, *present)


def make_io(model: torch.nn.Module, spec: ModelSpec) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Seeded example inputs (ordered as ExportWrapper.forward expects) and output names."""
    cfg = model.config
    gen = torch.Generator().manual_seed(SEED)
    seq = 1 if spec.kv_cache else SEQ
    total = seq + (PAST if spec.kv_cache else 0)
    inputs = {
        "input_ids": torch.randint(0, cfg.vocab_size, (BATCH, seq), generator=gen, dtype=torch.int64),
        "attention_mask": torch.ones(BATCH, total, dtype=torch.int64),
    }
    if spec.token_type_ids:
        inputs["token_type_ids"] = torch.zeros(BATCH, seq, dtype=torch.int64)
    if spec.position_ids:
        inputs["position_ids"] = torch.arange(total - seq, total, dtype=torch.int64)[None].expand(BATCH, seq)
    outputs = ["logits" if spec.task == "causal-lm" else "last_hidden_state"]
    if spec.kv_cache:
        kv_heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        for i in range(cfg.num_hidden_layers):
            for kind in ("key", "value"):
                inputs[f"past_key_values.{i}.{kind}"] = torch.randn(BATCH, kv_heads, PAST, head_dim, generator=gen)
                outputs.append(f"present.{i}.{kind}")
    return inputs, outputs


# --------------------------------------------------------------------------- exporting


# Symbolic axis names of the dynamic TorchScript exports, as Optimum's exports name them.
TS_BATCH, TS_SEQ, TS_PAST = "batch_size", "sequence_length", "past_sequence_length"
TS_TOTAL = "past_sequence_length + 1"  # attention mask / present length of one decode step


def ts_dynamic_axes(spec: ModelSpec, inputs: dict[str, torch.Tensor], output_names: list[str]) -> dict | None:
    """``dynamic_axes`` for a dynamic spec: batch and sequence (or past) on every input/output."""
    if not spec.dynamic:
        return None
    axes: dict[str, dict[int, str]] = {}
    for name in list(inputs) + output_names:
        if name.startswith(("past_key_values.", "present.")):
            axes[name] = {0: TS_BATCH, 2: TS_PAST if name.startswith("past") else TS_TOTAL}
        elif name == "attention_mask" and spec.kv_cache:
            axes[name] = {0: TS_BATCH, 1: TS_TOTAL}
        else:
            axes[name] = {0: TS_BATCH, 1: TS_SEQ}
    return axes


def dynamo_dynamic_shapes(spec: ModelSpec, inputs: dict[str, torch.Tensor]) -> tuple | None:
    """``dynamic_shapes`` for a dynamic spec (a decode step keeps its sequence of 1 static)."""
    if not spec.dynamic:
        return None
    from torch.export import Dim

    batch, seq, past = Dim("batch", min=1, max=64), Dim("sequence", min=2, max=64), Dim("past", min=2, max=64)
    shapes = []
    for name in inputs:
        if name.startswith("past_key_values."):
            shapes.append({0: batch, 2: past})
        elif spec.kv_cache:
            shapes.append({0: batch, 1: past + 1} if name == "attention_mask" else {0: batch})
        else:
            shapes.append({0: batch, 1: seq})
    # ExportWrapper.forward(input_ids, attention_mask, *rest): the rest is one nested tuple
    return (shapes[0], shapes[1], tuple(shapes[2:])) if len(shapes) > 2 else tuple(shapes)


def export_ts(wrapper, inputs, output_names, path: Path, dynamic_axes: dict | None = None) -> None:
    """``dynamic_axes`` overrides the spec's (``ts_dynamic_axes``) when given."""
    if dynamic_axes is None:
        dynamic_axes = ts_dynamic_axes(wrapper.spec, inputs, output_names)
    torch.onnx.export(
        wrapper,
        tuple(inputs.values()),
        str(path),
        dynamo=False,
        opset_version=TS_OPSET,
        input_names=list(inputs),
        output_names=output_names,
        do_constant_folding=True,
        dynamic_axes=dynamic_axes,
    )


def export_dynamo(wrapper, inputs, output_names, path: Path, dynamic_shapes: tuple | None = None) -> None:
    """``dynamic_shapes`` overrides the spec's (``dynamo_dynamic_shapes``) when given."""
    if dynamic_shapes is None:
        dynamic_shapes = dynamo_dynamic_shapes(wrapper.spec, inputs)
    program = torch.onnx.export(
        wrapper,
        tuple(inputs.values()),
        dynamo=True,
        input_names=list(inputs),
        output_names=output_names,
        optimize=True,
        dynamic_shapes=dynamic_shapes,
    )
    program.save(str(path), external_data=False)


STRIPPED_METADATA = ("pkg.torch.onnx.stack_trace",)


def strip_machine_paths(path: Path) -> None:
    """Drop per-node stack traces (absolute paths of this machine's site-packages).

    The dynamo exporter's other node metadata (namespace, class hierarchy, name scopes)
    is kept: it is what real exported models carry.
    """
    model = onnx.load(str(path))
    for node in model.graph.node:
        keep = [p for p in node.metadata_props if p.key not in STRIPPED_METADATA]
        del node.metadata_props[:]
        node.metadata_props.extend(keep)
    onnx.save(model, str(path))


EXPORTERS = {"ts": export_ts, "dynamo": export_dynamo}


@contextlib.contextmanager
def quiet():
    """Silence the exporters' chatter (progress prints, tracer warnings)."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def run_onnx(path: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    graph_inputs = [i.name for i in session.get_inputs()]
    names = [o.name for o in session.get_outputs()]
    values = session.run(names, {k: feeds[k] for k in graph_inputs})
    return dict(zip(names, values))


def value_info(vi: onnx.ValueInfoProto) -> dict[str, Any]:
    t = vi.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim]
    return {"name": vi.name, "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name, "shape": dims}


def describe_onnx(path: Path) -> dict[str, Any]:
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    initializer_names = {i.name for i in model.graph.initializer}
    return {
        "opset": opset,
        "ir_version": model.ir_version,
        "nodes": len(model.graph.node),
        "op_types": dict(collections.Counter(n.op_type for n in model.graph.node).most_common()),
        "functions": len(model.functions),
        "inputs": [value_info(i) for i in model.graph.input if i.name not in initializer_names],
        "outputs": [value_info(o) for o in model.graph.output],
        "external_data": any(
            t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer
        ),
    }


def export_fixture(fx: Fixture, out_dir: Path) -> None:
    """Export one fixture, write its .onnx/.npz files and fill fx.record."""
    spec = fx.spec
    model = build_model(spec)
    wrapper = ExportWrapper(model, spec).eval()
    inputs, output_names = make_io(model, spec)
    fx.record.update(architecture=spec.model_type, exporter=fx.exporter, config=config_summary(model, spec))
    if spec.dynamic:
        fx.record["dynamic"] = True

    with torch.no_grad():
        expected = [t.detach().numpy() for t in wrapper(*inputs.values())]

    path = out_dir / f"{fx.name}.onnx"
    with quiet(), torch.no_grad():
        EXPORTERS[fx.exporter](wrapper, inputs, output_names, path)
    strip_machine_paths(path)
    info = describe_onnx(path)

    feeds = {k: v.numpy() for k, v in inputs.items()}
    missing = [i["name"] for i in info["inputs"] if i["name"] not in feeds]
    if missing:
        raise RuntimeError(f"graph inputs not produced by the tool: {missing}")
    feeds = {i["name"]: feeds[i["name"]] for i in info["inputs"]}  # only what the graph takes
    got = run_onnx(path, feeds)
    if len(got) != len(expected):
        raise RuntimeError(f"{len(got)} ONNX outputs vs {len(expected)} torch outputs")
    diff = max(float(np.max(np.abs(g - e))) for g, e in zip(got.values(), expected))

    np.savez(out_dir / f"{fx.name}.inputs.npz", **feeds)
    np.savez(out_dir / f"{fx.name}.outputs.npz", **got)
    fx.record.update(
        file=path.name,
        size_bytes=path.stat().st_size,
        **info,
        torch_vs_onnx_max_abs=diff,
        within_tolerance=diff <= TOLERANCE,
    )


def exporter_error(exc: BaseException) -> str:
    lines = traceback.format_exception_only(type(exc), exc)
    text = "".join(lines).strip()
    return text if len(text) < 2000 else text[:2000] + " ..."


def run_fixture(fx: Fixture, out_dir: Path) -> None:
    try:
        export_fixture(fx, out_dir)
        status = "ok" if fx.record["within_tolerance"] else "MISMATCH"
        log.info("%-22s %s  diff=%.2e  %6d B  opset %s  %d nodes", fx.name, status,
                     fx.record["torch_vs_onnx_max_abs"], fx.record["size_bytes"], fx.record["opset"],
                     fx.record["nodes"])
    except Exception as exc:  # record and move on: one failing exporter must not stop the rest
        for suffix in (".onnx", ".onnx.data", ".inputs.npz", ".outputs.npz"):
            (out_dir / f"{fx.name}{suffix}").unlink(missing_ok=True)
        fx.record.update(architecture=fx.spec.model_type, exporter=fx.exporter, error=exporter_error(exc))
        log.warning("%-22s FAILED: %s", fx.name, fx.record["error"].splitlines()[-1][:300])


# --------------------------------------------------------------------------- outputs


def versions() -> dict[str, str]:
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": ort.__version__,
        "onnxscript": __import__("onnxscript").__version__,
        "numpy": np.__version__,
    }


def write_manifest(fixtures: list[Fixture], out_dir: Path) -> None:
    ok = {fx.name: fx.record for fx in fixtures if "error" not in fx.record and not fx.spec.dynamic}
    ok_dynamic = {fx.name: fx.record for fx in fixtures if "error" not in fx.record and fx.spec.dynamic}
    failed = {fx.name: fx.record for fx in fixtures if "error" in fx.record}
    manifest_path = out_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    # --only re-exports a subset: keep the other entries of an existing manifest.
    fixtures_all = {**manifest.get("fixtures", {}), **ok}
    dynamic_all = {**manifest.get("dynamic_fixtures", {}), **ok_dynamic}
    failures_all = {**manifest.get("failures", {}), **failed}
    for name in list(ok) + list(ok_dynamic):
        failures_all.pop(name, None)
    for name in failed:
        fixtures_all.pop(name, None)
        dynamic_all.pop(name, None)
    manifest = {
        "generator": "python tools/export_fixtures.py --out tests/fixtures",
        "seed": SEED,
        "tolerance": TOLERANCE,
        "notes": [
            "Shapes are fixed (no dynamic axes) in 'fixtures'; 'dynamic_fixtures' have symbolic batch/"
            "sequence/past axes (their npz data uses the fixed example shapes). Weights are inline.",
            "Node metadata keys stripped for reproducibility: " + ", ".join(STRIPPED_METADATA),
            "outputs.npz holds onnxruntime CPU outputs; torch_vs_onnx_max_abs compares them to eager torch.",
        ],
        "versions": versions(),
        "fixtures": dict(sorted(fixtures_all.items())),
        "dynamic_fixtures": dict(sorted(dynamic_all.items())),
        "failures": dict(sorted(failures_all.items())),
    }
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")


def copy_example(out_dir: Path) -> None:
    src = out_dir / f"{EXAMPLE_SOURCE}.onnx"
    if not src.exists():
        return
    EXAMPLE_DIR.mkdir(exist_ok=True)
    shutil.copyfile(src, EXAMPLE_DIR / f"{EXAMPLE_STEM}.onnx")
    shutil.copyfile(out_dir / f"{EXAMPLE_SOURCE}.inputs.npz", EXAMPLE_DIR / f"{EXAMPLE_STEM}.inputs.npz")


def select(only: list[str] | None) -> list[Fixture]:
    fixtures = [Fixture(spec, exporter) for spec in SPECS for exporter in spec.exporters]
    if not only:
        return fixtures
    chosen = [fx for fx in fixtures if fx.name in only or fx.spec.name in only]
    unknown = set(only) - {fx.name for fx in fixtures} - {s.name for s in SPECS}
    if unknown:
        raise SystemExit(f"unknown fixture(s): {sorted(unknown)}; known: {[fx.name for fx in fixtures]}")
    return chosen


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "fixtures", help="output directory")
    parser.add_argument(
        "--only", nargs="+", metavar="NAME",
        help="export only these fixtures (e.g. llama_gqa_ts) or model specs (e.g. llama_gqa)",
    )
    parser.add_argument("--no-example", action="store_true", help="do not refresh examples/tiny_llama.*")
    return parser.parse_args(argv)


def setup_logging(logger: logging.Logger) -> None:
    """``logger``'s lines plain on stderr; torch's and transformers' own notes silenced."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # "torchvision is not installed" notes
    transformers.logging.set_verbosity_error()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(log)

    args.out.mkdir(parents=True, exist_ok=True)
    fixtures = select(args.only)
    for fx in fixtures:
        run_fixture(fx, args.out)
    write_manifest(fixtures, args.out)
    if not args.no_example:
        copy_example(args.out)
    failed = [fx.name for fx in fixtures if "error" in fx.record]
    mismatched = [fx.name for fx in fixtures if fx.record.get("within_tolerance") is False]
    log.info("%d exported, %d failed %s, %d over tolerance %s",
                 len(fixtures) - len(failed), len(failed), failed, len(mismatched), mismatched)
    return 0


if __name__ == "__main__":
    sys.exit(main())
