"""Analytic vs trace for one rank of DTensor tensor parallelism (``--engine torch --tp N``, ± sequence
parallelism), on tiny Llama configs. The trace runs the real ``parallelize_module`` plan
(trainfit.trace.tensor_parallel) on PyTorch's fake process group; the analytic model
(trainfit.analytic.parallel ``_torch_tp``) is closed-form. Each phase must agree within 3%.
``python benchmarks/agreement_distributed.py`` prints the same at catalog sizes."""

from __future__ import annotations

import pytest

from trainfit.errors import StrategyError
from trainfit.result import Component, Phase
from trainfit.strategy import EngineOptions, Parallelism, Strategy

from .conftest import tiny_spec

pytest.importorskip("torch")
from trainfit.analytic.parallel import estimate_parallel
from trainfit.trace.distributed import trace_distributed

TOLERANCE = 0.03
#: Wide enough that grad-norm clipping's per-tensor 512-byte norms (not modelled) stay small, with heads and
#: k/v heads that 4 divides.
WIDER = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "vocab_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}

# (family, tp, dp, sequence parallel, precision, checkpointing)
CELLS = [
    ("llama", 2, 1, False, "amp-bf16", "none"),
    ("llama", 2, 1, True, "amp-bf16", "none"),
    ("llama", 4, 1, False, "amp-bf16", "none"),
    ("llama", 4, 1, True, "amp-bf16", "none"),
    ("llama", 2, 4, True, "amp-bf16", "none"),  # W = 8: DP 4 without sharding, each rank as in TP alone
    ("llama", 2, 1, True, "pure-bf16", "none"),  # no autocast: q/k/v share one all-gathered norm output
    ("llama", 4, 1, False, "fp32", "none"),  # fp32 logits: the all-gather is the forward's worst moment
    ("llama", 2, 1, True, "amp-bf16", "full"),  # the kept segment inputs are sequence-sharded
    ("qwen2", 2, 1, True, "amp-bf16", "none"),  # q/k/v biases sharded with their weights
]


def _strategy(tp: int, dp: int, sp: bool, precision: str, ckpt: str = "none") -> Strategy:
    return Strategy(
        precision=precision,
        checkpointing=ckpt,
        parallelism=Parallelism(data=dp, tensor=tp, sequence_parallel=sp),
        engine=EngineOptions(engine="torch"),
        micro_batch=2,
        seq_len=128,
    )


@pytest.mark.parametrize(
    ("family", "tp", "dp", "sp", "precision", "ckpt"),
    [pytest.param(*c, id=f"{c[0]}-tp{c[1]}-dp{c[2]}-{'sp' if c[3] else 'nosp'}-{c[4]}-ckpt-{c[5]}") for c in CELLS],
)
def test_rank_agrees_with_trace(family: str, tp: int, dp: int, sp: bool, precision: str, ckpt: str) -> None:
    spec = tiny_spec(family, **WIDER, tie_word_embeddings=False)
    s = _strategy(tp, dp, sp, precision, ckpt)
    traced = trace_distributed(spec, s)
    closed = estimate_parallel(spec, s)
    for a, t in zip(closed.phases, traced.phases, strict=True):
        assert abs(a.total_bytes - t.total_bytes) <= TOLERANCE * t.total_bytes, (
            a.phase,
            a.total_bytes,
            t.total_bytes,
        )
    step_a, step_t = closed.phase(Phase.OPTIMIZER_STEP), traced.phase(Phase.OPTIMIZER_STEP)
    for c in (Component.WEIGHTS, Component.OPTIMIZER_STATES, Component.GRADIENTS):
        assert abs(step_a.get(c) - step_t.get(c)) <= 0.01 * step_t.get(c) + 4096, c


def test_sequence_parallel_splits_the_norms_not_the_matmul_inputs() -> None:
    """SP removes from each layer what the traced norms saved, (1 − 1/tp) of it, and nothing else: the trace's
    activation saving from SP equals the analytic model's, which counts the norms alone."""
    spec = tiny_spec("llama", **WIDER)
    t = {sp: trace_distributed(spec, _strategy(2, 1, sp, "amp-bf16")) for sp in (False, True)}
    a = {sp: estimate_parallel(spec, _strategy(2, 1, sp, "amp-bf16")) for sp in (False, True)}
    saved_t = t[False].phase(Phase.FORWARD).get(Component.ACTIVATIONS) - t[True].phase(Phase.FORWARD).get(
        Component.ACTIVATIONS
    )
    saved_a = a[False].phase(Phase.FORWARD).get(Component.ACTIVATIONS) - a[True].phase(Phase.FORWARD).get(
        Component.ACTIVATIONS
    )
    assert saved_t > 0
    assert abs(saved_a - saved_t) <= 0.03 * saved_t, (saved_a, saved_t)


@pytest.mark.slow
def test_depth_extrapolation_matches_full_depth() -> None:
    """Traced at 1 and 2 layers and extrapolated to 5 = traced at 5 layers."""
    spec = tiny_spec("llama", num_hidden_layers=5, **WIDER)
    s = _strategy(2, 1, True, "amp-bf16")
    ext = trace_distributed(spec, s)
    full = trace_distributed(spec, s, extrapolate=False)
    for a, t in zip(ext.phases, full.phases, strict=True):
        assert abs(a.total_bytes - t.total_bytes) <= 0.01 * t.total_bytes, (a.phase, a.total_bytes, t.total_bytes)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"engine": EngineOptions(engine="megatron")}, "Megatron"),
        ({"sharding": "fsdp"}, "not modelled yet"),
    ],
)
def test_refusals(kwargs: dict[str, object], needle: str) -> None:
    spec = tiny_spec("llama", **WIDER)
    base = {"parallelism": Parallelism(data=2, tensor=2), "engine": EngineOptions(engine="torch")} | kwargs
    with pytest.raises(StrategyError, match=needle):
        trace_distributed(spec, Strategy(**base))  # type: ignore[arg-type]


def test_pipeline_is_refused() -> None:
    spec = tiny_spec("llama", **WIDER)
    with pytest.raises(StrategyError, match="pipeline"):
        trace_distributed(spec, Strategy(parallelism=Parallelism(tensor=2, pipeline=2)))
