"""``qnnpasses partition``: split a model into HTP and CPU sub-models and prove the chain equal.

Writes ``DIR/plan.json`` (partitions in execution order), one ONNX model per partition and
``DIR/partitions.png``/``.svg``.  ``--check`` runs the sub-models in order — HTP partitions on the
real QNN HTP backend in fp16 when it is available (or on the CPU with ``--on cpu``)
— and compares the outputs with the original model's on the CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

from qnnpasses.commands.common import (
    add_deprecated,
    add_format_arg,
    add_on_arg,
    add_shape_arg,
    inputs_static,
    load_shaped,
    shaped_path,
)
from qnnpasses.errors import BackendUnavailableError, BadInputError, CheckFailedError
from qnnpasses.units import fmt_bytes, fmt_flops, parse_size
from qnnpasses.wording import explain

def _names(text: str | None) -> tuple[str, ...]:
    return tuple(n.strip() for n in (text or "").split(",") if n.strip())


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "partition", help="split a model into HTP and CPU sub-models, with a plan and a picture",
        description="Split a model into sub-models that run on the HTP and on the CPU, in execution order: "
                    "DIR/plan.json, one ONNX model per partition and DIR/partitions.png/.svg.  --check runs the "
                    "chain and compares it with the original.")
    p.add_argument("model", help="ONNX model (never modified)")
    p.add_argument("--out-dir", metavar="DIR", help="folder to write the plan, the sub-models and the picture into")
    add_deprecated(p, "-o", "out_dir", "--out-dir VALUE")
    add_deprecated(p, "--output", "out_dir", "--out-dir VALUE")
    p.add_argument("--backend", choices=("htp",), default="htp", help="accelerator to partition for")
    p.add_argument("--max-part-bytes", default="2G", metavar="SIZE",
                   help="budget of weights + peak activations per HTP partition (default 2G; 0 = no limit)")
    p.add_argument("--placement", choices=("table", "htp"), default="table",
                   help="who decides where each node goes: the measured op-support table (default), or the real "
                        "HTP backend (loads the model once)")
    add_deprecated(p, "--real", "placement", "--placement htp", value="htp")
    p.add_argument("--cpu-ops", metavar="OP,...", help="force these op types onto the CPU")
    p.add_argument("--cpu-nodes", metavar="NAME,...", help="force these nodes onto the CPU")
    p.add_argument("--keep-islands", action="store_true", help="keep small HTP islands on the HTP whatever they cost")
    p.add_argument("--cpu-gflops", type=float, help="cost model: CPU GFLOP/s (default 50)")
    p.add_argument("--htp-gflops", type=float, help="cost model: HTP GFLOP/s (default 2000)")
    p.add_argument("--link-gbps", type=float, help="cost model: CPU<->HTP copy GB/s (default 10)")
    p.add_argument("--launch-us", type=float, help="cost model: fixed cost of one HTP graph run in us (default 10)")
    p.add_argument("--check", action="store_true", help="run the partitions in order and compare with the original")
    add_on_arg(p, ("htp", "cpu"), "htp", "where --check runs the HTP partitions (default htp; cpu when the "
                                         "backend is missing)")
    add_deprecated(p, "--check-on", "on", "--on VALUE")
    p.add_argument("--inputs", metavar="X.npz", help="inputs for --check (default: seeded random inputs)")
    add_shape_arg(p)
    p.add_argument("--as-written", action="store_true",
                   help="partition the graph exactly as written, before onnxruntime folds its constants on load "
                        "(by default the graph every session hands the HTP is partitioned)")
    p.add_argument("--no-picture", action="store_true", help="do not draw partitions.png/.svg")
    add_format_arg(p)
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


def _placement(model: str, *, optimize: bool = True):
    from qnnpasses.backends.htp import htp_available, probe_placement

    if not htp_available():
        raise BackendUnavailableError("--placement htp needs onnxruntime-qnn with a working QNN HTP backend")
    from qnnpasses.progress import step

    step("asking the HTP backend where each node runs")
    placement = probe_placement(model, optimize=optimize)
    if placement.error and not placement.validation:
        raise BadInputError(f"the HTP backend could not load {model}: {placement.error}")
    return placement


def main(args) -> int:
    from qnnpasses.backends.cpu import check_inputs, load_inputs, make_inputs
    from qnnpasses.partition import make_plan, write_partitions
    from qnnpasses.partition.graph import build_node_graph

    if not args.out_dir:
        raise BadInputError("partition needs --out-dir DIR (the folder to write the partitions into)")
    options = _options(args)
    ir = load_shaped(args)
    written_nodes, folded, view_note = len(ir.graph.nodes), [], ""
    if not args.as_written:  # the graph every onnxruntime session hands the EP (constants folded)
        from qnnpasses.op_support.deployed import deployed_view

        with shaped_path(args) as path:
            view = deployed_view(path, [n.name for n in ir.graph.nodes])
        if view.ir is not None:
            view.ir.path = Path(args.model)
            ir, folded = view.ir, view.folded
        view_note = view.note
    ng = build_node_graph(ir)
    placement = None
    if args.placement == "htp":
        with shaped_path(args) as path:
            placement = _placement(path, optimize=not args.as_written)
    plan = make_plan(ir, options, placement=placement, node_graph=ng)
    out = Path(args.out_dir)
    write_partitions(ir, plan, out, node_graph=ng, picture=not args.no_picture)
    report = {"plan": str(out / "plan.json"), "counts": plan.counts()}
    check = None
    if args.check:
        from qnnpasses.partition.check import check_plan

        inputs = load_inputs(args.inputs) if args.inputs else make_inputs(ir)
        check_inputs(ir, inputs)
        with shaped_path(args) as path:
            check = check_plan(plan, out, path, inputs, on=args.on)
        report["check"] = check.to_dict()
        data = json.loads((out / "plan.json").read_text())
        data["check"] = report["check"]
        (out / "plan.json").write_text(json.dumps(data, indent=2) + "\n")
    report["nodes"] = node_accounting(ir, plan)
    report["nodes"].update(as_written=written_nodes, folded_on_load=len(folded), view_note=view_note)
    print(json.dumps(report, indent=2) if args.format == "json" else render_text(plan, out, check, report["nodes"],
                                                                                      static_inputs=inputs_static(ir)))
    if check is not None and not check.ok:
        raise CheckFailedError("the chained partitions do not reproduce the original outputs: "
                               + "; ".join(f"{k}: {v['reason']}" for k, v in check.outputs.items() if not v["ok"]))
    return 0


def node_accounting(ir, plan) -> dict:
    """Where every node of the model went: into a partition, into the partitions as a constant
    computation, or nowhere (it feeds no output)."""
    from collections import Counter

    placed = {n for p in plan.partitions for n in p.nodes}
    constant = {n for p in plan.partitions for n in p.constant_nodes} - placed
    nodes = list(ir.graph.nodes)
    unused = [n for n in nodes if n.name not in placed and n.name not in constant]
    ops = Counter(n.op for n in nodes if n.name in constant)
    return {"total": len(nodes), "in_partitions": len(placed), "constant_only": len(constant),
            "constant_only_ops": dict(ops.most_common()), "unused": [n.name for n in unused]}


def render_text(plan, out: Path, check, nodes: dict | None = None, *, static_inputs: bool = False) -> str:
    from qnnpasses.partition.picture import _span  # the picture module pulls in the partitioner

    counts = ", ".join(f"{n} {b.upper()}" for b, n in sorted(plan.counts().items()))
    lines = [f"{plan.model}: {counts} partition(s) (placement from the {plan.source}) -> {out / 'plan.json'}"]
    if nodes and nodes.get("folded_on_load"):
        lines.append(f"  onnxruntime folds {nodes['folded_on_load']} of the {nodes['as_written']} nodes when it loads "
                     "the model (constant and shape arithmetic); the rest is partitioned (--as-written: all of them)")
    elif nodes and nodes.get("view_note"):
        lines.append(f"  note: {nodes['view_note']}")
    if nodes:
        text = f"  {nodes['total']} nodes: {nodes['in_partitions']} in partitions"
        if nodes["constant_only"]:
            ops = ", ".join(f"{op} x{c}" for op, c in list(nodes["constant_only_ops"].items())[:4])
            text += (f", {nodes['constant_only']} compute only constants ({ops}{', ...' if len(nodes['constant_only_ops']) > 4 else ''})"
                     " and are copied into the partitions that read them")
        if nodes["unused"]:
            text += f", {len(nodes['unused'])} feed no output and are dropped"
        lines.append(text)
    for p in plan.partitions:
        lines.append(f"  #{p.id} {p.backend.upper()}: {len(p.nodes)} nodes, layers {_span(p.layers)}, "
                     f"weights {fmt_bytes(p.weight_bytes)}, {fmt_flops(p.flops)}, in {fmt_bytes(p.boundary_bytes['in'])}"
                     f", out {fmt_bytes(p.boundary_bytes['out'])} -> {p.file}")
        for op, why in list(p.cpu_reasons.items())[:3]:
            lines.append(f"      {op}: {explain(why, static_inputs=static_inputs)}")
    for island in plan.islands_moved_to_cpu:
        lines.append(f"  kept on CPU: {len(island['nodes'])}-node HTP island (saves {island['saving_us']} us, "
                     f"transfer costs {island['transfer_us']} us)")
    for split in plan.memory_splits:
        lines.append(f"  memory budget {fmt_bytes(split['budget'])}: split into {split['pieces']} pieces "
                     f"(~{', '.join(fmt_bytes(s) for s in split['estimated_bytes'])})")
    lines.extend(f"  note: {n}" for n in plan.notes)
    pictures = plan.options.get("picture")
    if pictures:
        lines.append("  picture: " + ", ".join(str(out / name) for name in pictures))
    if check is not None:
        status = "OK" if check.ok else "FAILED"
        for name, o in check.outputs.items():
            lines.append(f"  check ({check.on}) {status}: {name} max abs {o['max_abs']:.3g}, cosine {o['cosine']:.7f}")
    return "\n".join(lines)
