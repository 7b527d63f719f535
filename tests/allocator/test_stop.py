"""``Simulator(stop_above_bytes=...)``: a run that stops once reserved passes a limit, for callers that only ask
whether it does (the planner's verdict-only estimates), and the memo that answers it."""

from __future__ import annotations

import random

from trainfit.allocator import AllocatorConfig
from trainfit.allocator.simulator import AllocatorResult, Simulator
from trainfit.analytic.events import forget_simulations, memo_stoppable


def _stream(seed: int) -> list[tuple[str, int, int]]:
    rng = random.Random(seed)
    live: list[int] = []
    out: list[tuple[str, int, int]] = []
    for key in range(1, 600):
        if live and rng.random() < 0.45:
            out.append(("free", live.pop(rng.randrange(len(live))), 0))
        size = rng.choice((rng.randrange(1, 1 << 20), rng.randrange(1 << 20, 1 << 27)))
        out.append(("malloc", key, size))
        live.append(key)
    return out


def _run(events: list[tuple[str, int, int]], config: AllocatorConfig, stop: int | None) -> AllocatorResult:
    sim = Simulator(config, stop_above_bytes=stop)

    def drive(x: Simulator) -> None:
        for op, key, size in events:
            if op == "malloc":
                x.malloc(key, size)
            else:
                x.free(key)

    return sim.result(oom=sim.drive(drive))


def test_a_run_stops_where_reserved_first_passes_the_limit() -> None:
    for seed in range(4):
        for config in (AllocatorConfig(), AllocatorConfig(expandable_segments=True)):
            events = _stream(seed)
            whole = _run(events, config, None)
            assert not whole.stopped
            # a limit at or above the peak is never passed: the run is the whole run
            assert _run(events, config, whole.peak_reserved_bytes) == whole
            limit = whole.peak_reserved_bytes // 2
            part = _run(events, config, limit)
            assert part.stopped
            assert limit < part.peak_reserved_bytes <= whole.peak_reserved_bytes


def test_the_memo_answers_a_stoppable_run_with_a_whole_one() -> None:
    forget_simulations()
    events, config = _stream(9), AllocatorConfig()
    whole = _run(events, config, None)
    calls: list[int | None] = []

    def run(stop: int | None) -> AllocatorResult:
        calls.append(stop)
        return _run(events, config, stop)

    key = ("test_stop", 9)
    # stopped: kept under its limit only; asked whole, the stream runs whole
    assert memo_stoppable(key, whole.peak_reserved_bytes // 2, run).stopped
    assert memo_stoppable(key, None, run) == whole
    # now the whole run answers any limit without running
    assert memo_stoppable(key, 1, run) == whole
    assert calls == [whole.peak_reserved_bytes // 2, None]
    # a limit the run never passes gives the whole run, kept as it
    forget_simulations()
    calls.clear()
    assert memo_stoppable(key, whole.peak_reserved_bytes, run) == whole
    assert memo_stoppable(key, None, run) == whole
    assert calls == [whole.peak_reserved_bytes]
    forget_simulations()
