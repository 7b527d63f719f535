"""LLM.int8 base weights (``--base-dtype int8``): real bitsandbytes ``Linear8bitLt`` layers (has_fp16_weights=False)
run as on CUDA (``MatMul8bitLt``) on fake tensors (trainfit.trace.peft) against the closed forms of
trainfit.analytic (the int8 inputs kept on ``ctx``, which checkpointing cannot drop; the backward's weight
dequantised in the input's dtype). Every phase within 3%; storage byte-exact.
"""

from __future__ import annotations

from typing import Any

import pytest

from trainfit import Strategy, estimate
from trainfit.arch.config import spec_from_config
from trainfit.result import Component
from trainfit.strategy import finetune_setup

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

LLAMA: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
    "max_position_embeddings": 512, "tie_word_embeddings": False,
}  # fmt: skip

# (targets, dropout, checkpointing, precision, intermediate size, micro-batch, seq)
MATRIX = [
    ("q_proj", 0.0, "none", "amp-bf16", 512, 2, 128),
    ("all-linear", 0.1, "none", "amp-bf16", 512, 2, 128),
    ("q_proj,v_proj", 0.0, "none", "pure-bf16", 512, 2, 128),
    ("q_proj", 0.0, "full", "amp-bf16", 512, 2, 128),  # the ctx-held inputs survive checkpointing
    ("all-linear", 0.1, "full", "amp-bf16", 512, 2, 128),
    ("q_proj,v_proj", 0.1, "full", "pure-bf16", 512, 2, 128),
    # a wide MLP and few tokens: the backward's dequantised weight (N·K in the input's dtype) is the peak
    ("q_proj", 0.0, "none", "amp-bf16", 8192, 1, 32),
    ("q_proj", 0.0, "none", "pure-bf16", 8192, 1, 32),
]


@pytest.mark.parametrize(("targets", "dropout", "ckpt", "precision", "inter", "batch", "seq"), MATRIX)
def test_int8_analytic_agrees_with_the_bitsandbytes_trace(
    targets: str, dropout: float, ckpt: str, precision: str, inter: int, batch: int, seq: int
) -> None:
    spec = spec_from_config({**LLAMA, "intermediate_size": inter}, name="small-llama", source="test")
    a, b = finetune_setup("lora", rank=8, targets=targets, dropout=dropout, base_dtype="int8")
    s = Strategy(adapter=a, base_weights=b, precision=precision, checkpointing=ckpt, micro_batch=batch, seq_len=seq)
    ra = estimate(spec, s)
    rt = estimate(spec, s, method="trace", simulate_allocator=False)
    assert ra.trainable_params == rt.trainable_params
    for pa, pt in zip(ra.phases, rt.phases, strict=True):
        assert abs(pa.total_bytes - pt.total_bytes) <= 0.03 * pt.total_bytes, (pa.phase, pa.total_bytes, pt.total_bytes)


def test_int8_trace_stores_the_base_byte_exact() -> None:
    """What an int8 base saves over a bf16 one (int8 CB + fp32 SCB per linear, DESIGN §4.4: N·K + 4·N instead
    of 2·N·K) is the same, to the byte, in the analytic inventory and in the traced bitsandbytes modules (both
    methods hold the same other bytes either way, so the difference isolates the quantised linears)."""
    spec = spec_from_config(LLAMA, name="small-llama", source="test")

    def stored(base: str, method: str) -> int:
        a, b = finetune_setup("lora", rank=8, targets="q_proj,v_proj", base_dtype=base)
        s = Strategy(adapter=a, base_weights=b, precision="pure-bf16", micro_batch=1, seq_len=64)
        c = estimate(spec, s, method=method, simulate_allocator=False).phases[-1].components
        return c.get(Component.WEIGHTS, 0) + c.get(Component.ADAPTER_WEIGHTS, 0)

    saved = {m: stored("bf16", m) - stored("int8", m) for m in ("analytic", "trace")}
    linears = 4 * (256 * (256 + 128 + 128 + 256) + 3 * 256 * 512)  # N·K summed over the 4 layers' linears
    assert saved["analytic"] == saved["trace"]
    assert abs(saved["trace"] - linears) < 4 * 7 * 4096  # 2·N·K − (N·K + 4·N), up to 512-byte rounding
