"""Side by side on the real HTP backend: raw export, onnxsim, onnxslim, onnxruntime's
``qnn_preprocess_model``, and ``qnnpasses run --pipeline htp-llm``.

For every fixture and variant it reports, from one verbose, profiled session in a
child process (``qnnpasses.backends.htp.probe_placement``): whether the model finalizes and
runs, the number of QNN partitions and CPU nodes, the op count of the composed QNN
graph and how many of those ops only move data, and the cosine of the HTP (fp16)
outputs against the fp32 CPU reference.

    python tools/bench_htp.py                       # every committed fixture
    python tools/bench_htp.py --only llama_gqa_ts bert_dynamo --json out/bench_htp.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"

# QNN op types that only move or re-type data (no arithmetic).
DATA_MOVEMENT = frozenset({
    "Reshape", "Transpose", "StridedSlice", "Concat", "Gather", "GatherElements", "GatherNd", "Cast", "Convert",
    "Split", "Tile", "Pad", "ExpandDims", "Squeeze", "DepthToSpace", "SpaceToDepth", "Resize",
})


@dataclass
class Row:
    fixture: str
    variant: str
    ok: bool
    partitions: int | None = None
    cpu_nodes: int | None = None
    qnn_ops: int | None = None
    data_movement: int | None = None
    cosine: float | None = None
    seconds: float | None = None
    error: str = ""


# --------------------------------------------------------------------------- variants


def _raw(src: Path, dst: Path) -> None:
    dst.write_bytes(src.read_bytes())


def _onnxsim(src: Path, dst: Path) -> None:
    import onnxsim

    model, ok = onnxsim.simplify(onnx.load(src))
    if not ok:
        raise RuntimeError("onnxsim could not validate its result")
    onnx.save(model, dst)


def _onnxslim(src: Path, dst: Path) -> None:
    import onnxslim

    onnx.save(onnxslim.slim(onnx.load(src)), dst)


def _ort_preprocess(src: Path, dst: Path) -> None:
    from onnxruntime.quantization.execution_providers.qnn import qnn_preprocess_model

    if not qnn_preprocess_model(str(src), str(dst)):
        _raw(src, dst)  # "nothing to do": the model is what the backend gets


def _htp_llm(src: Path, dst: Path) -> None:
    from qnnpasses.ir.load import load_model
    from qnnpasses.ir.model import save_model
    from qnnpasses.passmanager.manager import PassManager
    from qnnpasses.passmanager.named import get_pipeline

    ir = load_model(src)
    PassManager(get_pipeline("htp-llm")).run(ir)
    save_model(ir, dst)


VARIANTS: dict[str, Callable[[Path, Path], None]] = {
    "raw": _raw,
    "onnxsim": _onnxsim,
    "onnxslim": _onnxslim,
    "ort-qnn-preprocess": _ort_preprocess,
    "htp-llm": _htp_llm,
}


# --------------------------------------------------------------------------- measuring


def _inputs_for(model_path: Path, fixture: str) -> dict[str, np.ndarray]:
    """The fixture's inputs in the dtypes this variant declares (a pass may narrow int64)."""
    with np.load(FIXTURES / f"{fixture}.inputs.npz") as data:
        inputs = {k: data[k] for k in data.files}
    declared = {i.name: onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
                for i in onnx.load(model_path, load_external_data=False).graph.input}
    return {k: v.astype(declared.get(k, v.dtype)) for k, v in inputs.items() if k in declared}


def _cosine(work: Path, fixture: str) -> float | None:
    from qnnpasses.backends.cpu import cosine_similarity

    outputs = work / "outputs.npz"
    if not outputs.exists():
        return None
    with np.load(FIXTURES / f"{fixture}.outputs.npz") as ref, np.load(outputs) as got:
        return min(cosine_similarity(got[k], ref[k]) for k in ref.files if k in got.files)


def measure(fixture: str, variant: str, tmp: Path) -> Row:
    from qnnpasses.backends.htp import probe_placement

    src = FIXTURES / f"{fixture}.onnx"
    dst = tmp / f"{fixture}.{variant}.onnx"
    start = time.perf_counter()
    try:
        VARIANTS[variant](src, dst)
    except Exception as exc:  # a peer tool failing is a result, not a crash of the benchmark
        return Row(fixture, variant, False, error=f"{variant} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    seconds = time.perf_counter() - start
    work = tmp / f"{fixture}.{variant}.probe"
    placement = probe_placement(dst, _inputs_for(dst, fixture), keep_dir=work)
    ops = placement.qnn_graph_ops
    return Row(
        fixture, variant, placement.ok,
        partitions=placement.qnn_partitions, cpu_nodes=len(placement.cpu_nodes),
        qnn_ops=ops["total"] or None,
        data_movement=sum(n for op, n in ops["by_type"].items() if op in DATA_MOVEMENT) if ops["total"] else None,
        cosine=_cosine(work, fixture) if placement.ok else None,
        seconds=round(seconds, 2), error=(placement.error or "")[:160],
    )


# --------------------------------------------------------------------------- reporting


def _cell(value, fmt="{}") -> str:
    return "–" if value is None else fmt.format(value)


def markdown(rows: list[Row]) -> str:
    lines = ["| fixture | variant | runs | QNN partitions | CPU nodes | QNN ops | data movement | cosine | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.fixture} | {r.variant} | {'yes' if r.ok else 'no'} | {_cell(r.partitions)} | "
                     f"{_cell(r.cpu_nodes)} | {_cell(r.qnn_ops)} | {_cell(r.data_movement)} | "
                     f"{_cell(r.cosine, '{:.6f}')} | {r.error.replace('|', '/')[:80]} |")
    return "\n".join(lines)


def op_ratio_summary(rows: list[Row]) -> str:
    """htp-llm's composed QNN op count over onnxslim's, per fixture."""
    by = {(r.fixture, r.variant): r for r in rows}
    lines = ["| fixture | htp-llm QNN ops | onnxslim QNN ops | ratio |", "|---|---|---|---|"]
    for fixture in sorted({r.fixture for r in rows}):
        ours, slim = by.get((fixture, "htp-llm")), by.get((fixture, "onnxslim"))
        if ours and slim and ours.qnn_ops and slim.qnn_ops:
            lines.append(f"| {fixture} | {ours.qnn_ops} | {slim.qnn_ops} | {ours.qnn_ops / slim.qnn_ops:.2f} |")
        else:
            lines.append(f"| {fixture} | {_cell(ours and ours.qnn_ops)} | {_cell(slim and slim.qnn_ops)} | – |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="fixture names (default: every fixture in the manifest)")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    parser.add_argument("--update", action="store_true",
                        help="measure only --variants/--only, keep the other rows of docs/bench_htp.json, "
                             "rewrite it and docs/bench_htp.md")
    args = parser.parse_args(argv)
    from qnnpasses.backends.htp import htp_available

    if not htp_available():
        print("onnxruntime-qnn's HTP backend is not available", file=sys.stderr)
        return 2
    manifest = json.loads((FIXTURES / "manifest.json").read_text())
    fixtures = args.only or sorted(manifest["fixtures"])
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_htp_") as tmp:
        for fixture in fixtures:
            for variant in args.variants:
                row = measure(fixture, variant, Path(tmp))
                rows.append(row)
                print(f"{fixture:<24} {variant:<20} ok={row.ok} parts={row.partitions} cpu={row.cpu_nodes} "
                      f"ops={row.qnn_ops} move={row.data_movement} cos={row.cosine} {row.error[:60]}",
                      file=sys.stderr, flush=True)
    if args.update:  # the measured rows replace theirs; the order is the document's
        docs = ROOT / "docs"
        fresh = {(r.fixture, r.variant): r for r in rows}
        rows = [fresh.pop((old["fixture"], old["variant"]), None) or Row(**old)
                for old in json.loads((docs / "bench_htp.json").read_text())] + list(fresh.values())
        args.json = docs / "bench_htp.json"
        (docs / "bench_htp.md").write_text(f"{markdown(rows)}\n\n{op_ratio_summary(rows)}\n")
    print(markdown(rows))
    print()
    print(op_ratio_summary(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
