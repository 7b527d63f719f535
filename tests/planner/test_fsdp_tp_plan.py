"""2-D FSDP2 × DTensor tensor parallelism in `trainfit plan`: where it is proposed, what the speed model charges
for it (the ring volumes of the plan's collectives, by hand), and that its plans are the estimate's own numbers
for the very flags they print."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from trainfit import estimate, get_gpu, load_model
from trainfit.planner.rank import search_plans
from trainfit.planner.space import candidates
from trainfit.planner.speed import (
    HBM_EFFICIENCY,
    SpeedInputs,
    loss_bytes_per_token,
    nccl_nvlink_gbps,
    step_time,
    step_time_of,
)
from trainfit.strategy import Engine, EngineOptions, Parallelism, Sharding, Strategy


def _two_d(space: list) -> list:  # type: ignore[type-arg]
    return [c for c in space if c.tensor > 1 and c.engine is Engine.TORCH]


def test_2d_candidates_are_within_a_node_and_divide_the_model() -> None:
    spec, gpu = load_model("llama-3.1-8b"), get_gpu("h100-sxm-80gb")  # 32 heads, 8 k/v heads, MLP 14336
    space = candidates(spec, gpu, gpus=32, gpus_per_node=8, global_batch=64)
    two_d = _two_d(space)
    assert {c.tensor for c in two_d} == {2, 4, 8}
    for c in two_d:
        assert c.sharding is Sharding.FSDP and c.pipeline == 1 and c.offload == "none"
        assert c.data * c.tensor == c.world and 64 % c.data == 0
    assert {c.world for c in two_d if c.tensor == 8} == {8, 16, 32}
    # 4 GPUs per node: TP 8 would cross nodes
    small = candidates(spec, gpu, gpus=32, gpus_per_node=4, global_batch=64)
    assert {c.tensor for c in _two_d(small)} == {2, 4}


@pytest.mark.parametrize("slug", ["gpt2", "qwen2.5-0.5b", "llama-3.2-1b"])
def test_no_2d_candidates_where_the_estimate_refuses_dtensor_tp(slug: str) -> None:
    """gpt2 (fused qkv, tied), Qwen2.5-0.5B and Llama 3.2 1B (tied embeddings): the DTensor plan is not modelled."""
    spec, gpu = load_model(slug), get_gpu("a100-sxm-80gb")
    assert not _two_d(candidates(spec, gpu, gpus=16, gpus_per_node=8, global_batch=32))
    probe = Strategy(
        sharding="fsdp",
        engine=EngineOptions(engine=Engine.TORCH),
        parallelism=Parallelism.for_gpus(16, tensor=2, sequence_parallel=True),
    )
    with pytest.raises(Exception):  # noqa: B017 — the estimate's own refusal (StrategyError), whatever the reason
        estimate(spec, probe, gpu="a100-sxm-80gb", fixes=False)


def test_2d_candidates_memory_equals_the_estimate() -> None:
    spec, gpu = load_model("llama-3.1-8b"), get_gpu("a100-sxm-40gb")
    from tests.planner.test_rank import _search

    s = _search("llama-3.1-8b", "a100-sxm-40gb", 32, 2048)
    space = _two_d(candidates(spec, gpu, gpus=16, gpus_per_node=8, global_batch=32))
    for c in random.Random(4).sample(space, 12):
        st = s.strategy(c, 1)
        need = s.need(st, exact=True)  # a simulated reserve that does not fit: the whole requirement
        mine = None if need is None else need[0]
        alloc = "" if need is None else need[1].to_env()  # the allocator the planner's number holds for
        try:
            rep = estimate(spec, st, gpu=gpu, headroom=0.3, search_micro_batch=False, fixes=False, allocator=alloc)
        except Exception as exc:  # per-op SAC with TP: refused, and the planner drops it too
            assert mine is None, exc
            continue
        assert rep.fit is not None and mine == rep.fit.required_bytes
        assert 0 < s.lower_bound(st) <= mine


def test_the_dtensor_plan_ends_cost_their_ring_volumes() -> None:
    """DTensor TP's embedding (all-reduce, or reduce-scatter + all-gather with SP), the head's input (all-gather +
    reduce-scatter) and the logits all-gather for the model's own loss: 2·2·(t−1)/t·b·s·h + (t−1)/t·b·s·V bytes in
    the compute dtype per micro-step, over NVLink — what Megatron's vocabulary-parallel loss does not pay (its
    ends are left out). Their exposure: tests/planner/test_speed.py (async TP vs eager)."""
    spec, gpu = load_model("llama-3.1-8b"), get_gpu("h100-sxm-80gb")
    mk = dict(seq_len=4096, micro_batch=2, grad_accum=3, tensor=4, data=2, sharding=Sharding.FSDP, compute_bits=16)
    dtensor = SpeedInputs(**mk, dtensor_tp=True, vocab_size=spec.vocab_size)  # type: ignore[arg-type]
    # Megatron without sequence parallelism moves the same bytes in its layers (all-reduces; with SP it all-gathers
    # each column-parallel input once more in backward); it overlaps some of them, so compare the traffic
    megatron = SpeedInputs(**mk, plain_tp=True)  # type: ignore[arg-type]
    t_d, t_m = step_time_of(spec, dtensor, gpu), step_time_of(spec, megatron, gpu)
    b, s, h, v, t, accum = 2, 4096, spec.hidden_size, spec.vocab_size, 4, 3
    volume = (2 * 2 * (t - 1) / t * b * s * h * 2 + (t - 1) / t * b * s * v * 2) * accum
    assert t_d.comm_seconds - t_m.comm_seconds == pytest.approx(volume / (nccl_nvlink_gbps(gpu) * 1e9))
    # every DTensor rank runs the whole loss over the gathered logits, Megatron's vocabulary-parallel loss its 1/t
    loss = loss_bytes_per_token(spec, dtensor) * b * s * accum * (1 - 1 / t)
    hbm = gpu.memory_bandwidth_gbps * 1e9 * HBM_EFFICIENCY
    assert t_d.compute_seconds - t_m.compute_seconds == pytest.approx(loss / hbm)


def test_2d_fsdp_traffic_crosses_nodes_only_when_dp_does() -> None:
    """TP innermost: with 8 GPUs per node and TP 8, every data-parallel peer is on another node (the network);
    with 16 GPUs per node the same 2 × 8 run stays on NVLink. The FSDP2 volume is the 1-D one over P/t."""
    spec, gpu = load_model("llama-3.1-8b"), get_gpu("h100-sxm-80gb")
    base = Strategy(
        precision="pure-bf16",
        seq_len=4096,
        micro_batch=1,
        sharding="fsdp",
        engine=EngineOptions(engine=Engine.TORCH),
        parallelism=Parallelism.for_gpus(16, tensor=8, sequence_parallel=True, gpus_per_node=8),
    )
    one_node = dataclasses.replace(
        base, parallelism=Parallelism.for_gpus(16, tensor=8, sequence_parallel=True, gpus_per_node=16)
    )
    x_net, x_nvl = SpeedInputs.of(base, spec), SpeedInputs.of(one_node, spec)
    assert x_net.dtensor_tp and x_net.vocab_size == spec.vocab_size
    from trainfit.arch.params import count_params

    # pure-bf16 FSDP2 (no mixed-precision policy: bf16 gathers in forward and backward, bf16 reduce-scatter) over
    # a ring of 2, each rank holding P/8: the 1-D volume over the TP-local parameters; under TP the root (token
    # table, final norm, head) is gathered once, in forward only (fsdp_units.gathered_once_fraction)
    p8 = count_params(spec) / 8
    once = x_net.fsdp_gathered_once
    assert once == pytest.approx(2 * spec.vocab_size * spec.hidden_size / count_params(spec), rel=1e-3)
    volume = (2 - once) * (1 / 2) * p8 * 2 + (1 / 2) * p8 * 2
    for x, link in ((x_net, 50e9 * 24 / 25), (x_nvl, nccl_nvlink_gbps(gpu) * 1e9)):  # NCCL's bus bandwidths
        tp_only = dataclasses.replace(x, data=1, sharding=Sharding.NONE)
        fsdp = step_time_of(spec, x, gpu).comm_seconds - step_time_of(spec, tp_only, gpu).comm_seconds
        assert fsdp == pytest.approx(volume / link)
    assert step_time(spec, base, gpu).comm_seconds > step_time(spec, one_node, gpu).comm_seconds


def test_a_2d_plan_is_the_estimate_of_its_printed_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """Llama 3.1 8B, sequence 8192, on 4 × A100-40GB: 1-D FSDP2 needs CPU offload; 2-D FSDP2 × TP fits without.
    The plan's flags, given to `trainfit estimate`, give the plan's own per-GPU requirement."""
    from tests.cli._cli_helper import run_cli

    spec, gpu = load_model("llama-3.1-8b"), get_gpu("a100-sxm-40gb")
    r = search_plans(spec, gpu, gpus=4, seq_len=8192, global_batch=8, top=3)
    two_d = [p for p in r.plans if p.strategy.parallelism.tensor > 1]
    assert two_d and r.plans[0] is two_d[0], [p.changes for p in r.plans]
    p = two_d[0]
    assert p.strategy.engine.engine is Engine.TORCH and p.strategy.parallelism.sequence_parallel
    flags = [f for change in p.changes for f in change.split()]
    assert "--engine" in flags and "--tp" in flags and "--sharding" in flags
    # its reserve is simulated (FsdpTpHooks): the allocator setting the plan needs, as the estimate spells it
    flags = [f"--alloc-conf={f.split('=', 1)[1]}" if f.startswith("PYTORCH_CUDA_ALLOC_CONF=") else f for f in flags]
    baseline = ["--gpus", "4", "--batch", "2"]  # DDP over the 4 GPUs, 8 / 4 sequences each: what the changes are from
    flags = [*baseline, *flags]  # (a repeated option: the last one counts)
    res = run_cli(capsys, "estimate", "llama-3.1-8b", "--gpu", "a100-sxm-40gb", "--seq", "8192", *flags, "--json")
    assert res.code == 0, res.err
    out = json.loads(res.out)
    assert out["required_bytes"] == p.required_bytes and out["fits"]


def test_more_gpus_never_make_the_best_plan_slower_with_2d() -> None:
    spec, gpu = load_model("llama-3.1-8b"), get_gpu("a100-sxm-40gb")
    times = []
    for n in (2, 4, 8):
        r = search_plans(spec, gpu, gpus=n, seq_len=8192, global_batch=8, top=1)
        assert r.plans, n
        times.append(r.plans[0].speed.step_seconds)
    assert times == sorted(times, reverse=True)
