"""ZeRO-Offload's gradient traffic with gradient accumulation: what DeepSpeed's stage_1_and_2.py moves over PCIe
(``copy_grads_in_partition`` → ``async_accumulate_grad_in_cpu_via_gpu``: the running sum kept on the host, added on
the GPU), not once per step — derived from the speed model's inputs, not hard-coded."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from trainfit import get_gpu, load_model
from trainfit.arch.params import count_params
from trainfit.planner.speed import SpeedInputs, step_time_of, zero_offload_gradient_copies
from trainfit.strategy import Sharding

SPEC, GPU = "llama-3.1-8b", "h100-sxm-80gb"


def _inputs(sharding: Sharding, accum: int, compute_bits: int = 16) -> SpeedInputs:
    return SpeedInputs(
        data=8, seq_len=4096, micro_batch=1, grad_accum=accum, sharding=sharding, offload_optimizer=True,
        compute_bits=compute_bits, compute_dtype="bf16" if compute_bits == 16 else "fp32",
        grad_bits=compute_bits, weight_bits=compute_bits,
    )  # fmt: skip


#: copies of the gradient partition per step beyond the boundary's, by the mechanism (k micro-steps)
COPIES: dict[Sharding, Callable[[int], int]] = {
    Sharding.ZERO2: lambda k: k + (k - 1),  # down every micro-step, up after the first
    Sharding.ZERO1: lambda k: 1 + 1,  # one reduction, at the boundary (micro_step_id = k - 1 > 0): down and up
}


@pytest.mark.parametrize("compute_bits", [16, 32])
@pytest.mark.parametrize("sharding", list(COPIES))
def test_zero_offload_moves_the_gradient_partition_per_micro_step(sharding: Sharding, compute_bits: int) -> None:
    """ZeRO-2 reduces every micro-step and round-trips the host sum: k copies down and k − 1 up of the rank's
    partition in the model's dtype; ZeRO-1 reduces once, at the boundary, where ``micro_step_id > 0``: one each way.
    One micro-step copies only the boundary's fp32 gradients. The rest of the step does not change per micro-step
    count beyond compute: the step time grows by the compute and exactly these copies over PCIe, not overlapped."""
    spec, gpu = load_model(SPEC), get_gpu(GPU)
    shard = count_params(spec) / 8
    pcie = gpu.pcie_gbps * 1e9
    one = step_time_of(spec, _inputs(sharding, 1, compute_bits), gpu)
    for k in (2, 4, 8):
        t = step_time_of(spec, _inputs(sharding, k, compute_bits), gpu)
        extra = COPIES[sharding](k) * shard * compute_bits / 8 / pcie
        assert sum(zero_offload_gradient_copies(sharding, k)) == COPIES[sharding](k)
        assert t.offload_seconds - one.offload_seconds == pytest.approx(extra, rel=1e-9)
        grown = t.compute_seconds - one.compute_seconds + t.exposed_comm_seconds - one.exposed_comm_seconds
        assert t.step_seconds - one.step_seconds == pytest.approx(grown + extra, rel=1e-9)
    assert zero_offload_gradient_copies(sharding, 1) == (0, 0)


def test_the_boundary_copy_is_fp32_whatever_the_recipe() -> None:
    """At the boundary ``async_inplace_copy_grad_to_fp32_buffer_from_gpu`` casts the partition to fp32 on the GPU and
    copies that: 4 B per element down, then the 16-bit parameters back (2 B) — with master-bf16's 16-bit gradients
    as with amp-bf16's fp32 ones."""
    spec, gpu = load_model(SPEC), get_gpu(GPU)
    x = _inputs(Sharding.ZERO2, 1)
    amp = dataclasses.replace(x, grad_bits=32, weight_bits=32)
    assert step_time_of(spec, x, gpu).offload_seconds == pytest.approx(step_time_of(spec, amp, gpu).offload_seconds)
