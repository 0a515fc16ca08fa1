"""Every sub-command speaks the same vocabulary, and every option says what it is for.

Walks the real parser and each command's real ``--help`` output:

* every option (and positional) has help; ``--format`` too;
* ``-o/--output`` names a file, a folder the command writes is ``--out-dir`` (or ends in ``-dir``);
* where something runs it is ``--on``; the old spellings (``--real``, ``--check-on``, ``--plot``,
  ``--emit``, ``-o`` for a folder) are hidden and only warn;
* every command that loads a model takes ``--shape``; every command takes ``-v``;
* help talks about the user's task, not the code (no module paths, no internal counters);
* docs/cli.md is what tools/cli_reference.py writes from this parser (a test fails on drift).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qnnpasses.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
#: commands whose static shapes are their subject, set by their own options
SHAPES_FROM_OPTIONS = {"llm": "--context/--prefill"}
OLD_SPELLINGS = {"--real", "--check-on", "--plot", "--emit"}
INTERNALS = re.compile(r"qnnpasses\.commands|own_fold|rows2d|_seconds|\bkwargs\b|benchmark")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


COMMANDS = _subparsers()


def _visible(parser):
    return [a for a in parser._actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_has_help_and_follows_the_vocabulary(name):
    parser = COMMANDS[name]
    visible = _visible(parser)
    for action in visible:
        assert action.help and action.help.strip(), f"{name}: {action.option_strings or action.dest} has no help"
    options = {s for a in visible for s in a.option_strings}
    assert not options & OLD_SPELLINGS, f"{name} shows old spellings {options & OLD_SPELLINGS}"
    assert "-v" in options and "--verbose" in options
    for action in visible:
        if not action.option_strings:
            continue
        if "-o" in action.option_strings or "--output" in action.option_strings:
            assert action.metavar != "DIR" and action.dest == "output", f"{name}: -o must name a file"
        if action.metavar == "DIR":
            assert any(s.endswith("-dir") for s in action.option_strings), f"{name}: {action.option_strings} is a folder"
        if action.dest == "on":
            assert set(action.choices) <= {"cpu", "htp"}, f"{name}: --on takes cpu|htp"
    positionals = {a.dest for a in visible if not a.option_strings}
    if positionals & {"model", "a"} and name not in SHAPES_FROM_OPTIONS:  # it loads a model
        assert "--shape" in options, f"{name} loads a model but has no --shape"


def test_where_something_runs_is_always_on():
    runs = {"check", "compare", "partition", "diagnose", "compile", "generate"}
    for name in runs & set(COMMANDS):
        options = {s for a in _visible(COMMANDS[name]) for s in a.option_strings}
        assert "--on" in options, name


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_is_written_for_the_task(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith(f"usage: qnnpasses {name}")
    assert not INTERNALS.search(out), f"{name} --help mentions internals: {INTERNALS.search(out).group(0)}"
    if "--format" in out:
        assert re.search(r"--format \{[a-z,]+\}\s+output format", out), f"{name}: --format without help"


def test_bare_qnnpasses_lists_the_commands(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "commands:" in err and "typical session:" in err
    for name in COMMANDS:
        assert re.search(rf"^\s+{name}\b", err, re.MULTILINE), name
    assert "qnnpasses.commands" not in err


def test_old_spellings_still_work_with_a_warning(tmp_path, capsys):
    from conftest import fixture_path

    out = tmp_path / "parts"
    code = main(["partition", str(fixture_path("llama_gqa_ts")), "-o", str(out), "--check-on", "cpu", "--check",
                 "--no-picture"])
    err = capsys.readouterr().err
    assert code == 0 and (out / "plan.json").exists()
    assert "-o is deprecated; use --out-dir" in err and "--check-on is deprecated; use --on cpu" in err


def test_a_command_module_that_fails_to_import_is_an_error(tmp_path):
    """A broken command is listed and fails with one line when used, instead of vanishing."""
    script = f"""
import sys
import qnnpasses.commands as pkg
pkg.__path__.append({str(tmp_path)!r})
from qnnpasses import cli
sys.exit(cli.main(sys.argv[1:]))
"""
    (tmp_path / "broken.py").write_text("import no_such_module_anywhere\n")
    listing = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert listing.returncode == 2
    assert "the 'broken' command cannot load: ModuleNotFoundError" in listing.stderr
    assert re.search(r"^\s+broken\s+\(cannot load", listing.stderr, re.MULTILINE)
    used = subprocess.run([sys.executable, "-c", script, "broken"], capture_output=True, text=True)
    assert used.returncode == 3 and "cannot load" in used.stderr and "Traceback" not in used.stderr


def test_docs_cli_md_is_generated_from_the_parser():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "tools" / "cli_reference.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert (ROOT / "docs" / "cli.md").read_text() == tool.render(), \
        "docs/cli.md is out of date: run python tools/cli_reference.py"
    block = tool.readme_block()
    text = f"intro\n{tool.BEGIN}\nold\n{tool.END}\noutro\n"
    assert tool.rewrite_readme(text) == f"intro\n{block}\noutro\n"
    for name in COMMANDS:
        assert f"`qnnpasses {name}`" in block
    readme = (ROOT / "README.md").read_text()
    if tool.BEGIN in readme:  # once the lead embeds it, it must stay current too
        assert tool.rewrite_readme(readme) == readme, "README command block is out of date"
