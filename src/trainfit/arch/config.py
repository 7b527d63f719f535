"""Translate a Hugging Face ``config.json`` into a :class:`ModelSpec`.

One alias table maps the HF spellings of the common dimensions (``n_embd``/``d_model`` →
``hidden_size`` ...); one small function per family sets what the keys do not say (bias flags,
norm kind, tying defaults), using the defaults of the transformers config class when a key is
absent. Nothing here executes remote code: configs with ``auto_map`` are read as plain JSON.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from trainfit.arch.spec import MLASpec, MlpKind, ModelKind, ModelSpec, MoESpec, NormKind, ParamTensor
from trainfit.errors import ConfigError, UnsupportedArchitectureError

#: HF spellings of each ModelSpec dimension, first match wins.
ALIASES: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "n_embd", "d_model", "dim"),
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "num_heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "num_kv_heads": ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"),
    "intermediate_size": ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size"),
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"),
}

Config = Mapping[str, Any]


def _get(cfg: Config, field: str, default: Any = None, *, required: bool = False) -> Any:
    for key in ALIASES.get(field, (field,)):
        if cfg.get(key) is not None:
            return cfg[key]
    if required:
        spellings = " / ".join(ALIASES.get(field, (field,)))
        raise ConfigError(f"config.json has no '{spellings}' key; it is needed to compute memory")
    return default


def _dropout(cfg: Config, *keys: str, default: float = 0.0) -> float:
    """A dropout probability; ``default`` is the transformers config class's default for the key."""
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int | float):
            return float(v)
    return default


def _common(cfg: Config, *, name: str, source: str) -> dict[str, Any]:
    h = int(_get(cfg, "hidden_size", required=True))
    heads = int(_get(cfg, "num_heads", required=True))
    kv = int(_get(cfg, "num_kv_heads", heads))
    head_dim = cfg.get("head_dim") or h // heads
    archs = cfg.get("architectures") or []
    return {
        "name": name,
        "source": source,
        "model_type": str(cfg.get("model_type", "")),
        "architecture": str(archs[0]) if archs else "",
        "hidden_size": h,
        "num_layers": int(_get(cfg, "num_layers", required=True)),
        "num_heads": heads,
        "num_kv_heads": kv,
        "head_dim": int(head_dim),
        "vocab_size": int(_get(cfg, "vocab_size", required=True)),
        "max_position_embeddings": _get(cfg, "max_position_embeddings"),
        "use_cache": bool(cfg.get("use_cache", True)),
        "hf_config": dict(cfg),
    }


def _intermediate(cfg: Config, default: int | None = None) -> int:
    v = _get(cfg, "intermediate_size")
    if v is None:
        if default is None:
            raise ConfigError("config.json has no 'intermediate_size' key; it is needed to compute memory")
        return default
    return int(v)


def _rope_dim(cfg: Config, head_dim: int, fraction_key: str, default: float = 1.0) -> int:
    frac = cfg.get(fraction_key, default)
    return int(head_dim * float(frac))


# --- families -------------------------------------------------------------------------------------


def _llama_like(cfg: Config, base: dict[str, Any], *, tie_default: bool, qkv_bias: bool) -> dict[str, Any]:
    """Llama, Mistral, Qwen2/3, Gemma, Phi-3, Mixtral, Qwen-MoE: RMSNorm, RoPE, SwiGLU, GQA
    (transformers ``modeling_llama.py`` and its copies)."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    bias = bool(cfg.get("attention_bias", qkv_bias))
    act = str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu")
    return base | {
        "intermediate_size": _intermediate(cfg),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", tie_default)),
        "norm": NormKind.RMSNORM,
        "mlp": MlpKind.GATED,
        "activation": act,
        "qkv_bias": bias,
        "out_bias": bool(cfg.get("attention_bias", False)),
        "mlp_bias": bool(cfg.get("mlp_bias", False)),
        "rotary_dim": _rope_dim(cfg, base["head_dim"], "partial_rotary_factor"),
        "attention_dropout": _dropout(cfg, "attention_dropout"),
        "sliding_window": window,
        # Mistral, Mixtral, Phi-3, StarCoder2: every layer uses the sliding mask when the config sets a window.
        "sliding_layers": base["num_layers"] if window else 0,
    }


def _llama(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    return _llama_like(cfg, base, tie_default=False, qkv_bias=False)


def _qwen_masks(cfg: Config, num_layers: int, *, moe: bool = False) -> dict[str, Any]:
    """Which Qwen layers slide, as their configs build ``layer_types`` when none is given: with
    ``use_sliding_window`` (default false), Qwen2/Qwen3 slide from ``max_window_layers`` on
    (configuration_qwen2.py); Qwen2-MoE slides on even layer indices below it (configuration_qwen2_moe.py).
    Qwen2/Qwen3 build a full causal mask and, when any layer slides, a sliding one too
    (``has_sliding_layers`` in modeling_qwen2.py); Qwen2-MoE always builds both."""
    types = cfg.get("layer_types")
    if not isinstance(types, list):
        mwl = int(cfg.get("max_window_layers", 28))
        on = bool(cfg.get("use_sliding_window", False)) and cfg.get("sliding_window") is not None
        slides = [on and ((i + 1) % 2 == 1 and i < mwl if moe else i >= mwl) for i in range(num_layers)]
        types = ["sliding_attention" if x else "full_attention" for x in slides]
    sliding = sum(1 for t in types if t == "sliding_attention")
    return {
        "attention_masks": 2 if (sliding or moe) else 1,
        "sliding_window": cfg.get("sliding_window") if sliding else None,
        "sliding_layers": sliding,
    }


def _qwen2(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    # Qwen2 has q/k/v biases but no o_proj bias (modeling_qwen2.py).
    out = _llama_like(cfg, base, tie_default=False, qkv_bias=True)
    return out | {"qkv_bias": True, "out_bias": False} | _qwen_masks(cfg, base["num_layers"])


def _qwen3(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    out = _llama_like(cfg, base, tie_default=False, qkv_bias=False) | {"qk_norm": True}
    return out | _qwen_masks(cfg, base["num_layers"])


def _gemma(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    """Gemma (modeling_gemma.py): tied head, (1 + w) RMSNorm in fp32, embeddings scaled by sqrt(h)."""
    return _llama_like(cfg, base, tie_default=True, qkv_bias=False) | {
        "norm_unit_offset": True,
        "embedding_scale": True,
    }


def _gemma2(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    """Gemma-2 (modeling_gemma2.py): pre/post feed-forward norms and a post-attention norm (4 RMSNorms
    per layer); tanh soft-capping of attention scores (50) and logits (30); no SDPA attention."""
    attn_cap = cfg.get("attn_logit_softcapping", 50.0)
    final_cap = cfg.get("final_logit_softcapping", 30.0)
    return _gemma(cfg, base) | {
        "norms_per_layer": 4,
        "attn_logit_softcapping": float(attn_cap) if attn_cap else None,
        "final_logit_softcapping": float(final_cap) if final_cap else None,
        "supports_sdpa": False,
        # Gemma2Model.forward always builds both the full and the sliding-window mask; even layers slide.
        "attention_masks": 2,
        "sliding_layers": (base["num_layers"] + 1) // 2 if cfg.get("sliding_window") else 0,
    }


def _phi3(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    # Phi-3 fuses qkv_proj and gate_up_proj; no biases. Same parameter count as Llama.
    return _llama_like(cfg, base, tie_default=False, qkv_bias=False) | {"fused_qkv": True}


def _mixtral(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    out = _llama_like(cfg, base, tie_default=False, qkv_bias=False)
    moe = MoESpec(
        num_experts=int(cfg.get("num_local_experts", 8)),
        experts_per_token=int(cfg.get("num_experts_per_tok", 2)),
        expert_intermediate_size=out["intermediate_size"],
    )
    return out | {"moe": moe}


def _qwen_moe(cfg: Config, base: dict[str, Any], *, shared: bool, qkv_bias: bool) -> dict[str, Any]:
    out = _llama_like(cfg, base, tie_default=False, qkv_bias=qkv_bias)
    if qkv_bias:
        out |= {"qkv_bias": True, "out_bias": False}
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
        raise UnsupportedArchitectureError(
            "MoE configs with mlp_only_layers or decoder_sparse_step != 1 are not supported yet"
        )
    moe = MoESpec(
        num_experts=int(cfg.get("num_experts", 60)),
        experts_per_token=int(cfg.get("num_experts_per_tok", 4)),
        expert_intermediate_size=int(cfg.get("moe_intermediate_size", out["intermediate_size"])),
        num_shared_experts=1 if shared else 0,
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0)) if shared else 0,
        shared_expert_gate=shared,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        weights_in_compute_dtype=True,
    )
    return out | {"moe": moe}


def _qwen2_moe(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    return _qwen_moe(cfg, base, shared=True, qkv_bias=True) | _qwen_masks(cfg, base["num_layers"], moe=True)


def _qwen3_moe(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    # One mask function for every layer (modeling_qwen3_moe.py), sliding when the config enables it.
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    return _qwen_moe(cfg, base, shared=False, qkv_bias=False) | {
        "qk_norm": True,
        "attention_masks": 1,
        "sliding_window": window,
        "sliding_layers": base["num_layers"] if window else 0,
    }


def _deepseek(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2/V3: multi-head latent attention + dense-then-MoE stack (modeling_deepseek_v3.py).
    The multi-token-prediction layers (num_nextn_predict_layers) are not built by transformers and
    are not counted."""
    out = _llama_like(cfg, base, tie_default=False, qkv_bias=False)
    q_lora = cfg.get("q_lora_rank")
    mla = MLASpec(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(_need(cfg, "kv_lora_rank")),
        qk_nope_head_dim=int(_need(cfg, "qk_nope_head_dim")),
        qk_rope_head_dim=int(_need(cfg, "qk_rope_head_dim")),
        v_head_dim=int(_need(cfg, "v_head_dim")),
    )
    if int(cfg.get("moe_layer_freq", 1)) != 1:
        raise UnsupportedArchitectureError("DeepSeek configs with moe_layer_freq != 1 are not supported yet")
    n_shared = int(cfg.get("n_shared_experts") or 0)
    moe_i = int(_need(cfg, "moe_intermediate_size"))
    moe = MoESpec(
        num_experts=int(_need(cfg, "n_routed_experts")),
        experts_per_token=int(_need(cfg, "num_experts_per_tok")),
        expert_intermediate_size=moe_i,
        num_shared_experts=n_shared,
        shared_expert_intermediate_size=moe_i,
        num_dense_layers=int(cfg.get("first_k_dense_replace", 0)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
    )
    return out | {
        "mla": mla,
        "moe": moe,
        "num_kv_heads": base["num_heads"],
        "head_dim": mla.qk_head_dim,
        "rotary_dim": mla.qk_rope_head_dim,
    }


def _need(cfg: Config, key: str) -> Any:
    if cfg.get(key) is None:
        raise ConfigError(f"config.json has no '{key}' key; it is needed for this architecture")
    return cfg[key]


def _gpt2(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    """GPT-2 (modeling_gpt2.py): fused c_attn, Conv1D with biases, LayerNorm, learned positions, tied."""
    h = base["hidden_size"]
    return base | {
        "intermediate_size": _intermediate(cfg, 4 * h),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        "norm": NormKind.LAYERNORM,
        "norm_bias": True,
        "mlp": MlpKind.DENSE,
        "activation": str(cfg.get("activation_function", "gelu_new")),
        "qkv_bias": True,
        "fused_qkv": True,
        "out_bias": True,
        "mlp_bias": True,
        "learned_positions": int(_get(cfg, "max_position_embeddings", 1024)),
        "attention_dropout": _dropout(cfg, "attn_pdrop", default=0.1),
        "hidden_dropout": _dropout(cfg, "resid_pdrop", default=0.1),
        "embedding_dropout": _dropout(cfg, "embd_pdrop", default=0.1),
        "max_position_embeddings": int(_get(cfg, "max_position_embeddings", 1024)),
        "softmax_upcast": False,  # eager: softmax in the scores' dtype, then .type(value.dtype)
    }


def _opt(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    """OPT (modeling_opt.py): positions table has 2 extra rows (offset), optional project_in/out."""
    h = base["hidden_size"]
    proj = int(cfg.get("word_embed_proj_dim", h))
    extra: tuple[ParamTensor, ...] = ()
    if proj != h:
        extra = (
            ParamTensor(name="project_in.weight", shape=(h, proj), matmul=True),
            ParamTensor(name="project_out.weight", shape=(proj, h), matmul=True),
        )
    bias = bool(cfg.get("enable_bias", True))
    final = bool(cfg.get("do_layer_norm_before", True)) and not cfg.get("_remove_final_layer_norm", False)
    max_pos = int(_get(cfg, "max_position_embeddings", 2048))
    return base | {
        "intermediate_size": _intermediate(cfg),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        "norm": NormKind.LAYERNORM,
        "norm_bias": bool(cfg.get("layer_norm_elementwise_affine", True)),
        "mlp": MlpKind.DENSE,
        "activation": str(cfg.get("activation_function", "relu")),
        "qkv_bias": bias,
        "out_bias": bias,
        "mlp_bias": bias,
        "learned_positions": max_pos + 2,
        "final_norm": final,
        "attention_dropout": _dropout(cfg, "attention_dropout"),
        "hidden_dropout": _dropout(cfg, "dropout", default=0.1),
        "extra_tensors": extra,
        "word_embed_dim": proj if proj != h else None,
    }


def _gpt_neox(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", True))
    return base | {
        "intermediate_size": _intermediate(cfg),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "norm": NormKind.LAYERNORM,
        "norm_bias": True,
        "mlp": MlpKind.DENSE,
        "activation": str(cfg.get("hidden_act", "gelu")),
        "qkv_bias": bias,
        "fused_qkv": True,
        "out_bias": bias,
        "mlp_bias": True,
        "parallel_attn": bool(cfg.get("use_parallel_residual", True)),
        "rotary_dim": _rope_dim(cfg, base["head_dim"], "rotary_pct", 0.25),
        "attention_dropout": _dropout(cfg, "attention_dropout"),
        "hidden_dropout": _dropout(cfg, "hidden_dropout"),
    }


def _falcon(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    """Falcon (modeling_falcon.py): fused qkv; multi-query unless new_decoder_architecture; one
    LayerNorm per layer with parallel attention (two, ln_attn/ln_mlp, in the new architecture)."""
    h = base["hidden_size"]
    new_arch = bool(cfg.get("new_decoder_architecture", False))
    if new_arch:
        kv = int(cfg.get("num_kv_heads") or base["num_heads"])
    elif cfg.get("multi_query", True):
        kv = 1
    else:
        kv = base["num_heads"]
    if cfg.get("alibi"):
        raise UnsupportedArchitectureError("Falcon with ALiBi attention is not supported yet")
    parallel = bool(cfg.get("parallel_attn", True))
    bias = bool(cfg.get("bias", False))
    return base | {
        "num_kv_heads": kv,
        "intermediate_size": int(cfg.get("ffn_hidden_size") or 4 * h),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        "norm": NormKind.LAYERNORM,
        "norm_bias": True,
        "norms_per_layer": 2 if (new_arch or not parallel) else 1,
        "mlp": MlpKind.DENSE,
        "activation": str(cfg.get("activation", "gelu")),
        "qkv_bias": bias,
        "fused_qkv": True,
        "out_bias": bias,
        "mlp_bias": bias,
        "parallel_attn": parallel,
        "rotary_dim": base["head_dim"],
        "attention_dropout": _dropout(cfg, "attention_dropout"),
        "hidden_dropout": _dropout(cfg, "hidden_dropout"),
        # Eager: softmax(scores + mask, dtype=hidden_states.dtype) — no upcast beyond the residual dtype, no
        # cast of the probabilities (probs·v casts under autocast), no dropout without ALiBi.
        "softmax_upcast": False,
        "eager_casts_probs": False,
        # FalconModel's loop holds the previous block's outputs, its attention probabilities included, until
        # the next block returns.
        "eager_probs_outlive_layer": True,
        # FalconModel builds its mask with allow_is_causal_skip=False and FalconAttention calls SDPA itself.
        "sdpa_gqa": False,
        "sdpa_kv_expanded": new_arch,
        "sdpa_mask_always": True,
        "autocast_weight_cache": False,  # FalconLinear: input @ self.weight.T
    }


def _phi(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    """Phi-1/2 (modeling_phi.py): one LayerNorm, parallel attention+MLP, partial RoPE, lm_head bias."""
    if cfg.get("qk_layernorm"):
        raise UnsupportedArchitectureError("Phi with qk_layernorm=true is not supported yet")
    return base | {
        "intermediate_size": _intermediate(cfg),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "norm": NormKind.LAYERNORM,
        "norm_bias": True,
        "norms_per_layer": 1,
        "mlp": MlpKind.DENSE,
        "activation": str(cfg.get("hidden_act", "gelu_new")),
        "qkv_bias": True,
        "out_bias": True,
        "mlp_bias": True,
        "lm_head_bias": True,
        "parallel_attn": True,
        "rotary_dim": _rope_dim(cfg, base["head_dim"], "partial_rotary_factor", 0.5),
        "attention_dropout": _dropout(cfg, "attention_dropout"),
        "hidden_dropout": _dropout(cfg, "resid_pdrop"),
        "embedding_dropout": _dropout(cfg, "embd_pdrop"),
    }


def _starcoder2(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    bias = bool(cfg.get("use_bias", True))
    return base | {
        "intermediate_size": _intermediate(cfg),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        "norm": NormKind.LAYERNORM,
        "norm_bias": True,
        "mlp": MlpKind.DENSE,
        "activation": str(cfg.get("hidden_act", "gelu_pytorch_tanh")),
        "qkv_bias": bias,
        "out_bias": bias,
        "mlp_bias": bias,
        "rotary_dim": base["head_dim"],
        "attention_dropout": _dropout(cfg, "attention_dropout"),
        "hidden_dropout": _dropout(cfg, "residual_dropout"),
        "embedding_dropout": _dropout(cfg, "embedding_dropout"),
        "sliding_window": cfg.get("sliding_window"),
        "sliding_layers": base["num_layers"] if cfg.get("sliding_window") else 0,
    }


def _bert(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    """BERT for masked LM (modeling_bert.py): post-norm encoder, learned + token-type embeddings
    with a LayerNorm, MLM head = dense + LayerNorm + tied decoder with its own bias; no pooler."""
    h = base["hidden_size"]
    v = base["vocab_size"]
    head = (
        ParamTensor(name="cls.predictions.transform.dense.weight", shape=(h, h), matmul=True),
        ParamTensor(name="cls.predictions.transform.dense.bias", shape=(h,), matmul=False),
        ParamTensor(name="cls.predictions.transform.LayerNorm.weight", shape=(h,), matmul=False),
        ParamTensor(name="cls.predictions.transform.LayerNorm.bias", shape=(h,), matmul=False),
        ParamTensor(name="cls.predictions.bias", shape=(v,), matmul=False),
    )
    return base | {
        "kind": ModelKind.MASKED_LM,
        "use_cache": False,  # encoders build no KV cache
        # An unpadded batch needs no bidirectional mask; the eager softmax keeps the scores' dtype.
        "attention_masks": 0,
        "softmax_upcast": False,
        "eager_casts_probs": False,
        "intermediate_size": _intermediate(cfg),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        "norm": NormKind.LAYERNORM,
        "norm_bias": True,
        "mlp": MlpKind.DENSE,
        "activation": str(cfg.get("hidden_act", "gelu")),
        "qkv_bias": True,
        "out_bias": True,
        "mlp_bias": True,
        "learned_positions": int(_get(cfg, "max_position_embeddings", 512)),
        "token_types": int(cfg.get("type_vocab_size", 2)),
        "embedding_norm": True,
        "final_norm": False,
        "attention_dropout": _dropout(cfg, "attention_probs_dropout_prob", default=0.1),
        "hidden_dropout": _dropout(cfg, "hidden_dropout_prob", default=0.1),
        "embedding_dropout": _dropout(cfg, "hidden_dropout_prob", default=0.1),
        "extra_tensors": head,
    }


FAMILIES: dict[str, Callable[[Config, dict[str, Any]], dict[str, Any]]] = {
    "llama": _llama,
    "mistral": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "phi3": _phi3,
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "gpt2": _gpt2,
    "opt": _opt,
    "gpt_neox": _gpt_neox,
    "falcon": _falcon,
    "phi": _phi,
    "starcoder2": _starcoder2,
    "bert": _bert,
}

#: Architectures whose config lacks ``model_type`` (old GPT-2 revisions) → family.
_ARCH_TO_TYPE = {"GPT2LMHeadModel": "gpt2", "BertForMaskedLM": "bert"}


def spec_from_config(cfg: Config, *, name: str, source: str) -> ModelSpec:
    """Build a ModelSpec from a parsed config.json. Raises ConfigError / UnsupportedArchitectureError."""
    if not isinstance(cfg, Mapping):
        raise ConfigError("config.json must hold a JSON object")
    model_type = cfg.get("model_type")
    if not model_type:
        for arch in cfg.get("architectures") or []:
            if arch in _ARCH_TO_TYPE:
                model_type = _ARCH_TO_TYPE[arch]
                break
    if not model_type:
        raise ConfigError("config.json has no 'model_type' key; add it (e.g. \"llama\") or use --params")
    if model_type not in FAMILIES:
        raise UnsupportedArchitectureError(
            f"model_type '{model_type}' is not supported; supported: {', '.join(sorted(FAMILIES))}. "
            "For a what-if estimate give --params, --hidden-size and --num-layers instead."
        )
    base = _common(cfg, name=name, source=source)
    base["model_type"] = model_type
    fields = FAMILIES[model_type](cfg, base)
    try:
        return ModelSpec(**fields)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config.json is inconsistent: {exc}") from None
