"""``trainfit models`` / ``trainfit gpus`` never cut ids or numbers (issue 15 #13); ``--version`` and usage
errors follow the one-line error policy (#17)."""

from __future__ import annotations

import pytest

from tests.cli._cli_helper import run_cli
from trainfit.arch import catalog_slugs
from trainfit.hardware import list_gpus


def _cells(out: str) -> set[str]:
    """Every table cell's text (rich separates cells with box-drawing bars)."""
    return {cell.strip() for line in out.splitlines() for cell in line.split("│")}


@pytest.mark.parametrize("columns", ["60", "80", "200"])
@pytest.mark.parametrize("terminal", [False, True], ids=["piped", "terminal"])
def test_model_ids_are_whole(capsys, monkeypatch, columns: str, terminal: bool) -> None:
    monkeypatch.setenv("COLUMNS", columns)
    if terminal:  # rich then sizes the table for a terminal of COLUMNS columns
        monkeypatch.setenv("TTY_COMPATIBLE", "1")
    res = run_cli(capsys, "models")
    assert res.code == 0 and "…" not in res.out
    cells = _cells(res.out)
    assert set(catalog_slugs()) <= cells
    assert "8.03B" in cells and "128256" in cells  # numbers whole too (llama-3.1-8b)
    assert any(line.split("│")[1].strip() == "llama-3.1-8b" for line in res.out.splitlines() if "│" in line)


@pytest.mark.parametrize("columns", ["60", "200"])
def test_gpu_ids_are_whole(capsys, monkeypatch, columns: str) -> None:
    monkeypatch.setenv("COLUMNS", columns)
    res = run_cli(capsys, "gpus")
    assert res.code == 0 and "…" not in res.out
    cells = _cells(res.out)
    assert {g.id for g in list_gpus()} <= cells
    assert "14.57" in cells and "driver" in cells  # T4: memory the driver reports with ECC on


def test_version(capsys) -> None:
    from trainfit import __version__

    res = run_cli(capsys, "--version")
    assert res.code == 0 and res.out.strip() == f"trainfit {__version__}" and res.err == ""


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["estimate", "gpt2", "--batch", "abc"], "--batch"),
        (["estimate", "gpt2", "--bogus"], "no such option: --bogus"),
        (["estimate", "gpt2", "extra"], "unexpected extra argument"),
        (["nosuchcommand"], "no such command 'nosuchcommand'"),
        (["--bogus"], "no such option"),
        (["models", "--json", "extra"], "unexpected extra argument"),
        (["gpus", "--json=3"], "--json"),
        (["estimate", "gpt2", "--batch"], "requires an argument"),
    ],
)
def test_usage_errors_are_one_line_exit_2(capsys, args: list[str], needle: str) -> None:
    res = run_cli(capsys, *args)
    assert res.code == 2 and res.out == ""
    lines = res.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], res.err
    assert "╭" not in res.err and "Usage:" not in res.err


def test_no_arguments_prints_the_help(capsys) -> None:
    res = run_cli(capsys)
    assert res.code == 2 and "estimate" in res.out and "Traceback" not in res.err
