"""The textual pipeline form: parsing, typed options, round trips and errors."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from qnnpasses.errors import PipelineSpecError
from qnnpasses.passmanager.api import Pass, PassResult, register_pass
from qnnpasses.passmanager.spec import Repeat, parse_pipeline


@register_pass
class _TypedOptionsPass(Pass):
    name = "test-typed-options"
    summary = "a pass with one option of each type (tests only)"

    @dataclass
    class Options:
        count: int = 1
        scale: float = 0.5
        enabled: bool = True
        label: str = "x"
        dims: tuple[int, ...] = ()
        limit: int | None = None

    def run(self, ir, ctx):
        return PassResult(changed=False)


def test_options_are_converted_to_their_declared_types():
    (p,) = parse_pipeline("test-typed-options{count=0x10,scale=2e-3,enabled=no,label=abc,dims=1:128:64,limit=7}").items
    o = p.options
    assert (o.count, o.scale, o.enabled, o.label, o.dims, o.limit) == (16, 0.002, False, "abc", (1, 128, 64), 7)


@pytest.mark.parametrize(
    "text",
    [
        "cleanup",
        "test-typed-options{count=3},cleanup",
        "repeat(cleanup,test-typed-options{scale=0.25})",
        "cleanup,repeat{max=2}(cleanup,repeat(cleanup)),test-typed-options{enabled=false,dims=1:2}",
    ],
)
def test_textual_form_round_trips(text):
    pipeline = parse_pipeline(text)
    assert pipeline.to_text() == text
    assert parse_pipeline(pipeline.to_text()).to_text() == text


def test_options_print_in_declaration_order():
    assert parse_pipeline("test-typed-options{dims=1:2,enabled=false}").to_text() == "test-typed-options{enabled=false,dims=1:2}"


def test_whitespace_and_defaults_are_normalised():
    pipeline = parse_pipeline(" cleanup , repeat{max=4}( test-typed-options{count=1} ) ")
    assert pipeline.to_text() == "cleanup,repeat(test-typed-options)"
    assert isinstance(pipeline.items[1], Repeat) and pipeline.items[1].max_iterations == 4


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty pipeline"),
        ("no-such-pass", "unknown pass 'no-such-pass'"),
        ("cleanup{x=1}", "has no option 'x'"),
        ("test-typed-options{count=many}", "expected an integer"),
        ("test-typed-options{enabled=maybe}", "expected true/false"),
        ("test-typed-options{count=1,count=2}", "given twice"),
        ("test-typed-options{count=}", "empty option value"),
        ("test-typed-options{count=1", "expected '}'"),
        ("cleanup,,cleanup", "expected a pass name"),
        ("cleanup cleanup", "expected ',' or the end"),
        ("repeat(cleanup", "expected ',' or ')'"),
        ("repeat{max=0}(cleanup)", "at least 1"),
        ("repeat{times=2}(cleanup)", "only the option 'max'"),
        ("repeat{max=two}(cleanup)", "must be an integer"),
    ],
)
def test_malformed_specs_name_the_problem(text, message):
    with pytest.raises(PipelineSpecError, match=re.escape(message)):
        parse_pipeline(text)


def test_register_pass_rejects_bad_declarations():
    with pytest.raises(TypeError, match="summary"):

        @register_pass
        class NoSummary(Pass):
            name = "test-no-summary"

    with pytest.raises(TypeError, match="name"):

        @register_pass
        class BadName(Pass):
            name = "bad name,"
            summary = "x"

    with pytest.raises(TypeError, match="already registered"):

        @register_pass
        class Duplicate(Pass):
            name = "cleanup"
            summary = "x"


def test_split_items_keeps_options_and_repeats_whole():
    from qnnpasses.passmanager.spec import split_items

    assert split_items("none, rotate-residual{a=1,b=2},repeat{max=3}(simplify,cleanup),") == [
        "none", "rotate-residual{a=1,b=2}", "repeat{max=3}(simplify,cleanup)"]
    assert split_items("") == []


def test_pipeline_variants_are_declared_options_on_the_named_pipeline():
    from qnnpasses.errors import PipelineSpecError
    from qnnpasses.passmanager.named import get_pipeline

    plain, quantized = get_pipeline("htp-llm").to_text(), get_pipeline("htp-llm", "quantized").to_text()
    assert quantized == (plain.replace("attention-cleanup,", "attention-cleanup{assume_unmasked_rows=true},")
                         .replace("(layout,", "(layout{head_proj=false},"))
    assert get_pipeline("htp-llm", "pair").to_text() == plain.replace(
        "attention-cleanup,", "attention-cleanup{assume_unmasked_rows=true},")
    with pytest.raises(PipelineSpecError, match="unknown variant 'int3'"):
        get_pipeline("htp-llm", "int3")
