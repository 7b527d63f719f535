"""The verdict's middle tier on the trace's own events (trace.api.trace_spec with ``capacity_bytes``): the tier
agrees with ``allocator.least_capacity`` bisecting the same full-depth stream (``reserved_from_trace().stream``)."""

from __future__ import annotations

import os

import pytest

from tests.trace.conftest import tiny_spec
from trainfit import estimate
from trainfit.allocator import AllocatorConfig, least_capacity
from trainfit.estimate import gpu_compute_capability
from trainfit.hardware import get_gpu
from trainfit.planner.search import allocator_capacity_bytes
from trainfit.result import FitTier
from trainfit.strategy import Strategy
from trainfit.trace.events import reserved_from_trace

GPU = "h100-sxm-80gb"


@pytest.mark.slow
def test_trace_tier_agrees_with_least_capacity() -> None:
    spec = tiny_spec("llama")
    strategy = Strategy(micro_batch=4, seq_len=1024)
    config = AllocatorConfig.from_env()
    r0 = estimate(spec, strategy, method="trace", gpu=GPU, headroom=0.0)
    assert r0.fit is not None and r0.capped is None  # fits an 80 GB GPU: nothing to cap
    stream = reserved_from_trace(
        spec, strategy, config, compute_capability=gpu_compute_capability(get_gpu(GPU)), env=os.environ
    ).stream
    least, _ = least_capacity(list(stream), config)
    outside = r0.overhead.outside_allocator_bytes
    # the allocator's share halfway between the least capacity and the uncapped reserved estimate
    capacity = (least + r0.reserved_estimate_bytes) // 2
    assert r0.peak_bytes <= least < capacity < r0.reserved_estimate_bytes, "no room for the middle tier"
    headroom = 1 - (capacity + outside + 1) / r0.fit.gpu_memory_bytes
    rep = estimate(spec, strategy, method="trace", gpu=GPU, headroom=headroom)
    assert rep.fit is not None and rep.capped is not None
    assert rep.capped.capacity_bytes == allocator_capacity_bytes(rep.fit.usable_bytes, outside)
    assert rep.fit.tier is FitTier.FITS_WITH_FLUSHES and rep.fit.cache_flushes >= 1
