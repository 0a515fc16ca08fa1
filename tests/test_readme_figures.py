"""Every figure in the README comes from a tool: the README's generated blocks agree with docs/."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import readme_figures

# the README's figure blocks: the benchmark table and ratios, the trained-weight table, the
# sweep grid and the scale/speed bullets
EXPECTED_BLOCKS = {"placement_table", "op_ratios", "trained_table", "sweep_table", "memory_bullet", "speed_bullet"}


def test_readme_figures_agree_with_the_docs_the_tools_wrote():
    problems = readme_figures.check()
    assert problems == [], "\n".join(problems)


def test_every_figure_block_is_generated():
    keys = {m.group(3) for m in readme_figures.BLOCK.finditer(readme_figures.README.read_text())}
    assert keys >= EXPECTED_BLOCKS


def test_a_figure_edited_by_hand_is_caught(tmp_path):
    readme = readme_figures.README.read_text()
    start = readme.index("<!-- generated: docs/bench_htp.json placement_table -->")
    edited = readme[:start] + readme[start:].replace("| raw export | ", "| raw export | 1", 1)
    path = tmp_path / "README.md"
    path.write_text(edited)
    problems = readme_figures.check(path)
    assert len(problems) == 1 and "| raw export | 1" in problems[0]
