"""``qnnpasses partition``: split a model into HTP and CPU sub-models and prove the chain equal.

Writes ``DIR/plan.json`` (partitions in execution order), one ONNX model per partition and
``DIR/partitions.svg``.  ``--check`` runs the sub-models in order — HTP partitions on the
real QNN HTP backend in fp16 when it is available (or on the CPU with ``--check-on cpu``)
— and compares the outputs with the original model's on the CPU.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from qnnpasses.errors import BackendUnavailableError, BadInputError, CheckFailedError
from qnnpasses.ir.load import load_model

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``2G``, ``512MiB``, ``1.5g``, ``6000000`` -> bytes (binary units)."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise BadInputError(f"--max-part-bytes expects a size such as 2G, 512M or 6000000 (got '{text}')")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _names(text: str | None) -> tuple[str, ...]:
    return tuple(n.strip() for n in (text or "").split(",") if n.strip())


def register(subparsers) -> None:
    p = subparsers.add_parser("partition", help="split a model into HTP/CPU sub-models (plan.json + ONNX per partition)")
    p.add_argument("model", help="ONNX model (never modified)")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="output folder")
    p.add_argument("--backend", choices=("htp",), default="htp", help="accelerator backend (op-support table)")
    p.add_argument("--max-part-bytes", default="2G", metavar="SIZE",
                   help="budget of weights + peak activations per HTP partition (default 2G; 0 = no limit)")
    p.add_argument("--real", action="store_true", help="place nodes by the real QNN HTP backend's verdict, not the table")
    p.add_argument("--cpu-ops", metavar="OP,...", help="force these op types onto the CPU")
    p.add_argument("--cpu-nodes", metavar="NAME,...", help="force these nodes onto the CPU")
    p.add_argument("--keep-islands", action="store_true", help="keep small HTP islands on the HTP whatever they cost")
    p.add_argument("--cpu-gflops", type=float, help="cost model: CPU GFLOP/s (default 50)")
    p.add_argument("--htp-gflops", type=float, help="cost model: HTP GFLOP/s (default 2000)")
    p.add_argument("--link-gbps", type=float, help="cost model: CPU<->HTP copy GB/s (default 10)")
    p.add_argument("--launch-us", type=float, help="cost model: fixed cost of one HTP graph run in us (default 10)")
    p.add_argument("--check", action="store_true", help="run the partitions in order and compare with the original")
    p.add_argument("--check-on", choices=("htp", "cpu"), default="htp",
                   help="where --check runs HTP partitions (htp falls back to cpu when the backend is missing)")
    p.add_argument("--inputs", metavar="X.npz", help="inputs for --check (default: seeded random inputs)")
    p.add_argument("--no-picture", action="store_true", help="do not draw partitions.svg")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.set_defaults(func=main)


def _options(args):
    from dataclasses import replace

    from qnnpasses.partition import CostModel, PartitionOptions

    cost = CostModel()
    overrides = {k: getattr(args, k) for k in ("cpu_gflops", "htp_gflops", "link_gbps", "launch_us")
                 if getattr(args, k) is not None}
    if any(v <= 0 for v in overrides.values()):
        raise BadInputError("cost model rates must be positive")
    return PartitionOptions(backend=args.backend, cpu_ops=_names(args.cpu_ops), cpu_nodes=_names(args.cpu_nodes),
                            max_part_bytes=parse_size(args.max_part_bytes), cost=replace(cost, **overrides),
                            keep_islands=args.keep_islands)


def _placement(model: str):
    from qnnpasses.backends.htp import htp_available, probe_placement

    if not htp_available():
        raise BackendUnavailableError("--real needs onnxruntime-qnn with a working QNN HTP backend")
    placement = probe_placement(model, optimize=False)
    if placement.error and not placement.validation:
        raise BadInputError(f"the HTP backend could not load {model}: {placement.error}")
    return placement


def main(args) -> int:
    from qnnpasses.backends.cpu import check_inputs, load_inputs, make_inputs
    from qnnpasses.partition import make_plan, write_partitions
    from qnnpasses.partition.graph import build_node_graph

    options = _options(args)
    ir = load_model(args.model)
    ng = build_node_graph(ir)
    plan = make_plan(ir, options, placement=_placement(args.model) if args.real else None, node_graph=ng)
    out = Path(args.output)
    write_partitions(ir, plan, out, node_graph=ng, picture=not args.no_picture)
    report = {"plan": str(out / "plan.json"), "counts": plan.counts()}
    check = None
    if args.check:
        from qnnpasses.partition.check import check_plan

        inputs = load_inputs(args.inputs) if args.inputs else make_inputs(ir)
        check_inputs(ir, inputs)
        check = check_plan(plan, out, args.model, inputs, on=args.check_on)
        report["check"] = check.to_dict()
        data = json.loads((out / "plan.json").read_text())
        data["check"] = report["check"]
        (out / "plan.json").write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps(report, indent=2) if args.format == "json" else render_text(plan, out, check))
    if check is not None and not check.ok:
        raise CheckFailedError("the chained partitions do not reproduce the original outputs: "
                               + "; ".join(f"{k}: {v['reason']}" for k, v in check.outputs.items() if not v["ok"]))
    return 0


def render_text(plan, out: Path, check) -> str:
    counts = ", ".join(f"{n} {b.upper()}" for b, n in sorted(plan.counts().items()))
    lines = [f"{plan.model}: {counts} partition(s) (placement from the {plan.source}) -> {out / 'plan.json'}"]
    for p in plan.partitions:
        layers = ",".join(p.layers[:6]) + ("..." if len(p.layers) > 6 else "")
        lines.append(f"  #{p.id} {p.backend.upper():3s} {len(p.nodes):5d} nodes  layers {layers:12s} "
                     f"weights {p.weight_bytes / 1e6:9.2f} MB  {p.flops / 1e6:10.2f} MFLOP  "
                     f"in {p.boundary_bytes['in'] / 1e3:8.1f} kB  out {p.boundary_bytes['out'] / 1e3:8.1f} kB  {p.file}")
        for op, why in list(p.cpu_reasons.items())[:3]:
            lines.append(f"       {op}: {why[:140]}")
    for island in plan.islands_moved_to_cpu:
        lines.append(f"  kept on CPU: {len(island['nodes'])}-node HTP island (saves {island['saving_us']} us, "
                     f"transfer costs {island['transfer_us']} us)")
    for split in plan.memory_splits:
        lines.append(f"  memory budget {split['budget']} B: split into {split['pieces']} pieces "
                     f"(~{', '.join(str(s) for s in split['estimated_bytes'])} B)")
    lines.extend(f"  note: {n}" for n in plan.notes)
    if check is not None:
        status = "OK" if check.ok else "FAILED"
        for name, o in check.outputs.items():
            lines.append(f"  check ({check.on}) {status}: {name} max abs {o['max_abs']:.3g}, cosine {o['cosine']:.7f}")
    return "\n".join(lines)
