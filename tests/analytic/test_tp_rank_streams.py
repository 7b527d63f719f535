"""Reserved memory of tensor/pipeline-parallel ranks (trainfit.analytic.rank_events): a Megatron TP/SP/PP stage
(``MegatronStage``) as an allocator event stream in the 1F1B order, held to the closed form (trainfit.analytic.
parallel ``_megatron``), which counts the micro-batches in flight by formula (Narayanan et al. 2021: min(pp − s, m))
rather than by running the schedule: replayed, the stream must peak at exactly the closed form's bytes on every
stage and leave exactly its resident states (Megatron is not installed: no trace to replay against). A DTensor TP
rank (``DtensorTpHooks``) against ``_torch_tp``'s moments (its traced events: tests/trace/test_rank_stream.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess

import pytest

from trainfit import estimate
from trainfit.allocator import AllocatorConfig, Event, Op
from trainfit.analytic.events import Stream
from trainfit.analytic.parallel import (
    estimate_parallel,
    first_stage_embeddings,
    in_flight_chunks,
    in_flight_microbatches,
    last_stage_heads,
    megatron_init_bytes,
    megatron_inputs,
    plan,
    tp_local_spec,
)
from trainfit.analytic.rank_events import (
    interleaved_order,
    megatron_events,
    one_f_one_b,
    rank_simulated,
    simulate_rank,
)
from trainfit.arch import load_model
from trainfit.arch.params import inventory
from trainfit.arch.spec import ModelKind
from trainfit.errors import StrategyError
from trainfit.overhead import ALLOCATOR_RESERVE_FRACTION
from trainfit.result import Component, Phase
from trainfit.strategy import EngineOptions, Parallelism, PipelineSchedule, Strategy, finetune_setup

INTERLEAVED, GPIPE = PipelineSchedule.INTERLEAVED, PipelineSchedule.GPIPE


def _s(
    tp: int,
    pp: int,
    m: int = 1,
    *,
    sp: bool = False,
    dp: int = 2,
    ckpt: str = "none",
    sharding: str = "ddp",
    precision: str = "amp-bf16",
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B,
    v: int = 1,
) -> Strategy:
    return Strategy(
        parallelism=Parallelism(
            data=dp,
            tensor=tp,
            pipeline=pp,
            sequence_parallel=sp,
            microbatches=m,
            pipeline_schedule=schedule,
            virtual_stages=v,
        ),
        sharding=sharding,
        checkpointing=ckpt,
        precision=precision,
        micro_batch=1,
        seq_len=2048,
    )


@pytest.mark.parametrize(("pp", "m"), [(1, 1), (1, 4), (2, 1), (2, 8), (4, 2), (4, 16), (8, 3)])
def test_the_1f1b_order_holds_the_formulas_micro_batches(pp: int, m: int) -> None:
    """Each micro-batch runs forward then backward once, in order; the most alive at once on stage s is
    min(pp − s, m) — the closed form's count, by formula."""
    for stage in range(pp):
        order = one_f_one_b(pp, stage, m)
        assert [j for f, j in order if f] == list(range(m))
        assert [j for f, j in order if not f] == list(range(m))
        live: set[int] = set()
        most = 0
        for forward, j in order:
            if forward:
                live.add(j)
                most = max(most, len(live))
            else:
                assert j in live
                live.remove(j)
        assert most == in_flight_microbatches(PipelineSchedule.ONE_F_ONE_B, pp, stage, m, 1)


@pytest.mark.parametrize(
    ("pp", "v", "m"), [(2, 2, 2), (2, 3, 8), (4, 2, 8), (4, 4, 12), (3, 2, 9), (8, 2, 16), (8, 5, 8)]
)
def test_the_interleaved_order_holds_the_formulas_chunks(pp: int, v: int, m: int) -> None:
    """Megatron's interleaved schedule run pass by pass (``interleaved_order``): every (micro-batch, chunk) runs
    forward once and backward once after it, each micro-batch's chunks forward in order 0…v − 1 and backward in
    the reverse order; the most alive at once on stage s is the closed form's (pp − s − 1)·2 + (v − 1)·pp + 1
    capped at m·v (``in_flight_chunks``, from the warm-up formula); stage 0's chunk-0 micro-batches (each holding an
    embedding output) at most ``first_stage_embeddings``' min(m, 2·pp), reached together with the most chunks; the
    last stage's last chunk at most one (``last_stage_heads``)."""
    for stage in range(pp):
        order = interleaved_order(pp, stage, m, v)
        everything = {(j, c) for j in range(m) for c in range(v)}
        assert sorted((j, c) for f, j, c in order if f) == sorted(everything)
        assert sorted((j, c) for f, j, c in order if not f) == sorted(everything)
        for j in range(m):
            assert [c for f, i, c in order if f and i == j] == list(range(v))
            assert [c for f, i, c in order if not f and i == j] == list(reversed(range(v)))
        live: set[tuple[int, int]] = set()
        most = (0, 0)
        last_chunk = 0
        for forward, j, c in order:
            if forward:
                live.add((j, c))
            else:
                assert (j, c) in live
                live.remove((j, c))
            most = max(most, (len(live), sum(1 for _, k in live if k == 0)))
            last_chunk = max(last_chunk, sum(1 for _, k in live if k == v - 1))
        assert most[0] == in_flight_chunks(INTERLEAVED, pp, stage, m, v)
        if stage == 0:
            assert most[1] == first_stage_embeddings(INTERLEAVED, pp, m, v)
        if stage == pp - 1:
            assert last_chunk == last_stage_heads(INTERLEAVED, pp, m)


def _megatron_python() -> str | None:
    return os.environ.get("TRAINFIT_MEGATRON_PYTHON")


_MEGATRON_TABLES = """
import json, sys
from types import SimpleNamespace as N
from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table
out = []
for pp, stage, m, v in json.loads(sys.argv[1]):
    comm = N(pp_group=N(size=lambda: pp, rank=lambda: stage), virtual_pipeline_model_parallel_size=v)
    _, _, warmup, _ = get_pp_rank_microbatches(m, v, pp, p2p_communicator=comm)
    out.append([warmup, get_schedule_table(m, v, pp)])
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(
    _megatron_python() is None, reason="point TRAINFIT_MEGATRON_PYTHON at a Python with megatron-core (>= 0.17)"
)
def test_the_interleaved_order_is_megatrons_table() -> None:
    """Against Megatron's own ``get_schedule_table`` and ``get_pp_rank_microbatches`` (megatron-core, run under
    TRAINFIT_MEGATRON_PYTHON, ``microbatch_group_size_per_vp_stage`` = pp): the warm-up's length and the
    forwards' (micro-batch, chunk) sequence."""
    cases = [(2, 0, 4, 2), (4, 0, 8, 2), (4, 3, 8, 2), (4, 1, 12, 3), (8, 0, 8, 4), (3, 2, 9, 2)]
    got = subprocess.run(
        [str(_megatron_python()), "-c", _MEGATRON_TABLES, json.dumps(cases)],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    for (pp, stage, m, v), (warmup, table) in zip(cases, json.loads(got.stdout.splitlines()[-1]), strict=True):
        order = interleaved_order(pp, stage, m, v)
        assert [(j, c) for f, j, c in order if f] == [tuple(x) for x in table]
        assert next(i for i, (f, _, _) in enumerate(order) if not f) == min(warmup + 1, m * v)


def _live(events: list[Event]) -> tuple[int, int]:
    """(the most bytes alive at once, the bytes alive at the end), counted from the events as requested."""
    sizes: dict[int, int] = {}
    now = most = 0
    for e in events:
        if e.op is Op.ALLOC:
            sizes[e.key] = e.size_bytes
            now += e.size_bytes
            most = max(most, now)
        else:
            now -= sizes.pop(e.key)
    return most, now


CASES = [
    ("llama-3.2-1b", _s(2, 1)),
    ("llama-3.2-1b", _s(4, 1, 4, sp=True)),
    ("llama-3.2-1b", _s(2, 2, 8, sp=True)),
    ("llama-3.2-1b", _s(2, 4, 3, ckpt="full", sharding="zero1", dp=8)),
    ("llama-3.2-1b", _s(1, 4, 16, ckpt="selective")),
    ("qwen2.5-0.5b", _s(2, 2, 4)),  # tied: the last stage's own copy of the table
    ("qwen2.5-0.5b", _s(2, 1, 2, precision="fp32")),
    ("llama-3.1-8b", _s(8, 4, 16, sp=True, sharding="zero1")),
    # interleaved: 2 layers per chunk; every forward in the warm-up (m = pp); tied, 3 chunks, SP; 70B-like shape
    ("llama-3.2-1b", _s(2, 4, 8, schedule=INTERLEAVED, v=2)),
    ("llama-3.2-1b", _s(1, 2, 2, ckpt="full", sharding="zero1", dp=8, schedule=INTERLEAVED, v=4)),
    ("qwen2.5-0.5b", _s(2, 2, 6, sp=True, ckpt="selective", schedule=INTERLEAVED, v=3)),
    ("llama-3.1-8b", _s(8, 4, 16, sp=True, sharding="zero1", schedule=INTERLEAVED, v=4)),
    # GPipe: the last stage keeps every micro-batch's head input and loss; fewer micro-batches than stages
    ("llama-3.2-1b", _s(2, 4, 8, schedule=GPIPE)),
    ("qwen2.5-0.5b", _s(2, 2, 4, ckpt="full", schedule=GPIPE)),
    ("llama-3.2-1b", _s(1, 4, 2, sharding="zero1", schedule=GPIPE)),
    # sqrt: each model chunk in segments of ⌈c/⌈√c⌉⌉ layers (8 per stage: 3, 3, 2; 8 per chunk under interleaving)
    ("llama-3.2-1b", _s(2, 2, 4, ckpt="sqrt")),
    ("llama-3.1-8b", _s(2, 2, 8, sp=True, ckpt="sqrt", sharding="zero1", schedule=INTERLEAVED, v=2)),
    ("qwen2.5-0.5b", _s(1, 4, 4, ckpt="sqrt", schedule=GPIPE)),
]


@pytest.mark.parametrize(("slug", "strategy"), CASES)
def test_every_stage_peaks_at_the_closed_forms_bytes(slug: str, strategy: Strategy) -> None:
    spec = load_model(slug)
    p = plan(spec, strategy)
    assert rank_simulated(strategy, p)
    rep = estimate_parallel(spec, strategy)
    stages = rep.ranks or ()
    for stage in range(p.pp):
        phases = {ph.phase: ph for ph in (stages[stage].phases if stages else rep.phases)}
        peak = max(ph.total_bytes for ph in phases.values())
        s = Stream()
        megatron_events(s, spec, strategy, p, stage, steps=3)
        most, end = _live(s.events)
        # the backward is the closed form's peak phase (so the forward's recompute term is not the headline)
        assert phases[Phase.BACKWARD].total_bytes == peak
        assert most == max(peak, megatron_init_bytes(megatron_inputs(spec, strategy, p), stage, p.pp))
        step = phases[Phase.OPTIMIZER_STEP]
        resident = (Component.WEIGHTS, Component.GRADIENTS, Component.MASTER_WEIGHTS, Component.OPTIMIZER_STATES)
        assert end == sum(step.get(c) for c in resident) == step.total_bytes


@pytest.mark.parametrize(("slug", "strategy"), [*CASES[1:4], CASES[9], CASES[13], CASES[15]])
def test_the_simulated_rank_allocates_what_the_stream_does(slug: str, strategy: Strategy) -> None:
    """Through the allocator model: the allocated peak is the closed form's but for 512-byte rounding and
    unsplit remainders of large blocks (≤ 1 MiB each), and nothing is reserved below it."""
    spec = load_model(slug)
    p = plan(spec, strategy)
    rep = estimate_parallel(spec, strategy)
    stage = max(range(len(rep.ranks)), key=lambda i: rep.ranks[i].peak_bytes) if rep.ranks else 0
    res = simulate_rank(spec, strategy, p, AllocatorConfig(), stage=stage)
    assert res.peak_allocated_bytes == pytest.approx(rep.peak_bytes, rel=2e-3)
    assert res.peak_reserved_bytes >= res.peak_allocated_bytes


def test_estimate_reports_which_reserve_it_used() -> None:
    spec = load_model("llama-3.2-1b")
    for s in (_s(2, 1), _s(2, 4, 8, sp=True), _s(2, 2, 4, ckpt="full")):
        r = estimate(spec, s)
        assert r.overhead.allocator_reserve_bytes != int(r.peak_bytes * ALLOCATOR_RESERVE_FRACTION)
        note = next(n for n in r.notes if n.startswith("reserved:"))
        assert "caching-allocator simulation" in note
        assert ("pipeline stage" in note) == (s.parallelism.pipeline > 1)
    for s in (_s(2, 4, 8, schedule=GPIPE), _s(1, 4, 8, schedule=INTERLEAVED, v=2)):
        note = next(n for n in estimate(spec, s).notes if n.startswith("reserved:"))
        assert f"the {s.parallelism.pipeline_schedule.value} order" in note


def _dtensor(tp: int, *, precision: str = "amp-bf16", ckpt: str = "none", sp: bool = False) -> Strategy:
    return Strategy(
        parallelism=Parallelism(tensor=tp, sequence_parallel=sp),
        engine=EngineOptions(engine="torch"),
        precision=precision,
        checkpointing=ckpt,
        micro_batch=1,
        seq_len=2048,
    )


@pytest.mark.parametrize(
    "strategy",
    [
        _dtensor(4),
        _dtensor(2, precision="pure-bf16", ckpt="full"),
        _dtensor(8, ckpt="selective"),
        _dtensor(2, precision="fp32"),
        _dtensor(2, precision="master-bf16"),
        _dtensor(4, sp=True),
        _dtensor(2, precision="pure-bf16", ckpt="full", sp=True),
        _dtensor(8, ckpt="selective", sp=True),
        _dtensor(2, precision="fp32", sp=True),
        dataclasses.replace(_dtensor(4), grad_accum=2),  # the second micro-step adds into the resident .grad
        dataclasses.replace(_dtensor(8, ckpt="selective", sp=True), grad_accum=3),
        dataclasses.replace(_dtensor(2, precision="master-bf16"), grad_accum=2),
    ],
)
def test_the_dtensor_tp_stream_peaks_where_the_closed_form_does(strategy: Strategy) -> None:
    """DTensor TP (``DtensorTpHooks``) against ``parallel._torch_tp``: the closed form builds the rank's peak from
    moments over the TP-local model; the stream writes the same tensors in order. The allocated peak agrees
    within 0.3% (the simulator's block rounding — a large-pool block keeps a remainder of up to 1 MiB unsplit, and
    SwiGLU's four saved tensors are four blocks — and the stream's transients), and after ``zero_grad`` the rank
    holds its shard states: weights, master weights and optimizer states of ⌈V/tp⌉ vocabulary rows."""
    spec = load_model("llama-3.1-8b")
    p = plan(spec, strategy)
    assert rank_simulated(strategy, p)
    rep = estimate_parallel(spec, strategy)
    res = simulate_rank(spec, strategy, p, AllocatorConfig())
    assert res.peak_allocated_bytes == pytest.approx(rep.peak_bytes, rel=3e-3)
    step = rep.phase(Phase.OPTIMIZER_STEP)
    kept = sum(step.get(c) for c in (Component.WEIGHTS, Component.MASTER_WEIGHTS, Component.OPTIMIZER_STATES))
    assert res.allocated_end_bytes == pytest.approx(kept, rel=2e-3)


def _fsdp_tp(
    tp: int,
    dp: int,
    *,
    sp: bool = False,
    precision: str = "amp-bf16",
    ckpt: str = "none",
    accum: int = 1,
    sync: bool = True,
    raf: bool = True,
    micro: int = 2,
    seq: int = 4096,
) -> Strategy:
    return Strategy(
        parallelism=Parallelism(data=dp, tensor=tp, sequence_parallel=sp),
        sharding="fsdp",
        engine=EngineOptions(engine="torch", sync_each_batch=sync, reshard_after_forward=raf),
        precision=precision,
        checkpointing=ckpt,
        micro_batch=micro,
        seq_len=seq,
        grad_accum=accum,
    )


@pytest.mark.parametrize(
    "strategy",
    [
        _fsdp_tp(2, 4),
        _fsdp_tp(4, 2, sp=True, precision="pure-bf16", ckpt="full"),
        _fsdp_tp(8, 8, ckpt="selective"),
        _fsdp_tp(2, 4, precision="fp32"),
        _fsdp_tp(2, 4, accum=2),  # every micro-step reduce-scatters
        _fsdp_tp(2, 4, accum=3, sync=False, ckpt="full"),  # no_sync: the table's gradient kept whole
        _fsdp_tp(4, 2, sp=True, raf=False),
        _fsdp_tp(2, 4, micro=1, seq=512),  # the peak at the root's post-backward
    ],
)
def test_the_fsdp_tp_stream_peaks_where_the_closed_form_does(strategy: Strategy) -> None:
    """2-D FSDP2 × DTensor TP (``FsdpTpHooks``) against ``parallel._fsdp_tp`` at llama-3.1-8b's size: the stream's
    allocated peak within 0.5% of the closed form's (+0.00…+0.07%; −0.42% where the root's post-backward is the
    peak, 1 × 512 tokens), and after ``zero_grad`` the rank holds its shard states (the traced events: tests/trace/
    test_rank_stream.py)."""
    spec = load_model("llama-3.1-8b")
    p = plan(spec, strategy)
    assert rank_simulated(strategy, p)
    rep = estimate_parallel(spec, strategy)
    res = simulate_rank(spec, strategy, p, AllocatorConfig())
    assert res.peak_allocated_bytes == pytest.approx(rep.peak_bytes, rel=5e-3)
    step = rep.phase(Phase.OPTIMIZER_STEP)
    kept = sum(step.get(c) for c in (Component.WEIGHTS, Component.MASTER_WEIGHTS, Component.OPTIMIZER_STATES))
    assert res.allocated_end_bytes == pytest.approx(kept, rel=5e-3)


def test_estimate_simulates_dtensor_tp_and_2d_fsdp_and_refuses_adapters() -> None:
    """DTensor TP ranks (± SP, with accumulation) and 2-D FSDP2 × TP ranks replay their stream. Adapters, --freeze
    and a --base-dtype with DTensor TP get one line, not a number: PEFT shards LoRA only under transformers'
    ``tp_plan``, which is not the plan modelled (the closed form gave the whole bf16 model as each rank's weights
    and a token-table gradient that a frozen table does not have)."""
    spec = load_model("llama-3.1-8b")
    two_d = dataclasses.replace(_dtensor(4, sp=True), sharding="fsdp", parallelism=Parallelism(data=2, tensor=4))
    for s in (_dtensor(4), _dtensor(4, sp=True), dataclasses.replace(_dtensor(4, sp=True), grad_accum=2), two_d):
        r = estimate(spec, s)
        assert r.reserve_simulated
        assert any(n.startswith("reserved:") and "caching-allocator simulation" in n for n in r.notes)
    lora = finetune_setup("lora")[0]
    for s in (dataclasses.replace(_dtensor(4), adapter=lora), dataclasses.replace(two_d, adapter=lora)):
        with pytest.raises(StrategyError, match=r"DTensor tensor parallelism .* not modelled"):
            estimate(spec, s)


def test_gpipe_is_refused_without_a_causal_lm_loss() -> None:
    """The GPipe stage keeps every micro-batch's loss until its backward; the bytes it keeps are written for the
    causal-LM loss only, so other heads get one line, not a number."""
    spec = dataclasses.replace(load_model("llama-3.2-1b"), kind=ModelKind.TOKEN_CLS)
    with pytest.raises(StrategyError, match="gpipe is modelled for causal LMs"):
        plan(spec, _s(2, 4, 8, schedule=GPIPE))
    assert plan(spec, _s(2, 4, 8)).pp == 4  # 1F1B keeps the old closed form there


def test_the_distributed_optimizers_init_can_peak_above_the_step() -> None:
    """With the distributed optimizer each parameter is alive twice while DDP's buffers are built (the module's own
    and its ``param_data`` copy, plus ``grad_data``): 8 B/param in bf16 against 6 + 12/d in the step, so at a large
    data-parallel degree with full recompute the init is the rank's highest allocation. The stream (which makes the
    module's parameters, then the buffers, then frees the originals) peaks there, at ``megatron_init_bytes``; the
    estimate says so, and the simulated reserve holds it; the replicated optimizer's init has no such moment."""
    spec = load_model("llama-3.1-8b")
    s = _s(2, 1, sharding="zero1", dp=32, ckpt="full")
    p = plan(spec, s)
    rep = estimate_parallel(spec, s)
    init = megatron_init_bytes(megatron_inputs(spec, s, p), 0, 1)
    assert init == (2 + 2 + 4) * inventory(tp_local_spec(spec, 2)).total  # one chunk: every parameter of the rank
    assert init > rep.peak_bytes
    st = Stream()
    megatron_events(st, spec, s, p, 0, steps=2)
    assert _live(st.events)[0] == init
    assert any(n.startswith("Megatron's init:") for n in rep.notes)
    assert simulate_rank(spec, s, p, AllocatorConfig()).peak_reserved_bytes >= init
    ddp = _s(2, 1, sharding="ddp", dp=32, ckpt="full")
    assert megatron_init_bytes(megatron_inputs(spec, ddp, plan(spec, ddp)), 0, 1) == 0
    assert not any(n.startswith("Megatron's init:") for n in estimate_parallel(spec, ddp).notes)


@pytest.mark.parametrize(
    ("slug", "strategy"),
    [
        *CASES[::3],
        ("llama-3.2-1b", _s(2, 4, 64, ckpt="full", sharding="zero1", dp=8)),
        ("qwen2.5-0.5b", _s(2, 2, 48, sp=True, ckpt="selective")),
        ("llama-3.2-1b", _s(2, 4, 32, schedule=INTERLEAVED, v=2)),
        ("llama-3.2-1b", _s(1, 2, 40, ckpt="sqrt", schedule=GPIPE)),
        ("llama-3.1-8b", _s(4, 4, 64, sp=True, ckpt="full", sharding="zero1", dp=1)),
    ],
)
def test_a_replay_that_skips_the_repeating_passes_peaks_as_the_whole_one(
    slug: str, strategy: Strategy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``megatron_events`` skips whole periods of a schedule's steady phase once the allocator and the in-flight
    micro-batches are as they were a period before (``_repeating_passes``): on every stage the result is the replay
    of every pass's, field for field; with many micro-batches under 1F1B most passes are skipped (GPipe has no steady
    phase; this interleaved one's allocator does not settle within its 48 steady passes, so nothing is skipped)."""
    import trainfit.analytic.rank_events as rank_events
    from trainfit.analytic.events import forget_simulations

    spec = load_model(slug)
    p = plan(spec, strategy)
    real = rank_events._repeating_passes
    skipped: list[int] = []

    def counted(*args: object, **kw: object) -> tuple[int, int, int, int] | None:
        got = real(*args, **kw)  # type: ignore[arg-type]
        if got is not None:
            skipped.append(got[0] * got[1])
        return got

    for stage in range(p.pp):
        forget_simulations()
        monkeypatch.setattr(rank_events, "_repeating_passes", counted)
        fast = simulate_rank(spec, strategy, p, AllocatorConfig(), stage=stage)
        forget_simulations()
        monkeypatch.setattr(rank_events, "_repeating_passes", lambda *_a, **_k: None)
        whole = simulate_rank(spec, strategy, p, AllocatorConfig(), stage=stage)
        assert fast == whole
        # under a device capacity just below the reserved peak: a cache flush (or an OOM), counted alike
        capacity = whole.peak_reserved_bytes - (whole.peak_reserved_bytes - whole.peak_allocated_bytes) // 10
        forget_simulations()
        capped = simulate_rank(spec, strategy, p, AllocatorConfig(), stage=stage, capacity_bytes=capacity)
        forget_simulations()
        monkeypatch.setattr(rank_events, "_repeating_passes", counted)
        assert simulate_rank(spec, strategy, p, AllocatorConfig(), stage=stage, capacity_bytes=capacity) == capped
    if (
        strategy.parallelism.microbatches >= 32
        and strategy.parallelism.pipeline_schedule is PipelineSchedule.ONE_F_ONE_B
    ):
        passes = 2 * strategy.parallelism.microbatches * strategy.parallelism.virtual_stages
        assert max(skipped) > passes // 2  # most of a step's passes, on some stage
