#!/usr/bin/env python
"""Where the HTP prepares w4a16's int4 weights in blocks: the layer probe of ``qnnpasses llm``, over shapes.

``qnnpasses llm --precision w4a16`` asks the HTP, before quantizing, whether it prepares the first
layer of the pair's prefill graph with int4 weights in blocks of 32 rows, and quantizes per output
channel where it does not (:mod:`qnnpasses.llm.int4_blocks`).  Here that probe runs on one-layer
decoders with the layer shapes of Qwen2.5-0.5B, Llama-3.2-1B and Qwen2.5-1.5B (random init,
vocabulary 1,024: a token embedding smaller than the originals', and no lm_head in the piece),
exported by transformers' TorchScript path with a KV cache as a user does, at several contexts
and prefill lengths, for the default target, and for every other HTP arch the simulator accepts
at the easiest and the hardest point.
Each row asks with blocks and with one scale per output channel.

The probe stands in for the pair's compile: for the first shape, every point is also built in
full (``qnnpasses llm`` with ``--int4-blocks 32``, one layer, compiled): the compile of the
prefill graph must succeed exactly where the probe prepared the blocks.

Writes ``docs/int4_blocks.json`` and ``docs/int4_blocks.md``.

    python tools/probe_int4_blocks.py
    python tools/probe_int4_blocks.py --archs      # the other archs' rows again
    python tools/probe_int4_blocks.py --doc-only
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from probe_act_matmul import write_docs  # noqa: E402

DOC_JSON, DOC_MD = ROOT / "docs" / "int4_blocks.json", ROOT / "docs" / "int4_blocks.md"
CACHE = Path(os.environ.get("QNNPASSES_CACHE", Path.home() / ".cache" / "qnnpasses")) / "int4_blocks"
VOCAB = 1024
#: (context, prefill) points; the last is what users ship (AI Hub's defaults)
POINTS = ((256, 16), (256, 64), (512, 16), (512, 32), (1024, 16), (1024, 128), (2048, 64), (4096, 32), (4096, 128))
#: the targets asked at the hardest and the easiest point (tools/probe_htp_rounding.py's)
ARCH_TARGETS = ("sa8295", "xelite", "8gen3", "8elite", "8elitegen5")
#: the rows per int4 scale the probe asks about (the w4a16 default)
BLOCK_ROWS = 32


def one_layer_export(shape: str, folder: Path | None = None) -> Path:
    """A one-layer decoder with ``shape``'s layer (tools/bench_sizes.py's configs) in ``folder``
    (default: cached under CACHE)."""
    path = (folder or CACHE / shape) / "model.onnx"
    if path.exists():
        return path
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import bench_sizes
    import decoder_matrix as dm
    import export_fixtures as ef

    family, config = bench_sizes.SHAPES[shape]
    config = {**config, "num_hidden_layers": 1, "vocab_size": VOCAB}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **config)).eval()
    path.parent.mkdir(parents=True, exist_ok=True)
    wrapper = ef.ExportWrapper(model, dm.kv_spec(model)).eval()
    prompt = torch.randint(10, VOCAB, (1, dm.PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    inputs, outputs = dm.example_io(model, prompt)
    with ef.quiet(), torch.no_grad():
        ef.export_ts(wrapper, inputs, outputs, path, dm.ts_axes(inputs, outputs))
    return path


def float_prefill(model: Path, context: int, prefill: int, folder: Path) -> dict:
    """The pair's float prefill graph as ``qnnpasses llm --precision w4a16`` makes it before
    quantizing, in ``folder``, with the manifest entries the probe reads."""
    from qnnpasses.ir.load import load_model
    from qnnpasses.ir.model import save_model
    from qnnpasses.llm.convert import _io, graph_roles, static_graph
    from qnnpasses.llm.roles import export_roles

    roles = export_roles(load_model(model), {})
    ir, _ = static_graph(model, roles, prefill, context - prefill, quantized=True)
    save_model(ir, folder / "prefill.onnx")
    graph = {"tokens": prefill, "past": context - prefill, "parts": [{"onnx": "prefill.onnx"}],
             "roles": graph_roles(ir, roles), "io": _io(ir)}
    return {"graphs": {"prefill": graph}, "kv_heads": int(roles.kv_heads), "head_dim": int(roles.head_dim),
            "vocab": int(roles.vocab)}


def ask(model: Path, context: int, prefill: int) -> dict:
    """The probe with blocks and per channel at one point, for the active target."""
    from dataclasses import replace

    from qnnpasses.llm.int4_blocks import layer_piece, prepares
    from qnnpasses.quant.shared import precision_policy

    policy = precision_policy("w4a16", block_size=BLOCK_ROWS)
    with tempfile.TemporaryDirectory(prefix="int4-blocks-") as tmp:
        manifest = float_prefill(model, context, prefill, Path(tmp))
        piece = layer_piece(Path(tmp), manifest, Path(tmp) / "piece")
        blocks = prepares(piece, policy)
        channel = prepares(piece, replace(policy, block_size=None))
    return {"blocks": blocks["prepared"], "per_channel": channel["prepared"],
            "error": _brief(blocks["error"]), "seconds": round(blocks["seconds"] + channel["seconds"], 1)}


def full_build(model: Path, context: int, prefill: int) -> dict:
    """``qnnpasses llm --precision w4a16 --int4-blocks 32``, compiled: does the pair compile?"""
    from qnnpasses.errors import CheckFailedError
    from qnnpasses.llm.convert import build

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="int4-build-") as tmp:
        calib = Path(tmp) / "calib.npz"
        np.savez(calib, input_ids=rng.integers(0, VOCAB, (4, max(2 * prefill + 8, 40))))
        started = time.monotonic()
        try:
            build(model, Path(tmp) / "pair", context=context, prefill=prefill, precision="w4a16", calib=calib,
                  int4_blocks=BLOCK_ROWS, probe=False, try_shared=False)
            ok, error = True, None
        except CheckFailedError as exc:
            ok, error = False, _brief(str(exc))
    return {"compiled": ok, "error": error, "seconds": round(time.monotonic() - started, 1)}


def _brief(error: str | None) -> str | None:
    """The backend's own words of a failed prepare (``QNN_COMMON_ERROR_...``), else the first 120 characters."""
    if not error:
        return None
    for word in error.replace(",", " ").replace(".", " ").split():
        if word.startswith("QNN_") and "ERROR" in word:
            return word.rstrip(":")
    return error[:120]


def measure(archs_only: bool = False) -> dict:
    """Every row; ``archs_only``: the rows of the other archs again, the others kept from the doc."""
    import onnxruntime
    import onnxruntime_qnn

    from qnnpasses.backends.targets import activate, active, resolve
    import bench_sizes

    default = active()
    rows = []
    if archs_only:
        rows = [r for r in json.loads(DOC_JSON.read_text())["rows"] if r["arch"] == f"v{default.htp_arch}"]
    for number, shape in enumerate([] if archs_only else bench_sizes.SHAPES):
        model = one_layer_export(shape)
        for context, prefill in POINTS:
            row = {"shape": shape, "context": context, "prefill": prefill, "arch": f"v{default.htp_arch}",
                   **ask(model, context, prefill)}
            if number == 0:
                row["build"] = full_build(model, context, prefill)
            rows.append(row)
            print(json.dumps(row), flush=True)
    shape = next(iter(bench_sizes.SHAPES))
    for name in ARCH_TARGETS:
        target = resolve(name)
        if target.htp_arch == default.htp_arch:
            continue
        activate(target)
        for context, prefill in (POINTS[0], POINTS[-1]):
            rows.append({"shape": shape, "context": context, "prefill": prefill, "arch": f"v{target.htp_arch}",
                         **ask(one_layer_export(shape), context, prefill)})
            print(json.dumps(rows[-1]), flush=True)
    activate(default)
    return {"onnxruntime": onnxruntime.__version__, "onnxruntime_qnn": onnxruntime_qnn.__version__,
            "target": default.as_dict(), "block_rows": BLOCK_ROWS, "vocab": VOCAB, "rows": rows,
            "arch_targets": {f"v{resolve(n).htp_arch}": resolve(n).product for n in ARCH_TARGETS}}


def _yes(value) -> str:
    return {True: "yes", False: "**no**", None: "-"}[value]


def render(doc: dict) -> str:
    target = doc["target"]
    lines = ["# int4 weights in blocks on the HTP", "",
             f"Written by `python tools/probe_int4_blocks.py`; every figure is in `docs/int4_blocks.json` "
             f"(onnxruntime {doc['onnxruntime']}, onnxruntime-qnn {doc['onnxruntime_qnn']}).", "",
             ("`qnnpasses llm --precision w4a16` quantizes int4 weights in blocks of "
              f"{doc['block_rows']} input rows per scale (the more accurate grid) where the HTP prepares them, and with one "
              "scale per output channel where it does not: before quantizing, it cuts the pair's prefill graph after "
              "the first layer (the token embedding and the first layer, to the end of its MLP), quantizes that as the "
              "pair will be (weights rounded to nearest on min/max scales, activations calibrated on one call) and has "
              "the HTP prepare it in a child process (`qnnpasses/llm/int4_blocks.py`); the report records the answer under "
              "`quantization.int4_blocks`. `--int4-blocks B|none` skips the question."), "",
             (f"Here that probe runs on one-layer decoders with the layer shapes of the models in the first column "
              f"(random init, vocabulary {doc['vocab']:,}: a token embedding smaller than the originals', and no "
              "lm_head in the piece), "
              "exported by transformers' TorchScript path with a KV cache, in integer mode with the graph-boundary "
              f"Q/DQ on the HTP, for {target['product']} (HTP v{str(target['htp_arch']).lstrip('v')}) and, at the easiest and the "
              "hardest point, the other HTP archs. *Pair compiles* builds the one-layer pair in full with "
              f"`--int4-blocks {doc['block_rows']}` and compiles both graphs: where it fails, the probe must have "
              "refused the blocks."), "",
             "| layer shape | HTP | context | prefill | blocks prepare | per channel prepares | the backend's error | "
             "pair compiles (blocks) | probe s |",
             "|---|---|---:|---:|---|---|---|---|---:|"]
    for row in doc["rows"]:
        build = row.get("build")
        compiled = "-" if build is None else _yes(build["compiled"])
        lines.append(f"| {row['shape']} | {row['arch']} | {row['context']} | {row['prefill']} | {_yes(row['blocks'])} | "
                     f"{_yes(row['per_channel'])} | {row['error'] or ''} | {compiled} | {row['seconds']:.1f} |")
    agree = [r for r in doc["rows"] if "build" in r]
    same = sum(r["build"]["compiled"] == r["blocks"] for r in agree)
    default = [r for r in doc["rows"] if r["arch"] == f"v{str(target['htp_arch']).lstrip('v')}"]
    failed = sum(r["blocks"] is False for r in default)
    lines += ["", f"The probe's answer and the full pair's compile agree at {same} of {len(agree)} points. On "
              f"HTP v{str(target['htp_arch']).lstrip('v')}, blocks fail at {failed} of {len(default)} points, with no "
              "order in context or prefill that a rule could follow: the build asks."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``--doc-only``: rewrite the .md from the .json; ``--archs``: measure the other archs' rows again."""
    args = list(sys.argv[1:] if argv is None else argv)
    archs = "--archs" in args
    return write_docs(lambda: measure(archs_only=archs), render, DOC_JSON, DOC_MD,
                      [a for a in args if a != "--archs"])


if __name__ == "__main__":
    sys.exit(main())
