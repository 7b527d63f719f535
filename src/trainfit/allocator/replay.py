"""Replay a real ``torch.cuda.memory._snapshot()`` through the simulator and compare reserved bytes.

A snapshot (``snapshot()`` in c10/cuda/CUDACachingAllocator.cpp, exported by torch/cuda/memory.py) holds
the segments *at the moment it was taken* and, in ``device_traces[d]``, the recorded events: ``alloc``,
``free_requested``, ``free_completed`` (sizes are the *requested* bytes), ``segment_alloc`` /
``segment_free`` (``cudaMalloc``/``cudaFree``), ``segment_map`` / ``segment_unmap`` (expandable segments),
``empty_cache``, ``oom``, ``snapshot``.

Recording may start after some memory exists (here: the model, its optimizer states and the cuBLAS
workspace of the main thread). We rebuild the state at the first event by walking back from the end:

* segments at the start = the final segments minus those ``segment_alloc``ed during the trace (plus any
  ``segment_free``d one that was not allocated in it); for expandable segments, the mapped bytes minus the
  bytes ``segment_map``ped during the trace (maps grow a segment at its end);
* blocks live at the start = blocks freed in the trace that it never allocated (their size: the requested
  size rounded, which misses an unsplit remainder of ≤ 1 MiB), plus blocks live at the end that the trace
  never allocated (their exact block size is in the snapshot);
* everything else in a starting segment is free, merged, as the allocator keeps it.

The events are then replayed with the real addresses as keys. New ``cudaMalloc`` segments get the real
address of an unused real segment of the same size, so that best-fit ties (equal sizes, lowest address)
break as they did; every ``alloc`` also compares the simulated address with the real one, which checks the
model block by block, not just in total.

Findings on the H200 traces of ``q05-amp-foreach-b4s2048`` (torch 2.11, one stream): every event is on the
default stream and every ``free_requested`` is immediately followed by its ``free_completed`` (no
cross-stream frees in a plain training loop), so the two-step free does not matter here. The cuBLAS
workspace of the main thread (32 MiB on sm90) predates the recording; the trace allocates a second 32 MiB
cuBLAS workspace at the first matmul of the backward pass (the autograd engine's device thread has its own
handle, and workspaces are kept per handle and stream) and a 1 MiB cuBLASLt workspace in the first
forward. See :mod:`trainfit.allocator.workspaces` and ``docs/allocator.md`` for the measured agreement.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainfit.allocator.config import AllocatorConfig
from trainfit.allocator.simulator import (
    AllocatorResult,
    Event,
    Op,
    Simulator,
    round_size,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayResult:
    simulated: AllocatorResult
    #: Reserved bytes at the first event (rebuilt), the real peak and end implied by the segment events.
    start_reserved_bytes: int
    real_peak_reserved_bytes: int
    real_reserved_end_bytes: int
    real_num_device_allocs: int
    alloc_events: int
    #: Allocations the simulator placed at the real address.
    address_matches: int
    first_address_mismatch: int | None

    @property
    def peak_reserved_error(self) -> float:
        """(simulated − real) / real peak reserved."""
        return (self.simulated.peak_reserved_bytes - self.real_peak_reserved_bytes) / self.real_peak_reserved_bytes


def config_of(snapshot: Mapping[str, Any]) -> AllocatorConfig:
    """The allocator settings a snapshot was taken under (its ``allocator_settings``)."""
    settings = snapshot.get("allocator_settings") or {}
    conf = settings.get("PYTORCH_CUDA_ALLOC_CONF")
    cfg = AllocatorConfig.parse(conf)
    if settings.get("expandable_segments") and not cfg.expandable_segments:
        cfg = AllocatorConfig.parse((conf + "," if conf else "") + "expandable_segments:True")
    return cfg


_OPS = {
    "alloc": Op.ALLOC,
    "free_requested": Op.FREE_REQUESTED,
    "free_completed": Op.FREE_COMPLETED,
    "empty_cache": Op.EMPTY_CACHE,
}


def replay_snapshot(
    snapshot: Mapping[str, Any],
    *,
    config: AllocatorConfig | None = None,
    device: int = 0,
    real_addresses: bool = True,
    layout: bool = False,
) -> ReplayResult:
    """Seed the simulator with the snapshot's starting state and replay its events on ``device``."""
    cfg = config or config_of(snapshot)
    trace: Sequence[Mapping[str, Any]] = snapshot["device_traces"][device]
    segments = [s for s in snapshot["segments"] if s.get("device", device) == device]

    # ---- blocks live at the start
    live_in_trace: dict[int, int] = {}
    pre_freed: dict[int, int] = {}
    seg_alloc: list[tuple[int, int]] = []
    seg_freed_unknown: list[tuple[int, int, int]] = []  # (address, size, stream)
    seg_alloc_addrs: set[int] = set()
    mapped_in_trace = 0
    unmapped_in_trace = 0
    real_delta = 0
    real_peak_delta = 0
    real_allocs = 0
    for e in trace:
        act = e["action"]
        if act == "alloc":
            live_in_trace[e["addr"]] = e["size"]
        elif act == "free_completed":
            if live_in_trace.pop(e["addr"], None) is None and e["addr"] not in pre_freed:
                pre_freed[e["addr"]] = e["size"]
        elif act == "free_requested":
            if e["addr"] not in live_in_trace and e["addr"] not in pre_freed:
                pre_freed[e["addr"]] = e["size"]
        elif act in ("segment_alloc", "segment_map"):
            real_delta += e["size"]
            real_allocs += 1
            real_peak_delta = max(real_peak_delta, real_delta)
            if act == "segment_alloc":
                seg_alloc.append((e["addr"], e["size"]))
                seg_alloc_addrs.add(e["addr"])
            else:
                mapped_in_trace += e["size"]
        elif act in ("segment_free", "segment_unmap"):
            real_delta -= e["size"]
            if act == "segment_free" and e["addr"] not in seg_alloc_addrs:
                seg_freed_unknown.append((e["addr"], e["size"], e.get("stream", 0)))
            if act == "segment_unmap":
                unmapped_in_trace += e["size"]

    end_live: dict[int, int] = {}
    for s in segments:
        for b in s["blocks"]:
            if b["state"] in ("active_allocated", "active_pending_free"):
                end_live[b["address"]] = b["size"]
    pre_live: dict[int, int] = {a: round_size(sz, cfg) for a, sz in pre_freed.items()}
    for a, sz in end_live.items():
        if a not in live_in_trace:
            pre_live[a] = sz

    # ---- segments at the start: (address, size, small, stream, expandable, virtual)
    starts: list[tuple[int, int, bool, int, bool]] = []
    expandable_runs = [s for s in segments if s.get("is_expandable")]
    for s in segments:
        if s.get("is_expandable") or s["address"] in seg_alloc_addrs:
            continue
        starts.append((s["address"], s["total_size"], s["segment_type"] == "small", s["stream"], False))
    for addr, size, stream in seg_freed_unknown:  # only small-pool segments are exactly 2 MiB
        starts.append((addr, size, size == 2 << 20, stream, False))
    if expandable_runs:
        # maps in the trace grow the runs at their end; take them off the last-growing (largest) runs.
        # With one run per pool and stream (no unmaps), the start of each run is its end minus its maps.
        maps_by_run: dict[int, int] = defaultdict(int)
        run_bounds = sorted((s["address"], s["address"] + s["total_size"]) for s in expandable_runs)
        lows = [lo for lo, _ in run_bounds]
        for e in trace:
            if e["action"] in ("segment_map", "segment_unmap"):
                k = bisect_right(lows, e["addr"]) - 1
                if k >= 0:
                    sign = 1 if e["action"] == "segment_map" else -1
                    maps_by_run[run_bounds[k][0]] += sign * e["size"]
        for s in expandable_runs:
            size = s["total_size"] - maps_by_run[s["address"]]
            if size > 0:
                starts.append((s["address"], size, s["segment_type"] == "small", s["stream"], True))
    start_reserved = sum(sz for _, sz, _, _, _ in starts)

    # ---- assign the live blocks to their segments
    starts.sort()
    lows = [a for a, *_ in starts]
    per_seg: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    for a, sz in pre_live.items():
        k = bisect_right(lows, a) - 1
        if k < 0 or a >= starts[k][0] + starts[k][1]:
            continue  # freed block of a segment we cannot place (should not happen)
        per_seg[starts[k][0]].append((a, a, sz))

    by_size: dict[int, deque[int]] = defaultdict(deque)
    for a, sz in seg_alloc:
        by_size[sz].append(a)

    def hook(size: int) -> int | None:
        q = by_size.get(size)
        return q.popleft() if q else None

    def seeded() -> Simulator:
        sim = Simulator(cfg, segment_address=hook if real_addresses else None)
        for addr, size, small, stream, expandable in starts:
            sim.seed_segment(
                address=addr,
                size_bytes=size,
                small=small,
                stream=stream,
                live=per_seg.get(addr, ()),
                expandable=expandable,
            )
        return sim

    events = [Event(_OPS[e["action"]], e["addr"], e["size"], e.get("stream", 0)) for e in trace if e["action"] in _OPS]
    real_addr = [e["addr"] for e in trace if e["action"] in _OPS]
    sim = seeded()
    matches = 0
    allocs = 0
    first_bad: int | None = None
    oom = None
    for i, ev in enumerate(events):
        oom = sim.run((ev,))
        if oom is not None:
            break
        if ev.op is Op.ALLOC:
            allocs += 1
            if sim.address_of(ev.key) == real_addr[i]:
                matches += 1
            elif first_bad is None:
                first_bad = i
    result = sim.result(oom=oom)
    if layout:
        by_size.clear()
        for a, sz in seg_alloc:
            by_size[sz].append(a)
        again = seeded()
        if result.peak_event_index >= 0:
            again.run(events, stop_after=result.peak_event_index)
        from dataclasses import replace

        result = replace(result, layout_at_peak=again.layout())
    return ReplayResult(
        simulated=result,
        start_reserved_bytes=start_reserved,
        real_peak_reserved_bytes=start_reserved + real_peak_delta,
        real_reserved_end_bytes=start_reserved + real_delta,
        real_num_device_allocs=real_allocs,
        alloc_events=allocs,
        address_matches=matches,
        first_address_mismatch=first_bad,
    )
