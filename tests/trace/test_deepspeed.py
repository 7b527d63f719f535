"""Analytic vs trace for one rank of a DeepSpeed ZeRO run: the real ``DeepSpeedEngine`` (stages 1 and 2,
bf16 and fp16 blocks) on PyTorch's fake process group at W ∈ {2, 8, 64}, against the closed form of
:mod:`trainfit.analytic.parallel`, each phase within 3%. A reduce bucket of 50,000 elements keeps the bucket
from dwarfing a tiny model's states (DeepSpeed's default, 5e8 elements, is 1 GB), so several buckets fill
and flush in each backward. ``python benchmarks/agreement_distributed.py`` prints the same at catalog sizes."""

from __future__ import annotations

import dataclasses

import pytest

from trainfit.errors import StrategyError
from trainfit.result import Component, Phase
from trainfit.strategy import EngineOptions, Offload, Parallelism, Strategy, finetune_setup

from .conftest import tiny_spec

pytest.importorskip("torch")
pytest.importorskip("deepspeed")
from trainfit.analytic.parallel import estimate_parallel
from trainfit.export.configs import export_plan
from trainfit.trace.deepspeed import ds_config
from trainfit.trace.distributed import trace_distributed

TOLERANCE = 0.03
WIDER = {"hidden_size": 128, "intermediate_size": 256, "vocab_size": 512}
BUCKET = 50_000

CELLS = [
    ("zero1", 2, "amp-bf16"),
    ("zero1", 8, "amp-fp16"),
    ("zero2", 2, "amp-fp16"),
    ("zero2", 8, "amp-bf16"),
    ("zero2", 64, "amp-bf16"),
    ("zero1", 64, "amp-bf16"),
]


def _strategy(sharding: str, w: int, precision: str, **kw: object) -> Strategy:
    return Strategy(
        precision=precision,
        parallelism=Parallelism(data=w),
        sharding=sharding,
        micro_batch=2,
        seq_len=128,
        engine=EngineOptions(reduce_bucket_size=BUCKET, allgather_bucket_size=BUCKET),
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.slow
@pytest.mark.parametrize(("sharding", "w", "precision"), [pytest.param(*c, id="-".join(map(str, c))) for c in CELLS])
def test_rank_agrees_with_trace(sharding: str, w: int, precision: str) -> None:
    spec = tiny_spec("llama", **WIDER)
    s = _strategy(sharding, w, precision)
    traced = trace_distributed(spec, s)
    closed = estimate_parallel(spec, s)
    for a, t in zip(closed.phases, traced.phases, strict=True):
        assert abs(a.total_bytes - t.total_bytes) <= TOLERANCE * t.total_bytes, (
            a.phase,
            a.total_bytes,
            t.total_bytes,
        )
    step_a, step_t = closed.phase(Phase.OPTIMIZER_STEP), traced.phase(Phase.OPTIMIZER_STEP)
    for c in (Component.WEIGHTS, Component.MASTER_WEIGHTS, Component.OPTIMIZER_STATES, Component.GRADIENTS):
        assert abs(step_a.get(c) - step_t.get(c)) <= 0.01 * step_t.get(c) + 4096, c


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sharding", "optimizer"),
    [
        ("zero1", "lion"),
        ("zero2", "adafactor"),
        ("zero2", "adamw-8bit"),
        ("zero3", "adafactor"),
        ("zero3", "sgd-momentum"),
    ],
)
def test_other_optimizers_agree_with_trace(sharding: str, optimizer: str) -> None:
    """The Trainer's own optimizer as DeepSpeed's client, stepping the flat fp32 partition: its states are one long
    vector's (Adafactor's second moment unfactored), and Lion's and Adafactor's update temporaries over it come
    after the 16-bit gradients are freed (the step's peak then). Each phase within 0.5% (the states alone are 14% of
    the step's bytes here, the update temporaries 27%); the states to 4 KiB."""
    spec = tiny_spec("llama", **WIDER)
    s = _strategy(sharding, 4, "amp-bf16", optimizer=optimizer)
    traced = trace_distributed(spec, s)
    closed = estimate_parallel(spec, s)
    for a, t in zip(closed.phases, traced.phases, strict=True):
        held = t.total_bytes - t.get(Component.WORKSPACES)
        assert abs(a.total_bytes - held) <= 0.005 * held, (a.phase, a.total_bytes, held)
    step_a, step_t = closed.phase(Phase.OPTIMIZER_STEP), traced.phase(Phase.OPTIMIZER_STEP)
    assert abs(step_a.get(Component.OPTIMIZER_STATES) - step_t.get(Component.OPTIMIZER_STATES)) <= 4096


@pytest.mark.slow
def test_zero1_at_the_default_bucket_agrees_with_trace() -> None:
    """ZeRO-1 at DeepSpeed's default ``reduce_bucket_size`` (5e8 elements, a 1 GB bf16 bucket, 20 times this
    model): the gradient hooks make the whole bucket at the first gradient, whatever the model's size, and it
    stays through backward with every gradient (stage_1_and_2.py ``setup_buckets``)."""
    spec = tiny_spec("llama", **WIDER)
    s = Strategy(precision="amp-bf16", parallelism=Parallelism(data=8), sharding="zero1", micro_batch=2, seq_len=128)
    assert s.engine.reduce_bucket_size == 500_000_000
    traced = trace_distributed(spec, s)
    closed = estimate_parallel(spec, s)
    for a, t in zip(closed.phases, traced.phases, strict=True):
        assert abs(a.total_bytes - t.total_bytes) <= TOLERANCE * t.total_bytes, (a.phase, a.total_bytes, t.total_bytes)


def test_the_trace_runs_the_whole_depth() -> None:
    """What a ZeRO rank holds is not linear in the depth (its partition's edges, where the reductions fall): the
    trace runs every layer, whatever ``extrapolate`` says."""
    spec = tiny_spec("llama", num_hidden_layers=5, **WIDER)
    s = _strategy("zero2", 4, "amp-bf16")
    traced = trace_distributed(spec, s)
    assert traced.details is not None and not traced.details.extrapolated
    assert any(n.startswith("traced 5 of 5 layers") for n in traced.notes)


def test_the_trace_runs_the_exported_config() -> None:
    """What DeepSpeed is given is ``trainfit export``'s ds_config.json less its optimizer block."""
    spec = tiny_spec("llama", **WIDER)
    s = _strategy("zero2", 8, "amp-fp16")
    exported = export_plan(spec, s).deepspeed_config
    assert exported is not None
    cfg = ds_config(spec, s)
    assert "optimizer" not in cfg and "optimizer" in exported
    assert cfg == {k: v for k, v in exported.items() if k != "optimizer"}
    assert cfg["zero_optimization"]["reduce_bucket_size"] == BUCKET
    assert cfg["fp16"]["enabled"] is True


# ZeRO-3: an MLP and vocabulary above DeepSpeed's persistence threshold (1e5 elements), so that the layers'
# MLP weights, the embedding and the head are partitioned and gathered while the attention weights and norms
# stay whole; (W, precision, checkpointing, stage3_prefetch_bucket_size, stage3_max_reuse_distance).
ZERO3 = {"hidden_size": 128, "intermediate_size": 1024, "vocab_size": 1024}
ZERO3_CELLS = [
    (8, "amp-bf16", "none", 50_000, 1_000_000_000),
    (2, "amp-fp16", "none", 0, 1_000_000_000),
    (8, "amp-bf16", "full", 150_000, 300_000),
    # DeepSpeed's default prefetch bucket (5e7 elements) is larger than this model: the first module's prefetch
    # gathers every parameter in one coalesced handle, whose flat buffer lives until the head's fetch
    (8, "amp-bf16", "none", 50_000_000, 1_000_000_000),
    (64, "amp-bf16", "none", 50_000, 1_000_000_000),
]


def _zero3(w: int, precision: str, ckpt: str, prefetch: int, reuse: int, **kw: object) -> Strategy:
    """ZeRO-3 over ``w`` ranks, 2 × 128, with these prefetch bucket and reuse distance (``kw``: more fields)."""
    return Strategy(
        precision=precision,
        parallelism=Parallelism(data=w),
        sharding="zero3",
        checkpointing=ckpt,
        micro_batch=2,
        seq_len=128,
        engine=EngineOptions(
            reduce_bucket_size=BUCKET,
            allgather_bucket_size=BUCKET,
            prefetch_bucket_size=prefetch,
            max_reuse_distance=reuse,
        ),
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("w", "precision", "ckpt", "prefetch", "reuse"), [pytest.param(*c, id="-".join(map(str, c))) for c in ZERO3_CELLS]
)
def test_zero3_rank_agrees_with_trace(w: int, precision: str, ckpt: str, prefetch: int, reuse: int) -> None:
    """Rank 0 of the real ZeRO-3 engine (parameters partitioned at ``deepspeed.initialize``, the coordinator's
    fetch, prefetch and release in the second step, whose module order is recorded in the first) against the
    closed form with its replay of the coordinator (analytic/zero3.py): every phase within 2%, and the
    gathered parameters, the gradient partition and the states within 1%."""
    spec = tiny_spec("llama", **ZERO3)
    s = _zero3(w, precision, ckpt, prefetch, reuse)
    import torch

    linear = torch.nn.functional.linear
    traced = trace_distributed(spec, s)
    # ZeRO-3 swaps F.linear for its own autograd function "until manually reset": the trace must undo it, or
    # every amp model traced later in the process saves what DeepSpeed's linear saves.
    assert torch.nn.functional.linear is linear
    closed = estimate_parallel(spec, s)
    assert traced.details is not None and not traced.details.extrapolated  # stage 3 runs at full depth
    for a, t in zip(closed.phases, traced.phases, strict=True):
        assert abs(a.total_bytes - t.total_bytes) <= 0.02 * t.total_bytes, (a.phase, a.total_bytes, t.total_bytes)
    fwd_a, fwd_t = closed.phase(Phase.FORWARD), traced.phase(Phase.FORWARD)
    assert fwd_t.get(Component.UNSHARDED_PARAMS) > 0
    step_a, step_t = closed.phase(Phase.OPTIMIZER_STEP), traced.phase(Phase.OPTIMIZER_STEP)
    for c in (Component.WEIGHTS, Component.MASTER_WEIGHTS, Component.OPTIMIZER_STATES, Component.GRADIENTS):
        assert abs(step_a.get(c) - step_t.get(c)) <= 0.01 * step_t.get(c) + 4096, c
    for c in (Component.UNSHARDED_PARAMS, Component.WEIGHTS, Component.GRADIENTS):
        assert abs(fwd_a.get(c) - fwd_t.get(c)) <= 0.01 * fwd_t.get(c) + 4096, c


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["none", "optimizer"])
def test_zero3_on_one_rank_gathers_nothing(offload: str) -> None:
    """One rank: ``all_gather_coalesced`` answers with ``_no_gather_coalesced`` (``NoGatherHandle``: the parameter's
    data becomes its partition, already on the device), so nothing is gathered. The replay kept a flat buffer and a
    whole copy per fetch there (+7.6% on this cell's forward); now every phase is within 1% and no parameter is
    counted twice. (ZeRO-Infinity at one rank copies each parameter in from the host, which the trace cannot show:
    on DeepSpeed's CPU accelerator ``.to(device)`` of a host tensor returns it.)"""
    spec = tiny_spec("llama", hidden_size=256, intermediate_size=512, vocab_size=8192, num_hidden_layers=4)
    s = Strategy(
        parallelism=Parallelism(data=1),
        sharding="zero3",
        micro_batch=2,
        seq_len=256,
        offload=Offload.parse(offload),
        engine=EngineOptions(reduce_bucket_size=50_000, allgather_bucket_size=50_000, prefetch_bucket_size=50_000),
    )
    traced = trace_distributed(spec, s)
    closed = estimate_parallel(spec, s)
    for a, t in zip(closed.phases, traced.phases, strict=True):
        assert abs(a.total_bytes - t.total_bytes) <= 0.01 * t.total_bytes, (a.phase, a.total_bytes, t.total_bytes)
        assert a.get(Component.UNSHARDED_PARAMS) == t.get(Component.UNSHARDED_PARAMS) == 0


RANK_CELLS = [
    ("zero2", 8, "none"),
    ("zero2", 4, "optimizer"),
    ("zero1", 4, "none"),
    ("zero1", 4, "optimizer"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("sharding", "w", "offload"), RANK_CELLS, ids=["-".join(map(str, c)) for c in RANK_CELLS])
def test_every_rank_agrees_with_its_trace(sharding: str, w: int, offload: str) -> None:
    """ZeRO-1/2 ranks differ by the parameters their partitions meet (parallel.ZeroRank): each rank of the real
    engine, traced at full depth, against the closed form's entry for it, each phase within 3%; the last rank (the LM
    head's slice) is 16% above rank 0 in the offloaded ZeRO-2 backward, which the closed form once gave every rank."""
    from trainfit.trace.deepspeed import trace_deepspeed

    spec = tiny_spec("llama", **WIDER)
    s = _strategy(sharding, w, "amp-bf16", offload=Offload.parse(offload))
    s = dataclasses.replace(s, micro_batch=1, seq_len=32)
    closed = estimate_parallel(spec, s)
    assert closed.ranks
    for r in range(w):
        traced = trace_deepspeed(spec, s, rank=r, extrapolate=False)
        for a, t in zip(closed.rank(r).phases, traced.phases, strict=True):
            assert abs(a.total_bytes - t.total_bytes) <= TOLERANCE * t.total_bytes, (r, a.phase, a.total_bytes, t)


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["none", "optimizer"])
def test_a_head_larger_than_the_bucket_is_reduced_at_the_final_norms_hook(offload: str) -> None:
    """The LM head (512 × 128 elements) is larger than the 50 000-element bucket, so it waits for the next hook: the
    final norm's, which runs right after the head's (an ``AccumulateGrad`` node runs as soon as it is ready), before
    the top layer's recomputation. The rank holding the head's slice, against the traced engine: the backward within
    0.5% (with the final norm's hook at the end of backward the offloaded one was +1.9%: the head slice's fp64 copy
    beside the top layer's recomputed tensors), the other phases within the file's tolerance (the offloaded step is
    −0.9%, 12 KiB)."""
    from trainfit.trace.deepspeed import trace_deepspeed

    spec = tiny_spec("llama", **WIDER)
    assert spec.vocab_size * spec.hidden_size > BUCKET
    s = _strategy("zero2", 4, "amp-bf16", offload=Offload.parse(offload))
    s = dataclasses.replace(s, micro_batch=1, seq_len=256, checkpointing="full")  # type: ignore[arg-type]
    closed = estimate_parallel(spec, s)
    traced = trace_deepspeed(spec, s, rank=3, extrapolate=False)
    for a, t in zip(closed.rank(3).phases, traced.phases, strict=True):
        tol = 0.005 if a.phase is Phase.BACKWARD else TOLERANCE
        assert abs(a.total_bytes - t.total_bytes) <= tol * t.total_bytes, (a.phase, a.total_bytes, t.total_bytes)


def test_the_trace_takes_the_closed_forms_worst_rank() -> None:
    """``--method trace`` traces the rank the closed form finds the worst (the last here: it holds the LM head's slice,
    reduced as backward begins), at full depth, and says which."""
    from trainfit.trace.deepspeed import trace_deepspeed

    spec = tiny_spec("llama", **WIDER)
    s = dataclasses.replace(
        _strategy("zero2", 4, "amp-bf16", offload=Offload.parse("optimizer")), micro_batch=1, seq_len=32
    )
    closed = estimate_parallel(spec, s)
    worst = max(closed.ranks, key=lambda e: e.peak_bytes).ranks[0]
    assert worst != 0
    traced = trace_deepspeed(spec, s)
    assert any(n.startswith(f"rank {worst} of 4 (the closed form's worst") for n in traced.notes)
    assert traced.peak_bytes == pytest.approx(closed.peak_bytes, rel=TOLERANCE)
    with pytest.raises(StrategyError, match="not one of the 4 ranks"):
        trace_deepspeed(spec, s, rank=4)


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"offload": Offload.parse("optimizer+params")}, "zero3"),
        ({"optimizer": "sgd", "offload": Offload.parse("optimizer")}, "CPU AdamW"),
        # what no one models is refused as the analytic model refuses it
        (dict(zip(("adapter", "base_weights"), finetune_setup("qlora", base_dtype="nf4"), strict=True)), "QLoRA"),
        (dict(zip(("adapter", "base_weights"), finetune_setup("lora", base_dtype="fp32"), strict=True)), "recast"),
    ],
)
def test_refusals_are_one_line(kw: dict[str, object], words: str) -> None:
    args: dict[str, object] = {"sharding": "zero2", **kw}
    sharding = str(args.pop("sharding"))
    s = _strategy(sharding, 8, "amp-bf16", **args)
    with pytest.raises(StrategyError, match=words):
        trace_distributed(tiny_spec("llama", **WIDER), s)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["zero1", "zero2"])
def test_an_accumulating_rank_agrees_with_trace(sharding: str) -> None:
    """Two accumulation steps, traced through the engine at depth (the boundary set per pass,
    ``set_gradient_accumulation_boundary``, the depth extrapolation over both passes): every phase within the
    tolerance. The small bucket here hides stage 1's bucket kept across micro-steps within it; the cells that
    separate it are tests/trace/test_rank_stream.py's ``test_the_zero_streams_accumulate_like_the_traced_engine``."""
    spec = tiny_spec("llama", **WIDER)
    s = _strategy(sharding, 8, "amp-bf16", grad_accum=2)
    traced = trace_distributed(spec, s)
    closed = estimate_parallel(spec, s)
    for a, t in zip(closed.phases, traced.phases, strict=True):
        assert abs(a.total_bytes - t.total_bytes) <= TOLERANCE * t.total_bytes, (a.phase, a.total_bytes, t.total_bytes)


@pytest.mark.slow
def test_zero1_offload_keeps_its_bucket_across_micro_steps() -> None:
    """ZeRO-1 with ZeRO-Offload under accumulation: as without offload, a micro-step before the boundary reduces
    nothing, so autograd's gradients stay whole on the device and the bucket made at the first gradient (here
    DeepSpeed's default, 5e8 elements: 1 GB in bf16) stays to the boundary's reduction, through every later forward.
    The closed form had it only at the reduction: −92% in the forward, −4.3% in the backward."""
    spec = tiny_spec("llama", hidden_size=256, intermediate_size=512, vocab_size=8192, num_hidden_layers=4)
    s = Strategy(
        parallelism=Parallelism(data=8),
        sharding="zero1",
        micro_batch=2,
        seq_len=256,
        grad_accum=3,
        offload=Offload.parse("optimizer"),
        engine=EngineOptions(reduce_bucket_size=500_000_000, allgather_bucket_size=500_000_000),
    )
    traced = trace_distributed(spec, s)
    closed = estimate_parallel(spec, s)
    for a, t in zip(closed.phases, traced.phases, strict=True):
        assert abs(a.total_bytes - t.total_bytes) <= 0.01 * t.total_bytes, (a.phase, a.total_bytes, t.total_bytes)
    assert closed.phase(Phase.FORWARD).get(Component.COMM_BUFFERS) >= 500_000_000 * 2  # + the 16-bit staging buffer


def _finetune(what: str) -> dict[str, object]:
    """The adapter and base weights of ``what``: LoRA (r 16, all-linear), DoRA, or ``--freeze
    embeddings,layers:0-1``."""
    if what == "freeze":
        adapter, base = finetune_setup("freeze", freeze="embeddings,layers:0-1")
    else:
        adapter, base = finetune_setup("lora", rank=16, dora=what == "dora")
    return {"adapter": adapter, "base_weights": base}


def _fine_tuning_agrees(spec: object, s: Strategy, tolerance: float) -> None:
    """The traced fine-tuning rank against the closed form: the same trainable count, each phase within
    ``tolerance``, the step's states within 1%."""
    traced = trace_distributed(spec, s)  # type: ignore[arg-type]
    closed = estimate_parallel(spec, s)  # type: ignore[arg-type]
    assert traced.trainable_params == closed.trainable_params < traced.params
    for a, t in zip(closed.phases, traced.phases, strict=True):
        assert abs(a.total_bytes - t.total_bytes) <= tolerance * t.total_bytes, (a.phase, a.total_bytes, t.total_bytes)
    step_a, step_t = closed.phase(Phase.OPTIMIZER_STEP), traced.phase(Phase.OPTIMIZER_STEP)
    for c in (Component.WEIGHTS, Component.MASTER_WEIGHTS, Component.OPTIMIZER_STATES, Component.GRADIENTS):
        assert abs(step_a.get(c) - step_t.get(c)) <= 0.01 * step_t.get(c) + 4096, c


#: (sharding, what trains, precision, checkpointing, accumulation steps)
FINETUNE_CELLS = [
    ("zero1", "lora", "amp-bf16", "none", 1),
    ("zero2", "freeze", "amp-bf16", "none", 1),
    ("zero2", "dora", "amp-fp16", "none", 2),
    ("zero1", "freeze", "amp-bf16", "full", 2),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sharding", "what", "precision", "ckpt", "accum"),
    [pytest.param(*c, id="-".join(map(str, c))) for c in FINETUNE_CELLS],
)
def test_a_fine_tuning_rank_agrees_with_trace(sharding: str, what: str, precision: str, ckpt: str, accum: int) -> None:
    """ZeRO-1/2 with real PEFT adapters (LoRA all-linear, DoRA) or ``--freeze embeddings,layers:0-1`` under the real
    engine: the client optimizer gets the trainable parameters only, so the flat 16-bit groups, the fp32 partition,
    Adam's states and the gradient partition are the trainable ones'; the frozen parameters (adapted bases too) stay
    16-bit module parameters (DeepSpeed's bf16/fp16 block casts the whole module, adapters included). The step
    flattens the gradient partition and casts it to fp32 (the closed form kept only the cast before it was traced:
    −5.7% in the step of the freeze cell), and rank 0's gradient partition holds whole the trainable tensors its
    slice meets (−0.8% in that step without). Every phase within 1% (−0.34…+0.2% measured). Not here: DoRA with full
    checkpointing, +9% in backward at this size (the one-GPU closed form is −6.8% in forward for DoRA with full
    checkpointing under pure bf16 at this size too; at catalog size DoRA agrees within 0.01%, docs/accuracy.md)."""
    s = _strategy(sharding, 4, precision, checkpointing=ckpt, grad_accum=accum, **_finetune(what))
    _fine_tuning_agrees(tiny_spec("llama", **WIDER), s, 0.01)


#: (what trains, W, precision, checkpointing, stage3_prefetch_bucket_size, stage3_max_reuse_distance)
ZERO3_FINETUNE_CELLS = [
    ("lora", 8, "amp-bf16", "none", 50_000, 1_000_000_000),
    ("freeze", 8, "amp-bf16", "none", 50_000, 1_000_000_000),
    ("lora", 8, "amp-bf16", "full", 150_000, 300_000),
    ("freeze", 8, "amp-bf16", "none", 50_000_000, 1_000_000_000),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("what", "w", "precision", "ckpt", "prefetch", "reuse"),
    [pytest.param(*c, id="-".join(map(str, c))) for c in ZERO3_FINETUNE_CELLS],
)
def test_a_zero3_fine_tuning_rank_agrees_with_trace(
    what: str, w: int, precision: str, ckpt: str, prefetch: int, reuse: int
) -> None:
    """ZeRO-3 with real PEFT LoRA adapters or ``--freeze embeddings,layers:0-1``: every parameter is partitioned, the
    frozen ones with their own ``ds_tensor`` beside the optimizer's flat buffer; the coordinator's replay has no
    backward fetch where no output requires grad (the dead layers, a frozen table: +12% in forward before), and the
    step's peak is at its start when the persistent parameters, still whole, outweigh its own temporaries (LoRA:
    −29% before). Every phase within 2% (−0.7…+1.5% measured), the states within 1%."""
    _fine_tuning_agrees(
        tiny_spec("llama", **ZERO3), _zero3(w, precision, ckpt, prefetch, reuse, **_finetune(what)), 0.02
    )


@pytest.mark.parametrize("stage", [2, 3])
def test_the_zero_optimizer_steps_one_flat_partition(stage: int) -> None:
    """What a client optimizer (the Trainer's own: here transformers' Adafactor) steps under ZeRO is the rank's flat
    1-D fp32 partition, not the model's tensors: the real engine (CPU accelerator, a 4-rank fake process group,
    one real step) leaves one state of a quarter of the model's elements, Adafactor's second moment unfactored —
    what the closed form's optimizer states hold (``_deepspeed``: ``optimizer_state_bytes`` of the flat partition)."""
    import deepspeed
    import torch
    from transformers.optimization import Adafactor

    from trainfit.trace.deepspeed import _deepspeed_world, _quiet_deepspeed

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)).to(torch.bfloat16)
    numel = sum(p.numel() for p in model.parameters())
    cfg = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": True},
        "zero_allow_untested_optimizer": True,
    }
    opt = Adafactor(model.parameters(), lr=1e-3, relative_step=False, scale_parameter=False)
    with _quiet_deepspeed(), _deepspeed_world(4):
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        engine.backward(engine(torch.randn(1, 64, dtype=torch.bfloat16)).float().sum())
        engine.step()
        states = list(engine.optimizer.optimizer.state.items())
    ((flat, state),) = states
    assert flat.dim() == 1 and flat.numel() == -(-numel // 4) and flat.dtype == torch.float32
    assert state["exp_avg_sq"].shape == flat.shape  # a 1-D parameter: nothing factored
    closed = estimate_parallel(
        tiny_spec("llama"), Strategy(parallelism=Parallelism(data=4), sharding=f"zero{stage}", optimizer="adafactor")
    )
    per_param = closed.phases[-1].get(Component.OPTIMIZER_STATES) / closed.trainable_params
    assert per_param == pytest.approx(4 / 4, rel=0.05)  # 4 bytes per element of a 1/4 partition
