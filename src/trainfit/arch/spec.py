"""ModelSpec: a family-neutral description of a transformer, enough to count every parameter and
every saved activation without torch.

Field names follow Hugging Face (``hidden_size``, ``num_heads``, ``num_kv_heads``, ``head_dim``,
``intermediate_size``, ``vocab_size``, ``tie_word_embeddings``, ``num_experts``...). The per-family
translation from a ``config.json`` lives in :mod:`trainfit.arch.config`; everything downstream reads
only this object. ``hf_config`` keeps the original config so the trace engine can rebuild the real
module with transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from trainfit.errors import ConfigError

#: Largest value of any integer dimension: 2**31 − 1. No real transformer comes near it, and tensor
#: dimensions beyond it overflow the 32-bit indexing of many CUDA kernels: such a value is a typo.
MAX_DIM = 2**31 - 1


def check_dim(owner: str, name: str, value: Any, *, minimum: int = 1) -> None:
    """Raise ConfigError unless ``value`` is an int (not a bool) in [minimum, MAX_DIM]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{owner}: {name} must be a whole number, got {value!r}")
    if not minimum <= value <= MAX_DIM:
        raise ConfigError(f"{owner}: {name} must be from {minimum} to {MAX_DIM}, got {value}")


class ModelKind(StrEnum):
    """The task head on top of the layer stack (``--head``): what HF ``AutoModelFor...`` class is trained."""

    CAUSAL_LM = "causal-lm"  # *ForCausalLM: vocabulary-sized logits over every token
    MASKED_LM = "masked-lm"  # *ForMaskedLM (BERT): transform + tied decoder over every token
    SEQ_CLS = "seq-cls"  # *ForSequenceClassification: num_labels logits per sequence
    TOKEN_CLS = "token-cls"  # *ForTokenClassification: num_labels logits per token
    BASE = "none"  # AutoModel: the base model, no head (the loss is the caller's)

    @property
    def has_vocab_logits(self) -> bool:
        """Language-model heads: logits as wide as the vocabulary, and a head tied to the embeddings."""
        return self in (ModelKind.CAUSAL_LM, ModelKind.MASKED_LM)


class NormKind(StrEnum):
    RMSNORM = "rmsnorm"
    LAYERNORM = "layernorm"


class MlpKind(StrEnum):
    GATED = "gated"  # down(act(gate(x)) * up(x)): SwiGLU / GeGLU (Llama, Mistral, Qwen, Gemma)
    DENSE = "dense"  # fc2(act(fc1(x))): GPT-2, OPT, NeoX, Falcon, Phi-2, BERT


@dataclass(frozen=True, slots=True, kw_only=True)
class MoESpec:
    """Mixture-of-experts MLP (Mixtral, Qwen-MoE, DeepSeek). Experts are gated MLPs."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0  # per shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid gate on the shared expert
    num_dense_layers: int = 0  # leading dense layers (DeepSeek first_k_dense_replace)
    norm_topk_prob: bool = True  # renormalise the top-k routing weights (Mixtral always does)
    weights_in_compute_dtype: bool = False  # Qwen-MoE casts the routing weights to the logits' dtype

    def __post_init__(self) -> None:
        check_dim("MoESpec", "num_experts", self.num_experts)
        check_dim("MoESpec", "experts_per_token", self.experts_per_token)
        check_dim("MoESpec", "expert_intermediate_size", self.expert_intermediate_size)
        check_dim("MoESpec", "num_shared_experts", self.num_shared_experts, minimum=0)
        check_dim("MoESpec", "shared_expert_intermediate_size", self.shared_expert_intermediate_size, minimum=0)
        check_dim("MoESpec", "num_dense_layers", self.num_dense_layers, minimum=0)
        if self.experts_per_token > self.num_experts:
            raise ConfigError(
                f"MoESpec: experts_per_token ({self.experts_per_token}) cannot exceed num_experts ({self.num_experts})"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank q and kv projections."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamTensor:
    """One parameter tensor of the model (or of every layer of one kind)."""

    name: str
    shape: tuple[int, ...]
    matmul: bool  # used as a matmul weight (autocast casts/caches a low-precision copy of it)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    name: str
    source: str  # "catalog:llama-3.1-8b", a path, "hub:org/name" or "explicit"
    model_type: str  # HF model_type ("llama", "gpt2", ...) or "explicit"
    architecture: str  # HF class name, e.g. "LlamaForCausalLM"
    kind: ModelKind = ModelKind.CAUSAL_LM
    num_labels: int = 2  # classification heads (config.num_labels; HF's default is 2)

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool = False
    word_embed_dim: int | None = None  # token-embedding width when it differs from hidden_size (OPT)

    norm: NormKind = NormKind.RMSNORM
    norm_bias: bool = False
    norm_unit_offset: bool = False  # Gemma RMSNorm: x·rsqrt(·)·(1 + w), computed in fp32
    embedding_scale: bool = False  # Gemma multiplies embeddings by sqrt(hidden) (a 0-dim tensor)
    norms_per_layer: int = 2
    mlp: MlpKind = MlpKind.GATED
    activation: str = "silu"
    qkv_bias: bool = False
    fused_qkv: bool = False  # one matmul for q, k and v (GPT-2 c_attn, NeoX, Falcon)
    out_bias: bool = False
    mlp_bias: bool = False
    lm_head_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    parallel_attn: bool = False  # attention and MLP both read one normed input (Falcon, Phi-2, NeoX)

    learned_positions: int = 0  # rows of a learned position table (0: rotary or none)
    token_types: int = 0  # BERT token-type embeddings
    embedding_norm: bool = False  # LayerNorm after the embeddings (BERT)
    final_norm: bool = True
    rotary_dim: int = 0  # rotated dims per head (0: no RoPE)

    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0  # residual / hidden dropout inside blocks
    embedding_dropout: float = 0.0
    sliding_window: int | None = None
    sliding_layers: int = 0  # layers attending within sliding_window (Mistral: all; Qwen2: from max_window_layers)
    attn_logit_softcapping: float | None = None  # Gemma-2: tanh soft-cap on attention scores (eager only)
    final_logit_softcapping: float | None = None  # Gemma-2: tanh soft-cap on the logits
    supports_sdpa: bool = True  # transformers offers SDPA attention for this model
    # Eager attention: how many distinct [b, 1, s, s] additive masks the model materialises (Gemma-2 and
    # Qwen2 with sliding layers build a full and a sliding one; an unpadded encoder batch needs none), and
    # whether its eager softmax upcasts (``softmax(..., dtype=torch.float32)``; GPT-2 and BERT do not),
    # and whether it casts the probabilities itself (``.to(query.dtype)`` / ``.type(value.dtype)``).
    attention_masks: int = 1
    softmax_upcast: bool = True
    eager_casts_probs: bool = True  # eager casts the probabilities to q's/v's dtype before dropout (not BERT)
    eager_probs_outlive_layer: bool = False  # HF Falcon's stack loop keeps the last layer's probabilities
    # How the model calls SDPA. transformers' integration (``sdpa_attention_forward``) passes ``enable_gqa``
    # without a mask and repeats k/v with one; HF Falcon before transformers 5.25 calls SDPA itself, always with
    # a materialised mask, with one k/v head (multi-query, no enable_gqa) or k/v already expanded to every head
    # (new arch): ``arch.config._falcon_attention``.
    sdpa_gqa: bool = True
    # Autocast caches a cast only of a leaf weight; HF Falcon's Linear multiplies by ``weight.T`` (a view),
    # so its casts are per call: saved for backward without checkpointing, transient with it.
    autocast_weight_cache: bool = True
    sdpa_kv_expanded: bool = False
    sdpa_mask_always: bool = False
    use_cache: bool = True  # config.use_cache: HF builds a DynamicCache even in training unless disabled

    moe: MoESpec | None = None
    mla: MLASpec | None = None
    extra_tensors: tuple[ParamTensor, ...] = ()  # parameters outside the standard pieces (MLM head...)
    params_override: int | None = None  # explicit --params: a what-if total, not counted
    hf_config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Dimensions are ints in [1, MAX_DIM] (intermediate_size may be 0); raises ConfigError."""
        for fname in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size"):
            check_dim("ModelSpec", fname, getattr(self, fname))
        check_dim("ModelSpec", "intermediate_size", self.intermediate_size, minimum=0)
        check_dim("ModelSpec", "num_labels", self.num_labels)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"ModelSpec: num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        p = self.params_override
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or p < 1):
            raise ConfigError(f"ModelSpec: params_override must be a positive whole number, got {p!r}")
        if self.moe is not None and self.moe.num_dense_layers > self.num_layers:
            raise ConfigError(
                f"ModelSpec: {self.moe.num_dense_layers} leading dense layers but only {self.num_layers} layers"
            )

    @property
    def embed_dim(self) -> int:
        return self.word_embed_dim or self.hidden_size

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    @property
    def q_dim(self) -> int:
        """Width of the concatenated query heads."""
        if self.mla is not None:
            return self.num_heads * self.mla.qk_head_dim
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the concatenated key (= value) heads as the attention kernel sees them."""
        if self.mla is not None:
            return self.num_heads * self.mla.qk_head_dim
        return self.num_kv_heads * self.head_dim

    @property
    def num_moe_layers(self) -> int:
        return 0 if self.moe is None else self.num_layers - self.moe.num_dense_layers

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers
