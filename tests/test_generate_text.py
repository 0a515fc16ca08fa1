"""Text in, text out: the tokenizer travels with the bundle, ``generate --prompt`` / ``--chat``,
sampling, end of sequence, streaming, and bad input (one line, exit 2).

The model is the random-weight LLaMA/GQA KV-cache export (vocabulary 256) put in a Hugging Face
style folder beside a word-level tokenizer of exactly 256 ids made here with the ``tokenizers``
package (its post-processor adds BOS; a chat template in tokenizer_config.json).  The tokens are
checked against the original export run greedily on onnxruntime CPU, the chat prompt ids
against transformers' own ``apply_chat_template`` on the same folder.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import qnnpasses.passes  # noqa: F401 - registers the passes the llm build runs
from conftest import fixture_path, htp_backend_available, requires_htp

from qnnpasses.cli import main as cli_main
from qnnpasses.llm.convert import build
from qnnpasses.llm.reference import ReferenceModel
from qnnpasses.llm.runner import Runner
from qnnpasses.llm.sampling import Sampler, SamplingError, SamplingOptions
from qnnpasses.llm.tokenizer import StreamDecoder, TextTokenizer

SOURCE = fixture_path("llama_gqa_kv_dyn_ts")
CONTEXT, PREFILL, VOCAB = 128, 8, 256
SPECIALS = ["<unk>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPT = "w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21"
NEW = 12


def write_tokenizer(folder, vocab: int = VOCAB, eos: int | None = None) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    words = [f"w{i}" for i in range(vocab - len(SPECIALS))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIALS + words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 1)])
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
        "unk_token": "<unk>", "chat_template": TEMPLATE}))
    if eos is not None:
        (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, eos]}))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A model folder as a user has it: the export and its tokenizer files side by side."""
    root = tmp_path_factory.mktemp("hf") / "model"
    root.mkdir()
    shutil.copyfile(SOURCE, root / "model.onnx")
    write_tokenizer(root)
    return root


@pytest.fixture(scope="module")
def bundle(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("bundle") / "pair"
    build(folder, out, context=CONTEXT, prefill=PREFILL, compile=htp_backend_available(), probe=False)
    return out


@pytest.fixture(scope="module")
def text(folder):
    return TextTokenizer(folder)


@pytest.fixture(scope="module")
def greedy(text):
    """The original export's greedy tokens for PROMPT (fp32, onnxruntime CPU)."""
    return ReferenceModel(SOURCE).generate(text.encode(PROMPT), NEW)


def run_json(capsys, *args) -> dict:
    assert cli_main(["generate", *map(str, args), "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_tokenizer_travels_with_the_bundle(bundle, folder):
    manifest = json.loads((bundle / "llm.json").read_text())
    entry = manifest["tokenizer"]
    assert entry["files"] == ["tokenizer.json", "tokenizer_config.json"]
    assert (entry["bos_token_id"], entry["eos_token_ids"], entry["pad_token_id"]) == (1, [2], None)
    assert entry["chat_template"] is True and entry["vocab_size"] == VOCAB
    for name in entry["files"]:
        assert (bundle / name).read_bytes() == (folder / name).read_bytes()


def test_prompt_text_gives_the_original_exports_greedy_tokens(bundle, text, greedy, capsys):
    report = run_json(capsys, bundle, "--prompt", PROMPT, "--max-new-tokens", NEW, "--on", "cpu")
    assert report["prompt_ids"] == [1] + [6 + i for i in range(10, 22)]  # BOS from the post-processor
    assert report["tokens"] == greedy and report["stopped"] == "max_new_tokens"
    assert report["text"] == text.decode(greedy) and report["text"].startswith("w")
    assert report["sampling"] == {"mode": "greedy"}
    assert report["time_to_first_token"] > 0 and report["tokens_per_second"] > 0


def test_text_streams_then_the_summary(bundle, text, greedy, capsys):
    assert cli_main(["generate", str(bundle), "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--on", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == text.decode(greedy)
    assert lines[1] == f"-- {NEW} new tokens"
    assert lines[-1].startswith("time to first token ") and lines[-1].endswith("tokens/s on this host")


def test_chat_prompt_ids_are_transformers(bundle, folder, text, capsys):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w30 w31 w32"}]
    want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want)
    report = run_json(capsys, bundle, "--prompt", "w30 w31 w32", "--system", "w1 w2", "--chat", "--max-new-tokens", 1,
                      "--on", "cpu")
    assert report["prompt_ids"] == want == [1, 5, 7, 8, 3, 36, 37, 38, 4]


def test_seeded_sampling_is_reproducible_and_stays_in_the_top_k(bundle, capsys):
    args = [bundle, "--prompt", PROMPT, "--max-new-tokens", NEW, "--on", "cpu", "--temperature", "1.5", "--top-k", "5"]
    first = run_json(capsys, *args, "--seed", 7)
    again = run_json(capsys, *args, "--seed", 7)
    other = run_json(capsys, *args, "--seed", 8)
    assert first["tokens"] == again["tokens"] and first["tokens"] != other["tokens"]
    assert first["sampling"] == {"mode": "sample", "temperature": 1.5, "top_k": 5, "top_p": 1.0, "seed": 7}
    runner = Runner(bundle, on="cpu")
    logits = runner.score(first["prompt_ids"], first["tokens"][:-1])[len(first["prompt_ids"]) - 1:]
    top5 = np.argsort(-logits, axis=-1)[:, :5]
    assert all(token in row for token, row in zip(first["tokens"], top5))


def test_generation_stops_at_end_of_sequence(folder, greedy, tmp_path, capsys):
    """generation_config.json's eos ids stop generation; the stopping token is the last one."""
    model = tmp_path / "model"
    model.mkdir()
    shutil.copyfile(folder / "model.onnx", model / "model.onnx")
    write_tokenizer(model, eos=greedy[3])
    build(model, tmp_path / "pair", context=CONTEXT, prefill=PREFILL, compile=False, probe=False)
    assert json.loads((tmp_path / "pair" / "llm.json").read_text())["tokenizer"]["eos_token_ids"] == [2, greedy[3]]
    stopped = run_json(capsys, tmp_path / "pair", "--prompt", PROMPT, "--max-new-tokens", NEW, "--on", "cpu")
    assert stopped["tokens"] == greedy[:4] and stopped["stopped"] == "eos"
    ignored = run_json(capsys, tmp_path / "pair", "--prompt", PROMPT, "--max-new-tokens", NEW, "--on", "cpu",
                       "--ignore-eos")
    assert ignored["tokens"] == greedy


def test_compare_takes_the_model_folder(bundle, folder, greedy, capsys):
    report = run_json(capsys, bundle, "--prompt", PROMPT, "--max-new-tokens", NEW, "--on", "cpu", "--compare", folder)
    assert report["compare"]["original_tokens"] == greedy and report["compare"]["identical_leading_tokens"] == NEW
    assert report["compare"]["teacher_forced_top1"] == 1.0


@requires_htp
def test_htp_generates_the_cpu_text(bundle, greedy, capsys):
    report = run_json(capsys, bundle, "--prompt", PROMPT, "--max-new-tokens", NEW, "--on", "htp")
    assert report["tokens"] == greedy


def test_sampler_keeps_what_top_k_and_top_p_allow():
    logits = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    probs = Sampler(SamplingOptions(temperature=1.0, top_p=0.8)).probabilities(logits)
    assert np.allclose(probs, np.array([0.5, 0.2, 0.15, 0, 0]) / 0.85)  # 0.5 + 0.2 < 0.8 needs the third
    probs = Sampler(SamplingOptions(temperature=1.0, top_k=2)).probabilities(logits)
    assert np.allclose(probs, np.array([0.5, 0.2, 0, 0, 0]) / 0.7)
    probs = Sampler(SamplingOptions(temperature=2.0)).probabilities(logits)
    assert np.allclose(probs, np.sqrt([0.5, 0.2, 0.15, 0.1, 0.05]) / np.sqrt([0.5, 0.2, 0.15, 0.1, 0.05]).sum())
    assert Sampler(SamplingOptions(temperature=1.0, top_p=0.01)).probabilities(logits).tolist() == [1, 0, 0, 0, 0]
    assert Sampler()(logits) == 0
    with pytest.raises(SamplingError):
        SamplingOptions(temperature=-1)


def test_stream_decoder_holds_back_incomplete_characters(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE({"a": 0, "\u00c3": 1, "\u00a9": 2}, []))  # byte-level: 'é' is bytes C3 A9
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(tmp_path / "tokenizer.json"))
    stream = StreamDecoder(TextTokenizer(tmp_path))
    assert [stream.push(t) for t in (0, 1, 2, 0)] == ["a", "", "\u00e9", "a"]


@pytest.mark.parametrize("args, message", [
    (["--prompt", "w1", "--temperature", "-1"], "--temperature"),
    (["--prompt", "w1", "--top-p", "0"], "--top-p"),
    (["--prompt", "w1", "--top-p", "1.5"], "--top-p"),
    (["--prompt", "w1", "--top-k", "-2"], "--top-k"),
    (["--prompt-ids", "1", "--chat"], "--chat"),
    (["--prompt", "w1", "--system", "w2"], "--chat"),
    (["--prompt", "w1", "--temperature", "1", "--compare", str(SOURCE)], "greedy"),
])
def test_bad_text_input_exits_2(bundle, capsys, args, message):
    assert cli_main(["generate", str(bundle), "--on", "cpu", *args]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1 and message in lines[0], captured.err


def test_no_tokenizer_or_no_template_exits_2(folder, tmp_path, capsys):
    plain = tmp_path / "plain"
    build(SOURCE, plain, context=CONTEXT, prefill=PREFILL, compile=False, probe=False)
    assert "tokenizer" not in json.loads((plain / "llm.json").read_text())
    assert cli_main(["generate", str(plain), "--prompt", "w1", "--on", "cpu"]) == 2
    assert "has no tokenizer" in capsys.readouterr().err
    bare = tmp_path / "bare"
    bare.mkdir()
    write_tokenizer(bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    build(SOURCE, tmp_path / "notemplate", context=CONTEXT, prefill=PREFILL, compile=False, probe=False,
          tokenizer=bare)
    assert cli_main(["generate", str(tmp_path / "notemplate"), "--prompt", "w1", "--chat", "--on", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no chat template" in err[0]


def test_llm_refuses_a_wrong_tokenizer(tmp_path, capsys):
    """A tokenizer folder without tokenizer.json, or with ids beyond the model's logits: one line,
    exit 2, nothing written."""
    empty = tmp_path / "empty"
    empty.mkdir()
    big = tmp_path / "big"
    big.mkdir()
    write_tokenizer(big, vocab=VOCAB + 100)
    for folder, message in ((empty, "has no tokenizer.json"), (big, "beyond the model's vocabulary of 256"),
                            (tmp_path / "absent", "no such folder")):
        out = tmp_path / f"out_{folder.name}"
        code = cli_main(["llm", str(SOURCE), "--out-dir", str(out), "--context", "64", "--prefill", "4",
                         "--no-compile", "--tokenizer", str(folder)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], err
        assert not out.exists()


def test_llm_takes_a_folder_with_one_model_only(tmp_path, capsys):
    (tmp_path / "none").mkdir()
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.onnx", "b.onnx"):
        shutil.copyfile(SOURCE, two / name)
    for folder, message in ((tmp_path / "none", "holds no .onnx model"), (two, "several models (a.onnx, b.onnx)")):
        code = cli_main(["llm", str(folder), "--out-dir", str(tmp_path / "out"), "--context", "64", "--prefill", "4"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], err
