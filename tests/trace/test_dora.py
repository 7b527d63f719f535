"""DoRA (``LoraConfig(use_dora=True)``): the trace runs real PEFT DoRA modules; the analytic method refuses it in one
line rather than count it as LoRA (trainfit.analytic.adapters.check_dora)."""

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


def test_dora_refusals() -> None:
    spec = spec_from_config(LLAMA, name="small-llama", source="test")
    with pytest.raises(StrategyError, match="does not model DoRA"):
        estimate(spec, _strategy("dora"))
    with pytest.raises(StrategyError, match="DoRA over a quantised base"):
        estimate(spec, _strategy("dora", "int8"), method="trace", simulate_allocator=False)
