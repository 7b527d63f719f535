"""Analytic vs trace for fine-tuning: real PEFT LoRA modules traced on fake tensors (trainfit.trace.peft) against
the closed forms of trainfit.analytic.adapters, on a matrix of small configs. Every phase within 3%.

The configs are small but not tiny (hidden 256, 256 tokens) so that the 512-byte allocator rounding does not
swamp the per-token terms; each trace takes a second or two.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from trainfit import Strategy, estimate
from trainfit.analytic.activations import sdpa_kernel
from trainfit.arch.config import spec_from_config
from trainfit.result import TraceDetails
from trainfit.strategy import finetune_setup

from .conftest import assert_phases_agree, traced_once

pytest.importorskip("peft")

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
        "max_position_embeddings": 512, "tie_word_embeddings": False,
    },
    "qwen2": {
        "model_type": "qwen2", "hidden_size": 256, "intermediate_size": 640, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
        "max_position_embeddings": 512, "tie_word_embeddings": True,
    },
    "gemma": {
        "model_type": "gemma", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 1024,
        "max_position_embeddings": 512,
    },
    "qwen3": {
        "model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
        "max_position_embeddings": 512, "tie_word_embeddings": False,
    },
    # Fused qkv and parallel blocks, as PEFT names their linears.
    "gpt2": {  # Conv1D c_attn / c_proj / c_fc / c_proj (PEFT sets fan_in_fan_out), Python GeLU
        "model_type": "gpt2", "n_embd": 256, "n_layer": 4, "n_head": 4, "vocab_size": 1024, "n_positions": 512,
    },
    "falcon": {  # query_key_value (multi-query), one LayerNorm feeding attention and MLP in parallel
        "model_type": "falcon", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
        "vocab_size": 1024, "new_decoder_architecture": False, "multi_query": True, "parallel_attn": True,
        "bias": False, "max_position_embeddings": 512,
    },
    "phi": {  # separate q/k/v, dense, fc1/fc2; one LayerNorm, parallel block
        "model_type": "phi", "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
        "num_attention_heads": 4, "vocab_size": 1024, "max_position_embeddings": 512,
    },
    "phi3": {  # qkv_proj and gate_up_proj fused
        "model_type": "phi3", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1024, "max_position_embeddings": 512,
        "tie_word_embeddings": False, "pad_token_id": 0,
    },
    "bert": {  # encoder, masked LM: query/key/value, attention.output.dense, intermediate.dense, output.dense
        "model_type": "bert", "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
        "num_attention_heads": 4, "vocab_size": 1024, "max_position_embeddings": 512,
        "architectures": ["BertForMaskedLM"],
    },
    "neox": {  # query_key_value; parallel residual with two LayerNorms over the same x
        "model_type": "gpt_neox", "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
        "num_attention_heads": 4, "vocab_size": 1024, "max_position_embeddings": 512,
    },
}  # fmt: skip

# (family, targets, dropout, checkpointing, adapter dtype, precision, base dtype); finetune "lora" unless the
# base is nf4/fp4 (QLoRA: real bitsandbytes Linear4bit layers, prepare_model_for_kbit_training).
MATRIX = [
    ("llama", "all-linear", 0.0, "full", "fp32", "amp-bf16", "nf4"),
    ("llama", "q_proj,v_proj", 0.1, "full", "fp32", "amp-bf16", "nf4"),
    ("qwen2", "all-linear", 0.1, "full", "fp32", "amp-bf16", "nf4"),
    ("llama", "q_proj,v_proj", 0.0, "none", "fp32", "amp-bf16", "bf16"),
    ("llama", "all-linear", 0.1, "none", "fp32", "amp-bf16", "bf16"),
    ("llama", "all-linear", 0.0, "full", "fp32", "amp-bf16", "bf16"),
    ("llama", "all-linear", 0.1, "full", "fp32", "amp-bf16", None),
    ("llama", "q_proj,v_proj", 0.1, "full", "bf16", "pure-bf16", "bf16"),
    ("qwen2", "all-linear", 0.1, "full", "fp32", "amp-bf16", "bf16"),
    ("gemma", "all-linear", 0.1, "none", "fp32", "amp-bf16", "bf16"),
    ("qwen3", "all-linear", 0.0, "full", "fp32", "pure-bf16", "bf16"),
    # QLoRA without autocast: the 4-bit q/k/v return their fp32 input's dtype (prepare_model_for_kbit_training's
    # fp32 residual), so SDPA gets fp32 q/k/v and, with grouped k/v heads, runs its math kernel.
    ("llama", "all-linear", 0.0, "none", "fp32", "pure-bf16", "nf4"),
]

# Fused qkv and parallel blocks (trainfit.analytic.adapters.layer_linears): a LayerNorm over a 16-bit residual
# under autocast saves its own fp32 cast (one per norm, NeoX's second norm too); Falcon's masked multi-query
# attention takes SDPA's math kernel, which keeps no output for a frozen dense; a frozen fc2 keeps no GeLU product.
LAYOUTS = [
    ("gpt2", "all-linear", 0.0, "none", "fp32", "amp-bf16", "bf16"),
    ("gpt2", "c_attn,c_proj", 0.1, "full", "bf16", "pure-bf16", "bf16"),
    ("falcon", "all-linear", 0.1, "full", "fp32", "amp-bf16", "bf16"),
    ("falcon", "query_key_value", 0.0, "none", "fp32", "amp-bf16", "bf16"),
    ("phi", "all-linear", 0.0, "none", "fp32", "amp-bf16", "bf16"),
    ("phi3", "qkv_proj,gate_up_proj", 0.1, "none", "fp32", "amp-bf16", "bf16"),
    ("neox", "all-linear", 0.0, "none", "fp32", "amp-bf16", "bf16"),
    ("neox", "all-linear", 0.1, "full", "bf16", "pure-bf16", "bf16"),
    # BERT as transformers names it; all-linear also wraps the MLM head's transform dense (PEFT leaves out only
    # the tied decoder). Without input gradients the embeddings' LayerNorm and dropout save nothing.
    ("bert", "query,value", 0.0, "none", "fp32", "amp-bf16", "bf16"),
    ("bert", "all-linear", 0.1, "full", "fp32", "amp-bf16", "bf16"),
]


# A quantised base on those layouts: transformers' replace_with_bnb_linear converts GPT-2's Conv1D (weight
# transposed) and every exact nn.Linear but the head; a 4-bit layer returns its input's dtype (fp32 over QLoRA's
# residual), so the MLP and q/k/v are fp32 and autocast copies q/k/v for SDPA. (Falcon's FalconLinear is left
# float by transformers: refused, test_falcon_quantised_base_is_refused.) GPT-2 and Phi-2 with full checkpointing
# and dropout are 2.7% apart in backward, as their float-base rows are (2.6%: the checkpointed GeLU block).
QLORA_LAYOUTS = [
    ("gpt2", "all-linear", 0.0, "none", "fp32", "amp-bf16", "nf4"),
    ("gpt2", "c_attn,c_proj", 0.1, "full", "fp32", "amp-bf16", "nf4"),
    ("phi", "all-linear", 0.0, "none", "fp32", "amp-bf16", "nf4"),
    ("phi", "dense,fc2", 0.1, "full", "fp32", "amp-bf16", "fp4"),
    ("phi3", "all-linear", 0.1, "none", "fp32", "amp-bf16", "nf4"),
    ("phi3", "qkv_proj,gate_up_proj", 0.0, "full", "fp32", "amp-bf16", "nf4"),
    ("neox", "all-linear", 0.1, "full", "fp32", "amp-bf16", "nf4"),
    ("neox", "query_key_value", 0.0, "none", "fp32", "amp-bf16", "fp4"),
]


@pytest.mark.parametrize(
    ("family", "targets", "dropout", "ckpt", "adapter_dtype", "precision", "base"),
    MATRIX
    + [pytest.param(*x, marks=pytest.mark.slow) for x in LAYOUTS]
    + [pytest.param(*x, marks=pytest.mark.slow) for x in QLORA_LAYOUTS[1:]]
    + QLORA_LAYOUTS[:1],
)
def test_lora_analytic_agrees_with_the_peft_trace(
    family: str, targets: str, dropout: float, ckpt: str, adapter_dtype: str, precision: str, base: str | None
) -> None:
    spec = spec_from_config(FAMILIES[family], name=f"small-{family}", source="test")
    how = "qlora" if base in ("nf4", "fp4") else "lora"
    a, b = finetune_setup(how, rank=8, targets=targets, dropout=dropout, adapter_dtype=adapter_dtype, base_dtype=base)
    s = Strategy(adapter=a, base_weights=b, precision=precision, checkpointing=ckpt, micro_batch=2, seq_len=128)
    ra = estimate(spec, s)
    # traced once per process: the last MATRIX cell is test_lora_on_a_4bit_base_is_not_kbit_prepared's QLoRA cell
    rt = traced_once(estimate, spec, s, method="trace", simulate_allocator=False)
    assert ra.trainable_params == rt.trainable_params
    assert isinstance(rt.details, TraceDetails)
    assert set(rt.details.sdpa_backends) == {sdpa_kernel(spec, s)}  # the kernel the traced q/k/v dtypes got
    for pa, pt in zip(ra.phases, rt.phases, strict=True):
        assert abs(pa.total_bytes - pt.total_bytes) <= 0.03 * pt.total_bytes, (pa.phase, pa.total_bytes, pt.total_bytes)


# A wide MLP (intermediate 16 × hidden) puts the backward peak inside the MLP, where a frozen base's moments are
# derived op by op (analytic.activations.frozen_mlp_backward_bytes): the product's three gradients, the adapter's cast
# chain, a 4-bit base's dequantised weight, the recomputed down projection's forward. The sum of per-site worst
# cases they replaced was −1.8…+5.4% off on these cells (noted per cell); now within 0.1%.
WIDE_MLP = [
    ("q_proj,v_proj", 0.0, "none", "fp32", "amp-bf16", "bf16"),  # was −1.3%: the product's third gradient
    ("all-linear", 0.1, "none", "fp32", "amp-bf16", "bf16"),  # was +5.4%: two neighbours of the chain, not all
    ("all-linear", 0.0, "full", "fp32", "amp-bf16", "bf16"),  # was +3.0%: the recomputed down projection's forward
    ("q_proj,v_proj", 0.1, "full", "fp32", "amp-bf16", "nf4"),  # was −1.6%
    pytest.param("all-linear", 0.1, "full", "fp32", "amp-bf16", None, marks=pytest.mark.slow),  # was +2.2%
    pytest.param("all-linear", 0.0, "none", "fp32", "pure-bf16", "nf4", marks=pytest.mark.slow),  # was +2.4%
    pytest.param("q_proj,v_proj", 0.1, "full", "bf16", "pure-bf16", "bf16", marks=pytest.mark.slow),  # was −1.8%
]


@pytest.mark.parametrize(("targets", "dropout", "ckpt", "adapter_dtype", "precision", "base"), WIDE_MLP)
def test_a_frozen_mlps_backward_moments_agree_with_the_trace(
    targets: str, dropout: float, ckpt: str, adapter_dtype: str, precision: str, base: str | None
) -> None:
    spec = spec_from_config(
        {**FAMILIES["llama"], "intermediate_size": 4096}, name="small-llama-wide-mlp", source="test"
    )
    how = "qlora" if base in ("nf4", "fp4") else "lora"
    a, b = finetune_setup(how, rank=8, targets=targets, dropout=dropout, adapter_dtype=adapter_dtype, base_dtype=base)
    s = Strategy(adapter=a, base_weights=b, precision=precision, checkpointing=ckpt, micro_batch=2, seq_len=128)
    ra = estimate(spec, s)
    rt = estimate(spec, s, method="trace", simulate_allocator=False)
    for pa, pt in zip(ra.phases, rt.phases, strict=True):
        assert abs(pa.total_bytes - pt.total_bytes) <= 0.002 * pt.total_bytes, (
            pa.phase,
            pa.total_bytes,
            pt.total_bytes,
        )


def test_trace_builds_the_adapters_peft_builds() -> None:
    """The traced model's trainable tensors are PEFT's: rank-8 A/B pairs on q and v of every layer."""
    spec = spec_from_config(FAMILIES["llama"], name="small-llama", source="test")
    a, b = finetune_setup("lora", rank=8, targets="q_proj,v_proj", base_dtype="bf16")
    rt = estimate(
        spec, Strategy(adapter=a, base_weights=b, micro_batch=1, seq_len=64), method="trace", simulate_allocator=False
    )
    # per layer: q 8·(256+256), v 8·(256+128); 4 layers.
    assert rt.trainable_params == 4 * (8 * 512 + 8 * 384)


def test_qlora_trace_stores_the_base_byte_exact() -> None:
    """The traced 4-bit weights (packed values + quant-state buffers) are what the analytic storage formula
    says, to the allocator block: weights + adapter weights of the analytic report vs the trace's weights
    (which also hold the rotary embedding's ``inv_freq`` and ``original_inv_freq`` buffers: head_dim/2 fp32
    values each, one 512-byte block each)."""
    spec = spec_from_config(FAMILIES["llama"], name="small-llama", source="test")
    a, b = finetune_setup("qlora", rank=8, targets="all-linear")
    s = Strategy(adapter=a, base_weights=b, micro_batch=1, seq_len=64, checkpointing="full")
    ra, rt = estimate(spec, s), estimate(spec, s, method="trace", simulate_allocator=False)
    from trainfit.result import Component

    analytic = ra.phases[-1].get(Component.WEIGHTS) + ra.phases[-1].get(Component.ADAPTER_WEIGHTS)
    assert rt.phases[-1].get(Component.WEIGHTS) == analytic + 2 * 512


@pytest.mark.parametrize(
    ("family", "rotary_blocks"),
    [
        ("gpt2", 0),
        ("phi3", 2),
        pytest.param("phi", 2, marks=pytest.mark.slow),
        pytest.param("neox", 2, marks=pytest.mark.slow),
    ],
)
def test_qlora_trace_stores_other_layouts_byte_exact(family: str, rotary_blocks: int) -> None:
    """As above on GPT-2 (Conv1D c_attn/c_proj/c_fc converted by transformers, weight transposed to (out, in)),
    Phi-2, Phi-3 (one 4-bit ``gate_up_proj``: one set of quantisation statistics, not two) and NeoX: the
    analytic packs each converted linear as the trace's bitsandbytes layers hold it, and a 4-bit layer's bias in
    the compute dtype (``Linear4bit.forward`` recasts it on the first call)."""
    spec = spec_from_config(FAMILIES[family], name=f"small-{family}", source="test")
    a, b = finetune_setup("qlora", rank=8, targets="all-linear")
    s = Strategy(adapter=a, base_weights=b, micro_batch=1, seq_len=64, checkpointing="full")
    ra, rt = estimate(spec, s), estimate(spec, s, method="trace", simulate_allocator=False)
    from trainfit.result import Component

    analytic = ra.phases[-1].get(Component.WEIGHTS) + ra.phases[-1].get(Component.ADAPTER_WEIGHTS)
    assert rt.phases[-1].get(Component.WEIGHTS) == analytic + rotary_blocks * 512
    assert rt.phases[-1].get(Component.AUTOCAST_COPIES) == 0  # no bias recast in the forward


def _bnb_conversions(cfg: dict[str, Any]) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]]:
    """(in, out) features of each module turned ``Linear4bit`` on the same meta model by trace.bnb's
    ``to_linear4bit`` and by transformers' own ``replace_with_bnb_linear`` (with ``get_keys_to_not_convert``, as
    ``from_pretrained`` calls it)."""
    import torch
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.base import get_keys_to_not_convert

    bnb = pytest.importorskip("bitsandbytes")
    from trainfit.trace.bnb import to_linear4bit
    from trainfit.trace.hf import build_meta

    spec = spec_from_config(cfg, name=f"small-{cfg['model_type']}", source="test")
    s = Strategy(micro_batch=1, seq_len=32)

    def converted(m: torch.nn.Module) -> dict[str, tuple[int, int]]:
        return {n: (x.in_features, x.out_features) for n, x in m.named_modules() if isinstance(x, bnb.nn.Linear4bit)}

    ours, _ = build_meta(spec, s, torch.float32)
    to_linear4bit(ours, quant_type="nf4", double_quant=True, compute=torch.bfloat16)
    theirs, _ = build_meta(spec, s, torch.float32)
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    replace_with_bnb_linear(theirs, modules_to_not_convert=get_keys_to_not_convert(theirs), quantization_config=config)
    return converted(ours), converted(theirs)


@pytest.mark.parametrize("family", ["llama", "gpt2", "phi", "phi3", "neox", "falcon"])
def test_the_trace_converts_the_linears_transformers_converts(family: str) -> None:
    """trainfit.trace.bnb against transformers' own ``replace_with_bnb_linear`` (with
    ``get_keys_to_not_convert``, as ``from_pretrained`` calls it) on the same meta model: the same modules become
    ``Linear4bit``, with the same (in, out) features — GPT-2's Conv1D included, Falcon's FalconLinear (an
    ``nn.Linear`` subclass) left alone by both."""
    ours, theirs = _bnb_conversions(FAMILIES[family])
    assert ours == theirs
    assert (len(ours) == 0) == (family == "falcon")


def test_falcon_quantised_base_is_refused_by_both_methods() -> None:
    from trainfit.errors import StrategyError

    spec = spec_from_config(FAMILIES["falcon"], name="small-falcon", source="test")
    a, b = finetune_setup("qlora", rank=8, targets="all-linear")
    s = Strategy(adapter=a, base_weights=b, micro_batch=1, seq_len=32)
    for method in ("analytic", "trace"):
        with pytest.raises(StrategyError, match="not its FalconLinear layers"):
            estimate(spec, s, method=method)


@pytest.mark.parametrize("ckpt", ["none", "full"])
def test_lora_on_a_4bit_base_is_not_kbit_prepared(ckpt: str) -> None:
    """``--finetune lora --base-dtype nf4`` is a 4-bit base wrapped by ``get_peft_model`` alone; QLoRA is the same
    plus ``prepare_model_for_kbit_training`` (fp32 norms, embeddings and head). Under pure bf16 the two differ by
    those fp32 copies: the trace (real PEFT) must agree with the analytic for plain LoRA on nf4 (a trace that
    prepared every 4-bit base was 5.6% above it), and QLoRA must hold more than it."""
    spec = spec_from_config(FAMILIES["llama"], name="small-llama", source="test")
    s = Strategy(precision="pure-bf16", checkpointing=ckpt, micro_batch=2, seq_len=128)
    a, b = finetune_setup("lora", rank=8, targets="all-linear", base_dtype="nf4")
    assert not b.kbit_prepared
    lora = dataclasses.replace(s, adapter=a, base_weights=b)
    ra, rt = estimate(spec, lora), estimate(spec, lora, method="trace", simulate_allocator=False)
    for pa, pt in zip(ra.phases, rt.phases, strict=True):
        assert abs(pa.total_bytes - pt.total_bytes) <= 0.01 * pt.total_bytes, (pa.phase, pa.total_bytes, pt.total_bytes)
    a, b = finetune_setup("qlora", rank=8, targets="all-linear")
    assert b.kbit_prepared
    qlora = dataclasses.replace(s, adapter=a, base_weights=b)  # (without checkpointing: a MATRIX cell, traced once)
    rq = traced_once(estimate, spec, qlora, method="trace", simulate_allocator=False)
    # prepare_model_for_kbit_training's fp32 casts: the 1024×256 embedding and head tables alone add 2 × 1024·256·2
    assert rq.phases[-1].total_bytes - rt.phases[-1].total_bytes >= 2 * 1024 * 256 * 2


@pytest.mark.parametrize(
    ("family", "targets", "modules"),
    [
        ("gpt2", "all-linear", 4),  # c_attn, attn.c_proj, c_fc, mlp.c_proj
        ("gpt2", "c_proj", 2),  # PEFT's suffix match: both c_proj
        ("falcon", "all-linear", 4),
        ("phi3", "all-linear", 4),  # qkv_proj, o_proj, gate_up_proj, down_proj
        ("phi", "dense,fc2", 2),
        ("bert", "query,value", 2),
        ("bert", "all-linear", 6),  # and the MLM head's cls.predictions.transform.dense
        ("bert", "dense", 3),  # attention.output.dense, intermediate.dense, output.dense (and the head's)
    ],
)
def test_the_adapters_are_the_ones_peft_builds(family: str, targets: str, modules: int) -> None:
    """The analytic trainable count (trainfit.analytic.adapters.layer_linears, names as transformers spells them)
    against the trace's, which counts what PEFT really wrapped (``all-linear`` resolved by
    ``_maybe_include_all_linear_layers``; a name matched as a module-path suffix)."""
    spec = spec_from_config(FAMILIES[family], name=f"small-{family}", source="test")
    a, b = finetune_setup("lora", rank=8, targets=targets, base_dtype="bf16")
    s = Strategy(adapter=a, base_weights=b, micro_batch=1, seq_len=32)
    from trainfit.analytic.adapters import adapter_sites

    assert len(adapter_sites(spec, a)) == modules
    rt = estimate(spec, s, method="trace", simulate_allocator=False)
    assert estimate(spec, s).trainable_params == rt.trainable_params


def test_all_linear_on_a_transformers5_moe_is_what_peft_converts_it_to() -> None:
    """transformers 5 fuses Mixtral's experts into 3-D ``gate_up_proj``/``down_proj`` parameters and makes the router
    a custom module; PEFT (peft/utils/transformers_weight_conversion.py ``_convert_peft_config_moe``) turns
    ``all-linear`` into the attention linears, the router ``gate`` and ``target_parameters`` for the experts
    (``ParamWrapper``: lora_A r·E × d_in, lora_B d_out × r·E, twice the rank for the fused gate_up). The trace runs
    exactly that (counted by hand here), and so does the analytic (trainfit.analytic.adapters.moe_param_sites)."""
    cfg = {
        "model_type": "mixtral", "hidden_size": 256, "intermediate_size": 384, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "num_local_experts": 4,
        "num_experts_per_tok": 2, "max_position_embeddings": 512,
    }  # fmt: skip
    spec = spec_from_config(cfg, name="small-mixtral", source="test")
    a, b = finetune_setup("lora", rank=8, targets="all-linear", base_dtype="bf16")
    s = Strategy(adapter=a, base_weights=b, micro_batch=1, seq_len=32)
    r, e, h, i, kv = 8, 4, 256, 384, 128
    attention = r * (h + h) + 2 * r * (h + kv) + r * (h + h)
    router = r * (h + e)
    experts = (2 * r * e) * (h + 2 * i) + (r * e) * (i + h)
    rt = estimate(spec, s, method="trace", simulate_allocator=False)
    assert rt.trainable_params == 2 * (attention + router + experts)
    assert estimate(spec, s).trainable_params == rt.trainable_params


# MoE layers of transformers 5 under PEFT's conversion (trainfit.analytic.activations.frozen_moe_terms): experts
# large enough against the vocabulary that the parametrized expert weights (ParamWrapper's baddbmm) dominate.
MOE_FAMILIES: dict[str, dict[str, Any]] = {
    "mixtral": {
        "model_type": "mixtral", "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "num_local_experts": 8,
        "num_experts_per_tok": 2, "max_position_embeddings": 512,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 192,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": 1024, "num_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 512,
        "tie_word_embeddings": False, "norm_topk_prob": True,
    },
    # PEFT does not convert qwen2_moe: all-linear adapts attention, the shared expert and shared_expert_gate only
    "qwen2_moe": {
        "model_type": "qwen2_moe", "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 192,
        "shared_expert_intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1024, "num_experts": 8, "num_experts_per_tok": 2,
        "max_position_embeddings": 512, "tie_word_embeddings": False,
    },
}  # fmt: skip

# (family, targets, checkpointing, adapter dtype, precision, base dtype)
MOE_MATRIX = [
    ("mixtral", "all-linear", "none", "fp32", "amp-bf16", "bf16"),
    ("mixtral", "all-linear", "full", "fp32", "amp-bf16", "bf16"),
    ("qwen3_moe", "q_proj,gate_proj,up_proj", "full", "fp32", "amp-bf16", "bf16"),
    ("qwen2_moe", "all-linear", "full", "fp32", "amp-bf16", "bf16"),
]
MOE_SLOW = [
    ("mixtral", "q_proj", "none", "fp32", "amp-bf16", "bf16"),
    ("mixtral", "all-linear", "none", "fp32", "amp-bf16", None),  # fp32 base: fp32 experts and new weights
    ("mixtral", "all-linear", "full", "bf16", "pure-bf16", "bf16"),  # no factor copies
    ("mixtral", "w1,w3,q_proj", "none", "fp32", "pure-bf16", "bf16"),
    ("qwen3_moe", "all-linear", "full", "fp32", "amp-bf16", "bf16"),
    ("qwen3_moe", "down_proj,q_proj,v_proj", "full", "fp32", "amp-bf16", "bf16"),
    ("qwen2_moe", "all-linear", "none", "fp32", "amp-bf16", "bf16"),
    ("qwen2_moe", "q_proj,v_proj", "none", "fp32", "amp-bf16", "bf16"),
    ("qwen2_moe", "all-linear", "none", "fp32", "amp-bf16", None),  # fp32 experts, frozen: GroupedMmBackward0
    ("qwen3_moe", "all-linear", "selective", "fp32", "amp-bf16", "bf16"),  # the frozen core's output not kept
]


@pytest.mark.parametrize(
    ("family", "targets", "ckpt", "adapter_dtype", "precision", "base"),
    MOE_MATRIX + [pytest.param(*x, marks=pytest.mark.slow) for x in MOE_SLOW],
)
def test_moe_lora_analytic_agrees_with_the_peft_trace(
    family: str, targets: str, ckpt: str, adapter_dtype: str, precision: str, base: str | None
) -> None:
    """Every phase within 2% of the trace, the cuBLAS workspaces (the same constant in both) left out."""
    from trainfit.result import Component

    spec = spec_from_config(MOE_FAMILIES[family], name=f"small-{family}", source="test")
    a, b = finetune_setup("lora", rank=8, targets=targets, adapter_dtype=adapter_dtype, base_dtype=base)
    s = Strategy(adapter=a, base_weights=b, precision=precision, checkpointing=ckpt, micro_batch=2, seq_len=256)
    ra = estimate(spec, s)
    rt = estimate(spec, s, method="trace", simulate_allocator=False)
    assert ra.trainable_params == rt.trainable_params
    for pa, pt in zip(ra.phases, rt.phases, strict=True):
        assert pa.get(Component.WORKSPACES) == pt.get(Component.WORKSPACES)
        ref = pt.total_bytes - pt.get(Component.WORKSPACES)
        assert abs(pa.total_bytes - pt.total_bytes) <= 0.02 * ref, (pa.phase, pa.total_bytes, pt.total_bytes)


@pytest.mark.parametrize("family", ["qwen3", pytest.param("llama", marks=pytest.mark.slow)])
def test_lora_with_selective_recompute_agrees_as_tightly_as_without(family: str) -> None:
    """LoRA over a frozen base with ``--checkpointing selective``: the fused kernel's output is saved only by
    the kernel inside the core's checkpoint (a frozen o_proj keeps no input), and selective recompute does
    not enable the embeddings' input grads (no ``gradient_checkpointing_enable``), so the first layer saves
    what it saves without checkpointing. Each phase within 0.1% of the trace, as without checkpointing."""
    spec = spec_from_config(FAMILIES[family], name=f"small-{family}", source="test")
    a, b = finetune_setup("lora", rank=8, targets="all-linear", adapter_dtype="fp32", base_dtype="bf16")
    s = Strategy(adapter=a, base_weights=b, precision="amp-bf16", checkpointing="selective", micro_batch=2, seq_len=128)
    ra = estimate(spec, s)
    rt = estimate(spec, s, method="trace", simulate_allocator=False)
    for pa, pt in zip(ra.phases, rt.phases, strict=True):
        assert abs(pa.total_bytes - pt.total_bytes) <= 0.001 * pt.total_bytes, (
            pa.phase,
            pa.total_bytes,
            pt.total_bytes,
        )


# DeepSeek (trainfit.analytic.activations.frozen_latent_terms, _fp32_router_terms): multi-head latent attention, one
# leading dense layer and a shared expert beside the routed ones. PEFT's conversion (the Qwen2-MoE pattern) adapts the
# MLA linears, the router and the expert stacks; the dense MLP and the shared expert stay frozen. V3 has q_a/q_b and a
# sigmoid router (16-bit scores under autocast); V2 here takes V2-Lite's plain q_proj and a softmax router (fp32
# routing weights, which make the routed output fp32).
DEEPSEEK: dict[str, Any] = {
    "model_type": "deepseek_v3", "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 96,
    "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "vocab_size": 1024,
    "max_position_embeddings": 512, "tie_word_embeddings": False, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True,
}  # fmt: skip
DEEPSEEK_V2 = DEEPSEEK | {"model_type": "deepseek_v2", "q_lora_rank": None, "norm_topk_prob": False}

# (config, targets, dropout, checkpointing, precision, base dtype); fp32 adapters
DEEPSEEK_MATRIX = [
    (DEEPSEEK, "all-linear", 0.0, "none", "amp-bf16", "bf16"),
    (DEEPSEEK_V2, "all-linear", 0.0, "full", "amp-bf16", "bf16"),
    # the first layer (no input gradients): q_a's adapter makes its latent norm save, kv's latent norm saves
    # nothing, and kv_b's adapter over it keeps no dropout mask
    (DEEPSEEK, "q_a_proj,kv_b_proj", 0.1, "none", "amp-bf16", None),
]
DEEPSEEK_SLOW = [
    (DEEPSEEK, "all-linear", 0.0, "full", "pure-bf16", "bf16"),  # fp32 logits, fp32 routing weights
    (DEEPSEEK, "q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj", 0.1, "none", "amp-bf16", "bf16"),
    (DEEPSEEK, "all-linear", 0.0, "selective", "amp-bf16", "bf16"),
]


# QLoRA on MoE and MLA layers: transformers' replace_with_bnb_linear packs every nn.Linear (attention, MLA's
# projections, shared experts, dense MLPs) and leaves the 3-D expert stacks and the routers float, which
# prepare_model_for_kbit_training then casts to fp32; PEFT adapts the experts through ParamWrapper as over a float base.
QLORA_MOE = [
    (MOE_FAMILIES["mixtral"], "full", 2),  # +0.7% in backward
    # +0.02% (was -0.9% in the forward: kv_a's fp32 output kept whole by its latent norm, v's autocast cast saved
    # instead of kv_b's output, the KV cache's k_rot copy: analytic.activations.frozen_layer_terms)
    (DEEPSEEK, "none", None),
    # +0.01% (was -2.6%: the packed shared expert returns its fp32 input's dtype, so its SwiGLU is fp32)
    (MOE_FAMILIES["qwen2_moe"], "none", 2),
]


@pytest.mark.parametrize("cfg", [MOE_FAMILIES["mixtral"], MOE_FAMILIES["qwen2_moe"], DEEPSEEK])
def test_transformers_packs_no_expert_stack_nor_router(cfg: dict[str, Any]) -> None:
    """transformers' own ``replace_with_bnb_linear`` on a meta MoE/MLA model: the trace's ``to_linear4bit`` converts
    the same modules, and the weights it converts are, element for element, the layer tensors the analytic packs
    (``analytic.adapters.bnb_converted``: the linears, not the routers nor the 3-D expert stacks)."""
    from trainfit.analytic.adapters import bnb_converted
    from trainfit.arch.params import inventory

    ours, theirs = _bnb_conversions(cfg)
    assert ours == theirs
    spec = spec_from_config(cfg, name=f"small-{cfg['model_type']}", source="test")
    packed = sum(g.count * t.numel for g in inventory(spec).layers for t in g.tensors if bnb_converted(t))
    assert packed == sum(i * o for i, o in theirs.values())


@pytest.mark.parametrize(("cfg", "ckpt", "rotary_blocks"), QLORA_MOE)
def test_qlora_on_moe_and_mla_layers_agrees_with_the_trace(
    cfg: dict[str, Any], ckpt: str, rotary_blocks: int | None
) -> None:
    """Every phase within the 3% of the QLoRA agreement matrix; on Mixtral the stored base byte-exact too (the
    packed attention linears, the float router and experts): the analytic weights + adapter weights against the
    trace's weights, which also hold the rotary ``inv_freq``/``original_inv_freq`` buffers (one block each)."""
    from trainfit.result import Component

    spec = spec_from_config(cfg, name=f"small-{cfg['model_type']}", source="test")
    a, b = finetune_setup("qlora", rank=8, targets="all-linear")
    s = Strategy(adapter=a, base_weights=b, precision="amp-bf16", checkpointing=ckpt, micro_batch=2, seq_len=256)  # type: ignore[arg-type]
    ra = estimate(spec, s)
    rt = estimate(spec, s, method="trace", simulate_allocator=False)
    assert ra.trainable_params == rt.trainable_params
    assert_phases_agree(ra, rt, 0.03)
    if rotary_blocks is not None:
        stored = ra.phases[-1].get(Component.WEIGHTS) + ra.phases[-1].get(Component.ADAPTER_WEIGHTS)
        assert rt.phases[-1].get(Component.WEIGHTS) == stored + rotary_blocks * 512


@pytest.mark.parametrize(
    ("cfg", "targets", "dropout", "ckpt", "precision", "base"),
    DEEPSEEK_MATRIX + [pytest.param(*x, marks=pytest.mark.slow) for x in DEEPSEEK_SLOW],
)
def test_deepseek_lora_analytic_agrees_with_the_peft_trace(
    cfg: dict[str, Any], targets: str, dropout: float, ckpt: str, precision: str, base: str | None
) -> None:
    """LoRA on DeepSeek's MLA and MoE layers: the same trainable tensors as PEFT builds, every phase within 1% of
    the trace (0.4% at most when written; the forward's own transients are what is left)."""
    spec = spec_from_config(cfg, name=f"small-{cfg['model_type']}", source="test")
    a, b = finetune_setup("lora", rank=8, targets=targets, dropout=dropout, adapter_dtype="fp32", base_dtype=base)
    s = Strategy(adapter=a, base_weights=b, precision=precision, checkpointing=ckpt, micro_batch=2, seq_len=256)
    ra = estimate(spec, s)
    rt = estimate(spec, s, method="trace", simulate_allocator=False)
    assert ra.trainable_params == rt.trainable_params
    assert_phases_agree(ra, rt, 0.01)


# The first layer when the embeddings' output needs no gradient (no layer checkpointing): nothing is saved before its
# first adapter (trainfit.analytic.adapters.BlindLayer), and its KV cache holds k and v that no kernel saves
# (activations.first_layer_cache_bytes). (config, targets, attention, precision, base dtype, checkpointing)
FIRST_LAYER = [
    ("llama", "o_proj", "sdpa", "amp-bf16", "bf16", "none"),  # the whole attention unsaved
    ("llama", "gate_proj,up_proj,down_proj", "sdpa", "amp-bf16", "bf16", "none"),
    ("qwen2_moe", "down_proj", "sdpa", "amp-bf16", "bf16", "none"),  # router and routed experts save nothing
    ("mixtral", "o_proj", "sdpa", "amp-bf16", "bf16", "none"),  # once refused
    # a parallel block's MLP over the unsaved input; Phi-2's backward peaks in its logits' backward, −1.8% here with
    # any target (not this mechanism: the head's moment), so only its forward is held to 0.15%
    ("phi", "q_proj", "sdpa", "amp-bf16", "bf16", "none"),
    ("qwen3", "q_proj,v_proj", "sdpa", "amp-bf16", "bf16", "none"),  # k's norm keeps nothing
    ("bert", "query,value", "sdpa", "amp-bf16", "bf16", "none"),  # post-norm: its norms read the live attention (−1.4%)
]
FIRST_LAYER_SLOW = [
    ("llama", "q_proj,v_proj", "eager", "amp-bf16", "bf16", "none"),  # q·kᵀ keeps k, not q
    ("llama", "v_proj", "sdpa", "fp32", None, "none"),  # the math kernel, in part
    ("llama", "up_proj", "sdpa", "amp-bf16", "nf4", "none"),  # act kept, gate and up not
    ("llama", "down_proj", "sdpa", "amp-bf16", "int8", "none"),
    ("qwen2_moe", "shared_expert_gate", "sdpa", "amp-bf16", "bf16", "none"),
    ("neox", "dense", "sdpa", "amp-bf16", "bf16", "none"),  # the cache's copies of a fused qkv's views
    ("phi3", "down_proj", "sdpa", "amp-bf16", "bf16", "none"),
    ("gemma", "v_proj", "eager", "amp-bf16", "bf16", "none"),
]


@pytest.mark.parametrize(
    ("family", "targets", "attention", "precision", "base", "ckpt"),
    FIRST_LAYER + [pytest.param(*x, marks=pytest.mark.slow) for x in FIRST_LAYER_SLOW],
)
def test_the_first_layer_saves_from_its_first_adapter_on(
    family: str, targets: str, attention: str, precision: str, base: str | None, ckpt: str
) -> None:
    """Forward and backward within 0.15% of the trace, without the cuBLAS workspaces (the 2-layer configs make the
    first layer half the stack: before, an MLP or o_proj target was +2…+22% over, a q/k/v subset under eager
    attention +3…+8%); the optimizer step, which the first layer does not reach, within 2% as elsewhere here."""
    from trainfit.result import Component, Phase

    cfg = (FAMILIES | MOE_FAMILIES)[family]
    spec = spec_from_config(cfg, name=f"small-{family}", source="test")
    how = "qlora" if base == "nf4" else "lora"
    a, b = finetune_setup(how, rank=8, targets=targets, adapter_dtype="fp32", base_dtype=base)
    s = Strategy(
        adapter=a, base_weights=b, precision=precision, checkpointing=ckpt, attention=attention, micro_batch=2,
        seq_len=256,
    )  # fmt: skip
    ra = estimate(spec, s)
    rt = estimate(spec, s, method="trace", simulate_allocator=False)
    for pa, pt in zip(ra.phases, rt.phases, strict=True):
        ref = pt.total_bytes - pt.get(Component.WORKSPACES)
        loose = pa.phase is Phase.OPTIMIZER_STEP or (family == "phi" and pa.phase is Phase.BACKWARD)
        tol = 0.02 if loose else 0.0015
        assert abs(pa.total_bytes - pt.total_bytes) <= tol * ref, (pa.phase, pa.total_bytes, pt.total_bytes)


# A frozen non-gated MLP in a checkpointed forward (trainfit.analytic.activations._dense_mlp_forward_bytes): the
# layer's locals and the worst of fc1's branch, the activation's chain (HF's Python GeLU in fp32 under autocast) and
# fc2; with Liger's fused linear cross-entropy no logits hide it. (config, targets, base dtype, dropout, loss)
DENSE_FORWARD = [
    ("gpt2", "all-linear", "bf16", 0.0, "fused-linear"),  # was −32%: the Python GeLU's fp32 chain
    ("neox", "all-linear", "nf4", 0.0, "fused-linear"),  # was −12%: a 4-bit fc1's clone and converted branch
    ("bert", "intermediate.dense", "bf16", 0.0, "standard"),  # the embedding output held as a grad-requiring leaf
    ("gpt2", "full", None, 0.0, "standard"),  # full fine-tuning (no adapter): was −1.4%
]
DENSE_FORWARD_SLOW = [
    ("gpt2", "c_fc", "bf16", 0.1, "fused-linear"),
    ("gpt2", "all-linear", "nf4", 0.0, "fused-linear"),
    ("neox", "dense_h_to_4h", "nf4", 0.1, "fused-linear"),
    ("phi", "fc1", "bf16", 0.0, "standard"),  # a parallel block: the normed input and the attention's output held
]


@pytest.mark.parametrize(
    ("family", "targets", "base", "dropout", "loss"),
    DENSE_FORWARD + [pytest.param(*x, marks=pytest.mark.slow) for x in DENSE_FORWARD_SLOW],
)
def test_a_checkpointed_dense_mlps_forward_agrees_with_the_trace(
    family: str, targets: str, base: str | None, dropout: float, loss: str
) -> None:
    """The forward within 0.2% of the trace, the cuBLAS workspaces left out (the backward of these MLPs is still the
    fitted sum: not held here)."""
    from trainfit.result import Component
    from trainfit.strategy import MemorySavers

    spec = spec_from_config(FAMILIES[family], name=f"small-{family}", source="test")
    how = "qlora" if base == "nf4" else "lora"
    s = Strategy(precision="amp-bf16", checkpointing="full", micro_batch=2, seq_len=256, savers=MemorySavers(loss=loss))
    if targets != "full":
        a, b = finetune_setup(how, rank=8, targets=targets, adapter_dtype="fp32", base_dtype=base, dropout=dropout)
        s = dataclasses.replace(s, adapter=a, base_weights=b)
    pa = estimate(spec, s).phases[0]
    pt = estimate(spec, s, method="trace", simulate_allocator=False).phases[0]
    ref = pt.total_bytes - pt.get(Component.WORKSPACES)
    assert abs(pa.total_bytes - pt.total_bytes) <= 0.002 * ref, (pa.total_bytes, pt.total_bytes)


# A frozen non-gated MLP's backward (trainfit.analytic.activations.frozen_dense_backward_bytes): the activation's
# chain (Python GeLU: three fp32 t·i gradients under autocast), an adapted fc2's input gradients and their sum.
# (config, targets, base dtype, checkpointing)
DENSE_BACKWARD = [
    ("gpt2", "all-linear", "bf16", "none"),  # was +2.7%
    ("neox", "all-linear", "nf4", "none"),
    ("gpt2", "all-linear", "nf4", "full"),  # was +6.1%
]
DENSE_BACKWARD_SLOW = [
    ("gpt2", "mlp.c_proj", "bf16", "none"),
    ("phi", "all-linear", "nf4", "none"),
    ("neox", "all-linear", "bf16", "none"),
]


@pytest.mark.parametrize(
    ("family", "targets", "base", "ckpt"),
    DENSE_BACKWARD + [pytest.param(*x, marks=pytest.mark.slow) for x in DENSE_BACKWARD_SLOW],
)
def test_a_dense_mlps_backward_agrees_with_the_trace(family: str, targets: str, base: str, ckpt: str) -> None:
    """The backward within 0.2% of the trace without the workspaces. Not held here: a checkpointed float base's
    recomputation moments (GPT-2/Phi-2 −1.0%, NeoX −1.4%, Falcon −1.4%, BERT −2.5%; NeoX QLoRA +4.3%: the trace's
    peak inside fc2's input-gradient sum, not fully accounted for yet — docs/finetuning.md)."""
    from trainfit.result import Component

    spec = spec_from_config(FAMILIES[family], name=f"small-{family}", source="test")
    how = "qlora" if base == "nf4" else "lora"
    a, b = finetune_setup(how, rank=8, targets=targets, adapter_dtype="fp32", base_dtype=base)
    s = Strategy(adapter=a, base_weights=b, precision="amp-bf16", checkpointing=ckpt, micro_batch=2, seq_len=256)
    pa = estimate(spec, s).phases[1]
    pt = estimate(spec, s, method="trace", simulate_allocator=False).phases[1]
    ref = pt.total_bytes - pt.get(Component.WORKSPACES)
    assert abs(pa.total_bytes - pt.total_bytes) <= 0.002 * ref, (pa.total_bytes, pt.total_bytes)
