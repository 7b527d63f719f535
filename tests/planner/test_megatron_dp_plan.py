"""Megatron-LM's pure data parallelism (tensor 1 × pipeline 1, its distributed optimizer: ``--sharding zero1
--engine megatron``) is a plan: searched, estimated like ``trainfit estimate`` of the same flags, timed with Megatron's
own widths (fp32 main gradients reduce-scattered, 16-bit parameters all-gathered, no autocast) and exported as
arguments Megatron-LM runs (tests/export/test_megatron_args.py parses them with Megatron's own ``validate_args``)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from trainfit import estimate, get_gpu, load_model
from trainfit.arch.params import count_params
from trainfit.export import export_plan
from trainfit.planner.rank import search_plans
from trainfit.planner.space import candidates
from trainfit.planner.speed import SpeedInputs, nccl_nvlink_gbps, step_time, step_time_of
from trainfit.strategy import Engine, EngineOptions, Parallelism, Precision, Sharding, Strategy

SLUG, GPU, SEQ, BATCH = "llama-3.2-1b", "a100-sxm-40gb", 4096, 64


def _strategy_flags(s: Strategy) -> list[str]:
    """``trainfit estimate`` flags of a data-parallel Megatron plan's Strategy."""
    return [
        "--precision", s.precision.value, "--checkpointing", s.checkpointing.value, "--batch", str(s.micro_batch),
        "--grad-accum", str(s.grad_accum), "--seq", str(s.seq_len), "--gpus", str(s.world_size),
        "--sharding", s.sharding.value, "--engine", "megatron",
    ]  # fmt: skip


def test_a_data_parallel_megatron_plan_is_searched_estimated_and_timed_like_the_estimate(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tests.cli._cli_helper import run_cli

    spec, gpu = load_model(SLUG), get_gpu(GPU)
    r = search_plans(spec, gpu, gpus=8, seq_len=SEQ, global_batch=BATCH, top=8)
    dp = [
        p
        for p in r.plans
        if p.candidate.engine is Engine.MEGATRON and p.candidate.tensor == p.candidate.pipeline == 1 and p.gpus > 1
    ]
    assert dp, [p.changes for p in r.plans]
    for p in dp:
        s = p.strategy
        assert s.sharding is Sharding.ZERO1 and s.parallelism.data == p.gpus and s.global_batch == BATCH
        # the memory: the estimate of the same Strategy, and `trainfit estimate` with the same flags
        rep = estimate(spec, s, gpu=gpu, headroom=0.3, allocator=p.alloc_conf)
        assert rep.fit is not None and rep.fit.fits and rep.fit.required_bytes == p.required_bytes
        cli = run_cli(capsys, "estimate", SLUG, "--gpu", GPU, *_strategy_flags(s), "--json",
                      *(["--alloc-conf", p.alloc_conf] if p.alloc_conf else []))  # fmt: skip
        assert cli.code == 0, cli.err
        out = json.loads(cli.out)
        assert out["fits"] and out["required_bytes"] == p.required_bytes
        # the speed: the speed model of that Strategy, from the candidate's inputs as from the Strategy's
        assert p.speed == step_time(spec, s, gpu)
        kw = {"micro_batch": s.micro_batch, "grad_accum": s.grad_accum, "seq_len": SEQ, "gpus_per_node": 8}
        assert p.candidate.speed_inputs(**kw, spec=spec) == SpeedInputs.of(s, spec)
        # its export: Megatron's arguments at tensor/pipeline 1, the batch Megatron derives, no Trainer arguments
        ex = export_plan(spec, s)
        args = " ".join(ex.megatron_args)
        assert "--tensor-model-parallel-size 1" in args and "--pipeline-model-parallel-size 1" in args
        assert f"--global-batch-size {BATCH}" in args and f"--micro-batch-size {s.micro_batch}" in args
        assert "--use-distributed-optimizer" in args and "--sequence-parallel" not in args
        assert ex.training_arguments is None and ex.deepspeed_config is None
        assert "pretrain_gpt.py" in ex.launch and "CUDA_DEVICE_MAX_CONNECTIONS" not in ex.launch
        assert any("no training_args.json" in n and "Megatron-LM" in n for n in ex.notes)


def test_megatron_candidates_come_without_tensor_or_pipeline_parallelism_too() -> None:
    spec, gpu = load_model(SLUG), get_gpu(GPU)
    space = candidates(spec, gpu, gpus=8, gpus_per_node=8, global_batch=BATCH)
    mega = [c for c in space if c.engine is Engine.MEGATRON]
    worlds = {c.world for c in mega if c.tensor == c.pipeline == 1}
    assert worlds == {2, 4, 8}  # every many-GPU world (one GPU has no data parallelism to shard over)
    # one recipe per compute dtype: what `--bf16` runs (16-bit parameters, fp32 main gradients and master copy)
    assert {c.precision for c in mega} == {Precision.MASTER_BF16}


def test_megatron_is_timed_with_its_own_widths_whatever_the_recipe() -> None:
    """``--bf16`` is one run whichever 16-bit recipe the Strategy names: Megatron keeps fp32 main gradients
    (``accumulate_allreduce_grads_in_fp32``) over 16-bit parameters and runs no autocast, so its speed inputs are the
    same, and its distributed optimizer reduce-scatters 4-byte gradients and all-gathers 2-byte parameters: the ring
    volume (d − 1)/d · P · (4 + 2) per rank over NVLink."""
    spec, gpu = load_model(SLUG), get_gpu(GPU)
    d = 8
    base = Strategy(
        seq_len=SEQ, micro_batch=1, grad_accum=8, sharding="zero1", engine=EngineOptions(engine=Engine.MEGATRON),
        parallelism=Parallelism.for_gpus(d),
    )  # fmt: skip
    recipes = ("amp-bf16", "master-bf16", "pure-bf16")
    xs = [SpeedInputs.of(dataclasses.replace(base, precision=p), spec) for p in recipes]
    assert xs[0] == xs[1] == xs[2]
    x = xs[0]
    assert (x.grad_bits, x.weight_bits, x.autocast, x.fused_elementwise) == (32, 16, False, True)
    t = step_time_of(spec, x, gpu)
    assert t.comm_seconds == pytest.approx((d - 1) / d * count_params(spec) * (4 + 2) / (nccl_nvlink_gbps(gpu) * 1e9))


def test_megatron_has_no_per_op_sac() -> None:
    """torchtitan's per-op SAC is no Megatron-LM option (its recompute is whole layers or the attention core, which
    is all megatron_args.txt could say): the estimate refuses it there, and the search does not ask."""
    from trainfit.errors import StrategyError

    spec, gpu = load_model(SLUG), get_gpu(GPU)
    s = Strategy(
        seq_len=SEQ, micro_batch=1, checkpointing="sac", sharding="zero1", engine=EngineOptions(engine=Engine.MEGATRON),
        parallelism=Parallelism.for_gpus(8),
    )  # fmt: skip
    with pytest.raises(StrategyError, match="per-op SAC"):
        estimate(spec, s, gpu=gpu)
    space = candidates(spec, gpu, gpus=8, gpus_per_node=8, global_batch=BATCH)
    assert not [c for c in space if c.engine is Engine.MEGATRON and c.checkpointing.value == "sac"]
