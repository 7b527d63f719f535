"""Many GPUs: the memory of each rank (and of each host) under data, tensor and pipeline parallelism,
sharded states and CPU offload, for the frameworks people use. Torch-free.

The single-GPU model (:mod:`trainfit.analytic.model`) stays the one source of the activation, logits and
backward-temporary arithmetic; this module changes *which* tensors a rank holds and adds what the
frameworks add. Four engines, each with its own rules (:class:`~trainfit.strategy.Engine`):

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
  from its forward to its backward (DESIGN §4.3). In backward, a layer's bf16 gradients are reduced
  through an fp32 reduce-scatter input of its padded size (``_fsdp_collectives.py`` ``foreach_reduce``).
  HSDP shards within ``gpus_per_node`` ranks and replicates across nodes.
* **DeepSpeed ZeRO** (``--sharding zero1|zero2|zero3``): 16-bit parameters and gradients, fp32 master
  weights and Adam states partitioned over the data-parallel group (Rajbhandari et al. 2020, §5). Stages
  1–2 flatten all parameters into one buffer padded to a multiple of 2·W elements and give each rank a
  1/W slice (deepspeed/runtime/zero/stage_1_and_2.py ``DeepSpeedZeroOptimizer.__init__``,
  ``nccl_start_alignment_factor``); stage 2 keeps its gradient partition in ``grads_in_partition`` and, with
  ``contiguous_gradients``, reduces through an ``ipg_buffer`` of ``reduce_bucket_size`` elements (two with
  ``overlap_comm``) during backward; the step casts the gradient partition to fp32. Stage 3 partitions
  each parameter to ⌈numel/W⌉ (zero/partition_parameters.py ``_partition_param``), keeps parameters under
  ``param_persistence_threshold`` (1e5) whole, a persistent ``reduce_bucket_size`` gradient bucket
  (zero/stage3.py ``__ipg_bucket_flat_buffer``), and fetches the module being run plus up to
  ``stage3_prefetch_bucket_size`` elements ahead (zero/partitioned_param_coordinator.py).
* **Megatron-LM** (``--tp``, ``--pp``, ``--sharding zero1`` = the distributed optimizer): bf16 parameters,
  fp32 main gradients in the persistent contiguous grad buffer (``accumulate_allreduce_grads_in_fp32`` is
  forced for bf16), fp32 master weights and Adam states: 18 B/param, or 6 + 12/d with the distributed
  optimizer (megatron/training/theoretical_memory_usage.py ``compute_weight_and_optimizer_memory``).
  Tensor parallelism splits attention heads, k/v groups, the MLP width and the (padded) vocabulary over
  ``tp`` ranks; without sequence parallelism the norm and residual activations stay replicated, with it
  every activation is divided by ``tp`` (Korthikanti et al. 2022, Table 2: sbh(10 + 24/t) vs sbh·34/t).
  Pipeline parallelism gives each stage L/pp layers, the embedding to the first and the final norm, head
  and logits to the last; a stage holds the activations of the micro-batches in flight: 1F1B
  min(pp − s, m), interleaved (pp − s − 1)·2 + (v − 1)·pp + 1 chunk-micro-batches of L/(pp·v) layers
  (megatron/core/pipeline_parallel/schedules.py ``forward_backward_pipelining_with_interleaving``,
  ``num_warmup_microbatches``), GPipe m.

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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from trainfit.analytic.activations import effective_strategy
from trainfit.analytic.model import (
    Moment,
    MomentName,
    StepInputs,
    backward_moments,
    forward_moments,
    optimizer_step_moment,
    step_inputs,
)
from trainfit.analytic.states import optimizer_state_bytes
from trainfit.arch.params import inventory
from trainfit.arch.spec import ModelSpec, ParamTensor
from trainfit.cuda_facts import allocator_bytes
from trainfit.errors import StrategyError
from trainfit.overhead import overhead_for
from trainfit.result import (
    BytesPerParam,
    Component,
    MemoryReport,
    Method,
    Phase,
    PhaseBreakdown,
    RankMemory,
)
from trainfit.strategy import (
    Engine,
    OffloadTarget,
    Optimizer,
    OptimizerImpl,
    PipelineSchedule,
    Precision,
    Sharding,
    Strategy,
)
from trainfit.units import MiB, fmt_gib

#: DeepSpeed ``stage3_param_persistence_threshold`` default: smaller parameters are never partitioned.
DS_PERSISTENCE_THRESHOLD = 100_000
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
    """``auto``: megatron with TP/PP, deepspeed for zero*, torch otherwise (ddp, fsdp, hsdp)."""
    e = strategy.engine.engine
    if e is not Engine.AUTO:
        return e
    par, sh = strategy.parallelism, strategy.sharding
    if par.tensor > 1 or par.pipeline > 1:
        return Engine.MEGATRON
    if sh in (Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3):
        return Engine.DEEPSPEED
    return Engine.TORCH


def plan(spec: ModelSpec, strategy: Strategy) -> ParallelPlan:
    """Validate the combination (one-line :class:`StrategyError` otherwise) and resolve the engine."""
    par, sh, _eo, off = strategy.parallelism, strategy.sharding, strategy.engine, strategy.offload
    tp, pp, dp = par.tensor, par.pipeline, par.data
    engine = resolve_engine(strategy)
    if strategy.beyond_single_gpu_training() and not strategy.trains_every_weight:
        raise StrategyError(
            "many GPUs are modelled for full fine-tuning; adapters with sharding: trainfit does not model yet"
        )
    if strategy.workload.value != "training" or strategy.savers.any or not strategy.base_weights.is_default:
        raise StrategyError(
            "many GPUs are modelled for a full-precision training step; this setup: trainfit does not model yet"
        )
    if off.activations:
        raise StrategyError("activation offload is not modelled; use --offload none|optimizer|optimizer+params")
    if off.optimizer is OffloadTarget.NVME or off.parameters is OffloadTarget.NVME:
        raise StrategyError("NVMe offload is not modelled; --offload moves states to CPU memory")
    if off.parameters_on_host and not off.optimizer_on_host:
        raise StrategyError("offloading parameters needs the optimizer offloaded too (--offload optimizer+params)")
    if (tp > 1 or pp > 1) and engine is not Engine.MEGATRON:
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
    if engine is Engine.DEEPSPEED:
        if sh not in (Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3):
            raise StrategyError(f"--engine deepspeed models --sharding zero1|zero2|zero3, not {sh.value}")
        if off.parameters_on_host and sh is not Sharding.ZERO3:
            raise StrategyError("parameter offload (ZeRO-Infinity) needs --sharding zero3")
    if engine is Engine.TORCH:
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


def _defaults(engine: Engine, strategy: Strategy) -> tuple[str, ...]:
    eo, sh = strategy.engine, strategy.sharding
    if engine is Engine.TORCH and sh in (Sharding.FSDP, Sharding.HSDP):
        mp = (
            f"MixedPrecisionPolicy(param_dtype={strategy.recipe.compute_dtype}, reduce_dtype=fp32) over fp32 shards"
            if strategy.recipe.mixed
            else "no mixed-precision policy (parameters in their own dtype)"
        )
        return (f"FSDP2 fully_shard per decoder layer + root, reshard_after_forward={eo.reshard_after_forward}, {mp}",)
    if engine is Engine.TORCH:
        return (
            f"torch DDP: bucket_cap_mb={eo.bucket_cap_mb}, first bucket {eo.first_bucket_bytes // 1024} KiB, "
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
    return (
        f"Megatron-LM: bf16 params, fp32 main grads (accumulate_allreduce_grads_in_fp32), "
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


def _compute_strategy(strategy: Strategy) -> Strategy:
    """The strategy whose single-GPU activations a 16-bit-compute framework run has: layers in bf16 over
    16-bit parameters, no autocast (FSDP2's param_dtype, DeepSpeed's and Megatron's bf16 modules)."""
    if strategy.recipe.compute_bits == 32:
        return dataclasses.replace(strategy, precision=Precision.FP32)
    return dataclasses.replace(strategy, precision=Precision.PURE_BF16)


def _moments(q: StepInputs) -> dict[Phase, list[Moment]]:
    return {
        Phase.FORWARD: forward_moments(q),
        Phase.BACKWARD: backward_moments(q),
        Phase.OPTIMIZER_STEP: [optimizer_step_moment(q)],
    }


Adjust = Callable[[Moment], dict[Component, int]]


def _worst(q: StepInputs, adjust: Adjust, host: dict[Component, int]) -> tuple[PhaseBreakdown, ...]:
    """Each phase's worst moment after ``adjust`` maps a single-GPU moment to this rank's components."""
    out = []
    for ph, ms in _moments(q).items():
        best = max((adjust(m) for m in ms), key=lambda c: sum(c.values()))
        out.append(PhaseBreakdown(phase=ph, components=_full(best), host_components=dict(host)))
    return tuple(out)


def _full(parts: dict[Component, int]) -> dict[Component, int]:
    base = dict.fromkeys(Component, 0)
    for c, n in parts.items():
        base[c] = base.get(c, 0) + max(0, n)
    return base


def _single(m: Moment) -> dict[Component, int]:
    return dict(m.components())


# -- sharded states --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardedStates:
    """One rank's resident model states (bytes) and the step's temporaries."""

    weights_bytes: int
    grads_bytes: int
    master_bytes: int
    optimizer_bytes: int
    step_temp_bytes: int


def fsdp_states(spec: ModelSpec, strategy: Strategy, shards: int) -> ShardedStates:
    """FSDP2 shards: each parameter padded to ⌈dim0/W⌉ rows on the rank; fp32 under the mixed-precision
    policy (the shard is the master weight), gradients in the shard's dtype, optimizer states like the shard
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py; torch/optim/adamw.py ``_init_group``)."""
    r = strategy.recipe
    bits = 32 if strategy.recipe.mixed else r.weight_bits
    inv = inventory(spec)
    impl = strategy.optimizer_impl
    w = g = o = 0
    largest = 0
    for t, m in inv.all_tensors():
        s = shard_tensor(t, shards)
        w += m * _alloc(s.numel, bits)
        g += m * _alloc(s.numel, bits)
        o += m * optimizer_state_bytes(s, strategy.optimizer, bits, impl)
        largest = max(largest, s.numel)
    temp = 0
    if strategy.optimizer is Optimizer.ADAMW and impl is OptimizerImpl.FOREACH:
        temp = g
    elif strategy.optimizer is Optimizer.LION:
        temp = 2 * _alloc(largest, bits)
    return ShardedStates(weights_bytes=w, grads_bytes=g, master_bytes=0, optimizer_bytes=o, step_temp_bytes=temp)


def _unsharded_bytes(tensors: Sequence[tuple[ParamTensor, int]], bits: int) -> int:
    return sum(m * _alloc(t.numel, bits) for t, m in tensors)


# -- torch DDP -------------------------------------------------------------------------------------------


def ddp_bucket_bytes(spec: ModelSpec, grad_bits: int, cap_bytes: int, first_bytes: int) -> list[int]:
    """DDP's buckets: parameters in reverse order, a bucket closes once it holds ≥ its limit (the first
    1 MiB, then ``bucket_cap_mb``); one flat gradient-dtype tensor each (c10d/reducer.cpp
    ``compute_bucket_assignment_by_size``; torch/nn/parallel/distributed.py ``_DEFAULT_FIRST_BUCKET_BYTES``)."""
    inv = inventory(spec)
    order: list[ParamTensor] = list(inv.model_tensors[:1])  # the token table comes first in module order
    for g in inv.layers:
        order += [t for _ in range(g.count) for t in g.tensors]
    order += list(inv.model_tensors[1:])
    buckets: list[int] = []
    size = 0
    limit = first_bytes
    for t in reversed(order):
        size += t.numel * grad_bits // 8
        if size >= limit:
            buckets.append(size)
            size, limit = 0, cap_bytes
    if size:
        buckets.append(size)
    return [allocator_bytes(b) for b in buckets]


def _ddp(spec: ModelSpec, strategy: Strategy) -> tuple[tuple[PhaseBreakdown, ...], list[str]]:
    q = step_inputs(spec, strategy, keep_logits=False)
    eo = strategy.engine
    buckets = ddp_bucket_bytes(spec, strategy.recipe.grad_bits, eo.bucket_cap_mb * 1024 * 1024, eo.first_bucket_bytes)
    total = sum(buckets)

    def adjust(m: Moment) -> dict[Component, int]:
        c = _single(m)
        if eo.gradient_as_bucket_view:
            c[Component.GRADIENTS] = total  # the gradients are views of the buckets, which never go away
        else:
            c[Component.COMM_BUFFERS] = total
        return c

    notes = [
        f"DDP: {len(buckets)} gradient buckets of {fmt_gib(total)} in all, resident from construction"
        + (" (the gradients are views of them)" if eo.gradient_as_bucket_view else " on top of the gradients")
    ]
    return _worst(q, adjust, {}), notes


# -- torch FSDP2 -----------------------------------------------------------------------------------------


def _fsdp(spec: ModelSpec, strategy: Strategy, p: ParallelPlan) -> tuple[tuple[PhaseBreakdown, ...], list[str]]:
    cs = _compute_strategy(strategy)
    q = step_inputs(spec, cs, keep_logits=False)
    st = fsdp_states(spec, strategy, p.shard)
    inv = inventory(spec)
    cbits = cs.recipe.compute_bits
    mixed = strategy.recipe.mixed
    sbits = 32 if mixed else strategy.recipe.weight_bits
    root = _unsharded_bytes([(t, 1) for t in inv.model_tensors], cbits)
    layer = max(_unsharded_bytes([(t, 1) for t in g.tensors], cbits) for g in inv.layers)
    layers_all = sum(g.count * _unsharded_bytes([(t, 1) for t in g.tensors], cbits) for g in inv.layers)
    # The reduce-scatter input of one layer: its padded size in the reduce dtype (fp32 under the policy).
    rs = max(
        allocator_bytes(sum(shard_tensor(t, p.shard).numel * p.shard for t in g.tensors) * sbits // 8)
        for g in inv.layers
    )
    # One layer's padded all-gather output in the compute dtype: FSDP2 keeps the last all-gather result
    # (``comm_ctx.all_gather_state``) until the next copy-out or the root's post-forward
    # (_fsdp_param_group.py ``wait_for_unshard``), so it is alive through the loss, and the last layer's
    # unshard is in flight when backward starts.
    ag = max(
        allocator_bytes(sum(shard_tensor(t, p.shard).numel * p.shard for t in g.tensors) * cbits // 8)
        for g in inv.layers
    )
    # The root's reduce-scatter at the end of backward (its post-backward): the fp32 input of its padded
    # size, while the LM head's bf16 gradient is still referenced.
    root_shard_grads = sum(_alloc(shard_tensor(t, p.shard).numel, sbits) for t in inv.model_tensors)
    rs_root = allocator_bytes(sum(shard_tensor(t, p.shard).numel * p.shard for t in inv.model_tensors) * sbits // 8)
    raf = strategy.engine.reshard_after_forward
    offload = strategy.offload.parameters_on_host
    n_layers = sum(g.count for g in inv.layers)
    g_full = max(1, q.states.grads_bytes)

    def adjust(m: Moment) -> dict[Component, int]:
        c = _single(m)
        c[Component.AUTOCAST_COPIES] = 0
        if offload:
            c[Component.WEIGHTS] = c[Component.OPTIMIZER_STATES] = c[Component.MASTER_WEIGHTS] = 0
        else:
            c[Component.WEIGHTS], c[Component.MASTER_WEIGHTS] = st.weights_bytes, 0
            c[Component.OPTIMIZER_STATES] = st.optimizer_bytes
        frac = min(1.0, m.gradients / g_full)
        c[Component.GRADIENTS] = 0 if offload else int(st.grads_bytes * frac)
        unsharded = 0
        comm = 0
        if m.phase is Phase.FORWARD:
            unsharded = root + (0 if raf else layers_all)
            comm = ag if p.shard > 1 else 0
        elif m.name in (MomentName.BACKWARD_START, MomentName.BACKWARD_FINAL_NORM):
            unsharded = root + (layers_all if not raf else 0)
            comm = ag if p.shard > 1 and raf else 0
        elif m.name in (MomentName.BACKWARD_TOP_BLOCK, MomentName.BACKWARD_TOP_SOFTMAX):
            # the current layer and the one prefetched; its bf16 gradients feed an fp32 reduce-scatter input
            unsharded = root + (layers_all if not raf else 2 * layer)
            comm = rs
        elif m.name in (MomentName.BACKWARD_BOTTOM_BLOCK, MomentName.BACKWARD_BOTTOM_SOFTMAX):
            unsharded = root + (layer if raf else layers_all)
            comm = rs
        elif m.name is MomentName.BACKWARD_EMBEDDING:
            # inside the root's post-backward: the root is resharded, its gradients are being reduced
            comm = rs_root
            # Copy-in done, the token table's bf16 gradient is freed and the root's sharded gradients are
            # allocated (the LM head's bf16 gradient is still referenced): the later of the two moments is
            # worse when the root's shards outweigh the table's gradient (small W).
            c[Component.TEMPORARIES] += q.grad_head + max(0, q.grad_late - root_shard_grads)
            if q.grad_late > root_shard_grads:
                c[Component.GRADIENTS] -= root_shard_grads
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
        c[Component.UNSHARDED_PARAMS] = unsharded
        c[Component.COMM_BUFFERS] = comm
        return c

    host: dict[Component, int] = {}
    if offload:
        per_node = min(p.world, strategy.parallelism.gpus_per_node)
        host = {
            Component.WEIGHTS: st.weights_bytes * per_node,
            Component.GRADIENTS: st.grads_bytes * per_node,
            Component.OPTIMIZER_STATES: st.optimizer_bytes * per_node,
        }
    notes = [
        f"FSDP2 over {p.shard} ranks"
        + (f" (HSDP: replicated over {p.dp // p.shard} nodes)" if p.sharding is Sharding.HSDP else "")
        + f": {n_layers} layer groups + root; unsharded root {fmt_gib(root)}, one layer "
        f"{fmt_gib(layer, 3)} in {'bf16' if cbits == 16 else 'fp32'}"
        + ("" if raf else "; reshard_after_forward=False keeps every layer unsharded through forward and backward"),
    ]
    if mixed:
        notes.append(
            "FSDP2 mixed precision: fp32 sharded parameters (the master weights), bf16 compute, fp32 reductions; "
            "no autocast weight copies"
        )
    if offload:
        notes.append("CPUOffloadPolicy: shards, gradients and optimizer states in pinned host memory (per node)")
    return _worst(q, adjust, host), notes


# -- DeepSpeed ZeRO --------------------------------------------------------------------------------------


def deepspeed_partition_numel(spec: ModelSpec, stage: int, dp: int) -> tuple[int, int]:
    """(elements a rank's partition holds, elements kept whole on every rank). Stages 1–2: one flat buffer
    padded to a multiple of 2·dp, split evenly (stage_1_and_2.py); stage 3: each parameter padded to a
    multiple of dp, parameters under the persistence threshold kept whole (partition_parameters.py)."""
    inv = inventory(spec)
    total = inv.total
    if stage < 3:
        align = DS_ALIGNMENT_FACTOR * dp
        return -(-total // align) * align // dp, 0
    part = whole = 0
    for t, m in inv.all_tensors():
        if t.numel < DS_PERSISTENCE_THRESHOLD:
            whole += m * t.numel
        else:
            part += m * -(-t.numel // dp)
    return part, whole


def deepspeed_rank0_gradients(spec: ModelSpec, part: int) -> tuple[int, int]:
    """Stages 1–2, rank 0: (elements of every parameter whose slice of the flat buffer meets the rank's
    partition [0, part), the largest such slice). Parameters are flattened in ``model.parameters()`` order
    (embeddings, the layers, the final norm and head); ``grads_in_partition`` holds each meeting parameter's
    gradient whole (stage_1_and_2.py ``copy_grads_in_partition``: ``total_size`` sums ``numel()`` over
    ``params_in_partition``), and the step's norm reads each slice of ``averaged_gradients`` cast to fp64
    (``get_grad_norm_direct``: ``g.data.to(get_norm_dtype())``)."""
    inv = inventory(spec)
    emb = [t for t in inv.model_tensors if t.name.startswith("embed")]
    rest = [t for t in inv.model_tensors if not t.name.startswith("embed")]

    def order() -> Iterator[ParamTensor]:
        yield from emb
        for g in inv.layers:
            for _ in range(g.count):
                yield from g.tensors
        yield from rest

    offset = whole = largest = 0
    for t in order():
        if offset >= part:
            break
        whole += t.numel
        largest = max(largest, min(offset + t.numel, part) - offset)
        offset += t.numel
    return whole, largest


def _deepspeed(spec: ModelSpec, strategy: Strategy, p: ParallelPlan) -> tuple[tuple[PhaseBreakdown, ...], list[str]]:
    fp32 = strategy.recipe.compute_bits == 32
    cs = _compute_strategy(strategy)
    q = step_inputs(spec, cs, keep_logits=False)
    stage = int(strategy.sharding.value[-1])
    eo = strategy.engine
    pb = 4 if fp32 else 2  # parameter and gradient bytes
    inv = inventory(spec)
    total = inv.total
    part, whole = deepspeed_partition_numel(spec, stage, p.dp)
    off_opt, off_par = strategy.offload.optimizer_on_host, strategy.offload.parameters_on_host
    master = 0 if fp32 else 4 * part
    opt_bits = 32
    optim = 2 * part * opt_bits // 8 if strategy.optimizer is Optimizer.ADAMW else 0
    if strategy.optimizer is not Optimizer.ADAMW:
        optim = sum(
            m * optimizer_state_bytes(shard_tensor(t, p.dp), strategy.optimizer, 32, strategy.optimizer_impl)
            for t, m in inv.all_tensors()
        )
    weights = allocator_bytes(total * pb) if stage < 3 else allocator_bytes(part * pb) + allocator_bytes(whole * pb)
    bucket = allocator_bytes(eo.reduce_bucket_size * pb)
    overlap = _overlap(strategy)
    grad_part = allocator_bytes(part * pb)
    fp32_grad = 0 if fp32 else allocator_bytes(part * 4)  # the step's fp32 gradient partition
    if stage < 3:
        # Rank 0 (the trace's): the gradients of the parameters its partition meets, whole; the step first
        # takes the norm of each slice in fp64, then flattens the slices (``self.flatten``) and casts the
        # flat partition to fp32 (stage_1_and_2.py ``DeepSpeedZeroOptimizer.step``).
        whole_numel, largest_slice = deepspeed_rank0_gradients(spec, part)
        grad_part = allocator_bytes(whole_numel * pb)
        step_temp = max(allocator_bytes(8 * largest_slice), allocator_bytes(part * pb) + fp32_grad)
    else:
        step_temp = fp32_grad
    largest_module = max(t.numel for t, _ in inv.all_tensors())
    fetch = 0
    if stage == 3:
        fetch = allocator_bytes(min(total, largest_module + eo.prefetch_bucket_size) * pb)
    g_full = max(1, q.states.grads_bytes)

    def adjust(m: Moment) -> dict[Component, int]:
        c = _single(m)
        c[Component.AUTOCAST_COPIES] = 0
        c[Component.WEIGHTS] = 0 if off_par else weights
        c[Component.MASTER_WEIGHTS] = 0 if off_opt else allocator_bytes(master)
        c[Component.OPTIMIZER_STATES] = 0 if off_opt else allocator_bytes(optim)
        frac = min(1.0, m.gradients / g_full)
        comm = unsharded = 0
        if stage == 1:
            grads = int(allocator_bytes(total * pb) * frac)
            if m.name is MomentName.BACKWARD_EMBEDDING:
                comm = allocator_bytes(min(total, eo.reduce_bucket_size) * pb)  # the flattened allreduce bucket
        else:
            grads = 0 if off_opt else int(grad_part * frac)
            # The bucket is made at the first parameter gradient (``process_gradients`` → ``setup_buckets``),
            # after the loss's backward, and released at the end of backward (``_release_ipg_buffers``).
            if m.phase is Phase.BACKWARD and m.name is not MomentName.BACKWARD_START:
                comm = bucket * (2 if overlap and stage == 2 else 1)
        if stage == 3:
            comm = bucket  # persistent __ipg_bucket_flat_buffer
            if m.phase is not Phase.OPTIMIZER_STEP:
                unsharded = fetch
        if m.phase is Phase.OPTIMIZER_STEP:
            # Stage 1 too keeps only its partition's gradients after backward: at the accumulation boundary
            # ``reduce_gradients`` reduces every gradient and copies the partition's into
            # ``grads_in_partition`` (stage_1_and_2.py ``reduce_ready_partitions_and_remove_grads``).
            grads = 0 if off_opt else grad_part
            c[Component.TEMPORARIES] = 0 if off_opt else step_temp
        c[Component.GRADIENTS] = grads
        c[Component.COMM_BUFFERS] = comm
        c[Component.UNSHARDED_PARAMS] = unsharded
        return c

    host: dict[Component, int] = {}
    if off_opt:
        per_node = min(p.world, strategy.parallelism.gpus_per_node)
        host = {
            Component.MASTER_WEIGHTS: master * per_node,
            Component.OPTIMIZER_STATES: optim * per_node,
            Component.GRADIENTS: part * 4 * per_node,  # the pinned fp32 gradient partition
        }
        if off_par:
            host[Component.WEIGHTS] = part * pb * per_node
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
    return _worst(q, adjust, host), notes


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
    set: 1F1B min(pp − s, m) (Narayanan et al. 2021, §2.2); interleaved ((pp − s − 1)·2 + (v − 1)·pp + 1)
    chunks of 1/v of the stage, at most m·v (Megatron schedules.py ``num_warmup_microbatches``); GPipe m."""
    if pp == 1:
        return 1.0
    if schedule is PipelineSchedule.GPIPE:
        return float(m)
    if schedule is PipelineSchedule.INTERLEAVED:
        chunks = min((pp - stage - 1) * 2 + (v - 1) * pp + 1, m * v)
        return chunks / v
    return float(min(pp - stage, m))


def _megatron(
    spec: ModelSpec, strategy: Strategy, p: ParallelPlan
) -> tuple[tuple[PhaseBreakdown, ...], tuple[RankMemory, ...], list[str]]:
    par = strategy.parallelism
    cs = _compute_strategy(strategy)
    local = tp_local_spec(spec, p.tp)
    q = step_inputs(local, cs, keep_logits=False)
    fp32 = cs.recipe.compute_bits == 32
    dist_opt = strategy.sharding is Sharding.ZERO1
    if strategy.optimizer is not Optimizer.ADAMW:
        raise StrategyError(
            f"tensor/pipeline parallelism models Megatron's Adam (fp32 states); --optimizer {strategy.optimizer.value} "
            "is not modelled there yet"
        )
    inv = inventory(local)
    per_layer_params = max(g.params_per_layer for g in inv.layers)
    embed = [t for t in inv.model_tensors if t.name.startswith("embed")]
    rest = [t for t in inv.model_tensors if not t.name.startswith("embed")]
    embed_params = sum(t.numel for t in embed)
    rest_params = sum(t.numel for t in rest)
    if spec.tie_word_embeddings and p.pp > 1:
        # The last stage keeps its own copy of the tied token table for the head (Megatron's
        # ``share_embeddings_and_output_weights`` across the first and last stage); on one stage it is one tensor.
        rest_params += sum(t.numel for t in embed if t.name == "embed_tokens.weight")
    L = spec.num_layers
    ls = L // p.pp
    # Activations of one micro-batch on one layer (SP: every tensor split; Korthikanti et al. 2022, Table 2).
    if p.sequence_parallel:
        full_q = step_inputs(spec, cs, keep_logits=False)
        act_layer = full_q.stack.max_layer_bytes // p.tp
        kept_layer = full_q.kept_inputs // max(1, full_q.segments) // p.tp if full_q.segments else 0
    else:
        act_layer = q.stack.max_layer_bytes
        kept_layer = q.kept_inputs // max(1, q.segments) if q.segments else 0
    ckpt = q.segments > 0
    per_mb_layer = kept_layer if ckpt else act_layer
    recompute = act_layer * (q.segment_layers if ckpt else 0)
    pb = 4 if fp32 else 2

    stages: list[RankMemory] = []
    for s in range(p.pp):
        params = ls * per_layer_params + (embed_params if s == 0 else 0) + (rest_params if s == p.pp - 1 else 0)
        weights = params * pb
        grads = params * 4  # fp32 main-grad buffer, persistent
        if fp32:
            master = 0
            optim = params * 8 // (p.dp if dist_opt else 1)
        else:
            master = params * 4 // (p.dp if dist_opt else 1)
            optim = params * 8 // (p.dp if dist_opt else 1)
        flight = in_flight_microbatches(par.pipeline_schedule, p.pp, s, par.microbatches, par.virtual_stages)
        acts = int(flight * ls * per_mb_layer) + recompute
        if s == 0:
            acts += int(flight * q.stack.embedding_bytes)
        logits_f = q.logits_forward if s == p.pp - 1 else 0
        logits_b = q.logits_backward if s == p.pp - 1 else 0
        head_in = q.stack.head_input_bytes if s == p.pp - 1 else 0
        resident = {
            Component.WEIGHTS: weights,
            Component.GRADIENTS: grads,
            Component.MASTER_WEIGHTS: master,
            Component.OPTIMIZER_STATES: optim,
        }
        phases = (
            PhaseBreakdown(
                phase=Phase.FORWARD,
                components=_full(resident | {Component.ACTIVATIONS: acts + head_in, Component.LOGITS_LOSS: logits_f}),
            ),
            PhaseBreakdown(
                phase=Phase.BACKWARD,
                components=_full(
                    resident
                    | {
                        Component.ACTIVATIONS: acts + head_in,
                        Component.LOGITS_LOSS: logits_b,
                        Component.TEMPORARIES: q.block_temp,
                    }
                ),
            ),
            PhaseBreakdown(phase=Phase.OPTIMIZER_STEP, components=_full(resident)),
        )
        group = p.tp * p.dp
        stages.append(RankMemory(ranks=tuple(range(s * group, (s + 1) * group)), phases=phases))
    worst = max(stages, key=lambda r: r.peak_bytes)
    notes = [
        f"Megatron TP {p.tp}{' + SP' if p.sequence_parallel else ''}, PP {p.pp} ({par.pipeline_schedule.value}, "
        f"{par.microbatches} micro-batches), DP {p.dp}: {ls} layers per stage; stage 0 holds the embedding and "
        f"the most micro-batches in flight, the last stage the head and the logits",
        "activations per layer from the Hugging Face block model split per Korthikanti et al. 2022 "
        "(without SP the norm and residual tensors are replicated)",
    ]
    if p.pp > 1 and par.microbatches < p.pp:
        notes.append(
            f"only {par.microbatches} micro-batch(es) for {p.pp} pipeline stages: the pipeline idles most of the "
            "step (--microbatches sets how many per step; memory on stage 0 grows up to pp of them)"
        )
    return worst.phases, tuple(stages) if p.pp > 1 else (), notes


# -- the entry point -------------------------------------------------------------------------------------


def estimate_parallel(
    spec: ModelSpec,
    strategy: Strategy,
) -> MemoryReport:
    """Per-rank peak allocated memory (the worst rank's phases; every stage in ``ranks`` when they differ)
    and host memory per node, for ``strategy``'s parallel setup. The allocator simulation is not run for
    many GPUs yet: the reserve is the fixed fraction of :func:`trainfit.overhead.overhead_for`."""
    strategy, _ = effective_strategy(spec, strategy)
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
    elif p.engine is Engine.DEEPSPEED:
        phases, notes = _deepspeed(spec, strategy, p)
        why = "every rank holds the same partition size (rank 0's, the largest with padding)"
    elif p.sharding in (Sharding.FSDP, Sharding.HSDP):
        phases, notes = _fsdp(spec, strategy, p)
        why = "every rank holds the same; uneven shards are padded to rank 0's ⌈dim0/W⌉ rows"
    else:
        phases, notes = _ddp(spec, strategy)
        why = "every rank holds a full replica"
    peak = max(ph.total_bytes for ph in phases)
    st_bytes = {c: max(ph.get(c) for ph in phases) for c in (Component.WEIGHTS, Component.GRADIENTS)}
    params = inventory(spec).total
    opt = next(ph for ph in phases if ph.phase is Phase.OPTIMIZER_STEP)
    return MemoryReport(
        method=Method.ANALYTIC,
        model_name=spec.name,
        params=params,
        trainable_params=params,
        phases=phases,
        overhead=overhead_for(peak),
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
            "per-rank bytes inside PyTorch's allocator; NCCL's own buffers are outside it (the overhead's NCCL term: "
            "measured for torch DDP and FSDP2 on one rank, not for DeepSpeed or Megatron)",
        ),
        ranks=ranks,
    )


def _worst_stage(ranks: tuple[RankMemory, ...]) -> int:
    best = max(range(len(ranks)), key=lambda i: ranks[i].peak_bytes)
    return best


#: NCCL's buffers outside PyTorch's allocator, measured with a one-rank NCCL group on the H200
#: (DESIGN §4.1: +67 MiB under FSDP2, +557 MiB after DDP). Not measured for DeepSpeed or Megatron (0).
NCCL_FSDP_BYTES = 67 * MiB
NCCL_DDP_BYTES = 557 * MiB


def nccl_bytes(strategy: Strategy) -> int:
    """NCCL's own device buffers for ``strategy`` (outside the allocator; 0 where not measured)."""
    if not strategy.is_distributed or resolve_engine(strategy) is not Engine.TORCH:
        return 0
    return NCCL_FSDP_BYTES if strategy.sharding in (Sharding.FSDP, Sharding.HSDP) else NCCL_DDP_BYTES


def data_parallel_degree(gpus: int, tp: int, pp: int) -> int:
    """gpus / (tp·pp), refusing a world size that is not a multiple of tp·pp."""
    if gpus % (tp * pp):
        raise StrategyError(f"--gpus {gpus} is not a multiple of --tp {tp} × --pp {pp} = {tp * pp}")
    return gpus // (tp * pp)


__all__ = [
    "ParallelPlan",
    "ShardedStates",
    "data_parallel_degree",
    "ddp_bucket_bytes",
    "deepspeed_partition_numel",
    "estimate_parallel",
    "fsdp_states",
    "in_flight_microbatches",
    "nccl_bytes",
    "plan",
    "resolve_engine",
    "shard_tensor",
    "tp_local_spec",
]
