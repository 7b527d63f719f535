"""Analytic vs trace for one rank of a many-GPU run: FSDP2 (both reshard settings), HSDP (2 × 8) and DDP
(both bucket settings) at W ∈ {2, 8, 16}, on tiny configs. The trace runs the real ``fully_shard`` and
``DistributedDataParallel`` on PyTorch's fake process group; the analytic model is closed-form. Each
phase must agree within 3%. ``python benchmarks/agreement_distributed.py`` prints the same at catalog sizes."""

from __future__ import annotations

import pytest

from trainfit.result import Component, Phase
from trainfit.strategy import EngineOptions, Parallelism, Strategy

from .conftest import tiny_spec

pytest.importorskip("torch")
from trainfit.analytic.parallel import estimate_parallel
from trainfit.trace.distributed import trace_distributed

TOLERANCE = 0.03
#: Wider than the other tiny configs: with hidden 64 the per-tensor 512-byte blocks of grad-norm clipping
#: (one fp32 norm per gradient tensor, not modelled) are ~5% of a rank's optimizer step.
WIDER = {"hidden_size": 128, "intermediate_size": 256, "vocab_size": 512}

CELLS = [
    ("llama", "fsdp", 2, True, "amp-bf16"),
    ("llama", "fsdp", 8, True, "amp-bf16"),
    ("llama", "fsdp", 8, False, "amp-bf16"),
    ("qwen2", "fsdp", 2, False, "fp32"),
    ("llama", "hsdp", 16, True, "amp-bf16"),  # 2 nodes × 8: sharded over 8, replicated over 2
    ("llama", "ddp", 2, False, "amp-bf16"),
    ("qwen2", "ddp", 8, True, "amp-bf16"),
]


def _strategy(sharding: str, w: int, flag: bool, precision: str) -> Strategy:
    return Strategy(
        precision=precision,
        parallelism=Parallelism(data=w),
        sharding=sharding,
        micro_batch=2,
        seq_len=128,
        # flag: reshard_after_forward for FSDP2, gradient_as_bucket_view for DDP
        engine=EngineOptions(
            reshard_after_forward=flag if sharding != "ddp" else True,
            gradient_as_bucket_view=flag if sharding == "ddp" else False,
        ),
    )


@pytest.mark.parametrize(
    ("family", "sharding", "w", "flag", "precision"),
    [pytest.param(*c, id="-".join(map(str, c))) for c in CELLS],
)
def test_rank_agrees_with_trace(family: str, sharding: str, w: int, flag: bool, precision: str) -> None:
    spec = tiny_spec(family, **WIDER)
    s = _strategy(sharding, w, flag, precision)
    traced = trace_distributed(spec, s)
    closed = estimate_parallel(spec, s)
    for a, t in zip(closed.phases, traced.phases, strict=True):
        assert abs(a.total_bytes - t.total_bytes) <= TOLERANCE * t.total_bytes, (
            a.phase,
            a.total_bytes,
            t.total_bytes,
        )
    step_a, step_t = closed.phase(Phase.OPTIMIZER_STEP), traced.phase(Phase.OPTIMIZER_STEP)
    for c in (Component.WEIGHTS, Component.OPTIMIZER_STATES):
        assert abs(step_a.get(c) - step_t.get(c)) <= 0.01 * step_t.get(c) + 4096, c


def test_fsdp_depth_extrapolation_matches_full_depth() -> None:
    """Traced at 2 and 3 layers and extrapolated to 5 = traced at 5 layers (FSDP2's transient buffers held)."""
    spec = tiny_spec("llama", num_hidden_layers=5, **WIDER)
    s = _strategy("fsdp", 4, True, "amp-bf16")
    ext = trace_distributed(spec, s)
    full = trace_distributed(spec, s, extrapolate=False)
    assert ext.details is not None and full.details is not None
    for a, t in zip(ext.phases, full.phases, strict=True):
        assert abs(a.total_bytes - t.total_bytes) <= 0.01 * t.total_bytes, (a.phase, a.total_bytes, t.total_bytes)
