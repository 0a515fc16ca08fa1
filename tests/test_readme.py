"""The README's pass example is real code: extract it, register it, and run it."""

from __future__ import annotations

import re
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from qnnpasses.ir.load import load_model
from qnnpasses.passmanager.manager import PassManager, RunConfig
from qnnpasses.passmanager.spec import parse_pipeline

README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def test_first_lines_are_exactly_two_commands():
    lines = README.read_text().splitlines()
    assert lines[0].startswith("# ")
    block = _readme_blocks("sh")[0].strip().splitlines()
    assert len(block) == 2
    assert "qnnpasses run --pipeline htp-llm" in block[0] and "pytest" in block[1]


def test_pass_example_runs(tmp_path):
    (example,) = [b for b in _readme_blocks("python") if "class DropDoubleNeg" in b]
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    graph = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["a"]), helper.make_node("Neg", ["a"], ["b"]), helper.make_node("Relu", ["b"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    ir = load_model(path)
    result = PassManager(parse_pipeline("drop-double-neg"), RunConfig(verify=True)).run(ir)
    assert result.records[0].status == "changed" and result.records[0].stats == {"removed": 1}
    assert [n.op for n in ir.graph.nodes] == ["Relu"]
    assert result.final_verification["max_abs"] == 0.0
