"""The trace as an allocator event stream, and the reserved memory the caching allocator would hold for it.

The tracker (:mod:`trainfit.trace.tracker`) numbers every storage allocation and every free with one tick
each, so its records *are* the ordered sequence of ``malloc`` / ``free`` calls a CUDA run makes (sizes
already rounded to 512 B, which the allocator's own rounding leaves unchanged by default). What the trace
cannot see are the allocations no tensor owns: the cuBLAS and cuBLASLt workspaces
(:mod:`trainfit.allocator.workspaces`). We add them where the H200 trace shows them: the main thread's
cuBLAS and cuBLASLt workspaces at the first forward pass, the autograd thread's cuBLAS workspace at the
first backward pass.

Full depth by stitching. Fragmentation is not linear in depth, so we do not extrapolate reserved bytes; we
rebuild the *event stream* of the full model from a trace with three units of the layer stack (first,
middle, last) by repeating the middle unit's events, forward and backward, to the real count. A storage
keeps its identity across the copy: one allocated in the middle unit gets a fresh key per copy; a free in
a copy of a storage born in the unit before (the first unit, or the previous copy) frees that unit's
corresponding storage (the k-th allocation of one unit corresponds to the k-th of the next, which we check
by size); storages of the middle unit freed later (gradients at ``zero_grad``) are freed once per copy. The
events of a unit's parameters outside its regions (weights at setup, optimizer states and the foreach
temporaries of the optimizer step) are found the same way, by the parameters' order: see
:func:`stitch_events`. Full-depth traces check the stitching (tests/trace/test_events.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from trainfit.allocator import AllocatorConfig, AllocatorResult, Event, Op, simulate
from trainfit.allocator.workspaces import Thread, WorkspaceKind, training_workspaces
from trainfit.trace import runner as rn

#: Keys of workspace allocations (tracker records use their index, ≥ 0).
_WORKSPACE_KEY = -1


def tracker_events(run: rn.TraceRun) -> list[Event]:
    """The run's allocations and frees in order (storages the step never puts on the device excluded)."""
    tr = run.tracker
    tr.merge_inplace_accumulations()
    slots: list[Event | None] = [None] * (tr.t + 2)
    for idx, rec in enumerate(tr.records):
        if tr.component(rec) is None:
            continue
        slots[rec.alloc_t] = Event(Op.ALLOC, idx, rec.nbytes)
        if rec.free_t is not None:
            slots[rec.free_t] = Event(Op.FREE, idx)
    return [e for e in slots if e is not None]


def _tick_index(run: rn.TraceRun) -> list[int]:
    """For each tick, how many kept events precede or are at it (to insert events after a tick)."""
    tr = run.tracker
    kept = [0] * (tr.t + 2)
    for rec in tr.records:
        if tr.component(rec) is None:
            continue
        kept[rec.alloc_t] = 1
        if rec.free_t is not None:
            kept[rec.free_t] = 1
    acc = 0
    out = [0] * len(kept)
    for t, k in enumerate(kept):
        acc += k
        out[t] = acc
    return out


def with_workspaces(
    events: list[Event],
    run: rn.TraceRun,
    compute_capability: tuple[int, int],
    env: Mapping[str, str] | None = None,
) -> list[Event]:
    """Insert the cuBLAS/cuBLASLt workspace allocations (never freed) at the first forward and backward."""
    steps = run.timeline.steps
    if not steps or not steps[0].passes:
        return list(events)
    first = steps[0].passes[0]
    index = _tick_index(run)
    at: dict[int, list[Event]] = {}
    key = _WORKSPACE_KEY
    for ws in training_workspaces(compute_capability, env):
        tick = first.fwd_start if ws.thread is Thread.MAIN else first.bwd_start
        pos = index[min(tick, len(index) - 1)]
        at.setdefault(pos, []).append(Event(Op.ALLOC, key, ws.size_bytes))
        key -= 1
        assert ws.kind in WorkspaceKind
    out: list[Event] = []
    for i, e in enumerate(events):
        out.extend(at.pop(i, ()))
        out.append(e)
    for pos in sorted(at):
        out.extend(at[pos])
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceReserved:
    """Reserved memory predicted for a traced run."""

    result: AllocatorResult
    events: int
    layers_traced: int
    layers_full: int
    stitched: bool


def reserved_from_run(
    run: rn.TraceRun,
    config: AllocatorConfig | None = None,
    *,
    compute_capability: tuple[int, int] = (9, 0),
    env: Mapping[str, str] | None = None,
    capacity_bytes: int | None = None,
    layout: bool = False,
) -> AllocatorResult:
    """Replay a (full-depth) run's events plus the workspaces through the allocator model."""
    events = with_workspaces(tracker_events(run), run, compute_capability, env)
    return simulate(events, config, capacity_bytes=capacity_bytes, layout=layout)
