"""FSDP2's ``CPUOffloadPolicy`` traced: rank 0 of the real ``fully_shard(offload_policy=CPUOffloadPolicy())``
on PyTorch's fake process group against the closed form of :mod:`trainfit.analytic.parallel`. The sharded
parameters, their gradients and the optimizer states are host memory (the tracker files them so, and the step
that runs on them); the device keeps the unsharded parameters, the collectives' buffers and the activations.
Device phases within 3% (the step: within 16 KiB, it is empty); the host states within 2% of the analytic's
host bytes per rank."""

from __future__ import annotations

import dataclasses

import pytest

from trainfit.strategy import EngineOptions, Offload, Parallelism, Strategy

from .conftest import tiny_spec, traced_once

pytest.importorskip("torch")
from trainfit.analytic.parallel import estimate_parallel
from trainfit.trace import depth
from trainfit.trace import tracker as tk
from trainfit.trace.distributed import fake_world, run_layout_distributed, trace_distributed

WIDER = {"hidden_size": 128, "intermediate_size": 256, "vocab_size": 512}


def _strategy(w: int, raf: bool, precision: str, ckpt: str = "none") -> Strategy:
    return Strategy(
        precision=precision,
        parallelism=Parallelism(data=w),
        sharding="fsdp",
        checkpointing=ckpt,
        micro_batch=2,
        seq_len=128,
        offload=Offload.parse("optimizer+params"),
        engine=EngineOptions(reshard_after_forward=raf),
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("w", "raf", "precision", "ckpt"),
    # W = 2 differs from W = 8 in the world size alone: full-matrix only
    [(8, True, "amp-bf16", "none"), pytest.param(2, True, "amp-bf16", "none", marks=pytest.mark.full_matrix)],
)
def test_fsdp_cpu_offload_device_peak_agrees(w: int, raf: bool, precision: str, ckpt: str) -> None:
    spec = tiny_spec("llama", **WIDER)
    s = _strategy(w, raf, precision, ckpt)
    traced = trace_distributed(spec, s)
    closed = estimate_parallel(spec, s)
    for a, t in zip(closed.phases, traced.phases, strict=True):
        assert abs(a.total_bytes - t.total_bytes) <= 0.03 * t.total_bytes + 16384, (
            a.phase,
            a.total_bytes,
            t.total_bytes,
        )
    # the states left the device: the device peak is below the same run without offload
    # (test_distributed.py's test_rank_agrees_with_trace cell, traced once per process)
    assert (
        traced.peak_bytes < traced_once(trace_distributed, spec, dataclasses.replace(s, offload=Offload())).peak_bytes
    )


@pytest.mark.slow
def test_fsdp_cpu_offload_host_states_agree() -> None:
    """The largest host bytes the traced rank holds (shards, gradients and Adam's states, at the step) against
    the analytic's host bytes per node divided by the ranks of the node."""
    w = 8
    spec = tiny_spec("llama", num_hidden_layers=2, **WIDER)
    s = _strategy(w, True, "amp-bf16")
    from trainfit.trace.distributed import _run_strategy

    plan = depth.plan_depth(spec, _run_strategy(s)[0], extrapolate=False, base_units=2)
    _counts, layout = plan.layouts[0]
    with fake_world(w) as mesh:
        run = run_layout_distributed(spec, s, plan, layout, mesh, steps=2, adamw_impl="fused")
    events = sorted(
        [(r.alloc_t, r.nbytes) for r in run.tracker.records if r.kind == tk.HOST]
        + [(r.free_t, -r.nbytes) for r in run.tracker.records if r.kind == tk.HOST and r.free_t is not None]
    )
    live = top = 0
    for _t, n in events:
        live += n
        top = max(top, live)
    closed = estimate_parallel(spec, s)
    per_node = min(w, s.parallelism.gpus_per_node)
    host = max(p.host_bytes for p in closed.phases) // per_node
    assert abs(host - top) <= 0.02 * top, (host, top)
