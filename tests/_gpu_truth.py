"""The published H200 calibration data (``../shared/gpu-truth``, ``h200-training.jsonl``) for the tests that read
it, through the benchmarks' reader (``benchmarks/h200_data.py``, loaded by path: :mod:`tests._benchmarks`):
where it is (None when this checkout has no ``shared/`` beside it), its measuring processes, a case's Strategy.
The figures are measurements by ``measure_training.py``, not outputs of trainfit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests._benchmarks import load_benchmark
from trainfit import Strategy

data = load_benchmark("h200_data")
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


#: The committed raw output of the H200 sessions (``benchmarks/h200/<date>/``, written by benchmarks/gpu_session.py).
SESSIONS = Path(__file__).resolve().parents[1] / "benchmarks" / "h200"


def session_measured(path: Path, case: str) -> dict[str, Any]:
    """The ``measured`` record of ``case`` in a session's JSON-lines file."""
    for row in data.rows(path):
        if row.get("case") == case and row.get("record") == "measured":
            found: dict[str, Any] = row
            return found
    raise AssertionError(f"{case} not in {path}")
