"""``qnnpasses llm --bundle genai``: a bundle onnxruntime-genai loads and generates with.

The model is the random-weight LLaMA/GQA KV-cache export in a Hugging Face style folder with a
word-level tokenizer (``test_generate_text``).  What is held:

* the graphs take and give the cache as onnxruntime-genai's windowed cache and Genie do: uint8,
  key ``[kv_heads, 1, head_dim, slots]``, value ``[kv_heads, 1, slots, head_dim]``, with the
  names Qualcomm's bundles use, and one set of encodings shared by both graphs;
* onnxruntime-genai itself (its CPU provider, the release the test extra pins) generates
  exactly the tokens ``qnnpasses generate --on cpu`` generates from the same folder, for prompts
  shorter than one window, of whole windows and of several windows with a short first one;
* what the 8-bit cache costs against the original export (fp32, onnxruntime CPU), and both
  graphs on the HTP as one partition with no CPU node;
* requests onnxruntime-genai's cache cannot honour are refused in one line, exit 2, nothing written.
"""

from __future__ import annotations

import json
import numpy as np
import onnx
import pytest
import qnnpasses.passes  # noqa: F401 - registers the passes the llm build runs
from conftest import fixture_path, htp_backend_available, requires_htp
from test_generate_text import PROMPT, SOURCE, folder, write_tokenizer  # noqa: F401 - folder is a fixture

from qnnpasses.cli import main as cli_main
from qnnpasses.llm.convert import build
from qnnpasses.errors import BadInputError
from qnnpasses.llm.genai import CONFIG_NAME, HOST_VERSIONS, PAD_VALUE, check_model
from qnnpasses.llm.reference import leading_matches

CONTEXT, PREFILL, NEW = 64, 8, 16
#: prompt lengths: inside one window, exactly two, several with a short first window
LENGTHS = (3, 16, 21)


@pytest.fixture(scope="module")
def bundle(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("genai") / "bundle"
    build(folder, out, context=CONTEXT, prefill=PREFILL, compile=htp_backend_available(),
          probe=htp_backend_available(), bundle="genai")
    return out


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [[1] + [int(t) for t in rng.integers(6, 256, n - 1)] for n in LENGTHS]


def run_json(capsys, *args) -> dict:
    assert cli_main(["generate", *map(str, args), "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def initializer(model: onnx.ModelProto, name: str) -> np.ndarray:
    return next(onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.name == name)


def dequantize_scale(model: onnx.ModelProto, tensor: str) -> float:
    """The scale of the DequantizeLinear (or QuantizeLinear) next to graph tensor ``tensor``."""
    for node in model.graph.node:
        if node.op_type in ("DequantizeLinear", "QuantizeLinear") and tensor in (node.input[0], node.output[0]):
            return float(initializer(model, node.input[1]))
    raise AssertionError(f"no (De)QuantizeLinear at {tensor}")


def graph_io(model: onnx.ModelProto):
    """The graph's inputs and outputs by name, and readers of a tensor's dims and element type."""
    io = {v.name: v for v in [*model.graph.input, *model.graph.output]}

    def shape(name: str) -> list[int]:
        return [d.dim_value for d in io[name].type.tensor_type.shape.dim]

    def dtype(name: str) -> int:
        return io[name].type.tensor_type.elem_type

    return io, shape, dtype


def test_graphs_hold_the_cache_as_the_runtimes_take_it(bundle):
    manifest = json.loads((bundle / "llm.json").read_text())
    assert manifest["kv_layout"] == {"key": "HBDS", "value": "HBSD"} and manifest["kv_dtype"] == "uint8"
    assert manifest["kv_alignment"] == "right" and manifest["kv_encodings"]["zero_point"] == PAD_VALUE
    kv, hd, layers = manifest["kv_heads"], manifest["head_dim"], manifest["layers"]
    scales = {}
    for name, tokens in (("prefill", PREFILL), ("decode", 1)):
        model = onnx.load(str(bundle / f"{name}.onnx"))
        io, shape, dtype = graph_io(model)
        past = CONTEXT - tokens
        assert {"input_ids", "attention_mask", "position_ids", "logits"} <= set(io)
        assert shape("attention_mask") == [1, CONTEXT] and shape("position_ids") == [1, tokens]
        assert dtype("logits") == onnx.TensorProto.FLOAT and not any("offset" in n for n in io)
        for i in range(layers):
            assert shape(f"past_key_{i}_in") == [kv, 1, hd, past] and shape(f"past_value_{i}_in") == [kv, 1, past, hd]
            assert shape(f"past_key_{i}_out") == [kv, 1, hd, tokens] and shape(f"past_value_{i}_out") == [kv, 1, tokens, hd]
            for kind in ("key", "value"):
                for end in ("in", "out"):
                    tensor = f"past_{kind}_{i}_{end}"
                    assert dtype(tensor) == onnx.TensorProto.UINT8
                    scales.setdefault((kind, i), set()).add(dequantize_scale(model, tensor))
    for (kind, i), found in scales.items():  # one encoding per tensor, in both graphs, as the manifest says
        assert found == {np.float32(manifest["kv_encodings"][f"{kind}_scales"][i])}


def test_genai_config_describes_the_bundle(bundle):
    config = json.loads((bundle / CONFIG_NAME).read_text())
    manifest = json.loads((bundle / "llm.json").read_text())
    model, decoder = config["model"], config["model"]["decoder"]
    assert model["type"] == "decoder-pipeline" and model["context_length"] == CONTEXT
    assert (model["vocab_size"], model["bos_token_id"], model["eos_token_id"]) == (manifest["vocab"], 1, 2)
    assert decoder["sliding_window"] == {"window_size": PREFILL, "pad_value": PAD_VALUE, "alignment": "right",
                                         "slide_key_value_cache": True, "slide_inputs": True}
    qnn = decoder["session_options"]["provider_options"][0]["qnn"]
    target = manifest["target"]
    assert (qnn["soc_model"], "v" + qnn["htp_arch"]) == (str(target["soc_model"]), target["htp_arch"])
    (prompt,), (token,) = (entry.values() for entry in decoder["pipeline"])
    assert (prompt["run_on_prompt"], prompt["run_on_token_gen"], token["run_on_prompt"]) == (True, False, False)
    for entry, graph in ((prompt, "prefill"), (token, "decode")):
        part = manifest["graphs"][graph]["parts"][0]
        assert entry["filename"] == (part["compiled"] or part["onnx"]) and (bundle / entry["filename"]).is_file()
        assert entry["inputs"] == part["inputs"] and entry["outputs"] == part["outputs"]


def test_onnxruntime_genai_generates_our_tokens(bundle, capsys):
    og = pytest.importorskip("onnxruntime_genai")
    if og.__version__ not in HOST_VERSIONS:
        pytest.skip(f"onnxruntime-genai {og.__version__}: its CPU provider has no windowed cache (the test extra pins 0.16.0)")
    for prompt in prompts():
        ids = ",".join(map(str, prompt))
        ours = run_json(capsys, bundle, "--prompt-ids", ids, "--max-new-tokens", NEW, "--on", "cpu", "--ignore-eos")
        theirs = run_json(capsys, bundle, "--prompt-ids", ids, "--max-new-tokens", NEW, "--on", "cpu", "--ignore-eos",
                          "--runtime", "onnxruntime-genai")
        assert theirs["runtime"] == "onnxruntime-genai"
        assert theirs["tokens"] == ours["tokens"] and len(ours["tokens"]) == NEW, len(prompt)


def test_split_graphs_are_pipeline_models_in_order(folder, tmp_path, capsys):
    """--parts: each part is one pipeline model, run in order, tensors passed by name; the parts
    compute what the whole pair computes, and onnxruntime-genai still generates our tokens."""
    og = pytest.importorskip("onnxruntime_genai")
    out = tmp_path / "parts"
    build(folder, out, context=CONTEXT, prefill=PREFILL, parts=2, compile=False, probe=False, bundle="genai")
    report = json.loads((out / "report.json").read_text())
    assert report["parts_verification"]["ok"] and report["parts_verification"]["tokens"] == report["bundle_verification"]["tokens"]
    pipeline = json.loads((out / CONFIG_NAME).read_text())["model"]["decoder"]["pipeline"]
    names = [next(iter(entry)) for entry in pipeline]
    assert names == ["prompt_1_of_2", "prompt_2_of_2", "token_1_of_2", "token_2_of_2"]
    assert [entry[n]["filename"] for entry, n in zip(pipeline, names)] == [
        "prefill.part0.onnx", "prefill.part1.onnx", "decode.part0.onnx", "decode.part1.onnx"]
    if og.__version__ not in HOST_VERSIONS:
        pytest.skip(f"onnxruntime-genai {og.__version__}: no windowed cache on the CPU")
    for prompt in prompts()[::2]:
        ids = ",".join(map(str, prompt))
        ours = run_json(capsys, out, "--prompt-ids", ids, "--max-new-tokens", NEW, "--on", "cpu", "--ignore-eos")
        theirs = run_json(capsys, out, "--prompt-ids", ids, "--max-new-tokens", NEW, "--on", "cpu", "--ignore-eos",
                          "--runtime", "onnxruntime-genai")
        assert theirs["tokens"] == ours["tokens"] and len(ours["tokens"]) == NEW


def test_the_8_bit_cache_against_the_original(bundle, folder, capsys):
    """Teacher-forced top-1 of the uint8-cache pair vs the original (fp32), and the build's record
    of it: the float pair is checked to rounding first, the 8-bit one is measured."""
    report = json.loads((bundle / "report.json").read_text())
    assert report["verification"]["ok"] and report["verification"]["logits"] < 1e-4
    assert report["bundle"]["calibration"] == "text" and report["bundle_verification"]["top1"] >= 0.9
    for prompt in prompts():
        result = run_json(capsys, bundle, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", NEW,
                          "--on", "cpu", "--compare", folder)["compare"]
        assert result["teacher_forced_top1"] >= 0.9, (len(prompt), result)


@requires_htp
def test_both_graphs_on_the_htp_and_its_tokens(bundle, capsys):
    report = json.loads((bundle / "report.json").read_text())
    for name in ("prefill", "decode"):
        (part,) = report["htp"][name]["parts"]
        assert part["ok"] and part["qnn_partitions"] == 1 and part["cpu_nodes"] == 0, part
    for prompt in prompts():
        ids = ",".join(map(str, prompt))
        cpu = run_json(capsys, bundle, "--prompt-ids", ids, "--max-new-tokens", NEW, "--on", "cpu", "--ignore-eos")
        htp = run_json(capsys, bundle, "--prompt-ids", ids, "--max-new-tokens", NEW, "--on", "htp", "--ignore-eos")
        assert htp["files"]["prefill"] == ["prefill_ctx.onnx"]
        # fp16 on random weights: near-tied logits may flip late tokens (measured 12-16 of 16)
        assert leading_matches(htp["tokens"], cpu["tokens"]) >= 8, (len(prompt), htp["tokens"], cpu["tokens"])


@pytest.mark.parametrize("options, message", [
    ({"precision": "w8a16", "calib": "x.npy"}, "--precision fp16"),
    ({"prefill": 1}, "at least 2"),
    ({"context": 12}, "twice --prefill"),
])
def test_requests_the_windowed_cache_cannot_honour_exit_2(folder, tmp_path, capsys, options, message):
    assert_llm_refused(capsys, folder, tmp_path / "out", "genai", {"context": CONTEXT, "prefill": PREFILL, **options},
                       message)


def assert_llm_refused(capsys, folder, out, bundle: str, options: dict, message: str) -> None:
    """``qnnpasses llm FOLDER --bundle BUNDLE`` with ``options`` exits 2 with one line holding
    ``message`` and writes nothing."""
    argv = ["llm", str(folder), "--out-dir", str(out), "--bundle", bundle, "--no-compile"]
    for key, value in options.items():
        argv += [f"--{key}", str(value)]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and not out.exists()


def test_no_tokenizer_and_sliding_windows_are_refused(tmp_path, capsys):
    argv = ["--out-dir", str(tmp_path / "out"), "--context", "32", "--prefill", "4", "--bundle", "genai", "--no-compile"]
    assert cli_main(["llm", str(SOURCE), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tokenizer.json" in err[0] and not (tmp_path / "out").exists()
    # the sliding-window fixtures here take one token at a time (below the window's 2), so the
    # refusal of local layers is held at the check the build runs once their windows are known
    with pytest.raises(BadInputError, match="sliding-window"):
        check_model({"0": 8, "2": 8})
    check_model({})


def test_generate_refuses_what_onnxruntime_genai_cannot_run(bundle, folder, tmp_path, capsys):
    assert cli_main(["generate", str(bundle), "--prompt", PROMPT, "--runtime", "onnxruntime-genai", "--on", "htp"]) == 2
    assert "QNN provider" in capsys.readouterr().err
    plain = tmp_path / "plain"
    build(folder, plain, context=CONTEXT, prefill=PREFILL, compile=False, probe=False)
    assert cli_main(["generate", str(plain), "--prompt", PROMPT, "--runtime", "onnxruntime-genai", "--on", "cpu"]) == 2
    assert CONFIG_NAME in capsys.readouterr().err
