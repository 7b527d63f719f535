"""Translate a Hugging Face ``config.json`` into a :class:`ModelSpec`.

One alias table maps the HF spellings of the common dimensions (``n_embd``/``d_model`` →
``hidden_size`` ...); one small function per family sets what the keys do not say (bias flags,
norm kind, tying defaults), using the defaults of the transformers config class when a key is
absent. Nothing here executes remote code: configs with ``auto_map`` are read as plain JSON.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from typing import Any

from trainfit.arch.spec import MAX_DIM, MLASpec, MlpKind, ModelKind, ModelSpec, MoESpec, NormKind, ParamTensor
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

#: Largest value any integer key may take (``spec.MAX_DIM``, 2**31 − 1): no real transformer comes near it
#: (the widest vocabulary is ~2.6·10^5, the deepest stack ~10^2 layers); beyond it a value is a typo.
MAX_INT = MAX_DIM

#: Model types whose transformers module refuses ``hidden_size % num_attention_heads != 0`` even when the
#: config gives ``head_dim`` (transformers 5: ``validate_architecture`` of LlamaConfig, Gemma2Config,
#: DeepseekV2Config and GPTNeoXConfig; the attention modules of GPT-2, OPT, Falcon and BERT raise). The
#: other families build ``head_dim`` (given, or ``hidden_size // num_attention_heads``) wide heads.
HEADS_MUST_DIVIDE: frozenset[str] = frozenset(
    {"llama", "gemma2", "deepseek_v2", "gpt2", "opt", "gpt_neox", "falcon", "bert"}
)

#: ``head_dim`` when the config omits it: the config class's own default where it has one (Qwen3Config
#: 128, GemmaConfig/Gemma2Config 256), else ``hidden_size // num_attention_heads``.
HEAD_DIM_DEFAULTS: dict[str, int] = {"qwen3": 128, "gemma": 256, "gemma2": 256}

#: Families whose modeling code ignores a ``head_dim`` key (heads are always ``hidden_size / heads`` wide).
HEAD_DIM_IGNORED: frozenset[str] = frozenset({"gpt2", "opt", "gpt_neox", "bert"})


def _show(value: Any) -> str:
    """A short JSON rendering of a bad value for an error message."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _key(cfg: Config, field: str) -> str | None:
    """The first HF spelling of ``field`` present (not null) in ``cfg``."""
    for key in ALIASES.get(field, (field,)):
        if cfg.get(key) is not None:
            return key
    return None


def _check_int(key: str, value: Any, *, minimum: int = 1, maximum: int = MAX_INT) -> int:
    """``value`` as an int in [minimum, maximum]; JSON bools and floats are not integers (transformers'
    strict config dataclasses refuse them too, so the trace could not build such a model)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config.json: '{key}' must be a whole number, got {_show(value)}; fix it in the config")
    if not minimum <= value <= maximum:
        bound = f"at least {minimum}" if value < minimum else f"at most {maximum}"
        raise ConfigError(f"config.json: '{key}' must be {bound}, got {value}; fix it in the config")
    return value


def _get(cfg: Config, field: str, default: Any = None, *, required: bool = False) -> Any:
    key = _key(cfg, field)
    if key is not None:
        return cfg[key]
    if required:
        spellings = " / ".join(ALIASES.get(field, (field,)))
        raise ConfigError(f"config.json has no '{spellings}' key; it is needed to compute memory")
    return default


def _get_int(cfg: Config, field: str, default: Any = None, *, required: bool = False, minimum: int = 1) -> Any:
    """An integer dimension under any of its HF spellings (``default`` when absent or null)."""
    key = _key(cfg, field)
    if key is None:
        return _get(cfg, field, default, required=required)
    return _check_int(key, cfg[key], minimum=minimum)


def _int(cfg: Config, key: str, default: Any = None, *, minimum: int = 1) -> Any:
    """An integer key (``default`` when absent or null)."""
    v = cfg.get(key)
    return default if v is None else _check_int(key, v, minimum=minimum)


def _float(cfg: Config, key: str, default: Any, *, low: float = 0.0, high: float = 1.0) -> Any:
    """A real number in [low, high] (``default`` when absent or null); bools are not numbers."""
    v = cfg.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not low <= v <= high:
        raise ConfigError(
            f"config.json: '{key}' must be a number from {low:g} to {high:g}, got {_show(v)}; fix it in the config"
        )
    return float(v)


def _bool(cfg: Config, key: str, default: bool) -> bool:
    """A JSON true/false (``default`` when absent or null); 0/1 and strings are refused, as transformers does."""
    v = cfg.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ConfigError(f"config.json: '{key}' must be true or false, got {_show(v)}; fix it in the config")
    return v


def _str(cfg: Config, *keys: str, default: str) -> str:
    """The first of ``keys`` present as a string (``default`` when none is)."""
    for key in keys:
        v = cfg.get(key)
        if v is None or v == "":
            continue
        if not isinstance(v, str):
            raise ConfigError(f"config.json: '{key}' must be a string, got {_show(v)}; fix it in the config")
        return v
    return default


def _dropout(cfg: Config, *keys: str, default: float = 0.0) -> float:
    """A dropout probability; ``default`` is the transformers config class's default for the key."""
    for k in keys:
        if cfg.get(k) is not None:
            return float(_float(cfg, k, default))
    return default


def _common(cfg: Config, *, name: str, source: str, model_type: str) -> dict[str, Any]:
    h = _get_int(cfg, "hidden_size", required=True)
    heads = _get_int(cfg, "num_heads", required=True)
    kv = _get_int(cfg, "num_kv_heads", heads)
    if heads % kv:
        raise ConfigError(
            f"config.json: {heads} attention heads are not a multiple of {kv} key/value heads; fix the config"
        )
    if model_type in HEADS_MUST_DIVIDE and h % heads:
        raise ConfigError(
            f"config.json: hidden size {h} is not divisible by {heads} attention heads, which transformers "
            f"requires for '{model_type}' models; fix the config"
        )
    head_dim = None if model_type in HEAD_DIM_IGNORED else _int(cfg, "head_dim")
    if head_dim is None:
        head_dim = HEAD_DIM_DEFAULTS.get(model_type) or h // heads
    if head_dim < 1:
        raise ConfigError(
            f"config.json: {heads} attention heads are more than the hidden size {h}; give 'head_dim' or fix the config"
        )
    archs = cfg.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list):
        raise ConfigError(f"config.json: 'architectures' must be a list of class names, got {_show(archs)}")
    max_pos = _get_int(cfg, "max_position_embeddings")
    return {
        "name": name,
        "source": source,
        "model_type": model_type,
        "architecture": str(archs[0]) if archs else "",
        "hidden_size": h,
        "num_layers": _get_int(cfg, "num_layers", required=True),
        "num_heads": heads,
        "num_kv_heads": kv,
        "head_dim": head_dim,
        "vocab_size": _get_int(cfg, "vocab_size", required=True),
        "max_position_embeddings": max_pos,
        "use_cache": _bool(cfg, "use_cache", True),
        "hf_config": dict(cfg),
    }


def _intermediate(cfg: Config, default: int | None = None) -> int:
    v = _get_int(cfg, "intermediate_size", minimum=0)
    if v is None:
        if default is None:
            raise ConfigError("config.json has no 'intermediate_size' key; it is needed to compute memory")
        return default
    return int(v)


def _rope_dim(cfg: Config, head_dim: int, fraction_key: str, default: float = 1.0) -> int:
    frac = _float(cfg, fraction_key, default)
    return int(head_dim * frac)


# --- families -------------------------------------------------------------------------------------


def _llama_like(cfg: Config, base: dict[str, Any], *, tie_default: bool, qkv_bias: bool) -> dict[str, Any]:
    """Llama, Mistral, Qwen2/3, Gemma, Phi-3, Mixtral, Qwen-MoE: RMSNorm, RoPE, SwiGLU, GQA
    (transformers ``modeling_llama.py`` and its copies)."""
    window = _window(cfg) if _bool(cfg, "use_sliding_window", True) else None
    bias = _bool(cfg, "attention_bias", qkv_bias)
    act = _str(cfg, "hidden_activation", "hidden_act", default="silu")
    return base | {
        "intermediate_size": _intermediate(cfg),
        "tie_word_embeddings": _bool(cfg, "tie_word_embeddings", tie_default),
        "norm": NormKind.RMSNORM,
        "mlp": MlpKind.GATED,
        "activation": act,
        "qkv_bias": bias,
        "out_bias": _bool(cfg, "attention_bias", False),
        "mlp_bias": _bool(cfg, "mlp_bias", False),
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
    if isinstance(types, list):
        sliding = sum(1 for t in types if t == "sliding_attention")
    elif not (_bool(cfg, "use_sliding_window", False) and _window(cfg) is not None):
        sliding = 0
    else:  # counted, not listed: a list per layer would be as long as num_layers
        mwl = _int(cfg, "max_window_layers", 28, minimum=0)
        sliding = (min(mwl, num_layers) + 1) // 2 if moe else max(0, num_layers - mwl)
    return {
        "attention_masks": 2 if (sliding or moe) else 1,
        "sliding_window": _window(cfg) if sliding else None,
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
    # A null cap turns soft-capping off; an absent one takes Gemma2Config's default.
    attn_cap = _float(cfg, "attn_logit_softcapping", None, high=1e9) if "attn_logit_softcapping" in cfg else 50.0
    final_cap = _float(cfg, "final_logit_softcapping", None, high=1e9) if "final_logit_softcapping" in cfg else 30.0
    return _gemma(cfg, base) | {
        "norms_per_layer": 4,
        "attn_logit_softcapping": float(attn_cap) if attn_cap else None,
        "final_logit_softcapping": float(final_cap) if final_cap else None,
        "supports_sdpa": False,
        # Gemma2Model.forward always builds both the full and the sliding-window mask; even layers slide.
        "attention_masks": 2,
        "sliding_layers": (base["num_layers"] + 1) // 2 if _window(cfg) else 0,
    }


def _phi3(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    # Phi-3 fuses qkv_proj and gate_up_proj; no biases. Same parameter count as Llama.
    return _llama_like(cfg, base, tie_default=False, qkv_bias=False) | {"fused_qkv": True}


def _mixtral(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    out = _llama_like(cfg, base, tie_default=False, qkv_bias=False)
    n_experts, top_k = _routing(cfg, "num_local_experts", 8, 2)
    moe = MoESpec(
        num_experts=n_experts,
        experts_per_token=top_k,
        expert_intermediate_size=out["intermediate_size"],
    )
    return out | {"moe": moe}


def _qwen_moe(cfg: Config, base: dict[str, Any], *, shared: bool, qkv_bias: bool) -> dict[str, Any]:
    out = _llama_like(cfg, base, tie_default=False, qkv_bias=qkv_bias)
    if qkv_bias:
        out |= {"qkv_bias": True, "out_bias": False}
    if cfg.get("mlp_only_layers") or _int(cfg, "decoder_sparse_step", 1) != 1:
        raise UnsupportedArchitectureError(
            "MoE configs with mlp_only_layers or decoder_sparse_step != 1 are not supported yet"
        )
    n_experts, top_k = _routing(cfg, "num_experts", 60, 4)
    moe = MoESpec(
        num_experts=n_experts,
        experts_per_token=top_k,
        expert_intermediate_size=_int(cfg, "moe_intermediate_size", out["intermediate_size"]),
        num_shared_experts=1 if shared else 0,
        shared_expert_intermediate_size=_int(cfg, "shared_expert_intermediate_size", 0, minimum=0) if shared else 0,
        shared_expert_gate=shared,
        norm_topk_prob=_bool(cfg, "norm_topk_prob", False),
        weights_in_compute_dtype=True,
    )
    return out | {"moe": moe}


def _qwen2_moe(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    return _qwen_moe(cfg, base, shared=True, qkv_bias=True) | _qwen_masks(cfg, base["num_layers"], moe=True)


def _qwen3_moe(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    # One mask function for every layer (modeling_qwen3_moe.py), sliding when the config enables it.
    window = _window(cfg) if _bool(cfg, "use_sliding_window", False) else None
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
    q_lora = _int(cfg, "q_lora_rank", minimum=0)
    mla = MLASpec(
        q_lora_rank=q_lora or None,
        kv_lora_rank=_need(cfg, "kv_lora_rank"),
        qk_nope_head_dim=_need(cfg, "qk_nope_head_dim"),
        qk_rope_head_dim=_need(cfg, "qk_rope_head_dim"),
        v_head_dim=_need(cfg, "v_head_dim"),
    )
    if _int(cfg, "moe_layer_freq", 1) != 1:
        raise UnsupportedArchitectureError("DeepSeek configs with moe_layer_freq != 1 are not supported yet")
    n_shared = _int(cfg, "n_shared_experts", 0, minimum=0)
    moe_i = _need(cfg, "moe_intermediate_size")
    n_experts, top_k = _routing(cfg, "n_routed_experts", None, None)
    moe = MoESpec(
        num_experts=n_experts,
        experts_per_token=top_k,
        expert_intermediate_size=moe_i,
        num_shared_experts=n_shared,
        shared_expert_intermediate_size=moe_i,
        num_dense_layers=_int(cfg, "first_k_dense_replace", 0, minimum=0),
        # transformers 5.24 configuration_deepseek_v3.py ``norm_topk_prob: bool | None = True`` (V2's config class
        # defaults to False, and modeling_deepseek_v2.py ``DeepseekV2TopkRouter.forward`` never renormalises: the
        # key is ignored there).
        norm_topk_prob=base["model_type"] == "deepseek_v3" and _bool(cfg, "norm_topk_prob", True),
    )
    return out | {
        "mla": mla,
        "moe": moe,
        "num_kv_heads": base["num_heads"],
        "head_dim": mla.qk_head_dim,
        "rotary_dim": mla.qk_rope_head_dim,
    }


def _need(cfg: Config, key: str) -> int:
    """A required positive integer key."""
    if cfg.get(key) is None:
        raise ConfigError(f"config.json has no '{key}' key; it is needed for this architecture")
    return _check_int(key, cfg[key])


def _routing(cfg: Config, experts_key: str, experts: int | None, top_k: int | None) -> tuple[int, int]:
    """``num_experts`` and ``experts_per_token`` (defaults: the config class's; None: required): a token is
    routed to 1..num_experts experts."""
    n = _need(cfg, experts_key) if experts is None else _int(cfg, experts_key, experts)
    k = _need(cfg, "num_experts_per_tok") if top_k is None else _int(cfg, "num_experts_per_tok", top_k)
    if k > n:
        raise ConfigError(
            f"config.json: 'num_experts_per_tok' is {k} but there are only {n} experts ('{experts_key}'); "
            f"a token is routed to 1..{n} experts"
        )
    return n, k


def _window(cfg: Config) -> int | None:
    """``sliding_window`` in tokens; null (and 0, which some configs write for "none") means no window."""
    return _int(cfg, "sliding_window", minimum=0) or None


def _gpt2(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    """GPT-2 (modeling_gpt2.py): fused c_attn, Conv1D with biases, LayerNorm, learned positions, tied."""
    h = base["hidden_size"]
    return base | {
        # GPT2MLP reads only n_inner (None: 4h); an 'intermediate_size' key is not mapped onto it.
        "intermediate_size": _int(cfg, "n_inner", 4 * h, minimum=0),
        "tie_word_embeddings": _bool(cfg, "tie_word_embeddings", True),
        "norm": NormKind.LAYERNORM,
        "norm_bias": True,
        "mlp": MlpKind.DENSE,
        "activation": _str(cfg, "activation_function", default="gelu_new"),
        "qkv_bias": True,
        "fused_qkv": True,
        "out_bias": True,
        "mlp_bias": True,
        "learned_positions": _get_int(cfg, "max_position_embeddings", 1024),
        "attention_dropout": _dropout(cfg, "attn_pdrop", default=0.1),
        "hidden_dropout": _dropout(cfg, "resid_pdrop", default=0.1),
        "embedding_dropout": _dropout(cfg, "embd_pdrop", default=0.1),
        "max_position_embeddings": _get_int(cfg, "max_position_embeddings", 1024),
        "softmax_upcast": False,  # eager: softmax in the scores' dtype, then .type(value.dtype)
    }


def _opt(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    """OPT (modeling_opt.py): positions table has 2 extra rows (offset), optional project_in/out."""
    h = base["hidden_size"]
    proj = _int(cfg, "word_embed_proj_dim", h)
    extra: tuple[ParamTensor, ...] = ()
    if proj != h:
        extra = (
            ParamTensor(name="project_in.weight", shape=(h, proj), matmul=True),
            ParamTensor(name="project_out.weight", shape=(proj, h), matmul=True),
        )
    bias = _bool(cfg, "enable_bias", True)
    final = _bool(cfg, "do_layer_norm_before", True) and not _bool(cfg, "_remove_final_layer_norm", False)
    max_pos = _get_int(cfg, "max_position_embeddings", 2048)
    return base | {
        "intermediate_size": _intermediate(cfg),
        "tie_word_embeddings": _bool(cfg, "tie_word_embeddings", True),
        "norm": NormKind.LAYERNORM,
        "norm_bias": _bool(cfg, "layer_norm_elementwise_affine", True),
        "mlp": MlpKind.DENSE,
        "activation": _str(cfg, "activation_function", default="relu"),
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
    bias = _bool(cfg, "attention_bias", True)
    return base | {
        "intermediate_size": _intermediate(cfg),
        "tie_word_embeddings": _bool(cfg, "tie_word_embeddings", False),
        "norm": NormKind.LAYERNORM,
        "norm_bias": True,
        "mlp": MlpKind.DENSE,
        "activation": _str(cfg, "hidden_act", default="gelu"),
        "qkv_bias": bias,
        "fused_qkv": True,
        "out_bias": bias,
        "mlp_bias": True,
        "parallel_attn": _bool(cfg, "use_parallel_residual", True),
        "rotary_dim": _rope_dim(cfg, base["head_dim"], "rotary_pct", 0.25),
        "attention_dropout": _dropout(cfg, "attention_dropout"),
        "hidden_dropout": _dropout(cfg, "hidden_dropout"),
    }


def _falcon(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    """Falcon (modeling_falcon.py): fused qkv; multi-query unless new_decoder_architecture; one
    LayerNorm per layer with parallel attention (two, ln_attn/ln_mlp, in the new architecture)."""
    h = base["hidden_size"]
    new_arch = _bool(cfg, "new_decoder_architecture", False)
    if cfg.get("head_dim") is not None:
        raise ConfigError(
            "config.json: falcon configs cannot set 'head_dim' (transformers derives it from hidden_size and "
            "num_attention_heads and refuses the key); remove it"
        )
    if new_arch:
        kv = _int(cfg, "num_kv_heads", base["num_heads"])
        if base["num_heads"] % kv:
            raise ConfigError(
                f"config.json: {base['num_heads']} attention heads are not a multiple of {kv} key/value heads; "
                "fix the config"
            )
    elif _bool(cfg, "multi_query", True):
        kv = 1
    else:
        kv = base["num_heads"]
    if _bool(cfg, "alibi", False):
        raise UnsupportedArchitectureError("Falcon with ALiBi attention is not supported yet")
    parallel = _bool(cfg, "parallel_attn", True)
    bias = _bool(cfg, "bias", False)
    return base | {
        "num_kv_heads": kv,
        "intermediate_size": _int(cfg, "ffn_hidden_size", 4 * h),
        "tie_word_embeddings": _bool(cfg, "tie_word_embeddings", True),
        "norm": NormKind.LAYERNORM,
        "norm_bias": True,
        "norms_per_layer": 2 if (new_arch or not parallel) else 1,
        "mlp": MlpKind.DENSE,
        "activation": _str(cfg, "activation", default="gelu"),
        "qkv_bias": bias,
        "fused_qkv": True,
        "out_bias": bias,
        "mlp_bias": bias,
        "parallel_attn": parallel,
        "rotary_dim": base["head_dim"],
        "attention_dropout": _dropout(cfg, "attention_dropout"),
        "hidden_dropout": _dropout(cfg, "hidden_dropout"),
        # FalconModel's loop holds the previous block's outputs, its attention probabilities included, until
        # the next block returns; it builds its mask with allow_is_causal_skip=False (always materialised).
        "eager_probs_outlive_layer": True,
        "sdpa_mask_always": True,
        **_falcon_attention(new_arch),
        "autocast_weight_cache": False,  # FalconLinear: input @ self.weight.T
    }


#: The transformers release whose FalconAttention goes through the shared attention interface
#: (``ALL_ATTENTION_FUNCTIONS``: ``eager_attention_forward`` / ``sdpa_attention_forward``, transformers 5.25
#: modeling_falcon.py) instead of calling SDPA or its own eager softmax itself (5.24 and earlier).
FALCON_INTERFACE_RELEASE = (5, 25)


@functools.cache
def installed_transformers() -> tuple[int, int] | None:
    """(major, minor) of the installed transformers, or None when it is not installed (read from the package
    metadata: nothing is imported)."""
    from importlib import metadata

    try:
        version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None
    parts = [int(p) if p.isdigit() else 0 for p in version.split(".")[:2]]
    return (parts[0], parts[1] if len(parts) > 1 else 0)


def _falcon_attention(new_arch: bool) -> dict[str, Any]:
    """How HF Falcon's attention runs, which changed in transformers 5.25; without transformers installed,
    the current code. From 5.25 it is the shared interface's: eager softmax in fp32 cast back to q's dtype;
    SDPA through ``sdpa_attention_forward``, which (the mask being always materialised) repeats k/v to every
    head (``repeat_kv``). Before: eager ``softmax(scores + mask, dtype=hidden_states.dtype)`` — no upcast, no
    cast of the probabilities; SDPA called directly, multi-query with one k/v head and no ``enable_gqa`` (the
    math kernel), the new architecture with k/v already expanded to every head by its own ``flatten``."""
    installed = installed_transformers()
    if installed is None or installed >= FALCON_INTERFACE_RELEASE:
        return {}
    return {"softmax_upcast": False, "eager_casts_probs": False, "sdpa_gqa": False, "sdpa_kv_expanded": new_arch}


def _phi(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    """Phi-1/2 (modeling_phi.py): one LayerNorm, parallel attention+MLP, partial RoPE, lm_head bias."""
    if _bool(cfg, "qk_layernorm", False):
        raise UnsupportedArchitectureError("Phi with qk_layernorm=true is not supported yet")
    return base | {
        "intermediate_size": _intermediate(cfg),
        "tie_word_embeddings": _bool(cfg, "tie_word_embeddings", False),
        "norm": NormKind.LAYERNORM,
        "norm_bias": True,
        "norms_per_layer": 1,
        "mlp": MlpKind.DENSE,
        "activation": _str(cfg, "hidden_act", default="gelu_new"),
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
    bias = _bool(cfg, "use_bias", True)
    return base | {
        "intermediate_size": _intermediate(cfg),
        "tie_word_embeddings": _bool(cfg, "tie_word_embeddings", True),
        "norm": NormKind.LAYERNORM,
        "norm_bias": True,
        "mlp": MlpKind.DENSE,
        "activation": _str(cfg, "hidden_act", default="gelu_pytorch_tanh"),
        "qkv_bias": bias,
        "out_bias": bias,
        "mlp_bias": bias,
        "rotary_dim": base["head_dim"],
        "attention_dropout": _dropout(cfg, "attention_dropout"),
        "hidden_dropout": _dropout(cfg, "residual_dropout"),
        "embedding_dropout": _dropout(cfg, "embedding_dropout"),
        "sliding_window": _window(cfg),
        "sliding_layers": base["num_layers"] if _window(cfg) else 0,
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
        "tie_word_embeddings": _bool(cfg, "tie_word_embeddings", True),
        "norm": NormKind.LAYERNORM,
        "norm_bias": True,
        "mlp": MlpKind.DENSE,
        "activation": _str(cfg, "hidden_act", default="gelu"),
        "qkv_bias": True,
        "out_bias": True,
        "mlp_bias": True,
        "learned_positions": _get_int(cfg, "max_position_embeddings", 512),
        "token_types": _int(cfg, "type_vocab_size", 2, minimum=0),
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
        archs = cfg.get("architectures")
        for arch in archs if isinstance(archs, list) else []:
            if isinstance(arch, str) and arch in _ARCH_TO_TYPE:
                model_type = _ARCH_TO_TYPE[arch]
                break
    if not model_type:
        raise ConfigError("config.json has no 'model_type' key; add it (e.g. \"llama\") or use --params")
    if not isinstance(model_type, str):
        raise ConfigError(f"config.json: 'model_type' must be a string such as \"llama\", got {_show(model_type)}")
    if model_type not in FAMILIES:
        raise UnsupportedArchitectureError(
            f"model_type '{model_type}' is not supported; supported: {', '.join(sorted(FAMILIES))}. "
            "For a what-if estimate give --params, --hidden-size and --num-layers instead."
        )
    base = _common(cfg, name=name, source=source, model_type=model_type)
    fields = FAMILIES[model_type](cfg, base)
    moe = fields.get("moe")
    if moe is not None and moe.num_dense_layers > base["num_layers"]:
        raise ConfigError(
            f"config.json: 'first_k_dense_replace' is {moe.num_dense_layers} but the model has "
            f"{base['num_layers']} layers; fix the config"
        )
    return ModelSpec(**fields)  # validates the rest (ConfigError)
