"""Assemble the analytic estimate: model states + activations + logits + temporaries, per phase.

Phases of a steady-state step (step ≥ 2: optimizer states resident; grads set to None by
``zero_grad(set_to_none=True)`` between steps, resident throughout when accumulating):

* forward   = base + saved activations + autocast copies + the loss computation's logits;
* backward  = the larger of its two ends — start (everything saved + logits gradients) and end
  (all gradients + the first layer's activations); in between, one layer's activations are freed as
  its gradients appear, so the total is linear in the layer index and its maximum is at an end;
* optimizer-step = base + all gradients + the step's temporaries,

with base = weights + fp32 master weights + optimizer states. Materialised attention scores (eager
attention, SDPA's math kernel) add moments of their own: in the forward, the last layer's score chain at
the softmax (``EagerChain``); in the backward, the top and bottom blocks inside their softmax backward,
when their post-softmax saved tensors are already released.
With checkpointing, only each checkpoint's input is kept and backward recomputes one layer (``full``) or
one segment (``sqrt``).
Autocast's weight cache holds every 16-bit weight copy until the autocast region exits (after the
loss), checkpointing or not; without checkpointing the copies stay saved for backward.

Each of these is a named :class:`Moment` (:class:`MomentName`) with typed fields per component, built by
one function per phase; a phase's breakdown is its largest moment. Saved tensors carry a
:class:`~trainfit.analytic.activations.TermRole` that says when they are released, so no moment looks a
term up by its name. A later capability (sharding, adapters) changes a field of the inputs, not the
moments' arithmetic.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum

from trainfit._memo import Memo, spec_key
from trainfit.allocator import AllocatorConfig, AllocatorResult, simulate
from trainfit.allocator.process import ProcessStart
from trainfit.allocator.report import allocator_details, capped_run
from trainfit.allocator.workspaces import Workspace
from trainfit.analytic.activations import (
    SavedTerm,
    TermRole,
    Widths,
    adapter_backward_bytes,
    attention_mask_bytes,
    attention_variants,
    backward_temp_bytes,
    blind_layer_unsaved,
    check_sac,
    checkpoint_terms,
    dead_layer_cache_tensors,
    dense_forward_bytes,
    derived_mlp_backward_bytes,
    eager_backward_moment,
    eager_forward_moment,
    eager_nograd_inputs_bytes,
    effective_strategy,
    first_layer_cache_bytes,
    first_layer_unsaved_bytes,
    frozen_down_forward_bytes,
    frozen_head_input_bytes,
    frozen_layer_terms,
    int8_ctx_bytes,
    int8_dense_recompute_bytes,
    int8_layer_bytes,
    int8_moe_recompute_bytes,
    kv_cache_held_tensors,
    layer_terms,
    model_terms,
    moe_adapter_forward_bytes,
    sac_saved_terms,
    score_chain,
    selective_core_before_softmax_bytes,
    selective_core_locals_bytes,
    selective_recompute_bytes,
    unsaved_stack_locals_bytes,
)
from trainfit.analytic.adapters import (
    dequant_transient_bytes,
    dora_norm_transient_bytes,
    finetuning,
    fp32_base_note,
    frozen_forms_known,
    frozen_layers,
)
from trainfit.analytic.blocks import simulate_with_rounding
from trainfit.analytic.events import simulate_training, training_events
from trainfit.analytic.float8 import (
    block_linears,
    check_float8,
    converted_weight_names,
    layer_backward_extra,
    layer_forward_extra,
)
from trainfit.analytic.float8 import enabled as float8_enabled
from trainfit.analytic.logits import logits_memory
from trainfit.analytic.savers import (
    check_savers,
    checkpoint_input_bytes,
    checkpoint_inputs_on_gpu,
    chunked_head_copy_bytes,
    chunked_loss_memory,
    fused_linear_head_input_bytes,
    fused_linear_loss_memory,
    offload_embedding_kept_bytes,
    offload_in_flight_bytes,
    offload_layer_host_bytes,
    offload_model_host_bytes,
    offload_retained_bytes,
    saver_notes,
)
from trainfit.analytic.states import (
    ModelStates,
    finetune_parts,
    model_states,
    param_states,
    tied_gradient_sum,
    tied_sum_modelled,
)
from trainfit.arch.params import inventory
from trainfit.arch.spec import ModelSpec, NormKind
from trainfit.cuda_facts import allocator_bytes
from trainfit.overhead import outside_allocator
from trainfit.result import (
    AnalyticDetails,
    BytesPerParam,
    Component,
    MemoryReport,
    Method,
    Phase,
    PhaseBreakdown,
    Term,
)
from trainfit.strategy import Attention, Checkpointing, LossImpl, Optimizer, Strategy


def _sum(terms: list[SavedTerm]) -> int:
    return sum(allocator_bytes(t.bytes) for t in terms)


class MomentName(StrEnum):
    """The moments of a training step whose live bytes can be a phase's worst."""

    FORWARD_END = "forward-end"  # after the loss, everything saved
    FORWARD_LAST_SOFTMAX = "forward-last-softmax"  # the last block's materialised score chain
    FORWARD_FP8_CAST = "forward-fp8-cast"  # --fp8: inside the last block's worst Float8Linear cast
    FORWARD_LAST_DORA_NORM = "forward-last-dora-norm"  # the last block's DoRA weight norm (full-size matrices)
    FORWARD_LAST_MOE_EXPERTS = "forward-last-moe-experts"  # checkpointed: PEFT's parametrized expert weights
    FORWARD_LAST_DOWN_PROJ = "forward-last-down-proj"  # a frozen gated MLP's down projection in the last layer
    FORWARD_FINAL_NORM = "forward-final-norm"  # ZeRO-3: inside the final norm, before the head's parameter fetch
    BACKWARD_START = "backward-start"  # logits gradients, everything still saved
    BACKWARD_HEAD_GRAD_CAST = (
        "backward-head-grad-cast"  # autocast: the head's 16-bit weight gradient cast into its .grad
    )
    BACKWARD_FINAL_NORM = "backward-final-norm"  # LM head done, inside the final norm's backward
    BACKWARD_TOP_BLOCK = "backward-top-block"  # inside the top block's (segment's) backward
    BACKWARD_TOP_RECOMPUTE = "backward-top-recompute"  # LLM.int8 MoE: inside the top layer's recomputed experts
    BACKWARD_BOTTOM_RECOMPUTE = "backward-bottom-recompute"  # LLM.int8 MoE: the same in the bottom layer
    BACKWARD_MIDDLE_BLOCK = "backward-middle-block"  # ZeRO-1/2: inside the layer where a rank's gradient buffer is made
    BACKWARD_REDUCTION = "backward-reduction"  # ZeRO-1/2: a reduction set off as a layer's backward begins
    BACKWARD_BOTTOM_BLOCK = "backward-bottom-block"  # inside the bottom block's (segment's) backward
    BACKWARD_TOP_SOFTMAX = "backward-top-softmax"  # inside the top block's softmax backward
    BACKWARD_BOTTOM_SOFTMAX = "backward-bottom-softmax"
    BACKWARD_EMBEDDING = "backward-embedding"  # every gradient present, embedding backward
    BACKWARD_REDUCE = "backward-reduce"  # ZeRO-1: after backward, the reduction into the partition's gradients
    OPTIMIZER_STEP = "optimizer-step"


_SOFTMAX_OF = {
    MomentName.BACKWARD_TOP_BLOCK: MomentName.BACKWARD_TOP_SOFTMAX,
    MomentName.BACKWARD_BOTTOM_BLOCK: MomentName.BACKWARD_BOTTOM_SOFTMAX,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Resident:
    """What every moment of a steady-state step holds: weights, fp32 master weights, optimizer states."""

    weights: int
    master_weights: int
    optimizer_states: int
    adapter_weights: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Moment:
    """Live bytes at one named moment of a step, by component."""

    name: MomentName
    phase: Phase
    resident: Resident
    gradients: int = 0
    activations: int = 0
    autocast_copies: int = 0
    logits_loss: int = 0
    temporaries: int = 0
    # Outside the device peak: offloaded activations (pinned host memory) and paged optimizer states (CUDA
    # unified memory, invisible to max_memory_allocated) — trainfit.analytic.savers.
    host_activations: int = 0
    host_optimizer_states: int = 0

    def host_components(self) -> dict[Component, int]:
        out = {Component.ACTIVATIONS: self.host_activations, Component.OPTIMIZER_STATES: self.host_optimizer_states}
        return {k: v for k, v in out.items() if v}

    def components(self) -> dict[Component, int]:
        parts = dict.fromkeys(Component, 0)
        parts |= {
            Component.WEIGHTS: self.resident.weights,
            Component.MASTER_WEIGHTS: self.resident.master_weights,
            Component.OPTIMIZER_STATES: self.resident.optimizer_states,
            Component.ADAPTER_WEIGHTS: self.resident.adapter_weights,
            Component.GRADIENTS: self.gradients,
            Component.ACTIVATIONS: self.activations,
            Component.AUTOCAST_COPIES: self.autocast_copies,
            Component.LOGITS_LOSS: self.logits_loss,
            Component.TEMPORARIES: self.temporaries,
        }
        return parts

    @property
    def total_bytes(self) -> int:
        return sum(self.components().values())

    def breakdown(self) -> PhaseBreakdown:
        return PhaseBreakdown(phase=self.phase, components=self.components(), host_components=self.host_components())

    def inside_softmax_backward(self, swap: int, temporaries: int) -> Moment:
        """This block moment, inside its attention softmax backward: the block's post-softmax saved tensors
        are released (``swap`` is the change in activations) and the softmax gradients are in flight."""
        return dataclasses.replace(
            self, name=_SOFTMAX_OF[self.name], activations=max(0, self.activations + swap), temporaries=temporaries
        )


def worst(moments: list[Moment]) -> Moment:
    """The moment with the most live bytes (the first of equals)."""
    return max(moments, key=lambda m: m.total_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionVariantLayers:
    """One kind of layer under one attention variant: how many, what it saves, what it has saved by the
    time its attention softmax runs."""

    spec: ModelSpec  # the spec as this variant's attention sees it
    kind: str
    layers: int
    saved_bytes: int
    before_softmax_bytes: int
    # --checkpointing selective: what the recomputed attention core saves before its softmax (q/k casts,
    # repeat_kv copies, a soft-cap's tanh), alive again while the recomputation's softmax backward runs
    recomputed_before_softmax_bytes: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class StackActivations:
    """Saved activations of the layer stack and the model-level tensors around it."""

    variants: tuple[AttentionVariantLayers, ...]
    all_layers_bytes: int  # every layer's saved tensors
    max_layer_bytes: int  # the largest layer's
    per_kind_bytes: dict[str, int]
    top_kind: str
    model_bytes: int  # embedding + head saved tensors
    embedding_bytes: int  # saved by the embedding: lives to the end of backward
    head_input_bytes: int  # the LM head's input: released first
    autocast_layer_copies: dict[str, int]  # 16-bit weight copies per layer kind (amp only)
    layer_counts: dict[str, int]
    bottom_segment_bytes: int | None = None  # --freeze: what the bottom checkpointed segment's layers save
    bottom_kept_segments: int = 1  # --freeze: segments whose inputs are kept at the bottom moment
    bottom_layer: int | None = None  # --freeze: the layer whose backward is the bottom moment
    layer_on_device_bytes: int | None = None  # --activation-offload: a layer's saves on the GPU in its backward


def stack_activations(spec: ModelSpec, strategy: Strategy, st: ModelStates) -> StackActivations:
    """Per layer kind and attention variant. A stack where only some layers slide (Qwen2 with
    use_sliding_window) makes two SDPA calls: the sliding layers get the mask, the others none, and each
    may get a different kernel — two attention variants, each with its own layer count."""
    inv = inventory(spec)
    w = Widths.of(strategy)
    variants = attention_variants(spec, strategy)
    per_kind: dict[str, int] = {}
    counts: dict[str, int] = {}
    copies: dict[str, int] = {}
    rows: list[AttentionVariantLayers] = []
    for g in inv.layers:
        counts[g.kind] = g.count
        for vspec, n in variants:
            lt = layer_terms(vspec, strategy, moe=g.kind == "moe")
            cut = next((i for i, x in enumerate(lt) if x.role is TermRole.SOFTMAX_OUTPUT), None)
            recomputed = 0
            if cut is None:  # --checkpointing selective: the score chain is the checkpointed core's, after its inputs
                cut = next((i + 1 for i, x in enumerate(lt) if x.name == "attn.core_inputs"), len(lt))
                recomputed = selective_core_before_softmax_bytes(vspec, strategy, moe=g.kind == "moe")
            # With one kind (every stack with mixed sliding layers is one), the variant counts are exact.
            layers = g.count if len(variants) == 1 else n
            rows.append(
                AttentionVariantLayers(
                    spec=vspec,
                    kind=g.kind,
                    layers=layers,
                    saved_bytes=_sum(lt),
                    before_softmax_bytes=_sum(lt[:cut]),
                    recomputed_before_softmax_bytes=recomputed,
                )
            )
            per_kind[g.kind] = max(per_kind.get(g.kind, 0), _sum(lt))
        fp8 = converted_weight_names(spec, strategy)  # Float8Linear weights get no autocast copy
        mm = sum(t.numel for t in g.tensors if t.matmul and t.name not in fp8)
        copies[g.kind] = mm * w.compute if w.amp else 0
    if finetuning(strategy):
        copies = dict.fromkeys(copies, finetune_parts(spec, strategy).copies_layer_bytes)
    elif spec.params_override is not None and w.amp:
        scale = st.autocast_copies_bytes / max(1, sum(counts[k] * copies[k] for k in counts))
        copies = {k: int(v * scale) for k, v in copies.items()}
    if len(variants) == 1 or len(inv.layers) == 1:
        all_layers = sum(r.layers * r.saved_bytes for r in rows) - first_layer_unsaved_bytes(spec, strategy)
    else:  # mixed sliding layers in a stack of several kinds (no such family today): the larger variant
        all_layers = sum(counts[k] * per_kind[k] for k in counts)
    fz = frozen_layers(spec, strategy)
    bottom_segment: int | None = None
    kept_segments = 1
    bottom_layer: int | None = None
    known = frozen_forms_known(spec)  # the frozen-layer forms are known
    if fz is not None and known and len(rows) == 1:
        # --freeze: dead layers save nothing, wholly frozen ones the frozen forms (adapters.FrozenLayers).
        normal, still = rows[0].saved_bytes, _sum(frozen_layer_terms(spec, strategy))
        all_layers -= fz.dead * normal + fz.frozen * (normal - still)
        all_layers -= _sum(list(blind_layer_unsaved(spec, strategy)[1]))
        per_kind[rows[0].kind] = max(normal if fz.trainable else 0, still if fz.frozen else 0)
        bottom_layer = fz.dead  # the lowest layer to run backward
        if strategy.checkpointing.whole_layers:  # input grads on: no dead
            # Below the lowest trainable layer every gradient exists, so the worst moment there is entering
            # the topmost wholly frozen segment of the bottom: all their inputs kept, its frozen layers
            # recomputed (else the first segment, as it is).
            sizes = strategy.checkpoint_layout(spec.num_layers).segment_sizes
            prefix = next((i for i, f in enumerate(fz.frozen_at) if not f), len(fz.frozen_at))
            start, n = 0, 0
            while n < len(sizes) and start + sizes[n] <= prefix:
                start, n = start + sizes[n], n + 1
            kept_segments = max(1, n)
            lo = start - sizes[n - 1] if n else 0
            hi = lo + sizes[kept_segments - 1]
            bottom_segment = sum(still if f else normal for f in fz.frozen_at[lo:hi])
            bottom_layer = hi - 1
    elif fz is not None and fz.dead:
        # Dead layers save nothing whatever their layout (no autograd node at all); the frozen forms of the others
        # are known only for Llama-style layers of one kind. Per dead layer its kind's smaller variant.
        kind_at = [g.kind for g in inv.layers for _ in range(g.count)]
        least = {r.kind: min(x.saved_bytes for x in rows if x.kind == r.kind) for r in rows}
        all_layers -= sum(least[kind_at[i]] for i in range(fz.dead))
    mt = model_terms(spec, strategy)
    return StackActivations(
        variants=tuple(rows),
        all_layers_bytes=all_layers,
        max_layer_bytes=max(per_kind.values()),
        per_kind_bytes=per_kind,
        top_kind=inv.layers[-1].kind,
        model_bytes=_sum(mt),
        embedding_bytes=_sum([t for t in mt if t.role is TermRole.EMBEDDING]),
        head_input_bytes=_sum([t for t in mt if t.role is TermRole.HEAD_INPUT]),
        autocast_layer_copies=copies,
        layer_counts=counts,
        bottom_segment_bytes=bottom_segment,
        bottom_kept_segments=kept_segments,
        bottom_layer=bottom_layer,
    )


def _dead_cache_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """What the KV cache holds for the dead layers beyond what every layer's cache adds
    (:func:`~trainfit.analytic.activations.dead_layer_cache_tensors`)."""
    full = dead_layer_cache_tensors(spec, strategy)
    if not full:
        return 0
    fz = frozen_layers(spec, strategy)
    assert fz is not None
    held = sum(map(allocator_bytes, kv_cache_held_tensors(spec, strategy)))
    return fz.dead * (sum(map(allocator_bytes, full)) - held)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepInputs:
    """Every quantity the moments of a training step are built from."""

    spec: ModelSpec
    strategy: Strategy
    states: ModelStates
    stack: StackActivations
    resident: Resident
    grads_resident: int  # gradients held from the previous micro-step (accumulation)
    grad_layer: int  # one layer's gradients
    grad_head: int  # the LM head's (or tied table's) gradient: the first to appear
    grad_late: int  # the untied token table's gradient: the last to appear
    copies_all: int  # every autocast weight copy
    copies_head: int  # the copies outside the layer stack
    copies_max_layer: int
    copies_fwd_ckpt: int  # what a checkpointed forward keeps of them
    logits_forward: int
    logits_backward: int
    block_temp: int  # inside a block's backward
    norm_temp: int  # inside the final norm's backward
    kept_inputs: int  # checkpointed segments' inputs
    segments: int  # 0 without checkpointing
    segment_layers: int  # layers in the largest segment
    masks: int  # [b, 1, s, s] attention masks
    cache_held: int  # the KV cache's own k/v copies (training with use_cache)
    forward_transient: int = 0  # alive at the forward's end but saved by nothing (a frozen head's input)
    #: The loss runs after the model's forward returned (torchtune's chunked CE): its outputs' KV cache copies are
    #: gone by then (``cache_held`` left out of the forward's end)
    loss_after_outputs: bool = False
    host_activations: int = 0  # --activation-offload: saved tensors in pinned host memory
    host_optimizer_states: int = 0  # paged optimizer: states in CUDA unified memory, outside the allocator
    sac_saved: int = 0  # --checkpointing sac: one layer's kept save-list outputs (in kept_inputs)
    float8_forward: int = 0  # --fp8: the worst Float8Linear cast transient of a block's forward
    dora_norm: int = 0  # DoRA: the weight norm's full-size transients, inside a layer's forward (or recompute)
    moe_experts: int = 0  # LoRA on MoE experts, checkpointed: the last layer's expert working set (new weights)
    #: An adapter's frozen gated MLP: its forward's worst moment beyond the layer's saves (checkpointed: all of it;
    #: activations.frozen_down_forward_bytes).
    down_forward: int = 0
    int8_layer: int = 0  # LLM.int8: the largest layer's inputs only ctx holds (activations.int8_layer_bytes)
    int8_held: int = 0  # LLM.int8: every layer's ctx-held inputs, alive until the graph goes after backward
    int8_bottom: int = 0  # LLM.int8: what of them the bottom layer's backward moment does not count otherwise
    recompute_moe: tuple[int, int] = (0, 0)  # LLM.int8 MoE, checkpointed: (saved, in flight) inside the recomputation
    #: --activation-offload: (activations, gradient) the previous backward's last unpacking node keeps, from the end
    #: of one backward to the next one's final norm (savers.offload_retained_bytes)
    offload_retained: tuple[int, int] = (0, 0)


#: The planner and the micro-batch search build the same steps again (the same compute strategy under many
#: parallel layouts); StepInputs is immutable.
_STEPS: Memo[StepInputs] = Memo(512)


def step_inputs(spec: ModelSpec, strategy: Strategy, *, keep_logits: bool) -> StepInputs:
    """Every quantity of one training step (memoised on the spec's repr, the strategy and ``keep_logits``)."""
    return _STEPS.get((spec_key(spec), strategy, keep_logits), lambda: _build_step_inputs(spec, strategy, keep_logits))


def _build_step_inputs(spec: ModelSpec, strategy: Strategy, keep_logits: bool) -> StepInputs:
    check_sac(spec, strategy)
    check_float8(spec, strategy)
    q = _step_inputs(spec, strategy, keep_logits=keep_logits)
    if finetuning(strategy):
        q = _finetune_inputs(q)
    return _float8_inputs(_saver_inputs(q, keep_logits=keep_logits))


def _float8_inputs(q: StepInputs) -> StepInputs:
    """``--fp8``: the casts of torchao's ``Float8Linear`` (:mod:`trainfit.analytic.float8`). Inside a block's
    backward the worst converted linear's casts sit on top of the incoming residual gradient (r·t·h) and its own
    grad_output (a·t·n); in the forward, on top of everything the stack has saved (the last block's linears)."""
    if not float8_enabled(q.strategy):
        return q
    spec, strategy = q.spec, q.strategy
    w = Widths.of(strategy)
    t = strategy.tokens_per_micro_batch
    residual_grad = w.residual * t * spec.hidden_size
    widest_out = max(x.out_features for x in block_linears(spec) if x.converted)
    in_flight = residual_grad + w.compute * t * widest_out
    return dataclasses.replace(
        q,
        block_temp=max(q.block_temp, in_flight + layer_backward_extra(spec, strategy)),
        float8_forward=layer_forward_extra(spec, strategy),
    )


def _saver_inputs(q: StepInputs, *, keep_logits: bool) -> StepInputs:
    """The memory savers' closed forms (:mod:`trainfit.analytic.savers`) applied to the step's inputs."""
    spec, strategy = q.spec, q.strategy
    sv = strategy.savers
    if not sv.any and strategy.checkpointing is not Checkpointing.SELECTIVE:
        return q
    if strategy.checkpointing is Checkpointing.SELECTIVE:
        q = dataclasses.replace(q, block_temp=q.block_temp + selective_recompute_bytes(spec, strategy))
        if q.masks and q.segments == 0:
            # The [b, 1, s, s] mask is an input of every checkpointed attention core (the interface gets it
            # positionally; torch.utils.checkpoint's non-reentrant ``_NoopSaveInputs`` saves tensor args): saved from
            # the first layer's forward until the bottom layer's core is recomputed, not dead with the decoder's
            # forward — counted with the embedding's saves (found by the trace: amp + eager, −3.4% in backward).
            a = q.stack
            stack = dataclasses.replace(
                a, embedding_bytes=a.embedding_bytes + q.masks, model_bytes=a.model_bytes + q.masks
            )
            q = dataclasses.replace(q, stack=stack, masks=0)
    if sv.loss is LossImpl.CHUNKED:
        lg = chunked_loss_memory(spec, strategy, keep_logits=keep_logits, head_trainable=q.grad_head > 0)
        per_chunk = chunked_head_copy_bytes(spec, strategy)  # a frozen head's uncached cast, once per chunk
        # torchtune's recipe computes the loss on the chunks the model returned: the final norm's output (the
        # chunks' base, saved by nothing under a frozen head) and the decoder's output object with its KV cache are
        # released before the loss's log-softmax, the forward's largest moment (trace.savers.chunked_loss_fns; the
        # trace: the closed form held both, +1.06% on a small Llama under pure-bf16 QLoRA)
        q = dataclasses.replace(
            q,
            loss_after_outputs=True,
            forward_transient=q.forward_transient - frozen_head_input_bytes(spec, strategy),
            logits_forward=lg.forward_peak_bytes,
            logits_backward=lg.backward_peak_bytes,
            copies_all=q.copies_all + per_chunk,
            copies_head=q.copies_head + per_chunk,
            copies_fwd_ckpt=q.copies_fwd_ckpt + per_chunk,
        )
    elif sv.loss is LossImpl.FUSED_LINEAR:
        # Under autocast the head's 16-bit weight copy is saved by nothing (Liger's node saves grad_input and
        # grad_weight): autocast's cached copy dies with the forward's autocast region, and each chunk's
        # ``x @ weight.t()`` casts the weight again (a view is not cached) — found by the trace.
        ch = q.copies_head
        lg = fused_linear_loss_memory(spec, strategy, head_grad_bytes=q.grad_head, weight_cast_bytes=ch)
        grad_input = allocator_bytes(fused_linear_head_input_bytes(spec, strategy))
        a = q.stack
        stack = dataclasses.replace(
            a, model_bytes=a.model_bytes - a.head_input_bytes + grad_input, head_input_bytes=grad_input
        )
        q = dataclasses.replace(
            q,
            stack=stack,
            logits_forward=lg.forward_peak_bytes,
            logits_backward=lg.backward_peak_bytes,
            copies_all=q.copies_all - ch,
            copies_head=0,
            copies_fwd_ckpt=q.copies_fwd_ckpt - ch,
            # a trainable head's weight, a leaf that requires grad, is cast once and cached for ``grad_logits @
            # weight``; a frozen head's casts are per call, one at a time (the per-chunk one above): no second copy
            forward_transient=q.forward_transient + (ch if q.grad_head else 0),
        )
    if sv.activation_offload:
        q = _offload_inputs(q)
    if sv.paged_optimizer:
        q = dataclasses.replace(
            q,
            resident=dataclasses.replace(q.resident, optimizer_states=0),
            host_optimizer_states=q.resident.optimizer_states,
        )
    return q


def _offload_inputs(q: StepInputs) -> StepInputs:
    """``--activation-offload`` (:mod:`trainfit.analytic.savers`, torchtune ``OffloadActivations``). With
    checkpointing only the segments' inputs are packed: two stay on the GPU, every one is copied to the host, with
    the embedding's and the final norm's saves. Without, every layer's saves leave the GPU: at the forward's end the
    stash of the last 5 packs holds the final norm's saves (``model_bytes`` keeps them), the embedding keeps only
    tensors under 1 KiB, autocast's weight copies die with the forward (the saved ones are host copies; the head's
    stays, ``NoOpManager``), and a layer's backward holds the unpacked copies of two autograd nodes."""
    spec, strategy, a = q.spec, q.strategy, q.stack
    model_host = offload_model_host_bytes(spec, strategy)
    q = dataclasses.replace(q, offload_retained=offload_retained_bytes(spec, strategy))
    # LLM.int8's inputs are kept on MatMul8bitLt's ``ctx.tensors``, not through save_for_backward
    # (activations.int8_ctx_bytes), so torchtune's saved-tensor hooks never pack them: every layer's stay on the GPU
    # to the end of backward (llama-3.2-1b LoRA over int8, 2 × 1024: −22.6% against the trace when they were offloaded)
    int8 = q.int8_held
    if q.segments:
        packed = q.kept_inputs - int8
        gpu = checkpoint_inputs_on_gpu(packed, checkpoint_input_bytes(spec, strategy), q.segments)
        return dataclasses.replace(q, kept_inputs=gpu + int8, host_activations=packed + model_host)
    emb = allocator_bytes(offload_embedding_kept_bytes(spec, strategy))
    stack = dataclasses.replace(
        a,
        variants=tuple(dataclasses.replace(v, saved_bytes=0, before_softmax_bytes=0) for v in a.variants),
        all_layers_bytes=int8,
        per_kind_bytes=dict.fromkeys(a.per_kind_bytes, 0),
        model_bytes=a.model_bytes - a.embedding_bytes + emb,
        embedding_bytes=emb,
        layer_on_device_bytes=0,
    )
    # Autocast's cache holds the copies of trainable leaves to the forward's end; a frozen weight's copy is per call
    # (aten/src/ATen/autocast_mode.cpp ``cached_cast``), saved by its matmul and so packed to the host with the rest:
    # only the cached ones are a forward-end transient (LoRA over an fp32 base under amp had all its frozen weights'
    # copies there, +32% over the trace on llama-3.2-1b at 1 × 256).
    cached_layer_copies = q.copies_fwd_ckpt - q.copies_head
    return dataclasses.replace(
        q,
        stack=stack,
        copies_all=q.copies_head,
        copies_max_layer=0,
        forward_transient=q.forward_transient + cached_layer_copies,
        block_temp=q.block_temp + offload_in_flight_bytes(spec, strategy),
        host_activations=a.all_layers_bytes - int8 + offload_layer_host_bytes(spec, strategy) + model_host,
        int8_bottom=int8,  # the bottom layer's own are no longer among its (offloaded) saves
    )


def _finetune_inputs(q: StepInputs) -> StepInputs:
    # Fine-tuning: only trainable tensors have gradients; a quantised base dequantises a weight in backward.
    spec, strategy = q.spec, q.strategy
    parts = finetune_parts(spec, strategy)
    # --freeze: a dead layer's frozen weights are cast per call and saved by nothing (adapters.FrozenLayers).
    fz = frozen_layers(spec, strategy)
    dead = fz.dead if fz is not None else 0
    # When nothing below the head needs a gradient (every layer dead, the final norm frozen), the head's
    # matmul needs no input gradient and saves no 16-bit copy of its weight: autocast's cached copy dies with
    # the forward's autocast region — a forward-end transient, gone in backward.
    head_copy = parts.copies_head_bytes if fz is not None and not fz.stack_output_grad and fz.final_norm_frozen else 0
    return dataclasses.replace(
        q,
        copies_all=q.copies_all - dead * parts.copies_layer_bytes - head_copy,
        copies_max_layer=q.copies_max_layer if fz is None or fz.dead < spec.num_layers else 0,
        # LLM.int8 inputs held on ctx escape checkpointing (activations.int8_ctx_bytes): kept like its inputs.
        kept_inputs=q.kept_inputs + (int8_ctx_bytes(spec, strategy) if q.segments else 0),
        int8_held=int8_ctx_bytes(spec, strategy),
        int8_layer=int8_layer_bytes(spec, strategy),
        # without checkpointing the bottom layer's own are among its saves already
        int8_bottom=int8_ctx_bytes(spec, strategy)
        - (0 if q.segments else int8_layer_bytes(spec, strategy, all_inputs=True)),
        resident=dataclasses.replace(q.resident, adapter_weights=q.states.adapter_weights_bytes),
        # A frozen bottom layer adds no gradient: every trainable one is there during its backward.
        grad_layer=0 if fz is not None and fz.bottom_frozen else parts.grad_layer_bytes,
        grad_head=parts.grad_head_bytes,
        grad_late=parts.grad_late_bytes,
        # A frozen MLP's moments derived op by op in backward_temp_bytes (derived_mlp_backward_bytes, the dequantised
        # weight and adapter chain included); elsewhere the older sum of the worst of each.
        block_temp=q.block_temp
        + (
            0
            if derived_mlp_backward_bytes(spec, strategy) is not None
            else dequant_transient_bytes(spec, strategy) + adapter_backward_bytes(spec, strategy)
        )
        # a checkpointed layer's recomputation computes DoRA's weight norm again
        + (dora_norm_transient_bytes(spec, strategy) if q.segments else 0),
        # A checkpointed forward keeps autocast's cached copies (trainable leaves: the adapters); a frozen
        # weight's per-call copy dies with its no-grad layer (the head's is saved by the head's matmul).
        copies_fwd_ckpt=q.copies_head + spec.num_layers * parts.cached_copies_layer_bytes,
        forward_transient=frozen_head_input_bytes(spec, strategy) + head_copy,
        dora_norm=dora_norm_transient_bytes(spec, strategy),
        moe_experts=moe_adapter_forward_bytes(spec, strategy) if q.segments else 0,
        down_forward=frozen_down_forward_bytes(spec, strategy, checkpointed=bool(q.segments)) or 0,
        # LLM.int8 inside a recomputation: the MoE experts' moment, else a dense MLP's adapted down projection
        recompute_moe=int8_moe_recompute_bytes(spec, strategy)
        if spec.num_moe_layers
        else int8_dense_recompute_bytes(spec, strategy),
    )


def _step_inputs(spec: ModelSpec, strategy: Strategy, *, keep_logits: bool) -> StepInputs:
    st = model_states(spec, strategy)
    inv = inventory(spec)
    stack = stack_activations(spec, strategy, st)
    gb = strategy.recipe.grad_bits // 8
    table = spec.vocab_size * spec.embed_dim
    counts, copies = stack.layer_counts, stack.autocast_layer_copies
    c_all = st.autocast_copies_bytes
    c_head = max(0, c_all - sum(counts[k] * copies[k] for k in counts))
    lg = logits_memory(spec, strategy, keep_logits=keep_logits)
    temps = backward_temp_bytes(spec, strategy)
    kept_inputs, n_segments, seg_layers = checkpoint_terms(spec, strategy)
    variants = attention_variants(spec, strategy)
    return StepInputs(
        spec=spec,
        strategy=strategy,
        states=st,
        stack=stack,
        resident=Resident(
            weights=st.weights_bytes, master_weights=st.master_bytes, optimizer_states=st.optimizer_bytes
        ),
        grads_resident=st.grads_bytes if strategy.grad_accum > 1 else 0,
        grad_layer=max(g.params_per_layer for g in inv.layers) * gb,
        # The LM head's gradient appears first (the token table's, when tied); the untied token table's last.
        grad_head=_head_grad_numel(spec) * gb,
        grad_late=0 if spec.tie_word_embeddings and spec.kind.has_vocab_logits else table * gb,
        copies_all=c_all,
        copies_head=c_head,
        copies_max_layer=max(copies.values()),
        # A checkpointed forward keeps autocast's cached weight copies; uncached (per-call) ones die with it.
        copies_fwd_ckpt=c_all if spec.autocast_weight_cache else c_head,
        logits_forward=lg.forward_peak_bytes,
        logits_backward=lg.backward_peak_bytes,
        block_temp=temps.block_bytes,
        norm_temp=temps.norm_bytes,
        kept_inputs=kept_inputs,
        sac_saved=sum(x.bytes for x in sac_saved_terms(spec, strategy)),
        segments=n_segments,
        segment_layers=seg_layers,
        # The [b, 1, s, s] attention masks (eager attention; SDPA past a sliding window): inputs of every
        # checkpointed layer, so with checkpointing they stay until the first layer's backward; without, they
        # die with the decoder's forward.
        masks=sum(allocator_bytes(m) for m in attention_mask_bytes(spec, strategy)),
        cache_held=sum(n * sum(map(allocator_bytes, kv_cache_held_tensors(v, strategy))) for v, n in variants)
        + allocator_bytes(first_layer_cache_bytes(spec, strategy))
        + _dead_cache_bytes(spec, strategy),
        forward_transient=frozen_head_input_bytes(spec, strategy),  # 0 for a trainable LM head
        down_forward=dense_forward_bytes(spec, strategy),  # a checkpointed non-gated MLP's working set
    )


def _head_grad_numel(spec: ModelSpec) -> int:
    """Elements of the first gradient to appear: the LM head's (the tied token table's), or a classification
    head's own tensors (trainfit.arch.heads; the token table's gradient then comes last)."""
    if not spec.kind.has_vocab_logits:
        from trainfit.arch.heads import head_tensors

        return sum(t.numel for t in head_tensors(spec))
    return spec.vocab_size * spec.embed_dim if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size


def _recompute_bytes(q: StepInputs, *, bottom: bool = False) -> tuple[int, int]:
    """(what the recomputed segment saves, the segment's input). The recomputed segment saves its own input
    again; when the first norm saves the residual tensor itself (fp32 residual, or LayerNorm), that is the
    kept checkpoint — count it once. ``bottom``: the first segment, counted layer by layer under --freeze."""
    input_bytes = Widths.of(q.strategy).residual * q.strategy.tokens_per_micro_batch * q.spec.hidden_size
    # LLM.int8: a recomputed layer's int8 inputs go with the recomputed graph (activations.int8_layer_bytes).
    saved = q.segment_layers * (q.stack.max_layer_bytes - q.int8_layer)
    if bottom and q.stack.bottom_segment_bytes is not None:
        saved = q.stack.bottom_segment_bytes
    return saved - _shared_input_bytes(q), input_bytes


def _shared_input_bytes(q: StepInputs) -> int:
    """The segment's input when the recomputed first norm saves that very tensor (fp32 residual, or LayerNorm):
    already counted as the kept checkpoint."""
    w = Widths.of(q.strategy)
    if w.residual == 4 or q.spec.norm is NormKind.LAYERNORM:
        return w.residual * q.strategy.tokens_per_micro_batch * q.spec.hidden_size
    return 0


def forward_moments(q: StepInputs) -> list[Moment]:
    a = q.stack
    base = {"phase": Phase.FORWARD, "resident": q.resident, "gradients": q.grads_resident}
    if q.segments == 0:
        end = Moment(
            name=MomentName.FORWARD_END,
            **base,  # type: ignore[arg-type]
            activations=a.all_layers_bytes + a.model_bytes,
            autocast_copies=q.copies_all,
            logits_loss=q.logits_forward,
            temporaries=(0 if q.loss_after_outputs else q.cache_held) + q.forward_transient,
        )
    else:
        end = Moment(
            name=MomentName.FORWARD_END,
            **base,  # type: ignore[arg-type]
            activations=q.kept_inputs + a.model_bytes + q.masks,
            autocast_copies=q.copies_fwd_ckpt,
            logits_loss=q.logits_forward,
            temporaries=q.forward_transient,
        )
    moments = [end]
    if q.float8_forward:
        # The last block's casts, over what the stack below (or, checkpointed, the kept inputs) holds; the head's
        # autocast copy is not made yet. Counting the whole last block as saved makes this an upper bound.
        layer_copies = q.copies_all - q.copies_head
        moments.append(
            Moment(
                name=MomentName.FORWARD_FP8_CAST,
                **base,  # type: ignore[arg-type]
                activations=(a.all_layers_bytes if q.segments == 0 else q.kept_inputs) + a.embedding_bytes + q.masks,
                autocast_copies=layer_copies if q.segments == 0 or q.spec.autocast_weight_cache else q.copies_max_layer,
                temporaries=q.float8_forward + q.cache_held,
            )
        )
    if q.dora_norm:
        # Inside the last layer's widest DoRA linear: every layer's saved tensors (the last one's nearly all),
        # or the kept inputs of a checkpointed forward, and the weight norm's full-size transients.
        moments.append(
            Moment(
                name=MomentName.FORWARD_LAST_DORA_NORM,
                **base,  # type: ignore[arg-type]
                activations=(a.all_layers_bytes if q.segments == 0 else q.kept_inputs + q.masks) + a.embedding_bytes,
                autocast_copies=q.copies_all - q.copies_head if q.segments == 0 else q.copies_fwd_ckpt - q.copies_head,
                temporaries=q.dora_norm + q.cache_held,
            )
        )
    if q.moe_experts:
        # Inside the last layer's experts of a checkpointed forward (activations.moe_adapter_forward_bytes).
        moments.append(
            Moment(
                name=MomentName.FORWARD_LAST_MOE_EXPERTS,
                **base,  # type: ignore[arg-type]
                activations=q.kept_inputs + q.masks + a.embedding_bytes,
                autocast_copies=q.copies_fwd_ckpt - q.copies_head,
                temporaries=q.moe_experts + q.cache_held,
            )
        )
    if q.down_forward:
        # Inside the last layer's MLP: every layer's saves (the last one's nearly all), or the kept inputs of a
        # checkpointed forward and the MLP's working set.
        moments.append(
            Moment(
                name=MomentName.FORWARD_LAST_DOWN_PROJ,
                **base,  # type: ignore[arg-type]
                activations=(a.all_layers_bytes if q.segments == 0 else q.kept_inputs + q.masks) + a.embedding_bytes,
                autocast_copies=q.copies_all - q.copies_head if q.segments == 0 else q.copies_fwd_ckpt - q.copies_head,
                temporaries=q.down_forward + q.cache_held,
            )
        )
    for v in a.variants:
        if v.kind != a.top_kind:
            continue
        chain_saved, chain_transient = eager_forward_moment(v.spec, q.strategy)
        if not chain_saved:
            continue
        # A materialised score chain in the last layer can outweigh the loss computation.
        if q.segments == 0:
            # Every layer below has saved everything; the last one what it saves before the softmax.
            moments.append(
                Moment(
                    name=MomentName.FORWARD_LAST_SOFTMAX,
                    **base,  # type: ignore[arg-type]
                    activations=a.all_layers_bytes
                    - v.saved_bytes
                    + v.before_softmax_bytes
                    + chain_saved
                    + a.embedding_bytes,
                    autocast_copies=q.copies_all,
                    temporaries=chain_transient
                    + selective_core_locals_bytes(v.spec, q.strategy)
                    + unsaved_stack_locals_bytes(v.spec, q.strategy)
                    + q.masks
                    + q.cache_held,
                )
            )
        else:
            # A checkpointed forward saves nothing: the chain and the attention's inputs are transient.
            moments.append(
                Moment(
                    name=MomentName.FORWARD_LAST_SOFTMAX,
                    **base,  # type: ignore[arg-type]
                    activations=q.kept_inputs + a.embedding_bytes + q.masks,
                    autocast_copies=q.copies_fwd_ckpt + (0 if q.spec.autocast_weight_cache else q.copies_max_layer),
                    temporaries=eager_nograd_inputs_bytes(v.spec, q.strategy)
                    + chain_saved
                    + chain_transient
                    + _previous_probs(v.spec, q.strategy),
                )
            )
    return moments


def backward_moments(q: StepInputs) -> list[Moment]:
    a = q.stack
    g_all = q.states.grads_bytes
    gr = q.grads_resident
    g_head = max(gr, q.grad_head)
    model_norm = a.model_bytes - a.head_input_bytes  # after the LM head's backward, inside the final norm's
    base = {"phase": Phase.BACKWARD, "resident": q.resident}
    recomputing: list[Moment] = []
    if q.segments == 0:
        saved = a.all_layers_bytes + a.model_bytes
        start = Moment(
            name=MomentName.BACKWARD_START,
            **base,  # type: ignore[arg-type]
            gradients=gr,
            activations=saved,
            autocast_copies=q.copies_all,
            logits_loss=q.logits_backward,
        )
        norm = Moment(
            name=MomentName.BACKWARD_FINAL_NORM,
            **base,  # type: ignore[arg-type]
            gradients=g_head,
            activations=a.all_layers_bytes + model_norm,
            autocast_copies=q.copies_all - q.copies_head,
            temporaries=q.norm_temp,
        )
        top = Moment(
            name=MomentName.BACKWARD_TOP_BLOCK,
            **base,  # type: ignore[arg-type]
            gradients=g_head,
            activations=a.all_layers_bytes + a.embedding_bytes,
            autocast_copies=q.copies_all - q.copies_head,
            temporaries=q.block_temp,
        )
        bottom = Moment(
            name=MomentName.BACKWARD_BOTTOM_BLOCK,
            **base,  # type: ignore[arg-type]
            gradients=max(gr, g_all - q.grad_layer - q.grad_late),
            # LLM.int8: the layers above keep their ctx-held inputs until the graph goes (activations.int8_ctx_bytes)
            activations=(a.max_layer_bytes if a.layer_on_device_bytes is None else a.layer_on_device_bytes)
            + a.embedding_bytes
            + q.int8_bottom,
            autocast_copies=q.copies_max_layer,
            temporaries=q.block_temp,
        )
    else:
        recompute, segment_input = _recompute_bytes(q)
        start = Moment(
            name=MomentName.BACKWARD_START,
            **base,  # type: ignore[arg-type]
            gradients=gr,
            activations=q.kept_inputs + a.model_bytes + q.masks,
            autocast_copies=q.copies_head,
            logits_loss=q.logits_backward,
        )
        norm = Moment(
            name=MomentName.BACKWARD_FINAL_NORM,
            **base,  # type: ignore[arg-type]
            gradients=g_head,
            activations=q.kept_inputs + model_norm + q.masks,
            temporaries=q.norm_temp,
        )
        # Under sac the recomputation takes the layer's kept outputs from its cache (torch.utils.checkpoint
        # ``_CachedTorchDispatchMode``) instead of allocating them, and the cache lets go of them: the layer's
        # saved set replaces them.
        top = Moment(
            name=MomentName.BACKWARD_TOP_BLOCK,
            **base,  # type: ignore[arg-type]
            gradients=g_head,
            activations=q.kept_inputs - q.sac_saved + recompute + a.embedding_bytes + q.masks,
            autocast_copies=q.segment_layers * q.copies_max_layer,
            temporaries=q.block_temp,
        )
        if q.recompute_moe[0]:
            # LLM.int8 MoE: inside the top layer's recomputed routed experts, before its graph (and its int8 inputs)
            # is dropped (activations.int8_moe_recompute_bytes).
            saved, in_flight = q.recompute_moe
            recomputing.append(
                Moment(
                    name=MomentName.BACKWARD_TOP_RECOMPUTE,
                    **base,  # type: ignore[arg-type]
                    gradients=g_head,
                    activations=q.kept_inputs + saved - _shared_input_bytes(q) + a.embedding_bytes + q.masks,
                    autocast_copies=q.segment_layers * q.copies_max_layer,
                    temporaries=in_flight,
                )
            )
        # Entering the first segment's backward: its layers' and the token table's grads are not there yet.
        recompute_bottom, _ = _recompute_bytes(q, bottom=True)
        g_bottom = max(gr, g_all - q.segment_layers * q.grad_layer - q.grad_late)
        if q.recompute_moe[0]:
            # ... and inside the bottom layer's recomputed experts, every gradient above there (counted at the largest
            # layer's size, as the bottom moment is).
            saved, in_flight = q.recompute_moe
            recomputing.append(
                Moment(
                    name=MomentName.BACKWARD_BOTTOM_RECOMPUTE,
                    **base,  # type: ignore[arg-type]
                    gradients=g_bottom,
                    activations=a.bottom_kept_segments * segment_input
                    + saved
                    - _shared_input_bytes(q)
                    + a.embedding_bytes
                    + q.masks
                    + q.int8_bottom,
                    autocast_copies=q.segment_layers * q.copies_max_layer,
                    temporaries=in_flight,
                )
            )
        bottom = Moment(
            name=MomentName.BACKWARD_BOTTOM_BLOCK,
            **base,  # type: ignore[arg-type]
            gradients=g_bottom,
            activations=a.bottom_kept_segments * segment_input
            + recompute_bottom
            + a.embedding_bytes
            + q.masks
            + q.int8_bottom,  # LLM.int8: every layer's ctx-held inputs (activations.int8_ctx_bytes)
            autocast_copies=q.segment_layers * q.copies_max_layer,
            temporaries=q.block_temp,
        )
    # A tied table receives a second dense gradient from the embedding, added into the head's, which waits in
    # autograd's buffer — in place or not (states.tied_gradient_sum). The head's buffered gradient (born in the
    # head's backward: logits/loss, as the trace files it) is a tensor of its own unless it is added into in place
    # and becomes the .grad; with accumulation the .grad is resident and an out-of-place sum is transient too.
    # Data parallelism too (states.tied_sum_modelled; analytic.parallel adjusts the moment per framework).
    tied = tied_gradient_sum(q.spec, q.strategy) if q.grad_head else None
    single = tied_sum_modelled(q.strategy)
    held_apart = tied is not None and single and (tied.out_of_place_bytes > 0 or gr > 0)
    embedding = Moment(
        name=MomentName.BACKWARD_EMBEDDING,
        **base,  # type: ignore[arg-type]
        gradients=g_all,
        activations=a.embedding_bytes + q.int8_held,
        logits_loss=q.grad_head if held_apart else 0,
        temporaries=(tied.embedding_grad_bytes + (tied.out_of_place_bytes if gr and single else 0)) if tied else 0,
    )
    moments = [start, norm, top, *recomputing, bottom, embedding]
    cast = head_grad_cast_bytes(q)
    if cast:
        # Under autocast the head's matmul backward makes its weight gradient in the compute dtype (mm over the
        # weight's cast, which autocast cached and the node saved); ToCopyBackward0 then casts it into the wider
        # .grad after the node has released the cast (the analytic stream's ``casts``; the trace's records): for
        # a moment the 16-bit gradient, the .grad and the head input's gradient are all there, the logits' gradients
        # gone. With the optimizer in backward this is the backward's worst (llama-3.2-1b, amp-bf16, 1 × 512: the
        # tied table's 1002 MiB .grad beside its 501 MiB bf16 gradient; the closed form had the peak 1.3% low).
        moments.append(
            dataclasses.replace(
                norm,
                name=MomentName.BACKWARD_HEAD_GRAD_CAST,
                temporaries=cast
                + Widths.of(q.strategy).residual * q.strategy.tokens_per_micro_batch * q.spec.hidden_size,
            )
        )
    for v in a.variants:
        if v.kind != a.top_kind:
            continue
        attn_saved, attn_temp = eager_backward_moment(v.spec, q.strategy)
        if attn_saved:
            # Inside the top layer's (and the bottom segment's top layer's) attention backward: that layer
            # holds what it saved before its softmax plus the softmax output, the rest of it is released.
            swap = v.before_softmax_bytes + v.recomputed_before_softmax_bytes + attn_saved - a.per_kind_bytes[v.kind]
            moments += [m.inside_softmax_backward(swap, attn_temp) for m in (top, bottom)]
    return moments


def head_grad_cast_bytes(q: StepInputs) -> int:
    """The head's weight gradient in the compute dtype where autocast makes it narrower than the .grad it is cast
    into (a trainable head with an autocast copy, the standard loss — Liger's fused loss writes the .grad itself, a
    chunked loss sums its chunks' gradients first); 0 otherwise."""
    s, r = q.strategy, q.strategy.recipe
    cast = (
        r.autocast
        and q.copies_head > 0
        and q.grad_head > 0
        and q.spec.kind.has_vocab_logits
        and s.savers.loss is LossImpl.STANDARD
        and r.compute_bits < r.grad_bits
    )
    return q.grad_head * r.compute_bits // r.grad_bits if cast else 0


def optimizer_step_moment(q: StepInputs) -> Moment:
    return Moment(
        name=MomentName.OPTIMIZER_STEP,
        phase=Phase.OPTIMIZER_STEP,
        resident=q.resident,
        gradients=q.states.grads_bytes,
        temporaries=q.states.step_temp_bytes,
    )


def training_moments(q: StepInputs) -> dict[Phase, Moment]:
    """The worst moment of each phase of a training step."""
    fwd, bwd, opt = forward_moments(q), backward_moments(q), optimizer_step_moment(q)
    if q.strategy.savers.optimizer_in_backward:
        # torchtune register_optim_in_bwd_hooks: each gradient is stepped and dropped as it is accumulated, so
        # one tensor's gradient at a time; optimizer.step() then has nothing left to do (trainfit.analytic.savers).
        one = largest_grad_bytes(q.spec, q.strategy)
        bwd = [dataclasses.replace(m, gradients=min(m.gradients, one)) for m in bwd]
        opt = dataclasses.replace(opt, gradients=0, temporaries=0)
    if any(q.offload_retained):
        # torchtune OffloadActivations keeps the last unpacking node (and what it reaches) from the end of one
        # backward to the next one's final norm: the optimizer step, the forward and the loss backward hold it.
        held, grad = q.offload_retained

        def retained(m: Moment) -> Moment:
            return dataclasses.replace(m, activations=m.activations + held, temporaries=m.temporaries + grad)

        fwd = [retained(m) for m in fwd]
        bwd = [retained(m) if m.name is MomentName.BACKWARD_START else m for m in bwd]
        opt = retained(opt)
    ha, ho = q.host_activations, q.host_optimizer_states
    return {
        Phase.FORWARD: dataclasses.replace(worst(fwd), host_activations=ha, host_optimizer_states=ho),
        Phase.BACKWARD: dataclasses.replace(worst(bwd), host_activations=ha, host_optimizer_states=ho),
        Phase.OPTIMIZER_STEP: dataclasses.replace(opt, host_optimizer_states=ho),
    }


def largest_grad_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """The largest single gradient tensor (optimizer in backward holds one at a time)."""
    gb = strategy.recipe.grad_bits
    return max(
        (
            allocator_bytes(ps.tensor.numel * (ps.bits or gb) // 8)
            for ps in param_states(spec, strategy)
            if ps.trainable
        ),
        default=0,
    )


def _closed_form(
    spec: ModelSpec, strategy: Strategy, *, keep_logits: bool
) -> tuple[Strategy, StepInputs, tuple[PhaseBreakdown, ...]]:
    strategy, _ = effective_strategy(spec, strategy)  # Gemma-2: eager attention
    check_savers(spec, strategy)
    q = step_inputs(spec, strategy, keep_logits=keep_logits)
    worst_moments = training_moments(q)
    return strategy, q, tuple(worst_moments[ph].breakdown() for ph in Phase)


def analytic_phases(spec: ModelSpec, strategy: Strategy, *, keep_logits: bool = False) -> tuple[PhaseBreakdown, ...]:
    """The closed-form phases of :func:`estimate_analytic` alone — its ``peak_bytes`` is their maximum — without
    the allocator simulation that gives its reserve (most of its time): for callers that need allocated bytes
    only, such as the model's invariant tests."""
    return _closed_form(spec, strategy, keep_logits=keep_logits)[2]


def estimate_analytic(
    spec: ModelSpec,
    strategy: Strategy,
    *,
    keep_logits: bool = False,
    allocator: AllocatorConfig | None = None,
    workspaces: tuple[Workspace, ...] = (),
    layout: bool = False,
    capacity_bytes: int | None = None,
    stop_above_bytes: int | None = None,
    start: ProcessStart | None = None,
) -> MemoryReport:
    """Closed-form per-GPU peak allocated memory for one training step of ``spec`` under ``strategy``; reserved
    memory from the caching-allocator simulation of the same tensors (:mod:`trainfit.analytic.events`) under
    ``allocator`` (default: ``PYTORCH_CUDA_ALLOC_CONF`` from the environment), with the GPU's cuBLAS
    ``workspaces`` in the stream (the phases leave them out: :func:`trainfit.estimate` adds them per GPU).
    ``capacity_bytes``: the allocator's share of the GPU; when only the uncapped reserve exceeds it, the stream
    runs once more under it (``MemoryReport.capped``, :func:`trainfit.allocator.report.capped_run`).
    ``stop_above_bytes``: the stream stops once reserved passes it (``MemoryReport.reserve_stopped``: a lower bound
    of the reserve; for callers that only ask whether it fits) — not with the savers or fp8, whose reserve is taken
    above the simulation's own allocated peak, which a stopped run does not bound.
    ``start``: the process the run starts in (``trainfit.history``): the whole synthesised stream runs after its
    history (:class:`~trainfit.allocator.process.ProcessStart`; not memoised, never stopped early)."""
    strategy, q, phases = _closed_form(spec, strategy, keep_logits=keep_logits)
    config = allocator if allocator is not None else AllocatorConfig.from_env()
    own_peak = strategy.savers.any or float8_enabled(strategy)
    stop = None if own_peak else stop_above_bytes
    # max_memory_allocated counts blocks: each phase's blocks beyond its requests, from the allocator simulation of
    # the stream the reserve comes from (one pass for both; after a process history or for the layout, the reserve's
    # own run follows)
    fresh, rounding = simulate_with_rounding(
        spec, strategy, config, workspaces, stop_above_bytes=stop if start is None and not layout else None
    )
    phases = tuple(
        dataclasses.replace(p, components={**p.components, Component.ALLOCATOR_ROUNDING: rounding[Phase(p.phase)]})
        for p in phases
    )
    peak = max(p.total_bytes for p in phases)
    st, stack = q.states, q.stack
    tokens_layers = strategy.tokens_per_micro_batch * spec.hidden_size * spec.num_layers
    coeff = (stack.all_layers_bytes if q.segments == 0 else q.kept_inputs) / tokens_layers

    def simulated(
        capacity: int | None = None, *, with_layout: bool = False, stop_at: int | None = None
    ) -> AllocatorResult:
        if start is None:
            return simulate_training(
                spec,
                strategy,
                config,
                workspaces,
                layout=with_layout,
                capacity_bytes=capacity,
                stop_above_bytes=stop_at,
            )
        events = start.events(training_events(spec, strategy, workspaces))
        return simulate(events, config, layout=with_layout, capacity_bytes=capacity, setup=start.setup)

    sim = fresh if start is None and not layout else simulated(with_layout=layout, stop_at=stop)
    held = peak + sum(w.size_bytes for w in workspaces)
    reserve = max(0, sim.peak_reserved_bytes - held)
    if own_peak:
        # The synthesised stream replays the paged optimizer, the loss savers, the optimizer in backward and (without
        # checkpointing, coarsely) activation offloading, but not fp8's casts (Float8Linear's transients):
        # take the allocator's own overhead above its allocated peak rather than above this peak.
        reserve = max(0, sim.peak_reserved_bytes - sim.peak_allocated_bytes)
    capped = capped_run(
        simulated,
        sim,
        held_bytes=held,
        reserve_bytes=reserve,
        capacity_bytes=capacity_bytes,
    )
    return MemoryReport(
        method=Method.ANALYTIC,
        model_name=spec.name,
        params=st.params,
        trainable_params=st.trainable_params,
        phases=phases,
        overhead=outside_allocator(None, allocator_reserve_bytes=reserve),
        bytes_per_param=BytesPerParam(
            weights=st.per_param(st.weights_bytes),
            gradients=st.per_param(st.grads_bytes),
            master_weights=st.per_param(st.master_bytes),
            optimizer_states=st.per_param(st.optimizer_bytes),
            autocast_copies=st.per_param(st.autocast_copies_bytes),
        ),
        terms=_terms(spec, strategy, st, stack, q.logits_backward),
        notes=_notes(spec, strategy, coeff),
        details=AnalyticDetails(
            activation_coefficient=round(coeff, 2),
            activations_per_layer_bytes=stack.max_layer_bytes,
            allocator=allocator_details(sim, config),
        ),
        capped=capped,
        reserve_simulated=True,
        reserve_stopped=sim.stopped,
    )


def _notes(spec: ModelSpec, strategy: Strategy, coeff: float) -> tuple[str, ...]:
    notes = [
        f"activation coefficient c = {coeff:.1f} bytes per (token·hidden·layer) (the article assumes 10–20)",
        "steady state (step ≥ 2): optimizer states resident; grads freed by zero_grad(set_to_none=True)",
        "model outputs (logits) dropped before backward, as the HF Trainer does",
        f"optimizer.step() uses torch's {strategy.optimizer_impl.value} implementation"
        + (
            " (list-sized temporaries; --optimizer-impl fused avoids them)"
            if strategy.optimizer_impl.value == "foreach" and strategy.optimizer is Optimizer.ADAMW
            else ""
        ),
    ]
    if strategy.grad_accum > 1:
        notes.append(
            f"grad accumulation ×{strategy.grad_accum}: grads stay resident across micro-steps; "
            f"effective batch {strategy.effective_batch}"
        )
    if float8_enabled(strategy):
        n = sum(x.converted for x in block_linears(spec))
        notes.append(
            f"--fp8 {strategy.float8.value}: torchao Float8Linear on {n} of each block's {len(block_linears(spec))} "
            "linears (dims ÷ 16; LM head in bf16), eager casts; the allocator stream leaves their transients out"
        )
    base_note = fp32_base_note(spec, strategy)
    if base_note is not None:
        notes.append(base_note)
    return tuple(notes) + saver_notes(spec, strategy)


def _terms(
    spec: ModelSpec, strategy: Strategy, st: ModelStates, stack: StackActivations, logits_backward_bytes: int
) -> tuple[Term, ...]:
    w = Widths.of(strategy)
    return (
        Term(
            name="weights",
            bytes=st.weights_bytes,
            formula=f"Σ numel·{strategy.recipe.weight_bits // 8} B",
            source="parameter inventory (trainfit.arch.params)",
        ),
        Term(
            name="gradients",
            bytes=st.grads_bytes,
            formula=f"Σ numel·{strategy.recipe.grad_bits // 8} B",
            source="one grad per trainable parameter, parameter dtype",
        ),
        Term(
            name="master_weights",
            bytes=st.master_bytes,
            formula="Σ numel·4 B (master-* only)",
            source="Micikevicius et al. 2018",
        ),
        Term(
            name="optimizer_states",
            bytes=st.optimizer_bytes,
            formula=f"{strategy.optimizer.value} states",
            source="trainfit.analytic.states docstring",
        ),
        Term(
            name="activations/layer",
            bytes=stack.max_layer_bytes,
            formula="Σ saved tensors of one block",
            source="trainfit.analytic.activations (Korthikanti et al. 2022, Table 2, modernised)",
        ),
        Term(
            name="logits_loss (backward)",
            bytes=logits_backward_bytes,
            formula="12·b·s·vocab",
            source="HF ForCausalLMLoss: logits.float() + cross_entropy",
        ),
        Term(
            name="autocast_copies",
            bytes=st.autocast_copies_bytes,
            formula=f"Σ matmul numel·{w.compute} B (amp-* only)",
            source="aten autocast_mode.cpp cached_cast",
        ),
        Term(
            name="optimizer_step_temporaries",
            bytes=st.step_temp_bytes,
            formula="foreach sqrt buffer (+fp32 grads)",
            source="torch/optim/adam.py _multi_tensor_adam",
        ),
    )


def _previous_probs(spec: ModelSpec, strategy: Strategy) -> int:
    """The previous block's returned attention probabilities, when the stack loop keeps them (HF Falcon)
    while the next block runs; without checkpointing they are saved anyway."""
    ch = score_chain(spec, strategy)
    if ch is None or not spec.eager_probs_outlive_layer or strategy.attention is not Attention.EAGER:
        return 0
    return ch.softmax_out * ch.scores
