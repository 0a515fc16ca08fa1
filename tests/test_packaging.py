"""Packaging: every package directory is installed, inside the qnnpasses namespace."""

from __future__ import annotations

import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _declared_packages() -> set[str]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return {line.strip() for line in config["options"]["packages"].splitlines() if line.strip()}


def test_every_package_directory_is_declared():
    on_disk = {"qnnpasses.passes", "qnnpasses.op_support"}
    for init in (ROOT / "qnnpasses").rglob("__init__.py"):
        on_disk.add(".".join(init.parent.relative_to(ROOT).parts))
    assert on_disk <= _declared_packages(), f"missing from setup.cfg packages: {sorted(on_disk - _declared_packages())}"


def test_passes_and_op_support_live_inside_the_namespace():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    mapping = dict(line.split("=") for line in config["options"]["package_dir"].strip().splitlines())
    mapping = {k.strip(): v.strip() for k, v in mapping.items()}
    assert mapping["qnnpasses.passes"] == "passes" and mapping["qnnpasses.op_support"] == "op_support"
    assert "passes" not in _declared_packages() and "op_support" not in _declared_packages()
