"""Runs one after another in one process (:mod:`trainfit.allocator.process`); expected values worked out by hand
from the allocator's rules (c10/cuda/CUDACachingAllocator.cpp: ``get_allocation_size``, ``should_split``,
``release_cached_blocks``), not by running the simulator."""

from __future__ import annotations

import pytest

from trainfit.allocator import AllocatorConfig, Event, Op, simulate
from trainfit.allocator.process import ProcessStart, built_on_device, matmul_warm_up, simulate_process
from trainfit.allocator.workspaces import Thread, WorkspaceKind, training_workspaces, workspace_key

MiB = 1 << 20
WS = workspace_key(0)


def _run(big: int, ws: bool) -> list[Event]:
    """A run that makes and frees a ``big`` MiB tensor, then (``ws``) a 32 MiB workspace, then a 10 MiB one."""
    out = [Event(Op.ALLOC, 0, big * MiB), Event(Op.FREE, 0)]
    if ws:
        out.append(Event(Op.ALLOC, WS, 32 * MiB))
    return [*out, Event(Op.ALLOC, 1, 10 * MiB), Event(Op.FREE, 1)]


def test_a_workspace_pins_the_segment_it_was_carved_from() -> None:
    """Run 1's workspace takes the low 32 MiB of its freed 100 MiB segment (best fit, split: 68 MiB left > 1 MiB);
    ``empty_cache`` cannot release that segment, so run 2 starts with 100 MiB reserved and its 60 MiB tensor fits
    in the 68 MiB free behind the workspace: no new segment. Its workspace exists already: not made again."""
    first, second = simulate_process([_run(100, True), _run(60, True)], AllocatorConfig())
    assert first.start_reserved_bytes == 0
    assert first.peak_reserved_bytes == 100 * MiB  # the 10 MiB tensor fits in the free 68 MiB too
    assert first.end_reserved_bytes == 100 * MiB
    assert second.start_reserved_bytes == 100 * MiB
    assert second.peak_reserved_bytes == 100 * MiB
    assert second.peak_allocated_bytes == 32 * MiB + 60 * MiB


def test_a_larger_tensor_than_the_pinned_segment_s_free_part_needs_its_own() -> None:
    """Run 2's 80 MiB tensor does not fit the 68 MiB free part: a new 80 MiB segment beside the pinned one."""
    _, second = simulate_process([_run(100, True), _run(80, True)], AllocatorConfig())
    assert second.peak_reserved_bytes == 180 * MiB
    assert second.end_reserved_bytes == 100 * MiB


def test_without_workspaces_every_run_starts_empty() -> None:
    runs = simulate_process([_run(100, False), _run(60, False)], AllocatorConfig())
    assert [r.start_reserved_bytes for r in runs] == [0, 0]
    assert [r.peak_reserved_bytes for r in runs] == [100 * MiB, 60 * MiB]


def test_expandable_segments_unmap_all_but_the_workspace_pages() -> None:
    """With expandable segments ``empty_cache`` unmaps every free page: the workspace keeps its 32 MiB, which
    spans two 20 MiB pages of the large pool's range (``map_block``), so 40 MiB stay mapped."""
    first, second = simulate_process(
        [_run(100, True), _run(60, True)], AllocatorConfig.parse("expandable_segments:True")
    )
    assert first.end_reserved_bytes == 40 * MiB
    assert second.start_reserved_bytes == 40 * MiB


def test_a_workspace_is_never_freed() -> None:
    with pytest.raises(ValueError, match="workspace"):
        simulate_process([[Event(Op.ALLOC, WS, MiB), Event(Op.FREE, WS)]])


def test_the_warm_up_matmul_makes_the_main_thread_s_cublas_workspace() -> None:
    ws = training_workspaces((9, 0))
    events = matmul_warm_up(ws)
    made = [e for e in events if e.op is Op.ALLOC and e.key < 0]
    main = [k for k, w in enumerate(ws) if w.thread is Thread.MAIN and w.kind is WorkspaceKind.CUBLAS]
    assert [e.key for e in made] == [workspace_key(main[0])] and made[0].size_bytes == 32 * MiB
    # three 256 KiB fp32 tensors in one 2 MiB small segment, kept cached: 34 MiB reserved (the H200's meta line)
    (run,) = simulate_process([[]], AllocatorConfig(), warm_up=events)
    assert run.start_reserved_bytes == 34 * MiB


def test_a_head_built_then_tied_goes_in_right_after_the_parameters() -> None:
    weights = [Event(Op.ALLOC, WS, 32 * MiB), Event(Op.ALLOC, 0, 4 * MiB), Event(Op.ALLOC, 1, 4 * MiB)]
    step = [Event(Op.ALLOC, 2, 60 * MiB), Event(Op.ALLOC, 3, 100 * MiB)]
    out = built_on_device([*weights, *step], weights=2, transient_bytes=50 * MiB)
    assert out[:3] == weights and out[5:] == step
    assert out[3].op is Op.ALLOC and out[3].size_bytes == 50 * MiB and out[4] == Event(Op.FREE, out[3].key)
    assert out[3].key not in {e.key for e in weights + step}
    assert built_on_device(step, weights=2, transient_bytes=0) == step
    with pytest.raises(ValueError, match="fewer than the 3 parameters"):
        built_on_device(step, weights=3, transient_bytes=MiB)


def test_the_freed_head_takes_a_tensor_that_would_have_had_a_segment_of_its_own() -> None:
    # weights: one 4 MiB tensor (a 20 MiB segment); the head's 100 MiB, freed, stays cached. The step's 60 MiB
    # tensor best-fits into it (split: 40 MiB left), so the 100 MiB one needs a new segment: 20 + 100 + 100.
    # Without the head: 20 + 60 + 100 (each large request > 10 MiB gets a segment of its own size).
    run = [Event(Op.ALLOC, 0, 4 * MiB), Event(Op.ALLOC, 1, 60 * MiB), Event(Op.ALLOC, 2, 100 * MiB)]
    (plain,) = simulate_process([run])
    (built,) = simulate_process([built_on_device(run, weights=1, transient_bytes=100 * MiB)])
    assert plain.peak_reserved_bytes == 180 * MiB
    assert built.peak_reserved_bytes == 220 * MiB


def test_a_process_start_puts_one_run_where_the_process_simulation_has_it() -> None:
    """ProcessStart (what ``trainfit estimate --warm-up --after ... --build on-device`` replays): run 1 of
    the first test above, then run 2 alone from that state — 100 MiB reserved at its start (the pinned segment),
    its 60 MiB tensor in the 68 MiB behind the workspace, the workspace not made again; its peaks its own."""
    start = ProcessStart(earlier=(tuple(_run(100, True)),))
    assert start.workspaces_made() == {WS}
    second = _run(60, True)
    res = simulate(start.events(second), AllocatorConfig(), setup=start.setup)
    assert res.peak_reserved_bytes == 100 * MiB
    assert res.peak_allocated_bytes == 32 * MiB + 60 * MiB
    (_, in_process) = simulate_process([_run(100, True), second], AllocatorConfig())
    assert (res.peak_reserved_bytes, res.peak_allocated_bytes) == (
        in_process.peak_reserved_bytes,
        in_process.peak_allocated_bytes,
    )


def test_a_process_start_builds_the_run_s_model_on_the_device() -> None:
    """The freed head of the test above, through ProcessStart: 20 + 100 + 100 MiB; with a warm-up, its three
    256×256 fp32 tensors (256 KiB each, the small pool: one 2 MiB segment) come first and stay reserved."""
    run = [Event(Op.ALLOC, 0, 4 * MiB), Event(Op.ALLOC, 1, 60 * MiB), Event(Op.ALLOC, 2, 100 * MiB)]
    built = ProcessStart(weights=1, transient_bytes=100 * MiB)
    assert not built.fresh and ProcessStart().fresh
    assert simulate(built.events(run), AllocatorConfig(), setup=built.setup).peak_reserved_bytes == 220 * MiB
    warm = ProcessStart(warm_up=tuple(matmul_warm_up(())), weights=1, transient_bytes=100 * MiB)
    res = simulate(warm.events(run), AllocatorConfig(), setup=warm.setup)
    assert res.peak_reserved_bytes == 2 * MiB + 220 * MiB
