"""An event-driven model of PyTorch's CUDA caching allocator (``DeviceCachingAllocator`` in
c10/cuda/CUDACachingAllocator.cpp), to predict *reserved* memory from a sequence of allocations and frees.

Reserved memory is what ``cudaMalloc`` (or, with expandable segments, ``cuMemMap``) has handed the
allocator; allocated memory is the blocks it has handed out. Their difference is fragmentation, and it
depends on the exact order of requests, so we replay the order instead of guessing a ratio. The rules,
each from the source (function names of ``DeviceCachingAllocator`` unless said otherwise):

* **Rounding** (``round_size``): requests round up to 512 B (``kMinBlockSize``); with
  ``roundup_power2_divisions`` a request above 512·d rounds to the next of d equal steps between two powers
  of two (``roundup_power2_next_division``).
* **Pools** (``get_pool``): ≤ 1 MiB (``kSmallSize``) goes to the small pool, anything larger to the large
  pool; each pool is searched per stream (``BlockComparatorSize`` orders by stream, size, address).
* **Segment sizes** (``get_allocation_size``): small requests get a 2 MiB segment (``kSmallBuffer``),
  requests under 10 MiB (``kMinLargeAlloc``) a ``large_segment_size`` one (20 MiB, the former ``kLargeBuffer``;
  ``large_segment_size_mb``), larger ones their size rounded up to 2 MiB (``kRoundLarge``).
* **Best fit** (``get_free_block``): the smallest cached block of the pool and stream that is large enough,
  lowest address on ties. With ``max_split_size``, a request below it never takes a block at or above it,
  and a request at or above it takes a block at most ``max_non_split_rounding`` larger.
* **Splitting** (``should_split``, ``alloc_found_block``): the request takes the low end of the block; the
  rest becomes a free block if it is ≥ 512 B (small pool, or any pool with expandable segments), or
  > 1 MiB for a large-pool request below ``max_split_size``. An unsplit remainder stays part of the
  allocated block and counts in ``allocated``.
* **Merging** (``free_block``, ``try_merge_blocks``): a freed block merges with its free neighbours in the
  same segment; segments never merge.
* **Growth** (``malloc``, ``alloc_block``): a miss allocates a new segment. If it does not fit (the device
  capacity, or a memory fraction checked against ``get_allocation_size``), the allocator frees oversize cached
  blocks (``release_available_cached_blocks``, only with ``max_split_size``), then every unsplit cached segment
  and every free expandable page (``release_cached_blocks``) and retries (``num_alloc_retries``); a second miss
  is an out-of-memory error. ``garbage_collection_threshold`` (``garbage_collect_cached_blocks``) runs before a
  new segment only under a memory fraction (``set_fraction``), and never frees expandable blocks.
* **Expandable segments** (``find_expandable_block``, ``try_allocate_expandable_block``, ``map_block``,
  ``unmap_block``; Note [Expandable Segments]): one virtual range per pool and stream (the small pool too),
  mapped on demand in pages of 2 MiB (small pool) or ``large_segment_size`` (20 MiB, large pool) at the lowest
  unmapped address with room, merged with the free block before it: only the pages that block lacks are mapped
  (``reserved`` counts mapped bytes). While searching, the free block at the mapped end counts as if it had the
  unmapped space behind it, so other blocks are preferred to it. ``round_size`` still applies; any remainder
  ≥ 512 B is split off, so ``max_split_size`` only limits which blocks a request may take
  (``get_free_block``), it no longer keeps large blocks whole. Free pages stay mapped until ``empty_cache`` or
  an out-of-memory retry unmaps the whole ones; a range never shrinks otherwise. Hence a cost with no
  counterpart in fixed segments: a request that misses grows the range from its free tail, right behind
  older blocks, so a block freed in the middle leaves a mapped hole pinned by live neighbours, where the
  default allocator would have given the request a segment of its own and kept the freed one whole for the
  next request of its size (tests/allocator/test_expandable.py; llama-3.1-70b ZeRO-2 over 64 ranks reserves
  161.9 GiB this way against 159.6 by default, docs/allocator.md). Under a capacity the holes' pages are
  unmapped and the run fits in much less (that stream: 153.8 GiB, its allocated peak is 153.7).
* **Release** (``release_cached_blocks``, ``release_blocks``): reserved memory only shrinks on
  ``empty_cache()`` (or an out-of-memory retry): unsplit free segments are ``cudaFree``d, free pages of
  expandable segments unmapped.
* **Cross-stream frees** (``free``, ``insert_events``, ``process_events``): a block used on another stream
  is freed in two steps, ``free_requested`` (``allocated`` drops) and ``free_completed`` (the block returns
  to the pool once the other stream's events have completed); the model takes both as events.

What is not modelled: CUDA graph private pools, IPC, peer access, the free-memory callbacks, and the
allocator's interaction with memory outside it (the capacity is a number we are told). Known differences with
expandable segments: the virtual range is 9/8 of the capacity (the source: of ``totalGlobalMem``), which only
matters once unmapped gaps push the mapped end past it; newer sources' ``release_available_cached_blocks`` skips
expandable blocks and goes on to smaller oversize ones, here it stops at the first (the same outcome unless
fixed segments and expandable ones share a pool: seeded segments, or the setting switched mid-run with
``_set_allocator_settings``, which the model does not do — one setting per run).

Speed: each pool keeps its free blocks in a list sorted by (size, address), searched and updated with
``bisect``; merges follow the blocks' neighbour links, so an event costs O(log n) comparisons plus a list
insertion (a C ``memmove``), never a scan. See ``benchmarks/allocator_speed.py``.
"""

from __future__ import annotations

import gc
import itertools
from bisect import bisect_left, insort
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from trainfit.allocator.config import AllocatorConfig, AllocatorConfigError, Backend

#: Constants of c10/cuda/CUDACachingAllocator.cpp.
MIN_BLOCK_BYTES = 512  # kMinBlockSize
SMALL_SIZE_BYTES = 1 << 20  # kSmallSize: the largest small-pool request
SMALL_BUFFER_BYTES = 2 << 20  # kSmallBuffer: small-pool segment (and expandable page) size
LARGE_BUFFER_BYTES = 20 << 20  # kLargeBuffer: default large_segment_size (AllocatorConfig.large_segment_size_bytes)
MIN_LARGE_ALLOC_BYTES = 10 << 20  # kMinLargeAlloc
ROUND_LARGE_BYTES = 2 << 20  # kRoundLarge

#: Where simulated segments start (any aligned address works: only the order of addresses matters).
_BASE_ADDRESS = 1 << 40
#: Virtual size of an expandable segment when no capacity is given (find_expandable_block reserves
#: 1 1/8 of the GPU's memory; only its being larger than any request matters here).
_DEFAULT_VA_BYTES = 1 << 46


class Op(StrEnum):
    ALLOC = "alloc"
    FREE = "free"  # free_requested and free_completed at once (same-stream free)
    FREE_REQUESTED = "free_requested"
    FREE_COMPLETED = "free_completed"
    EMPTY_CACHE = "empty_cache"


class Event(NamedTuple):
    """One allocator call: ``key`` names the allocation (any int unique among live ones)."""

    op: Op
    key: int = 0
    size_bytes: int = 0
    stream: int = 0


class PoolKind(StrEnum):
    SMALL = "small"
    LARGE = "large"


class BlockState(StrEnum):
    ALLOCATED = "allocated"
    PENDING_FREE = "pending_free"  # free requested, not completed (cross-stream)
    FREE = "free"


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockLayout:
    address: int
    size_bytes: int
    state: BlockState


@dataclass(frozen=True, slots=True, kw_only=True)
class SegmentLayout:
    """One segment (for expandable segments: one contiguous mapped range), blocks by address."""

    address: int
    size_bytes: int
    pool: PoolKind
    stream: int
    expandable: bool
    blocks: tuple[BlockLayout, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class OutOfMemory:
    """The request the allocator could not satisfy, even after freeing its cache."""

    event_index: int
    request_bytes: int
    reserved_bytes: int
    allocated_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocatorResult:
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    #: Reserved bytes when allocated first reached its peak (what an OOM at that moment would see).
    reserved_at_peak_allocated_bytes: int
    reserved_end_bytes: int
    allocated_end_bytes: int
    #: reserved − allocated at the moment reserved peaked, and that over reserved.
    fragmentation_bytes: int
    fragmentation_ratio: float
    #: Index of the event after which reserved first reached its peak (-1: never grew).
    peak_event_index: int
    num_segments_end: int
    num_segments_at_peak: int
    num_device_allocs: int
    num_device_frees: int
    #: Misses that needed ``release_cached_blocks`` (every free segment freed, every free page unmapped, after a
    #: device synchronisation) before the retry (``num_alloc_retries`` of ``torch.cuda.memory_stats``): only
    #: under a capacity; a run that fits only this way pays for it in every step that repeats it.
    num_alloc_retries: int = 0
    oom: OutOfMemory | None = None
    layout_at_peak: tuple[SegmentLayout, ...] | None = None
    #: The run stopped when its reserved bytes first passed ``Simulator(stop_above_bytes=...)``: every peak here is
    #: the one at that moment (a lower bound of the whole run's), ``peak_reserved_bytes`` above that limit.
    stopped: bool = False


class _Segment:
    __slots__ = ("address", "expandable", "page_bytes", "pool", "small", "stream")

    def __init__(
        self,
        address: int,
        small: bool,
        stream: int,
        expandable: bool,
        large_page: int = LARGE_BUFFER_BYTES,
        pool: _Pool | None = None,
    ) -> None:
        self.address = address
        self.pool = pool  # the pool its free blocks go to (free_completed: no (small, stream) lookup per free)
        self.small = small
        self.stream = stream
        self.expandable = expandable
        self.page_bytes = SMALL_BUFFER_BYTES if small else large_page


class _Block:
    __slots__ = ("addr", "gc_base", "in_use", "mapped", "next", "pending", "prev", "req", "seg", "size")

    def __init__(self, addr: int, size: int, seg: _Segment, mapped: bool = True) -> None:
        self.addr = addr
        self.size = size
        self.req = 0  # in use: the request's bytes rounded to 512 (what the closed form counts), for requested_bytes
        self.seg = seg
        self.mapped = mapped
        self.in_use = False  # handed out (allocated, or freed but not completed)
        self.pending = False  # free requested, not completed
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.gc_base = 0


class _Pool:
    __slots__ = ("free", "small", "stream", "unmapped")

    def __init__(self, small: bool, stream: int) -> None:
        self.small = small
        self.stream = stream
        self.free: list[tuple[int, int, _Block]] = []  # (size, address, block), sorted
        self.unmapped: list[tuple[int, _Block]] = []  # (address, block), sorted


class AllocatorOutOfMemory(Exception):
    """Internal: raised by ``malloc`` and turned into :class:`OutOfMemory` by :func:`simulate`."""


class _PassedLimit(Exception):
    """Internal: raised by ``malloc`` when reserved passes ``stop_above_bytes``; :meth:`Simulator.drive` stops."""


def round_size(size_bytes: int, config: AllocatorConfig) -> int:
    """``round_size``: 512 B granularity, or ``roundup_power2_divisions`` steps."""
    if size_bytes < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    d = config.divisions_for(size_bytes)
    if d > 1 and size_bytes > MIN_BLOCK_BYTES * d:
        # roundup_power2_next_division
        if size_bytes & (size_bytes - 1) == 0:
            return size_bytes
        floor = 1 << (size_bytes.bit_length() - 1)
        step = floor >> (d.bit_length() - 1)
        if step == 0:
            return floor << 1
        low = size_bytes & ~(step - 1)
        return size_bytes if low == size_bytes else low + step
    return -(-size_bytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES


def allocation_size(size_bytes: int, large_segment_bytes: int = LARGE_BUFFER_BYTES) -> int:
    """``get_allocation_size``: the segment ``cudaMalloc``ed for a (rounded) request that missed the cache
    (``large_segment_bytes``: ``large_segment_size``, 20 MiB unless ``large_segment_size_mb`` says otherwise)."""
    if size_bytes <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size_bytes < MIN_LARGE_ALLOC_BYTES:
        return large_segment_bytes
    return -(-size_bytes // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


class Simulator:
    """The allocator's state. Drive it with :meth:`malloc` / :meth:`free` / ... or :func:`simulate`.

    ``capacity_bytes``: the device memory the allocator can get (the GPU minus what lives outside it):
    ``cudaMalloc`` of a segment, or ``cuMemCreate`` of the pages an expandable segment maps, fails beyond it;
    ``None`` means unlimited (no out-of-memory retries). ``memory_fraction_bytes``: the limit of
    ``torch.cuda.set_per_process_memory_fraction`` (``allowed_memory_maximum``): ``alloc_block`` refuses a new
    segment whose ``get_allocation_size`` would pass it — with expandable segments too, before any page is
    mapped — and only with it does ``garbage_collection_threshold`` act (``set_fraction`` in ``malloc``).
    ``segment_address``: optional hook giving the address of a new ``cudaMalloc`` segment of a given size
    (a replay uses the real addresses so that ties in best fit break as they did); ``None`` falls back.
    ``stop_above_bytes``: for a caller that only asks whether the reserved peak passes this many bytes — a
    run stops the moment it does (``AllocatorResult.stopped``); not a device limit.
    """

    def __init__(
        self,
        config: AllocatorConfig | None = None,
        *,
        capacity_bytes: int | None = None,
        memory_fraction_bytes: int | None = None,
        segment_address: Callable[[int], int | None] | None = None,
        stop_above_bytes: int | None = None,
    ) -> None:
        self.config = config or AllocatorConfig()
        if self.config.backend is not Backend.NATIVE:
            raise AllocatorConfigError("only the native caching allocator is modelled (not cudaMallocAsync)")
        self.capacity_bytes = capacity_bytes
        self.memory_fraction_bytes = memory_fraction_bytes
        self._large_page = self.config.large_segment_size_bytes
        self._segment_address = segment_address
        self._max_split = self.config.max_split_bytes
        self._expandable = self.config.expandable_segments
        self._gc = self.config.garbage_collection_threshold > 0.0 and memory_fraction_bytes is not None
        self._plain_rounding = not any(d > 1 for d in self.config.roundup_power2_divisions)
        #: No expandable segment in any pool and no garbage collection: :meth:`malloc`'s best fit is the first
        #: free block of the request's size or more (``_get_free_block``'s other branches never apply)
        self._plain_pools = not self._expandable and not self._gc
        self._max_non_split = self.config.max_non_split_rounding_bytes
        self._pools: dict[tuple[bool, int], _Pool] = {}
        self._gc_calls = {True: 0, False: 0}
        self._live: dict[int, _Block] = {}
        self._next_address = _BASE_ADDRESS
        self.reserved_bytes = 0
        self.allocated_bytes = 0
        #: The live requests, each rounded up to 512 B (``kMinBlockSize``; what the closed form counts per tensor):
        #: ``allocated_bytes`` less what the blocks hold beyond them (an unsplit remainder, power-of-two rounding).
        self.requested_bytes = 0
        #: The largest ``allocated_bytes`` and ``requested_bytes`` since :meth:`start_window` (a phase of a step).
        self.window_allocated_bytes = 0
        self.window_requested_bytes = 0
        self.peak_reserved_bytes = 0
        self.peak_allocated_bytes = 0
        self.reserved_at_peak_allocated_bytes = 0
        self.fragmentation_at_peak_bytes = 0
        self.num_segments = 0  # cudaMalloc segments + expandable segments
        self.num_segments_at_peak = 0
        self.num_device_allocs = 0
        self.num_device_frees = 0
        self.num_alloc_retries = 0
        self.peak_event_index = -1
        self.event_index = -1
        self.stop_above_bytes = stop_above_bytes
        self.stopped = False

    # ---------------------------------------------------------------- pools and free lists
    def _pool(self, small: bool, stream: int) -> _Pool:
        pool = self._pools.get((small, stream))
        if pool is None:
            pool = self._pools[(small, stream)] = _Pool(small, stream)
        return pool

    def _insert_free(self, pool: _Pool, b: _Block) -> None:
        b.gc_base = self._gc_calls[pool.small]
        insort(pool.free, (b.size, b.addr, b))

    @staticmethod
    def _remove_free(pool: _Pool, b: _Block) -> None:
        i = bisect_left(pool.free, (b.size, b.addr))
        del pool.free[i]

    @staticmethod
    def _remove_unmapped(pool: _Pool, b: _Block) -> None:
        i = bisect_left(pool.unmapped, (b.addr,))
        del pool.unmapped[i]

    def _new_address(self, size: int) -> int:
        if self._segment_address is not None:
            addr = self._segment_address(size)
            if addr is not None:
                return addr
        addr = self._next_address
        self._next_address += -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES + ROUND_LARGE_BYTES
        return addr

    # ---------------------------------------------------------------- public operations
    def malloc(self, key: int, size_bytes: int, stream: int = 0) -> int:
        """Allocate ``size_bytes`` for ``key`` on ``stream``; returns the block's address."""
        live = self._live
        if key in live:
            raise ValueError(f"allocation key {key} is already live")
        req = MIN_BLOCK_BYTES if size_bytes < MIN_BLOCK_BYTES else -(-size_bytes // 512) * 512
        size = req if self._plain_rounding else round_size(size_bytes, self.config)
        small = size <= SMALL_SIZE_BYTES
        pool = self._pools.get((small, stream)) or self._pool(small, stream)
        if self._plain_pools:
            # _get_free_block without expandable segments or garbage collection, inlined (the planner's hot path)
            free = pool.free
            i = bisect_left(free, (size, -1))
            block = None
            if i < len(free):
                b = free[i][2]
                max_split = self._max_split
                if size < max_split:
                    if b.size < max_split:
                        del free[i]
                        block = b
                elif b.size < size + self._max_non_split:
                    del free[i]
                    block = b
        else:
            block = self._get_free_block(pool, size)
        if block is None:
            block = self._grow(pool, size)
        remaining = block.size - size
        if (
            (remaining >= MIN_BLOCK_BYTES)
            if (small or self._expandable)
            else (size < self._max_split and remaining > SMALL_SIZE_BYTES)
        ):
            rest = _Block(block.addr + size, remaining, block.seg)
            rest.prev = block
            nxt = block.next
            rest.next = nxt
            if nxt is not None:
                nxt.prev = rest
            block.next = rest
            block.size = size
            if self._gc:
                rest.gc_base = self._gc_calls[small]
            insort(pool.free, (remaining, rest.addr, rest))
        block.in_use = True
        block.req = req
        live[key] = block
        allocated = self.allocated_bytes = self.allocated_bytes + block.size
        requested = self.requested_bytes = self.requested_bytes + req
        if requested > self.window_requested_bytes:
            self.window_requested_bytes = requested
        if allocated > self.window_allocated_bytes:
            self.window_allocated_bytes = allocated
        if allocated > self.peak_allocated_bytes:
            self.peak_allocated_bytes = allocated
            self.reserved_at_peak_allocated_bytes = self.reserved_bytes
        if self.reserved_bytes > self.peak_reserved_bytes:
            self.peak_reserved_bytes = self.reserved_bytes
            self.fragmentation_at_peak_bytes = self.reserved_bytes - allocated
            self.num_segments_at_peak = self.num_segments
            self.peak_event_index = self.event_index
            if self.stop_above_bytes is not None and self.reserved_bytes > self.stop_above_bytes:
                raise _PassedLimit
        return block.addr

    def free_requested(self, key: int) -> None:
        """``free`` of a block with uses on other streams: ``allocated`` drops, the block stays unavailable."""
        b = self._live[key]
        if not b.pending:
            b.pending = True
            self.allocated_bytes -= b.size
            self.requested_bytes -= b.req

    def free_completed(self, key: int) -> None:
        """The block's other-stream uses have completed: it returns to its pool (``free_block``)."""
        b = self._live.pop(key)
        if b.pending:
            b.pending = False
        else:
            self.allocated_bytes -= b.size
            self.requested_bytes -= b.req
        b.in_use = False
        seg = b.seg
        pool = seg.pool
        assert pool is not None
        free = pool.free
        prev = b.prev
        nxt = b.next
        if prev is not None and not prev.in_use:
            if prev.mapped and b.mapped:  # _merge of a mapped neighbour before, inlined
                del free[bisect_left(free, (prev.size, prev.addr))]
                b.addr = prev.addr
                before = b.prev = prev.prev
                if before is not None:
                    before.next = b
                b.size += prev.size
            else:
                self._merge(pool, b, prev)
        if nxt is not None and not nxt.in_use:
            if nxt.mapped and b.mapped:  # and after
                del free[bisect_left(free, (nxt.size, nxt.addr))]
                after = b.next = nxt.next
                if after is not None:
                    after.prev = b
                b.size += nxt.size
            else:
                self._merge(pool, b, nxt)
        if self._gc:
            b.gc_base = self._gc_calls[seg.small]
        insort(free, (b.size, b.addr, b))

    def free(self, key: int) -> None:
        """A same-stream free: requested and completed at once."""
        self.free_completed(key)

    def empty_cache(self) -> None:
        """``emptyCache`` → ``release_cached_blocks``: free unsplit segments, unmap free expandable pages."""
        for pool in list(self._pools.values()):
            to_unmap: list[_Block] = []
            for _, _, b in list(pool.free):
                if b.seg.expandable:
                    to_unmap.append(b)
                elif b.prev is None and b.next is None:
                    self._release_segment(pool, b)
            for b in to_unmap:
                self._unmap_block(pool, b)
                if b.prev is None and b.next is None and not b.mapped:
                    self._remove_unmapped(pool, b)
                    self.num_segments -= 1

    # ---------------------------------------------------------------- search
    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        if self._gc:
            self._gc_calls[pool.small] += 1
        free = pool.free
        i = bisect_left(free, (size, -1))
        n = len(free)
        if i == n:
            return None
        b = free[i][2]
        if b.seg.expandable:
            if self._expandable:

                def reach(x: _Block) -> int:
                    nxt = x.next
                    return x.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

                while b.seg.expandable and i + 1 < n and reach(free[i + 1][2]) < reach(b):
                    i += 1
                    b = free[i][2]
            else:
                i += 1
                while i < n and free[i][2].seg.expandable:
                    i += 1
                if i == n:
                    return None
                b = free[i][2]
        max_split = self._max_split
        if size < max_split and b.size >= max_split:
            return None
        if size >= max_split and b.size >= size + self.config.max_non_split_rounding_bytes:
            return None
        del free[i]
        return b

    # ---------------------------------------------------------------- growth
    def _grow(self, pool: _Pool, size: int) -> _Block:
        if self._gc:
            self._garbage_collect()
        alloc = allocation_size(size, self._large_page)
        block = self._alloc_block(pool, size, alloc)
        if block is None and self._release_available(pool, size):
            block = self._alloc_block(pool, size, alloc)
        if block is None:
            self.empty_cache()
            self.num_alloc_retries += 1  # alloc_block(..., isRetry=true)
            block = self._alloc_block(pool, size, alloc)
        if block is None:
            raise AllocatorOutOfMemory(size)
        return block

    def _fits(self, nbytes: int) -> bool:
        """Whether the device can back ``nbytes`` more (``cudaMalloc`` / ``cuMemCreate`` succeed)."""
        return self.capacity_bytes is None or self.reserved_bytes + nbytes <= self.capacity_bytes

    def _alloc_block(self, pool: _Pool, size: int, alloc: int) -> _Block | None:
        """``alloc_block``: the memory fraction is checked against the whole ``get_allocation_size`` first; then
        an expandable segment maps the pages it lacks (each map checks the device), or ``cudaMalloc`` the segment."""
        fraction = self.memory_fraction_bytes
        if fraction is not None and self.reserved_bytes + alloc > fraction:
            return None
        if self._expandable:
            return self._alloc_expandable(pool, size)
        if not self._fits(alloc):
            return None
        seg = _Segment(self._new_address(alloc), pool.small, pool.stream, expandable=False, pool=pool)
        self.reserved_bytes += alloc
        self.num_segments += 1
        self.num_device_allocs += 1
        return _Block(seg.address, alloc, seg)

    def _release_segment(self, pool: _Pool, b: _Block) -> None:
        self._remove_free(pool, b)
        self.reserved_bytes -= b.size
        self.num_segments -= 1
        self.num_device_frees += 1

    def _release_available(self, pool: _Pool, size: int) -> bool:
        """``release_available_cached_blocks``: free oversize cached blocks, only with ``max_split_size``."""
        if self.config.max_split_size_bytes is None:
            return False
        key = max(size, self._max_split)
        free = pool.free
        i = bisect_left(free, (key, -1))
        if i < len(free):
            b = free[i][2]
            if b.prev is None and b.next is None and not b.seg.expandable:
                self._release_segment(pool, b)
                return True
            return False
        released = 0
        i -= 1
        while i >= 0 and released < key:
            b = free[i][2]
            if b.size < self._max_split or b.prev is not None or b.next is not None or b.seg.expandable:
                break
            released += b.size
            self._release_segment(pool, b)
            i -= 1
        return released >= key

    def _garbage_collect(self) -> None:
        """``garbage_collect_cached_blocks``: free unsplit large cached blocks older than the average."""
        assert self.memory_fraction_bytes is not None
        threshold = int(self.config.garbage_collection_threshold * self.memory_fraction_bytes)
        if self.reserved_bytes <= threshold:
            return
        target = self.reserved_bytes - threshold
        calls = self._gc_calls[False]
        pools = [p for p in self._pools.values() if not p.small]

        def freeable() -> list[tuple[_Pool, _Block]]:
            return [
                (p, b)
                for p in pools
                for _, _, b in p.free
                if b.prev is None and b.next is None and not b.seg.expandable
            ]

        cands = freeable()
        if not cands:
            return
        total_age = sum(calls - b.gc_base for _, b in cands)
        count = len(cands)
        reclaimed = 0
        freed_one = True
        while reclaimed < target and freed_one and count > 0:
            threshold_age = total_age / count
            freed_one = False
            for p, b in freeable():
                age = calls - b.gc_base
                if age >= threshold_age:
                    freed_one = True
                    reclaimed += b.size
                    total_age -= age
                    count -= 1
                    self._release_segment(p, b)

    # ---------------------------------------------------------------- expandable segments
    def _alloc_expandable(self, pool: _Pool, size: int) -> _Block | None:
        """``try_allocate_expandable_block``."""
        c = self._find_expandable(pool, size)
        if not c.mapped and not self._map_block(pool, c, min(c.size, size)):
            return None
        while c.size < size:
            nxt = c.next
            if nxt is None:  # a request past the whole virtual range (9/8 of the device): out of memory
                return None
            assert not nxt.mapped
            if not self._map_block(pool, nxt, min(size - c.size, nxt.size)):
                return None
            c = nxt
        self._remove_free(pool, c)
        return c

    def _find_expandable(self, pool: _Pool, size: int) -> _Block:
        """``find_expandable_block``: the lowest unmapped range (with the free block before it) with room."""
        for _, u in pool.unmapped:
            c = u
            if c.prev is not None and not c.prev.in_use:
                c = c.prev
            room = 0
            x: _Block | None = c
            while room < size and x is not None and not x.in_use:
                room += x.size
                x = x.next
            if room >= size:
                return c
        page = SMALL_BUFFER_BYTES if pool.small else self._large_page
        # No device limit: a range as large as the request when the default 64 TiB is not (no real range is that
        # large, but an unlimited simulation answers for any request).
        va = (
            max(_DEFAULT_VA_BYTES, size)
            if self.capacity_bytes is None
            else self.capacity_bytes + self.capacity_bytes // 8
        )
        va = -(-va // page) * page
        seg = _Segment(self._new_address(va), pool.small, pool.stream, True, self._large_page, pool)
        self._plain_pools = False
        u = _Block(seg.address, va, seg, mapped=False)
        insort(pool.unmapped, (u.addr, u))
        self.num_segments += 1
        return u

    def _map_block(self, pool: _Pool, b: _Block, size: int) -> bool:
        """``map_block``: back the start of unmapped block ``b`` with whole pages covering ``size``."""
        page = b.seg.page_bytes
        mapped = min(-(-size // page) * page, b.size)
        if not self._fits(mapped):
            return False
        self._remove_unmapped(pool, b)
        b.mapped = True
        if mapped < b.size:
            rest = _Block(b.addr + mapped, b.size - mapped, b.seg, mapped=False)
            rest.prev = b
            rest.next = b.next
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = mapped
            insort(pool.unmapped, (rest.addr, rest))
        self._merge(pool, b, b.prev)
        self._merge(pool, b, b.next)
        self._insert_free(pool, b)
        self.reserved_bytes += mapped
        self.num_device_allocs += 1
        return True

    def _unmap_block(self, pool: _Pool, b: _Block) -> None:
        """``unmap_block``: give back the whole pages inside free block ``b``."""
        page = b.seg.page_bytes
        off = b.addr - b.seg.address
        begin = -(-off // page) * page
        end = (off + b.size) // page * page
        if begin >= end:
            return
        self._remove_free(pool, b)
        before = begin - off
        after = off + b.size - end
        if before > 0:
            bf = _Block(b.addr, before, b.seg)
            bf.prev = b.prev
            if b.prev is not None:
                b.prev.next = bf
            bf.next = b
            b.prev = bf
            self._insert_free(pool, bf)
        if after > 0:
            af = _Block(b.seg.address + end, after, b.seg)
            af.next = b.next
            if b.next is not None:
                b.next.prev = af
            af.prev = b
            b.next = af
            self._insert_free(pool, af)
        b.addr = b.seg.address + begin
        b.size = end - begin
        b.mapped = False
        self._merge(pool, b, b.prev)
        self._merge(pool, b, b.next)
        insort(pool.unmapped, (b.addr, b))
        self.reserved_bytes -= end - begin
        self.num_device_frees += 1

    # ---------------------------------------------------------------- merging
    def _merge(self, pool: _Pool, dst: _Block, src: _Block | None) -> None:
        """``try_merge_blocks``: absorb free neighbour ``src`` (same mapping state) into ``dst``."""
        if src is None or src.in_use or src.mapped != dst.mapped:
            return
        if src.mapped:
            self._remove_free(pool, src)
        else:
            self._remove_unmapped(pool, src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if src.prev is not None:
                src.prev.next = dst
        else:
            dst.next = src.next
            if src.next is not None:
                src.next.prev = dst
        dst.size += src.size

    # ---------------------------------------------------------------- seeding and inspection
    def seed_segment(
        self,
        *,
        address: int,
        size_bytes: int,
        small: bool,
        stream: int = 0,
        live: Iterable[tuple[int, int, int]] = (),
        expandable: bool = False,
        virtual_bytes: int | None = None,
    ) -> None:
        """Add an existing segment (for replays that start mid-run).

        ``live``: (key, address, size) of the blocks allocated in it; the gaps become free blocks. For an
        expandable segment ``size_bytes`` is the mapped part, from ``address``; ``virtual_bytes`` the range.
        """
        pool = self._pool(small, stream)
        seg = _Segment(address, small, stream, expandable, self._large_page, pool)
        if expandable:
            self._plain_pools = False
        blocks: list[_Block] = []
        cursor = address
        end = address + size_bytes
        for key, addr, size in sorted(live, key=lambda t: t[1]):
            if addr < cursor or addr + size > end:
                raise ValueError(f"block at {addr:#x} does not fit segment {address:#x}")
            if addr > cursor:
                blocks.append(_Block(cursor, addr - cursor, seg))
            b = _Block(addr, size, seg)
            b.in_use = True
            b.req = size  # a seeded block's request is not known: its size
            self._live[key] = b
            self.allocated_bytes += size
            self.requested_bytes += size
            blocks.append(b)
            cursor = addr + size
        if cursor < end:
            blocks.append(_Block(cursor, end - cursor, seg))
        if expandable:
            va = virtual_bytes or _DEFAULT_VA_BYTES
            if va > size_bytes:
                blocks.append(_Block(end, va - size_bytes, seg, mapped=False))
        for prev, nxt in itertools.pairwise(blocks):
            prev.next = nxt
            nxt.prev = prev
        for b in blocks:
            if not b.in_use:
                if b.mapped:
                    self._insert_free(pool, b)
                else:
                    insort(pool.unmapped, (b.addr, b))
        self.reserved_bytes += size_bytes
        self.num_segments += 1
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes
            self.reserved_at_peak_allocated_bytes = self.reserved_bytes
        self.num_segments_at_peak = self.num_segments
        self.fragmentation_at_peak_bytes = self.reserved_bytes - self.allocated_bytes

    def state_key(self) -> tuple[object, ...] | None:
        """Everything the allocator's next decisions depend on, but the allocation keys: every block (live, free,
        unmapped) with its segment, the address the next segment gets and the counters; equal keys, fed the same
        calls (keys renamed alike), make the same decisions and reach the same state. None where the garbage
        collector's call counters also decide (``garbage_collection_threshold``), which this does not compare, or where
        segment addresses come from outside (``segment_address``)."""
        if self._gc or self._segment_address is not None:
            return None
        blocks = list(self._live.values())
        for pool in self._pools.values():
            blocks += [b for _, _, b in pool.free]
            blocks += [b for _, b in pool.unmapped]
        return (
            self.reserved_bytes,
            self.allocated_bytes,
            self.num_segments,
            self._next_address,
            tuple(
                sorted(
                    (b.addr, b.size, b.in_use, b.pending, b.mapped, b.seg.address, b.seg.small, b.seg.stream)
                    for b in blocks
                )
            ),
        )

    def ordered_state_key(self) -> tuple[object, ...] | None:
        """:meth:`state_key` and where each live block is, in the order its key was given (keys count up as
        allocations are made): equal keys, fed calls that free the same-ranked keys and allocate alike, make the
        same decisions — the state of a repeating schedule whose live blocks change owner (a pipeline's in-flight
        micro-batches). None where :meth:`state_key` is."""
        key = self.state_key()
        if key is None:
            return None
        live = self._live
        return (*key, tuple(live[k].addr for k in sorted(live)))

    def repeats_after(self, before: tuple[object, ...] | None, now: tuple[object, ...] | None) -> bool:
        """Whether a repeated sequence of calls (a training step, keys renamed alike) that took this allocator from
        :meth:`state_key` ``before`` to ``now`` would, run again from ``now``, repeat itself exactly: no call
        would raise a peak and it would end in ``now``, so a caller that only needs the peaks can stop here.

        True when the keys are equal (the same calls from the same state make the same decisions). Also when
        ``now`` is ``before`` plus small-pool segments, each one whole free block, that the calls had to create
        (``malloc`` → ``alloc_block``, addresses above every earlier block's): run again, each call that found a
        block before finds the same one — a small block is at most one such segment's 2 MiB, and on a tie best
        fit takes the lower address, the block it found before — and each that created a segment finds that
        segment free instead (the lowest of those left, the address it was given); so every block is the same at
        every call, allocated is the same, and reserved (never lower without ``empty_cache``: no capacity, no memory
        fraction, so no flush) stays at ``now``'s, the peak already reached.
        Not for the large pool, whose cached segments of other sizes could win a best fit."""
        if before is None or now is None:
            return False
        if before == now:
            return True
        if (
            not self._plain_pools
            or self.capacity_bytes is not None
            or self.memory_fraction_bytes is not None
            or self._max_split <= SMALL_BUFFER_BYTES
        ):
            return False
        r0, a0, n0, next0, blocks0 = before
        r1, a1, n1, _, blocks1 = now
        assert isinstance(blocks0, tuple) and isinstance(blocks1, tuple)
        assert isinstance(r0, int) and isinstance(r1, int) and isinstance(n0, int) and isinstance(n1, int)
        assert isinstance(next0, int)
        added = blocks1[len(blocks0) :]
        if a0 != a1 or not added or blocks1[: len(blocks0)] != blocks0:
            return False
        if n1 - n0 != len(added) or r1 - r0 != len(added) * SMALL_BUFFER_BYTES:
            return False
        # (addr, size, in_use, pending, mapped, segment address, small, stream): whole, free, new small segments
        return all(
            b[0] >= next0 and b[1] == SMALL_BUFFER_BYTES and not b[2] and not b[3] and b[4] and b[5] == b[0] and b[6]
            for b in added
        )

    def address_of(self, key: int) -> int:
        return self._live[key].addr

    def live_keys(self) -> list[int]:
        """The keys of the blocks allocated now (freed or not yet completed included)."""
        return list(self._live)

    def start_window(self) -> None:
        """Start :attr:`window_allocated_bytes` and :attr:`window_requested_bytes` again from the current figures
        (the peaks of a phase: what ``max_memory_allocated`` counts above the requests in it, blocks less requests)."""
        self.window_allocated_bytes = self.allocated_bytes
        self.window_requested_bytes = self.requested_bytes

    def reset_peak_stats(self) -> None:
        """``torch.cuda.reset_peak_memory_stats()``: the peaks start again from the current figures."""
        self.peak_reserved_bytes = self.reserved_bytes
        self.peak_allocated_bytes = self.allocated_bytes
        self.reserved_at_peak_allocated_bytes = self.reserved_bytes
        self.fragmentation_at_peak_bytes = self.reserved_bytes - self.allocated_bytes
        self.num_segments_at_peak = self.num_segments
        self.peak_event_index = self.event_index

    def layout(self) -> tuple[SegmentLayout, ...]:
        """Every segment (expandable: every mapped run) with its blocks, by address."""
        blocks: dict[int, _Block] = {}
        for b in self._live.values():
            blocks[id(b)] = b
        for pool in self._pools.values():
            for _, _, b in pool.free:
                blocks[id(b)] = b
        heads = {id(b): b for b in blocks.values() if b.prev is None or not b.prev.mapped}
        out: list[SegmentLayout] = []
        for head in heads.values():
            items: list[BlockLayout] = []
            x: _Block | None = head
            while x is not None and x.mapped:
                state = (
                    BlockState.FREE
                    if not x.in_use
                    else (BlockState.PENDING_FREE if x.pending else BlockState.ALLOCATED)
                )
                items.append(BlockLayout(address=x.addr, size_bytes=x.size, state=state))
                x = x.next
            out.append(
                SegmentLayout(
                    address=head.addr,
                    size_bytes=sum(i.size_bytes for i in items),
                    pool=PoolKind.SMALL if head.seg.small else PoolKind.LARGE,
                    stream=head.seg.stream,
                    expandable=head.seg.expandable,
                    blocks=tuple(items),
                )
            )
        return tuple(sorted(out, key=lambda s: s.address))

    def result(self, *, oom: OutOfMemory | None = None) -> AllocatorResult:
        peak = self.peak_reserved_bytes
        return AllocatorResult(
            peak_reserved_bytes=peak,
            peak_allocated_bytes=self.peak_allocated_bytes,
            reserved_at_peak_allocated_bytes=self.reserved_at_peak_allocated_bytes,
            reserved_end_bytes=self.reserved_bytes,
            allocated_end_bytes=self.allocated_bytes,
            fragmentation_bytes=self.fragmentation_at_peak_bytes,
            fragmentation_ratio=self.fragmentation_at_peak_bytes / peak if peak else 0.0,
            peak_event_index=self.peak_event_index,
            num_segments_end=self.num_segments,
            num_segments_at_peak=self.num_segments_at_peak,
            num_device_allocs=self.num_device_allocs,
            num_device_frees=self.num_device_frees,
            num_alloc_retries=self.num_alloc_retries,
            oom=oom,
            stopped=self.stopped,
        )

    # ---------------------------------------------------------------- driving
    def run(self, events: Iterable[Event], *, stop_after: int | None = None) -> OutOfMemory | None:
        """Apply ``events`` in order (up to index ``stop_after`` included); returns the OOM if one happened."""
        # blocks link to each other (prev/next): keep the cyclic collector from rescanning them every few
        # thousand allocations (a third of the run time); nothing here leaves garbage cycles behind
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run(events, stop_after)
        except _PassedLimit:
            self.stopped = True
            return None
        finally:
            if was_enabled:
                gc.enable()

    def drive(self, calls: Callable[[Simulator], object]) -> OutOfMemory | None:
        """Let ``calls`` drive this simulator (``malloc``/``free_*``, e.g. a stream synthesised straight into it);
        returns the out-of-memory error that ended it under a capacity (None: it ran through)."""
        was_enabled = gc.isenabled()
        gc.disable()  # as run()
        try:
            calls(self)
        except _PassedLimit:
            self.stopped = True
        except AllocatorOutOfMemory as exc:
            return OutOfMemory(
                event_index=self.event_index,
                request_bytes=int(exc.args[0]) if exc.args else 0,
                reserved_bytes=self.reserved_bytes,
                allocated_bytes=self.allocated_bytes,
            )
        finally:
            if was_enabled:
                gc.enable()
        return None

    def apply(self, op: Op, key: int = 0, size_bytes: int = 0, stream: int = 0) -> None:
        """One allocator call, an :class:`Event`'s fields (raises ``AllocatorOutOfMemory`` where an ALLOC fails)."""
        if op is Op.ALLOC:
            self.malloc(key, size_bytes, stream)
        elif op is Op.FREE or op is Op.FREE_COMPLETED:
            self.free_completed(key)
        elif op is Op.FREE_REQUESTED:
            self.free_requested(key)
        else:
            self.empty_cache()

    def _run(self, events: Iterable[Event], stop_after: int | None) -> OutOfMemory | None:
        # apply()'s dispatch, inlined: a method call per event made this loop 15% slower
        # (benchmarks/allocator_speed.py: 0.75 vs 0.88 M events/s)
        alloc, free, req, done = Op.ALLOC, Op.FREE, Op.FREE_REQUESTED, Op.FREE_COMPLETED
        malloc, free_completed, free_requested = self.malloc, self.free_completed, self.free_requested
        i = self.event_index
        for ev in events:
            i += 1
            self.event_index = i
            op = ev[0]
            if type(op) is not Op:
                op = Op(op)  # a plain string; raises on an unknown one
            if op is alloc:
                try:
                    malloc(ev[1], ev[2], ev[3])
                except AllocatorOutOfMemory:
                    return OutOfMemory(
                        event_index=i,
                        request_bytes=ev[2],
                        reserved_bytes=self.reserved_bytes,
                        allocated_bytes=self.allocated_bytes,
                    )
            elif op is free or op is done:
                free_completed(ev[1])
            elif op is req:
                free_requested(ev[1])
            else:
                self.empty_cache()
            if stop_after is not None and i >= stop_after:
                break
        return None


def simulate(
    events: Iterable[Event] | Callable[[], Iterable[Event]],
    config: AllocatorConfig | None = None,
    *,
    capacity_bytes: int | None = None,
    memory_fraction_bytes: int | None = None,
    layout: bool = False,
    setup: Callable[[Simulator], None] | None = None,
) -> AllocatorResult:
    """Replay ``events`` through a fresh allocator and report reserved/allocated peaks and fragmentation.

    ``layout=True`` adds the segment layout at the reserved peak: the events are replayed a second time up
    to the peak (pass ``events`` as a list, or as a function returning a fresh iterable). ``setup`` seeds the
    simulator (e.g. with the segments that existed before the events started). ``capacity_bytes`` and
    ``memory_fraction_bytes``: as :class:`Simulator`'s.
    """

    def fresh() -> Simulator:
        sim = Simulator(config, capacity_bytes=capacity_bytes, memory_fraction_bytes=memory_fraction_bytes)
        if setup is not None:
            setup(sim)
        return sim

    def stream_of() -> Iterable[Event]:
        return events() if callable(events) else events

    sim = fresh()
    oom = sim.run(stream_of())
    res = sim.result(oom=oom)
    if not layout:
        return res
    again = fresh()
    if res.peak_event_index >= 0:
        again.run(stream_of(), stop_after=res.peak_event_index)
    from dataclasses import replace

    return replace(res, layout_at_peak=again.layout())


def least_capacity(
    stream: Sequence[Event] | Callable[[Simulator], object],
    config: AllocatorConfig | None = None,
    *,
    resolution_bytes: int = 1 << 20,
) -> tuple[int, AllocatorResult]:
    """The smallest device capacity (a multiple of ``resolution_bytes``) at which ``stream`` runs without an
    out-of-memory error, and the run at it (its ``num_alloc_retries``: the cache flushes that fitting takes).

    Without a capacity the reserve is the uncapped peak, what ``max_memory_reserved`` shows with room to spare;
    near the limit ``malloc`` frees the cache and retries (``release_cached_blocks``), so a run can fit in less:
    with expandable segments much less, their free pages being unmapped one by one. ``stream``: the events, or a
    function that drives a given :class:`Simulator` (``malloc``/``free_*`` calls; an out-of-memory error ends it).
    Bisection between the allocated and the uncapped reserved peaks: it takes fitting to be monotonic in the
    capacity, which the rules only approximately are (an earlier flush changes later placements).
    """

    def run(capacity: int | None) -> AllocatorResult:
        sim = Simulator(config, capacity_bytes=capacity)
        return sim.result(oom=sim.drive(stream) if callable(stream) else sim.run(stream))

    free = run(None)
    step = resolution_bytes
    lo = -(-free.peak_allocated_bytes // step)
    hi = -(-free.peak_reserved_bytes // step)
    best = run(hi * step)
    if best.oom is not None:  # the capped virtual range (9/8 of the capacity) can be what fails
        return free.peak_reserved_bytes, free
    while lo < hi:
        mid = (lo + hi) // 2
        res = run(mid * step)
        if res.oom is None:
            hi, best = mid, res
        else:
            lo = mid + 1
    return hi * step, best
