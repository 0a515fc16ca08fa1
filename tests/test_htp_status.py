"""The HTP backend probe tells "not installed" from "installed but broken", and HTP tests never
turn into silent skips where the backend is expected (CI)."""

from __future__ import annotations

import pytest

from qnnpasses.backends import htp
from qnnpasses.errors import BackendUnavailableError


def _probe_with(monkeypatch, behaviour):
    monkeypatch.setattr(htp, "_qnn_devices", behaviour)
    return htp.htp_status()


def test_missing_package_is_not_installed(monkeypatch):
    def missing():
        raise BackendUnavailableError("onnxruntime-qnn is not installed (pip install onnxruntime-qnn)")
    assert _probe_with(monkeypatch, missing)[0] == htp.NOT_INSTALLED
    assert not htp.htp_available()


def test_a_failing_ep_or_no_device_is_broken_with_the_reason(monkeypatch):
    def crashes():
        raise RuntimeError("libQnnHtp.so: cannot open shared object file")
    state, reason = _probe_with(monkeypatch, crashes)
    assert state == htp.BROKEN and "RuntimeError: libQnnHtp.so" in reason
    assert _probe_with(monkeypatch, list)[0] == htp.BROKEN


def test_htp_tests_fail_in_ci_when_the_backend_does_not_load():
    import conftest

    class Item:
        def __init__(self, marked):
            self.marked = marked

        def get_closest_marker(self, name):
            return object() if self.marked and name == "htp" else None

    saved = conftest._HTP_STATUS
    try:
        conftest._HTP_STATUS = (htp.NOT_INSTALLED, "onnxruntime-qnn is not installed")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("CI", "true")
            with pytest.raises(pytest.fail.Exception, match="expected but does not load"):
                conftest.pytest_runtest_setup(Item(True))
            mp.delenv("CI")
            mp.delenv("QNNPASSES_EXPECT_HTP", raising=False)
            with pytest.raises(pytest.skip.Exception, match="not installed"):
                conftest.pytest_runtest_setup(Item(True))
            conftest.pytest_runtest_setup(Item(False))  # unmarked tests are not affected
        conftest._HTP_STATUS = (htp.BROKEN, "EP failed to load")
        with pytest.raises(pytest.fail.Exception, match="EP failed to load"):
            conftest.pytest_runtest_setup(Item(True))  # installed but broken: a failure, CI or not
    finally:
        conftest._HTP_STATUS = saved
