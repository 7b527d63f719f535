"""Activations saved for backward, tensor by tensor, for the Hugging Face implementations of modern
and classic blocks, as a CUDA run keeps them.

The reference point is Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", Table 2): per GPT-2-era layer with 16-bit activations and no recompute,
``s·b·h·(34 + 5·a·s/h)`` bytes. We depart from it wherever a real modern training run does:

* **Flash / memory-efficient SDPA** keeps q, k, v, the output and an fp32 logsumexp (b·heads·s),
  not the b·heads·s² scores and probabilities; the ``5·a·s/h`` term exists only where the scores are
  materialised: eager attention and SDPA's math kernel (``sdpa_kernel`` says which kernel a call gets).
* **GQA**: k and v are kv_heads wide (transformers passes ``enable_gqa`` to SDPA when it passes no
  mask — ``integrations/sdpa_attention.py``, ``use_gqa_in_sdpa`` — and repeats k/v when it does).
* **Autocast over fp32 weights** (``amp-*``): the residual stream stays fp32 (embedding and norms
  return fp32), and every ``Linear`` casts its fp32 input *separately* — autocast caches casts of leaf
  weights only (aten/src/ATen/autocast_mode.cpp, ``cached_cast``) — so q, k and v each save their own
  16-bit copy of the normed input, and gate/up do too.
* **A bitsandbytes base without autocast** (QLoRA under ``pure-*``): the 4-bit q/k/v return their fp32
  input's dtype, so the attention runs in fp32 — no FlashAttention, the math kernel with grouped k/v heads
  (:func:`attention_width`).
* **RMSNorm** (HF ``LlamaRMSNorm``) upcasts to fp32 and saves the fp32 input and the normed tensor;
  **LayerNorm** saves its input plus fp32 mean and rstd (``native_layer_norm``); under autocast
  ``layer_norm`` runs in fp32 (CUDA autocast fp32 list).
* **SwiGLU** saves gate, act(gate), up and the product (4 tensors of b·s·intermediate);
  a fused GeLU MLP saves fc1's output and the activation output (2 tensors); HF's Python
  ``gelu_new``/``gelu_fast`` (GPT-2, Phi-2, NeoX) save five, and under autocast ``pow`` runs in fp32.
* **Dropout** saves a 1-byte mask only when its probability is > 0 (``native_dropout``); SDPA's
  attention dropout keeps only an RNG seed.
* RoPE's cos/sin are computed once per forward and shared by every layer (counted once).
* MoE layers route ``b·s·top_k`` token copies through experts (transformers 5 ``grouped_mm`` experts,
  which have no autocast policy and run in the *weight* dtype — fp32 under ``amp-*``).

Everything is in bytes for one micro-batch; ``t = batch·seq`` tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from enum import StrEnum

from trainfit.analytic.adapters import (
    AdapterSaved,
    AdapterSite,
    BlindLayer,
    SiteInput,
    adapter_saved,
    adapter_sites,
    base_weight_width,
    finetuning,
    frozen_base,
    frozen_forms_known,
    frozen_layers,
    head_sites,
    layer_linears,
    moe_param_sites,
)
from trainfit.arch.params import inventory
from trainfit.arch.spec import MlpKind, ModelKind, ModelSpec, NormKind
from trainfit.cuda_facts import SdpaKernel, sdpa_kernel_for
from trainfit.errors import StrategyError
from trainfit.strategy import Adapter, AdapterKind, Attention, Checkpointing, Quantization, Strategy

#: HF activations implemented in Python (several saved intermediates) rather than one fused kernel.
PYTHON_GELUS = frozenset({"gelu_new", "gelu_fast", "gelu_python"})


class TermRole(StrEnum):
    """When a saved tensor is released, which is what the step's moments need to know about it."""

    BLOCK = "block"  # saved by a block; released by that block's backward
    MLP = "mlp"  # saved by a block's MLP; released by the MLP's backward, before the block's norms
    SOFTMAX_OUTPUT = "softmax-output"  # a block's attention softmax output: what it has saved when the softmax runs
    EMBEDDING = "embedding"  # saved by the embedding (ids, RoPE tables, embedding norm): lives to the end
    HEAD = "head"  # final norm / MLM head: released by the head's backward
    HEAD_INPUT = "head-input"  # the LM head's input: released first, before the final norm's backward


@dataclass(frozen=True, slots=True, kw_only=True)
class SavedTerm:
    name: str
    bytes: int
    formula: str
    role: TermRole = TermRole.BLOCK
    # The separate tensors that make up ``bytes`` when there are several (q, k and v; a dropout's mask and
    # output), as the allocator sees them (trainfit.analytic.events); empty: one tensor.
    pieces: tuple[int, ...] = ()
    # How many autograd saves reference this tensor (one storage, several ``SavedVariable``s): what a
    # ``saved_tensors_hooks`` pack sees, and copies once per save (--activation-offload: trainfit.analytic.savers).
    saves: int = 1

    def tensors(self) -> tuple[int, ...]:
        """The byte sizes of the tensors behind this term."""
        return self.pieces or (self.bytes,)


@dataclass(frozen=True, slots=True, kw_only=True)
class Widths:
    """Byte widths under a recipe: residual stream, matmul compute, and whether autocast casts inputs."""

    residual: int
    compute: int
    amp: bool

    @classmethod
    def of(cls, strategy: Strategy) -> Widths:
        r = strategy.recipe
        return cls(residual=residual_bits(strategy) // 8, compute=r.compute_bits // 8, amp=r.autocast)


def residual_bits(strategy: Strategy) -> int:
    """The residual stream's width: the embedding table's dtype. Under an adapter the frozen base may be
    stored in ``BaseWeights.dtype``, and ``prepare_model_for_kbit_training`` casts the embeddings to fp32."""
    r = strategy.recipe
    if strategy.adapter is None:
        return r.weight_bits
    base = strategy.base_weights
    if base.kbit_prepared:
        return 32
    return base.dtype.bits if base.dtype is not None else r.weight_bits


def _norm_terms(
    name: str, t: int, h: int, spec: ModelSpec, w: Widths, *, input_saved: bool = True, frozen: bool = False
) -> list[SavedTerm]:
    """Saved tensors of one norm over the residual stream (input width = residual). A ``frozen`` weight does
    not make ``weight * normed`` keep ``normed`` (only the gradient of ``normed`` is computed)."""
    r = w.residual
    if spec.norm is NormKind.RMSNORM and spec.norm_unit_offset:
        # Gemma: fp32 x·rsqrt, times (1 + w.float()) — both fp32 factors saved — then cast back.
        out = [
            SavedTerm(name=f"{name}.rsqrt", bytes=4 * t, formula="4·t", saves=2),
            SavedTerm(name=f"{name}.normed_fp32", bytes=0 if frozen else 4 * t * h, formula="4·t·h"),
            SavedTerm(name=f"{name}.one_plus_w", bytes=4 * h, formula="4·h"),
        ]
        if input_saved:
            out.append(SavedTerm(name=f"{name}.input_fp32", bytes=4 * t * h, formula="4·t·h", saves=2))
        return out
    if spec.norm is NormKind.RMSNORM:
        # HF LlamaRMSNorm: x.to(fp32) saved by pow/mul; rsqrt (t fp32); weight * normed.to(input_dtype).
        # ``pow(2)`` and ``x * rsqrt`` both save the fp32 input; ``rsqrt`` and the same mul both save rsqrt.
        out = [SavedTerm(name=f"{name}.rsqrt", bytes=4 * t, formula="4·t", saves=2)]
        if input_saved:
            out.append(SavedTerm(name=f"{name}.input_fp32", bytes=4 * t * h, formula="4·t·h", saves=2))
        if not frozen:
            out.append(SavedTerm(name=f"{name}.normed", bytes=r * t * h, formula=f"{r}·t·h"))
        return out
    # native_layer_norm saves input (+ weight/bias) and fp32 mean/rstd.
    out = [SavedTerm(name=f"{name}.mean_rstd", bytes=8 * t, formula="8·t")]
    if w.amp and r < 4:
        # A 16-bit residual (an adapter's 16-bit base under autocast): layer_norm is on CUDA autocast's fp32 list,
        # so each call casts its input — a new fp32 copy per norm, which it saves — and its weight and bias
        # (fp32-list casts are not cached: aten/src/ATen/autocast_mode.h ``cached_cast`` caches only casts to
        # the lower precision). Checked against the trace of NeoX/GPT-2/Phi-2 LoRA (tests/trace/test_peft.py).
        n_affine = 2 if spec.norm_bias else 1
        out.append(SavedTerm(name=f"{name}.input_fp32", bytes=4 * t * h, formula="4·t·h (autocast cast)"))
        out.append(
            SavedTerm(
                name=f"{name}.affine_fp32",
                bytes=n_affine * 4 * h,
                formula=f"{n_affine} × 4·h",
                pieces=(4 * h,) * n_affine,
            )
        )
    elif input_saved:
        out.append(SavedTerm(name=f"{name}.input", bytes=r * t * h, formula=f"{r}·t·h"))
    return out


def _norm_out_width(spec: ModelSpec, w: Widths) -> int:
    """dtype width of a norm's output: LayerNorm runs in fp32 under autocast; RMSNorm returns the input dtype."""
    if spec.norm is NormKind.LAYERNORM and w.amp:
        return 4
    return w.residual


def norm_out_width(spec: ModelSpec, w: Widths) -> int:
    """The final norm's output width (what an LM head or a fused loss reads)."""
    return _norm_out_width(spec, w)


def _matmul_inputs(name: str, t: int, width: int, n_consumers: int, in_bytes: int, w: Widths) -> SavedTerm:
    """Inputs saved by the matmuls that read one tensor. Under autocast an fp32 input is cast once per
    matmul (activation casts are not cached); otherwise all matmuls save the same tensor."""
    if w.amp and in_bytes == 4:
        return SavedTerm(
            name=f"{name}.casts",
            bytes=n_consumers * w.compute * t * width,
            formula=f"{n_consumers}·{w.compute}·t·w",
        )
    return SavedTerm(
        name=f"{name}.input", bytes=in_bytes * t * width, formula=f"{in_bytes}·t·w", saves=max(1, n_consumers)
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class EagerChain:
    """Byte widths along eager attention's score chain (HF ``eager_attention_forward``), per score element,
    as a CUDA run allocates them; ``scores`` = b·heads·s² elements.

    ``scores = q·kᵀ·scale`` (compute dtype a) [→ Gemma-2 soft-cap: /c, tanh (saved), ·c] → ``+ mask``
    (type promotion to the mask's dtype, which is the embeddings' — fp32 under autocast) → softmax →
    probabilities in the compute dtype → ``probs·v``. Most HF models call ``softmax(x, dtype=float32)``;
    CUDA autocast gives GPT-2's and BERT's plain ``softmax`` an fp32 output too (``fp32_set_opt_dtype``).
    ATen's ``softmax`` (aten/src/ATen/native/SoftMax.cpp) converts a 16-bit input to fp32 *first* — a
    full-size copy — except for an fp16 input on CUDA, which takes the fused ``half_to_float`` kernel.
    """

    scores: int
    softmax_in: int  # p: the softmax input (scores promoted by the additive mask)
    input_copy: int  # c: the fp32 copy of a 16-bit softmax input (0 when not needed or fused)
    softmax_out: int  # o: the softmax output (saved by its backward)
    probs: int  # a when the probabilities are a separate, lower-precision tensor (saved by probs·v), else 0
    grad_in: int  # the softmax backward's output (the input's dtype when fused, else o)
    input_held: bool  # the softmax input is still referenced while the probabilities are cast
    dropout: int  # 0 without attention dropout, else the width of the tensor it drops (probs or output)


def eager_chain(spec: ModelSpec, strategy: Strategy) -> EagerChain:
    w = Widths.of(strategy)
    a = w.compute
    p = max(a, w.residual) if spec.attention_masks else a
    upcast = spec.softmax_upcast or w.amp
    o = 4 if upcast else p
    fused = o == 4 and p == 2 and strategy.recipe.compute_dtype == "fp16"
    # ``softmax(x, dtype=float32).to(query.dtype)`` is one expression: x stays referenced during the cast
    # unless the query is fp32 (RoPE'd under autocast: cos/sin are fp32), when ``.to`` is a no-op and the
    # cast happens inside the probs·v matmul, after x is released. GPT-2/BERT reassign before casting.
    q_width = w.residual if spec.rotary_dim else a
    # The code's own cast (to q's dtype, or GPT-2's to v's) is a no-op when that dtype is already o's;
    # the probs·v matmul's autocast then makes the 16-bit copy, after dropout.
    casts = spec.eager_casts_probs and q_width != o
    return EagerChain(
        scores=strategy.micro_batch * spec.num_heads * strategy.seq_len**2,
        softmax_in=p,
        input_copy=4 if o == 4 and p != 4 and not fused else 0,
        softmax_out=o,
        probs=a if o != a else 0,
        grad_in=p if fused else o,
        input_held=spec.softmax_upcast and q_width != 4,
        dropout=(a if casts else o) if spec.attention_dropout > 0 else 0,
    )


def score_chain(spec: ModelSpec, strategy: Strategy) -> EagerChain | None:
    """The materialised b·heads·s² score chain, if the attention has one: eager attention's, or SDPA's math
    kernel, which runs the whole chain in fp32 (16-bit inputs are upcast first) and keeps no separate
    probabilities. ``None`` for the flash and memory-efficient kernels."""
    if strategy.attention is Attention.EAGER:
        return eager_chain(spec, strategy)
    if sdpa_kernel(spec, strategy) != MATH:
        return None
    return EagerChain(
        scores=strategy.micro_batch * spec.num_heads * strategy.seq_len**2,
        softmax_in=4,
        input_copy=0,
        softmax_out=4,
        probs=0,
        grad_in=4,
        input_held=False,
        dropout=4 if spec.attention_dropout > 0 else 0,
    )


#: Kernel names as the analytic model uses them (the one enum lives in trainfit.cuda_facts).
FLASH, EFFICIENT, MATH = SdpaKernel.FLASH, SdpaKernel.EFFICIENT, SdpaKernel.MATH


def effective_strategy(spec: ModelSpec, strategy: Strategy) -> tuple[Strategy, str | None]:
    """The strategy a real run would use, and why it differs: transformers refuses SDPA for some models
    (Gemma-2), which then run eager attention. The one place this fallback is decided."""
    if strategy.attention is Attention.SDPA and not spec.supports_sdpa:
        why = f"{spec.name} ({spec.model_type}) has no SDPA attention in transformers; estimating eager attention"
        return dataclasses.replace(strategy, attention=Attention.EAGER), why
    return strategy, None


def sdpa_window_mask(spec: ModelSpec, strategy: Strategy) -> bool:
    """SDPA with a sliding window gets a real mask once the sequence reaches the window: transformers skips
    the mask (``is_causal``) only while ``kv_length < sliding_window`` (``_ignore_causal_mask_sdpa`` in
    masking_utils.py)."""
    return (
        strategy.attention is Attention.SDPA
        and spec.sliding_window is not None
        and spec.sliding_layers > 0
        and strategy.seq_len >= spec.sliding_window
    )


def attention_variants(spec: ModelSpec, strategy: Strategy) -> list[tuple[ModelSpec, int]]:
    """(the spec as one kind of layer sees its attention, number of such layers). A stack in which some but
    not all layers slide (Qwen2 with ``use_sliding_window``), at a sequence that reaches the window, makes
    two SDPA calls — the sliding layers with a mask, the others with none — that may get different kernels."""
    if not sdpa_window_mask(spec, strategy) or spec.sliding_layers >= spec.num_layers:
        return [(spec, spec.num_layers)]
    full = dataclasses.replace(spec, sliding_layers=0)
    return [(spec, spec.sliding_layers), (full, spec.num_layers - spec.sliding_layers)]


def _sdpa_masked(spec: ModelSpec, strategy: Strategy) -> bool:
    return spec.sdpa_mask_always or sdpa_window_mask(spec, strategy)


def sdpa_kv_heads(spec: ModelSpec, strategy: Strategy) -> int:
    """k/v heads as SDPA receives them: transformers' integration passes ``enable_gqa`` without a mask and
    repeats k/v to every head with one (``use_gqa_in_sdpa``); Falcon's new architecture expands them itself."""
    if spec.sdpa_kv_expanded or (spec.sdpa_gqa and _sdpa_masked(spec, strategy)):
        return spec.num_heads
    return spec.num_kv_heads


def _attention_head_dims(spec: ModelSpec) -> tuple[int, int]:
    """(q/k head dim, v head dim) as the attention kernel sees them (MLA's differ)."""
    if spec.mla is not None:
        return spec.mla.qk_head_dim, spec.mla.v_head_dim
    return spec.head_dim, spec.head_dim


def repeat_kv_copies(spec: ModelSpec) -> bool:
    """Whether transformers' ``repeat_kv`` (``expand`` then ``reshape`` to every head) makes new k and v: with
    a single k/v head (multi-query: Falcon-7B, Gemma-2B) the reshape folds the size-1 head dim into a stride-0
    view, and what the kernel saves is the un-repeated k and v (found by the trace: ``ReshapeAliasBackward0``
    over the fused qkv output, transformers 5.25 Falcon)."""
    return 1 < spec.num_kv_heads < spec.num_heads


def sdpa_kernel(spec: ModelSpec, strategy: Strategy) -> SdpaKernel:
    """The CUDA kernel SDPA picks (``select_sdp_backend`` on sm80+, default priority flash > memory-efficient
    > math; mirrored by ``trainfit.trace.kernels.sdpa_backend``). Flash needs 16-bit inputs, no mask, equal
    q/v head dims ≤ 256, and equal head counts unless ``enable_gqa``; the memory-efficient kernel takes masks
    and fp32 but never fewer k/v heads. So GQA models trained in fp32, and multi-query Falcon, get the math
    kernel, which materialises the b·heads·s² scores."""
    masked = _sdpa_masked(spec, strategy)
    d, dv = _attention_head_dims(spec)
    return sdpa_kernel_for(
        half=attention_width(strategy, Widths.of(strategy)) == 2,
        masked=masked,
        same_heads=sdpa_kv_heads(spec, strategy) == spec.num_heads,
        gqa_ok=spec.sdpa_gqa and not masked,
        head_dim=d,
        v_head_dim=dv,
        flash_capable=strategy.flash_sdp,
    )


def sdpa_bias_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """Per masked layer, for the memory-efficient kernel: SDPA converts the bool mask to an additive one in
    the query dtype (``convert_boolean_attn_mask``), padded to a multiple of 16 columns, and the kernel saves
    it for backward — a new [b, 1, s, s] tensor in every layer."""
    if strategy.attention is not Attention.SDPA or not _sdpa_masked(spec, strategy):
        return 0
    if sdpa_kernel(spec, strategy) != EFFICIENT:
        return 0
    s = strategy.seq_len
    return attention_width(strategy, Widths.of(strategy)) * strategy.micro_batch * s * (-(-s // 16) * 16)


def attention_mask_bytes(spec: ModelSpec, strategy: Strategy) -> list[int]:
    """The additive [b, 1, s, s] masks transformers materialises for eager attention, in the embeddings'
    dtype (``masking_utils``: ``torch.where`` over a bool mask); SDPA without padding gets ``is_causal`` and
    no mask. They live as long as the decoder's forward, and — as inputs of every checkpointed layer — until
    the first layer's recomputation when checkpointing."""
    if strategy.attention is Attention.SDPA and _sdpa_masked(spec, strategy):
        # SDPA gets a bool mask, built once and broadcast over the batch (masking_utils' sdpa_mask).
        return [strategy.seq_len**2]
    if strategy.attention is not Attention.EAGER:
        return []
    one = strategy.micro_batch * strategy.seq_len**2 * Widths.of(strategy).residual
    return [one] * spec.attention_masks


def _attention_terms(spec: ModelSpec, strategy: Strategy, t: int, w: Widths) -> list[SavedTerm]:
    a = attention_width(strategy, w)
    b, s = strategy.micro_batch, strategy.seq_len
    nh = spec.num_heads
    out: list[SavedTerm] = []
    if spec.mla is not None:
        m = spec.mla
        qd, kd, vd = nh * m.qk_head_dim, nh * m.qk_head_dim, nh * m.v_head_dim
        # q_a/kv_a latents: normed (RMSNorm) low-rank tensors feeding q_b / kv_b.
        lat = (m.q_lora_rank or 0) + m.kv_lora_rank
        out.append(SavedTerm(name="attn.latents", bytes=(4 + a + a) * t * lat, formula="(4+2a)·t·(q_lora+kv_lora)"))
        out.append(
            SavedTerm(
                name="attn.kv_b_out",
                bytes=a * t * nh * (m.qk_nope_head_dim + m.v_head_dim),
                formula="a·t·heads·(nope+v)",
            )
        )
    else:
        qd, kd = spec.q_dim, spec.kv_dim
        vd = kd
    out_width = nh * spec.mla.v_head_dim if spec.mla is not None else qd
    if spec.qk_norm:
        # Per-head RMSNorm: fp32 input + normed + one fp32 rsqrt per head and token.
        qk_norm_bytes = (4 + a) * t * (qd + kd) + 4 * t * (nh + spec.num_kv_heads)
        out.append(
            SavedTerm(
                name="attn.qk_norm",
                bytes=qk_norm_bytes,
                formula="(4+a)·t·(q_dim+kv_dim) + 4·t·(heads+kv_heads)",
            )
        )
    if strategy.attention is Attention.SDPA:
        kernel = sdpa_kernel(spec, strategy)
        if spec.mla is None and sdpa_kv_heads(spec, strategy) != spec.num_kv_heads and repeat_kv_copies(spec):
            # k and v reach SDPA expanded to every head (repeat_kv when a mask rules out enable_gqa).
            kd = vd = nh * spec.head_dim
        if kernel == MATH:
            # aten's _scaled_dot_product_attention_math: fp32 copies of 16-bit inputs, q and k scaled, the
            # fp32 softmax output saved; output cast back.
            # k and v reach every head: repeat_interleave under enable_gqa; otherwise the matmuls broadcast
            # them, which copies unless the batch is 1 (a size-1 batch folds into a stride-0 view).
            heads = sdpa_kv_heads(spec, strategy)
            if spec.sdpa_gqa or b > 1:
                heads = nh
            d, dv = _attention_head_dims(spec)
            full, full_v = heads * d, heads * dv
            out.append(
                SavedTerm(
                    name="attn.sdpa_math.qkv",
                    bytes=4 * t * (qd + full + full_v),
                    formula="4·t·(q_dim+2·heads·hd)",
                    pieces=(4 * t * qd, 4 * t * full, 4 * t * full_v),
                )
            )
            out.append(
                SavedTerm(
                    name="attn.softmax",
                    bytes=4 * b * nh * s * s,
                    formula="4·b·heads·s² (fp32 output)",
                    role=TermRole.SOFTMAX_OUTPUT,
                )
            )
            if spec.attention_dropout > 0:
                # at::dropout on CUDA: fused native_dropout, a bool mask and the fp32 dropped probabilities.
                out.append(
                    SavedTerm(
                        name="attn.sdpa_math.dropout",
                        bytes=5 * b * nh * s * s,
                        formula="(1+4)·b·heads·s²",
                        pieces=(b * nh * s * s, 4 * b * nh * s * s),
                    )
                )
            out.append(
                SavedTerm(name="attn.sdpa.out", bytes=a * t * out_width, formula="a·t·heads·v_head_dim", saves=2)
            )
            return out
        out.append(_sdpa_inputs(spec, strategy, t, a, qd, kd, vd))
        if bias := sdpa_bias_bytes(spec, strategy):
            out.append(SavedTerm(name="attn.sdpa.bias", bytes=bias, formula="a·b·s·⌈s/16⌉·16 (masked layers)"))
        out.append(SavedTerm(name="attn.sdpa.out", bytes=a * t * out_width, formula="a·t·heads·v_head_dim", saves=2))
        out.append(SavedTerm(name="attn.sdpa.lse", bytes=4 * b * nh * s, formula="4·b·heads·s"))
        return out
    # Eager (modeling_*.eager_attention_forward): repeat_kv copies, the softmax output, the probabilities.
    kv_rep = nh * (kd // spec.num_kv_heads) if spec.num_kv_heads else kd
    ch = eager_chain(spec, strategy)
    scores = ch.scores
    if spec.num_kv_heads == nh and strategy.micro_batch == 1:
        # No repeat_kv copies and a batch of one: matmul's reshape to 3-D keeps views of a fused qkv output
        # as views, so the matmuls save q, k and v as SDPA does (views keep the whole fused output; the KV
        # cache's copies replace k and v). With a larger batch the head-interleaved views cannot fold
        # (b, heads) into one dim and are copied — a·t per head dim either way, the fused output freed.
        qkv = _sdpa_inputs(spec, strategy, t, a, qd, kd, vd)
        out.append(SavedTerm(name="attn.eager.q_k_v", bytes=qkv.bytes, formula=qkv.formula))
    else:
        out.append(
            SavedTerm(
                name="attn.eager.q_k_v",
                bytes=a * t * (qd + kv_rep + kv_rep),
                formula="a·t·(q_dim+2·heads·hd)",
                pieces=(a * t * qd, a * t * kv_rep, a * t * kv_rep),
            )
        )
    if spec.attn_logit_softcapping:
        out.append(SavedTerm(name="attn.eager.softcap_tanh", bytes=a * scores, formula="a·b·heads·s² (tanh out)"))
    out.append(
        SavedTerm(
            name="attn.softmax",
            bytes=ch.softmax_out * scores,
            formula=f"{ch.softmax_out}·b·heads·s² (output)",
            role=TermRole.SOFTMAX_OUTPUT,
        )
    )
    if spec.attention_dropout > 0:
        out.append(
            SavedTerm(
                name="attn.eager.dropout",
                bytes=(1 + a) * scores,
                formula="(1+a)·b·heads·s²",
                pieces=(scores, a * scores),
            )
        )
    elif ch.probs:
        out.append(SavedTerm(name="attn.eager.probs", bytes=ch.probs * scores, formula="a·b·heads·s²"))
    out.append(SavedTerm(name="attn.eager.out", bytes=a * t * qd, formula="a·t·q_dim"))
    return out


def _kv_cache_active(spec: ModelSpec, strategy: Strategy) -> bool:
    """HF builds a DynamicCache in training when ``config.use_cache`` is true, and its ``update``
    concatenates k and v into new tensors; gradient checkpointing turns the cache off."""
    decoder = spec.kind is not ModelKind.MASKED_LM and spec.model_type != "bert"  # any decoder head builds it
    return spec.use_cache and decoder and strategy.checkpoint_segments(spec.num_layers) == 0


def kv_cache_held_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """Per layer, the bytes of :func:`kv_cache_held_tensors`."""
    return sum(kv_cache_held_tensors(spec, strategy))


def kv_cache_held_tensors(spec: ModelSpec, strategy: Strategy) -> tuple[int, ...]:
    """Per layer, the KV cache's copies of k and v that no backward saves, held until the model's outputs
    are dropped (the end of the forward). The cache ``torch.cat``s k after RoPE — whose dtype is promoted to
    the residual stream's by cos/sin, fp32 under autocast — and v. The attention kernel saves a copy itself
    when it needs a cast (autocast), repeat_kv's expansion (eager with GQA, or SDPA given a mask, which
    loses ``enable_gqa``) or the math kernel's scaled/upcast copies; then the cache's copy is extra. None without
    the cache (MLA: :func:`_mla_cache_held_tensors`); for a fused qkv (k and v views of one output that SDPA keeps),
    none unless a bitsandbytes qkv returns its input's dtype (``Linear4bit.forward``: ``.to(inp_dtype)``, fp32 over
    QLoRA's fp32 residual): under autocast SDPA then saves its own 16-bit copies and the cache's fp32 k and v are
    extra."""
    if not _kv_cache_active(spec, strategy):
        return ()
    if spec.mla is not None:
        return _mla_cache_held_tensors(spec, strategy)
    if strategy.checkpointing is Checkpointing.SELECTIVE:
        # The checkpointed attention core gets the cache's k and v (``cache.update`` returns its ``torch.cat``
        # copies) and saves them as its inputs (:func:`_core_inputs`): nothing extra (found by the trace).
        return ()
    w = Widths.of(strategy)
    t = strategy.tokens_per_micro_batch
    kd = spec.kv_dim
    if spec.fused_qkv:
        quantised = strategy.base_weights.quantization is not Quantization.NONE
        width = frozen_base_mlp_width(strategy, w)
        if not (quantised and w.amp and width != w.compute):
            # RoPE promotes k to cos/sin's dtype, the residual's: over an fp32 residual under autocast (full
            # fine-tuning's fp32 weights) the cache keeps that fp32 k while SDPA saves its own 16-bit cast (NeoX,
            # found by the trace); the math kernel's copies are its own case
            a = attention_width(strategy, w)
            k_width = max(a, w.residual) if spec.rotary_dim else a
            extra = k_width != a and strategy.attention is Attention.SDPA and sdpa_kernel(spec, strategy) != MATH
            return (k_width * t * kd,) if extra else ()
        return ((max(width, w.residual) if spec.rotary_dim else width) * t * kd, width * t * kd)
    a = attention_width(strategy, w)
    k_width = max(a, w.residual) if spec.rotary_dim else a
    gqa = spec.num_kv_heads < spec.num_heads
    if strategy.attention is Attention.EAGER:
        repeated, math = gqa, False
    else:
        repeated = sdpa_kv_heads(spec, strategy) != spec.num_kv_heads and repeat_kv_copies(spec)
        math = sdpa_kernel(spec, strategy) == MATH
    # The math kernel saves scaled (new) k and fp32 or broadcast v; the others save what they are given.
    k_extra = k_width * t * kd if (repeated or math or k_width != a) else 0
    v_extra = a * t * kd if (repeated or (math and (gqa or a != 4))) else 0
    if strategy.base_weights.quantization is not Quantization.NONE:
        # A bitsandbytes v_proj returns its input's dtype (fp32 over QLoRA's fp32 residual stream): the cache
        # keeps that v while the attention kernel saves its own autocast copy (without autocast, that v itself).
        v_width = frozen_base_mlp_width(strategy, w)
        if v_width != a:
            v_extra = v_width * t * kd
    return tuple(x for x in (k_extra, v_extra) if x)


def dead_layer_cache_tensors(spec: ModelSpec, strategy: Strategy) -> tuple[int, ...]:
    """``--freeze``: what the KV cache holds for each dead layer (adapters.FrozenLayers: frozen, below every gradient,
    so its attention saves nothing) — its own ``torch.cat`` copies of k (after RoPE, promoted to the residual's dtype
    by cos/sin) and v, to the forward's end, where a live layer's kernel saves them and the cache adds only
    :func:`kv_cache_held_tensors` (a fused projection's k and v are views, the cache's copies new tensors all the
    same). Not for MLA (its cache holds other tensors). Found by the trace: a tiny Llama over 4 FSDP2 ranks with three
    dead layers, forward −1.4% without them."""
    fz = frozen_layers(spec, strategy)
    if fz is None or not fz.dead or not _kv_cache_active(spec, strategy) or spec.mla is not None:
        return ()
    w = Widths.of(strategy)
    t = strategy.tokens_per_micro_batch
    a = attention_width(strategy, w)
    k_width = max(a, w.residual) if spec.rotary_dim else a
    return (k_width * t * spec.kv_dim, a * t * spec.kv_dim)


def first_layer_cache_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """What the first layer's KV cache holds beyond :func:`kv_cache_held_bytes` when that layer's attention saves
    nothing (a first layer whose input needs no gradient and whose q/k/v carry no adapter:
    :class:`~trainfit.analytic.adapters.BlindLayer`): the cache's k (after RoPE, promoted to the residual's dtype by
    cos/sin) and v — its own ``torch.cat`` copies, a fused projection's views included — which no kernel saves, to
    the forward's end; MLA's cache holds k_rot and the normed latent. Found by the trace (tests/trace/test_peft.py)."""
    if strategy.adapter is None or not _kv_cache_active(spec, strategy) or not frozen_base(strategy):
        return 0
    if input_grads_enabled(strategy) or BlindLayer.of(spec, strategy.adapter).attention:
        return 0
    w = Widths.of(strategy)
    t = strategy.tokens_per_micro_batch
    out = frozen_base_mlp_width(strategy, w)  # a frozen projection's output: autocast's, or a bitsandbytes input's
    if spec.mla is not None:
        m = spec.mla
        full = max(out, w.residual) * t * m.qk_rope_head_dim + w.residual * t * m.kv_lora_rank
    else:
        k_width = max(out, w.residual) if spec.rotary_dim else out
        full = (k_width + out) * t * spec.kv_dim
    return full - kv_cache_held_bytes(spec, strategy)


def _mla_cache_held_tensors(spec: ModelSpec, strategy: Strategy) -> tuple[int, ...]:
    """MLA's DynamicCache (modeling_deepseek_v3.py ``DeepseekV3Attention.forward``: ``cache.update(kv_nope, k_rot)``
    before ``expand_kv``) ``torch.cat``s the normed latent kv_nope (the residual's width: ``DeepseekV3RMSNorm``
    returns ``weight * x.to(input_dtype)``) and the RoPE'd shared key k_rot (kv_a's output promoted by cos/sin,
    which carry the residual's dtype) into new tensors, and ``expand_kv`` reads those. k_rot's copy is saved by
    nothing (``key_states[...].copy_(k_rot)`` needs no input in backward); kv_nope's is kv_b_proj's input, kept
    by an LLM.int8 kv_b_proj (``MatMul8bitLt`` ctx, in place of the norm's output) or by its adapter when that reads
    it uncast (:func:`trainfit.analytic.adapters.adapter_saved`). Both held until the forward's outputs are
    dropped (found by the trace). Modelled under a frozen base (adapters); full fine-tuning: 0 (not modelled)."""
    if not frozen_base(strategy) or strategy.adapter is None:
        return ()
    assert spec.mla is not None
    w = Widths.of(strategy)
    t = strategy.tokens_per_micro_batch
    m = spec.mla
    k_rot = max(frozen_base_mlp_width(strategy, w), w.residual) * t * m.qk_rope_head_dim
    kept = strategy.base_weights.quantization is Quantization.INT8
    if not kept:
        saved = adapter_saved(
            adapter_sites(spec, strategy.adapter),
            strategy.adapter,
            tokens=t,
            input_width=site_widths(spec, strategy, w),
            amp=w.amp,
            compute=w.compute,
            quantised=strategy.base_weights.quantization is not Quantization.NONE,
        )
        kept = any(x.reads is SiteInput.KV_LATENT for x in saved)
    return (k_rot,) if kept else (k_rot, w.residual * t * m.kv_lora_rank)


def _sdpa_inputs(spec: ModelSpec, strategy: Strategy, t: int, a: int, qd: int, kd: int, vd: int) -> SavedTerm:
    """q, k, v as SDPA saves them. Separate projections (or RoPE'd q and k) are new tensors of their
    own size. With a fused qkv matmul, any of q/k/v that reaches SDPA as a *view* keeps the whole fused
    output alive; the KV cache's ``torch.cat`` replaces k and v by copies (GPT-2: q stays a view, so the
    fused output and the two copies are all saved)."""
    cache = _kv_cache_active(spec, strategy)
    plain = SavedTerm(
        name="attn.sdpa.qkv",
        bytes=a * t * (qd + kd + vd),
        formula="a·t·(q_dim+2·kv_dim)",
        pieces=(a * t * qd, a * t * kd, a * t * vd),
    )
    if spec.mla is not None:
        # MLA (modeling_deepseek_v3.py ``expand_kv``): q is ``cat(q_pass, q_rot)`` and k a ``new_empty`` filled by
        # ``copy_`` — new tensors — but v is a view of kv_b_proj's output, which ``attn.kv_b_out`` already counts.
        return SavedTerm(
            name="attn.sdpa.qkv",
            bytes=a * t * (qd + kd),
            formula="a·t·(q_dim+k_dim) (v: a view of kv_b's output)",
            pieces=(a * t * qd, a * t * kd),
        )
    if not spec.fused_qkv or spec.sdpa_kv_expanded:
        # (Falcon's new architecture copies k and v out of the fused output while expanding them.)
        return plain
    w = Widths.of(strategy)
    if (
        strategy.base_weights.quantization is not Quantization.NONE
        and w.amp
        and frozen_base_mlp_width(strategy, w) != a
    ):
        # A bitsandbytes qkv returns its input's dtype (fp32 over QLoRA's residual): autocast casts q, k and v
        # to new 16-bit tensors for SDPA, which saves those, not the fused output.
        return plain
    fused = a * t * (qd + kd + vd)
    if spec.rotary_dim:  # q, k rotated into new tensors; v is a view unless the cache copied it
        if cache:
            return plain
        return SavedTerm(
            name="attn.sdpa.qkv", bytes=a * t * (qd + kd) + fused, formula="a·t·(q_dim+kv_dim) + fused qkv (v view)"
        )
    if cache:
        return SavedTerm(
            name="attn.sdpa.qkv", bytes=fused + a * t * (kd + vd), formula="fused qkv (q view) + k, v cache copies"
        )
    return SavedTerm(name="attn.sdpa.qkv", bytes=fused, formula="fused qkv output (q, k, v views)")


def _frozen_swiglu(name: str, each: int, formula: str, blind: BlindLayer | None = None) -> list[SavedTerm]:
    """A SwiGLU whose down projection is frozen (it keeps no input, so the product is not saved): the gate, act and
    up outputs, ``each`` bytes apiece, three tensors. In a layer whose input needs no gradient (``blind``) each is
    kept only for an input that needs one (derivatives.yaml: ``silu`` keeps its input for the gate's gradient;
    ``mul`` keeps up for act's and act for up's): the gate and up when the gate needs a gradient, act when up does."""
    if blind is None:
        return [SavedTerm(name=name, bytes=3 * each, formula=formula, pieces=(each,) * 3)]
    n = 2 * blind.gate + blind.up
    kept = SavedTerm(
        name=name, bytes=n * each, formula=f"{n} of {formula} (input needs no gradient)", pieces=(each,) * n
    )
    return [kept] if n else []


def _act_terms(name: str, spec: ModelSpec, t: int, i: int, w: Widths) -> list[SavedTerm]:
    a = w.compute
    if spec.mlp is MlpKind.GATED:
        return [
            SavedTerm(
                name=f"{name}.swiglu",
                bytes=4 * a * t * i,
                formula="4·a·t·i (gate, act, up, product)",
                pieces=(a * t * i,) * 4,
            )
        ]
    if spec.activation in PYTHON_GELUS:
        if w.amp:
            # pow runs in fp32 under CUDA autocast: x32, tanh out, 1+tanh (fp32), 0.5·x (16-bit), fc2 cast.
            return [
                SavedTerm(
                    name=f"{name}.gelu_python",
                    bytes=(4 + 4 + 4 + a + a) * t * i,
                    formula="(12+2a)·t·i",
                    pieces=(4 * t * i,) * 3 + (a * t * i,) * 2,
                )
            ]
        return [SavedTerm(name=f"{name}.gelu_python", bytes=5 * a * t * i, formula="5·a·t·i", pieces=(a * t * i,) * 5)]
    if spec.activation == "relu":
        # ReLU's backward uses its output, which is also fc2's saved input: one tensor.
        return [SavedTerm(name=f"{name}.relu", bytes=a * t * i, formula="a·t·i (relu out)")]
    return [
        SavedTerm(
            name=f"{name}.act", bytes=2 * a * t * i, formula="2·a·t·i (fc1 out, act out)", pieces=(a * t * i,) * 2
        )
    ]


def _router_bytes(spec: ModelSpec, t: int, a: int) -> int:
    """Router bookkeeping saved for backward (transformers 5 MoE blocks): fp32 softmax over experts,
    int64 top-k indices and three int64 routing index arrays, the routing weights (fp32; Qwen-MoE
    casts them to the compute dtype), per-expert int32 counts; renormalising the top-k weights adds
    their fp32 sum and a clone."""
    assert spec.moe is not None
    m = spec.moe
    k, e = m.experts_per_token, m.num_experts
    weight_bytes = a if m.weights_in_compute_dtype else 4
    out = 4 * t * e + 4 * e + 32 * t * k + weight_bytes * t * k
    if m.norm_topk_prob:
        out += 4 * t + 4 * t * k
    return out


def _moe_terms(spec: ModelSpec, t: int, w: Widths, norm_bytes: int) -> list[SavedTerm]:
    """MoE block (transformers 5 ``*SparseMoeBlock``): the router, shared experts and shared-expert gate
    all read the normed input (one saved tensor, or one autocast cast each); routed experts process
    ``t·top_k`` gathered rows."""
    assert spec.moe is not None
    m, h, a = spec.moe, spec.hidden_size, w.compute
    routed = t * m.experts_per_token
    readers = 1 + (2 if m.num_shared_experts else 0) + (1 if m.shared_expert_gate else 0)
    out = [
        _matmul_inputs("mlp.moe_in", t, h, readers, norm_bytes, w),
        SavedTerm(name="mlp.router", bytes=_router_bytes(spec, t, a), formula="4·t·E + 4·E + 36·t·k (+renorm)"),
        # grouped_mm runs in the weight dtype (no autocast policy): fp32 experts under amp-*.
        SavedTerm(
            name="mlp.experts",
            bytes=w.residual * routed * (2 * h + 4 * m.expert_intermediate_size),
            formula="w·t·top_k·(2h + 4·moe_i), w = weight bytes",
        ),
    ]
    if spec.model_type in _FP32_ROUTERS and not w.amp and norm_bytes != 4:
        # DeepSeek's router linear runs on ``hidden_states.type(torch.float32)``: over a 16-bit normed input (no
        # autocast to cast it back) a new fp32 tensor, which the linear saves for its weight gradient (found by the
        # trace: DeepSeek-V2 pure-bf16, 4·t·h per MoE layer).
        out.append(SavedTerm(name="mlp.router_in", bytes=4 * t * h, formula="4·t·h (x.float())"))
    if m.num_shared_experts:
        si = m.num_shared_experts * m.shared_expert_intermediate_size
        out.append(
            SavedTerm(
                name="mlp.shared.swiglu", bytes=4 * a * t * si, formula="4·a·t·shared_i", pieces=(a * t * si,) * 4
            )
        )
    if m.shared_expert_gate:
        # sigmoid(gate(x)) * shared_out: saves the sigmoid output and the shared experts' output.
        out.append(SavedTerm(name="mlp.shared_gate", bytes=a * t * (h + 1), formula="a·t·(h+1)"))
    return out


#: Attention terms that are not the attention core's (selective recompute keeps them): MLA's latents and up-projection
#: output and the per-head q/k norms run before the attention interface; the core's output is o_proj's saved input
#: (for a fused SDPA kernel the same storage as the kernel's saved ``out``: HF's ``transpose(1, 2).contiguous()`` of
#: the kernel's b·s·heads·d output is a view).
_OUTSIDE_CORE = frozenset(
    {
        "attn.latents",
        "attn.q_a_layernorm",
        "attn.kv_a_layernorm",
        "attn.kv_b_out",
        "attn.qk_norm",
        "attn.sdpa.out",
        "attn.eager.out",
    }
)


def _is_core(term: SavedTerm) -> bool:
    """A saved tensor of the attention core: from the interface's q, k, v to its output (scores, softmax,
    dropout, probabilities, a fused kernel's logsumexp and q/k/v casts or repeat_kv copies, a padded bias)."""
    return term.name.startswith("attn.") and term.name not in _OUTSIDE_CORE


def _core_inputs(spec: ModelSpec, strategy: Strategy, t: int, w: Widths) -> SavedTerm:
    """What the selective checkpoint saves instead: the attention interface's q, k, v as they reach it — k and v
    not yet expanded to every head (repeat_kv is inside), q and k after RoPE, whose cos/sin carry the residual
    stream's dtype (fp32 under autocast: the interface's q and k are fp32 where the kernel would have saved
    16-bit casts; found by the trace)."""
    if spec.mla is not None:
        m, nh = spec.mla, spec.num_heads
        qd = kd = nh * m.qk_head_dim
        vd = nh * m.v_head_dim
    else:
        qd, kd, vd = spec.q_dim, spec.kv_dim, spec.kv_dim
    a = w.compute
    # RoPE's cos/sin promote q and k to the residual's dtype; DeepSeek-V2's complex rotation casts back
    # (modeling_deepseek_v2.py ``apply_rotary_emb``: ``.type_as(xq)``), V3's cos/sin interleave does not.
    promotes = bool(spec.rotary_dim or spec.mla is not None) and spec.model_type != "deepseek_v2"
    rope = w.residual if promotes else a
    if rope == a:
        base = _sdpa_inputs(spec, strategy, t, a, qd, kd, vd)  # the kernel's own inputs (views of a fused qkv)
        return SavedTerm(name="attn.core_inputs", bytes=base.bytes, formula=base.formula, pieces=base.pieces)
    qk = rope * t * (qd + kd)
    if spec.mla is not None:
        # MLA's v is a view of kv_b_proj's output (modeling_deepseek_v3.py ``expand_kv``), which ``attn.kv_b_out``
        # keeps outside the core (in kv_b's output width: fp32 from an LLM.int8/4-bit kv_b over an fp32 residual).
        return SavedTerm(name="attn.core_inputs", bytes=qk, formula="r·t·(q_dim+k_dim) (v: a view of kv_b's output)")
    if spec.fused_qkv and not spec.sdpa_kv_expanded and not _kv_cache_active(spec, strategy):
        v, vf = a * t * (qd + kd + vd), "fused qkv (v view)"
    elif strategy.base_weights.quantization is not Quantization.NONE:
        # a bitsandbytes v_proj returns its input's dtype (fp32 over QLoRA's fp32 residual): the checkpoint keeps it
        vw = frozen_base_mlp_width(strategy, w)
        v, vf = vw * t * vd, f"{vw}·t·kv_dim (bitsandbytes v)"
    else:
        v, vf = a * t * vd, "a·t·kv_dim"
    return SavedTerm(name="attn.core_inputs", bytes=qk + v, formula=f"r·t·(q_dim+kv_dim) + {vf}", pieces=(qk, v))


def layer_terms(
    spec: ModelSpec, strategy: Strategy, *, moe: bool = False, blind: BlindLayer | None = None
) -> list[SavedTerm]:
    """Saved activation tensors of one transformer layer. Under ``--checkpointing selective`` (Megatron's
    ``recompute_granularity="selective"``, ``core_attn``; Korthikanti et al. 2022 §5) the attention core is one
    non-reentrant checkpoint: its saved tensors are replaced by its inputs (:func:`_core_inputs`) and come back
    while the layer's backward runs (:func:`selective_recompute_bytes`) — unless none of them needs a gradient
    (``blind``, :func:`frozen_layer_terms`): then nothing is recorded for backward."""
    terms = frozen_layer_terms(spec, strategy, moe=moe, blind=blind) if blind else _layer_terms(spec, strategy, moe=moe)
    if strategy.checkpointing is not Checkpointing.SELECTIVE or not any(_is_core(x) for x in terms):
        return terms
    kept = [x for x in terms if not _is_core(x)]
    at = next((i for i, x in enumerate(terms) if _is_core(x)), len(kept))
    w = Widths.of(strategy)
    return [*kept[:at], _core_inputs(spec, strategy, strategy.tokens_per_micro_batch, w), *kept[at:]]


def selective_recompute_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """Selective recompute: while a layer's backward runs, its attention core is run again and saves what it
    saves without checkpointing (a fused SDPA kernel also its output, a new tensor this time) —
    Korthikanti et al. 2022 §5; the trace's ``torch.utils.checkpoint`` recomputation."""
    if strategy.checkpointing is not Checkpointing.SELECTIVE:
        return 0
    moe = spec.num_moe_layers > 0 and spec.num_dense_layers == 0
    terms = _layer_terms(spec, strategy, moe=moe)
    core = sum(x.bytes for x in terms if _is_core(x))
    if not any(x.name == "attn.sdpa.lse" for x in terms):
        return core
    # the kernel's output: from the attention's own terms, as a frozen layer's drops it (frozen_layer_terms)
    attn = _attention_terms(spec, strategy, strategy.tokens_per_micro_batch, Widths.of(strategy))
    return core + sum(x.bytes for x in attn if x.name == "attn.sdpa.out")


def selective_core_before_softmax_bytes(spec: ModelSpec, strategy: Strategy, *, moe: bool = False) -> int:
    """Selective recompute with a score chain (eager, SDPA's math kernel): what the attention core saves before
    its softmax output (q/k casts, repeat_kv copies, a soft-cap's tanh), alive around the chain's softmax in the
    forward and again in its recomputation's backward."""
    if strategy.checkpointing is not Checkpointing.SELECTIVE:
        return 0
    terms = _layer_terms(spec, strategy, moe=moe)
    cut = next((i for i, x in enumerate(terms) if x.role is TermRole.SOFTMAX_OUTPUT), 0)
    return sum(x.bytes for x in terms[:cut] if _is_core(x))


def selective_core_locals_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """Selective recompute's checkpointed forward with a score chain (eager, SDPA's math kernel): the attention
    function's own locals beyond its inputs, alive while the chain runs. The checkpoint's saved-tensor hooks drop
    what autograd would save (the casts autocast makes for the matmuls die with them), so what stays is what a
    Python name holds: ``repeat_kv``'s expanded k and v (eager attention with fewer k/v heads:
    transformers' ``eager_attention_forward``; SDPA's math kernel handed fewer k/v heads, whose ``enable_gqa``
    expansion is its own), k at RoPE's width. Found by the trace."""
    if strategy.checkpointing is not Checkpointing.SELECTIVE or spec.mla is not None:
        return 0
    if score_chain(spec, strategy) is None:
        return 0
    heads = spec.num_kv_heads if strategy.attention is Attention.EAGER else sdpa_kv_heads(spec, strategy)
    if heads == spec.num_heads or spec.sdpa_kv_expanded or not repeat_kv_copies(spec):
        return 0  # nothing repeated inside the core, or views of one k/v head
    w = Widths.of(strategy)
    a = attention_width(strategy, w)
    k_width = max(a, w.residual) if spec.rotary_dim else a
    return (k_width + a) * strategy.tokens_per_micro_batch * spec.num_heads * spec.head_dim


def check_sac(spec: ModelSpec, strategy: Strategy) -> None:
    """What ``--checkpointing sac`` is modelled for: dense decoder layers whose attention is one of SDPA's fused
    kernels, full fine-tuning. Elsewhere the save list holds ops trainfit does not follow yet (eager and the math
    kernel's ``bmm`` scores, MoE's ``grouped_mm`` and ``topk``, MLA's extra projections, adapters' matmuls)."""
    if strategy.checkpointing is not Checkpointing.SAC:
        return
    why = ""
    if spec.moe is not None or spec.num_moe_layers:
        why = "MoE layers"
    elif spec.mla is not None:
        why = "multi-head latent attention"
    elif finetuning(strategy):
        why = "adapters or frozen/quantised base weights"
    elif strategy.attention is not Attention.SDPA or sdpa_kernel(spec, strategy) == MATH:
        why = "attention outside SDPA's fused kernels (eager, or SDPA's math fallback)"
    if why:
        raise StrategyError(
            f"--checkpointing sac is modelled for dense layers with SDPA's fused attention; not for {why}: "
            "use --checkpointing full or selective"
        )


def _layer_linears(spec: ModelSpec) -> list[tuple[str, int, bool]]:
    """The layer's linear projections in forward order: (name, output width, has bias). HF runs the attention
    (q, k, v or the fused qkv, then o) before the MLP, also where both read one normed input."""
    h, i = spec.hidden_size, spec.intermediate_size
    out = (
        [("attn.qkv", spec.q_dim + 2 * spec.kv_dim, spec.qkv_bias)]
        if spec.fused_qkv
        else [(f"attn.{n}", spec.q_dim if n == "q" else spec.kv_dim, spec.qkv_bias) for n in "qkv"]
    )
    out.append(("attn.o", h, spec.out_bias))
    if spec.mlp is MlpKind.GATED:
        out += [("mlp.gate", i, spec.mlp_bias), ("mlp.up", i, spec.mlp_bias), ("mlp.down", h, spec.mlp_bias)]
    else:
        out += [("mlp.fc1", i, spec.mlp_bias), ("mlp.fc2", h, spec.mlp_bias)]
    return out


def _sac_linears(spec: ModelSpec) -> list[tuple[str, int, bool, bool]]:
    """The layer's linears with whether torchtitan's per-op SAC saves their output: (name, output width, has
    bias, saved). ``mm`` outputs alternate saved / recomputed by their count in the block's forward (the
    policy's ``mm_count`` key); ``addmm`` (a linear with a bias) is not counted and always saved."""
    out: list[tuple[str, int, bool, bool]] = []
    mm = 0
    for name, width, bias in _layer_linears(spec):
        if not bias:
            mm += 1
        out.append((name, width, bias, bias or mm % 2 == 1))
    return out


def sac_recomputed_linears(spec: ModelSpec) -> list[tuple[str, int, int]]:
    """The linears of one layer whose matmul torchtitan's per-op SAC runs again in backward (every second
    ``mm``; :func:`sac_saved_terms` keeps the others): (name, input width, output width). A linear reads the
    hidden size, except ``attn.o`` (the attention output, ``q_dim`` wide) and the MLP's last projection (the
    intermediate size)."""
    last_mlp = _layer_linears(spec)[-1][0]
    ins = {"attn.o": spec.q_dim, last_mlp: spec.intermediate_size}
    return [(n, ins.get(n, spec.hidden_size), w) for n, w, _b, saved in _sac_linears(spec) if not saved]


def sac_saved_terms(spec: ModelSpec, strategy: Strategy) -> list[SavedTerm]:
    """What torchtitan's per-op SAC keeps of one layer beyond its input, until that layer's backward
    (torchtitan/distributed/activation_checkpoint.py ``SelectiveAC._wrap_block``): the outputs of the ops in
    its save list — torch's ``get_default_op_list().compute_intensive_ops`` (``mm``, ``addmm``, ``bmm``, the
    fused SDPA kernels, …) — except every second ``mm`` of the block's forward (its count is kept per call;
    ``addmm``, a linear with a bias, is not counted and always saved). A fused SDPA kernel's saved outputs are
    its output and its fp32 logsumexp. Everything else is recomputed. Outputs are in the compute dtype."""
    if strategy.checkpointing is not Checkpointing.SAC:
        return []
    w = Widths.of(strategy)
    a, t = w.compute, strategy.tokens_per_micro_batch
    b, s = strategy.micro_batch, strategy.seq_len
    out: list[SavedTerm] = []
    for name, width, _bias, saved in _sac_linears(spec):
        if saved:
            out.append(SavedTerm(name=f"sac.{name}", bytes=a * t * width, formula=f"a·t·{name} width"))
    lse = s if sdpa_kernel(spec, strategy) == FLASH else -(-s // 32) * 32
    out.append(SavedTerm(name="sac.sdpa.out", bytes=a * t * spec.q_dim, formula="a·t·heads·head_dim"))
    out.append(SavedTerm(name="sac.sdpa.lse", bytes=4 * b * spec.num_heads * lse, formula="4·b·heads·s"))
    return out


def _layer_terms(spec: ModelSpec, strategy: Strategy, *, moe: bool = False) -> list[SavedTerm]:
    if frozen_base(strategy):
        return frozen_layer_terms(spec, strategy, moe=moe)
    w = Widths.of(strategy)
    t = strategy.tokens_per_micro_batch
    h, a = spec.hidden_size, w.compute
    nb = _norm_out_width(spec, w)
    terms = _norm_terms("norm1", t, h, spec, w)
    n_attn_in = 1 if spec.fused_qkv else 3
    if spec.mla is not None:
        n_attn_in = 2
    mlp_reads_norm1 = spec.parallel_attn and spec.norms_per_layer == 1
    if mlp_reads_norm1:
        n_attn_in += 1 if spec.mlp is MlpKind.DENSE else 2
    terms.append(_matmul_inputs("attn_in", t, h, n_attn_in, nb, w))
    terms += _attention_terms(spec, strategy, t, w)
    if spec.hidden_dropout > 0:
        terms.append(SavedTerm(name="dropout_masks", bytes=2 * t * h, formula="2 × 1·t·h (attention, MLP)"))
    if not mlp_reads_norm1:
        # NeoX parallel residual: the second norm reads the same x as the first (saved once).
        terms += _norm_terms("norm2", t, h, spec, w, input_saved=not spec.parallel_attn)
        if spec.norms_per_layer > 2:  # Gemma-2 post-attention / post-feed-forward norms
            for k in range(3, spec.norms_per_layer + 1):
                terms += _norm_terms(f"norm{k}", t, h, spec, w)
    mlp: list[SavedTerm] = []
    if moe:
        mlp += _moe_terms(spec, t, w, nb)
    else:
        i = spec.intermediate_size
        if not mlp_reads_norm1:
            n_mlp_in = 2 if spec.mlp is MlpKind.GATED else 1
            mlp.append(_matmul_inputs("mlp_in", t, h, n_mlp_in, nb, w))
        mlp += _act_terms("mlp", spec, t, i, w)
    del a
    return terms + [dataclasses.replace(x, role=TermRole.MLP) for x in mlp]


def attention_width(strategy: Strategy, w: Widths) -> int:
    """Bytes per element of q, k and v as they reach the attention kernel, and of its output: the compute dtype,
    except over a quantised base without autocast. A bitsandbytes q/k/v projection returns its *input's* dtype
    (bitsandbytes/nn/modules.py ``Linear4bit.forward``: ``matmul_4bit(x.to(compute_dtype), …).to(inp_dtype)``)
    and PEFT's LoRA sum keeps it (peft/tuners/lora/bnb.py ``Linear4bit.forward``: with autocast off the adapter
    output is cast to ``expected_dtype = result.dtype``), so over QLoRA's fp32 residual
    (``prepare_model_for_kbit_training``) a pure-16-bit recipe feeds SDPA fp32 q, k and v: no FlashAttention, the
    memory-efficient kernel only with equal head counts, else the math kernel (its b·heads·s² fp32 scores), and an
    fp32 attention output for o_proj. Under autocast SDPA casts them to the compute dtype (found by the trace:
    tests/trace/test_peft.py, QLoRA under pure-bf16 without checkpointing)."""
    if strategy.adapter is not None and strategy.base_weights.quantization is not Quantization.NONE and not w.amp:
        return frozen_base_mlp_width(strategy, w)
    return w.compute


def frozen_base_mlp_width(strategy: Strategy, w: Widths) -> int:
    """Width of a frozen MLP's intermediate tensors: the compute dtype, except that a bitsandbytes linear
    returns its *input's* dtype (``Linear4bit.forward``: ``out.to(inp_dtype)``), so a quantised base over an
    fp32 residual stream (after ``prepare_model_for_kbit_training``) runs its MLP in fp32."""
    if strategy.base_weights.quantization is not Quantization.NONE:
        return max(w.compute, w.residual) if w.amp else w.residual
    return w.compute


def frozen_layer_terms(
    spec: ModelSpec, strategy: Strategy, *, moe: bool = False, blind: BlindLayer | None = None
) -> list[SavedTerm]:
    """Saved tensors of one layer whose base weights are all frozen, with the adapters' own (module docstring
    of :mod:`trainfit.analytic.adapters`): norms keep no normed output, frozen linears keep no input, a
    SwiGLU keeps gate, act(gate) and up (not the product), a fused GeLU MLP keeps fc1's output; attention
    saves what it saves under full fine-tuning; the adapters add their inputs, masks and rank-r outputs.
    ``blind``: the layer's input needs no gradient (:class:`~trainfit.analytic.adapters.BlindLayer`): each part
    saves only where a tensor it reads needs one; a dropout over an input that needs none keeps no mask, nor DoRA's
    second base linear a weight copy."""
    w = Widths.of(strategy)
    t = strategy.tokens_per_micro_batch
    h, a = spec.hidden_size, w.compute
    nb = _norm_out_width(spec, w)
    # Without an adapter: a layer --freeze freezes whole, its input requiring grad (adapters.FrozenLayers).
    sites = adapter_sites(spec, strategy.adapter) if strategy.adapter is not None else ()
    mlp_w = frozen_base_mlp_width(strategy, w)
    widths = site_widths(spec, strategy, w)
    saved = (
        adapter_saved(
            sites,
            strategy.adapter,
            tokens=t,
            input_width=widths,
            amp=w.amp,
            compute=a,
            base_width=base_weight_width(strategy),
            quantised=strategy.base_weights.quantization is not Quantization.NONE,
        )
        if strategy.adapter is not None
        else []
    )
    if blind is not None:
        saved = [
            x
            for x, site in zip(saved, _site_of(saved, sites), strict=True)
            if site.reads in blind.live or not x.name.endswith((".dropout_mask", ".dora_weight"))
        ]
    # Whether each input of the layer's linears needs a gradient (all do, but in a blind layer).
    live = set(SiteInput) if blind is None else set(blind.live)
    # A shared input is saved once; the attention output is already saved by SDPA, ReLU's output by ReLU. SDPA's
    # math kernel (Falcon's masked multi-query attention) saves its inputs and probabilities, not its output.
    math = strategy.attention is Attention.SDPA and sdpa_kernel(spec, strategy) == MATH
    int8 = strategy.base_weights.quantization is Quantization.INT8
    # --checkpointing selective: the fused kernel runs inside the core's checkpoint, whose saves are dropped
    # (torch.utils.checkpoint, non-reentrant: only the region's inputs stay, in ``_NoopSaveInputs``), so its
    # output is saved only by a reader outside — a frozen o_proj is none (an LLM.int8 one is).
    core_out_dropped = strategy.checkpointing is Checkpointing.SELECTIVE and not int8
    fused_keeps_out = strategy.attention is Attention.SDPA and not math and not core_out_dropped
    already = {SiteInput.ATTN_OUT} if fused_keeps_out and SiteInput.ATTN_OUT in live else set()
    if spec.mlp is MlpKind.DENSE and spec.activation == "relu" and SiteInput.MLP_ACT in live:
        already.add(SiteInput.MLP_ACT)
    # An LLM.int8 linear is no frozen nn.Linear: bitsandbytes' MatMul8bitLt.forward keeps its input A in
    # ``ctx.tensors = (CAt, subA, A)`` whenever the input requires grad (bitsandbytes/autograd/_functions.py),
    # so every int8 linear's input stays saved, shared inputs once (:func:`int8_layer_inputs`; the attention
    # output is the fused kernel's saved output, kept below).
    int8_in: dict[SiteInput, list[SavedTerm]] = {}
    if int8:
        skip = {SiteInput.ATTN_OUT} | (already & {SiteInput.MLP_ACT})  # ReLU's output is saved already
        int8_in = {k: [v] for k, v in int8_layer_inputs(spec, strategy, moe=moe).items() if k not in skip and k in live}
        already |= set(int8_in)
    seen: set[SiteInput] = set()

    def adapter_terms(reads: tuple[SiteInput, ...]) -> list[SavedTerm]:
        out: list[SavedTerm] = []
        for x, site in zip(saved, _site_of(saved, sites), strict=True):
            if site.reads not in reads:
                continue
            if x.reads is not None:
                if x.reads in seen or x.reads in already:
                    continue
                seen.add(x.reads)
            out.append(SavedTerm(name=f"lora.{x.name}", bytes=x.bytes, formula=x.formula))
        return out

    # A blind layer's first norm reads an input that needs no gradient (and has a frozen weight): it saves nothing.
    # A post-norm layer's (BERT: LayerNorm(attention output + input)) reads the attention's output: live with it.
    post_norm = _post_norm(spec)
    first_norm_live = blind is None or (post_norm and blind.residual)
    terms = _norm_terms("norm1", t, h, spec, w, frozen=True) if first_norm_live else []
    terms += int8_in.get(SiteInput.NORM1, [])
    terms += adapter_terms((SiteInput.NORM1,))
    attn = _attention_terms(spec, strategy, t, w) if blind is None or blind.attention else []
    if spec.qk_norm:
        # frozen per-head norms: each keeps its fp32 input and rsqrt — the q norm only if q needs a gradient, the k
        # norm only if k does (a blind layer with q or k unadapted)
        q_on, k_on = (True, True) if blind is None else (blind.q, blind.k)
        qk = q_on * 4 * t * (spec.q_dim + spec.num_heads) + k_on * 4 * t * (spec.kv_dim + spec.num_kv_heads)
        attn = [dataclasses.replace(x, bytes=qk) if x.name == "attn.qk_norm" else x for x in attn]
    if blind is not None and blind.attention and (strategy.attention is Attention.EAGER or math):
        attn = _blind_eager_terms(attn, blind)
    if (strategy.attention is Attention.EAGER or math or core_out_dropped) and not int8:
        # o_proj's input: a frozen o_proj keeps none
        attn = [x for x in attn if x.name not in ("attn.eager.out", "attn.sdpa.out")]
    if spec.mla is not None:
        # A latent RMSNorm whose q_a/kv_a projection carries no adapter sees an input needing no gradient (blind).
        unlit = frozenset({SiteInput.NORM1, SiteInput.Q_LATENT, SiteInput.KV_LATENT} - live) if blind else frozenset()
        latents = frozen_latent_terms(spec, t, blind=unlit, fp32_latents=mla_latents_fp32(strategy, w))
        attn = [y for x in attn for y in (latents if x.name == "attn.latents" else [x])]
        if w.amp and mlp_w != a:
            # kv_b_proj returns fp32 (a bitsandbytes linear over an fp32 residual): v, a view of its output, reaches
            # SDPA in fp32 and autocast casts it to a new 16-bit tensor, which the kernel saves instead (the trace);
            # with the core checkpointed (selective) the checkpoint keeps v itself, so all of kv_b's fp32 output.
            m = spec.mla
            v = a * t * spec.num_heads * m.v_head_dim
            out_b = mlp_w * t * spec.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
            kept = (
                SavedTerm(name="attn.kv_b_out", bytes=out_b, formula=f"{mlp_w}·t·heads·(nope+v) (v's base, fp32)")
                if strategy.checkpointing is Checkpointing.SELECTIVE
                else SavedTerm(name="attn.sdpa.v_cast", bytes=v, formula="a·t·heads·v_head_dim (autocast cast of v)")
            )
            attn = [kept if x.name == "attn.kv_b_out" else x for x in attn]
    terms += attn
    terms += int8_in.get(SiteInput.Q_LATENT, []) + int8_in.get(SiteInput.KV_LATENT, [])
    terms += adapter_terms((SiteInput.Q_LATENT, SiteInput.KV_LATENT))
    terms += adapter_terms((SiteInput.ATTN_OUT,))
    masks = 2 if blind is None else blind.residual + blind.mlp_out
    if spec.hidden_dropout > 0 and masks:
        terms.append(SavedTerm(name="dropout_masks", bytes=masks * t * h, formula=f"{masks} × 1·t·h (attention, MLP)"))
    # one norm feeds a parallel block's MLP too; a blind layer's second norm saves only over a live residual (a
    # post-norm one, LayerNorm(MLP output + attention output), over either)
    second_norm_live = blind is None or blind.mlp_in or (post_norm and blind.mlp_out)
    if not (spec.parallel_attn and spec.norms_per_layer == 1) and second_norm_live:
        terms += _norm_terms("norm2", t, h, spec, w, frozen=True, input_saved=not spec.parallel_attn)
    if spec.norms_per_layer > 2:
        for k in range(3, spec.norms_per_layer + 1):  # Gemma-2: post-attention (3), post-feed-forward (4)
            if blind is None or (blind.residual if k == 3 else blind.mlp_out):
                terms += _norm_terms(f"norm{k}", t, h, spec, w, frozen=True)
    i = spec.intermediate_size
    mlp = int8_in.get(SiteInput.NORM2, []) + adapter_terms((SiteInput.NORM2,))
    if moe:
        shared = SiteInput.NORM2 in seen or SiteInput.NORM2 in already
        mlp += frozen_moe_terms(spec, strategy, t, w, nb, norm_out_saved=shared, blind=blind)
        mlp += int8_in.get(SiteInput.MLP_ACT, [])  # an LLM.int8 shared expert's down_proj input
        mlp += adapter_terms((SiteInput.MLP_ACT,))  # a shared expert's down_proj (Qwen2-MoE)
        return terms + [dataclasses.replace(x, role=TermRole.MLP) for x in mlp]
    if spec.mlp is MlpKind.GATED:
        mlp += _frozen_swiglu("mlp.swiglu", mlp_w * t * i, "3·a·t·i (gate, act, up)", blind)
    elif blind is not None and not blind.gate:
        pass  # a blind layer's activation over an fc1 output that needs no gradient saves nothing
    elif spec.activation == "relu":
        mlp.append(SavedTerm(name="mlp.relu", bytes=mlp_w * t * i, formula="a·t·i (relu out)"))
    elif spec.activation in PYTHON_GELUS and mlp_w != a:
        # A bitsandbytes fc1 returns its input's dtype (fp32 over QLoRA's fp32 residual): the whole GeLU runs
        # in fp32 and keeps x (pow's input), tanh's output, 1 + tanh and 0.5·x; a frozen fc2 keeps nothing.
        mlp.append(SavedTerm(name="mlp.gelu_python", bytes=4 * mlp_w * t * i, formula=f"4·{mlp_w}·t·i (fp32 GeLU)"))
    elif spec.activation in PYTHON_GELUS:
        # HF's Python GeLU keeps its own intermediates (x or its fp32 cast for pow, tanh's output, 1 + tanh,
        # 0.5·x), but a frozen fc2 does not keep the product it reads (matched against the GPT-2/Phi-2 trace).
        full = _act_terms("mlp", spec, t, i, w)[0]
        mlp.append(
            dataclasses.replace(full, bytes=full.bytes - a * t * i, formula=f"{full.formula} − a·t·i (fc2 frozen)")
        )
    else:
        mlp.append(SavedTerm(name="mlp.act", bytes=mlp_w * t * i, formula="a·t·i (fc1 out)"))
    mlp += int8_in.get(SiteInput.MLP_ACT, [])
    mlp += adapter_terms((SiteInput.MLP_ACT,))
    return terms + [dataclasses.replace(x, role=TermRole.MLP) for x in mlp]


def _blind_eager_terms(attn: list[SavedTerm], blind: BlindLayer) -> list[SavedTerm]:
    """Eager attention's (and SDPA's math kernel's) saves when only some of q, k, v need a gradient (a blind first
    layer with q and v adapted, PEFT's default): ``q·kᵀ`` keeps q for k's gradient and k for q's; the softmax (and a
    soft-cap's tanh, a dropout's mask) keeps its output only if the scores need a gradient (q or k does); ``probs·v``
    keeps v for the probabilities' gradient and the probabilities for v's (derivatives.yaml ``mm``/``bmm``,
    ``_softmax``, ``native_dropout``)."""
    qk = blind.q or blind.k
    out: list[SavedTerm] = []
    for x in attn:
        if x.name in ("attn.eager.q_k_v", "attn.sdpa_math.qkv") and x.pieces:
            keep = (blind.k, blind.q, qk)
            pieces = tuple(p for p, on in zip(x.pieces, keep, strict=True) if on)
            out.append(dataclasses.replace(x, bytes=sum(pieces), pieces=pieces, formula=f"{x.formula}, in part"))
        elif x.name in ("attn.eager.dropout", "attn.sdpa_math.dropout") and x.pieces:
            pieces = tuple(p for p, on in zip(x.pieces, (qk, blind.v), strict=True) if on)
            out.append(dataclasses.replace(x, bytes=sum(pieces), pieces=pieces, formula=f"{x.formula}, in part"))
        elif x.name in ("attn.eager.softcap_tanh", "attn.softmax") and not qk:
            separate = ("attn.eager.probs", "attn.eager.dropout", "attn.sdpa_math.dropout")
            if x.name == "attn.softmax" and blind.v and not any(y.name in separate for y in attn):
                out.append(x)  # the probabilities are the softmax's output: probs·v keeps them for v's gradient
        elif x.name == "attn.eager.probs" and not blind.v:
            continue
        else:
            out.append(x)
    return [x for x in out if x.bytes]


def site_widths(spec: ModelSpec, strategy: Strategy, w: Widths) -> dict[SiteInput, int]:
    """Bytes per element of each tensor an adapted linear reads under a frozen base: the normed inputs (the norm's
    output width), the attention output (the compute dtype), the MLP's activation (:func:`frozen_base_mlp_width`)
    and MLA's normed latents — HF ``DeepseekV3RMSNorm`` returns ``weight * x.to(input_dtype)``, the base weight's
    dtype promoted with q_a's/kv_a's output (the compute dtype under autocast): the residual's width."""
    nb = _norm_out_width(spec, w)
    return {
        SiteInput.NORM1: nb,
        SiteInput.NORM2: nb,
        SiteInput.ATTN_OUT: attention_width(strategy, w),
        SiteInput.MLP_ACT: frozen_base_mlp_width(strategy, w),
        SiteInput.Q_LATENT: w.residual,
        SiteInput.KV_LATENT: w.residual,
    }


def frozen_latent_terms(
    spec: ModelSpec, t: int, *, blind: frozenset[SiteInput] = frozenset(), fp32_latents: bool = False
) -> list[SavedTerm]:
    """MLA's two latent RMSNorms with frozen weights (modeling_deepseek_v3.py ``DeepseekV3Attention.forward``:
    ``q_a_layernorm(q_a_proj(x))``, ``kv_a_layernorm(split(kv_a_proj_with_mqa(x))[0])``): each keeps its input's fp32
    copy (``pow`` and ``x * rsqrt``; a copy of the split's strided view) and its fp32 rsqrt — 4·t·(lat + 1) — but not
    the normed latent (a frozen weight) nor q_b's or kv_b's input (frozen linears). ``fp32_latents``: q_a and kv_a
    return fp32 already (a bitsandbytes linear over an fp32 residual returns its input's dtype), so ``.to(float32)``
    is no copy: kv_a_layernorm saves the split's view itself, which keeps kv_a's whole output, 4·t·(kv_lora + rope)
    (found by the trace of LLM.int8 layers). A latent whose input needs no gradient (``blind``: the first layer
    without input gradients, its q_a/kv_a not adapted) keeps nothing."""
    assert spec.mla is not None
    m = spec.mla
    out: list[SavedTerm] = []
    for site, name, lat in (
        (SiteInput.Q_LATENT, "q_a_layernorm", m.q_lora_rank),
        (SiteInput.KV_LATENT, "kv_a_layernorm", m.kv_lora_rank),
    ):
        if lat and site not in blind:
            whole = lat + (m.qk_rope_head_dim if fp32_latents and site is SiteInput.KV_LATENT else 0)
            out.append(
                SavedTerm(
                    name=f"attn.{name}",
                    bytes=4 * t * whole + 4 * t,
                    formula="4·t·lat + 4·t (fp32 input, rsqrt)" if whole == lat else "4·t·(lat + rope) + 4·t",
                    pieces=(4 * t * whole, 4 * t),
                )
            )
    return out


def mla_latents_fp32(strategy: Strategy, w: Widths) -> bool:
    """Whether MLA's frozen q_a/kv_a projections return fp32 (:func:`frozen_latent_terms`): the width of a frozen
    linear's output (:func:`frozen_base_mlp_width`) is 4."""
    return frozen_base_mlp_width(strategy, w) == 4


def frozen_moe_terms(
    spec: ModelSpec,
    strategy: Strategy,
    t: int,
    w: Widths,
    nb: int,
    *,
    norm_out_saved: bool,
    blind: BlindLayer | None = None,
) -> list[SavedTerm]:
    """A frozen transformers 5 MoE block (Mixtral / Qwen3-MoE layout) with PEFT's ``ParamWrapper`` adapters
    (:func:`trainfit.analytic.adapters.moe_param_sites`; module docstring of :mod:`trainfit.analytic.adapters`).
    ``grouped_mm`` runs in the weight dtype (w = the base's bytes, :func:`_moe_terms`); over ``t·k`` routed rows:

    * frozen experts: act's input (gate), act(gate) and up for the product's backward, and the down output
      that the routing weights multiply (they require grad through the router): w·t·k·(h + 3·moe_i) — not the
      gathered input nor the product, which only a frozen stack's weight gradient would need;
    * an adapted stack (``_LoraFactorsProxy``: ``baddbmm(W, B_e, A_e)``, peft/tuners/lora/layer.py) is a new
      weight that needs a gradient: ``grouped_mm`` saves it (w·E·d_out·d_in) and its input (gathered rows
      w·t·k·h for gate_up, the product w·t·k·moe_i for down); ``baddbmm`` saves both factors, copies in the
      weight dtype when the adapter dtype differs (``.to(param.dtype)``: w·rank·E·(d_in + d_out));
    * an adapted router (``_LoraParameterProxy``: ``W + B·A·s``) makes its linear save its input (the normed
      tensor, or autocast's cast of it) and the new E × h weight;
    * the router's softmax/top-k bookkeeping as in full fine-tuning (:func:`_router_bytes`).

    ``blind`` (the block's input needs no gradient; its router and experts carry no adapter, else refused by
    :func:`trainfit.analytic.adapters.validate`): the router and the routed experts save nothing, the shared
    experts as a blind SwiGLU, and Qwen2-MoE's ``sigmoid(gate) * shared_out`` keeps shared_out for the gate's
    gradient and the sigmoid output for its own and shared_out's."""
    assert spec.moe is not None and strategy.adapter is not None
    if blind is not None and not blind.mlp_in:
        return _blind_moe_terms(spec, strategy, t, w, blind)
    m, h, a = spec.moe, spec.hidden_size, w.compute
    e = w.residual  # the base's bytes: grouped_mm has no autocast policy
    ad = strategy.adapter.dtype.bits // 8
    k_t, i = t * m.experts_per_token, m.expert_intermediate_size
    params = {p.name: p for p in moe_param_sites(spec, strategy.adapter)}
    router = _router_bytes(spec, t, a)
    if spec.model_type == "deepseek_v3" and w.amp:
        # DeepseekV3TopkRouter: sigmoid of the autocast linear's 16-bit logits keeps a 16-bit output, not fp32.
        router -= (4 - a) * t * m.num_experts
    out = [
        SavedTerm(name="mlp.router", bytes=router, formula="4·t·E + 4·E + 36·t·k (+renorm)"),
        SavedTerm(name="mlp.experts", bytes=e * k_t * (h + 3 * i), formula="w·t·top_k·(h + 3·moe_i) (frozen)"),
    ]
    # The shared experts are nn.Linear modules: the compute dtype, or over a bitsandbytes base their input's dtype
    # (an int8/4-bit linear returns it, frozen_base_mlp_width: fp32 over an fp32 residual stream).
    sw = frozen_base_mlp_width(strategy, w)
    if m.num_shared_experts:  # frozen SwiGLU; its adapters are layer sites
        si = m.num_shared_experts * m.shared_expert_intermediate_size
        out += _frozen_swiglu("mlp.shared.swiglu", sw * t * si, f"3·{sw}·t·shared_i (gate, act, up)")
    if m.shared_expert_gate:
        # sigmoid(gate(x)) * shared_out: saves the shared expert's output (made before the routed experts run) and
        # the sigmoid output (after them, modeling_qwen2_moe.py Qwen2MoeSparseMoeBlock.forward).
        out.append(SavedTerm(name="mlp.shared_out", bytes=sw * t * h, formula=f"{sw}·t·h"))
        out.append(SavedTerm(name="mlp.shared_gate", bytes=sw * t, formula=f"{sw}·t (sigmoid)"))
    if spec.model_type in _FP32_ROUTERS:
        out += _fp32_router_terms(spec, t, w, nb, adapted="router" in params, norm_out_saved=norm_out_saved)
    elif "router" in params:
        p = params["router"]
        if w.amp and nb != a:
            out.append(SavedTerm(name="lora.router.in", bytes=a * t * h, formula=f"{a}·t·h (autocast cast)"))
        elif not norm_out_saved:
            out.append(SavedTerm(name="lora.router.in", bytes=nb * t * h, formula=f"{nb}·t·h (normed input)"))
        out.append(SavedTerm(name="lora.router.weight", bytes=e * p.weight_numel, formula="w·E·h (W + s·B·A)"))
    ins = {"gate_up_proj": (h, "h (gathered rows)"), "down_proj": (i, "moe_i (product)")}
    for name in ("gate_up_proj", "down_proj"):
        if name not in params:
            continue
        p = params[name]
        width, what = ins[name]
        out.append(SavedTerm(name=f"lora.{name}.in", bytes=e * k_t * width, formula=f"w·t·top_k·{what}"))
        out.append(SavedTerm(name=f"lora.{name}.weight", bytes=e * p.weight_numel, formula="w·E·d_out·d_in (baddbmm)"))
        if ad != e:
            out.append(
                SavedTerm(name=f"lora.{name}.factors", bytes=e * p.adapter_numel, formula="w·rank·E·(d_in + d_out)")
            )
    return out


def _blind_moe_terms(spec: ModelSpec, strategy: Strategy, t: int, w: Widths, blind: BlindLayer) -> list[SavedTerm]:
    """:func:`frozen_moe_terms` of a block whose input needs no gradient."""
    assert spec.moe is not None
    m, h = spec.moe, spec.hidden_size
    sw = frozen_base_mlp_width(strategy, w)
    out: list[SavedTerm] = []
    if m.num_shared_experts:
        si = m.num_shared_experts * m.shared_expert_intermediate_size
        out += _frozen_swiglu("mlp.shared.swiglu", sw * t * si, f"3·{sw}·t·shared_i (gate, act, up)", blind)
    if m.shared_expert_gate:
        if blind.shared_gate:
            out.append(SavedTerm(name="mlp.shared_out", bytes=sw * t * h, formula=f"{sw}·t·h"))
        if blind.shared_gate or blind.mlp_out:
            out.append(SavedTerm(name="mlp.shared_gate", bytes=sw * t, formula=f"{sw}·t (sigmoid)"))
    return out


#: MoE routers that compute their logits in fp32 (modeling_deepseek_v3.py ``DeepseekV3TopkRouter.forward``, the same
#: in modeling_deepseek_v2.py: ``F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))``).
#: Mixtral's and Qwen-MoE's routers run ``F.linear`` in the input dtype (Mixtral casts only the logits, ``.float()``,
#: for its softmax): not listed; Mixtral's fp32 routing weights: :func:`moe_adapter_backward_bytes`.
_FP32_ROUTERS = frozenset({"deepseek_v2", "deepseek_v3"})


def _fp32_router_terms(
    spec: ModelSpec, t: int, w: Widths, nb: int, *, adapted: bool, norm_out_saved: bool
) -> list[SavedTerm]:
    """What DeepSeek's fp32 router linear saves over a frozen base (E experts, a: the compute width). Its weight
    gradient is not needed unless PEFT adapts it, so the linear keeps the weight it multiplied by — autocast's 16-bit
    cast of the fp32 copy under ``amp-*`` (a·E·h; casts of tensors that are no leaves requiring grad are not cached,
    aten/src/ATen/autocast_mode.h ``cached_cast``), else the fp32 copy (4·E·h; the parameter itself over an fp32
    base). PEFT's ``_LoraParameterProxy`` (``W + B·A·s``, a new tensor) makes it keep its input too: autocast's cast
    of ``x.float()`` (a·t·h) or, without autocast, ``x.float()`` (4·t·h; ``x`` itself when it is fp32 already)."""
    assert spec.moe is not None
    h, e_n, a = spec.hidden_size, spec.moe.num_experts, w.compute
    out: list[SavedTerm] = []
    if adapted and w.amp:
        out.append(SavedTerm(name="lora.router.in", bytes=a * t * h, formula=f"{a}·t·h (autocast cast of x.float())"))
    elif adapted and (nb != 4 or not norm_out_saved):
        out.append(SavedTerm(name="lora.router.in", bytes=4 * t * h, formula="4·t·h (x.float())"))
    weight = a if w.amp else (4 if adapted or w.residual != 4 else 0)
    if weight:
        out.append(SavedTerm(name="lora.router.weight", bytes=weight * e_n * h, formula=f"{weight}·E·h (weight cast)"))
    return out


def moe_adapter_backward_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """In flight at the worst moment of a frozen MoE block's backward (:func:`frozen_moe_terms`), net of the
    block's saved tensors released by then (w: the base's bytes, r: the residual's, ``T = t·top_k`` routed
    rows), every moment over the residual gradient r·t·h:

    * the gate·up product's backward: the product's, act(gate)'s and up's gradients (w·T·3·moe_i), the routed
      output that the routing weights multiplied already released (w·T·h) — and, when PEFT adapts the down
      projection, its new weight and saved input too;
    * an adapted down projection's grouped_mm backward: its input's gradient w·T·moe_i and the full weight
      gradient w·E·h·moe_i (``baddbmm``'s backward reduces it to the factors' after), the output's gradient
      already consumed;
    * an adapted gate_up's: the concatenated gate/up gradient w·T·2·moe_i, the input's w·T·h and the weight
      gradient w·E·2·moe_i·h, with gate, act(gate), up and the routed output released (and down's saved
      tensors, when adapted).

    Read off the trace's peaks (tests/trace/test_peft.py), not derived op by op."""
    assert strategy.adapter is not None and spec.moe is not None
    params = {p.name: p for p in moe_param_sites(spec, strategy.adapter)}
    w = Widths.of(strategy)
    e, r = w.residual, w.residual
    t = strategy.tokens_per_micro_batch
    h, i = spec.hidden_size, spec.moe.expert_intermediate_size
    big_t = t * spec.moe.experts_per_token
    down_released = 0
    moments = []
    if "down_proj" in params:
        down_w = e * params["down_proj"].weight_numel
        moments.append(e * big_t * i + down_w)
        down_released = down_w + e * big_t * i
    moments.append(e * big_t * (3 * i - h) - down_released)
    if "gate_up_proj" in params:
        released = e * big_t * (3 * i + h) + down_released
        moments.append(e * big_t * (2 * i + h) + e * params["gate_up_proj"].weight_numel - released)
    if spec.model_type in _FP32_ROUTERS and (spec.model_type == "deepseek_v2" or not w.amp):
        # fp32 routing weights (DeepSeek-V2's softmax(dtype=float32); V3's fp32 logits without autocast) promote the
        # routed output ``proj_out * sample_weights`` (transformers integrations/moe.py grouped_mm_experts_forward)
        # to fp32: its backward opens with fp32 T × h gradients (the sum's expanded copy, the un-permuting index's
        # zeros and index_put) beside the incoming residual gradient. Net of what the analytic counts as still
        # saved there, two of them (8·T·h) match the trace's peak (read off it, tests/trace/test_peft.py).
        # Mixtral's weights are fp32 too (modeling_mixtral.py MixtralTopKRouter.forward: ``softmax(router_logits
        # .float())``, never cast back), so its routed output is promoted the same way; but with wide experts the
        # moment never sets the peak: over frozen 16-bit experts it is below the product's w·T·(3·moe_i − h)
        # whenever moe_i ≥ (5 + 1/top_k)·h/3, and Mixtral-8x7B (moe_i = 3.5h) stays at ≤ 0.87 of the moment taken
        # (any targets, 512 to 512k tokens), so it is not added. No trace cell isolates it: below that width the
        # tiny configs' forward disagrees first (an unmodelled forward transient of the routed output, ≈ 8·T·h).
        # Qwen2-/Qwen3-MoE cast the weights back (``router_top_value.to(router_logits.dtype)``): no promotion.
        moments.append(8 * big_t * h + r * t * h)
    shared = _quantised_shared_branch_bytes(spec, strategy)
    return r * t * h + max(0, *(x + shared for x in moments))


def _quantised_shared_branch_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """Over a bitsandbytes base, what DeepSeek's shared experts (:data:`_SHARED_AFTER_EXPERTS`: added after the
    routed ones) change in the routed experts' backward moments (:func:`moe_adapter_backward_bytes`): their branch
    back-propagates first — its down projection needs no saved tensor (``MatMul8bitLt`` reads only ``ctx``,
    ``MatMul4Bit`` saves nothing), so it runs before the layer's recomputation — and by the routed experts' backward
    their SwiGLU's saves (gate, act(gate), up: 3·w·t·shared_i in their input's width, :func:`frozen_moe_terms`) are
    released, while their input gradient waits to be summed with the routed branch's in the input's dtype
    (``MatMul8bitLt.backward``: ``grad_output.to(ctx.dtype_A)``; ``Linear4bit``'s ``x.to(compute_dtype)`` casts its
    gradient back): norm2's output width · t·h. Read off the trace's records at its backward peak (DeepSeek-V2,
    LLM.int8: +2.0% → +1.2% of the trace without workspaces; QLoRA +5.3% → +4.4%). 0 otherwise."""
    m = spec.moe
    if (
        strategy.base_weights.quantization is Quantization.NONE
        or m is None
        or not m.num_shared_experts
        or spec.model_type not in _SHARED_AFTER_EXPERTS
    ):
        return 0
    w = Widths.of(strategy)
    t = strategy.tokens_per_micro_batch
    si = m.num_shared_experts * m.shared_expert_intermediate_size
    return _norm_out_width(spec, w) * t * spec.hidden_size - 3 * frozen_base_mlp_width(strategy, w) * t * si


def moe_adapter_forward_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """A checkpointed forward saves nothing, but inside the last layer's experts PEFT's parametrized weights live
    for the whole call (``ParamWrapper._activate_lora``: ``nn.utils.parametrize.cached()``, each computed at first
    use): the factor copies of every adapted stack, the normed input and the residual (r·t·h each), and the worse
    of two moments (w: the base's bytes, ``T = t·top_k``): the gate·up product — gate_up's new weight
    (w·E·2·moe_i·h), the gathered rows (w·T·h), gate_up's output, act(gate) and the product (w·T·4·moe_i) — or
    the down projection — both new weights, the gathered rows, the product and the output (w·T·(2h + moe_i)).
    Read off the trace's peak (tests/trace/test_peft.py). 0 without an adapted expert stack."""
    adapter = strategy.adapter
    if adapter is None or spec.moe is None:
        return 0
    params = {p.name: p for p in moe_param_sites(spec, adapter) if p.experts > 1}
    if not params:
        return 0
    w = Widths.of(strategy)
    e, ad = w.residual, adapter.dtype.bits // 8
    t = strategy.tokens_per_micro_batch
    h, i = spec.hidden_size, spec.moe.expert_intermediate_size
    big_t = t * spec.moe.experts_per_token
    factors = sum(e * p.adapter_numel for p in params.values()) if ad != e else 0
    new = {n: e * p.weight_numel for n, p in params.items()}
    at_act = new.get("gate_up_proj", 0) + e * big_t * (h + 4 * i)
    at_down = sum(new.values()) + e * big_t * (2 * h + i)
    p = max(e, _routing_weight_width(spec, w))
    at_unpermute = sum(new.values()) + 2 * e * big_t * h + 2 * p * big_t * h
    held = (_norm_out_width(spec, w) + w.residual) * t * h - _int8_kept_early(spec, strategy)
    return factors + max(at_act, at_down, at_unpermute) + held


def _routing_weight_width(spec: ModelSpec, w: Widths) -> int:
    """Bytes per routing weight as the experts multiply by them: fp32 for Mixtral (``softmax(router_logits.float())``,
    never cast back) and DeepSeek-V2 (``softmax(dtype=float32)``); the compute dtype for Qwen-MoE
    (``.to(router_logits.dtype)``, :attr:`MoESpec.weights_in_compute_dtype`) and for DeepSeek-V3 under autocast (the
    sigmoid of the autocast linear's 16-bit logits), fp32 without (modeling_deepseek_v3.py ``DeepseekV3TopkRouter``)."""
    assert spec.moe is not None
    if spec.model_type == "deepseek_v3":
        return w.compute if w.amp else 4
    return w.compute if spec.moe.weights_in_compute_dtype else 4


def _int8_kept_early(spec: ModelSpec, strategy: Strategy) -> int:
    """What the checkpointed forward's kept inputs (:func:`int8_ctx_bytes`) count of the last MoE layer that is not
    there, or is there already, while its routed experts run (:func:`moe_adapter_forward_bytes`): the normed input,
    which an LLM.int8 shared expert (or ``shared_expert_gate``) keeps on ctx — counted there, not again — and the
    shared experts' product (down_proj's int8 input), not made yet: the routed experts run first
    (modeling_deepseek_v3.py ``DeepseekV3MoE.forward``: ``self.experts(...)``, then ``+ self.shared_experts(...)``).
    0 without an LLM.int8 base."""
    if strategy.base_weights.quantization is not Quantization.INT8:
        return 0
    ins = int8_layer_inputs(spec, strategy, moe=True)
    return sum(ins[k].bytes for k in (SiteInput.NORM2, SiteInput.MLP_ACT) if k in ins)


def _site_of(saved: list[AdapterSaved], sites: tuple[AdapterSite, ...]) -> list[AdapterSite]:
    """The site each saved adapter tensor belongs to (names are ``{site}.{what}``)."""
    by_name = {s.name: s for s in sites}
    return [by_name[x.name.rpartition(".")[0]] for x in saved]  # a site may be dotted (attn.c_proj)


def input_grads_enabled(strategy: Strategy) -> bool:
    """Whether the embeddings' output requires grad under an adapter: transformers 5 enables it whenever
    gradient checkpointing is turned on (``_activation_checkpointing_enable`` → ``enable_input_require_grads``),
    ``prepare_model_for_kbit_training`` does only together with checkpointing (peft/utils/other.py), and
    ``get_peft_model`` only when the model already checkpoints (peft_model.py:
    ``if getattr(model, "is_gradient_checkpointing", True)``). ``--checkpointing selective`` turns none of
    that on: only the attention core is wrapped in ``torch.utils.checkpoint`` (Megatron's ``core_attn``; the
    trace's ``trainfit.trace.savers.selective_recompute``), so the first layer saves as without checkpointing."""
    return strategy.checkpointing.whole_layers


def blind_layer_unsaved(spec: ModelSpec, strategy: Strategy) -> tuple[int, tuple[SavedTerm, ...]]:
    """``--freeze``: the lowest layer to run backward when its input needs no gradient (``FrozenLayers.
    input_grad_from``: above dead layers, or the first over frozen embeddings without checkpointing), and what it
    does not save — its first RMSNorm's fp32 input and rsqrt, which HF's ``LlamaRMSNorm`` saves (``pow``, ``mul``,
    ``rsqrt``) only for the input's gradient; ``weight * normed`` still saves ``normed`` for the weight's (a
    LayerNorm's one kernel saves its input for the weight's gradient too). Where the frozen forms are known
    (Llama-style layers of one kind); else ``(0, ())``. Found by the trace: a dead bottom under FSDP2 left the
    stream 0.6% over the traced peak, the closed form 0.25% on one GPU."""
    fz = frozen_layers(spec, strategy)
    inv = inventory(spec)
    if fz is None or not fz.input_grad_from or fz.dead >= spec.num_layers or len(inv.layers) != 1:
        return 0, ()
    if not frozen_forms_known(spec) or spec.norm is not NormKind.RMSNORM or spec.norm_unit_offset:
        return 0, ()
    terms = layer_terms(spec, strategy, moe=inv.layers[0].kind == "moe")
    return fz.dead, tuple(x for x in terms if x.name in _input_grad_saves("norm1"))


def _input_grad_saves(norm: str) -> tuple[str, str]:
    """The terms of an RMSNorm (:func:`_norm_terms`) saved only for its input's gradient: the fp32 input and rsqrt."""
    return f"{norm}.rsqrt", f"{norm}.input_fp32"


def first_layer_unsaved_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """What the first layer does *not* save under an adapter when the embeddings' output does not require
    grad: nothing before its first adapter (:class:`~trainfit.analytic.adapters.BlindLayer`) — its first norm
    with an attention-input target (q, k or v, as ``all-linear`` and the usual q,v), its whole attention with
    MLP-only targets."""
    first = first_layer_terms(spec, strategy)
    if first is None:
        return 0
    return _sum_bytes(layer_terms(spec, strategy, moe=inventory(spec).layers[0].kind == "moe")) - _sum_bytes(first)


def first_layer_terms(spec: ModelSpec, strategy: Strategy) -> list[SavedTerm] | None:
    """The first layer's saved tensors when its input needs no gradient (:func:`first_layer_unsaved_bytes`), else
    None (it saves as every layer of its kind)."""
    if not frozen_base(strategy) or input_grads_enabled(strategy):
        return None
    assert strategy.adapter is not None
    moe = inventory(spec).layers[0].kind == "moe"
    return layer_terms(spec, strategy, moe=moe, blind=BlindLayer.of(spec, strategy.adapter))


def adapter_backward_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """Gradients an adapter adds in flight inside its layer's backward, at the widest site: ``lora_A``'s input
    gradient in the width it computed in (mm), then autocast's cast back to the adapter dtype, dropout's
    backward and PEFT's cast back to the input dtype (``_cast_input_dtype``): every gradient of that chain but
    the last is alive at its worst moment (amp, fp32 adapters, 16-bit input: (2 + 4)·t·d_in; with dropout
    (2 + 4 + 4)·t·d_in; no autocast: 4·t·d_in); mm·t·d_in when nothing is cast. Matched against the trace of
    real PEFT modules (tests/trace/test_peft.py), not derived op by op — and an over-count where derived: each step
    frees the one before (:func:`lora_chain_peak`). Used only where :func:`frozen_mlp_backward_bytes` is not (other
    MLP forms, MoE, DoRA, LLM.int8)."""
    if strategy.adapter is None:
        return 0
    w = Widths.of(strategy)
    t = strategy.tokens_per_micro_batch
    ad = strategy.adapter.dtype.bits // 8
    mm = w.compute if w.amp else ad
    widths = site_widths(spec, strategy, w)
    drop = strategy.adapter.dropout > 0

    def extra(site: AdapterSite) -> int:
        # The input gradient's widths back from lora_A: its matmul's, autocast's cast back to the adapter
        # dtype, dropout's backward, PEFT's cast back to the input's dtype. All but the last are alive at once.
        chain = [mm]
        if w.amp and ad != mm:
            chain.append(ad)
        if drop:
            chain.append(ad)
        if widths[site.reads] != ad:
            chain.append(widths[site.reads])
        return sum(chain[:-1]) if len(chain) > 1 else chain[0]

    return max((t * s.d_in * extra(s) for s in adapter_sites(spec, strategy.adapter)), default=0)


def lora_chain_peak(widths: list[int]) -> int:
    """Bytes per element at the worst moment of a LoRA input gradient's chain of casts: each step (autocast's cast
    back from lora_A's matmul, dropout's backward, PEFT's ``_cast_input_dtype`` back to the input's dtype) makes a new
    tensor from the previous one, which autograd frees once the step has run — so two neighbours at most are alive
    (checked against the trace: lora_A's mm output is gone when dropout's backward allocates)."""
    if len(widths) == 1:
        return widths[0]
    return max(a + b for a, b in itertools.pairwise(widths))


def lora_input_grad_chain(strategy: Strategy, input_width: int) -> list[int]:
    """The widths of an adapted linear's input gradient along the adapter branch (PEFT ``lora.Linear.forward``:
    ``lora_B(lora_A(dropout(x.to(adapter dtype))))``): lora_A's matmul (the compute dtype under autocast, else the
    adapter's), autocast's cast back to the adapter dtype, dropout's backward, the cast back to ``input_width``."""
    assert strategy.adapter is not None
    w = Widths.of(strategy)
    ad = strategy.adapter.dtype.bits // 8
    mm = w.compute if w.amp else ad
    chain = [mm]
    if w.amp and ad != mm:
        chain.append(ad)
    if strategy.adapter.dropout > 0:
        chain.append(ad)
    if input_width != ad:
        chain.append(input_width)
    return chain


@dataclass(frozen=True, slots=True)
class _FrozenMlp:
    """What :func:`frozen_mlp_backward_bytes` and :func:`frozen_down_forward_bytes` read: the widths (m: the MLP's,
    c: the compute dtype's), the adapted sites and what the down projection's adapter saves, by kind (``lora_in``,
    ``dropout_mask``, ``lora_A_out``)."""

    adapter: Adapter
    quant: Quantization
    w: Widths
    t: int
    h: int
    i: int
    m: int
    c: int
    sites: tuple[AdapterSite, ...]
    down: tuple[AdapterSite, ...]
    down_saved: dict[str, int]

    @classmethod
    def of(cls, spec: ModelSpec, strategy: Strategy) -> _FrozenMlp | None:
        if strategy.adapter is None or not _frozen_mlp_derived(spec, strategy):
            return None
        return cls.build(spec, strategy)

    @classmethod
    def build(cls, spec: ModelSpec, strategy: Strategy) -> _FrozenMlp:
        """The record of a gated MLP under an adapter, whatever its base (the callers decide what they derive)."""
        adapter = strategy.adapter
        assert adapter is not None
        quant = strategy.base_weights.quantization
        w = Widths.of(strategy)
        t = strategy.tokens_per_micro_batch
        m = frozen_base_mlp_width(strategy, w)
        sites = adapter_sites(spec, adapter)
        down = tuple(x for x in sites if x.reads is SiteInput.MLP_ACT)
        saved = adapter_saved(
            down,
            adapter,
            tokens=t,
            input_width={SiteInput.MLP_ACT: m},
            amp=w.amp,
            compute=w.compute,
            base_width=base_weight_width(strategy),
            quantised=quant is not Quantization.NONE,
        )
        return cls(
            adapter=adapter,
            quant=quant,
            w=w,
            t=t,
            h=spec.hidden_size,
            i=spec.intermediate_size,
            m=m,
            c=w.compute,
            sites=sites,
            down=down,
            down_saved={x.name.rsplit(".", 1)[-1]: x.bytes for x in saved},
        )


def _frozen_mlp_derived(spec: ModelSpec, strategy: Strategy) -> bool:
    """Whether :func:`frozen_mlp_backward_bytes` derives this layer's MLP: a dense gated MLP under a LoRA adapter
    over a float or 4-bit base."""
    adapter = strategy.adapter
    if adapter is None or adapter.kind is AdapterKind.DORA or spec.mlp is not MlpKind.GATED:
        return False
    if spec.moe is not None and spec.num_moe_layers:
        return False
    return strategy.base_weights.quantization is not Quantization.INT8


def _down_adapter_moments(
    strategy: Strategy, saved: dict[str, int], width: int, t: int, i: int, down: tuple[AdapterSite, ...]
) -> tuple[list[int], int]:
    """An adapted down projection's (fc2's) backward, as every derived MLP form has it: the input gradient's cast
    chain (:func:`lora_chain_peak`), lora_A's saved input released, and the branch's result (width·t·i) that waits
    while the base back-propagates; ``([], 0)`` without an adapter there."""
    if not down:
        return [], 0
    chain = lora_chain_peak(lora_input_grad_chain(strategy, width)) * t * i - saved.get("lora_in", 0)
    return [chain], width * t * i


def frozen_mlp_backward_bytes(spec: ModelSpec, strategy: Strategy) -> int | None:
    """In flight at the worst moment of a frozen gated MLP's backward under an adapter, over the incoming residual
    gradient r·t·h and net of the MLP's saved tensors (gate, act(gate) and up, :func:`frozen_layer_terms`: a
    frozen down projection saves no input, so nothing is released before the product's backward). Op by op
    (HF ``LlamaMLP``: ``down(act(gate(x)) * up(x))``; m = the MLP's width, :func:`frozen_base_mlp_width`; c = the
    compute width), each moment over t·i unless said:

    * the product's backward: its gradient, act(gate)'s and up's — 3·m;
    * an adapted down projection (PEFT adds ``lora_B(lora_A(...))`` after the base output, so autograd runs the
      adapter branch first): the input gradient's cast chain (:func:`lora_chain_peak`); then, its result (m)
      alive, the base's: over a float base the matmul's input gradient (c) and autocast's cast back to m when
      m ≠ c; over a 4-bit base (bitsandbytes ``Linear4bit.forward``: ``x.to(compute_dtype)``, ``matmul_4bit``,
      ``.to(inp_dtype)``; ``MatMul4Bit.backward``: ``grad_output @ dequantize_4bit(W).t()``) the incoming gradient
      cast to c (c·t·h when m ≠ c), the dequantised weight (c·h·i) and the matmul's c·t·i, then, those freed, the
      cast back to m; then the sum of the two (3·m, as the product's moment);
    * a frozen down projection's backward needs no saved tensor, so under checkpointing it runs before the
      layer is recomputed (the non-reentrant checkpoint recomputes at the first unpack): its product gradient
      (m) waits through the recomputation — the product's moment again — and its own moments are outside the
      saved set; without checkpointing they are the base's moments above without the adapter's result.

    ``None`` where this is not derived (other MLP forms, MoE layers, LLM.int8 and DoRA bases): the caller keeps
    the older sum of :func:`backward_temp_bytes`, the dequantised weight and the adapter chain. Checked against
    the trace's live tensors at its peak (tests/trace/test_peft.py, wide-MLP cells)."""
    mlp = _FrozenMlp.of(spec, strategy)
    if mlp is None:
        return None
    quant, w, saved = mlp.quant, mlp.w, mlp.down_saved
    t, h, i, m, c, down = mlp.t, mlp.h, mlp.i, mlp.m, mlp.c, mlp.down
    released = sum(saved.values())
    branch, g_lora = _down_adapter_moments(strategy, saved, m, t, i, down)
    moments = [3 * m * t * i - released, *branch]
    checkpointed = bool(strategy.checkpoint_layout(spec.num_layers).segment_sizes)
    if down and checkpointed:
        # The recomputation runs the adapted down projection's forward again (frozen_down_forward_bytes) with the
        # MLP's saves alive; the adapter output's scaling (``* scaling``) needs no saved tensor, so its backward ran
        # before the recomputation and its c·t·h gradient waits for lora_B's.
        forward = frozen_down_forward_bytes(spec, strategy, checkpointed=False)
        assert forward is not None
        moments.append(c * t * h + forward)
    if down or not checkpointed:
        if quant is Quantization.NONE:
            moments.append(g_lora + c * t * i + (m * t * i if m != c else 0) - released)
        else:
            g_cast = c * t * h if m != c else 0
            moments.append(g_lora + g_cast + c * h * i + c * t * i - released)
            moments.append(g_lora + c * t * i + (m * t * i if m != c else 0) - released)
    return w.residual * t * h + max(moments)


def _dense_mlp_widths(spec: ModelSpec, strategy: Strategy) -> tuple[int, int] | None:
    """(m, g): a frozen non-gated MLP's fc1 output width and its activation's output width (HF's Python GeLU returns
    fp32 under autocast: ``pow`` is on CUDA autocast's fp32 list and the rest follows by promotion); None where
    :func:`_dense_mlp_forward_bytes` and :func:`frozen_dense_backward_bytes` do not derive the MLP."""
    adapter = strategy.adapter
    if (
        (adapter is None and finetuning(strategy))  # --freeze patterns: not derived
        or (adapter is not None and adapter.kind is AdapterKind.DORA)
        or spec.mlp is not MlpKind.DENSE
        or spec.moe is not None
        or strategy.base_weights.quantization is Quantization.INT8
    ):
        return None
    w = Widths.of(strategy)
    m = frozen_base_mlp_width(strategy, w)
    return m, (4 if w.amp else m) if spec.activation in PYTHON_GELUS else m


def dense_forward_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """A non-gated MLP's working set at the worst moment of a checkpointed forward, with the layer's locals
    (:func:`_dense_mlp_forward_bytes`; full fine-tuning too, whose linears carry no adapter branch): 0 without
    checkpointing or where not derived."""
    if strategy.checkpoint_segments(spec.num_layers) == 0:
        return 0
    return _dense_mlp_forward_bytes(spec, strategy) or 0


def frozen_dense_backward_bytes(spec: ModelSpec, strategy: Strategy) -> int | None:
    """In flight at the worst moment of a frozen non-gated MLP's backward under an adapter (fc1 → activation → fc2;
    the cases of :func:`_dense_mlp_widths`), over the incoming residual gradient r·t·h and net of what the MLP's
    saves have released by then — the mirror of :func:`frozen_mlp_backward_bytes` (m: fc1's output width, g: the
    activation's output, fc2's input; each over t·i unless said):

    * an adapted fc2: the input gradient's cast chain (:func:`lora_chain_peak`), its saved input released; then,
      the branch's result (g) alive, the base's: over a float base the matmul's input gradient (c) and autocast's
      cast back to g when g ≠ c; over a 4-bit base the incoming gradient cast to c, the dequantised weight (c·h·i),
      the matmul's c·t·i; then the two input gradients and their sum (3g), fc2's saves released (a frozen fc2
      saves none: under checkpointing its backward runs before the layer is recomputed, the gradient g waiting);
    * the activation's backward, fc2's saves gone: ``F.gelu``/ReLU the output's gradient and the input's (2m); HF's
      Python GeLU its output's gradient and two neighbours of its chain in fp32 under autocast (3·4), else 3m.

    The layer's MLP dropout mask is released before any of it. Checked against the trace's live tensors at its peak
    (tests/trace/test_peft.py)."""
    widths = _dense_mlp_widths(spec, strategy)
    if widths is None or strategy.adapter is None:
        return None
    m, g = widths
    w = Widths.of(strategy)
    t, h, i, c = strategy.tokens_per_micro_batch, spec.hidden_size, spec.intermediate_size, w.compute
    quant = strategy.base_weights.quantization
    down = tuple(x for x in adapter_sites(spec, strategy.adapter) if x.reads is SiteInput.MLP_ACT)
    saved = {
        x.name.rsplit(".", 1)[-1]: x.bytes
        for x in adapter_saved(
            down,
            strategy.adapter,
            tokens=t,
            input_width={SiteInput.MLP_ACT: g},
            amp=w.amp,
            compute=c,
            base_width=base_weight_width(strategy),
            quantised=quant is not Quantization.NONE,
        )
    }
    released = sum(saved.values())
    python = spec.activation in PYTHON_GELUS
    act = (3 * 4 if w.amp else 3 * m) if python else 2 * m
    checkpointed = bool(strategy.checkpoint_layout(spec.num_layers).segment_sizes)
    branch, g_lora = _down_adapter_moments(strategy, saved, g, t, i, down)
    moments = [act * t * i - released, *branch]
    if down:
        moments.append(3 * g * t * i - released)  # the branch's and the base's input gradients, and their sum
    if down or not checkpointed:
        if quant is Quantization.NONE:
            moments.append(g_lora + c * t * i + (g * t * i if g != c else 0))
        else:
            moments.append(g_lora + (c * t * h if m != c else 0) + c * h * i + c * t * i)
    if down and checkpointed:
        # The recomputation runs the adapted fc2's forward again, the layer's saves made so far alive (all but
        # lora_A's output): the layer's locals, the activation's output g, ``x.to(adapter dtype)`` (a copy when g
        # differs), the base output; the scaling's c·t·h gradient waits (:func:`frozen_mlp_backward_bytes`).
        ad = strategy.adapter.dtype.bits // 8
        out_w = m if quant is not Quantization.NONE else c
        copy = ad if g != ad else 0
        forward = _dense_layer_locals(spec, strategy) + (g + copy) * t * i + out_w * t * h - saved.get("lora_A_out", 0)
        moments.append(c * t * h + forward)
    mask = t * h if spec.hidden_dropout > 0 else 0
    return w.residual * t * h + max(moments) - mask


#: Decoder layers that keep the attention's output in a local of their own while the MLP runs (modeling_gpt2.py
#: ``GPT2Block.forward``: ``attn_output, ... = self.attn(...)``, then ``hidden_states = attn_output + residual``).
_ATTN_OUTPUT_LOCAL = frozenset({"gpt2"})


def _dense_mlp_forward_bytes(spec: ModelSpec, strategy: Strategy) -> int | None:
    """What a non-gated MLP (fc1 → activation → fc2: GPT-2, Phi-2, NeoX, Falcon, BERT, StarCoder2) holds at the
    worst moment of a checkpointed forward, which saves nothing, under a LoRA adapter over a float or 4-bit base or
    in full fine-tuning (no adapter branches); ``None`` elsewhere. The layer's locals (found by the trace, in each
    model's code): a sequential block keeps the post-attention residual and norm2's output (GPT-2 its attention
    output too); a parallel block (Phi-2, Falcon, NeoX) the normed input its MLP reads and the attention's output,
    which it adds after the MLP; BERT the attention block's output, the MLP output's residual. Then the worst of

    * fc1: the base output (m·t·i: the compute dtype, or a bitsandbytes layer's input dtype) and, adapted, PEFT's
      branch — lora_B's output and its scaled copy (lora_A's matmul width each; over a 4-bit base the result's clone,
      and without autocast the branch converted to m) — over the input's cast to the adapter dtype (t·h; none over
      a 4-bit base under autocast);
    * the activation: ``F.gelu``/ReLU its input and output (2m·t·i); HF's Python GeLU (``NewGELUActivation``:
      ``0.5 * x * (1 + tanh(√(2/π)·(x + 0.044715·x³)))``) keeps x and 0.5·x while its chain runs, two neighbours
      at a time, in fp32 under autocast (``pow`` is on CUDA autocast's fp32 list; the rest follows by type
      promotion): (2m + 2·4)·t·i, else 4m·t·i — and its output is fp32 then;
    * fc2 over the activation's output g: autocast's cast of it (c·t·i when g ≠ c), the base output, and, adapted,
      ``x.to(adapter dtype)`` (a copy when g differs) with lora_A's autocast cast of that (mm·t·i) — as
      :func:`frozen_down_forward_bytes` reads a gated MLP's down projection."""
    widths = _dense_mlp_widths(spec, strategy)
    if widths is None:
        return None
    m, g = widths
    adapter = strategy.adapter
    w = Widths.of(strategy)
    t, h, i, c = strategy.tokens_per_micro_batch, spec.hidden_size, spec.intermediate_size, w.compute
    ad = adapter.dtype.bits // 8 if adapter is not None else c
    mm = c if w.amp else ad
    nb = _norm_out_width(spec, w)
    sites = adapter_sites(spec, adapter) if adapter is not None else ()
    fc1 = any(x.in_mlp and x.reads is not SiteInput.MLP_ACT for x in sites)
    fc2 = any(x.reads is SiteInput.MLP_ACT for x in sites)
    held = _dense_layer_locals(spec, strategy)
    # fc1: its input as PEFT's branch casts it to the adapter dtype (``_cast_input_dtype``: a local of ``forward``,
    # alive to the sum; dropout's output and autocast's copy for lora_A die with lora_A's call)
    quantised = strategy.base_weights.quantization is not Quantization.NONE
    # (PEFT's bitsandbytes layers cast only without autocast: ``requires_conversion``, adapters.adapter_saved)
    in_casts = (ad if nb != ad else 0) * t * h if fc1 and not (quantised and w.amp) else 0
    if fc1 and quantised and w.amp:
        # peft/tuners/lora/bnb.py Linear4bit.forward under autocast: the base result and its clone, then the clone,
        # lora_B's output scaled and their sum: two m-wide tensors and one of lora_A's matmul width at the add
        first = max(2 * m, m + 2 * mm, 2 * m + mm) * t * i
    elif fc1 and quantised:
        # without autocast: the clone, the scaled branch converted to the result's dtype (``output.to(
        # expected_dtype)``) and the sum: three m-wide tensors at the add (two and the scaled one at the conversion)
        first = max(3 * m, 2 * m + mm) * t * i + in_casts
    else:
        first = m * t * i + (2 * mm * t * i if fc1 else 0) + in_casts
    act = (2 * m + 2 * g) * t * i if spec.activation in PYTHON_GELUS else 2 * m * t * i
    cast = c * t * i if g != c else 0
    out_w = m if quantised else c
    second = g * t * i + cast + out_w * t * h
    if fc2:
        copy = ad if g != ad else 0
        second = max(second, (g + copy + mm) * t * i + out_w * t * h)
    return held + max(first, act, second)


def _dense_layer_locals(spec: ModelSpec, strategy: Strategy) -> int:
    """What a layer with a non-gated MLP holds in locals while its MLP runs (:func:`_dense_mlp_forward_bytes`)."""
    w = Widths.of(strategy)
    t, h, r, c, nb = strategy.tokens_per_micro_batch, spec.hidden_size, w.residual, w.compute, _norm_out_width(spec, w)
    if spec.model_type == "bert":
        held = r * t * h  # the attention block's (post-norm) output
    elif spec.parallel_attn:
        held = nb * t * h + c * t * h  # the normed input the MLP reads, and the attention's output
    else:
        held = r * t * h + nb * t * h
    if spec.model_type in _ATTN_OUTPUT_LOCAL:
        # and GPT2Model.forward's ``position_embeds`` (1 × s × h, the table's dtype), a local to the forward's end
        held += c * t * h + r * strategy.seq_len * h
    return held


def _post_norm(spec: ModelSpec) -> bool:
    """A post-norm encoder (BERT): every layer ends in a LayerNorm, the embeddings are normed, no final norm."""
    return spec.embedding_norm and not spec.final_norm and spec.norm is NormKind.LAYERNORM


def frozen_down_forward_bytes(spec: ModelSpec, strategy: Strategy, *, checkpointed: bool) -> int | None:
    """What a frozen gated MLP holds at its forward's worst moment (the cases of :func:`frozen_mlp_backward_bytes`;
    ``None`` elsewhere) beyond what its layer saves — or, in a ``checkpointed`` forward, which saves nothing, all of
    it. Always the layer's locals: the post-attention residual (``residual`` in HF's decoder layer; saved as itself
    only by a LayerNorm or an fp32 RMSNorm input) and the MLP's input (norm2's output: a frozen norm saves none, an
    adapter reading it saves it as itself only with no cast, no dropout and no autocast copy). Then, at the down
    projection, the product (saved by nothing) and the worse of

    * the base layer's forward: over a float base autocast's cast of the input (c·t·i when m ≠ c) and the output
      (c·t·h), and where nothing is saved the per-call cast of a weight wider than c (c·h·i); over a 4-bit base
      (``Linear4bit.forward``) the input cast to c, the dequantised weight (``matmul_4bit`` above the fused kernel's
      token count) and the output;
    * an adapted down projection's branch (PEFT ``lora.Linear.forward``), the base output (c·t·h; a 4-bit layer's
      ``.to(inp_dtype)`` makes it m wide) alive: ``x.to(adapter dtype)`` and dropout's output, held by
      ``forward``'s locals, and lora_A's input as autocast casts it (saved with the layer; where nothing is saved,
      a transient of its own).

    In a checkpointed forward gate's output dies once act(gate) is made, act(gate) and up once the product is, so
    an adapted up projection's branch can be worse: act(gate), up's base output, the branch's casts of its t·h input
    and lora_B's output and its scaled copy (the branch's width, t·i each) before the sum. What the down projection's
    adapter saves is counted with the layer; the parts not yet made at each moment are taken off."""
    mlp = _FrozenMlp.of(spec, strategy)
    if mlp is None:
        return _dense_mlp_forward_bytes(spec, strategy) if checkpointed else None
    adapter, quant, w, saved, sites = mlp.adapter, mlp.quant, mlp.w, mlp.down_saved, mlp.sites
    t, h, i, m, c, down = mlp.t, mlp.h, mlp.i, mlp.m, mlp.c, mlp.down
    ad = adapter.dtype.bits // 8
    mm = c if w.amp else ad
    nb = _norm_out_width(spec, w)
    residual_held = spec.norm is NormKind.LAYERNORM or w.residual == 4
    norm2_shared = any(x.reads is SiteInput.NORM2 for x in sites) and (
        nb == ad and adapter.dropout == 0 and not (w.amp and nb != c)
    )
    # where nothing is saved, both are plain locals
    locals_ = (
        ((0 if residual_held and not checkpointed else w.residual) + (0 if norm2_shared and not checkpointed else nb))
        * t
        * h
    )
    input_cast = c * t * i if m != c else 0
    if quant is Quantization.NONE:
        weight_cast = c * h * i if checkpointed and w.amp and base_weight_width(strategy) != c else 0
        base = input_cast + weight_cast + c * t * h
    else:
        base = input_cast + c * h * i + c * t * h
    branch = (ad if m != ad else 0) + (ad if adapter.dropout > 0 else 0)
    if checkpointed:  # nothing saved, nothing to take off; lora_A's input, when a copy, is a transient of its own
        copy = branch > 0 or (w.amp and (ad if branch else m) != c)
        not_yet, branch_extra = 0, (mm * t * i if copy else 0)
    else:
        not_yet, branch_extra = sum(saved.values()), -saved.get("lora_A_out", 0)
    moments = [m * t * i + base - not_yet]
    if down:
        out_w = m if quant is not Quantization.NONE else c
        moments.append((m + branch) * t * i + out_w * t * h + branch_extra)
    if checkpointed:
        moments.append(3 * m * t * i)  # the product made, act(gate) and up still alive
    if checkpointed and any(x.reads is SiteInput.NORM2 for x in sites):
        casts = (ad if nb != ad else 0) + (ad if adapter.dropout > 0 else 0)
        moments.append(2 * m * t * i + 2 * mm * t * i + casts * t * h)
    return locals_ + max(moments)


def frozen_head_input_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """A frozen LM head saves no input, but the final norm's output is still referenced while the logits and
    the loss are computed (the HF forward's ``hidden_states``): a transient at the forward's end. A decoder's
    classification head holds it too (``last_hidden_state`` while ``score`` and the loss run; matched to the
    trace, tests/trace/test_heads.py)."""
    classifier = spec.kind in (ModelKind.SEQ_CLS, ModelKind.TOKEN_CLS) and spec.model_type != "bert"
    w = Widths.of(strategy)
    held = _norm_out_width(spec, w) * strategy.tokens_per_micro_batch * spec.hidden_size
    if frozen_base(strategy) or classifier:
        return held
    # A trainable LM head saves its input — autocast's 16-bit cast of it when the norm's output is wider (an fp32
    # residual under autocast): the norm's own output is then still referenced, as above (NeoX, Llama; the trace).
    causal = spec.kind is ModelKind.CAUSAL_LM
    return held if causal and w.amp and _norm_out_width(spec, w) != w.compute else 0


def model_terms(spec: ModelSpec, strategy: Strategy) -> list[SavedTerm]:
    """Saved tensors outside the layers: embedding bookkeeping, shared RoPE tables, final norm and
    the LM head's input (the logits themselves are in :mod:`trainfit.analytic.logits`)."""
    w = Widths.of(strategy)
    t = strategy.tokens_per_micro_batch
    h = spec.hidden_size
    out = [SavedTerm(name="embed.input_ids", bytes=8 * t, formula="8·t (int64 ids)")]
    if spec.embedding_scale:
        out.append(SavedTerm(name="embed.scale", bytes=w.residual, formula="0-dim normalizer"))
    if spec.rotary_dim:
        # position_ids broadcast over the batch: (1, s, rotary_dim) tables.
        s = strategy.seq_len
        out.append(
            SavedTerm(
                name="rope.cos_sin", bytes=2 * w.residual * s * spec.rotary_dim, formula="2·r·s·rotary_dim (shared)"
            )
        )
    if spec.learned_positions and spec.kind is ModelKind.CAUSAL_LM:
        # GPT-2 broadcasts one arange over the batch; OPT derives positions per row from the mask.
        rows = t if spec.model_type == "opt" else strategy.seq_len
        out.append(SavedTerm(name="embed.position_ids", bytes=8 * rows, formula="8·s (int64; OPT: 8·b·s)"))
    elif spec.learned_positions:
        # BERT slices its registered position_ids / token_type_ids buffers; the slice keeps the
        # position buffer's whole storage (max_position_embeddings int64s).
        out.append(SavedTerm(name="embed.position_ids", bytes=8 * spec.learned_positions, formula="8·max_positions"))
        if spec.token_types:
            out.append(SavedTerm(name="embed.token_type_ids", bytes=8 * strategy.seq_len, formula="8·s"))
    # Under an adapter without input gradients (adapters.input_grads_enabled) the frozen embeddings' output needs
    # no gradient: their norm and dropout save nothing (BERT; matched against the trace, tests/trace/test_peft.py).
    blind = frozen_base(strategy) and not input_grads_enabled(strategy)
    if spec.embedding_norm and not blind:
        out += _norm_terms("embed_norm", t, h, spec, w)
    if spec.embedding_dropout > 0 and not blind:
        out.append(SavedTerm(name="embed.dropout_mask", bytes=t * h, formula="1·t·h"))
    if frozen_base(strategy) and input_grads_enabled(strategy) and _embedding_output_transformed(spec):
        # ``enable_input_require_grads`` makes the frozen token embedding's output a leaf that requires grad
        # (transformers modeling_utils ``make_inputs_require_grads``: ``output.requires_grad_(True)``); its
        # AccumulateGrad node holds it until the graph is freed. Where the first layer reads it as itself that is the
        # checkpoint's kept input; where positions, a norm or dropout come between, it is a tensor of its own (GPT-2,
        # BERT: found by the trace).
        out.append(SavedTerm(name="embed.leaf_output", bytes=w.residual * t * h, formula="r·t·h (grad-requiring leaf)"))
    embedding = [dataclasses.replace(x, role=TermRole.EMBEDDING) for x in out]
    out = []
    nb = _norm_out_width(spec, w)
    frozen = frozen_base(strategy)
    fz = frozen_layers(spec, strategy)
    if spec.final_norm and fz is not None and fz.final_norm_frozen:
        # --freeze norm: a frozen final norm keeps no normed output; over an input that needs no gradient
        # (every layer dead) it saves nothing at all.
        out += _norm_terms("final_norm", t, h, spec, w, frozen=True) if fz.stack_output_grad else []
    elif spec.final_norm:
        final = _norm_terms("final_norm", t, h, spec, w, frozen=frozen)
        if fz is not None and not fz.stack_output_grad and spec.norm is NormKind.RMSNORM and not spec.norm_unit_offset:
            # every layer dead: the final RMSNorm's input needs no gradient, so it keeps only ``normed`` for its
            # weight's (as :func:`blind_layer_unsaved`; found by the trace, FSDP2 forward +2.4% before)
            final = [x for x in final if x.name not in _input_grad_saves("final_norm")]
        out += final
    if spec.kind is ModelKind.MASKED_LM:
        # BERT MLM head: dense (reads the last LayerNorm output) → GeLU → LayerNorm(fp32 under AMP). Under an
        # adapter the dense is frozen (saves no input); LoRA on it (all-linear, adapters.head_sites) saves its own.
        if not frozen:
            out.append(_matmul_inputs("mlm.dense_in", t, h, 1, nb, w))
        elif strategy.adapter is not None and (sites := head_sites(spec, strategy.adapter)):
            out += [
                SavedTerm(name=f"lora.{x.name}", bytes=x.bytes, formula=x.formula)
                for x in adapter_saved(
                    sites, strategy.adapter, tokens=t, input_width={SiteInput.NORM1: nb}, amp=w.amp, compute=w.compute
                )
            ]
        out.append(SavedTerm(name="mlm.gelu_in", bytes=w.compute * t * h, formula="a·t·h"))
        ln_in = 4 if w.amp else w.compute
        out.append(SavedTerm(name="mlm.norm", bytes=ln_in * t * h + 8 * t, formula="4·t·h + 8·t"))
    if not spec.kind.has_vocab_logits:
        out += classifier_terms(spec, strategy)
    head = [dataclasses.replace(x, role=TermRole.HEAD) for x in out]
    head_input = dataclasses.replace(_matmul_inputs("lm_head_in", t, h, 1, nb, w), role=TermRole.HEAD_INPUT)
    if frozen or not spec.kind.has_vocab_logits:  # a frozen LM head keeps no input; a classifier's is above
        head_input = dataclasses.replace(head_input, bytes=0, formula="0 (frozen or no LM head)")
    return [*embedding, *head, head_input]


def _embedding_output_transformed(spec: ModelSpec) -> bool:
    """Whether anything comes between the token embedding's output and the first layer's input (not Gemma's scale:
    transformers 5's ``GemmaScaledWordEmbedding`` applies it inside the module whose output is made a leaf)."""
    return bool(spec.learned_positions or spec.embedding_norm or spec.embedding_dropout > 0)


def classifier_terms(spec: ModelSpec, strategy: Strategy) -> list[SavedTerm]:
    """What a classification head saves for backward (trainfit.arch.heads), beyond the final norm.

    * decoder ``seq-cls``: ``score`` runs over every token, so it saves its t·h input like an LM head
      (cast per call under autocast), and the row pick ``logits[arange(b), last]`` saves two b-long int64
      index tensors — transformers ``GenericForSequenceClassification.forward``;
    * BERT ``seq-cls``: the pooler's dense reads ``hidden[:, 0]``, a *view*: without autocast it saves the view,
      which keeps the whole last hidden state (r·t·h) alive; under autocast it saves its own a·b·h cast. Then
      tanh's output, dropout's bool mask and the classifier's input, each b·h — ``BertPooler``,
      ``BertForSequenceClassification``;
    * ``token-cls``: dropout on the last hidden state keeps a bool mask (t·h) and the score saves the dropped
      tensor (its a·t·h cast under autocast) — ``GenericForTokenClassification``;
    * ``none``: nothing (the assumed loss, ``last_hidden_state.mean()``, saves only a shape).
    """
    from trainfit.arch.heads import classifier_dropout, is_encoder

    w = Widths.of(strategy)
    t, b, h = strategy.tokens_per_micro_batch, strategy.micro_batch, spec.hidden_size
    nb = _norm_out_width(spec, w)
    p = classifier_dropout(spec)
    if spec.kind is ModelKind.SEQ_CLS and is_encoder(spec):
        out = [
            SavedTerm(name="pooler.dense_in", bytes=w.compute * b * h, formula="a·b·h (cast of hidden[:, 0])")
            if w.amp
            else SavedTerm(name="pooler.dense_in", bytes=nb * t * h, formula="r·t·h (hidden[:, 0] keeps its base)"),
            SavedTerm(name="pooler.tanh_out", bytes=w.compute * b * h, formula="a·b·h"),
        ]
        if p > 0:
            out.append(SavedTerm(name="classifier.dropout_mask", bytes=b * h, formula="1·b·h"))
        out.append(SavedTerm(name="classifier.input", bytes=w.compute * b * h, formula="a·b·h"))
        return out
    if spec.kind is ModelKind.SEQ_CLS:
        return [
            _matmul_inputs("score_in", t, h, 1, nb, w),
            SavedTerm(name="score.row_pick", bytes=16 * b, formula="2·8·b (int64 indices)", pieces=(8 * b, 8 * b)),
        ]
    if spec.kind is ModelKind.TOKEN_CLS:
        out = []
        if p > 0:
            out.append(SavedTerm(name="classifier.dropout_mask", bytes=t * h, formula="1·t·h"))
        out.append(_matmul_inputs("score_in", t, h, 1, nb, w))
        return out
    return []


_INT8_INPUT_NAMES = {
    SiteInput.NORM1: ("int8.norm1_out", "t·h"),
    SiteInput.NORM2: ("int8.norm2_out", "t·h"),
    SiteInput.ATTN_OUT: ("int8.attn_out", "t·d_in(o_proj)"),
    SiteInput.MLP_ACT: ("int8.mlp_act", "t·d_in(down_proj)"),
    SiteInput.Q_LATENT: ("int8.q_latent", "t·q_lora_rank"),
    SiteInput.KV_LATENT: ("int8.kv_latent", "t·kv_lora_rank"),
}


def int8_layer_inputs(spec: ModelSpec, strategy: Strategy, *, moe: bool = False) -> dict[SiteInput, SavedTerm]:
    """The distinct inputs of one layer's LLM.int8 linears (``moe``: an MoE layer's, else a dense one's), which
    ``MatMul8bitLt.forward`` keeps on ``ctx.tensors`` (bitsandbytes/autograd/_functions.py: ``(CAt, subA, A)``,
    ``A`` a view of the input) whenever an input requires grad. The int8 linears are exactly the layer's
    ``nn.Linear`` modules (transformers' ``replace_with_bnb_linear``; :func:`trainfit.analytic.adapters.layer_linears`
    lists them, :func:`trainfit.analytic.adapters.bnb_converted` packs them): the attention's projections (MLA:
    ``q_a_proj``/``kv_a_proj_with_mqa`` over norm1's output, ``q_b_proj``/``kv_b_proj`` over the normed latents,
    modeling_deepseek_v3.py ``DeepseekV3Attention.forward``), a dense MLP's or the shared experts' gate/up over
    norm2's output and down over their activation product, Qwen2-MoE's ``shared_expert_gate`` over norm2's output.
    The routers and the 3-D expert stacks are no ``nn.Linear`` and keep nothing here, so a Mixtral layer's norm2
    output is not held. Widths: what each tensor is in the trace (:func:`site_widths`: an int8 linear returns its
    input's dtype, ``int8_scaled_mm(..., dtype=A.dtype)``, and a latent norm returns the base weight's dtype
    promoted with it)."""
    w = Widths.of(strategy)
    t = strategy.tokens_per_micro_batch
    widths = site_widths(spec, strategy, w)
    out: dict[SiteInput, SavedTerm] = {}
    for site in layer_linears(spec, "moe" if moe else "dense"):
        if site.reads in out:
            continue
        name, what = _INT8_INPUT_NAMES[site.reads]
        width = widths[site.reads]
        out[site.reads] = SavedTerm(name=name, bytes=width * t * site.d_in, formula=f"{width}·{what} (int8 A)")
    return out


def int8_ctx_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """The whole stack's inputs that LLM.int8 linears keep on ``ctx``, a checkpointed forward's too. ``MatMul8bitLt``
    (bitsandbytes/autograd/_functions.py) stores its input on ``ctx.tensors``, not through
    ``save_for_backward``, so the saved-tensor hooks of non-reentrant checkpointing never see it, and the engine's
    release of a node's saved variables after it runs does not free it either: every int8 linear's input stays
    alive from the forward until the graph is freed after the whole backward, checkpointing or not. Per layer
    kind the distinct tensors of :func:`int8_layer_inputs` — a Llama layer's norm1 and norm2 outputs, the
    attention output (o_proj's input), the MLP's activation product (down_proj's input); an MoE layer's
    attention inputs and its shared experts'; MLA's normed latents too. Found in the trace of real
    ``Linear8bitLt`` layers; 0 for other bases."""
    if strategy.base_weights.quantization is not Quantization.INT8 or strategy.adapter is None:
        return 0
    return sum(
        g.count * sum(x.bytes for x in int8_layer_inputs(spec, strategy, moe=g.kind == "moe").values())
        for g in inventory(spec).layers
    )


def int8_layer_bytes(spec: ModelSpec, strategy: Strategy, *, all_inputs: bool = False) -> int:
    """The LLM.int8 inputs of the layer that saves the most (the one the moments count). Two moments need them
    apart. A checkpointed layer's recomputation makes them again on its recomputed ``MatMul8bitLt`` nodes' own
    ``ctx.tensors`` (outside the saved-tensor hooks that hand the recomputed saves to the original graph), and those
    go with the recomputed graph when the recomputation stops (torch/utils/checkpoint.py, non-reentrant:
    ``_StopRecomputationError`` once every save is back); the original forward's, in the kept inputs
    (:func:`int8_ctx_bytes`), serve the backward — so the recomputed layer keeps none of the inputs only ``ctx``
    holds (its ``int8.*`` terms in :func:`layer_terms`; a fused kernel's output or a ReLU output the recomputation
    saves anyway). And without checkpointing the bottom layer's backward holds every layer's inputs
    (:func:`int8_ctx_bytes`: a ``ctx`` attribute lives as long as its node, the nodes as long as the graph, freed
    after the whole backward), of which the bottom layer's own (``all_inputs``: every one of
    :func:`int8_layer_inputs`) are among its saves already. Both found in the trace's records. 0 for other bases."""
    if strategy.base_weights.quantization is not Quantization.INT8 or strategy.adapter is None:
        return 0
    kinds = [g.kind == "moe" for g in inventory(spec).layers]
    most = max(kinds, key=lambda moe: _sum_bytes(layer_terms(spec, strategy, moe=moe)))
    if all_inputs:
        return sum(x.bytes for x in int8_layer_inputs(spec, strategy, moe=most).values())
    return sum(x.bytes for x in layer_terms(spec, strategy, moe=most) if x.name.startswith("int8."))


def _int8_mlp(spec: ModelSpec, strategy: Strategy) -> _FrozenMlp | None:
    """The widths and down-projection saves of a dense gated MLP of LLM.int8 linears under a LoRA adapter (the
    :class:`_FrozenMlp` of :func:`int8_mlp_backward_bytes`), else None (other MLP forms, MoE layers, DoRA, other
    bases)."""
    adapter = strategy.adapter
    if (
        adapter is None
        or adapter.kind is AdapterKind.DORA
        or strategy.base_weights.quantization is not Quantization.INT8
        or spec.mlp is not MlpKind.GATED
        or (spec.moe is not None and spec.num_moe_layers)
    ):
        return None
    return _FrozenMlp.build(spec, strategy)


def int8_mlp_backward_bytes(spec: ModelSpec, strategy: Strategy) -> int | None:
    """In flight at the worst moment of a dense gated MLP's backward over LLM.int8 linears under LoRA, over the
    incoming residual gradient r·t·h and net of the saved tensors released by then — after a checkpointed layer's
    recomputation has stopped (the moments inside it: :func:`int8_dense_recompute_bytes`). As
    :func:`frozen_mlp_backward_bytes`, with bitsandbytes' ``MatMul8bitLt`` (bitsandbytes/autograd/_functions.py) for
    the base linears (m: the MLP's width, the int8 linears' input dtype, since ``int8_scaled_mm(..., dtype=A.dtype)``
    returns it; c: the compute width), each moment over t·i unless said:

    * the product's backward: its gradient, act(gate)'s and up's — 3·m (the product itself is down_proj's ``ctx.A``,
      held to the graph's end: nothing of the MLP is released but the down adapter's saves);
    * an adapted down projection's adapter branch (PEFT ``Linear8bitLt.forward`` adds it after the base output, so it
      back-propagates first): the input gradient's cast chain (:func:`lora_chain_peak`);
    * the base's ``MatMul8bitLt.backward``, the adapter's result (m) alive: ``grad_output.to(ctx.dtype_A)`` (m·t·h
      when the incoming gradient is not m wide), ``CB.to(ctx.dtype_A, copy=True)`` — the whole weight, m·h·i — and
      ``grad_output @ CB``, m·t·i; a frozen down projection reads only ``ctx`` (no saved-tensor hook), so under
      checkpointing it runs before the recomputation and only its result waits (the product's moment, or
      :func:`int8_dense_recompute_bytes`'s).

    Read off the trace's live tensors at its peak (tests/trace/test_int8.py); ``None`` where not derived."""
    mlp = _int8_mlp(spec, strategy)
    if mlp is None:
        return None
    w, saved = mlp.w, mlp.down_saved
    t, h, i, m, down = mlp.t, mlp.h, mlp.i, mlp.m, mlp.down
    released = sum(saved.values())
    branch, g_lora = _down_adapter_moments(strategy, saved, m, t, i, down)
    moments = [3 * m * t * i - released, *branch]
    checkpointed = bool(strategy.checkpoint_layout(spec.num_layers).segment_sizes)
    if down or not checkpointed:
        g_cast = m * t * h if m != w.residual else 0
        moments.append(g_lora + g_cast + m * h * i + m * t * i - released)
    return w.residual * t * h + max(moments)


def int8_dense_recompute_bytes(spec: ModelSpec, strategy: Strategy) -> tuple[int, int]:
    """(saved, in flight) inside the top dense layer's *recomputation* under an LLM.int8 base with an adapted down
    projection (a gated MLP, :func:`_int8_mlp`), at that projection's recomputed forward: the last save of the layer
    is lora_B's input, so the recomputation (torch/utils/checkpoint.py, non-reentrant: ``_StopRecomputationError``
    once every save is back) is still running, and the recomputed layer's int8 inputs — its ``MatMul8bitLt`` nodes'
    own ``ctx.tensors`` (:func:`int8_layer_bytes`), the product among them — are alive beside the original forward's.

    Saved: everything the layer saves (:func:`layer_terms`, its int8 inputs included). In flight: the layer output's
    gradient (r·t·h); the adapter output's scaled gradient, made before the recomputation because ``* scaling``
    saves nothing (lora_B's output width: the compute dtype under autocast, else the adapter's); the post-attention
    residual where no norm saves it (a 16-bit RMSNorm input). Then the worse of

    * the branch at lora_A's output (the layer's saves all made): the base output (``int8_scaled_mm(...,
      dtype=A.dtype)``: m·t·h), held by PEFT ``Linear8bitLt.forward`` while the branch runs, and with dropout what
      dropout read or made that lora_A does not save — under autocast dropout's output (m wide; lora_A saves its
      cast), without it ``x.to(adapter dtype)`` when m is not the adapter's width (lora_A saves dropout's output);
    * the base forward (the down adapter's saves not made yet, nor the base output): ``A.to(torch.float16)`` (2·t·i,
      a copy unless A is fp16) beside its int8 rows ``CA`` (t·i) and their fp32 row scales (4·t), then the output
      beside ``CA`` and the scales. The trace runs bitsandbytes' fake ``int8_scaled_mm`` (``register_fake``: the
      output only); the CUDA kernel's int32 product and fp16 dequantisation are in neither method.

    Read off the trace's records at its backward peak (tests/trace/test_int8.py). (0, 0) without checkpointing, an
    adapted down projection or a derived MLP."""
    mlp = _int8_mlp(spec, strategy)
    if mlp is None or strategy.checkpoint_segments(spec.num_layers) == 0:
        return 0, 0
    w, adapter = mlp.w, mlp.adapter
    t, h, i, m = mlp.t, mlp.h, mlp.i, mlp.m
    ad = adapter.dtype.bits // 8
    mm = w.compute if w.amp else ad
    terms = layer_terms(spec, strategy)
    lora = {x.name.removeprefix("lora."): x.bytes for x in terms if x.name.startswith("lora.")}
    down_saved = sum(mlp.down_saved.values())
    residual_held = spec.norm is NormKind.LAYERNORM or w.residual == 4
    # what the backward holds while the layer is recomputed: a frozen down projection's input gradient, else the
    # adapter output's scaled gradient
    waiting = mm * t * h if mlp.down else m * t * i
    held = w.residual * t * h + waiting + (0 if residual_held else w.residual * t * h)
    # Without an adapted down projection the recomputation stops at the product's saves, before the product is made.
    moments = [-m * t * i]
    if mlp.down:
        # with dropout, lora_A saves dropout's output (its autocast cast under amp): what it read is a local
        local = (m if w.amp else (ad if m != ad else 0)) if adapter.dropout > 0 else 0
        branch = m * t * h + local * t * i
        fp16_copy = 0 if m == 2 and strategy.recipe.compute_dtype == "fp16" else 2 * t * i
        moments += [branch, t * i + 4 * t + max(fp16_copy, m * t * h) - down_saved]
    adapted = {x.name for x in mlp.sites if x.reads is SiteInput.NORM2}
    # (site, what of the layer's saves is not made yet at its branch's output) in forward order
    for name, not_yet in (
        ("gate_proj", 3 * m * t * i + sum(b for k, b in lora.items() if k.startswith("up_proj."))),
        ("up_proj", m * t * i),
    ):
        if name in adapted:
            sums = [m + 2 * mm, 2 * m + mm] + ([3 * m] if not w.amp else [])
            moments.append(max(sums) * t * i - not_yet - m * t * i - down_saved)
    return _sum_bytes(terms), held + max(moments)


#: MoE blocks that run their shared experts after the routed ones (modeling_deepseek_v3.py ``DeepseekV3MoE.forward``:
#: ``self.experts(...)`` then ``+ self.shared_experts(residuals)``; the same in modeling_deepseek_v2.py). Qwen2-MoE runs
#: its shared expert first and its ``shared_expert_gate`` after (modeling_qwen2_moe.py ``Qwen2MoeSparseMoeBlock``).
_SHARED_AFTER_EXPERTS = frozenset({"deepseek_v2", "deepseek_v3"})


def int8_moe_recompute_bytes(spec: ModelSpec, strategy: Strategy) -> tuple[int, int]:
    """(saved, in flight) inside the top MoE layer's *recomputation* under an LLM.int8 base, at the un-permute of its
    routed experts (transformers integrations/moe.py ``grouped_mm_experts_forward``: ``weighted_out[inv_perm]``) —
    the most the recomputed layer holds at once, since its int8 inputs are dropped with its graph when the
    recomputation stops (:func:`int8_layer_bytes`), so afterwards the layer's backward holds less.

    Saved: what the layer saves (:func:`layer_terms`, its int8 inputs included) but for what its forward makes
    after the routed experts — DeepSeek's shared experts (:data:`_SHARED_AFTER_EXPERTS`: their SwiGLU and int8
    product), Qwen2-MoE's ``shared_expert_gate`` (its sigmoid, the shared output it multiplies, its adapter). In
    flight: the layer output's gradient (r·t·h); the gathered rows (w·T·h, w the experts' width, ``T = t·top_k``)
    unless an adapted gate_up keeps them; the routed output weighted and put back in token order (2·p·T·h, p the
    wider of w and the routing weights', :func:`_routing_weight_width`); where the shared experts come after the
    routed ones, their down projection's input gradient (its input's width · t·shared_i), computed before the
    recomputation starts (an int8 ``MatMul8bitLt`` backward reads only ``ctx``, no saved-tensor hook); and the block's
    locals that nothing saves: the 16-bit residual (r·t·h; an fp32 one is norm2's saved input) and the normed input
    where no int8 linear reads it. Checked against the trace's records at its backward peak (Qwen2-MoE under amp and
    pure bf16, DeepSeek-V3). (0, 0) for other bases and dense stacks."""
    if (
        strategy.base_weights.quantization is not Quantization.INT8
        or strategy.adapter is None
        or spec.moe is None
        or not spec.num_moe_layers
        or strategy.checkpoint_segments(spec.num_layers) == 0
    ):
        return 0, 0
    m, w = spec.moe, Widths.of(strategy)
    t, h = strategy.tokens_per_micro_batch, spec.hidden_size
    big_t = t * m.experts_per_token
    e = w.residual  # grouped_mm has no autocast policy: the experts' weight dtype
    if spec.model_type in _SHARED_AFTER_EXPERTS:
        after = {"mlp.shared.swiglu", "int8.mlp_act"}
    else:
        gate_lora = ("lora_in", "lora_A_out", "dropout_mask")
        after = {"mlp.shared_gate"} | {f"lora.shared_expert_gate.{x}" for x in gate_lora}
    terms = layer_terms(spec, strategy, moe=True)
    saved = sum(x.bytes for x in terms if x.name not in after)
    gathered = 0 if any(x.name == "lora.gate_up_proj.in" for x in terms) else e * big_t * h
    p = max(e, _routing_weight_width(spec, w))
    shared_grad = 0
    if spec.model_type in _SHARED_AFTER_EXPERTS and m.num_shared_experts:
        si = m.num_shared_experts * m.shared_expert_intermediate_size
        shared_grad = frozen_base_mlp_width(strategy, w) * t * si
    # The block's locals while its experts run: the residual (saved as norm2's input only when that is fp32 already,
    # else norm2 saves its own fp32 cast) and the normed input (saved when an int8 linear reads it).
    locals_ = (0 if w.residual == 4 else w.residual * t * h) + (
        0 if SiteInput.NORM2 in int8_layer_inputs(spec, strategy, moe=True) else _norm_out_width(spec, w) * t * h
    )
    return saved, w.residual * t * h + gathered + 2 * p * big_t * h + shared_grad + locals_


def _sum_bytes(terms: list[SavedTerm]) -> int:
    return sum(x.bytes for x in terms)


def checkpoint_terms(spec: ModelSpec, strategy: Strategy) -> tuple[int, int, int]:
    """(bytes kept by the checkpointed segments' inputs, number of segments, layers in the largest
    segment) under ``Strategy.checkpoint_layout`` — full (and sac, which also keeps :func:`sac_saved_terms`
    per layer): one layer per segment; sqrt: segments of ⌈L/⌈√L⌉⌉ layers covering every layer. Backward
    recomputes one segment at a time."""
    layout = strategy.checkpoint_layout(spec.num_layers)
    segments = len(layout.segment_sizes)
    w = Widths.of(strategy)
    # A post-norm encoder (BERT: every layer ends in a LayerNorm, no final norm) hands each layer the LayerNorm's
    # output, fp32 under CUDA autocast (layer_norm is on its fp32 list) whatever the base weights' dtype: a 16-bit
    # base under an adapter still keeps 4·t·h per segment (matched against the trace, tests/trace/test_peft.py).
    width = max(w.residual, 4) if _post_norm(spec) and w.amp else w.residual
    kept = segments * width * strategy.tokens_per_micro_batch * spec.hidden_size
    # --checkpointing sac: each layer also keeps its save-list outputs until its backward
    kept += spec.num_layers * sum(x.bytes for x in sac_saved_terms(spec, strategy))
    return kept, segments, layout.largest_segment


@dataclass(frozen=True, slots=True, kw_only=True)
class BackwardTemps:
    norm_bytes: int  # inside a norm's backward (the final norm's is the worst: most still saved)
    block_bytes: int  # inside a block's backward (max of its norm and MLP moments)


def derived_mlp_backward_bytes(spec: ModelSpec, strategy: Strategy) -> int | None:
    """A frozen MLP's backward moments where they are derived op by op — a gated MLP over a float or 4-bit base
    (:func:`frozen_mlp_backward_bytes`) or an LLM.int8 one (:func:`int8_mlp_backward_bytes`), a non-gated MLP
    (:func:`frozen_dense_backward_bytes`) — over the incoming residual gradient and net of the MLP's dropout mask,
    released before them; None elsewhere (the older sum of :func:`backward_temp_bytes`, the dequantised weight and the
    adapter chain)."""
    mask = strategy.tokens_per_micro_batch * spec.hidden_size if spec.hidden_dropout > 0 else 0
    for derive in (frozen_mlp_backward_bytes, int8_mlp_backward_bytes):
        value = derive(spec, strategy)
        if value is not None:
            return value - mask
    return frozen_dense_backward_bytes(spec, strategy)  # its mask taken off already


def backward_temp_bytes(spec: ModelSpec, strategy: Strategy) -> BackwardTemps:
    """Transient gradients at the worst moment of one block's backward, net of the saved tensors
    already released by then (calibrated against the fake-tensor trace, which is itself checked
    against real CPU runs — docs/accuracy.md):

    * MLP: the incoming residual gradient (r·t·h) and three intermediate-width gradients while the
      gate·up product back-propagates (grad of the product, of act(gate), of up), minus the product
      itself, already released by the down projection's backward: r·t·h + 2·a·t·i. HF's Python GeLU
      holds more (fp32 ``pow`` under autocast) and has released two saved tensors by then; MoE experts
      add the concatenated gate_up gradient.
    * HF RMSNorm's backward runs in fp32 on five t·h tensors (cast, rsqrt product, mean, pow): 20·t·h, of
      which the saved normed tensor (r·t·h) is already released at the peak: (20 − r)·t·h (measured on a real
      CPU backward, tests/analytic/test_independent_backward.py).
    """
    w = Widths.of(strategy)
    t = strategy.tokens_per_micro_batch
    h, a = spec.hidden_size, w.compute
    i = spec.intermediate_size
    python_gelu = spec.mlp is MlpKind.DENSE and spec.activation in PYTHON_GELUS
    # In flight per intermediate element, net of the saved tensors already released: the product (or,
    # for HF's Python GeLU, the fc2 input and 0.5·x) — and the MLP's residual dropout mask. A fused
    # activation (GeLU, SiLU MLP without a gate) holds the gradient of its output and its own gradient, net
    # of its output, released by fc2's backward: one tensor. ReLU's output is its own saved tensor: two.
    if python_gelu:
        in_flight = 14 - 2 * a if w.amp else 2 * a
    elif spec.mlp is MlpKind.GATED or spec.activation == "relu":
        in_flight = 2 * a
    else:
        in_flight = a
    mask = t * h if spec.hidden_dropout > 0 else 0
    mlp = w.residual * t * h + in_flight * t * i - mask
    derived = derived_mlp_backward_bytes(spec, strategy)
    if derived is not None:
        mlp = derived
    if spec.moe is not None and spec.num_moe_layers:
        # Experts run in the weight dtype. With 16-bit weights transformers uses grouped_mm over all
        # routed rows at once, and the fused gate_up output's gradient is concatenated back from its two
        # halves: two more routed·moe_i-wide tensors than a dense SwiGLU. fp32 weights take the
        # per-expert loop fallback, whose gradients in flight are those of a dense SwiGLU.
        e = w.residual
        routed_i = t * spec.moe.experts_per_token * spec.moe.expert_intermediate_size
        per_routed = 5 * e - e if e == 2 else 3 * e - e
        moe = w.residual * t * h + per_routed * routed_i
        if spec.model_type in _FP32_ROUTERS and (spec.model_type == "deepseek_v2" or not w.amp):
            # DeepSeek's fp32 routing weights promote the routed output: its backward opens with fp32 T × h
            # gradients, as over a frozen base (moe_adapter_backward_bytes)
            moe = max(moe, 8 * t * spec.moe.experts_per_token * h + w.residual * t * h)
        if frozen_base(strategy):
            moe = moe_adapter_backward_bytes(spec, strategy)
        mlp = max(mlp if spec.num_dense_layers else 0, moe)
    norm = (20 - w.residual) * t * h if spec.norm is NormKind.RMSNORM else 2 * w.residual * t * h
    # Inside a block, its norms back-propagate after its MLP has released its saved tensors, so a
    # block's norm moment nets out those.
    mlp_saved = sum(x.bytes for x in layer_terms(spec, strategy, moe=spec.num_moe_layers > 0) if x.role is TermRole.MLP)
    in_block_norm = max(0, norm - mlp_saved)
    return BackwardTemps(norm_bytes=norm, block_bytes=max(mlp, in_block_norm))


def eager_forward_moment(spec: ModelSpec, strategy: Strategy) -> tuple[int, int]:
    """(saved, transient) bytes of eager attention's score chain at its worst forward moment, beyond the
    tensors the layer saved before it: either while the softmax runs (its input, the input's fp32 copy,
    its output) or while the probabilities are cast (the output is saved; see ``EagerChain.input_held``).
    The saved part (softmax output and probabilities) is what the layer keeps; the rest is freed. (0, 0)
    for the fused SDPA kernels."""
    ch = score_chain(spec, strategy)
    if ch is None:
        return 0, 0
    at_softmax = (ch.softmax_out, ch.softmax_in + ch.input_copy)
    at_probs = (ch.softmax_out + ch.probs, ch.softmax_in if ch.input_held else 0)
    moments = [at_softmax, at_probs]
    if ch.dropout:
        # Saved: output, bool mask, the probs·v matmul's input (16-bit in eager attention, fp32 in SDPA's math
        # kernel); a wider dropout output is transient.
        a = Widths.of(strategy).compute if strategy.attention is Attention.EAGER else 4
        moments.append((ch.softmax_out + 1 + a, ch.dropout if ch.dropout != a else 0))
    saved, transient = max(moments, key=sum)
    return saved * ch.scores, transient * ch.scores


def eager_backward_moment(spec: ModelSpec, strategy: Strategy) -> tuple[int, int]:
    """(saved, transient) bytes at the softmax's backward in a layer, beyond what the layer saved before
    its softmax (everything it saved after — probabilities, attention output, MLP — is released by then).
    Saved: the softmax output. Transient: the incoming gradient converted to the output's dtype, the
    softmax backward's output, the residual-stream gradient and the gradient of the repeated v (its
    backward runs after the score chain's: repeat_kv precedes the scores in the graph). (0, 0) for the fused
    SDPA kernels."""
    ch = score_chain(spec, strategy)
    if ch is None:
        return 0, 0
    w = Widths.of(strategy)
    t = strategy.tokens_per_micro_batch
    in_flight = w.residual * t * spec.hidden_size + w.compute * t * spec.num_heads * spec.head_dim
    saved, transient = ch.softmax_out, ch.softmax_out + ch.grad_in
    if ch.dropout and 1 + 2 * ch.dropout > transient:
        # Inside dropout's backward: its mask, the incoming gradient and its output, all in its dtype.
        saved, transient = ch.softmax_out + 1, 2 * ch.dropout
    return saved * ch.scores, transient * ch.scores + in_flight


def unsaved_stack_locals_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """Inside the top layer of a forward that is not checkpointed, what the model's and the layer's Python locals
    hold that no backward saves: the layer's input (the decoder layer's ``residual``) and the embedding output (the
    model's ``inputs_embeds``), where the layer's norm saves a copy of its input instead of the input (RMSNorm over a
    16-bit residual upcasts it to fp32 first: transformers ``LlamaRMSNorm.forward``) — one tensor in a one-layer
    model. Found by the trace (Llama pure-bf16 eager, tests/trace/test_savers_trace.py)."""
    if strategy.checkpoint_segments(spec.num_layers) != 0:
        return 0
    w = Widths.of(strategy)
    if spec.norm is NormKind.LAYERNORM or w.residual == 4 or _embedding_output_transformed(spec):
        return 0
    return min(2, spec.num_layers) * w.residual * strategy.tokens_per_micro_batch * spec.hidden_size


def eager_nograd_inputs_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """Tensors a checkpointed (no-grad) forward still holds while eager attention's score chain runs: the
    normed input, q, k and v (RoPE'd q and k in the embeddings' dtype — cos/sin follow the residual
    stream, so fp32 under autocast), and repeat_kv's copies of k and v for grouped-query attention."""
    w = Widths.of(strategy)
    t = strategy.tokens_per_micro_batch
    qk = w.residual if spec.rotary_dim else w.compute
    qd, kd = spec.q_dim, spec.kv_dim
    out = w.residual * t * spec.hidden_size + qk * t * (qd + kd) + w.compute * t * kd
    if repeat_kv_copies(spec):
        out += (qk + w.compute) * t * spec.num_heads * spec.head_dim
    return out
