"""Attention masks and eager attention's score chain: dtype widths per recipe and model, derived from the
Hugging Face ``eager_attention_forward`` functions, ``masking_utils`` and ATen's ``softmax`` (SoftMax.cpp);
the byte totals they lead to are checked against the trace in tests/trace/test_agreement.py."""

from __future__ import annotations

from typing import Any

import pytest

from trainfit.analytic.activations import attention_mask_bytes, eager_chain
from trainfit.arch.config import spec_from_config
from trainfit.arch.loader import load_model
from trainfit.strategy import Strategy

GEMMA2 = {
    "model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
}  # fmt: skip


def _s(precision: str, attention: str = "eager") -> Strategy:
    return Strategy(precision=precision, micro_batch=2, seq_len=64, attention=attention)  # type: ignore[arg-type]


def _widths(slug: str, precision: str) -> tuple[int, int, int, int, int, bool]:
    c = eager_chain(load_model(slug), _s(precision))
    return c.softmax_in, c.input_copy, c.softmax_out, c.probs, c.grad_in, c.input_held


@pytest.mark.parametrize(
    ("precision", "expected"),
    [
        # fp32: one fp32 chain, the softmax output is the probabilities.
        ("fp32", (4, 0, 4, 0, 4, False)),
        # bf16 weights: bf16 scores + bf16 mask; ATen converts to fp32 first; .to(bf16) while x is held.
        ("pure-bf16", (2, 4, 4, 2, 4, True)),
        ("master-bf16", (2, 4, 4, 2, 4, True)),
        # fp16 weights: CUDA's fused half_to_float kernel, no copy; its backward returns fp16.
        ("master-fp16", (2, 0, 4, 2, 2, True)),
        # autocast: the fp32 mask promotes the scores; q is fp32 after RoPE, so .to() is a no-op and the
        # probs·v matmul makes the 16-bit copy after x is released.
        ("amp-bf16", (4, 0, 4, 2, 4, False)),
        ("amp-fp16", (4, 0, 4, 2, 4, False)),
    ],
)
def test_llama_style_chain(precision: str, expected: tuple[int, ...]) -> None:
    assert _widths("llama-3.1-8b", precision) == expected


def test_gpt2_softmax_keeps_the_scores_dtype() -> None:
    # No dtype= in GPT-2's softmax: in bf16 the output is bf16 and is the probabilities.
    assert _widths("gpt2", "pure-bf16")[2:4] == (2, 0)
    # Under autocast, fp32_set_opt_dtype makes it fp32 and .type(value.dtype) casts to bf16.
    assert _widths("gpt2", "amp-bf16")[2:4] == (4, 2)


def test_bert_has_no_mask_and_fuses_fp16_under_autocast() -> None:
    spec = load_model("bert-base-uncased")
    assert attention_mask_bytes(spec, _s("amp-fp16")) == []
    assert _widths("bert-base-uncased", "amp-fp16")[:3] == (2, 0, 4)  # fp16 scores, fused upcast
    assert _widths("bert-base-uncased", "amp-bf16")[:3] == (2, 4, 4)  # bf16 scores, converted first
    assert eager_chain(spec, _s("amp-bf16")).dropout == 4  # dropout on the fp32 softmax output


def test_masks_follow_the_embedding_dtype_and_sdpa_has_none() -> None:
    spec = spec_from_config(GEMMA2, name="t", source="test")
    b, s = 2, 64
    assert attention_mask_bytes(spec, _s("amp-bf16")) == [4 * b * s * s] * 2  # full + sliding, fp32
    assert attention_mask_bytes(spec, _s("pure-bf16")) == [2 * b * s * s] * 2
    assert attention_mask_bytes(spec, Strategy(precision="amp-bf16", micro_batch=b, seq_len=s)) == []


@pytest.mark.parametrize(
    ("extra", "masks", "sliding"),
    [
        ({}, 1, 0),
        ({"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 2}, 2, 2),
        ({"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 28}, 1, 0),  # no layer slides
        ({"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 2}, 1, 0),
        (
            {
                "sliding_window": 4096,
                "layer_types": ["full_attention", "sliding_attention", "full_attention", "full_attention"],
            },
            2,
            1,
        ),
    ],
)
def test_qwen2_builds_a_sliding_mask_only_when_a_layer_slides(
    extra: dict[str, object], masks: int, sliding: int
) -> None:
    cfg = {
        "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, **extra,
    }  # fmt: skip
    spec = spec_from_config(cfg, name="t", source="test")
    assert (spec.attention_masks, spec.sliding_layers) == (masks, sliding)


def test_sdpa_gets_a_window_mask_from_the_window_on() -> None:
    """``_ignore_causal_mask_sdpa`` skips the mask only while kv_length < sliding_window."""
    from trainfit.analytic.activations import EFFICIENT, FLASH, sdpa_bias_bytes, sdpa_kernel, sdpa_window_mask

    spec = load_model("mistral-7b-v0.1")  # sliding_window 4096, every layer
    assert spec.sliding_layers == spec.num_layers
    below = Strategy(precision="amp-bf16", micro_batch=1, seq_len=4095)
    at = Strategy(precision="amp-bf16", micro_batch=1, seq_len=4096)
    assert not sdpa_window_mask(spec, below) and sdpa_bias_bytes(spec, below) == 0
    assert sdpa_window_mask(spec, at)
    assert sdpa_bias_bytes(spec, at) == 2 * 4096 * 4096  # bf16 bias, 4096 already a multiple of 16
    odd = Strategy(precision="amp-bf16", micro_batch=2, seq_len=4100)
    assert sdpa_bias_bytes(spec, odd) == 2 * 2 * 4100 * 4112  # columns padded to 16
    assert attention_mask_bytes(spec, at) == [4096 * 4096]  # the bool mask, broadcast over the batch
    assert (sdpa_kernel(spec, below), sdpa_kernel(spec, at)) == (FLASH, EFFICIENT)
    assert not sdpa_window_mask(load_model("llama-3.1-8b"), at)


def test_sdpa_kernel_choice() -> None:
    """select_sdp_backend's rules as trainfit applies them (mirrored by the trace's emulation)."""
    from trainfit.analytic.activations import EFFICIENT, FLASH, MATH, sdpa_kernel

    llama = load_model("llama-3.1-8b")  # GQA 32/8, head dim 128
    assert sdpa_kernel(llama, _s("amp-bf16", attention="sdpa")) == FLASH  # enable_gqa, no mask
    # fp32 rules out flash; the memory-efficient kernel takes no GQA: math.
    assert sdpa_kernel(llama, _s("fp32", attention="sdpa")) == MATH
    assert sdpa_kernel(load_model("gpt2"), _s("fp32", attention="sdpa")) == EFFICIENT  # same heads


@pytest.mark.parametrize("release", [(5, 24), (5, 25), None])
def test_falcon_sdpa_kernel_follows_the_transformers_release(release: Any, transformers_release: Any) -> None:
    """Multi-query Falcon-7B, its mask always built: before transformers 5.25 FalconAttention calls SDPA itself
    with one k/v head and no enable_gqa (the math kernel); from 5.25 (or without transformers: the current code)
    the shared interface repeats k/v to every head — stride-0 views — and the memory-efficient kernel runs."""
    from trainfit.analytic.activations import EFFICIENT, MATH, sdpa_kernel, sdpa_kv_heads

    transformers_release(release)
    falcon = load_model("falcon-7b")
    old = release is not None and release < (5, 25)
    assert (falcon.num_kv_heads, falcon.sdpa_gqa, falcon.sdpa_mask_always) == (1, not old, True)
    amp = _s("amp-bf16", attention="sdpa")
    assert sdpa_kernel(falcon, amp) == (MATH if old else EFFICIENT)
    assert sdpa_kv_heads(falcon, amp) == (1 if old else falcon.num_heads)
