"""Analytic vs trace for ``--finetune freeze``: the trace freezes the real model's parameters
(``requires_grad_(False)``, trainfit.trace.peft.freeze_patterns) and lets autograd decide what is saved; the
analytic side counts dead, frozen and trainable layers (trainfit.analytic.adapters.FrozenLayers). Every phase
within 3%.

Eight layers, so that a layer range splits the stack into two runs of four that the trace extrapolates
separately (the depth test holds that extrapolation to a full-depth trace, byte for byte).
"""

from __future__ import annotations

from typing import Any

import pytest

from trainfit import Strategy, estimate
from trainfit.arch.config import spec_from_config
from trainfit.arch.spec import ModelSpec
from trainfit.strategy import finetune_setup

pytest.importorskip("transformers")

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
        "max_position_embeddings": 512, "tie_word_embeddings": False,
    },
    "qwen2": {
        "model_type": "qwen2", "hidden_size": 256, "intermediate_size": 640, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
        "max_position_embeddings": 512, "tie_word_embeddings": True,
    },
}  # fmt: skip

# (family, --freeze, checkpointing, precision)
MATRIX = [
    ("llama", "embeddings", "none", "fp32"),
    ("llama", "embeddings", "full", "amp-bf16"),
    ("llama", "embeddings,layers:0-3", "none", "fp32"),  # a dead prefix: layers 0-3 save nothing
    ("llama", "embeddings,layers:0-3", "none", "amp-bf16"),
    ("llama", "embeddings,layers:0-3", "full", "amp-bf16"),  # checkpointing: input grads on, 0-3 frozen
    # selective recompute turns no input grads on (no gradient_checkpointing_enable): 0-1 stay dead (+6.4% before)
    ("llama", "embeddings,layers:0-1", "selective", "amp-bf16"),
    ("llama", "layers:0-3", "sqrt", "amp-bf16"),  # a frozen bottom segment recomputes the frozen forms
    ("llama", "layers:4-7", "none", "pure-bf16"),  # frozen layers above trainable ones
    ("llama", "embeddings,layers:0-7", "none", "amp-bf16"),  # everything but the final norm and the head
    ("llama", "embeddings,layers:0-7,norm", "full", "fp32"),  # everything but the head
    ("qwen2", "embeddings,layers:0-3", "none", "amp-bf16"),  # tied head: freezing the table freezes it
]


def _spec(family: str) -> ModelSpec:
    return spec_from_config(FAMILIES[family], name=f"small-{family}", source="test")


@pytest.mark.parametrize(("family", "freeze", "ckpt", "precision"), MATRIX)
def test_freeze_analytic_agrees_with_the_trace(family: str, freeze: str, ckpt: str, precision: str) -> None:
    spec = _spec(family)
    a, b = finetune_setup("freeze", freeze=freeze)
    s = Strategy(adapter=a, base_weights=b, precision=precision, checkpointing=ckpt, micro_batch=2, seq_len=128)
    ra = estimate(spec, s)
    rt = estimate(spec, s, method="trace", simulate_allocator=False)
    assert ra.trainable_params == rt.trainable_params
    for pa, pt in zip(ra.phases, rt.phases, strict=True):
        assert abs(pa.total_bytes - pt.total_bytes) <= 0.03 * pt.total_bytes, (pa.phase, pa.total_bytes, pt.total_bytes)


def test_freeze_range_extrapolates_each_run_exactly() -> None:
    """A layer range makes frozen and trainable layers two runs; each is extrapolated on its own, and the
    result equals a trace of all eight layers (and so does the trainable-parameter count)."""
    from trainfit.trace.api import trace_spec

    spec = _spec("llama")
    a, b = finetune_setup("freeze", freeze="layers:4-7")
    s = Strategy(adapter=a, base_weights=b, precision="amp-bf16", micro_batch=1, seq_len=64)
    ext = trace_spec(spec, s)
    full = trace_spec(spec, s, extrapolate=False)
    assert ext.details is not None and len(ext.details.layers_traced) == 3  # base, and one more unit per run
    assert max(ext.details.layers_traced) < 8
    assert ext.trainable_params == full.trainable_params
    for pe, pf in zip(ext.phases, full.phases, strict=True):
        assert pe.components == pf.components, pe.phase


def test_trace_freezes_what_the_inventory_freezes() -> None:
    """Module names and groups select the same tensors in the real model as in the analytic inventory."""
    spec = _spec("llama")
    for freeze in ("q_proj,o_proj", "norm", "lm_head", "embeddings,layers:2-5"):
        a, b = finetune_setup("freeze", freeze=freeze)
        s = Strategy(adapter=a, base_weights=b, micro_batch=1, seq_len=32)
        traced = estimate(spec, s, method="trace", simulate_allocator=False)
        assert estimate(spec, s).trainable_params == traced.trainable_params, freeze
