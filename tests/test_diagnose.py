"""``qnnpasses diagnose``: the bisection (with a fake compiler, fast) and the real case on the
HTP: ``llama_gqa_dynamo`` fails to finalize as a whole, and the culprit is the first RMSNorm's
weight multiply ``node_mul_4`` (``Mul(weight, x)``), which ``simplify`` fixes."""

from __future__ import annotations

import json
import math

import onnx
import onnx.parser
import pytest
from conftest import fixture_path, requires_htp

from qnnpasses.debug.diagnose import (
    bisect_failure,
    diagnose,
    failure_kind,
    named_nodes,
    render_text,
    root_cause,
)


class FakeCompiler:
    """Fails a window when it holds every node of one of the ``culprits`` sets; counts calls."""

    def __init__(self, *culprits: set[int]):
        self.culprits = culprits
        self.calls: list[tuple[int, int]] = []

    def __call__(self, start: int, end: int) -> bool:
        self.calls.append((start, end))
        return any(all(start <= i < end for i in c) for c in self.culprits)


def probe_budget(n: int) -> int:
    return 2 * math.ceil(math.log2(n)) + 2


@pytest.mark.parametrize("n, culprit", [(133, 37), (133, 0), (133, 132), (1, 0), (2, 1), (1000, 617)])
def test_single_culprit_is_found_exactly(n, culprit):
    fake = FakeCompiler({culprit})
    assert bisect_failure(n, fake) == (culprit, culprit + 1)
    assert len(fake.calls) == len(set(fake.calls)) <= probe_budget(n)


@pytest.mark.parametrize("first, last", [(10, 37), (0, 132), (60, 61)])
def test_failure_needing_two_nodes_gives_the_window_spanning_both(first, last):
    fake = FakeCompiler({first, last})
    assert bisect_failure(133, fake) == (first, last + 1)
    assert len(fake.calls) <= probe_budget(133)


def test_earliest_ending_culprit_wins_when_there_are_several():
    assert bisect_failure(100, FakeCompiler({70}, {20, 30}, {90})) == (20, 31)


def test_model_that_compiles_gives_none_after_one_full_probe():
    fake = FakeCompiler()
    assert bisect_failure(50, fake) is None
    assert (0, 50) in fake.calls and len(fake.calls) <= probe_budget(50)
    assert bisect_failure(0, fake) is None


def test_error_classification_and_backend_lines():
    finalize = "EP_FAIL : Failed to finalize QNN graph. Error: QNN_COMMON_ERROR_MEM_ALLOC [could not create op: q::X]"
    assert failure_kind(finalize) == "finalize"
    assert failure_kind("EP_FAIL : Failed to compose Qnn graph.") == "compose"
    assert failure_kind("backend process killed by SIGSEGV") == "crash"
    assert failure_kind("timed out after 5s") == "timeout"
    assert failure_kind(None) is None
    lines = ["unexpected thing", "Failed to validate op /m/Slice_6 with error 0xc26",
             "could not create op: q::ForceFormat_Crouton", '"node_mul_4" generated: could not create op']
    assert root_cause(lines)[0] == '"node_mul_4" generated: could not create op' and "unexpected thing" not in root_cause(lines)
    assert named_nodes(lines) == ["node_mul_4", "/m/Slice_6"]


# --------------------------------------------------------------------------- on the real HTP


@pytest.fixture(scope="module")
def llama_diagnosis():
    return diagnose(fixture_path("llama_gqa_dynamo"), timeout=120)


@requires_htp
def test_llama_gqa_dynamo_culprit_is_the_constant_first_norm_weight_mul(llama_diagnosis):
    d = llama_diagnosis
    print("\n" + render_text(d))
    assert not d.ok and failure_kind(d.error) == "finalize"
    assert any("could not create op" in line for line in d.root_cause)
    assert d.named_by_backend[0] == "node_mul_4"  # then the GatherND the EP left on the CPU
    assert d.culprit == {"name": "node_mul_4", "op_type": "Mul"} and d.confirmed_by_backend
    ops = [n["op_type"] for n in d.window]
    assert ops == ["Pow", "ReduceMean", "Add", "Sqrt", "Reciprocal", "Mul", "Mul"]  # the first RMSNorm, whole
    assert failure_kind(d.culprit_error) == "finalize"
    assert len(d.probes) < 20 and d.nodes > 100
    assert {(f["rule"], f["fix"]) for f in d.lint if f["node"] == "node_mul_4"} >= {("QP006", "simplify")}


@requires_htp
def test_the_fix_lint_names_makes_the_model_compile(tmp_path):
    """``simplify`` (operands swapped) turns the same model into one the HTP compiles."""
    from qnnpasses.backends.htp import probe_placement
    from qnnpasses.ir.load import load_model
    from qnnpasses.ir.model import save_model
    from qnnpasses.passmanager.manager import PassManager
    from qnnpasses.passmanager.spec import parse_pipeline

    ir = load_model(fixture_path("llama_gqa_dynamo"))
    PassManager(parse_pipeline("simplify")).run(ir)
    save_model(ir, tmp_path / "fixed.onnx")
    placement = probe_placement(tmp_path / "fixed.onnx")
    assert placement.ok, placement.error


@requires_htp
def test_cli_json_and_exit_codes(tmp_path, capsys):
    from qnnpasses.cli import main as cli

    text = """<ir_version: 8, opset_import: ["" : 18]> main (float[1, 16, 64] x) => (float[1, 16, 64] y) {
        two = Constant <value = float {2.0}> ()
        eps = Constant <value = float {1e-6}> ()
        axes = Constant <value = int64[1] {-1}> ()
        w = Constant <value = float[64] {WEIGHTS}> ()
        p = Pow (x, two)
        m = ReduceMean <keepdims = 1> (p, axes)
        a = Add (m, eps)
        s = Sqrt (a)
        r = Reciprocal (s)
        n = Mul (x, r)
        g = Mul (w, n)
        y = Add (g, x)
    }""".replace("WEIGHTS", ", ".join(["1.5"] * 64))
    bad = tmp_path / "rms.onnx"
    onnx.save(onnx.parser.parse_model(text), bad)
    assert cli(["diagnose", str(bad), "--format", "json", "--timeout", "60"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["culprit"]["op_type"] == "Mul" and report["probe_count"] < 10
    assert [n["op_type"] for n in report["window"]][-2:] == ["Mul", "Mul"]
    good = tmp_path / "good.onnx"
    onnx.save(onnx.parser.parse_model(text.replace("g = Mul (w, n)", "g = Mul (n, w)")), good)
    assert cli(["diagnose", str(good)]) == 0
    assert "compiles and runs on the HTP" in capsys.readouterr().out
    assert cli(["diagnose", str(good), "--timeout", "0"]) == 2
