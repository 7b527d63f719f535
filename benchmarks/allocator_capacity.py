"""Uncapped reserve against the least capacity a many-GPU rank fits in, default allocator and expandable segments.

For every ``--reserve`` row of ``agreement_distributed.py`` (micro-batch 1 x 2048, amp-bf16) the rank's synthesised
stream (trainfit.analytic.rank_events) is recorded while ``estimate`` runs it, then bisected with
``trainfit.allocator.least_capacity``: the smallest device capacity (1 MiB steps) with no out-of-memory error, and
the cache flushes (``num_alloc_retries``) fitting there takes. The table of docs/accuracy.md ("Reserved memory
with many GPUs").

``--reduce MODEL SHARDING W CKPT``: delta debugging of that row's stream down to the fewest allocations that still
reserve at least 1 GiB more with expandable segments than without (docs/allocator.md, "Expandable segments: when
they reserve more"); prints the remaining events.

Usage: python benchmarks/allocator_capacity.py [--reduce llama-3.1-70b zero2 64 full]
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trainfit.analytic.rank_events as rank_events
from trainfit import estimate
from trainfit.allocator import AllocatorConfig, Event, Op, Simulator, least_capacity, simulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agreement_distributed import RESERVE_CASES, strategy

GiB, MiB = 2**30, 2**20
EXPANDABLE = AllocatorConfig.parse("expandable_segments:True")


class _Recording(Simulator):
    """A simulator that keeps the calls it is driven with, as events."""

    def __init__(self, config: AllocatorConfig | None = None, **kw: Any) -> None:
        super().__init__(config, **kw)
        self.events: list[Event] = []

    def malloc(self, key: int, size_bytes: int, stream: int = 0) -> int:
        self.events.append(Event(Op.ALLOC, key, size_bytes, stream))
        return super().malloc(key, size_bytes, stream)

    def free_requested(self, key: int) -> None:
        self.events.append(Event(Op.FREE_REQUESTED, key))
        super().free_requested(key)

    def free_completed(self, key: int) -> None:
        self.events.append(Event(Op.FREE_COMPLETED, key))
        super().free_completed(key)


def rank_streams(slug: str, sharding: str, w: int, flag: bool, ckpt: str) -> dict[bool, list[Event]]:
    """The rank's stream under each allocator setting (keyed by expandable), as ``estimate`` synthesises it."""
    s = strategy(sharding, w, flag, ckpt)
    if sharding.startswith("zero"):
        s = dataclasses.replace(s, engine=dataclasses.replace(s.engine, overlap_comm=True if flag else None))
    made: list[_Recording] = []

    def recording(config: AllocatorConfig | None = None, **kw: Any) -> _Recording:
        made.append(_Recording(config, **kw))
        return made[-1]

    original = rank_events.Simulator
    rank_events.Simulator = recording  # type: ignore[misc,assignment]
    try:
        rank_events.simulation_memo().clear()
        for conf in ("", "expandable_segments:True"):
            estimate(slug, s, allocator=conf)
    finally:
        rank_events.Simulator = original  # type: ignore[misc]
    return {r.config.expandable_segments: r.events for r in made}


def table() -> None:
    print("| model | setup | W | ckpt | default: peak / least capacity (retries) | expandable: same |")
    print("|---|---|---:|---|---:|---:|")
    for slug, sharding, w, flag, ckpt in RESERVE_CASES:
        streams = rank_streams(str(slug), str(sharding), int(str(w)), bool(flag), str(ckpt))
        cells = []
        for expandable in (False, True):
            events = streams[expandable]
            config = EXPANDABLE if expandable else AllocatorConfig()
            peak = simulate(events, config).peak_reserved_bytes
            cap, at = least_capacity(events, config)
            cells.append(f"{peak / GiB:.2f} / {cap / GiB:.2f} ({at.num_alloc_retries})")
        setup = f"{sharding}{', flag' if flag else ''}"
        print(f"| {slug} | {setup} | {w} | {ckpt} | {cells[0]} | {cells[1]} |", flush=True)


def reduce(events: Sequence[Event], margin_bytes: int = GiB) -> list[Event]:
    """Delta debugging over allocations (each with its frees): the fewest that keep expandable segments'
    reserve ``margin_bytes`` above the default allocator's."""
    keys: list[int] = []
    for e in events:
        if e.op is Op.ALLOC:
            keys.append(e.key)

    def keep(ks: Sequence[int]) -> list[Event]:
        chosen = set(ks)
        return [e for e in events if e.key in chosen]

    def worse(ks: Sequence[int]) -> bool:
        sub = keep(ks)
        gap = simulate(sub, EXPANDABLE).peak_reserved_bytes - simulate(sub, AllocatorConfig()).peak_reserved_bytes
        return gap >= margin_bytes

    n = 2
    while len(keys) >= 2:
        chunk = max(1, len(keys) // n)
        for start in range(0, len(keys), chunk):
            candidate = keys[:start] + keys[start + chunk :]
            if candidate and worse(candidate):
                keys, n = candidate, max(n - 1, 2)
                break
        else:
            if chunk == 1:
                break
            n = min(len(keys), n * 2)
    return keep(keys)


def main(argv: list[str]) -> None:
    if "--reduce" in argv:
        i = argv.index("--reduce")
        slug, sharding, w, ckpt = argv[i + 1 : i + 5]
        events = rank_streams(slug, sharding, int(w), False, ckpt)[False]
        small = reduce(events)
        for e in small:
            print(e.op.value, e.key, f"{e.size_bytes / MiB:.2f} MiB" if e.op is Op.ALLOC else "")
        for name, config in (("default", AllocatorConfig()), ("expandable", EXPANDABLE)):
            print(name, f"{simulate(small, config).peak_reserved_bytes / MiB:,.0f} MiB reserved")
        return
    table()


if __name__ == "__main__":
    main(sys.argv[1:])
