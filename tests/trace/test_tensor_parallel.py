"""Analytic vs trace for one rank of DTensor tensor parallelism (``--engine torch --tp N``, ± sequence
parallelism), on tiny Llama configs. The trace runs the real ``parallelize_module`` plan
(trainfit.trace.tensor_parallel) on PyTorch's fake process group; the analytic model
(trainfit.analytic.parallel ``_torch_tp``) is closed-form. Each phase must agree within 3%. The trace itself
is checked against the same steps on real CPU tensors (``torch.profiler``), as for one GPU.
``python benchmarks/agreement_distributed.py`` prints the same at catalog sizes."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest

from trainfit.arch.params import inventory
from trainfit.arch.spec import ModelSpec
from trainfit.errors import StrategyError
from trainfit.result import Component, Phase
from trainfit.strategy import EngineOptions, Parallelism, Sharding, Strategy

from .conftest import tiny_spec, traced_once

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
    _agrees(spec, s, TOLERANCE)


# (tp, dp, sequence parallel): TP 8 with and without SP, and W = 64 as tp × dp (the matrix: W ∈ {2, 8, 64}).
TP8_CELLS = [
    pytest.param(8, 1, True, id="tp8-dp1-sp"),
    pytest.param(8, 1, False, id="tp8-dp1-nosp"),
    pytest.param(8, 8, False, id="tp8-dp8-nosp-w64"),
    pytest.param(2, 32, True, id="tp2-dp32-sp-w64"),
]


@pytest.mark.parametrize(("tp", "dp", "sp"), TP8_CELLS)
def test_tp8_rank_agrees_with_trace(tp: int, dp: int, sp: bool) -> None:
    """TP 8 (heads and k/v heads that 8 divides): each shard of a projection is 1/8 of it; with and without SP, and
    at W = 64 (DP without sharding, so each rank holds what TP alone gives it, the data-parallel size changing
    nothing on the rank — the trace still builds the 2-D mesh)."""
    spec = tiny_spec("llama", **{**WIDER, "num_key_value_heads": 8}, tie_word_embeddings=False)
    _agrees(spec, _strategy(tp, dp, sp, "amp-bf16"), TOLERANCE)


def _agrees(spec: ModelSpec, s: Strategy, tolerance: float, step_slack: int = 0) -> None:
    """Each phase of the closed form within ``tolerance`` of the trace (+ ``step_slack`` bytes in the optimizer
    step), the step's states within 1%."""
    traced = traced_once(trace_distributed, spec, s)
    closed = estimate_parallel(spec, s)
    for a, t in zip(closed.phases, traced.phases, strict=True):
        slack = step_slack if a.phase is Phase.OPTIMIZER_STEP else 0
        assert abs(a.total_bytes - t.total_bytes) <= tolerance * t.total_bytes + slack, (
            a.phase,
            a.total_bytes,
            t.total_bytes,
        )
    step_a, step_t = closed.phase(Phase.OPTIMIZER_STEP), traced.phase(Phase.OPTIMIZER_STEP)
    for c in (Component.WEIGHTS, Component.OPTIMIZER_STATES, Component.GRADIENTS):
        assert abs(step_a.get(c) - step_t.get(c)) <= 0.01 * step_t.get(c) + 4096, c


def test_selective_recompute_applies_under_tp() -> None:
    """``--checkpointing selective`` under DTensor TP checkpoints the attention core (trace.savers
    ``selective_recompute``, as on one GPU and under FSDP2). The trace used to ignore it and run without recompute;
    here it must save other bytes than the run without it, and every phase must agree with the closed form within
    1% (the run without recompute is 1.7% below the analytic selective backward, so an ignored flag fails)."""
    spec = tiny_spec("llama", **WIDER, tie_word_embeddings=False)
    sel, none = _strategy(2, 1, True, "amp-bf16", "selective"), _strategy(2, 1, True, "amp-bf16", "none")
    traced, plain = traced_once(trace_distributed, spec, sel), traced_once(trace_distributed, spec, none)
    assert traced.phase(Phase.BACKWARD).get(Component.ACTIVATIONS) != plain.phase(Phase.BACKWARD).get(
        Component.ACTIVATIONS
    )
    closed = estimate_parallel(spec, sel)
    for a, t in zip(closed.phases, traced.phases, strict=True):
        assert abs(a.total_bytes - t.total_bytes) <= 0.01 * t.total_bytes, (a.phase, a.total_bytes, t.total_bytes)


FSDP_TOLERANCE = 0.02
# (tp, dp, sequence parallel, precision, checkpointing, reshard_after_forward)
FSDP_CELLS = [
    pytest.param(2, 4, False, "amp-bf16", "none", True, id="tp2-dp4-nosp-amp-bf16"),
    pytest.param(4, 2, True, "pure-bf16", "full", True, id="tp4-dp2-sp-pure-bf16-ckpt-full"),
    pytest.param(2, 4, True, "fp32", "none", False, id="tp2-dp4-sp-fp32-no-reshard", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("tp", "dp", "sp", "precision", "ckpt", "raf"), FSDP_CELLS)
def test_fsdp_tp_rank_agrees_with_trace(tp: int, dp: int, sp: bool, precision: str, ckpt: str, raf: bool) -> None:
    """2-D FSDP2 × TP (``--sharding fsdp``): the trace runs ``parallelize_module`` then ``fully_shard`` per layer
    and root on the ``dp`` mesh dimension (torchtitan's ``parallelize_llama``); the analytic model shards the
    TP-local tensors with FSDP2's rules. Each phase within 2%; the states within 1% (+ grad clipping's
    per-tensor norms, 512 bytes each, which neither model counts)."""
    spec = tiny_spec("llama", **WIDER, tie_word_embeddings=False)
    s = dataclasses.replace(
        _strategy(tp, dp, sp, precision, ckpt),
        sharding=Sharding.FSDP,
        engine=EngineOptions(engine="torch", reshard_after_forward=raf),
    )
    # clip_grad_norm_ in the traced step: one 512-byte norm per parameter tensor, their stack and the clip
    # coefficient (torch/nn/utils/clip_grad.py ``_get_total_norm``), not in the analytic model.
    clip = 512 * (sum(m for _, m in inventory(spec).all_tensors()) + 2)
    _agrees(spec, s, FSDP_TOLERANCE, step_slack=clip)


@pytest.mark.parametrize("sync", [False, True], ids=["no-sync", "sync-each-batch"])
def test_fsdp_tp_accumulation_follows_no_sync(sync: bool) -> None:
    """2-D FSDP2 × TP with three accumulation steps: under accelerate's ``no_sync`` the trace now runs the micro-steps
    before the last with ``set_requires_gradient_sync(False)``, as FSDP2 alone does (it ignored it before and traced
    every micro-step reduce-scattering), and the closed form keeps the token table's unsharded gradient whole in the
    reduce dtype: the embedding's backward makes the whole table's gradient and only the reducing post-backward
    copies the rank's rows out (``parallel.tp_kept_table_grad_bytes``; the closed form was 4.1% under the trace of a
    hidden-256 cell without it). Each phase within 1%."""
    spec = tiny_spec("llama", **WIDER, tie_word_embeddings=False)
    s = dataclasses.replace(
        _strategy(2, 2, False, "amp-bf16"),
        sharding=Sharding.FSDP,
        grad_accum=3,
        engine=EngineOptions(engine="torch", sync_each_batch=sync),
    )
    clip = 512 * (sum(m for _, m in inventory(spec).all_tensors()) + 2)
    _agrees(spec, s, 0.01, step_slack=clip)
    if not sync:  # the kept gradients: more than with a reduce-scatter after every micro-step
        synced = dataclasses.replace(s, engine=EngineOptions(engine="torch", sync_each_batch=True))
        assert (
            traced_once(trace_distributed, spec, s).peak_bytes > traced_once(trace_distributed, spec, synced).peak_bytes
        )


def _run_tp(spec, s: Strategy, mode, mesh, **kw):  # type: ignore[no-untyped-def]
    """All layers of ``spec`` parallelised with the plan and run for two steps (fake tensors or real ones)."""
    from trainfit.trace import hf
    from trainfit.trace import runner as rn
    from trainfit.trace.optim import make_optimizer
    from trainfit.trace.tensor_parallel import TPTracker, parallelize

    meta, _ = hf.build_meta(spec, s, rn.weight_dtype(s.recipe))
    n = meta.config.num_hidden_layers
    path, _stack = hf.find_stack(meta, n)
    model = hf.reduced_model(meta, path, list(range(n)), n)
    rn.materialize(model, mode, None)
    layers = list(model.get_submodule(path))
    tr = TPTracker()
    with contextlib.ExitStack() as ctx:
        if mode is not None:  # the fake trace builds the DTensors under the tracker, as trace_tensor_parallel does
            ctx.enter_context(mode)
            ctx.enter_context(tr)
        parallelize(model, layers, mesh["tp"], sequence_parallel=s.parallelism.sequence_parallel)
    fns = rn.StepFns(
        make_batch=hf.batch_fn(spec, s.micro_batch, s.seq_len),
        forward=lambda m, b: m(**b),
        loss_of=lambda o, _b: o.loss,
        make_optimizer=lambda p: make_optimizer(s.optimizer, p, adamw_impl="foreach"),
    )
    opts = rn.RunOptions(recipe=s.recipe, head_module=hf.head_of(model))
    with hf.runtime_patches():
        return rn.run_steps(model, fns, opts, rn.Execution(mode=mode, emulate_cuda=False, tracker=lambda: tr, **kw))


@pytest.mark.parametrize(("sp", "precision"), [(True, "fp32"), (False, "amp-bf16"), (True, "pure-bf16")])
def test_fake_trace_matches_real_cpu_run(sp: bool, precision: str) -> None:
    """Ground truth for the tracker's DTensor handling (local shards, ``wait_tensor`` returning its input, the
    whole token-table gradient): the same TP steps on real CPU tensors over the fake process group, measured by
    ``torch.profiler(profile_memory=True)``, agree with the fake-tensor trace to a constant few KiB."""
    from trainfit.trace import readout
    from trainfit.trace import runner as rn
    from trainfit.trace.tensor_parallel import fake_mesh

    from .test_real_cpu import TOL_BYTES, profiled_window_peaks

    spec = tiny_spec("llama", **WIDER | {"num_hidden_layers": 2})
    s = Strategy(
        precision=precision,
        parallelism=Parallelism(tensor=2, sequence_parallel=sp),
        engine=EngineOptions(engine="torch"),
        micro_batch=2,
        seq_len=64,
    )
    with fake_mesh(1, 2) as mesh:
        fake = readout.phase_peaks(_run_tp(spec, s, rn.fake_mode(), mesh))
        real = profiled_window_peaks(
            lambda: _run_tp(spec, s, None, mesh, track=False, annotate=True),
            {ph.value: f"trainfit:1:{ph.value}" for ph in Phase},
        )
    for ph, pk in fake.items():
        assert abs(pk.total_bytes - real[ph.value]) <= TOL_BYTES, (ph, pk.total_bytes, real[ph.value])


@pytest.mark.slow
def test_sequence_parallel_splits_the_norms_not_the_matmul_inputs() -> None:
    """SP removes from each layer what the traced norms saved, (1 − 1/tp) of it, and nothing else: the trace's
    activation saving from SP equals the analytic model's, which counts the norms alone."""
    spec = tiny_spec("llama", **WIDER)
    t = {sp: traced_once(trace_distributed, spec, _strategy(2, 1, sp, "amp-bf16")) for sp in (False, True)}
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
        ({"sharding": "hsdp"}, "none|fsdp"),
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


def test_a_forward_peak_inside_the_top_layer_is_traced_at_two_and_three_units_on_a_tp_rank() -> None:
    """As on one GPU (tests/trace/test_depth.py): eager attention's chain sets the forward peak inside the top layer,
    where the one-unit trace holds the embedding output and the layer's input as one tensor; the TP trace re-runs at
    2 and 3 units and equals the full-depth trace."""
    from trainfit.trace.tensor_parallel import trace_tensor_parallel

    spec = tiny_spec("llama", num_hidden_layers=4)
    s = Strategy(
        precision="pure-bf16",
        attention="eager",
        micro_batch=2,
        seq_len=1024,
        parallelism=Parallelism(tensor=2),
        engine=EngineOptions(engine="torch"),
    )
    ext, full = trace_tensor_parallel(spec, s), trace_tensor_parallel(spec, s, extrapolate=False)
    assert ext.extra["layers_traced"] == [2, 3]
    assert [p.total_bytes for p in ext.phases] == [p.total_bytes for p in full.phases]
