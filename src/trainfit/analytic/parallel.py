"""Many GPUs: the memory of each rank (and of each host) under data, tensor and pipeline parallelism,
sharded states and CPU offload, for the frameworks people use. Torch-free.

The single-GPU model (:mod:`trainfit.analytic.model`) stays the one source of the activation, logits and
backward-temporary arithmetic; this module changes *which* tensors a rank holds and adds what the
frameworks add. One set of rules per engine (:class:`~trainfit.strategy.Engine`) and setup:

* **torch DDP** (``--sharding ddp``): every rank holds the single-GPU states plus the reducer's gradient
  buckets — one flat tensor per bucket in the gradient dtype, filled in reverse parameter order, the first
  closed at 1 MiB (``dist._DEFAULT_FIRST_BUCKET_BYTES``) and the rest at ``bucket_cap_mb`` (25) MiB
  (torch/nn/parallel/distributed.py ``_ddp_init_helper``; c10d/reducer.cpp
  ``compute_bucket_assignment_by_size``). With ``gradient_as_bucket_view`` the gradients *are* views of the
  buckets: the buckets stay, the separate gradients go, and they stay resident between steps.
* **torch FSDP2** (``--sharding fsdp|hsdp``, ``fully_shard`` per decoder layer plus the root): each
  parameter is sharded on dim 0 and padded to ⌈dim0/W⌉ rows (torch/distributed/fsdp/_fully_shard/
  _fsdp_param.py ``FSDPParam._init_sharded_param``); gradients and optimizer states live on the shards.
  For the 16-bit recipes the default mixed-precision policy is ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``: fp32 shards are the master weights, layers run in bf16 (activations as in a
  bf16 model, no autocast copies). The unsharded (all-gathered) parameters at a moment are the root's
  (embeddings, final norm, head: the root is not resharded after forward, ``FSDPState._lazy_init``) plus
  the current layer and the one prefetched; ``reshard_after_forward=False`` keeps every layer unsharded
  from its forward until its own post-backward, which reshards it either way (DESIGN §4.3; the backward's
  moments layer by layer: :func:`_fsdp_inner_moments`; the forward's, at a layer's all-gather copy-out with the
  previous group's all-gather output still alive: :func:`_fsdp_forward_moments`). In backward, a layer's bf16
  gradients are reduced through an fp32 reduce-scatter input of its padded size (``_fsdp_collectives.py``
  ``foreach_reduce``) in its post-backward, after its whole backward: its norms back-propagate over them
  (:func:`_fsdp_norm_moments`); the root's gradient shards are made only in the root's post-backward.
  HSDP shards within ``gpus_per_node`` ranks and replicates across nodes. ``--fsdp-wrap units`` (torchtitan,
  accelerate 1.15) makes an untied token table and [final norm, head] groups of their own (:func:`fsdp_unit`; the
  closed form's ``units``: the table resharded after its forward, the head's gradient reduce-scattered right after
  the final norm's backward); a tied table sits in [final norm, head], which is then what the root was.
* **DeepSpeed ZeRO** (``--sharding zero1|zero2|zero3``): 16-bit parameters and gradients, fp32 master
  weights and Adam states partitioned over the data-parallel group (Rajbhandari et al. 2020, §5). Stages
  1–2 flatten all parameters into one buffer padded to a multiple of 2·W elements and give each rank a
  1/W slice (deepspeed/runtime/zero/stage_1_and_2.py ``DeepSpeedZeroOptimizer.__init__``,
  ``nccl_start_alignment_factor``); stage 2 keeps its gradient partition in ``grads_in_partition`` and, with
  ``contiguous_gradients``, reduces through an ``ipg_buffer`` of ``reduce_bucket_size`` elements (two with
  ``overlap_comm``) during backward; the step casts the gradient partition to fp32. Stage 3 partitions
  each parameter to ⌈numel/W⌉ (zero/partition_parameters.py ``_partition_param``) into one flat buffer, keeps
  parameters of at most ``param_persistence_threshold`` (1e5) elements whole besides their partition, a
  persistent ``reduce_bucket_size`` gradient bucket and gradient partition (zero/stage3.py
  ``_setup_for_real_optimizer``), and gathers parameters as its coordinator does — fetch, prefetch up to
  ``stage3_prefetch_bucket_size``, keep what is reused within ``stage3_max_reuse_distance`` — replayed over
  the module order by :mod:`trainfit.analytic.zero3` (checked against the traced engine).
* **Megatron-LM** (``--tp``, ``--pp``, ``--sharding zero1`` = the distributed optimizer): bf16 parameters,
  fp32 main gradients in the persistent contiguous grad buffer (``accumulate_allreduce_grads_in_fp32`` is
  forced for bf16; for fp16 the note and the export ask for it), fp32 master weights and Adam states: 18 B/param,
  or 6 + 12/d with the distributed optimizer (megatron/training/theoretical_memory_usage.py
  ``compute_weight_and_optimizer_memory``).
  Tensor parallelism splits attention heads, k/v groups, the MLP width and the (padded) vocabulary over
  ``tp`` ranks; without sequence parallelism the norm and residual activations stay replicated, with it
  every activation is divided by ``tp`` (Korthikanti et al. 2022, Table 2: sbh(10 + 24/t) vs sbh·34/t).
  Pipeline parallelism gives each stage L/pp layers, the embedding to the first and the final norm, head
  and logits to the last; a stage holds the activations of the micro-batches in flight: 1F1B
  min(pp − s, m), interleaved (pp − s − 1)·2 + (v − 1)·pp + 1 chunk-micro-batches of L/(pp·v) layers
  (megatron/core/pipeline_parallel/schedules.py ``forward_backward_pipelining_with_interleaving``,
  ``num_warmup_microbatches``), GPipe m (:func:`in_flight_chunks`); the first stage min(m, 2·pp) embedding
  outputs under interleaving (only chunk 0 has the embedding: :func:`first_stage_embeddings`), and the last
  stage under GPipe m head inputs and m − 1 losses waiting for their backward (:func:`last_stage_heads`). Each
  count is what the schedule, run pass by pass, holds (:mod:`trainfit.analytic.rank_events`, tested). With the
  distributed optimizer the init holds every parameter twice while DDP's buffers are built
  (:func:`megatron_init_bytes`): said in a note when it is above the step.

* **torch DTensor TP** (``--engine torch --tp``, ± ``--sequence-parallel``; torchtitan's Llama plan through
  ``parallelize_module``, torch/distributed/tensor/parallel/style.py): the single-GPU recipe and step of a
  rank's model — heads, k/v heads and MLP width split, hidden size and (gathered) vocabulary whole — with the
  states of its shards (vocabulary rows ⌈V/tp⌉), the token table's gradient computed whole (DTensor's
  embedding backward has no vocabulary-sharded strategy), under SP the norms' saved tensors split but each
  matmul's all-gathered input saved whole, and the logits' all-gather (:func:`_torch_tp`). Checked against
  the trace of the real plan (:mod:`trainfit.trace.tensor_parallel`).

Fine-tuning (``--finetune lora|qlora|freeze``) keeps the single-GPU per-tensor rule
(:func:`~trainfit.analytic.states.param_states`: what trains, adapters, packed 4-bit weights) and each
framework's own: DDP buckets only trainable gradients; FSDP2 shards and all-gathers every parameter but
reduce-scatters, and keeps gradients and optimizer states for, only the trainable ones, and its policy computes
PEFT's fp32 adapters in bf16; a QLoRA weight's packed storage shards like any tensor while its quant state is
whole on every rank; ZeRO keeps every parameter in 16 bits (partitioned in stage 3) and partitions only the
trainable ones' gradients, masters and optimizer states (:func:`held_tensors`, :func:`fsdp_groups`,
:func:`zero_partition`; docs/distributed.md "Many GPUs with adapters"). LoRA on MoE layers (PEFT's ``ParamWrapper``)
runs under DDP and FSDP2: its lora_A/B are ordinary layer parameters, and it forms ``W + B·A`` from the all-gathered
expert stack inside the layer's forward, so the one-GPU MoE terms hold per rank, with the top layer unsharded in the
checkpointed forward's in-experts moment; a 4-bit base packs what ``bnb_converted`` says (not the router).
Megatron with adapters, int8 bases, QLoRA with ZeRO, and MoE adapters with ZeRO, offload or FSDP2 over mixed
dense and MoE layers are refused (:func:`check_parallel_finetune`).

Offload (``--offload optimizer`` for ZeRO-Offload, ``optimizer+params`` for ZeRO-Infinity and FSDP2's
``CPUOffloadPolicy``) moves the fp32 master weights, optimizer states and fp32 gradient partition (and
with ``+params`` the parameter partition) to pinned host memory; host bytes are reported per node
(``gpus_per_node`` ranks).

What is left out: NCCL's own buffers (outside the allocator; DESIGN §4.1), DeepSpeed's two parameter groups
of the HF Trainer (one group assumed; the padding differs by < 2·W elements), Megatron's vocabulary
padding beyond ``make_vocab_size_divisible_by`` = 128·tp, MoE expert parallelism.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from trainfit._memo import Memo, spec_key
from trainfit.allocator import AllocatorConfig
from trainfit.allocator.report import capped_run
from trainfit.allocator.workspaces import Workspace
from trainfit.analytic.activations import TermRole, Widths, effective_strategy, layer_terms
from trainfit.analytic.adapters import (
    adapter_tensors,
    bnb_converted,
    check_finetune_model,
    finetuning,
    frozen_layers,
    is_frozen,
    moe_tensors,
)
from trainfit.analytic.model import (
    Moment,
    MomentName,
    StepInputs,
    backward_moments,
    forward_moments,
    optimizer_step_moment,
    step_inputs,
)
from trainfit.analytic.states import (
    optimizer_state_bytes,
    optimizer_state_tensors,
    param_states,
    tied_gradient_sum,
    tied_sum_modelled,
)
from trainfit.analytic.zero3 import PERSISTENCE_THRESHOLD, gathered_bytes
from trainfit.arch.params import inventory
from trainfit.arch.spec import MlpKind, ModelKind, ModelSpec, NormKind, ParamTensor
from trainfit.cuda_facts import allocator_bytes, quantized_weight_tensors
from trainfit.errors import StrategyError
from trainfit.fsdp_units import (
    EMBEDDING_UNIT,
    ROOT_UNIT,
    TAIL_UNIT,
    fsdp_unit,
    resolved_fsdp_wrap,
    units_unmodelled,
    untied_units,
)
from trainfit.overhead import overhead_for
from trainfit.result import (
    BytesPerParam,
    CappedRun,
    Component,
    MemoryReport,
    Method,
    Phase,
    PhaseBreakdown,
    PipelineInFlight,
    RankMemory,
)
from trainfit.strategy import (
    Checkpointing,
    DType,
    Engine,
    FsdpWrap,
    OffloadTarget,
    Optimizer,
    OptimizerImpl,
    PipelineSchedule,
    Precision,
    Quantization,
    Sharding,
    Strategy,
)
from trainfit.units import MiB, fmt_gib

#: DeepSpeed ``stage3_param_persistence_threshold`` default: parameters of at most this many elements stay whole.
DS_PERSISTENCE_THRESHOLD = PERSISTENCE_THRESHOLD
#: DeepSpeed stages 1–2 pad the flat buffer to a multiple of this times the data-parallel size.
DS_ALIGNMENT_FACTOR = 2
#: Megatron ``make_vocab_size_divisible_by`` default (the padded vocabulary is a multiple of this × tp).
MEGATRON_VOCAB_DIVISOR = 128


# -- the plan: engine, degrees, validation ---------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelPlan:
    """The resolved setup: which engine's rules, the degrees, and the shard group."""

    engine: Engine
    sharding: Sharding
    world: int
    dp: int
    tp: int
    pp: int
    shard: int  # ranks a sharded state is split over (dp; HSDP: within a node)
    sequence_parallel: bool
    defaults: tuple[str, ...]  # the engine defaults used, said to the user


def resolve_engine(strategy: Strategy) -> Engine:
    """``auto``: megatron with TP/PP (torch for TP with ``--sharding fsdp``: 2-D FSDP2×TP, which Megatron does
    not run), deepspeed for zero*, torch otherwise (ddp, fsdp, hsdp)."""
    e = strategy.engine.engine
    if e is not Engine.AUTO:
        return e
    par, sh = strategy.parallelism, strategy.sharding
    if par.tensor > 1 and par.pipeline == 1 and sh is Sharding.FSDP:
        return Engine.TORCH
    if par.tensor > 1 or par.pipeline > 1:
        return Engine.MEGATRON
    if sh in (Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3):
        return Engine.DEEPSPEED
    return Engine.TORCH


#: The framework-specific options: (name — a ``trainfit estimate`` flag of :data:`trainfit.cli.estimate.STRATEGY_FLAGS`
#: or, without a flag, an :class:`EngineOptions` field —, whose option it is, its value in a strategy); the default
#: is its value in ``Strategy()`` (the frameworks' documented defaults, :class:`EngineOptions`).
_SCOPED: tuple[tuple[str, str, Callable[[Strategy], object]], ...] = (
    ("reshard_after_forward", "fsdp", lambda s: s.engine.reshard_after_forward),
    ("sync_each_batch", "fsdp", lambda s: s.engine.sync_each_batch),
    ("sharded_init", "fsdp", lambda s: s.engine.sharded_init),
    ("fsdp_wrap", "fsdp", lambda s: s.engine.fsdp_wrap),
    ("bucket_cap_mb", "ddp", lambda s: s.engine.bucket_cap_mb),
    ("first_bucket_bytes", "ddp", lambda s: s.engine.first_bucket_bytes),
    ("gradient_as_bucket_view", "ddp", lambda s: s.engine.gradient_as_bucket_view),
    ("reduce_bucket_size", "deepspeed", lambda s: s.engine.reduce_bucket_size),
    ("allgather_bucket_size", "deepspeed", lambda s: s.engine.allgather_bucket_size),
    ("overlap_comm", "deepspeed", lambda s: s.engine.overlap_comm),
    ("prefetch_bucket_size", "deepspeed", lambda s: s.engine.prefetch_bucket_size),
    ("max_live_parameters", "deepspeed", lambda s: s.engine.max_live_parameters),
    ("max_reuse_distance", "deepspeed", lambda s: s.engine.max_reuse_distance),
    ("pp_schedule", "pipeline", lambda s: s.parallelism.pipeline_schedule),
    ("microbatches", "pipeline", lambda s: s.parallelism.microbatches),
)
_FLAGGED = frozenset(
    {"reshard_after_forward", "sync_each_batch", "sharded_init", "fsdp_wrap", "bucket_cap_mb"}
    | {"gradient_as_bucket_view", "reduce_bucket_size", "pp_schedule", "microbatches"}
)


def _run_kind(strategy: Strategy) -> str:
    """What runs ``strategy``, in words, for the refusals of :func:`inapplicable_options`."""
    if not strategy.is_distributed:
        return "one GPU without a sharding framework"
    engine, sh, tp = resolve_engine(strategy), strategy.sharding, strategy.parallelism.tensor
    if engine is Engine.MEGATRON:
        return "Megatron-LM (its gradients live in its own contiguous buffer, bucketed by Megatron's DDP)"
    if engine is Engine.DEEPSPEED:
        return f"DeepSpeed ZeRO-{sh.value.removeprefix('zero')}"
    if sh in (Sharding.FSDP, Sharding.HSDP):
        return f"{'2-D FSDP2×TP' if tp > 1 else 'FSDP2' if sh is Sharding.FSDP else 'HSDP'} (--sharding {sh.value})"
    return "DTensor tensor parallelism without data-parallel buckets" if tp > 1 else "torch DDP"


def inapplicable_options(strategy: Strategy) -> dict[str, str]:
    """The framework-specific options that do nothing for ``strategy`` (its resolved engine, sharding and pipeline),
    each with the one-line refusal for it: FSDP2's (``--reshard-after-forward``, ``--sync-each-batch``,
    ``--sharded-init``, ``--fsdp-wrap``) outside FSDP2/HSDP; torch DDP's (``--bucket-cap-mb``,
    ``--gradient-as-bucket-view``, the first bucket) outside torch DDP; DeepSpeed's (``--reduce-bucket-size``, the
    all-gather and stage-3 buckets, ``overlap_comm``) outside DeepSpeed; the pipeline's (``--pp-schedule``,
    ``--microbatches``) without ``--pp`` > 1. Keys are the CLI's flag names
    (:data:`trainfit.cli.estimate.STRATEGY_FLAGS`) or, for the options without a flag, the :class:`EngineOptions`
    field. The CLI refuses any of them given explicitly; :func:`check_options` (the library) those set to another
    value than the default."""
    engine = resolve_engine(strategy)
    sh, par = strategy.sharding, strategy.parallelism
    applies = {
        "fsdp": strategy.is_distributed and engine is Engine.TORCH and sh in (Sharding.FSDP, Sharding.HSDP),
        "ddp": strategy.is_distributed
        and engine is Engine.TORCH
        and sh in (Sharding.NONE, Sharding.DDP)
        and par.tensor == 1
        and par.pipeline == 1,
        "deepspeed": strategy.is_distributed and engine is Engine.DEEPSPEED,
        "pipeline": par.pipeline > 1,
    }
    whose = {
        "fsdp": "FSDP2's option (--sharding fsdp|hsdp, the torch engine)",
        "ddp": "torch DDP's option (--sharding ddp, or none over many GPUs, the torch engine)",
        "deepspeed": "DeepSpeed ZeRO's option (--sharding zero1|zero2|zero3)",
    }
    out = {}
    for name, scope, _get in _SCOPED:
        if applies[scope]:
            continue
        what = f"--{name.replace('_', '-')}" if name in _FLAGGED else f"EngineOptions.{name}"
        if scope == "pipeline":
            out[name] = f"{what} sets the pipeline's schedule and micro-batches: it needs --pp > 1"
        else:
            out[name] = f"{what} is {whose[scope]}; this run is {_run_kind(strategy)}: drop it"
    return out


def check_options(strategy: Strategy) -> None:
    """Refuse (one-line :class:`StrategyError`) a framework-specific option set, to another value than its default,
    for a run it does not apply to (:func:`inapplicable_options`): it would be ignored silently. ``trainfit.estimate``
    calls it (the public API, and so the CLI, the web page and the planner); the internal models
    (:func:`estimate_parallel`, the traces) leave options that do not apply alone, as they always did."""
    bad = inapplicable_options(strategy)
    default = Strategy()
    for name, _scope, get in _SCOPED:
        if name in bad and get(strategy) != get(default):
            raise StrategyError(bad[name])


def plan(spec: ModelSpec, strategy: Strategy) -> ParallelPlan:
    """Validate the combination (one-line :class:`StrategyError` otherwise) and resolve the engine."""
    par, sh, _eo, off = strategy.parallelism, strategy.sharding, strategy.engine, strategy.offload
    tp, pp, dp = par.tensor, par.pipeline, par.data
    engine = resolve_engine(strategy)
    if strategy.workload.value != "training":
        raise StrategyError(f"sharded and many-GPU setups are modelled for training, not {strategy.workload.value}")
    if engine is Engine.MEGATRON and strategy.engine.gradient_as_bucket_view:
        # Megatron's DDP points each parameter's main_grad into its contiguous gradient buffer
        # (megatron/core/distributed/param_and_grad_buffer.py ``_ParamAndGradBuffer``): torch DDP's flag has no
        # counterpart there (the other options of another framework: ``check_options``, from ``trainfit.estimate``)
        raise StrategyError(inapplicable_options(strategy)["gradient_as_bucket_view"])
    if strategy.savers.any:
        raise StrategyError(
            f"the memory savers ({', '.join(strategy.savers.names())}) are modelled on one GPU without a sharding "
            "framework or offload; drop them, or drop --gpus/--sharding/--offload/--engine"
        )
    if strategy.engine.fsdp_wrap is FsdpWrap.UNITS:
        _check_units(spec, strategy)
    if finetuning(strategy):
        check_parallel_finetune(spec, strategy, engine)
    if strategy.checkpointing is Checkpointing.SAC and (tp > 1 or pp > 1):
        raise StrategyError(
            "--checkpointing sac with tensor/pipeline parallelism is not modelled yet; use --checkpointing full"
        )
    if strategy.checkpointing is Checkpointing.SAC and engine is Engine.MEGATRON:
        # Megatron-LM recomputes whole layers (--recompute-granularity full) or the attention core (selective):
        # torchtitan's per-op SAC policy is no Megatron option, and its export could only say full recompute
        raise StrategyError(
            "--checkpointing sac is torchtitan's per-op SAC; Megatron-LM recomputes full layers or the attention "
            "core: use --checkpointing full or selective with --engine megatron"
        )
    if off.activations:
        raise StrategyError("activation offload is not modelled; use --offload none|optimizer|optimizer+params")
    if off.optimizer is OffloadTarget.NVME or off.parameters is OffloadTarget.NVME:
        raise StrategyError("NVMe offload is not modelled; --offload moves states to CPU memory")
    if off.parameters_on_host and not off.optimizer_on_host:
        raise StrategyError("offloading parameters needs the optimizer offloaded too (--offload optimizer+params)")
    if engine is Engine.TORCH and tp > 1:
        _check_torch_tp(spec, strategy)
    elif (tp > 1 or pp > 1) and engine is not Engine.MEGATRON:
        if engine is Engine.DEEPSPEED and tp == 1 and sh in (Sharding.ZERO2, Sharding.ZERO3):
            raise StrategyError(f"DeepSpeed's pipeline engine refuses ZeRO-2/3 (--sharding {sh.value} with --pp {pp})")
        raise StrategyError(f"tensor/pipeline parallelism is modelled with --engine megatron, not {engine.value}")
    if engine is Engine.MEGATRON:
        if sh in (Sharding.ZERO2, Sharding.ZERO3):
            raise StrategyError(
                f"--sharding {sh.value} with pipeline or tensor parallelism: Megatron shards only the optimizer "
                "(--sharding zero1, its distributed optimizer); DeepSpeed's pipeline engine refuses ZeRO-2/3"
            )
        if sh in (Sharding.FSDP, Sharding.HSDP):
            raise StrategyError(f"--sharding {sh.value} with --engine megatron is not modelled (use zero1 or ddp)")
        if off.any:
            raise StrategyError("offload with --engine megatron is not modelled")
        if spec.num_heads % tp or spec.num_kv_heads % tp:
            raise StrategyError(
                f"--tp {tp} must divide the attention heads ({spec.num_heads}) and k/v heads ({spec.num_kv_heads})"
            )
        if spec.intermediate_size % tp:
            raise StrategyError(f"--tp {tp} must divide the MLP width ({spec.intermediate_size})")
        if pp > spec.num_layers:
            raise StrategyError(f"--pp {pp} is larger than the {spec.num_layers} layers")
        v = par.virtual_stages
        if v > 1 and par.pipeline_schedule is not PipelineSchedule.INTERLEAVED:
            raise StrategyError("--virtual-stages > 1 needs --pp-schedule interleaved")
        if spec.num_layers % (pp * v):
            raise StrategyError(
                f"{spec.num_layers} layers do not split evenly over --pp {pp}"
                + (f" × --virtual-stages {v}" if v > 1 else "")
            )
        if par.pipeline_schedule is PipelineSchedule.INTERLEAVED and pp > 1 and par.microbatches % pp:
            raise StrategyError(f"the interleaved schedule needs --microbatches a multiple of --pp {pp}")
        if spec.moe is not None and tp > 1:
            raise StrategyError("tensor parallelism of MoE layers (expert parallelism) is not modelled")
        if par.pipeline_schedule is PipelineSchedule.GPIPE and pp > 1 and spec.kind is not ModelKind.CAUSAL_LM:
            raise StrategyError(
                f"--pp-schedule gpipe is modelled for causal LMs (the last stage keeps every micro-batch's loss), "
                f"not --head {spec.kind.value}"
            )
    if engine is Engine.DEEPSPEED:
        if sh not in (Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3):
            raise StrategyError(f"--engine deepspeed models --sharding zero1|zero2|zero3, not {sh.value}")
        if off.parameters_on_host and sh is not Sharding.ZERO3:
            raise StrategyError("parameter offload (ZeRO-Infinity) needs --sharding zero3")
    if engine is Engine.TORCH and tp == 1:
        if sh in (Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3):
            raise StrategyError(f"--sharding {sh.value} is DeepSpeed ZeRO: use --engine deepspeed (or auto)")
        if off.any and sh not in (Sharding.FSDP, Sharding.HSDP):
            raise StrategyError("offload needs a sharding framework: --sharding zero1|zero2|zero3|fsdp|hsdp")
        if off.any and not off.parameters_on_host:
            raise StrategyError(
                "FSDP2 offloads parameters, gradients and optimizer states together (CPUOffloadPolicy): "
                "use --offload optimizer+params"
            )
    shard = dp
    if sh is Sharding.HSDP:
        shard = min(dp, par.gpus_per_node)
        if dp % shard:
            raise StrategyError(f"HSDP needs the GPUs ({dp}) to be a multiple of the GPUs per node ({shard})")
    return ParallelPlan(
        engine=engine,
        sharding=sh,
        world=par.world_size,
        dp=dp,
        tp=tp,
        pp=pp,
        shard=shard,
        sequence_parallel=par.sequence_parallel,
        defaults=_defaults(engine, strategy),
    )


def _check_units(spec: ModelSpec, strategy: Strategy) -> None:
    """``--fsdp-wrap units`` as asked: refused in one line where the analytic model does not have it (the trace
    has it)."""
    why = units_unmodelled(spec, strategy)
    if why:
        how = (
            "not modelled yet (nor traced):"
            if strategy.parallelism.tensor > 1
            else "traced only for now: add --method trace, or"
        )
        raise StrategyError(
            f"--fsdp-wrap units (the embedding and [final norm, head] as FSDP2 units of their own) with {why} is "
            f"{how} drop --fsdp-wrap for the layers-plus-root wrapping"
        )


def _check_torch_tp(spec: ModelSpec, strategy: Strategy) -> None:
    """What the DTensor tensor-parallel model covers (``--engine torch --tp N``): one pipeline stage, data
    parallel without sharding, a dense untied Llama-family decoder whose heads, k/v heads and MLP width ``tp``
    divides."""
    par, sh = strategy.parallelism, strategy.sharding
    tp = par.tensor
    if par.pipeline > 1:
        raise StrategyError("pipeline parallelism is modelled with --engine megatron, not torch")
    if sh not in (Sharding.NONE, Sharding.FSDP):
        raise StrategyError(
            f"DTensor tensor parallelism (--engine torch --tp) is modelled with --sharding none|fsdp (2-D FSDP2×TP), "
            f"not {sh.value}; --engine megatron with --sharding ddp|zero1 is, by --method analytic"
        )
    if strategy.offload.any:
        raise StrategyError("offload with DTensor tensor parallelism is not modelled")
    if not strategy.trains_every_weight or not strategy.base_weights.is_default:
        # The model is torchtitan's plan over the model's own linears; PEFT's LoRA layers take tensor parallelism
        # only from transformers' ``tp_plan`` (peft/tuners/lora/model.py ``get_tp_plan_and_mesh``: lora_A
        # replicated beside a colwise base, row-sharded beside a rowwise one), a different plan (whole vocabulary
        # embedding) that neither the closed form nor the trace runs (trace/tensor_parallel.py refuses it too).
        raise StrategyError(
            "adapters, --freeze and --base-dtype with DTensor tensor parallelism (--engine torch --tp) are not "
            "modelled; use --tp 1 with --sharding fsdp|hsdp|ddp|zero1|zero2|zero3"
        )
    if spec.moe is not None or spec.mla is not None or spec.kind is not ModelKind.CAUSAL_LM:
        raise StrategyError("DTensor tensor parallelism is modelled for dense causal LMs (the Llama plan)")
    if spec.tie_word_embeddings:
        raise StrategyError("DTensor tensor parallelism with tied embeddings is not modelled (one table, two plans)")
    if spec.fused_qkv or spec.parallel_attn or spec.norms_per_layer != 2 or spec.mlp is not MlpKind.GATED:
        raise StrategyError("DTensor tensor parallelism is modelled for Llama-style blocks (separate q/k/v, SwiGLU)")
    if spec.num_heads % tp or spec.num_kv_heads % tp or spec.intermediate_size % tp:
        raise StrategyError(
            f"--tp {tp} must divide the attention heads ({spec.num_heads}), k/v heads ({spec.num_kv_heads}) "
            f"and the MLP width ({spec.intermediate_size})"
        )


def _defaults(engine: Engine, strategy: Strategy) -> tuple[str, ...]:
    eo, sh = strategy.engine, strategy.sharding
    if engine is Engine.TORCH and strategy.parallelism.tensor > 1:
        sp = strategy.parallelism.sequence_parallel
        return (
            "DTensor tensor parallelism (torchtitan's Llama plan): ColwiseParallel q/k/v/gate/up, RowwiseParallel "
            "o/down, vocabulary-sharded embedding, lm_head ColwiseParallel with gathered logits"
            + (", SequenceParallel norms" if sp else "")
            + f"; the single-GPU {strategy.precision.value} recipe (TP changes no dtype)",
        )
    if engine is Engine.TORCH and sh in (Sharding.FSDP, Sharding.HSDP):
        mp = (
            f"MixedPrecisionPolicy(param_dtype={strategy.recipe.compute_dtype}, reduce_dtype=fp32) over fp32 shards"
            if strategy.recipe.mixed
            else "no mixed-precision policy (parameters in their own dtype)"
        )
        return (f"FSDP2 fully_shard per decoder layer + root, reshard_after_forward={eo.reshard_after_forward}, {mp}",)
    if engine is Engine.TORCH:
        return (
            f"torch DDP: bucket_cap_mb={eo.bucket_cap_mb}, first bucket {eo.ddp_first_bucket_bytes // 1024} KiB, "
            f"gradient_as_bucket_view={eo.gradient_as_bucket_view}",
        )
    if engine is Engine.DEEPSPEED:
        return (
            f"DeepSpeed ZeRO-{sh.value[-1]} bf16/fp16 mixed precision (16-bit params and grads, fp32 master and "
            f"Adam): reduce_bucket_size={eo.reduce_bucket_size:.0e}, allgather_bucket_size="
            f"{eo.allgather_bucket_size:.0e}, contiguous_gradients=True, overlap_comm={_overlap(strategy)}"
            + (f", stage3_prefetch_bucket_size={eo.prefetch_bucket_size:.0e}" if sh is Sharding.ZERO3 else ""),
        )
    par = strategy.parallelism
    half = strategy.recipe.compute_dtype
    grads = (
        "fp32 main grads (--accumulate-allreduce-grads-in-fp32: set it; --fp16 alone keeps fp16 ones)"
        if half == "fp16"
        else "fp32 main grads (accumulate_allreduce_grads_in_fp32)"
    )
    return (
        f"Megatron-LM: {half if half in ('bf16', 'fp16') else 'fp32'} params, {grads}, "
        f"{'distributed optimizer' if sh is Sharding.ZERO1 else 'replicated optimizer'}, "
        f"{par.pipeline_schedule.value} schedule, {par.microbatches} micro-batches"
        + (f", {par.virtual_stages} virtual stages" if par.virtual_stages > 1 else ""),
    )


def _overlap(strategy: Strategy) -> bool:
    o = strategy.engine.overlap_comm
    return o if o is not None else strategy.sharding is Sharding.ZERO3


# -- small helpers ---------------------------------------------------------------------------------------


def _alloc(numel: int, bits: int) -> int:
    return allocator_bytes(numel * bits // 8) if numel else 0


def shard_tensor(t: ParamTensor, shards: int) -> ParamTensor:
    """FSDP2's local shard of ``t`` on rank 0 (the largest): dim 0 padded to ⌈dim0/W⌉ rows
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py ``_init_sharded_param``)."""
    if shards == 1:
        return t
    rows = -(-t.shape[0] // shards)
    return ParamTensor(name=t.name, shape=(rows, *t.shape[1:]), matmul=t.matmul)


def compute_strategy(strategy: Strategy, *, casts_every_param: bool = True) -> Strategy:
    """The strategy whose single-GPU activations a 16-bit-compute framework run has: layers in bf16 over
    16-bit parameters, no autocast (FSDP2's param_dtype, DeepSpeed's and Megatron's bf16 modules).

    Fine-tuning: a framework that casts every parameter for compute (``casts_every_param``: FSDP2's
    mixed-precision policy, whose ``param_dtype`` applies to frozen parameters and to PEFT's fp32 adapters
    alike, _fsdp_param.py ``init_dtype_attrs``; DeepSpeed's ``_cast_module_mixed_precision``) runs the
    adapters in the 16-bit dtype — ``lora_A``'s weight is bf16, so PEFT's ``_cast_input_dtype`` copies
    nothing — and the frozen base (an fp32 ``prepare_model_for_kbit_training`` base included) in bf16."""
    if strategy.recipe.compute_bits == 32:
        return dataclasses.replace(strategy, precision=Precision.FP32)
    cs = dataclasses.replace(strategy, precision=Precision.PURE_BF16)
    if casts_every_param and finetuning(strategy):
        if cs.adapter is not None:
            cs = dataclasses.replace(cs, adapter=dataclasses.replace(cs.adapter, dtype=cs.recipe.compute))
        cs = dataclasses.replace(cs, base_weights=dataclasses.replace(cs.base_weights, dtype=None, kbit_prepared=False))
    return cs


def _moments(q: StepInputs) -> dict[Phase, list[Moment]]:
    return {
        Phase.FORWARD: forward_moments(q),
        Phase.BACKWARD: backward_moments(q),
        Phase.OPTIMIZER_STEP: [optimizer_step_moment(q)],
    }


Adjust = Callable[[Moment], dict[Component, int]]


def _worst(
    q: StepInputs, adjust: Adjust, host: dict[Component, int], extra: Sequence[Moment] = ()
) -> tuple[PhaseBreakdown, ...]:
    """Each phase's worst moment after ``adjust`` maps a single-GPU moment to this rank's components
    (``extra``: an engine's own moments, added to their phase's)."""
    out = []
    for ph, ms in _moments(q).items():
        best = max((adjust(m) for m in [*ms, *(m for m in extra if m.phase is ph)]), key=lambda c: sum(c.values()))
        out.append(PhaseBreakdown(phase=ph, components=_full(best), host_components=dict(host)))
    return tuple(out)


def _full(parts: dict[Component, int]) -> dict[Component, int]:
    base = dict.fromkeys(Component, 0)
    for c, n in parts.items():
        base[c] = base.get(c, 0) + max(0, n)
    return base


def _single(m: Moment) -> dict[Component, int]:
    return dict(m.components())


# -- fine-tuning: what a rank holds of a partly frozen model ---------------------------------------------

#: FSDP-QLoRA stores the packed 4-bit weights in bf16 elements (``bnb_4bit_quant_storage=torch.bfloat16``;
#: Answer.AI's fsdp_qlora, PEFT's "FSDP + QLoRA" guide), so that ``fully_shard`` can flatten them with the
#: rest: two bytes per storage element, four 4-bit values each.
QUANT_STORAGE_BITS = 16


#: The data-parallel setups whose rank is checked against the trace with adapters on MoE layers.
_MOE_ADAPTER_SHARDINGS = (Sharding.NONE, Sharding.DDP, Sharding.FSDP, Sharding.HSDP)


def check_parallel_finetune(spec: ModelSpec, strategy: Strategy, engine: Engine) -> None:
    """Refuse, in one line, a fine-tuning setup the many-GPU model does not cover (and whatever the single-GPU
    fine-tuning model refuses: targets the model lacks, layer layouts the adapter closed forms do not cover)."""
    check_finetune_model(spec, strategy)
    if strategy.adapter is not None and spec.moe is not None:
        # The MoE closed forms (analytic.adapters.moe_param_sites, activations.frozen_moe_terms) are checked
        # against the traced DDP and FSDP2 rank (tests/trace/test_distributed_finetune.py), not ZeRO's partitions
        # or an offloaded step.
        if engine is not Engine.TORCH or strategy.sharding not in _MOE_ADAPTER_SHARDINGS or strategy.offload.any:
            raise StrategyError(
                f"adapters on {spec.name}'s MoE layers with many GPUs are modelled for --sharding ddp|fsdp|hsdp "
                "without offload only"
            )
        if strategy.sharding in (Sharding.FSDP, Sharding.HSDP) and len(inventory(spec).layers) > 1:
            # held_tensors places every adapter in one layer group: FSDP2's per-layer groups of a model with
            # dense and MoE layers (DeepSeek's first_k_dense_replace) would be mis-sized.
            raise StrategyError(
                f"adapters on {spec.name}'s mixed dense and MoE layers under FSDP2 are not modelled; use --sharding ddp"
            )
    quant = strategy.base_weights.quantization
    if engine is Engine.MEGATRON:
        raise StrategyError(
            "adapters and --freeze with tensor/pipeline parallelism (Megatron) are not modelled; "
            "use --sharding fsdp|hsdp|ddp|zero1|zero2|zero3"
        )
    if quant is Quantization.INT8:
        raise StrategyError(
            "an int8 (LLM.int8) base with many GPUs is not modelled (its Int8Params do not shard); "
            "use --finetune qlora (nf4) or a 16-bit base"
        )
    if quant is not Quantization.NONE and engine is Engine.DEEPSPEED:
        raise StrategyError(
            "QLoRA with DeepSpeed ZeRO is not modelled (4-bit weights inside ZeRO partitions); "
            "use --sharding fsdp|hsdp|ddp"
        )
    if quant is not Quantization.NONE and strategy.offload.any:
        raise StrategyError("QLoRA with CPU offload is not modelled; use --offload none")


@dataclass(frozen=True, slots=True, kw_only=True)
class HeldTensor:
    """One parameter tensor (× ``count`` identical ones) as a data-parallel framework holds it."""

    tensor: ParamTensor
    count: int
    trainable: bool
    bits: int  # its stored width (a packed 4-bit weight: its storage dtype's)
    root: bool  # outside the decoder layers (embeddings, final norm, head): FSDP2's root group
    adapter: bool = False
    group: int = -1  # the inventory's layer group it belongs to (-1: root)
    packed_bytes: int = 0  # a bitsandbytes 4-bit weight: its packed data, sharded as storage elements
    quant_state_bytes: int = 0  # its quant state (absmax, codes, offset): allocator-rounded, whole per rank
    dtype: DType = DType.FP32  # its stored dtype (``bits`` wide; a packed 4-bit weight: its storage dtype)

    @property
    def storage_numel(self) -> int:
        """Elements of the tensor as stored (a packed weight: ⌈bytes/2⌉ bf16 elements of one column)."""
        if self.packed_bytes:
            return -(-self.packed_bytes * 8 // QUANT_STORAGE_BITS)
        return self.tensor.numel

    def shard_numel(self, shards: int) -> int:
        """The local shard on rank 0: dim 0 padded to ⌈dim0/W⌉ rows (FSDP2 ``_init_sharded_param``)."""
        if self.packed_bytes:
            return -(-self.storage_numel // shards)
        return shard_tensor(self.tensor, shards).numel


#: :func:`held_tensors` of recent (spec, strategy, fsdp_mixed): one estimate asks for them several times.
_HELD: Memo[tuple[HeldTensor, ...]] = Memo(256)


def held_tensors(spec: ModelSpec, strategy: Strategy, *, fsdp_mixed: bool = False) -> tuple[HeldTensor, ...]:
    """Every parameter tensor of ``spec`` under ``strategy``'s trainable mask (``param_states``) with the
    width a data-parallel rank stores it in. ``fsdp_mixed``: FSDP2 under a mixed-precision policy, whose
    model is built in fp32 (a base without ``--base-dtype`` and every trainable tensor but a 16-bit adapter
    is fp32); a QLoRA base's packed weights are stored as bf16 elements (:data:`QUANT_STORAGE_BITS`) and
    its other frozen tensors in fp32 (``prepare_model_for_kbit_training``). Memoized."""
    return _HELD.get(
        (spec_key(spec), strategy, fsdp_mixed), lambda: _held_tensors(spec, strategy, fsdp_mixed=fsdp_mixed)
    )


def _held_tensors(spec: ModelSpec, strategy: Strategy, *, fsdp_mixed: bool) -> tuple[HeldTensor, ...]:
    r, base = strategy.recipe, strategy.base_weights
    quant = base.quantization.dtype
    inv = inventory(spec)
    # param_states walks the inventory in order (model tensors, then each layer group's; a tensor frozen in
    # some layers and trainable in others twice in a row), then the adapters: follow it to place each tensor.
    seq = [(t, -1) for t in inv.model_tensors] + [(t, i) for i, g in enumerate(inv.layers) for t in g.tensors]
    dense = next((i for i, g in enumerate(inv.layers) if g.kind == "dense"), 0)
    # adapters outside the stack (a head transform's, :func:`~trainfit.analytic.adapters.head_sites`) are model-level
    stacked = set(adapter_tensors(spec, strategy.adapter)) if strategy.adapter is not None else set()
    out: list[HeldTensor] = []
    at = -1
    for x in param_states(spec, strategy):
        t = x.tensor
        if x.adapter:
            group = dense if t in stacked else -1
        else:
            if at < 0 or seq[at][0] != t:
                at += 1
                while seq[at][0] != t:
                    at += 1
            group = seq[at][1]
        root = group < 0
        common = {"tensor": t, "count": x.count, "trainable": x.trainable, "root": root, "group": group}
        if x.adapter:
            assert strategy.adapter is not None
            dt = strategy.adapter.dtype
            out.append(HeldTensor(**common, bits=x.bits, adapter=True, dtype=dt))  # type: ignore[arg-type]
            continue
        if x.trainable:
            dt = DType.FP32 if fsdp_mixed else r.weight_dtype
            out.append(HeldTensor(**common, bits=dt.bits, dtype=dt))  # type: ignore[arg-type]
            continue
        if quant is not None and bnb_converted(t) and not root:
            pieces = quantized_weight_tensors(t.numel, t.shape[0], quant.value, double_quant=base.double_quant)
            out.append(
                HeldTensor(
                    **common,  # type: ignore[arg-type]
                    bits=QUANT_STORAGE_BITS,
                    dtype=DType.BF16,  # bnb_4bit_quant_storage=bfloat16
                    packed_bytes=pieces[0],
                    quant_state_bytes=sum(allocator_bytes(n) for n in pieces[1:]),
                )
            )
            continue
        dt = base.dtype if base.dtype is not None else (DType.FP32 if fsdp_mixed else r.weight_dtype)
        if base.kbit_prepared and dt.bits == 16:
            dt = DType.FP32
        out.append(HeldTensor(**common, bits=dt.bits, dtype=dt))  # type: ignore[arg-type]
    return tuple(out)


# -- sharded states --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardedStates:
    """One rank's resident model states (bytes) and the step's temporaries."""

    weights_bytes: int
    grads_bytes: int
    master_bytes: int
    optimizer_bytes: int
    step_temp_bytes: int
    adapter_bytes: int = 0  # the adapters' shards (LoRA A/B, DoRA magnitudes)


def fsdp_states(spec: ModelSpec, strategy: Strategy, shards: int) -> ShardedStates:
    """FSDP2 shards: each parameter padded to ⌈dim0/W⌉ rows on the rank; fp32 under the mixed-precision
    policy (the shard is the master weight), gradients in the shard's dtype, optimizer states like the shard
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py; torch/optim/adamw.py ``_init_group``).

    Fine-tuning: ``fully_shard`` shards every parameter of a group, frozen or not; only the trainable ones
    get a sharded gradient (``FSDPParam.to_accumulated_grad_if_needed``/``foreach_reduce`` see only
    parameters with a gradient) and optimizer states (the optimizer is given the trainable ones). A QLoRA
    weight's packed storage shards like any tensor; its quant state (absmax, codes) is a Python attribute of
    the parameter, not a parameter, so every rank keeps all of it."""
    impl = strategy.optimizer_impl
    w = a = o = 0
    largest, largest_bits = 0, 32
    held = held_tensors(spec, strategy, fsdp_mixed=strategy.recipe.mixed)
    for h in held:
        m = h.count
        n = h.shard_numel(shards)
        kept = m * (_alloc(n, h.bits) + h.quant_state_bytes)
        if h.adapter:
            a += kept
        else:
            w += kept
        if h.trainable:
            o += m * optimizer_state_bytes(shard_tensor(h.tensor, shards), strategy.optimizer, h.bits, impl)
            if n > largest:
                largest, largest_bits = n, h.bits
    g = _fsdp_sharded_grads(spec, strategy, held, shards)
    temp = 0
    if strategy.optimizer is Optimizer.ADAMW and impl is OptimizerImpl.FOREACH:
        temp = g
    elif strategy.optimizer is Optimizer.LION:
        temp = 2 * _alloc(largest, largest_bits)
    return ShardedStates(
        weights_bytes=w, grads_bytes=g, master_bytes=0, optimizer_bytes=o, step_temp_bytes=temp, adapter_bytes=a
    )


def _unsharded_bytes(tensors: Sequence[tuple[ParamTensor, int]], bits: int) -> int:
    return sum(m * _alloc(t.numel, bits) for t, m in tensors)


# -- torch DDP -------------------------------------------------------------------------------------------


def ddp_module_order(spec: ModelSpec, grad_bits: int, strategy: Strategy | None = None) -> list[tuple[int, int, int]]:
    """(elements, gradient bits, layer) of every parameter in the reducer, in module registration order; layer -1:
    the token table (first), ``num_layers``: the model-level tensors after the layers (final norm, an untied head).
    Reversed, it is the order the gradients become ready in a backward (a tied table's last). With ``strategy``
    fine-tuning, its trainable tensors only, each in its own gradient dtype (:func:`ddp_bucket_bytes`)."""
    inv = inventory(spec)
    n_layers = sum(g.count for g in inv.layers)
    order: list[tuple[int, int, int]] = []
    if strategy is None or not finetuning(strategy):
        order = [(t.numel, grad_bits, -1) for t in inv.model_tensors[:1]]  # the token table comes first
        k = 0
        for g in inv.layers:
            for _ in range(g.count):
                order += [(t.numel, grad_bits, k) for t in g.tensors]
                k += 1
        order += [(t.numel, grad_bits, n_layers) for t in inv.model_tensors[1:]]
        return order
    held = [h for h in held_tensors(spec, strategy) if h.trainable]
    gb = strategy.recipe.grad_bits

    def bits(h: HeldTensor) -> int:
        return h.bits if h.adapter else gb

    first = inv.model_tensors[:1]
    order += [(h.tensor.numel, bits(h), -1) for h in held if h.root and h.tensor in first]
    per_layer = [h for h in held if not h.root]
    for k in range(n_layers):
        # a tensor trainable in c of the layers: in the first c (the order only moves bucket edges)
        order += [(h.tensor.numel, bits(h), k) for h in per_layer if k < h.count]
    order += [(h.tensor.numel, bits(h), n_layers) for h in held if h.root and h.tensor not in first]
    return order


def ddp_bucket_bytes(
    spec: ModelSpec, grad_bits: int, cap_bytes: int, first_bytes: int, strategy: Strategy | None = None
) -> list[int]:
    """DDP's buckets: parameters in reverse order, a bucket closes once it holds ≥ its limit (the first
    1 MiB, then ``bucket_cap_mb``); one flat gradient-dtype tensor each (c10d/reducer.cpp
    ``compute_bucket_assignment_by_size``; torch/nn/parallel/distributed.py ``_DEFAULT_FIRST_BUCKET_BYTES``).

    With ``strategy`` fine-tuning, only its trainable parameters are in the reducer (distributed.py
    ``_build_params_for_reducer`` keeps ``p.requires_grad``), each in its own gradient dtype (an fp32
    adapter's gradient is fp32), and the buckets are assigned per dtype (the reducer keys its size limits by
    dtype and device)."""
    buckets: list[int] = []
    size: dict[int, int] = {}
    limit: dict[int, int] = {}
    for numel, b, _ in reversed(ddp_module_order(spec, grad_bits, strategy)):
        size[b] = size.get(b, 0) + numel * b // 8
        if size[b] >= limit.get(b, first_bytes):
            buckets.append(size[b])
            size[b], limit[b] = 0, cap_bytes
    buckets += [n for n in size.values() if n]
    return [allocator_bytes(b) for b in buckets]


#: ``DistributedDataParallel.broadcast_bucket_size`` (torch/nn/parallel/distributed.py: ``int(250 * 1024 * 1024)``).
DDP_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


def module_buffers(spec: ModelSpec) -> list[tuple[int, int]]:
    """(element bits, bytes) of the model's registered buffers, as ``named_buffers`` yields them: RoPE's
    ``inv_freq`` and ``original_inv_freq`` (fp32, rotary_dim/2 each; modeling_llama.py ``LlamaRotaryEmbedding``),
    Gemma's 0-dim ``embed_scale``, DeepSeek-V3's per-MoE-layer fp32 ``e_score_correction_bias``, BERT's int64
    ``position_ids`` and ``token_type_ids`` (1 × max positions each; modeling_bert.py ``BertEmbeddings``). Checked
    against transformers 5.24's ``named_buffers`` on Llama, Qwen2, Gemma2, GPT-2 (none) and BERT."""
    out: list[tuple[int, int]] = []
    if spec.embedding_scale:
        out.append((32, 4))
    if spec.rotary_dim:
        out += [(32, 4 * (spec.rotary_dim // 2))] * 2
    if spec.moe is not None and spec.model_type == "deepseek_v3":
        out += [(32, 4 * spec.moe.num_experts)] * spec.num_moe_layers
    if spec.model_type == "bert" and spec.max_position_embeddings:
        out += [(64, 8 * spec.max_position_embeddings)] * 2
    return out


def ddp_broadcast_bytes(spec: ModelSpec, strategy: Strategy) -> list[int]:
    """The flat buffers of DDP's construction-time broadcast, in the order they are made: ``_sync_module_states``
    (torch/distributed/utils.py) broadcasts every parameter — frozen ones too — then every buffer from rank 0
    through ``dist._broadcast_coalesced`` (c10d/comm.cpp ``broadcast_coalesced``), which groups them by dtype in
    ``broadcast_bucket_size`` buckets (reducer.cpp ``compute_bucket_assignment_by_size`` with one limit: a bucket
    closes once it holds ≥ the limit; buckets ordered by their first tensor) and flattens each into one new tensor
    (tensor_flatten.h ``flatten_dense_tensors``: a ``cat``, a lone tensor's view when a bucket holds one), at most two
    in flight (``max_in_flight``). Each flat is freed when its broadcast is finished (0: a bucket of one tensor,
    broadcast as a view of it). Parameters in model order
    (the token table, each layer's, the rest; an adapter after its layer's base tensors) — approximately: BERT's
    position tables, a layer group's frozen/trainable split and DeepSeek's dense layers may sit a few tensors off,
    which moves where a 250 MiB bucket closes, not the total. Dtypes are keyed by width (bf16 and fp16, int8 and
    uint8 never meet in one model here)."""
    inv = inventory(spec)
    roots = set(inv.model_tensors)  # by value: the inventory and param_states are memoised apart
    first = inv.model_tensors[:1]
    states = param_states(spec, strategy)
    layer_states = [ps for ps in states if ps.tensor not in roots]
    order: list[tuple[int, int]] = [(ps.param_bits, ps.param_bytes) for ps in states if ps.tensor in first]
    for k in range(spec.num_layers):
        order += [(ps.param_bits, ps.param_bytes) for ps in layer_states if k < ps.count]
    order += [(ps.param_bits, ps.param_bytes) for ps in states if ps.tensor in roots and ps.tensor not in first]
    return coalesced_flats(order + module_buffers(spec))


def ddp_buffer_sync_bytes(spec: ModelSpec) -> list[int]:
    """The flat buffers of the broadcast DDP runs before a forward (``broadcast_buffers``, the default:
    distributed.py ``_sync_buffers`` → ``_default_broadcast_coalesced`` over the module's buffers), after a rebuild of
    its buckets: the buffers alone, coalesced as :func:`ddp_broadcast_bytes` has it. The stream syncs before every
    forward, as every micro-step of it reduces (under ``no_sync`` only the forward after a syncing one would)."""
    return coalesced_flats(module_buffers(spec))


def coalesced_flats(order: Sequence[tuple[int, int]]) -> list[int]:
    """``dist._broadcast_coalesced``' flat tensors for tensors given as (element bits, bytes) in order: grouped by
    dtype into buckets that close once they hold ≥ ``broadcast_bucket_size``, ordered by their first tensor, each
    flattened (allocator-rounded; 0 for a bucket of one tensor, broadcast as a view of it)."""
    buckets: list[tuple[int, int, int]] = []  # (first index, bytes, tensors)
    open_: dict[int, list[int]] = {}  # dtype -> [first index, bytes, tensors]
    for i, (bits, nbytes) in enumerate(order):
        if nbytes == 0:
            continue
        b = open_.setdefault(bits, [i, 0, 0])
        b[1] += nbytes
        b[2] += 1
        if b[1] >= DDP_BROADCAST_BUCKET_BYTES:
            buckets.append((b[0], b[1], b[2]))
            del open_[bits]
    buckets += [(b[0], b[1], b[2]) for b in open_.values()]
    buckets.sort()
    return [allocator_bytes(nbytes) if n > 1 else 0 for _, nbytes, n in buckets]


def ddp_stashed_first_bucket(spec: ModelSpec, strategy: Strategy, q: StepInputs) -> int:
    """Bytes of DDP's first-iteration bucket that NCCL's stash keeps alive past the rebuild, above what the worst
    step holds anyway. Without ``find_unused_parameters`` the first iteration reduces one bucket of every gradient
    (one per gradient dtype; distributed.py ``compute_bucket_size_limits``: ``[sys.maxsize]``); at the next forward
    the reducer rebuilds its buckets and drops it (reducer.cpp ``initialize_buckets``: ``buckets_.clear()``, then
    the new ones), but ProcessGroupNCCL still holds it: an asynchronous collective stashes its tensors on its work's
    ``TensorShelf`` (ProcessGroupNCCL.cpp ``collective``), released by ``Work::wait``, which the reducer never calls
    (it waits on the work's future, ``finalize_backward``), or by the next collective's ``workEnqueue`` once the
    watchdog (every 100 ms, ``kWatchdogThreadSleepMillis``) has seen the work complete. Whether it has by the
    rebuild's and the buffers' broadcasts is timing: H200, torch 2.11, qwen2.5-0.5b on one NCCL rank, the second
    step's forward and backward peaks were +988065792 bytes in 2 of 3 runs, never with a 0.3 s pause after the
    optimizer step (benchmarks/h200/2026-12-04b). Counted here: a plan must fit when it stays. With one
    micro-step that is the second step's; under accumulation (DDP reduces every micro-step) the first step's second
    micro-step, before the optimizer has made its states: it is then the worst only by what the bucket exceeds them
    by."""
    bucket = sum(ddp_bucket_bytes(spec, strategy.recipe.grad_bits, sys.maxsize, sys.maxsize, strategy))
    if strategy.grad_accum > 1:
        return max(0, bucket - q.resident.optimizer_states)
    return bucket


def _ddp_stash_moments(spec: ModelSpec, strategy: Strategy) -> frozenset[MomentName]:
    """The backward moments before DDP's first reduction of a step, at which the stashed first bucket
    (:func:`ddp_stashed_first_bucket`) is still held — the earliest the stash can let it go is that reduction, set
    off when bucket 0 (the first ``ddp_first_bucket_bytes`` of gradients in the order they became ready, per
    gradient dtype; it closes once it holds ≥ its cap, ``compute_bucket_assignment_by_size``) is full: after the
    model-level tensors behind the layers (final norm, an untied head), inside the top layer (its first weight
    gradient: released inside the top block), in a lower layer, or — on a small model whose layers together hold
    less than the cap — only with the token table, at the end of backward."""
    cap = strategy.engine.ddp_first_bucket_bytes
    n_layers = spec.num_layers
    filled: dict[int, int] = {}
    closes_at = -1  # the table's: every backward moment holds it
    for numel, bits, layer in reversed(ddp_module_order(spec, strategy.recipe.grad_bits, strategy)):
        filled[bits] = filled.get(bits, 0) + numel * bits // 8
        if filled[bits] >= cap:
            closes_at = layer
            break
    held = {MomentName.BACKWARD_START}
    if closes_at < n_layers:  # not filled by the final norm and an untied head alone
        held.add(MomentName.BACKWARD_FINAL_NORM)
    if closes_at < n_layers - 1:  # not by the top layer either: held inside it
        held.add(MomentName.BACKWARD_TOP_BLOCK)
    if closes_at < 0:  # the layers together hold less than the cap: only the token table fills it
        held |= {MomentName.BACKWARD_BOTTOM_BLOCK, MomentName.BACKWARD_EMBEDDING}
    return frozenset(held)


def _ddp(spec: ModelSpec, strategy: Strategy) -> tuple[tuple[PhaseBreakdown, ...], list[str]]:
    q = step_inputs(spec, strategy, keep_logits=False)
    eo = strategy.engine
    buckets = ddp_bucket_bytes(
        spec, strategy.recipe.grad_bits, eo.bucket_cap_mb * 1024 * 1024, eo.ddp_first_bucket_bytes, strategy
    )
    total = sum(buckets)
    # A tied table's out-of-place sum (states.tied_gradient_sum), which the one-GPU moment files as the
    # table's .grad: with bucket views AccumulateGrad adds it into the table's view in place
    # (torch/csrc/autograd/functions/accumulate_grad.h ``accumulateGrad``), a tensor of its own until then
    # (the trace: tests/trace/test_tied_many_gpus.py); with accumulation it is in the moment's temporaries.
    tied = tied_gradient_sum(spec, strategy) if q.grad_head and not q.grads_resident else None
    tied_sum = tied.out_of_place_bytes if tied is not None and tied_sum_modelled(strategy) else 0

    stash = ddp_stashed_first_bucket(spec, strategy, q)
    held_at = _ddp_stash_moments(spec, strategy)

    def adjust(m: Moment) -> dict[Component, int]:
        c = _single(m)
        if eo.gradient_as_bucket_view:
            c[Component.GRADIENTS] = total  # the gradients are views of the buckets, which never go away
            if m.name is MomentName.BACKWARD_EMBEDDING:
                c[Component.TEMPORARIES] += tied_sum
        else:
            c[Component.COMM_BUFFERS] = total
        if m.phase is Phase.FORWARD or m.name in held_at:
            c[Component.COMM_BUFFERS] += stash
        return c

    notes = [
        f"DDP: {len(buckets)} gradient buckets of {fmt_gib(total)} in all, resident from construction"
        + (" (the gradients are views of them)" if eo.gradient_as_bucket_view else " on top of the gradients")
    ]
    if stash:
        notes.append(
            f"DDP over NCCL: the first iteration's single bucket ({fmt_gib(stash)}) outlives the rebuild of the "
            "buckets, held by the stash of its all-reduce until the next backward's first reduction (counted; whether "
            "it stays depends on timing: NCCL's watchdog, every 100 ms, may have released it)"
        )
    if finetuning(strategy):
        notes.append(
            "fine-tuning under DDP: every rank holds the single-GPU fine-tuning states; the buckets hold only the "
            "trainable parameters' gradients"
        )
    return _worst(q, adjust, {}), notes


# -- torch FSDP2 -----------------------------------------------------------------------------------------


def _fsdp_sharded_grads(spec: ModelSpec, strategy: Strategy, held: Sequence[HeldTensor], shards: int) -> int:
    """The sharded gradients: views into each group's flat reduce-scatter output, one allocation per group
    of the padded shards of its trainable parameters in their dtype (_fsdp_collectives.py ``foreach_reduce``:
    ``torch.as_strided(reduce_output, ...)``); the model-level tensors in the root's group or their units
    (:func:`fsdp_unit`). A tensor trainable in c of a group's layers is taken to be trainable in the same c layers
    as the others (exact for layer ranges and module names)."""
    by_unit: dict[int, int] = {}
    for h in held:
        if h.root and h.trainable:
            u = fsdp_unit(spec, strategy, h.tensor)
            by_unit[u] = by_unit.get(u, 0) + h.shard_numel(shards) * h.bits // 8
    out = sum(allocator_bytes(n) for n in by_unit.values())
    for i, g in enumerate(inventory(spec).layers):
        layer = [(h.count, h.shard_numel(shards) * h.bits // 8) for h in held if h.group == i and h.trainable]
        for k in range(g.count):
            out += allocator_bytes(sum(n for count, n in layer if k < count))
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class FsdpUnitBytes:
    """One model-level FSDP2 group's bytes (``--fsdp-wrap units``: the untied table's, [final norm, head]'s)."""

    unsharded: int = 0  # its unsharded parameters
    all_gather: int = 0  # its padded all-gather output
    reduce_scatter: int = 0  # its padded reduce-scatter input (trainable parameters only)
    shard_grads: int = 0  # its sharded gradients (one reduce output)


@dataclass(frozen=True, slots=True, kw_only=True)
class FsdpGroups:
    """What FSDP2's groups move: the unsharded parameters (per tensor, padded to W shards, in the all-gather dtype),
    the padded all-gather output and reduce-scatter input of one layer group, the root's; under ``--fsdp-wrap
    units`` with an untied table the root's are what is left of the model-level tensors (nothing for a Llama), the
    table's and [final norm, head]'s are ``embedding`` and ``tail`` (else empty)."""

    root_bytes: int  # the root's unsharded parameters
    layer_bytes: int  # the largest layer's unsharded parameters
    layers_all_bytes: int  # every layer's
    all_gather_bytes: int  # one layer's padded all-gather output
    root_all_gather_bytes: int  # the root's
    reduce_scatter_bytes: int  # one layer's padded reduce-scatter input (its trainable parameters only)
    root_reduce_scatter_bytes: int
    root_shard_grads_bytes: int  # the root's sharded gradients
    embedding: FsdpUnitBytes = FsdpUnitBytes()
    tail: FsdpUnitBytes = FsdpUnitBytes()


def fsdp_wire_bits(held_bits: int, *, mixed: bool, compute_bits: int, packed: bool = False) -> tuple[int, int]:
    """(all-gather, reduce-scatter) width in bits of one FSDP2 parameter held in ``held_bits``: under the
    mixed-precision policy (``mixed``: ``MixedPrecisionPolicy(param_dtype=<compute>, reduce_dtype=fp32)``) the
    all-gather casts to ``param_dtype`` — a packed 4-bit storage is not cast (bf16 already, or not floating) —
    and the gradients are reduced in ``reduce_dtype``; without a policy both move the parameter's own dtype
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py ``init_dtype_attrs``; _fsdp_collectives.py
    ``foreach_all_gather``, ``foreach_reduce``). The one rule the memory model (:func:`fsdp_groups`) and the speed
    model (:mod:`trainfit.planner.speed`) both read."""
    if not mixed:
        return held_bits, held_bits
    return (held_bits if packed else compute_bits), 32


def fsdp_groups(spec: ModelSpec, strategy: Strategy, shards: int) -> FsdpGroups:
    """Per group (``fully_shard`` per decoder layer + root): the all-gather moves every parameter, frozen or
    not, cast to ``param_dtype`` under the policy (a packed 4-bit storage is not cast: bf16 already, or not
    floating, _fsdp_param.py ``init_dtype_attrs``; mixed dtypes without a policy are gathered as bytes,
    _fsdp_collectives.py ``foreach_all_gather``); the reduce-scatter moves the gradients of the trainable
    ones in ``reduce_dtype`` (fp32 under the policy), ``foreach_reduce``."""
    mixed = strategy.recipe.mixed
    cbits = strategy.recipe.compute_bits
    held = held_tensors(spec, strategy, fsdp_mixed=mixed)

    def gather_bits(h: HeldTensor) -> int:
        return fsdp_wire_bits(h.bits, mixed=mixed, compute_bits=cbits, packed=bool(h.packed_bytes))[0]

    def reduce_bits(h: HeldTensor) -> int:
        return fsdp_wire_bits(h.bits, mixed=mixed, compute_bits=cbits, packed=bool(h.packed_bytes))[1]

    def unique(hs: Sequence[HeldTensor]) -> list[HeldTensor]:
        """One entry per tensor of a layer (a tensor frozen in some layers and trainable in others is held
        twice, with its two counts); trainable if any copy is (the worst layer)."""
        seen: dict[int, HeldTensor] = {}
        for h in hs:
            k = id(h.tensor)
            if k not in seen or (h.trainable and not seen[k].trainable):
                seen[k] = h
        return list(seen.values())

    split = untied_units(spec, strategy)
    unit = {h.tensor: fsdp_unit(spec, strategy, h.tensor) if split else ROOT_UNIT for h in held if h.root}
    root = unique([h for h in held if h.root and unit[h.tensor] == ROOT_UNIT])
    inv = inventory(spec)
    layers = [unique([h for h in held if h.group == i]) for i in range(len(inv.layers))]

    def unsharded(hs: Sequence[HeldTensor]) -> int:
        # each unsharded parameter is a view of its own padded all-gather output, W padded shards long
        # (_fsdp_param.py ``init_all_gather_outputs``, ``init_unsharded_param``: ``torch.as_strided``)
        return sum(_alloc(h.shard_numel(shards) * shards, gather_bits(h)) for h in hs)

    def padded(hs: Sequence[HeldTensor], bits: Callable[[HeldTensor], int]) -> int:
        return allocator_bytes(sum(h.shard_numel(shards) * shards * bits(h) // 8 for h in hs))

    def of(u: int) -> FsdpUnitBytes:
        hs = unique([h for h in held if h.root and unit[h.tensor] == u])
        return FsdpUnitBytes(
            unsharded=unsharded(hs),
            all_gather=padded(hs, gather_bits),
            reduce_scatter=padded([h for h in hs if h.trainable], reduce_bits),
            shard_grads=sum(_alloc(h.shard_numel(shards), h.bits) for h in hs if h.trainable),
        )

    return FsdpGroups(
        embedding=of(EMBEDDING_UNIT),
        tail=of(TAIL_UNIT),
        root_bytes=unsharded(root),
        layer_bytes=max(unsharded(hs) for hs in layers),
        layers_all_bytes=sum(g.count * unsharded(hs) for g, hs in zip(inv.layers, layers, strict=True)),
        all_gather_bytes=max(padded(hs, gather_bits) for hs in layers),
        root_all_gather_bytes=padded(root, gather_bits),
        reduce_scatter_bytes=max(padded([h for h in hs if h.trainable], reduce_bits) for hs in layers),
        root_reduce_scatter_bytes=padded([h for h in root if h.trainable], reduce_bits),
        root_shard_grads_bytes=sum(_alloc(h.shard_numel(shards), h.bits) for h in root if h.trainable),
    )


def fsdp_no_sync_grad_bytes(spec: ModelSpec, strategy: Strategy, shards: int) -> int:
    """What a rank holds more when FSDP2 skips the reduce-scatter between micro-steps — the HF Trainer's default
    under gradient accumulation: accelerate's ``no_sync`` is ``set_requires_gradient_sync(False)`` for FSDP2
    (accelerate/accelerator.py ``no_sync``, used by transformers' Trainer for every micro-step but the last unless
    ``sync_each_batch``), and each parameter then keeps its *unsharded* gradient, upcast to ``reduce_dtype``
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py ``to_accumulated_grad_if_needed``), to the last micro-step:
    every trainable parameter's full gradient in the reduce dtype, less the sharded gradients the estimate
    already holds (``shards``: the sharding group's size). trainfit's FSDP2 estimate reduce-scatters every
    micro-step (``sync_each_batch=True``, which its exports set)."""
    mixed = strategy.recipe.mixed
    held = held_tensors(spec, strategy, fsdp_mixed=mixed)
    root, layers = fsdp_unsharded_grad_bytes(spec, strategy)
    sharded = sum(_alloc(h.shard_numel(shards), h.bits) * h.count for h in held if h.trainable)
    return max(0, root + layers - sharded)


def fsdp_unsharded_grad_bytes(spec: ModelSpec, strategy: Strategy, unit: int | None = None) -> tuple[int, int]:
    """(the root's, the layers') unsharded gradients in FSDP2's reduce dtype, one allocation per parameter:
    what accelerate's ``no_sync`` accumulates between micro-steps (``to_accumulated_grad_if_needed``:
    ``unsharded_grad.to(reduce_dtype)`` under the policy; without one autograd's own ``.grad`` stays). ``unit``:
    the model-level tensors of that group only (:func:`fsdp_unit`) as the first."""
    mixed = strategy.recipe.mixed
    cbits = strategy.recipe.compute_bits
    out = [0, 0]
    for h in held_tensors(spec, strategy, fsdp_mixed=mixed):
        if h.root and unit is not None and fsdp_unit(spec, strategy, h.tensor) != unit:
            continue
        if h.trainable:
            bits = fsdp_wire_bits(h.bits, mixed=mixed, compute_bits=cbits, packed=False)[1]
            out[0 if h.root else 1] += _alloc(h.tensor.numel, bits) * h.count
    return out[0], out[1]


def tp_kept_table_grad_bytes(spec: ModelSpec, held_spec: ModelSpec, strategy: Strategy) -> int:
    """2-D FSDP2 × DTensor TP under accelerate's ``no_sync``: what the token table's kept unsharded gradient holds
    beyond the rank's ⌈V/tp⌉ rows. The embedding's backward computes the whole table's gradient
    (``embedding_dense_backward`` has no vocabulary-sharded strategy); in a micro-step that does not reduce,
    ``to_accumulated_grad_if_needed`` upcasts that whole gradient to the reduce dtype and keeps it — only the
    reducing post-backward copies the rank's rows out of it (``Replicate`` → ``Shard(0)``). The trace of a tiny
    llama at TP 2 × dp 2 keeps 8 MiB for the table (8192 × 256 in fp32), not the rows' 4 MiB."""
    mixed = strategy.recipe.mixed
    for h in held_tensors(held_spec, strategy, fsdp_mixed=mixed):
        if h.tensor.name == "embed_tokens.weight" and h.trainable:
            bits = fsdp_wire_bits(h.bits, mixed=mixed, compute_bits=strategy.recipe.compute_bits, packed=False)[1]
            return _alloc(spec.vocab_size * spec.hidden_size, bits) - _alloc(h.tensor.numel, bits)
    return 0


#: The single-GPU moments inside a layer's backward.
_LAYER_BACKWARD = (
    MomentName.BACKWARD_TOP_BLOCK,
    MomentName.BACKWARD_TOP_SOFTMAX,
    MomentName.BACKWARD_BOTTOM_BLOCK,
    MomentName.BACKWARD_BOTTOM_SOFTMAX,
)


def _fsdp(
    spec: ModelSpec,
    strategy: Strategy,
    p: ParallelPlan,
    *,
    q: StepInputs | None = None,
    held_spec: ModelSpec | None = None,
    table_copy: int = 0,
) -> tuple[tuple[PhaseBreakdown, ...], list[str]]:
    """One FSDP2 rank. ``q``/``held_spec``/``table_copy`` (2-D FSDP2×TP, :func:`_fsdp_tp`): the rank's step
    inputs, the model whose parameter inventory is the tensors FSDP2 shards (the TP-local ones) instead of
    ``spec``'s, and the token table's local gradient copied out of the whole one in the embedding's backward."""
    cs = compute_strategy(strategy, casts_every_param=strategy.recipe.mixed)
    q = q or step_inputs(spec, cs, keep_logits=False)
    held_spec = held_spec or spec
    st = fsdp_states(held_spec, strategy, p.shard)
    inv = inventory(held_spec)
    cbits = cs.recipe.compute_bits
    mixed = strategy.recipe.mixed
    fg = fsdp_groups(held_spec, strategy, p.shard)
    root, layer, layers_all = fg.root_bytes, fg.layer_bytes, fg.layers_all_bytes
    # The reduce-scatter input of one layer: its padded size in the reduce dtype (fp32 under the policy).
    rs = fg.reduce_scatter_bytes
    # One layer's padded all-gather output in the compute dtype: FSDP2 keeps the last all-gather result
    # (``comm_ctx.all_gather_state``) until the next copy-out or the root's post-forward
    # (_fsdp_param_group.py ``wait_for_unshard``), so it is alive through the loss, and the last layer's
    # unshard is in flight when backward starts.
    ag = fg.all_gather_bytes
    # The root's reduce-scatter at the end of backward (its post-backward): the fp32 input of its padded
    # size, while the LM head's bf16 gradient is still referenced.
    root_shard_grads = fg.root_shard_grads_bytes
    rs_root = fg.root_reduce_scatter_bytes
    raf = strategy.engine.reshard_after_forward
    offload = strategy.offload.parameters_on_host
    n_layers = sum(g.count for g in inv.layers)
    g_full = max(1, q.states.grads_bytes)

    # Layers unsharded in a layer's backward: FSDP2's post-backward reshards every layer after its backward
    # (``reshard_after_backward``, _fsdp_param_group.py ``post_backward``); below it, with reshard_after_forward
    # every layer still unsharded since its forward, without it the current one and the one its pre-backward
    # prefetched (``_backward_prefetch``). The bottom moment is the bottom segment's top layer.
    seg = q.segment_layers if q.segments else 1
    bottom_held = min(seg, 2) if raf else seg
    # The reduce-scatter input in flight at the bottom moment: the layer above's, freed by the next post-backward
    # (``reduce_scatter_max_input_buffers`` = 1) — none when that layer is wholly frozen (--freeze: its post-backward
    # freed the one before and reduced nothing, ``len(fsdp_params_with_grad) == 0``).
    fz = frozen_layers(spec, strategy)
    dead = fz.dead if fz is not None else 0
    # the layers that run a backward (--freeze: none below the dead ones)
    n_back = n_layers - dead
    bottom = q.stack.bottom_layer if q.stack.bottom_layer is not None else dead + seg - 1
    above = bottom + 1  # none above the top layer: its own is made in its post-backward
    rs_bottom = rs if above < n_layers and not (fz is not None and fz.frozen_at[above]) else 0
    if dead:
        # with reshard_after_forward the dead layer below the bottom one, prefetched by its pre-backward (or the top
        # one by the root's, every layer dead); without, every dead layer, unsharded until the final callback
        bottom_held = bottom_held + (1 if raf else dead) if n_back else (1 if raf else n_layers)

    # HSDP accumulating (a micro-step after the first): each group's reduce output, added into its sharded .grad,
    # is also the all-reduce's input, which the group holds to the end of backward (_fsdp_param_group.py
    # ``_all_reduce_state``, dropped in ``finalize_backward``): one sharded gradient per layer done. (FSDP frees it
    # when ``foreach_reduce`` returns.) Under CPUOffloadPolicy in every micro-step: the gradient is copied to the host
    # but the device's reduce output stays held.
    # accelerate's no_sync (the HF Trainer's default, ``EngineOptions.sync_each_batch`` False): the micro-steps
    # before the last keep each parameter's unsharded gradient in the reduce dtype (fsdp_unsharded_grad_bytes) and
    # no sharded one; the last adds into them and reduce-scatters layer by layer, so a layer done holds its shards
    # (its reduce outputs are the sharded gradients: nothing to hold under HSDP).
    no_sync = not strategy.engine.sync_each_batch and strategy.grad_accum > 1
    hold = p.dp > p.shard and (offload or (q.grads_resident > 0 and not no_sync))
    # --fsdp-wrap units with an untied table: the table and [final norm, head] are groups of their own
    wrap = resolved_fsdp_wrap(held_spec, strategy)
    untied = untied_units(held_spec, strategy)
    emb, tail = fg.embedding, fg.tail
    layer_shard_grads = (st.grads_bytes - root_shard_grads - emb.shard_grads - tail.shard_grads) // max(1, n_layers)
    # the model-level groups unsharded through the layers: the root's, and (units) the table's without raf
    through = root + (0 if raf else emb.unsharded)
    acc_root, acc_layers = fsdp_unsharded_grad_bytes(held_spec, strategy) if no_sync else (0, 0)
    if no_sync and table_copy:  # 2-D: the token table's is kept whole (tp_kept_table_grad_bytes)
        acc_root += tp_kept_table_grad_bytes(spec, held_spec, strategy)
    acc_layer = acc_layers // max(1, n_layers)
    # units, untied, no_sync: the accumulated gradients of the table's unit and [final norm, head]'s (the root's
    # are then what is left)
    acc_emb = acc_tail = 0
    if no_sync and untied:
        acc_emb = fsdp_unsharded_grad_bytes(held_spec, strategy, EMBEDDING_UNIT)[0]
        acc_tail = fsdp_unsharded_grad_bytes(held_spec, strategy, TAIL_UNIT)[0]
        acc_root -= acc_emb + acc_tail

    def units_no_sync(done: int, tail_done: bool, emb_done: bool = False) -> int:
        """Units, no_sync, the last micro-step: the gradients held with ``done`` layers and the [final norm, head]
        and table units reduced or not (a reduced group's shards go to the host under CPUOffloadPolicy)."""
        shards = not offload
        return (
            acc_root
            + (emb.shard_grads * shards if emb_done else acc_emb)
            + (tail.shard_grads * shards if tail_done else acc_tail)
            + acc_layer * (n_layers - done)
            + layer_shard_grads * done * shards
        )

    def no_sync_grads(done: int) -> int:
        """The gradients held with ``done`` layers reduced in the last micro-step (the root's not yet). Under
        CPUOffloadPolicy the accumulated unsharded gradients are on the device too (only reduced shards go to the
        host): leaving the layers' out put the trace of a tiny llama 4.2–6.6% above this."""
        return acc_root + acc_layer * (n_layers - done) + layer_shard_grads * done * (not offload)

    def layers_done(m: Moment) -> int:
        """Layers whose post-backward has run at the single-GPU moment ``m`` (the bottom one: all but it)."""
        if m.name in (MomentName.BACKWARD_BOTTOM_BLOCK, MomentName.BACKWARD_BOTTOM_SOFTMAX):
            return n_layers - 1
        return n_layers if m.name is MomentName.BACKWARD_EMBEDDING else 0

    def with_shards(m: Moment) -> dict[Component, int]:
        """``m``'s single-GPU components with this rank's shards, optimizer states and no autocast copies."""
        c = _single(m)
        c[Component.AUTOCAST_COPIES] = 0
        if offload:
            c[Component.WEIGHTS] = c[Component.OPTIMIZER_STATES] = c[Component.MASTER_WEIGHTS] = 0
            c[Component.ADAPTER_WEIGHTS] = 0
        else:
            c[Component.WEIGHTS], c[Component.MASTER_WEIGHTS] = st.weights_bytes, 0
            c[Component.ADAPTER_WEIGHTS] = st.adapter_bytes
            c[Component.OPTIMIZER_STATES] = st.optimizer_bytes
        return c

    def units(
        m: Moment, inner: tuple[int, bool, int] | None = None, *, tail_post: bool = False
    ) -> dict[Component, int]:
        """``adjust`` for ``--fsdp-wrap units`` with an untied table (:func:`_fsdp_wrap_note`). The table's unit is
        unsharded in its forward (then resharded, with ``reshard_after_forward``), prefetched by layer 0's
        pre-backward and unsharded again for its own backward, whose post-backward (the root's final callback, as
        its input, the token ids, has no gradient) reduces its gradient last. [final norm, head] is unsharded from
        the final norm's forward, not resharded after it (``reshard_after_forward=False``: accelerate, torchtitan),
        and its post-backward runs right after the final norm's backward (``RegisterPostBackwardFunction`` on the
        norm's input): the head's bf16 gradient, freed after the reduce output, and the fp32 reduce-scatter input,
        in flight through the top layer's backward (``tail_post``: that moment). The trace of llama-3.1-8b over 8
        ranks at 1 × 1024: the root wrapping's peak (the root's whole table and head, the head's gradient waiting
        to the end) 5.4% above."""
        c = with_shards(m)
        bwd = m.phase is Phase.BACKWARD
        tail_done = tail_post or (bwd and m.name not in (MomentName.BACKWARD_START, MomentName.BACKWARD_FINAL_NORM))
        every_layer = 0 if raf else layers_all
        gathers = p.shard > 1
        if offload:
            c[Component.GRADIENTS] = 0
        elif q.grads_resident:
            c[Component.GRADIENTS] = st.grads_bytes  # accumulating: every shard exists; reduce outputs are new
        elif bwd or tail_post:
            done = max(0, m.gradients - q.grad_head) / max(1, g_full - q.grad_head - q.grad_late)
            c[Component.GRADIENTS] = int(layer_shard_grads * n_layers * min(1.0, done)) + (
                tail.shard_grads if tail_done else 0
            )
            if m.name is MomentName.BACKWARD_EMBEDDING:
                c[Component.GRADIENTS] = st.grads_bytes - emb.shard_grads - root_shard_grads
        else:
            c[Component.GRADIENTS] = int(st.grads_bytes * min(1.0, m.gradients / g_full))
        n_done = layers_done(m) if inner is None else inner[2]
        if no_sync and m.phase is not Phase.OPTIMIZER_STEP:
            c[Component.GRADIENTS] = units_no_sync(n_done if bwd else 0, tail_done)
        # a new reduce output beside the shards (accumulating) or dropped once on the host (CPUOffloadPolicy)
        transient = (q.grads_resident > 0 and not no_sync) or offload
        unsharded = comm = 0
        if tail_post:
            unsharded = through + every_layer
            comm = tail.reduce_scatter + (ag if gathers and raf else 0)
            c[Component.TEMPORARIES] = q.grad_head + (tail.shard_grads if transient else 0)
            if no_sync:
                # the head's gradient added into the accumulated one and freed; that one (the group's last) is held
                # beside the reduce-scatter input until after the reduce output (the trace of HSDP with units)
                c[Component.GRADIENTS] = units_no_sync(0, False)
                c[Component.TEMPORARIES] = tail.shard_grads
            c[Component.TEMPORARIES] += (
                Widths.of(q.strategy).residual * q.strategy.tokens_per_micro_batch * (q.spec.hidden_size)
            )
        elif m.phase is Phase.FORWARD:
            if m.name is MomentName.FORWARD_END:
                unsharded, comm = through + tail.unsharded + every_layer, tail.all_gather if gathers else 0
            else:
                unsharded, comm = through + every_layer, ag if gathers else 0
                if raf and m.name in (MomentName.FORWARD_LAST_MOE_EXPERTS, MomentName.FORWARD_LAST_DOWN_PROJ):
                    unsharded += layer
        elif m.name is MomentName.BACKWARD_START:
            unsharded = through + tail.unsharded + every_layer  # the last layer's prefetch is not issued yet
        elif m.name is MomentName.BACKWARD_FINAL_NORM:
            unsharded = through + tail.unsharded + every_layer
            comm = ag if gathers and raf else 0
            c[Component.TEMPORARIES] += q.grad_head  # reduced by [final norm, head]'s post-backward, next
        elif m.name in (MomentName.BACKWARD_TOP_BLOCK, MomentName.BACKWARD_TOP_SOFTMAX):
            unsharded = through + (layers_all if not raf else min(2, n_layers) * layer)
            comm = tail.reduce_scatter
        elif m.name in (MomentName.BACKWARD_BOTTOM_BLOCK, MomentName.BACKWARD_BOTTOM_SOFTMAX):
            unsharded = through + bottom_held * layer
            # the table's all-gather output: prefetched by layer 0's pre-backward (not yet when --freeze puts the
            # bottom moment in a higher layer: the topmost frozen one of a frozen bottom)
            table = emb.all_gather if gathers and raf and not q.stack.bottom_layer else 0
            comm = (rs_bottom if n_layers > 1 else tail.reduce_scatter) + table
        elif m.name is MomentName.BACKWARD_EMBEDDING:
            c[Component.LOGITS_LOSS] = 0
            # inside the embedding's backward: the table unsharded, layer 0's reduce-scatter input in flight;
            # or its post-backward's reduce output: resharded, its own input, the table's bf16 gradient held
            own = c[Component.TEMPORARIES] + table_copy
            if no_sync:
                # the table's gradient added into the accumulated one and freed; that one is held beside the
                # reduce-scatter input until after the reduce output, as [final norm, head]'s
                c[Component.GRADIENTS] = units_no_sync(n_layers, True)
                if emb.unsharded + rs + q.grad_late + own >= emb.reduce_scatter + emb.shard_grads:
                    unsharded, comm = root + emb.unsharded, rs
                    c[Component.TEMPORARIES] = q.grad_late + own
                else:
                    unsharded, comm = root, emb.reduce_scatter
                    c[Component.TEMPORARIES] = emb.shard_grads
            elif emb.unsharded + rs + own >= emb.reduce_scatter + emb.shard_grads:
                unsharded, comm = root + emb.unsharded, rs
                c[Component.TEMPORARIES] = q.grad_late + own
            else:
                unsharded, comm = root, emb.reduce_scatter
                c[Component.TEMPORARIES] = q.grad_late + (emb.shard_grads if transient else 0)
                if not transient:
                    c[Component.GRADIENTS] += emb.shard_grads
        elif m.phase is Phase.OPTIMIZER_STEP:
            c[Component.TEMPORARIES] = 0 if offload else st.step_temp_bytes
        if inner is not None:
            unsharded = through + inner[0] * layer
            comm = (rs_bottom if inner[2] == n_back - 1 else rs) if inner[1] else tail.reduce_scatter
            if inner[2] == n_back - 1 and gathers and raf and not q.stack.bottom_layer:
                comm += emb.all_gather  # the bottom layer's backward: the table's prefetched all-gather output
        if hold and bwd:
            comm += layer_shard_grads * n_done + (tail.shard_grads if tail_done else 0)
        c[Component.UNSHARDED_PARAMS] = unsharded
        c[Component.COMM_BUFFERS] = comm
        return c

    def adjust(m: Moment, inner: tuple[int, bool, int] | None = None) -> dict[Component, int]:
        """``m`` as this rank's components; ``inner``: (the layers unsharded, a reduce-scatter input held, the
        layers done) for the moments of :func:`_fsdp_inner_moments`."""
        if not n_back and m.name in _LAYER_BACKWARD:
            # every layer dead (--freeze): no layer runs a backward; the root's (or [final norm, head]'s)
            # pre-backward prefetched the top one, dropped by the final callback
            m = dataclasses.replace(m, name=MomentName.BACKWARD_FINAL_NORM)
        if untied:
            return units(m, inner)
        c = with_shards(m)
        frac = min(1.0, m.gradients / g_full)
        c[Component.GRADIENTS] = 0 if offload else int(st.grads_bytes * frac)
        if m.phase is Phase.BACKWARD and m.name is not MomentName.BACKWARD_EMBEDDING and not q.grads_resident:
            # The root's sharded gradients (LM head, token table, final norm) are made in its post-backward, at
            # the end: before it the rank holds the shards of the layers done (the head's bf16 gradient waits
            # unsharded, below), not a share of the head's
            done = max(0, m.gradients - q.grad_head) / max(1, g_full - q.grad_head - q.grad_late)
            c[Component.GRADIENTS] = 0 if offload else int((st.grads_bytes - root_shard_grads) * min(1.0, done))
        unsharded = 0
        comm = 0
        if m.phase is Phase.FORWARD:
            unsharded = root + (0 if raf else layers_all)
            if raf and m.name in (MomentName.FORWARD_LAST_MOE_EXPERTS, MomentName.FORWARD_LAST_DOWN_PROJ):
                # inside the top layer's experts: that layer is unsharded (its pre-forward all-gather) besides
                # its all-gather output, while PEFT's ParamWrapper forms W + B·A from the unsharded stacks
                unsharded += layer
            comm = ag if p.shard > 1 else 0
        elif m.name in (MomentName.BACKWARD_START, MomentName.BACKWARD_FINAL_NORM):
            unsharded = root + (layers_all if not raf else 0)
            # the last layer's prefetch: by the root's pre-backward, on the model's output, the loss, so before the
            # loss's backward; under --fsdp-wrap units by [final norm, head]'s, on the logits, after it
            late_prefetch = m.name is MomentName.BACKWARD_START and wrap is FsdpWrap.UNITS
            comm = ag if p.shard > 1 and raf and not late_prefetch else 0
        elif m.name in (MomentName.BACKWARD_TOP_BLOCK, MomentName.BACKWARD_TOP_SOFTMAX):
            # the current layer and the one prefetched (every layer without reshard_after_forward); no
            # reduce-scatter input yet: the top layer's is made in its post-backward (_fsdp_inner_moments)
            unsharded = root + (layers_all if not raf else min(2, n_layers) * layer)
        elif m.name in (MomentName.BACKWARD_BOTTOM_BLOCK, MomentName.BACKWARD_BOTTOM_SOFTMAX):
            # the layers above are resharded by their post-backward, whatever reshard_after_forward says
            unsharded = root + bottom_held * layer
            comm = rs_bottom
        elif m.name is MomentName.BACKWARD_EMBEDDING:
            # The head's waiting gradient is ``q.grad_head`` below (a tied table's: states.tied_gradient_sum,
            # whose out-of-place sum stays in the temporaries); not the moment's own count of it as well.
            c[Component.LOGITS_LOSS] = 0
            # Inside the root's post-backward: the root is resharded, its gradients are being reduced.
            # Copy-in done, the token table's bf16 gradient is freed and the root's sharded gradients are
            # allocated (the LM head's bf16 gradient is still referenced): the later of the two moments is
            # worse when the root's shards outweigh the table's gradient (small W).
            post_temp = q.grad_head + max(0, q.grad_late - root_shard_grads)
            post_grads = root_shard_grads if q.grad_late > root_shard_grads else 0
            # Accumulating, the root's sharded gradients exist already: its reduce output is a new tensor beside
            # them (added into them, then freed; under HSDP held, the same bytes), made after the late ones go.
            resident = root_shard_grads if q.grads_resident else 0
            if resident:
                post_temp, post_grads = q.grad_head + max(q.grad_late, root_shard_grads), 0
            # Or the embedding's own backward, before that: the root still unsharded, the last layer's
            # reduce-scatter input still in flight (one kept: ``reduce_scatter_max_input_buffers`` = 1,
            # _fsdp_param_group.py ``post_backward``), the table's gradient just computed (under TP whole,
            # with its Shard(0) copy: ``table_copy``), the root's shards not yet made.
            # A tied table's out-of-place sum (states.tied_gradient_sum) beside both its inputs: the one-GPU
            # moment files it as the table's .grad, which the root's shards replace here; with accumulation it
            # is already in the moment's temporaries (traces: tests/trace/test_tied_many_gpus.py).
            tied = tied_gradient_sum(q.spec, q.strategy) if q.grad_head and not q.grads_resident else None
            during_temp = q.grad_head + q.grad_late + table_copy + (tied.out_of_place_bytes if tied else 0)
            # Or the copy-in itself: the root's fp32 reduce-scatter input made while the bf16 gradients it copies
            # are still referenced (``post_backward`` holds ``unsharded_grads`` across ``foreach_reduce``), the
            # root's shards not yet made (the trace: llama-3.1-8b over 8 ranks with full recompute, 501 MiB more).
            copy_in = q.grad_head + q.grad_late
            # The moment's own temporaries (a tied table's embedding gradient, and accumulating its out-of-place
            # sum) are alive in the embedding's backward only: by the root's post-backward they are summed into the
            # table's gradient (the head's, ``q.grad_head``).
            during_temp += c[Component.TEMPORARIES]
            if no_sync and not offload:
                # The last micro-step: the root's accumulated gradients take this one's at its post-backward
                # (``accumulate_unsharded_grad_if_needed``, in place), are copied into its reduce-scatter input and
                # freed; its reduce output is its sharded gradients.
                c[Component.GRADIENTS] = no_sync_grads(n_layers)
                during = root + rs + during_temp
                copy_in_grads = rs_root + q.grad_head
                after = rs_root + q.grad_head + root_shard_grads - acc_root
                if during >= max(copy_in_grads, after):
                    unsharded, comm = root, rs
                    c[Component.TEMPORARIES] = during_temp
                else:
                    comm = rs_root
                    c[Component.TEMPORARIES] = q.grad_head + max(0, root_shard_grads - acc_root)
                    c[Component.GRADIENTS] -= min(acc_root, root_shard_grads) if after > copy_in_grads else 0
            elif offload:
                # CPUOffloadPolicy: no sharded gradient is on the device to subtract; the root's reduce output is
                # made after the table's gradient goes and dropped once copied to the host (_fsdp_collectives.py
                # ``foreach_reduce``: ``new_sharded_grad.to("cpu")``), the head's still referenced. The trace of
                # an 8b-shaped 4-layer llama over 8 ranks with full recompute peaks at the copy-in (the root's
                # shards subtracted from no gradients had put it 7.6% low).
                post_temp = max(copy_in, q.grad_head + root_shard_grads)
                if root + rs + during_temp > rs_root + post_temp:
                    unsharded, comm = root, rs
                    c[Component.TEMPORARIES] = during_temp
                else:
                    comm = rs_root
                    c[Component.TEMPORARIES] = post_temp
            else:
                if rs_root + copy_in - root_shard_grads + resident > rs_root + post_temp - post_grads:
                    post_temp, post_grads = copy_in, root_shard_grads - resident
                if root + rs + during_temp - root_shard_grads + resident > rs_root + post_temp - post_grads:
                    unsharded, comm = root, rs
                    c[Component.TEMPORARIES] = during_temp
                    c[Component.GRADIENTS] -= root_shard_grads - resident
                else:
                    comm = rs_root
                    c[Component.TEMPORARIES] = post_temp
                    c[Component.GRADIENTS] -= post_grads
        if m.name in (
            MomentName.BACKWARD_FINAL_NORM,
            MomentName.BACKWARD_TOP_BLOCK,
            MomentName.BACKWARD_TOP_SOFTMAX,
            MomentName.BACKWARD_BOTTOM_BLOCK,
            MomentName.BACKWARD_BOTTOM_SOFTMAX,
        ):
            # the LM head's bf16 gradient waits, unsharded, for the root's reduce-scatter at the end
            c[Component.TEMPORARIES] += q.grad_head
        if offload and m.phase is Phase.OPTIMIZER_STEP:
            c[Component.TEMPORARIES] = 0
        elif m.phase is Phase.OPTIMIZER_STEP:
            c[Component.TEMPORARIES] = st.step_temp_bytes
        if inner is not None:
            unsharded = root + inner[0] * layer
            comm = (rs_bottom if inner[2] == n_back - 1 else rs) if inner[1] else 0
        n_done = layers_done(m) if inner is None else inner[2]
        if hold and m.phase is Phase.BACKWARD:
            comm += layer_shard_grads * n_done
        if no_sync and m.phase is Phase.FORWARD:
            c[Component.GRADIENTS] = no_sync_grads(0)
        elif no_sync and m.phase is Phase.BACKWARD and m.name is not MomentName.BACKWARD_EMBEDDING:
            c[Component.GRADIENTS] = no_sync_grads(n_done)
        c[Component.UNSHARDED_PARAMS] = unsharded
        c[Component.COMM_BUFFERS] = comm
        return c

    host: dict[Component, int] = {}
    if offload:
        per_node = min(p.world, strategy.parallelism.gpus_per_node)
        host = {
            Component.WEIGHTS: (st.weights_bytes + st.adapter_bytes) * per_node,
            Component.GRADIENTS: st.grads_bytes * per_node,
            Component.OPTIMIZER_STATES: st.optimizer_bytes * per_node,
        }
    groups = (
        f"+ the table {fmt_gib(emb.unsharded)} and [final norm, head] {fmt_gib(tail.unsharded)} as units"
        + (f" + root {fmt_gib(root)}" if root else "")
        if untied
        else f"+ {'[final norm, head]' if wrap is FsdpWrap.UNITS else 'root'} {fmt_gib(root)}"
    )
    notes = [
        f"FSDP2 over {p.shard} ranks"
        + (f" (HSDP: replicated over {p.dp // p.shard} nodes)" if p.sharding is Sharding.HSDP else "")
        + f": {n_layers} layer groups of {fmt_gib(layer, 3)} {groups}, unsharded in "
        f"{'bf16' if cbits == 16 else 'fp32'}"
        + ("" if raf else "; reshard_after_forward=False keeps each layer unsharded until its post-backward"),
        _fsdp_wrap_note(held_spec, strategy, untied),
    ]
    if mixed:
        notes.append(
            "FSDP2 mixed precision: fp32 sharded parameters (the master weights), "
            f"{strategy.recipe.compute_dtype} compute, fp32 reductions; no autocast weight copies"
        )
    if offload:
        notes.append("CPUOffloadPolicy: shards, gradients and optimizer states in pinned host memory (per node)")
    if no_sync:
        notes.append(
            f"accelerate's no_sync between micro-steps (sync_each_batch=False, the HF Trainer's default): every "
            f"unsharded gradient held in the reduce dtype, {fmt_gib(acc_root + acc_layers)}, until the last "
            "micro-step reduce-scatters them"
        )
    if finetuning(strategy):
        notes.append(_fsdp_finetune_note(strategy, mixed))
    phases = _worst(q, adjust, host)
    inner = [
        adjust(m, (held, in_flight, n)) for m, held, in_flight, n in _fsdp_inner_moments(q, raf, n_back, dead=dead)
    ]
    if untied:
        inner.append(units(_fsdp_tail_post_moment(q), tail_post=True))
    # one rank alone keeps no all-gather output (``wait_for_unshard`` copies from the shards directly)
    copy_out = (
        [
            adjust(m) | {Component.UNSHARDED_PARAMS: through + held, Component.COMM_BUFFERS: comm}
            for m, held, comm in _fsdp_forward_moments(q, fg, raf, n_layers, untied=untied)
        ]
        if p.shard > 1
        else []
    )
    for phase, extra in ((Phase.BACKWARD, inner), (Phase.FORWARD, copy_out)):
        if not extra:
            continue
        now = next(ph for ph in phases if ph.phase is phase)
        worst = max(extra, key=lambda c: sum(c.values()))
        if sum(worst.values()) > now.total_bytes:
            new = PhaseBreakdown(phase=phase, components=_full(worst), host_components=dict(host))
            phases = tuple(new if ph.phase is phase else ph for ph in phases)
    return phases, notes


def _fsdp_forward_moments(
    q: StepInputs, fg: FsdpGroups, raf: bool, n_layers: int, *, untied: bool = False
) -> list[tuple[Moment, int, int]]:
    """FSDP2's forward moments besides the single-GPU ones, as (the moment, the bytes unsharded then besides the
    root's (and the table's unit's, when not resharded), the all-gather outputs alive). In the forward FSDP2
    prefetches implicitly: ``wait_for_unshard`` keeps each group's flat all-gather output in
    ``comm_ctx.all_gather_state`` to free it after the *next* group's copy-out (_fsdp_param_group.py
    ``wait_for_unshard``, training state ``FORWARD``). It drops that state before copying out, but through the local
    ``prev_all_gather_state`` bound by its walrus test, which holds it until the method returns: during a layer's
    copy-out (``foreach_all_gather_copy_out``: ``split_with_sizes_copy`` into the parameters' own
    ``all_gather_outputs``, _fsdp_collectives.py) the previous group's all-gather output, this layer's and this
    layer's unsharded parameters are all alive. The worst such moment is the top layer's (every layer below has
    saved its tensors, or its checkpoint input) or the bottom layer's, whose previous group is the root, whose
    all-gather output (embeddings, head) can outweigh a layer's. The trace: llama-3.1-70b over 64 ranks, full
    recompute, the forward's peak is the top layer's copy-out (2 × 1.59 GiB of all-gather outputs and its 1.59 GiB
    of unsharded parameters over the 80 kept inputs).

    ``untied`` (``--fsdp-wrap units``, an untied table): the bottom layer's previous group is the table's unit, and
    [final norm, head]'s copy-out, over every layer's saved tensors and the top layer's output, has the top layer's
    all-gather output beside its own."""
    a = q.stack
    s = q.strategy
    base = forward_moments(q)[0]
    # the hidden states entering a layer (the embedding's output for the bottom one): not yet saved by it
    entering = Widths.of(s).residual * s.tokens_per_micro_batch * q.spec.hidden_size
    below = a.embedding_bytes + q.masks
    ag = fg.all_gather_bytes

    def at(activations: int) -> Moment:
        return dataclasses.replace(base, activations=activations, autocast_copies=0, logits_loss=0, temporaries=0)

    # the bottom layer: only the root and itself unsharded, whatever reshard_after_forward says
    out = [
        (at(below + entering), fg.layer_bytes, (fg.embedding.all_gather if untied else fg.root_all_gather_bytes) + ag)
    ]
    if untied:
        kept = a.all_layers_bytes if q.segments == 0 else q.kept_inputs
        every = 0 if raf else fg.layers_all_bytes
        out.append((at(below + kept + entering), every + fg.tail.unsharded, ag + fg.tail.all_gather))
    if n_layers >= 2:
        if q.segments == 0:
            saved = a.all_layers_bytes - a.max_layer_bytes + entering
        else:  # the kept inputs include the top's; inside a segment of several layers its input is a transient
            saved = q.kept_inputs + (entering if q.segment_layers > 1 else 0)
        # without reshard_after_forward every layer below stays unsharded (the step's first forward after a
        # backward that resharded them all: each is unsharded again in its own forward)
        out.append((at(below + saved), fg.layer_bytes if raf else fg.layers_all_bytes, 2 * ag))
    return out


def _fsdp_tail_post_moment(q: StepInputs) -> Moment:
    """``--fsdp-wrap units`` with an untied table: [final norm, head]'s post-backward, right after the final norm's
    backward — the single-GPU final-norm moment without the norm's saved tensors and temporaries (what this rank
    holds then: :func:`_fsdp`'s ``units``)."""
    m = next(x for x in backward_moments(q) if x.name is MomentName.BACKWARD_FINAL_NORM)
    a = q.stack
    norm_saved = a.model_bytes - a.head_input_bytes - a.embedding_bytes
    return dataclasses.replace(m, activations=max(0, m.activations - norm_saved), temporaries=0, logits_loss=0)


def _fsdp_inner_moments(
    q: StepInputs, raf: bool, n_layers: int, *, dead: int = 0
) -> list[tuple[Moment, int, bool, int]]:
    """FSDP2's backward moments besides the single-GPU ones, as (the single-GPU moment shifted, the layers
    unsharded then, whether a reduce-scatter input is held, the layers whose post-backward has made their reduce
    output). Per layer, top down (_fsdp_param_group.py
    ``pre_backward``, ``post_backward``; _fsdp_collectives.py ``foreach_reduce``): its pre-backward unshards it
    (a no-op without ``reshard_after_forward``: every layer stays unsharded from its forward) and prefetches the
    next; its backward (and, checkpointed, its recomputation: the recompute's pre-forward finds it unsharded,
    ``FSDPState._pre_forward`` in ``PRE_BACKWARD``) runs with the previous layer's fp32 reduce-scatter input in
    flight (``reduce_scatter_max_input_buffers`` = 1) and ends holding all its bf16 weight gradients; its
    post-backward reshards it whatever ``reshard_after_forward`` says (``reshard_after_backward``), frees the
    previous input, makes its own and copies the gradients in. Going down one layer, the rank gains one layer's
    sharded gradients and loses the layer above's checkpoint input (or saved tensors) and, without
    ``reshard_after_forward``, one unsharded layer: linear between the ends, so the moments are taken at the
    layers next to the ends — the top, the layer below it, the one above the bottom, the bottom — each inside its
    backward (the single-GPU moment) and inside its norms' backward (:func:`_fsdp_norm_moments`: its bf16
    gradients held, itself still unsharded: for large layers and short sequences the worse), plus the top
    layer's post-backward (resharded, its reduce-scatter input made). At W = 2 the fp32 shard of a layer's
    gradients (4/2 bytes per element) weighs as much as the bf16 layer: without ``reshard_after_forward`` and
    with recompute the layer below the top is the backward's worst moment.

    Checkpointed segments of several layers (``sqrt``) are entered at their top layer: there only the top's
    moments and the layer below the top are shifted (by one layer's recomputed tensors).

    ``n_layers``: the layers that run a backward; ``dead`` more below them run none (``--freeze``,
    :class:`~trainfit.analytic.adapters.FrozenLayers`) and stay unsharded from their forward without
    ``reshard_after_forward`` (the root's final callback reshards them), the one below the bottom prefetched with it."""
    if n_layers < 1 or n_layers + dead < 2:
        return []
    a = q.stack
    one_segment = q.segments > 0 and q.segment_layers == 1
    # What one layer's backward releases for good: its checkpoint input (full, sac: with its kept outputs) or its
    # saved tensors (no or selective recompute; inside a segment, one layer's recomputed tensors).
    released = q.kept_inputs // q.segments if one_segment else a.max_layer_bytes
    # What the current layer holds only during its backward: its recomputed tensors, or its saved ones.
    own = q.segment_layers * a.max_layer_bytes if q.segments else a.max_layer_bytes
    seg = q.segment_layers if q.segments else 1
    top_held = min(2, n_layers) if raf else n_layers + dead
    bottom_held = (min(seg, 2) if raf else seg) + (1 if raf else dead) * bool(dead)
    tops = (MomentName.BACKWARD_TOP_BLOCK, MomentName.BACKWARD_TOP_SOFTMAX)
    bottoms = (MomentName.BACKWARD_BOTTOM_BLOCK, MomentName.BACKWARD_BOTTOM_SOFTMAX)
    inside: list[tuple[Moment, int, bool, int]] = []
    out: list[tuple[Moment, int, bool, int]] = []
    for m in backward_moments(q):
        if m.name is MomentName.BACKWARD_TOP_BLOCK:
            inside.append((m, top_held, False, 0))
            post = dataclasses.replace(
                m,
                activations=max(0, m.activations - own - (released if one_segment else 0)),
                temporaries=q.grad_layer,  # the layer's bf16 gradients, copied into the reduce-scatter input
            )
            out.append((post, top_held - 1, True, 0))  # before its reduce output
        elif m.name is MomentName.BACKWARD_BOTTOM_BLOCK and n_layers > 1:  # one layer: the top's moments
            inside.append((m, bottom_held, True, n_layers - 1))
        if n_layers < 3:
            continue
        if m.name in tops:
            below_top = dataclasses.replace(
                m, gradients=m.gradients + q.grad_layer, activations=max(0, m.activations - released)
            )
            inside.append((below_top, 2 if raf else n_layers - 1, True, 1))
        elif m.name in bottoms and (q.segments == 0 or one_segment):
            above_bottom = dataclasses.replace(
                m, gradients=max(q.grads_resident, m.gradients - q.grad_layer), activations=m.activations + released
            )
            inside.append((above_bottom, 2, True, n_layers - 2))
    for m, held, in_flight, done in inside:
        out += [(m, held, in_flight, done), *((n, held, in_flight, done) for n in _fsdp_norm_moments(q, m, own))]
    return out


def _fsdp_norm_moments(q: StepInputs, m: Moment, own: int) -> list[Moment]:
    """A layer's last moments inside its own backward, from the moment ``m`` inside it (``own``: what the layer
    holds only during its backward, its recomputed or saved tensors): FSDP2 takes a layer's unsharded gradients
    only in its post-backward, which ``RegisterPostBackwardFunction`` on the layer's *inputs* runs once their
    gradient exists, after the whole layer's backward (_fsdp_param_group.py ``_register_post_backward_hook``,
    ``post_backward``: ``unsharded_param.grad`` into ``unsharded_grads`` for ``foreach_reduce``). So each bf16
    weight gradient of the layer is held, unsharded, from its matmul's backward to the end of the layer, and its
    norms back-propagate over them in fp32 (HF RMSNorm: the single-GPU final-norm temporaries,
    :func:`~trainfit.analytic.activations.backward_temp_bytes`), with the incoming residual gradient (one
    residual-width ``t·h`` tensor that autograd's input buffer accumulates in place at each residual add,
    torch/csrc/autograd/input_buffer.cpp ``InputBuffer::add``: alive from the final norm's backward to the
    embedding's). Two moments: inside the post-attention norm's backward (the MLP's gradients held, its saved
    tensors released, the attention's still saved) and inside the input norm's (every gradient of the layer held,
    only that norm's saved tensors left). The trace: llama-3.1-70b over 64 ranks with full recompute peaks in the
    input norm's backward (1.59 GiB of bf16 gradients, 0.38 GiB of norm tensors) — the layer's end without its
    norm was 1.13% low; a narrow attention under a wide MLP peaks in the post-attention norm's."""
    s = q.strategy
    v = next(v for v in q.stack.variants if v.kind == q.stack.top_kind)
    terms = layer_terms(v.spec, s, moe=v.kind == "moe")
    norm1 = sum(x.bytes for x in terms if x.name.startswith("norm1."))
    mlp_saved = sum(x.bytes for x in terms if x.role is TermRole.MLP)
    residual = Widths.of(s).residual * s.tokens_per_micro_batch * q.spec.hidden_size
    rest = max(0, m.activations - own)  # the layer's own tensors released
    input_norm = dataclasses.replace(m, activations=rest + norm1, temporaries=q.grad_layer + q.norm_temp + residual)
    post_attention = dataclasses.replace(
        m,
        activations=rest + max(0, q.stack.max_layer_bytes - mlp_saved),
        temporaries=_mlp_grad_bytes(q) + q.norm_temp + residual,
    )
    return [input_norm, post_attention]


def _mlp_grad_bytes(q: StepInputs) -> int:
    """One layer's trainable MLP gradients in their own dtype (the largest layer kind): its ``mlp.*`` tensors and
    the adapters on its MLP linears (named after the linear, ``gate_proj.lora_A.weight``)."""
    inv = inventory(q.spec)
    gb = q.strategy.recipe.grad_bits
    states = param_states(q.spec, q.strategy)
    best = 0
    for g in inv.layers:
        linears = {t.name.split(".")[1] for t in g.tensors if t.name.startswith("mlp.")}
        own = {id(t) for t in g.tensors}
        n = 0
        for x in states:
            mlp = x.tensor.name.startswith("mlp.") if id(x.tensor) in own else x.tensor.name.split(".")[0] in linears
            if x.trainable and mlp and (id(x.tensor) in own or x.adapter):
                n += _alloc(x.tensor.numel, x.bits or gb)
        best = max(best, n)
    return best


def _fsdp_wrap_note(spec: ModelSpec, strategy: Strategy, untied: bool) -> str:
    if strategy.engine.fsdp_wrap is FsdpWrap.AUTO and resolved_fsdp_wrap(spec, strategy) is FsdpWrap.ROOT:
        return (
            "wrapping modelled: each decoder layer, then the root holding the embeddings, final norm and head; "
            "torchtitan and accelerate 1.15 also shard the token embedding and [final norm, head] as units of their "
            f"own, which the analytic model does not have with {units_unmodelled(spec, strategy)} "
            "(--fsdp-wrap units --method trace traces it)"
        )
    if resolved_fsdp_wrap(spec, strategy) is FsdpWrap.ROOT:
        return (
            "wrapping modelled: each decoder layer, then the root holding the embeddings, final norm and head "
            "(accelerate before 1.15); torchtitan and accelerate 1.15 (PR #4015) also shard the token embedding and "
            "[final norm, head] as units of their own (--fsdp-wrap units): with an untied table, ~5% lower on "
            "llama-3.1-8b over 8 ranks"
        )
    if untied:
        return (
            "wrapping modelled: each decoder layer, the token embedding and [final norm, head] as units of their own, "
            "then the root (torchtitan's apply_fsdp, accelerate 1.15's fsdp2_prepare_model): the table resharded "
            "after its forward, [final norm, head] kept to its backward and its gradients reduce-scattered right after "
            "it"
        )
    return (
        "wrapping modelled: each decoder layer, then [final norm, head] holding the tied table (torchtitan, accelerate "
        "1.15): unsharded from the embedding's forward to the end of backward, as the root would be"
    )


def _fsdp_finetune_note(strategy: Strategy, mixed: bool) -> str:
    note = (
        "fine-tuning under FSDP2: every parameter, frozen or not, is sharded and all-gathered; only the trainable "
        "ones have sharded gradients, reduce-scatters and optimizer states"
    )
    if mixed and strategy.adapter is not None:
        note += (
            f"; the policy's param_dtype casts the {strategy.adapter.dtype.value} adapters to "
            f"{strategy.recipe.compute_dtype} for compute (their shards stay {strategy.adapter.dtype.value})"
        )
    if strategy.base_weights.quantization is not Quantization.NONE:
        note += (
            "; 4-bit weights as packed bf16 storage (bnb_4bit_quant_storage=bf16, sharded like any tensor), their "
            "quant state whole on every rank"
        )
    return note


# -- DeepSpeed ZeRO --------------------------------------------------------------------------------------


def deepspeed_partition_numel(spec: ModelSpec, stage: int, dp: int) -> tuple[int, int]:
    """(elements a rank's partition holds, elements kept whole on every rank). Stages 1–2: one flat buffer
    padded to a multiple of 2·dp, split evenly (stage_1_and_2.py); stage 3: each parameter padded to a
    multiple of dp, parameters of at most the persistence threshold kept whole as well (partition_parameters.py
    ``_convert_to_deepspeed_param``: ``ds_numel <= param_persistence_threshold``)."""
    inv = inventory(spec)
    total = inv.total
    if stage < 3:
        align = DS_ALIGNMENT_FACTOR * dp
        return -(-total // align) * align // dp, 0
    part, whole = _stage3_numel(inv.all_tensors(), dp)
    return part, whole if dp > 1 else 0  # one rank: a persistent parameter's data is its partition


@dataclass(frozen=True, slots=True, kw_only=True)
class ZeroPartition:
    """What a ZeRO rank holds, in elements: the 16-bit parameters (``weights_numel`` as one flat buffer
    plus ``frozen_tensors`` kept as their own tensors), and the partition of the trainable parameters
    that carries the gradients, fp32 master weights and optimizer states."""

    trainable_numel: int  # every trainable element (the flat 16-bit groups of stages 1–2)
    part_numel: int  # this rank's partition of them
    trainable_tensors: tuple[tuple[ParamTensor, int], ...]
    frozen_tensors: tuple[tuple[ParamTensor, int], ...]  # stages 1–2: frozen tensors outside the flat groups
    stage3_part_numel: int = 0  # stage 3: every parameter's partition (frozen and persistent ones too)
    stage3_whole_numel: int = 0  # stage 3: parameters under the persistence threshold, whole on every rank
    stage3_whole_tensors: tuple[tuple[ParamTensor, int], ...] = ()  # stage 3: those tensors


def zero_partition(spec: ModelSpec, strategy: Strategy, stage: int, dp: int) -> ZeroPartition:
    """Fine-tuning under ZeRO: the flat 16-bit groups and the fp32 partitions hold only the trainable
    parameters (stage_1_and_2.py and stage3.py keep ``is_optimized_parameter``: ``requires_grad``); the engine
    casts every parameter, frozen or not, to the 16-bit dtype (engine.py ``_cast_module_mixed_precision``);
    stage 3 partitions every parameter, frozen or not (partition_parameters.py ``_partition_param``), and a
    parameter under the persistence threshold is kept whole besides its partition, which still carries its
    fp32 master and optimizer states (``ds_tensor``). Full fine-tuning is the case where all train."""
    held = held_tensors(spec, strategy)
    trainable = tuple((h.tensor, h.count) for h in held if h.trainable)
    frozen = tuple((h.tensor, h.count) for h in held if not h.trainable)
    n_train = sum(t.numel * m for t, m in trainable)
    if stage < 3:
        align = DS_ALIGNMENT_FACTOR * dp
        part = -(-n_train // align) * align // dp
        return ZeroPartition(
            trainable_numel=n_train, part_numel=part, trainable_tensors=trainable, frozen_tensors=frozen
        )
    s3_part, s3_whole = _stage3_numel([*trainable, *frozen], dp)
    full = not finetuning(strategy)
    # A persistent parameter keeps its partition too (``ds_tensor``): the flat 16-bit buffer, the gradient
    # partition and the fp32 partition count every parameter's ``partition_numel()`` (stage3.py
    # ``_create_fp16_partitions_with_defragmentation``, ``_setup_for_real_optimizer``).
    part = s3_part if full else sum(m * -(-t.numel // dp) for t, m in trainable)
    # One rank: a persistent parameter's data is its partition (``NoGatherHandle`` points ``param.data`` at
    # ``ds_tensor``), no second copy — unless ZeRO-Infinity keeps the partitions on the host
    whole_kept = dp > 1 or strategy.offload.parameters_on_host
    return ZeroPartition(
        trainable_numel=n_train,
        part_numel=part,
        trainable_tensors=trainable,
        frozen_tensors=(),
        stage3_part_numel=s3_part,
        stage3_whole_numel=s3_whole if whole_kept else 0,
        stage3_whole_tensors=tuple(
            (t, m) for t, m in [*trainable, *frozen] if whole_kept and t.numel <= DS_PERSISTENCE_THRESHOLD
        ),
    )


def _stage3_numel(tensors: Sequence[tuple[ParamTensor, int]], dp: int) -> tuple[int, int]:
    part = whole = 0
    for t, m in tensors:
        part += m * -(-t.numel // dp)
        if t.numel <= DS_PERSISTENCE_THRESHOLD:
            whole += m * t.numel
    return part, whole


def zero3_frozen_partitions(spec: ModelSpec, strategy: Strategy, dp: int) -> list[tuple[int, bool]]:
    """Stage 3 fine-tuning: (elements, persistent?) of each frozen parameter's own partition (``ds_tensor``, no part of
    the optimizer's flat buffer: partition_parameters.py ``_partition_param``), one per instance. It is made on the
    ``remote_device``: the device, or with ``offload_param`` the host (parameter_offload.py
    ``_convert_to_zero_parameters`` passes ``remote_device=self.offload_device``) — except a persistent parameter's
    (at most the persistence threshold), which stays on the device (``ds_persist`` → ``local_device``)."""
    if not finetuning(strategy):
        return []
    return [
        (-(-h.tensor.numel // dp), h.tensor.numel <= DS_PERSISTENCE_THRESHOLD)
        for h in held_tensors(spec, strategy)
        if not h.trainable
        for _ in range(h.count)
    ]


def deepspeed_flat_layout(spec: ModelSpec, strategy: Strategy | None = None) -> list[tuple[int | None, ParamTensor]]:
    """(layer, or None for a model-level tensor; the tensor) of each parameter of stages 1–2's flat buffer, in its
    order: ``model.parameters()`` order (embeddings, the layers, the final norm and head), which is that of
    ``reduce_gradients`` too. Fine-tuning (``strategy``): the trainable ones only, which are the optimizer's (the
    flat groups hold nothing else) — each layer's unfrozen tensors under ``--freeze``, or each layer's adapters (an
    MoE router's or expert stack's in the MoE layers only)."""
    inv = inventory(spec)
    out: list[tuple[int | None, ParamTensor]] = []
    if strategy is None or not finetuning(strategy):
        out += [(None, t) for t in inv.model_tensors if t.name.startswith("embed")]
        layer = 0
        for g in inv.layers:
            for _ in range(g.count):
                out += [(layer, t) for t in g.tensors]
                layer += 1
        out += [(None, t) for t in inv.model_tensors if not t.name.startswith("embed")]
        return out
    held = held_tensors(spec, strategy)
    model = [h.tensor for h in held if h.root and h.trainable]
    adapter, patterns = strategy.adapter, strategy.base_weights.frozen
    adapters = [h.tensor for h in held if h.adapter and not h.root]
    moe = set(moe_tensors(spec, adapter)) if adapter is not None else set()
    out += [(None, t) for t in model if t.name.startswith("embed")]
    layer = 0
    for g in inv.layers:
        for _ in range(g.count):
            if adapter is None:
                out += [(layer, t) for t in g.tensors if not is_frozen(t, patterns, layer, layers=spec.num_layers)]
            else:
                out += [(layer, t) for t in adapters if g.kind != "dense" or t not in moe]
            layer += 1
    out += [(None, t) for t in model if not t.name.startswith("embed")]
    return out


def _flat_order(spec: ModelSpec, strategy: Strategy | None = None) -> Iterator[ParamTensor]:
    """The tensors of :func:`deepspeed_flat_layout`, in order."""
    return (t for _, t in deepspeed_flat_layout(spec, strategy))


def deepspeed_flatten_copies(contents: Sequence[tuple[int, int]], part: int, bucket_numel: int) -> list[int]:
    """Elements of each copy DeepSpeed stages 1–2 make to reduce a bucket holding ``contents`` ((flat offset,
    elements) of each gradient, in the order they entered it). ``average_tensor`` cuts them at the partitions'
    edges (``part`` elements each), merging consecutive pieces of one partition into one range, and hands the ranges
    to ``allreduce_and_scatter`` (``use_multi_rank_bucket_allreduce``, the default), which gathers ranges until they
    pass ``reduce_bucket_size`` and flattens each group for the collective (``allreduce_bucket``:
    ``self.flatten(bucket)``, freed when it returns): a new tensor (``torch.cat``) for two ranges or more, a view for
    one (torch/csrc/utils/tensor_flatten.h ``flatten_dense_tensors``). So only a reduction across a partition edge
    copies: at llama-2-7b over 8 ranks with the default bucket, seven copies of ~940 MiB per step."""
    ranges: list[tuple[int, int]] = []  # (partition, elements)
    for off, n in contents:
        while n > 0:
            piece = min(n, part - off % part)
            if ranges and ranges[-1][0] == off // part:
                ranges[-1] = (ranges[-1][0], ranges[-1][1] + piece)
            else:
                ranges.append((off // part, piece))
            off, n = off + piece, n - piece
    copies: list[int] = []
    count = total = 0  # ranges and elements in the group being gathered
    for _, n in ranges:
        count, total = count + 1, total + n
        if total > bucket_numel:
            copies += [total] if count > 1 else []
            count = total = 0
    return [*copies, total] if count > 1 else copies


def _layout_of(strategy: Strategy | None) -> Strategy | None:
    """The strategy that decides the flat layout: a fine-tuning one (its trainable tensors); None for full training,
    whatever the strategy (every tensor), so that memo keys do not split on batch sizes."""
    return strategy if strategy is not None and finetuning(strategy) else None


#: The flat layouts and reductions of recent (spec, layout strategy[, bucket]): each rank, the closed form and the
#: stream ask for them again.
_MADE: Memo[tuple[tuple[int, int, int], ...]] = Memo(64)
_REDUCTIONS: Memo[tuple[tuple[int, ...], tuple[int, ...]]] = Memo(64)


def deepspeed_made_order(spec: ModelSpec, strategy: Strategy | None = None) -> tuple[tuple[int, int, int], ...]:
    """(flat offset, elements, backward position) of each parameter of :func:`deepspeed_flat_layout`, in flat order.
    The backward position orders when the gradient hooks take a gradient: 0 for the head side's (the untied LM head's
    and the final norm's — an ``AccumulateGrad`` node runs as soon as it is ready, before any other ready node:
    torch/csrc/autograd/engine.cpp ``CompareNodeTaskTime`` orders by sequence number, and an ``AccumulateGrad``'s is
    UINT64_MAX; the traced engine reduces a waiting head at the final norm's hook, before the top layer's
    recomputation), ``1 + (L − 1 − j)`` = ``L − j`` for layer ``j``'s, ``L + 1`` for the embeddings' (the token
    table's at the end of backward; a tied table's after autograd's sum, ``RankHooks.defers_tied_table``):
    :func:`~trainfit.analytic.events.early_model_grad`."""
    from trainfit.analytic.events import early_model_grad

    layout = _layout_of(strategy)

    def compute() -> tuple[tuple[int, int, int], ...]:
        n = spec.num_layers
        out: list[tuple[int, int, int]] = []
        offset = 0
        for layer, t in deepspeed_flat_layout(spec, layout):
            model_level = 0 if early_model_grad(spec, t) and not t.name.startswith("embed") else n + 1
            out.append((offset, t.numel, model_level if layer is None else n - layer))
            offset += t.numel
        return tuple(out)

    return _MADE.get((spec_key(spec), layout), compute)


@dataclass(frozen=True, slots=True)
class ZeroRank:
    """Stages 1–2: what data-parallel rank ``rank``'s partition ``[lo, lo + part)`` of the flat 16-bit buffer meets.
    Every partition has the same size, but what a rank holds besides depends on where its edges fall: the gradient
    buffer ``grads_in_partition`` holds whole every parameter the partition meets (stage_1_and_2.py
    ``copy_grads_in_partition``: ``total_size`` sums ``numel()`` over ``params_in_partition``) and is made at the
    first reduction of the IPG bucket that holds one of their gradients — near the start of backward for the rank of
    the LM head, after it for rank 0's token table; the step's norm reads each slice in fp64
    (``get_grad_norm_direct``) and flattens the slices (a view when there is one)."""

    rank: int
    lo: int
    part: int
    #: (flat offset, elements, elements inside the partition, the reduction that takes its gradient) of each parameter
    #: the partition meets, in flat order (:func:`deepspeed_reductions`)
    slices: tuple[tuple[int, int, int, int], ...]
    padded: bool  # the partition runs past the flat buffer's end (the last rank's, zero-padded)
    positions: tuple[int, ...]  # the backward position of each reduction (:func:`deepspeed_reductions`)

    @property
    def whole_numel(self) -> int:
        """Elements of every parameter the partition meets (``grads_in_partition``'s size)."""
        return sum(n for _, n, _, _ in self.slices)

    @property
    def largest_slice(self) -> int:
        """Elements of the largest slice (the norm's fp64 copy, one slice at a time)."""
        return max((k for _, _, k, _ in self.slices), default=0)

    @property
    def largest_owner(self) -> tuple[int, int]:
        """(elements, the reduction that takes its gradient) of the parameter with the largest slice (the first of
        equals)."""
        if not self.slices:
            return 0, 0
        _, n, _, f = max(self.slices, key=lambda s: s[2])
        return n, f

    @property
    def buffer_flush(self) -> int:
        """The first reduction that copies a gradient of the partition's parameters (the one that makes
        ``grads_in_partition``)."""
        return min((f for _, _, _, f in self.slices), default=0)

    @property
    def buffer_at(self) -> int:
        """The backward position of :attr:`buffer_flush`."""
        return self.positions[self.buffer_flush] if self.positions else 0

    @property
    def step_copies(self) -> bool:
        """Whether the step's ``self.flatten(self.averaged_gradients[i])`` (stage_1_and_2.py ``step``) makes a new
        flat partition. ``_flatten_dense_tensors`` of one tensor returns a view of it
        (torch/csrc/utils/tensor_flatten.h ``flatten_dense_tensors``: ``tensors.size() == 1``, no ``cat``): a
        partition inside one parameter (a token table wider than it) copies nothing. ``get_flat_partition`` appends
        a zero tensor for the padding of the last partition, which then always copies."""
        return len(self.slices) + self.padded > 1


def deepspeed_reductions(
    spec: ModelSpec, bucket_numel: int, strategy: Strategy | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Stages 1–2 (stage 2, and stage 1 with ``overlap_comm``): (the reduction that takes each parameter's gradient,
    in flat order; the backward position, :func:`deepspeed_made_order`, of each reduction, in the order they happen,
    the epilogue's last). The hooks take gradients in the order
    autograd makes them — the reverse of the flat order, layer by layer from the top, the token table last — into
    the IPG bucket; one that would overflow it first reduces what it holds (stage_1_and_2.py
    ``reduce_independent_p_g_buckets_and_remove_grads``), a gradient larger than the bucket waits for the next such
    reduction; what is left goes in the epilogue after backward (position ``L + 2``). The order: by backward position,
    each layer's gradients in reverse flat order, the late model-level ones in model order (the stream's,
    ``events.synthesise``), a tied table's after them all (after autograd's sum)."""
    layout = _layout_of(strategy)
    return _REDUCTIONS.get((spec_key(spec), layout, bucket_numel), lambda: _reductions(spec, bucket_numel, layout))


def _reductions(
    spec: ModelSpec, bucket_numel: int, strategy: Strategy | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    order = deepspeed_made_order(spec, strategy)
    n_layers = spec.num_layers
    flush = [0] * len(order)
    positions: list[int] = []
    contents: list[int] = []
    elements = 0
    for i in _hook_order(spec, strategy):
        _, n, made = order[i]
        if elements + n > bucket_numel:
            for k in contents:
                flush[k] = len(positions)
            positions.append(made)
            contents, elements = [], 0
        contents.append(i)
        elements += n
    for k in contents:
        flush[k] = len(positions)
    positions.append(n_layers + 2)  # the epilogue's
    return tuple(flush), tuple(positions)


def _hook_order(spec: ModelSpec, strategy: Strategy | None) -> list[int]:
    """The indices of :func:`deepspeed_made_order` in the order the gradient hooks take them
    (:func:`deepspeed_reductions`)."""
    order = deepspeed_made_order(spec, strategy)
    n_layers = spec.num_layers
    tied = spec.tie_word_embeddings

    def when(i: int) -> tuple[int, int]:
        made = order[i][2]
        if made <= n_layers:
            return made, -i
        return made, len(order) if tied and i == 0 else i  # (a tied table is the flat buffer's first tensor)

    return sorted(range(len(order)), key=when)


def deepspeed_reduction_copies(
    spec: ModelSpec, part: int, bucket_numel: int, strategy: Strategy | None = None
) -> tuple[int, ...]:
    """Stages 1–2 in backward: the elements of the largest copy each reduction of :func:`deepspeed_reductions` makes
    to reduce its bucket (:func:`deepspeed_flatten_copies`: only a bucket spanning a partition edge is copied; the
    same for every rank)."""
    order = deepspeed_made_order(spec, strategy)
    flush, positions = deepspeed_reductions(spec, bucket_numel, strategy)
    contents: list[list[tuple[int, int]]] = [[] for _ in positions]
    for i in _hook_order(spec, strategy):
        contents[flush[i]].append(order[i][:2])
    return tuple(max(deepspeed_flatten_copies(c, part, bucket_numel), default=0) for c in contents)


#: The ranks of recent (spec, strategy, partition, ranks, bucket): the closed form, the stream and the planner ask.
_RANKS: Memo[tuple[ZeroRank, ...]] = Memo(256)


def deepspeed_ranks(
    spec: ModelSpec, part: int, dp: int, bucket_numel: int, strategy: Strategy | None = None
) -> tuple[ZeroRank, ...]:
    """:class:`ZeroRank` of each of the ``dp`` ranks (flat order :func:`deepspeed_made_order`; fine-tuning with
    ``strategy``: the trainable tensors only, the optimizer's), memoized."""
    layout = _layout_of(strategy)
    return _RANKS.get(
        (spec_key(spec), layout, part, dp, bucket_numel), lambda: _deepspeed_ranks(spec, part, dp, bucket_numel, layout)
    )


def _deepspeed_ranks(
    spec: ModelSpec, part: int, dp: int, bucket_numel: int, strategy: Strategy | None
) -> tuple[ZeroRank, ...]:
    order = deepspeed_made_order(spec, strategy)
    flush, positions = deepspeed_reductions(spec, bucket_numel, strategy)
    total = sum(n for _, n, _ in order)
    out: list[ZeroRank] = []
    i = 0  # the first parameter that ends after the current rank's start
    for rank in range(dp):
        lo, hi = rank * part, (rank + 1) * part
        while i < len(order) and order[i][0] + order[i][1] <= lo:
            i += 1
        slices: list[tuple[int, int, int, int]] = []
        j = i
        while j < len(order) and order[j][0] < hi:
            off, n, _ = order[j]
            slices.append((off, n, min(off + n, hi) - max(off, lo), flush[j]))
            j += 1
        out.append(ZeroRank(rank=rank, lo=lo, part=part, slices=tuple(slices), padded=hi > total, positions=positions))
    return tuple(out)


def deepspeed_rank(
    spec: ModelSpec, part: int, bucket_numel: int, rank: int = 0, strategy: Strategy | None = None
) -> ZeroRank:
    """One rank's :class:`ZeroRank` (:func:`deepspeed_ranks`)."""
    return deepspeed_ranks(spec, part, rank + 1, bucket_numel, strategy)[rank]


#: ZeRO-1's flushes of recent (spec, partition, bucket, gradient bytes).
_FLUSHES: Memo[tuple[tuple[int, int, int, int], ...]] = Memo(64)


def _zero1_flushes(
    spec: ModelSpec, part: int, bucket_numel: int, grad_bytes: int
) -> tuple[tuple[int, int, int, int], ...]:
    """(first flat offset, end offset, gradient bytes live, the largest copy) of each flush of ZeRO-1's reduction
    (:func:`zero1_reduce_gradients`), the gradients still live counted before the flush frees the large ones."""

    def compute() -> tuple[tuple[int, int, int, int], ...]:
        tensors = list(_flat_order(spec))
        live = sum(allocator_bytes(t.numel * grad_bytes) for t in tensors)
        out: list[tuple[int, int, int, int]] = []
        contents: list[tuple[int, int]] = []
        pending: list[int] = []
        elements = offset = 0

        def flush() -> None:
            nonlocal live, contents, pending, elements
            copies = deepspeed_flatten_copies(contents, part, bucket_numel)
            copy = max((allocator_bytes(n * grad_bytes) for n in copies), default=0)
            start, end = (contents[0][0], sum(contents[-1])) if contents else (0, 0)
            out.append((start, end, live, copy))
            live -= sum(pending)
            contents, pending, elements = [], [], 0

        for t in tensors:
            if elements + t.numel > bucket_numel:
                flush()
            size = allocator_bytes(t.numel * grad_bytes)
            if t.numel <= bucket_numel:
                live -= size
            else:
                pending.append(size)
            contents.append((offset, t.numel))
            elements += t.numel
            offset += t.numel
        flush()  # the epilogue's (``overlapping_partition_gradients_reduce_epilogue``)
        return tuple(out)

    return _FLUSHES.get((spec_key(spec), part, bucket_numel, grad_bytes), compute)


def zero1_reduce_gradients(
    spec: ModelSpec, part: int, bucket_numel: int, grad_bytes: int, zr: ZeroRank | None = None
) -> tuple[int, int]:
    """ZeRO-1 without ``overlap_comm``, rank ``zr`` (None: rank 0): (gradient bytes, the flush's copy) at the worst
    moment of the reduction after backward (stage_1_and_2.py ``reduce_gradients`` →
    ``reduce_independent_p_g_buckets_and_remove_grads``, in flat order: each gradient no larger than the bucket is
    copied into it and freed; a larger one is reduced in place at the next flush and freed after it). Each flush first
    reduces the bucket, copying it when it spans a partition edge (:func:`deepspeed_flatten_copies`, beside the
    gradients still live); the first flush that meets the rank's partition then makes the buffer of the whole
    gradients it meets (``copy_grads_in_partition``), held from then on. Gradients are counted with ``grad_bytes``
    per element and the allocator's rounding per tensor.
    """
    zr = zr if zr is not None else deepspeed_rank(spec, part, bucket_numel)
    lo, hi = zr.lo, zr.lo + part
    buffer = allocator_bytes(zr.whole_numel * grad_bytes)
    worst = (0, 0)
    made = False
    for start, end, live, copy in _zero1_flushes(spec, part, bucket_numel, grad_bytes):
        worst = max(worst, (live + (buffer if made else 0), copy), key=sum)
        if not made and start < hi and end > lo:
            made = True
            worst = max(worst, (live + buffer, 0), key=sum)
    return worst


def zero1_offload_reduce(
    spec: ModelSpec, part: int, bucket_numel: int, grad_bytes: int, zr: ZeroRank
) -> tuple[int, int]:
    """ZeRO-1 without ``overlap_comm`` under ZeRO-Offload, rank ``zr``: (gradient bytes still live, the fp64 copy) at
    the worst slice's copy to the host. The reduction after backward walks the gradients in flat order as
    :func:`zero1_reduce_gradients` does, each flush copying the partition's slices of the bucket's gradients one by
    one, its norm in fp64 first (stage_1_and_2.py ``copy_grads_in_partition`` → ``set_norm_for_param_grad_in_gpu``):
    a slice late in the flat order meets fewer gradients still live (the last rank's LM head: the traced engine)."""
    flushes = _zero1_flushes(spec, part, bucket_numel, grad_bytes)
    best = (0, 0)
    for off, _, inside, _ in zr.slices:
        live = next((lv for start, end, lv, _ in flushes if start <= off < end), flushes[-1][2] if flushes else 0)
        best = max(best, (live, allocator_bytes(8 * inside)), key=sum)
    return best


def _zero12_weights_bytes(zp: ZeroPartition, pb: int) -> int:
    """ZeRO-1/2's 16-bit parameters, whole on every rank at every moment: the flat groups of the trainable ones
    and each frozen one (the engine casts all: ``zero_partition``)."""
    return allocator_bytes(zp.trainable_numel * pb) + sum(m * _alloc(t.numel, pb * 8) for t, m in zp.frozen_tensors)


def resident_floor_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """A cheap lower bound of :func:`estimate_parallel`'s allocated peak: what a rank holds at every moment of the
    closed form, where it is cheaper to know than the closed form — DeepSpeed ZeRO-1/2's whole 16-bit parameters
    (their closed form builds each distinct rank's phases, tens of milliseconds for a 70B model; the planner asks
    for hundreds of bounds, most of them of setups far over the GPU: ``planner.search.lower_bound_bytes``). 0
    elsewhere (no cheaper bound than the closed form). Raises what the closed form raises for a setup no
    framework runs (``plan``)."""
    strategy, _ = effective_strategy(spec, strategy)
    p = plan(spec, strategy)
    if p.engine is not Engine.DEEPSPEED or p.sharding is Sharding.ZERO3 or strategy.offload.parameters_on_host:
        return 0
    stage = int(strategy.sharding.value[-1])
    pb = 4 if strategy.recipe.compute_bits == 32 else 2
    return _zero12_weights_bytes(zero_partition(spec, strategy, stage, p.dp), pb)


def _deepspeed(
    spec: ModelSpec, strategy: Strategy, p: ParallelPlan
) -> tuple[tuple[PhaseBreakdown, ...], list[str], tuple[RankMemory, ...], ZeroRank | None]:
    """(the worst rank's phases, notes, each distinct rank's phases when they differ, the worst rank of stages 1–2:
    None at stage 3, whose ranks hold the same)."""
    fp32 = strategy.recipe.compute_bits == 32
    cs = compute_strategy(strategy)
    q = step_inputs(spec, cs, keep_logits=False)
    stage = int(strategy.sharding.value[-1])
    eo = strategy.engine
    pb = 4 if fp32 else 2  # parameter and gradient bytes
    inv = inventory(spec)
    zp = zero_partition(spec, strategy, stage, p.dp)
    total = zp.trainable_numel
    part, whole = zp.part_numel, zp.stage3_whole_numel
    off_opt, off_par = strategy.offload.optimizer_on_host, strategy.offload.parameters_on_host
    # The fp32 master partition, a copy even when the partition is fp32 already: stages 1–2 clone it
    # (stage_1_and_2.py ``__init__``: ``.detach().clone().to(device, dtype=master_weights_and_grads_dtype)``);
    # stage 3 would share an fp32 partition on its device (stage3.py ``_create_fp32_partitions``), but compares the
    # partition's ``torch.device`` with ``self.device``, a string (``current_device_name()``: 'cuda:0'), which is
    # never equal, and clones too (DeepSpeed 0.19.8). Without it fp32 ZeRO was 4.7% low against the traced engine.
    master = 4 * part
    opt_bits = 32
    optim = 2 * part * opt_bits // 8 if strategy.optimizer is Optimizer.ADAMW else 0
    client_states, client_temps = zero_client_step(strategy, part)
    if strategy.optimizer is not Optimizer.ADAMW:
        optim = sum(client_states)
    client_temp = sum(client_temps)
    weights_step = 0
    if stage < 3:
        weights = _zero12_weights_bytes(zp, pb)
    else:
        # The flat buffer of every parameter's partition (``lp_param_buffer``) and each persistent parameter
        # whole; the step partitions the persistent ones too and re-gathers them after it (stage3.py ``step``:
        # ``_partition_all_parameters`` ... ``_post_step``).
        weights = allocator_bytes(zp.stage3_part_numel * pb) + sum(
            m * _alloc(t.numel, pb * 8) for t, m in zp.stage3_whole_tensors
        )
        weights_step = allocator_bytes(zp.stage3_part_numel * pb)
    bucket = allocator_bytes(eo.reduce_bucket_size * pb)
    overlap = _overlap(strategy)
    fp32_grad = 0 if fp32 else allocator_bytes(part * 4)  # the step's fp32 gradient partition
    # Stage 3: the gradient partition flattened, then cast to fp32 (stage3.py ``_prepare_fp32_grad_for_sub_group``:
    # ``self.flatten(self.averaged_gradients[i]).to(fp32)``); stages 1–2: per rank (``rank_phases``)
    step_temp = allocator_bytes(part * pb) + fp32_grad
    zero1_path = stage == 1 and not overlap and not off_opt and not finetuning(strategy)
    fetch = None
    if stage == 3:  # the gathered parameters, replaying DeepSpeed's parameter coordinator (analytic/zero3.py)
        fetch = gathered_bytes(spec, strategy, p.dp, pb)
    g_full = max(1, q.states.grads_bytes)
    largest = max((t.numel for t, _m in zp.trainable_tensors), default=0)
    # ZeRO-Offload, stages 1–2: a 16-bit device buffer of the largest parameter, through which gradients are
    # staged for the host (stage_1_and_2.py ``__init__``: ``temp_grad_buffer_for_gpu_offload``), held all run.
    off_staging = allocator_bytes(largest * pb) if off_opt and stage < 3 else 0
    # ZeRO-Infinity keeps the persistent parameters whole on the device; only their partitions go to the host.
    # A frozen persistent parameter's own partition stays on the device too (zero3_frozen_partitions); the
    # optimizer's are in the host's flat buffer.
    whole_on_device = sum(m * _alloc(t.numel, pb * 8) for t, m in zp.stage3_whole_tensors) + sum(
        allocator_bytes(n * pb) for n, persist in zero3_frozen_partitions(spec, strategy, p.dp) if persist and p.dp > 1
    )  # (one rank: the persistent parameter's data is that partition, counted among the wholes)

    # Stage 1 under accumulation: a micro-step before the boundary reduces nothing, with or without overlap_comm
    # (stage_1_and_2.py ``reduce_ready_partitions_and_remove_grads``: only ``partition_gradients`` or the boundary),
    # so autograd's gradients stay whole and accumulate; the hooks' ``setup_buckets`` makes the bucket(s) at the
    # first gradient of the step's first micro-step, released only by the boundary's reduction
    # (``_release_ipg_buffers``): whole gradients and bucket(s) through every later micro-step, from its forward.
    # With ZeRO-Offload too (the traced engine: without it the closed form was −92% in a later forward with
    # DeepSpeed's default bucket, 1 GB, and −4.3% in the backward; tests/trace/test_deepspeed.py).
    zero1_accumulating = stage == 1 and strategy.grad_accum > 1
    # ZeRO-Offload, stages 1–2: each reduction copies the gradients of the partition's parameters to the host one by one
    # (stage_1_and_2.py ``copy_grads_in_partition``): the slice's norm in fp64 (``set_norm_for_param_grad_in_gpu``),
    # then the slice in fp32 for the copy (``async_inplace_copy_grad_to_fp32_buffer_from_gpu``), each dropped before
    # the next. Rank 0's largest slice is reduced at the flush of its parameter's gradient — the token table's, the
    # last one backward makes (model order) — with the bucket, and that gradient itself when it is larger than the
    # bucket (``extra_large_param_to_reduce``, kept until the flush): the end of backward, every activation gone.
    offload_reduce = stage < 3 and off_opt and not finetuning(strategy)
    # Stage 1's hooks clear no gradient (stage 2's ``clear_grad_attribute`` is for ``partition_gradients``): one
    # larger than the bucket, of a parameter outside the rank's partition, keeps its own storage from its reduction
    # to the epilogue's ``_clear_param_grad_only`` — the untied LM head's, made first, through the whole backward
    # (the traced engine with overlap_comm: −12% without it on a one-row cell)
    n_layers = spec.num_layers
    backward = {m.name: m for m in _moments(q)[Phase.BACKWARD]}

    # The backward position (:func:`deepspeed_made_order`) whose gradients exist at each moment (−1: before backward
    # makes any; the middle block's is its layer's, an entry moment's its reduction's: ``rank_phases``)
    made_at = {
        MomentName.BACKWARD_FINAL_NORM: 0,
        MomentName.BACKWARD_TOP_BLOCK: 1,
        MomentName.BACKWARD_TOP_SOFTMAX: 1,
        MomentName.BACKWARD_TOP_RECOMPUTE: 1,
        MomentName.BACKWARD_BOTTOM_BLOCK: n_layers,
        MomentName.BACKWARD_BOTTOM_SOFTMAX: n_layers,
        MomentName.BACKWARD_BOTTOM_RECOMPUTE: n_layers,
        MomentName.BACKWARD_EMBEDDING: n_layers + 1,
        MomentName.BACKWARD_REDUCE: n_layers + 2,
        MomentName.OPTIMIZER_STEP: n_layers + 2,
    }

    def layer_moment(made: int, *, entry: bool) -> Moment | None:
        """The backward of the layer at backward position ``made`` (1 … L): inside it (``entry`` False; only for a
        layer neither the top nor the bottom one, whose moments exist) or as it begins (``entry``: every tensor it
        saved still there, none of its transients — where a reduction its first gradients set off falls; the stream
        makes a layer's gradients before its transients, rank_events). A middle layer's activations, copies and
        transients lie between the top and bottom blocks' by the layers still saved below it (uniform layers)."""
        norm = backward.get(MomentName.BACKWARD_FINAL_NORM)
        if made == 0 and entry and norm is not None:
            # the final norm's hook: after its weight's gradient, before the rest of its backward (an
            # ``AccumulateGrad`` runs as soon as it is ready: deepspeed_made_order); the traced engine makes a rank's
            # gradient buffer there with 16 MiB of the norm's temporaries alive (llama-3.1-8b over 8)
            return dataclasses.replace(norm, name=MomentName.BACKWARD_REDUCTION, temporaries=0)
        top, bottom = backward.get(MomentName.BACKWARD_TOP_BLOCK), backward.get(MomentName.BACKWARD_BOTTOM_BLOCK)
        if not 1 <= made <= n_layers or top is None or bottom is None or (not entry and made in (1, n_layers)):
            return None
        below = n_layers - made  # the layer's index: layers 0..below-1 still hold what they saved

        def at(a: int, b: int) -> int:
            return b + (a - b) * below // max(1, n_layers - 1)

        return dataclasses.replace(
            top,
            name=MomentName.BACKWARD_REDUCTION if entry else MomentName.BACKWARD_MIDDLE_BLOCK,
            gradients=at(top.gradients, bottom.gradients),
            activations=at(top.activations, bottom.activations),
            autocast_copies=at(top.autocast_copies, bottom.autocast_copies),
            temporaries=0 if entry else at(top.temporaries, bottom.temporaries),
        )

    # Stages 1–2: gradients that stay outside the IPG bucket for a while. A tied table's: autograd keeps the head's
    # in the table's input buffer until the embedding's is added to it (states.tied_gradient_sum), and the hooks take
    # the sum only then (RankHooks.defers_tied_table). A parameter larger than the bucket keeps its own gradient until
    # the next reduction (``extra_large_param_to_reduce``); stage 1's hooks clear nothing, so one outside the
    # partition stays to the epilogue (``_clear_param_grad_only``), and under ZeRO-Offload one inside it is cloned and
    # kept too (``_offload_gradient_safety_enabled``; rank_events.Zero2Hooks).
    order = deepspeed_made_order(spec, strategy) if stage < 3 else ()
    flush_of, positions = deepspeed_reductions(spec, eo.reduce_bucket_size, strategy) if stage < 3 else ((), ())
    large = [(off, n, made, f) for (off, n, made), f in zip(order, flush_of, strict=True) if n > eo.reduce_bucket_size]
    tied_grad = q.grad_head if stage < 3 and tied_gradient_sum(spec, cs) is not None else 0
    # Each reduction in backward copies a bucket that spans a partition edge into one tensor for the collective
    # (``average_tensor`` → ``allreduce_bucket``: ``self.flatten(bucket)``, freed when it returns), the same on every
    # rank: up to a bucket (llama-3.2-1b over 8 ranks: 928 MiB, the traced peak of the ranks in its tied table, −1.5%
    # without it). Stage 1 without overlap_comm reduces after backward (``zero1_reduce_gradients``).
    hooks_reduce = stage < 3 and not (stage == 1 and not overlap)
    copies = (
        tuple(allocator_bytes(n * pb) for n in deepspeed_reduction_copies(spec, part, eo.reduce_bucket_size, strategy))
        if hooks_reduce
        else ()
    )

    def held(zr: ZeroRank, at: int, *, flush: int | None, clones: bool = True) -> int:
        """Those of rank ``zr`` alive at backward position ``at`` (:func:`deepspeed_made_order`): at reduction
        ``flush`` (the gradients it takes still there), or (None) after every reduction the gradients made there set
        off — inside a layer's backward; elsewhere (the final norm's, the embedding's, after backward) counted as
        still there; ``clones``: with the offload clones made there."""
        out = tied_grad if 0 <= at <= n_layers + 1 else 0
        lo, hi = zr.lo, zr.lo + part
        for off, n, made, f in large:
            if at < (n_layers + 2 if tied_grad and made == n_layers + 1 else made):  # (the tied sum: counted above)
                continue
            inside = off < hi and off + n > lo
            if flush is not None:
                alive = f >= flush
            elif at == 0 and not off_opt:  # after the final norm's hook (its reductions: an entry moment)
                alive = positions[f] > 0
            else:  # (ZeRO-Offload at 0: as the head's hook clones it, the head's gradient is still there)
                alive = positions[f] > at or (positions[f] == at and not 1 <= at <= n_layers)
            if (off_opt and inside) or (stage == 1 and not inside) or alive:
                out += allocator_bytes(n * pb)
            if off_opt and clones and flush is None and at == made:  # the offload clone, beside autograd's gradient
                out += allocator_bytes(n * pb)
        return out

    def rank_phases(zr: ZeroRank | None) -> tuple[PhaseBreakdown, ...]:
        """The phases of rank ``zr`` (stages 1–2; None: stage 3's, every rank's)."""
        grad_part = allocator_bytes(part * pb)
        step_tmp = step_temp
        zero1_reduced: tuple[int, int] | None = None  # (gradients, the flush's copy) at the reduction's worst moment
        first = owner_flush = -1
        reduce_temp = reduce_live = 0
        entry: dict[int, int] = {}  # id of an entry moment (layer_moment) → the reduction it stands for
        if zr is not None:
            # The gradients of the parameters the rank's partition meets, whole, from the first reduction that copies
            # one of them; the step first takes the norm of each slice in fp64, then flattens the slices
            # (``self.flatten``) and casts the flat partition to fp32 (stage_1_and_2.py ``DeepSpeedZeroOptimizer.
            # step``). Fine-tuning: over the trainable tensors, the optimizer's and so the flat groups' only ones (the
            # traced engine with real PEFT adapters or --freeze, tests/trace/test_deepspeed.py; the step kept only
            # the cast before: −5.7%).
            grad_part = allocator_bytes(zr.whole_numel * pb)
            flat = allocator_bytes(part * pb) if zr.step_copies else 0
            step_tmp = max(allocator_bytes(8 * zr.largest_slice), flat + fp32_grad)
            first = zr.buffer_at
            if zero1_path:
                zero1_reduced = zero1_reduce_gradients(spec, part, eo.reduce_bucket_size, pb, zr)
            if offload_reduce and stage == 1 and not overlap:
                # after backward, in flat order: the worst slice's fp64 copy beside the gradients not yet reduced
                reduce_live, reduce_temp = zero1_offload_reduce(spec, part, eo.reduce_bucket_size, pb, zr)
            elif offload_reduce:
                # the reduction that copies the largest slice: set off by a gradient of a layer as its backward
                # begins (an entry moment), or by a late one, or after backward
                owner_flush = zr.largest_owner[1]
                reduce_temp = allocator_bytes(8 * zr.largest_slice)
        extra_rank: list[Moment] = []
        if zr is not None:
            copying = (f for f, n in enumerate(copies) if n)
            for f in sorted({zr.buffer_flush, owner_flush, *(f for *_, f in large), *copying} - {-1}):
                if (m := layer_moment(positions[f], entry=True)) is not None:
                    entry[id(m)] = f
                    extra_rank.append(m)
            if (m := layer_moment(first, entry=False)) is not None:
                extra_rank.append(m)

        def adjust(m: Moment) -> dict[Component, int]:
            f = entry.get(id(m))
            if f is not None:
                return _adjust(m, positions[f], f)
            return _adjust(m, first if m.name is MomentName.BACKWARD_MIDDLE_BLOCK else made_at.get(m.name, -1), None)

        def _adjust(m: Moment, made: int, flush: int | None) -> dict[Component, int]:
            """``m`` at backward position ``made``; ``flush``: an entry moment's reduction."""
            c = _single(m)
            c[Component.AUTOCAST_COPIES] = 0
            c[Component.ADAPTER_WEIGHTS] = 0  # cast to 16 bits with the rest, in the flat groups (WEIGHTS)
            c[Component.WEIGHTS] = whole_on_device if off_par else weights
            c[Component.MASTER_WEIGHTS] = 0 if off_opt else allocator_bytes(master)
            c[Component.OPTIMIZER_STATES] = 0 if off_opt else allocator_bytes(optim)
            frac = min(1.0, m.gradients / g_full)
            comm = unsharded = 0
            kept = held(zr, made, flush=flush, clones=flush is None) if zr is not None and made >= 0 else 0
            # ZeRO-Offload clones a head larger than the bucket at the head's own hook, before the final norm's
            # backward makes its temporaries (the traced engine; with them llama-3.1-8b's ranks 1–6 over 8 were +0.40%)
            head_clone = off_opt and flush is None and made == 0 and any(mm == 0 for _, _, mm, _ in large)
            if kept and head_clone and m.name is MomentName.BACKWARD_FINAL_NORM:
                c[Component.TEMPORARIES] = 0
            # Stage 1 with overlap_comm: its hooks reduce as stage 2's at the boundary (``process_gradients`` →
            # ``reduce_ready_partitions_and_remove_grads``), with ZeRO-Offload too (the traced engine, a tied one-row
            # cell with two accumulation steps: this path kept every gradient whole beside the table's fp64 copy,
            # +9.7%)
            if stage == 1 and not overlap:
                grads = int(allocator_bytes(total * pb) * frac)
                if off_opt:
                    # The hooks make the IPG bucket at the first gradient here too (``process_gradients`` →
                    # ``setup_buckets``: reduce_bucket_size elements, whatever the model's size — DeepSpeed's
                    # default 5e8 is 954 MiB in 16 bits), freed at the end of backward; the reduction adds its
                    # flattened allreduce bucket (``buffered_reduce_fallback``: the gradients ``flatten``ed, at most
                    # reduce_bucket_size)
                    if m.phase is Phase.BACKWARD and m.name is not MomentName.BACKWARD_START:
                        comm = bucket
                    if m.name is MomentName.BACKWARD_EMBEDDING:
                        comm = bucket + allocator_bytes(min(total, eo.reduce_bucket_size) * pb)
                elif m.phase is Phase.BACKWARD and m.name is not MomentName.BACKWARD_START:
                    # Autograd's gradients stay whole through backward; the gradient hooks only make the bucket,
                    # at the first parameter gradient (``process_gradients`` → ``setup_buckets``: reduce_bucket_size
                    # elements whatever the model's size), freed after the reduction (``_release_ipg_buffers``).
                    comm = bucket
                    if m.name is MomentName.BACKWARD_REDUCE and zero1_reduced is not None:
                        grads = zero1_reduced[0]
                        c[Component.TEMPORARIES] = zero1_reduced[1]
            else:  # stage 2, and stage 1 with overlap_comm (whose hooks reduce as stage 2's do: ``process_gradients``)
                # ``grads_in_partition`` from the first reduction that copies a gradient of the partition's parameters:
                # once backward has reached that reduction (under accumulation, from the first micro-step on: the
                # moments are a later micro-step's, autograd's gradients resident)
                # (a reduction the token table's gradient sets off comes after autograd's sum of a tied one)
                there = made > first or (made == first and first <= n_layers)
                if flush is not None and zr is not None:  # as the reduction ``flush`` runs
                    there = zr.buffer_flush <= flush
                grads = 0 if off_opt or not (q.grads_resident or there) else grad_part
                # The bucket is made at the first parameter gradient (``process_gradients`` → ``setup_buckets``),
                # after the loss's backward, and released at the end of backward (``_release_ipg_buffers``).
                if m.phase is Phase.BACKWARD and m.name is not MomentName.BACKWARD_START:
                    comm = bucket * (2 if overlap and stage < 3 else 1)
                    grads += kept
                # a reduction as a layer's backward begins, or the epilogue's: its bucket's copy, gone before
                # ``copy_grads_in_partition`` makes the buffer (the larger of the two moments)
                at = flush if flush is not None else len(copies) - 1 if m.name is MomentName.BACKWARD_REDUCE else None
                if copies and at is not None and copies[at]:
                    made_here = zr is not None and zr.buffer_flush == at and not q.grads_resident and not off_opt
                    if copies[at] > (grad_part if made_here else 0):
                        c[Component.TEMPORARIES] = copies[at]
                        grads -= grad_part if made_here else 0
            if stage == 1 and not overlap:
                at_reduction = m.name is MomentName.BACKWARD_REDUCE
            elif owner_flush >= 0 and made == positions[owner_flush]:
                at_reduction = flush == owner_flush or (flush is None and not 0 <= made <= n_layers)
            else:
                at_reduction = False
            if offload_reduce and zr is not None and m.phase is Phase.BACKWARD and at_reduction:
                # (the bucket's copy for the collective is gone before the slices' copies to the host)
                c[Component.TEMPORARIES] = max(reduce_temp, c[Component.TEMPORARIES])
                # stage 1 reduces after backward (``reduce_gradients``), autograd's gradients not yet reduced still
                # whole (with overlap_comm its hooks reduce as stage 2's)
                after = stage == 1 and not overlap
                grads = reduce_live if after else held(zr, made, flush=owner_flush, clones=False)
                comm = bucket * (2 if overlap and stage == 2 else 1)
            reducing = (offload_reduce and at_reduction) or m.name is MomentName.BACKWARD_REDUCE  # (the boundary's)
            if zero1_accumulating and m.phase is not Phase.OPTIMIZER_STEP and not reducing:
                grads = allocator_bytes(total * pb)
                comm = bucket * (2 if overlap else 1)
            if stage == 3:
                comm = bucket  # persistent __ipg_bucket_flat_buffer
                # The gradient partition is one buffer made at init (stage3.py ``_setup_for_real_optimizer``:
                # ``grad_partitions_flat_buffer``), held through the step.
                grads = 0 if off_opt else grad_part
                if m.phase is not Phase.OPTIMIZER_STEP and fetch is not None:
                    unsharded = fetch.at.get(m.name, fetch.peak_bytes)
            if m.phase is Phase.OPTIMIZER_STEP:
                # Stage 1 too keeps only its partition's gradients after backward: at the accumulation boundary
                # ``reduce_gradients`` reduces every gradient and copies the partition's into
                # ``grads_in_partition`` (stage_1_and_2.py ``reduce_ready_partitions_and_remove_grads``).
                grads = 0 if off_opt else grad_part
                c[Component.TEMPORARIES] = 0 if off_opt else step_tmp
                if stage == 3 and not off_opt and weights_step + step_temp > weights:
                    # (offloaded, the device's step is the copy back of the partition: its peak is at the start,
                    # the persistent parameters still whole; so it is when the persistent ones outweigh the step's own
                    # temporaries — LoRA, whose adapters' gradient partition is small, the traced engine)
                    c[Component.WEIGHTS] = weights_step
                elif stage == 3 and not off_opt:
                    c[Component.TEMPORARIES] = 0
                if client_temp and not off_opt:
                    # inside the client optimizer's step: the fp32 gradient of the partition and the optimizer's own
                    # temporaries over it; stages 1–2 have freed the 16-bit gradients (``free_grad_in_param_list``),
                    # stage 3 its flattened copy (its gradient partition is a persistent buffer), the persistent
                    # parameters partitioned
                    inside = {
                        Component.GRADIENTS: grad_part if stage == 3 else 0,
                        Component.TEMPORARIES: allocator_bytes(part * 4) + client_temp,
                        Component.WEIGHTS: weights_step if stage == 3 else c[Component.WEIGHTS],
                    }
                    now = {k: grads if k is Component.GRADIENTS else c[k] for k in inside}
                    if sum(inside.values()) > sum(now.values()):
                        grads = inside.pop(Component.GRADIENTS)
                        c.update(inside)
            c[Component.GRADIENTS] = grads
            c[Component.COMM_BUFFERS] = comm + off_staging
            c[Component.UNSHARDED_PARAMS] = unsharded
            return c

        return _worst(q, adjust, host, [*extra, *extra_rank])

    host: dict[Component, int] = {}
    if off_opt:
        per_node = min(p.world, strategy.parallelism.gpus_per_node)
        host = {
            Component.MASTER_WEIGHTS: master * per_node,
            Component.OPTIMIZER_STATES: optim * per_node,
            Component.GRADIENTS: part * 4 * per_node,  # the pinned fp32 gradient partition
        }
        if stage < 3:
            # Pinned 16-bit staging: the partition's copy-back buffer and one parameter's gradient
            # (stage_1_and_2.py ``param_buffer_of_bit16_for_cpu_offload_groups``, ``temp_grad_buffer_for_cpu_offload``);
            # under accumulation also a pinned 16-bit copy of each partition parameter's whole gradient, which the
            # micro-steps add into (``async_accumulate_grad_in_cpu_via_gpu``: ``accumulated_grads_in_cpu``).
            # The heaviest node's ranks.
            accumulated = 0
            if strategy.grad_accum > 1:
                wholes = [zr.whole_numel for zr in deepspeed_ranks(spec, part, p.dp, eo.reduce_bucket_size, strategy)]
                accumulated = max(sum(wholes[i : i + per_node]) for i in range(0, len(wholes), per_node))
            host[Component.COMM_BUFFERS] = (part + largest) * pb * per_node + accumulated * pb
        else:
            # Stage 3 moves its 16-bit gradient partition to the host too, besides the fp32 one (stage3.py
            # ``_setup_for_real_optimizer``: ``grad_partitions_flat_buffer`` on ``self.device``, pinned).
            host[Component.GRADIENTS] = part * (4 + pb) * per_node
        if off_par:
            # the optimizer's 16-bit partition and each frozen parameter's own (made on the ``remote_device``, the
            # host; a persistent one's on the device): parameter_offload.py ``_convert_to_zero_parameters``
            frozen_part = sum(n for n, persist in zero3_frozen_partitions(spec, strategy, p.dp) if not persist)
            host[Component.WEIGHTS] = (part + frozen_part) * pb * per_node
    if finetuning(strategy):
        frozen_numel = sum(t.numel * m for t, m in zp.frozen_tensors)
        notes_ft = [
            f"fine-tuning under ZeRO-{stage}: the 16-bit parameters of all {inv.total:,} elements"
            + (" (partitioned)" if stage == 3 else f" ({frozen_numel:,} frozen, outside the flat groups)")
            + f"; gradients, fp32 master weights and optimizer states only for the {total:,} trainable"
        ]
    else:
        notes_ft = []
    notes = [
        f"DeepSpeed ZeRO-{stage} over {p.dp} ranks: partition of {part:,} elements per rank"
        + (f" (+{whole:,} in parameters under the persistence threshold, kept whole)" if stage == 3 else "")
        + f"; reduce bucket {eo.reduce_bucket_size:.0e} elements ({fmt_gib(bucket)})",
    ]
    if off_opt:
        notes.append(
            "ZeRO-Offload: fp32 master weights, Adam states and the fp32 gradient partition in pinned host memory "
            "(host bytes per node)"
        )
    if stage == 3:
        # The HF Trainer and accelerate build the model under ``deepspeed.zero.Init`` (from_pretrained with ZeRO-3
        # enabled): every parameter is partitioned as it is made. A model built first and handed to
        # ``deepspeed.initialize`` is whole on the device until the engine partitions it (the trace's way,
        # trace/deepspeed.py; its init then needs the 16-bit model besides the partitions).
        notes.append(
            "DeepSpeed ZeRO-3: the model built under deepspeed.zero.Init (the HF Trainer's and accelerate's way); "
            "one built before deepspeed.initialize is whole on each GPU first: "
            f"{fmt_gib(allocator_bytes(inv.total * pb))} of {8 * pb}-bit parameters at init"
        )
    extra = [_zero3_final_norm_moment(q)] if stage == 3 and fetch is not None else []
    if stage < 3:
        # ZeRO-1 without overlap_comm: the engine reduces after backward (engine.py ``allreduce_gradients`` →
        # ``reduce_gradients``), every gradient still there, the bucket and the partition's buffer made; ZeRO-2
        # offloaded: the last flush's copies to the host (``offload_reduce``); otherwise the epilogue's reduction
        # (``independent_gradient_partition_epilogue``), with the gradients it takes.
        extra.append(Moment(name=MomentName.BACKWARD_REDUCE, phase=Phase.BACKWARD, resident=q.resident))
    if stage == 3:
        return rank_phases(None), notes + notes_ft, (), None
    # Stages 1–2: every rank's partition meets other parameters; ranks whose rank-dependent inputs agree share phases.
    by_inputs: dict[tuple[object, ...], list[ZeroRank]] = {}
    for zr in deepspeed_ranks(spec, part, p.dp, eo.reduce_bucket_size, strategy):
        inside = tuple(off < zr.lo + part and off + n > zr.lo for off, n, _, _ in large)
        reduction = zero1_reduce_gradients(spec, part, eo.reduce_bucket_size, pb, zr) if zero1_path else None
        key = (zr.whole_numel, zr.largest_slice, zr.largest_owner, zr.buffer_at, zr.step_copies, inside, reduction)
        by_inputs.setdefault(key, []).append(zr)
    # ... and ranks whose phases agree are one entry of the per-rank table
    Seen = tuple[tuple[tuple[Component, int], ...], ...]
    by_phases: dict[Seen, tuple[tuple[PhaseBreakdown, ...], list[ZeroRank]]] = {}
    for group in by_inputs.values():
        phases = rank_phases(group[0])
        seen = tuple(tuple(sorted(ph.components.items())) for ph in phases)
        by_phases.setdefault(seen, (phases, []))[1].extend(group)
    entries = sorted(by_phases.values(), key=lambda e: min(zr.rank for zr in e[1]))
    ranks = tuple(RankMemory(ranks=tuple(sorted(zr.rank for zr in rs)), phases=ph) for ph, rs in entries)
    phases, members = max(entries, key=lambda e: max(x.total_bytes for x in e[0]))  # (the lowest rank of equals)
    return phases, notes + notes_ft, ranks if len(ranks) > 1 else (), min(members, key=lambda zr: zr.rank)


def _zero3_final_norm_moment(q: StepInputs) -> Moment:
    """ZeRO-3, inside the final norm's forward: every activation saved (the forward's end, before the
    logits), the norm's transients alive, and the gathered parameters of the moment before the head's fetch.
    A coalesced all-gather's flat buffer lives until the last parameter it carries is waited on
    (partition_parameters.py ``AllGatherCoalescedHandle``: the handle keeps ``partitions``, views of it, and
    stays in ``__inflight_param_registry`` for each parameter until that parameter's module fetches it); with
    a prefetch bucket larger than the model (DeepSpeed's default 5e7 on a small model) the first module's
    prefetch gathers every parameter in one handle, whose last parameter is the LM head: the whole buffer and
    every whole copy are alive through the forward, until the head's fetch (analytic/zero3.py).
    Transients of HF ``LlamaRMSNorm.forward``: its input (the last layer's output), the fp32 product
    ``hidden_states * torch.rsqrt(variance + eps)`` and the fp32 mean; a LayerNorm only its input."""
    end = forward_moments(q)[0]
    t, h = q.strategy.tokens_per_micro_batch, q.spec.hidden_size
    norm = Widths.of(q.strategy).residual * t * h
    if q.spec.norm is NormKind.RMSNORM:
        norm += 4 * t * h + 4 * t
    return dataclasses.replace(
        end,
        name=MomentName.FORWARD_FINAL_NORM,
        logits_loss=0,
        temporaries=end.temporaries - q.forward_transient + norm,
    )


# -- Megatron TP / SP / PP -------------------------------------------------------------------------------


def tp_local_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """One tensor-parallel rank's model: heads, k/v groups and the MLP width split over ``tp``; the
    vocabulary padded to a multiple of 128·tp and split (Megatron ``VocabParallelEmbedding``,
    ``ColumnParallelLinear``/``RowParallelLinear``); norms replicated."""
    if tp == 1:
        return spec
    div = MEGATRON_VOCAB_DIVISOR * tp
    vocab = -(-spec.vocab_size // div) * div
    return dataclasses.replace(
        spec,
        num_heads=spec.num_heads // tp,
        num_kv_heads=spec.num_kv_heads // tp,
        intermediate_size=spec.intermediate_size // tp,
        vocab_size=vocab // tp,
    )


def in_flight_microbatches(schedule: PipelineSchedule, pp: int, stage: int, m: int, v: int) -> float:
    """Micro-batches whose activations stage ``stage`` holds at once, in units of the stage's full layer
    set: :func:`in_flight_chunks` over ``v`` (1F1B min(pp − s, m), Narayanan et al. 2021, §2.2; interleaved
    ((pp − s − 1)·2 + (v − 1)·pp + 1)/v, at most m; GPipe m)."""
    return in_flight_chunks(schedule, pp, stage, m, v) / (v if schedule is PipelineSchedule.INTERLEAVED else 1)


def in_flight_chunks(schedule: PipelineSchedule, pp: int, stage: int, m: int, v: int) -> int:
    """Model-chunk micro-batches (each L/(pp·v) layers; v = 1 outside the interleaved schedule) whose saved
    tensors stage ``stage`` holds at its peak: 1F1B min(pp − s, m) (``forward_backward_pipelining_without_
    interleaving``: min(pp − s − 1, m) warm-up forwards, then one more before each backward); interleaved
    min((pp − s − 1)·2 + (v − 1)·pp + 1, m·v) (``forward_backward_pipelining_with_interleaving``:
    ``get_pp_rank_microbatches``' warm-up count with ``microbatch_group_size_per_vp_stage`` = pp, capped at
    m·v, then one forward before each backward; megatron/core/pipeline_parallel/schedules.py, megatron-core
    0.19.2); GPipe m (every forward before the first backward: torch/distributed/pipelining/schedules.py
    ``ScheduleGPipe._step_microbatches``)."""
    if pp == 1:
        return 1
    if schedule is PipelineSchedule.GPIPE:
        return m
    if schedule is PipelineSchedule.INTERLEAVED:
        return min((pp - stage - 1) * 2 + (v - 1) * pp + 1, m * v)
    return min(pp - stage, m)


def in_flight_note(stages: Sequence[RankMemory]) -> str:
    """The stages' in-flight micro-batches in one line: ``stage 0: 4 micro-batches, stage 1: 3, …``; interleaved,
    the model-chunk micro-batches and their whole-stage equivalent (``stage 0: 9 chunks of 2 (4.5 micro-batches)``)."""
    parts = []
    for r in stages:
        f = r.pipeline
        if f is None:
            continue
        mb = f.in_flight_microbatches
        mb_s = f"{mb:g}"
        if f.model_chunks > 1:
            parts.append(f"stage {f.stage}: {f.in_flight_chunks} chunks of {f.model_chunks} ({mb_s} micro-batches)")
        else:
            parts.append(f"stage {f.stage}: {f.in_flight_chunks} micro-batch{'es' if f.in_flight_chunks > 1 else ''}")
    return ", ".join(parts)


def first_stage_embeddings(schedule: PipelineSchedule, pp: int, m: int, v: int) -> int:
    """Embedding outputs (saved for the first layer's backward) alive on stage 0 at its peak: one per micro-batch
    in flight under 1F1B and GPipe; interleaved, only model chunk 0 holds the embedding, and at most two groups'
    chunk-0 micro-batches are alive, min(m, 2·pp): group g's chunk-0 backwards (positions (v − 1)·pp … v·pp − 1
    of its pp·v backward slots, the chunk order reversed: ``get_model_chunk_id(k, forward=False)``) begin after
    forward (g + 2)·pp·v − 2 (the warm-up is (v + 1)·pp − 2 on stage 0), after group g + 1's chunk-0 forwards and
    before group g + 2's; with m = pp every chunk's forward is warm-up and all m are alive."""
    if schedule is PipelineSchedule.INTERLEAVED and pp > 1:
        return min(m, 2 * pp)
    return in_flight_chunks(schedule, pp, 0, m, v)


def last_stage_heads(schedule: PipelineSchedule, pp: int, m: int) -> int:
    """Head inputs and losses alive on the last stage at its peak: GPipe m (every micro-batch's loss is computed
    in its forward, ``_maybe_compute_loss``, and back-propagated after all forwards); 1F1B and interleaved 1 (the
    last stage's warm-up has no forward of its last model chunk: each such forward is followed at once by the
    same micro-batch's backward, forward k + (v − 1)·pp and backward k sitting in the same group's slots)."""
    return m if schedule is PipelineSchedule.GPIPE and pp > 1 else 1


@dataclass(frozen=True, slots=True, kw_only=True)
class MegatronInputs:
    """What one Megatron rank's stages are built from (bytes; shared by :func:`_megatron`'s closed form and the
    rank's event stream, :class:`trainfit.analytic.rank_events.MegatronStage`)."""

    q: StepInputs  # the TP-local model's single-GPU step inputs (compute strategy, logits not kept)
    layers_per_stage: int
    per_layer_params: int  # the largest layer kind's, counted for every layer of a stage
    embed: tuple[ParamTensor, ...]  # on the first stage
    rest: tuple[ParamTensor, ...]  # on the last stage (with the tied table's copy when pp > 1)
    act_layer: int  # one micro-batch's saved tensors of one layer (SP: split over tp)
    per_mb_layer: int  # what one micro-batch keeps between its forward and backward per layer, or per segment
    chunk_segments: tuple[int, ...]  # the checkpointed segments of one model chunk, in layers (empty: none)
    recompute: int  # a checkpointed segment's tensors, recomputed in backward
    param_bytes: int  # 2 (bf16 parameters) or 4 (fp32 compute)
    fp32: bool
    dist_opt: bool
    loss_kept: int  # what one micro-batch's loss keeps from its forward to its backward (last stage)
    chunks: int  # model chunks per stage (virtual stages under the interleaved schedule; 1 otherwise)

    @property
    def chunk_layers(self) -> int:
        """Layers of one model chunk (the stage's layers under 1F1B and GPipe)."""
        return self.layers_per_stage // self.chunks

    @property
    def kept_per_chunk(self) -> int:
        """What one micro-batch keeps in one model chunk from its forward to its backward: each layer's saved
        tensors, or each checkpointed segment's input."""
        return self.per_mb_layer * (len(self.chunk_segments) if self.chunk_segments else self.chunk_layers)

    def chunk_params(self, stage: int, pp: int, chunk: int) -> int:
        """Parameters of model chunk ``chunk`` of stage ``stage``: its layers, the embedding on chunk 0 of stage 0,
        the final norm and head on the last chunk of the last stage (Megatron ``pre_process``/``post_process``
        per virtual stage)."""
        return (
            self.chunk_layers * self.per_layer_params
            + (sum(t.numel for t in self.embed) if stage == 0 and chunk == 0 else 0)
            + (sum(t.numel for t in self.rest) if stage == pp - 1 and chunk == self.chunks - 1 else 0)
        )

    def stage_params(self, stage: int, pp: int) -> int:
        """Parameters held by pipeline stage ``stage``."""
        return (
            self.layers_per_stage * self.per_layer_params
            + (sum(t.numel for t in self.embed) if stage == 0 else 0)
            + (sum(t.numel for t in self.rest) if stage == pp - 1 else 0)
        )


def megatron_inputs(spec: ModelSpec, strategy: Strategy, p: ParallelPlan) -> MegatronInputs:
    """Per-stage quantities of Megatron TP/SP/PP (see the module docstring); refuses optimizers other than Adam."""
    cs = compute_strategy(strategy)
    local = tp_local_spec(spec, p.tp)
    q = step_inputs(local, cs, keep_logits=False)
    if strategy.optimizer is not Optimizer.ADAMW:
        raise StrategyError(
            f"tensor/pipeline parallelism models Megatron's Adam (fp32 states); --optimizer {strategy.optimizer.value} "
            "is not modelled there yet"
        )
    inv = inventory(local)
    embed = tuple(t for t in inv.model_tensors if t.name.startswith("embed"))
    rest = tuple(t for t in inv.model_tensors if not t.name.startswith("embed"))
    if spec.tie_word_embeddings and p.pp > 1:
        # The last stage keeps its own copy of the tied token table for the head (Megatron's
        # ``share_embeddings_and_output_weights`` across the first and last stage); on one stage it is one tensor.
        rest += tuple(t for t in embed if t.name == "embed_tokens.weight")
    # Activations of one micro-batch on one layer (SP: every tensor split; Korthikanti et al. 2022, Table 2).
    if p.sequence_parallel:
        full_q = step_inputs(spec, cs, keep_logits=False)
        act_layer = full_q.stack.max_layer_bytes // p.tp
        kept_layer = full_q.kept_inputs // max(1, full_q.segments) // p.tp if full_q.segments else 0
    else:
        act_layer = q.stack.max_layer_bytes
        kept_layer = q.kept_inputs // max(1, q.segments) if q.segments else 0
    ckpt = q.segments > 0
    segments = megatron_chunk_segments(spec, strategy)
    fp32 = cs.recipe.compute_bits == 32
    # The loss's saved tensors (the closed form's loss is the causal-LM one of trainfit.analytic.logits): the
    # fp32 log-probabilities LogSoftmaxBackward keeps (Megatron's vocab-parallel cross-entropy likewise keeps its
    # fp32 ``exp_logits``, tensor_parallel/cross_entropy.py ``save_for_backward``), and a soft-cap's tanh output.
    n = strategy.tokens_per_micro_batch * local.vocab_size
    kept = 4 * n + (cs.recipe.compute_bits // 8 * n if spec.final_logit_softcapping else 0)
    return MegatronInputs(
        q=q,
        layers_per_stage=spec.num_layers // p.pp,
        per_layer_params=max(g.params_per_layer for g in inv.layers),
        embed=embed,
        rest=rest,
        act_layer=act_layer,
        per_mb_layer=kept_layer if ckpt else act_layer,
        chunk_segments=segments,
        recompute=act_layer * (segments[-1] if segments else 0),  # the top segment's (the shortest)
        param_bytes=4 if fp32 else 2,
        fp32=fp32,
        dist_opt=strategy.sharding is Sharding.ZERO1,
        loss_kept=kept if spec.kind is ModelKind.CAUSAL_LM else 0,
        chunks=_megatron_chunks(strategy),
    )


def zero_client_step(strategy: Strategy, part: int) -> tuple[list[int], list[int]]:
    """(the optimizer's state tensors, its update temporaries) over a ZeRO rank's flat fp32 partition of ``part``
    elements, shared by the closed form (:func:`_deepspeed`) and the rank streams (``rank_events.Zero2Hooks``,
    ``Zero3Hooks``). The optimizer steps that flat 1-D partition (stage_1_and_2.py: its param groups point at
    ``single_partition_of_fp32_groups``; stage3.py at ``fp32_partitioned_groups_flat``), not the model's tensors:
    AdamW keeps two fp32 moments; another optimizer (the Trainer's, DeepSpeed's client) the states of one 1-D tensor
    (:func:`~trainfit.analytic.states.optimizer_state_tensors`: Adafactor's second moment unfactored, 8-bit AdamW one
    long quantised tensor). Temporaries (trace/optim.py's forms; states.py ``_step_temp_bytes`` for an fp32 tensor):
    Lion's ``exp_avg.clone()`` and out-of-place add, Adafactor's two update tensors; AdamW (DeepSpeed's fused
    kernel), SGD and 8-bit AdamW update in place. Shown on the traced engine (tests/trace/test_deepspeed.py)."""
    temps = [allocator_bytes(part * 4)] * 2 if strategy.optimizer in (Optimizer.LION, Optimizer.ADAFACTOR) else []
    if strategy.optimizer is Optimizer.ADAMW:
        return [part * 4, part * 4], temps
    flat = ParamTensor(name="fp32_partition", shape=(part,), matmul=False)
    return list(optimizer_state_tensors(flat, strategy.optimizer, 32, strategy.optimizer_impl)), temps


def _megatron_chunks(strategy: Strategy) -> int:
    """Model chunks per pipeline stage: the interleaved schedule's virtual stages, else one."""
    par = strategy.parallelism
    return par.virtual_stages if par.pipeline_schedule is PipelineSchedule.INTERLEAVED and par.pipeline > 1 else 1


def megatron_chunk_segments(spec: ModelSpec, strategy: Strategy) -> tuple[int, ...]:
    """The checkpointed segments of one Megatron model chunk, in layers (empty without recompute or with selective
    recompute). Megatron checkpoints each chunk's TransformerBlock on its own: ``--recompute-method uniform
    --recompute-num-layers k`` keeps the input of each group of k layers from the chunk's bottom, the last group
    clamped to the chunk (megatron/core/transformer/transformer_block.py ``_checkpointed_forward``; with pipeline
    parallelism k counts the layers of a stage, with virtual stages those of a chunk) — the chunk's
    :func:`~trainfit.strategy.training.checkpoint_layout`: one layer per segment for full, ⌈c/⌈√c⌉⌉ for sqrt."""
    par = strategy.parallelism
    return strategy.checkpoint_layout(spec.num_layers // par.pipeline // _megatron_chunks(strategy)).segment_sizes


def megatron_init_bytes(mi: MegatronInputs, stage: int, pp: int) -> int:
    """The allocated peak of stage ``stage`` while Megatron builds it, before the first step (0 without the
    distributed optimizer, whose init never exceeds the resident states). With it, each model chunk's DDP wrapper
    allocates its ``_ParamAndGradBuffer``'s ``param_data`` (parameter dtype) and ``grad_data`` (fp32), then moves
    the parameters in one by one (``param.data = <view>; copy_(old); del old``:
    megatron/core/distributed/param_and_grad_buffer.py ``_ParamAndGradBuffer.__init__``), while the module's own
    parameters, made on the device by ``get_model`` (megatron/training/training.py: ``.cuda()`` before
    ``wrap_model_chunks_with_ddp``, chunk by chunk), are still alive; so when chunk c's buffers exist, the
    parameters of chunks ≥ c are held twice: max over c of pb·Σ_{≥c} P + (pb + 4)·Σ_{≤c} P — (2·pb + 4)·P with one
    chunk, 8 B/param in bf16, against 6 + 12/d resident in training. The optimizer's fp32 main shards come after
    (``shard_model_param.clone().float()``, one small clone at a time: distrib_optimizer.py
    ``_build_model_and_main_param_groups``) and Adam's states at the first step. Buffer padding is left out."""
    if not mi.dist_opt:
        return 0
    sizes = [mi.chunk_params(stage, pp, c) for c in range(mi.chunks)]
    pb = mi.param_bytes
    return max(pb * sum(sizes[c:]) + (pb + 4) * sum(sizes[: c + 1]) for c in range(len(sizes)))


def _megatron_lower_segment(mi: MegatronInputs) -> int:
    """Checkpointed segments of several layers (``sqrt``), whose top one is the shortest (Megatron's uniform groups
    start at the chunk's bottom layer): the most a lower segment's backward holds beyond the micro-batch's inputs
    still kept — its recomputed layers less the inputs of the segments above it, freed by their backwards — when
    that exceeds the top segment's recomputation (the closed form's ``recompute``, the top one's size); else 0."""
    sizes = mi.chunk_segments
    if len(sizes) < 2:
        return 0
    lower = max(mi.act_layer * sizes[-1 - i] - i * mi.per_mb_layer for i in range(1, len(sizes)))
    return lower if lower > mi.act_layer * sizes[-1] else 0


def _megatron(
    spec: ModelSpec, strategy: Strategy, p: ParallelPlan
) -> tuple[tuple[PhaseBreakdown, ...], tuple[RankMemory, ...], list[str]]:
    par = strategy.parallelism
    mi = megatron_inputs(spec, strategy, p)
    q, ls, fp32, dist_opt = mi.q, mi.layers_per_stage, mi.fp32, mi.dist_opt
    recompute, pb = mi.recompute, mi.param_bytes

    stages: list[RankMemory] = []
    for s in range(p.pp):
        params = mi.stage_params(s, p.pp)
        weights = params * pb
        grads = params * 4  # fp32 main-grad buffer, persistent
        if fp32:
            master = 0
            optim = params * 8 // (p.dp if dist_opt else 1)
        else:
            master = params * 4 // (p.dp if dist_opt else 1)
            optim = params * 8 // (p.dp if dist_opt else 1)
        sched, m = par.pipeline_schedule, par.microbatches
        chunks = in_flight_chunks(sched, p.pp, s, m, mi.chunks)
        acts = chunks * mi.kept_per_chunk + recompute
        if s == 0:
            acts += first_stage_embeddings(sched, p.pp, m, mi.chunks) * q.stack.embedding_bytes
        logits_f = q.logits_forward if s == p.pp - 1 else 0
        logits_b = q.logits_backward if s == p.pp - 1 else 0
        head_in = 0
        if s == p.pp - 1:  # the others' head inputs and losses, waiting for their backward (GPipe)
            heads = last_stage_heads(sched, p.pp, m)
            head_in = heads * q.stack.head_input_bytes + (heads - 1) * mi.loss_kept
        resident = {
            Component.WEIGHTS: weights,
            Component.GRADIENTS: grads,
            Component.MASTER_WEIGHTS: master,
            Component.OPTIMIZER_STATES: optim,
        }
        bwd_acts, bwd_logits = acts + head_in, logits_b
        if lower := _megatron_lower_segment(mi):
            # a larger segment below the top one, recomputed once the segments above have freed their inputs and,
            # on the last stage, the micro-batch's head input and loss buffers are gone (the top one's moment)
            mine = q.stack.head_input_bytes if s == p.pp - 1 else 0
            if acts - recompute + lower + head_in - mine > bwd_acts + bwd_logits:
                bwd_acts, bwd_logits = acts - recompute + lower + head_in - mine, 0
        # a checkpointed forward runs one layer at a time without grad: one layer's tensors, not a segment's
        fwd_acts = acts - recompute + (mi.act_layer if mi.chunk_segments else 0) + head_in
        phases = (
            PhaseBreakdown(
                phase=Phase.FORWARD,
                components=_full(resident | {Component.ACTIVATIONS: fwd_acts, Component.LOGITS_LOSS: logits_f}),
            ),
            PhaseBreakdown(
                phase=Phase.BACKWARD,
                components=_full(
                    resident
                    | {
                        Component.ACTIVATIONS: bwd_acts,
                        Component.LOGITS_LOSS: bwd_logits,
                        Component.TEMPORARIES: q.block_temp,
                    }
                ),
            ),
            PhaseBreakdown(phase=Phase.OPTIMIZER_STEP, components=_full(resident)),
        )
        group = p.tp * p.dp
        stages.append(
            RankMemory(
                ranks=tuple(range(s * group, (s + 1) * group)),
                phases=phases,
                pipeline=PipelineInFlight(stage=s, in_flight_chunks=chunks, model_chunks=mi.chunks),
            )
        )
    worst = max(stages, key=lambda r: r.peak_bytes)
    init = [(megatron_init_bytes(mi, s, p.pp) - stages[s].peak_bytes, s) for s in range(p.pp)]
    over, at = max(init)
    notes = [
        f"Megatron TP {p.tp}{' + SP' if p.sequence_parallel else ''}, PP {p.pp} ({par.pipeline_schedule.value}, "
        f"{par.microbatches} micro-batches), DP {p.dp}: {ls} layers per stage; stage 0 holds the embedding and "
        f"the most micro-batches in flight, the last stage the head and the logits",
        "activations per layer from the Hugging Face block model split per Korthikanti et al. 2022 "
        "(without SP the norm and residual tensors are replicated)",
    ]
    if p.pp > 1:
        notes.append(f"Megatron pipeline in flight at each stage's peak: {in_flight_note(stages)}")
    if p.pp > 1 and par.microbatches < p.pp:
        notes.append(
            f"only {par.microbatches} micro-batch(es) for {p.pp} pipeline stages: the pipeline idles most of the "
            "step (--microbatches sets how many per step; memory on stage 0 grows up to pp of them)"
        )
    if over > 0:
        notes.append(
            f"Megatron's init: building the distributed optimizer's buffers (param_data, grad_data) while the "
            f"module's own parameters still exist peaks at {fmt_gib(over + stages[at].peak_bytes)}"
            + (f" on pipeline stage {at}" if p.pp > 1 else "")
            + f", {fmt_gib(over)} above that stage's training step; max_memory_allocated counts it, and the caching "
            "allocator keeps it reserved (megatron/core/distributed/param_and_grad_buffer.py)"
        )
    return worst.phases, tuple(stages) if p.pp > 1 else (), notes


# -- torch DTensor TP / SP -------------------------------------------------------------------------------


def dtensor_tp_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """What one DTensor tensor-parallel rank computes with: ``heads/tp`` query and k/v heads, ``i/tp`` MLP width
    (``ColwiseParallel`` shards q/k/v/gate/up on dim 0, ``RowwiseParallel`` o/down on dim 1), the full hidden
    size (norms and the residual stream are replicated) and the full vocabulary (the logits are gathered)."""
    return dataclasses.replace(
        spec,
        num_heads=spec.num_heads // tp,
        num_kv_heads=spec.num_kv_heads // tp,
        intermediate_size=spec.intermediate_size // tp,
    )


#: Saved-tensor names (trainfit.analytic.activations) over the residual stream: split by sequence
#: parallelism. The matmul inputs (``attn_in``, ``mlp_in``, ``lm_head_in``) are the all-gathered tensors.
SP_SPLIT_PREFIXES = ("norm1.", "norm2.", "final_norm.")


def _sp_saved_bytes(spec: ModelSpec, strategy: Strategy, tp: int) -> tuple[int, int]:
    """(per layer, final norm) bytes that sequence parallelism removes from one rank's saved tensors: the
    norms' saved tensors split over ``tp`` (``SequenceParallel``), while each matmul still saves its whole
    all-gathered input (``PrepareModuleInput`` redistributes ``Shard(1)`` → ``Replicate()`` before q/k/v and
    gate/up; unlike Megatron, which saves the sharded input and all-gathers it again in backward —
    Korthikanti et al. 2022 §4.2.2)."""
    from trainfit.analytic.activations import layer_terms, model_terms

    def cut(names: list[tuple[str, int]]) -> int:
        return sum(b - b // tp for n, b in names if n.startswith(SP_SPLIT_PREFIXES))

    layer = cut([(x.name, x.bytes) for x in layer_terms(spec, strategy)])
    final = cut([(x.name, x.bytes) for x in model_terms(spec, strategy)])
    return layer, final


def _torch_tp(spec: ModelSpec, strategy: Strategy, p: ParallelPlan) -> tuple[tuple[PhaseBreakdown, ...], list[str]]:
    """One rank of DTensor TP (± SP): the single-GPU step of :func:`dtensor_tp_spec`'s model, with the
    states of the rank's shards (the vocabulary split as ``torch.chunk``: rank 0 holds ⌈V/tp⌉ rows —
    torch/distributed/tensor/_api.py ``distribute_tensor``), and two DTensor facts:

    * the token table's gradient is computed whole: ``embedding_dense_backward`` has no strategy with the
      weight gradient sharded on the vocabulary (torch/distributed/tensor/_ops/_embedding_ops.py
      ``embedding_dense_backward_strategy``), so the replicated V·h gradient is computed and the rank's
      ``Shard(0)`` gradient is a view of it — the whole table's gradient stays resident;
    * with sequence parallelism the norms' saved tensors are split, the matmul inputs are not
      (:func:`_sp_saved_bytes`); the norms' backward temporaries are split too;
    * the logits are gathered whole (``output_layouts=Replicate()``) for the model's own loss.
    """
    q, table_grad, vocab_rows = _tp_inputs(spec, strategy, p)
    tp = p.tp
    phases = tuple(
        PhaseBreakdown(phase=ph, components=_full(_single(worst_m)))
        for ph, worst_m in ((ph, max(ms, key=lambda m: m.total_bytes)) for ph, ms in _moments(q).items())
    )
    notes = [
        f"DTensor TP {tp}{' + SP' if p.sequence_parallel else ''}, DP {p.dp} (no sharding): each rank holds "
        f"{spec.num_heads // tp} of {spec.num_heads} heads, {spec.intermediate_size // tp} of "
        f"{spec.intermediate_size} MLP columns and {vocab_rows:,} of {spec.vocab_size:,} vocabulary rows; norms "
        "replicated; the logits gathered whole for the loss",
        f"the token table's gradient is computed whole on every rank ({fmt_gib(table_grad)}; DTensor's embedding "
        "backward has no vocabulary-sharded strategy)",
    ]
    if p.dp > 1:
        notes.append(
            f"the {p.dp} data-parallel replicas add no buffers here (--sharding none: gradients all-reduced in "
            "place); DDP over DTensors is not modelled (--sharding fsdp: 2-D FSDP2×TP is)"
        )
    if p.sequence_parallel:
        notes.append(_SP_NOTE)
    return phases, notes


_SP_NOTE = (
    "sequence parallelism splits the norms' saved tensors; each matmul saves its all-gathered input "
    "(unlike Megatron, which re-gathers it in backward)"
)


def _tp_inputs(spec: ModelSpec, strategy: Strategy, p: ParallelPlan) -> tuple[StepInputs, int, int]:
    """(the single-GPU step inputs of one DTensor TP rank — see :func:`_torch_tp` —, the whole token table's
    gradient bytes, the rank's vocabulary rows)."""
    from trainfit.analytic.states import model_states

    tp = p.tp
    local = dtensor_tp_spec(spec, tp)
    q = step_inputs(local, strategy, keep_logits=False)
    vocab_rows = -(-spec.vocab_size // tp)
    st = model_states(dataclasses.replace(local, vocab_size=vocab_rows), strategy)
    gbits = strategy.recipe.grad_bits
    table_grad = _alloc(spec.vocab_size * spec.hidden_size, gbits)
    st = dataclasses.replace(st, grads_bytes=st.grads_bytes - _alloc(vocab_rows * spec.hidden_size, gbits) + table_grad)
    head_copy = _alloc(vocab_rows * spec.hidden_size, strategy.recipe.compute_bits) if strategy.recipe.autocast else 0
    # Gathering the logits (Shard(-1) → Replicate): all-gather on dim 0 into a whole-size buffer, then chunk
    # and cat onto the vocabulary dim (torch/distributed/_functional_collectives.py ``all_gather_single``,
    # ``_maybe_view_chunk_cat``), while the rank's own slice is still referenced: 2·t·V + t·⌈V/tp⌉ elements
    # in the logits' dtype. The worse of that and the loss's own peak (it is, in fp32).
    t, cbits = strategy.tokens_per_micro_batch, strategy.recipe.compute_bits
    gather = 2 * _alloc(t * spec.vocab_size, cbits) + _alloc(t * vocab_rows, cbits)
    q = dataclasses.replace(
        q,
        states=st,
        resident=dataclasses.replace(
            q.resident, weights=st.weights_bytes, master_weights=st.master_bytes, optimizer_states=st.optimizer_bytes
        ),
        grads_resident=st.grads_bytes if strategy.grad_accum > 1 else 0,
        grad_head=vocab_rows * spec.hidden_size * gbits // 8,
        grad_late=spec.vocab_size * spec.hidden_size * gbits // 8,
        copies_all=st.autocast_copies_bytes,
        copies_head=head_copy,
        copies_fwd_ckpt=st.autocast_copies_bytes if spec.autocast_weight_cache else head_copy,
        logits_forward=max(q.logits_forward, gather),
    )
    if p.sequence_parallel:
        layer_cut, final_cut = _sp_saved_bytes(local, strategy, tp)
        a = q.stack
        n = spec.num_layers
        stack = dataclasses.replace(
            a,
            variants=tuple(dataclasses.replace(v, saved_bytes=v.saved_bytes - layer_cut) for v in a.variants),
            all_layers_bytes=a.all_layers_bytes - n * layer_cut,
            max_layer_bytes=a.max_layer_bytes - layer_cut,
            per_kind_bytes={k: v - layer_cut for k, v in a.per_kind_bytes.items()},
            model_bytes=a.model_bytes - final_cut,
        )
        # A checkpointed segment keeps its input: the residual stream, a Shard(1) DTensor under SP.
        q = dataclasses.replace(q, stack=stack, norm_temp=q.norm_temp // tp, kept_inputs=q.kept_inputs // tp)
    return q, table_grad, vocab_rows


def dtensor_tp_held_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """The model whose parameter inventory is one TP rank's local tensors: :func:`dtensor_tp_spec` with
    ⌈V/tp⌉ vocabulary rows (``ColwiseParallel`` local weights ``[out/tp, in]``, ``RowwiseParallel``
    ``[out, in/tp]``, the inventory's ``(out, in)`` shapes; norms whole)."""
    return dataclasses.replace(dtensor_tp_spec(spec, tp), vocab_size=-(-spec.vocab_size // tp))


def _fsdp_tp(spec: ModelSpec, strategy: Strategy, p: ParallelPlan) -> tuple[tuple[PhaseBreakdown, ...], list[str]]:
    """One rank of 2-D FSDP2 × DTensor TP (torchtitan's ``parallelize_llama``: ``apply_tp``, then
    ``fully_shard`` per layer and root over the ``dp`` mesh dimension). FSDP2 shards a DTensor parameter's
    *local* tensor on dim 0 over the dp ranks (_fsdp_param.py ``_init_sharding_spec_tp`` returns
    ``param._local_tensor``; ``_init_sharded_param`` chunks it with ``_chunk_with_empty`` and pads to
    ⌈dim0/dp⌉ rows): each TP-local tensor of :func:`dtensor_tp_held_spec` gets FSDP2's rules
    (:func:`_fsdp`: sharded fp32 states under the policy, the unsharded root plus the current and the
    prefetched layer — each at its TP-local size —, the all-gather and reduce-scatter buffers), and the
    activations, logits gather and whole token-table gradient are DTensor TP's (:func:`_tp_inputs`) under
    FSDP2's compute dtype."""
    cs = compute_strategy(strategy, casts_every_param=strategy.recipe.mixed)
    q, table_grad, vocab_rows = _tp_inputs(spec, cs, p)
    # The embedding's backward computes the whole table's gradient, then redistributes it Replicate → Shard(0)
    # into a copy of the rank's ⌈V/tp⌉ rows (DTensor ``Shard._split_tensor``/``_local_shard``), which FSDP2's
    # post-backward reduce-scatters; the whole one is freed after the copy.
    table_copy = _alloc(vocab_rows * spec.hidden_size, cs.recipe.grad_bits)
    phases, notes = _fsdp(spec, strategy, p, q=q, held_spec=dtensor_tp_held_spec(spec, p.tp), table_copy=table_copy)
    tp = p.tp
    notes = [
        f"2-D FSDP2 × DTensor TP {tp}{' + SP' if p.sequence_parallel else ''}: TP first ({spec.num_heads // tp} of "
        f"{spec.num_heads} heads, {spec.intermediate_size // tp} of {spec.intermediate_size} MLP columns, "
        f"{vocab_rows:,} of {spec.vocab_size:,} vocabulary rows per TP rank), then FSDP2 shards each TP-local "
        f"tensor on dim 0 over the {p.dp} data-parallel ranks",
        *notes,
        f"the token table's gradient is computed whole on every rank ({fmt_gib(table_grad)} in the compute dtype; "
        "DTensor's embedding backward has no vocabulary-sharded strategy) before the root's reduce-scatter",
    ]
    if p.sequence_parallel:
        notes.append(_SP_NOTE)
    return phases, notes


#: The closed forms of recent (spec, effective strategy) pairs: the planner asks for a candidate's lower bound
#: (:func:`trainfit.planner.search.lower_bound_bytes`, no allocator) and then its estimate (with one, sometimes two
#: allocators) — the same phases each time.
_CLOSED: Memo[tuple[ParallelPlan, tuple[PhaseBreakdown, ...], tuple[RankMemory, ...], tuple[str, ...], str]] = Memo(512)


def _closed_form(
    spec: ModelSpec, strategy: Strategy
) -> tuple[ParallelPlan, tuple[PhaseBreakdown, ...], tuple[RankMemory, ...], tuple[str, ...], str]:
    """(the plan, the worst rank's phases, every stage's memory when they differ, notes, why that rank) of
    ``strategy`` (already :func:`~trainfit.analytic.activations.effective_strategy`'s), memoized."""
    return _CLOSED.get((spec_key(spec), strategy), lambda: _closed_form_of(spec, strategy))


def _closed_form_of(
    spec: ModelSpec, strategy: Strategy
) -> tuple[ParallelPlan, tuple[PhaseBreakdown, ...], tuple[RankMemory, ...], tuple[str, ...], str]:
    p = plan(spec, strategy)
    ranks: tuple[RankMemory, ...] = ()
    if p.engine is Engine.MEGATRON:
        phases, ranks, notes = _megatron(spec, strategy, p)
        why = (
            f"worst rank: pipeline stage {_worst_stage(ranks)} ("
            + (
                "the first stage holds the most micro-batches in flight"
                if _worst_stage(ranks) == 0
                else "the last stage holds the head and the logits"
            )
            + ")"
            if ranks
            else "every rank holds the same"
        )
    elif p.engine is Engine.TORCH and p.tp > 1 and p.sharding is Sharding.FSDP:
        phases, notes = _fsdp_tp(spec, strategy, p)
        why = "every rank holds the same; rank 0 has the largest vocabulary shard and ⌈dim0/dp⌉-row FSDP2 shards"
    elif p.engine is Engine.TORCH and p.tp > 1:
        phases, notes = _torch_tp(spec, strategy, p)
        why = "every rank of the tensor-parallel group holds the same (rank 0 has the largest vocabulary shard)"
    elif p.engine is Engine.DEEPSPEED:
        phases, notes, ranks, zr = _deepspeed(spec, strategy, p)
        why = _zero_why(spec, strategy, p, ranks, zr)
    elif p.sharding in (Sharding.FSDP, Sharding.HSDP):
        phases, notes = _fsdp(spec, strategy, p)
        why = "every rank holds the same; uneven shards are padded to rank 0's ⌈dim0/W⌉ rows"
    else:
        phases, notes = _ddp(spec, strategy)
        why = "every rank holds a full replica"
    return p, tuple(phases), ranks, tuple(notes), why


def _zero_why(
    spec: ModelSpec, strategy: Strategy, p: ParallelPlan, ranks: tuple[RankMemory, ...], zr: ZeroRank | None
) -> str:
    """Which DeepSpeed rank is the worst, and why (``zr``: the worst rank of stages 1–2; None at stage 3)."""
    if zr is None:
        return "every rank holds the same partition size (rank 0's, the largest with padding)"
    if not ranks:
        return "every rank holds the same (equal partitions of the flat buffer, and what they meet weighs alike)"
    n = spec.num_layers
    lightest = min(r.peak_bytes for r in ranks)
    worst = max(r.peak_bytes for r in ranks)
    head = (
        # the difference, not the two peaks: these are before the cuBLAS workspaces estimate() adds to every rank
        # (with_workspaces), so peaks here read 0.06 GiB under the per-rank table; a difference is unchanged by them
        f"worst rank: {zr.rank} of {p.dp} ({fmt_gib(worst - lightest)} more than the lightest): ZeRO "
        "partitions are equal, but what a rank holds besides depends on the parameters its partition meets"
    )
    if strategy.offload.optimizer_on_host:
        return (
            head + f" — its largest slice ({zr.largest_slice:,} elements) goes to the host through an fp64 norm copy "
            "when the reduction reaches it"
        )
    at = zr.buffer_at
    if at == 0:
        when = "at the start of backward (the LM head's reduction)"
    elif at > n:
        when = "after the layers' backward"
    else:
        when = f"in layer {n - at}'s backward"
    return (
        head
        + f" — its gradient buffer holds all {len(zr.slices)} whole ({zr.whole_numel:,} elements), made {when}"
        + ("; its step flattens the slices into a copy" if zr.step_copies else "")
    )


def _flatten_note(spec: ModelSpec, strategy: Strategy, p: ParallelPlan, device_bytes: int | None) -> str:
    """Where DeepSpeed ZeRO-1/2 makes its flat 16-bit groups at init, for the reserve note ('' for the others)."""
    if p.engine is not Engine.DEEPSPEED or p.sharding is Sharding.ZERO3:
        return ""
    from trainfit.analytic.rank_events import Zero2Hooks  # imports this module

    z = Zero2Hooks(spec, strategy, p)
    if device_bytes is None:
        return (
            "; DeepSpeed's flat 16-bit groups made from host copies (the GPU's free memory at init is not known: "
            "give --gpu)"
        )
    z.free_device_bytes = device_bytes - z.model_bytes()
    if z.flattens_on_device():
        return (
            "; DeepSpeed flattens the 16-bit groups on the GPU, beside the model's own parameter tensors "
            f"({fmt_gib(z.free_device_bytes)} free after the model)"
        )
    return f"; DeepSpeed flattens the 16-bit groups from host copies (only {fmt_gib(z.free_device_bytes)} free)"


# -- the entry point -------------------------------------------------------------------------------------


def estimate_parallel(
    spec: ModelSpec,
    strategy: Strategy,
    *,
    allocator: AllocatorConfig | None = None,
    workspaces: tuple[Workspace, ...] = (),
    capacity_bytes: int | None = None,
    stop_above_bytes: int | None = None,
    device_bytes: int | None = None,
) -> MemoryReport:
    """Per-rank peak allocated memory (the worst rank's phases; every stage in ``ranks`` when they differ)
    and host memory per node, for ``strategy``'s parallel setup. Reserved memory: with ``allocator`` given,
    torch DDP and FSDP2 ranks, DeepSpeed ZeRO ranks (16-bit AdamW; ZeRO-Offload at stages 1–3), DTensor TP ranks
    (± SP; 2-D FSDP2×TP too) and Megatron TP/SP/PP ranks (1F1B, interleaved or GPipe; the worst stage) replay their
    event stream through the caching-allocator simulation (:mod:`trainfit.analytic.rank_events`, with the GPU's cuBLAS
    ``workspaces``); other setups, and calls without ``allocator``, keep the fixed fraction of
    :func:`trainfit.overhead.overhead_for`. ``capacity_bytes``: the allocator's share of the GPU; when only a
    simulated rank's uncapped reserve exceeds it, its stream runs once more under it (``MemoryReport.capped``).
    ``stop_above_bytes``: a simulated stream stops once its reserved bytes pass it (``MemoryReport.reserve_stopped``:
    the reserve is then a lower bound; for callers that only ask whether it fits). ``device_bytes``: the GPU's memory
    less what is used outside the allocator — whether DeepSpeed ZeRO-1/2 flattens its 16-bit groups on the device at
    init depends on it (:meth:`~trainfit.analytic.rank_events.Zero2Hooks.weights`; None: not known, the host path)."""
    strategy, _ = effective_strategy(spec, strategy)
    p, phases, ranks, notes, why = _closed_form(spec, strategy)
    peak = max(ph.total_bytes for ph in phases)
    overhead = overhead_for(peak)
    reserve_note = "reserved: the fixed reserve fraction of the allocated peak (docs/accuracy.md)"
    capped = None
    simulated = stopped = False
    sim = (
        simulated_reserve(
            spec,
            strategy,
            peak + sum(w.size_bytes for w in workspaces),
            allocator,
            workspaces,
            p=p,
            ranks=ranks,
            capacity_bytes=capacity_bytes,
            stop_above_bytes=stop_above_bytes,
            device_bytes=device_bytes,
        )
        if allocator is not None
        else None
    )
    if sim is not None:
        simulated, stopped, capped, reserve_note = True, sim.stopped, sim.capped, sim.note
        # max_memory_allocated counts blocks: each phase's blocks above its requests, from the same simulation, as
        # one GPU's (analytic.blocks); the reserve is then taken above the larger peak, the reserved bytes unchanged
        phases, ranks, reserve = sim.rounded(phases, ranks)
        overhead = dataclasses.replace(
            overhead_for(max(ph.total_bytes for ph in phases)), allocator_reserve_bytes=reserve
        )
    st_bytes = {c: max(ph.get(c) for ph in phases) for c in (Component.WEIGHTS, Component.GRADIENTS)}
    params = inventory(spec).total
    trainable = sum(h.tensor.numel * h.count for h in held_tensors(spec, strategy) if h.trainable)
    opt = next(ph for ph in phases if ph.phase is Phase.OPTIMIZER_STEP)
    return MemoryReport(
        method=Method.ANALYTIC,
        model_name=spec.name,
        params=params,
        trainable_params=trainable,
        phases=phases,
        overhead=overhead,
        bytes_per_param=BytesPerParam(
            weights=opt.get(Component.WEIGHTS) / params,
            gradients=st_bytes[Component.GRADIENTS] / params,
            master_weights=opt.get(Component.MASTER_WEIGHTS) / params,
            optimizer_states=opt.get(Component.OPTIMIZER_STATES) / params,
        ),
        notes=(
            f"{p.world} GPUs = data {p.dp} × tensor {p.tp} × pipeline {p.pp}; engine {p.engine.value}",
            *p.defaults,
            *notes,
            why,
            reserve_note,
            f"per-rank bytes inside PyTorch's allocator; NCCL's own buffers are outside it: {nccl_basis(strategy)}",
        ),
        ranks=ranks,
        capped=capped,
        reserve_simulated=simulated,
        reserve_stopped=stopped,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulatedReserve:
    """A rank's reserve from the caching-allocator simulation of its synthesised event stream."""

    reserve_bytes: int  # the stream's reserved peak above ``held_bytes`` (≥ 0)
    peak_reserved_bytes: int  # the stream's own reserved peak
    stream_peak_allocated_bytes: int  # the stream's own allocated peak (workspaces included)
    stopped: bool  # the stream stopped above ``stop_above_bytes``: the reserve is a lower bound
    capped: CappedRun | None  # the same stream under ``capacity_bytes`` when borderline (capped_run)
    note: str  # where the reserve comes from, for the report's notes
    #: Per phase, the stream's blocks above its requests at the steady state (``Component.ALLOCATOR_ROUNDING``;
    #: rank_events.simulate_rank_with_rounding; none for a Megatron stage)
    rounding: tuple[tuple[Phase, int], ...] = ()

    def rounded(
        self, phases: tuple[PhaseBreakdown, ...], ranks: tuple[RankMemory, ...]
    ) -> tuple[tuple[PhaseBreakdown, ...], tuple[RankMemory, ...], int]:
        """``phases`` (the worst rank's, whose peak the reserve was taken above) and ``ranks`` with the stream's
        blocks above its requests as each phase's ``Component.ALLOCATOR_ROUNDING`` — ``max_memory_allocated`` counts
        blocks, as one GPU's (analytic.blocks) — and the reserve above the larger peak: the reserved bytes do not
        change. The simulated rank is the worst one; the others listed beside it differ in what their partitions
        hold, not in how the allocator serves the layers' tensors, so each takes its rounding (their own streams are
        not simulated) and the ranks still differ by their tensors alone."""
        by_phase = dict(self.rounding)
        if not any(by_phase.values()):
            return phases, ranks, self.reserve_bytes

        def rounded(breakdown: tuple[PhaseBreakdown, ...]) -> tuple[PhaseBreakdown, ...]:
            return tuple(
                dataclasses.replace(
                    ph, components={**ph.components, Component.ALLOCATOR_ROUNDING: by_phase.get(Phase(ph.phase), 0)}
                )
                for ph in breakdown
            )

        out = rounded(phases)
        grown = max(ph.total_bytes for ph in out) - max(ph.total_bytes for ph in phases)
        ranks = tuple(dataclasses.replace(r, phases=rounded(r.phases)) for r in ranks)
        return out, ranks, max(0, self.reserve_bytes - grown)


def simulated_reserve(
    spec: ModelSpec,
    strategy: Strategy,
    held_bytes: int,
    allocator: AllocatorConfig,
    workspaces: tuple[Workspace, ...] = (),
    *,
    p: ParallelPlan | None = None,
    ranks: tuple[RankMemory, ...] = (),
    capacity_bytes: int | None = None,
    stop_above_bytes: int | None = None,
    device_bytes: int | None = None,
) -> SimulatedReserve | None:
    """The reserve above ``held_bytes`` (an allocated peak, workspaces included: this module's closed form or a
    traced rank's) of the rank that :func:`~trainfit.analytic.rank_events.rank_simulated` names, from its event
    stream through the caching-allocator simulation; None for the setups that keep the fixed fraction.
    ``p``, ``ranks``: the closed form's plan and per-stage ranks (the worst stage's stream is simulated; None:
    computed here); the other arguments as :func:`estimate_parallel`'s."""
    from trainfit.analytic.rank_events import (  # imports this module
        rank_simulated,
        simulate_rank,
        simulate_rank_with_rounding,
    )

    if p is None:
        strategy, _ = effective_strategy(spec, strategy)
        p, _, ranks, _, _ = _closed_form(spec, strategy)
    if not rank_simulated(strategy, p):
        return None
    stage = _worst_stage(ranks) if ranks else 0
    dp_rank = 0
    if p.engine is Engine.DEEPSPEED:  # ranks: ZeRO-1/2's distinct data-parallel ranks, not pipeline stages
        stage, dp_rank = 0, ranks[stage].ranks[0] if ranks else 0
    sim, rounding = simulate_rank_with_rounding(
        spec,
        strategy,
        p,
        allocator,
        workspaces,
        stage=stage,
        stop_above_bytes=stop_above_bytes,
        device_bytes=device_bytes,
        dp_rank=dp_rank,
    )
    reserve = max(0, sim.peak_reserved_bytes - held_bytes)
    capped = capped_run(
        lambda c: simulate_rank(
            spec,
            strategy,
            p,
            allocator,
            workspaces,
            stage=stage,
            capacity_bytes=c,
            device_bytes=device_bytes,
            dp_rank=dp_rank,
        ),
        sim,
        held_bytes=held_bytes,
        reserve_bytes=reserve,
        capacity_bytes=capacity_bytes,
    )
    order = strategy.parallelism.pipeline_schedule.value
    return SimulatedReserve(
        reserve_bytes=reserve,
        peak_reserved_bytes=sim.peak_reserved_bytes,
        stream_peak_allocated_bytes=sim.peak_allocated_bytes,
        stopped=sim.stopped,
        capped=capped,
        rounding=tuple(rounding.items()),
        note=(
            "reserved: this rank's event stream"
            + (f" (pipeline stage {stage}, the {order} order)" if ranks and p.engine is Engine.MEGATRON else "")
            + (f" (rank {dp_rank})" if ranks and p.engine is Engine.DEEPSPEED else "")
            + f" through the caching-allocator simulation (peak reserved {fmt_gib(sim.peak_reserved_bytes)})"
            + _flatten_note(spec, strategy, p, device_bytes)
        ),
    )


def _worst_stage(ranks: tuple[RankMemory, ...]) -> int:
    best = max(range(len(ranks)), key=lambda i: ranks[i].peak_bytes)
    return best


#: NCCL's buffers outside PyTorch's allocator, measured with a one-rank NCCL group on the H200
#: (DESIGN §4.1: +67 MiB under FSDP2, +557 MiB after DDP). Not measured for DeepSpeed, Megatron or DTensor TP
#: without FSDP2 (0).
NCCL_FSDP_BYTES = 67 * MiB
NCCL_DDP_BYTES = 557 * MiB
#: The shared NET P2P buffer NCCL 2.28 allocates for a one-rank communicator (NVIDIA/nccl issue 2363, "Failed to
#: CUDA calloc 536870912 bytes"): possibly most of DDP's one-rank figure (:func:`nccl_is_lower_bound`). Not counted.
NCCL_ONE_RANK_SHARED_BYTES = 512 * MiB
#: NCCL's documented default for NCCL_BUFFSIZE, "the size of the buffer used by NCCL when communicating data between
#: pairs of GPUs" (NCCL user guide, Environment Variables): what a world size above 1 adds per connected peer and
#: channel — the channels and peers depend on the topology and algorithm NCCL picks, so it is named, not counted.
NCCL_BUFFSIZE_BYTES = 4 * MiB


def _nccl_kind(strategy: Strategy) -> str | None:
    """Which one-rank measurement stands for ``strategy``'s NCCL buffers: "FSDP2" (FSDP2, HSDP, 2-D FSDP2×TP), "DDP"
    (torch DDP), or None (none measured: DeepSpeed, Megatron-LM, DTensor TP without FSDP2, one GPU)."""
    if not strategy.is_distributed or resolve_engine(strategy) is not Engine.TORCH:
        return None
    if strategy.sharding in (Sharding.FSDP, Sharding.HSDP):
        return "FSDP2"
    if strategy.parallelism.tensor > 1:
        return None
    return "DDP"


def nccl_bytes(strategy: Strategy) -> int:
    """NCCL's own device buffers for ``strategy`` (outside the allocator): the one-rank H200 measurement of its
    framework (DESIGN §4.1), whatever the world size; 0 where none was measured (:func:`nccl_basis` says which)."""
    kind = _nccl_kind(strategy)
    return 0 if kind is None else NCCL_FSDP_BYTES if kind == "FSDP2" else NCCL_DDP_BYTES


def nccl_basis(strategy: Strategy) -> str:
    """Where :func:`nccl_bytes`' figure comes from, for ``strategy``'s engine and world size, in one sentence (empty
    on one GPU without a process group)."""
    if not strategy.is_distributed:
        return ""
    w = strategy.world_size
    kind = _nccl_kind(strategy)
    if kind is None:
        engine = resolve_engine(strategy)
        who = {Engine.DEEPSPEED: "DeepSpeed", Engine.MEGATRON: "Megatron-LM"}.get(engine, "DTensor tensor parallelism")
        return f"NCCL's buffers not counted (0): not measured for {who}"
    figure = NCCL_FSDP_BYTES if kind == "FSDP2" else NCCL_DDP_BYTES
    said = (
        f"NCCL {figure // MiB} MiB: measured under {'FSDP2' if kind == 'FSDP2' else 'torch DDP'} with a one-rank NCCL "
        "process group on an H200 (DESIGN §4.1)"
    )
    if w == 1:
        return said
    peers = (
        f"with peers NCCL also allocates a buffer per connected pair of GPUs and channel (NCCL_BUFFSIZE, "
        f"{NCCL_BUFFSIZE_BYTES // MiB} MiB by default; NCCL user guide, Environment Variables), whose count depends "
        "on the topology and is not modelled"
    )
    if nccl_is_lower_bound(strategy):
        return f"{said}, counted as it is at world size {w}: a lower bound there — {peers}"
    return (
        f"{said}, counted as it is at world size {w}: not a bound either way there — {peers}, while up to "
        f"{NCCL_ONE_RANK_SHARED_BYTES // MiB} MiB of the one-rank figure may be the shared P2P buffer NCCL 2.28 "
        "gives a one-rank communicator, which a larger group need not have (NVIDIA/nccl issue 2363)"
    )


def nccl_is_lower_bound(strategy: Strategy) -> bool:
    """Whether :func:`nccl_bytes`' one-rank figure is a lower bound for ``strategy``'s world size: at world size 1 it
    is the measurement; above it, FSDP2's 67 MiB is (peers only add buffers), torch DDP's 557 MiB is not known to
    be — 512 MiB of it may be NCCL 2.28's shared P2P buffer of a one-rank communicator (NVIDIA/nccl issue 2363: a
    singleton group's first all-reduce callocs 536870912 bytes; PR 2366 skips it when ``nRanks == 1``), a buffer a
    group with peers need not allocate. False where nothing is counted."""
    kind = _nccl_kind(strategy)
    return kind is not None and (strategy.world_size == 1 or kind == "FSDP2")


def data_parallel_degree(gpus: int, tp: int, pp: int) -> int:
    """gpus / (tp·pp), refusing a world size that is not a multiple of tp·pp."""
    if gpus % (tp * pp):
        raise StrategyError(f"--gpus {gpus} is not a multiple of --tp {tp} × --pp {pp} = {tp * pp}")
    return gpus // (tp * pp)


__all__ = [
    "SP_SPLIT_PREFIXES",
    "FsdpGroups",
    "HeldTensor",
    "MegatronInputs",
    "ParallelPlan",
    "ShardedStates",
    "SimulatedReserve",
    "ZeroPartition",
    "check_options",
    "check_parallel_finetune",
    "compute_strategy",
    "data_parallel_degree",
    "ddp_bucket_bytes",
    "deepspeed_flat_layout",
    "deepspeed_flatten_copies",
    "deepspeed_partition_numel",
    "dtensor_tp_held_spec",
    "estimate_parallel",
    "first_stage_embeddings",
    "fsdp_groups",
    "fsdp_no_sync_grad_bytes",
    "fsdp_states",
    "fsdp_wire_bits",
    "held_tensors",
    "in_flight_chunks",
    "in_flight_microbatches",
    "in_flight_note",
    "inapplicable_options",
    "last_stage_heads",
    "megatron_init_bytes",
    "megatron_inputs",
    "nccl_basis",
    "nccl_bytes",
    "nccl_is_lower_bound",
    "plan",
    "resident_floor_bytes",
    "resolve_engine",
    "shard_tensor",
    "simulated_reserve",
    "tp_local_spec",
    "zero_partition",
]
