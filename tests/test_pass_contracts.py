"""Pass contracts and properties: what a pass declares, the manager enforces and the order follows."""

from __future__ import annotations

import random

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from conftest import fixture_inputs, fixture_path

from qnnpasses.errors import PipelineSpecError
from qnnpasses.ir.load import load_model
from qnnpasses.passmanager.api import (
    CASE_PADDED_LEFT,
    CASE_RANDOM,
    EXACT,
    Contract,
    Pass,
    PassResult,
    approximate,
    assumes,
    changes_interface,
    get_property,
    register_pass,
    register_property,
    registered_passes,
)
from qnnpasses.passmanager.manager import (
    CHANGED,
    ROLLED_BACK,
    SKIPPED,
    PassManager,
    RunConfig,
)
from qnnpasses.passmanager.named import (
    CONTRIB_LOWERINGS,
    HTP_LLM_LAST,
    HTP_LLM_PASSES,
    derive_order,
    named_pipelines,
)
from qnnpasses.passmanager.spec import parse_pipeline

MODEL = "llama_gqa_ts"  # input_ids + attention_mask -> logits


def _run(spec, **config):
    ir = load_model(fixture_path(MODEL))
    return ir, PassManager(parse_pipeline(spec), RunConfig(verify=True, **config)).run(ir)


def _before_output(ir, ctx, make):
    out = ir.graph.outputs[0]
    producer = out.inputs[0]
    fresh = gs.Variable(ctx.unique_name(ir, "pre"), dtype=out.dtype, shape=out.shape)
    producer.outputs[producer.outputs.index(out)] = fresh
    ir.graph.nodes.extend(make(fresh, out))


def _add(value):
    def make_pass(ir, ctx):
        c = gs.Constant(ctx.unique_name(ir, "c"), np.array(value, dtype=np.float32))
        _before_output(ir, ctx, lambda x, y: [gs.Node("Add", name=ctx.unique_name(ir, "add"), inputs=[x, c], outputs=[y])])
        return PassResult(changed=True)
    return make_pass


@register_pass
class SmallApprox(Pass):
    name = "test-contract-small-approx"
    summary = "adds 5e-4 within a small stated tolerance (tests only)"
    contract = approximate(atol=1e-3, rtol=0.0, min_cosine=0.9999, why="adds 5e-4")
    run = staticmethod(lambda ir, ctx: _add(5e-4)(ir, ctx))


@register_pass
class LargeApprox(Pass):
    name = "test-contract-large-approx"
    summary = "adds 0.05 within a large stated tolerance (tests only)"
    contract = approximate(atol=0.1, min_cosine=0.9, why="adds 0.05")
    run = staticmethod(lambda ir, ctx: _add(0.05)(ir, ctx))


@register_pass
class TooLarge(Pass):
    name = "test-contract-beyond-its-tolerance"
    summary = "states 1e-3 and adds 0.01 (tests only)"
    contract = approximate(atol=1e-3, min_cosine=0.9999, why="claims 1e-3")
    run = staticmethod(lambda ir, ctx: _add(0.01)(ir, ctx))


@register_pass
class RowZeroOnly(Pass):
    """Changes only rows whose query is position 0 masked -- what padded-left inputs make."""

    name = "test-contract-assumes-unpadded-start"
    summary = "logits * mask[..., :1] (tests only)"
    contract = assumes("the first position is never padding", holds_on=(CASE_RANDOM,))

    def run(self, ir, ctx):
        mask = next(t for t in ir.graph.inputs if t.name == "attention_mask")

        def make(x, y):
            f, first = (gs.Variable(ctx.unique_name(ir, n), dtype=np.float32) for n in ("f", "first"))
            starts, ends, axes = (gs.Constant(ctx.unique_name(ir, n), np.array(v, dtype=np.int64))
                                  for n, v in (("s", [0]), ("e", [1]), ("a", [1])))
            u = gs.Variable(ctx.unique_name(ir, "u"), dtype=np.float32)
            one = gs.Constant(ctx.unique_name(ir, "ax"), np.array([-1], dtype=np.int64))
            return [gs.Node("Cast", attrs={"to": 1}, inputs=[mask], outputs=[f], name=ctx.unique_name(ir, "cast")),
                    gs.Node("Slice", inputs=[f, starts, ends, axes], outputs=[first], name=ctx.unique_name(ir, "slice")),
                    gs.Node("Unsqueeze", inputs=[first, one], outputs=[u], name=ctx.unique_name(ir, "unsq")),
                    gs.Node("Mul", inputs=[x, u], outputs=[y], name=ctx.unique_name(ir, "mul"))]

        _before_output(ir, ctx, make)
        return PassResult(changed=True)


@register_pass
class RenamesOutput(Pass):
    name = "test-contract-renames-output"
    summary = "renames the first output to 'scores' (tests only)"
    contract = changes_interface("the first output is called 'scores'")

    def output_renames(self, ir, ctx):
        return {ir.graph.outputs[0].name: "scores"}

    def run(self, ir, ctx):
        ir.graph.outputs[0].name = "scores"
        return PassResult(changed=True)


@register_pass
class RenamesSilently(Pass):
    name = "test-contract-renames-silently"
    summary = "renames the first output without declaring it (tests only)"

    def run(self, ir, ctx):
        ir.graph.outputs[0].name = "renamed"
        return PassResult(changed=True)


@register_pass
class KeepsLastPosition(Pass):
    """logits [1, S, V] -> logits[:, -1:, :]: what the output keeps is declared in map_reference."""

    name = "test-contract-keeps-last-position"
    summary = "the output keeps only the last position (tests only)"
    contract = changes_interface("logits keep only the last position")

    def map_reference(self, reference, inputs):
        return {k: v[:, -1:, :] for k, v in reference.items()}

    def run(self, ir, ctx):
        def make(x, y):
            starts, ends, axes = (gs.Constant(ctx.unique_name(ir, n), np.array(v, dtype=np.int64))
                                  for n, v in (("s", [-1]), ("e", [2**62]), ("a", [1])))
            return [gs.Node("Slice", inputs=[x, starts, ends, axes], outputs=[y], name=ctx.unique_name(ir, "slice"))]

        _before_output(ir, ctx, make)
        out = ir.graph.outputs[0]
        out.shape = [out.shape[0], 1, *out.shape[2:]]
        return PassResult(changed=True)


ABSENT = register_property("test-absent", "never holds (tests only)", lambda ir: "it never holds").name


@register_pass
class NeedsAbsent(Pass):
    name = "test-contract-needs-absent"
    summary = "requires a property that never holds (tests only)"
    requires = frozenset({ABSENT})
    run = staticmethod(lambda ir, ctx: PassResult(changed=False))


@register_pass
class PromisesAbsent(Pass):
    name = "test-contract-promises-absent"
    summary = "ensures a property it does not establish (tests only)"
    ensures = frozenset({ABSENT})
    run = staticmethod(lambda ir, ctx: PassResult(changed=False))


def test_every_builtin_pass_declares_a_contract_and_known_properties():
    for name, cls in registered_passes().items():
        assert isinstance(cls.contract, Contract), name
        for prop in cls.requires | cls.ensures:
            get_property(prop)  # raises for unknown names
    assert registered_passes()["mha-to-gqa"].contract.needs_opt_in
    assert registered_passes()["attention-cleanup"].contract.kind == "assumes"
    assert registered_passes()["fix-shapes"].contract.kind == "changes-interface"


def test_unknown_property_names_fail_at_registration_with_a_clear_error():
    with pytest.raises(TypeError, match=r"requires unknown properties \['no-such-property'\].*register_property"):
        @register_pass
        class Bad(Pass):
            name = "test-contract-bad"
            summary = "declares an unknown property"
            requires = frozenset({"no-such-property"})


def test_a_small_stated_tolerance_runs_by_default_a_large_one_needs_allow_lossy():
    _, result = _run("test-contract-small-approx,test-contract-large-approx")
    small, large = result.records
    assert small.status == CHANGED and small.verification["max_abs"] == pytest.approx(5e-4, abs=1e-6)
    assert large.status == SKIPPED and "--allow-lossy" in large.reason
    _, result = _run("test-contract-large-approx", allow_lossy=True)
    assert result.records[0].status == CHANGED and result.records[0].verification["tolerance"]["atol"] == 0.1
    assert result.final_verification["ok"]


def test_an_approximation_beyond_its_stated_tolerance_is_rolled_back():
    _, result = _run("test-contract-beyond-its-tolerance")
    assert result.records[0].status == ROLLED_BACK and "contract's tolerance" in result.records[0].reason


def test_an_assumption_is_verified_only_on_inputs_that_satisfy_it():
    _, result = _run("test-contract-assumes-unpadded-start")
    record = result.records[0]
    assert record.status == CHANGED and set(record.verification["cases"]) == {CASE_RANDOM}
    # the end-to-end comparison leaves out what the assumption excludes, and says so
    assert result.final_verification["ok"] and CASE_PADDED_LEFT in result.final_verification["not_compared"]
    # declared EXACT the same rewrite fails on the padded-left inputs
    ir = load_model(fixture_path(MODEL))
    pass_ = RowZeroOnly()
    pass_.contract = EXACT
    from qnnpasses.passmanager.spec import Pipeline

    result = PassManager(Pipeline([pass_]), RunConfig(verify=True)).run(ir)
    assert result.records[0].status == ROLLED_BACK and "padded-left" in result.records[0].reason


def test_an_interface_change_is_verified_through_its_declared_mapping():
    ir, result = _run("test-contract-renames-output")
    assert result.records[0].status == CHANGED and [t.name for t in ir.graph.outputs] == ["scores"]
    assert result.final_verification["ok"] and result.final_verification["max_abs"] == 0.0
    _, result = _run("test-contract-renames-silently")
    assert result.records[0].status == ROLLED_BACK and "output is missing" in result.records[0].reason


def test_an_interface_change_of_values_is_verified_through_map_reference():
    _, result = _run("test-contract-keeps-last-position,test-contract-renames-output")
    assert [r.status for r in result.records] == [CHANGED, CHANGED]
    assert result.final_verification["ok"] and result.final_verification["max_abs"] == 0.0
    assert result.final_verification["outputs"][0]["name"] == "scores"


def test_requires_skips_with_the_reason_and_ensures_is_checked():
    _, result = _run("test-contract-needs-absent,test-contract-promises-absent")
    needs, promises = result.records
    assert needs.status == SKIPPED and needs.reason == "requires test-absent: it never holds"
    assert any("ensures test-absent, which does not hold" in n for n in promises.notes)


def test_calibration_samples_join_the_verification_cases():
    from qnnpasses.passmanager.api import PassContext

    sample = fixture_inputs(MODEL)
    ir = load_model(fixture_path(MODEL))
    manager = PassManager(parse_pipeline("test-contract-small-approx"), RunConfig(verify=True),
                          context=PassContext(calibration=[sample, {"wrong": np.zeros(1)}]))
    result = manager.run(ir)
    assert [c["name"] for c in result.verification_cases].count("given") == 1  # the misfit is left out
    assert "given" in result.records[0].verification["cases"]


#: htp-llm as it was spelled while the lowerings and fix-shapes were still pinned first by hand
HTP_LLM_BEFORE_DECLARATIONS = (
    "lower-simplified-norm,lower-gqa,lower-rotary-embedding,lower-mha,lower-matmulnbits,fix-shapes,simplify,"
    "fold-conv-affine,gathernd,lower-int64,lower-cast-to-bool,attention-cleanup,gqa-broadcast,fuse-rmsnorm,"
    "fuse-layernorm,decompose-layernorm,fuse-gelu,decompose-gelu,fp16-safety,rotary,repeat{max=3}(layout,simplify),"
    "cleanup")


def test_htp_llm_order_is_derived_from_the_declarations():
    # nothing is pinned but cleanup: the declarations give the same pipeline the hand pinning gave
    assert named_pipelines()["htp-llm"].spec == HTP_LLM_BEFORE_DECLARATIONS
    passes = registered_passes()
    contrib = set(CONTRIB_LOWERINGS)
    assert all(passes[name].ensures & passes["fix-shapes"].requires for name in contrib)
    # whatever the tie-break list, every pass ensuring a property precedes every pass requiring it,
    # the onnxruntime-op lowerings come before fix-shapes, and fix-shapes before everything else
    for seed in range(5):
        names = list(HTP_LLM_PASSES)
        random.Random(seed).shuffle(names)
        order = derive_order(names, last=HTP_LLM_LAST)
        assert order[-1] == HTP_LLM_LAST[-1]
        position = {n: i for i, n in enumerate(order)}
        for a in order:
            for b in order:
                if passes[a].ensures & passes[b].requires and a != b:
                    assert position[a] < position[b], (a, b)
        assert max(position[n] for n in contrib) < position["fix-shapes"] < position["simplify"], order
        assert all(position["fix-shapes"] < i for n, i in position.items() if n not in contrib | {"fix-shapes"}), order
        assert position["lower-cast-to-bool"] > position["simplify"], order
    # decompositions after fusions, whatever the list says
    order = derive_order(["decompose-layernorm", "fuse-layernorm", "simplify"])
    assert order.index("fuse-layernorm") < order.index("decompose-layernorm")
    assert order.index("simplify") < order.index("fuse-layernorm")


def test_hard_rules_are_asserted():
    with pytest.raises(PipelineSpecError, match="must run first"):
        derive_order(["simplify", "fuse-rmsnorm"], first=("fuse-rmsnorm",))
    with pytest.raises(PipelineSpecError, match="must run last"):
        derive_order(["simplify", "fuse-rmsnorm"], last=("simplify",))


def test_passes_command_shows_contracts(capsys):
    from qnnpasses.cli import main

    assert main(["passes"]) == 0
    out = capsys.readouterr().out
    assert "contract: approximate" in out and "needs --allow-lossy" in out  # mha-to-gqa
    assert "contract: exact assuming scores stay within +-|mask_value|/2" in out
    assert main(["passes", "--properties"]) == 0
    assert "static-shapes" in capsys.readouterr().out
