"""partition: cycle-free HTP/CPU partitions, island cost model, memory-budget splits, and chains
of extracted sub-models that reproduce the original (CPU exactly, HTP within fp16)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import fixture_path, requires_htp
from onnx import TensorProto, helper, numpy_helper

from qnnpasses.backends.cpu import make_inputs, run_cpu
from qnnpasses.cli import main as cli_main
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import save_model
from qnnpasses.partition import PartitionOptions, make_plan, write_partitions
from qnnpasses.partition.check import check_plan, run_chain
from qnnpasses.partition.graph import build_node_graph
from qnnpasses.partition.regions import form_partitions
from qnnpasses.passmanager.api import PassContext
from qnnpasses.passmanager.manager import PassManager, RunConfig
from qnnpasses.passmanager.spec import parse_pipeline

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- helpers


def _model(path: Path, nodes, weights: dict[str, np.ndarray], x_shape=(1, 64, 256), y="y") -> Path:
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()]
    graph = helper.make_graph(nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT, list(x_shape))], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _erf_residual(path: Path) -> Path:
    """x -> MatMul -> h; Erf(h) + h -> MatMul -> y: a lone Erf (the HTP rejects it) on a residual."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"], name="mm1"),
             helper.make_node("Erf", ["h"], ["e"], name="erf"),
             helper.make_node("Add", ["e", "h"], ["r"], name="res"),
             helper.make_node("MatMul", ["r", "W2"], ["y"], name="mm2")]
    return _model(path, nodes, {"W1": rng.standard_normal((256, 256)) * 0.05, "W2": rng.standard_normal((256, 256)) * 0.05})


@pytest.fixture(scope="module")
def bert_simplified(tmp_path_factory) -> Path:
    """bert_ts after `simplify`: Erf-based GeLU left in both layers (Erf is not in the HTP table)."""
    ir = load_model(fixture_path("bert_ts"))
    PassManager(parse_pipeline("simplify"), RunConfig(), [], PassContext()).run(ir)
    return save_model(ir, tmp_path_factory.mktemp("bert") / "bert_s.onnx")


@pytest.fixture(scope="module")
def decoder8(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("llm8") / "model.onnx"
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_big_llm.py"), "--layers", "8", "--hidden", "256",
                    "--heads", "4", "--kv-heads", "2", "--intermediate", "512", "--vocab", "256", "--seq", "16",
                    "--weights", "random", "--dtype", "float32", "--out", str(out)], check=True, capture_output=True)
    return out


# --------------------------------------------------------------------------- regions


def test_residual_around_a_cpu_node_gives_htp_cpu_htp_not_a_cycle(tmp_path):
    ir = load_model(_erf_residual(tmp_path / "m.onnx"))
    plan = make_plan(ir, PartitionOptions(keep_islands=True))
    assert [p.backend for p in plan.partitions] == ["htp", "cpu", "htp"]
    assert [p.nodes for p in plan.partitions] == [["mm1"], ["erf"], ["res", "mm2"]]
    # the residual 'h' skips the CPU partition: it is an output of #0 and an input of #2
    assert plan.partitions[0].outputs == ["h"] and set(plan.partitions[2].inputs) == {"e", "h"}


def test_merging_two_regions_is_refused_when_it_closes_a_cycle():
    import networkx as nx

    dag = nx.DiGraph([(0, 1), (1, 2), (0, 2), (3, 4)])   # 0,2 htp around cpu 1; 3->4 an independent htp chain
    parts = form_partitions(dag, {0: "htp", 1: "cpu", 2: "htp", 3: "htp", 4: "htp"})
    by_backend = sorted((b, sorted(m)) for b, m in parts)
    # 3-4 merges with one of the HTP regions (no path between them), never 0 with 2
    assert len(parts) == 3 and ("cpu", [1]) in by_backend
    assert not any({0, 2} <= set(m) for _, m in parts)
    quotient = nx.DiGraph()
    owner = {v: i for i, (_, m) in enumerate(parts) for v in m}
    quotient.add_edges_from((owner[u], owner[v]) for u, v in dag.edges if owner[u] != owner[v])
    assert nx.is_directed_acyclic_graph(quotient)


def test_tiny_htp_island_between_cpu_ops_stays_on_cpu(tmp_path):
    nodes = [helper.make_node("Erf", ["x"], ["a"], name="erf1"),
             helper.make_node("Add", ["a", "a"], ["b"], name="tiny_add"),
             helper.make_node("Erf", ["b"], ["y"], name="erf2")]
    ir = load_model(_model(tmp_path / "island.onnx", nodes, {}))
    plan = make_plan(ir)
    assert [p.backend for p in plan.partitions] == ["cpu"]
    assert plan.islands_moved_to_cpu[0]["nodes"] == ["tiny_add"]
    island = plan.islands_moved_to_cpu[0]
    assert island["saving_us"] < island["transfer_us"]
    kept = make_plan(ir, PartitionOptions(keep_islands=True))
    assert [p.backend for p in kept.partitions] == ["cpu", "htp", "cpu"]


def test_cpu_ops_and_nodes_force_offload(tmp_path):
    ir = load_model(_erf_residual(tmp_path / "m.onnx"))
    plan = make_plan(ir, PartitionOptions(cpu_nodes=("mm2",), keep_islands=True))
    assert plan.partitions[-1].backend == "cpu" and "mm2" in plan.partitions[-1].nodes
    plan = make_plan(ir, PartitionOptions(cpu_ops=("MatMul",)))
    assert [p.backend for p in plan.partitions] == ["cpu"]


# --------------------------------------------------------------------------- real fixtures


# The HTP runs BERT's Erf-based GeLU (its EP fuses the pattern), so the table keeps it on
# the HTP; forcing the Erf nodes onto the CPU (progressive offload) gives the split to test.
BERT_OFFLOAD = PartitionOptions(keep_islands=True, cpu_ops=("Erf",))


def test_bert_splits_around_erf_and_the_cpu_chain_is_exact(bert_simplified, tmp_path):
    ir = load_model(bert_simplified)
    plan = make_plan(ir, BERT_OFFLOAD)
    parts = plan.partitions
    if parts[0].op_types == {"Cast": 1}:   # the mask's int64->bool Cast, where the table rejects it
        parts = parts[1:]
    assert [p.backend for p in parts] == ["htp", "cpu", "htp", "cpu", "htp"]   # layer 0, Erf, layer 1, Erf, tail
    assert [p.op_types for p in parts if p.backend == "cpu"] == [{"Erf": 1}, {"Erf": 1}]
    write_partitions(ir, plan, tmp_path)
    inputs = make_inputs(ir)
    result = check_plan(plan, tmp_path, bert_simplified, inputs, on="cpu")
    assert result.ok and result.outputs["last_hidden_state"]["max_abs"] <= 1e-5
    # every sub-model is a valid stand-alone model whose I/O are the plan's boundary tensors
    for part in plan.partitions:
        proto = onnx.load(tmp_path / part.file)
        onnx.checker.check_model(proto)
        assert [i.name for i in proto.graph.input] == part.inputs
        assert [o.name for o in proto.graph.output] == part.outputs


@requires_htp
def test_bert_chain_on_real_htp_matches(bert_simplified, tmp_path):
    ir = load_model(bert_simplified)
    plan = make_plan(ir, BERT_OFFLOAD)
    write_partitions(ir, plan, tmp_path, picture=False)
    result = check_plan(plan, tmp_path, bert_simplified, make_inputs(ir), on="htp")
    assert result.on == "htp" and [r["ran_on"] for r in result.ran].count("htp") == 3 == plan.counts()["htp"]
    assert result.ok and result.outputs["last_hidden_state"]["cosine"] >= 0.999


@pytest.fixture(scope="module")
def decoder_split(decoder8, tmp_path_factory):
    """The 8-layer decoder planned with a budget of ~1/3.5 of its size, written out."""
    ir = load_model(decoder8)
    ng = build_node_graph(ir)
    whole = make_plan(ir, node_graph=ng).partitions
    assert len(whole) == 1
    total = whole[0].weight_bytes + whole[0].peak_activation_bytes
    budget = int(total / 3.5)
    plan = make_plan(ir, PartitionOptions(max_part_bytes=budget), node_graph=ng)
    out = tmp_path_factory.mktemp("llm8_parts")
    write_partitions(ir, plan, out, node_graph=ng)
    return ir, plan, out, budget


def test_decoder_splits_into_balanced_consecutive_layer_ranges(decoder8, decoder_split):
    ir, plan, out, budget = decoder_split
    parts = plan.partitions
    assert len(parts) == 4 and all(p.backend == "htp" for p in parts)
    sizes = [p.weight_bytes + p.peak_activation_bytes for p in parts]
    assert max(sizes) <= budget and max(sizes) / min(sizes) <= 1.5
    layer_ranges = [[int(x) for x in p.layers if x.isdigit()] for p in parts]
    assert [r for rs in layer_ranges for r in rs] == list(range(8))            # consecutive, each layer once
    # cuts fall on the residual stream: one [1,16,256] float tensor crosses each cut
    assert all(len(p.inputs) == 1 and p.boundary_bytes["in"] == 16 * 256 * 4 for p in parts[1:])
    assert all((out / f"part{i:02d}_htp.onnx.data").exists() for i in range(4))   # weights streamed external
    inputs = make_inputs(ir)
    reference = run_cpu(decoder8, inputs)
    env = run_chain(plan, out, inputs, on="cpu")
    assert np.max(np.abs(env["logits"] - reference["logits"])) <= 1e-5
    saved = json.loads((out / "plan.json").read_text())
    assert [p["id"] for p in saved["partitions"]] == [0, 1, 2, 3] and saved["memory_splits"][0]["pieces"] == 4


@requires_htp
def test_decoder_pieces_chain_on_real_htp(decoder8, decoder_split):
    ir, plan, out, _ = decoder_split
    result = check_plan(plan, out, decoder8, make_inputs(ir), on="htp")
    assert [r["ran_on"] for r in result.ran] == ["htp"] * 4
    assert result.ok and result.outputs["logits"]["cosine"] >= 0.999


@requires_htp
def test_real_placement_and_cli_check_on_htp(tmp_path, capsys):
    model = _erf_residual(tmp_path / "m.onnx")
    code = cli_main(["partition", str(model), "-o", str(tmp_path / "out"), "--real", "--check", "--format", "json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["source"] == "real" and [p["backend"] for p in plan["partitions"]] == ["htp", "cpu", "htp"]
    assert "Erf" in plan["partitions"][1]["cpu_reasons"]
    assert report["check"]["ok"] and report["check"]["outputs"]["y"]["cosine"] >= 0.999


def test_cli_writes_plan_models_and_picture(bert_simplified, tmp_path, capsys):
    out = tmp_path / "out"
    code = cli_main(["partition", str(bert_simplified), "-o", str(out), "--check", "--check-on", "cpu",
                     "--max-part-bytes", "1G"])
    assert code == 0
    text = capsys.readouterr().out
    assert "check (cpu) OK" in text
    plan = json.loads((out / "plan.json").read_text())
    for key in ("id", "backend", "nodes", "inputs", "outputs", "weight_bytes", "flops", "boundary_bytes"):
        assert all(key in p for p in plan["partitions"])
    assert plan["check"]["ok"] and all((out / p["file"]).exists() for p in plan["partitions"])
    svg = (out / "partitions.svg").read_text()
    # one block per partition in execution order, labelled with its backend and node count
    for p in plan["partitions"]:
        assert f"#{p['id']} {p['backend'].upper()}: {len(p['nodes'])} nodes" in svg
    assert (out / "partitions.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli_main(["partition", str(bert_simplified), "-o", str(out), "--max-part-bytes", "lots"]) == 2
