"""Byte counts of real CPU runs, for checks of the analytic model that do not go through trainfit's own
trace: every allocator call seen by ``torch.profiler(profile_memory=True)``, inside one named window.

Counting follows the CUDA caching allocator the analytic model describes: each allocation is rounded up
to 512 bytes (``c10/cuda/CUDACachingAllocator.cpp``; docs/DESIGN §4.2). Optionally, allocations of at most
``ignore_at_most`` bytes are skipped: CPU kernels wrap Python numbers in 0-dim tensors (the foreach slow
path's ``torch.tensor(1.0)`` for host step counters, a scalar's dtype cast), which on CUDA are kernel
arguments or host memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

BLOCK = 512
_WINDOW = "independent-check-window"


def rounded(nbytes: int) -> int:
    """The CUDA caching allocator's block size for a request of ``nbytes``."""
    return -(-nbytes // BLOCK) * BLOCK


def peak_in_window(run: Callable[[Callable[[], Any]], Any], *, ignore_at_most: int = 0) -> int:
    """Call ``run(window)`` under the profiler; ``run`` builds its tensors and wraps the part to measure in
    ``with window():``. Returns the largest number of bytes alive at some moment inside the window above what
    was alive when it opened (tensors freed inside the window count negatively). Everything is allocated
    under the profiler, because it reports no size for freeing a block allocated before it started."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run(lambda: record_function(_WINDOW))
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    (lo, hi) = next((e.start_ns(), e.end_ns()) for e in events if e.name() == _WINDOW)
    live = 0
    at_start: int | None = None
    best = 0
    for e in events:
        if e.name() != "[memory]" or e.start_ns() > hi:
            continue
        if at_start is None and e.start_ns() >= lo:
            at_start = best = live
        n = e.nbytes()
        if abs(n) <= ignore_at_most:
            continue
        live += rounded(n) if n > 0 else -rounded(-n)
        if at_start is not None:
            best = max(best, live)
    return 0 if at_start is None else best - at_start


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Allocator bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(rounded(n) for n in seen.values())
