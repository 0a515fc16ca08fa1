"""The HTP op-support table against the real backend.

The main test rebuilds every probe of the committed *holdout* suite (single-op models the
table was not written from), asks the checker, and compares with the verdict the real
QNN HTP backend gave (``tools/probe_results/htp_holdout.jsonl``).  It needs no backend.
The last tests ask the backend itself (skipped without onnxruntime-qnn).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from conftest import fixture_path
from onnx import TensorProto, helper
from qnnpasses.op_support.checker import check_graph, check_node, summarize
from qnnpasses.op_support.probe_models import ProbeSpec, build_model
from qnnpasses.op_support.table import load_table

from qnnpasses.backends.htp import parse_ep_log, probe_placement

HOLDOUT = Path(__file__).resolve().parents[1] / "tools" / "probe_results" / "htp_holdout.jsonl"
MIN_AGREEMENT = 0.95


def _records() -> list[dict]:
    return [json.loads(line) for line in HOLDOUT.read_text().splitlines() if line.strip()]


def _predict(record: dict, table: dict) -> tuple[bool, list[str]]:
    model = build_model(ProbeSpec.from_record(record))
    graph = gs.import_onnx(model)
    result = check_node(graph.nodes[0], table, opset=graph.opset)
    return result.supported, result.reasons


def test_checker_agrees_with_real_backend_on_holdout_suite():
    table = load_table("htp")
    records = _records()
    assert len(records) >= 300, "holdout suite too small to measure agreement"
    disagreements = []
    for rec in records:
        supported, reasons = _predict(rec, table)
        if supported != (rec["verdict"] == "htp"):
            disagreements.append(
                f"{rec['id']}: backend={rec['verdict']} ({rec['reason'][:90]}) "
                f"checker={'htp' if supported else 'cpu'} ({'; '.join(reasons)[:90]})"
            )
    agreement = 1 - len(disagreements) / len(records)
    print(f"\nchecker/backend agreement on {len(records)} holdout probes: {agreement:.1%}")
    for line in disagreements:
        print("  " + line)
    assert agreement >= MIN_AGREEMENT, f"agreement {agreement:.1%} < {MIN_AGREEMENT:.0%}:\n" + "\n".join(disagreements)


def test_holdout_records_rebuild_deterministically():
    rec = _records()[0]
    a = build_model(ProbeSpec.from_record(rec)).SerializeToString()
    b = build_model(ProbeSpec.from_record(rec)).SerializeToString()
    assert a == b


def _relu_erf_relu(tmp_path: Path) -> Path:
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu0"),
        helper.make_node("Erf", ["r"], ["e"], name="erf0"),
        helper.make_node("Relu", ["e"], ["y"], name="relu1"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "relu_erf_relu.onnx"
    onnx.save(onnx.shape_inference.infer_shapes(model), path)
    return path


def test_checker_predicts_partitions_of_relu_erf_relu(tmp_path):
    graph = gs.import_onnx(onnx.load(_relu_erf_relu(tmp_path)))
    results = check_graph(graph)
    assert [r.supported for r in results] == [True, False, True]
    summary = summarize(graph, results)
    assert summary.partitions == {"htp": 2, "cpu": 1}
    assert summary.by_op_type["Erf"] == {"supported": 0, "unsupported": 1}


def test_unknown_dtype_is_a_note_not_a_failure():
    x = gs.Variable("x", dtype=None, shape=[2, 3])
    y = gs.Variable("y", dtype=None, shape=[2, 3])
    result = check_node(gs.Node("Relu", "r", inputs=[x], outputs=[y]))
    assert result.supported
    assert any(n.startswith("unknown:") for n in result.notes)


def _no_shape_model(tmp_path: Path) -> Path:
    """Relu -> Sigmoid on an input declared without any shape."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, None)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu0"), helper.make_node("Sigmoid", ["r"], ["y"], name="sig0")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "no_shape.onnx"
    onnx.save(model, path)
    return path


def test_unknown_shape_fails_and_names_fix_shapes(tmp_path):
    graph = gs.import_onnx(onnx.load(_no_shape_model(tmp_path)))
    results = check_graph(graph)
    assert [r.supported for r in results] == [False, False]
    assert all("unknown shape" in r.reasons[0] and "fix-shapes" in r.reasons[0] for r in results)


def test_checker_reads_the_shapes_onnxruntime_infers(tmp_path):
    """``Reshape(x, Shape(x))``: ONNX's per-op inference leaves the result's dims symbolic,
    onnxruntime's data propagation knows them (so the EP gets static shapes and the Relu after
    it is predicted on the HTP); a tensor neither knows keeps no shape (and fails)."""
    from qnnpasses.op_support.deployed import onnxruntime_graph

    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape0"),
             helper.make_node("Reshape", ["x", "s"], ["r"], name="reshape0"),
             helper.make_node("Relu", ["r"], ["y"], name="relu0")]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    per_op = onnx.shape_inference.infer_shapes(model, data_prop=False)
    r_dims = next(v for v in per_op.graph.value_info if v.name == "r").type.tensor_type.shape.dim
    assert not any(d.HasField("dim_value") for d in r_dims)  # the premise: ONNX does not know it
    graph = onnxruntime_graph(model)
    assert graph.tensors()["r"].shape == [2, 3, 4] and graph.tensors()["y"].shape == [2, 3, 4]
    verdicts = {r.name: r.supported for r in check_graph(graph)}
    assert verdicts == {"shape0": False, "reshape0": True, "relu0": True}
    unknown = onnxruntime_graph(onnx.load(_no_shape_model(tmp_path)))
    assert unknown.tensors()["r"].shape is None
    assert [r.supported for r in check_graph(unknown)] == [False, False]


def test_rules_learned_from_node_test_verdicts():
    """Rules read from the backend's verdicts on ONNX's node tests (docs/check_agreement.md):
    an empty output is refused (test_layer_normalization_*_axis0_expanded: empty Slice), an empty
    axes operand is not a dynamic one (test_reduce_sum_default_axes_*: htp), pool dilations must be
    1 (test_maxpool_2d_dilations: cpu), Mod takes int8 (test_mod_mixed_sign_int8: htp)."""
    def var(name, shape, dtype=np.float32):
        return gs.Variable(name, dtype=dtype, shape=shape)

    starts, ends = gs.Constant("st", np.array([0], np.int64)), gs.Constant("en", np.array([0], np.int64))
    empty = check_node(gs.Node("Slice", "s", inputs=[var("x", [2, 5]), starts, ends], outputs=[var("y", [0, 5])]))
    assert not empty.supported and "empty" in empty.reasons[0]
    reduce = gs.Node("ReduceSum", "r", attrs={"keepdims": 1},
                     inputs=[var("x", [3, 2, 2]), var("axes", [0], np.int64)], outputs=[var("y", [1, 1, 1])])
    assert check_node(reduce).supported
    pool = {"kernel_shape": [2, 2], "strides": [1, 1]}
    dilated = gs.Node("MaxPool", "p", attrs={**pool, "dilations": [2, 2]}, inputs=[var("x", [1, 1, 4, 4])],
                      outputs=[var("y", [1, 1, 2, 2])])
    plain = gs.Node("MaxPool", "q", attrs={**pool, "dilations": [1, 1]}, inputs=[var("x", [1, 1, 4, 4])],
                    outputs=[var("y", [1, 1, 3, 3])])
    assert not check_node(dilated).supported and check_node(plain).supported
    mod = gs.Node("Mod", "m", inputs=[var("a", [6], np.int8), var("b", [6], np.int8)], outputs=[var("c", [6], np.int8)])
    assert check_node(mod).supported
    fmod = gs.Node("Mod", "f", attrs={"fmod": 1}, inputs=[var("a", [6], np.int64), var("b", [6], np.int64)],
                   outputs=[var("c", [6], np.int64)])
    assert not check_node(fmod).supported


def test_graph_boundary_qdq_stays_on_the_htp_when_the_session_keeps_it_there():
    """The table's 'Q of a graph input / DQ of a graph output run on the CPU' rules are the EP's
    default (offload_graph_io_quantization=1), lifted for a session that sets it to 0."""
    x = gs.Variable("x", np.float32, [1, 8])
    scale, zero = gs.Constant("s", np.array(0.01, np.float32)), gs.Constant("z", np.array(0, np.uint16))
    q, dq, r, q2, y = (gs.Variable(n, t, [1, 8]) for n, t in
                       (("q", np.uint16), ("dq", np.float32), ("r", np.float32), ("q2", np.uint16), ("y", np.float32)))
    nodes = [gs.Node("QuantizeLinear", "q_in", inputs=[x, scale, zero], outputs=[q]),
             gs.Node("DequantizeLinear", "dq_in", inputs=[q, scale, zero], outputs=[dq]),
             gs.Node("Relu", "relu", inputs=[dq], outputs=[r]),
             gs.Node("QuantizeLinear", "q_out", inputs=[r, scale, zero], outputs=[q2]),
             gs.Node("DequantizeLinear", "dq_out", inputs=[q2, scale, zero], outputs=[y])]
    graph = gs.Graph(nodes=nodes, inputs=[x], outputs=[y], opset=21)
    default = {r.name: r.supported for r in check_graph(graph)}
    assert default == {"q_in": False, "dq_in": True, "relu": True, "q_out": True, "dq_out": False}
    kept = check_graph(graph, provider_options={"offload_graph_io_quantization": "0"})
    assert all(r.supported for r in kept), [(r.name, r.reasons) for r in kept]


def test_parse_ep_log_attributes_backend_error_to_node():
    log = [
        "2026-01-01 00:00:00.1 [V:onnxruntime:Default, qnn_backend_manager.cc:519 QnnLogging]  <E> [4294967295] has incorrect Rank 6.\n",
        "2026-01-01 00:00:00.2 [V:onnxruntime:, qnn_execution_provider.cc:1713 LogNodeSupport] Validation FAILED for 1 nodes in OrtNodeUnit (Transpose) :\n",
        "\tOperator type: Transpose Node name: t0 Node index: 0\n",
        "\tREASON : Failed to add node.\n",
        "\n",
        "2026-01-01 00:00:00.3 [V:onnxruntime:, qnn_execution_provider.cc:1713 LogNodeSupport] Validation PASSED for 1 nodes in OrtNodeUnit (Relu) :\n",
        "\tOperator type: Relu Node name: r0 Node index: 1\n",
        "\n",
    ]
    facts = parse_ep_log(log)
    assert facts.validation["t0"]["passed"] is False
    assert "incorrect Rank 6" in facts.validation["t0"]["reason"]
    assert facts.validation["r0"] == {"passed": True, "reason": "", "op_type": "Relu"}


needs_htp = pytest.mark.htp  # conftest: skip only when not installed outside CI


@needs_htp
def test_real_backend_puts_erf_on_cpu_and_relu_on_htp(tmp_path):
    placement = probe_placement(_relu_erf_relu(tmp_path), {"x": np.ones((1, 4, 8), np.float32)})
    assert placement.ok, placement.error
    assert placement.node_verdict("erf0")[0] == "cpu"
    assert placement.node_verdict("relu0")[0] == "htp"
    assert placement.node_verdict("relu1")[0] == "htp"
    assert placement.cpu_nodes == ["erf0"]
    assert placement.qnn_partitions == 2
    assert placement.qnn_graph_ops["by_type"] == {"Relu": 2}


@needs_htp
def test_real_backend_refuses_nodes_of_unknown_shape_as_the_checker_says(tmp_path):
    placement = probe_placement(_no_shape_model(tmp_path), {"x": np.ones((2, 3), np.float32)}, optimize=False)
    assert placement.node_verdict("relu0") == ("cpu", "Cannot get shape")
    assert placement.node_verdict("sig0") == ("cpu", "Cannot get shape")


@needs_htp
def test_real_backend_reports_finalize_failure():
    """A raw dynamo LLaMA export: every node validates, yet the HTP cannot finalize the graph."""
    placement = probe_placement(fixture_path("llama_gqa_dynamo"))
    assert not placement.ok
    assert "Failed to finalize QNN graph" in placement.error
    assert "ForceFormat_Crouton" in placement.error  # the backend's root cause, appended to the EP's error
    assert placement.validation["node_mul_4"]["passed"]
    assert placement.node_verdict("node_mul_4")[0] == "error"


def test_check_command_json_lists_nodes_in_graph_order(tmp_path, capsys):
    from qnnpasses.cli import main

    path = _relu_erf_relu(tmp_path)
    assert main(["check", str(path), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [n["name"] for n in report["nodes"]] == ["relu0", "erf0", "relu1"]
    assert {"name", "op_type", "supported", "reasons", "qnn_op"} <= set(report["nodes"][0])
    assert report["nodes"][1]["supported"] is False and report["nodes"][1]["reasons"]
    assert report["summary"]["partitions"] == {"htp": 2, "cpu": 1}


def test_check_command_rejects_missing_model(tmp_path, capsys):
    from qnnpasses.cli import main

    assert main(["check", str(tmp_path / "nope.onnx")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


@needs_htp
def test_check_real_agrees_with_backend_on_bert_export():
    """Whole-model agreement on a real export (Erf-GeLU fusion, dynamic dims, int64 shape ops)."""
    import subprocess
    import sys

    fixture = Path(__file__).parent / "fixtures" / "bert_ts.onnx"
    if not fixture.exists():
        pytest.skip("bert_ts fixture not present")
    out = subprocess.run([sys.executable, "-m", "qnnpasses.cli", "check", str(fixture), "--real", "--format", "json"],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    real = json.loads(out)["summary"]["real"]
    print(f"\nbert_ts: table/backend agreement {real['agreement']:.1%} over {real['compared_nodes']} nodes")
    assert real["ok"]
    assert real["agreement"] >= MIN_AGREEMENT
