"""The one child-process harness for backend work: how a child ended, and what it wrote."""

from __future__ import annotations

import json
import os
import textwrap

from qnnpasses.backends.child import run_child

CHILD = textwrap.dedent("""
    import json, os, signal, sys, time
    mode, result = sys.argv[1], sys.argv[2]
    with open(result, "w") as fh:
        json.dump({"ok": mode == "ok", "stage": "session"}, fh)
    if mode == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if mode == "hang":
        time.sleep(60)
    if mode == "fail":
        sys.exit("qnn: could not create op")
""")


def _run(tmp_path, monkeypatch, mode: str, **kwargs):
    (tmp_path / "fake_backend_child.py").write_text(CHILD)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    return run_child("fake_backend_child", [mode, str(tmp_path / "r.json")], tmp_path / "r.json", **kwargs)


def test_a_clean_child_gives_its_result(tmp_path, monkeypatch):
    run = _run(tmp_path, monkeypatch, "ok")
    assert run.ok and run.crash is None and run.result == {"ok": True, "stage": "session"}


def test_a_crash_is_named_by_its_signal_and_keeps_the_progress_written(tmp_path, monkeypatch):
    run = _run(tmp_path, monkeypatch, "segv")
    assert not run.ok and run.crash == "backend process killed by SIGSEGV" and run.result["stage"] == "session"


def test_an_error_exit_keeps_the_last_stderr_line(tmp_path, monkeypatch):
    run = _run(tmp_path, monkeypatch, "fail")
    assert (run.crash, run.returncode, run.stderr_tail) == (
        "backend process exited with status 1", 1, ["qnn: could not create op"])


def test_a_hang_is_stopped_at_the_timeout(tmp_path, monkeypatch):
    run = _run(tmp_path, monkeypatch, "hang", timeout=2)
    assert run.crash == "timed out after 2s" and not run.ok


def test_a_log_path_takes_the_childs_output(tmp_path, monkeypatch):
    run = _run(tmp_path, monkeypatch, "fail", log_path=tmp_path / "backend.log")
    assert run.stderr_tail == [] and "could not create op" in (tmp_path / "backend.log").read_text()
    assert json.loads((tmp_path / "r.json").read_text())["ok"] is False
