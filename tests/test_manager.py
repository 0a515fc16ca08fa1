"""The pass manager: rollback, skipping, fixed points, strict mode and per-pass records."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from conftest import FIXTURE_NAMES, fixture_inputs, fixture_outputs, fixture_path

from qnnpasses.backends.cpu import run_cpu
from qnnpasses.errors import CheckFailedError
from qnnpasses.ir import checks
from qnnpasses.ir.checks import check_model
from qnnpasses.ir.load import load_model
from qnnpasses.passmanager.api import (
    STATIC_SHAPES,
    Pass,
    PassContext,
    PassResult,
    register_pass,
)
from qnnpasses.passmanager.instruments import IRDumpInstrument
from qnnpasses.passmanager.manager import (
    CHANGED,
    ROLLED_BACK,
    SKIPPED,
    UNCHANGED,
    Instrument,
    PassManager,
    RunConfig,
)
from qnnpasses.passmanager.spec import parse_pipeline

FIXTURE = "bert_ts"


def _first(ir, op):
    return next(n for n in ir.graph.nodes if n.op == op)


@register_pass
class AddBecomesSub(Pass):
    """Deliberately wrong: valid graph, different numbers."""

    name = "test-add-becomes-sub"
    summary = "turns the first Add into Sub (deliberately wrong, tests only)"

    def run(self, ir, ctx):
        _first(ir, "Add").op = "Sub"
        return PassResult(changed=True, stats={"broken": 1})


@register_pass
class Crashes(Pass):
    name = "test-crashes"
    summary = "half-rewrites the graph, then raises (tests only)"

    def run(self, ir, ctx):
        ir.graph.nodes.pop()
        raise RuntimeError("boom")


@register_pass
class BreaksGraph(Pass):
    name = "test-breaks-graph"
    summary = "leaves a node reading a tensor nobody produces (tests only)"

    def run(self, ir, ctx):
        _first(ir, "MatMul").inputs[0] = gs.Variable("nobody_makes_this", dtype=np.float32)
        return PassResult(changed=True)


def _insert_before_output(ir, ctx, op, prefix):
    """Put a unary ``op`` node between the first graph output and its producer."""
    out = ir.graph.outputs[0]
    producer = out.inputs[0]
    fresh = gs.Variable(ctx.unique_name(ir, f"pre_{prefix}"), dtype=out.dtype, shape=out.shape)
    producer.outputs[producer.outputs.index(out)] = fresh
    ir.graph.nodes.append(gs.Node(op, name=ctx.unique_name(ir, prefix), inputs=[fresh], outputs=[out]))


@register_pass
class InsertNeg(Pass):
    """Lossy on purpose: negates the first output."""

    name = "test-lossy-negate"
    summary = "negates the first output (lossy, tests only)"
    lossless = False

    def run(self, ir, ctx):
        _insert_before_output(ir, ctx, "Neg", "neg")
        return PassResult(changed=True)


@register_pass
class NeedsStatic(Pass):
    name = "test-needs-static"
    summary = "requires static shapes (tests only)"
    requires = frozenset({STATIC_SHAPES})

    def run(self, ir, ctx):
        return PassResult(changed=False, stats={"ran": 1})


@register_pass
class DoubleIdentity(Pass):
    """Adds an Identity before the output each run, three in total."""

    name = "test-grow"
    summary = "adds an Identity before the first output, a few times (tests only)"

    def run(self, ir, ctx):
        identities = sum(1 for n in ir.graph.nodes if n.name.startswith("grow"))
        if identities >= 3:
            return PassResult(changed=False)
        _insert_before_output(ir, ctx, "Identity", "grow")
        return PassResult(changed=True, stats={"added": 1})


@register_pass
class ChecksItself(Pass):
    """Rewrites, checks its own result (as simplify does between folding rounds), and with
    ``then_break`` breaks the graph after that check."""

    name = "test-checks-itself"
    summary = "adds an Identity, checks the graph itself, maybe breaks it afterwards (tests only)"

    @dataclass
    class Options:
        then_break: bool = False

    def run(self, ir, ctx):
        _insert_before_output(ir, ctx, "Identity", "own_check")
        assert check_model(ir, refresh=True) is None
        if self.options.then_break:
            _first(ir, "MatMul").inputs[0] = gs.Variable("nobody_makes_this", dtype=np.float32)
        return PassResult(changed=True)


def _run(spec, verify=True, **config):
    ir = load_model(fixture_path(FIXTURE))
    manager = PassManager(parse_pipeline(spec), RunConfig(verify=verify, inputs=fixture_inputs(FIXTURE), **config))
    return ir, manager.run(ir)


def _assert_outputs_unchanged(ir):
    for name, expected in fixture_outputs(FIXTURE).items():
        np.testing.assert_allclose(run_cpu(ir, fixture_inputs(FIXTURE))[name], expected, atol=1e-5)


def test_numerically_wrong_pass_is_rolled_back_with_figures():
    ir, result = _run("test-add-becomes-sub,cleanup")
    record = result.records[0]
    assert record.status == ROLLED_BACK and not record.changed
    assert "outputs changed beyond tolerance" in record.reason
    assert record.verification["max_abs"] > 1e-3 and record.verification["cosine"] < 0.99999
    assert not any(n.op == "Sub" and n.name == _first(ir, "Add").name for n in ir.graph.nodes)
    assert result.records[1].status == UNCHANGED  # the pipeline went on
    _assert_outputs_unchanged(ir)


def test_references_kept_on_disk_verify_as_those_in_memory(monkeypatch, tmp_path):
    """Outputs above SPILL_BYTES are compared from files mapped back: the same figures, a wrong pass
    still rolled back, and no file left behind (an LLM graph's references at context 4096 are
    gigabytes: 3.9 GiB of a 0.5 B build's memory before)."""
    import tempfile

    from qnnpasses.memory import spill
    from qnnpasses.passmanager import manager as manager_module

    spec = "test-add-becomes-sub,fix-shapes,simplify,cleanup"
    _, in_memory = _run(spec)
    monkeypatch.setattr(manager_module, "SPILL_BYTES", 0)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    kept = []
    monkeypatch.setattr(manager_module, "spill", lambda *a, **k: kept.append(a[2]) or spill(*a, **k))
    ir, spilled = _run(spec)
    assert len(kept) >= 2 * len(spilled.verification_cases)  # the input's outputs and each checked pass's
    assert [r.status for r in spilled.records] == [r.status for r in in_memory.records]
    assert spilled.records[0].status == ROLLED_BACK and "outputs changed beyond tolerance" in spilled.records[0].reason
    assert spilled.records[0].verification == in_memory.records[0].verification
    assert any(r.status == CHANGED for r in spilled.records[1:])
    assert spilled.final_verification == in_memory.final_verification and spilled.final_verification["ok"]
    assert list(tmp_path.iterdir()) == []
    _assert_outputs_unchanged(ir)


def test_without_verify_a_wrong_pass_is_kept():
    ir, result = _run("test-add-becomes-sub", verify=False)
    assert result.records[0].status == CHANGED
    assert result.records[0].op_delta == {"Add": -1, "Sub": 1}


def test_crashing_pass_is_rolled_back():
    ir, result = _run("test-crashes")
    assert result.records[0].status == ROLLED_BACK
    assert "RuntimeError: boom" in result.records[0].reason
    assert len(ir.graph.nodes) == result.records[0].nodes_before
    _assert_outputs_unchanged(ir)


def test_pass_breaking_the_graph_is_rolled_back_even_without_verify():
    ir, result = _run("test-breaks-graph", verify=False)
    assert result.records[0].status == ROLLED_BACK
    assert "graph check failed" in result.records[0].reason
    _assert_outputs_unchanged(ir)


def test_strict_mode_stops_with_check_failed():
    with pytest.raises(CheckFailedError, match="test-add-becomes-sub"):
        _run("test-add-becomes-sub,cleanup", strict=True)


def test_lossy_pass_needs_allow_lossy_and_then_reports_its_deviation():
    _, skipped = _run("test-lossy-negate")
    assert skipped.records[0].status == SKIPPED and "--allow-lossy" in skipped.records[0].reason
    ir, result = _run("test-lossy-negate", allow_lossy=True)
    record = result.records[0]
    assert record.status == CHANGED and record.lossless is False
    assert record.verification["cosine"] == pytest.approx(-1.0)
    assert [a["op_type"] for a in record.added] == ["Neg"]
    assert result.final_verification["cosine"] == pytest.approx(-1.0)


def test_requirement_not_met_skips_with_reason(tmp_path):
    import onnx

    model = onnx.load(fixture_path(FIXTURE))
    for inp in model.graph.input:
        inp.type.tensor_type.shape.dim[1].dim_param = "sequence"
    del model.graph.value_info[:]
    path = tmp_path / "dynamic.onnx"
    onnx.save(model, path)
    ir = load_model(path)
    result = PassManager(parse_pipeline("test-needs-static")).run(ir)
    assert result.records[0].status == SKIPPED and "static input shapes" in result.records[0].reason
    result = PassManager(parse_pipeline("test-needs-static")).run(load_model(fixture_path(FIXTURE)))
    assert result.records[0].stats == {"ran": 1}


def test_repeat_runs_to_a_fixed_point_under_its_cap():
    ir, result = _run("repeat{max=10}(test-grow)")
    statuses = [(r.iteration, r.status) for r in result.records]
    assert statuses == [(1, CHANGED), (2, CHANGED), (3, CHANGED), (4, UNCHANGED)]
    ir, result = _run("repeat{max=2}(test-grow)")
    assert [r.iteration for r in result.records] == [1, 2]


def test_records_list_added_and_removed_nodes_exactly():
    ir, result = _run("test-grow")
    record = result.records[0]
    assert record.removed == []
    assert [a["op_type"] for a in record.added] == ["Identity"]
    assert record.nodes_after == record.nodes_before + 1
    assert record.op_delta == {"Identity": 1}


def test_instruments_see_every_pass_and_dump_diffs(tmp_path):
    seen = []

    class Recorder(Instrument):
        def before_pass(self, pass_, ir, record):
            seen.append(("before", pass_.name))

        def after_pass(self, pass_, ir, record):
            seen.append(("after", pass_.name, record.status))

    ir = load_model(fixture_path(FIXTURE))
    PassManager(parse_pipeline("test-grow,test-add-becomes-sub"), RunConfig(verify=True),
                [Recorder(), IRDumpInstrument(tmp_path)]).run(ir)
    assert seen == [("before", "test-grow"), ("after", "test-grow", CHANGED),
                    ("before", "test-add-becomes-sub"), ("after", "test-add-becomes-sub", ROLLED_BACK)]
    diff = (tmp_path / "01-test-grow.diff").read_text()
    added = [line for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    removed = [line for line in diff.splitlines() if line.startswith("-") and not line.startswith("---")]
    # one new Identity line; its producer's line changes because its output was renamed
    assert sum(" : Identity(" in line for line in added) == 1 and len(added) == 2
    assert len(removed) == 1 and "-> (last_hidden_state)" in removed[0]
    assert not (tmp_path / "02-test-add-becomes-sub.diff").exists()


def test_unique_names_do_not_collide():
    ir = load_model(fixture_path(FIXTURE))
    ctx = PassContext()
    names = {ctx.unique_name(ir, "x") for _ in range(50)}
    assert len(names) == 50 and not names & set(ir.graph.tensors())


# ---------------------------------------------------------------- a manager that cannot be lied to

# Plugins written to files and loaded with --plugin, as a user would.  Each one is wrong in a
# way the old manager let through: it said "unchanged", or it broke only padded rows.
_PLUGIN_HEAD = '''
import numpy as np
import onnx_graphsurgeon as gs
from qnnpasses.passmanager.api import EXACT, Pass, PassResult, approximate, register_pass


def before_output(ir, ctx, make):
    out = ir.graph.outputs[0]
    producer = out.inputs[0]
    fresh = gs.Variable(ctx.unique_name(ir, "pre"), dtype=out.dtype, shape=out.shape)
    producer.outputs[producer.outputs.index(out)] = fresh
    ir.graph.nodes.extend(make(fresh, out))
'''

_NEGATE_SAYS_UNCHANGED = _PLUGIN_HEAD + '''
@register_pass
class NegateQuietly(Pass):
    name = "test-negate-quietly"
    summary = "negates the output and says it changed nothing (tests only)"

    def run(self, ir, ctx):
        before_output(ir, ctx, lambda x, y: [gs.Node("Neg", name=ctx.unique_name(ir, "neg"), inputs=[x], outputs=[y])])
        return PassResult(changed=False)
'''

# logits * mask[..., None]: identical while the mask is all ones, wrong exactly where it is 0
_BREAK_PADDED_ROWS = _PLUGIN_HEAD + '''
@register_pass
class ZeroPaddedRows(Pass):
    name = "test-zero-padded-rows"
    summary = "zeroes the output rows of padding positions (tests only)"
    contract = EXACT

    def run(self, ir, ctx):
        mask = next(t for t in ir.graph.inputs if t.name == "attention_mask")

        def make(x, y):
            f = gs.Variable(ctx.unique_name(ir, "maskf"), dtype=x.dtype)
            u = gs.Variable(ctx.unique_name(ir, "masku"), dtype=x.dtype)
            axes = gs.Constant(ctx.unique_name(ir, "axes"), np.array([-1], dtype=np.int64))
            return [gs.Node("Cast", name=ctx.unique_name(ir, "cast"), attrs={"to": 1}, inputs=[mask], outputs=[f]),
                    gs.Node("Unsqueeze", name=ctx.unique_name(ir, "unsq"), inputs=[f, axes], outputs=[u]),
                    gs.Node("Mul", name=ctx.unique_name(ir, "mul"), inputs=[x, u], outputs=[y])]

        before_output(ir, ctx, make)
        return PassResult(changed=True)
'''

# each run within its stated 0.5, twice 0.8: only the end-to-end comparison sees it
_DRIFT = _PLUGIN_HEAD + '''
@register_pass
class Drift(Pass):
    name = "test-drift"
    summary = "adds 0.4 to the output (tests only)"
    contract = approximate(atol=0.5, min_cosine=0.0, why="adds 0.4")

    def run(self, ir, ctx):
        c = gs.Constant(ctx.unique_name(ir, "c"), np.array(0.4, dtype=np.float32))
        before_output(ir, ctx, lambda x, y: [gs.Node("Add", name=ctx.unique_name(ir, "add"), inputs=[x, c], outputs=[y])])
        return PassResult(changed=True)
'''


def _cli_run(tmp_path, capsys, plugin: str, spec: str, *extra):
    from qnnpasses.cli import main

    plugin_file = tmp_path / "plugin.py"
    plugin_file.write_text(plugin)
    out, report = tmp_path / "out.onnx", tmp_path / "report"
    code = main(["run", str(fixture_path("llama_gqa_ts")), "-o", str(out), "--passes", spec, "--plugin", str(plugin_file),
                 "--verify", "--report-dir", str(report), "-q", *extra])
    captured = capsys.readouterr()
    import json

    return code, out, json.loads((report / "report.json").read_text()), captured.err


def test_a_pass_that_says_unchanged_is_checked_anyway_and_strict_fails(tmp_path, capsys):
    code, out, report, err = _cli_run(tmp_path, capsys, _NEGATE_SAYS_UNCHANGED, "test-negate-quietly", "--strict")
    assert code == 1 and not out.exists()
    record = report["passes"][0]
    assert record["status"] == ROLLED_BACK and record["misreported"] is True
    assert record["verification"]["cosine"] == pytest.approx(-1.0)
    assert "test-negate-quietly" in err


def test_a_pass_that_breaks_only_padded_rows_fails_strict(tmp_path, capsys):
    code, out, report, _ = _cli_run(tmp_path, capsys, _BREAK_PADDED_ROWS, "test-zero-padded-rows", "--strict")
    assert code == 1 and not out.exists()
    cases = report["passes"][0]["verification"]["cases"]
    assert cases["random"]["ok"] and cases["random"]["max_abs"] == 0.0  # all-ones masks see nothing
    assert not cases["padded-right"]["ok"] and not cases["padded-left"]["ok"] and not cases["masked"]["ok"]


def test_end_to_end_failure_fails_strict_and_warns_without(tmp_path, capsys):
    code, out, report, err = _cli_run(tmp_path, capsys, _DRIFT, "test-drift,test-drift", "--strict", "--allow-lossy")
    assert code == 1 and not out.exists()
    assert [p["status"] for p in report["passes"]] == [CHANGED, CHANGED]
    assert report["final_verification"]["ok"] is False
    assert report["final_verification"]["max_abs"] == pytest.approx(0.8, abs=1e-5)
    code, out, report, err = _cli_run(tmp_path, capsys, _DRIFT, "test-drift,test-drift", "--allow-lossy")
    assert code == 0 and out.exists()
    assert "WARNING: end-to-end verification FAILED" in err and "max abs error 0.8" in err


def test_a_pass_that_says_changed_but_did_nothing_is_unchanged():
    @register_pass
    class Boasts(Pass):
        name = "test-boasts"
        summary = "changes nothing and says it did (tests only)"

        def run(self, ir, ctx):
            return PassResult(changed=True)

    _, result = _run("test-boasts")
    assert result.records[0].status == UNCHANGED and result.records[0].misreported


def test_a_pure_reorder_is_no_change_but_a_broken_order_is_rolled_back():
    @register_pass
    class Reverses(Pass):
        name = "test-reverse-nodes"
        summary = "reverses the node list (tests only)"

        def run(self, ir, ctx):
            ir.graph.nodes.reverse()
            return PassResult(changed=False)

    ir, result = _run("test-reverse-nodes", verify=False)
    assert result.records[0].status == ROLLED_BACK and "topological order" in result.records[0].reason
    _assert_outputs_unchanged(ir)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_htp_llm_verifies_on_every_fixture_without_false_alarms(name):
    """Strict verification on padded, masked and extreme inputs: no pass of htp-llm is rolled back."""
    from qnnpasses.passmanager.named import get_pipeline

    ir = load_model(fixture_path(name))
    result = PassManager(get_pipeline("htp-llm"), RunConfig(verify=True, strict=True)).run(ir)
    assert result.final_verification["ok"], result.final_verification.get("failure")
    cases = {c["name"] for c in result.verification_cases}
    assert {"random", "padded-right", "padded-left", "masked"} <= cases  # every fixture has a mask input
    for record in result.records:
        if record.status == CHANGED and record.contract["kind"] == "exact":
            assert set(record.verification["cases"]) == cases, record.name


def _count_checks(monkeypatch) -> list[int]:
    calls = [0]
    real = checks._check_serialized  # what every check of a model ends in

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(checks, "_check_serialized", counting)
    return calls


def test_a_graph_the_pass_already_checked_is_not_checked_again(monkeypatch):
    ir = load_model(fixture_path(FIXTURE))
    calls = _count_checks(monkeypatch)
    result = PassManager(parse_pipeline("test-checks-itself"), RunConfig(verify=False)).run(ir)
    assert result.records[0].status == CHANGED
    assert calls[0] == 1  # the pass's own check; the manager's would find the same


def test_a_change_after_the_pass_s_own_check_is_still_checked_and_rolled_back(monkeypatch):
    ir = load_model(fixture_path(FIXTURE))
    calls = _count_checks(monkeypatch)
    nodes = len(ir.graph.nodes)
    result = PassManager(parse_pipeline("test-checks-itself{then_break=true}"), RunConfig(verify=False)).run(ir)
    assert calls[0] == 2
    assert result.records[0].status == ROLLED_BACK and "graph check failed" in result.records[0].reason
    assert len(ir.graph.nodes) == nodes
    _assert_outputs_unchanged(ir)


@register_pass
class AnchoredAtSub(Pass):
    """Declares Sub as its anchor and counts its runs; breaks the graph if it ever runs."""

    name = "test-anchored-at-sub"
    summary = "anchored at Sub, breaks the graph when run (tests only)"
    anchor_ops = frozenset({"Sub"})
    runs = 0

    def run(self, ir, ctx):
        type(self).runs += 1
        _first(ir, "MatMul").inputs[0] = gs.Variable("nobody_makes_this", dtype=np.float32)
        return PassResult(changed=True)


def test_a_pass_whose_anchor_ops_are_absent_is_not_run(monkeypatch):
    ir = load_model(fixture_path(FIXTURE))
    assert not any(n.op == "Sub" for n in ir.graph.nodes)
    AnchoredAtSub.runs = 0
    calls = _count_checks(monkeypatch)
    record = PassManager(parse_pipeline("test-anchored-at-sub"), RunConfig(verify=False)).run(ir).records[0]
    assert (record.status, record.reason, AnchoredAtSub.runs, calls[0]) == (UNCHANGED, "no Sub in the graph", 0, 0)


def test_a_pass_whose_anchor_op_is_present_runs_and_is_guarded():
    # test-add-becomes-sub plants the Sub; the anchored pass then runs, breaks the graph and is rolled back
    AnchoredAtSub.runs = 0
    ir, result = _run("test-add-becomes-sub,test-anchored-at-sub", verify=False)
    assert AnchoredAtSub.runs == 1
    assert result.records[1].status == ROLLED_BACK and "graph check failed" in result.records[1].reason
