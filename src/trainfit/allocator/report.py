"""The simulation's answer as the typed details a :class:`~trainfit.result.MemoryReport` carries (shared by the
analytic method and the trace, which both replay an event stream).

:func:`capped_run` is the one rule for the verdict's middle tier (:class:`~trainfit.result.FitTier`): a method
whose reserve comes from a simulated stream re-runs that stream once under the capacity the verdict compares
against, and only in the borderline case (the allocated peak fits it, the uncapped reserved estimate does not).
A real run there does not fail at the uncapped peak: ``malloc`` frees the cached blocks and retries
(c10/cuda/CUDACachingAllocator.cpp ``release_cached_blocks``; :class:`~trainfit.allocator.simulator.Simulator`)."""

from __future__ import annotations

from collections.abc import Callable

from trainfit.allocator.config import AllocatorConfig
from trainfit.allocator.simulator import AllocatorResult, BlockState, SegmentLayout
from trainfit.result import AllocatorDetails, CappedRun, SegmentSummary

__all__ = ["allocator_details", "capped_run", "segment_summary"]


def segment_summary(seg: SegmentLayout) -> SegmentSummary:
    """One segment's totals: its allocated blocks (pending frees count as allocated) and its free space."""
    free = [b.size_bytes for b in seg.blocks if b.state is BlockState.FREE]
    return SegmentSummary(
        size_bytes=seg.size_bytes,
        pool=seg.pool.value,
        expandable=seg.expandable,
        allocated_bytes=seg.size_bytes - sum(free),
        free_bytes=sum(free),
        blocks=len(seg.blocks),
        largest_free_bytes=max(free, default=0),
    )


def allocator_details(result: AllocatorResult, config: AllocatorConfig) -> AllocatorDetails:
    """The details of a simulation run (with its segment layout at the reserved peak when it was asked for)."""
    return AllocatorDetails(
        config=config.to_env(),
        reserved_peak_bytes=result.peak_reserved_bytes,
        fragmentation_bytes=result.fragmentation_bytes,
        segments=result.num_segments_at_peak,
        layout=tuple(segment_summary(s) for s in result.layout_at_peak or ()),
    )


def capped_run(
    run: Callable[[int], AllocatorResult],
    uncapped: AllocatorResult,
    *,
    held_bytes: int,
    reserve_bytes: int,
    capacity_bytes: int | None,
) -> CappedRun | None:
    """The stream of ``uncapped`` once more under ``capacity_bytes`` (``run(c)``: the same stream simulated with
    capacity ``c``), when it is borderline: the allocated peak the report holds (``held_bytes``, workspaces
    included) fits the capacity and the reserved estimate (``held_bytes + reserve_bytes``) does not; else None.

    The report's reserved estimate may sit above the stream's own reserved peak (a method that takes its reserve
    above a larger allocated peak than the stream's: the savers' streams), so the stream runs under the capacity
    less that difference: "the estimate fits C" and "the stream fits its capacity" are the same statement (never
    more than the capacity: where the estimate sits below the stream's peak the stream gets the capacity itself)."""
    reserved = held_bytes + reserve_bytes
    if capacity_bytes is None or held_bytes > capacity_bytes or reserved <= capacity_bytes:
        return None
    stream_capacity = capacity_bytes - max(0, reserved - uncapped.peak_reserved_bytes)
    res = run(stream_capacity)
    return CappedRun(
        capacity_bytes=capacity_bytes,
        stream_capacity_bytes=stream_capacity,
        completed=res.oom is None,
        num_alloc_retries=res.num_alloc_retries,
        peak_reserved_bytes=res.peak_reserved_bytes,
    )
