"""Fine-tuning in the analytic model: which tensors train, what the adapters add, and what autograd saves
around a frozen linear.

**What trains.** Full fine-tuning trains every tensor; ``--freeze`` patterns (:func:`is_frozen`) take
tensors out; an adapter freezes the whole base and adds, beside each targeted linear (``d_in → d_out``), a
LoRA pair ``A`` (r × d_in) and ``B`` (d_out × r) in the adapter dtype (Hu et al. 2021; PEFT
``peft/tuners/lora/layer.py`` ``LoraLayer.update_layer``), plus DoRA's magnitude vector (d_out, Liu et al.
2024). Targets are matched as PEFT matches ``target_modules``: a module name suffix, or ``all-linear`` for
every linear inside the layers (PEFT ``_maybe_include_all_linear_layers`` also leaves the output head out).

**Layouts** (:func:`layer_linears`): the linears are named as each transformers implementation names them —
GPT-2's ``Conv1D`` ``c_attn``/``c_proj``/``c_fc`` (two ``c_proj``: ``attn.c_proj``, ``mlp.c_proj``), Falcon's and
NeoX's ``query_key_value``/``dense``/``dense_h_to_4h``/``dense_4h_to_h``, Phi-2's ``dense``, Phi-3's fused
``qkv_proj`` and ``gate_up_proj``. A fused qkv is one adapted linear reading the normed input; a parallel block
with one norm (Phi-2, Falcon-7B) feeds that normed tensor to the MLP too.

**MoE layers** (transformers 5: the router a custom module holding an ``nn.Parameter``, the experts 3-D
``gate_up_proj``/``down_proj`` parameters run by ``grouped_mm``). PEFT rewrites the config first
(peft/utils/transformers_weight_conversion.py ``_convert_peft_config_moe``): ``all-linear`` and the v4 names
(Mixtral ``gate``/``w1``/``w3``/``w2``, Qwen-MoE ``gate``/``gate_proj``/``up_proj``/``down_proj``) become
``target_parameters`` on the router weight and the expert stacks, the fused ``gate_up_proj`` at twice the rank
(``rank_pattern``; ``w1`` without ``w3`` is refused). Each is a ``ParamWrapper`` (peft/tuners/lora/layer.py):
lora_A ``r·E × d_in``, lora_B ``d_out × r·E`` (:class:`ParamSite`). Its forward parametrizes the weight for the
call (``nn.utils.parametrize``): an expert stack becomes ``baddbmm(W, B_e, A_e)`` (``_LoraFactorsProxy``, the
factors cast to the weight's dtype) — a **new full E × d_out × d_in weight**, which ``grouped_mm`` saves for the
input gradient, with its input (the weight now needs a gradient): per layer and adapted stack, the whole expert
stack again in the base dtype, the largest term; in backward its E × d_out × d_in gradient is formed before
``baddbmm``'s backward reduces it to the factors (:func:`moe_param_grad_bytes`). The router's 2-D weight takes
``W + B·A·s`` (``_LoraParameterProxy``). ``ParamWrapper`` refuses dropout and DoRA (so do we, one line). Covered:
Mixtral and Qwen3-MoE layouts (every layer MoE, no shared experts), and Qwen2-MoE, which PEFT does not convert
(``qwen2_moe`` is no key of transformers' ``_MODEL_TO_CONVERSION_PATTERN``): ``all-linear`` adapts its attention,
shared-expert linears and ``shared_expert_gate`` as ordinary layer sites, the router and experts stay frozen.
DeepSeek-V2/V3 are converted like Qwen3-MoE, and because ``all-linear`` is resolved to leaf names first
(``_resolve_string_target_modules``) the names ``gate_proj``/``up_proj``/``down_proj`` leave with the experts: the
``first_k_dense_replace`` dense MLPs and the shared experts get no adapter (:func:`_matched`), the router and expert
pairs exist in the MoE layers only (:func:`adapter_tensor_counts`). Multi-head latent attention's linears are ordinary
sites; q_b_proj and kv_b_proj read the normed latents (``SiteInput.Q_LATENT``/``KV_LATENT``; what the frozen latent
norms save: :func:`trainfit.analytic.activations.frozen_latent_terms`). Other MoE families with shared experts or
dense layers stay traced only (:func:`supports_adapters`).

**Storage of the frozen base.** A float base may be stored in its own dtype (``--base-dtype``); a quantised
one keeps every layer linear packed (bitsandbytes bytes in :func:`trainfit.cuda_facts.quantized_weight_tensors`):
transformers' ``replace_with_bnb_linear`` converts exactly ``nn.Linear`` and GPT-2's ``Conv1D`` (transposed to
(out, in)), so GPT-2, Phi-2, Phi-3 (one packed ``gate_up_proj``, :func:`packed_weight_bytes`) and NeoX are packed
like Llama; Falcon's ``FalconLinear`` subclass is not converted at all (refused, :func:`quantised_base_refusal`).
In MoE models the expert stacks and routers are no ``nn.Linear``: they stay float (and QLoRA's
``prepare_model_for_kbit_training`` makes them fp32), while MLA's linears and the shared experts are packed.
A 4-bit layer's bias ends up in the compute dtype (``Linear4bit.forward`` recasts it on its first call).
QLoRA runs PEFT's ``prepare_model_for_kbit_training`` (peft/utils/other.py), which casts every parameter that
is not 4-bit (embeddings, norms, the LM head) to fp32.

**What autograd saves** (derivatives.yaml saves an input only for the gradients it must compute; checked
against the fake-tensor trace of real PEFT modules, tests/trace/test_peft.py):

* a frozen linear saves nothing (its input gradient needs only the weight, a parameter);
* a norm with a frozen weight does not keep its normed output (``weight * normed``: only the weight is
  saved for the gradient of ``normed``);
* a frozen SwiGLU MLP keeps gate, act(gate) and up, not their product (down_proj's input); a frozen fused
  GeLU MLP keeps fc1's output, not the activation's;
* a LayerNorm over a 16-bit residual under autocast saves its own fp32 cast of the input (one per norm);
  SDPA's math kernel keeps no output for a frozen o_proj; HF's Python GeLU keeps no product for a frozen fc2;
* per adapted linear (PEFT ``lora.Linear.forward``: ``_cast_input_dtype`` then
  ``lora_B(lora_A(dropout(x))) * scaling``): the input as ``lora_A`` sees it — ``x`` itself when nothing
  casts it (then one tensor for every adapter reading it), else a new copy per module (in the adapter dtype,
  or the compute dtype under autocast) — a bool mask per module when dropout > 0 (CUDA ``native_dropout``),
  and ``lora_A``'s output (T·r) saved by ``lora_B``. Under autocast the adapters' own 16-bit weight copies
  are cached (2·r·(d_in + d_out) per module; aten ``cached_cast`` caches leaf tensors that require grad).
  These are DESIGN §4.4's closed forms, extended to every target set. DoRA adds the base and ``lora_B`` outputs
  and, with dropout, the weight its second base linear multiplied by (:func:`dora_weight_copy_bytes`); over a
  bitsandbytes base its weight norm first dequantises the weight (:func:`dora_dequant_bytes`).

Hidden states require grad from the embedding on: PEFT's ``PeftModel`` (and ``prepare_model_for_kbit_training``)
call ``enable_input_require_grads`` (peft/peft_model.py ``_prepare_model_for_gradient_checkpointing``).

**Transients.** bitsandbytes' ``MatMul4Bit.backward`` dequantises the whole weight to compute the input
gradient: one N·K tensor in the compute dtype per linear, alive during that matmul; ``MatMul8bitLt.backward``
makes it in the *input's* dtype (``CB.to(ctx.dtype_A)``; no autocast inside the Function).

**LLM.int8 saves what a frozen linear does not.** ``MatMul8bitLt.forward`` keeps its input on ``ctx.tensors``
whenever an input requires grad, outside ``save_for_backward``: every int8 linear's input is saved — per layer kind
the distinct inputs of its ``nn.Linear`` modules, MoE and MLA layers included
(:func:`trainfit.analytic.activations.int8_layer_inputs`) — until the graph is freed after the backward, and
non-reentrant checkpointing (saved-tensor hooks) cannot drop it (:func:`trainfit.analytic.activations.int8_ctx_bytes`);
a recomputation's copies go with the recomputed graph (:func:`trainfit.analytic.activations.int8_layer_bytes`).

**``--freeze``** (:class:`FrozenLayers`): a wholly frozen layer saves nothing when no gradient flows into it
(frozen embeddings, no layer checkpointing — selective recompute counts as none — no trainable layer below),
the frozen forms when one does.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from trainfit.arch.params import LayerGroup, ParamInventory, inventory
from trainfit.arch.spec import MlpKind, ModelKind, ModelSpec, ParamTensor
from trainfit.cuda_facts import allocator_bytes, quantized_weight_tensors
from trainfit.errors import StrategyError
from trainfit.strategy import ALL_LINEAR, Adapter, AdapterKind, Quantization, Strategy
from trainfit.strategy.adapters import FREEZE_GROUPS, layer_range


class SiteInput(StrEnum):
    """The tensor an adapted linear reads (adapters reading the same tensor can share it)."""

    NORM1 = "norm1"  # the attention's normed input (q, k, v)
    ATTN_OUT = "attn-out"  # the attention output (o_proj)
    NORM2 = "norm2"  # the MLP's normed input (gate, up, fc1)
    MLP_ACT = "mlp-act"  # the MLP's activation (down_proj, fc2)
    Q_LATENT = "q-latent"  # MLA: q_a_layernorm's output (q_b_proj)
    KV_LATENT = "kv-latent"  # MLA: kv_a_layernorm's output (kv_b_proj)


_INPUT_OF = {
    "q_proj": SiteInput.NORM1,
    "k_proj": SiteInput.NORM1,
    "v_proj": SiteInput.NORM1,
    "qkv_proj": SiteInput.NORM1,
    "o_proj": SiteInput.ATTN_OUT,
    "gate_proj": SiteInput.NORM2,
    "up_proj": SiteInput.NORM2,
    "fc1": SiteInput.NORM2,
    "down_proj": SiteInput.MLP_ACT,
    "fc2": SiteInput.MLP_ACT,
    "shared_expert_gate": SiteInput.NORM2,  # Qwen2-MoE: nn.Linear(h, 1)
    "q_a_proj": SiteInput.NORM1,  # MLA (modeling_deepseek_v3.py DeepseekV3Attention)
    "q_b_proj": SiteInput.Q_LATENT,
    "kv_a_proj_with_mqa": SiteInput.NORM1,
    "kv_b_proj": SiteInput.KV_LATENT,
}

#: Hugging Face module names that differ from the inventory's (OPT's out_proj is o_proj).
_HF_ALIASES = {"out_proj": "o_proj"}

_NEOX_NAMES = {"qkv_proj": "query_key_value", "o_proj": "dense", "fc1": "dense_h_to_4h", "fc2": "dense_4h_to_h"}

#: The layer linears as each transformers implementation names them (and PEFT's ``target_modules`` match them),
#: where they differ from the inventory's Llama names: GPT-2's ``Conv1D`` modules (modeling_gpt2.py ``GPT2Attention``
#: ``c_attn``/``c_proj``, ``GPT2MLP`` ``c_fc``/``c_proj`` — two ``c_proj`` per layer, told apart as ``attn.c_proj``
#: and ``mlp.c_proj``), NeoX and Falcon (``query_key_value``, ``dense``, ``dense_h_to_4h``, ``dense_4h_to_h``), Phi-2
#: (``dense``), OPT (``out_proj``), StarCoder2 (``c_fc``, ``c_proj``). Phi-3's ``gate_up_proj`` is one linear for the
#: inventory's gate and up (:func:`layer_linears`).
_HF_NAMES: dict[str, dict[str, str]] = {
    "gpt2": {"qkv_proj": "c_attn", "o_proj": "attn.c_proj", "fc1": "c_fc", "fc2": "mlp.c_proj"},
    "gpt_neox": _NEOX_NAMES,
    "falcon": _NEOX_NAMES,
    "phi": {"o_proj": "dense"},
    "opt": {"o_proj": "out_proj"},
    "starcoder2": {"fc1": "c_fc", "fc2": "c_proj"},
    # modeling_bert.py: BertSelfAttention query/key/value, BertSelfOutput.dense, BertIntermediate.dense,
    # BertOutput.dense — the suffix "output.dense" matches both outputs, "dense" all three, as in PEFT.
    "bert": {
        "q_proj": "query",
        "k_proj": "key",
        "v_proj": "value",
        "o_proj": "attention.output.dense",
        "fc1": "intermediate.dense",
        "fc2": "output.dense",
    },
}


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterSite:
    """One adapted linear of a layer: its module name, widths and the tensor it reads."""

    name: str  # as PEFT spells it: q_proj, down_proj, c_attn, attn.c_proj (when a name repeats in the layer)
    d_in: int
    d_out: int
    reads: SiteInput
    # The inventory's (Llama) name of the linear: q_proj, o_proj, gate_proj, fc1, down_proj, shared_expert_gate,
    # gate_up_proj for Phi-3's fused one; empty for a head linear.
    short: str = ""

    @property
    def in_mlp(self) -> bool:
        """A linear of the MLP (fc1/fc2, gate/up/down, Phi-3's gate_up_proj, Qwen2-MoE's shared_expert_gate), not of
        the attention — whatever tensor it reads (a parallel block's fc1 reads the attention's normed input)."""
        return self.short == "gate_up_proj" or _INPUT_OF.get(self.short) in (SiteInput.NORM2, SiteInput.MLP_ACT)

    def matches(self, target: str) -> bool:
        """PEFT's ``target_modules`` test for a module name: the full name or a ``.``-separated suffix of it
        (peft/tuners/tuners_utils.py ``check_target_module_exists``)."""
        return self.name == target or self.name.endswith("." + target) or target.endswith("." + self.name)


def finetuning(strategy: Strategy) -> bool:
    """Anything but full fine-tuning of every weight: an adapter or ``--freeze`` patterns."""
    return strategy.adapter is not None or bool(strategy.base_weights.frozen)


def _short(t: ParamTensor) -> str:
    """``attn.q_proj.weight`` → ``q_proj``."""
    parts = t.name.split(".")
    return parts[-2] if len(parts) >= 2 else parts[0]


def supports_adapters(spec: ModelSpec) -> str | None:
    """Why the analytic adapter model cannot describe ``spec`` (``None`` when it can): it covers dense layers
    (gated or fused-activation MLP) with separate or fused q/k/v projections, sequential or parallel, multi-head
    latent attention, and MoE stacks of the Mixtral / Qwen3-MoE layout (every layer MoE, routed experts only) or of
    DeepSeek's (leading dense layers, shared experts)."""
    if spec.params_override is not None:
        return "explicit --params (no tensor shapes to attach adapters to)"
    if spec.moe is not None:
        if moe_family(spec) is None and spec.model_type not in _MOE_UNCONVERTED:
            return f"mixture-of-experts layers of a {spec.model_type} model (PEFT's v5 conversion not modelled)"
        if (
            moe_family(spec) is not None
            and spec.model_type not in _DEEPSEEK
            and (spec.moe.num_shared_experts or spec.num_dense_layers)
        ):
            return (
                f"shared experts or leading dense layers beside the MoE layers of a {spec.model_type} model "
                "(modelled for DeepSeek's layout only)"
            )
    return None


#: Model types PEFT converts (transformers' conversion_mapping.py ``_MODEL_TO_CONVERSION_PATTERN``, which PEFT
#: extends with ``mixtral``) and whose conversion the closed forms cover, with their family; and PEFT's v4 name → v5
#: parameter map per family (peft/utils/transformers_weight_conversion.py ``_MOE_TARGET_MODULE_MAPPING``; ``router``
#: is ``gate.weight``). ``qwen2_moe`` itself is no key of that table: PEFT leaves a Qwen2-MoE config alone, so
#: ``all-linear`` adapts its attention and shared-expert linears only (checked on the trace).
_MOE_FAMILIES = {"mixtral": "mixtral", "qwen3_moe": "qwen2_moe", "deepseek_v2": "qwen2_moe", "deepseek_v3": "qwen2_moe"}
#: DeepSeek-V2/V3 (conversion_mapping.py maps both to the Qwen2-MoE pattern): MLA attention, ``first_k_dense_replace``
#: dense layers and shared experts, whose gate_proj/up_proj/down_proj PEFT's conversion sends to the routed experts.
_DEEPSEEK = frozenset({"deepseek_v2", "deepseek_v3"})
#: MoE model types PEFT does not convert whose layers the closed forms cover: the experts and router stay frozen.
_MOE_UNCONVERTED = frozenset({"qwen2_moe"})
_MOE_TARGETS: dict[str, dict[str, str]] = {
    "mixtral": {"gate": "router", "w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"},
    "qwen2_moe": {"gate": "router", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"},
}


def moe_family(spec: ModelSpec) -> str | None:
    """PEFT's MoE conversion family of ``spec`` (``None``: a dense model, or a family not modelled)."""
    return _MOE_FAMILIES.get(spec.model_type) if spec.moe is not None else None


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamSite:
    """A parameter PEFT adapts directly (``target_parameters``, ``ParamWrapper``): the router's 2-D weight
    (``experts`` 1) or a 3-D expert stack, with the rank per expert (doubled for the fused ``gate_up_proj``)."""

    name: str  # router | gate_up_proj | down_proj
    experts: int
    d_in: int
    d_out: int
    rank: int

    @property
    def adapter_numel(self) -> int:
        """lora_A (rank·E × d_in) plus lora_B (d_out × rank·E) — PEFT ``ParamWrapper.update_layer``."""
        return self.rank * self.experts * (self.d_in + self.d_out)

    @property
    def weight_numel(self) -> int:
        return self.experts * self.d_in * self.d_out


def moe_param_sites(spec: ModelSpec, adapter: Adapter) -> tuple[ParamSite, ...]:
    """The MoE parameters ``adapter`` reaches through PEFT's conversion (empty for a dense model): with
    ``all-linear`` the router and both expert stacks, else those the v4 names map to. Naming one half of the
    fused gate_up (``w1`` without ``w3``) is refused in one line, as PEFT refuses it."""
    family = moe_family(spec)
    if family is None:
        return ()
    assert spec.moe is not None
    m, h, r = spec.moe, spec.hidden_size, adapter.rank
    mapping = _MOE_TARGETS[family]
    wanted = set(mapping) if ALL_LINEAR in adapter.targets else set(adapter.targets) & set(mapping)
    fused = [old for old, new in mapping.items() if new == "gate_up_proj"]
    if 0 < len(wanted & set(fused)) < len(fused):
        raise StrategyError(
            f"PEFT cannot adapt {' or '.join(sorted(wanted & set(fused)))} alone in {spec.name}: transformers 5 fuses "
            f"{' and '.join(fused)} into gate_up_proj; name both"
        )
    chosen = {mapping[x] for x in wanted}
    e, i = m.num_experts, m.expert_intermediate_size
    sites = [
        ParamSite(name="router", experts=1, d_in=h, d_out=e, rank=r),
        ParamSite(name="gate_up_proj", experts=e, d_in=h, d_out=2 * i, rank=2 * r),
        ParamSite(name="down_proj", experts=e, d_in=i, d_out=h, rank=r),
    ]
    return tuple(s for s in sites if s.name in chosen)


def _layout_beyond_llama(spec: ModelSpec) -> str | None:
    if spec.fused_qkv:
        return "a fused qkv projection"
    if spec.parallel_attn:
        return "parallel attention/MLP blocks"
    return None


def frozen_forms_known(spec: ModelSpec) -> bool:
    """Whether ``--freeze``'s frozen-layer forms were checked for ``spec``'s layout: Llama-style layers (separate
    q/k/v, sequential attention and MLP) with a gated or fused-activation MLP (no MoE: an MoE layer's frozen
    form is known only beside PEFT's adapters, :func:`trainfit.analytic.activations.frozen_moe_terms`)."""
    return (
        spec.moe is None and supports_adapters(spec) is None and _layout_beyond_llama(spec) is None and mlp_frozen(spec)
    )


def layer_linears(spec: ModelSpec, kind: str = "dense") -> tuple[AdapterSite, ...]:
    """Every linear of one kind of layer (``dense``, ``moe``; the first kind the model has when it lacks that one)
    as PEFT sees it — what ``all-linear`` wraps, every ``nn.Linear``/``Conv1D`` but the output layer (PEFT
    ``_maybe_include_all_linear_layers``): its module name, widths and input. A parallel block with one norm
    (Phi-2, Falcon-7B: ``mlp(ln(x))`` beside ``attn(ln(x))``, modeling_phi.py ``PhiDecoderLayer``,
    modeling_falcon.py ``FalconDecoderLayer``) feeds the MLP the attention's normed input; NeoX and Falcon's new
    architecture norm the same ``x`` twice (two tensors). In an MoE layer of transformers 5 the router
    (``*TopKRouter``: an ``nn.Parameter``) and the experts (``*Experts``: 3-D ``gate_up_proj``/``down_proj``
    parameters run by ``grouped_mm``) are no linears: only the attention and the shared experts are."""
    names = _HF_NAMES.get(spec.model_type, {})
    mlp_in = SiteInput.NORM1 if spec.parallel_attn and spec.norms_per_layer == 1 else SiteInput.NORM2
    inv = inventory(spec)
    group = next((g for g in inv.layers if g.kind == kind), inv.layers[0])
    out: list[AdapterSite] = []
    for t in group.tensors:
        short = _short(t)
        if not t.matmul or short not in _INPUT_OF:
            continue
        reads = mlp_in if _INPUT_OF[short] is SiteInput.NORM2 else _INPUT_OF[short]
        out.append(
            AdapterSite(name=names.get(short, short), d_in=t.shape[1], d_out=t.shape[0], reads=reads, short=short)
        )
    if spec.model_type == "phi3":  # modeling_phi3.py Phi3MLP: gate_up_proj (h → 2·i), then chunk(2)
        gate, up = (next(s for s in out if s.name == n) for n in ("gate_proj", "up_proj"))
        fused = AdapterSite(
            name="gate_up_proj", d_in=gate.d_in, d_out=gate.d_out + up.d_out, reads=gate.reads, short="gate_up_proj"
        )
        out = [fused if s is gate else s for s in out if s is not up]
    return tuple(out)


def _names(site: AdapterSite, target: str, linears: tuple[AdapterSite, ...]) -> bool:
    """:meth:`AdapterSite.matches`, where a target longer than the site's name (``self_attn.q_proj``) names it only if
    no other linear of the layer is named by a longer part of the target: BERT's ``attention.output.dense`` is the
    attention's output, not the MLP's ``output.dense`` (whose full name, ``layer.N.output.dense``, it does not end)."""
    if not site.matches(target):
        return False
    if site.name == target or site.name.endswith("." + target):
        return True
    return not any(len(o.name) > len(site.name) and o.matches(target) for o in linears)


def _matched(spec: ModelSpec, adapter: Adapter, linears: tuple[AdapterSite, ...]) -> tuple[AdapterSite, ...]:
    wanted = set(adapter.targets)
    family = moe_family(spec)
    if family is None:
        return (
            linears if ALL_LINEAR in wanted else tuple(s for s in linears if any(_names(s, x, linears) for x in wanted))
        )
    # Names PEFT's MoE conversion moves to target_parameters are no target_modules any more (a Qwen-MoE
    # ``gate_proj`` names the experts, not a linear): moe_param_sites. ``all-linear`` is resolved to leaf names
    # first (``_resolve_string_target_modules``), so a DeepSeek dense MLP's and shared expert's gate_proj/up_proj/
    # down_proj leave with them: only the attention linears stay adapted (checked on the trace).
    moved = set(_MOE_TARGETS[family])
    if ALL_LINEAR in wanted:
        return tuple(s for s in linears if s.name not in moved)
    return tuple(s for s in linears if any(_names(s, x, linears) for x in wanted - moved))


def check_targets(spec: ModelSpec, adapter: Adapter) -> None:
    """Every LoRA target must name a linear of some layer of ``spec`` (PEFT refuses a target it cannot find);
    one line naming the ones that are otherwise."""
    wanted = set(adapter.targets)
    if ALL_LINEAR in wanted and len(wanted) > 1:
        raise StrategyError("give either all-linear or module names as LoRA targets, not both")
    linears = tuple(s for g in inventory(spec).layers for s in layer_linears(spec, g.kind)) + _head_linears(spec)
    family = moe_family(spec)
    moe_names = set(_MOE_TARGETS[family]) if family is not None else set()
    unknown = sorted(x for x in wanted - {ALL_LINEAR} - moe_names if not any(s.matches(x) for s in linears))
    if unknown:
        names = ", ".join(dict.fromkeys(s.name.rpartition(".")[2] for s in linears))
        experts = (
            f" (the experts are 3-D parameters, not linears: PEFT reaches them as {', '.join(sorted(moe_names))} "
            "through target_parameters, which all-linear includes on transformers 5)"
            if spec.moe is not None
            else ""
        )
        raise StrategyError(
            f"no module named {', '.join(unknown)} in {spec.name}; its linears are {names} (or all-linear){experts}"
        )


def adapter_sites(spec: ModelSpec, adapter: Adapter) -> tuple[AdapterSite, ...]:
    """The linears of one (dense) layer that ``adapter`` targets (PEFT ``target_modules`` matching). A target
    that is no module of the model, or a layout the closed forms do not cover, raises one line."""
    check_targets(spec, adapter)
    why = supports_adapters(spec)
    if why is not None:
        raise StrategyError(
            f"the analytic adapter model does not cover {spec.name} yet: it has {why}; use --method trace"
        )
    return _matched(spec, adapter, layer_linears(spec))


@dataclass(frozen=True, slots=True, kw_only=True)
class BlindLayer:
    """Which tensors of a layer need a gradient when the layer's input does not: the first layer under an adapter
    when the embeddings' output needs none (:func:`trainfit.analytic.activations.input_grads_enabled`). A tensor
    needs one once an adapter's output flows into it, and an op saves only what the gradients of its inputs that
    need one use (torch's generated autograd nodes guard each save with ``should_compute_output``,
    tools/autograd/gen_variable_type.py; a frozen op over tensors that need none makes no node at all). So the
    first layer saves nothing before its first adapter: with an attention-input target only its first norm is
    lost, with MLP-only targets its whole attention, with ``down_proj`` alone everything but the adapter and what
    follows the MLP (found against the trace of real PEFT modules, tests/trace/test_peft.py)."""

    attention: bool  # the attention core's inputs: some q/k/v (or an MLA latent's) projection carries an adapter
    q: bool  # q needs a gradient (its projection, a fused qkv or an MLA latent's carries an adapter)
    k: bool
    v: bool
    residual: bool  # the attention's output added to the residual stream (an adapted o_proj, or the above)
    mlp_in: bool  # the MLP's normed input (the residual stream, unless the block is parallel)
    gate: bool  # a gated MLP's gate output (a dense MLP's fc1 output)
    up: bool  # a gated MLP's up output (a dense MLP: = gate)
    product: bool  # the MLP's activation, the down projection's input
    mlp_out: bool  # the MLP's (or MoE block's) output
    shared_gate: bool  # Qwen2-MoE's sigmoid(shared_expert_gate(x))
    live: frozenset[SiteInput]  # the adapted linears' inputs that need a gradient

    @classmethod
    def of(cls, spec: ModelSpec, adapter: Adapter) -> BlindLayer:
        sites = adapter_sites(spec, adapter)
        shorts = {s.short for s in sites}
        q_lat, kv_lat = "q_a_proj" in shorts, "kv_a_proj_with_mqa" in shorts
        attention = any(
            s.reads in (SiteInput.NORM1, SiteInput.Q_LATENT, SiteInput.KV_LATENT) and not s.in_mlp for s in sites
        )
        residual = attention or any(s.reads is SiteInput.ATTN_OUT for s in sites)
        fused = spec.mla is not None or bool(shorts & {"qkv_proj"})  # MLA: taken whole
        q, k, v = (attention and (fused or x in shorts) for x in ("q_proj", "k_proj", "v_proj"))
        mlp_in = residual and not spec.parallel_attn
        if spec.mlp is MlpKind.GATED:
            gate = mlp_in or bool(shorts & {"gate_proj", "gate_up_proj"})
            up = mlp_in or bool(shorts & {"up_proj", "gate_up_proj"})
        else:
            gate = up = mlp_in or "fc1" in shorts
        product = gate or up
        shared_gate = mlp_in or "shared_expert_gate" in shorts
        mlp_out = mlp_in or any(s.in_mlp for s in sites)
        live = {SiteInput.ATTN_OUT} if attention else set()
        live |= {SiteInput.Q_LATENT} if q_lat else set()
        live |= {SiteInput.KV_LATENT} if kv_lat else set()
        live |= {SiteInput.NORM2} if mlp_in else set()
        live |= {SiteInput.MLP_ACT} if product else set()
        return cls(
            attention=attention,
            q=q,
            k=k,
            v=v,
            residual=residual,
            mlp_in=mlp_in,
            gate=gate,
            up=up,
            product=product,
            mlp_out=mlp_out,
            shared_gate=shared_gate,
            live=frozenset(live),
        )


def head_sites(spec: ModelSpec, adapter: Adapter) -> tuple[AdapterSite, ...]:
    """Linears outside the layers that ``adapter`` targets: BERT's masked-LM head transform
    (``cls.predictions.transform.dense``, h → h, modeling_bert.py ``BertPredictionHeadTransform``), reading the last
    layer's output; ``all-linear`` wraps it (PEFT ``_maybe_include_all_linear_layers`` leaves out only the output
    layer, the tied ``decoder``), and so does a ``dense`` target."""
    return _matched(spec, adapter, _head_linears(spec))


def _head_linears(spec: ModelSpec) -> tuple[AdapterSite, ...]:
    if spec.kind is not ModelKind.MASKED_LM or spec.model_type != "bert":
        return ()
    h = spec.hidden_size
    return (AdapterSite(name="cls.predictions.transform.dense", d_in=h, d_out=h, reads=SiteInput.NORM1),)


def site_tensors(sites: tuple[AdapterSite, ...], adapter: Adapter) -> tuple[ParamTensor, ...]:
    """LoRA A (r × d_in) and B (d_out × r) per site (PEFT ``update_layer``), and DoRA's magnitude (d_out) —
    Hu et al. 2021; Liu et al. 2024."""
    out: list[ParamTensor] = []
    r = adapter.rank
    for s in sites:
        out.append(ParamTensor(name=f"{s.name}.lora_A.weight", shape=(r, s.d_in), matmul=True))
        out.append(ParamTensor(name=f"{s.name}.lora_B.weight", shape=(s.d_out, r), matmul=True))
        if adapter.kind is AdapterKind.DORA:
            out.append(ParamTensor(name=f"{s.name}.lora_magnitude_vector", shape=(s.d_out,), matmul=False))
    return tuple(out)


def _dense_group(inv: ParamInventory) -> LayerGroup:
    return next(g for g in inv.layers if g.kind == "dense")


def adapter_tensor_counts(spec: ModelSpec, adapter: Adapter) -> tuple[tuple[ParamTensor, int], ...]:
    """Each adapter tensor of the stack with the number of layers that hold it: the linears' pairs in every layer,
    the MoE router's and expert stacks' (:func:`moe_param_sites`) in the MoE layers only (DeepSeek's leading dense
    layers have none)."""
    moe = set(moe_tensors(spec, adapter))
    return tuple((t, spec.num_moe_layers if t in moe else spec.num_layers) for t in adapter_tensors(spec, adapter))


def trainable_adapter_counts(spec: ModelSpec, adapter: Adapter) -> tuple[tuple[ParamTensor, int], ...]:
    """Every adapter tensor of the model with the number of copies: the stack's (:func:`adapter_tensor_counts`) and
    the head's (:func:`head_sites`, once). What trains, is reduced and is stepped — the memory model's trainable
    parameters (:func:`trainfit.analytic.states.finetune_param_states`) and the speed model's
    (``trainfit.planner.speed._adapter_numbers``) both read it."""
    head = site_tensors(head_sites(spec, adapter), adapter)
    return adapter_tensor_counts(spec, adapter) + tuple((t, 1) for t in head)


def moe_tensors(spec: ModelSpec, adapter: Adapter) -> tuple[ParamTensor, ...]:
    """One MoE layer's ``ParamWrapper`` pairs (:func:`moe_param_sites`)."""
    out: list[ParamTensor] = []
    for p in moe_param_sites(spec, adapter):
        # The router's delta B·A is a matmul under autocast (cached 16-bit copies of A and B); an expert stack's
        # factors are cast to the weight's dtype explicitly (moe_adapter_saved), no autocast copy.
        rank = p.rank * p.experts
        mm = p.experts == 1
        out.append(ParamTensor(name=f"mlp.experts.{p.name}.lora_A.weight", shape=(rank, p.d_in), matmul=mm))
        out.append(ParamTensor(name=f"mlp.experts.{p.name}.lora_B.weight", shape=(p.d_out, rank), matmul=mm))
    return tuple(out)


def adapter_tensors(spec: ModelSpec, adapter: Adapter) -> tuple[ParamTensor, ...]:
    """One layer's adapter tensors (:func:`site_tensors` of :func:`adapter_sites`, then the MoE router's and expert
    stacks' pairs of :func:`moe_tensors`; :func:`adapter_tensor_counts` says how many layers hold each)."""
    return site_tensors(adapter_sites(spec, adapter), adapter) + moe_tensors(spec, adapter)


def is_frozen(t: ParamTensor, patterns: tuple[str, ...], layer: int | None, *, layers: int) -> bool:
    """Whether ``t`` (in layer ``layer``, or outside the stack when ``None``) matches a ``--freeze`` pattern:
    ``embeddings`` (token, position and type tables), ``lm_head``, ``norm`` (every norm weight), ``layers:A-B``
    (whole layers), or a module name (``q_proj``: that linear in every layer)."""
    for p in patterns:
        rng = layer_range(p)
        if rng is not None:
            if rng.stop > layers:
                raise StrategyError(f"freeze range {p} goes past the model's {layers} layers (0-{layers - 1})")
            if layer is not None and layer in rng:
                return True
        elif p == "embeddings":
            if t.name.startswith("embed_") and "norm" not in t.name:
                return True
        elif p == "lm_head":
            if t.name.startswith("lm_head"):
                return True
        elif p == "norm":
            if "norm" in t.name:
                return True
        elif _short(t) == _HF_ALIASES.get(p, p):
            return True
    return False


@dataclass(frozen=True, slots=True, kw_only=True)
class FrozenLayers:
    """How ``--freeze`` patterns leave the layer stack, counting whole layers only (a layer with any trainable
    tensor counts as trainable: an upper bound for a partly frozen one).

    Autograd records a node only where an input requires grad (torch/csrc/autograd/function.h
    ``compute_requires_grad``), so a frozen layer whose input needs no gradient saves nothing: it is ``dead``.
    Its input needs one when the embeddings' output does — a trainable embedding table, or checkpointing,
    with which transformers 5 calls ``enable_input_require_grads`` (modeling_utils.py
    ``_activation_checkpointing_enable``, for every ``input_ids`` model; not ``--checkpointing selective``,
    which only wraps the attention core in ``torch.utils.checkpoint``) — or when any layer below trains.
    A ``frozen`` layer with such an input saves what the input gradient needs (the frozen forms of
    :func:`trainfit.analytic.activations.frozen_layer_terms`, no adapters)."""

    dead: int
    frozen: int
    trainable: int
    bottom_frozen: bool  # the lowest layer that runs a backward is wholly frozen: it adds no gradient
    frozen_at: tuple[bool, ...] = ()  # per layer of the stack: wholly frozen (dead or frozen)
    stack_input_grad: bool = True  # the first layer's input (the embeddings' output) requires grad
    stack_output_grad: bool = True  # the last layer's output requires grad
    final_norm_frozen: bool = False  # every final-norm tensor frozen (``norm``)

    @property
    def input_grad_from(self) -> int:
        """The lowest layer whose input requires grad (0: every layer's): the one above the dead layers, and the
        lowest live layer itself only when the embeddings' output requires grad. Below it autograd runs no
        backward, and the lowest live layer's ``RegisterPostBackwardFunction`` (FSDP2) never fires."""
        return self.dead + 1 if self.dead or not self.stack_input_grad else 0


def frozen_layers(spec: ModelSpec, strategy: Strategy) -> FrozenLayers | None:
    """The stack under ``--freeze`` (``None`` without freeze patterns, or under an adapter)."""
    patterns = strategy.base_weights.frozen
    if strategy.adapter is not None or not patterns:
        return None
    inv = inventory(spec)
    n = spec.num_layers
    per_layer: list[tuple[ParamTensor, ...]] = []
    for g in inv.layers:
        per_layer += [g.tensors] * g.count
    embeds = [t for t in inv.model_tensors if t.name.startswith("embed")]
    # Input grads are on only under layer checkpointing (activations.input_grads_enabled: HF's
    # gradient_checkpointing_enable → enable_input_require_grads); --checkpointing selective wraps only the
    # attention core in torch.utils.checkpoint and turns none of that on, so a frozen bottom stays dead.
    grad = strategy.checkpointing.value not in ("none", "selective") or any(
        not is_frozen(t, patterns, None, layers=n) for t in embeds
    )
    stack_input_grad = grad
    dead = frozen = trainable = 0
    bottom_frozen = False
    frozen_at = tuple(all(is_frozen(t, patterns, i, layers=n) for t in ts) for i, ts in enumerate(per_layer))
    for wholly in frozen_at:
        if wholly:
            if grad:
                bottom_frozen = bottom_frozen or (frozen + trainable == 0)
                frozen += 1
            else:
                dead += 1
        else:
            trainable += 1
            grad = True
    final = [t for t in inv.model_tensors if t.name.startswith("final_norm")]
    return FrozenLayers(
        dead=dead,
        frozen=frozen,
        trainable=trainable,
        bottom_frozen=bottom_frozen,
        frozen_at=frozen_at,
        stack_input_grad=stack_input_grad,
        stack_output_grad=grad,
        final_norm_frozen=bool(final) and all(is_frozen(t, patterns, None, layers=n) for t in final),
    )


def check_freeze_patterns(spec: ModelSpec, patterns: tuple[str, ...]) -> None:
    """Every ``--freeze`` name must name something in the model (one line otherwise)."""
    inv = inventory(spec)
    names = {_short(t) for t in inv.model_tensors} | {_short(t) for g in inv.layers for t in g.tensors}
    for p in patterns:
        if layer_range(p) is not None or p in FREEZE_GROUPS:
            continue
        if _HF_ALIASES.get(p, p) not in names:
            raise StrategyError(
                f"--freeze {p}: no such module in {spec.name}; use {', '.join(FREEZE_GROUPS)}, layers:A-B or one of "
                + ", ".join(sorted(n for n in names if "proj" in n or n.startswith("fc")))
            )


def frozen_layer_counts(spec: ModelSpec, patterns: tuple[str, ...], group: LayerGroup, t: ParamTensor) -> int:
    """How many of ``group``'s ``count`` copies of ``t`` are frozen. Layer ranges count layers of the stack in
    order; a model with several layer kinds numbers them in inventory order (dense first)."""
    inv = inventory(spec)
    start = 0
    for g in inv.layers:
        if g.kind == group.kind:
            break
        start += g.count
    return sum(is_frozen(t, patterns, start + k, layers=spec.num_layers) for k in range(group.count))


# -- what autograd saves -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterSaved:
    """One tensor (or one shared tensor) an adapter saves per layer."""

    name: str
    bytes: int
    formula: str
    reads: SiteInput | None = None  # set for a shared input: count it once per input tensor


def adapter_saved(
    sites: tuple[AdapterSite, ...],
    adapter: Adapter,
    *,
    tokens: int,
    input_width: dict[SiteInput, int],
    amp: bool,
    compute: int,
    base_width: int = 2,
    quantised: bool = False,
) -> list[AdapterSaved]:
    """Per layer, what the adapters save (PEFT ``lora.Linear.forward``; DESIGN §4.4 closed forms): the input
    as ``lora_A`` sees it, the dropout mask, and ``lora_A``'s output. ``input_width``: bytes per element of
    each input tensor as the base layer receives it; ``base_width``: bytes per base weight element (DoRA with
    dropout keeps a copy of the weight, :func:`dora_weight_copy_bytes`); ``quantised``: a bitsandbytes base."""
    t, r = tokens, adapter.rank
    ad = adapter.dtype.bits // 8
    mm = compute if amp else ad  # the width lora_A's matmul computes (and saves its input) in
    out: list[AdapterSaved] = []
    for s in sites:
        w_in = input_width[s.reads]
        # PEFT _cast_input_dtype: x.to(lora_A.weight.dtype) when the dtypes differ — over a bitsandbytes base only
        # without autocast (peft/tuners/lora/bnb.py: ``requires_conversion = not torch.is_autocast_enabled()``)
        cast = w_in != ad and not (quantised and amp)
        dropped = adapter.dropout > 0
        autocast_cast = amp and (ad if (cast or dropped) else w_in) != compute
        if not cast and not dropped and not autocast_cast:
            out.append(
                AdapterSaved(
                    name=f"{s.name}.lora_in", bytes=w_in * t * s.d_in, formula="x itself (shared)", reads=s.reads
                )
            )
        else:
            out.append(AdapterSaved(name=f"{s.name}.lora_in", bytes=mm * t * s.d_in, formula=f"{mm}·t·d_in (new copy)"))
        if dropped:
            out.append(AdapterSaved(name=f"{s.name}.dropout_mask", bytes=t * s.d_in, formula="1·t·d_in (bool mask)"))
        out.append(AdapterSaved(name=f"{s.name}.lora_A_out", bytes=mm * t * r, formula=f"{mm}·t·r"))
        if adapter.kind is AdapterKind.DORA:
            # With dropout PEFT recomputes the base output from the dropped input: F.linear in lora_A's matmul
            # width (autocast's compute dtype, else the adapter dtype); without, it reuses the base layer's — a
            # bitsandbytes layer's in its input's dtype (Linear4bit.forward ``.to(inp_dtype)``, MatMul8bitLt).
            base_out = mm if dropped else (w_in if quantised else compute)
            out += _dora_saved(s, tokens=t, mm=mm, base_out=base_out, ad=ad)
            copy = dora_weight_copy_bytes(s, ad=ad, amp=amp, compute=compute, base=base_width, quantised=quantised)
            if dropped and copy:
                out.append(AdapterSaved(name=f"{s.name}.dora_weight", bytes=copy, formula="d_in·d_out (weight copy)"))
    return out


def base_weight_width(strategy: Strategy) -> int:
    """Bytes per element of a float base weight: ``--base-dtype``, else the recipe's weight dtype."""
    base = strategy.base_weights.dtype
    return base.bits // 8 if base is not None else strategy.recipe.weight_bits // 8


def dora_weight_copy_bytes(
    s: AdapterSite, *, ad: int, amp: bool, compute: int, base: int, quantised: bool = False
) -> int:
    """DoRA with dropout (PEFT ``DoraLinearVariant.forward``, peft/tuners/lora/variants.py: ``x = dropout(x)``,
    ``base_result=None``; then ``DoraLinearLayer.forward``, peft/tuners/lora/dora.py) runs the base layer a
    second time as ``F.linear(x, weight.to(x.dtype))``. The weight needs no gradient, so that linear saves only
    the weight it multiplied by (its input's gradient needs it; derivatives.yaml ``linear``/``mm``): the
    parameter itself when nothing casts it (0 bytes), else a d_in × d_out copy per adapted linear and layer —
    the ``.to(x.dtype)`` copy (adapter dtype), or autocast's cast of it to the compute dtype (not cached:
    autocast caches casts of leaf tensors only, aten/src/ATen/autocast_mode.h ``cached_cast``). Over a bitsandbytes
    base (``quantised``) the weight is always a fresh tensor (``dequantize_module_weight``, then ``.to(x.dtype)``):
    the saved one is autocast's compute-dtype cast, or that tensor itself — compute·d_in·d_out under autocast,
    else (x cast to the adapter dtype by PEFT's bnb layers) ad·d_in·d_out."""
    n = s.d_in * s.d_out
    if quantised:
        return (compute if amp else ad) * n
    if amp and ad != compute:
        return compute * n
    return ad * n if base != ad else 0


def _dora_saved(s: AdapterSite, *, tokens: int, mm: int, base_out: int, ad: int) -> list[AdapterSaved]:
    """What DoRA adds per adapted linear (PEFT ``DoraLinearLayer.forward``, peft/tuners/lora/dora.py, without
    dropout: ``base_result`` is the base layer's output): ``(mag_norm_scale - 1) * base_result`` saves the base
    output (t·d_out, the base matmul's dtype) and ``mag_norm_scale - 1``; ``mag_norm_scale * lora_result`` saves
    ``lora_B``'s output (t·d_out, lora_B's matmul dtype) and ``mag_norm_scale``; ``magnitude / weight_norm`` saves
    the detached weight norm — three d_out vectors in the adapter dtype. The weight norm itself (``lora_B(lora_A(
    eye(d_in)))`` and the full-size ``W + s·BA``) is computed without a path to any gradient (``.detach()``):
    forward transients only, freed within the call. Checked against the trace (tests/trace/test_dora.py)."""
    t = tokens
    return [
        AdapterSaved(name=f"{s.name}.dora_base_out", bytes=base_out * t * s.d_out, formula=f"{base_out}·t·d_out"),
        AdapterSaved(name=f"{s.name}.dora_lora_out", bytes=mm * t * s.d_out, formula=f"{mm}·t·d_out"),
        AdapterSaved(name=f"{s.name}.dora_scales", bytes=3 * allocator_bytes(ad * s.d_out), formula=f"3 × {ad}·d_out"),
    ]


def dora_norm_transient_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """DoRA's weight norm, recomputed in every forward call (PEFT ``DoraLinearLayer.forward``: ``get_lora_weight``
    then ``get_weight_norm``), at its widest adapted linear, while ``weight + scaling * lora_weight`` is formed:
    ``lora_A``'s saved ``eye(d_in)`` (its matmul's dtype), ``lora_A``'s output (d_in·r), ``lora_weight`` in the
    input's dtype, the base weight cast to it (when the base dtype differs), the scaled copy and the sum — full
    d_in × d_out matrices, freed when the call returns (nothing on that path needs a gradient). Over a
    bitsandbytes base the weight is dequantised first (:func:`dora_dequant_bytes`). 0 without DoRA."""
    adapter = strategy.adapter
    if adapter is None or adapter.kind is not AdapterKind.DORA:
        return 0
    amp = strategy.recipe.autocast
    ad = adapter.dtype.bits // 8
    mm = strategy.recipe.compute_bits // 8 if amp else ad
    eye = max(s.d_in * s.d_in * mm + s.d_in * adapter.rank * mm for s in adapter_sites(spec, adapter))
    if strategy.base_weights.quantization is not Quantization.NONE:
        return eye + dora_dequant_bytes(spec, strategy)
    base = strategy.base_weights.dtype
    wb = base.bits // 8 if base is not None else strategy.recipe.weight_bits // 8
    full = 3 + (1 if wb != ad else 0)
    return max(
        s.d_in * s.d_in * mm + s.d_in * adapter.rank * mm + full * ad * s.d_in * s.d_out
        for s in adapter_sites(spec, adapter)
    )


def dora_dequant_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """DoRA's weight norm over a bitsandbytes base, at its widest adapted linear: the d_in × d_out matrices alive at
    once in ``DoraLinearLayer.forward`` (peft/tuners/lora/dora.py), in the width ``x`` has there — the adapter
    dtype (PEFT's bnb ``Linear4bit``/``Linear8bitLt.forward`` cast it), or under autocast its own width (those
    layers cast only without autocast, peft/tuners/lora/bnb.py ``requires_conversion``):

    * ``dequantize_module_weight`` (peft/utils/integrations.py): 4-bit, ``dequantize_4bit`` — one tensor in the
      dtype the weight was quantised from (the compute dtype here, as the trace builds it); LLM.int8,
      ``int8_vectorwise_dequant``, whose kernel (bitsandbytes/_ops.py, ``A * stats.view(-1, 1) * (1/127)``) holds
      two fp32 tensors at once — beside ``lora_weight`` (x's width);
    * then ``.to(x.dtype)`` (a copy when the widths differ; the dequantised one is dropped), and
      ``get_weight_norm``: ``weight + scaling * lora_weight`` — lora_weight, weight, the scaled copy and the sum.

    The largest of those moments; unlike a float base, the weight is never the parameter itself."""
    from trainfit.analytic.activations import Widths, site_widths

    adapter = strategy.adapter
    assert adapter is not None
    w = Widths.of(strategy)
    widths = site_widths(spec, strategy, w)
    ad = adapter.dtype.bits // 8
    int8 = strategy.base_weights.quantization is Quantization.INT8
    wq = 4 if int8 else w.compute
    out = 0
    for s in adapter_sites(spec, adapter):
        x = widths[s.reads] if w.amp else ad
        moments = (
            4 * x,  # lora_weight, weight, scaling * lora_weight, the sum
            x + (8 if int8 else wq),  # lora_weight and the dequantisation
            x + wq + (x if wq != x else 0),  # the cast to x's dtype
        )
        out = max(out, max(moments) * s.d_in * s.d_out)
    return out


def frozen_base(strategy: Strategy) -> bool:
    """Every base weight frozen and the hidden states requiring grad (an adapter)."""
    return strategy.adapter is not None


def dequant_transient_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """The largest dequantised weight alive at once in backward: bitsandbytes' ``MatMul4Bit.backward``
    (bitsandbytes/autograd/_functions.py) computes ``grad_output @ dequantize_4bit(W).t()``, and
    ``MatMul8bitLt.backward`` multiplies by ``CB·SCB/127``: one N·K tensor in the compute dtype."""
    if strategy.base_weights.quantization is Quantization.NONE:
        return 0
    linears = layer_linears(spec)
    largest = max(s.d_in * s.d_out for s in linears)
    out = largest * strategy.recipe.compute_bits // 8
    if strategy.base_weights.quantization is Quantization.INT8:
        out = int8_dequant_bytes(spec, strategy)
    # Linear4bit.forward casts its input to the compute dtype (x.to(compute_dtype)); over an fp32 residual
    # stream (prepare_model_for_kbit_training) that cast's backward makes an fp32 copy of the input gradient
    # of the widest input (down_proj's): 4·t·d_in, alive with the rest of the MLP's backward (matched against
    # the trace of real bitsandbytes layers, tests/trace/test_peft.py; fitted, not derived op by op). A gated MLP's
    # moments are derived instead (activations.frozen_mlp_backward_bytes; model.py adds this sum only elsewhere).
    if strategy.base_weights.kbit_prepared and strategy.recipe.compute_bits < 32:
        widest = max(linears, key=lambda s: s.d_in)
        adapted = strategy.adapter is not None and widest in adapter_sites(spec, strategy.adapter)
        # An adapter on that linear already holds part of it (its own gradient chain): 2·t·d_in more, not 4.
        out += (2 if adapted else 4) * strategy.tokens_per_micro_batch * widest.d_in
    return out


def int8_dequant_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """LLM.int8's dequantised weight in backward, at the widest int8 linear of any layer kind (a DeepSeek dense
    layer's MLP, an MoE layer's attention or shared experts — :func:`layer_linears` per kind): ``MatMul8bitLt.backward``
    (bitsandbytes/autograd/_functions.py) computes ``CB.to(ctx.dtype_A, copy=True).mul_(SCB·1/127)`` — one N·K
    tensor in its *input's* dtype (no autocast inside the Function; fp32 over an fp32 residual stream, and MLA's
    normed latents in the residual's dtype, :func:`trainfit.analytic.activations.site_widths`), alive while
    ``grad_output @ CB`` runs."""
    from trainfit.analytic.activations import Widths, site_widths

    width = site_widths(spec, strategy, Widths.of(strategy))
    return max(s.d_in * s.d_out * width[s.reads] for g in inventory(spec).layers for s in layer_linears(spec, g.kind))


def mlp_frozen(spec: ModelSpec) -> bool:
    """Whether the frozen MLP form is known for ``spec`` (gated, or a fused activation)."""
    return spec.mlp is MlpKind.GATED or spec.activation not in ("gelu_new", "gelu_fast", "gelu_python")


def _anything_trains(spec: ModelSpec, strategy: Strategy) -> bool:
    """Whether any parameter is left trainable (an adapter, or a tensor no ``--freeze`` pattern covers)."""
    if strategy.adapter is not None:
        return True
    patterns, layers = strategy.base_weights.frozen, spec.num_layers
    inv = inventory(spec)
    if any(not is_frozen(t, patterns, None, layers=layers) for t in inv.model_tensors):
        return True
    stack = [t for g in inv.layers for t in g.tensors]
    return any(not is_frozen(t, patterns, i, layers=layers) for i in range(layers) for t in stack)


#: Model types whose layer linears are ``nn.Linear`` subclasses, which transformers' ``replace_with_bnb_linear``
#: (transformers/integrations/bitsandbytes.py: ``isinstance(module, Conv1D) or type(module) is nn.Linear``) leaves
#: unconverted: modeling_falcon.py ``FalconLinear(nn.Linear)``.
_BNB_UNCONVERTED = {"falcon": "FalconLinear"}


def quantised_base_refusal(spec: ModelSpec) -> str | None:
    """Why a bitsandbytes base of ``spec`` is not modelled (``None`` when it is). transformers converts every
    ``nn.Linear`` and GPT-2 ``Conv1D`` but the output head into ``Linear4bit``/``Linear8bitLt`` (Conv1D's weight
    transposed to (out, in)), so GPT-2, Phi-2, Phi-3 and NeoX layers are packed like Llama's; Falcon's
    ``FalconLinear`` layers are left float (its 4- and 8-bit loads quantise nothing). In MoE layers only the
    ``nn.Linear`` modules are packed — MLA's projections, shared experts, DeepSeek's dense MLPs, Qwen2-MoE's
    ``shared_expert_gate`` — while the fused 3-D expert stacks and the routers (``nn.Parameter`` in custom modules,
    e.g. modeling_mixtral.py ``MixtralExperts``/``MixtralTopKRouter``) stay float, as the inventory's ``matmul``
    flag already says; checked against the trace (tests/trace/test_peft.py). MoE families the adapter model does not
    cover (:func:`supports_adapters`) are refused here too."""
    if spec.model_type in _BNB_UNCONVERTED:
        return (
            f"transformers' bitsandbytes integration (replace_with_bnb_linear) converts nn.Linear and Conv1D "
            f"layers only, not its {_BNB_UNCONVERTED[spec.model_type]} layers, which would stay float"
        )
    if (why := supports_adapters(spec)) is not None:
        return why
    return None


#: The inventory's MoE router: a plain ``nn.Parameter`` in a router module in transformers 5 (modeling_mixtral.py
#: ``MixtralTopKRouter``, modeling_deepseek_v3.py ``DeepseekV3TopkRouter``), not an ``nn.Linear``.
_ROUTER = "mlp.router.weight"


def bnb_converted(t: ParamTensor) -> bool:
    """Whether transformers' ``replace_with_bnb_linear`` packs the layer tensor ``t``: a linear's weight (the
    inventory's ``matmul`` flag), but not a MoE router (no ``nn.Linear``; the expert stacks are not ``matmul``)."""
    return t.matmul and t.name != _ROUTER


def packed_weight_bytes(spec: ModelSpec, t: ParamTensor, kind: str, *, double_quant: bool) -> int:
    """Device bytes of the bitsandbytes layer holding the layer linear weight ``t`` (allocator-rounded pieces of
    :func:`trainfit.cuda_facts.quantized_weight_tensors`). Phi-3's gate and up are one ``gate_up_proj`` (2·i × h,
    modeling_phi3.py ``Phi3MLP``), quantised as one tensor: its bytes go to ``gate_proj``, none to ``up_proj``."""
    return sum(allocator_bytes(n) for n in _packed_pieces(spec, t, kind, double_quant=double_quant))


def packed_param_bytes(spec: ModelSpec, t: ParamTensor, kind: str) -> int:
    """Unrounded bytes of the parameter itself (``Params4bit``' packed uint8 data, ``Int8Params``' int8 data) of
    :func:`packed_weight_bytes`' layer: what ``named_parameters`` yields; the quantisation state is an attribute."""
    pieces = _packed_pieces(spec, t, kind, double_quant=False)
    return pieces[0] if pieces else 0


def _packed_pieces(spec: ModelSpec, t: ParamTensor, kind: str, *, double_quant: bool) -> tuple[int, ...]:
    numel, rows = t.numel, t.shape[0]
    if spec.model_type == "phi3" and t.name.endswith("mlp.up_proj.weight"):
        return ()
    if spec.model_type == "phi3" and t.name.endswith("mlp.gate_proj.weight"):
        numel, rows = 2 * numel, 2 * rows
    return quantized_weight_tensors(numel, rows, kind, double_quant=double_quant)


def packed_bias_names(spec: ModelSpec) -> frozenset[str]:
    """The bias tensors (inventory names) of the layer linears bitsandbytes converts."""
    return frozenset(
        t.name.removesuffix(".weight") + ".bias" for g in inventory(spec).layers for t in g.tensors if bnb_converted(t)
    )


def check_finetune_model(spec: ModelSpec, strategy: Strategy, *, analytic: bool = True) -> None:
    """Refuse, in one line, a fine-tuning setup this model cannot have or the method does not model: a
    target or ``--freeze`` name the model lacks, an adapter on a layer layout the closed forms do not cover,
    a ``--freeze`` that leaves nothing to train (the trace runs LLM.int8 layers and ``--freeze`` too)."""
    if strategy.adapter is not None:
        check_targets(spec, strategy.adapter)
        # PEFT's ParamWrapper (the router and expert stacks of a transformers 5 MoE) raises on both.
        if moe_param_sites(spec, strategy.adapter) and (
            strategy.adapter.dropout > 0 or strategy.adapter.kind is AdapterKind.DORA
        ):
            what = "DoRA" if strategy.adapter.kind is AdapterKind.DORA else "--lora-dropout > 0"
            raise StrategyError(
                f"PEFT's ParamWrapper (LoRA on {spec.name}'s MoE router and experts) does not work with {what}; "
                "drop it, or target only attention linears"
            )
        indexed = sorted(x for x in strategy.adapter.targets if any(p.isdigit() for p in x.split(".")))
        if analytic and indexed:
            raise StrategyError(
                f"LoRA targets on some layers only ({', '.join(indexed)}) are not modelled analytically: the "
                "closed forms adapt every layer alike; name the module (e.g. o_proj), or use --method trace"
            )
        if analytic or spec.params_override is not None:
            adapter_sites(spec, strategy.adapter)  # a layout the closed forms do not cover: one line
            if (
                analytic
                and strategy.checkpointing.value in ("none", "selective")  # activations.input_grads_enabled
                and inventory(spec).layers[0].kind == "moe"
                and moe_param_sites(spec, strategy.adapter)
                and not BlindLayer.of(spec, strategy.adapter).mlp_in
            ):
                # Without checkpointing the embeddings' output needs no gradient (activations.input_grads_enabled),
                # so the first layer saves only from its first adapter on (BlindLayer): not derived for adapted
                # experts or routers over an input that needs none.
                raise StrategyError(
                    f"the analytic model covers LoRA on {spec.name}'s experts without (or with selective) "
                    "checkpointing only with an attention target (q_proj, k_proj, v_proj or o_proj); add one, use "
                    "--checkpointing full, or --method trace"
                )
        if strategy.base_weights.quantization is not Quantization.NONE:
            why = quantised_base_refusal(spec)
            if why is not None:
                raise StrategyError(f"a quantised base of {spec.name} is not modelled: {why}; use a float --base-dtype")
    if strategy.base_weights.frozen:
        check_freeze_patterns(spec, strategy.base_weights.frozen)
        for p in strategy.base_weights.frozen:
            rng = layer_range(p)
            if rng is not None and rng.stop > spec.num_layers:
                raise StrategyError(f"freeze range {p} goes past {spec.name}'s {spec.num_layers} layers")
    if strategy.base_weights.frozen and not _anything_trains(spec, strategy):
        raise StrategyError("--freeze leaves no trainable parameter (torch's optimizers refuse an empty list)")


def check_dora(strategy: Strategy, *, analytic: bool) -> None:
    """DoRA (``LoraConfig(use_dora=True)``, Liu et al. 2024): both methods cover it with and without dropout
    (:func:`_dora_saved`, :func:`dora_weight_copy_bytes`), over a float or a bitsandbytes base
    (:func:`dora_dequant_bytes`); nothing is refused here any more. ``analytic`` is kept for callers."""
    del analytic, strategy


#: How :func:`fp32_base_note` begins (the table shows that note without ``--explain``).
FP32_BASE_NOTE = "frozen base stored in fp32"


def fp32_base_note(spec: ModelSpec, strategy: Strategy) -> str | None:
    """The report's note when an adapter's frozen base is stored in fp32 under a 16-bit autocast recipe (amp-bf16,
    amp-fp16): the base takes the recipe's weight dtype unless ``--base-dtype`` says otherwise (transformers loads
    ``from_pretrained(..., torch_dtype=torch.float32)`` when the Trainer runs amp over fp32 weights), though nothing
    trains it — a 16-bit copy halves its bytes (the figure: the weights of the same setup with ``--base-dtype`` at the
    compute dtype). ``None`` otherwise."""
    import dataclasses

    from trainfit.analytic.states import model_states
    from trainfit.units import fmt_gib

    rec, base = strategy.recipe, strategy.base_weights
    if strategy.adapter is None or base.dtype is not None or base.quantization is not Quantization.NONE:
        return None
    if not rec.autocast or rec.weight_bits != 32 or rec.compute_bits != 16:
        return None
    half = dataclasses.replace(strategy, base_weights=dataclasses.replace(base, dtype=rec.compute))
    now, then = model_states(spec, strategy).weights_bytes, model_states(spec, half).weights_bytes
    return (
        f"{FP32_BASE_NOTE} (the recipe's weights, {fmt_gib(now)}); --base-dtype {rec.compute_dtype} halves "
        f"it ({fmt_gib(then)}, {fmt_gib(now - then)} less)"
    )
