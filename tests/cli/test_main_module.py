"""``python -m trainfit`` is the console script: same version line, same one-line errors and exit status 2."""

from __future__ import annotations

import subprocess
import sys

from trainfit import __version__


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainfit", *args], capture_output=True, text=True, timeout=120)


def test_version() -> None:
    done = _run("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"trainfit {__version__}"


def test_bad_input_is_one_line_and_exit_2() -> None:
    done = _run("estimate", "no-such-model-xyz")
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr


def test_the_command_list_unwraps_each_commands_first_paragraph() -> None:
    """``trainfit --help`` lists each command by its docstring's first paragraph, reflowed to the terminal: the
    docstring's own line breaks ("the phase of the peak,⏎ bytes per parameter") used to show through."""
    import re

    from typer.testing import CliRunner

    from trainfit.cli.app import app

    listed = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "600"}).output
    for info in app.registered_commands:
        assert info.callback is not None and info.callback.__doc__
        first = " ".join(info.callback.__doc__.strip().split("\n\n")[0].split()).replace("\\[", "[")  # rich escape
        row = re.search(rf"│ {info.name} +(.*?) *│", listed)
        assert row is not None and row.group(1) == first, (info.name, row and row.group(1))
