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
"""

from __future__ import annotations

import dataclasses

from trainfit.analytic.activations import (
    SavedTerm,
    Widths,
    attention_mask_bytes,
    attention_variants,
    backward_temp_bytes,
    checkpoint_terms,
    eager_backward_moment,
    eager_forward_moment,
    eager_nograd_inputs_bytes,
    kv_cache_held_bytes,
    layer_terms,
    model_terms,
    score_chain,
)
from trainfit.analytic.logits import logits_memory
from trainfit.analytic.overhead import ALLOCATOR_BLOCK_BYTES, overhead_for
from trainfit.analytic.states import model_states
from trainfit.arch.params import inventory
from trainfit.arch.spec import ModelSpec, NormKind
from trainfit.result import Component, MemoryReport, Method, PhaseBreakdown, Term
from trainfit.result import Phase as P
from trainfit.strategy import Attention, Optimizer, Strategy
from trainfit.units import round_up

C = Component


def _sum(terms: list[SavedTerm]) -> int:
    return sum(round_up(t.bytes, ALLOCATOR_BLOCK_BYTES) for t in terms)


def _phase(phase: P, **parts: int) -> PhaseBreakdown:
    return PhaseBreakdown(phase=phase, components={C(k): int(v) for k, v in parts.items()})


def estimate_analytic(spec: ModelSpec, strategy: Strategy, *, keep_logits: bool = False) -> MemoryReport:
    """Closed-form per-GPU peak allocated memory for one training step of ``spec`` under ``strategy``."""
    if strategy.attention is Attention.SDPA and not spec.supports_sdpa:
        # transformers refuses SDPA for this model (Gemma-2): the run would use eager attention.
        strategy = dataclasses.replace(strategy, attention=Attention.EAGER)
    st = model_states(spec, strategy)
    inv = inventory(spec)
    w = Widths.of(strategy)
    L = spec.num_layers

    # Activations per layer kind and the model-level tensors. A stack where only some layers slide (Qwen2
    # with use_sliding_window) makes two SDPA calls: the sliding layers get the mask, the others none, and
    # each may get a different kernel — two attention variants, each with its own layer count.
    variants = attention_variants(spec, strategy)
    per_layer: dict[str, int] = {}
    counts: dict[str, int] = {}
    layer_copies: dict[str, int] = {}
    # Per variant and kind: (layers, all it saves, what it has saved when its attention softmax runs).
    saved_by: list[tuple[ModelSpec, str, int, int, int]] = []
    for g in inv.layers:
        counts[g.kind] = g.count
        for vspec, n in variants:
            lt = layer_terms(vspec, strategy, moe=g.kind == "moe")
            cut = next((i for i, x in enumerate(lt) if x.name == "attn.softmax"), len(lt))
            # With one kind (every stack with mixed sliding layers is one), the variant counts are exact.
            layers = g.count if len(variants) == 1 else n
            saved_by.append((vspec, g.kind, layers, _sum(lt), _sum(lt[:cut])))
            per_layer[g.kind] = max(per_layer.get(g.kind, 0), _sum(lt))
        mm = sum(t.numel for t in g.tensors if t.matmul)
        layer_copies[g.kind] = mm * w.compute if w.amp else 0
    if spec.params_override is not None and w.amp:
        scale = st.autocast_copies_bytes / max(1, sum(counts[k] * layer_copies[k] for k in counts))
        layer_copies = {k: int(v * scale) for k, v in layer_copies.items()}
    if len(variants) == 1 or len(inv.layers) == 1:
        a_layers = sum(layers * total for _, _, layers, total, _ in saved_by)
    else:  # mixed sliding layers in a stack of several kinds (no such family today): the larger variant
        a_layers = sum(counts[k] * per_layer[k] for k in counts)
    a_model_terms = model_terms(spec, strategy)
    a_model = _sum(a_model_terms)
    a_max_layer = max(per_layer.values())
    c_max_layer = max(layer_copies.values())
    c_all = st.autocast_copies_bytes
    c_head = max(0, c_all - sum(counts[k] * layer_copies[k] for k in counts))
    # A checkpointed forward keeps autocast's cached weight copies; uncached (per-call) ones die with it.
    c_fwd_ckpt = c_all if spec.autocast_weight_cache else c_head
    lg = logits_memory(spec, strategy, keep_logits=keep_logits)
    temps = backward_temp_bytes(spec, strategy)
    bwd_temp = temps.block_bytes

    base = {
        "weights": st.weights_bytes,
        "master_weights": st.master_bytes,
        "optimizer_states": st.optimizer_bytes,
    }
    gb = strategy.recipe.grad_bits // 8
    g_all = st.grads_bytes
    g_resident = g_all if strategy.grad_accum > 1 else 0
    g_layer = max(g.params_per_layer for g in inv.layers) * gb
    table = spec.vocab_size * spec.embed_dim
    # The LM head's gradient appears first (the token table's, when tied); the untied token table's last.
    g_head = (table if spec.tie_word_embeddings else _head_params(spec)) * gb
    g_late = 0 if spec.tie_word_embeddings else table * gb
    # Model-level saved tensors: the head's (final norm, LM-head input) die after the head's backward;
    # the embedding's (ids, RoPE tables, masks) live to the end.
    a_model_end = _sum([t for t in a_model_terms if t.name.startswith(("embed", "rope"))])
    # A tied table receives a second dense gradient from the embedding, added into the first.
    b_embed = _phase(
        P.BACKWARD,
        **base,
        gradients=g_all,
        activations=a_model_end,
        temporaries=table * gb if spec.tie_word_embeddings else 0,
    )

    # After the LM head's backward, inside the final norm's: the head's input is released, the norm's
    # own saved tensors are not yet.
    lm_head_in = _sum([t for t in a_model_terms if t.name.startswith("lm_head_in")])
    a_model_norm = a_model - lm_head_in

    kept_inputs, n_segments, seg_layers = checkpoint_terms(spec, strategy)
    # The [b, 1, s, s] attention masks (eager attention; SDPA past a sliding window): inputs of every
    # checkpointed layer, so with checkpointing they stay until the first layer's backward; without, they die
    # with the decoder's forward.
    masks = sum(round_up(m, ALLOCATOR_BLOCK_BYTES) for m in attention_mask_bytes(spec, strategy))
    # The KV cache's own copies of k and v (built in training when use_cache is on) live to the forward's end.
    cache_held = sum(n * round_up(kv_cache_held_bytes(v, strategy), ALLOCATOR_BLOCK_BYTES) for v, n in variants)
    if n_segments == 0:
        saved = a_layers + a_model
        forward = _phase(
            P.FORWARD,
            **base,
            gradients=g_resident,
            activations=saved,
            autocast_copies=c_all,
            logits_loss=lg.forward_peak_bytes,
            temporaries=cache_held,
        )
        b_start = _phase(
            P.BACKWARD,
            **base,
            gradients=g_resident,
            activations=saved,
            autocast_copies=c_all,
            logits_loss=lg.backward_peak_bytes,
        )
        b_norm = _phase(
            P.BACKWARD,
            **base,
            gradients=max(g_resident, g_head),
            activations=a_layers + a_model_norm,
            autocast_copies=c_all - c_head,
            temporaries=temps.norm_bytes,
        )
        b_top = _phase(
            P.BACKWARD,
            **base,
            gradients=max(g_resident, g_head),
            activations=a_layers + a_model_end,
            autocast_copies=c_all - c_head,
            temporaries=bwd_temp,
        )
        b_bottom = _phase(
            P.BACKWARD,
            **base,
            gradients=max(g_resident, g_all - g_layer - g_late),
            activations=a_max_layer + a_model_end,
            autocast_copies=c_max_layer,
            temporaries=bwd_temp,
        )
    else:
        # The recomputed segment saves its own input again; when the first norm saves the residual
        # tensor itself (fp32 residual, or LayerNorm), that is the kept checkpoint — count it once.
        shared_input = w.residual == 4 or spec.norm is NormKind.LAYERNORM
        input_bytes = w.residual * strategy.tokens_per_micro_batch * spec.hidden_size
        recompute = seg_layers * a_max_layer - (input_bytes if shared_input else 0)
        kept = kept_inputs
        forward = _phase(
            P.FORWARD,
            **base,
            gradients=g_resident,
            activations=kept + a_model + masks,
            autocast_copies=c_fwd_ckpt,
            logits_loss=lg.forward_peak_bytes,
        )
        b_start = _phase(
            P.BACKWARD,
            **base,
            gradients=g_resident,
            activations=kept + a_model + masks,
            autocast_copies=c_head,
            logits_loss=lg.backward_peak_bytes,
        )
        b_norm = _phase(
            P.BACKWARD,
            **base,
            gradients=max(g_resident, g_head),
            activations=kept + a_model_norm + masks,
            autocast_copies=0,
            temporaries=temps.norm_bytes,
        )
        b_top = _phase(
            P.BACKWARD,
            **base,
            gradients=max(g_resident, g_head),
            activations=kept_inputs + recompute + a_model_end + masks,
            autocast_copies=seg_layers * c_max_layer,
            temporaries=bwd_temp,
        )
        # Entering the first segment's backward: its layers' and the token table's grads are not there yet.
        segment_input = input_bytes
        b_bottom = _phase(
            P.BACKWARD,
            **base,
            gradients=max(g_resident, g_all - seg_layers * g_layer - g_late),
            activations=segment_input + recompute + a_model_end + masks,
            autocast_copies=seg_layers * c_max_layer,
            temporaries=bwd_temp,
        )
    candidates = [b_start, b_norm, b_top, b_bottom, b_embed]
    top = inv.layers[-1].kind
    in_attention: list[PhaseBreakdown] = []
    for vspec, kind, _layers, total, before in saved_by:
        if kind != top:
            continue
        attn_saved, attn_temp = eager_backward_moment(vspec, strategy)
        if attn_saved:
            # Inside the top layer's (and the bottom segment's top layer's) attention backward: that layer
            # holds what it saved before its softmax plus the softmax output, the rest of it is released.
            swap = before + attn_saved - per_layer[kind]
            candidates += [_attention_moment(b, swap, attn_temp) for b in (b_top, b_bottom)]
        chain_saved, chain_transient = eager_forward_moment(vspec, strategy)
        if not chain_saved:
            continue
        # A materialised score chain in the last layer can outweigh the loss computation.
        if n_segments == 0:
            # Every layer below has saved everything; the last one what it saves before the softmax.
            in_attention.append(
                _phase(
                    P.FORWARD,
                    **base,
                    gradients=g_resident,
                    activations=a_layers - total + before + chain_saved + a_model_end,
                    autocast_copies=c_all,
                    temporaries=chain_transient + masks + cache_held,
                )
            )
        else:
            # A checkpointed forward saves nothing: the chain and the attention's inputs are transient.
            in_attention.append(
                _phase(
                    P.FORWARD,
                    **base,
                    gradients=g_resident,
                    activations=kept + a_model_end + masks,
                    autocast_copies=c_fwd_ckpt + (0 if spec.autocast_weight_cache else c_max_layer),
                    temporaries=eager_nograd_inputs_bytes(vspec, strategy)
                    + chain_saved
                    + chain_transient
                    + _previous_probs(vspec, strategy),
                )
            )
    backward = max(candidates, key=lambda p: p.total_bytes)
    forward = max([forward, *in_attention], key=lambda p: p.total_bytes)
    step = _phase(P.OPTIMIZER_STEP, **base, gradients=g_all, temporaries=st.step_temp_bytes)
    phases = (forward, backward, step)
    peak = max(p.total_bytes for p in phases)

    p = st.params
    bpp = {
        "weights": st.per_param(st.weights_bytes),
        "gradients": st.per_param(st.grads_bytes),
        "master_weights": st.per_param(st.master_bytes),
        "optimizer_states": st.per_param(st.optimizer_bytes),
        "autocast_copies": st.per_param(st.autocast_copies_bytes),
    }
    tokens_layers = strategy.tokens_per_micro_batch * spec.hidden_size * L
    coeff = (a_layers if n_segments == 0 else kept_inputs) / tokens_layers
    terms = (
        Term(
            name="weights",
            bytes=st.weights_bytes,
            formula=f"Σ numel·{strategy.recipe.weight_bits // 8} B",
            source="parameter inventory (trainfit.arch.params)",
        ),
        Term(
            name="gradients",
            bytes=g_all,
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
            bytes=a_max_layer,
            formula="Σ saved tensors of one block",
            source="trainfit.analytic.activations (Korthikanti et al. 2022, Table 2, modernised)",
        ),
        Term(
            name="logits_loss (backward)",
            bytes=lg.backward_peak_bytes,
            formula="12·b·s·vocab",
            source="HF ForCausalLMLoss: logits.float() + cross_entropy",
        ),
        Term(
            name="autocast_copies",
            bytes=c_all,
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
    return MemoryReport(
        method=Method.ANALYTIC,
        model_name=spec.name,
        params=p,
        trainable_params=p,
        phases=phases,
        overhead=overhead_for(peak),
        bytes_per_param=bpp,
        terms=terms,
        notes=tuple(notes),
        extra={"activation_coefficient": round(coeff, 2), "activations_per_layer_bytes": a_max_layer},
    )


def _previous_probs(spec: ModelSpec, strategy: Strategy) -> int:
    """The previous block's returned attention probabilities, when the stack loop keeps them (HF Falcon)
    while the next block runs; without checkpointing they are saved anyway."""
    ch = score_chain(spec, strategy)
    if ch is None or not spec.eager_probs_outlive_layer or strategy.attention is not Attention.EAGER:
        return 0
    return ch.softmax_out * ch.scores


def _attention_moment(block: PhaseBreakdown, swap: int, temporaries: int) -> PhaseBreakdown:
    parts = dict(block.components)
    parts[C.ACTIVATIONS] = max(0, parts.get(C.ACTIVATIONS, 0) + swap)
    parts[C.TEMPORARIES] = temporaries
    return PhaseBreakdown(phase=block.phase, components=parts)


def _head_params(spec: ModelSpec) -> int:
    return spec.vocab_size * spec.hidden_size
