"""transformers' log lines do not leak into trace output (issue 15 #17)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import TINY

pytest.importorskip("torch")


def test_trace_with_checkpointing_prints_no_transformers_lines(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY["llama"]))
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainfit.cli.app",
            "estimate",
            str(cfg),
            "--method",
            "trace",
            "--checkpointing",
            "full",
            "--batch",
            "1",
            "--seq",
            "64",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    # transformers warns "use_cache=True is incompatible with gradient checkpointing" without the quieting
    assert "[transformers]" not in res.stderr and "use_cache" not in res.stderr, res.stderr
