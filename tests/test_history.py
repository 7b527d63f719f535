"""The process history (:mod:`trainfit.history`) against the published H200 cases (``../shared/gpu-truth``).

Those cases were measured one after another in one process by ``measure_training.py``: a warm-up matmul, then
each model built by ``from_config`` on the GPU, trained three steps, freed, ``empty_cache()``. With the matching
history (``--build on-device --warm-up --after <the cases before it>``) ``trainfit estimate`` must reproduce each
case's ``max_memory_reserved`` — read from the published file, a measurement, not an output of ours — within the
tolerances docs/accuracy.md states for it ("Against a real GPU"): the trace 0.5%, the analytic method 1.5%.
The trace cases after the first of a process trace every earlier case too (tens of seconds each): ``slow``.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests._gpu_truth import H200_TORCH, h200_processes, measured_strategy
from trainfit import Strategy, estimate, load_model
from trainfit.arch import explicit_model
from trainfit.errors import StrategyError
from trainfit.history import Build, EarlierRun, ProcessHistory
from trainfit.strategy import Parallelism

GPU = "h200-sxm-141gb"
#: docs/accuracy.md, "Against a real GPU": the published max_memory_reserved, in process, per method.
TOLERANCE = {"trace": 0.005, "analytic": 0.015}


def _cases() -> list[tuple[str, dict[str, Any], tuple[dict[str, Any], ...]]]:
    """(allocator, case, the cases before it in its process), in the file's order."""
    return [
        ("" if alloc == "default" else alloc, row, tuple(cases[:k]))
        for alloc, cases in h200_processes()
        for k, row in enumerate(cases)
    ]


def _as_measured(before: tuple[dict[str, Any], ...]) -> ProcessHistory:
    """measure_training.py's process: the warm-up, every model built on the GPU, the earlier cases before."""
    return ProcessHistory(
        build=Build.ON_DEVICE,
        warm_up=True,
        after=tuple(
            EarlierRun(model=load_model(r["model"]), strategy=measured_strategy(r), build=Build.ON_DEVICE)
            for r in before
        ),
    )


def _param(allocator: str, row: dict[str, Any], before: tuple[dict[str, Any], ...], slow: bool) -> Any:
    name = f"{row['id']}-{allocator or 'default'}"
    return pytest.param(allocator, row, before, id=name, marks=[pytest.mark.slow] if slow else [])


CASES = _cases()
needs_data = pytest.mark.skipif(not CASES, reason="the H200 calibration data (../shared/gpu-truth) is not here")


def _as_measured_within_tolerance(method: str, allocator: str, row: dict[str, Any], before: tuple[Any, ...]) -> None:
    """``max_memory_reserved`` and the device's used memory at the end, with the measuring process's history."""
    report = estimate(
        row["model"],
        measured_strategy(row),
        method=method,
        gpu=GPU,
        allocator=allocator,
        history=_as_measured(before),
        fixes=False,
        torch_version=H200_TORCH,
    )
    assert abs(report.reserved_estimate_bytes / row["max_reserved"] - 1) <= TOLERANCE[method]
    assert abs(report.nvidia_smi_estimate_bytes / row["device_used_end"] - 1) <= TOLERANCE[method]


@needs_data
@pytest.mark.parametrize(("allocator", "row", "before"), [_param(*c, slow=False) for c in CASES])
def test_the_analytic_method_with_the_measuring_process_history(
    allocator: str, row: dict[str, Any], before: tuple[dict[str, Any], ...]
) -> None:
    _as_measured_within_tolerance("analytic", allocator, row, before)


@needs_data
@pytest.mark.parametrize(
    ("allocator", "row", "before"),
    # the first case of the default process alone is cheap enough for every run (one trace, about 15 s here)
    [_param(*c, slow=bool(c[2]) or bool(c[0])) for c in CASES],
)
def test_the_trace_with_the_measuring_process_history(
    allocator: str, row: dict[str, Any], before: tuple[dict[str, Any], ...]
) -> None:
    _as_measured_within_tolerance("trace", allocator, row, before)


def test_the_default_history_is_a_fresh_process() -> None:
    """No history, an explicit fresh one and the default report the same reserve; the report echoes it."""
    s = Strategy(micro_batch=2, seq_len=512)
    none = estimate("gpt2", s, gpu=GPU)
    fresh = estimate("gpt2", s, gpu=GPU, history=ProcessHistory())
    assert ProcessHistory().fresh
    assert none.reserved_estimate_bytes == fresh.reserved_estimate_bytes
    assert none.history == ProcessHistory()


def test_a_tied_model_built_on_the_device_starts_with_its_freed_head() -> None:
    """qwen2.5-0.5b ties its head: built on the GPU, the head's own weight is made and freed before training (the
    simulated stream holds it: tests/allocator/test_process.py); the allocated phases do not change, the report
    says which history its reserve assumed."""
    s = Strategy(precision="pure-bf16", micro_batch=1, seq_len=512)
    fresh = estimate("qwen2.5-0.5b", s, gpu=GPU)
    built = estimate("qwen2.5-0.5b", s, gpu=GPU, history=ProcessHistory(build="on-device"))
    assert built.history is not None and built.history.build is Build.ON_DEVICE
    assert any("from_config on the GPU" in n for n in built.notes)
    assert built.peak_bytes == fresh.peak_bytes  # the history moves the reserve only


def test_a_history_the_method_cannot_honour_is_refused() -> None:
    s = Strategy(micro_batch=1, seq_len=512)
    on_device = ProcessHistory(build=Build.ON_DEVICE)
    with pytest.raises(StrategyError, match="--method analytic or trace"):
        estimate("gpt2", s, method="rule-of-thumb", history=on_device)
    with pytest.raises(StrategyError, match="one GPU"):
        estimate("gpt2", Strategy(micro_batch=1, seq_len=512, parallelism=Parallelism.for_gpus(2)), history=on_device)
    with pytest.raises(StrategyError, match="unknown build"):
        ProcessHistory(build="from-the-moon")
    numbers = explicit_model(params=10**8, hidden_size=512, num_layers=4)
    after_numbers = ProcessHistory(after=(EarlierRun(model=numbers, strategy=s),))
    with pytest.raises(StrategyError, match="needs a real model config"):
        estimate("gpt2", s, method="trace", history=after_numbers)
