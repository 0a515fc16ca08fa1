"""``qnnpasses lint``: each rule on a tiny graph (exact findings and fixes), the fixtures
(expected counts, and agreement of error findings with the real HTP), the output formats
(JSON shape, SARIF 2.1.0 validated against the official schema), exit codes, and the
pre-commit hook definition."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import onnx
import onnx.parser
import pytest
from conftest import FIXTURE_NAMES, LLAMA_FAMILY, fixture_path, requires_htp
from onnx import numpy_helper

from qnnpasses.cli import main as cli
from qnnpasses.lint import LintConfig, all_rules, lint_model
from qnnpasses.lint.formats import to_sarif

ROOT = Path(__file__).resolve().parents[1]
SARIF_SCHEMA = json.loads((Path(__file__).parent / "data" / "sarif-2.1.0.json").read_text())
DYNAMO_LLAMA = [n for n in LLAMA_FAMILY if n.endswith("_dynamo")]


def parse(body: str, signature: str, opset: int = 18, inits: list[onnx.TensorProto] = ()) -> onnx.ModelProto:
    model = onnx.parser.parse_model(f'<ir_version: 8, opset_import: ["" : {opset}]> main {signature} {{ {body} }}')
    model.graph.initializer.extend(inits)
    return model


def by_rule(report, rule: str) -> list:
    return [f for f in report.findings if f.rule == rule]


def weight(name: str = "w", n: int = 64) -> onnx.TensorProto:
    return numpy_helper.from_array(np.linspace(0.5, 1.5, n, dtype=np.float32), name)


RMS_RECIPROCAL = """
    two = Constant <value = float {2.0}> ()
    eps = Constant <value = float {1e-6}> ()
    axes = Constant <value = int64[1] {-1}> ()
    p = Pow (x, two)
    m = ReduceMean <keepdims = 1> (p, axes)
    a = Add (m, eps)
    s = Sqrt (a)
    r = Reciprocal (s)
    n = Mul (x, r)
    y = Mul (w, n)
"""
SIG_X = "(float[1, 16, 64] x) => (float[1, 16, 64] y)"


# --------------------------------------------------------------------------- rules on tiny graphs


def test_rules_have_stable_unique_ids_names_and_documentation():
    rules = all_rules()
    assert [r.id for r in rules] == [f"QP{i:03d}" for i in range(1, 21)]
    assert len({r.name for r in rules}) == len(rules)
    for r in rules:
        assert r.description and r.summary and r.fix and r.help_uri.startswith("https://")


def test_unsupported_op_without_fixing_pass_names_the_manual_action():
    report = lint_model(parse("y = Erf (x)", "(float[1, 16, 64] x) => (float[1, 16, 64] y)"))
    [f] = by_rule(report, "QP001")
    assert (f.severity, f.node, f.op_type) == ("error", f.node, "Erf")
    assert "Erf" in f.message and f.fix.startswith("manual:")


def _erf_gelu(divisor: str) -> str:
    """The spelling of GeLU the EP fuses, ``0.5 * x * (1 + Erf(x / divisor))``."""
    return f"""
        c = Constant <value = float {{{divisor}}}> ()
        one = Constant <value = float {{1.0}}> ()
        half = Constant <value = float {{0.5}}> ()
        d = Div (x, c)
        e = Erf (d)
        a = Add (e, one)
        m = Mul (x, a)
        y = Mul (m, half)
    """


def test_unsupported_erf_gelu_is_fixed_by_fuse_gelu_and_reported_as_decomposed():
    report = lint_model(parse(_erf_gelu("1.4142135"), SIG_X))
    [gelu] = by_rule(report, "QP013")
    assert gelu.fix == "fuse-gelu" and gelu.op_type == "Mul" and "5 nodes: Div, Erf, Add, Mul, Mul" in gelu.message
    assert not by_rule(report, "QP001")  # the EP fuses this Erf spelling itself (op-support table)


def test_gelu_shape_with_wrong_constants_is_no_gelu_for_check_lint_or_the_pass():
    """x/2 in place of x/sqrt(2): the EP's spelling, but not a GeLU.  check, lint and fuse-gelu share
    one recognizer, so none of them calls it one: the Erf stays unsupported, nothing is fused."""
    from qnnpasses.ir.load import load_model
    from qnnpasses.op_support import check_graph
    from qnnpasses.passmanager.api import PassContext, get_pass

    model = parse(_erf_gelu("2.0"), SIG_X)
    report = lint_model(model)
    assert not by_rule(report, "QP013")
    [f] = by_rule(report, "QP001")
    assert f.op_type == "Erf"
    ir = load_model(model)
    [erf] = [s for s in check_graph(ir.graph) if s.op_type == "Erf"]
    assert erf.supported is False
    assert not get_pass("fuse-gelu")().run(ir, PassContext()).changed


def test_rank_limit_is_its_own_rule():
    report = lint_model(parse("y = Sqrt (x)", "(float[1, 2, 3, 4, 5] x) => (float[1, 2, 3, 4, 5] y)"))
    [f] = by_rule(report, "QP002")
    assert f.op_type == "Sqrt" and "rank 5" in f.message and not by_rule(report, "QP001")


def test_computed_operand_that_must_be_constant_and_folding_fixes_it():
    body = """
        s = Shape (x)
        y = Tile (x, s)
    """
    report = lint_model(parse(body, "(float[2, 8] x) => (float[4, 64] y)"))
    # folding alone fixes both nodes, and onnxruntime (like the converter) folds on load: the
    # HTP runs the model, so they are QP020 warnings, not QP001/QP003 errors
    assert not by_rule(report, "QP001") and not by_rule(report, "QP003") and report.counts()["error"] == 0
    shape_op, tile = by_rule(report, "QP020")
    assert (shape_op.op_type, shape_op.fix, shape_op.severity) == ("Shape", "simplify", "warning")
    assert (tile.op_type, tile.fix, tile.severity) == ("Tile", "simplify", "warning")
    assert "repeats must be a constant" in tile.message and "onnxruntime does on load" in tile.message
    from_input = lint_model(parse("y = Tile (x, reps)", "(float[2, 8] x, int64[2] reps) => (float[?, ?] y)"))
    [f] = by_rule(from_input, "QP003")
    assert f.severity == "error" and f.fix.startswith("manual:")


def test_symbolic_input_dims_point_to_fix_shapes():
    report = lint_model(parse("y = Relu (x)", "(float[batch, 16] x) => (float[batch, 16] y)"))
    findings = by_rule(report, "QP004")
    assert {(f.node, f.op_type) for f in findings} == {("x", "graph input"), ("y", "graph output")}
    assert all(f.fix.startswith("fix-shapes") and "batch" in f.message for f in findings)


def test_zero_sized_concat_operand_is_fixed_by_simplify():
    body = """
        st = Constant <value = int64[1] {16}> ()
        en = Constant <value = int64[1] {32}> ()
        ax = Constant <value = int64[1] {-1}> ()
        e = Slice (x, st, en, ax)
        y = Concat <axis = -1> (x, e)
    """
    report = lint_model(parse(body, "(float[1, 4, 16] x) => (float[1, 4, 16] y)"))
    [f] = by_rule(report, "QP005")
    assert f.op_type == "Concat" and "1x4x0" in f.message and f.fix == "simplify"


def test_constant_first_weight_mul_of_reciprocal_rmsnorm_is_an_error_fixed_by_simplify():
    report = lint_model(parse(RMS_RECIPROCAL, SIG_X, inits=[weight()]))
    [f] = by_rule(report, "QP006")
    assert (f.severity, f.op_type, f.fix) == ("error", "Mul", "simplify") and "'w'" in f.message
    [rms] = by_rule(report, "QP011")
    assert rms.fix == "fuse-rmsnorm" and "7 nodes" in rms.message and rms.node == f.node


def test_constant_first_in_div_form_norm_is_only_info():
    body = RMS_RECIPROCAL.replace("r = Reciprocal (s)\n", "").replace("n = Mul (x, r)", "n = Div (x, s)")
    report = lint_model(parse(body, SIG_X, inits=[weight()]))
    [f] = by_rule(report, "QP018")
    assert f.severity == "info" and not by_rule(report, "QP006")


def test_weight_second_is_clean():
    body = RMS_RECIPROCAL.replace("y = Mul (w, n)", "y = Mul (n, w)")
    assert not by_rule(lint_model(parse(body, SIG_X, inits=[weight()])), "QP006")


@pytest.mark.parametrize("opset, rule_id, severity", [(11, "QP007", "warning"), (6, "QP019", "error")])
def test_old_opsets(opset, rule_id, severity):
    [f] = by_rule(lint_model(parse("y = Relu (x)", "(float[4] x) => (float[4] y)", opset=opset)), rule_id)
    assert f.severity == severity and f"opset {opset}" in f.message and f.node is None


def test_weights_above_the_graph_limit_point_to_partition():
    model = parse("y = MatMul (x, w)", "(float[1, 64] x) => (float[1, 64] y)",
                  inits=[numpy_helper.from_array(np.ones((64, 64), np.float32), "w")])
    assert not by_rule(lint_model(model), "QP008")
    [f] = by_rule(lint_model(model, LintConfig(max_graph_weight_bytes=1000)), "QP008")
    assert f.fix.startswith("qnnpasses partition --max-part-bytes") and f.details["weight_bytes"] == 64 * 64 * 4


def test_int64_ids_feeding_a_gather_are_lowered():
    model = parse("y = Gather (emb, ids)", "(int64[1, 16] ids) => (float[1, 16, 64] y)",
                  inits=[numpy_helper.from_array(np.ones((256, 64), np.float32), "emb")])
    [f] = by_rule(lint_model(model), "QP009")
    assert (f.op_type, f.fix, f.details["tensor"]) == ("Gather", "lower-int64", "ids")


def test_float32_plan_only_for_float32_graphs_without_qdq():
    assert by_rule(lint_model(parse("y = Relu (x)", "(float[4] x) => (float[4] y)")), "QP010")
    assert not by_rule(lint_model(parse("y = Relu (x)", "(float16[4] x) => (float16[4] y)")), "QP010")
    qdq = """
        s = Constant <value = float {0.1}> ()
        z = Constant <value = uint8 {128}> ()
        q = QuantizeLinear (x, s, z)
        y = DequantizeLinear (q, s, z)
    """
    assert not by_rule(lint_model(parse(qdq, "(float[4] x) => (float[4] y)")), "QP010")


def test_decomposed_layernorm():
    body = """
        axes = Constant <value = int64[1] {-1}> ()
        two = Constant <value = float {2.0}> ()
        eps = Constant <value = float {1e-5}> ()
        mu = ReduceMean <keepdims = 1> (x, axes)
        d = Sub (x, mu)
        p = Pow (d, two)
        v = ReduceMean <keepdims = 1> (p, axes)
        a = Add (v, eps)
        s = Sqrt (a)
        n = Div (d, s)
        g = Mul (n, w)
        y = Add (g, b)
    """
    model = parse(body, SIG_X, inits=[weight("w"), weight("b")])
    [f] = by_rule(lint_model(model), "QP012")
    assert f.fix == "fuse-layernorm" and f.op_type == "Add" and "9 nodes" in f.message


def test_transpose_pair_that_cancels():
    body = """
        t = Transpose <perm = [0, 2, 1]> (x)
        r = Relu (t)
        y = Transpose <perm = [0, 2, 1]> (r)
    """
    [f] = by_rule(lint_model(parse(body, "(float[1, 16, 64] x) => (float[1, 16, 64] y)")), "QP014")
    assert f.op_type == "Transpose" and f.fix == "layout" and f.severity == "info"
    assert f.details["nodes"] == ["Transpose_0", "Relu_1", "Transpose_2"] and f.node == "Transpose_0"


def test_symbolic_batch_points_to_fix_shapes_and_pattern_rules_still_apply(tmp_path):
    model = onnx.load(fixture_path("llama_gqa_dynamo"))
    for value in [*model.graph.input, *model.graph.output]:
        value.type.tensor_type.shape.dim[0].dim_param = "batch"
    del model.graph.value_info[:]
    report = lint_model(model)
    dynamic = by_rule(report, "QP004")
    assert {f.node for f in dynamic} == {"input_ids", "attention_mask", "logits"}
    assert all(f.severity == "error" and f.fix.startswith("fix-shapes") for f in dynamic)
    assert len(by_rule(report, "QP015")) == 4 and len(by_rule(report, "QP011")) == 5  # found after fix-shapes


def test_ignore_skips_rules_by_id_or_name():
    report = lint_model(parse("y = Erf (x)", "(float[4] x) => (float[4] y)"),
                        LintConfig(ignore=frozenset({"QP001", "float32-without-plan"})))
    assert not by_rule(report, "QP001") and not by_rule(report, "QP010") and len(report.rules) == len(all_rules()) - 2


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def fixture_reports():
    """check --format json and lint --format json through the CLI, on every fixture."""
    reports = {}
    for name in FIXTURE_NAMES:
        reports[name] = {cmd: _cli_json([cmd, str(fixture_path(name)), "--format", "json"]) for cmd in ("check", "lint")}
    return reports


def _cli_json(argv: list[str], capsys=None) -> dict:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli(argv)
    assert code in (0, 1), f"{argv}: exit {code}"
    return json.loads(out.getvalue())


def test_check_and_lint_run_on_every_fixture(fixture_reports):
    # no wall-clock assertion: speed lives in benchmarks, not in a test that a loaded machine fails
    reports = fixture_reports
    print("\nfixture               errors warnings info  by rule")
    for name in FIXTURE_NAMES:
        check, lint = reports[name]["check"], reports[name]["lint"]
        s = lint["summary"]
        print(f"{name:<22}{s['error']:>6}{s['warning']:>9}{s['info']:>5}  {s['by_rule']}")
        assert check["summary"]["nodes"] == len(check["nodes"]) > 0
        assert s["rule_failures"] == {} and s["findings"] == len(lint["findings"])
        for f in lint["findings"]:
            assert set(f) >= {"rule", "severity", "node", "op_type", "message", "fix"} and f["fix"]


def test_fixture_findings_match_what_the_passes_rewrite(fixture_reports):
    reports = fixture_reports
    for name in FIXTURE_NAMES:
        lint = reports[name]["lint"]
        rules = lint["summary"]["by_rule"]
        assert rules.get("QP011", 0) == (5 if name in LLAMA_FAMILY else 0), name  # 2 layers x 2 norms + final
        assert rules.get("QP013", 0) == (2 if name.startswith("gpt2") or name == "bert_ts" else 0), name
        errors = {f["rule"] for f in lint["findings"] if f["severity"] == "error"}
        if name in DYNAMO_LLAMA:  # Reciprocal-form RMSNorm with the weight first: fails to finalize (measured)
            assert rules["QP006"] + rules.get("QP018", 0) == 6 and "QP006" in errors, name
        if name.endswith("_ts") and name != "phi3_ts":  # shape arithmetic onnxruntime folds: warnings only
            assert not errors and rules["QP020"] > 0, (name, errors)
            assert reports[name]["check"]["summary"]["unsupported"] == 0, name  # the verdict check gives
    sdpa = {n: reports[n]["lint"] for n in ("llama_gqa_sdpa_dynamo", "llama_gqa_sdpa_ts")}
    guards = {n: [f["fix"] for f in r["findings"] if f["rule"] == "QP016"] for n, r in sdpa.items()}
    assert guards["llama_gqa_sdpa_dynamo"] == ["attention-cleanup"] * 2  # causal mask: provably dead
    assert all("assume_unmasked_rows=true" in fix for fix in guards["llama_gqa_sdpa_ts"]) and len(guards["llama_gqa_sdpa_ts"]) == 2
    repeat = [f["node"] for f in reports["llama_gqa_dynamo"]["lint"]["findings"] if f["rule"] == "QP015"]
    assert repeat == ["node_expand_1", "node_expand_2", "node_expand_3", "node_expand_4"]
    assert reports["llama_mha_dynamo"]["lint"]["summary"]["by_rule"].get("QP015") is None
    assert [f["rule"] for f in reports["phi3_ts"]["lint"]["findings"] if f["severity"] == "error"] == ["QP005", "QP005"]


@requires_htp
def test_error_findings_agree_with_the_real_htp():
    """No error (constant-foldable nodes are QP020 warnings: onnxruntime folds those on
    load): the model compiles on the HTP; the errors found are what makes it fail."""
    from qnnpasses.backends.htp import probe_placement

    for name, fails_with in (("llama_gqa_ts", None), ("phi3_ts", "QP005"), ("llama_gqa_dynamo", "QP006")):
        errors = {f.rule for f in lint_model(fixture_path(name)).findings if f.severity == "error"}
        placement = probe_placement(fixture_path(name))
        assert placement.ok == (fails_with is None), (name, placement.error)
        assert (fails_with in errors) if fails_with else not errors, (name, errors)


# --------------------------------------------------------------------------- formats and CLI


def test_sarif_validates_against_the_sarif_2_1_0_schema(tmp_path):
    out = tmp_path / "lint.sarif"
    code = cli(["lint", str(fixture_path("llama_gqa_sdpa_dynamo")), "--format", "sarif", "-o", str(out)])
    assert code == 1  # it has errors
    doc = json.loads(out.read_text())
    validator = jsonschema.Draft4Validator(SARIF_SCHEMA)
    assert not list(validator.iter_errors(doc))
    run = doc["runs"][0]
    rules = run["tool"]["driver"]["rules"]
    assert [r["id"] for r in rules] == [r.id for r in all_rules()]
    assert all(r["helpUri"].startswith("https://") and r["fullDescription"]["text"] for r in rules)
    result = next(r for r in run["results"] if r["ruleId"] == "QP006")
    assert result["level"] == "error" and rules[result["ruleIndex"]]["id"] == "QP006"
    assert result["locations"][0]["physicalLocation"]["artifactLocation"]["uri"].endswith("llama_gqa_sdpa_dynamo.onnx")
    assert result["locations"][0]["logicalLocations"][0]["name"] == "node_mul_4"
    assert {r["level"] for r in run["results"]} == {"error", "warning", "note"}
    broken = json.loads(json.dumps(doc))
    broken["runs"][0]["results"][0]["level"] = "fatal"
    assert list(validator.iter_errors(broken)), "the schema must catch a bad level"


def test_sarif_of_a_model_level_finding_has_no_logical_location():
    report = lint_model(parse("y = Relu (x)", "(float[4] x) => (float[4] y)"))
    doc = to_sarif(report)
    assert not list(jsonschema.Draft4Validator(SARIF_SCHEMA).iter_errors(doc))
    [result] = doc["runs"][0]["results"]
    assert result["ruleId"] == "QP010" and "logicalLocations" not in result["locations"][0]


@pytest.mark.parametrize("fail_on, expected", [("error", 0), ("warning", 1), ("never", 0)])
def test_exit_code_follows_fail_on(fail_on, expected, capsys):
    # nodes constant folding removes are warnings (QP020): onnxruntime folds them, the HTP runs the model
    assert cli(["lint", str(fixture_path("llama_gqa_ts")), "--fail-on", fail_on]) == expected
    out = capsys.readouterr().out
    assert out.startswith(f"{fixture_path('llama_gqa_ts')}: 0 error(s)") and "fix: simplify" in out
    assert "warning QP020 constant-foldable:" in out


def test_errors_fail_by_default_and_text_names_rule_and_fix(capsys):
    assert cli(["lint", str(fixture_path("llama_gqa_dynamo"))]) == 1
    out = capsys.readouterr().out
    assert "error   QP006 constant-first-operand: node_mul_4 (Mul)" in out and "fix: simplify" in out


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    assert cli(["lint", str(tmp_path / "missing.onnx")]) == 2
    assert cli(["lint", str(fixture_path("llama_gqa_ts")), "--ignore", "QP999"]) == 2
    err = capsys.readouterr().err
    assert "QP999" in err and all(line.startswith("qnnpasses") for line in err.strip().splitlines())


def test_list_rules(capsys):
    assert cli(["lint", "--list-rules"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == len(all_rules())


def test_several_models_give_one_sarif_log_with_a_run_each(capsys):
    models = [str(fixture_path(n)) for n in ("bert_dynamo", "gpt2_dynamo")]
    assert cli(["lint", *models, "--format", "sarif", "--fail-on", "never"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["runs"]) == 2 and not list(jsonschema.Draft4Validator(SARIF_SCHEMA).iter_errors(doc))


# --------------------------------------------------------------------------- pre-commit hook


def _parse_hook_list(text: str) -> list[dict[str, str]]:
    """The minimal YAML of a hooks file: a list of flat ``key: value`` mappings."""
    hooks: list[dict[str, str]] = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = re.match(r"^(- |  )([\w-]+):\s*(.*)$", line)
        assert m, f"unexpected line in .pre-commit-hooks.yaml: {line!r}"
        if m.group(1) == "- ":
            hooks.append({})
        hooks[-1][m.group(2)] = m.group(3).strip()
    return hooks


def test_pre_commit_hook_definition():
    [hook] = _parse_hook_list((ROOT / ".pre-commit-hooks.yaml").read_text())
    assert hook["id"] == "qnnpasses-lint" and hook["language"] == "python"
    assert hook["entry"] == "qnnpasses lint --fail-on error"
    assert re.search(hook["files"], "models/decoder.onnx") and not re.search(hook["files"], "decoder.onnx.data")
    # pre-commit appends the staged file names to the entry: that command line must parse
    from qnnpasses.cli import build_parser

    args = build_parser().parse_args(hook["entry"].split()[1:] + ["a.onnx", "b.onnx"])
    assert args.model == ["a.onnx", "b.onnx"] and args.fail_on == "error"
