"""Eager attention's score chain: dtype widths per recipe and model, derived from the Hugging Face
``eager_attention_forward`` functions and ATen's ``softmax`` (SoftMax.cpp); the byte totals they lead to
are checked against the trace in tests/trace/test_agreement.py."""

from __future__ import annotations

import pytest

from trainfit.analytic.activations import attention_mask_bytes, eager_chain
from trainfit.arch.config import spec_from_config
from trainfit.arch.loader import load_model
from trainfit.strategy import Strategy

GEMMA2 = {
    "model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
}  # fmt: skip


def _s(precision: str, **kw: object) -> Strategy:
    return Strategy(precision=precision, micro_batch=2, seq_len=64, attention="eager", **kw)  # type: ignore[arg-type]


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
    ("extra", "masks"),
    [
        ({}, 1),
        ({"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 2}, 2),
        ({"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 28}, 1),  # no layer slides
        ({"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 2}, 1),
        ({"layer_types": ["full_attention", "sliding_attention", "full_attention", "full_attention"]}, 2),
    ],
)
def test_qwen2_builds_a_sliding_mask_only_when_a_layer_slides(extra: dict[str, object], masks: int) -> None:
    cfg = {
        "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, **extra,
    }  # fmt: skip
    assert spec_from_config(cfg, name="t", source="test").attention_masks == masks
