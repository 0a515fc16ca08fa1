"""Trained weights through the whole deployment path: SmolLM2-135M exported with a dynamic KV
cache (``tools/trained_fixtures.py``, ``kv_ts``) -> ``qnnpasses llm`` (static prefill + decode
pair) -> greedy generation on the HTP in fp16, against the original export run in fp32 on
onnxruntime CPU with a growing cache.  Its massive activations (|h| ~ 25,800) are what break
fp16 on the HTP; the full figures (4 prompts, both exporters, w8a16) are in docs/llm.md.  The
second family, Gemma 3 270M, goes the same way (docs/llm_gemma3_270m.md).  The tests that
generate for minutes on the simulated HTP carry the ``heavy`` marker (README, "Heavier suites").

Greedy decoding of real text meets fp32 near-ties often (top-2 logit margins of 0.001-0.03),
and no fp16 run can be expected to break every such tie as fp32 does: its activations carry
fp16's rounding into the logits (docs/llm.md lists the margin at every token that differs).  The prompt here
is one whose fp32 continuation is decided wherever it generates (the test checks that premise on the CPU),
so the issue's bars apply to it unchanged.  One more prompt starts at a near-tie that only the
rounding of the logits decides (a margin below half of fp16's spacing there): the pair's logits,
offset by the first tokens' maximum, resolve it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import requires_htp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import trained_fixtures as tf

pytestmark = [pytest.mark.trained, requires_htp]

CONTEXT, PREFILL, NEW = 64, 16, 32
WINDOW, START, PROMPT_TOKENS = 0, 32, 16  # eval window 0, tokens 32..47: fp32 top-2 margins >= 0.1
DECIDED = 0.1  # fp32 top-1 minus top-2 logit above which fp16 must agree
GEMMA_WINDOW = 7  # Gemma 3: eval window 7 from its BOS, fp32 top-2 margins >= 0.159 where it generates
TIE_WINDOW, TIE_NEW = 7, 8  # SmolLM2: eval window 7 from its start, a near-tie at the first generated token


def _kv_pair(tmp_path_factory, model: str, window: int, start: int) -> tuple[Path, Path, list[int]]:
    """``model``'s TorchScript KV export (built on first use), its fp16 pair and a prompt of
    ``PROMPT_TOKENS`` tokens from eval window ``window`` at ``start``."""
    try:
        tf.ensure_built(model, "kv_ts")
    except RuntimeError as exc:  # the weights package (or its loader's needs) is missing
        pytest.skip(str(exc))
    import qnnpasses.passes  # noqa: F401 - registers the passes

    from qnnpasses.llm.convert import build

    export = tf.DEFAULT_CACHE / f"{model}_kv_ts.onnx"
    out = tmp_path_factory.mktemp(model) / "pair"
    # the session on the .onnx graphs prepares them for the HTP exactly as compiling does
    build(export, out, context=CONTEXT, prefill=PREFILL, compile=False, probe=False)
    with np.load(tf.DEFAULT_CACHE / f"{model}.eval.npz") as data:
        prompt = data["input_ids"][window, start:start + PROMPT_TOKENS].tolist()
    return export, out, prompt


def _generates_the_originals_tokens_on_the_htp(export: Path, pair: Path, prompt: list[int]) -> None:
    """The pair on the HTP (fp16, CPU fallback disabled) generates ``NEW`` tokens greedily: at
    least 30 are the original's (fp32 on the CPU, growing cache), and fed the original's
    sequence its argmax is the original's at >= 98% of the positions.  The premise, checked
    first: fp32 leads by ``DECIDED`` or more wherever a token is generated."""
    from qnnpasses.llm.reference import ReferenceModel, leading_matches
    from qnnpasses.llm.runner import Runner

    reference = ReferenceModel(export)
    expected = reference.generate(prompt, NEW)
    fp32 = reference.logits(prompt + expected[:-1])
    top2 = np.sort(fp32, axis=-1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    assert margin[len(prompt) - 1:].min() >= DECIDED  # the premise: fp32 is decided at every generated token

    runner = Runner(pair, on="htp")  # CPU fallback disabled: 0 CPU nodes or no session
    result = runner.generate(prompt, NEW, keep_logits=True)
    assert leading_matches(result.tokens, expected) >= 30, (result.tokens, expected)
    # teacher forcing: the original's sequence through the pair (when the generation fed exactly
    # that sequence, its own logits are the teacher-forced ones), argmax at every position
    forced = result.logits if result.tokens == expected else runner.score(prompt, expected[:-1])
    agree = forced.argmax(-1) == fp32.argmax(-1)
    assert agree.size == PROMPT_TOKENS + NEW - 1
    assert agree.mean() >= 0.98, [(int(i), float(margin[i])) for i in np.flatnonzero(~agree)]


@pytest.fixture(scope="module")
def smollm2_pair(tmp_path_factory):
    return _kv_pair(tmp_path_factory, "smollm2_135m", WINDOW, START)


@pytest.mark.heavy
def test_smollm2_pair_generates_the_originals_tokens_on_the_htp_fp16(smollm2_pair):
    _generates_the_originals_tokens_on_the_htp(*smollm2_pair)


@pytest.mark.heavy
def test_smollm2_pair_orders_a_near_tie_plain_fp16_logits_cannot(tmp_path_factory):
    """The start of eval window 7: fp32's first generated token leads its runner-up by less than half
    of fp16's spacing at that logit, so plain fp16 logits can round the two to one value (the plain
    pair on the HTP loses it: docs/llm.md).  The default pair's logits come out relative to the first
    tokens' maximum, where fp16 resolves the margin: it generates the original's tokens."""
    from qnnpasses.llm.reference import ReferenceModel, leading_matches
    from qnnpasses.llm.runner import Runner

    export, pair, prompt = _kv_pair(tmp_path_factory, "smollm2_135m", TIE_WINDOW, 0)
    reference = ReferenceModel(export)
    expected = reference.generate(prompt, TIE_NEW)
    first = np.sort(reference.logits(prompt)[-1])[-2:]
    assert first[1] - first[0] < np.spacing(np.float16(first[1])) / 2, first  # the premise: a near-tie
    manifest = json.loads((pair / "llm.json").read_text())
    assert manifest["graphs"]["decode"]["roles"]["logits_offset"] == "logits_offset"
    result = Runner(pair, on="htp").generate(prompt, TIE_NEW)
    assert leading_matches(result.tokens, expected) == TIE_NEW, (result.tokens, expected)


@pytest.mark.heavy
def test_gemma3_pair_generates_the_originals_tokens_on_the_htp_fp16(tmp_path_factory):
    """The second trained family (Gemma 3 270M: q/k norms, post-norms, (1 + w) RMSNorm, scaled
    embedding, 262,144-token vocabulary, exported with transformers' default attention): its
    fp16 pair on the HTP as SmolLM2's.  The prompt is the start of eval window 7 (BOS first, as
    Gemma was trained), where fp32 leads by >= 0.159 at every generated token; the figures over
    4 prompts and both exporters are in docs/llm_gemma3_270m.md."""
    _generates_the_originals_tokens_on_the_htp(*_kv_pair(tmp_path_factory, "gemma3_270m", GEMMA_WINDOW, 0))


# --------------------------------------------------------------------------- text in, text out


def _hf_folder():
    """SmolLM2 as a user's Hugging Face folder (the ``hf`` export), built on first use, and its record."""
    try:
        record = tf.ensure_built("smollm2_135m", tf.HF_EXPORTER)
    except RuntimeError as exc:
        pytest.skip(str(exc))
    import qnnpasses.passes  # noqa: F401 - registers the passes

    return record, tf.hf_model_path(tf.SPECS["smollm2_135m"], tf.DEFAULT_CACHE).parent


@pytest.fixture(scope="module")
def smollm2_text_bundle(tmp_path_factory):
    """Trained SmolLM2 as a user's Hugging Face folder (default attention, tokenizer files beside
    model.onnx: the ``hf`` export) -> a bundle that carries the tokenizer; transformers' results."""
    record, folder = _hf_folder()
    from qnnpasses.llm.convert import build

    out = tmp_path_factory.mktemp("smollm2_text") / "bundle"
    build(folder, out, context=CONTEXT, prefill=PREFILL, compile=False, probe=False)
    return out, record["exports"][tf.HF_EXPORTER]["text"]


def _generate(capsys, bundle, *args) -> dict:
    import json

    from qnnpasses.cli import main as cli_main

    assert cli_main(["generate", str(bundle), *map(str, args), "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def _leading(a: list[int], b: list[int]) -> int:
    from qnnpasses.llm.reference import leading_matches

    return leading_matches(a, b)


def test_smollm2_prompt_text_gives_transformers_tokens_on_the_cpu(smollm2_text_bundle, capsys):
    bundle, hf = smollm2_text_bundle
    report = _generate(capsys, bundle, "--prompt", hf["prompt"], "--max-new-tokens", 16, "--on", "cpu")
    assert report["prompt_ids"] == hf["prompt_ids"]
    assert _leading(report["tokens"], hf["greedy"][:16]) >= 14, (report["tokens"], hf["greedy"])
    assert "Paris" in report["text"]
    # transformers' generate() stopped at the end of sequence (its 30th token); so does generate
    assert hf["greedy"][-1] == hf["eos_token_id"] and len(hf["greedy"]) < 40
    report = _generate(capsys, bundle, "--prompt", hf["prompt"], "--max-new-tokens", 40, "--on", "cpu")
    assert report["stopped"] == "eos" and report["tokens"][-1] == hf["eos_token_id"]
    assert _leading(report["tokens"], hf["greedy"]) >= len(hf["greedy"]) - 2


def test_smollm2_chat_prompt_is_transformers_and_sampling_is_seeded(smollm2_text_bundle, capsys):
    bundle, hf = smollm2_text_bundle
    args = ["--prompt", hf["chat_message"], "--chat", "--max-new-tokens", 8, "--on", "cpu"]
    report = _generate(capsys, bundle, *args)
    assert report["prompt_ids"] == hf["chat_prompt_ids"]
    sampled = [_generate(capsys, bundle, *args, "--temperature", "0.8", "--top-p", "0.9", "--seed", 3)["tokens"]
               for _ in range(2)]
    assert sampled[0] == sampled[1] and len(sampled[0]) >= 1


def test_smollm2_prompt_text_on_the_htp(smollm2_text_bundle, capsys):
    bundle, hf = smollm2_text_bundle
    report = _generate(capsys, bundle, "--prompt", hf["prompt"], "--max-new-tokens", 32, "--on", "htp")
    want = min(30, len(hf["greedy"]))
    assert _leading(report["tokens"], hf["greedy"]) >= want, (report["tokens"], hf["greedy"])


# --------------------------------------------------------------------------- onnxruntime-genai's bundle


@pytest.fixture(scope="module")
def smollm2_genai_bundle(tmp_path_factory):
    """The same folder as a ``--bundle genai`` (uint8 cache, key transposed, plain logits)."""
    record, folder = _hf_folder()
    from qnnpasses.llm.convert import build

    out = tmp_path_factory.mktemp("smollm2_genai") / "bundle"
    build(folder, out, context=CONTEXT, prefill=PREFILL, compile=False, probe=False, bundle="genai")
    return folder, out, record["exports"][tf.HF_EXPORTER]["text"]


def test_smollm2_genai_bundle_runs_in_onnxruntime_genai(smollm2_genai_bundle, capsys):
    """onnxruntime-genai generates what our runner generates from the bundle, and the 8-bit cache
    keeps teacher-forced top-1 near the float pair's (docs/llm_bundles.md has the figures)."""
    og = pytest.importorskip("onnxruntime_genai")
    from qnnpasses.llm.genai import HOST_VERSIONS

    if og.__version__ not in HOST_VERSIONS:
        pytest.skip(f"onnxruntime-genai {og.__version__} has no windowed cache on the CPU")
    folder, bundle, hf = smollm2_genai_bundle
    ours = _generate(capsys, bundle, "--prompt", hf["prompt"], "--max-new-tokens", 16, "--on", "cpu")
    theirs = _generate(capsys, bundle, "--prompt", hf["prompt"], "--max-new-tokens", 16, "--on", "cpu",
                       "--runtime", "onnxruntime-genai")
    assert ours["prompt_ids"] == hf["prompt_ids"] and theirs["tokens"] == ours["tokens"]
    from qnnpasses.llm.reference import ReferenceModel
    from qnnpasses.llm.runner import Runner

    reference, runner = ReferenceModel(folder / "model.onnx"), Runner(bundle, on="cpu")
    with np.load(tf.DEFAULT_CACHE / "smollm2_135m.eval.npz") as data:
        windows = data["input_ids"][:4, :CONTEXT - 1]
    agree = [float((runner.score(list(w[:16]), list(w[16:])).argmax(-1) == reference.logits(list(w)).argmax(-1)).mean())
             for w in windows.tolist()]
    assert np.mean(agree) >= 0.95, agree


# --------------------------------------------------------------------------- Genie's bundle


@pytest.fixture(scope="module")
def smollm2_genie_bundle(tmp_path_factory):
    """The same folder as a compiled ``--bundle genie`` (Genie's inputs, uint8 cache, context binaries)."""
    record, folder = _hf_folder()
    from qnnpasses.llm.convert import build

    out = tmp_path_factory.mktemp("smollm2_genie") / "bundle"
    build(folder, out, context=CONTEXT, prefill=PREFILL, compile=True, probe=False, bundle="genie")
    return out, record["exports"][tf.HF_EXPORTER]["text"]


@pytest.mark.heavy
def test_smollm2_genie_bundle_runs_in_genie(smollm2_genie_bundle, capsys):
    """Genie itself (libGenie.so, simulated HTP) generates transformers' tokens from the text prompt,
    and exactly what our runner generates from the same context binaries (docs/llm_bundles.md)."""
    from qnnpasses.llm.genie import library_path

    if library_path() is None:
        pytest.skip("libGenie.so is not installed (it ships in the onnxruntime-qnn wheel)")
    bundle, hf = smollm2_genie_bundle
    args = ["--prompt", hf["prompt"], "--max-new-tokens", 32, "--on", "htp"]
    ours = _generate(capsys, bundle, *args)
    genie = _generate(capsys, bundle, *args, "--runtime", "genie")
    # Genie ends at the end of sequence without handing that token over
    assert ours["prompt_ids"] == hf["prompt_ids"] and ours["stopped"] == genie["stopped"] == "eos"
    assert genie["tokens"] == ours["tokens"][:-1] and "Paris" in genie["text"]
    assert _leading(genie["tokens"], hf["greedy"]) >= min(30, len(hf["greedy"])) - 1, (genie["tokens"], hf["greedy"])
