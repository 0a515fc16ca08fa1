"""Property: whatever is wrong with the input model, `qnnpasses run` fails cleanly or succeeds cleanly.

Hypothesis mutates real fixtures — flipped bytes, truncation, dropped nodes, renamed
tensors, duplicated outputs, removed initializers, broken external data — and runs
``qnnpasses run --passes cleanup`` in-process.  Every outcome must be one of:

* success (the mutation left a valid model): exit 0 and an output that loads again;
* refusal: exit 2 and exactly one stderr line ``qnnpasses: error: ...``, and no output
  file, no partial/temporary file in the output folder.

In both cases the input model (and its external data file) is unchanged.  Exit 3
(internal error) or any other outcome is a bug.  tests/test_cli.py covers the fixed cases.

``QNNPASSES_FUZZ_EXAMPLES=N`` runs N examples with fresh randomness instead of the
derandomized CI budget.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
from conftest import fixture_path
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from qnnpasses.cli import main
from qnnpasses.ir.load import load_model

FIXTURES = ("llama_gqa_ts", "gpt2_ts", "bert_dynamo", "llama_gqa_kv_dynamo")
_EXAMPLES = int(os.environ.get("QNNPASSES_FUZZ_EXAMPLES", "0"))
_SETTINGS = settings(
    max_examples=_EXAMPLES or 250,
    deadline=None,
    derandomize=not _EXAMPLES,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
_CACHE: dict[str, bytes] = {}


def _fixture_bytes(name: str) -> bytes:
    if name not in _CACHE:
        _CACHE[name] = fixture_path(name).read_bytes()
    return _CACHE[name]


def _proto(name: str) -> onnx.ModelProto:
    return onnx.load_from_string(_fixture_bytes(name))


# --------------------------------------------------------------------------- mutations
# Each takes (hypothesis data, fixture name, folder) and writes folder/model.onnx
# (plus folder/model.onnx.data for external data); returns the model path.  A mutation
# whose result must be refused even though its bytes are readable returns
# (path, reason) instead.


def _save(model: onnx.ModelProto, folder: Path) -> Path:
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def flip_bytes(data, name, folder):
    raw = bytearray(_fixture_bytes(name))
    for _ in range(data.draw(st.integers(1, 16), label="flips")):
        at = data.draw(st.integers(0, len(raw) - 1), label="at")
        raw[at] ^= data.draw(st.integers(1, 255), label="mask")
    path = folder / "model.onnx"
    path.write_bytes(bytes(raw))
    return path


def truncate(data, name, folder):
    raw = _fixture_bytes(name)
    path = folder / "model.onnx"
    path.write_bytes(raw[: data.draw(st.integers(0, len(raw) - 1), label="length")])
    return path


def drop_nodes(data, name, folder):
    model = _proto(name)
    nodes = list(model.graph.node)
    drop = set(data.draw(st.lists(st.integers(0, len(nodes) - 1), min_size=1, max_size=4), label="drop"))
    del model.graph.node[:]
    model.graph.node.extend(n for i, n in enumerate(nodes) if i not in drop)
    return _save(model, folder)


def rename_tensors(data, name, folder):
    """Rename one use or one definition of a tensor: the other side dangles."""
    model = _proto(name)
    node = model.graph.node[data.draw(st.integers(0, len(model.graph.node) - 1), label="node")]
    slots = node.input if (data.draw(st.booleans(), label="input side") and len(node.input)) else node.output
    slots[data.draw(st.integers(0, len(slots) - 1), label="slot")] = data.draw(
        st.sampled_from(["renamed", "", model.graph.input[0].name, model.graph.output[0].name]), label="new name")
    return _save(model, folder)


def duplicate_outputs(data, name, folder):
    """Two producers of one tensor name, or a graph output listed twice."""
    model = _proto(name)
    if data.draw(st.booleans(), label="graph output"):
        model.graph.output.append(model.graph.output[0])
    else:
        nodes = model.graph.node
        a, b = (data.draw(st.integers(0, len(nodes) - 1), label=label) for label in ("a", "b"))
        nodes[b].output[0] = nodes[a].output[0]
    return _save(model, folder)


def remove_initializers(data, name, folder):
    model = _proto(name)
    inits = list(model.graph.initializer)
    drop = set(data.draw(st.lists(st.integers(0, len(inits) - 1), min_size=1, max_size=3), label="drop"))
    del model.graph.initializer[:]
    model.graph.initializer.extend(t for i, t in enumerate(inits) if i not in drop)
    return _save(model, folder)


def break_external_data(data, name, folder):
    """Save with external data, then damage the data file or the references to it."""
    model = _proto(name)
    path = folder / "model.onnx"
    onnx.save_model(model, path, save_as_external_data=True, location="model.onnx.data", size_threshold=256)
    data_file = folder / "model.onnx.data"
    how = data.draw(st.sampled_from(["delete", "truncate", "offset", "length", "location", "garbage", "outside"]),
                    label="how")
    if how == "outside":
        return _point_outside(data, path, data_file)
    if how == "delete":
        data_file.unlink()
    elif how == "truncate":
        size = data_file.stat().st_size
        with open(data_file, "r+b") as fh:
            fh.truncate(data.draw(st.integers(0, size - 1), label="size"))
    elif how == "garbage":
        rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
        data_file.write_bytes(rng.bytes(data_file.stat().st_size))  # valid layout, nonsense weights: may succeed
    else:
        _edit_external_reference(data, path, how)
    return path


def _point_outside(data, path: Path, data_file: Path) -> tuple[Path, str]:
    """The data file moves out of the model's folder and the model follows it there
    (``../`` or an absolute path): onnx refuses such models since 1.16 (CVE-2024-27318),
    because a model file must not be able to read arbitrary files."""
    outside = path.parent.parent / "elsewhere.data"
    data_file.rename(outside)
    location = "../elsewhere.data" if data.draw(st.booleans(), label="relative") else str(outside)
    model = onnx.load(path, load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    path.write_bytes(model.SerializeToString())
    return path, "external data outside the model's folder"


def _edit_external_reference(data, path: Path, key: str) -> None:
    model = onnx.load(path, load_external_data=False)
    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    tensor = external[data.draw(st.integers(0, len(external) - 1), label="tensor")]
    values = {"offset": st.sampled_from(["-8", "99999999", "abc", "3"]),
              "length": st.sampled_from(["-1", "0", "1", "99999999999", "x"]),
              "location": st.sampled_from(["nowhere.bin", "", "/dev/null", "sub/dir/../model.onnx.data"])}[key]
    value = data.draw(values, label=key)
    for entry in tensor.external_data:
        if entry.key == key:
            entry.value = value
            break
    else:
        tensor.external_data.add(key=key, value=value)
    path.write_bytes(model.SerializeToString())


MUTATIONS = [flip_bytes, truncate, drop_nodes, rename_tensors, duplicate_outputs, remove_initializers,
             break_external_data]


# --------------------------------------------------------------------------- the property


def _inputs(tmp: Path) -> dict[str, bytes]:
    """Every file but the output folder's: the model, its data file, files it points to."""
    return {str(p.relative_to(tmp)): p.read_bytes() for p in tmp.rglob("*") if p.is_file() and "out" not in p.parts}


@_SETTINGS
@given(data=st.data(), name=st.sampled_from(FIXTURES), mutation=st.sampled_from(MUTATIONS))
def test_mutated_model_fails_cleanly_or_succeeds(capsys, data, name, mutation):
    with tempfile.TemporaryDirectory(prefix="qnnpasses-fuzz-") as tmp:
        tmp = Path(tmp)
        (tmp / "in").mkdir()
        model = mutation(data, name, tmp / "in")
        model, must_refuse = model if isinstance(model, tuple) else (model, None)
        out_dir = tmp / "out"
        before = _inputs(tmp)
        capsys.readouterr()
        code = main(["run", str(model), "-o", str(out_dir / "out.onnx"), "--passes", "cleanup", "-q"])
        err = capsys.readouterr().err
        event(f"{mutation.__name__}: exit {code}")  # see --hypothesis-show-statistics
        assert _inputs(tmp) == before, "the input model or a file it refers to was modified"
        assert not must_refuse or code == 2, f"exit {code}: accepted a model that must be refused ({must_refuse})"
        if code == 0:
            load_model(out_dir / "out.onnx")  # raises when the written model is unusable
            leftovers = {p.name for p in out_dir.iterdir()} - {"out.onnx", "out.onnx.data"}
            assert not leftovers, f"temporary files left behind: {leftovers}"
            return
        lines = err.strip().splitlines()
        assert code == 2, f"exit {code} ({mutation.__name__}): {err}"
        assert len(lines) == 1 and lines[0].startswith("qnnpasses: error:"), err
        assert not out_dir.exists() or not any(out_dir.iterdir()), f"partial output: {list(out_dir.iterdir())}"
