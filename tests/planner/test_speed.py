"""The speed model against hand-written formulas (Kaplan 6·N, ring all-reduce, the pipeline bubble)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from trainfit import Strategy, get_gpu, load_model
from trainfit.arch.params import count_params
from trainfit.planner.space import candidates
from trainfit.planner.speed import (
    HBM_EFFICIENCY,
    MATMUL_EFFICIENCY,
    SpeedInputs,
    model_flops_per_token,
    step_time,
    step_time_of,
)
from trainfit.strategy import Parallelism, Sharding


def test_flops_per_token_is_six_n_plus_attention() -> None:
    spec = load_model("llama-3.1-8b")  # untied: the input embedding is a lookup
    n = count_params(spec) - spec.vocab_size * spec.hidden_size
    s = 4096
    attention = 3 * 2 * s * spec.num_heads * spec.head_dim * spec.num_layers  # 12·L·h·s per token, halved (causal)
    # norm weights are not matmuls but are in N: they are < 0.01% of it
    assert model_flops_per_token(spec, s) == pytest.approx(6 * n + attention, rel=1e-4)
    assert model_flops_per_token(spec, s, frozen_base=True) == pytest.approx((6 * n + attention) * 2 / 3, rel=1e-4)


def test_one_gpu_step_is_flops_over_peak_plus_activation_traffic() -> None:
    spec, gpu = load_model("llama-3.2-1b"), get_gpu("a100-sxm-80gb")
    s = Strategy(seq_len=2048, micro_batch=4, grad_accum=2)
    t = step_time(spec, s, gpu)
    tokens = 2048 * 4 * 2
    flops = model_flops_per_token(spec, 2048) * tokens
    traffic = 3 * 34 * spec.hidden_size * spec.num_layers * tokens
    expected = flops / (312e12 * MATMUL_EFFICIENCY) + traffic / (2039e9 * HBM_EFFICIENCY)
    assert gpu.memory_bandwidth_gbps == 2039
    assert t.step_seconds == pytest.approx(expected, rel=1e-9)
    assert t.exposed_comm_seconds == t.bubble_seconds == t.offload_seconds == 0
    assert t.tokens_per_second == pytest.approx(tokens / expected)


def test_checkpointing_adds_one_forward_of_the_blocks() -> None:
    spec, gpu = load_model("llama-3.2-1b"), get_gpu("h100-sxm-80gb")
    base = Strategy(seq_len=2048, micro_batch=2)
    none, full, sqrt = (
        step_time(spec, dataclasses.replace(base, checkpointing=c), gpu) for c in ("none", "full", "sqrt")
    )
    assert none.recompute_seconds == 0
    assert full.step_seconds == pytest.approx(none.step_seconds + full.recompute_seconds)
    assert sqrt.step_seconds == full.step_seconds
    # the recompute is about a third of the (model) compute: a forward of the blocks out of forward + backward
    assert 0.2 < full.recompute_seconds / none.compute_seconds < 0.34


def test_ddp_all_reduce_is_the_ring_volume_over_nvlink() -> None:
    spec, gpu = load_model("llama-3.2-1b"), get_gpu("a100-sxm-80gb")
    s = Strategy(seq_len=1024, micro_batch=1, sharding="ddp", parallelism=Parallelism.for_gpus(8))
    t = step_time(spec, s, gpu)
    volume = 2 * 7 / 8 * count_params(spec) * 4  # amp-bf16 keeps fp32 gradients
    assert t.comm_seconds == pytest.approx(volume / 300e9)


def test_pipeline_bubble_is_p_minus_one_over_m() -> None:
    spec, gpu = load_model("llama-3.1-8b"), get_gpu("h100-sxm-80gb")
    for m in (4, 8, 16):
        x = SpeedInputs(pipeline=4, seq_len=4096, micro_batch=1, grad_accum=m, grad_bits=16, weight_bits=16)
        t = step_time_of(spec, x, gpu)
        assert t.bubble_seconds == pytest.approx(t.compute_seconds * 3 / m)


def test_more_gpus_over_network_cost_more_than_over_nvlink() -> None:
    spec, gpu = load_model("llama-3.1-8b"), get_gpu("h100-sxm-80gb")
    x = SpeedInputs(data=16, seq_len=4096, micro_batch=1, grad_accum=1, sharding=Sharding.FSDP)
    slow = dataclasses.replace(x, gpus_per_node=8)
    fast = dataclasses.replace(x, gpus_per_node=16)
    assert step_time_of(spec, slow, gpu).comm_seconds > step_time_of(spec, fast, gpu).comm_seconds


def test_candidate_speed_inputs_match_the_strategy() -> None:
    spec, gpu = load_model("llama-3.2-1b"), get_gpu("a100-sxm-80gb")
    space = candidates(spec, gpu, gpus=16, gpus_per_node=8, global_batch=64, allow=())
    for c in random.Random(0).sample(space, 60):
        accum = 64 // c.data
        s = c.strategy(micro_batch=1, grad_accum=accum, seq_len=1024, gpus_per_node=8)
        assert SpeedInputs.of(s) == c.speed_inputs(micro_batch=1, grad_accum=accum, seq_len=1024, gpus_per_node=8)
