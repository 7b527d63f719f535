"""Exact parameter inventory of a ModelSpec, tensor by tensor, without torch.

The inventory lists every parameter tensor once (tied weights once) with its shape, split into
model-level tensors and per-layer tensors for each kind of layer (dense / MoE). Counts equal
``sum(p.numel() for p in model.parameters())`` of the transformers module built on the ``meta``
device for every catalog model (tested). Shapes matter beyond the total: Adafactor's factored
states, bitsandbytes' small-tensor fallback and autocast's weight copies all depend on them.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainfit._memo import Memo, spec_key
from trainfit.arch.spec import MlpKind, ModelSpec, NormKind, ParamTensor


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerGroup:
    kind: str  # "dense" | "moe"
    count: int
    tensors: tuple[ParamTensor, ...]

    @property
    def params_per_layer(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def params(self) -> int:
        return self.count * self.params_per_layer


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamInventory:
    model_tensors: tuple[ParamTensor, ...]
    layers: tuple[LayerGroup, ...]

    @property
    def total(self) -> int:
        return sum(t.numel for t in self.model_tensors) + sum(g.params for g in self.layers)

    @property
    def matmul_params(self) -> int:
        """Parameters used as matmul weights (autocast keeps a low-precision copy of each)."""
        return sum(t.numel for t in self.model_tensors if t.matmul) + sum(
            g.count * sum(t.numel for t in g.tensors if t.matmul) for g in self.layers
        )

    @property
    def embedding_params(self) -> int:
        return sum(t.numel for t in self.model_tensors if t.name.startswith("embed"))

    def all_tensors(self) -> list[tuple[ParamTensor, int]]:
        """(tensor, multiplicity) pairs covering every parameter."""
        out = [(t, 1) for t in self.model_tensors]
        for g in self.layers:
            out.extend((t, g.count) for t in g.tensors)
        return out


def _linear(name: str, n_in: int, n_out: int, bias: bool) -> list[ParamTensor]:
    out = [ParamTensor(name=f"{name}.weight", shape=(n_out, n_in), matmul=True)]
    if bias:
        out.append(ParamTensor(name=f"{name}.bias", shape=(n_out,), matmul=False))
    return out


def _norm(name: str, width: int, spec: ModelSpec) -> list[ParamTensor]:
    out = [ParamTensor(name=f"{name}.weight", shape=(width,), matmul=False)]
    if spec.norm is NormKind.LAYERNORM and spec.norm_bias:
        out.append(ParamTensor(name=f"{name}.bias", shape=(width,), matmul=False))
    return out


def _attention(spec: ModelSpec) -> list[ParamTensor]:
    h = spec.hidden_size
    if spec.mla is not None:
        m = spec.mla
        out: list[ParamTensor] = []
        qk = spec.num_heads * m.qk_head_dim
        if m.q_lora_rank:
            out += _linear("attn.q_a_proj", h, m.q_lora_rank, False)
            out.append(ParamTensor(name="attn.q_a_layernorm.weight", shape=(m.q_lora_rank,), matmul=False))
            out += _linear("attn.q_b_proj", m.q_lora_rank, qk, False)
        else:
            out += _linear("attn.q_proj", h, qk, False)
        out += _linear("attn.kv_a_proj_with_mqa", h, m.kv_lora_rank + m.qk_rope_head_dim, False)
        out.append(ParamTensor(name="attn.kv_a_layernorm.weight", shape=(m.kv_lora_rank,), matmul=False))
        out += _linear("attn.kv_b_proj", m.kv_lora_rank, spec.num_heads * (m.qk_nope_head_dim + m.v_head_dim), False)
        out += _linear("attn.o_proj", spec.num_heads * m.v_head_dim, h, False)
        return out
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    if spec.fused_qkv:
        out = _linear("attn.qkv_proj", h, q + 2 * kv, spec.qkv_bias)
    else:
        out = (
            _linear("attn.q_proj", h, q, spec.qkv_bias)
            + _linear("attn.k_proj", h, kv, spec.qkv_bias)
            + _linear("attn.v_proj", h, kv, spec.qkv_bias)
        )
    if spec.qk_norm:
        out += [
            ParamTensor(name="attn.q_norm.weight", shape=(spec.head_dim,), matmul=False),
            ParamTensor(name="attn.k_norm.weight", shape=(spec.head_dim,), matmul=False),
        ]
    return out + _linear("attn.o_proj", q, h, spec.out_bias)


def _mlp(name: str, spec: ModelSpec, inter: int, *, bias: bool) -> list[ParamTensor]:
    h = spec.hidden_size
    if spec.mlp is MlpKind.GATED:
        return (
            _linear(f"{name}.gate_proj", h, inter, bias)
            + _linear(f"{name}.up_proj", h, inter, bias)
            + _linear(f"{name}.down_proj", inter, h, bias)
        )
    return _linear(f"{name}.fc1", h, inter, bias) + _linear(f"{name}.fc2", inter, h, bias)


def _moe(spec: ModelSpec) -> list[ParamTensor]:
    assert spec.moe is not None
    m, h = spec.moe, spec.hidden_size
    out = [
        ParamTensor(name="mlp.router.weight", shape=(m.num_experts, h), matmul=True),
        # Stored fused as in transformers 5 (experts.gate_up_proj / experts.down_proj) and multiplied by
        # grouped_mm, which has no autocast policy: transformers casts the *input* to the weight dtype
        # (integrations/moe.py ``_grouped_mm``), so autocast makes no 16-bit copy of expert weights.
        ParamTensor(
            name="mlp.experts.gate_up_proj",
            shape=(m.num_experts, 2 * m.expert_intermediate_size, h),
            matmul=False,
        ),
        ParamTensor(name="mlp.experts.down_proj", shape=(m.num_experts, h, m.expert_intermediate_size), matmul=False),
    ]
    if m.num_shared_experts:
        shared_i = m.num_shared_experts * m.shared_expert_intermediate_size
        out += _mlp("mlp.shared_experts", spec, shared_i, bias=False)
        if m.shared_expert_gate:
            out += _linear("mlp.shared_expert_gate", h, 1, False)
    return out


def _layer(spec: ModelSpec, *, moe: bool) -> tuple[ParamTensor, ...]:
    tensors = _attention(spec)
    tensors += _moe(spec) if moe else _mlp("mlp", spec, spec.intermediate_size, bias=spec.mlp_bias)
    for i in range(spec.norms_per_layer):
        tensors += _norm(f"norm{i + 1}", spec.hidden_size, spec)
    return tuple(tensors)


#: The analytic model asks for the same inventory many times per estimate, the planner thousands of times.
_INVENTORIES: Memo[ParamInventory] = Memo(64)


def inventory(spec: ModelSpec) -> ParamInventory:
    """Every parameter tensor of ``spec`` (tied embeddings counted once); immutable, memoised."""
    return _INVENTORIES.get(spec_key(spec), lambda: _build_inventory(spec))


def _build_inventory(spec: ModelSpec) -> ParamInventory:
    h, v = spec.hidden_size, spec.vocab_size
    # The token embedding doubles as the LM head when tied: mark it as a matmul weight then.
    # A classification or headless model (trainfit.arch.heads) has no vocabulary-sized head at all.
    lm = spec.kind.has_vocab_logits
    model: list[ParamTensor] = [
        ParamTensor(name="embed_tokens.weight", shape=(v, spec.embed_dim), matmul=spec.tie_word_embeddings and lm)
    ]
    if spec.learned_positions:
        model.append(ParamTensor(name="embed_positions.weight", shape=(spec.learned_positions, h), matmul=False))
    if spec.token_types:
        model.append(ParamTensor(name="embed_token_types.weight", shape=(spec.token_types, h), matmul=False))
    if spec.embedding_norm:
        model += _norm("embed_norm", h, spec)
    if spec.final_norm:
        model += _norm("final_norm", h, spec)
    if not lm:
        pass
    elif not spec.tie_word_embeddings:
        model += _linear("lm_head", h, v, spec.lm_head_bias)
    elif spec.lm_head_bias:
        model.append(ParamTensor(name="lm_head.bias", shape=(v,), matmul=False))
    model += spec.extra_tensors

    groups = []
    if spec.num_dense_layers:
        groups.append(LayerGroup(kind="dense", count=spec.num_dense_layers, tensors=_layer(spec, moe=False)))
    if spec.num_moe_layers:
        groups.append(LayerGroup(kind="moe", count=spec.num_moe_layers, tensors=_layer(spec, moe=True)))
    return ParamInventory(model_tensors=tuple(model), layers=tuple(groups))


def count_params(spec: ModelSpec) -> int:
    """Total parameters (the explicit ``--params`` value when given)."""
    if spec.params_override is not None:
        return spec.params_override
    return inventory(spec).total


#: Why bitsandbytes leaves the experts of :func:`fused_expert_params` unquantised, as the warnings word it.
FUSED_EXPERTS_NOT_BNB = (
    "transformers 5 stores them as 3-D nn.Parameter tensors, which bitsandbytes' replace_with_bnb_linear does not "
    "convert (it quantises nn.Linear modules)"
)


def fused_expert_params(spec: ModelSpec) -> int:
    """Parameters in an MoE's fused expert tensors (transformers 5 ``experts.gate_up_proj`` / ``down_proj``, 3-D
    ``nn.Parameter``s, not ``nn.Linear``): what bitsandbytes' ``replace_with_bnb_linear`` leaves unquantised. 0 for a
    dense model."""
    return sum(
        t.numel * g.count
        for g in inventory(spec).layers
        for t in g.tensors
        if t.name.startswith("mlp.experts.") and len(t.shape) == 3
    )


def active_params_per_token(spec: ModelSpec) -> int:
    """Parameters a token passes through (MoE: only top-k experts); for FLOPs and reporting."""
    inv = inventory(spec)
    total = inv.total
    if spec.moe is None:
        return total
    m = spec.moe
    per_expert = 3 * spec.hidden_size * m.expert_intermediate_size
    return total - spec.num_moe_layers * (m.num_experts - m.experts_per_token) * per_expert
