"""Replaying the real H200 allocator traces (``shared/gpu-truth``) must reproduce the real reserved bytes.

The expected figures come from the measurement itself: the trace's own segment events and the
``max_reserved`` that ``torch.cuda.max_memory_reserved()`` reported in ``h200-training.jsonl``.
"""

from __future__ import annotations

import functools
import pickle
from typing import Any

import pytest

from tests._gpu_truth import TRUTH, data
from trainfit.allocator import config_of, replay_snapshot

CASE = "q05-amp-foreach-b4s2048"
pytestmark = pytest.mark.skipif(TRUTH is None, reason="gpu-truth calibration data not available")


@functools.cache
def _snapshot(kind: str) -> dict[str, Any]:
    assert TRUTH is not None
    with open(TRUTH / f"allocator-trace-{CASE}-{kind}.pickle", "rb") as fh:
        snap: dict[str, Any] = pickle.load(fh)
    return snap


def _measured_max_reserved(expandable: bool) -> int:
    assert TRUTH is not None
    return int(data.case(TRUTH, CASE, expandable=expandable)[1]["max_reserved"])


@pytest.mark.parametrize("kind", ["default", "expandable"])
def test_replay_within_half_percent(kind: str) -> None:
    snap = _snapshot(kind)
    assert config_of(snap).expandable_segments == (kind == "expandable")
    res = replay_snapshot(snap)
    measured = _measured_max_reserved(kind == "expandable")
    assert res.real_peak_reserved_bytes == measured  # the trace's own segment events agree with the counter
    assert abs(res.simulated.peak_reserved_bytes - measured) <= 0.005 * measured
    assert res.simulated.oom is None


@pytest.mark.parametrize("kind", ["default", "expandable"])
def test_replay_without_real_addresses_within_half_percent(kind: str) -> None:
    res = replay_snapshot(_snapshot(kind), real_addresses=False)
    measured = _measured_max_reserved(kind == "expandable")
    assert abs(res.simulated.peak_reserved_bytes - measured) <= 0.005 * measured


def test_replay_places_blocks_where_the_gpu_did() -> None:
    # with the real segment addresses, best fit must pick the very same block for (almost) every alloc
    res = replay_snapshot(_snapshot("default"))
    assert res.address_matches >= 0.99 * res.alloc_events


def test_layout_at_peak_sums_to_peak() -> None:
    res = replay_snapshot(_snapshot("default"), layout=True)
    lay = res.simulated.layout_at_peak
    assert lay is not None
    assert sum(s.size_bytes for s in lay) == res.simulated.peak_reserved_bytes


def test_workspaces_in_the_trace() -> None:
    # allocations never freed whose size is a workspace size: the 1 MiB cuBLASLt one in the first forward,
    # the 32 MiB cuBLAS one of the backward thread (the main thread's predates the recording)
    from trainfit.allocator.workspaces import cublas_workspace_bytes, cublaslt_workspace_bytes

    trace = _snapshot("default")["device_traces"][0]
    live: dict[int, tuple[int, int]] = {}
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = (i, e["size"])
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    kept = {size for _, size in live.values()}
    h200 = (2, 11)  # the snapshots' torch: a separate Lt workspace (torch 2.13 would share the cuBLAS one)
    assert cublas_workspace_bytes((9, 0), torch_version=h200) in kept
    assert cublaslt_workspace_bytes((9, 0), torch_version=h200) in kept
    pre = [
        b["size"]
        for s in _snapshot("default")["segments"]
        for b in s["blocks"]
        if b["state"] == "active_allocated" and b["address"] not in {e["addr"] for e in trace}
    ]
    assert cublas_workspace_bytes((9, 0)) in pre
