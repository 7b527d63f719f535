"""Each rule of the caching allocator on a hand-built sequence; expected values worked out by hand from
c10/cuda/CUDACachingAllocator.cpp (function named in each test), not by running the simulator."""

from __future__ import annotations

import pytest

from trainfit.allocator import AllocatorConfig, Event, Op, Simulator, round_size, simulate

MiB = 1 << 20


def cfg(conf: str = "") -> AllocatorConfig:
    return AllocatorConfig.parse(conf)


# ---------------------------------------------------------------- round_size
def test_round_size_512() -> None:
    c = cfg()
    assert round_size(1, c) == 512
    assert round_size(512, c) == 512
    assert round_size(513, c) == 1024
    assert round_size(11 * MiB + 1, c) == 11 * MiB + 512


def test_round_size_power2_divisions() -> None:
    c = cfg("roundup_power2_divisions:4")
    # 1.2 MiB lies in [1 MiB, 2 MiB): four steps of 256 KiB -> 1.25 MiB
    assert round_size(1258291, c) == 1310720
    # a power of two stays; 1200 B is not above 512 * 4, so plain 512 B rounding -> 1536
    assert round_size(4 * MiB, c) == 4 * MiB
    assert round_size(1200, c) == 1536


# roundup_power2_next_division(size, d): not a power of two -> floor = the power of two below size,
# step = floor >> log2(d), and size rounds up to a multiple of step. Worked by hand; each case names what a step
# of half or twice the size (an off-by-one in the shift) would give instead.
@pytest.mark.parametrize(
    ("conf", "size", "expected"),
    [
        # d = 2, 4 MiB + 1: step 2 MiB -> 6 MiB (step 1 MiB: 5 MiB; step 4 MiB: 8 MiB)
        ("roundup_power2_divisions:2", 4 * MiB + 1, 6 * MiB),
        # d = 4, 1 MiB + 1: step 256 KiB -> 1.25 MiB (128 KiB: 1.125 MiB; 512 KiB: 1.5 MiB)
        ("roundup_power2_divisions:4", MiB + 1, 1310720),
        # d = 4, 1.3 MiB (1363149 B): step 256 KiB -> 1.5 MiB (128 KiB: 1.375 MiB; 512 KiB: 1.5 MiB)
        ("roundup_power2_divisions:4", 1363149, 1572864),
        # d = 4, a multiple of the step stays: 1.75 MiB
        ("roundup_power2_divisions:4", 1835008, 1835008),
        # d = 4, 2049 B (just above 512 * 4): floor 2048, step 512 -> 2560 (256: 2304; 1024: 3072)
        ("roundup_power2_divisions:4", 2049, 2560),
        # d = 8, 300 MiB: floor 256 MiB, step 32 MiB -> 320 MiB (16 MiB: 304 MiB)
        ("roundup_power2_divisions:8", 300 * MiB, 320 * MiB),
        # d = 8, 257 MiB: step 32 MiB -> 288 MiB (16 MiB: 272 MiB; 64 MiB: 320 MiB)
        ("roundup_power2_divisions:8", 257 * MiB, 288 * MiB),
        # d = 16, 513 MiB: floor 512 MiB, step 32 MiB -> 544 MiB (16 MiB: 528 MiB; 64 MiB: 576 MiB)
        ("roundup_power2_divisions:16", 513 * MiB, 544 * MiB),
        # per interval: [1:2,>:8] -> 1-2 MiB get 2 (step 512 KiB), 2 MiB and up 8 (step 256 KiB at 2 MiB)
        ("roundup_power2_divisions:[1:2,>:8]", MiB + 1, 1536 * 1024),
        ("roundup_power2_divisions:[1:2,>:8]", 2 * MiB + 1, 2304 * 1024),
        # 0 or 1 divisions in an interval: plain 512 B rounding ([1:8,2:1,>:0] -> 1, then 0 from 4 MiB)
        ("roundup_power2_divisions:[1:8,2:1,>:0]", 3 * MiB + 1, 3 * MiB + 512),
        ("roundup_power2_divisions:[1:8,2:1,>:0]", 5 * MiB + 1, 5 * MiB + 512),
    ],
)
def test_round_size_power2_division_step(conf: str, size: int, expected: int) -> None:
    assert round_size(size, cfg(conf)) == expected


# ---------------------------------------------------------------- pools, segment sizes, splitting
def test_small_requests_share_a_2mib_segment() -> None:
    sim = Simulator(cfg())
    sim.malloc(1, 1000)
    sim.malloc(2, 1000)
    assert sim.reserved_bytes == 2 * MiB
    assert sim.allocated_bytes == 2048
    assert sim.address_of(2) == sim.address_of(1) + 1024  # split at the low end, rest stays free


def test_mid_size_request_gets_20mib_segment_and_splits() -> None:
    sim = Simulator(cfg())
    sim.malloc(1, 5 * MiB)
    assert sim.reserved_bytes == 20 * MiB
    assert sim.allocated_bytes == 5 * MiB
    sim.malloc(2, 15 * MiB)  # the 15 MiB remainder fits exactly
    assert sim.reserved_bytes == 20 * MiB
    assert sim.address_of(2) == sim.address_of(1) + 5 * MiB


def test_large_request_rounds_to_2mib_and_unsplit_remainder_counts_as_allocated() -> None:
    sim = Simulator(cfg())
    sim.malloc(1, 11 * MiB + 1)  # rounded to 11 MiB + 512 B, segment rounded up to 12 MiB
    assert sim.reserved_bytes == 12 * MiB
    assert sim.allocated_bytes == 12 * MiB  # remainder (~0.5 MiB) is not > 1 MiB: not split
    sim.free(1)
    sim.malloc(2, 10 * MiB + 512 * 1024)  # 10.5 MiB: remainder 1.5 MiB > 1 MiB -> split
    assert sim.allocated_bytes == 10 * MiB + 512 * 1024
    assert sim.reserved_bytes == 12 * MiB


def test_best_fit_smallest_then_lowest_address() -> None:
    sim = Simulator(cfg())
    for k, size in ((1, 14 * MiB), (2, 12 * MiB), (3, 12 * MiB), (4, 16 * MiB)):
        sim.malloc(k, size)
    addr = {k: sim.address_of(k) for k in (1, 2, 3, 4)}
    for k in (4, 3, 2, 1):
        sim.free(k)
    sim.malloc(5, 11 * MiB)  # candidates 12, 12, 14, 16: the 12 MiB ones; lower address wins
    assert sim.address_of(5) == min(addr[2], addr[3])
    assert sim.reserved_bytes == 54 * MiB


def test_merge_free_neighbours_within_segment() -> None:
    sim = Simulator(cfg())
    for k in (1, 2, 3):
        sim.malloc(k, 4 * MiB)  # one 20 MiB segment: [a 4][b 4][c 4][free 8]
    base = sim.address_of(1)
    sim.free(1)
    sim.free(2)  # merges with a: free 8 MiB at base
    sim.malloc(4, 8 * MiB)  # free blocks: 8 MiB at base and 8 MiB at base+12: lowest address
    assert sim.address_of(4) == base
    assert sim.reserved_bytes == 20 * MiB


def test_no_merge_across_segments() -> None:
    sim = Simulator(cfg())
    sim.malloc(1, 12 * MiB)
    sim.malloc(2, 12 * MiB)
    sim.free(1)
    sim.free(2)
    sim.malloc(3, 24 * MiB)  # two free 12 MiB segments never make a 24 MiB block
    assert sim.reserved_bytes == 48 * MiB


def test_pools_are_per_stream() -> None:
    sim = Simulator(cfg())
    sim.malloc(1, 12 * MiB, stream=0)
    sim.free(1)
    sim.malloc(2, 12 * MiB, stream=7)
    assert sim.reserved_bytes == 24 * MiB
    sim.malloc(3, 12 * MiB, stream=0)  # stream 0's cached block serves stream 0
    assert sim.reserved_bytes == 24 * MiB


def test_small_and_large_pools_are_separate() -> None:
    sim = Simulator(cfg())
    sim.malloc(1, 5 * MiB)  # 20 MiB large segment with 15 MiB free
    sim.malloc(2, 4096)  # small request: never from the large pool
    assert sim.reserved_bytes == 22 * MiB


# ---------------------------------------------------------------- max_split_size_mb
def test_max_split_size_oversize_blocks() -> None:
    sim = Simulator(cfg("max_split_size_mb:20"))
    sim.malloc(1, 30 * MiB)
    sim.free(1)
    sim.malloc(2, 25 * MiB)  # >= max_split: may take a block < 25 + 20 MiB, never split it
    assert sim.allocated_bytes == 30 * MiB
    assert sim.reserved_bytes == 30 * MiB
    sim.free(2)
    sim.malloc(3, 12 * MiB)  # < max_split: oversize cached block refused -> new 12 MiB segment
    assert sim.reserved_bytes == 42 * MiB


def test_max_non_split_rounding() -> None:
    sim = Simulator(cfg("max_split_size_mb:20"))
    sim.malloc(1, 60 * MiB)
    sim.free(1)
    sim.malloc(2, 30 * MiB)  # 60 >= 30 + 20: refused
    assert sim.reserved_bytes == 90 * MiB
    sim2 = Simulator(cfg("max_split_size_mb:20,max_non_split_rounding_mb:40"))
    sim2.malloc(1, 60 * MiB)
    sim2.free(1)
    sim2.malloc(2, 30 * MiB)  # 60 < 30 + 40: taken whole
    assert sim2.reserved_bytes == 60 * MiB
    assert sim2.allocated_bytes == 60 * MiB


# ---------------------------------------------------------------- release
def test_empty_cache_frees_only_unsplit_free_segments() -> None:
    sim = Simulator(cfg())
    sim.malloc(1, 12 * MiB)
    sim.malloc(2, 5 * MiB)  # 20 MiB segment, split
    sim.malloc(3, 1000)  # small segment
    sim.free(1)
    sim.free(3)
    sim.empty_cache()  # 12 MiB and the 2 MiB small segment go; the split 20 MiB one stays
    assert sim.reserved_bytes == 20 * MiB
    assert sim.peak_reserved_bytes == 34 * MiB


def test_oom_retry_frees_cache_then_fails() -> None:
    sim = Simulator(cfg(), capacity_bytes=40 * MiB)
    sim.malloc(1, 30 * MiB)
    sim.free(1)
    sim.malloc(2, 12 * MiB, stream=1)  # 30 + 12 > 40: release cached 30 MiB, retry
    assert sim.reserved_bytes == 12 * MiB
    assert sim.num_device_frees == 1
    res = simulate(
        [Event(Op.ALLOC, 1, 30 * MiB), Event(Op.ALLOC, 2, 12 * MiB)],
        cfg(),
        capacity_bytes=40 * MiB,
    )
    assert res.oom is not None
    assert res.oom.event_index == 1


def test_garbage_collection_threshold_needs_a_memory_fraction() -> None:
    events = [Event(Op.ALLOC, 1, 40 * MiB), Event(Op.FREE, 1), Event(Op.ALLOC, 2, 20 * MiB, stream=1)]
    # threshold 0.3 * 100 MiB = 30 MiB < 40 reserved: the 40 MiB block (age 1 = average) is freed first
    with_gc = simulate(events, cfg("garbage_collection_threshold:0.3"), memory_fraction_bytes=100 * MiB)
    assert with_gc.reserved_end_bytes == 20 * MiB
    assert with_gc.peak_reserved_bytes == 40 * MiB
    without_fraction = simulate(events, cfg("garbage_collection_threshold:0.3"))
    assert without_fraction.reserved_end_bytes == 60 * MiB
    # malloc collects only under set_fraction: a device capacity alone does not
    device_only = simulate(events, cfg("garbage_collection_threshold:0.3"), capacity_bytes=100 * MiB)
    assert device_only.reserved_end_bytes == 60 * MiB


# ---------------------------------------------------------------- cross-stream frees
def test_free_requested_keeps_block_until_completed() -> None:
    sim = Simulator(cfg())
    sim.malloc(1, 5 * MiB)
    a = sim.address_of(1)
    sim.free_requested(1)
    assert sim.allocated_bytes == 0
    sim.malloc(2, 5 * MiB)  # block 1 not reusable yet: from the 15 MiB remainder
    assert sim.address_of(2) == a + 5 * MiB
    sim.free_completed(1)
    sim.malloc(3, 5 * MiB)  # free: 5 MiB at a, 10 MiB tail -> best fit a
    assert sim.address_of(3) == a


# ---------------------------------------------------------------- expandable segments
def test_expandable_maps_pages_on_demand() -> None:
    sim = Simulator(cfg("expandable_segments:True"))
    sim.malloc(1, 5 * MiB)  # one 20 MiB page
    assert sim.reserved_bytes == 20 * MiB
    assert sim.allocated_bytes == 5 * MiB
    sim.malloc(2, 16 * MiB)  # 15 MiB free at the end + one more page, contiguous
    assert sim.reserved_bytes == 40 * MiB
    assert sim.address_of(2) == sim.address_of(1) + 5 * MiB
    sim.malloc(3, 1000)  # small pool: its own range, 2 MiB pages
    assert sim.reserved_bytes == 42 * MiB


def test_expandable_splits_any_remainder() -> None:
    sim = Simulator(cfg("expandable_segments:True"))
    sim.malloc(1, 12 * MiB)  # one 20 MiB page; remainder 8 MiB split (>= 512 B)
    sim.malloc(2, 11 * MiB + 512 * 1024)  # 8 MiB free + a page: ends at 23.5 MiB
    sim.free(1)
    sim.malloc(3, 11 * MiB + 512 * 1024)  # fits at the base, remainder 0.5 MiB split off (expandable)
    assert sim.allocated_bytes == 23 * MiB
    assert sim.reserved_bytes == 40 * MiB


def test_expandable_prefers_other_blocks_to_the_growing_end() -> None:
    sim = Simulator(cfg("expandable_segments:True"))
    sim.malloc(1, 4 * MiB)
    sim.malloc(2, 10 * MiB)
    sim.malloc(3, 4 * MiB)  # page: [4][10][4][2 free, then unmapped]
    base = sim.address_of(1)
    sim.free(2)
    sim.malloc(4, 3 * MiB // 2)  # best fit by size is the 2 MiB end block, but it counts as "expandable"
    assert sim.address_of(4) == base + 4 * MiB


def test_expandable_empty_cache_unmaps_free_pages() -> None:
    sim = Simulator(cfg("expandable_segments:True"))
    sim.malloc(1, 30 * MiB)  # two pages
    sim.malloc(2, 5 * MiB)  # same range, 5 MiB of the 10 MiB left on page 2
    sim.free(1)  # 30 MiB free at the base: page 1 whole, page 2 partly
    sim.empty_cache()
    assert sim.reserved_bytes == 20 * MiB


def test_layout_at_peak_adds_up() -> None:
    events = [
        Event(Op.ALLOC, 1, 5 * MiB),
        Event(Op.ALLOC, 2, 16 * MiB),  # the 15 MiB remainder is too small: a 16 MiB segment
        Event(Op.FREE, 1),
        Event(Op.ALLOC, 3, 1000),
        Event(Op.FREE, 2),
    ]
    res = simulate(events, cfg(), layout=True)
    assert res.peak_reserved_bytes == 38 * MiB
    assert res.peak_event_index == 3
    assert res.layout_at_peak is not None
    assert sum(s.size_bytes for s in res.layout_at_peak) == 38 * MiB
    assert sorted(s.size_bytes for s in res.layout_at_peak) == [2 * MiB, 16 * MiB, 20 * MiB]
    for seg in res.layout_at_peak:
        assert sum(b.size_bytes for b in seg.blocks) == seg.size_bytes


def test_duplicate_live_key_is_an_error() -> None:
    sim = Simulator(cfg())
    sim.malloc(1, 10)
    with pytest.raises(ValueError):
        sim.malloc(1, 10)


def test_plain_string_ops_are_accepted() -> None:
    events = [Event("alloc", 1, 5 * MiB), Event("free", 1), Event("alloc", 2, 1000)]  # type: ignore[arg-type]
    res = simulate(events, cfg())
    assert res.peak_reserved_bytes == 22 * MiB
    with pytest.raises(ValueError):
        simulate([Event("bogus", 1, 1)], cfg())  # type: ignore[arg-type]


def test_reserved_at_peak_allocated() -> None:
    events = [
        Event(Op.ALLOC, 1, 12 * MiB),  # reserved 12, allocated 12
        Event(Op.ALLOC, 2, 5 * MiB),  # + a 20 MiB segment: reserved 32, allocated 17 (the peak)
        Event(Op.FREE, 1),
        Event(Op.FREE, 2),
        Event(Op.ALLOC, 3, 14 * MiB),  # the 20 MiB segment is whole again: best fit, split, no growth
    ]
    res = simulate(events, cfg())
    assert res.peak_allocated_bytes == 17 * MiB
    assert res.reserved_at_peak_allocated_bytes == 32 * MiB
    assert res.peak_reserved_bytes == 32 * MiB
