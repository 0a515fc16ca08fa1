"""Roles of a KV export's inputs and outputs: found from what exporters emit, never silently wrong.

Fixtures (tools/export_fixtures.py): `llama_gqa_kv_sdpa_dyn_*` is LLaMA with transformers' default
attention (sdpa: its probabilities pass `Where(IsNaN(p), 0, p)` before the value MatMul) and a
position_ids input; `gpt2_kv_dyn_*` has two embedding Gathers, tokens and learned positions.
Both by TorchScript and dynamo.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from conftest import fixture_path

from qnnpasses.errors import BadInputError
from qnnpasses.ir.kv_roles import find_roles
from qnnpasses.ir.load import load_model
from qnnpasses.llm.roles import export_roles, named_roles

SDPA_AND_GPT2 = ["llama_gqa_kv_sdpa_dyn_ts", "llama_gqa_kv_sdpa_dyn_dynamo", "gpt2_kv_dyn_ts", "gpt2_kv_dyn_dynamo"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qnnpasses.cli", *args], capture_output=True, text=True)


@pytest.mark.parametrize("name", SDPA_AND_GPT2)
def test_roles_of_default_exports_agree_with_their_names(name):
    roles = export_roles(load_model(fixture_path(name)))
    assert (roles.input_ids, roles.position_ids, roles.attention_mask, roles.logits) == (
        "input_ids", "position_ids", "attention_mask", "logits")
    assert roles.past_key == [f"past_key_values.{i}.key" for i in range(2)]
    assert roles.past_value == [f"past_key_values.{i}.value" for i in range(2)]
    assert roles.present_key == [f"present.{i}.key" for i in range(2)]
    assert roles.present_value == [f"present.{i}.value" for i in range(2)]


def test_named_roles_read_the_hugging_face_names():
    proto = onnx.load(str(fixture_path("gpt2_kv_dyn_ts")), load_external_data=False)
    named = named_roles([i.name for i in proto.graph.input], [o.name for o in proto.graph.output])
    assert named["past_key"] + named["past_value"] == ["past_key_values.0.key", "past_key_values.1.key",
                                                       "past_key_values.0.value", "past_key_values.1.value"]
    assert named["present_key"] + named["present_value"] == ["present.0.key", "present.1.key", "present.0.value",
                                                             "present.1.value"]
    assert named_roles(["ids", "mask"], ["logits"]) is None


@pytest.mark.parametrize("name", ["gpt2_kv_dyn_ts", "llama_gqa_kv_sdpa_dyn_ts"])
def test_pair_of_a_default_export_matches_it_fed_by_its_own_names(name, tmp_path):
    """The build's CPU check feeds the original by its HF names, not by the roles the build found."""
    prefill = 8 if name.startswith("gpt2") else 1  # the sdpa GQA TorchScript export computes one token at a time
    result = _cli("llm", str(fixture_path(name)), "--out-dir", str(tmp_path / "pair"), "--context", "64",
                  "--prefill", str(prefill), "--no-compile")
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "pair" / "report.json").read_text())
    assert report["verification"]["reference_fed_by"] == "names"
    assert report["verification"]["ok"] and report["verification"]["logits"] <= 1e-4
    manifest = json.loads((tmp_path / "pair" / "llm.json").read_text())
    assert manifest["source_roles"]["input_ids"] == "input_ids"
    assert manifest["source_roles"]["position_ids"] == "position_ids"


def test_export_that_fixed_its_traced_length_is_refused(tmp_path):
    """TorchScript's sdpa with grouped-query attention reshapes the query to the traced length (1):
    a prefill of 8 would be wrong, so the build refuses before writing anything."""
    out = tmp_path / "pair"
    result = _cli("llm", str(fixture_path("llama_gqa_kv_sdpa_dyn_ts")), "--out-dir", str(out), "--context", "64",
                  "--prefill", "8", "--no-compile")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not compute 8 new tokens at once" in lines[0] and "--prefill 1" in lines[0]
    assert not out.exists()


def _edited_gpt2(tmp_path, *, swap_names: bool = False, untie: bool = False):
    """The GPT-2 export with its position table made vocabulary-sized and its lm_head untied
    (``untie``: the token table can no longer be told from the position table), or with the
    names of input_ids and position_ids swapped (``swap_names``)."""
    proto = onnx.load(str(fixture_path("gpt2_kv_dyn_ts")))
    rng = np.random.default_rng(0)
    if untie:
        for init in proto.graph.initializer:
            if init.name.endswith("wpe.weight"):
                init.CopyFrom(onnx.numpy_helper.from_array(rng.standard_normal((256, 64)).astype(np.float32), init.name))
            elif list(init.dims) == [64, 256]:
                init.CopyFrom(onnx.numpy_helper.from_array(rng.standard_normal((64, 256)).astype(np.float32), init.name))
    if swap_names:
        rename = {"input_ids": "position_ids", "position_ids": "input_ids"}
        for value in proto.graph.input:
            value.name = rename.get(value.name, value.name)
        for node in proto.graph.node:
            node.input[:] = [rename.get(t, t) for t in node.input]
    path = tmp_path / "edited.onnx"
    onnx.save(proto, str(path))
    return path


def test_ambiguous_token_table_is_refused_and_roles_can_be_given(tmp_path):
    path = _edited_gpt2(tmp_path, untie=True)
    with pytest.raises(BadInputError, match=r"cannot tell the token ids .*'input_ids'.*'position_ids'"):
        find_roles(load_model(path).graph)
    result = _cli("llm", str(path), "--out-dir", str(tmp_path / "refused"), "--context", "64", "--prefill", "8",
                  "--no-compile")
    assert result.returncode == 2 and "--roles input_ids=NAME" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    given = find_roles(load_model(path).graph, {"input_ids": "input_ids", "position_ids": "position_ids"})
    assert (given.input_ids, given.position_ids) == ("input_ids", "position_ids")


def test_structure_and_names_that_disagree_are_refused(tmp_path):
    """Swapped names: the Gather on the vocabulary table reads the input named position_ids."""
    path = _edited_gpt2(tmp_path, swap_names=True)
    with pytest.raises(BadInputError, match="roles disagree"):
        find_roles(load_model(path).graph)
    given = find_roles(load_model(path).graph, {"input_ids": "position_ids", "position_ids": "input_ids"})
    assert (given.input_ids, given.position_ids) == ("position_ids", "input_ids")


@pytest.mark.parametrize("roles, message", [
    ("input_ids", "expected ROLE=NAME"),
    ("colour=input_ids", "unknown role 'colour'"),
    ("input_ids=nothing", "no such input"),
    ("input_ids=attention_mask", "indexes no embedding table"),
    ("input_ids=input_ids,input_ids=input_ids", "given twice"),
])
def test_bad_roles_get_one_line_and_exit_2(roles, message, tmp_path):
    out = tmp_path / "pair"
    result = _cli("llm", str(fixture_path("gpt2_kv_dyn_ts")), "--out-dir", str(out), "--context", "64",
                  "--prefill", "8", "--no-compile", "--roles", roles)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr
    assert not out.exists()
