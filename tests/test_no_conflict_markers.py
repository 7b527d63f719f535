"""A merge must not leave conflict markers in the tree (they once slipped into docs/architecture.md)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^(<{7} |>{7} |={7}$)", re.MULTILINE)


def test_no_conflict_markers_in_tracked_text_files() -> None:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    bad = []
    for name in out.splitlines():
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".toml", ".json", ".js", ".html", ".css", ".txt", ".yaml", ".yml"}:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if MARKER.search(text):
            bad.append(name)
    assert not bad, f"conflict markers in {bad}"
