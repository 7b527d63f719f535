"""The simulation's answer as the typed details a :class:`~trainfit.result.MemoryReport` carries (shared by the
analytic method and the trace, which both replay an event stream)."""

from __future__ import annotations

from trainfit.allocator.config import AllocatorConfig
from trainfit.allocator.simulator import AllocatorResult, BlockState, SegmentLayout
from trainfit.result import AllocatorDetails, SegmentSummary

__all__ = ["allocator_details", "segment_summary"]


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
