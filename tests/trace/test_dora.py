"""DoRA (``LoraConfig(use_dora=True)``): the trace runs real PEFT DoRA modules; the analytic closed form, with and
without dropout (trainfit.analytic.adapters._dora_saved, dora_weight_copy_bytes), is checked against it."""

from __future__ import annotations

import dataclasses

import pytest

from trainfit import Strategy, estimate
from trainfit.arch.config import spec_from_config
from trainfit.errors import StrategyError
from trainfit.strategy import finetune_setup

from .conftest import traced_once

pytest.importorskip("peft")

LLAMA = {
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
    "max_position_embeddings": 512, "tie_word_embeddings": False,
}  # fmt: skip


def _strategy(kind: str, base: str = "bf16") -> Strategy:
    a, b = finetune_setup("lora", rank=8, targets="q_proj,v_proj", base_dtype=base)
    return Strategy(adapter=dataclasses.replace(a, kind=kind), base_weights=b, micro_batch=2, seq_len=128)


def test_dora_is_traced_with_its_magnitude_vectors() -> None:
    spec = spec_from_config(LLAMA, name="small-llama", source="test")
    lora = traced_once(estimate, spec, _strategy("lora"), method="trace", simulate_allocator=False)
    dora = traced_once(estimate, spec, _strategy("dora"), method="trace", simulate_allocator=False)
    # PEFT's lora_magnitude_vector: one d_out vector per adapted linear (q: 256, v: 128), 4 layers.
    assert dora.trainable_params - lora.trainable_params == 4 * (256 + 128)
    # DoRA's forward saves more than LoRA's (the identity through lora_A, a second base output).
    assert dora.phases[0].total_bytes > lora.phases[0].total_bytes


# (precision, checkpointing, targets, adapter dtype, dropout, tolerance)
DORA = [
    ("amp-bf16", "none", "q_proj,v_proj", "fp32", 0.0, 0.005),
    ("pure-bf16", "none", "all-linear", "bf16", 0.0, 0.005),
    ("pure-bf16", "full", "q_proj,v_proj", "bf16", 0.0, 0.005),
    ("amp-bf16", "full", "all-linear", "fp32", 0.0, 0.015),  # the weight norm's transients in the forward: -1.1%
    # With dropout PEFT runs the base linear again on the dropped input and keeps the weight it multiplied by.
    ("amp-bf16", "none", "q_proj,v_proj", "fp32", 0.1, 0.005),
    ("pure-bf16", "none", "all-linear", "fp32", 0.1, 0.01),  # the fp32 weight copies: -0.75% in the forward
    ("pure-bf16", "none", "all-linear", "bf16", 0.1, 0.005),  # no copy: the parameter itself is saved
    ("amp-bf16", "full", "all-linear", "fp32", 0.1, 0.02),  # forward transients under recomputation: -1.8%
]


@pytest.mark.parametrize(("precision", "ckpt", "targets", "adapter_dtype", "dropout", "tol"), DORA)
def test_dora_analytic_agrees_with_the_peft_trace(
    precision: str, ckpt: str, targets: str, adapter_dtype: str, dropout: float, tol: float
) -> None:
    """The closed form of DoRA's forward (analytic.adapters._dora_saved, dora_norm_transient_bytes) against real
    PEFT DoRA modules traced on fake tensors, every phase; and by hand, what DoRA saves beyond LoRA in the trace
    (q_proj,v_proj, amp): per layer and adapted linear the base output and lora_B's output (2 × 2·t·d_out, bf16
    under autocast) and three fp32 d_out vectors."""
    spec = spec_from_config(LLAMA, name="small-llama", source="test")
    a, b = finetune_setup(
        "lora", rank=8, targets=targets, base_dtype="bf16", dora=True, adapter_dtype=adapter_dtype, dropout=dropout
    )
    s = Strategy(adapter=a, base_weights=b, precision=precision, checkpointing=ckpt, micro_batch=2, seq_len=128)  # type: ignore[arg-type]
    ra = estimate(spec, s, simulate_allocator=False)
    rt = traced_once(estimate, spec, s, method="trace", simulate_allocator=False)
    for pa, pt in zip(ra.phases, rt.phases, strict=True):
        assert abs(pa.total_bytes - pt.total_bytes) <= tol * pt.total_bytes, (pa.phase, pa.total_bytes, pt.total_bytes)


def test_dora_saves_the_two_outputs_beyond_lora() -> None:
    spec = spec_from_config(LLAMA, name="small-llama", source="test")
    lora = traced_once(estimate, spec, _strategy("lora"), method="trace", simulate_allocator=False)
    dora = traced_once(estimate, spec, _strategy("dora"), method="trace", simulate_allocator=False)
    t = 256
    extra = 4 * sum(2 * 2 * t * d + 3 * max(512, 4 * d) for d in (256, 128))  # q: d_out 256, v: 128; 4 layers
    from trainfit.result import Component

    got = dora.phases[0].components[Component.ACTIVATIONS] - lora.phases[0].components[Component.ACTIVATIONS]
    # layer 0 keeps one d_out vector fewer (its base output needs no gradient of the scale - 1)
    assert 0 <= extra - got <= 1024 + 512


def test_dora_dropout_keeps_a_weight_copy_per_adapted_linear() -> None:
    """By hand, from PEFT's code (variants.py ``DoraLinearVariant.forward``, dora.py ``DoraLinearLayer.forward``):
    with dropout, ``F.linear(dropout(x), weight.to(x.dtype))`` saves the weight it multiplied by; under autocast
    with fp32 adapters that is autocast's bf16 cast of the fp32 copy, 2·d_in·d_out per adapted linear and layer
    (q: 256×256, v: 256×128), four layers but the first (its input needs no gradient without checkpointing).
    The analytic activations with dropout minus without (where the base output is reused: same bytes, bf16)
    must hold those copies plus the dropout masks (1·t·d_in per linear) the trace also shows."""
    spec = spec_from_config(LLAMA, name="small-llama", source="test")
    t = 256

    def act(dropout: float, method: str) -> int:
        a, b = finetune_setup("lora", rank=8, targets="q_proj,v_proj", base_dtype="bf16", dora=True, dropout=dropout)
        s = Strategy(adapter=a, base_weights=b, micro_batch=2, seq_len=128)
        r = (
            traced_once(estimate, spec, s, method=method, simulate_allocator=False)
            if method == "trace"
            else estimate(spec, s, method=method, simulate_allocator=False)
        )
        from trainfit.result import Component

        return r.phases[0].components[Component.ACTIVATIONS]

    copies = 3 * 2 * (256 * 256 + 256 * 128)
    masks = 3 * 2 * t * 256  # q and v both read the normed input; layer 0 keeps no mask either
    got = act(0.1, "analytic") - act(0.0, "analytic")
    assert got == copies + masks
    traced = act(0.1, "trace") - act(0.0, "trace")
    assert abs(traced - got) <= 4 * 512, (traced, got)


# DoRA over a bitsandbytes base (trace: real PEFT bnb DoRA layers, the weight dequantised as bitsandbytes does on a
# GPU, trainfit.trace.bnb.dequantize_weight): (finetune, base, precision, checkpointing, targets, dropout, tolerance).
QDORA = [
    ("lora", "nf4", "amp-bf16", "none", "q_proj,v_proj", 0.0, 0.005),
    ("lora", "int8", "pure-bf16", "none", "all-linear", 0.0, 0.005),  # fp32 adapters: x cast, the int8 dequant
    # Under recomputation the forward's weight-norm transients come back in backward (as over a float base).
    ("qlora", "nf4", "amp-bf16", "full", "all-linear", 0.1, 0.02),  # -1.6% forward, +0.9% backward
    ("lora", "int8", "amp-bf16", "full", "all-linear", 0.1, 0.02),  # +1.7% backward
]


@pytest.mark.parametrize(("how", "base", "precision", "ckpt", "targets", "dropout", "tol"), QDORA)
def test_dora_over_a_quantised_base_agrees_with_the_peft_trace(
    how: str, base: str, precision: str, ckpt: str, targets: str, dropout: float, tol: float
) -> None:
    """The closed form (analytic.adapters.dora_dequant_bytes; the base output a bitsandbytes layer returns in its
    input's dtype; with dropout, the dequantised weight the second base linear saves) against PEFT's DoRA on
    bitsandbytes Linear4bit / Linear8bitLt layers traced on fake tensors, every phase; the trainable tensors are
    LoRA's pairs plus one magnitude vector per adapted linear."""
    pytest.importorskip("bitsandbytes")
    spec = spec_from_config(LLAMA, name="small-llama", source="test")
    a, b = finetune_setup(how, rank=8, targets=targets, base_dtype=base, dora=True, dropout=dropout)
    s = Strategy(adapter=a, base_weights=b, precision=precision, checkpointing=ckpt, micro_batch=2, seq_len=128)  # type: ignore[arg-type]
    ra = estimate(spec, s, simulate_allocator=False)
    rt = traced_once(estimate, spec, s, method="trace", simulate_allocator=False)
    assert ra.trainable_params == rt.trainable_params
    for pa, pt in zip(ra.phases, rt.phases, strict=True):
        assert abs(pa.total_bytes - pt.total_bytes) <= tol * pt.total_bytes, (pa.phase, pa.total_bytes, pt.total_bytes)


def test_dora_refusals() -> None:
    with pytest.raises(StrategyError, match="LoRA variant"):
        finetune_setup("full", dora=True)
