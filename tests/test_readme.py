"""The README's set-up commands and its worked example stay true: .ci/run runs the README's test command,
the first command's estimate fits as the README says, and the quoted non-fitting output is what the CLI prints."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from typer.testing import CliRunner

from trainfit.cli.app import app

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()


def _commands() -> list[str]:
    block = README.split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.startswith("python3 -m venv")]


def _cli(line: str) -> str:
    args = shlex.split(line.split("trainfit ", 1)[1])
    res = CliRunner().invoke(app, args, terminal_width=120)
    assert res.exit_code == 0, res.output
    return " ".join(res.stdout.split())


def test_ci_runs_the_readme_test_command() -> None:
    _, install_test = _commands()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == install_test and "pytest" in ci


def test_first_command_fits_as_the_readme_says() -> None:
    install_run, _ = _commands()
    claim = re.search(r"`(FITS on [^`]+)`", README)
    assert claim is not None
    assert claim.group(1) in _cli(install_run)


def test_quoted_non_fitting_output_is_what_the_cli_prints() -> None:
    m = re.search(r"\$ (trainfit estimate [^\n]+)\n(DOES NOT FIT.*?)\n```", README, re.S)
    assert m is not None
    assert " ".join(m.group(2).split()) in _cli(m.group(1))
