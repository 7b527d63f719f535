"""LLM.int8 base weights (``--base-dtype int8``): real bitsandbytes ``Linear8bitLt`` layers (has_fp16_weights=False)
run as on CUDA (``MatMul8bitLt``) on fake tensors (trainfit.trace.peft) against the closed forms of
trainfit.analytic (the int8 inputs kept on ``ctx``, which checkpointing cannot drop and a recomputation drops with its
graph; the backward's weight dequantised in the input's dtype). Every phase within 3%; storage byte-exact. Dense
layers here; MoE and multi-head latent attention layers (Mixtral, Qwen2-MoE, DeepSeek) below.
"""

from __future__ import annotations

from typing import Any

import pytest

from trainfit import Strategy, estimate
from trainfit.arch.config import spec_from_config
from trainfit.result import Component
from trainfit.strategy import finetune_setup

from .conftest import traced_once
from .test_peft import DEEPSEEK, DEEPSEEK_V2, MOE_FAMILIES

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
    rt = traced_once(estimate, spec, s, method="trace", simulate_allocator=False)
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


def test_int8_on_a_parallel_block_keeps_no_second_normed_input() -> None:
    """Phi-2's one norm feeds its attention and its MLP (``fc1`` reads norm1's output): the int8 inputs on ctx are
    norm1's output, the attention output and fc2's input — no norm2 output (analytic.activations.int8_layer_inputs
    lists the layer's own int8 linears). It was counted before: +2.4% in the forward; now within 0.1%."""
    phi = {
        "model_type": "phi", "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
        "num_attention_heads": 4, "vocab_size": 1024, "max_position_embeddings": 512, "partial_rotary_factor": 0.5,
    }  # fmt: skip
    spec = spec_from_config(phi, name="small-phi", source="test")
    a, b = finetune_setup("lora", rank=8, targets="all-linear", base_dtype="int8")
    s = Strategy(adapter=a, base_weights=b, precision="pure-bf16", micro_batch=2, seq_len=128)
    _assert_within(estimate(spec, s), estimate(spec, s, method="trace", simulate_allocator=False), 0.01)


def _assert_within(closed: Any, traced: Any, tolerance: float) -> None:
    """Each phase within ``tolerance`` of the trace's allocated bytes, the cuBLAS workspaces (the same constant in
    both, tens of MiB) left out of the reference."""
    for pa, pt in zip(closed.phases, traced.phases, strict=True):
        assert pa.get(Component.WORKSPACES) == pt.get(Component.WORKSPACES)
        ref = pt.total_bytes - pt.get(Component.WORKSPACES)
        assert abs(pa.total_bytes - pt.total_bytes) <= tolerance * ref, (pa.phase, pa.total_bytes, pt.total_bytes)


# LLM.int8 under MoE and MLA layers (analytic.activations.int8_layer_inputs): transformers' replace_with_bnb_linear
# makes Linear8bitLt of every nn.Linear — attention (MLA's q_a/q_b/kv_a/kv_b/o too), shared experts, Qwen2-MoE's
# shared_expert_gate, DeepSeek's dense MLP — and leaves the 3-D expert stacks and the routers float (fp32 here: the
# recipe's weights). What the trace showed beyond the dense closed forms: a Mixtral layer keeps no norm2 output (no int8
# linear reads it); an int8 linear returns its input's dtype, so the shared experts' SwiGLU is fp32, MLA's kv_a output
# is fp32 (its latent norm saves the split's view: all of kv_a's output) and v reaches SDPA in fp32 (a cast is saved,
# not kv_b's output); the KV cache's copy of k_rot is held to the forward's end; every layer's int8 inputs live until
# the graph goes after the whole backward (the bottom layer's backward holds them all), a recomputed layer's die with
# its graph, and the worst backward moment is inside that recomputation's routed experts (Qwen2-MoE, DeepSeek).
# (config, checkpointing, precision, rotary blocks in the trace's weights); all-linear, amp-bf16, 2 x 256 tokens. Worst
# phase when written, of the trace's bytes without the workspaces: Mixtral +1.08% (backward, full checkpointing: the
# float experts' backward moment counts their routed output as still saved, as over an fp32 base), Qwen2-MoE -0.20%
# (optimizer step), DeepSeek -0.25% (optimizer step).
INT8_MOE = [
    (MOE_FAMILIES["mixtral"], "none", "amp-bf16", 2),  # +0.82% backward
    (MOE_FAMILIES["mixtral"], "full", "amp-bf16", 2),  # +1.08% backward (the bottom layer's)
    (MOE_FAMILIES["qwen2_moe"], "none", "amp-bf16", 2),  # -0.20% optimizer step, +0.02% backward
    (MOE_FAMILIES["qwen2_moe"], "full", "amp-bf16", 2),  # -0.08% backward (inside the recomputed experts)
    (DEEPSEEK, "none", "amp-bf16", None),  # -0.25% optimizer step, +0.03% backward
    (DEEPSEEK, "full", "amp-bf16", None),  # -0.21% forward (inside the last layer's experts), -0.08% backward
]
INT8_MOE_SLOW = [
    (DEEPSEEK_V2, "full", "amp-bf16", None),  # +1.22% backward: the dequantised weight counted at the experts' moment
    (MOE_FAMILIES["qwen2_moe"], "full", "pure-bf16", 2),  # -0.14%: a 16-bit residual is no saved norm input
    (DEEPSEEK, "full", "pure-bf16", None),  # -0.74% backward (a middle layer's: inputs below it, gradients above)
    (DEEPSEEK, "selective", "amp-bf16", None),  # +0.03%: the checkpointed core keeps v, all of kv_b's fp32 output
    (MOE_FAMILIES["mixtral"], "selective", "amp-bf16", 2),  # +1.22% backward, as over an fp32 base
]


@pytest.mark.parametrize(
    ("cfg", "ckpt", "precision", "rotary_blocks"),
    INT8_MOE + [pytest.param(*x, marks=pytest.mark.slow) for x in INT8_MOE_SLOW],
)
def test_int8_on_moe_and_mla_layers_agrees_with_the_trace(
    cfg: dict[str, Any], ckpt: str, precision: str, rotary_blocks: int | None
) -> None:
    """Every phase within 3% of the trace without its workspaces (1.22% at most when written); the stored base to the
    byte on Mixtral and Qwen2-MoE: int8 attention and shared-expert linears, the float router and experts (the trace's
    weights also hold the rotary ``inv_freq``/``original_inv_freq`` buffers, one block each)."""
    spec = spec_from_config(cfg, name=f"small-{cfg['model_type']}", source="test")
    a, b = finetune_setup("lora", rank=8, targets="all-linear", base_dtype="int8")
    s = Strategy(adapter=a, base_weights=b, precision=precision, checkpointing=ckpt, micro_batch=2, seq_len=256)
    ra = estimate(spec, s)
    rt = estimate(spec, s, method="trace", simulate_allocator=False)
    assert ra.trainable_params == rt.trainable_params
    _assert_within(ra, rt, 0.03)
    if rotary_blocks is not None:
        stored = ra.phases[-1].get(Component.WEIGHTS) + ra.phases[-1].get(Component.ADAPTER_WEIGHTS)
        assert rt.phases[-1].get(Component.WEIGHTS) == stored + rotary_blocks * 512


# A dense gated MLP of LLM.int8 linears, its backward derived op by op (analytic.activations.int8_mlp_backward_bytes:
# the product's three gradients, MatMul8bitLt.backward's dequantised weight in the input's dtype; and
# int8_dense_recompute_bytes: inside a checkpointed layer's recomputation, whose int8 inputs are alive until it stops,
# at an adapted down, gate or up projection's forward). The fitted sum these replaced (the dequantised weight plus the
# adapter chain over 2·a·t·i) was off by the figure noted per cell, of the trace without workspaces.
# (targets, dropout, checkpointing, precision, intermediate size, micro-batch, seq)
INT8_MLP = [
    ("q_proj", 0.0, "full", "amp-bf16", 512, 2, 128),  # was -1.93%: the product's third gradient
    ("all-linear", 0.1, "full", "amp-bf16", 512, 2, 128),  # was -0.73%: inside the recomputed down projection
    ("all-linear", 0.0, "full", "pure-bf16", 512, 2, 128),  # was +1.00%: the recomputed up projection's branch
    ("q_proj,v_proj", 0.1, "full", "pure-bf16", 512, 2, 128),  # was +3.94%
]
INT8_MLP_SLOW = [
    ("all-linear", 0.0, "full", "amp-bf16", 512, 2, 128),  # was -0.03% (the fitted sum happened to match)
    ("down_proj", 0.0, "full", "amp-bf16", 512, 2, 128),  # was -0.92%
    ("all-linear", 0.1, "full", "pure-bf16", 4096, 2, 128),  # was +14.19%
    ("q_proj", 0.0, "none", "pure-bf16", 8192, 1, 32),  # was +1.34%: the dequantised weight is the peak
]


@pytest.mark.parametrize(
    ("targets", "dropout", "ckpt", "precision", "inter", "batch", "seq"),
    INT8_MLP + [pytest.param(*x, marks=pytest.mark.slow) for x in INT8_MLP_SLOW],
)
def test_int8_gated_mlp_backward_agrees_with_the_trace(
    targets: str, dropout: float, ckpt: str, precision: str, inter: int, batch: int, seq: int
) -> None:
    """The backward phase within 0.3% of the trace without its workspaces (0.11% at most when written). The forward of
    a checkpointed wide int8 MLP is not derived yet (docs/finetuning.md), so only the backward is held here."""
    spec = spec_from_config({**LLAMA, "intermediate_size": inter}, name="small-llama", source="test")
    a, b = finetune_setup("lora", rank=8, targets=targets, dropout=dropout, base_dtype="int8")
    s = Strategy(adapter=a, base_weights=b, precision=precision, checkpointing=ckpt, micro_batch=batch, seq_len=seq)
    ra = estimate(spec, s)
    # four of these cells are test_int8_analytic_agrees_with_the_bitsandbytes_trace's: each traced once per process
    rt = traced_once(estimate, spec, s, method="trace", simulate_allocator=False)
    pa, pt = ra.phases[1], rt.phases[1]
    assert pa.phase == pt.phase and pa.phase.value == "backward"
    ref = pt.total_bytes - pt.get(Component.WORKSPACES)
    assert abs(pa.total_bytes - pt.total_bytes) <= 0.003 * ref, (pa.total_bytes, pt.total_bytes)
