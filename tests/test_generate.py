"""The generation loop (``qnnpasses generate``, :class:`qnnpasses.llm.runner.Runner`) on a
random-weight LLaMA/GQA KV-cache export turned into a prefill + decode pair (context 256,
prefill 16): its greedy tokens and teacher-forced logits against the original dynamic-KV
export run with a growing cache on onnxruntime CPU, the same tokens on the HTP, the JSON
report, and bad input refused with one line and exit 2."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import qnnpasses.passes  # noqa: F401 - registers the passes the llm build runs
from conftest import fixture_path, htp_backend_available, requires_htp

from qnnpasses.cli import main as cli_main
from qnnpasses.llm.convert import build
from qnnpasses.llm.reference import ReferenceModel
from qnnpasses.llm.runner import Runner, RunnerError

SOURCE = fixture_path("llama_gqa_kv_dyn_ts")
CONTEXT, PREFILL, VOCAB = 256, 16, 256
#: 40 tokens: two full prefill chunks and a padded third one
PROMPT = [(i * 37 + 11) % VOCAB for i in range(40)]
NEW = 24


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("llm") / "pair"
    build(SOURCE, out, context=CONTEXT, prefill=PREFILL, compile=htp_backend_available(), probe=False)
    return out


@pytest.fixture(scope="module")
def reference():
    return ReferenceModel(SOURCE)


@pytest.fixture(scope="module")
def cpu_run(pair):
    runner = Runner(pair, on="cpu")
    return runner, runner.generate(PROMPT, NEW, keep_logits=True)


def test_cpu_greedy_tokens_are_the_original_exports(cpu_run, reference):
    _runner, result = cpu_run
    assert result.tokens == reference.generate(PROMPT, NEW)
    assert len(result.tokens) == NEW and result.stopped == "max_new_tokens"
    assert result.prefill_calls == 3 and result.decode_calls == NEW - 1
    assert len(set(result.tokens)) > 3  # not a degenerate repetition of one token


def test_teacher_forced_logits_match_the_original(cpu_run, reference):
    """Every position through the static cache (padded chunks, decode steps) computes what the
    original computes with its growing cache."""
    runner, result = cpu_run
    got = runner.score(PROMPT, result.tokens)
    want = reference.logits(PROMPT + result.tokens)
    assert got.shape == (len(PROMPT) + NEW, VOCAB)
    assert np.max(np.abs(got - want)) <= 1e-4 * max(1.0, float(np.max(np.abs(want))))
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


def test_teacher_forcing_on_its_own_tokens_is_the_generation(cpu_run):
    """Scoring the prompt + the generated tokens repeats the generation's calls exactly (what
    tools/llm_eval.py relies on to count identical leading tokens by teacher forcing)."""
    runner, result = cpu_run
    assert np.array_equal(runner.score(PROMPT, result.tokens[:-1]), result.logits)


def test_generation_stops_when_the_context_is_full(pair, reference):
    runner = Runner(pair, on="cpu")
    prompt = [(i * 11 + 3) % VOCAB for i in range(CONTEXT - 5)]
    result = runner.generate(prompt, 20)
    assert result.stopped == "context_full" and len(result.tokens) == 5
    assert result.tokens == reference.generate(prompt, 5)


@requires_htp
def test_htp_generates_the_cpu_tokens(pair, cpu_run, capsys):
    _, cpu = cpu_run
    code = cli_main(["generate", str(pair), "--prompt-ids", ",".join(map(str, PROMPT)),
                     "--max-new-tokens", str(NEW), "--on", "htp", "--format", "json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokens"] == cpu.tokens
    assert report["files"] == {"prefill": ["prefill_ctx.onnx"], "decode": ["decode_ctx.onnx"]}


def test_json_report_with_compare(pair, cpu_run, capsys):
    _, cpu = cpu_run
    code = cli_main(["generate", str(pair), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens",
                     str(NEW), "--on", "cpu", "--format", "json", "--compare", str(SOURCE)])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokens"] == cpu.tokens and report["on"] == "cpu"
    assert report["prompt_tokens"] == len(PROMPT) and report["context"] == CONTEXT and report["prefill"] == PREFILL
    # the timings are reported as numbers (their values are host speed: benchmarks, not tests)
    assert all(isinstance(report[key], float) and math.isfinite(report[key])
               for key in ("prefill_seconds", "decode_seconds_per_token"))
    cmp = report["compare"]
    assert cmp["original_tokens"] == cpu.tokens and cmp["identical_leading_tokens"] == NEW
    assert cmp["teacher_forced_positions"] == len(PROMPT) + NEW - 1 and cmp["teacher_forced_top1"] == 1.0


def test_text_report(pair, capsys):
    assert cli_main(["generate", str(pair), "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--on", "cpu"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("new tokens (2): ")


@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", ""], "empty"),
    (["--prompt-ids", "1,x"], "integers"),
    (["--prompt-ids", str(VOCAB)], "outside the vocabulary"),
    (["--prompt-ids", ",".join(["1"] * (CONTEXT + 1))], "more than the context"),
    (["--prompt-ids", "1", "--max-new-tokens", "-1"], "negative"),
    (["--prompt-ids", "1", "--compare", str(fixture_path("llama_gqa_ts"))], "no KV cache"),
])
def test_bad_input_exits_2(pair, capsys, args, message):
    assert cli_main(["generate", str(pair), "--on", "cpu", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], captured.err


def test_missing_or_invalid_manifest_exits_2(tmp_path, capsys):
    assert cli_main(["generate", str(tmp_path / "absent"), "--prompt-ids", "1", "--on", "cpu"]) == 2
    (tmp_path / "llm.json").write_text('{"format": "something-else"}')
    assert cli_main(["generate", str(tmp_path), "--prompt-ids", "1", "--on", "cpu"]) == 2
    (tmp_path / "llm.json").write_text("{not json")
    assert cli_main(["generate", str(tmp_path), "--prompt-ids", "1", "--on", "cpu"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 3 and all(e.startswith("qnnpasses: error: ") for e in errors), errors


def test_runner_refuses_a_missing_graph_file(pair, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "llm.json").write_text((pair / "llm.json").read_text())
    with pytest.raises(RunnerError, match="missing file prefill.onnx"):
        Runner(broken, on="cpu")
