"""One rank of a tensor-parallel run, traced: DTensor ``parallelize_module`` on the fake process group.

The reference for the ``--engine torch`` tensor-parallel model in :mod:`trainfit.analytic.parallel`. Rank 0
of ``dp × tp`` ranks on PyTorch's fake process group (:func:`trainfit.trace.distributed.fake_world`) with a
2-D CPU device mesh ``("dp", "tp")``; the reduced-depth Hugging Face model is parallelised with the real
DTensor plan and run by the single-GPU step runner under :class:`~trainfit.trace.distributed.DistTracker`,
then extrapolated in depth like the single-GPU trace. The cost of a step does not depend on the degrees.

The plan is torchtitan's Llama plan (torchtitan/models/llama3/infra/parallelize.py ``apply_tp``) on the
Hugging Face module names, with the styles of torch/distributed/tensor/parallel/style.py:

* ``q_proj``/``k_proj``/``v_proj``/``gate_proj``/``up_proj``: ``ColwiseParallel`` (weight ``Shard(0)``, local
  heads and MLP width), ``o_proj``/``down_proj``: ``RowwiseParallel`` (weight ``Shard(1)``, output all-reduced);
  attention runs on plain local tensors of ``heads/tp`` heads.
* ``embed_tokens``: ``RowwiseParallel(input_layouts=Replicate())`` — the table sharded on the vocabulary,
  the masked lookup all-reduced; ``lm_head``: ``ColwiseParallel(output_layouts=Replicate())``, the logits
  all-gathered for the model's own loss (torchtitan without loss parallel; transformers' ``colwise_rep``).
* Sequence parallelism (``--sequence-parallel``): the norms are ``SequenceParallel()``, the embedding,
  ``o_proj`` and ``down_proj`` return ``Shard(1)`` DTensors (``use_local_output=False``: transformers
  builds RoPE and the causal mask from the hidden states' sequence length, which must stay global —
  DESIGN §4.3), and ``PrepareModuleInput`` all-gathers the attention and MLP inputs (``Shard(1)`` →
  ``Replicate()``); the final norm is ``SequenceParallel`` and ``lm_head`` takes ``Shard(1)`` input.

Norm weights stay plain replicated tensors without SP (and replicated DTensors with it). With
``--sharding fsdp`` the TP-parallelised model is then sharded by FSDP2 over the ``dp`` mesh dimension
(2-D, torchtitan's ``apply_fsdp``). The precision recipe is the single-GPU one (TP changes no dtype);
FSDP2 applies its mixed-precision policy as in :mod:`trainfit.trace.distributed`. Recompute as on one GPU:
``full``/``sqrt``/``sac`` checkpoint the layers (trace.hf ``install_checkpointing``), ``selective`` the attention
core (trace.savers ``selective_recompute``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from trainfit.arch.spec import ModelSpec
from trainfit.errors import StrategyError
from trainfit.result import MemoryReport
from trainfit.strategy import Checkpointing, Engine, Sharding, Strategy
from trainfit.trace import depth, hf
from trainfit.trace import runner as rn
from trainfit.trace.distributed import (
    DistTracker,
    fsdp_run_strategy,
    keyed_rank,
    no_sync_passes,
    patched_resize,
    rank_report,
    run_layouts,
    wrap_fsdp,
)
from trainfit.trace.optim import make_optimizer

Progress = Callable[[str, float], None]

#: HF Llama-family module names of the plan (decoder layer attribute paths).
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")


def check_traceable_tp(spec: ModelSpec, strategy: Strategy) -> None:
    """What this trace runs: DTensor TP (± SP) of a dense untied Llama-style decoder, data parallel without
    sharding, the single-GPU recipe. The analytic model's own checks (the same setups) run first."""
    from trainfit.analytic.parallel import plan

    if strategy.engine.engine is Engine.MEGATRON:
        raise StrategyError(
            "--method trace runs DTensor tensor parallelism (--engine torch); Megatron-LM: use --method analytic"
        )
    if strategy.parallelism.pipeline > 1:
        raise StrategyError("--method trace does not run pipeline parallelism; use --method analytic")
    plan(spec, torch_engine(strategy))
    if not strategy.trains_every_weight or not strategy.base_weights.is_default:
        raise StrategyError("adapters or frozen/quantised base weights with tensor parallelism are not modelled")


def torch_engine(strategy: Strategy) -> Strategy:
    """``strategy`` with ``--engine torch`` (``auto`` resolves TP to Megatron in the analytic model)."""
    import dataclasses

    return dataclasses.replace(strategy, engine=dataclasses.replace(strategy.engine, engine=Engine.TORCH))


def _no_parallel() -> Any:
    """A module replicated over the TP group: its parameters become ``Replicate()`` DTensors (views of the
    local tensors), its input a ``Replicate()`` DTensor and its output the local tensor again — torchtitan's
    ``NoParallel`` (torchtitan/distributed/tensor_parallel.py). Without SP the norms need it so that every
    parameter is a DTensor: ``clip_grad_norm_``'s ``_foreach_norm`` refuses plain tensors mixed with DTensors."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    class NoParallel(ParallelStyle):
        def _apply(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
            def params(_name: str, mod: torch.nn.Module, mesh: Any) -> None:
                for p_name, p in list(mod.named_parameters(recurse=False)):
                    local = DTensor.from_local(p, mesh, [Replicate()], run_check=False)
                    mod.register_parameter(p_name, torch.nn.Parameter(local))

            def inputs(_mod: torch.nn.Module, args: Any, mesh: Any) -> Any:
                return tuple(
                    DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                    if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
                    else a
                    for a in args
                )

            def outputs(_mod: torch.nn.Module, out: Any, _mesh: Any) -> Any:
                return out.to_local() if isinstance(out, DTensor) else out

            return distribute_module(module, device_mesh, params, inputs, outputs)

    return NoParallel()


def _layer_plan(sequence_parallel: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {name: ColwiseParallel() for name in COLWISE}
    if not sequence_parallel:
        plan |= {name: RowwiseParallel() for name in ROWWISE}
        plan |= {name: _no_parallel() for name in NORMS}
        return plan
    plan |= {name: RowwiseParallel(output_layouts=Shard(1), use_local_output=False) for name in ROWWISE}
    plan |= {name: SequenceParallel() for name in NORMS}
    plan["self_attn"] = PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": Shard(1)},
        desired_input_kwarg_layouts={"hidden_states": Replicate()},
    )
    plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def parallelize(
    model: torch.nn.Module, layers: list[torch.nn.Module], tp_mesh: Any, *, sequence_parallel: bool
) -> None:
    """Apply the plan (see the module docstring) to ``model`` in place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    root: dict[str, Any]
    if sequence_parallel:
        root = {
            "model.embed_tokens": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
            ),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
    else:
        root = {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "model.norm": _no_parallel(),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        }
    parallelize_module(model, tp_mesh, root)
    plan = _layer_plan(sequence_parallel)
    for layer in layers:
        parallelize_module(layer, tp_mesh, plan)


@contextlib.contextmanager
def fake_mesh(dp: int, tp: int) -> Iterator[Any]:
    """Rank 0 of ``dp × tp`` on the fake process group and its 2-D CPU mesh ``("dp", "tp")`` (TP innermost,
    as torchtitan's ``ParallelDims`` builds it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp * tp)
    try:
        yield init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    finally:
        dist.destroy_process_group()


class TPTracker(DistTracker):  # type: ignore[no-untyped-call]
    """:class:`~trainfit.trace.distributed.DistTracker` whose ``_c10d_functional.wait_tensor`` returns its input,
    as it does on a device (torch/csrc/distributed/c10d/Functional.cpp ``wait_tensor``): under fake tensors
    it would otherwise make a second storage for every collective's result (DESIGN §4.3)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops._c10d_functional.wait_tensor.default:
            return args[0]
        return super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[no-untyped-call]


@contextlib.contextmanager
def _mesh_tensor_outside_modes() -> Iterator[None]:
    """Device meshes built, and their rank tensor read, with no dispatch mode active: FSDP2 over a TP DTensor
    concatenates the dp and tp meshes (device_mesh.py ``DeviceMesh._concatenate``, _fsdp_param.py
    ``_init_sharding_spec_tp``), whose rank tensors are made from the real rank map (``as_strided``, ``eq``)
    — refused under fake tensors, and not memory the rank's step holds."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils._python_dispatch import _disable_current_modes

    prop = DeviceMesh.__dict__["mesh"]
    init = DeviceMesh.__init__

    def mesh(self: Any) -> Any:
        with _disable_current_modes():
            return prop.fget(self)

    def build(self: Any, *args: Any, **kwargs: Any) -> None:
        with _disable_current_modes():
            init(self, *args, **kwargs)

    DeviceMesh.mesh = property(mesh)  # type: ignore[method-assign,assignment]
    DeviceMesh.__init__ = build  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh.mesh = prop  # type: ignore[method-assign]
        DeviceMesh.__init__ = init  # type: ignore[method-assign]


def run_layout_tp(
    spec: ModelSpec,
    strategy: Strategy,
    plan: depth.DepthPlan,
    layout: hf.Layout,
    mesh: Any,
    *,
    steps: int,
    adamw_impl: str,
) -> rn.TraceRun:
    """Build the reduced model of ``layout``, parallelise it on ``mesh["tp"]`` (and with ``--sharding fsdp``
    shard it with FSDP2 on ``mesh["dp"]``) and run it under the tracker."""
    fsdp = strategy.sharding is Sharding.FSDP
    _, rec = fsdp_run_strategy(strategy)
    mode = rn.fake_mode()
    model = hf.reduced_model(plan.meta, plan.stack_path, layout.layers, plan.full_layers)
    rn.materialize(model, mode, None)
    stack: Any = model.get_submodule(plan.stack_path)
    layers: list[torch.nn.Module] = list(stack)
    box: list[Any] = []
    hf.install_checkpointing(model, layers, layout.blocks, box, sac=strategy.checkpointing is Checkpointing.SAC)
    first, last = depth.layer_positions(layout)
    tr = TPTracker()
    box.append(tr)
    with mode, tr:
        parallelize(model, layers, mesh["tp"], sequence_parallel=strategy.parallelism.sequence_parallel)
    if fsdp:
        # torchtitan's apply_fsdp after apply_tp: FSDP2 shards each DTensor's local (TP) tensor on dim 0
        # over the dp mesh dimension (_fsdp_param.py ``_init_sharding_spec_tp``); resize_ frees are tracked.
        with _mesh_tensor_outside_modes(), mode, tr, patched_resize(tr):
            # 2-D: the layers-plus-root wrapping (--fsdp-wrap units with tensor parallelism is not modelled;
            # analytic.parallel.resolved_fsdp_wrap resolves auto to root here too)
            wrap_fsdp(model, layers, mesh["dp"], strategy, units=False)
    fns = rn.StepFns(
        make_batch=hf.batch_fn(spec, strategy.micro_batch, strategy.seq_len, device="cpu"),
        forward=lambda m, batch: m(**batch),
        loss_of=hf.loss_of(spec),
        make_optimizer=lambda params: make_optimizer(strategy.optimizer, params, adamw_impl=adamw_impl),
    )
    options = rn.RunOptions(
        recipe=rec,
        steps=steps,
        grad_accum=strategy.grad_accum,
        head_module=hf.head_of(model),
        stack=rn.StackHooks(layers=layers, unit_first=first, unit_last=last) if plan.ext else rn.StackHooks(),
        flash_sdp=strategy.flash_sdp,
        # 2-D: accelerate's no_sync and the first step's micro-steps, as FSDP2 alone runs them (trace.distributed)
        before_pass=no_sync_passes(model, strategy, tr) if fsdp else None,
        accumulation_passes=rn.ACCUMULATION_PASSES if strategy.engine.sync_each_batch or not fsdp else 3,
        accumulate_first_step=fsdp,
    )
    meshes = _mesh_tensor_outside_modes() if fsdp else contextlib.nullcontext()
    selective: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if strategy.checkpointing is Checkpointing.SELECTIVE:
        from trainfit.trace.savers import selective_recompute

        # the attention core checkpointed, as on one GPU and under FSDP2 (trace.distributed): not a layer's blocks
        selective = selective_recompute(model, box)
    with meshes, hf.runtime_patches(), patched_resize(tr), selective:
        return rn.run_steps(model, fns, options, rn.Execution(mode=mode, tracker=lambda: tr))


def trace_tensor_parallel(
    spec: ModelSpec,
    strategy: Strategy,
    *,
    progress: Progress | None = None,
    steps: int = 2,
    adamw_impl: str | None = None,
    extrapolate: bool = True,
) -> MemoryReport:
    """Rank 0 of ``strategy``'s DTensor TP (± SP) run, traced on the fake process group and extrapolated in
    depth (the per-layer saved tensors and states are exactly linear in the number of layers)."""
    from trainfit.analytic.parallel import nccl_basis
    from trainfit.trace._deps import require_transformers

    check_traceable_tp(spec, strategy)
    require_transformers()
    adamw_impl = adamw_impl or strategy.optimizer_impl.value
    t0 = time.perf_counter()
    say = progress or (lambda _m, _f: None)
    par = strategy.parallelism
    tp, dp = par.tensor, par.data
    fsdp = strategy.sharding is Sharding.FSDP
    built, _ = fsdp_run_strategy(strategy)  # FSDP2's policy: fp32 parameters, bf16 compute
    # FSDP2 prefetches the next layer: its pattern is periodic from two layers on (trace/distributed.py).
    plan = depth.plan_depth(spec, built, extrapolate=extrapolate, base_units=2 if fsdp else depth.BASE_UNITS)

    def run_plan(plan: depth.DepthPlan) -> depth.Traced:
        with fake_mesh(dp, tp) as mesh:
            return run_layouts(
                plan,
                lambda layout: run_layout_tp(spec, strategy, plan, layout, mesh, steps=steps, adamw_impl=adamw_impl),
                say=say,
                rank=f"rank 0 of TP {tp}",
                failure="the tensor-parallel trace failed",
                errors=(RuntimeError, NotImplementedError, AssertionError, ValueError),
            )

    outcome = depth.extrapolated_depth(
        spec,
        strategy,
        plan,
        run_plan,
        lambda results: keyed_rank(results, strategy, fsdp=fsdp),
        depth.whole_phases,
        replan=lambda base: depth.plan_depth(spec, built, extrapolate=extrapolate, base_units=base),
        say=say,
    )
    plan, results, warnings, phases = outcome.plan, outcome.results, outcome.warnings, outcome.phases
    traced = [len(layout.layers) for _, layout, _ in results]
    sp = par.sequence_parallel
    notes = [
        f"rank 0 of {par.world_size} (TP {tp} × DP {dp}) on PyTorch's fake process group: DTensor "
        "parallelize_module with torchtitan's Llama plan (ColwiseParallel q/k/v/gate/up, RowwiseParallel o/down, "
        "vocabulary-sharded embedding, lm_head ColwiseParallel with gathered logits"
        + (", SequenceParallel norms)" if sp else ")")
        + (
            f"; then FSDP2 fully_shard per layer + root over the dp mesh dimension ({dp} ranks), "
            f"reshard_after_forward={strategy.engine.reshard_after_forward}"
            + (f", MixedPrecisionPolicy({strategy.recipe.compute_dtype}, fp32)" if strategy.recipe.mixed else "")
            if fsdp
            else ""
        ),
        f"traced {', '.join(map(str, traced))} of {plan.full_layers} layers"
        + (" and extrapolated each region linearly" if plan.ext else ""),
        f"NCCL's own buffers are outside the allocator: {nccl_basis(torch_engine(strategy))}",
    ]
    if strategy.engine.engine is Engine.AUTO and not fsdp:
        notes.append(
            "traced as --engine torch (DTensor); --method analytic with --engine auto models Megatron-LM's TP — "
            "compare with --engine torch"
        )
    return rank_report(
        spec,
        plan,
        phases,
        results,
        trainable_params=plan.params,
        optimizer_impl=adamw_impl if strategy.optimizer.value == "adamw" else strategy.optimizer.value,
        notes=notes,
        warnings=warnings,
        started=t0,
    )


__all__ = ["check_traceable_tp", "fake_mesh", "parallelize", "run_layout_tp", "trace_tensor_parallel"]
