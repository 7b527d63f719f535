"""The published H200 calibration data (``../shared/gpu-truth``, ``h200-training.jsonl``) for the tests that read
it, through the benchmarks' reader (``benchmarks/h200_data.py``, loaded by path: ``benchmarks/`` is not a package):
where it is (None when this checkout has no ``shared/`` beside it), its measuring processes, a case's Strategy.
The figures are measurements by ``measure_training.py``, not outputs of trainfit."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from trainfit import Strategy


def _reader() -> ModuleType:
    if "h200_data" in sys.modules:
        return sys.modules["h200_data"]
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "h200_data.py"
    spec = importlib.util.spec_from_file_location("h200_data", script)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["h200_data"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


data = _reader()
TRUTH: Path | None = data.find_truth()
#: The torch release of the H200 measurements (the files' ``meta`` lines: 2.11.0+cu130): it decides the cuBLAS and
#: cuBLASLt workspaces (``trainfit.allocator.workspaces``; a separate Lt workspace up to 2.11). Read from the data;
#: every process of it ran the same release.
H200_TORCH: tuple[int, int] = (
    next(iter({p.torch_version for p in data.processes(TRUTH)})) if TRUTH is not None else (2, 11)
)


def h200_processes() -> list[tuple[str, list[dict[str, Any]]]]:
    """The measuring processes of the calibration file: each one's allocator setting and its cases, in order."""
    return [] if TRUTH is None else [(p.allocator, p.cases) for p in data.processes(TRUTH)]


def measured_strategy(row: dict[str, Any]) -> Strategy:
    """The Strategy of one published case."""
    s: Strategy = data.measured_strategy(row)
    return s
