"""Run ``trainfit.cli.app.main`` in-process and capture its output and exit status (errors included)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import pytest


def _load_main() -> Any:
    return importlib.import_module("trainfit.cli.app").main


@dataclass
class Result:
    code: int
    out: str
    err: str


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> Result:
    main = _load_main()
    code = 0
    try:
        main(list(args))
    except SystemExit as exc:
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return Result(code=code, out=captured.out, err=captured.err)
