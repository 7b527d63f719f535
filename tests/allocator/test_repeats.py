"""``Simulator.repeats_after``: when a repeated sequence of calls (a training step) would, run again, change nothing
the peaks read — held by running it again."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from trainfit.allocator import AllocatorConfig
from trainfit.allocator.simulator import Simulator

Call = tuple[str, int, int]  # ("malloc", local key, bytes) | ("free", local key, 0)


def _body(seed: int, calls: int) -> list[Call]:
    """A step's calls: small and large allocations, each freed before the step's end (some at once, some later)."""
    rng = random.Random(seed)
    live: list[int] = []
    out: list[Call] = []
    for key in range(calls):
        if live and rng.random() < 0.4:
            out.append(("free", live.pop(rng.randrange(len(live))), 0))
        small = rng.random() < 0.6
        out.append(("malloc", key, rng.randrange(1, 1 << 20) if small else rng.randrange(1 << 20, 1 << 26)))
        live.append(key)
    out += [("free", k, 0) for k in live]
    return out


class _Steps:
    """Runs steps of ``body`` (keys renamed per step) on one simulator; ``kept``: small allocations the first step
    leaves behind at its end (as the optimizer's states), which the next steps' calls then have to place around."""

    def __init__(self, body: list[Call], kept: list[int], config: AllocatorConfig | None = None) -> None:
        self.sim = Simulator(config)
        self.body = body
        self.kept = kept
        self.steps = 0

    def step(self) -> tuple[object, ...]:
        base = (self.steps + 1) * 1_000_000
        for op, key, size in self.body:
            if op == "malloc":
                self.sim.malloc(base + key, size)
            else:
                self.sim.free(base + key)
        if self.steps == 0:
            for i, size in enumerate(self.kept):
                self.sim.malloc(-1 - i, size)
        self.steps += 1
        key = self.sim.state_key()
        assert key is not None
        return key

    def peaks(self) -> tuple[int, ...]:
        s = self.sim
        return (
            s.peak_reserved_bytes,
            s.peak_allocated_bytes,
            s.reserved_at_peak_allocated_bytes,
            s.fragmentation_at_peak_bytes,
            s.num_segments_at_peak,
            s.peak_event_index,
            s.num_device_allocs,
        )


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    calls=st.integers(5, 120),
    kept=st.lists(st.integers(1, 1 << 20), max_size=12),
)
def test_a_step_said_to_repeat_changes_nothing_when_run_again(seed: int, calls: int, kept: list[int]) -> None:
    """Whenever ``repeats_after(before, now)`` holds, the next step leaves every peak and counter as it was and ends
    in ``now`` — the stream may stop there."""
    run = _Steps(_body(seed, calls), kept)
    keys = [run.step()]
    for _ in range(4):
        keys.append(run.step())
        if run.sim.repeats_after(keys[-2], keys[-1]):
            peaks = run.peaks()
            assert run.step() == keys[-1]
            assert run.peaks()[:5] == peaks[:5]
            assert run.peaks()[6] == peaks[6]  # no new segment
            return


def test_a_step_that_only_added_whole_free_small_segments_repeats() -> None:
    """The rule's second case, seen: the first step's kept small tensors make the second step create small
    segments it leaves free; the keys differ, yet the third step repeats the second."""
    hits = 0
    for seed in range(200):
        run = _Steps(_body(seed, 80), [900_000] * 3)
        first, second = run.step(), run.step()
        if first != second and run.sim.repeats_after(first, second):
            peaks = run.peaks()
            assert run.step() == second
            assert run.peaks()[:5] == peaks[:5]
            hits += 1
    assert hits >= 5


def test_new_large_segments_or_a_block_in_use_do_not_repeat() -> None:
    """A large segment added (its size could win a later best fit), a whole small segment still in use, or an
    expandable or capacity-limited allocator (segments mapped or flushed): not this rule's case."""
    sim = Simulator()
    sim.malloc(1, 4 << 20)
    before = sim.state_key()
    sim.malloc(2, 30 << 20)  # a new large segment...
    sim.free(2)  # ...left free
    assert not sim.repeats_after(before, sim.state_key())

    sim = Simulator()
    sim.malloc(1, 4 << 20)
    before = sim.state_key()
    for key in (2, 3, 4):  # 3 × 700 kB: two small segments
        sim.malloc(key, 700_000)
    sim.free(4)
    assert not sim.repeats_after(before, sim.state_key())  # the second is free, the first is in use
    sim.free(2)
    sim.free(3)
    assert sim.repeats_after(before, sim.state_key())  # both whole and free now

    for config, capacity in ((AllocatorConfig.parse("expandable_segments:True"), None), (None, 80 << 30)):
        sim = Simulator(config, capacity_bytes=capacity)
        sim.malloc(1, 4 << 20)
        before = sim.state_key()
        sim.malloc(2, 1000)
        sim.free(2)
        assert not sim.repeats_after(before, sim.state_key())
