"""Run ``trainfit.cli.app.main`` in-process and capture its output and exit status.

The command registry imports every command module at import time; while a sibling command module is
still being written (``trainfit.cli.estimate``/``catalog`` land separately), a stand-in with an empty
``register`` keeps these tests about *our* commands. Once the real modules exist, nothing is stubbed.
"""

from __future__ import annotations

import importlib
import sys
import types
from dataclasses import dataclass

import pytest


def _load_main():  # type: ignore[no-untyped-def]
    if "trainfit.cli.app" not in sys.modules:
        for name in ("trainfit.cli.estimate", "trainfit.cli.catalog"):
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as exc:
                if exc.name != name:
                    raise
                stub = types.ModuleType(name)
                stub.register = lambda app: None  # type: ignore[attr-defined]
                sys.modules[name] = stub
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
