"""The live-storage tracker: 512-byte rounding, exact timelines, categories by fate."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from trainfit.result import Component  # noqa: E402
from trainfit.trace import tracker as tk  # noqa: E402


@pytest.mark.parametrize(("n", "expected"), [(0, 0), (1, 512), (512, 512), (513, 1024), (4096, 4096)])
def test_rounding_is_the_caching_allocators(n: int, expected: int) -> None:
    assert tk.rounded(n) == expected


def test_timeline_peak_and_breakdown() -> None:
    tr = tk.Tracker()
    with FakeTensorMode(), tr:
        tr.phase = tk.FORWARD
        a = torch.empty(100, dtype=torch.float32)  # 400 B -> 512
        b = torch.empty(1000, dtype=torch.uint8)  # 1000 B -> 1024
        start = tr.t
        del a
        c = torch.empty(300, dtype=torch.float32)  # 1200 -> 1536
        tr.forward_end[0] = tr.t
        end = tr.t
    (pk,) = tr.peaks([tk.Interval("x", 0, end)])
    assert pk.total_bytes == 1024 + 1536
    assert start == 2  # two allocations, one event each
    # b and c are alive when the forward ends: activations; a died before: not in the peak.
    assert pk.components[Component.ACTIVATIONS] == 1024 + 1536
    del b, c


def test_explicit_marks_and_host_storages_are_excluded() -> None:
    tr = tk.Tracker()
    with FakeTensorMode(), tr:
        w = torch.empty(256)  # 1 KiB
        step = torch.empty(())  # a CPU-side optimizer step counter on CUDA
        tr.mark([w], tk.WEIGHTS)
        tr.mark([step], tk.HOST)
    (pk,) = tr.peaks([tk.Interval("x", 0, tr.t)])
    assert pk.total_bytes == 1024
    assert pk.components[Component.WEIGHTS] == 1024
    del w, step


def test_autocast_weight_copies_are_recognised() -> None:
    tr = tk.Tracker()
    with FakeTensorMode(), tr:
        w = torch.nn.Parameter(torch.empty(64, 64))
        tr.mark([w], tk.WEIGHTS)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = torch.nn.functional.linear(torch.empty(2, 64), w)
            (pk,) = tr.peaks([tk.Interval("x", 0, tr.t)])
    assert pk.components[Component.AUTOCAST_COPIES] == 64 * 64 * 2
    del y


def test_inplace_accumulation_is_replayed() -> None:
    """Two reads of one activation: fake autograd adds the two gradients out of place, CUDA in place."""
    tr = tk.Tracker()
    with FakeTensorMode():
        x = torch.empty(256, 256, requires_grad=True)
        with tr:
            tr.phase = tk.FORWARD
            h = x * 2
            y = (h.sin() + h.cos()).sum()
            tr.forward_end[0] = tr.t
            tr.phase = tk.BACKWARD
            y.backward()
    assert len(tr.accumulations) == 1
    assert tr.merge_inplace_accumulations() == 1
    del h, y


def test_a_storage_freed_after_the_run_is_read_keeps_the_ticks_final() -> None:
    """The readers size their arrays by the tick count; a storage the garbage collector frees after they began
    (a fake tensor of the run in a reference cycle, collected during the next trace) must not take a new tick. Before,
    benchmarks/reserve_agreement.py --savers died with an IndexError in trace.events ``_raw_events`` after a few
    rows; now such a storage is alive to the end of the run."""
    from trainfit.trace.events import _raw_events, tracker_events
    from trainfit.trace.runner import TraceRun
    from trainfit.trace.timeline import Timeline

    tr = tk.Tracker()
    with FakeTensorMode(), tr:
        tr.phase = tk.FORWARD
        kept = torch.empty(1024)
        gone = torch.empty(1024)
        del gone
    run = TraceRun(tracker=tr, timeline=Timeline(), params=0, trainable_params=0, sdpa_backends={}, notes=[])
    before = tracker_events(run)
    ticks = tr.t
    del kept  # freed after the run was read
    assert tr.t == ticks and tr.records[0].free_t is None
    assert tracker_events(run) == before and len(_raw_events(run)) == len(before)
