"""The analytic rank stream (trainfit.analytic.rank_events) against the events of the real FSDP2 run on the fake
process group (trainfit.trace.distributed at full depth, three steps): replayed through the allocator model on
one CUDA stream (the CPU trace has no streams), the synthesised stream reaches the traced allocated peak. Its
reserved bytes are lower than the traced events' (it leaves out short-lived element-wise outputs, as one GPU's
stream does): the numbers are in docs/accuracy.md ("Reserved memory with many GPUs").

FSDP2 with CPUOffloadPolicy: allocated and reserved peaks, on one cell.

DeepSpeed ZeRO-1 and ZeRO-2 likewise: the real ``DeepSpeedEngine`` (trainfit.trace.deepspeed, full depth, three
steps) against the ZeRO-1/2 streams, allocated and reserved peaks on one CUDA stream."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest

from trainfit.allocator import AllocatorConfig, AllocatorResult, Event, Op, simulate
from trainfit.analytic.events import RankHooks, Stream, synthesise
from trainfit.analytic.parallel import compute_strategy
from trainfit.analytic.parallel import plan as parallel_plan
from trainfit.analytic.rank_events import FsdpHooks, Zero1Hooks, Zero2Hooks, Zero3Hooks
from trainfit.arch.spec import ModelSpec
from trainfit.strategy import BaseWeights, EngineOptions, Offload, Parallelism, Strategy

from .conftest import tiny_spec

pytest.importorskip("torch")


def _rank_peaks(
    spec: ModelSpec, s: Strategy, stream_strategy: Strategy, hooks: RankHooks
) -> tuple[AllocatorResult, AllocatorResult]:
    """The real run's events on the fake process group (full depth, three steps) and ``hooks``' stream of
    ``stream_strategy``, each replayed on one CUDA stream (the CPU trace has none): (traced, synthesised)."""
    from trainfit.trace import depth
    from trainfit.trace.distributed import fake_world, fsdp_run_strategy, run_layout_distributed
    from trainfit.trace.events import tracker_events

    built, _ = fsdp_run_strategy(s)
    plan = depth.plan_depth(spec, built, extrapolate=False)
    _, layout = plan.layouts[0]
    with fake_world(s.parallelism.data) as mesh:
        run = run_layout_distributed(spec, s, plan, layout, mesh, steps=3, adamw_impl="fused")
    traced = simulate(tracker_events(run), AllocatorConfig())
    st = Stream()
    synthesise(st, spec, stream_strategy, (), hooks, steps=3)
    return traced, simulate([Event(e.op, e.key, e.size_bytes, 0) for e in st.events], AllocatorConfig())


def _fsdp_peaks(spec: ModelSpec, s: Strategy) -> tuple[AllocatorResult, AllocatorResult]:
    """The real FSDP2 run and ``FsdpHooks``' stream (:func:`_rank_peaks`)."""
    stream_strategy = compute_strategy(s, casts_every_param=True)
    return _rank_peaks(spec, s, stream_strategy, FsdpHooks(spec, s, s.parallelism.data))


@pytest.mark.slow
def test_the_rank_stream_reaches_the_traced_allocated_peak() -> None:
    spec = tiny_spec("llama", hidden_size=256, intermediate_size=512, vocab_size=8192, num_hidden_layers=4)
    s = Strategy(parallelism=Parallelism(data=4), sharding="fsdp", micro_batch=2, seq_len=256)
    traced, mine = _fsdp_peaks(spec, s)
    assert mine.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.02)


@pytest.mark.slow
def test_the_cpu_offload_stream_reaches_the_traced_peaks() -> None:
    """FSDP2 with ``CPUOffloadPolicy`` (``FsdpHooks`` with the shards, gradients and optimizer on the host) against
    the events of the real ``fully_shard(offload_policy=CPUOffloadPolicy())`` run, which the tracker files the host
    states of (trainfit.trace.distributed ``DistTracker``), over 4 ranks. A short sequence under a wide vocabulary
    puts the peak in the root's post-backward (its fp32 reduce-scatter input beside the head's and the token
    table's bf16 gradients), where the closed form is held too. On the CPU mesh each shard's copy to the device is
    a no-op (``.to("cpu")``): the trace sees its bf16 cast, not the fp32 copy the stream makes before it, a
    transient below these peaks. Per layer + root: under FSDP2's units this cell peaks in [final norm, head]'s
    post-backward, with its reduce output on the device beside the head's gradient — which on the CPU mesh *is* the
    host gradient, so the trace cannot show it (the stream and the closed form count it: +11% here)."""
    from trainfit.analytic.parallel import estimate_parallel

    spec = tiny_spec("llama", hidden_size=256, intermediate_size=512, vocab_size=8192, num_hidden_layers=4)
    s = Strategy(
        parallelism=Parallelism(data=4),
        sharding="fsdp",
        micro_batch=1,
        seq_len=64,
        offload=Offload.parse("optimizer+params"),
        engine=EngineOptions(fsdp_wrap="root"),
    )
    traced, mine = _fsdp_peaks(spec, s)
    assert mine.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.01)
    assert mine.peak_reserved_bytes == pytest.approx(traced.peak_reserved_bytes, rel=0.05)
    assert estimate_parallel(spec, s).rank(0).peak_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.01)


def _zero_cell(
    sharding: str,
    w: int,
    bucket: int,
    overlap: bool | None = None,
    accum: int = 1,
    precision: str | None = None,
    optimizer: str = "adamw",
) -> tuple[ModelSpec, Strategy]:
    """The tiny llama (4 layers, hidden 256, vocabulary 8192) at 2 × 256 under DeepSpeed ZeRO over ``w`` ranks with a
    reduce and all-gather bucket of ``bucket`` elements."""
    spec = tiny_spec("llama", hidden_size=256, intermediate_size=512, vocab_size=8192, num_hidden_layers=4)
    s = Strategy(
        parallelism=Parallelism(data=w),
        sharding=sharding,
        micro_batch=2,
        seq_len=256,
        grad_accum=accum,
        optimizer=optimizer,  # type: ignore[arg-type]
        engine=EngineOptions(reduce_bucket_size=bucket, allgather_bucket_size=bucket, overlap_comm=overlap),
    )
    return spec, s if precision is None else dataclasses.replace(s, precision=precision)  # type: ignore[arg-type]


def _deepspeed_run(spec: ModelSpec, s: Strategy) -> Any:
    """The real ``DeepSpeedEngine`` of ``s`` at full depth, three steps, under the tracker (a ``TraceRun``)."""
    pytest.importorskip("deepspeed")
    from trainfit.trace import depth
    from trainfit.trace.deepspeed import _built, _deepspeed_world, _quiet_deepspeed, run_layout_deepspeed

    plan = depth.plan_depth(spec, _built(s), extrapolate=False)
    _, layout = plan.layouts[0]
    with _quiet_deepspeed(), _deepspeed_world(s.parallelism.data):
        return run_layout_deepspeed(spec, s, plan, layout, steps=3)


@functools.cache
def _zero_traced(
    sharding: str, w: int, bucket: int, overlap: bool | None, accum: int, precision: str | None, optimizer: str
) -> tuple[ModelSpec, Strategy, Any, AllocatorResult]:
    """:func:`_zero_cell`'s cell, its real engine's run (:func:`_deepspeed_run`, its accumulations merged) and that
    run's events on one CUDA stream, once per test process (every argument positional, so equal cells share a key):
    ``_zero_peaks`` and the ZeRO-1 flatten test read the same traced cell. The ``TraceRun`` holds no tensors; the
    callers only read it."""
    from trainfit.trace.events import tracker_events

    spec, s = _zero_cell(sharding, w, bucket, overlap, accum, precision, optimizer)
    run = _deepspeed_run(spec, s)
    return spec, s, run, simulate(tracker_events(run), AllocatorConfig())


def _zero_peaks(
    sharding: str,
    w: int,
    bucket: int,
    overlap: bool | None,
    accum: int = 1,
    precision: str | None = None,
    optimizer: str = "adamw",
) -> tuple[AllocatorResult, AllocatorResult, float]:
    """The real DeepSpeed engine's events (full depth, three steps) and ``Zero1Hooks``'/``Zero2Hooks``' stream, on
    one CUDA stream: (traced, synthesised, the closed form's peak over the traced allocated peak)."""
    from trainfit.analytic.parallel import estimate_parallel

    spec, s, _, traced = _zero_traced(sharding, w, bucket, overlap, accum, precision, optimizer)
    # DeepSpeed flattens its 16-bit groups on the device when the accelerator's free memory holds them: the traced
    # engine runs on DeepSpeed's CPU accelerator, whose free memory is the host's, so the stream is given that
    from deepspeed.accelerator import get_accelerator

    free = int(get_accelerator().available_memory())
    st = Stream()
    hooks = (Zero1Hooks if sharding == "zero1" else Zero2Hooks)(spec, s, parallel_plan(spec, s), free_device_bytes=free)
    synthesise(st, spec, compute_strategy(s), (), hooks, steps=3)
    mine = simulate([Event(e.op, e.key, e.size_bytes, 0) for e in st.events], AllocatorConfig())
    return traced, mine, estimate_parallel(spec, s).rank(0).peak_bytes / traced.peak_allocated_bytes


ZERO_CELLS = [
    ("zero2", 4, 200_000, None),
    ("zero2", 8, 500_000_000, None),
    ("zero1", 4, 200_000, None),
    ("zero1", 8, 500_000_000, None),
    ("zero1", 4, 200_000, True),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sharding", "w", "bucket", "overlap"), [pytest.param(*c, id="-".join(map(str, c))) for c in ZERO_CELLS]
)
def test_the_zero_stream_reaches_the_traced_peaks(sharding: str, w: int, bucket: int, overlap: bool | None) -> None:
    """A 200,000-element bucket fills several times per backward and is smaller than the embedding and the
    head (DeepSpeed's ``extra_large_param_to_reduce`` path); DeepSpeed's default (5e8) holds every gradient.
    ZeRO-1 keeps autograd's gradients until the reduction after backward (with ``overlap_comm``, stage 2's
    stream)."""
    traced, mine, _ = _zero_peaks(sharding, w, bucket, overlap)
    assert mine.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.02)
    assert mine.peak_reserved_bytes == pytest.approx(traced.peak_reserved_bytes, rel=0.05)


#: (sharding, W, bucket, what trains, checkpointing, accumulation steps)
ZERO_FINETUNE_CELLS = [
    ("zero2", 4, 200_000, "lora", "none", 1),
    ("zero1", 4, 200_000, "lora", "none", 2),
    ("zero2", 4, 200_000, "freeze", "full", 2),
    ("zero1", 8, 500_000_000, "freeze", "none", 1),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sharding", "w", "bucket", "what", "ckpt", "accum"),
    [pytest.param(*c, id="-".join(map(str, c))) for c in ZERO_FINETUNE_CELLS],
)
def test_the_zero_stream_fine_tunes_like_the_traced_engine(
    sharding: str, w: int, bucket: int, what: str, ckpt: str, accum: int
) -> None:
    """ZeRO-1/2 with real PEFT LoRA (all-linear) or ``--freeze embeddings,layers:0-1``: the streams' flat groups hold
    the trainable tensors in module order, the frozen parameters stay module parameters (they had none of them:
    −15% allocated, −24% reserved on the LoRA cell), rank 0's gradient partition is its trainable slice's. Against
    the real engine's events (full depth, three steps, one CUDA stream): allocated within 1% (−0.4…+0.6%), reserved
    within 5% (−4.3…−0.2%)."""
    import dataclasses

    from deepspeed.accelerator import get_accelerator

    from trainfit.strategy import finetune_setup
    from trainfit.trace.events import tracker_events

    spec, s = _zero_cell(sharding, w, bucket, None, accum)
    if what == "freeze":
        adapter, base = finetune_setup("freeze", freeze="embeddings,layers:0-1")
    else:
        adapter, base = finetune_setup("lora", rank=16)
    s = dataclasses.replace(s, adapter=adapter, base_weights=base, checkpointing=ckpt)
    traced = simulate(tracker_events(_deepspeed_run(spec, s)), AllocatorConfig())
    free = int(get_accelerator().available_memory())  # as _zero_peaks: the engine's free-memory test
    st = Stream()
    hooks = (Zero1Hooks if sharding == "zero1" else Zero2Hooks)(spec, s, parallel_plan(spec, s), free_device_bytes=free)
    synthesise(st, spec, compute_strategy(s), (), hooks, steps=3)
    mine = simulate([Event(e.op, e.key, e.size_bytes, 0) for e in st.events], AllocatorConfig())
    assert mine.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.01)
    assert mine.peak_reserved_bytes == pytest.approx(traced.peak_reserved_bytes, rel=0.05)


def _zero3_peaks(
    prefetch: int,
    reuse: int,
    ckpt: str,
    tuned: tuple[Any, Any] | None = None,
    precision: str = "amp-bf16",
    optimizer: str = "adamw",
) -> tuple[AllocatorResult, AllocatorResult]:
    """The real ZeRO-3 engine's events over 8 ranks (the tiny llama, 2 × 256, full depth, three steps; ``tuned``:
    the adapter and base weights of a fine-tuning run) and ``Zero3Hooks``' stream, on one CUDA stream."""
    pytest.importorskip("deepspeed")
    from trainfit.trace import depth
    from trainfit.trace.deepspeed import _built, _deepspeed_world, _quiet_deepspeed, run_layout_deepspeed
    from trainfit.trace.events import tracker_events

    spec = tiny_spec("llama", hidden_size=256, intermediate_size=512, vocab_size=8192, num_hidden_layers=4)
    adapter, base = tuned if tuned is not None else (None, BaseWeights())
    s = Strategy(
        parallelism=Parallelism(data=8),
        sharding="zero3",
        checkpointing=ckpt,
        precision=precision,  # type: ignore[arg-type]
        optimizer=optimizer,  # type: ignore[arg-type]
        micro_batch=2,
        seq_len=256,
        adapter=adapter,
        base_weights=base,
        engine=EngineOptions(
            reduce_bucket_size=50_000,
            allgather_bucket_size=50_000,
            prefetch_bucket_size=prefetch,
            max_reuse_distance=reuse,
        ),
    )
    plan = depth.plan_depth(spec, _built(s), extrapolate=False)
    _, layout = plan.layouts[0]
    with _quiet_deepspeed(), _deepspeed_world(8):
        run = run_layout_deepspeed(spec, s, plan, layout, steps=3)
    traced = simulate(tracker_events(run), AllocatorConfig())
    st = Stream()
    synthesise(st, spec, compute_strategy(s), (), Zero3Hooks(spec, s, parallel_plan(spec, s)), steps=3)
    return traced, simulate([Event(e.op, e.key, e.size_bytes, 0) for e in st.events], AllocatorConfig())


#: (what trains, stage3_prefetch_bucket_size, stage3_max_reuse_distance, checkpointing)
ZERO3_FINETUNE_CELLS = [
    ("lora", 50_000, 1_000_000_000, "none"),
    ("freeze", 50_000, 1_000_000_000, "none"),
    ("lora", 150_000, 300_000, "full"),
    ("freeze", 50_000_000, 1_000_000_000, "none"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("what", "prefetch", "reuse", "ckpt"), [pytest.param(*c, id="-".join(map(str, c))) for c in ZERO3_FINETUNE_CELLS]
)
def test_the_zero3_stream_fine_tunes_like_the_traced_engine(what: str, prefetch: int, reuse: int, ckpt: str) -> None:
    """ZeRO-3 with real PEFT LoRA or ``--freeze embeddings,layers:0-1`` over 8 ranks (``Zero3Hooks``: the flat buffer
    of the trainable partitions, each frozen partition its own, the coordinator's replay without backward fetches
    where no output requires grad) against the real engine's events: allocated within 1% (−0.4…0%), reserved within
    5% (−4.7…0%). Not held: LoRA with the default prefetch bucket (5e7) reserves +8.5% (one 8 MiB segment of 94)."""
    from trainfit.strategy import finetune_setup

    if what == "freeze":
        tuned = finetune_setup("freeze", freeze="embeddings,layers:0-1")
    else:
        tuned = finetune_setup("lora", rank=16)
    traced, mine = _zero3_peaks(prefetch, reuse, ckpt, tuned)
    assert mine.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.01)
    # LoRA with checkpointing: the traced reserve since ZeRO-3 ranks run the adapters as PEFT does (−2.4% before)
    tight = what == "lora" and ckpt == "full"
    assert mine.peak_reserved_bytes == pytest.approx(traced.peak_reserved_bytes, rel=0.005 if tight else 0.05)


def _traced_device_peaks(spec: ModelSpec, s: Strategy) -> AllocatorResult:
    """The real DeepSpeed engine with ZeRO-Offload (full depth, three steps), its events without its host storages
    (``trace.deepspeed_offload.HOST_KINDS``; ``trace.events.tracker_events`` keeps every tracked storage) replayed
    on one CUDA stream: what the device's allocator sees."""
    from trainfit.trace import depth
    from trainfit.trace.deepspeed import _built, _deepspeed_world, _quiet_deepspeed, run_layout_deepspeed
    from trainfit.trace.deepspeed_offload import HOST_KINDS

    plan = depth.plan_depth(spec, _built(s), extrapolate=False)
    _, layout = plan.layouts[0]
    with _quiet_deepspeed(), _deepspeed_world(s.parallelism.data):
        run = run_layout_deepspeed(spec, s, plan, layout, steps=3)
    tr = run.tracker
    tr.merge_inplace_accumulations()
    slots: list[Event | None] = [None] * (tr.t + 2)
    for idx, rec in enumerate(tr.records):
        if tr.component(rec) is None or rec.kind in HOST_KINDS:
            continue
        slots[rec.alloc_t] = Event(Op.ALLOC, idx, rec.nbytes)
        if rec.free_t is not None:
            slots[rec.free_t] = Event(Op.FREE, idx)
    return simulate([e for e in slots if e is not None], AllocatorConfig())


def _assert_zero12_device_peaks(spec: ModelSpec, s: Strategy, closed_rel: float = 0.02) -> None:
    """ZeRO-1/2's stream against the traced engine's device events (three steps): allocated within 1%, reserved
    within 5%, the closed form's peak within ``closed_rel`` of the traced allocated one (2%; the issue's 3% per rank
    where a cell says so)."""
    from deepspeed.accelerator import get_accelerator

    from trainfit.analytic.parallel import estimate_parallel

    traced = _traced_device_peaks(spec, s)
    free = int(get_accelerator().available_memory())  # what the traced engine's flatten test read
    hooks = (Zero1Hooks if s.sharding.value == "zero1" else Zero2Hooks)(
        spec, s, parallel_plan(spec, s), free_device_bytes=free
    )
    st = Stream()
    synthesise(st, spec, compute_strategy(s), (), hooks, steps=3)
    mine = simulate([Event(e.op, e.key, e.size_bytes, 0) for e in st.events], AllocatorConfig())
    assert mine.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.01)
    assert mine.peak_reserved_bytes == pytest.approx(traced.peak_reserved_bytes, rel=0.05)
    assert estimate_parallel(spec, s).rank(0).peak_bytes == pytest.approx(traced.peak_allocated_bytes, rel=closed_rel)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sharding", "what", "w", "accum", "offload"),
    [
        ("zero2", "lora", 4, 1, "optimizer"),
        ("zero2", "freeze", 2, 2, "optimizer"),
        ("zero3", "lora", 8, 1, "optimizer"),
        ("zero3", "freeze", 8, 1, "optimizer"),
        ("zero1", "lora", 4, 1, "optimizer"),
        ("zero1", "freeze", 2, 2, "optimizer"),
        ("zero3", "lora", 8, 1, "optimizer+params"),
        ("zero3", "freeze", 4, 2, "optimizer+params"),
    ],
)
def test_the_zero_offload_stream_fine_tunes_like_the_traced_engine(
    sharding: str, what: str, w: int, accum: int, offload: str
) -> None:
    """ZeRO-Offload (stages 1–3) and ZeRO-Infinity with real PEFT LoRA or ``--freeze embeddings,layers:0-1``: the
    device keeps the frozen parameters (ZeRO-3: their partitions; ZeRO-Infinity: only the persistent ones') besides
    what it keeps in full training; against the traced engine's device events: allocated within 1% (−0.34…0%),
    reserved within 5% (−4.4…−2.3%)."""
    pytest.importorskip("deepspeed")
    from deepspeed.accelerator import get_accelerator

    from trainfit.strategy import finetune_setup

    spec = tiny_spec("llama", hidden_size=256, intermediate_size=512, vocab_size=8192, num_hidden_layers=4)
    if what == "freeze":
        adapter, base = finetune_setup("freeze", freeze="embeddings,layers:0-1")
    else:
        adapter, base = finetune_setup("lora", rank=16)
    bucket = 50_000 if sharding == "zero3" else 200_000
    s = Strategy(
        parallelism=Parallelism(data=w),
        sharding=sharding,
        micro_batch=2,
        seq_len=256,
        grad_accum=accum,
        offload=Offload.parse(offload),
        adapter=adapter,
        base_weights=base,
        engine=EngineOptions(reduce_bucket_size=bucket, allgather_bucket_size=bucket, prefetch_bucket_size=bucket),
    )
    traced = _traced_device_peaks(spec, s)
    free = int(get_accelerator().available_memory())  # what the traced engine's flatten test read
    p = parallel_plan(spec, s)
    hooks = (
        Zero3Hooks(spec, s, p)
        if sharding == "zero3"
        else (Zero1Hooks if sharding == "zero1" else Zero2Hooks)(spec, s, p, free_device_bytes=free)
    )
    st = Stream()
    synthesise(st, spec, compute_strategy(s), (), hooks, steps=3)
    mine = simulate([Event(e.op, e.key, e.size_bytes, 0) for e in st.events], AllocatorConfig())
    assert mine.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.01)
    assert mine.peak_reserved_bytes == pytest.approx(traced.peak_reserved_bytes, rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sharding", "w", "bucket", "micro", "seq", "accum"),
    [
        ("zero2", 4, 200_000, 2, 256, 1),
        ("zero2", 8, 500_000_000, 2, 256, 1),
        ("zero2", 2, 200_000, 1, 64, 1),
        ("zero2", 2, 200_000, 1, 64, 2),
        ("zero1", 4, 200_000, 2, 256, 1),
        ("zero1", 2, 200_000, 1, 64, 1),
        ("zero1", 2, 200_000, 1, 64, 2),
        ("zero1-overlap", 2, 200_000, 1, 64, 2),
    ],
)
def test_the_zero_offload_stream_reaches_the_traced_device_peaks(
    sharding: str, w: int, bucket: int, micro: int, seq: int, accum: int
) -> None:
    """ZeRO-2 with ZeRO-Offload (``Zero2Hooks`` with ``offload``): the device keeps the flat 16-bit groups, the IPG
    bucket and a 16-bit staging buffer of the largest parameter; each reduction copies the partition's gradient
    slices to the host through an fp64 norm copy and an fp32 copy. Against the traced engine's device events (its
    host storages left out). On the one-row cells (one token row of 64) that copy of the token table's slice is the
    peak, which the closed form missed by 35% before it had the moment (``parallel._deepspeed``,
    ``offload_reduce``). With accumulation a micro-step before the boundary adds its gradients into their pinned
    host copies through the staging buffer: nothing more on the device. ZeRO-1 (``Zero1Hooks``) keeps autograd's
    gradients to the boundary and reduces them in flat order; a gradient larger than the bucket is cloned first
    (``_offload_gradient_safety_enabled``): without the clone the one-row cells reserved 25% less. With
    ``overlap_comm`` its hooks reduce at the boundary as stage 2's but clear no gradient: the head's (larger than the
    bucket, outside the partition) stays to the epilogue (stream −9.8%, closed form −12.3% without it; now +0.06% and
    −2.5%, held to the issue's 3% per rank)."""
    pytest.importorskip("deepspeed")

    spec = tiny_spec("llama", hidden_size=256, intermediate_size=512, vocab_size=8192, num_hidden_layers=4)
    s = Strategy(
        parallelism=Parallelism(data=w),
        sharding=sharding.removesuffix("-overlap"),
        micro_batch=micro,
        seq_len=seq,
        grad_accum=accum,
        offload=Offload.parse("optimizer"),
        engine=EngineOptions(
            reduce_bucket_size=bucket, allgather_bucket_size=bucket, overlap_comm=sharding.endswith("-overlap") or None
        ),
    )
    _assert_zero12_device_peaks(spec, s, closed_rel=0.03 if sharding.endswith("-overlap") else 0.02)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sharding", "w", "micro", "seq", "accum", "offload", "overlap"),
    [
        ("zero2", 2, 1, 64, 1, "optimizer", None),
        ("zero2", 4, 2, 256, 2, "none", None),
        ("zero1", 4, 2, 256, 1, "none", True),
        ("zero1", 4, 2, 256, 1, "none", None),
        ("zero1", 4, 2, 256, 2, "none", True),
        ("zero1", 2, 1, 64, 2, "optimizer", True),
    ],
)
def test_the_zero_stream_takes_a_tied_table_after_autograds_sum(
    sharding: str, w: int, micro: int, seq: int, accum: int, offload: str, overlap: bool | None
) -> None:
    """A tied token table (tiny llama with ``tie_word_embeddings``, a 2e5 bucket): ZeRO-2's hooks (ZeRO-1's with
    ``overlap_comm``) fire on the table's ``AccumulateGrad``, after the embedding's gradient is added to the head's,
    not with the head's backward. The stream took it with the head's: with offload the table's fp64 norm copy came
    while the top layers' activations were alive (+22% allocated on the one-row cell). The step flattens rank 0's
    partition as a view when it lies inside the table (``deepspeed_step_copies_partition``). Against the traced
    engine: allocated within 1%, reserved within 5%, the closed form within 2%."""
    pytest.importorskip("deepspeed")

    spec = tiny_spec(
        "llama", hidden_size=256, intermediate_size=512, vocab_size=8192, num_hidden_layers=4, tie_word_embeddings=True
    )
    bucket = 200_000
    s = Strategy(
        parallelism=Parallelism(data=w),
        sharding=sharding,
        micro_batch=micro,
        seq_len=seq,
        grad_accum=accum,
        offload=Offload.parse(offload),
        engine=EngineOptions(reduce_bucket_size=bucket, allgather_bucket_size=bucket, overlap_comm=overlap),
    )
    # the 3% per rank for the closed form (ZeRO-1 with overlap_comm, offload and accumulation: +2.0%)
    _assert_zero12_device_peaks(spec, s, closed_rel=0.03)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("prefetch", "ckpt", "micro", "seq", "accum", "offload"),
    [
        (50_000, "none", 2, 256, 1, "optimizer"),
        (150_000, "full", 2, 256, 1, "optimizer"),
        (50_000_000, "none", 1, 64, 2, "optimizer"),
        (50_000, "none", 2, 256, 1, "optimizer+params"),
        (150_000, "full", 2, 256, 1, "optimizer+params"),
    ],
)
def test_the_zero3_offload_stream_reaches_the_traced_device_peaks(
    prefetch: int, ckpt: str, micro: int, seq: int, accum: int, offload: str
) -> None:
    """ZeRO-3 with ZeRO-Offload (``Zero3Hooks`` with ``offload``): the fp32 partition and a zero gradient made on the
    device and moved to the host at init, the gradient partitions on the host, the step the host's; against the
    traced engine's device events over 8 ranks (4 on the one-row cells, with two accumulation steps). ZeRO-Infinity
    (``optimizer+params``): the 16-bit partitions are the host's too (``Zero3Hooks.params_on_host``); with them on
    the device the stream was +1.8…+2.3% allocated. Not on the one-row cell: there the init's layout is the reserve,
    and the trace wraps a model built on the device (every parameter whole there before ``deepspeed.initialize``
    partitions it) where the stream follows the HF Trainer's ``zero.Init`` (never whole on the device): 28 / 40 MiB
    (docs/distributed.md)."""
    pytest.importorskip("deepspeed")
    spec = tiny_spec("llama", hidden_size=256, intermediate_size=512, vocab_size=8192, num_hidden_layers=4)
    w = 8 if accum == 1 else 4
    s = Strategy(
        parallelism=Parallelism(data=w),
        sharding="zero3",
        checkpointing=ckpt,
        micro_batch=micro,
        seq_len=seq,
        grad_accum=accum,
        offload=Offload.parse(offload),
        engine=EngineOptions(
            reduce_bucket_size=50_000,
            allgather_bucket_size=50_000,
            prefetch_bucket_size=prefetch,
            max_reuse_distance=300_000 if ckpt == "full" else 1_000_000_000,
        ),
    )
    traced = _traced_device_peaks(spec, s)
    st = Stream()
    synthesise(st, spec, compute_strategy(s), (), Zero3Hooks(spec, s, parallel_plan(spec, s)), steps=3)
    mine = simulate([Event(e.op, e.key, e.size_bytes, 0) for e in st.events], AllocatorConfig())
    assert mine.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.01)
    assert mine.peak_reserved_bytes == pytest.approx(traced.peak_reserved_bytes, rel=0.05)


ZERO3_CELLS = [(50_000, 1_000_000_000, "none"), (150_000, 300_000, "full"), (50_000_000, 1_000_000_000, "none")]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("prefetch", "reuse", "ckpt"), [pytest.param(*c, id="-".join(map(str, c))) for c in ZERO3_CELLS]
)
def test_the_zero3_stream_reaches_the_traced_peaks(prefetch: int, reuse: int, ckpt: str) -> None:
    """ZeRO-3 (``Zero3Hooks``: the coordinator's replay, analytic/zero3.py, written at the layer hooks) against
    the real engine's events over 8 ranks: a small prefetch bucket, full checkpointing with a short reuse
    distance, and DeepSpeed's default 5e7 bucket (the whole model gathered in one handle). The reserve is held
    to 8%: on a model this small one 2 MiB small-pool segment is 2% of it."""
    pytest.importorskip("deepspeed")

    traced, mine = _zero3_peaks(prefetch, reuse, ckpt)
    assert mine.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.01)
    assert mine.peak_reserved_bytes == pytest.approx(traced.peak_reserved_bytes, rel=0.08)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["zero1", "zero2", "zero3"])
def test_the_zero_stream_reaches_the_traced_peaks_in_fp32(sharding: str) -> None:
    """fp32 ZeRO: the parameters, gradients and bucket in fp32; the optimizer's fp32 master partition is a copy of
    the fp32 partition all the same (stage 1–2's ``clone``; stage 3's sharing branch compares a ``torch.device``
    with a string and never shares), and the step's ``.to(fp32)`` of the flat gradient is no copy."""
    if sharding == "zero3":
        traced, mine = _zero3_peaks(50_000, 1_000_000_000, "none", precision="fp32")
    else:
        traced, mine, closed = _zero_peaks(sharding, 4, 200_000, None, precision="fp32")
        assert closed == pytest.approx(1.0, abs=0.01)  # the closed form's peak over the traced one
    assert mine.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.01)
    assert mine.peak_reserved_bytes == pytest.approx(traced.peak_reserved_bytes, rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize(("sharding", "optimizer"), [("zero1", "adafactor"), ("zero2", "lion"), ("zero3", "adafactor")])
def test_the_zero_stream_reaches_the_traced_peaks_with_other_optimizers(sharding: str, optimizer: str) -> None:
    """The Trainer's optimizer as DeepSpeed's client: one flat partition's states, made at the first step, and the
    update temporaries over it after the 16-bit gradients are gone. At stage 3 the allocated peak agrees but the
    traced engine reserves 16 MiB less than the stream (and than itself with AdamW): that reserve is not simulated
    (``rank_simulated``), and this test says so until it is."""
    if sharding == "zero3":
        traced, mine = _zero3_peaks(50_000, 1_000_000_000, "none", optimizer=optimizer)
        assert mine.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.01)
        assert mine.peak_reserved_bytes > 1.1 * traced.peak_reserved_bytes
        return
    traced, mine, _ = _zero_peaks(sharding, 4, 200_000, None, optimizer=optimizer)
    assert mine.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.01)
    assert mine.peak_reserved_bytes == pytest.approx(traced.peak_reserved_bytes, rel=0.05)


TP_CELLS = [
    (2, "amp-bf16", "none", False),
    (2, "pure-bf16", "full", False),
    (2, "amp-bf16", "none", True),
    (2, "pure-bf16", "full", True),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tp", "precision", "ckpt", "sp"),
    [pytest.param(*c[:3], c[3], id="-".join(map(str, c[:3])) + ("-sp" if c[3] else "")) for c in TP_CELLS],
)
def test_the_dtensor_tp_stream_reaches_the_traced_peaks(tp: int, precision: str, ckpt: str, sp: bool) -> None:
    """DTensor TP ± sequence parallelism (``DtensorTpHooks``: the single-GPU stream of the TP-local model with the
    rank's shard states, the whole token-table gradient and the gathered logits; under SP the norms' saved
    tensors, the residual stream and the checkpointed segments' inputs sequence-sharded) against the events of
    the real ``parallelize_module`` plan (trainfit.trace.tensor_parallel, full depth, three steps)."""
    from trainfit.analytic.parallel import dtensor_tp_spec
    from trainfit.analytic.rank_events import DtensorTpHooks
    from trainfit.trace import depth
    from trainfit.trace.distributed import fsdp_run_strategy
    from trainfit.trace.events import tracker_events
    from trainfit.trace.tensor_parallel import fake_mesh, run_layout_tp

    spec = tiny_spec("llama", hidden_size=256, intermediate_size=512, vocab_size=8192, num_hidden_layers=4)
    s = Strategy(
        parallelism=Parallelism(tensor=tp, sequence_parallel=sp),
        engine=EngineOptions(engine="torch"),
        precision=precision,
        checkpointing=ckpt,
        micro_batch=2,
        seq_len=256,
    )
    built, _ = fsdp_run_strategy(s)
    plan = depth.plan_depth(spec, built, extrapolate=False)
    _, layout = plan.layouts[0]
    with fake_mesh(1, tp) as mesh:
        run = run_layout_tp(spec, s, plan, layout, mesh, steps=3, adamw_impl="fused")
    traced = simulate(tracker_events(run), AllocatorConfig())
    st = Stream()
    synthesise(st, dtensor_tp_spec(spec, tp), s, (), DtensorTpHooks(spec, s, tp, sequence_parallel=sp), steps=3)
    mine = simulate([Event(e.op, e.key, e.size_bytes, 0) for e in st.events], AllocatorConfig())
    assert mine.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.01)
    assert mine.peak_reserved_bytes == pytest.approx(traced.peak_reserved_bytes, rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("precision", "ckpt", "micro", "accum", "sp"),
    [("amp-bf16", "full", 4, 2, False), ("amp-bf16", "none", 4, 2, True), ("pure-bf16", "full", 2, 3, False)],
)
def test_the_dtensor_tp_stream_accumulates_like_the_traced_run(
    precision: str, ckpt: str, micro: int, accum: int, sp: bool
) -> None:
    """DTensor TP 2 with accumulation: the stream's second micro-step adds into the resident ``.grad`` (one GPU's
    replay, ``RankHooks.replays_accumulation``); against the real ``parallelize_module`` run, full depth, three
    steps."""
    from trainfit.analytic.parallel import dtensor_tp_spec
    from trainfit.analytic.rank_events import DtensorTpHooks
    from trainfit.trace import depth
    from trainfit.trace.distributed import fsdp_run_strategy
    from trainfit.trace.events import tracker_events
    from trainfit.trace.tensor_parallel import fake_mesh, run_layout_tp

    spec = tiny_spec("llama", hidden_size=256, intermediate_size=512, vocab_size=8192, num_hidden_layers=4)
    s = Strategy(
        parallelism=Parallelism(tensor=2, sequence_parallel=sp),
        engine=EngineOptions(engine="torch"),
        precision=precision,
        checkpointing=ckpt,
        micro_batch=micro,
        seq_len=512,
        grad_accum=accum,
    )
    built, _ = fsdp_run_strategy(s)
    plan = depth.plan_depth(spec, built, extrapolate=False)
    _, layout = plan.layouts[0]
    with fake_mesh(1, 2) as mesh:
        run = run_layout_tp(spec, s, plan, layout, mesh, steps=3, adamw_impl="fused")
    traced = simulate(tracker_events(run), AllocatorConfig())
    st = Stream()
    synthesise(st, dtensor_tp_spec(spec, 2), s, (), DtensorTpHooks(spec, s, 2, sequence_parallel=sp), steps=3)
    mine = simulate([Event(e.op, e.key, e.size_bytes, 0) for e in st.events], AllocatorConfig())
    assert mine.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.01)
    assert mine.peak_reserved_bytes == pytest.approx(traced.peak_reserved_bytes, rel=0.05)


#: (precision, checkpointing, sequence parallel, accumulation steps, sync_each_batch, hidden size)
FSDP_TP_CELLS = [
    ("amp-bf16", "none", False, 1, True, 256),
    ("pure-bf16", "full", False, 1, True, 256),
    ("amp-bf16", "none", True, 1, True, 256),
    ("amp-bf16", "none", False, 2, False, 256),  # no_sync: the table's whole gradient kept, its rows copied out
    ("amp-bf16", "none", False, 2, True, 1024),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("precision", "ckpt", "sp", "accum", "sync", "hidden"),
    [
        pytest.param(*c, id=f"{c[0]}-{c[1]}{'-sp' if c[2] else ''}-accum{c[3]}{'' if c[4] else '-no-sync'}-h{c[5]}")
        for c in FSDP_TP_CELLS
    ],
)
def test_the_fsdp_tp_stream_reaches_the_traced_peaks(
    precision: str, ckpt: str, sp: bool, accum: int, sync: bool, hidden: int
) -> None:
    """2-D FSDP2 × DTensor TP (``FsdpTpHooks``: FSDP2's groups of the TP-local tensors over the TP-local stream)
    against the events of the real ``parallelize_module`` + ``fully_shard`` run on a 2 × 2 fake mesh (full depth,
    three steps), one CUDA stream: allocated within 1% (0.00…+0.05% on these cells), reserved within 5% (−1.8…+1.6%).
    With synced accumulation at hidden 256 the stream reserves +10…+15% (one 20 MiB segment; docs/distributed.md),
    not held here."""
    from trainfit.analytic.parallel import dtensor_tp_spec
    from trainfit.analytic.rank_events import FsdpTpHooks
    from trainfit.trace import depth
    from trainfit.trace.distributed import fsdp_run_strategy
    from trainfit.trace.events import tracker_events
    from trainfit.trace.tensor_parallel import fake_mesh, run_layout_tp

    wide = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128} if hidden > 256 else {}
    spec = tiny_spec(
        "llama", hidden_size=hidden, intermediate_size=2 * hidden, vocab_size=8192, num_hidden_layers=4, **wide
    )
    s = Strategy(
        parallelism=Parallelism(data=2, tensor=2, sequence_parallel=sp),
        sharding="fsdp",
        engine=EngineOptions(engine="torch", sync_each_batch=sync),
        precision=precision,
        checkpointing=ckpt,
        micro_batch=2,
        seq_len=256,
        grad_accum=accum,
    )
    built, _ = fsdp_run_strategy(s)
    plan = depth.plan_depth(spec, built, extrapolate=False)
    _, layout = plan.layouts[0]
    with fake_mesh(2, 2) as mesh:
        run = run_layout_tp(spec, s, plan, layout, mesh, steps=3, adamw_impl="fused")
    traced = simulate(tracker_events(run), AllocatorConfig())
    st = Stream()
    hooks = FsdpTpHooks(spec, s, 2, 2, sequence_parallel=sp)
    synthesise(st, dtensor_tp_spec(spec, 2), compute_strategy(s, casts_every_param=s.recipe.mixed), (), hooks, steps=3)
    mine = simulate([Event(e.op, e.key, e.size_bytes, 0) for e in st.events], AllocatorConfig())
    assert mine.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.01)
    assert mine.peak_reserved_bytes == pytest.approx(traced.peak_reserved_bytes, rel=0.05)


def _ddp_cell(view: bool, accum: int) -> tuple[ModelSpec, Strategy]:
    """The tiny llama (4 layers, hidden 256, vocabulary 8192, untied) at 2 × 256 under DDP over 4 ranks."""
    spec = tiny_spec("llama", hidden_size=256, intermediate_size=512, vocab_size=8192, num_hidden_layers=4)
    s = Strategy(
        parallelism=Parallelism(data=4),
        sharding="ddp",
        micro_batch=2,
        seq_len=256,
        grad_accum=accum,
        engine=EngineOptions(gradient_as_bucket_view=view),
    )
    return spec, s


@functools.cache
def _ddp_traced(view: bool, accum: int) -> tuple[ModelSpec, Strategy, Any, AllocatorResult]:
    """:func:`_ddp_cell`'s real DDP run on the fake process group (full depth, three steps; its accumulations
    merged) and its events on one CUDA stream, once per test process: the accumulation and bucket-rebuild tests read
    the same traced cells. The ``TraceRun`` holds no tensors; the callers only read it."""
    from trainfit.trace import depth
    from trainfit.trace.distributed import fake_world, run_layout_distributed
    from trainfit.trace.events import tracker_events

    spec, s = _ddp_cell(view, accum)
    plan = depth.plan_depth(spec, s, extrapolate=False)  # DDP builds under ``s`` itself (fsdp_run_strategy)
    _, layout = plan.layouts[0]
    with fake_world(4) as mesh:
        run = run_layout_distributed(spec, s, plan, layout, mesh, steps=3, adamw_impl="fused")
    return spec, s, run, simulate(tracker_events(run), AllocatorConfig())


def _stream_peaks(spec: ModelSpec, stream_strategy: Strategy, hooks: RankHooks) -> AllocatorResult:
    """``hooks``' stream of ``stream_strategy`` (three steps) on one CUDA stream, as :func:`_rank_peaks` makes it."""
    st = Stream()
    synthesise(st, spec, stream_strategy, (), hooks, steps=3)
    return simulate([Event(e.op, e.key, e.size_bytes, 0) for e in st.events], AllocatorConfig())


DDP_CELLS = [(False, 1), (True, 1), (False, 2), (True, 2), (False, 3)]


@pytest.mark.slow
@pytest.mark.parametrize(("view", "accum"), DDP_CELLS)
def test_the_ddp_stream_accumulates_like_the_traced_run(view: bool, accum: int) -> None:
    """DDP with and without gradient accumulation (``DdpHooks`` replays two micro-steps, the second with every .grad
    resident beside the buckets) against the real DDP run's events: with one micro-step the stream was 11.8% under
    the traced allocated peak (gradient_as_bucket_view off, 2 steps) and its reserve 9% under. Both have the first
    iteration's single bucket, then the rebuilt ones from the second forward (the trace's ``_RebuildingReducer``):
    with the rebuilt buckets in every step the stream reserved +3.4…+4.5% over the trace's single bucket."""
    from trainfit.analytic.rank_events import DdpHooks

    spec, s, _, traced = _ddp_traced(view, accum)
    mine = _stream_peaks(spec, s, DdpHooks(spec, s))
    assert mine.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.01)
    assert mine.peak_reserved_bytes == pytest.approx(traced.peak_reserved_bytes, rel=0.02)


@pytest.mark.slow
@pytest.mark.parametrize(("view", "accum"), [(False, 1), (True, 2)])
def test_the_traced_ddp_rebuilds_its_buckets_at_the_second_forward(view: bool, accum: int) -> None:
    """The traced DDP's comm buffers follow the real reducer (checked on gloo, ``python
    benchmarks/fsdp_stream_vs_trace.py --ddp-buckets``): one bucket of every gradient from construction, then at the
    second forward ``sync_bucket_indices``' two int32 tensors and the rebuilt buckets in the gradients' ready order
    — the LM head's alone (the 1 MiB first bucket), then the rest, as ``DdpHooks`` has them. The old bucket outlives
    them, held by NCCL's stash of its all-reduce (the trace's ``_NcclShelf``) to the next backward's first
    reduction, the head's bucket: it was freed before them (the H200's second step held it through forward and
    backward, +988065792 bytes on qwen2.5-0.5b). It was the single bucket in every step before that."""
    from trainfit.analytic.rank_events import DdpHooks
    from trainfit.trace.tracker import BACKWARD, FORWARD

    spec, s, run, _ = _ddp_traced(view, accum)  # the accumulation test's run of the same cell
    made = [r for r in run.tracker.comm_records if r.op == "empty.memory_format"]  # DDP's and the rebuild's
    first, sync, rebuilt = made[0], made[1:3], made[3:]
    head = 8192 * 256 * 4  # the LM head's gradient, ready first
    assert first.step == 0 and [r.nbytes for r in rebuilt] == [head, first.nbytes - head]
    assert {(r.step, r.phase) for r in sync + rebuilt} == {(1, FORWARD)}  # the second pass's forward
    assert all(r.free_t is not None and r.free_t < rebuilt[0].alloc_t for r in sync)
    assert first.free_t is not None and first.free_t > rebuilt[-1].alloc_t
    backward = [r.alloc_t for r in run.tracker.records if r.step == 1 and r.phase == BACKWARD]
    assert min(backward) < first.free_t < max(backward)  # in the rebuilding pass's backward, not before it
    hooks = DdpHooks(spec, s)
    assert hooks.first_buckets == [first.nbytes] and hooks.buckets == [r.nbytes for r in rebuilt]


@pytest.mark.slow
@pytest.mark.parametrize("cap_mb", [25, 2])
def test_an_explicit_bucket_cap_also_caps_ddps_first_bucket(cap_mb: int) -> None:
    """torch 2.13 gives an explicit ``bucket_cap_mb`` to the first rebuilt bucket too (``_BucketCapacityConfig``);
    only torch's default (none passed, the trace's ``bucket_cap_mb=None``) keeps the 1 MiB first bucket. With a tied
    table the first gradients ready are the top layer's, so the first bucket's cap shows (``DdpHooks`` closed it at
    1 MiB for any cap)."""
    from trainfit.analytic.rank_events import DdpHooks
    from trainfit.trace import depth
    from trainfit.trace.distributed import fake_world, run_layout_distributed

    spec = tiny_spec(
        "llama", hidden_size=256, intermediate_size=512, vocab_size=8192, num_hidden_layers=4, tie_word_embeddings=True
    )
    s = Strategy(
        parallelism=Parallelism(data=4),
        sharding="ddp",
        micro_batch=2,
        seq_len=64,
        engine=EngineOptions(bucket_cap_mb=cap_mb),
    )
    plan = depth.plan_depth(spec, s, extrapolate=False)
    _, layout = plan.layouts[0]
    with fake_world(4) as mesh:
        run = run_layout_distributed(spec, s, plan, layout, mesh, steps=2, adamw_impl="fused")
    rebuilt = [r.nbytes for r in run.tracker.comm_records if r.op == "empty.memory_format"][3:]
    mine = DdpHooks(spec, s).buckets
    # The stream takes reverse module order for the gradients' ready order: an edge may move by a norm weight or two.
    assert len(mine) == len(rebuilt) and sum(mine) == sum(rebuilt)
    assert all(abs(a - b) <= 2 * 4 * 256 for a, b in zip(mine, rebuilt, strict=True))
    assert rebuilt[0] > (2 * 1024 * 1024 if cap_mb == 2 else 1024 * 1024)  # the first bucket's cap, not 1 MiB


#: (family, fine-tuning, targets, recipe): DDP's construction broadcast of every parameter and buffer.
BROADCAST_CELLS = [
    ("llama", "full", "", "amp-bf16"),  # one fp32 flat: parameters and RoPE's two buffers
    ("llama", "lora", "all-linear", "pure-bf16"),  # bf16 base and the rotary buffers' fp32 flat with the adapters
    ("llama", "qlora", "all-linear", "amp-bf16"),  # packed uint8 weights; the quantisation state not broadcast
    ("llama", "freeze", "embeddings", "amp-bf16"),  # frozen tensors are broadcast too
    ("bert", "full", "", "amp-bf16"),  # int64 position/token-type buffers: a flat of their own
    ("gpt2", "full", "", "pure-bf16"),  # no buffers
]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "how", "targets", "precision"), BROADCAST_CELLS)
def test_ddps_construction_broadcast_flattens_what_the_stream_has(
    family: str, how: str, targets: str, precision: str
) -> None:
    """``DistributedDataParallel.__init__`` broadcasts every parameter (frozen ones too) and buffer from rank 0
    through ``_broadcast_coalesced``, which flattens each dtype's tensors into new tensors: the flats the traced
    construction makes are ``ddp_broadcast_bytes``' (the stream had none; a LoRA rank's reserve was −5.4% of the
    traced run's for it), and each forward's buffer sync makes ``ddp_buffer_sync_bytes``'."""
    import dataclasses

    from trainfit.analytic.parallel import ddp_broadcast_bytes, ddp_buffer_sync_bytes
    from trainfit.strategy import finetune_setup
    from trainfit.trace import depth
    from trainfit.trace.distributed import fake_world, run_layout_distributed

    wide = {"hidden_size": 256, "intermediate_size": 512, "vocab_size": 8192} if family == "llama" else {}
    spec = tiny_spec(family, **wide)
    s = Strategy(parallelism=Parallelism(data=4), sharding="ddp", micro_batch=2, seq_len=64, precision=precision)
    if how != "full":
        kw: dict[str, Any] = {"freeze": targets} if how == "freeze" else {"rank": 16, "targets": targets}
        if how == "qlora":
            kw["base_dtype"] = "nf4"
        adapter, base = finetune_setup(how, **kw)
        s = dataclasses.replace(s, adapter=adapter, base_weights=base)
    plan = depth.plan_depth(spec, s, extrapolate=False)
    _, layout = plan.layouts[0]
    with fake_world(4) as mesh:
        run = run_layout_distributed(spec, s, plan, layout, mesh, steps=2, adamw_impl="fused")
    made = [r for r in run.tracker.records if r.op == "cat.default" and r.owner in ("", "DistributedDataParallel")]
    at_init = [r.nbytes for r in made if r.phase == "setup"]
    per_forward = [r.nbytes for r in made if r.phase != "setup" and r.owner == "DistributedDataParallel"]
    assert at_init == [n for n in ddp_broadcast_bytes(spec, s) if n]
    assert per_forward == [n for n in ddp_buffer_sync_bytes(spec) if n] * 2  # two steps


#: (fine-tuning, targets, checkpointing, gradient_as_bucket_view, accumulation steps)
DDP_FINETUNE_CELLS = [
    ("lora", "all-linear", "none", False, 1),
    ("lora", "q_proj,v_proj", "full", True, 2),
    ("qlora", "all-linear", "full", False, 2),
    ("freeze", "layers:0-1", "full", True, 1),
]


@pytest.mark.slow
@pytest.mark.parametrize(("how", "targets", "ckpt", "view", "accum"), DDP_FINETUNE_CELLS)
def test_the_ddp_stream_fine_tunes_like_the_traced_run(
    how: str, targets: str, ckpt: str, view: bool, accum: int
) -> None:
    """A fine-tuning DDP rank's stream (the one-GPU stream of the adapters or frozen layers, the trainable
    gradients' buckets, the whole model's broadcast) against the real DDP run's events with real PEFT modules:
    allocated within 1%, reserved within 5% (−4.6…+1.3% on these cells; the one-GPU stream on the same cells
    −1.9…−2.3%: the element-wise outputs it leaves out, a 2 MiB small-pool segment each at this size)."""
    import dataclasses

    from trainfit.analytic.rank_events import DdpHooks
    from trainfit.strategy import finetune_setup

    spec, s = _ddp_cell(view, accum)
    kw: dict[str, Any] = {"freeze": targets} if how == "freeze" else {"rank": 16, "targets": targets}
    if how == "qlora":
        kw["base_dtype"] = "nf4"
    adapter, base = finetune_setup(how, **kw)
    s = dataclasses.replace(s, adapter=adapter, base_weights=base, checkpointing=ckpt)
    traced, mine = _rank_peaks(spec, s, s, DdpHooks(spec, s))
    assert mine.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.01)
    assert mine.peak_reserved_bytes == pytest.approx(traced.peak_reserved_bytes, rel=0.05)


#: (fine-tuning, targets, recipe, checkpointing, reshard_after_forward, accumulation steps, fsdp_wrap)
FSDP_FINETUNE_CELLS = [
    ("lora", "all-linear", "amp-bf16", "none", True, 1, "auto"),
    ("lora", "all-linear", "pure-bf16", "none", True, 1, "root"),  # no policy: fp32 adapters gathered as fp32
    ("qlora", "all-linear", "amp-bf16", "full", False, 1, "auto"),  # packed bf16-stored shards, whole quant state
    ("freeze", "layers:0-1", "amp-bf16", "full", True, 2, "units"),
    ("freeze", "layers:2-3", "amp-bf16", "none", True, 1, "auto"),  # the top frozen: the bottom's gradients
    # dead layers: no backward, layer 2's prefetch of layer 1 dropped unread by the final callback, layer 2's first
    # norm without its input-gradient saves (+3.6%, +1.9%, +0.6% before each)
    ("freeze", "embeddings,layers:0-1", "amp-bf16", "none", True, 1, "root"),
    # every layer dead, untied units: [final norm, head] reduces in the final callback, after the top layer's
    # prefetch is dropped (+8% before); dead layers without reshard_after_forward resharded there (leaked before)
    ("freeze", "embeddings,layers:0-3", "amp-bf16", "none", True, 1, "units"),
    ("freeze", "embeddings,layers:0-2", "amp-bf16", "none", False, 1, "root"),
    ("dora", "all-linear", "amp-bf16", "full", True, 1, "auto"),  # the magnitude vectors in their layers' groups
    ("lora-bf16", "all-linear", "amp-bf16", "none", True, 1, "auto"),  # bf16 base and adapters: no cast to gather
]


@pytest.mark.slow
@pytest.mark.parametrize(("how", "targets", "precision", "ckpt", "raf", "accum", "wrap"), FSDP_FINETUNE_CELLS)
def test_the_fsdp_stream_fine_tunes_like_the_traced_run(
    how: str, targets: str, precision: str, ckpt: str, raf: bool, accum: int, wrap: str
) -> None:
    """A fine-tuning FSDP2 rank's stream: each group's all-gather and unsharded parameters include its frozen,
    adapter and packed 4-bit parameters (``param_dtype`` under the policy, else their own dtype), its reduce-scatter
    and sharded gradients only the trainable ones, a 4-bit weight's quantisation state whole on the rank; against the
    real FSDP2 run with real PEFT modules (tiny llama over 4 ranks): allocated within 1% (+0.00…+0.6% on these and
    other cells; the stream failed on adapters before), reserved within 5% (−4.3…0.0%; full training on the same
    model −3.4…0.0%)."""
    from trainfit.analytic.rank_events import FsdpHooks
    from trainfit.strategy import finetune_setup

    spec = tiny_spec("llama", hidden_size=256, intermediate_size=512, vocab_size=8192, num_hidden_layers=4)
    kw: dict[str, Any] = {"freeze": targets} if how == "freeze" else {"rank": 16, "targets": targets}
    if how == "qlora":
        kw["base_dtype"] = "nf4"
    elif how == "dora":
        how, kw["dora"] = "lora", True
    elif how == "lora-bf16":
        how, kw["base_dtype"], kw["adapter_dtype"] = "lora", "bf16", "bf16"
    adapter, base = finetune_setup(how, **kw)
    s = Strategy(
        parallelism=Parallelism(data=4),
        sharding="fsdp",
        precision=precision,
        checkpointing=ckpt,
        micro_batch=2,
        seq_len=256,
        grad_accum=accum,
        adapter=adapter,
        base_weights=base,
        engine=EngineOptions(reshard_after_forward=raf, fsdp_wrap=wrap),
    )
    stream_strategy = compute_strategy(s, casts_every_param=s.recipe.mixed)  # as simulate_rank runs it
    traced, mine = _rank_peaks(spec, s, stream_strategy, FsdpHooks(spec, s, 4))
    assert mine.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.01)
    # QLoRA with checkpointing: since FSDP2 ranks run the adapters as PEFT does (events.LoraFlow) the reserve is the
    # traced run's (it was −2.4% with the saved tensors only)
    assert mine.peak_reserved_bytes == pytest.approx(traced.peak_reserved_bytes, rel=0.005 if how == "qlora" else 0.05)


def _accumulating(sharding: str, micro_batch: int, seq_len: int, *, sync: bool = True, accum: int = 2) -> Strategy:
    """``accum`` accumulation steps over 4 ranks (HSDP: 2 × 2); ``sync``: ``EngineOptions.sync_each_batch``."""
    return Strategy(
        parallelism=Parallelism(data=4, gpus_per_node=2 if sharding == "hsdp" else 8),
        sharding=sharding,
        micro_batch=micro_batch,
        seq_len=seq_len,
        grad_accum=accum,
        engine=EngineOptions(sync_each_batch=sync),
    )


def _traced_fsdp(spec: ModelSpec, s: Strategy) -> AllocatorResult:
    """The real FSDP2/HSDP run's events on the fake process group (full depth, three steps), one CUDA stream."""
    from trainfit.trace import depth
    from trainfit.trace.distributed import fake_world, fsdp_run_strategy, run_layout_distributed
    from trainfit.trace.events import tracker_events

    built, _ = fsdp_run_strategy(s)
    plan = depth.plan_depth(spec, built, extrapolate=False)
    _, layout = plan.layouts[0]
    shard = min(s.world_size, s.parallelism.gpus_per_node) if s.sharding.value == "hsdp" else None
    with fake_world(s.world_size, shard) as mesh:
        run = run_layout_distributed(spec, s, plan, layout, mesh, steps=3, adamw_impl="fused")
    return simulate(tracker_events(run), AllocatorConfig())


FSDP_ACCUMULATION_CELLS = [
    # (sharding, family, micro_batch, seq_len): the peak inside a layer's backward; in the root's post-backward
    # (a short sequence), untied and tied; HSDP's reduce outputs held to the end of backward
    ("fsdp", "llama", 2, 256),
    ("fsdp", "qwen2", 1, 32),
    ("hsdp", "llama", 1, 32),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sharding", "family", "micro_batch", "seq_len"),
    [pytest.param(*c, id="-".join(map(str, c))) for c in FSDP_ACCUMULATION_CELLS],
)
def test_the_fsdp2_stream_accumulates_like_the_traced_run(
    sharding: str, family: str, micro_batch: int, seq_len: int
) -> None:
    """FSDP2/HSDP with two accumulation steps (each micro-step reduce-scatters; the second's reduce outputs are
    added into the sharded .grad and dropped, under HSDP held as the all-reduce's input to the end of backward):
    the stream (``FsdpHooks`` replaying both micro-steps) and the closed form against the real run's events over
    4 ranks (HSDP: 2 × 2). With one micro-step the stream was 5.8% under the traced allocated peak of the first
    cell; without the held reduce outputs both were 4.4% (stream) and 14.8% (closed form) under the third's."""
    from trainfit.analytic.parallel import estimate_parallel

    spec = tiny_spec(family, hidden_size=256, intermediate_size=512, vocab_size=8192, num_hidden_layers=4)
    hsdp = sharding == "hsdp"
    s = _accumulating(sharding, micro_batch, seq_len)
    traced = _traced_fsdp(spec, s)
    st = Stream()
    hooks = FsdpHooks(spec, s, 2 if hsdp else 4, replicated=hsdp)
    synthesise(st, spec, compute_strategy(s, casts_every_param=True), (), hooks, steps=3)
    mine = simulate([Event(e.op, e.key, e.size_bytes, 0) for e in st.events], AllocatorConfig())
    assert mine.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.01)
    assert estimate_parallel(spec, s).rank(0).peak_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.01)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sharding", "family", "micro_batch", "seq_len", "accum"),
    [
        pytest.param(*c, id="-".join(map(str, c)))
        for c in [
            ("fsdp", "llama", 2, 256, 2),
            ("fsdp", "llama", 1, 32, 2),
            ("fsdp", "llama", 1, 32, 3),
            *((*x, 2) for x in FSDP_ACCUMULATION_CELLS[1:]),
        ]
    ],
)
def test_the_no_sync_accumulation_follows_the_trace(
    sharding: str, family: str, micro_batch: int, seq_len: int, accum: int
) -> None:
    """accelerate's ``no_sync`` (the HF Trainer's default; ``sync_each_batch=False``): the trace runs every
    micro-step but the last under ``set_requires_gradient_sync(False)`` (three with 3 or more steps: a middle one
    adds into the kept gradients and reduces nothing), so each parameter keeps its unsharded fp32 gradient to the
    last, which reduce-scatters layer by layer. The closed form holds those instead of the sharded gradients
    (``parallel.fsdp_unsharded_grad_bytes``) — 14.9% and 19.3% under the trace on the first two cells before — and
    the stream keeps them in ``FsdpHooks`` (``_accumulate``); both within 2% of the traced peak."""
    from trainfit.analytic.parallel import estimate_parallel

    spec = tiny_spec(family, hidden_size=256, intermediate_size=512, vocab_size=8192, num_hidden_layers=4)
    s = _accumulating(sharding, micro_batch, seq_len, sync=False, accum=accum)
    traced = _traced_fsdp(spec, s)
    synced = estimate_parallel(spec, _accumulating(sharding, micro_batch, seq_len, accum=accum)).peak_bytes
    mine = estimate_parallel(spec, s).rank(0).peak_bytes
    assert mine == pytest.approx(traced.peak_allocated_bytes, rel=0.02)
    st = Stream()
    hooks = FsdpHooks(spec, s, 2 if sharding == "hsdp" else 4, replicated=sharding == "hsdp")
    synthesise(st, spec, compute_strategy(s, casts_every_param=True), (), hooks, steps=3)
    stream = simulate([Event(e.op, e.key, e.size_bytes, 0) for e in st.events], AllocatorConfig())
    assert stream.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.02)
    # (the trace runs the first step's micro-steps too: a single synced first pass put HSDP's at −11.7%)
    assert stream.peak_reserved_bytes == pytest.approx(traced.peak_reserved_bytes, rel=0.05)
    if sharding == "fsdp":  # HSDP's synced micro-steps hold their reduce outputs: on this cell, more
        assert mine > synced


ZERO_ACCUMULATION_CELLS = [("zero2", 4, 200_000, None), ("zero1", 8, 500_000_000, None), ("zero1", 4, 200_000, True)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sharding", "w", "bucket", "overlap"),
    [pytest.param(*c, id="-".join(map(str, c))) for c in ZERO_ACCUMULATION_CELLS],
)
def test_the_zero_streams_accumulate_like_the_traced_engine(
    sharding: str, w: int, bucket: int, overlap: bool | None
) -> None:
    """DeepSpeed with two accumulation steps (the trace tells the engine which pass is the boundary,
    ``set_gradient_accumulation_boundary``): stage 2 reduces every micro-step (``Zero2Hooks`` replays two alike);
    stage 1 reduces nothing before the boundary, with or without ``overlap_comm``, so autograd's gradients stay whole
    and the bucket(s) made at the first gradient stay to the boundary's reduction (``Zero1Hooks``; the closed form's
    ``zero1_accumulating``). With one micro-step replayed the ZeRO-1 streams were 4.4–10.8% under the traced
    allocated peak, the closed form 4.5% and 8.2% under it on the last two cells."""
    traced, mine, closed = _zero_peaks(sharding, w, bucket, overlap, accum=2)
    assert mine.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.01)
    assert closed == pytest.approx(1, rel=0.01)


@pytest.mark.slow
def test_the_fsdp2_stream_wraps_a_loaded_model_as_the_traced_run_does() -> None:
    """A model loaded before ``fully_shard`` has each call's whole weights on the device while the call makes the
    shards (_fsdp_init.py ``_move_states_to_device``); they leave cached segments, the root's tied table among
    them, that the run then fills. Built on meta (``sharded_init``) only the shards exist. On a tied table of
    32 MiB (fp32) the two reserve differently, and the stream follows the traced run in each; the wrapping's own
    allocated peak (the trace's set-up events) is the stream's before its first step."""
    from trainfit.trace import depth
    from trainfit.trace.distributed import fake_world, fsdp_run_strategy, run_layout_distributed
    from trainfit.trace.events import tracker_events
    from trainfit.trace.tracker import SETUP

    spec = tiny_spec(
        "llama", hidden_size=256, intermediate_size=512, vocab_size=32768, num_hidden_layers=4, tie_word_embeddings=True
    )
    reserved = {}
    for sharded_init in (False, True):
        s = Strategy(
            parallelism=Parallelism(data=4),
            sharding="fsdp",
            micro_batch=1,
            seq_len=256,
            engine=EngineOptions(sharded_init=sharded_init),
        )
        built, _ = fsdp_run_strategy(s)
        plan = depth.plan_depth(spec, built, extrapolate=False)
        _, layout = plan.layouts[0]
        with fake_world(4) as mesh:
            run = run_layout_distributed(spec, s, plan, layout, mesh, steps=3, adamw_impl="fused")
        events = tracker_events(run)
        traced = simulate(events, AllocatorConfig())
        st = Stream()
        synthesise(st, spec, compute_strategy(s, casts_every_param=True), (), FsdpHooks(spec, s, 4), steps=3)
        mine = simulate([Event(e.op, e.key, e.size_bytes, 0) for e in st.events], AllocatorConfig())
        assert mine.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.005)
        assert mine.peak_reserved_bytes == pytest.approx(traced.peak_reserved_bytes, rel=0.01)
        reserved[sharded_init] = traced.peak_reserved_bytes
        records = run.tracker.records
        traced_setup = [e for e in events if records[e.key].phase == SETUP]
        wrap = Stream()
        FsdpHooks(spec, s, 4).weights(wrap, ())
        wrapped = simulate([Event(e.op, e.key, e.size_bytes, 0) for e in wrap.events], AllocatorConfig())
        assert wrapped.peak_allocated_bytes == pytest.approx(
            simulate(traced_setup, AllocatorConfig()).peak_allocated_bytes, rel=0.005
        )
    assert abs(reserved[False] / reserved[True] - 1) > 0.05  # the cell tells the two apart


@pytest.mark.slow
def test_the_zero1_stream_flattens_the_buckets_the_engine_copies() -> None:
    """``average_tensor`` copies a bucket into one tensor for the collective when it spans a partition edge (two
    ranges or more: ``self.flatten(bucket)``), and flattens one range as a view. ZeRO-1 reduces in the flat order
    after backward, so its copies are the engine's, size for size: at llama-2-7b over 8 ranks seven of ~940 MiB per
    step, 4% of the reserve (docs/accuracy.md)."""
    spec, s, run, _ = _zero_traced("zero1", 4, 200_000, None, 1, None, "adamw")  # the zero1-4-200000-None cell's run
    traced = [r.nbytes for r in run.tracker.records if r.op == "cat.default" and r.phase == "backward"]
    copies: list[int] = []

    class Recording(Zero1Hooks):
        def _flatten_chunks(self) -> list[int]:
            out = super()._flatten_chunks()
            copies.extend(n * self.pb for n in out)
            return out

    synthesise(Stream(), spec, compute_strategy(s), (), Recording(spec, s, parallel_plan(spec, s)), steps=3)
    assert traced and copies == traced


@pytest.mark.slow
@pytest.mark.parametrize(("tied", "w"), [(False, 2), (False, 8), (True, 8)])
def test_the_fsdp2_units_stream_follows_the_traced_run(tied: bool, w: int) -> None:
    """``--fsdp-wrap units`` (torchtitan, accelerate 1.15): the stream's groups (``FsdpHooks``: the untied table's unit
    resharded after its forward, prefetched by layer 0's pre-backward and reduced last; [final norm, head] gathered at
    the final norm, reduced right after its backward, its reduce-scatter input in flight through the top layer's;
    the last layer's prefetch on the logits, after the loss's backward) against the real ``fully_shard`` calls, on a
    shape whose peak is in the layers' backward (a 2048-token vocabulary under 512-wide layers, 1 × 1024). The
    layers-plus-root stream of the same model is 5% above the untied units' trace."""
    spec = tiny_spec(
        "llama", hidden_size=512, intermediate_size=2048, vocab_size=2048, num_hidden_layers=4, tie_word_embeddings=tied
    )
    s = Strategy(
        parallelism=Parallelism(data=w),
        sharding="fsdp",
        micro_batch=1,
        seq_len=1024,
        engine=EngineOptions(fsdp_wrap="units"),
    )
    traced, mine = _fsdp_peaks(spec, s)
    assert mine.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.003)
    assert mine.peak_reserved_bytes == pytest.approx(traced.peak_reserved_bytes, rel=0.03)
    root = Strategy(
        parallelism=Parallelism(data=w), sharding="fsdp", micro_batch=1, seq_len=1024,
        engine=EngineOptions(fsdp_wrap="root"),
    )  # fmt: skip
    st = Stream()
    synthesise(st, spec, compute_strategy(root, casts_every_param=True), (), FsdpHooks(spec, root, w), steps=3)
    wrapped = simulate([Event(e.op, e.key, e.size_bytes, 0) for e in st.events], AllocatorConfig())
    if not tied:
        assert wrapped.peak_allocated_bytes > 1.03 * traced.peak_allocated_bytes
