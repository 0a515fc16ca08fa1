"""tools/bench_sizes.py: docs/bench_sizes.md is what it writes, and its memory limit holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bench_sizes as tool  # noqa: E402


def test_the_doc_is_what_the_tool_writes():
    assert tool.write_markdown(json.loads(tool.DOC_JSON.read_text())) == tool.DOC_MD.read_text()


def _cgroup(limit: int):
    try:
        return tool.MemoryCgroup(limit)
    except SystemExit as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("mib, killed", [(128, True), (1024, False)])
def test_a_build_inside_the_memory_limit_is_held_to_it(mib, killed):
    """A child that allocates 400 MiB is killed in a 128 MiB group and finishes in a 1 GiB one,
    whose peak counts its allocation."""
    group = _cgroup(mib << 20)
    try:
        run = subprocess.run([sys.executable, "-c", "import numpy as np; print(np.ones(400 << 17).sum())"],
                             capture_output=True, text=True, preexec_fn=group.enter)
        figures = group.figures()
    finally:
        group.close()
    assert not group.path.exists()
    assert figures["limit_bytes"] == mib << 20
    if killed:
        assert run.returncode == -9 and figures["oom_kills"] >= 1
    else:
        assert run.returncode == 0 and figures["oom_kills"] in (0, None)
        assert 400 << 20 <= figures["max_usage_bytes"] <= mib << 20
