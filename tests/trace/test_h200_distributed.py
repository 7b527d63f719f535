"""FSDP2 and torch DDP at world size 1 on a real GPU (one H200, a one-rank NCCL process group, torch 2.11 + CUDA 13),
pinned: the H200 session of 2026-12-04, second run (``benchmarks/h200/2026-12-04b/session-distributed-rerun.jsonl``,
``benchmarks/gpu_session.py --sections distributed``; docs/accuracy.md). Each case ran alone in a fresh process,
qwen2.5-0.5b, pure bf16, 2 × 1024, three steps; the measured phases are step 2's ``max_memory_allocated``. The
prediction is today's ``estimate(--gpus 1 --sharding fsdp|ddp)`` with the session's torch release; nothing here is
tuned to the measurement.

DDP: the pinned case is ``q05-ddp-w1-pure-b2s1024``, the run where NCCL's stash of the first iteration's all-reduce
still held the old bucket when the reducer rebuilt its buckets (ProcessGroupNCCL ``collective``'s TensorShelf,
released by ``Work::wait``, which the reducer never calls), so step 2's forward and backward held it as well —
what trainfit models (``analytic.parallel`` ``ddp_stash_bytes``; the trace's ``_NcclShelf``). The
``-pause300ms`` variant paused 0.3 s after each optimizer step, NCCL's watchdog (every 100 ms) released the stash
first, and step 2 ran without it: the analytic model is +9.3% / +8.7% there by construction, a timing trainfit does
not model, so that case is not held to the tolerance (it is checked to be the stash's size apart instead)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests._gpu_truth import session_measured
from trainfit import Strategy, estimate

SESSION = (
    Path(__file__).resolve().parents[2] / "benchmarks" / "h200" / "2026-12-04b" / "session-distributed-rerun.jsonl"
)
PHASES = ("forward", "backward", "optimizer-step")
#: forward/backward, and the optimizer step (the analytic step was −1.15% under DDP: the step's few small fp32
#: temporaries of the foreach AdamW kernels it does not count)
TOLERANCE = {"forward": 0.01, "backward": 0.01, "optimizer-step": 0.015}
CASES = {"q05-fsdp-w1-pure-b2s1024": "fsdp", "q05-ddp-w1-pure-b2s1024": "ddp"}
TORCH = "2.11"  # the session's torch: cuBLASLt's own workspace (trainfit.allocator.workspaces)


def _measured(case: str) -> dict[str, Any]:
    return session_measured(SESSION, case)


def _strategy(sharding: str) -> Strategy:
    return Strategy(precision="pure-bf16", sharding=sharding, micro_batch=2, seq_len=1024)


def _report(sharding: str, method: str) -> Any:
    return estimate(
        "qwen2.5-0.5b",
        _strategy(sharding),
        method=method,
        gpu="h200-sxm-141gb",
        torch_version=TORCH,
        search_micro_batch=False,
        fixes=False,
    )


def _assert_phases(report: Any, measured: dict[str, int]) -> None:
    for ph in PHASES:
        got = report.phase(ph).total_bytes
        assert abs(got - measured[ph]) <= TOLERANCE[ph] * measured[ph], (ph, got, measured[ph])


@pytest.mark.parametrize("case", list(CASES))
def test_analytic_agrees_with_the_h200_at_world_size_1(case: str) -> None:
    """Recorded: FSDP2 −0.13 / −0.12 / −0.20%, DDP +0.01 / +0.01 / +0.05% (forward / backward / step), within 0.3%:
    the rank's stream counts the allocator's blocks above the tensors' requests since 2026-12-05
    (``Component.ALLOCATOR_ROUNDING``, rank_events.simulate_rank_with_rounding); before, FSDP2 −0.73 / −0.70 / −0.61%
    and DDP −0.51 / −0.49 / −1.15%. And the memory outside the allocator (device used − reserved at the end: CUDA
    context, kernels and NCCL's own buffers) within 1% — the NCCL term is this session's predecessor's one-rank
    measurement (DESIGN §4.1)."""
    m = _measured(case)
    r = _report(CASES[case], "analytic")
    for ph in PHASES:
        got, want = r.phase(ph).total_bytes, m["phases"][ph]
        assert abs(got - want) <= 0.003 * want, (ph, got, want)
    assert r.overhead.outside_allocator_bytes == pytest.approx(m["outside_allocator"], rel=0.01)


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=[pytest.mark.slow] if CASES[c] == "fsdp" else []) for c in CASES],  # FSDP2: ~6 s
)
def test_trace_agrees_with_the_h200_at_world_size_1(case: str) -> None:
    """The real ``fully_shard`` / ``DistributedDataParallel`` traced on the fake process group, with the blocks above
    the traced tensors from the rank's analytic stream (as its reserve, ``distributed.with_rank_reserve``): recorded
    FSDP2 −0.13 / −0.12 / −0.20%, DDP +0.01 / +0.01 / +0.05% (without the blocks −0.73 / −0.70 / −0.61% and −0.51 /
    −0.49 / −1.15%)."""
    pytest.importorskip("torch")
    r, m = _report(CASES[case], "trace"), _measured(case)["phases"]
    for ph in PHASES:
        assert abs(r.phase(ph).total_bytes - m[ph]) <= 0.003 * m[ph], (ph, r.phase(ph).total_bytes, m[ph])


def test_the_paused_ddp_run_lacks_exactly_the_stashed_bucket() -> None:
    """With the 0.3 s pause NCCL released the stash before the rebuild: step 2's forward and backward are the held
    run's less the first iteration's single bucket of every gradient (pure bf16: 2 B per parameter, 494,032,768
    parameters: 988,065,536 B; measured 988,065,792, the allocator's 512-byte rounding); the step, where no bucket is
    stashed, is unchanged. That is why trainfit's DDP model, which keeps the stash, is pinned to the held run."""
    held, freed = _measured("q05-ddp-w1-pure-b2s1024"), _measured("q05-ddp-w1-pure-b2s1024-pause300ms")
    bucket = 2 * held["params"]
    for ph in ("forward", "backward"):
        assert 0 <= held["phases"][ph] - freed["phases"][ph] - bucket < 512, ph
    assert held["phases"]["optimizer-step"] == freed["phases"]["optimizer-step"]
