"""The speed model's collectives at the rates NCCL reaches (its maintainers' published bus bandwidths) and FSDP2's
collectives that no compute hides (the first all-gather and the last reduce-scatter of every micro-step)."""

from __future__ import annotations

import dataclasses

import pytest

from trainfit import Strategy, get_gpu, load_model
from trainfit.arch.params import count_params, inventory
from trainfit.fsdp_units import edge_units_fraction
from trainfit.planner.speed import (
    NCCL_NETWORK_EFFICIENCY,
    SpeedInputs,
    nccl_network_gbps,
    nccl_nvlink_gbps,
    step_time,
    step_time_of,
)
from trainfit.strategy import Parallelism, Sharding


def test_nccl_reaches_its_maintainers_bus_bandwidth_not_the_line_rate() -> None:
    """A100: ~230 GB/s busbw of 12 NVLinks × 25 GB/s (NVIDIA/nccl-tests issue 149); H100 and H200 (NVLink 4):
    370 of 450 GB/s (NVIDIA/nccl-tests issue 212, NVIDIA/nccl issue 1442); other NVLink parts the 128-byte payload's
    20 of 25; AMD's Infinity Fabric its line rate (no figure); PCIe-only parts have none. Across nodes 24 of 25
    GB/s (NVIDIA/nccl issue 412)."""
    assert nccl_nvlink_gbps(get_gpu("a100-sxm-80gb")) == pytest.approx(230)
    assert nccl_nvlink_gbps(get_gpu("h100-sxm-80gb")) == pytest.approx(370)
    assert nccl_nvlink_gbps(get_gpu("h200-sxm-141gb")) == pytest.approx(370)
    b200 = get_gpu("b200-sxm-180gb")
    assert b200.nvlink_gbps is not None
    assert nccl_nvlink_gbps(b200) == pytest.approx(b200.nvlink_gbps * 0.8)
    mi300x = get_gpu("mi300x")
    assert nccl_nvlink_gbps(mi300x) == mi300x.nvlink_gbps
    assert nccl_nvlink_gbps(get_gpu("rtx-4090")) is None
    assert pytest.approx(0.96) == NCCL_NETWORK_EFFICIENCY
    assert nccl_network_gbps(25.0) == pytest.approx(24.0)


def test_an_all_reduce_across_nodes_is_slower_than_over_nvlink_by_the_bus_bandwidths_ratio() -> None:
    """DDP on 8 H100s of one node all-reduces 2·7/8 of the gradients at 370 GB/s; on 16 H100s over two nodes
    2·15/16 of them at 0.96 × 50 GB/s (400 Gb/s NDR per GPU, the default network)."""
    spec, gpu = load_model("llama-3.2-1b"), get_gpu("h100-sxm-80gb")
    grads = count_params(spec) * 4  # amp-bf16: fp32 gradients

    def comm(gpus: int) -> float:
        s = Strategy(seq_len=1024, micro_batch=1, sharding="ddp", parallelism=Parallelism.for_gpus(gpus))
        return step_time(spec, s, gpu).comm_seconds

    nvlink, network = comm(8), comm(16)
    assert nvlink == pytest.approx(2 * 7 / 8 * grads / 370e9)
    assert network == pytest.approx(2 * 15 / 16 * grads / 48e9)
    assert network / nvlink == pytest.approx((15 / 16) / (7 / 8) * 370 / 48)


def test_the_edge_units_are_the_root_the_embeddings_unit_and_one_layer() -> None:
    """``--fsdp-wrap auto``: Llama 3.1 8B (untied) gets units — the first forward waits for the token table's unit
    and layer 0, the head's [final norm, head] unit is prefetched; under TP (root wrapping) the root holds the
    table, the final norm and the head, all gathered before the first forward."""
    spec = load_model("llama-3.1-8b")
    inv = inventory(spec)
    total = count_params(spec)
    layer = sum(g.params for g in inv.layers) / spec.num_layers
    table = spec.vocab_size * spec.hidden_size
    assert edge_units_fraction(spec, 1) == pytest.approx((table + layer) / total)
    outside = sum(x.numel for x in inv.model_tensors)  # table, final norm, head
    assert edge_units_fraction(spec, 8) == pytest.approx((outside + layer) / total)


@pytest.mark.parametrize("data", [2, 4, 8])
def test_fsdp_exposes_its_first_all_gather_and_last_reduce_scatter_each_micro_step(data: int) -> None:
    """Long micro-steps (2 × 8192 tokens of Llama 3.1 8B per H100) hide every other FSDP2 collective; the edge units'
    all-gather (bf16 under master-bf16's policy) and reduce-scatter (fp32) are exposed every micro-step:
    accum × (d−1)/d × P·share × (2 + 4) B / 370 GB/s — growing with the data degree as the ring's (d−1)/d."""
    spec, gpu = load_model("llama-3.1-8b"), get_gpu("h100-sxm-80gb")
    accum = 3
    s = Strategy(
        precision="master-bf16", seq_len=8192, micro_batch=2, grad_accum=accum, sharding="fsdp",
        parallelism=Parallelism.for_gpus(data),
    )  # fmt: skip
    t = step_time(spec, s, gpu)
    assert t.comm_seconds / accum < t.compute_seconds / accum  # the rest of the traffic hides
    share = edge_units_fraction(spec, 1)
    edge = (data - 1) / data * count_params(spec) * share * (2 + 4) / 370e9
    assert t.exposed_comm_seconds == pytest.approx(accum * edge, rel=1e-9)


def test_the_edge_is_not_hidden_twice_when_the_collectives_outlast_the_compute() -> None:
    """Where FSDP2's traffic per micro-step is longer than its compute, the exposed time is the traffic less the
    compute — as before: the edges are part of the traffic, not added to it."""
    spec, gpu = load_model("llama-3.1-8b"), get_gpu("rtx-4090")  # PCIe: the collectives outlast the compute
    s = Strategy(
        precision="pure-bf16", seq_len=512, micro_batch=1, grad_accum=2, sharding="fsdp",
        parallelism=Parallelism.for_gpus(8),
    )  # fmt: skip
    t = step_time(spec, s, gpu)
    per_micro_comm, per_micro_compute = t.comm_seconds / 2, t.compute_seconds / 2
    assert per_micro_comm > per_micro_compute
    assert t.exposed_comm_seconds == pytest.approx(2 * (per_micro_comm - per_micro_compute), rel=1e-9)


def test_hsdp_exposes_the_edges_of_its_shard_group() -> None:
    """HSDP shards within a node (8 H100s) and replicates across: the edge units' collectives run in the shard group
    over NVLink; the cross-node all-reduce of the shards stays behind the last backward."""
    spec, gpu = load_model("llama-3.1-8b"), get_gpu("h100-sxm-80gb")
    s = Strategy(
        precision="master-bf16", seq_len=8192, micro_batch=2, grad_accum=2, sharding="hsdp",
        parallelism=Parallelism.for_gpus(16),
    )  # fmt: skip
    x = SpeedInputs.of(s, spec)
    t = step_time_of(spec, x, gpu)
    edge = 7 / 8 * count_params(spec) * edge_units_fraction(spec, 1) * (2 + 4) / 370e9
    assert t.exposed_comm_seconds == pytest.approx(2 * edge, rel=1e-9)
    fsdp = step_time_of(spec, dataclasses.replace(x, sharding=Sharding.FSDP), gpu)
    assert fsdp.exposed_comm_seconds > t.exposed_comm_seconds  # 16 ranks across nodes: a slower edge
