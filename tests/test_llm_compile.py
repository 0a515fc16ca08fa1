"""How a failed compile of a pair's graph is told: a compile child the kernel killed for memory
gets the way out (smaller parts), any other failure its own words only."""

from __future__ import annotations

import pytest

from qnnpasses.backends.child import ChildRun
from qnnpasses.errors import CheckFailedError
from qnnpasses.llm import compile as llm_compile


def _failing_child(returncode: int, crash: str):
    def run_child(module, args, result_path, **_):
        return ChildRun(None, crash, returncode, [])
    return run_child


def test_a_compile_child_killed_by_sigkill_points_at_smaller_parts(tmp_path, monkeypatch):
    monkeypatch.setattr(llm_compile, "run_child", _failing_child(-9, "backend process killed by SIGKILL"))
    with pytest.raises(CheckFailedError) as failed:
        llm_compile.compile_graphs([(tmp_path / "prefill.onnx", tmp_path / "prefill_ctx.onnx")], try_shared=False)
    message = str(failed.value)
    assert message.startswith("compiling prefill.onnx for the HTP failed: separate compile: backend process "
                              "killed by SIGKILL at graph 1 of 1")
    assert "ran out of memory" in message and "--max-part-bytes" in message and "\n" not in message


def test_other_compile_failures_get_no_memory_hint(tmp_path, monkeypatch):
    monkeypatch.setattr(llm_compile, "run_child", _failing_child(-11, "backend process killed by SIGSEGV"))
    with pytest.raises(CheckFailedError) as failed:
        llm_compile.compile_graphs([(tmp_path / "decode.onnx", tmp_path / "decode_ctx.onnx")], try_shared=False)
    assert str(failed.value) == ("compiling decode.onnx for the HTP failed: separate compile: backend process "
                                 "killed by SIGSEGV at graph 1 of 1")
