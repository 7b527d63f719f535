"""DoRA (``LoraConfig(use_dora=True)``): the trace runs real PEFT DoRA modules; the analytic closed form (without
dropout; with it, a one-line refusal: trainfit.analytic.adapters.check_dora) is checked against it."""

from __future__ import annotations

import dataclasses

import pytest

from trainfit import Strategy, estimate
from trainfit.arch.config import spec_from_config
from trainfit.errors import StrategyError
from trainfit.strategy import finetune_setup

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
    lora = estimate(spec, _strategy("lora"), method="trace", simulate_allocator=False)
    dora = estimate(spec, _strategy("dora"), method="trace", simulate_allocator=False)
    # PEFT's lora_magnitude_vector: one d_out vector per adapted linear (q: 256, v: 128), 4 layers.
    assert dora.trainable_params - lora.trainable_params == 4 * (256 + 128)
    # DoRA's forward saves more than LoRA's (the identity through lora_A, a second base output).
    assert dora.phases[0].total_bytes > lora.phases[0].total_bytes


# (precision, checkpointing, targets, adapter dtype, tolerance)
DORA = [
    ("amp-bf16", "none", "q_proj,v_proj", "fp32", 0.005),
    ("pure-bf16", "none", "all-linear", "bf16", 0.005),
    ("pure-bf16", "full", "q_proj,v_proj", "bf16", 0.005),
    ("amp-bf16", "full", "all-linear", "fp32", 0.015),  # the weight norm's transients in the forward: -1.1%
]


@pytest.mark.parametrize(("precision", "ckpt", "targets", "adapter_dtype", "tol"), DORA)
def test_dora_analytic_agrees_with_the_peft_trace(
    precision: str, ckpt: str, targets: str, adapter_dtype: str, tol: float
) -> None:
    """The closed form of DoRA's forward (analytic.adapters._dora_saved, dora_norm_transient_bytes) against real
    PEFT DoRA modules traced on fake tensors, every phase; and by hand, what DoRA saves beyond LoRA in the trace
    (q_proj,v_proj, amp): per layer and adapted linear the base output and lora_B's output (2 × 2·t·d_out, bf16
    under autocast) and three fp32 d_out vectors."""
    spec = spec_from_config(LLAMA, name="small-llama", source="test")
    a, b = finetune_setup("lora", rank=8, targets=targets, base_dtype="bf16", dora=True, adapter_dtype=adapter_dtype)
    s = Strategy(adapter=a, base_weights=b, precision=precision, checkpointing=ckpt, micro_batch=2, seq_len=128)  # type: ignore[arg-type]
    ra = estimate(spec, s, simulate_allocator=False)
    rt = estimate(spec, s, method="trace", simulate_allocator=False)
    for pa, pt in zip(ra.phases, rt.phases, strict=True):
        assert abs(pa.total_bytes - pt.total_bytes) <= tol * pt.total_bytes, (pa.phase, pa.total_bytes, pt.total_bytes)


def test_dora_saves_the_two_outputs_beyond_lora() -> None:
    spec = spec_from_config(LLAMA, name="small-llama", source="test")
    lora = estimate(spec, _strategy("lora"), method="trace", simulate_allocator=False)
    dora = estimate(spec, _strategy("dora"), method="trace", simulate_allocator=False)
    t = 256
    extra = 4 * sum(2 * 2 * t * d + 3 * max(512, 4 * d) for d in (256, 128))  # q: d_out 256, v: 128; 4 layers
    from trainfit.result import Component

    got = dora.phases[0].components[Component.ACTIVATIONS] - lora.phases[0].components[Component.ACTIVATIONS]
    # layer 0 keeps one d_out vector fewer (its base output needs no gradient of the scale - 1)
    assert 0 <= extra - got <= 1024 + 512


def test_dora_refusals() -> None:
    spec = spec_from_config(LLAMA, name="small-llama", source="test")
    with pytest.raises(StrategyError, match="DoRA with --lora-dropout"):
        a, b = finetune_setup("lora", rank=8, targets="q_proj,v_proj", base_dtype="bf16", dora=True, dropout=0.1)
        estimate(spec, Strategy(adapter=a, base_weights=b, micro_batch=2, seq_len=128))
    with pytest.raises(StrategyError, match="DoRA over a quantised base"):
        estimate(spec, _strategy("dora", "int8"), method="trace", simulate_allocator=False)
