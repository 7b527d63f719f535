"""SDPA's math kernel: the analytic terms ``attn.sdpa_math.*`` and ``attn.softmax`` against what autograd
saves when the kernel really runs, on the CPU (``sdpa_kernel(SDPBackend.MATH)``), storage by storage.

``_scaled_dot_product_attention_math`` (aten/src/ATen/native/transformers/attention.cpp) is a composite of
ordinary aten ops, the same code on CPU and CUDA: 16-bit q, k, v are upcast to fp32 (unless
``allow_fp16_bf16_reduction_math_sdp``), q and k are scaled into new tensors, k and v reach every head
(``repeat_interleave`` under ``enable_gqa``; otherwise the matmul broadcasts them, which copies unless the
batch is 1), and the fp32 softmax output is saved. The one op whose saving differs by device is attention
dropout: CUDA's fused ``native_dropout`` keeps a bool mask, the CPU's ``at::dropout`` an fp32 noise tensor
(``is_fused_kernel_acceptable`` is false on CPU) — 3 bytes more per score, added here as a CPU artefact.

Where the analytic rules pick another kernel for a case (16-bit GQA with ``enable_gqa`` → flash; fp32 with
equal heads → memory-efficient), ``sdpa_kernel`` is patched to MATH: that is what a GPU without FlashAttention
(before sm80) runs, and the terms must be right for it too.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest

from trainfit.analytic import activations as act
from trainfit.arch.config import spec_from_config
from trainfit.strategy import Strategy

pytest.importorskip("torch")
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

S = 32
LLAMA: dict[str, Any] = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
)
# Multi-query Falcon: one k/v head handed to SDPA without enable_gqa, always with a mask.
FALCON: dict[str, Any] = dict(
    model_type="falcon",
    hidden_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    vocab_size=256,
    new_decoder_architecture=False,
    multi_query=True,
    parallel_attn=True,
    bias=False,
    max_position_embeddings=128,
)
CONFIGS: dict[str, dict[str, Any]] = {
    "llama-gqa": LLAMA,
    "llama-mha": {**LLAMA, "num_key_value_heads": 4},
    "llama-gqa-dropout": {**LLAMA, "attention_dropout": 0.1},
    "falcon-mqa": FALCON,
}
PRECISIONS = [("fp32", "float32"), ("pure-bf16", "bfloat16")]


def _math_terms(spec: Any, st: Strategy) -> int:
    with mock.patch.object(act, "sdpa_kernel", return_value=act.MATH):
        terms = act.layer_terms(spec, st)
    return sum(t.bytes for t in terms if t.name.startswith("attn.sdpa_math.") or t.name == "attn.softmax")


def _saved_by_math_kernel(spec: Any, st: Strategy, dtype: Any) -> int:
    """Run SDPA's math kernel on q, k, v shaped as the model hands them over and add up the distinct
    storages autograd saves."""
    b, nh, hd = st.micro_batch, spec.num_heads, spec.head_dim
    kvh = act.sdpa_kv_heads(spec, st)
    masked = spec.sdpa_mask_always
    torch.manual_seed(0)
    q = torch.randn(b, nh, S, hd, dtype=dtype, requires_grad=True)
    k = torch.randn(b, kvh, S, hd, dtype=dtype, requires_grad=True)
    v = torch.randn(b, kvh, S, hd, dtype=dtype, requires_grad=True)
    mask = torch.ones(S, S, dtype=torch.bool).tril().expand(b, 1, S, S) if masked else None
    seen: dict[int, int] = {}

    def pack(t: Any) -> Any:
        st_ = t.untyped_storage()
        seen[st_.data_ptr()] = st_.nbytes()
        return t

    with sdpa_kernel(SDPBackend.MATH), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=not masked,
            dropout_p=spec.attention_dropout,
            enable_gqa=spec.sdpa_gqa and not masked,
        )
    return sum(seen.values())


def _cpu_dropout_artefact(spec: Any, st: Strategy) -> int:
    """CPU dropout saves an fp32 noise tensor where CUDA's native_dropout saves a bool mask: +3 per score."""
    return 3 * st.micro_batch * spec.num_heads * S * S if spec.attention_dropout > 0 else 0


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize(("precision", "dtype"), PRECISIONS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_math_kernel_terms_match_autograd(name: str, precision: str, dtype: str, batch: int) -> None:
    spec = spec_from_config(CONFIGS[name], name=name, source="test")
    st = Strategy(precision=precision, micro_batch=batch, seq_len=S)
    measured = _saved_by_math_kernel(spec, st, getattr(torch, dtype))
    assert _math_terms(spec, st) + _cpu_dropout_artefact(spec, st) == measured


def test_the_cases_cover_both_kernel_choices() -> None:
    """Some cases reach the math kernel by the analytic rules themselves, some only by the patch."""
    chosen = set()
    for name, cfg in CONFIGS.items():
        spec = spec_from_config(cfg, name=name, source="test")
        for precision, _ in PRECISIONS:
            chosen.add(act.sdpa_kernel(spec, Strategy(precision=precision, micro_batch=2, seq_len=S)))
    assert act.MATH in chosen and chosen - {act.MATH}
