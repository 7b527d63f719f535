"""Expandable segments on hand-built sequences; every expected figure is worked out by hand (in the comments)
from c10/cuda/CUDACachingAllocator.cpp, not by running the simulator:

* ``get_free_block``: best fit by size among the pool's free *mapped* blocks (the free block at the mapped end
  is ranked by its size plus the unmapped space behind it);
* ``find_expandable_block``: on a miss, the lowest-addressed unmapped range of the pool and stream, together
  with the free block just before it, that has room; ``try_allocate_expandable_block`` / ``map_block`` map
  whole pages (20 MiB in the large pool, ``large_segment_size``) covering what that free block lacks;
* ``should_split``: with expandable segments any remainder of ≥ 512 B becomes a free block;
* default segments for comparison: ``get_allocation_size`` (≥ 10 MiB: the request rounded to 2 MiB), split
  only when the remainder is > 1 MiB, no merging across segments;
* out of memory (``malloc``): ``release_cached_blocks`` → ``release_blocks`` → ``unmap_block`` unmaps every whole
  free page, then one retry (``alloc_block(..., isRetry=true)``);
* ``alloc_block``: the memory fraction (``set_fraction``) is checked against ``get_allocation_size`` before
  any page is mapped; the device itself only refuses the pages actually created (``ExpandableSegment::map``).
"""

from __future__ import annotations

import pytest

from trainfit.allocator import (
    AllocatorConfig,
    AllocatorConfigError,
    Event,
    Op,
    Simulator,
    least_capacity,
    simulate,
)

MiB = 1 << 20
EXPANDABLE = AllocatorConfig.parse("expandable_segments:True")


def _stranding_events() -> list[Event]:
    """The pattern behind llama-3.1-70b ZeRO-2 over 64 ranks reserving more with expandable segments (its
    stream reduced to four allocations: an 8016 MiB fp32 flat buffer, two 4205 MiB ones; here at small
    scale, behind a long-lived 1000 MiB block)."""
    return [
        Event(Op.ALLOC, 1, 1000 * MiB),  # E: lives throughout (the weights)
        Event(Op.ALLOC, 2, 200 * MiB),  # A
        Event(Op.FREE, 2),
        Event(Op.ALLOC, 3, 100 * MiB),  # B
        Event(Op.ALLOC, 4, 110 * MiB),  # C: lives on
        Event(Op.FREE, 3),
        Event(Op.ALLOC, 5, 200 * MiB),  # D: as large as A
    ]


def test_expandable_segment_strands_a_hole_that_default_segments_reuse() -> None:
    # default: E segment 1000; A segment 200, freed whole; B splits it (remainder 100 > 1 MiB); C misses (100 <
    # 110): its own 110 MiB segment -> 1310; B freed merges back: the 200 MiB segment is whole; D reuses it
    default = simulate(_stranding_events(), AllocatorConfig())
    assert default.peak_reserved_bytes == 1310 * MiB
    assert default.num_segments_at_peak == 3
    # expandable: E maps [0, 1000); A maps [1000, 1200) and is freed (the mapped end: free, then unmapped); B takes
    # its low end, free [1100, 1200); C misses: the free block before the unmapped range lacks 10 MiB -> one page,
    # reserved 1220, C = [1100, 1210), free [1210, 1220); B freed: a 100 MiB hole between E and C; D misses (hole
    # 100, tail 10): the tail plus 190 MiB -> ten pages, reserved 1420, D = [1210, 1410)
    grown = simulate(_stranding_events(), EXPANDABLE)
    assert grown.peak_reserved_bytes == 1420 * MiB
    assert grown.peak_allocated_bytes == default.peak_allocated_bytes == 1310 * MiB  # E + C + D
    assert grown.num_segments_at_peak == 1


def test_under_pressure_expandable_segments_unmap_the_hole_and_fit() -> None:
    events = _stranding_events()
    # device capacity 1320 MiB (its virtual range: 1320 * 9/8 = 1485 -> 1500 MiB, above the 1420 MiB used): D's
    # ten pages would make 1420 > 1320; release_cached_blocks unmaps the hole's five whole pages [1000, 1100)
    # (1120 left; the tail [1210, 1220) holds no whole page); the retry finds the unmapped hole too small
    # (100 MiB, then C), so it maps the ten pages behind the tail again: 1320 <= 1320
    sim = Simulator(EXPANDABLE, capacity_bytes=1320 * MiB)
    assert sim.run(events) is None
    assert sim.peak_reserved_bytes == 1320 * MiB
    assert sim.num_alloc_retries == 1
    assert sim.allocated_bytes == 1310 * MiB  # E + C + D
    # D freed and empty_cache: D's whole pages [1220, 1420) are unmapped, [1210, 1220) stays free -> 1120
    sim.free(5)
    sim.empty_cache()
    assert sim.reserved_bytes == 1120 * MiB
    # the lowest unmapped range with room comes first: F = 100 MiB maps the hole again (exactly 100 MiB before
    # C), at E's end, not behind C
    sim.malloc(6, 100 * MiB)
    assert sim.address_of(6) == sim.address_of(1) + 1000 * MiB
    assert sim.reserved_bytes == 1220 * MiB

    # one MiB less and the retry's 1120 + 200 does not fit
    oom = simulate(events, EXPANDABLE, capacity_bytes=1319 * MiB).oom
    assert oom is not None and oom.event_index == 6
    # the default allocator needs its 1310 MiB peak and no retry
    default = simulate(events, AllocatorConfig(), capacity_bytes=1310 * MiB)
    assert default.oom is None and default.num_alloc_retries == 0


def test_least_capacity_finds_the_hand_worked_limits() -> None:
    # from the test above: expandable segments fit in 1320 MiB with one flush (not in 1319); the default
    # allocator needs its 1310 MiB peak, which is also the allocated peak, so the bisection starts there
    cap, at = least_capacity(_stranding_events(), EXPANDABLE)
    assert cap == 1320 * MiB
    assert at.num_alloc_retries == 1 and at.peak_reserved_bytes == 1320 * MiB
    cap, at = least_capacity(_stranding_events(), AllocatorConfig())
    assert cap == 1310 * MiB and at.num_alloc_retries == 0

    def drive(sim: Simulator) -> None:  # the same stream as calls, the way the synthesised streams run
        sim.malloc(1, 1000 * MiB)
        sim.malloc(2, 200 * MiB)
        sim.free(2)
        sim.malloc(3, 100 * MiB)
        sim.malloc(4, 110 * MiB)
        sim.free(3)
        sim.malloc(5, 200 * MiB)

    assert least_capacity(drive, EXPANDABLE)[0] == 1320 * MiB


def test_memory_fraction_checks_the_allocation_size_but_the_device_only_new_pages() -> None:
    events = [
        Event(Op.ALLOC, 1, 15 * MiB),  # one 20 MiB page; [15, 20) free at the mapped end
        Event(Op.ALLOC, 2, 24 * MiB),  # misses: get_allocation_size(24 MiB) = 24 MiB, but only 19 MiB are lacking
    ]
    # device: the 5 MiB tail plus one more page: 40 <= 40
    device = simulate(events, EXPANDABLE, capacity_bytes=40 * MiB)
    assert device.oom is None
    assert device.peak_reserved_bytes == 40 * MiB
    # memory fraction: 20 + 24 > 40 before any page is mapped; release_cached_blocks finds no whole free page
    # (the tail is 5 MiB of a page in use); the retry is refused the same way
    fraction = simulate(events, EXPANDABLE, memory_fraction_bytes=40 * MiB)
    assert fraction.oom is not None and fraction.oom.event_index == 1
    assert fraction.num_alloc_retries == 1


# ---------------------------------------------------------------- large_segment_size_mb (torch 2.13)
def test_large_segment_size_sets_the_mid_segment_and_the_expandable_page() -> None:
    conf = AllocatorConfig.parse("large_segment_size_mb:64")
    assert conf.large_segment_size_bytes == 64 * MiB
    sim = Simulator(conf)
    sim.malloc(1, 5 * MiB)  # 1-10 MiB: get_allocation_size = large_segment_size
    assert sim.reserved_bytes == 64 * MiB
    sim.malloc(2, 12 * MiB)  # >= 10 MiB: still its size rounded to 2 MiB (kRoundLarge); 59 MiB remainder fits it
    assert sim.reserved_bytes == 64 * MiB
    grown = Simulator(AllocatorConfig.parse("large_segment_size_mb:64,expandable_segments:True"))
    grown.malloc(1, 70 * MiB)  # two 64 MiB pages
    assert grown.reserved_bytes == 128 * MiB
    grown.malloc(2, 1000)  # the small pool keeps 2 MiB pages
    assert grown.reserved_bytes == 130 * MiB


def test_large_segment_size_parsing_follows_pytorch() -> None:
    # > 10 (kMinLargeAlloc in MiB), and the floor of the split options parsed after it
    for bad in ("large_segment_size_mb:10", "large_segment_size_mb:40,max_split_size_mb:30", "max_split_size_mb:15"):
        with pytest.raises(AllocatorConfigError):
            AllocatorConfig.parse(bad)
    low = AllocatorConfig.parse("large_segment_size_mb:12,max_split_size_mb:15,max_non_split_rounding_mb:12")
    assert low.max_split_size_bytes == 15 * MiB and low.max_non_split_rounding_bytes == 12 * MiB
    # parsed before it, the floor is still the default 20
    late = AllocatorConfig.parse("max_split_size_mb:30,large_segment_size_mb:40")
    assert late.max_split_size_bytes == 30 * MiB and late.large_segment_size_bytes == 40 * MiB
    for conf in (low, late, AllocatorConfig.parse("large_segment_size_mb:64,expandable_segments:True")):
        assert AllocatorConfig.parse(conf.to_env()) == conf


def test_a_request_past_the_virtual_range_is_out_of_memory_or_gets_its_own_range() -> None:
    """A request larger than the whole virtual range (9/8 of the capacity, 1320 → 1485 → 1500 MiB in 20 MiB pages):
    ``map_block`` runs off the range's end — out of memory, as the device has no room for it either. Without a
    capacity (the unlimited simulation every estimate runs first) the range is made as large as the request."""
    events = [Event(Op.ALLOC, 1, 100 * MiB), Event(Op.ALLOC, 2, 1600 * MiB)]
    oom = simulate(events, EXPANDABLE, capacity_bytes=1320 * MiB).oom
    assert oom is not None and oom.event_index == 1
    huge = 20 * MiB << 22  # 80 TiB, whole 20 MiB pages: above the default 64 TiB range
    unlimited = simulate([Event(Op.ALLOC, 1, 100 * MiB), Event(Op.ALLOC, 2, huge)], EXPANDABLE)
    assert unlimited.oom is None and unlimited.peak_reserved_bytes == 100 * MiB + huge
