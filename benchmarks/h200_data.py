"""The published H200 calibration data (``shared/gpu-truth``), read once for every benchmark and test that uses it.

``h200-training.jsonl`` holds lines written by ``measure_training.py`` (a plain PyTorch loop, independent of
trainfit): a ``meta`` line opens each measuring process (its allocator setting, its torch release), the cases that
follow ran in that process in order. The figures are measurements, never outputs of trainfit. Benchmarks import this
module (``PYTHONPATH=src:benchmarks``); the tests load it by path (``tests/_gpu_truth.py``), since ``benchmarks/`` is
not a package.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainfit.allocator.workspaces import parse_torch_version
from trainfit.strategy import Strategy

FILE = "h200-training.jsonl"
_REPO = Path(__file__).resolve().parents[1]
#: Where the data lies: beside the checkout (``../shared``), and in this workplace's shared folder.
CANDIDATES = (_REPO.parent / "shared" / "gpu-truth", Path("/work/shared/gpu-truth"))


def find_truth(given: str | Path | None = None) -> Path | None:
    """The folder holding :data:`FILE`: ``given`` (a folder or the file itself) if it does, else the first of
    :data:`CANDIDATES` that does; None if none."""
    if given is not None:
        p = Path(given)
        if p.is_file():
            p = p.parent
        return p if (p / FILE).is_file() else None
    return next((p for p in CANDIDATES if (p / FILE).is_file()), None)


@dataclass(frozen=True)
class Process:
    """One measuring process: its ``PYTORCH_CUDA_ALLOC_CONF`` setting (``"default"``: unset), its torch release
    (which decides the cuBLAS/cuBLASLt workspaces, ``trainfit.allocator.workspaces``) and its cases in order."""

    allocator: str
    torch_version: tuple[int, int]
    cases: list[dict[str, Any]] = field(default_factory=list)

    @property
    def alloc_conf(self) -> str:
        """The setting as trainfit's ``allocator=`` takes it (empty: the default allocator)."""
        return "" if self.allocator == "default" else self.allocator


def rows(truth: Path) -> list[dict[str, Any]]:
    """Every line of the file ``truth`` (a JSON-lines file of ``measure_training.py``, or the folder holding
    :data:`FILE`), parsed."""
    path = truth if truth.is_file() else truth / FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def processes(truth: Path) -> list[Process]:
    """The measuring processes of ``truth`` (as :func:`rows` takes it), in order."""
    out: list[Process] = []
    for row in rows(truth):
        if "meta" in row:
            out.append(Process(row.get("allocator", "default"), parse_torch_version(row["meta"]["torch"])))
        elif "phases" in row:
            out[-1].cases.append(row)
    return out


def measured_strategy(row: dict[str, Any]) -> Strategy:
    """The Strategy of one published case."""
    return Strategy(
        precision=str(row["recipe"]),
        optimizer_impl=str(row["optimizer_impl"]),
        checkpointing=str(row["checkpointing"]),
        attention=str(row["attention"]),
        micro_batch=int(row["batch"]),
        seq_len=int(row["seq"]),
    )


def case(truth: Path, case_id: str, *, expandable: bool = False) -> tuple[Process, dict[str, Any]]:
    """The published case ``case_id`` measured with the default allocator or (``expandable``) with expandable
    segments, and the process it ran in."""
    for p in processes(truth):
        for row in p.cases:
            if row["id"] == case_id and ("expandable" in p.allocator) == expandable:
                return p, row
    raise KeyError(f"{case_id} ({'expandable' if expandable else 'default'} allocator) is not in {truth}")
