"""The verdict's middle tier, "fits with cache flushes" (issue 9; planner.search.fit_tier, allocator.report.capped_run).

Each verdict is held against an independent search: ``allocator.least_capacity`` bisects the smallest capacity a
stream runs in (with the allocator's flush-and-retry). The tier is FITS or FITS_WITH_FLUSHES exactly when that
least capacity is within the allocator's share of the usable memory; the hand-built streams' figures are worked
out from c10/cuda/CUDACachingAllocator.cpp's rules (``malloc`` → ``alloc_block`` fails → ``release_cached_blocks``
→ retry), not read off the simulator.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar

import pytest

import trainfit.analytic.rank_events as rank_events
from trainfit import estimate
from trainfit.allocator import AllocatorConfig, Event, Op, Simulator, least_capacity, simulate
from trainfit.allocator.report import capped_run
from trainfit.analytic.activations import effective_strategy
from trainfit.analytic.events import training_events
from trainfit.arch import load_model
from trainfit.estimate import gpu_workspaces
from trainfit.hardware import get_gpu
from trainfit.planner.search import allocator_capacity_bytes, fit_verdict
from trainfit.result import Component, FitTier, MemoryReport, Method, Overhead, Phase, PhaseBreakdown
from trainfit.strategy import Parallelism, Sharding, Strategy

MiB = 1 << 20
OUTSIDE = 500 * MiB  # what sits outside the allocator in the hand-built reports

#: A cached 30 MiB segment, freed, then a 40 MiB request: uncapped 70 MiB reserved, 40 MiB allocated; under a
#: capacity below 70 MiB the 40 MiB cudaMalloc fails, release_cached_blocks frees the idle segment, the retry
#: succeeds (one flush) — down to 40 MiB.
FLUSHABLE = [Event(Op.ALLOC, 1, 30 * MiB), Event(Op.FREE, 1), Event(Op.ALLOC, 2, 40 * MiB)]
#: A 2 MiB block in a 20 MiB segment (kLargeBuffer) stays live, so its segment cannot be released; a 19 MiB
#: request does not fit the 18 MiB remainder and needs a 20 MiB segment of its own: 40 MiB reserved, 21 MiB
#: allocated, and no flush helps below 40 MiB.
PINNED = [Event(Op.ALLOC, 1, 2 * MiB), Event(Op.ALLOC, 2, 19 * MiB)]


def report_of(events: list[Event], capacity: int) -> MemoryReport:
    """A report whose allocated peak and reserve are the stream's (as the analytic method's are, up to the
    closed form's peak), with the capped run a method would attach for ``capacity``."""
    free = simulate(events)
    held, reserve = free.peak_allocated_bytes, free.peak_reserved_bytes - free.peak_allocated_bytes
    capped = capped_run(
        lambda c: simulate(events, capacity_bytes=c),
        free,
        held_bytes=held,
        reserve_bytes=reserve,
        capacity_bytes=capacity,
    )
    return MemoryReport(
        method=Method.ANALYTIC,
        model_name="stream",
        params=1,
        trainable_params=1,
        phases=(PhaseBreakdown(phase=Phase.BACKWARD, components={Component.ACTIVATIONS: held}),),
        overhead=Overhead(cuda_context_bytes=OUTSIDE, allocator_reserve_bytes=reserve),
        capped=capped,
    )


def verdict_of(events: list[Event], capacity: int) -> tuple[FitTier, int]:
    """fit_verdict on a GPU whose whole memory (no headroom) is ``capacity`` + what sits outside the allocator."""
    gpu = dataclasses.replace(get_gpu("h100-sxm-80gb"), memory_bytes=capacity + OUTSIDE)
    fit = fit_verdict(load_model("gpt2"), Strategy(), report_of(events, capacity), gpu, 0.0, None)
    assert fit.fits == (fit.tier is FitTier.FITS)
    return fit.tier, fit.cache_flushes


def test_hand_built_streams_by_hand() -> None:
    assert verdict_of(FLUSHABLE, 70 * MiB) == (FitTier.FITS, 0)
    assert verdict_of(FLUSHABLE, 50 * MiB) == (FitTier.FITS_WITH_FLUSHES, 1)
    assert verdict_of(FLUSHABLE, 40 * MiB) == (FitTier.FITS_WITH_FLUSHES, 1)
    assert verdict_of(FLUSHABLE, 39 * MiB) == (FitTier.DOES_NOT_FIT, 0)  # the allocated peak does not fit
    assert verdict_of(PINNED, 40 * MiB) == (FitTier.FITS, 0)
    assert verdict_of(PINNED, 30 * MiB) == (FitTier.DOES_NOT_FIT, 0)  # allocated 21 fits, no flush frees enough


@pytest.mark.parametrize("events", [FLUSHABLE, PINNED], ids=["flushable", "pinned"])
def test_tier_agrees_with_least_capacity(events: list[Event]) -> None:
    least, _ = least_capacity(events)
    for capacity in range(15 * MiB, 80 * MiB, 5 * MiB):
        tier, _ = verdict_of(events, capacity)
        assert (tier is not FitTier.DOES_NOT_FIT) == (least <= capacity), capacity


def test_capped_run_only_in_the_borderline_case() -> None:
    calls: list[int] = []
    free = simulate(FLUSHABLE)

    def run(c: int) -> Any:
        calls.append(c)
        return simulate(FLUSHABLE, capacity_bytes=c)

    kw = {"held_bytes": 40 * MiB, "reserve_bytes": 30 * MiB}
    assert capped_run(run, free, capacity_bytes=None, **kw) is None
    assert capped_run(run, free, capacity_bytes=70 * MiB, **kw) is None  # the uncapped reserve fits
    assert capped_run(run, free, capacity_bytes=39 * MiB, **kw) is None  # the allocated peak does not
    assert calls == []
    # A reserve the method takes above a larger allocated peak than the stream's (the savers' streams): the
    # stream gets the capacity less what the estimate adds above its own reserved peak.
    capped = capped_run(run, free, capacity_bytes=60 * MiB, held_bytes=45 * MiB, reserve_bytes=30 * MiB)
    assert capped is not None and calls == [60 * MiB - 5 * MiB]
    assert capped.stream_capacity_bytes == 55 * MiB and capped.completed


# --- through trainfit.estimate ----------------------------------------------------------------------------

GPU = "h100-sxm-80gb"
FRACTIONS = (0.05, 0.3, 0.6, 0.95)  # of the way from the allocated peak to the uncapped requirement


def headrooms(spec: Any, strategy: Strategy) -> list[tuple[float, int]]:
    """(headroom, the allocator's capacity there) at FRACTIONS between "the allocated peak just fits" and "the
    uncapped reserve just fits"."""
    r0 = estimate(spec, strategy, gpu=GPU, headroom=0.0, fixes=False)
    assert r0.fit is not None
    lo = r0.peak_bytes + r0.overhead.outside_allocator_bytes
    hi = r0.fit.required_bytes
    assert hi > lo + 64 * MiB, "no room for the middle tier in this setup"
    out = []
    for frac in FRACTIONS:
        headroom = 1 - (lo + (hi - lo) * frac) / r0.fit.gpu_memory_bytes
        usable = int(r0.fit.gpu_memory_bytes * (1 - headroom))
        out.append((headroom, allocator_capacity_bytes(usable, r0.overhead.outside_allocator_bytes)))
    return out


def check_against(least: int, spec: Any, strategy: Strategy) -> set[FitTier]:
    seen = set()
    for headroom, capacity in headrooms(spec, strategy):
        if abs(capacity - least) < MiB:  # least_capacity's resolution
            continue
        rep = estimate(spec, strategy, gpu=GPU, headroom=headroom, fixes=False)
        assert rep.fit is not None and rep.capped is not None
        assert rep.capped.capacity_bytes == capacity
        assert (rep.fit.tier is FitTier.FITS_WITH_FLUSHES) == (least <= capacity), (headroom, capacity, least)
        assert (rep.fit.cache_flushes > 0) == (rep.fit.tier is FitTier.FITS_WITH_FLUSHES)
        assert not rep.fit.fits  # `fits` keeps its meaning: without flushes
        seen.add(rep.fit.tier)
    return seen


def test_one_gpu_analytic_tier_agrees_with_least_capacity() -> None:
    spec = load_model("qwen2.5-0.5b")
    strategy = Strategy(micro_batch=1, seq_len=2048)
    eff, _ = effective_strategy(spec, strategy)
    least, _ = least_capacity(training_events(spec, eff, gpu_workspaces(get_gpu(GPU))), AllocatorConfig.from_env())
    assert check_against(least, spec, strategy) == {FitTier.FITS_WITH_FLUSHES, FitTier.DOES_NOT_FIT}


class _Recording(Simulator):
    """Keeps the uncapped stream a rank's simulation is driven with."""

    made: ClassVar[list[_Recording]] = []

    def __init__(self, config: AllocatorConfig | None = None, **kw: Any) -> None:
        super().__init__(config, **kw)
        self.events: list[Event] = []
        _Recording.made.append(self)

    def malloc(self, key: int, size_bytes: int, stream: int = 0) -> int:
        self.events.append(Event(Op.ALLOC, key, size_bytes, stream))
        return super().malloc(key, size_bytes, stream)

    def free_completed(self, key: int) -> None:
        self.events.append(Event(Op.FREE, key))
        super().free_completed(key)


def test_many_gpu_rank_tier_agrees_with_least_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = load_model("qwen2.5-0.5b")
    strategy = Strategy(micro_batch=1, seq_len=2048, parallelism=Parallelism(data=2), sharding=Sharding.FSDP)
    monkeypatch.setattr(rank_events, "Simulator", _Recording)
    _Recording.made = []
    rank_events.simulation_memo().clear()
    estimate(spec, strategy, gpu=GPU, search_micro_batch=False)
    monkeypatch.undo()
    rank_events.simulation_memo().clear()
    (uncapped,) = [r for r in _Recording.made if r.capacity_bytes is None]
    assert not any(e.op is Op.FREE_REQUESTED for e in uncapped.events)  # one stream: plain frees replay it
    least, _ = least_capacity(uncapped.events, AllocatorConfig.from_env())
    assert FitTier.FITS_WITH_FLUSHES in check_against(least, spec, strategy)


def test_cli_prints_the_tier_and_json_keys(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.cli._cli_helper import run_cli

    spec = load_model("qwen2.5-0.5b")
    strategy = Strategy(micro_batch=1, seq_len=2048)
    headroom, _ = headrooms(spec, strategy)[-1]
    args = ["estimate", "qwen2.5-0.5b", "--gpu", GPU, "--batch", "1", "--seq", "2048", "--headroom", f"{headroom!r}"]
    res = run_cli(capsys, *args, "--no-fixes", "--json")
    assert res.code == 0, res.err
    out = json.loads(res.out)
    assert out["fits"] is False and out["verdict"] == "fits-with-flushes"
    assert out["cache_flushes"] == out["capped_run"]["num_alloc_retries"] >= 1
    assert out["capped_run"]["completed"] is True
    assert out["capped_run"]["capacity_bytes"] == out["usable_bytes"] - (
        out["nvidia_smi_estimate_bytes"] - out["reserved_estimate_bytes"]
    )
    res = run_cli(capsys, *args, "--no-fixes")
    n = out["cache_flushes"]
    assert f"FITS WITH {n} CACHE FLUSH{'' if n == 1 else 'ES'} on {GPU}" in " ".join(res.out.split())
    assert "fits without cache flushes" in " ".join(res.out.split())
