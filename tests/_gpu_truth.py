"""The published H200 calibration data (``../shared/gpu-truth``, ``h200-training.jsonl``) for the tests that read
it: where it is (None when this checkout has no ``shared/`` beside it), its measuring processes, a case's Strategy.
The figures are measurements by ``measure_training.py``, not outputs of trainfit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainfit import Strategy

_CANDIDATES = (Path(__file__).resolve().parents[2] / "shared" / "gpu-truth", Path("/work/shared/gpu-truth"))
#: The torch release of the H200 measurements (the files' ``meta`` lines: 2.11.0+cu130): it decides the cuBLAS and
#: cuBLASLt workspaces (``trainfit.allocator.workspaces``; a separate Lt workspace up to 2.11).
H200_TORCH = (2, 11)
TRUTH = next((p for p in _CANDIDATES if (p / "h200-training.jsonl").is_file()), None)


def h200_processes() -> list[tuple[str, list[dict[str, Any]]]]:
    """The measuring processes of the calibration file: each one's allocator setting and its cases, in order."""
    if TRUTH is None:
        return []
    out: list[tuple[str, list[dict[str, Any]]]] = []
    for line in (TRUTH / "h200-training.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "meta" in row:
            out.append((row["allocator"], []))
        elif "phases" in row:
            out[-1][1].append(row)
    return out


def measured_strategy(row: dict[str, Any]) -> Strategy:
    """The Strategy of one published case."""
    return Strategy(
        precision=row["recipe"],
        optimizer_impl=row["optimizer_impl"],
        checkpointing=row["checkpointing"],
        attention=row["attention"],
        micro_batch=row["batch"],
        seq_len=row["seq"],
    )
