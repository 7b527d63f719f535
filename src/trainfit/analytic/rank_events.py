"""Reserved memory of one data-parallel rank: its tensors as an allocator event stream. Torch-free.

The single-GPU stream (:mod:`trainfit.analytic.events`) with :class:`~trainfit.analytic.events.RankHooks`
that make it one rank's, in the order the framework runs, then replayed through the caching-allocator
simulation (:mod:`trainfit.allocator`) like one GPU's:

* **torch DDP**: the single-GPU stream of the rank's recipe plus the reducer's gradient buckets: one of every
  gradient when ``DistributedDataParallel`` is built (after the weights), replaced at the second forward by the
  rebuilt ones, never freed after (c10d/reducer.cpp ``rebuild_buckets``, ``initialize_buckets``; the old one held
  by NCCL's stash into the next backward; sizes:
  :func:`~trainfit.analytic.parallel.ddp_bucket_bytes`; :class:`DdpHooks`); with
  ``gradient_as_bucket_view`` the gradients are views of them and allocate nothing (a tied table's
  out-of-place sum is a tensor of its own until ``accumulateGrad`` adds it into the view: ``adds_into_view``).
  Every framework's hooks fire after autograd has summed a tied table's two gradients: a hook that takes a
  gradient at once (bucket views, ZeRO-2/3's IPG bucket) leaves the head's waiting in autograd's buffer.
* **torch FSDP2** (``fully_shard`` per layer + root, :func:`~trainfit.analytic.parallel.held_tensors` for the
  widths; fine-tuning: each group of its frozen, adapter and packed 4-bit parameters, :class:`_Group`): first the
  wrapping (:meth:`FsdpHooks.weights`: each call's whole weights on the device for a loaded model, only the shards
  for one built on meta, ``sharded_init``), then the stream of the compute strategy (bf16 layers, no autocast) over
  the rank's padded shards; per group, its unshard allocates the flat all-gather output (padded, ``param_dtype``;
  none on one rank; under the policy after the flat bf16 copy of the rank's shards, freed at once) and its copy-out
  one unsharded tensor
  per parameter, W padded shards long (``FSDPParam.init_unsharded_param``); in forward the output is kept until
  the next group's copy-out (``comm_ctx.all_gather_state``), in backward it is freed at its own
  (_fsdp_param_group.py ``wait_for_unshard``); the forward reshards each layer after it
  (``reshard_after_forward``); the root's pre-backward prefetches the last layer's all-gather, each layer's
  pre-backward copies it out and prefetches the next one's (``_backward_prefetch``); its bf16 weight gradients are
  made at the end of its backward, after its saved tensors go, with its input norm's fp32 temporaries over them
  (they are held to the post-backward; the closed form's input-norm moment), and its post-backward
  reshards (frees the unsharded parameters), frees the previous reduce-scatter input (one in flight:
  ``reduce_scatter_max_input_buffers``), allocates the fp32 reduce-scatter input of the padded size, frees
  the unsharded gradients after the copy-in and allocates the group's sharded gradients (one reduce output,
  the grads are views of it) (_fsdp_param_group.py ``post_backward``, _fsdp_collectives.py
  ``foreach_reduce``); the root's last. With ``--fsdp-wrap units`` (torchtitan, accelerate 1.15) an untied
  table is a group of its own (gathered in its forward, resharded after it, prefetched by layer 0's pre-backward,
  re-gathered for its backward and reduced last) and [final norm, head] another (gathered at the final norm, kept,
  reduced right after the final norm's backward: :meth:`FsdpHooks.head_backward_end`); the last layer's prefetch
  is then issued on the logits, after the loss's backward, not on the loss (the root's hook sits on the model's
  output). Against the traced units: allocated +0.00% (tiny llama, tied and untied), −0.00…+0.05% (llama-3.1-8b
  over 8). Streams: all-gather outputs on the all-gather copy-in stream, reduce outputs on the reduce-scatter
  stream, the rest (the reduce-scatter input included) on the default one; the
  allocator keeps a stream's freed blocks for that stream, which is part of FSDP2's reserve. With gradient
  accumulation every micro-step reduce-scatters (``sync_each_batch``; the HF Trainer's default ``no_sync`` is
  :func:`~trainfit.analytic.parallel.fsdp_no_sync_grad_bytes`' warning): two micro-steps are replayed, the second
  as the first, except that each reduce output is added into the sharded ``.grad`` and dropped when
  ``foreach_reduce`` returns (``sharded_param.grad._local_tensor += new_sharded_grad``); under HSDP the group
  holds it as its all-reduce input to the end of backward (``_all_reduce_state``, dropped in
  ``finalize_backward``). Against the traced runs (tests/trace/test_rank_stream.py, two accumulation steps):
  allocated +0.00…+0.06% (one micro-step: −5.8%). Under accelerate's ``no_sync`` (``sync_each_batch`` False, the
  HF Trainer's default) up to three micro-steps are replayed: each post-backward but the last micro-step's keeps
  the group's unsharded gradients (after the reshard, upcast to the reduce dtype under the policy:
  ``to_accumulated_grad_if_needed``), a later one adds into them (``accumulate_unsharded_grad_if_needed``), and
  the last reduce-scatters what was kept (``FsdpHooks._accumulate``); traced: −3.3…+0.0% allocated.
* **torch FSDP2 with CPUOffloadPolicy** (``--sharding fsdp --offload optimizer+params``; the same hooks with
  ``offload``): the shards, their gradients, the optimizer states and the step are host memory, so the device
  holds nothing between steps; each unshard copies every parameter's padded host shard to the device one by one
  on the copy-in stream (no flat foreach copy: ``use_foreach_copy`` is false for offloaded parameters), in its own
  dtype, cast to ``param_dtype`` under the mixed-precision policy (the copy freed at once), all held until the
  all-gather is issued (_fsdp_param.py ``all_gather_inputs``, _fsdp_collectives.py ``foreach_all_gather``); each
  post-backward's reduce output is dropped as soon as it is made, its gradients copied to the host
  (``foreach_reduce``: ``new_sharded_grad.to("cpu")``). Against the traced ``CPUOffloadPolicy`` run's events
  (tests/trace/test_rank_stream.py): allocated +0.15%, reserved equal; at llama-3.1-8b's width (W = 8, full
  recompute, 32 layers) allocated +0.28%, reserved −15% on one stream (as without offload: the short-lived
  element-wise outputs it leaves out). HSDP with offload: each group keeps its reduce output, the all-reduce's
  input, on the device until the end of backward (_fsdp_param_group.py ``_all_reduce_state``, dropped in
  ``finalize_backward``), in every micro-step, though its gradients went to the host; the closed form holds them
  too. Read from the source: the CPU mesh's trace cannot show it (there the reduce output *is* the host gradient).

Reserved memory can keep growing for a few steps (one GPU's stream settles by its second): steps are
replayed until one adds nothing to the peak (:data:`MAX_STEPS` at most), or until one leaves the allocator exactly as
the step before it did (:func:`~trainfit.analytic.events.steady_state`: the next would repeat it). The optimizer
  states are made on the shards in the first step.

* **DeepSpeed ZeRO-2** (16-bit compute, AdamW; :class:`Zero2Hooks`, deepspeed/runtime/zero/stage_1_and_2.py):
  the compute strategy's stream with no per-parameter gradients of its own (each is copied into the IPG
  bucket as autograd makes it, but one larger than the bucket); the flat 16-bit groups and the fp32 partition
  before the first step; the bucket(s) from the first gradient to the end of backward; rank 0's
  ``grads_in_partition`` made at the first flush that reaches its partition, on DeepSpeed's reduction stream
  under ``overlap_comm``; the optimizer step's own buffers (written from ``step_temp_bytes``, the one per-step
  hook after backward). Its allocated peak is :func:`~trainfit.analytic.parallel.estimate_parallel`'s. With
  accumulation every micro-step reduces (``partition_gradients``), so two alike are replayed
  (``reduces_each_micro_step``; ``grads_in_partition`` made once per step).
* **DeepSpeed ZeRO-1** (:class:`Zero1Hooks`, the same file with ``partition_gradients`` False): with
  ``overlap_comm`` the ZeRO-2 stream; without it (stage 1's default) autograd's gradients stay whole through
  backward, the bucket is made at the first gradient (``reduce_bucket_size`` elements, however small the
  model: the closed form used to count min(model, bucket) at the embedding only, 11× low at the default 5e8 on
  a tiny model), and the engine's reduction after backward copies them into it in flat order, making
  ``grads_in_partition`` at the first flush (``zero1_reduce_gradients``, the closed form's
  ``BACKWARD_REDUCE`` moment); a tied table's two gradients are summed before it (``events.synthesise``). Against the
  real engine's events (tests/trace/test_rank_stream.py): allocated +0.65–0.71%, reserved −0.2…+1.8%. With
  accumulation stage 1 reduces nothing before the boundary, with or without ``overlap_comm``
  (``reduce_ready_partitions_and_remove_grads``: ``partition_gradients`` or the boundary): autograd's gradients
  stay whole and add in place, the bucket(s) ``setup_buckets`` made at the first gradient stay to the boundary's
  reduction, which is the reduction above (with ``overlap_comm`` the hooks', each accumulated gradient into the
  bucket as its hook fires). Against the traced engine, two accumulation steps: allocated +0.08…+0.58%, reserved
  −1.9…+1.5% (one micro-step replayed: −4.4…−10.8%, −3.5…−13.9%).
* **DeepSpeed ZeRO-3** (:class:`Zero3Hooks`, stage3.py): the persistent buffers at init, the parameter
  coordinator's gathers, copies and releases from :mod:`trainfit.analytic.zero3`'s replay (which records them
  as events) at the layer hooks, a layer's releases held to its end (the closed form counts the worst over the
  layer's modules with the layer's tensors), the head gathered over the loss's backward; no gradients of their
  own; the step's partition of the persistent parameters, flatten + fp32 cast, AdamW's states, re-gather.
  Against the real engine's events: allocated +0.1…+0.4% (tiny, W = 8), −0.002% (llama-2-7b); reserved
  −7.3…+7.3% (tiny: a 2 MiB segment is 2% there), −1.4% (llama-2-7b, 32.79 to 33.26 GiB).

* **DTensor TP** ± sequence parallelism, no sharding (:class:`DtensorTpHooks`): the single-GPU stream of the
  TP-local model with the rank's shard states, the whole token-table gradient and the logits' all-gather
  (``RankHooks.copy_bytes``, ``RankHooks.logits_gather``); under SP the closed form's sequence-sharded tensors
  are 1/tp (``RankHooks.saved_bytes``: the norms' saved tensors; ``RankHooks.residual_bytes``: the residual
  stream, its gradient, a checkpointed segment's input, the final norm's backward temporaries), each matmul's
  all-gathered input whole. Against the traced ``parallelize_module`` events (tiny llama, TP 2): allocated
  ±0.001%, reserved −1.6…0% (no SP), 0…+2.4% (SP).
* **2-D FSDP2 × DTensor TP** (:class:`FsdpTpHooks`): FSDP2's groups of the TP-local tensors (each sharded on dim 0
  of its local tensor over the dp ranks) over the TP-local stream with DTensor TP's departures; the token table's
  whole gradient copied to the rank's rows before the root reduces it, and under ``no_sync`` kept whole in the
  reduce dtype (:func:`~trainfit.analytic.parallel.tp_kept_table_grad_bytes`). Against the traced
  ``parallelize_module`` + ``fully_shard`` events (tiny llama, TP 2 × dp 2, one CUDA stream): hidden 256 allocated
  +0.00…+0.05%, reserved −4.0…0% without accumulation (one 2 MiB segment at this size), +10…+15% with it (one
  20 MiB segment of 114; likely because the stream's per-layer temporaries are single allocations of 1–2.25 MiB
  in the large pool where the trace's are pieces under 1 MiB in the small one); hidden 1024 allocated
  −0.3…+0.7%, reserved −5.5…+2.4% (no_sync and synced accumulation, short and long sequences, fp32,
  checkpointing).
* **Megatron-LM TP (± SP) × PP** (:class:`MegatronStage`, :func:`megatron_events`): not a hooked single-GPU stream
  but one pipeline stage's own, since a pipeline schedule interleaves micro-batches (:func:`pipeline_order`: 1F1B
  :func:`one_f_one_b`, Megatron's interleaved 1F1B over v model chunks :func:`interleaved_order`, GPipe); the worst
  stage's stream, sized by :func:`~trainfit.analytic.parallel.megatron_inputs` as the closed form is, peaks at
  exactly its bytes on every stage: the schedules, run pass by pass, hold the closed form's counts
  (:func:`~trainfit.analytic.parallel.in_flight_chunks`, ``first_stage_embeddings``, ``last_stage_heads``). The
  interleaved order is checked against megatron-core's own schedule table; no trace of Megatron. The init makes
  the module's parameters, then DDP's buffers on Megatron's init stream, and with the distributed optimizer frees
  the module's parameters after copying them in (its allocated peak when that is above the step's).

What keeps the fixed reserve fraction (docs/accuracy.md "Reserved memory with many GPUs"): DeepSpeed ZeRO-3 with other
optimizers than AdamW, NVMe offload, and TP with fine-tuning (ZeRO fine-tuning is
simulated: :class:`Zero2Hooks`' flat groups hold the trainable tensors, ``parallel.deepspeed_flat_layout``, beside
the frozen module parameters; :class:`Zero3Hooks`' frozen partitions are their own).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from trainfit._memo import Memo, spec_key
from trainfit.allocator import AllocatorConfig, AllocatorResult, Simulator
from trainfit.allocator.workspaces import Thread, Workspace, workspace_key
from trainfit.analytic.activations import backward_temp_bytes
from trainfit.analytic.adapters import finetuning, frozen_layers, is_frozen, moe_tensors
from trainfit.analytic.blocks import PhaseRounding, marked
from trainfit.analytic.events import (
    RankHooks,
    StateBits,
    Stream,
    Trained,
    simulation_memo,
    steady_state,
    synthesise,
)
from trainfit.analytic.parallel import (
    SP_SPLIT_PREFIXES,
    HeldTensor,
    ParallelPlan,
    compute_strategy,
    ddp_broadcast_bytes,
    ddp_bucket_bytes,
    ddp_buffer_sync_bytes,
    deepspeed_flat_layout,
    deepspeed_flatten_copies,
    deepspeed_rank,
    dtensor_tp_held_spec,
    dtensor_tp_spec,
    held_tensors,
    megatron_inputs,
    shard_tensor,
    tp_local_spec,
    zero3_frozen_partitions,
    zero_client_step,
    zero_partition,
)
from trainfit.analytic.states import ParamState, model_states, optimizer_state_tensors, param_states
from trainfit.analytic.zero3 import gathered_bytes
from trainfit.arch.params import inventory
from trainfit.arch.spec import ModelSpec, ParamTensor
from trainfit.cuda_facts import allocator_bytes
from trainfit.fsdp_units import EMBEDDING_UNIT, ROOT_UNIT, TAIL_UNIT, fsdp_unit, resolved_fsdp_wrap, untied_units
from trainfit.result import Phase
from trainfit.strategy import (
    Checkpointing,
    DType,
    Engine,
    FsdpWrap,
    Offload,
    OffloadTarget,
    Optimizer,
    OptimizerImpl,
    PipelineSchedule,
    Sharding,
    Strategy,
)

__all__ = [
    "DdpHooks",
    "DtensorTpHooks",
    "FsdpHooks",
    "MegatronStage",
    "Zero1Hooks",
    "Zero2Hooks",
    "Zero3Hooks",
    "interleaved_order",
    "megatron_events",
    "megatron_simulated",
    "one_f_one_b",
    "pipeline_order",
    "rank_simulated",
    "simulate_rank",
]


def rank_simulated(strategy: Strategy, p: ParallelPlan) -> bool:
    """Whether this rank's reserve comes from the simulation (torch DDP and FSDP2/HSDP, with CPUOffloadPolicy
    too; DeepSpeed ZeRO-1/2/3 (16-bit or fp32; another optimizer than AdamW at stages 1–2), with ZeRO-Offload
    (AdamW) at every stage and ZeRO-Infinity to the CPU;
    DTensor TP ± SP without sharding, with gradient accumulation too; full training — DDP's and FSDP2/HSDP's
    fine-tuning too —, nothing else offloaded); otherwise the fixed fraction. Megatron TP/SP/PP:
    :func:`megatron_simulated`."""
    if p.engine is Engine.MEGATRON:
        return megatron_simulated(strategy, p)
    if p.engine is Engine.DEEPSPEED:
        # ZeRO-Offload is written for stages 1–3 (Zero2Hooks.offload, which Zero1Hooks inherits; Zero3Hooks.offload),
        # ZeRO-Infinity's parameters on the host for stage 3 (Zero3Hooks.params_on_host; stages 1–2 refuse it); not
        # NVMe, nor activation offload
        off = strategy.offload
        host = OffloadTarget.CPU
        offloaded = off.any and off not in (Offload(optimizer=host), Offload(optimizer=host, parameters=host))
        # fine-tuning (adapters, --freeze) since 2026-12-03, ZeRO-Offload at stages 1–3 too: stages 1–2's flat groups of
        # the trainable tensors beside the frozen module parameters (Zero2Hooks), stage 3's frozen partitions of their
        # own (Zero3Hooks); against the traced engine with real PEFT (tiny llama over 2–8): allocated −0.6…+0.6%,
        # reserved −4.7…−0.2% (+8.5% on a ZeRO-3 LoRA cell with the default prefetch bucket)
        return (
            p.sharding in (Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3)
            and p.tp == 1
            and p.pp == 1
            # another optimizer than AdamW (the Trainer's, DeepSpeed's client): stages 1–2 against the traced engine
            # allocated ±0.00%, reserved −1.8%; at stage 3 the traced engine reserves 16 MiB less than with AdamW on
            # a tiny llama (98.6 vs 115.3 MiB) while the stream reserves the AdamW figure: not understood yet — and so
            # does fp32 ZeRO-1 (128 vs 144 MiB; the stream 142; fp32 ZeRO-2 with Lion or Adafactor −1.4%)
            and (
                strategy.optimizer is Optimizer.ADAMW
                or (
                    not off.any
                    and p.sharding is not Sharding.ZERO3
                    and not (p.sharding is Sharding.ZERO1 and strategy.recipe.compute_bits == 32)
                )
            )
            and not offloaded
        )
    if p.engine is Engine.TORCH and p.tp > 1:
        # With accumulation the stream replays two micro-steps (RankHooks.replays_accumulation). Its reserve was
        # +8.4% on a tiny cell (amp-bf16, full checkpointing) while SwiGLU's saved tensors were one allocation; as
        # four (SavedTerm.pieces) the tiny llama cells (TP 2, 2–3 accumulation steps, ± SP) reserve −1.9…+7.2% of
        # the traced run's, as without accumulation (−1.9…+6.3%), allocated +0.0…+0.9%.
        # 2-D FSDP2×TP (FsdpTpHooks) since 2026-12-03: allocated −0.3…+0.7%, reserved −5.5…+2.4% of the traced run's
        # on hidden-1024 cells, tiny ones −1.8…0% without accumulation (docs/distributed.md)
        return p.sharding in (Sharding.NONE, Sharding.FSDP) and not strategy.offload.any and not finetuning(strategy)
    return (
        p.engine is Engine.TORCH
        and p.tp == 1
        and p.pp == 1
        and p.sharding in (Sharding.DDP, Sharding.FSDP, Sharding.HSDP)
        and (not strategy.offload.any or strategy.offload.parameters_on_host)
        # fine-tuning: DDP as one GPU does, with the trainable gradients' buckets and the whole model's broadcast;
        # FSDP2/HSDP with frozen, adapter and packed 4-bit parameters in their groups (_Group)
    )


class DdpHooks(RankHooks):
    """DDP: after the weights, the construction's broadcast of every parameter and buffer from rank 0 (flat
    per-dtype copies of up to 250 MiB, two at a time, freed at once: :func:`~trainfit.analytic.parallel.
    ddp_broadcast_bytes`; the frozen base of a fine-tuned model too; before each forward the buffers' alone:
    :func:`~trainfit.analytic.parallel.ddp_buffer_sync_bytes`), then the first iteration's bucket — without
    ``find_unused_parameters`` one of every gradient
    (one per gradient dtype; distributed.py ``BucketCapacityConfig.compute_bucket_size_limits``: ``[sys.maxsize]``)
    — and at the second forward the rebuilt ones (distributed.py ``_pre_forward`` → c10d/reducer.cpp
    ``Reducer::rebuild_buckets``, once a backward has recorded the gradients' ready order; every micro-step of the
    stream reduces, so with accumulation that is the first step's second micro-step): ``sync_bucket_indices``' two
    int32 device tensors (every index and the bucket count; each bucket's length), freed on return, then
    ``initialize_buckets`` drops the old bucket and allocates the ``bucket_cap_mb`` ones, first bucket first (sizes:
    :func:`~trainfit.analytic.parallel.ddp_bucket_bytes`, reverse module order standing for the ready order). The
    old bucket is not freed there: NCCL's stash of its all-reduce holds it until the next backward's first reduction
    (:func:`~trainfit.analytic.parallel.ddp_stashed_first_bucket`), taken to be as the top layer's backward begins.
    With ``gradient_as_bucket_view`` there are no separate gradients (a resident one, a micro-step after the first,
    is a view of the old bucket until ``initialize_bucket_views`` has copied it into the new one's view)."""

    adapter_flow = True  # events.LoraFlow: the one-GPU stream with the bucket hooks

    def __init__(self, spec: ModelSpec, strategy: Strategy) -> None:
        eo = strategy.engine
        bits = strategy.recipe.grad_bits
        self.buckets = ddp_bucket_bytes(spec, bits, eo.bucket_cap_mb * 1024 * 1024, eo.ddp_first_bucket_bytes, strategy)
        self.first_buckets = ddp_bucket_bytes(spec, bits, sys.maxsize, sys.maxsize, strategy)
        self.broadcast = ddp_broadcast_bytes(spec, strategy)
        self.buffer_sync = ddp_buffer_sync_bytes(spec)
        self.view = eo.gradient_as_bucket_view
        self.adds_into_view = self.view
        self.params = 0  # tensors in the reducer (its trainable parameters, a tied one once)
        self.held: list[int] = []  # the live buckets' keys
        self.shelved: list[int] = []  # the first iteration's, on NCCL's stash after the rebuild
        self.forwards = 0
        self.micro = 0

    def weights(self, s: Stream, states: Sequence[ParamState]) -> None:
        super().weights(s, states)
        self.params = sum(ps.count for ps in states if ps.trainable)
        _broadcast(s, self.broadcast)
        self.held = [s.alloc(b) for b in self.first_buckets]

    def micro_step_begin(self, s: Stream, micro: int) -> None:
        self.micro = micro

    def forward_begin(self, s: Stream) -> None:
        self.forwards += 1
        if self.forwards == 2:
            s.free_all([s.alloc(4 * (self.params + 1)), s.alloc(4 * len(self.buckets))])  # sync_bucket_indices
            # NCCL's stash of the old bucket's all-reduce holds it past the rebuild, to the next backward's first
            # reduction (parallel.ddp_stashed_first_bucket), after the new ones are made
            self.shelved, self.held = self.held, [s.alloc(b) for b in self.buckets]
        # then the buffers (distributed.py ``_pre_forward``: ``_rebuild_buckets`` before ``_sync_buffers``)
        _broadcast(s, self.buffer_sync)

    def grad_bytes(self, x: ParamTensor, bits: int) -> int:
        return 0 if self.view else super().grad_bytes(x, bits)

    def layer_backward_begin(self, s: Stream, i: int) -> None:
        """The first reduction after the rebuild unstashes the first iteration's bucket (its ``workEnqueue``): an
        untied head's gradient fills the first bucket before the final norm's backward, the top layer's in its own
        backward otherwise — taken here, as the top layer's backward begins, in every micro-step (a later one
        reduces too, and the replay calls no gradient hook there)."""
        s.free_all(self.shelved)
        self.shelved = []
        super().layer_backward_begin(s, i)


def _broadcast(s: Stream, flats: Sequence[int]) -> None:
    """``dist._broadcast_coalesced``' flat tensors (c10d/comm.cpp ``broadcast_coalesced``): at most two in flight,
    each freed when its broadcast is finished."""
    in_flight: list[int] = []
    for nbytes in flats:
        if len(in_flight) == 2:
            s.free(in_flight.pop(0))
        in_flight.append(s.alloc(nbytes))
    s.free_all(in_flight)


#: Steps replayed at most. A rank's reserved memory can grow for a few steps before it settles (FSDP2's
#: per-stream pools: llama-3.1-8b over 8 ranks grows until the fourth step), so steps are replayed until one
#: raises no peak (from the third on), at most this many.
MAX_STEPS = 8

#: FSDP2's side streams (``FSDPCommContext.lazy_init``): the all-gather outputs are made on the all-gather
#: copy-in stream, the reduce outputs (the sharded gradients are views of them) on the reduce-scatter stream;
#: the caching allocator reuses a freed block only for its own stream. The rest is the default stream (0).
ALL_GATHER_STREAM = 1
REDUCE_SCATTER_STREAM = 2


class _Group:
    """One ``fully_shard`` group's sizes in bytes (FSDP2, rank 0), from its parameters as the rank holds them
    (:class:`~trainfit.analytic.parallel.HeldTensor`: frozen ones, adapters and packed 4-bit weights too). Every
    parameter is sharded and all-gathered — under the mixed-precision policy in ``param_dtype``, which applies to
    every floating parameter (_fsdp_param.py ``init_dtype_attrs``), else in its own dtype; only those that train
    are reduce-scattered (fp32 under the policy, else their own dtype) and get a sharded gradient (the reduce
    output, in the parameter's dtype)."""

    __slots__ = ("all_gather", "casts", "reduce_scatter", "shard_grads", "shards", "tensors", "trainable", "unsharded")

    def __init__(
        self,
        held: Sequence[HeldTensor],
        shards: int,
        gather_bits: int | None,
        reduce_bits: int | None,
        gather_dtype: DType | None = None,
    ) -> None:
        """``gather_bits``/``reduce_bits``: the policy's ``param_dtype``/``reduce_dtype`` widths (None: none);
        ``gather_dtype``: its ``param_dtype``."""
        self.tensors = [h.tensor for h in held]
        self.trainable = [h.tensor for h in held if h.trainable]
        local = [h.shard_numel(shards) for h in held]
        gather = [h.bits if gather_bits is None else gather_bits for h in held]
        self.shards = [n * h.bits // 8 for n, h in zip(local, held, strict=True)]
        # each all-gather input cast to param_dtype: only a parameter of another dtype has one (_fsdp_param.py
        # ``init_dtype_attrs`` clamps its ``param_dtype`` to None otherwise: a 16-bit base or adapter, packed 4-bit
        # storage; the shard itself is then the input)
        self.casts = [
            n * b // 8 if gather_dtype is not None and h.dtype != gather_dtype else 0
            for n, b, h in zip(local, gather, held, strict=True)
        ]
        # views of each parameter's padded all-gather output (_fsdp_param.py ``init_unsharded_param``)
        self.unsharded = [n * shards * b // 8 for n, b in zip(local, gather, strict=True)]
        self.all_gather = sum(self.unsharded)
        self.reduce_scatter = sum(
            n * shards * (h.bits if reduce_bits is None else reduce_bits) // 8
            for n, h in zip(local, held, strict=True)
            if h.trainable
        )
        self.shard_grads = sum(b for b, h in zip(self.shards, held, strict=True) if h.trainable)


def _fully_shard_calls(
    spec: ModelSpec,
    strategy: Strategy,
    held: Sequence[HeldTensor],
    unit: Callable[[ParamTensor], int] = lambda _: ROOT_UNIT,
) -> list[list[HeldTensor]]:
    """Each ``fully_shard`` call's parameters, in call order: every decoder layer's (model order), then under
    ``--fsdp-wrap units`` the token embedding's and [final norm, head]'s (``unit``: a model-level tensor's group,
    :func:`~trainfit.fsdp_units.fsdp_unit`), then the root's. A layer's tensor held two ways (frozen in some
    layers, trainable in others: :func:`~trainfit.analytic.parallel.held_tensors`) is frozen in the layers that
    ``--freeze`` names (:func:`~trainfit.analytic.adapters.is_frozen`, wherever in the stack they are); the
    stack's adapters are in every layer, an MoE router's or expert stack's only in the MoE layers."""
    inv = inventory(spec)
    patterns, adapter = strategy.base_weights.frozen, strategy.adapter
    moe = set(moe_tensors(spec, adapter)) if adapter is not None else set()
    model: dict[int, list[HeldTensor]] = {EMBEDDING_UNIT: [], TAIL_UNIT: [], ROOT_UNIT: []}
    ways: dict[tuple[int, ParamTensor], dict[bool, HeldTensor]] = {}
    adapters: list[HeldTensor] = []
    for h in held:
        if h.root:
            model[unit(h.tensor)].extend([h] * h.count)
        elif h.adapter:
            adapters.append(h)
        else:
            ways.setdefault((h.group, h.tensor), {})[h.trainable] = h
    calls: list[list[HeldTensor]] = []
    layer = 0
    for i, g in enumerate(inv.layers):
        mine = [h for h in adapters if g.kind != "dense" or h.tensor not in moe]
        for _ in range(g.count):
            one = []
            for t in g.tensors:
                trainable = adapter is None and not is_frozen(t, patterns, layer, layers=spec.num_layers)
                one.append(ways[(i, t)][trainable])
            calls.append(one + mine)
            layer += 1
    return calls + [g for g in model.values() if g]


class _OwnMasters:
    """:class:`RankHooks` of a framework that holds the fp32 masters and their gradients itself — FSDP2's mixed
    precision keeps the sharded fp32 parameters (held), DeepSpeed's fp32 partition is one of the flat groups its hooks
    build and its gradient partition is made by the step (``step_temp_bytes``): no separate copies in the stream."""

    def master_weights(self, s: Stream, strategy: Strategy, trained: Sequence[tuple[ParamTensor, int]]) -> None:
        pass

    def master_grads(
        self, s: Stream, strategy: Strategy, trained: Sequence[tuple[ParamTensor, int]]
    ) -> tuple[list[int], int]:
        return [], 0


class FsdpHooks(_OwnMasters, RankHooks):
    """FSDP2 per layer + root, or with ``--fsdp-wrap units`` the embedding and [final norm, head] as units of their
    own (see the module docstring); the stream is the compute strategy's. Groups are keyed by layer index, or
    :data:`~trainfit.analytic.parallel.ROOT_UNIT`, ``EMBEDDING_UNIT``, ``TAIL_UNIT``."""

    module_order = False  # its states come from the grouped counts

    adapter_flow = True  # events.LoraFlow: a data-parallel rank's activations are one GPU's

    reduces_each_micro_step = True  # every micro-step's gradients go through the post-backward (no_sync too)

    def __init__(self, spec: ModelSpec, strategy: Strategy, shards: int, *, replicated: bool = False) -> None:
        mixed = strategy.recipe.mixed
        bits = 32 if mixed else strategy.recipe.weight_bits
        gather = strategy.recipe.compute_bits if mixed else bits
        reduce = 32 if mixed else bits
        inv = inventory(spec)
        self.strategy = strategy
        self.shards = shards
        self.bits = bits
        self.raf = strategy.engine.reshard_after_forward
        # CPUOffloadPolicy: the shards, their gradients, the optimizer and its step live on the host
        self.offload = strategy.offload.parameters_on_host
        # the model-level groups: the root alone, or (units) the untied table, [final norm, head], what is left
        self.units = resolved_fsdp_wrap(spec, strategy) is FsdpWrap.UNITS
        self.untied = untied_units(spec, strategy)
        self.held = held_tensors(spec, strategy, fsdp_mixed=mixed)
        self.unit_of = {h.tensor: fsdp_unit(spec, strategy, h.tensor) for h in self.held if h.root}
        self.layer_counts = [g.count for g in inv.layers]
        policy = (gather, reduce, strategy.recipe.compute) if mixed else (None, None, None)
        self.model_groups = {
            u: _Group([h for h in self.held if h.root and self.unit_of[h.tensor] == u], shards, *policy)
            for u in (ROOT_UNIT, EMBEDDING_UNIT, TAIL_UNIT)
        }
        self.calls = _fully_shard_calls(spec, strategy, self.held, self.unit_of.__getitem__)
        calls = self.calls[: sum(self.layer_counts)]
        made: dict[tuple[int, ...], _Group] = {}  # layers alike share one
        self.layers = [made.setdefault(tuple(map(id, c)), _Group(c, shards, *policy)) for c in calls]
        # each layer's gradients, made at the end of its backward: the trainable tensors, in param_dtype under the
        # policy (the unsharded parameters' dtype), else in their own
        self.layer_grads = [[(h.tensor.numel, gather if mixed else h.bits) for h in c if h.trainable] for c in calls]
        self.unsharded: dict[int, list[int]] = {}  # group (-1: root) → its unsharded parameters
        self.gather_out = 0  # the forward's last all-gather output, kept until the next copy-out
        self.prefetched: dict[int, int] = {}  # backward: layer → its all-gather output, not yet copied out
        self.rs_pending = 0  # the reduce-scatter input in flight
        # HSDP: each group's reduce output is the all-reduce's input, which the group holds to the end of backward
        # (_fsdp_param_group.py ``_all_reduce_state``, dropped in ``finalize_backward``)
        self.replicated = replicated
        self.accumulating = False  # a micro-step after the first: the sharded gradients exist
        self.all_reduce_held: list[int] = []
        # accelerate's no_sync (``sync_each_batch`` False): every micro-step but the last keeps each group's unsharded
        # gradients (upcast to the reduce dtype under the policy, ``to_accumulated_grad_if_needed``; else autograd's
        # own .grad), and the next ones add into them (``accumulate_unsharded_grad_if_needed``)
        self.no_sync = not strategy.engine.sync_each_batch and strategy.grad_accum > 1
        self.syncing = True  # this micro-step reduce-scatters
        self.kept: dict[int, list[int]] = {}  # group → its accumulated unsharded gradients
        self.upcast = reduce != strategy.recipe.compute_bits if mixed else False
        cs = compute_strategy(strategy, casts_every_param=mixed)
        self.grad_bits = cs.recipe.grad_bits
        self.norm_temp = backward_temp_bytes(spec, cs).norm_bytes
        self.in_layers = {h.tensor for h in self.held if not h.root}  # adapters too
        # --freeze: below input_grad_from autograd runs no backward (adapters.FrozenLayers)
        fz = frozen_layers(spec, strategy)
        self.blind_from = fz.input_grad_from if fz is not None else 0
        # Untied units: [final norm, head] reduces right after the final norm's backward — when its input, the
        # stack's output, needs a gradient (every layer dead: no hook fires, the final callback reduces it)
        self.tail_early = self.untied and (fz is None or fz.stack_output_grad)
        self.pending: tuple[int, list[int]] | None = None  # that layer's gradients, waiting for the final callback
        self.reduce_bits = reduce
        # the late gradients' tensors (``backward_end``), in the order the stream makes them
        # (the stream makes an adapter's gradient among them too, as nothing here: grad_bytes, layer_backward_end)
        inv_layers = {t for g in inv.layers for t in g.tensors}
        self.late_order = [
            ps.tensor
            for ps in param_states(spec, strategy)
            if ps.trainable and ps.tensor not in inv_layers and not self.early_grad(spec, ps.tensor)
        ]

    def grad_bytes(self, x: ParamTensor, bits: int) -> int:
        """A layer's weight gradients are made at the end of its backward (:meth:`layer_backward_end`)."""
        return 0 if x in self.in_layers else super().grad_bytes(x, bits)

    def weights(self, s: Stream, states: Sequence[ParamState]) -> None:
        """``fully_shard`` per layer and then on the root. Each parameter's padded shard is a new tensor
        (_fsdp_param.py ``_init_sharded_param``: ``new_zeros``, then a copy of the rank's chunk; under
        CPUOffloadPolicy moved to the host at once). A model loaded before it is wrapped (accelerate, the HF
        Trainer: the default) has each group's whole parameters on the device for the call
        (_fsdp_init.py ``_move_states_to_device``), gone when it returns: they leave cached segments — the root's
        table among them — that the run then fills. Built on the meta device (``sharded_init``, torchtitan),
        only the shards ever exist (``to_empty`` after wrapping)."""
        for h in self.held:  # a 4-bit weight's quantisation state: whole on every rank, never sharded
            if h.quant_state_bytes:
                for _ in range(h.count):
                    s.alloc(h.quant_state_bytes)
        if self.strategy.engine.sharded_init:
            if not self.offload:  # else the shards are host memory
                for h in self.held:
                    n = _alloc_bits(h.shard_numel(self.shards), h.bits)
                    for _ in range(h.count):
                        s.alloc(n)
            return
        for group in self.calls:
            whole = []
            for h in group:
                whole.append(s.alloc(_alloc_bits(h.storage_numel, h.bits)))
                shard = s.alloc(_alloc_bits(h.shard_numel(self.shards), h.bits))
                if self.offload:
                    s.free(shard)  # ``padded_sharded_param.cpu()``
            s.free_all(whole)

    def _group(self, i: int) -> _Group:
        return self.layers[i] if i >= 0 else self.model_groups[i]

    def _all_gather(self, s: Stream, i: int) -> int:
        """``unshard``: the all-gather output, made on the all-gather copy-in stream (forward and pre-backward:
        ``get_all_gather_streams``) after the flat ``param_dtype`` copy of the rank's shards that it copies in
        (_fsdp_collectives.py ``_get_param_all_gather_inputs``: one ``torch.empty`` under a mixed-precision
        policy, freed after ``all_gather_copy_in``, of the parameters whose dtype is not ``param_dtype``); none on one
        rank (copied straight from the shard)."""
        if self.shards == 1:
            return 0
        g = self._group(i)
        # offloaded: one input per parameter; else the foreach copy's flat buffer of those cast to param_dtype
        inputs = self._offloaded_inputs(s, g) if self.offload else [s.alloc(sum(g.casts), ALL_GATHER_STREAM)]
        out = s.alloc(g.all_gather, ALL_GATHER_STREAM)
        s.free_all(inputs)
        return out

    def _offloaded_input(self, s: Stream, g: _Group, k: int, stream: int = ALL_GATHER_STREAM) -> int:
        """CPUOffloadPolicy: parameter ``k``'s all-gather input (_fsdp_param.py ``FSDPParam.all_gather_inputs``,
        on the all-gather copy-in stream; on one rank the default one): its host shard copied to the device
        (``.to(device, non_blocking=True)``, the shard's own dtype), then under the mixed-precision policy cast to
        ``param_dtype`` (``_to_dtype_if_needed``), which frees the copy when the property returns."""
        copy = s.alloc(g.shards[k], stream)
        if not g.casts[k]:
            return copy
        cast = s.alloc(g.casts[k], stream)
        s.free(copy)
        return cast

    def _offloaded_inputs(self, s: Stream, g: _Group) -> list[int]:
        """Every parameter's all-gather input, one by one: offloaded parameters take no foreach copy into one flat
        buffer (_fsdp_collectives.py ``_get_param_all_gather_inputs``: ``use_foreach_copy`` is false), and
        ``foreach_all_gather`` holds them (``all_gather_inputs``) until it returns, after the copy-in."""
        return [self._offloaded_input(s, g, k) for k in range(len(g.shards))]

    def _copy_out(self, s: Stream, i: int) -> None:
        """``wait_for_unshard``: the unsharded parameters (``init_unsharded_param``). On one rank with
        CPUOffloadPolicy each is copied from its all-gather input (the host shard on the device), made just before
        it; the loop's variable keeps the previous one until the next is made (_fsdp_param_group.py
        ``wait_for_unshard``, ``world_size == 1``)."""
        g = self._group(i)
        if not (self.offload and self.shards == 1):
            self.unsharded[i] = [s.alloc(n) for n in g.unsharded]
            return
        out, prev = [], 0
        for k, n in enumerate(g.unsharded):
            cur = self._offloaded_input(s, g, k, stream=0)
            s.free(prev)
            out.append(s.alloc(n))
            prev = cur
        s.free(prev)
        self.unsharded[i] = out

    def _reshard(self, s: Stream, i: int) -> None:
        s.free_all(self.unsharded.pop(i, []))

    def forward_begin(self, s: Stream) -> None:
        # the root's pre-forward, then (units) the group of the table: its own, or [final norm, head] when tied
        self.layer_forward_begin(s, ROOT_UNIT)
        if self.units:
            self.layer_forward_begin(s, EMBEDDING_UNIT if self.untied else TAIL_UNIT)

    def embedding_forward_end(self, s: Stream) -> None:
        if self.untied and self.raf:
            self._reshard(s, EMBEDDING_UNIT)

    def head_forward_begin(self, s: Stream) -> None:
        # the final norm's pre-forward unshards [final norm, head], kept to its post-backward (accelerate and
        # torchtitan pass reshard_after_forward=False: its backward follows at once)
        if self.untied:
            self.layer_forward_begin(s, TAIL_UNIT)

    def layer_forward_begin(self, s: Stream, i: int) -> None:
        # In forward the all-gather output is kept (``comm_ctx.all_gather_state``) until the next copy-out.
        if i in self.unsharded or not self._group(i).tensors:
            return
        # ``wait_for_unshard`` drops the previous group's output from ``all_gather_state`` but its local
        # ``prev_all_gather_state`` holds it until the copy-out is done (the closed form's copy-out moments)
        out = self._all_gather(s, i)
        self._copy_out(s, i)
        s.free(self.gather_out)
        self.gather_out = out

    def layer_forward_end(self, s: Stream, i: int) -> None:
        if self.raf:
            self._reshard(s, i)

    def backward_begin(self, s: Stream) -> None:
        s.free(self.gather_out)  # the root's post-forward
        self.gather_out = 0
        if not self.units:
            self._prefetch_last(s)

    def head_backward_begin(self, s: Stream) -> None:
        if self.units:
            self._prefetch_last(s)

    def _prefetch_last(self, s: Stream) -> None:
        """The pre-backward of the group whose forward ran last prefetches the first layer to run backward, the last
        (``FSDPState._pre_backward`` → ``_backward_prefetch``). It is registered on that group's output: the root's
        is the model's, whose loss (computed inside the HF model's forward) starts the backward; [final norm,
        head]'s (units) is the logits, reached after the loss's backward."""
        last = len(self.layers) - 1
        if last >= 0 and last not in self.unsharded:
            self.prefetched[last] = self._all_gather(s, last)

    def layer_backward_begin(self, s: Stream, i: int) -> None:
        # In backward the all-gather output is freed at its copy-out; the pre-backward then prefetches the
        # next layer to run (``_backward_prefetch``): its all-gather output waits for that layer.
        if i not in self.unsharded:
            out = self.prefetched.pop(i, None)
            if out is None:
                out = self._all_gather(s, i)
            self._copy_out(s, i)
            s.free(out)
        nxt = i - 1 if i >= 1 else EMBEDDING_UNIT if self.untied else None  # the table's unit runs after layer 0
        if nxt is not None and nxt not in self.unsharded and nxt not in self.prefetched:
            self.prefetched[nxt] = self._all_gather(s, nxt)

    def early_grad(self, spec: ModelSpec, x: ParamTensor) -> bool:
        # units, untied: [final norm, head] reduces its gradients right after the final norm's backward
        return super().early_grad(spec, x) or (self.untied and self.unit_of.get(x) == TAIL_UNIT)

    def head_backward_end(self, s: Stream, grads: list[int]) -> list[int]:
        """Units, untied: [final norm, head]'s post-backward, which ``RegisterPostBackwardFunction`` on the final
        norm's input runs after its backward: the head's gradient is reduced early, freed after the reduce output
        (as the trace frees it), its reduce-scatter input in flight through the top layer's backward. Not when every
        layer is dead (:attr:`tail_early`)."""
        if not self.tail_early:
            return grads
        return self._post_backward(s, TAIL_UNIT, [], held=grads)

    def embedding_backward_begin(self, s: Stream) -> None:
        """Units, untied: the table's pre-backward copies out its all-gather, prefetched by layer 0's."""
        if not self.untied or EMBEDDING_UNIT in self.unsharded or self.blind_from:
            return  # (no backward reaches the table: its prefetch was dropped, layer_backward_end)
        out = self.prefetched.pop(EMBEDDING_UNIT, None)
        if out is None:
            out = self._all_gather(s, EMBEDDING_UNIT)
        self._copy_out(s, EMBEDDING_UNIT)
        s.free(out)

    def _post_backward(self, s: Stream, i: int, grads: list[int], held: Sequence[int] = ()) -> list[int]:
        """``FSDPParamGroup.post_backward``: reshard, release the previous reduce-scatter input (one in flight,
        ``reduce_scatter_max_input_buffers``), then ``foreach_reduce``: the input, the copy-in that frees the
        unsharded gradients but ``held``, the reduce output the sharded gradients are views of; then ``held`` goes.
        The traces free a group's last gradient (the head's under the root, the table's in its own unit, the head's
        in [final norm, head]) only after the reduce output; the callers hold it. Under no_sync (:attr:`no_sync`)
        the group's accumulated gradients take this micro-step's first, only the last micro-step reduces them, and
        the last accumulated one is held the same way (the trace of HSDP with units: [final norm, head]'s fp32 head
        gradient beside the reduce output; freeing it at the copy-in put the stream 3.3% under that peak)."""
        if self.no_sync:
            merged = self._accumulate(s, i, [*grads, *held])
            if not self.syncing:
                return []
            grads, held = merged[:-1], merged[-1:]
        self._reshard(s, i)
        s.free(self.rs_pending)
        g = self._group(i)
        self.rs_pending = s.alloc(g.reduce_scatter)
        s.free_all(grads)
        out = [s.alloc(g.shard_grads, REDUCE_SCATTER_STREAM)]
        if self.offload:
            # CPUOffloadPolicy: each sharded gradient is copied to the host (``new_sharded_grad.to("cpu")``) and
            # the device's reduce output is dropped when ``foreach_reduce`` returns; under HSDP it is the all-reduce's
            # input, which the group holds to the end of backward (``_all_reduce_state``) in every micro-step
            if self.replicated:
                self.all_reduce_held += out
            else:
                s.free_all(out)
            out = []
        elif self.accumulating:
            # A later micro-step: the reduce output is added into the existing sharded .grad
            # (``sharded_param.grad._local_tensor += new_sharded_grad``) and goes when ``foreach_reduce`` returns;
            # under HSDP the group holds it as its all-reduce input to the end of backward
            if self.replicated:
                self.all_reduce_held += out
            else:
                s.free_all(out)
            out = []
        s.free_all(held)
        return out

    def micro_step_begin(self, s: Stream, micro: int) -> None:
        self.accumulating = micro > 0 and not self.no_sync
        self.syncing = not self.no_sync or micro == self.micro_steps(self.strategy.grad_accum) - 1

    def micro_steps(self, grad_accum: int) -> int:
        """Under no_sync three with 3 or more accumulation steps: the first (nothing accumulated yet), one that adds
        into the accumulated gradients without reducing, and the last, which reduces them."""
        return min(grad_accum, 3 if self.no_sync else 2)

    def _accumulate(self, s: Stream, i: int, grads: list[int]) -> list[int]:
        """No_sync, ``post_backward``'s first part: a later micro-step adds this one's gradients into the kept ones
        in place and drops them (``accumulate_unsharded_grad_if_needed``). A micro-step that does not reduce then
        reshards and, the first time, keeps autograd's gradients, upcast to the reduce dtype under the policy
        (``to_accumulated_grad_if_needed``: after the reshard, one ``.to(reduce_dtype)`` per parameter, then
        autograd's go). The last micro-step reduces what was kept: returned, forgotten here."""
        kept = self.kept.pop(i, None)
        if kept is not None:
            s.free_all(grads)
            grads = kept
        if self.syncing:
            return grads
        self._reshard(s, i)
        if kept is None and self.upcast:
            upcast = [s.alloc(_alloc_bits(n, self.reduce_bits)) for n in self._kept_numels(i)]
            s.free_all(grads)
            grads = upcast
        self.kept[i] = grads
        return grads

    def _kept_numels(self, i: int) -> list[int]:
        """Elements of each gradient group ``i`` keeps under no_sync, in the order of its trainable tensors."""
        return [x.numel for x in self._group(i).trainable] if i < 0 else [n for n, _ in self.layer_grads[i]]

    def layer_backward_end(self, s: Stream, i: int, grads: list[int]) -> list[int]:
        """The layer's bf16 weight gradients, held unsharded to its post-backward, which runs after the whole
        layer's backward (``RegisterPostBackwardFunction`` on its inputs), with its input norm's fp32 backward
        temporaries over them: the closed form's input-norm moment (``parallel._fsdp_norm_moments``). Made
        here, after the layer's saved tensors are released, rather than with its block's temporaries as the
        single-GPU stream makes them (all of them beside every saved tensor and the block's temporaries: 2.3% above
        the closed form for llama-3.1-70b over 64 ranks with full recompute, whose trace peaks at the input-norm
        moment, 3.8% with CPU offload); the MLP's gradients beside the attention's saved tensors (the
        post-attention norm's moment) are left out."""
        grads = [s.alloc(_alloc_bits(n, bits)) for n, bits in self.layer_grads[i]]
        s.free(s.alloc(self.norm_temp))
        if self.blind_from and i == self.blind_from - 1:
            # The lowest layer to run backward, its input needing no gradient: no autograd hook runs its
            # post-backward (``_register_post_backward_hook`` finds no input that requires grad); the root's final
            # callback does (:meth:`_final_callback`), its unsharded gradients held until then.
            self.pending = (i, grads)
            return []
        return self._post_backward(s, i, grads)

    def _final_callback(self, s: Stream) -> list[int]:
        """After the root's (and the table unit's) post-backward, the rest of the root's final callback
        (_fsdp_state.py ``_root_post_backward_final_callback``: every state in module order, each group's
        ``post_backward`` unless it ran, then ``finalize_backward``): the dead layers' groups are resharded (still
        unsharded from their forward without ``reshard_after_forward``), the all-gather output the lowest live
        layer's pre-backward prefetched for the dead layer below it (or the root's for the top layer when every
        layer is dead) is dropped unread (``finalize_backward``: a mistargeted unshard), then the lowest live layer's
        post-backward reshards it and reduces its gradients."""
        for i in sorted(k for k in self.unsharded if 0 <= k < self.blind_from - 1):
            self._reshard(s, i)
        s.free_all(self.prefetched.pop(k) for k in list(self.prefetched))
        if self.pending is None:
            return []
        i, grads = self.pending
        self.pending = None
        return self._post_backward(s, i, grads)

    def backward_end(self, s: Stream, head: list[int], late: list[int]) -> list[int] | None:
        if self.units:
            out = self._units_post_backward(s, head, late)
        else:
            # The LM head's 16-bit gradient outlives the root's copy-in (the trace: it is freed after the root's
            # reduce output is made; analytic.parallel ``_fsdp``'s embedding moment).
            out = self._post_backward(s, ROOT_UNIT, late, held=head)
            out += self._final_callback(s)
        s.free(self.rs_pending)
        self.rs_pending = 0
        s.free_all(self.all_reduce_held)  # ``finalize_backward``
        self.all_reduce_held = []
        s.free(self.gather_out)
        self.gather_out = 0
        return out

    def _units_post_backward(self, s: Stream, head: list[int], late: list[int]) -> list[int]:
        """Units: the post-backward of each model-level group still to reduce, from the root's final callback, in the
        order of the FSDP states (the root's first; _fsdp_state.py ``_root_post_backward_final_callback``). Untied,
        ``head`` is [final norm, head]'s reduce output already; each group's gradients are freed after its reduce
        output (the trace)."""
        by_unit: dict[int, list[int]] = {ROOT_UNIT: [], EMBEDDING_UNIT: [], TAIL_UNIT: []}
        for x, key in zip(self.late_order, late, strict=True):
            if x not in self.in_layers:  # an adapter's: made with its layer's (0 here)
                by_unit[self.unit_of[x]].append(key)
        out = list(head) if self.tail_early else []
        if not self.tail_early:
            by_unit[TAIL_UNIT] += head
        for u in (ROOT_UNIT, EMBEDDING_UNIT, TAIL_UNIT):
            if by_unit[u]:
                out += self._post_backward(s, u, [], held=by_unit[u])
            else:  # no gradient to reduce: only the reshard
                self._reshard(s, u)
            if u == EMBEDDING_UNIT and self.untied:  # the layers come before [final norm, head] in module order
                out += self._final_callback(s)
        if not self.untied:  # tied, [final norm, head] holds the table, whose module comes first: the layers after
            out += self._final_callback(s)
        return out

    def optimizer_states(self, s: Stream, strategy: Strategy, trained: Trained, state_bits: StateBits = None) -> None:
        st = self.strategy
        if self.offload:
            return  # on the host, like the step that makes them
        for h in self.held:
            if not h.trainable:
                continue
            pieces = optimizer_state_tensors(
                shard_tensor(h.tensor, self.shards), st.optimizer, h.bits, st.optimizer_impl
            )
            for _ in range(h.count):
                for n in pieces:
                    s.alloc(n)

    def step_temp_bytes(self, default: int) -> int:
        st = self.strategy
        if self.offload:
            return 0  # the step runs on the host
        if st.optimizer is Optimizer.ADAMW and st.optimizer_impl is OptimizerImpl.FOREACH:
            return sum(g.shard_grads for g in self.layers) + sum(g.shard_grads for g in self.model_groups.values())
        return 0 if st.optimizer is Optimizer.ADAMW else default


class DtensorTpHooks(RankHooks):
    """DTensor tensor parallelism ± sequence parallelism (torchtitan's Llama plan, ``--engine torch --tp``,
    no sharding), rank 0: the single-GPU stream of :func:`~trainfit.analytic.parallel.dtensor_tp_spec`'s model
    (heads, k/v heads and MLP width split; hidden size and the gathered vocabulary whole) with the states of
    the rank's shards (:func:`~trainfit.analytic.parallel.dtensor_tp_held_spec`: ⌈V/tp⌉ vocabulary rows of the
    token table and the head), and the two DTensor facts of the closed form (``parallel._torch_tp``): the token
    table's gradient computed whole (``embedding_dense_backward`` has no vocabulary-sharded strategy), and the
    logits gathered whole (``_functional_collectives.all_gather_single`` into a whole-size buffer, then
    ``_maybe_view_chunk_cat``, with the rank's own slice still referenced). With ``sequence_parallel`` the
    sequence-sharded (``Shard(1)``) tensors are 1/tp: the norms' saved tensors (``SequenceParallel``:
    :data:`~trainfit.analytic.parallel.SP_SPLIT_PREFIXES`), a checkpointed segment's input and the final norm's
    backward temporaries (as ``parallel._tp_inputs`` splits them), and the residual stream and its gradient
    between layers (o_proj and down_proj return ``Shard(1)``; with these and the segment inputs left whole
    the full-checkpointing trace cell's allocated peak is 0.75% over the traced one); each matmul's input is the
    all-gathered whole (``PrepareModuleInput``: ``Shard(1)`` → ``Replicate()``)."""

    module_order = False  # its states come from the grouped counts

    adapter_flow = False  # events.LoraFlow: its linears are sharded (the flows are whole-layer shapes)

    def __init__(self, spec: ModelSpec, strategy: Strategy, tp: int, *, sequence_parallel: bool = False) -> None:
        self.seq = tp if sequence_parallel else 1
        held = dtensor_tp_held_spec(spec, tp)
        self.states = param_states(held, strategy)
        self.trained = [(ps.tensor, ps.count) for ps in self.states if ps.trainable]
        self.step_temp = model_states(held, strategy).step_temp_bytes
        self.rows = held.vocab_size
        self.vocab = spec.vocab_size
        a = strategy.recipe.compute_bits
        t = strategy.tokens_per_micro_batch
        self.gather = (_alloc_bits(t * self.rows, a), _alloc_bits(t * self.vocab, a))

    def _rank_rows(self, x: ParamTensor) -> int:
        """Elements of the rank's shard of ``x`` (the head's ⌈V/tp⌉ rows; the rest as the stream's model)."""
        return x.numel * self.rows // self.vocab if x.name.startswith("lm_head") else x.numel

    def weights(self, s: Stream, states: Sequence[ParamState]) -> None:
        super().weights(s, self.states)

    def saved_bytes(self, name: str, nbytes: int) -> int:
        return nbytes // self.seq if name.startswith(SP_SPLIT_PREFIXES) else nbytes

    def residual_bytes(self, nbytes: int) -> int:
        return nbytes // self.seq

    def copy_bytes(self, x: ParamTensor, bits: int) -> int:
        return _alloc_bits(self._rank_rows(x), bits)

    def grad_bytes(self, x: ParamTensor, bits: int) -> int:
        return _alloc_bits(self._rank_rows(x), bits)  # the token table's: whole

    def logits_gather(self, s: Stream) -> list[int]:
        return [s.alloc(n) for n in self.gather]  # the rank's logits, the all-gather output

    def master_weights(self, s: Stream, strategy: Strategy, trained: Sequence[tuple[ParamTensor, int]]) -> None:
        super().master_weights(s, strategy, self.trained)

    def master_grads(
        self, s: Stream, strategy: Strategy, trained: Sequence[tuple[ParamTensor, int]]
    ) -> tuple[list[int], int]:
        return super().master_grads(s, strategy, self.trained)

    def optimizer_states(self, s: Stream, strategy: Strategy, trained: Trained, state_bits: StateBits = None) -> None:
        super().optimizer_states(s, strategy, self.trained)

    def step_temp_bytes(self, default: int) -> int:
        return self.step_temp


class FsdpTpHooks(FsdpHooks):
    """2-D FSDP2 × DTensor TP (± SP; torchtitan's ``parallelize_llama``: ``apply_tp``, then ``fully_shard`` per layer
    and root over the ``dp`` mesh dimension), rank 0: FSDP2's groups of the TP-local tensors
    (:func:`~trainfit.analytic.parallel.dtensor_tp_held_spec`, each sharded on dim 0 of its local tensor over the dp
    ranks, as the closed form ``parallel._fsdp_tp``), over the stream of the TP-local model
    (:func:`~trainfit.analytic.parallel.dtensor_tp_spec`) with DTensor TP's departures (:class:`DtensorTpHooks`:
    the rank's vocabulary rows of the head, the gathered logits, SP's sequence-sharded tensors). The token table's
    gradient is computed whole (``embedding_dense_backward`` has no vocabulary-sharded strategy), then redistributed
    ``Replicate`` → ``Shard(0)`` into a copy of the rank's ⌈V/tp⌉ rows, the whole one freed, before the root's
    post-backward reduce-scatters it."""

    def __init__(
        self, spec: ModelSpec, strategy: Strategy, tp: int, dp: int, *, sequence_parallel: bool = False
    ) -> None:
        super().__init__(dtensor_tp_held_spec(spec, tp), strategy, dp)
        self.tp = DtensorTpHooks(spec, strategy, tp, sequence_parallel=sequence_parallel)
        # the input norm's backward temporaries are sequence-sharded under SP (as parallel._tp_inputs splits them)
        self.norm_temp = self.tp.residual_bytes(self.norm_temp)
        stream = dtensor_tp_spec(spec, tp)
        run = compute_strategy(strategy, casts_every_param=strategy.recipe.mixed)
        layers = {x for g in inventory(stream).layers for x in g.tensors}
        # the gradients synthesise makes at the end of backward, in its order
        self.late_stream = [
            ps.tensor
            for ps in param_states(stream, run)
            if ps.trainable and ps.tensor not in layers and not self.early_grad(stream, ps.tensor)
        ]
        self.table_rows = _alloc_bits(self.tp.rows * spec.hidden_size, run.recipe.grad_bits)
        # no_sync: the table's gradient is kept whole (parallel.tp_kept_table_grad_bytes); the reducing micro-step's
        # post-backward copies the rank's rows, in the reduce dtype, out of the accumulated whole one
        self.whole_table = spec.vocab_size * spec.hidden_size
        self.kept_rows = _alloc_bits(self.tp.rows * spec.hidden_size, self.reduce_bits)
        self.kept_table = 0  # the key of the kept whole gradient

    def saved_bytes(self, name: str, nbytes: int) -> int:
        return self.tp.saved_bytes(name, nbytes)

    def residual_bytes(self, nbytes: int) -> int:
        return self.tp.residual_bytes(nbytes)

    def copy_bytes(self, x: ParamTensor, bits: int) -> int:
        return self.tp.copy_bytes(x, bits)

    def grad_bytes(self, x: ParamTensor, bits: int) -> int:
        return 0 if x in self.in_layers else self.tp.grad_bytes(x, bits)

    def logits_gather(self, s: Stream) -> list[int]:
        return self.tp.logits_gather(s)

    def _kept_numels(self, i: int) -> list[int]:
        if i != ROOT_UNIT:
            return super()._kept_numels(i)
        return [self.whole_table if x.name == "embed_tokens.weight" else x.numel for x in self._group(i).trainable]

    def _accumulate(self, s: Stream, i: int, grads: list[int]) -> list[int]:
        if i != ROOT_UNIT:
            return super()._accumulate(s, i, grads)
        first = ROOT_UNIT not in self.kept
        out = super()._accumulate(s, i, grads)
        if first and not self.syncing:  # the kept gradients: upcast ones in _kept_numels' order, or autograd's own
            order = self._group(i).trainable if self.upcast else self.late_stream
            at = [k for k, x in enumerate(order) if x.name == "embed_tokens.weight"]
            self.kept_table = out[at[0]] if at else 0
        if self.syncing and self.kept_table in out:
            rows = s.alloc(self.kept_rows)
            s.free(self.kept_table)
            out[out.index(self.kept_table)] = rows
            self.kept_table = 0
        return out

    def backward_end(self, s: Stream, head: list[int], late: list[int]) -> list[int] | None:
        late = list(late)
        for k, x in enumerate(self.late_stream):
            if x.name == "embed_tokens.weight" and not self.no_sync:  # the rank's rows copied out of the whole one
                rows = s.alloc(self.table_rows)
                s.free(late[k])
                late[k] = rows
        return super().backward_end(s, head, late)


#: DeepSpeed's reduction stream (stage_1_and_2.py ``__init__``: ``self.reduction_stream``): with ``overlap_comm``
#: the reduced gradients are copied into the partition's buffer under it (``reduce_ipg_grads``).
DS_REDUCTION_STREAM = 3


class Zero2Hooks(_OwnMasters, RankHooks):
    """DeepSpeed ZeRO-2 (stage_1_and_2.py ``DeepSpeedZeroOptimizer``; fine-tuning without offload too: the optimizer's,
    and so the flat groups', tensors are the trainable ones, the frozen ones stay module parameters), data-parallel rank
    ``rank`` (0 unless asked; its partition ``[lo, hi)``, :class:`~trainfit.analytic.parallel.ZeroRank`):

    * init: the flat 16-bit parameters (``bit16_groups_flat``), the fp32 partition
      (``single_partition_of_fp32_groups``), a zero fp32 gradient partition made and dropped
      (``initialize_optimizer_states``);
    * backward: each gradient, as autograd makes it, goes into the IPG bucket (``process_gradients`` →
      ``setup_buckets`` makes ``reduce_bucket_size`` 16-bit elements, twice with ``overlap_comm``, at the first
      gradient; ``reduce_independent_p_g_buckets_and_remove_grads`` copies it in, so autograd's tensor goes);
      a full bucket is reduced (``reduce_ipg_grads``; one spanning a partition edge is first copied into one
      tensor for the collective, :meth:`_flatten_chunks`, freed when it returns) and the gradients
      of the parameters the rank's partition meets are copied into ``grads_in_partition`` (``copy_grads_in_partition``,
      made at the first such copy, on the reduction stream with ``overlap_comm``); a parameter larger than the bucket
      keeps its own gradient until the next reduction; the epilogue reduces the rest and frees the buckets
      (``independent_gradient_partition_epilogue`` → ``_release_ipg_buffers``);
    * step (``step``): the fp64 norm of each slice (``get_grad_norm_direct``), the flattened 16-bit partition (a
      view when the partition lies in one parameter: ``parallel.deepspeed_step_copies_partition``) and
      its fp32 copy, then the 16-bit one and ``grads_in_partition`` go (``free_grad_in_param_list``); AdamW's
      states are made in the first step; the fp32 gradient goes after it; the updated partitions are
      all-gathered in place into the flat 16-bit groups (runtime/utils.py ``all_gather_dp_groups``: one
      ``all_gather_into_tensor`` per group where the backend has it, else ``allgather_bucket_size`` chunks of
      views; no allocation either way).

    The step's events are written from :meth:`step_temp_bytes` (the one per-step hook after backward), on the
    stream the hooks keep from :meth:`weights`."""

    module_order = False  # its states come from the grouped counts

    adapter_flow = True  # events.LoraFlow: a data-parallel rank's activations are one GPU's

    # Accumulation: every micro-step's gradients go through the bucket (``partition_gradients``); the rank's keep
    # their views into ``grads_in_partition``, made once per step, so a later micro-step is the first's
    reduces_each_micro_step = True
    #: Whether a reduced gradient larger than the bucket, of a parameter outside the partition, stays as ``.grad``
    #: to the epilogue (stage 1's hooks clear nothing; stage 2's ``clear_grad_attribute`` frees it)
    keeps_outside_grads = False

    def __init__(
        self,
        spec: ModelSpec,
        strategy: Strategy,
        p: ParallelPlan,
        *,
        free_device_bytes: int | None = None,
        rank: int = 0,
    ) -> None:
        self.pb = 4 if strategy.recipe.compute_bits == 32 else 2  # parameter and gradient bytes
        self.free_device_bytes = free_device_bytes
        zp = zero_partition(spec, strategy, 2, p.dp)
        self.total, self.part = zp.trainable_numel, zp.part_numel
        self.state_sizes, self.client_temps = zero_client_step(strategy, self.part)
        # the data-parallel rank's partition [lo, hi) of the flat buffer (parallel.ZeroRank)
        zr = deepspeed_rank(spec, self.part, strategy.engine.reduce_bucket_size, rank, strategy)
        self.lo, self.hi = zr.lo, zr.lo + self.part
        self.largest_slice, self.step_copies = zr.largest_slice, zr.step_copies
        self.partition_grads = allocator_bytes(zr.whole_numel * self.pb)
        eo = strategy.engine
        self.bucket_numel = eo.reduce_bucket_size
        self.overlap = bool(eo.overlap_comm)  # DeepSpeed's default for stages 1–2: False
        # ZeRO-Offload (stages 1–2): the fp32 partition, its gradient and Adam's states are the host's
        self.offload = strategy.offload.optimizer_on_host
        # Offsets in the flat buffer (``model.parameters()`` order: embeddings, layers, final norm and head; fine-
        # tuning: the trainable tensors only, the optimizer's)
        self.model_offset: dict[str, int] = {}
        self.layer_offset: list[dict[str, int]] = [{} for _ in range(spec.num_layers)]
        off = 0
        flat = deepspeed_flat_layout(spec, strategy)
        for layer, t in flat:
            (self.model_offset if layer is None else self.layer_offset[layer])[t.name] = off
            off += t.numel
        # The model's own 16-bit parameter tensors before the engine flattens them: the optimizer's, in module
        # order, and (fine-tuning) the frozen ones, which stay module parameters (the engine's bf16/fp16 block casts
        # them too; adapters, frozen bases, packed nothing: QLoRA with ZeRO is refused)
        self.param_numels = [t.numel for _, t in flat]
        self.frozen_numels = (
            [h.tensor.numel for h in held_tensors(spec, strategy) if not h.trainable for _ in range(h.count)]
            if finetuning(strategy)
            else []
        )
        self.s = Stream()  # replaced by the replayed stream in weights()
        self.layer: int | None = None  # the layer whose gradients autograd is making (None: model-level)
        self.buckets: list[int] = []
        self.elements = 0
        self.pending_part = 0  # elements in the bucket of parameters the rank's partition meets
        self.pending_slices: list[int] = []  # each such parameter's elements inside the partition
        # gradients larger than the bucket, kept until the next reduction: (key, whether the reduction leaves it as the
        # parameter's .grad to the epilogue's ``_clear_param_grad_only``) — under offload one of the partition
        # (``copy_grads_in_partition`` copies it to the host and returns), at stage 1 one outside it (stage 2's
        # ``clear_grad_attribute`` frees it; stage 1 clears nothing in its hooks: the traced engine keeps the untied
        # head's 4 MiB gradient to the epilogue)
        self.pending: list[tuple[int, bool]] = []
        self.epilogue: list[int] = []
        self.contents: list[tuple[int, int]] = []  # (flat offset, elements) of what the next reduction reduces
        self.grads_in_partition = 0
        self.states: list[int] = []
        self.n_micro = self.micro_steps(strategy.grad_accum)
        self.micro = 0
        self.boundary = True  # the step's last micro-step (``is_gradient_accumulation_boundary``)

    def micro_step_begin(self, s: Stream, micro: int) -> None:
        self.micro, self.boundary = micro, micro == self.n_micro - 1

    def model_bytes(self) -> int:
        """The model's own 16-bit parameter tensors on the device, as the allocator rounds them."""
        return sum(allocator_bytes(n * self.pb) for n in [*self.param_numels, *self.frozen_numels])

    def flattens_on_device(self) -> bool:
        """DeepSpeed's test (stage_1_and_2.py ``flatten_on_accelerator``): the free memory holds the flat buffer."""
        free = self.free_device_bytes
        return free is not None and free >= allocator_bytes(self.total * self.pb)

    def weights(self, s: Stream, states: Sequence[ParamState]) -> None:
        """The flat 16-bit groups as ``DeepSpeedZeroOptimizer.__init__`` makes them: on the device, while the
        model's own parameter tensors are still there, when ``accelerator.available_memory()`` (``free_device_bytes``
        after the model is loaded) holds the flat buffer (``flatten_on_accelerator``, DeepSpeed ≥ 0.16); otherwise
        the parameters go to the host and ``empty_cache()`` releases their segments before the flat buffer is
        copied in — as if they had never been on the device (the default: the free memory is not known)."""
        self.s = s
        for n in self.frozen_numels:  # fine-tuning: the frozen parameters stay as the model loaded them
            s.alloc(allocator_bytes(n * self.pb))
        model: list[int] = []
        if self.flattens_on_device():
            model = [s.alloc(allocator_bytes(n * self.pb)) for n in self.param_numels]
        s.alloc(allocator_bytes(self.total * self.pb))  # bit16_groups_flat
        s.free_all(model)  # _update_model_bit16_weights: the parameters become views of it
        # single_partition_of_fp32_groups: the rank's 16-bit partition ``.detach().clone().to(fp32)``, the clone
        # dropped (under offload ``.to(device=cpu)``: the fp32 copy is the host's); an fp32 partition's ``.to``
        # returns the clone itself, which stays as the master
        clone = s.alloc(self.part * self.pb)
        if self.offload:
            s.free(clone)
        elif self.pb != 4:
            s.alloc(self.part * 4)
            s.free(clone)
        if self.offload:
            # ``temp_grad_buffer_for_gpu_offload``: a 16-bit device buffer of the largest parameter, held all run
            s.alloc(allocator_bytes(max(self.param_numels) * self.pb))
        else:
            s.free(s.alloc(self.part * 4))  # initialize_optimizer_states: a zero fp32 grad partition, dropped

    def grad_bytes(self, x: ParamTensor, bits: int) -> int:
        self._into_bucket(x)
        return 0  # copied into the bucket: autograd's gradient goes at once

    def defers_tied_table(self) -> bool:
        return True  # the gradient hooks (process_gradients) fire on AccumulateGrad, after autograd's sum

    def defers_head_grads(self) -> bool:
        return True  # ... after the head's MmBackward has returned and dropped the logits' gradient

    def head_grads_taken(self, s: Stream, grads: list[tuple[ParamTensor, int]]) -> None:
        self.layer = None
        for x, key in reversed(grads):  # the hooks' order: the reverse of the flat buffer's (a head's bias first)
            self._into_bucket(x, key)

    def tied_table_grad(self, s: Stream, x: ParamTensor, key: int) -> None:
        self.layer = None
        self._into_bucket(x, key)

    def _setup_buckets(self) -> None:
        """``setup_buckets``, at the first gradient: ``reduce_bucket_size`` elements, two with ``overlap_comm``."""
        if not self.buckets:
            self.buckets = [self.s.alloc(self.bucket_numel * self.pb) for _ in range(2 if self.overlap else 1)]

    def _into_bucket(self, x: ParamTensor, own: int | None = None) -> None:
        """``reduce_independent_p_g_buckets_and_remove_grads`` for ``x``'s gradient (``own``: the key of a
        gradient that already exists, None: autograd's, never allocated): copied into the bucket and gone, a
        full bucket reduced first; one larger than the bucket keeps its own, reduced at the next flush."""
        s = self.s
        off = (self.model_offset if self.layer is None else self.layer_offset[self.layer]).get(x.name, 0)
        self._setup_buckets()
        if self.elements + x.numel > self.bucket_numel:
            self._reduce()
        if x.numel > self.bucket_numel:  # extra_large_param_to_reduce: its own gradient, reduced next time
            grad = own if own is not None else s.alloc(x.numel * self.pb)
            if self.offload:
                # ``_offload_gradient_safety_enabled`` (ZeRO-Offload, DeepSpeed 0.19): the gradient is cloned into
                # storage of its own (``grad_reduc.data = grad_reduc.detach().clone()``) and the original goes
                clone = s.alloc(x.numel * self.pb)
                s.free(grad)
                grad = clone
            in_part = self._meets(off, x.numel)
            self.pending.append((grad, (self.offload and in_part) or (self.keeps_outside_grads and not in_part)))
        elif own is not None:
            s.free(own)
        self.elements += x.numel
        self.contents.append((off, x.numel))
        if self._meets(off, x.numel):
            self.pending_part += x.numel
            self.pending_slices.append(min(off + x.numel, self.hi) - max(off, self.lo))

    def _meets(self, off: int, numel: int) -> bool:
        """Whether the parameter at flat offset ``off`` meets the rank's partition."""
        return off < self.hi and off + numel > self.lo

    def _flatten_chunks(self) -> list[int]:
        """Elements of each copy this flush makes (:func:`~trainfit.analytic.parallel.deepspeed_flatten_copies`)."""
        return deepspeed_flatten_copies(self.contents, self.part, self.bucket_numel)

    def _reduce(self) -> None:
        s = self.s
        # The copy of a bucket spanning a partition edge (:meth:`_flatten_chunks`), at every reduction: in backward
        # where the stream's order within a layer puts the flushes (autograd's may differ a little; left out until
        # 2026-12-04, the traced ranks of llama-3.2-1b in its tied table peaked at one, 928 MiB: stream −1.4%, now
        # −0.15%), and in ZeRO-1's reduction after backward, in flat order (:class:`Zero1Hooks`).
        for n in self._flatten_chunks():
            s.free(s.alloc(n * self.pb))
        if self.offload:
            # copy_grads_in_partition under offload: at the accumulation boundary, per parameter its slice's norm in
            # fp64 (``set_norm_for_param_grad_in_gpu``: ``.to(float64).norm(2)``), then the slice cast to fp32 for the
            # copy to the host (``async_inplace_copy_grad_to_fp32_buffer_from_gpu``); no device partition buffer.
            # Before the boundary each gradient is added to its host copy through the 16-bit staging buffer
            # (``async_accumulate_grad_in_cpu_via_gpu``): nothing allocated on the device
            for n in self.pending_slices if self.boundary else ():
                s.free(s.alloc(allocator_bytes(8 * n)))
                s.free(s.alloc(allocator_bytes(4 * n)))
        elif self.pending_part and not self.grads_in_partition:
            self.grads_in_partition = s.alloc(self.partition_grads, DS_REDUCTION_STREAM if self.overlap else 0)
        s.free_all(k for k, kept in self.pending if not kept)
        self.epilogue += [k for k, kept in self.pending if kept]
        self.pending, self.elements, self.pending_part, self.pending_slices, self.contents = [], 0, 0, [], []

    def backward_begin(self, s: Stream) -> None:
        self.layer = None

    def layer_backward_begin(self, s: Stream, i: int) -> None:
        self.layer = i

    def layer_backward_end(self, s: Stream, i: int, grads: list[int]) -> list[int]:
        self.layer = None
        return grads

    def backward_end(self, s: Stream, head: list[int], late: list[int]) -> list[int] | None:
        self._reduce()  # independent_gradient_partition_epilogue
        s.free_all(self.buckets)  # _release_ipg_buffers
        self.buckets = []
        self._clear_grads()
        return None

    def _clear_grads(self) -> None:
        """The epilogue's ``_clear_param_grad_only``: the gradients the reductions left as ``.grad`` go."""
        self.s.free_all(self.epilogue)
        self.epilogue = []

    def optimizer_states(self, s: Stream, strategy: Strategy, trained: Trained, state_bits: StateBits = None) -> None:
        pass  # made by the step (torch.optim.AdamW's lazy state), after the gradients are flattened

    def step_temp_bytes(self, default: int) -> int:
        s = self.s
        if self.offload:
            return 0  # DeepSpeedCPUAdam on the host; the 16-bit partition is copied back into the flat group in place
        s.free(s.alloc(allocator_bytes(8 * self.largest_slice)))  # the norm's fp64 slices, one at a time
        # self.flatten(self.averaged_gradients[i]): a view of the one parameter's slice when the partition lies in one
        flat = s.alloc(self.part * self.pb) if self.step_copies else 0
        fp32 = flat if self.pb == 4 else s.alloc(self.part * 4)  # .to(fp32): a no-op on fp32 gradients
        if fp32 != flat:
            s.free(flat)
        # free_grad_in_param_list(params_in_partition); an fp32 view of it keeps its storage to the step's end
        viewed = self.grads_in_partition if fp32 == 0 else 0
        s.free(self.grads_in_partition if not viewed else 0)
        self.grads_in_partition = 0
        if not self.states:
            self.states = [s.alloc(n) for n in self.state_sizes]
        s.free_all([s.alloc(n) for n in self.client_temps])  # the client optimizer's update temporaries
        s.free(fp32 or viewed)
        return 0


class Zero1Hooks(Zero2Hooks):
    """DeepSpeed ZeRO-1 (stage_1_and_2.py with ``partition_gradients`` False), rank ``rank``. With ``overlap_comm`` its
    gradient hooks reduce as stage 2's do (``process_gradients``: ``partition_gradients or overlap_comm``), and
    the stream is :class:`Zero2Hooks`'. Without it (stage 1's default) the hooks only make the IPG bucket at
    the first gradient (``setup_buckets``); autograd's 16-bit gradients all stay until backward ends; then the
    engine's ``allreduce_gradients`` → ``reduce_gradients`` walks the parameters in ``bit16_groups`` order
    (``model.parameters()``) through ``reduce_independent_p_g_buckets_and_remove_grads``: each gradient is
    copied into the bucket and becomes a view of it (its own storage goes), one larger than the bucket is
    reduced on its own at the next flush; a full bucket is reduced and the gradients of the parameters the rank's
    partition meets are copied into ``grads_in_partition`` (made at the first such copy); the epilogue
    (``overlapping_partition_gradients_reduce_epilogue``) flushes the rest and frees the bucket. The step is
    stage 2's (``averaged_gradients`` over ``grads_in_partition``)."""

    keeps_outside_grads = True

    def __init__(
        self,
        spec: ModelSpec,
        strategy: Strategy,
        p: ParallelPlan,
        *,
        free_device_bytes: int | None = None,
        rank: int = 0,
    ) -> None:
        super().__init__(spec, strategy, p, free_device_bytes=free_device_bytes, rank=rank)
        self.made: list[tuple[int | None, ParamTensor]] = []  # (layer or None, tensor) of autograd's gradients
        # (layer or None, name) → (flat offset, tensor, its gradient's key): autograd's gradients, kept to the
        # reduction
        self.kept: dict[tuple[int | None, str], tuple[int, ParamTensor, int]] = {}

    def _reduces_now(self) -> bool:
        """The hooks reduce as stage 2's (``overlap_comm``), which stage 1 does at the boundary only
        (``reduce_ready_partitions_and_remove_grads``: ``partition_gradients`` or the boundary)."""
        return self.overlap and self.boundary

    def defers_tied_table(self) -> bool:
        # the hooks reduce this micro-step (overlap_comm at the boundary): they take the table after autograd's sum;
        # otherwise autograd's gradients are kept (one GPU's path)
        return self._reduces_now()

    def defers_head_grads(self) -> bool:
        return self._reduces_now() and not self.micro  # (a later micro-step adds into the kept .grad: grad_bytes)

    def tied_table_grad(self, s: Stream, x: ParamTensor, key: int) -> None:
        if self.micro:  # a later micro-step: AccumulateGrad adds the sum into the kept .grad, which the hook takes
            s.free(key)
            key = self.kept.pop((None, x.name))[2]
        super().tied_table_grad(s, x, key)

    def grad_bytes(self, x: ParamTensor, bits: int) -> int:
        s = self.s
        if self.micro:
            # A later micro-step: AccumulateGrad adds autograd's gradient into the kept .grad in place; at the
            # boundary with overlap_comm the hook then takes the accumulated one into the bucket
            s.free(s.alloc(x.numel * self.pb))
            if self._reduces_now():
                self._into_bucket(x, self.kept.pop((self.layer, x.name))[2])
            return 0
        if self._reduces_now():
            return super().grad_bytes(x, bits)
        self._setup_buckets()  # process_gradients → setup_buckets, whether or not it reduces
        self.made.append((self.layer, x))
        return x.numel * self.pb

    def _keep(self, layer: int | None, grads: list[int]) -> None:
        """Pair the gradients ``layer`` (None: model-level) made, in order, with their keys."""
        offsets = self.model_offset if layer is None else self.layer_offset[layer]
        mine = [x for at, x in self.made if at == layer]
        for x, key in zip(mine, grads, strict=True):
            self.kept[(layer, x.name)] = (offsets.get(x.name, 0), x, key)
        self.made = [(at, x) for at, x in self.made if at != layer]

    def layer_backward_end(self, s: Stream, i: int, grads: list[int]) -> list[int]:
        if not self.micro and not self._reduces_now():
            self._keep(i, grads)
        self.layer = None
        return []  # kept to the reduction (or, reduced at once, never made)

    def backward_end(self, s: Stream, head: list[int], late: list[int]) -> list[int] | None:
        if not self.micro and not self._reduces_now():
            self._keep(None, head + late)
        if not self.boundary:
            return []  # before the boundary: nothing reduced, the gradients and the bucket stay
        if self.overlap:
            return super().backward_end(s, head, late)
        # reduce_gradients, in flat order: each kept gradient through the hooks' own path into the bucket
        for (layer, _name), (_off, x, key) in sorted(self.kept.items(), key=lambda kv: kv[1][0]):
            self.layer = layer
            self._into_bucket(x, key)
        self.layer = None
        self.kept = {}
        self._reduce()  # the epilogue's reduce_ipg_grads
        s.free_all(self.buckets)  # _release_ipg_buffers
        self.buckets = []
        self._clear_grads()
        return []


class Zero3Hooks(_OwnMasters, RankHooks):
    """DeepSpeed ZeRO-3 (stage3.py ``DeepSpeedZeroOptimizer_Stage3``; fine-tuning too: the flat buffer holds the
    trainable partitions, each frozen parameter's partition is its own), rank 0:

    * init: the flat buffer of every parameter's 16-bit partition (``lp_param_buffer``) and each persistent
      parameter whole (``ds_persist``), the fp32 partition, the gradient partition (``grad_partitions_flat_buffer``,
      held all run) and the IPG bucket (``__ipg_bucket_flat_buffer``, held all run);
    * forward and backward: the parameter coordinator's all-gathers (flat buffer of W partitions, then each
      parameter copied out whole), prefetches and releases, replayed by :mod:`trainfit.analytic.zero3` and
      written at the layer hooks of the step they belong to (a layer's modules at its begin, their releases at
      its end; the final norm and head after the last layer; the head's backward over the loss's, the norm's
      before the top layer's; a recomputed layer's forward with its backward); each gradient goes into the
      bucket as autograd makes it (none of its own);
    * step (``step``): the persistent parameters' whole copies go (``_partition_all_parameters``), the
      gradient partition flattened and cast to fp32 (``_prepare_fp32_grad_for_sub_group``), AdamW's states in
      the first step, then the persistent parameters gathered again (``_post_step``).

    With ZeRO-Offload (``offload_optimizer`` to the CPU) the fp32 partition, its zero gradient and the gradient
    partitions are host buffers (``self.device`` is ``cpu``; the 16-bit partition's blocking ``.to(cpu, fp32)``
    converts on the CPU, aten/src/ATen/native/cuda/Copy.cu — the stream made both fp32 buffers on the device until
    2026-12-04, after the trace, which filed them so), and the step is the host's (the 16-bit partition written back
    in place): on the device only the parameters, the bucket and the gathers. ZeRO-Infinity (``offload_param``)
    moves the 16-bit partitions to the host too (a frozen persistent parameter's stays). Against the traced engine's
    device events on tiny llama cells: allocated −0.74…+0.00%, reserved −4.3…+2.5%, with accumulation too."""

    module_order = False  # its states come from the grouped counts

    adapter_flow = True  # events.LoraFlow: a data-parallel rank's activations are one GPU's

    # Accumulation: each micro-step reduces into the persistent gradient partition (stage3.py
    # ``__reduce_and_partition_ipg_grads``): a later micro-step's events are the first's; one is replayed (the
    # traced engine with two steps: allocated +0.03%, reserved +0.75% on a tiny llama over 8)
    replays_accumulation = False

    def __init__(self, spec: ModelSpec, strategy: Strategy, p: ParallelPlan) -> None:
        self.pb = 4 if strategy.recipe.compute_bits == 32 else 2  # parameter and gradient bytes
        zp = zero_partition(spec, strategy, 3, p.dp)
        self.part = zp.part_numel
        self.state_sizes, self.client_temps = zero_client_step(strategy, self.part)
        self.lp = allocator_bytes(zp.stage3_part_numel * self.pb)
        # fine-tuning: the flat buffer holds the optimizer's (trainable) partitions; each frozen parameter's
        # partition is its own ``ds_tensor`` (partition_parameters.py ``_partition_param``; the traced engine)
        self.frozen_parts: list[int] = []
        if finetuning(strategy):
            self.lp = allocator_bytes(zp.part_numel * self.pb)
            # ZeRO-Infinity makes them on the host, a persistent one's on the device (zero3_frozen_partitions)
            host = strategy.offload.parameters_on_host
            self.frozen_parts = [
                allocator_bytes(n * self.pb)
                for n, persist in zero3_frozen_partitions(spec, strategy, p.dp)
                if (persist and p.dp > 1) or not host  # one rank: a persistent one's data is its partition
            ]
        self.persistent = [allocator_bytes(t.numel * self.pb) for t, m in zp.stage3_whole_tensors for _ in range(m)]
        self.bucket = allocator_bytes(strategy.engine.reduce_bucket_size * self.pb)
        self.replay = gathered_bytes(spec, strategy, p.dp, self.pb).events
        self.layers = spec.num_layers
        # ZeRO-Offload: the fp32 partition, the gradient partitions and Adam's states are the host's
        self.offload = strategy.offload.optimizer_on_host
        # ZeRO-Infinity (``offload_param``): the 16-bit partitions are the host's too
        self.params_on_host = strategy.offload.parameters_on_host
        self.s = Stream()
        self.cursor = 0
        self.keys: dict[int, int] = {}  # replay allocation id -> stream key
        self.whole: list[int] = []
        self.states: list[int] = []
        self.deferred: list[int] = []

    def weights(self, s: Stream, states: Sequence[ParamState]) -> None:
        self.s = s
        for n in self.frozen_parts:
            s.alloc(n)
        if not self.params_on_host:
            s.alloc(self.lp)
        self.whole = [s.alloc(n) for n in self.persistent]
        if not self.offload:
            s.alloc(self.part * 4)  # fp32_partitioned_groups_flat
            s.alloc(allocator_bytes(self.part * self.pb))  # grad_partitions_flat_buffer
        s.alloc(self.bucket)  # __ipg_bucket_flat_buffer

    def _play(self, *where: str, defer: bool = False) -> None:
        """The replay's events from the cursor while they belong to ``where``; ``defer``: its frees wait for
        :meth:`_release` (a layer's modules are one moment of the stream: what they gather is alive together
        with the layer's tensors, as the closed form's worst over the layer's modules counts it)."""
        ev, s = self.replay, self.s
        while self.cursor < len(ev) and ev[self.cursor][0] in where:
            _, ident, nbytes = ev[self.cursor]
            if nbytes:
                self.keys[ident] = s.alloc(nbytes)
            elif defer:
                self.deferred.append(self.keys.pop(ident, 0))
            else:
                s.free(self.keys.pop(ident, 0))
            self.cursor += 1

    def _release(self) -> None:
        self.s.free_all(self.deferred)
        self.deferred = []

    def forward_begin(self, s: Stream) -> None:
        self.cursor = 0
        self._play("fwd")

    def layer_forward_begin(self, s: Stream, i: int) -> None:
        self._play(f"fwd-L{i}", defer=True)

    def layer_forward_end(self, s: Stream, i: int) -> None:
        self._release()
        if i == self.layers - 1:
            self._play("fwd-norm", "head")

    def backward_begin(self, s: Stream) -> None:
        self._play("bwd-head", defer=True)  # the head stays gathered through the loss's and its own backward

    def layer_backward_begin(self, s: Stream, i: int) -> None:
        if i == self.layers - 1:
            self._release()
            self._play("bwd-norm")
        self._play(*(f"rec-L{j}" for j in range(self.layers)))  # the recomputation, before the layer's backward
        self._play(f"bwd-L{i}", defer=True)

    def layer_backward_end(self, s: Stream, i: int, grads: list[int]) -> list[int]:
        self._release()
        return grads

    def grad_bytes(self, x: ParamTensor, bits: int) -> int:
        return 0  # copied into the IPG bucket as it is made

    def backward_end(self, s: Stream, head: list[int], late: list[int]) -> list[int] | None:
        self._release()
        self._play("bwd-norm", "bwd-embed", "end")
        s.free_all(self.keys.values())
        self.keys = {}
        return None

    def optimizer_states(self, s: Stream, strategy: Strategy, trained: Trained, state_bits: StateBits = None) -> None:
        pass  # made by the step

    def step_temp_bytes(self, default: int) -> int:
        s = self.s
        s.free_all(self.whole)  # _partition_all_parameters
        if self.offload:  # the step is the host's; the updated 16-bit partition is copied back in place
            self.whole = [s.alloc(n) for n in self.persistent]
            return 0
        flat = s.alloc(allocator_bytes(self.part * self.pb))  # self.flatten(self.averaged_gradients[i])
        fp32 = flat if self.pb == 4 else s.alloc(self.part * 4)  # .to(fp32): a no-op on fp32 gradients
        if not self.states:
            self.states = [s.alloc(n) for n in self.state_sizes]
        if fp32 != flat:
            s.free(flat)
        s.free_all([s.alloc(n) for n in self.client_temps])  # the client optimizer's update temporaries
        s.free(fp32)
        self.whole = [s.alloc(n) for n in self.persistent]  # _post_step: gathered again
        return 0


# -- Megatron TP / SP / PP -------------------------------------------------------------------------------


def one_f_one_b(pp: int, stage: int, microbatches: int) -> list[tuple[bool, int]]:
    """The order of one stage's forward (True) and backward (False) passes over the micro-batches under the
    1F1B schedule (megatron/core/pipeline_parallel/schedules.py ``forward_backward_pipelining_without_
    interleaving``: ``num_warmup_microbatches = min(pp − stage − 1, m)`` forwards, then one forward and one
    backward in turn, then the warm-up's backwards; one stage, ``forward_backward_no_pipelining``, is F B F B)."""
    warmup = min(pp - stage - 1, microbatches)
    order = [(True, j) for j in range(warmup)]
    for j in range(microbatches - warmup):
        order += [(True, warmup + j), (False, j)]
    order += [(False, j) for j in range(microbatches - warmup, microbatches)]
    return order


def interleaved_order(pp: int, stage: int, microbatches: int, chunks: int) -> list[tuple[bool, int, int]]:
    """One stage's (forward?, micro-batch, model chunk) passes under Megatron's interleaved 1F1B schedule
    (megatron/core/pipeline_parallel/schedules.py ``forward_backward_pipelining_with_interleaving``, megatron-core
    0.19.2, without p2p overlap): ``get_schedule_table`` lists the virtual micro-batches group by group
    (``microbatch_group_size_per_vp_stage`` = pp micro-batches, each through chunk 0, then chunk 1, …);
    ``get_pp_rank_microbatches`` runs (pp − stage − 1)·2 + (v − 1)·pp warm-up forwards (at most m·v), then forward
    ``k + warmup`` and backward ``k`` in turn, then the remaining backwards; backward ``k`` runs model chunk
    v − 1 − (table chunk of k) (``get_model_chunk_id(k, forward=False)``) on that chunk's oldest outstanding
    micro-batch (``input_tensors[chunk].pop(0)``)."""
    m, v = microbatches, chunks
    table = [
        (mb, c) for lo in range(0, m, pp) for c in range(v) for mb in range(lo, min(lo + pp, m))
    ]  # get_schedule_table; m is a multiple of pp (ParallelPlan refuses others)
    total = m * v
    warmup = min((pp - stage - 1) * 2 + (v - 1) * pp, total)
    waiting: list[list[int]] = [[] for _ in range(v)]  # per chunk, its forwards not yet back-propagated

    def forward(k: int) -> tuple[bool, int, int]:
        mb, c = table[k]
        waiting[c].append(mb)
        return True, mb, c

    def backward(k: int) -> tuple[bool, int, int]:
        c = v - 1 - table[k][1]
        return False, waiting[c].pop(0), c

    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(k + warmup), backward(k)]
    order += [backward(k) for k in range(total - warmup, total)]
    return order


def pipeline_order(
    schedule: PipelineSchedule, pp: int, stage: int, microbatches: int, chunks: int
) -> list[tuple[bool, int, int]]:
    """One stage's (forward?, micro-batch, model chunk) passes in one step: 1F1B (:func:`one_f_one_b`; one stage:
    ``forward_backward_no_pipelining``), interleaved (:func:`interleaved_order`), GPipe (every forward, then every
    backward in micro-batch order: torch/distributed/pipelining/schedules.py ``ScheduleGPipe._step_microbatches``)."""
    m = microbatches
    if pp > 1 and schedule is PipelineSchedule.INTERLEAVED:
        return interleaved_order(pp, stage, m, chunks)
    if pp > 1 and schedule is PipelineSchedule.GPIPE:
        return [(True, j, 0) for j in range(m)] + [(False, j, 0) for j in range(m)]
    return [(f, j, 0) for f, j in one_f_one_b(pp, stage, m)]


#: The side stream Megatron's ``get_model`` builds the DDP wrappers on (``ddp_stream = torch.cuda.Stream()``): the
#: param/grad buffers come from its pool, the module's freed parameters go back to the default stream's.
DDP_INIT_STREAM = 3


class MegatronStage:
    """One rank of Megatron-LM TP (± SP) × PP (1F1B, interleaved or GPipe) × DP, one pipeline stage (the worst: the
    closed form's headline), as events in the order Megatron makes them; the sizes are the closed form's
    (:func:`~trainfit.analytic.parallel.megatron_inputs`), so its allocated peak is
    :func:`~trainfit.analytic.parallel.estimate_parallel`'s:

    * init: the stage's bf16 (fp32 in fp32 compute) parameters, one per tensor (``Float16Module``; with the
      distributed optimizer one flat ``param_data`` buffer the parameters are views of), the persistent fp32
      gradient buffer (megatron/core/distributed/param_and_grad_buffer.py ``_ParamAndGradBuffer``:
      ``grad_data``, one tensor; the buckets are views), the fp32 main parameters (optimizer.py
      ``Float16OptimizerWithFloat16Params``: one clone per parameter; the distributed optimizer's shard, one
      flat piece); gradient-accumulation fusion writes the weight gradients into ``main_grad``, so autograd
      makes none of its own; under the interleaved schedule each of the v model chunks is its own DDP module
      with its own buffers (megatron/training/training.py ``get_model``);
    * each step: the micro-batches' forwards and backwards through the model chunks in the schedule's order
      (:func:`pipeline_order`); a forward keeps its saved tensors (layer by layer; chunk 0 of the first stage its
      embedding output; the last chunk of the last stage its head input and the loss's saved fp32 log-probabilities,
      ``MegatronInputs.loss_kept``) until its own backward, which frees them layer by layer from the top; the rest
      of the loss chain is a forward transient, the loss's backward buffers live over the top layer's backward
      temporaries (the closed form's backward moment); a checkpointed segment keeps its input and recomputes all
      its layers' tensors before their backwards, which free them from the top (Megatron
      ``--recompute-granularity full --recompute-method uniform --recompute-num-layers k``: k = 1 for full, the
      model chunk's ⌈c/⌈√c⌉⌉ for sqrt, ``MegatronInputs.chunk_segments``);
    * the optimizer step: Adam's two fp32 states per main parameter, made in the first step (apex/TE
      ``FusedAdam`` initialise them lazily); the update writes in place (no temporaries).

    With the distributed optimizer, init moves the module's parameters into the buffer's ``param_data`` (both alive
    until each copy: :func:`~trainfit.analytic.parallel.megatron_init_bytes`, which the stream peaks at when it is
    above the step). Left out, as the closed form leaves them out: the pipeline's send/receive buffers, the input
    ids, the buffers' padding."""

    def __init__(self, spec: ModelSpec, strategy: Strategy, p: ParallelPlan, stage: int) -> None:
        from trainfit.analytic.activations import layer_terms

        mi = megatron_inputs(spec, strategy, p)
        self.mi, self.stage, self.pp = mi, stage, p.pp
        self.first, self.last = stage == 0, stage == p.pp - 1
        cs = compute_strategy(strategy)
        local = tp_local_spec(spec, p.tp)
        # One micro-batch's saved tensors of one layer: the largest layer kind's terms (under SP the whole
        # model's, split over tp), the last one taking the closed form's rounding.
        src = spec if p.sequence_parallel else local
        div = p.tp if p.sequence_parallel else 1
        kinds = [layer_terms(src, cs, moe=g.kind == "moe") for g in inventory(src).layers]
        worst = max(kinds, key=lambda ts: sum(x.bytes for x in ts))
        terms = [n // div for x in worst for n in x.tensors()]
        self.layer = _fit(terms, mi.act_layer)
        self.checkpointed = mi.q.segments > 0
        inv = inventory(local)
        kind = max(inv.layers, key=lambda g: g.params_per_layer)
        self.v = mi.chunks
        layer = [t for _ in range(mi.chunk_layers) for t in kind.tensors]
        # per model chunk (one DDP wrapper, so one param/grad buffer, each: megatron/training/training.py
        # ``get_model``): chunk 0 of the first stage has the embedding, the last chunk of the last stage the head
        self.chunk_params: list[list[ParamTensor]] = [
            (list(mi.embed) if self.first and c == 0 else [])
            + layer
            + (list(mi.rest) if self.last and c == self.v - 1 else [])
            for c in range(self.v)
        ]
        self.params = [t for ts in self.chunk_params for t in ts]
        self.dp = p.dp if mi.dist_opt else 1
        self.stage_params = mi.stage_params(stage, p.pp)
        self.states: list[int] = []

    def _shards(self, total: int) -> list[int]:
        """The distributed optimizer's per-chunk pieces of ``total`` bytes, the last taking the rounding."""
        sizes = [sum(t.numel for t in ts) for ts in self.chunk_params]
        return _fit([n * total // self.stage_params for n in sizes], total)

    def init(self, s: Stream) -> None:
        mi, pb = self.mi, self.mi.param_bytes
        own = [[s.alloc(t.numel * pb) for t in ts] for ts in self.chunk_params]  # the module's, ``.cuda()``
        for ts, mine in zip(self.chunk_params, own, strict=True):  # wrap_model_chunks_with_ddp, chunk by chunk
            n = sum(t.numel for t in ts)
            if mi.dist_opt:
                s.alloc(n * pb, DDP_INIT_STREAM)  # param_data: each parameter is copied in, its own freed
            s.alloc(n * 4, DDP_INIT_STREAM)  # grad_data
            if mi.dist_opt:
                s.free_all(mine)
        if mi.fp32:
            return
        if mi.dist_opt:
            for n in self._shards(self.stage_params * 4 // self.dp):
                s.alloc(n)
        else:
            for t in self.params:
                s.alloc(t.numel * 4)

    def forward(self, s: Stream, chunk: int = 0) -> list[int]:
        """One micro-batch's forward through model chunk ``chunk``: what it keeps for its backward (embedding,
        per layer, head input and the loss's saved tensors)."""
        mi, q = self.mi, self.mi.q
        kept = [s.alloc(q.stack.embedding_bytes)] if self.first and chunk == 0 else []
        if self.checkpointed:
            for size in mi.chunk_segments:
                for _ in range(size):  # no grad inside the checkpoint: each layer's tensors die with it
                    s.free_all([s.alloc(n) for n in self.layer])
                kept.append(s.alloc(mi.per_mb_layer))  # the segment's input
        else:
            for _ in range(mi.chunk_layers):
                kept += [s.alloc(n) for n in self.layer]
        if self.last and chunk == self.v - 1:
            kept.append(s.alloc(q.stack.head_input_bytes))
            saved = s.alloc(mi.loss_kept)  # kept for the loss's backward
            s.free(s.alloc(q.logits_forward - mi.loss_kept))  # the rest of the loss chain
            kept.append(saved)
        return kept

    def backward(self, s: Stream, kept: list[int], chunk: int = 0) -> None:
        """One micro-batch's backward through model chunk ``chunk``: the loss's buffers (the head's chunk), then
        the layers from the top."""
        mi, q = self.mi, self.mi.q
        head = self.last and chunk == self.v - 1
        loss = [kept.pop(), s.alloc(q.logits_backward - mi.loss_kept)] if head else []
        head_in = kept.pop() if head else 0
        # per checkpointed segment (one layer each without checkpointing) from the top: what its forward kept —
        # the segment's input, or the layer's saved tensors — and the recomputation of all its layers at once
        groups = list(mi.chunk_segments) if self.checkpointed else [1] * mi.chunk_layers
        per = 1 if self.checkpointed else len(self.layer)
        top = True
        for size in reversed(groups):
            mine = kept[len(kept) - per :]
            del kept[len(kept) - per :]
            again = [[s.alloc(x) for x in self.layer] for _ in range(size)] if self.checkpointed else []
            for j in reversed(range(size)):
                s.free(s.alloc(q.block_temp))
                if top:
                    s.free_all(loss)
                    s.free(head_in)
                    top = False
                if again:
                    s.free_all(again[j])
            s.free_all(mine)
        s.free_all(kept)  # the embedding's output

    def step(self, s: Stream) -> None:
        """Adam's states, made in the first step (the update is in place)."""
        if self.states:
            return
        n = self.stage_params
        if self.mi.dist_opt:
            a = n * 4 // self.dp
            self.states = [*map(s.alloc, self._shards(a)), *map(s.alloc, self._shards(n * 8 // self.dp - a))]
        else:
            self.states = [s.alloc(t.numel * 4) for t in self.params for _ in range(2)]


def _fit(sizes: list[int], total: int) -> list[int]:
    """``sizes`` with the last one taking the difference to ``total`` (the closed form's rounding)."""
    if not sizes:
        return [total]
    return [*sizes[:-1], sizes[-1] + total - sum(sizes)]


def megatron_simulated(strategy: Strategy, p: ParallelPlan) -> bool:
    """Megatron ranks whose stream is written (:class:`MegatronStage`): any schedule (1F1B, interleaved, GPipe; one
    stage), no checkpointing, selective, full (one layer per segment) or sqrt (each model chunk's layers in
    segments of ⌈c/⌈√c⌉⌉), full training."""
    return (
        p.engine is Engine.MEGATRON
        and strategy.checkpointing
        in (Checkpointing.NONE, Checkpointing.SELECTIVE, Checkpointing.FULL, Checkpointing.SQRT)
        and not strategy.offload.any
        and not finetuning(strategy)
    )


def megatron_events(
    s: Stream,
    spec: ModelSpec,
    strategy: Strategy,
    p: ParallelPlan,
    stage: int,
    workspaces: tuple[Workspace, ...] = (),
    steps: int = MAX_STEPS,
    stop: Callable[[int], bool] | None = None,
) -> None:
    """Write stage ``stage``'s stream (:class:`MegatronStage`) into ``s``: ``steps`` steps of the 1F1B order, the
    main thread's ``workspaces`` at the first forward, the autograd thread's at the first backward (its start: the
    one-GPU stream's placement after the head's first matmul is not carried over to the pipeline order)."""
    st = MegatronStage(spec, strategy, p, stage)
    st.init(s)
    par = strategy.parallelism
    order = pipeline_order(par.pipeline_schedule, p.pp, stage, par.microbatches, st.v)
    sim = s.simulator
    for step in range(steps):
        live: dict[tuple[int, int], list[int]] = {}
        seen: dict[tuple[object, ...], tuple[int, int]] | None = {} if sim is not None else None
        i = 0
        while i < len(order):
            forward, j, c = order[i]
            if step == 0 and (j, c) == (0, 0 if forward else st.v - 1):  # the first forward, the first backward
                for k, ws in enumerate(workspaces):
                    if (ws.thread is Thread.MAIN) == forward:
                        s.workspace(ws.size_bytes, workspace_key(k), ws.stream)
            if forward:
                live[j, c] = st.forward(s, c)
            else:
                st.backward(s, live.pop((j, c)), c)
            i += 1
            if seen is not None and sim is not None and i < len(order):
                skip = _repeating_passes(sim, order, i, live, seen, window=4 * p.pp * st.v + 8)
                if skip is not None:
                    periods, length, shift, events = skip
                    i += periods * length
                    live = {(jj + periods * shift, cc): keys for (jj, cc), keys in live.items()}
                    sim.event_index += periods * events
                    seen = None  # one repeating stretch per step: the schedule's steady phase
        st.step(s)
        if stop is not None and stop(step):
            break


def _repeating_passes(
    sim: Simulator,
    order: list[tuple[bool, int, int]],
    i: int,
    live: dict[tuple[int, int], list[int]],
    seen: dict[tuple[object, ...], tuple[int, int]],
    window: int,
) -> tuple[int, int, int, int] | None:
    """Before pass ``order[i]``: (periods, passes per period, micro-batch shift per period, events per period) that
    :func:`megatron_events` may skip, or None. The steady phase of a schedule repeats: when the allocator is as it
    was before an earlier pass ``a`` (:meth:`~trainfit.allocator.Simulator.ordered_state_key`: the same blocks, the
    live ones in the same order of allocation) and so are the in-flight micro-batches (which of those blocks each
    holds, counted from the next pass's micro-batch), and the passes from ``i`` on are those from ``a`` on with every
    micro-batch ``shift`` later, each period of ``i − a`` passes makes the same decisions again (keys renamed alike)
    and ends as it began: no peak rises, no segment is made, no cache is flushed (the device counters are in the
    state). Skipping whole periods leaves the peaks, the counters and
    the state as the replay would (its in-flight micro-batches renamed, its event indices advanced). ``seen``: the
    states before the last ``window`` passes (a period longer than that is not looked for: the states are large)."""
    key = sim.ordered_state_key()
    if key is None:
        return None
    rank = {k: r for r, k in enumerate(sorted(sim.live_keys()))}
    base = order[i][1]
    flights = tuple(sorted(((jj - base, cc), tuple(rank.get(k, -1) for k in keys)) for (jj, cc), keys in live.items()))
    # the device calls so far: a period that made one (a segment, or a flush and retry under a capacity) is not
    # skipped, as each period would make it again and the counters would come out short
    state = (*key, flights, sim.num_device_allocs, sim.num_device_frees, sim.num_alloc_retries)
    hit = seen.pop(state, None)
    seen[state] = (i, sim.event_index)
    if len(seen) > window:
        del seen[next(iter(seen))]
    if hit is None:
        return None
    a, events_before = hit
    length, shift = i - a, base - order[a][1]
    if shift <= 0:  # each micro-batch passes once per step: a stretch that repeats moves on
        return None
    m = 0
    while i + m < len(order):
        forward, j, c = order[i + m - length]
        if order[i + m] != (forward, j + shift, c):
            break
        m += 1
    periods = m // length
    if periods == 0:
        return None
    return periods, length, shift, sim.event_index - events_before


def _alloc_bits(numel: int, bits: int) -> int:
    return numel * bits // 8


def simulate_rank(
    spec: ModelSpec,
    strategy: Strategy,
    p: ParallelPlan,
    config: AllocatorConfig | None = None,
    workspaces: tuple[Workspace, ...] = (),
    *,
    stage: int = 0,
    capacity_bytes: int | None = None,
    stop_above_bytes: int | None = None,
    device_bytes: int | None = None,
    dp_rank: int = 0,
) -> AllocatorResult:
    """The caching allocator's peaks over one rank's synthesised stream (``rank_simulated`` setups; ``stage``:
    the pipeline stage of a Megatron rank; ``dp_rank``: the data-parallel rank of a DeepSpeed ZeRO-1/2 one, whose
    partition decides what it holds; ``capacity_bytes``: under that device capacity, with the allocator's
    flush-and-retry, :class:`~trainfit.allocator.Simulator`; ``stop_above_bytes``: stop once reserved passes it,
    ``AllocatorResult.stopped``; ``device_bytes``: the GPU's memory less what is used outside the allocator, for
    DeepSpeed's free-memory test at init, :meth:`Zero2Hooks.weights`; None: not known)."""
    key = _rank_key(spec, strategy, p, config, workspaces, stage, device_bytes, dp_rank)
    if capacity_bytes is not None:
        return simulation_memo().get(
            (*key, capacity_bytes),
            lambda: _simulate(
                spec, strategy, p, config, workspaces, stage, capacity_bytes, device_bytes=device_bytes, dp_rank=dp_rank
            )[0],
        )
    return simulate_rank_with_rounding(
        spec,
        strategy,
        p,
        config,
        workspaces,
        stage=stage,
        stop_above_bytes=stop_above_bytes,
        device_bytes=device_bytes,
        dp_rank=dp_rank,
    )[0]


_ROUNDED: Memo[tuple[AllocatorResult, PhaseRounding]] = Memo(256)


def _rank_key(
    spec: ModelSpec,
    strategy: Strategy,
    p: ParallelPlan,
    config: AllocatorConfig | None,
    workspaces: tuple[Workspace, ...],
    stage: int,
    device_bytes: int | None,
    dp_rank: int,
) -> tuple[object, ...]:
    """A rank simulation's memo key (the simulation memo's, and the rounding's beside it)."""
    return ("rank", spec_key(spec), strategy, p, config, workspaces, stage, device_bytes, dp_rank)


def simulate_rank_with_rounding(
    spec: ModelSpec,
    strategy: Strategy,
    p: ParallelPlan,
    config: AllocatorConfig | None = None,
    workspaces: tuple[Workspace, ...] = (),
    *,
    stage: int = 0,
    stop_above_bytes: int | None = None,
    device_bytes: int | None = None,
    dp_rank: int = 0,
) -> tuple[AllocatorResult, dict[Phase, int]]:
    """:func:`simulate_rank` (no capacity) and, from the same pass, each phase's blocks above its requests at the
    steady state (:class:`~trainfit.analytic.blocks.PhaseMarking` mixed into the rank's hooks: what
    ``max_memory_allocated`` counts beyond the tensors' 512-byte-rounded requests, ``Component.ALLOCATOR_ROUNDING``).
    A Megatron stage's stream (no hooks) has none. A run that stops above ``stop_above_bytes`` is answered by the
    whole run when one is kept; its rounding, like its reserve, is then a lower bound. Memoised."""
    key = _rank_key(spec, strategy, p, config, workspaces, stage, device_bytes, dp_rank)
    memo = simulation_memo()  # the results stay there (emptied by events.forget_simulations); the rounding beside

    def kept(k: tuple[object, ...]) -> tuple[AllocatorResult, PhaseRounding] | None:
        hit = _ROUNDED.peek(k)
        return hit if hit is not None and memo.peek(k) is hit[0] else None

    def run(k: tuple[object, ...], stop: int | None) -> tuple[AllocatorResult, PhaseRounding]:
        out = _simulate(
            spec, strategy, p, config, workspaces, stage, stop_above=stop, device_bytes=device_bytes, dp_rank=dp_rank
        )
        keep(k, out)
        return out

    def keep(k: tuple[object, ...], out: tuple[AllocatorResult, PhaseRounding]) -> None:
        memo.put(k, out[0])
        _ROUNDED.put(k, out)

    whole = kept(key)
    if whole is None and stop_above_bytes is not None:
        part_key = (*key, "stop above", stop_above_bytes)
        part = kept(part_key) or run(part_key, stop_above_bytes)
        if part[0].stopped:
            return part[0], dict(part[1])
        keep(key, part)
        whole = part
    if whole is None:
        whole = run(key, None)
    return whole[0], dict(whole[1])


def _simulate(
    spec: ModelSpec,
    strategy: Strategy,
    p: ParallelPlan,
    config: AllocatorConfig | None,
    workspaces: tuple[Workspace, ...],
    stage: int = 0,
    capacity_bytes: int | None = None,
    stop_above: int | None = None,
    device_bytes: int | None = None,
    dp_rank: int = 0,
) -> tuple[AllocatorResult, PhaseRounding]:
    hooks: RankHooks | None = None
    run = strategy
    if p.engine is Engine.MEGATRON:
        pass
    elif p.engine is Engine.DEEPSPEED and p.sharding is Sharding.ZERO3:
        hooks, run = Zero3Hooks(spec, strategy, p), compute_strategy(strategy)
    elif p.engine is Engine.DEEPSPEED:
        zero = Zero1Hooks if p.sharding is Sharding.ZERO1 else Zero2Hooks
        z = zero(spec, strategy, p, rank=dp_rank)
        if device_bytes is not None:
            z.free_device_bytes = device_bytes - z.model_bytes()
        hooks, run = z, compute_strategy(strategy)
    elif p.tp > 1 and p.sharding is Sharding.FSDP:
        hooks = FsdpTpHooks(spec, strategy, p.tp, p.shard, sequence_parallel=p.sequence_parallel)
        run = compute_strategy(strategy, casts_every_param=strategy.recipe.mixed)
        spec = dtensor_tp_spec(spec, p.tp)
    elif p.tp > 1:
        hooks = DtensorTpHooks(spec, strategy, p.tp, sequence_parallel=p.sequence_parallel)
        spec = dtensor_tp_spec(spec, p.tp)
    elif p.sharding is Sharding.DDP:
        hooks, run = DdpHooks(spec, strategy), strategy
    else:
        hooks = FsdpHooks(spec, strategy, p.shard, replicated=p.dp > p.shard)
        run = compute_strategy(strategy, casts_every_param=strategy.recipe.mixed)
    sim = Simulator(config, capacity_bytes=capacity_bytes, stop_above_bytes=stop_above)
    marks = None if hooks is None else marked(hooks, sim)  # each phase's blocks above its requests
    seen = [-1]
    ended = steady_state(sim, capacity_bytes)

    def steady(step: int) -> bool:
        """A step that raised no reserved peak, after the states exist (step ≥ 2), ends the stream; so does one that
        left the allocator as the step before it did (:func:`~trainfit.analytic.events.steady_state`)."""
        grew = sim.peak_reserved_bytes > seen[0]
        seen[0] = sim.peak_reserved_bytes
        return ended(step) or (step >= 2 and not grew)

    rank = hooks

    def write(x: Simulator) -> None:
        if rank is None:
            megatron_events(Stream(x), spec, strategy, p, stage, workspaces, stop=steady)
        else:
            synthesise(Stream(x), spec, run, workspaces, rank, steps=MAX_STEPS, stop=steady)

    oom = sim.drive(write)
    if marks is None:
        return sim.result(oom=oom), ()
    marks.mark(None)
    return sim.result(oom=oom), tuple(marks.rounding.items())
