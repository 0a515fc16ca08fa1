"""``qnnpasses llm --bundle genie``: a bundle Genie itself loads and generates with.

The model is the random-weight LLaMA/GQA KV-cache export in a Hugging Face style folder with a
word-level tokenizer (``test_generate_text``).  What is held:

* the graphs take what Genie's engine gives: int32 ids, the whole additive mask ``[1, S, N]``,
  the rotary cos/sin ``[1, S, h]``, a uint8 cache with the key transposed and one encoding per
  tensor in both graphs;
* on the CPU they generate what the onnxruntime-genai form of the same model generates (the same
  8-bit cache, other inputs): the inputs mean what they meant;
* ``libGenie.so`` (from the onnxruntime-qnn wheel) accepts ``genie_config.json`` and refuses it
  with a required key missing; it loads the compiled bundle on the simulated HTP and generates
  exactly the tokens our runner generates from the same context binaries;
* a graph whose rotary or mask Genie cannot express is refused in one line, exit 2.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import qnnpasses.passes  # noqa: F401 - registers the passes the llm build runs
from conftest import htp_backend_available, requires_htp
from test_generate_text import SOURCE, folder  # noqa: F401 - folder is a fixture
from test_llm_bundle_genai import assert_llm_refused, graph_io, prompts, run_json

from qnnpasses.cli import main as cli_main
from qnnpasses.llm.convert import build
from qnnpasses.llm.genie import BACKEND_CONFIG_NAME, CONFIG_NAME, genie_config, library_path, validate_config
from qnnpasses.llm.genie_io import GenieFormError, Rope, derive_rope

CONTEXT, PREFILL, NEW = 64, 8, 16


@pytest.fixture(scope="module")
def bundle(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("genie") / "bundle"
    build(folder, out, context=CONTEXT, prefill=PREFILL, compile=htp_backend_available(),
          probe=htp_backend_available(), bundle="genie")
    return out


@pytest.fixture(scope="module")
def genai_bundle(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("genai_peer") / "bundle"
    build(folder, out, context=CONTEXT, prefill=PREFILL, compile=False, probe=False, bundle="genai")
    return out


def test_graphs_take_genies_inputs(bundle):
    manifest = json.loads((bundle / "llm.json").read_text())
    kv, hd, layers = manifest["kv_heads"], manifest["head_dim"], manifest["layers"]
    assert manifest["kv_alignment"] == "left" and manifest["kv_dtype"] == "uint8"
    assert manifest["rope"] == {"theta": 10000.0, "dim": hd // 2}
    for name, tokens in (("prefill", PREFILL), ("decode", 1)):
        model = onnx.load(str(bundle / f"{name}.onnx"))
        io, shape, dtype = graph_io(model)
        past = CONTEXT - tokens
        assert "position_ids" not in io
        assert shape("input_ids") == [1, tokens] and dtype("input_ids") == onnx.TensorProto.INT32
        assert shape("attention_mask") == [1, tokens, CONTEXT] and dtype("attention_mask") == onnx.TensorProto.FLOAT
        for trig in ("position_ids_cos", "position_ids_sin"):
            assert shape(trig) == [1, tokens, hd // 2] and dtype(trig) == onnx.TensorProto.FLOAT
        for i in range(layers):
            assert shape(f"past_key_{i}_in") == [kv, 1, hd, past] and shape(f"past_value_{i}_in") == [kv, 1, past, hd]
            assert dtype(f"past_key_{i}_out") == onnx.TensorProto.UINT8
        assert shape("logits") == [1, tokens, manifest["vocab"]]


def test_same_tokens_as_the_genai_form_on_the_cpu(bundle, genai_bundle, capsys):
    """The same 8-bit cache encodings, other inputs (whole mask, cos/sin, left-aligned cache): the
    tokens must not change, for prompts inside one window, of whole windows and of several."""
    for prompt in prompts():
        ids = ",".join(map(str, prompt))
        genie = run_json(capsys, bundle, "--prompt-ids", ids, "--max-new-tokens", NEW, "--on", "cpu", "--ignore-eos")
        genai = run_json(capsys, genai_bundle, "--prompt-ids", ids, "--max-new-tokens", NEW, "--on", "cpu",
                         "--ignore-eos")
        assert genie["tokens"] == genai["tokens"] and len(genie["tokens"]) == NEW, len(prompt)


def _per_layer_bias_graph(tokens: int, n: int, layers: int, bool_mask: bool = True) -> onnx.ModelProto:
    """Scores ``[1, 1, S, N]`` per layer plus a bias each layer builds itself from the 2-D mask and a
    causal constant, as transformers' sdpa exports do."""
    h = onnx.helper
    past = n - tokens
    causal = np.array([[c < past or c - past <= r for c in range(n)] for r in range(tokens)])[None, None]
    nodes = [h.make_node("Cast", ["attention_mask"], ["m_bool"], to=onnx.TensorProto.BOOL),
             h.make_node("Reshape", ["m_bool", "shape4"], ["m4"]),
             h.make_node("And", ["m4", "causal"], ["sees"])]
    inputs = [h.make_tensor_value_info("attention_mask", onnx.TensorProto.INT64, [1, n])]
    outputs = []
    for layer in range(layers):
        nodes += [h.make_node("Where", ["sees", "zero", "min"], [f"bias{layer}"]),
                  h.make_node("Add", [f"scores{layer}", f"bias{layer}"], [f"out{layer}"])]
        inputs.append(h.make_tensor_value_info(f"scores{layer}", onnx.TensorProto.FLOAT, [1, 1, tokens, n]))
        outputs.append(h.make_tensor_value_info(f"out{layer}", onnx.TensorProto.FLOAT, [1, 1, tokens, n]))
    inits = [onnx.numpy_helper.from_array(np.array([1, 1, 1, n], np.int64), "shape4"),
             onnx.numpy_helper.from_array(causal, "causal"),
             onnx.numpy_helper.from_array(np.array(0, np.float32), "zero"),
             onnx.numpy_helper.from_array(np.array(np.finfo(np.float32).min, np.float32), "min")]
    return h.make_model(h.make_graph(nodes, "g", inputs, outputs, inits), opset_imports=[h.make_opsetid("", 17)])


def test_a_bias_built_per_layer_becomes_genies_one_mask(tmp_path):
    """Every layer's copy of the bias is checked and computed from the one 3-D input; with Genie's
    mask (0 / -1000) each layer adds what it added from the 2-D mask."""
    import onnxruntime as ort

    from qnnpasses.ir.load import load_model
    from qnnpasses.ir.model import save_model
    from qnnpasses.llm.genie_io import MASKED, full_mask_input

    tokens, n, layers = 4, 12, 3
    onnx.save(_per_layer_bias_graph(tokens, n, layers), tmp_path / "g.onnx")
    ir = load_model(tmp_path / "g.onnx")
    assert full_mask_input(ir, "attention_mask", tokens) == [float(np.finfo(np.float32).min)]
    save_model(ir, tmp_path / "genie.onnx")
    before = ort.InferenceSession(str(tmp_path / "g.onnx"), providers=["CPUExecutionProvider"])
    after = ort.InferenceSession(str(tmp_path / "genie.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in after.get_inputs()][0] == "attention_mask" and len(after.get_inputs()) == layers + 1
    rng = np.random.default_rng(1)
    for _ in range(4):
        mask = (rng.random((1, n)) < 0.7).astype(np.int64)
        scores = {f"scores{k}": rng.standard_normal((1, 1, tokens, n)).astype(np.float32) for k in range(layers)}
        rows, cols = np.arange(tokens)[:, None], np.arange(n)[None, :]
        sees = (mask[0] != 0)[None] & ((cols < n - tokens) | (cols - (n - tokens) <= rows))
        genie = np.where(sees, 0, MASKED).astype(np.float32)[None]
        for want, got in zip(before.run(None, {"attention_mask": mask, **scores}),
                             after.run(None, {"attention_mask": genie, **scores})):
            assert np.array_equal(want, got)


def test_a_bias_that_is_not_the_causal_mask_is_refused(tmp_path):
    """A bias that hides a key the causal pattern shows (here the oldest slot, as a sliding window
    does) is not what Genie's mask describes: refused."""
    from qnnpasses.ir.load import load_model
    from qnnpasses.llm.genie_io import full_mask_input

    model = _per_layer_bias_graph(4, 12, 1)
    causal = next(t for t in model.graph.initializer if t.name == "causal")
    window = np.tril(np.ones((4, 12), bool), 8)
    window[:, 0] = False
    causal.CopyFrom(onnx.numpy_helper.from_array(window[None, None], "causal"))
    onnx.save(model, tmp_path / "g.onnx")
    with pytest.raises(GenieFormError, match="not 0 where the mask lets a query see a key"):
        full_mask_input(load_model(tmp_path / "g.onnx"), "attention_mask", 4)


def test_the_build_checks_the_bundle_against_the_original(bundle):
    report = json.loads((bundle / "report.json").read_text())
    assert report["verification"]["ok"] and report["bundle"]["format"] == "genie"
    assert report["bundle_verification"]["top1"] >= 0.9


def test_rope_is_read_from_the_tables_and_checked():
    positions = np.arange(64)
    cos, sin = Rope(500000.0, 32).tables(positions)
    assert derive_rope(np.concatenate([cos, cos], 1), np.concatenate([sin, sin], 1)) == Rope(500000.0, 32)
    scaled = cos.copy()
    scaled[:, 20:] = np.cos(np.outer(positions, 500000.0 ** (-np.arange(20, 32) / 32) / 8))  # llama3-style low bands
    with pytest.raises(GenieFormError, match="rope scaling"):
        derive_rope(np.concatenate([scaled, scaled], 1), np.concatenate([sin, sin], 1))
    with pytest.raises(GenieFormError, match="rotate-half"):
        derive_rope(np.concatenate([cos, cos[:, ::-1]], 1), np.concatenate([sin, sin], 1))


def _genie_or_skip():
    if library_path() is None:
        pytest.skip("libGenie.so is not installed (it ships in the onnxruntime-qnn wheel)")


@requires_htp
def test_genie_accepts_the_config_and_refuses_a_broken_one(bundle, tmp_path):
    _genie_or_skip()
    manifest = json.loads((bundle / "llm.json").read_text())
    report = json.loads((bundle / "report.json").read_text())
    assert report["bundle"]["genie_validation"].startswith("accepted by Genie API")
    config = json.loads((bundle / CONFIG_NAME).read_text())
    assert config == genie_config(manifest)
    assert config["dialog"]["engine"]["model"]["binary"]["ctx-bins"] == ["prefill_ctx_qnn.bin", "decode_ctx_qnn.bin"]
    backend = json.loads((bundle / BACKEND_CONFIG_NAME).read_text())["devices"][0]
    assert (backend["soc_model"], backend["dsp_arch"]) == (manifest["target"]["soc_model"], manifest["target"]["htp_arch"])
    del config["dialog"]["context"]["n-vocab"]
    broken = tmp_path / CONFIG_NAME
    broken.write_text(json.dumps(config))
    checked = validate_config(broken)
    assert not checked["ok"] and "n-vocab" in checked["error"], checked


@requires_htp
def test_genie_generates_our_tokens_on_the_htp(bundle, capsys):
    """libGenie drives the compiled bundle on the simulated HTP with its own cache, mask and rotary;
    our runner on the same context binaries gives the same tokens."""
    _genie_or_skip()
    for prompt in prompts():
        ids = ",".join(map(str, prompt))
        ours = run_json(capsys, bundle, "--prompt-ids", ids, "--max-new-tokens", NEW, "--on", "htp", "--ignore-eos")
        genie = run_json(capsys, bundle, "--prompt-ids", ids, "--max-new-tokens", NEW, "--on", "htp", "--ignore-eos",
                         "--runtime", "genie")
        assert genie["runtime"] == "genie" and genie["files"]["decode"] == ["decode_ctx_qnn.bin"]
        assert genie["tokens"] == ours["tokens"] and len(ours["tokens"]) == NEW, len(prompt)


@pytest.mark.parametrize("options, message", [
    ({"precision": "w8a16", "calib": "x.npy"}, "--precision fp16"),
    ({"prefill": 1}, "at least 2"),
    ({"parts": 2}, "cannot be split"),
])
def test_requests_the_genie_bundle_cannot_honour_exit_2(folder, tmp_path, capsys, options, message):
    assert_llm_refused(capsys, folder, tmp_path / "out", "genie", {"context": CONTEXT, "prefill": PREFILL, **options},
                       message)


def test_no_tokenizer_is_refused_and_genie_runs_on_the_htp_only(bundle, tmp_path, capsys):
    argv = ["--out-dir", str(tmp_path / "out"), "--context", "32", "--prefill", "4", "--bundle", "genie", "--no-compile"]
    assert cli_main(["llm", str(SOURCE), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tokenizer.json" in err[0] and not (tmp_path / "out").exists()
    assert cli_main(["generate", str(bundle), "--prompt-ids", "1,5", "--on", "cpu", "--runtime", "genie"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--on htp" in err[0]


def test_a_model_larger_than_one_part_is_refused_before_the_build(folder, tmp_path, monkeypatch):
    """Genie bundles cannot be split yet: a model whose graphs would hold more than one part may
    on the HTP (qnnpasses.llm.convert.DEFAULT_PART_BYTES) is refused in one line, nothing written."""
    from qnnpasses.errors import BadInputError
    from qnnpasses.llm import convert

    monkeypatch.setattr(convert, "DEFAULT_PART_BYTES", 1000)
    with pytest.raises(BadInputError, match="Genie bundles cannot be split yet"):
        build(folder, tmp_path / "bundle", context=CONTEXT, prefill=PREFILL, compile=False, probe=False,
              bundle="genie")
    assert not (tmp_path / "bundle").exists() and not list(tmp_path.glob(".bundle.*"))
