"""DeepSpeed's CPU offload traced: rank 0 of the real ``DeepSpeedEngine`` with ``offload_optimizer: {device:
cpu}`` (ZeRO-1/2/3) and ``offload_param`` (ZeRO-3) on PyTorch's fake process group, DeepSpeedCPUAdam's C++ step
replaced by a torch stand-in on the host tensors (:mod:`trainfit.trace.deepspeed_offload`), against the closed
form of :mod:`trainfit.analytic.parallel`.

Device phases within 3%, host components (what DeepSpeed pins, and Adam's states on the host) within 1%. One
explained exception: offloaded, the step leaves on the device little more than the 16-bit weights, and the
per-parameter fp64 norm scalars DeepSpeed keeps until the end of the step (``norm_for_param_grads``, one
512-byte block each), which the closed form leaves out, are then a few percent of a tiny model's step, as are the
few small gradients (norm weights, 512-byte blocks) stage 1 still holds on the device at the step: 32 KiB of
slack (a few kilobytes of tens of GiB at catalog sizes, ``benchmarks/agreement_distributed.py --offload``)."""

from __future__ import annotations

import dataclasses

import pytest

from trainfit.arch.spec import ModelSpec
from trainfit.errors import StrategyError
from trainfit.result import Component
from trainfit.strategy import EngineOptions, Offload, Parallelism, Strategy, finetune_setup

from .conftest import tiny_spec, traced_once

pytest.importorskip("torch")
pytest.importorskip("deepspeed")
from trainfit.analytic.parallel import estimate_parallel
from trainfit.export.configs import export_plan
from trainfit.trace.deepspeed import ds_config
from trainfit.trace.distributed import trace_distributed

WIDER = {"hidden_size": 128, "intermediate_size": 256, "vocab_size": 512}
# as tests/trace/test_deepspeed.py: MLP and vocabulary above the persistence threshold, so ZeRO-3 gathers
ZERO3 = {"hidden_size": 128, "intermediate_size": 1024, "vocab_size": 1024}
BUCKET = 50_000
SLACK = 32 * 1024

CELLS = [
    ("zero1", 2, "optimizer", "amp-fp16", 1),
    ("zero2", 64, "optimizer", "amp-bf16", 1),
    ("zero3", 8, "optimizer", "master-bf16", 1),
    ("zero3", 2, "optimizer+params", "amp-fp16", 1),
]
#: every stage, world size, offload and recipe above already meets the others; these run with TRAINFIT_FULL_MATRIX=1
MORE_CELLS = [
    ("zero2", 8, "optimizer", "master-bf16", 1),
    ("zero3", 64, "optimizer+params", "amp-bf16", 1),
    ("zero3", 8, "optimizer", "amp-bf16", 2),
]


def _strategy(sharding: str, w: int, offload: str, precision: str, accum: int = 1) -> Strategy:
    return Strategy(
        precision=precision,
        parallelism=Parallelism(data=w),
        sharding=sharding,
        micro_batch=2,
        seq_len=128,
        grad_accum=accum,
        offload=Offload.parse(offload),
        engine=EngineOptions(reduce_bucket_size=BUCKET, allgather_bucket_size=BUCKET, prefetch_bucket_size=BUCKET),
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sharding", "w", "offload", "precision", "accum"),
    [pytest.param(*c, id="-".join(map(str, c))) for c in CELLS]
    + [pytest.param(*c, id="-".join(map(str, c)), marks=pytest.mark.full_matrix) for c in MORE_CELLS],
)
def test_offloaded_rank_agrees_with_trace(sharding: str, w: int, offload: str, precision: str, accum: int) -> None:
    spec = tiny_spec("llama", **(ZERO3 if sharding == "zero3" else WIDER))
    s = _strategy(sharding, w, offload, precision, accum)
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import cpu_adam

    builder = cpu_adam.CPUAdamBuilder
    traced = trace_distributed(spec, s)
    # the stand-in and the host filing are the trace's only: DeepSpeed is left as it was
    assert cpu_adam.CPUAdamBuilder is builder and "pin_memory" not in vars(get_accelerator())
    closed = estimate_parallel(spec, s)
    for a, t in zip(closed.phases, traced.phases, strict=True):
        assert abs(a.total_bytes - t.total_bytes) <= 0.03 * t.total_bytes + SLACK, (
            a.phase,
            a.total_bytes,
            t.total_bytes,
        )
        for c in (Component.WEIGHTS, Component.GRADIENTS, Component.MASTER_WEIGHTS, Component.OPTIMIZER_STATES):
            assert abs(a.get(c) - t.get(c)) <= 0.01 * t.get(c) + SLACK, (a.phase, c, a.get(c), t.get(c))
        # the host: what DeepSpeed pins and Adam's states, by component (per node, as the analytic reports)
        assert set(t.host_components) == {c for c, n in a.host_components.items() if n}, a.phase
        for c, n in a.host_components.items():
            got = t.host_components.get(c, 0)
            assert abs(n - got) <= 0.01 * got + 4096 * s.parallelism.gpus_per_node, (a.phase, c, n, got)
    # the states left the device
    assert traced.phases[-1].get(Component.OPTIMIZER_STATES) == traced.phases[-1].get(Component.MASTER_WEIGHTS) == 0


def test_the_offloaded_trace_runs_the_exported_config() -> None:
    """Offloaded, DeepSpeed is given ``trainfit export``'s ds_config.json whole: its optimizer block makes the
    engine build DeepSpeedCPUAdam (only the C++ extension under it is a stand-in)."""
    spec = tiny_spec("llama", **WIDER)
    s = _strategy("zero3", 8, "optimizer+params", "amp-bf16")
    assert ds_config(spec, s) == export_plan(spec, s).deepspeed_config
    assert ds_config(spec, s)["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}


def test_host_adam_stand_in_is_adamw() -> None:
    """The stand-in for the ``cpu_adam`` extension against torch's AdamW on real tensors: the same update."""
    import torch

    from trainfit.trace.deepspeed_offload import HostAdamBuilder

    torch.manual_seed(0)
    p0, g = torch.randn(64), torch.randn(64)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    op = HostAdamBuilder().load()
    op.create_adam(0, 1e-2, 0.9, 0.99, 1e-8, 0.1, True, False)
    p, m, v = p0.clone(), torch.zeros(64), torch.zeros(64)
    for step in (1, 2, 3):
        ref.grad = g * step
        opt.step()
        op.adam_update(0, step, 1e-2, 0.9, 0.99, 1e-8, 0.1, True, p, g * step, m, v)
    torch.testing.assert_close(p, ref.detach())


@pytest.mark.parametrize(
    ("sharding", "offload", "words"),
    [("zero2", Offload.parse("optimizer+params"), "zero3"), ("zero3", Offload(activations=True), "activation")],
)
def test_offload_refusals_are_one_line(sharding: str, offload: Offload, words: str) -> None:
    s = Strategy(parallelism=Parallelism(data=8), sharding=sharding, offload=offload)
    with pytest.raises(StrategyError, match=words):
        trace_distributed(tiny_spec("llama", **WIDER), s)


def _accumulating_zero2_offload(accum: int) -> tuple[ModelSpec, Strategy]:
    spec = tiny_spec("llama", hidden_size=256, intermediate_size=512, vocab_size=8192, num_hidden_layers=4)
    s = dataclasses.replace(
        _strategy("zero2", 4, "optimizer", "amp-bf16", accum), parallelism=Parallelism(data=4, gpus_per_node=4)
    )
    return spec, s


def test_accumulating_zero2_offload_pins_a_copy_of_each_partition_gradient() -> None:
    """ZeRO-2 offload under accumulation adds each micro-step's gradients into a pinned 16-bit host copy of every
    parameter its partition meets (stage_1_and_2.py ``async_accumulate_grad_in_cpu_via_gpu``:
    ``accumulated_grads_in_cpu``, made by the first micro-step that accumulates, kept for the run); the device side is
    the first micro-step's. The trace files them as host memory because DeepSpeed pins them (they used to count as
    the device's gradients: made inside ``copy_grads_in_partition``). Rank 0 here; the node's four: below."""
    from trainfit.trace.deepspeed import trace_deepspeed

    peaks = {}
    for accum in (1, 2):
        spec, s = _accumulating_zero2_offload(accum)
        traced = traced_once(trace_deepspeed, spec, s, rank=0)  # accum 2: the node test's rank 0, traced once
        assert estimate_parallel(spec, s).rank(0).peak_bytes == pytest.approx(traced.peak_bytes, rel=0.01)
        host = max(traced.phases, key=lambda p: p.host_bytes)
        peaks[accum] = (traced.peak_bytes, host.host_components.get(Component.COMM_BUFFERS, 0))
    assert peaks[2][0] == peaks[1][0]  # the device: as without accumulation
    assert peaks[2][1] > peaks[1][1]  # the host: the pinned copies


@pytest.mark.slow
def test_a_nodes_pinned_copies_are_its_ranks_sum() -> None:
    """Each rank pins copies of the parameters its partition meets, which differ by rank (parallel.ZeroRank): the
    closed form's host bytes per node are the sum over the node's four ranks, each traced (a trace reports its rank's
    host bytes times the ranks of a node); every rank's device peak as the closed form's entry for it."""
    from trainfit.trace.deepspeed import trace_deepspeed

    spec, s = _accumulating_zero2_offload(2)
    ranks = [traced_once(trace_deepspeed, spec, s, rank=r) for r in range(4)]  # rank 0: the test above's
    closed = estimate_parallel(spec, s)
    node = sum(max(p.host_bytes for p in t.phases) for t in ranks) / len(ranks)
    assert max(p.host_bytes for p in closed.phases) == pytest.approx(node, abs=64 * 1024)
    assert node != max(p.host_bytes for p in ranks[0].phases)  # (rank 0's alone is not the node's)
    for r, traced in enumerate(ranks):
        assert closed.rank(r).peak_bytes == pytest.approx(traced.peak_bytes, rel=0.01), r


@pytest.mark.slow
@pytest.mark.parametrize(("w", "bucket", "micro", "seq"), [(8, 500_000_000, 2, 256), (2, 200_000, 1, 64)])
def test_zero1_offload_holds_the_ipg_bucket_and_the_slice_copies(w: int, bucket: int, micro: int, seq: int) -> None:
    """ZeRO-1 with ZeRO-Offload: the gradient hooks make the IPG bucket at the first gradient (DeepSpeed's default
    5e8 elements: 954 MiB in 16 bits, whatever the model's size), and the reduction after backward copies each slice
    of the partition to the host through an fp64 norm copy while autograd's gradients are all still whole. The
    closed form had neither: 92% and 38% under these two cells' traced peaks."""
    from trainfit.trace.deepspeed import trace_deepspeed

    spec = tiny_spec("llama", hidden_size=256, intermediate_size=512, vocab_size=8192, num_hidden_layers=4)
    s = Strategy(
        parallelism=Parallelism(data=w),
        sharding="zero1",
        micro_batch=micro,
        seq_len=seq,
        offload=Offload.parse("optimizer"),
        engine=EngineOptions(reduce_bucket_size=bucket, allgather_bucket_size=bucket),
    )
    traced = trace_deepspeed(spec, s, extrapolate=False)
    assert estimate_parallel(spec, s).peak_bytes == pytest.approx(traced.peak_bytes, rel=0.02)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sharding", "what", "offload"),
    [("zero2", "lora", "optimizer"), ("zero3", "freeze", "optimizer"), ("zero3", "lora", "optimizer+params")],
)
def test_an_offloaded_fine_tuning_rank_agrees_with_trace(sharding: str, what: str, offload: str) -> None:
    """ZeRO-Offload with real PEFT LoRA or ``--freeze embeddings,layers:0-1``: DeepSpeedCPUAdam gets the trainable
    parameters only, so the host holds their fp32 partition, Adam's states and the pinned staging; the frozen ones
    stay 16-bit on the device (ZeRO-3: partitioned). Device phases within 3% (−1.9…−0.1% measured, the step's
    fp64 norm scalars of the slack above), host components within 1%. ZeRO-Infinity: each frozen partition is made
    on the host too (``remote_device``; the trace filed them as the device's until 2026-12-04), a persistent one's
    on the device."""
    spec = tiny_spec("llama", **WIDER)
    if what == "freeze":
        adapter, base = finetune_setup("freeze", freeze="embeddings,layers:0-1")
    else:
        adapter, base = finetune_setup("lora", rank=16)
    s = dataclasses.replace(_strategy(sharding, 4, offload, "amp-bf16"), adapter=adapter, base_weights=base)
    traced = trace_distributed(spec, s)
    closed = estimate_parallel(spec, s)
    assert traced.trainable_params == closed.trainable_params < traced.params
    for a, t in zip(closed.phases, traced.phases, strict=True):
        assert abs(a.total_bytes - t.total_bytes) <= 0.03 * t.total_bytes + SLACK, (
            a.phase,
            a.total_bytes,
            t.total_bytes,
        )
        for c, n in a.host_components.items():
            got = t.host_components.get(c, 0)
            assert abs(n - got) <= 0.01 * got + 4096 * s.parallelism.gpus_per_node, (a.phase, c, n, got)
