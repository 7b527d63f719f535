"""The speed model against hand-written formulas (Kaplan 6·N, ring all-reduce, the pipeline bubble)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from trainfit import Strategy, get_gpu, load_model
from trainfit.arch.params import count_params
from trainfit.arch.spec import ModelKind, ModelSpec
from trainfit.planner.space import CHECKPOINTING, Candidate, Finetune, candidates
from trainfit.planner.speed import (
    EAGER_ELEMENTWISE_EFFICIENCY,
    HBM_EFFICIENCY,
    HOST_ADAM_NODE_GBPS,
    MATMUL_EFFICIENCY,
    SpeedInputs,
    StepTime,
    autocast_cast_bytes,
    dequant_bytes,
    elementwise_backward_bytes,
    elementwise_bytes,
    elementwise_efficiency,
    host_adam_seconds,
    loss_bytes_per_token,
    model_flops_per_token,
    nccl_nvlink_gbps,
    step_time,
    step_time_of,
)
from trainfit.strategy import Checkpointing, LossImpl, MemorySavers, Offload, Parallelism, Sharding, finetune_setup


def test_flops_per_token_is_six_n_plus_attention() -> None:
    spec = load_model("llama-3.1-8b")  # untied: the input embedding is a lookup
    n = count_params(spec) - spec.vocab_size * spec.hidden_size
    s = 4096
    attention = 3 * 2 * s * spec.num_heads * spec.head_dim * spec.num_layers  # 12·L·h·s per token, halved (causal)
    # norm weights are not matmuls but are in N: they are < 0.01% of it
    assert model_flops_per_token(spec, s) == pytest.approx(6 * n + attention, rel=1e-4)
    # a frozen weight has no weight gradient (4·N); attention has no weights: its backward stays 2× its forward
    assert model_flops_per_token(spec, s, frozen_base=True) == pytest.approx(4 * n + attention, rel=1e-4)


def _llama_dims(spec: ModelSpec) -> tuple[int, int, int, int]:
    h, i = spec.hidden_size, spec.intermediate_size
    return h, i, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim


def test_lora_adds_its_rank_r_matmuls_trained() -> None:
    spec = load_model("llama-3.2-1b")
    adapter, _ = finetune_setup("lora")  # rank 16 on q, k, v, o, gate, up, down
    h, i, q, kv = _llama_dims(spec)
    r, L = adapter.rank, spec.num_layers
    lora = L * r * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))  # A: r×d_in, B: d_out×r
    frozen = model_flops_per_token(spec, 2048, frozen_base=True)
    assert model_flops_per_token(spec, 2048, adapter=adapter) == pytest.approx(frozen + 6 * lora, rel=1e-12)


def test_elementwise_bytes_of_a_llama_layer() -> None:
    """llama-3.2-1b (h 2048, q 2048, k/v 512, MLP 8192, full RoPE) in bf16, by hand from transformers'
    LlamaDecoderLayer: two RMSNorms at 36 B/element (to fp32 2+4, pow 4+4, mean 4, ·rsqrt 4+4, to bf16 4+2,
    ·weight 2+2), rotary on q and k at 20 B, the attention output's contiguous copy 4 B per q element, SiLU·up
    10 B per intermediate element, two residual adds at 6 B. Under autocast over fp32 weights the norms and
    residual adds work on an fp32 stream — the norm's casts are no-ops (28 B) and the adds 12 B — and q, k, v,
    gate and up each cast the fp32 normed stream to bf16 (4 + 2 B per element, five times)."""
    spec = load_model("llama-3.2-1b")
    assert (spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size) == (2048, 2048, 512, 8192)
    assert spec.rotary_dim == spec.head_dim
    by_hand = 2 * 36 * 2048 + 20 * (2048 + 512) + 4 * 2048 + 10 * 8192 + 2 * 6 * 2048
    assert elementwise_bytes(spec, 16) == by_hand == 313344
    amp = 2 * 28 * 2048 + 5 * 6 * 2048 + 20 * (2048 + 512) + 4 * 2048 + 10 * 8192 + 2 * 12 * 2048
    assert elementwise_bytes(spec, 16, 32) == amp


def test_elementwise_backward_bytes_of_a_llama_layer() -> None:
    """The backward of the same layer op by op (autograd's derivative formulas), bf16: each RMSNorm 84 B per
    element (weight product and its reduced gradient 12, rsqrt branch 24, mean 4, pow 20, the two fp32 gradients
    summed 12, the casts back 12); q, k, v's input gradients summed (two adds) and gate, up's (one), 6 B each;
    rotary 30 B per q/k element; the output gradient made contiguous (4 B per q element) and dq, dk, dv
    reshaped (4 B per element); SiLU·up 36 B per intermediate element; the two residual gradient sums 6 B. More
    than the 2 × forward the model took before."""
    spec = load_model("llama-3.2-1b")
    h, i, q, kv = _llama_dims(spec)
    by_hand = 2 * 84 * h + 3 * 6 * h + 30 * (q + kv) + 4 * q + 4 * (q + 2 * kv) + 36 * i + 2 * 6 * h
    assert elementwise_backward_bytes(spec, 16) == by_hand
    assert by_hand > 2 * elementwise_bytes(spec, 16)
    # amp: fp32 stream — no norm casts (6r + 60 = 84 at r = 4), five casts' backward (2 + 4 B), the input
    # gradients summed in fp32 (12 B per add), residual sums 12 B
    amp = 2 * 84 * h + 5 * 6 * h + 3 * 12 * h + 30 * (q + kv) + 4 * q + 4 * (q + 2 * kv) + 36 * i + 2 * 12 * h
    assert elementwise_backward_bytes(spec, 16, 32) == amp


def test_loss_traffic_scales_with_vocabulary_times_tokens() -> None:
    """The eager loss over the logits is memory-bound: per logit element, ``.float()`` and its backward
    (2 + 4 and 4 + 2 B), log_softmax forward (three reads and a write of fp32: 16 B), nll_loss's dense zero-filled
    gradient (4 B) and log_softmax's backward (16 B) — 48 B in bf16, 36 B for fp32 logits (no casts); the same
    chunked; a classifier has no vocabulary logits."""
    q05, l1b = load_model("qwen2.5-0.5b"), load_model("llama-3.2-1b")
    bf16 = SpeedInputs.of(Strategy(seq_len=2048, micro_batch=4, precision="pure-bf16"), q05)
    assert loss_bytes_per_token(q05, bf16) == 48 * 151936
    assert loss_bytes_per_token(l1b, bf16) == 48 * 128256
    fp32 = dataclasses.replace(bf16, compute_bits=32, weight_bits=32, compute_dtype="fp32")
    assert loss_bytes_per_token(q05, fp32) == 36 * 151936
    chunked = dataclasses.replace(bf16, loss=LossImpl.CHUNKED)
    assert loss_bytes_per_token(q05, chunked) == loss_bytes_per_token(q05, bf16)
    assert loss_bytes_per_token(q05, dataclasses.replace(bf16, loss=LossImpl.FUSED_LINEAR)) == 6 * 151936
    cls = dataclasses.replace(l1b, kind=ModelKind.SEQ_CLS, num_labels=2)
    assert loss_bytes_per_token(cls, bf16) == 0
    # in the step: the loss adds vocabulary × tokens × 48 B over HBM, once per micro-step's tokens
    gpu = get_gpu("h200-sxm-141gb")
    st = Strategy(seq_len=2048, micro_batch=4, grad_accum=2, precision="pure-bf16")
    with_loss = step_time(q05, st, gpu)
    without = step_time(q05, dataclasses.replace(st, savers=MemorySavers(loss=LossImpl.FUSED_LINEAR)), gpu)
    hbm = gpu.memory_bandwidth_gbps * 1e9 * HBM_EFFICIENCY
    assert with_loss.step_seconds - without.step_seconds == pytest.approx((48 - 6) * 151936 * 4 * 2048 * 2 / hbm)


@pytest.mark.parametrize("sharding", ["fsdp", "hsdp"])
@pytest.mark.parametrize("offload", ["none", "optimizer+params"])
def test_fsdp2_mixed_recipes_are_one_run(sharding: str, offload: str) -> None:
    """Under FSDP2's MixedPrecisionPolicy every mixed recipe (amp-*, master-*) is the same run — fp32 shards gathered
    in the compute dtype, fp32 gradients, no autocast casts — so it has one step time (the memory model already gives
    it one memory); pure-bf16 moves 16-bit shards instead but computes the same layers. Without sharding amp keeps
    autocast's casts (the rule is FSDP2's, not the recipe's)."""
    spec = load_model("llama-3.2-3b")
    gpu = get_gpu("a100-sxm-80gb")

    def step(precision: str, sh: str = sharding) -> StepTime:
        s = Strategy(precision=precision, micro_batch=2, grad_accum=4, seq_len=2048, sharding=sh,  # type: ignore[arg-type]
                     offload=Offload.parse(offload), parallelism=Parallelism.for_gpus(16))  # fmt: skip
        return step_time(spec, s, gpu)

    for compute in ("bf16", "fp16"):
        assert step(f"amp-{compute}") == step(f"master-{compute}")
    pure, amp = step("pure-bf16"), step("amp-bf16")
    assert pure.compute_seconds == amp.compute_seconds and pure.recompute_seconds == amp.recompute_seconds
    if offload == "none":
        assert step("amp-bf16", "ddp").compute_seconds > step("master-bf16", "ddp").compute_seconds


def test_amp_adds_the_weight_casts() -> None:
    """Autocast over fp32 weights casts every matmul weight to bf16 once per micro-step (read 4, write 2 B) and its
    gradient back (2 + 4 B); a recomputed forward casts again; pure bf16 casts nothing, a frozen base has no
    gradient to cast back."""
    spec = load_model("llama-3.2-1b")
    amp = SpeedInputs.of(Strategy(seq_len=2048, micro_batch=4, precision="amp-bf16"), spec)
    pure = SpeedInputs.of(Strategy(seq_len=2048, micro_batch=4, precision="pure-bf16"), spec)
    n = count_params(spec)  # tied: the head is the one matmul over the table; norm weights < 0.01%
    fwd, bwd = autocast_cast_bytes(spec, amp)
    assert fwd == bwd == pytest.approx(6 * n, rel=1e-4)
    assert autocast_cast_bytes(spec, pure) == (0.0, 0.0)
    adapter, _ = finetune_setup("lora")
    assert autocast_cast_bytes(spec, dataclasses.replace(amp, adapter=adapter))[1] == 0.0
    gpu = get_gpu("h200-sxm-141gb")
    hbm = gpu.memory_bandwidth_gbps * 1e9 * HBM_EFFICIENCY
    one, two = (step_time_of(spec, dataclasses.replace(amp, grad_accum=k), gpu) for k in (1, 2))
    assert two.compute_seconds - 2 * one.compute_seconds == pytest.approx(0.0, abs=1e-12)  # per micro-step
    full = step_time_of(spec, dataclasses.replace(amp, checkpointing=Checkpointing.FULL), gpu)
    uncast = dataclasses.replace(amp, checkpointing=Checkpointing.FULL, autocast=False)
    assert full.recompute_seconds - step_time_of(spec, uncast, gpu).recompute_seconds == pytest.approx(fwd / hbm)
    assert full.compute_seconds - step_time_of(spec, uncast, gpu).compute_seconds == pytest.approx(3 * fwd / hbm)


def test_one_gpu_step_is_flops_over_peak_plus_memory_traffic() -> None:
    spec, gpu = load_model("llama-3.2-1b"), get_gpu("a100-sxm-80gb")
    s = Strategy(seq_len=2048, micro_batch=4, grad_accum=2, precision="pure-bf16")
    t = step_time(spec, s, gpu)
    tokens = 2048 * 4 * 2
    attn_fwd = 2 * 2048 * spec.num_heads * spec.head_dim * spec.num_layers  # causal half of 2·2·s·q per layer
    matmul = model_flops_per_token(spec, 2048) * tokens - 3 * attn_fwd * tokens
    # FlashAttention's backward recomputes QKᵀ: 3.5 forwards of attention run, at FlashAttention-2's A100 rate
    attention = 3.5 * attn_fwd * tokens
    # forward + backward op by op, bf16 (tests above), and the loss over the logits (48 B per element)
    # the layers' eager kernels run at EAGER_ELEMENTWISE_EFFICIENCY, the loss's softmax kernels at the copy rate
    layers = (313344 + elementwise_backward_bytes(spec, 16)) * spec.num_layers * tokens
    loss = 48 * 128256 * tokens
    adam = 28 * count_params(spec)  # fused AdamW: read w, g, m, v and write w, m, v in fp32, once per step
    hbm = 2039e9 * HBM_EFFICIENCY
    expected = (
        matmul / (312e12 * MATMUL_EFFICIENCY)
        + attention / (312e12 * 0.50)
        + layers / (2039e9 * EAGER_ELEMENTWISE_EFFICIENCY)
        + (loss + adam) / hbm
    )
    assert gpu.memory_bandwidth_gbps == 2039 and gpu.compute_capability == "8.0"
    assert t.step_seconds == pytest.approx(expected, rel=1e-9)
    assert t.optimizer_seconds == pytest.approx(adam / hbm)
    assert t.exposed_comm_seconds == t.bubble_seconds == t.offload_seconds == 0
    assert t.tokens_per_second == pytest.approx(tokens / expected)
    assert t.mfu == pytest.approx(model_flops_per_token(spec, 2048) * tokens / expected / 312e12)  # model FLOPs


def test_checkpointing_modes_recompute_what_they_drop() -> None:
    spec, gpu = load_model("llama-3.2-1b"), get_gpu("h100-sxm-80gb")
    base = Strategy(seq_len=2048, micro_batch=2)
    none, full, sqrt, sel, sac = (
        step_time(spec, dataclasses.replace(base, checkpointing=c), gpu)
        for c in ("none", "full", "sqrt", "selective", "sac")
    )
    tokens = 2 * 2048
    rate, attn_rate = 989e12 * MATMUL_EFFICIENCY, 989e12 * 0.35  # FlashAttention-2 on an H100
    # amp-bf16 (the default): bf16 matmul outputs over an fp32 residual stream
    # (and autocast casts every weight again in the recomputed forward: read 4, write 2 B)
    amp = SpeedInputs.of(base, spec)
    # (the layers' eager kernels at EAGER_ELEMENTWISE_EFFICIENCY, the weight casts' vectorised copies at HBM_EFFICIENCY)
    traffic = elementwise_bytes(spec, 16, 32) * spec.num_layers * tokens / (3350e9 * EAGER_ELEMENTWISE_EFFICIENCY)
    traffic += autocast_cast_bytes(spec, amp)[0] / (3350e9 * HBM_EFFICIENCY)
    h, i, q, kv = _llama_dims(spec)
    attn = 2 * 2048 * q * spec.num_layers  # forward attention per token (causal half of 2·2·s·q per layer)
    blocks = spec.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * i)
    assert none.recompute_seconds == 0
    # full and sqrt: one forward of every block — its matmuls, attention and the memory-bound work
    # (the model's P counts the norm weights as in Kaplan's N: < 0.01%)
    assert full.recompute_seconds == pytest.approx(
        2 * blocks * tokens / rate + attn * tokens / attn_rate + traffic, rel=1e-4
    )
    assert sqrt.step_seconds == full.step_seconds
    assert full.step_seconds == pytest.approx(none.step_seconds + full.recompute_seconds)
    # selective (Megatron): the attention core only
    assert sel.recompute_seconds == pytest.approx(attn * tokens / attn_rate, rel=1e-9)
    # torchtitan per-op SAC: mm 2, 4, 6 of q, k, v, o, gate, up, down (k, o, up) again, and every op outside the
    # save list (the memory-bound work)
    assert sac.recompute_seconds == pytest.approx(
        2 * spec.num_layers * (h * kv + q * h + h * i) * tokens / rate + traffic
    )
    assert none.step_seconds < sel.step_seconds < sac.step_seconds < full.step_seconds


def test_lora_and_qlora_step() -> None:
    """LoRA: frozen linears skip the weight gradients, the adapters add their own small matmuls and elementwise
    traffic, and only the adapters are stepped; QLoRA dequantises every 4-bit block weight in forward and
    backward (and once more in a recomputed forward)."""
    spec, gpu = load_model("llama-3.2-1b"), get_gpu("rtx-4090")
    full = Strategy(seq_len=2048, micro_batch=2, grad_accum=4, precision="pure-bf16")
    lora_a, lora_b = finetune_setup("lora")
    q_a, q_b = finetune_setup("qlora")
    lora = dataclasses.replace(full, adapter=lora_a, base_weights=lora_b)
    qlora = dataclasses.replace(full, adapter=q_a, base_weights=q_b)
    t_full, t_lora, t_q = (step_time(spec, s, gpu) for s in (full, lora, qlora))
    hbm = 1008e9 * HBM_EFFICIENCY
    h, i, q, kv = _llama_dims(spec)
    L, r, tokens = spec.num_layers, lora_a.rank, 2 * 2048 * 4
    sites = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]  # (d_in, d_out): q k v o gate up down
    elements = L * sum(6 * d_in + 10 * d_out for d_in, d_out in sites)  # PEFT lora.Linear forward + backward
    adapter_params = L * sum(r * (d_in + d_out) for d_in, d_out in sites)
    extra = ((model_flops_per_token(spec, 2048, adapter=lora_a) - model_flops_per_token(spec, 2048)) * tokens) / (
        165.15e12 * MATMUL_EFFICIENCY
    )
    expected = (
        t_full.step_seconds
        + extra
        + 2 * elements * tokens / (1008e9 * EAGER_ELEMENTWISE_EFFICIENCY)  # PEFT's eager code
        - 28 * (count_params(spec) - adapter_params) / hbm  # the optimizer steps the adapters only
    )
    assert t_lora.step_seconds == pytest.approx(expected, rel=1e-9)
    assert t_lora.step_seconds < t_full.step_seconds
    # bitsandbytes nf4 with double quantisation, per weight of n elements: packed n/2, uint8 absmax per 64,
    # fp32 absmax per 256 blocks (+ the fp32 nested code, offset and 4-bit code) read; fp32 absmax per 64
    # written and read back; the bf16 weight (2n) written
    per_layer = [h * q, h * kv, h * kv, q * h, h * i, h * i, i * h]
    dq = L * sum(n / 2 + n / 64 + 4 * n / (64 * 256) + 4 * 256 + 4 + 64 + 8 * n / 64 + 2 * n for n in per_layer)
    assert dequant_bytes(spec, q_b.quantization, double_quant=True, out_bits=16) == pytest.approx(dq, rel=1e-6)
    assert t_q.step_seconds == pytest.approx(t_lora.step_seconds + 2 * 4 * dq / hbm, rel=1e-6)  # fwd + bwd × 4
    ck = step_time(spec, dataclasses.replace(qlora, checkpointing="full"), gpu)
    ck_lora = step_time(spec, dataclasses.replace(lora, checkpointing="full"), gpu)
    assert ck.step_seconds - ck_lora.step_seconds == pytest.approx(3 * 4 * dq / hbm, rel=1e-6)


def test_ddp_all_reduce_is_the_ring_volume_over_nvlink_at_nccls_bus_bandwidth() -> None:
    """The ring volume (nccl-tests' bus-bandwidth convention: 2·(n−1)/n of the buffer) at the bus bandwidth NCCL's
    maintainer gives for an A100 node, ~230 GB/s of the 300 GB/s line rate (NVIDIA/nccl-tests issue 149)."""
    spec, gpu = load_model("llama-3.2-1b"), get_gpu("a100-sxm-80gb")
    s = Strategy(seq_len=1024, micro_batch=1, sharding="ddp", parallelism=Parallelism.for_gpus(8))
    t = step_time(spec, s, gpu)
    volume = 2 * 7 / 8 * count_params(spec) * 4  # amp-bf16 keeps fp32 gradients
    assert gpu.nvlink_gbps == 300
    assert t.comm_seconds == pytest.approx(volume / 230e9)


@pytest.mark.parametrize(
    ("params", "seconds"), [(1e9, 0.22), (2e9, 0.51), (4e9, 1.03), (8e9, 2.41), (10e9, 2.57)]
)  # fmt: skip
def test_cpu_adam_is_zero_offloads_table_4(params: float, seconds: float) -> None:
    """One process's CPU-Adam step is ZeRO-Offload's Table 4 (Ren et al. 2021: DeepSpeed's CPU-Adam on a DGX-2's two
    Xeon Platinum 8168): the 10-billion row exactly (the constant's derivation), the others within 17% (1B: the
    model +17%, 8B: −15%; the table itself is not linear in the parameters)."""
    assert pytest.approx(10e9 * 28 / 2.57 / 1e9) == HOST_ADAM_NODE_GBPS
    assert host_adam_seconds(params, 1) == pytest.approx(seconds, rel=0.0 if params == 10e9 else 0.17, abs=1e-12)


def test_offloaded_ranks_share_their_nodes_cpu_adam() -> None:
    """Eight ZeRO-Offload ranks on one node step their eighths on one host at once: each takes as long as one
    process stepping the whole model (the host's DRAM bandwidth is shared); one rank per node steps its eighth
    alone, 8× faster. The PCIe transfers are per GPU either way."""
    spec, gpu = load_model("llama-3.1-8b"), get_gpu("a100-sxm-80gb")
    x = SpeedInputs(
        data=8, seq_len=2048, micro_batch=1, grad_accum=1, sharding=Sharding.ZERO3, offload_optimizer=True,
        grad_bits=16, weight_bits=16,
    )  # fmt: skip
    one_node = step_time_of(spec, dataclasses.replace(x, gpus_per_node=8), gpu)
    spread = step_time_of(spec, dataclasses.replace(x, gpus_per_node=1), gpu)
    shard = count_params(spec) / 8
    assert one_node.offload_seconds - spread.offload_seconds == pytest.approx(
        shard * 28 * 7 / (HOST_ADAM_NODE_GBPS * 1e9)
    )
    assert host_adam_seconds(shard, 8) == pytest.approx(host_adam_seconds(count_params(spec), 1))


def test_pipeline_bubble_is_p_minus_one_over_m() -> None:
    spec, gpu = load_model("llama-3.1-8b"), get_gpu("h100-sxm-80gb")
    for m in (4, 8, 16):
        x = SpeedInputs(pipeline=4, seq_len=4096, micro_batch=1, grad_accum=m, grad_bits=16, weight_bits=16)
        t = step_time_of(spec, x, gpu)
        assert t.bubble_seconds == pytest.approx(t.compute_seconds * 3 / m)


def test_more_gpus_over_network_cost_more_than_over_nvlink() -> None:
    spec, gpu = load_model("llama-3.1-8b"), get_gpu("h100-sxm-80gb")
    x = SpeedInputs(data=16, seq_len=4096, micro_batch=1, grad_accum=1, sharding=Sharding.FSDP)
    slow = dataclasses.replace(x, gpus_per_node=8)
    fast = dataclasses.replace(x, gpus_per_node=16)
    assert step_time_of(spec, slow, gpu).comm_seconds > step_time_of(spec, fast, gpu).comm_seconds


def test_candidate_speed_inputs_match_the_strategy() -> None:
    spec, gpu = load_model("llama-3.2-1b"), get_gpu("a100-sxm-80gb")
    space = candidates(spec, gpu, gpus=16, gpus_per_node=8, global_batch=64, allow=(Finetune.LORA, Finetune.QLORA))
    sample = random.Random(0).sample(space, 80)
    assert {c.finetune for c in sample} == set(Finetune)
    assert {c.checkpointing for c in sample} == set(CHECKPOINTING)
    for c in sample:
        _same_inputs(spec, c, 64)


def _same_inputs(spec: ModelSpec, c: Candidate, global_batch: int) -> None:
    micro = global_batch // c.data if c.optimizer_in_backward else 1  # optimizer-in-backward: no accumulation
    accum = global_batch // (c.data * micro)
    s = c.strategy(micro_batch=micro, grad_accum=accum, seq_len=1024, gpus_per_node=8)
    x = c.speed_inputs(micro_batch=micro, grad_accum=accum, seq_len=1024, gpus_per_node=8, spec=spec)
    assert SpeedInputs.of(s, spec) == x


def test_2d_and_saver_candidates_speed_inputs_match_the_strategy() -> None:
    """2-D FSDP2 × TP (DTensor: the plan's ends and the vocabulary) and the one-GPU savers (activation offload: the
    memory model's saved bytes) read the same inputs from the candidate as from its Strategy."""
    spec, gpu = load_model("llama-3.1-8b"), get_gpu("h100-sxm-80gb")
    space = candidates(spec, gpu, gpus=16, gpus_per_node=8, global_batch=32)
    two_d = [c for c in space if c.tensor > 1 and c.engine.value == "torch"]
    savers = [c for c in space if c.twin() != c]
    assert {c.loss.value for c in savers} == {"fused-linear", "chunked", "standard"}
    assert any(c.activation_offload for c in savers) and any(c.optimizer_in_backward for c in savers)
    rng = random.Random(5)
    for c in rng.sample(two_d, 15) + rng.sample(savers, 25):
        _same_inputs(spec, c, 32)
    offload = next(c for c in savers if c.activation_offload)
    x = offload.speed_inputs(micro_batch=2, grad_accum=16, seq_len=1024, gpus_per_node=8, spec=spec)
    assert x.offload_activation_bytes > 0


@pytest.mark.parametrize(
    ("slug", "again"),
    [
        ("llama-3.2-1b", {"attn.k", "attn.o", "mlp.up"}),  # mm 1..7 = q k v o gate up down: the even ones
        ("qwen2.5-0.5b", {"mlp.gate", "mlp.down"}),  # q, k, v have biases (addmm, always saved): o gate up down
    ],
)
def test_sac_recomputes_every_second_mm(slug: str, again: set[str]) -> None:
    """torchtitan's policy by hand: ``mm`` outputs alternate saved / recomputed by their count in the block's
    forward; ``addmm`` (a linear with a bias) is not counted and always saved."""
    from trainfit.analytic.activations import sac_recomputed_linears, sac_saved_terms

    spec = load_model(slug)
    assert {n for n, _i, _o in sac_recomputed_linears(spec)} == again
    saved = {t.name.removeprefix("sac.") for t in sac_saved_terms(spec, Strategy(checkpointing="sac", seq_len=64))}
    assert not again & saved


@pytest.mark.parametrize(
    ("precision", "gather", "reduce"),
    [("amp-bf16", 2, 4), ("master-bf16", 2, 4), ("pure-bf16", 2, 2), ("fp32", 4, 4)],
)
def test_fsdp_collectives_follow_the_mixed_precision_policy(precision: str, gather: int, reduce: int) -> None:
    """FSDP2 under ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (amp-*, master-*: fp32 shards)
    all-gathers bf16 weights and reduce-scatters fp32 gradients; a 16-bit or fp32 model without a policy moves
    its own width both ways. The speed model's volume is the memory model's: each layer group's padded
    all-gather output and reduce-scatter input (``fsdp_groups``), the layers gathered twice (forward, backward), the
    root and the [final norm, head] unit once (never resharded after forward), everything reduced once per
    micro-step over a ring of 8 on NVLink."""
    from trainfit.analytic.parallel import fsdp_groups

    spec, gpu = load_model("llama-3.2-1b"), get_gpu("h100-sxm-80gb")
    s = Strategy(
        precision=precision, seq_len=1024, micro_batch=1, grad_accum=2, sharding="fsdp",
        parallelism=Parallelism.for_gpus(8),
    )  # fmt: skip
    g = fsdp_groups(spec, s, 8)
    layers = spec.num_layers
    gathered = g.root_all_gather_bytes + layers * g.all_gather_bytes
    reduced = g.root_reduce_scatter_bytes + layers * g.reduce_scatter_bytes
    ring = 7 / 8
    t = step_time(spec, s, gpu)
    once = g.root_all_gather_bytes + g.tail.all_gather  # llama-3.2-1b's tied table: the [final norm, head] unit's
    volume = 2 * gathered - once + reduced
    assert t.comm_seconds == pytest.approx(2 * ring * volume / (nccl_nvlink_gbps(gpu) * 1e9), rel=1e-3)
    p = count_params(spec)
    assert gathered == pytest.approx(gather * p, rel=1e-3)  # the policy's widths, per parameter
    assert reduced == pytest.approx(reduce * p, rel=1e-3)


def test_fsdp_lora_reduces_the_adapters_in_their_dtype() -> None:
    """PEFT keeps fp32 adapters on a bf16 base: without a policy (pure-bf16) FSDP2 reduce-scatters their fp32
    gradients; under the policy the same fp32. Only the adapters are reduced (the memory model's groups)."""
    from trainfit.analytic.parallel import fsdp_groups

    spec, gpu = load_model("llama-3.2-1b"), get_gpu("h100-sxm-80gb")
    adapter, base = finetune_setup("lora")
    s = Strategy(
        precision="pure-bf16", seq_len=1024, micro_batch=1, sharding="fsdp", adapter=adapter, base_weights=base,
        parallelism=Parallelism.for_gpus(8),
    )  # fmt: skip
    g = fsdp_groups(spec, s, 8)
    gathered = g.root_all_gather_bytes + spec.num_layers * g.all_gather_bytes
    reduced = g.root_reduce_scatter_bytes + spec.num_layers * g.reduce_scatter_bytes
    t = step_time(spec, s, gpu)
    volume = 2 * gathered - g.root_all_gather_bytes - g.tail.all_gather + reduced  # root and tail gathered once
    assert t.comm_seconds == pytest.approx(7 / 8 * volume / (nccl_nvlink_gbps(gpu) * 1e9), rel=1e-3)
    from trainfit.analytic.adapters import adapter_tensors

    adapters = spec.num_layers * sum(x.numel for x in adapter_tensors(spec, adapter))
    assert reduced == pytest.approx(4 * adapters, rel=1e-3)


def _tp_inputs(spec: ModelSpec, **kw: object) -> SpeedInputs:
    """One micro-batch of 4096 tokens twice, TP 8 on one H100 node, no data parallelism (TP traffic only)."""
    base: dict[str, object] = dict(tensor=8, seq_len=4096, micro_batch=1, grad_accum=2, grad_bits=16, weight_bits=16)
    return SpeedInputs(**(base | kw))  # type: ignore[arg-type]


def _gemm_seconds(spec: ModelSpec, tokens: int, t: int, rate: float) -> dict[str, float]:
    """Per-rank forward GEMM seconds of a Llama layer's linears (2·d_in·d_out FLOPs per token, split over t)."""
    h, i, q, kv = _llama_dims(spec)
    per = tokens / t / rate
    return {
        "qkv": 2 * h * (q + 2 * kv) * per,
        "o": 2 * q * h * per,
        "gate_up": 2 * 2 * h * i * per,
        "down": 2 * i * h * per,
    }


def _half(spec: ModelSpec, tokens: int, t: int, bw: float) -> float:
    return (t - 1) / t * tokens * spec.hidden_size * 2 / bw  # one all-gather or reduce-scatter of b·s·h bf16


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_megatron_tp_hides_the_input_gradient_collectives_behind_the_weight_gradient(checkpointing: str) -> None:
    """Megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` (sequence parallel): the forward all-gather
    and reduce-scatter of each block are exposed (and run again in a full recompute), so is the row-parallel
    backward's all-gather of the output gradient; the column-parallel backward all-gathers its saved input shard
    again behind the input-gradient GEMM and reduce-scatters the input gradient behind the weight-gradient GEMM
    (each GEMM as long as the forward's). On an H100 node at 4096 tokens the attention side (q, k, v: 36 µs)
    cannot hide a 65 µs collective; the MLP side (gate + up: 169 µs) can."""
    spec, gpu = load_model("llama-3.1-8b"), get_gpu("h100-sxm-80gb")
    x = _tp_inputs(spec, checkpointing=checkpointing)
    t = step_time_of(spec, x, gpu)
    gemm = _gemm_seconds(spec, 4096, 8, 989e12 * MATMUL_EFFICIENCY)
    half = _half(spec, 4096, 8, 370e9)  # NCCL's bus bandwidth on an H100 node
    assert gemm["qkv"] < half < gemm["gate_up"]
    forwards = 2 if checkpointing == "full" else 1
    per_layer_exposed = sum(forwards * 2 * half + half + 2 * max(0.0, half - gemm[c]) for c in ("qkv", "gate_up"))
    per_layer_comm = 2 * (forwards * 2 * half + 3 * half)
    L, accum = spec.num_layers, 2
    assert t.exposed_comm_seconds == pytest.approx(L * accum * per_layer_exposed, rel=1e-9)
    assert t.comm_seconds == pytest.approx(L * accum * per_layer_comm, rel=1e-9)
    # without sequence parallelism: an all-reduce after each row-parallel GEMM, and the input gradient's
    # all-reduce behind the weight-gradient GEMM (allreduce_dgrad)
    plain = step_time_of(spec, dataclasses.replace(x, plain_tp=True), gpu)
    exposed = sum(forwards * 2 * half + max(0.0, 2 * half - gemm[c]) for c in ("qkv", "gate_up"))
    assert plain.exposed_comm_seconds == pytest.approx(L * accum * exposed, rel=1e-9)
    assert plain.comm_seconds == pytest.approx(L * accum * 2 * (forwards + 1) * 2 * half, rel=1e-9)


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_async_tp_overlaps_the_matched_collectives_chunk_by_chunk(checkpointing: str) -> None:
    """torch's micro-pipeline TP pass (torchtitan's async TP): the forward all-gathers feeding q/k/v and gate/up,
    the reduce-scatters of o and down, and the backward all-gathers of o's and down's output gradients feeding
    their input-gradient GEMMs are split into 8 chunks whose copies run under the other 7 chunks' GEMMs; the
    backward reduce-scatters of the summed q/k/v and gate/up input gradients are not matched (exposed). Each
    fused reduce-scatter (o, down) ends with a sum of the 8 pulled partials on the compute stream
    (``_fused_matmul_reduce_scatter_impl``): 9/8 of the b·s·h bf16 bytes over the H100's HBM at 0.92. The
    eager DTensor plan (what train_fsdp2.py runs) exposes every collective; both move the same bytes. The plan's
    ends (embedding, head input, logits gather) run outside the compiled blocks: exposed either way."""
    spec, gpu = load_model("llama-3.1-8b"), get_gpu("h100-sxm-80gb")
    eager = _tp_inputs(spec, checkpointing=checkpointing, dtensor_tp=True, vocab_size=spec.vocab_size)
    t_eager = step_time_of(spec, eager, gpu)
    t_async = step_time_of(spec, dataclasses.replace(eager, async_tp=True), gpu)
    gemm = _gemm_seconds(spec, 4096, 8, 989e12 * MATMUL_EFFICIENCY)
    bw = 370e9  # NCCL's bus bandwidth on an H100 node: the eager collectives, the unmatched reduce-scatters
    half = _half(spec, 4096, 8, bw)
    copy = _half(spec, 4096, 8, 450e9)  # async TP's fused collectives: copy-engine copies at the line rate
    ends = (2 * 2 * half * bw + 7 / 8 * 4096 * spec.vocab_size * 2) / bw  # test_fsdp_tp_plan's ring volumes
    forwards = 2 if checkpointing == "full" else 1
    L, accum = spec.num_layers, 2

    def hidden(gemm_seconds: float) -> float:
        return max(0.0, copy - gemm_seconds * 7 / 8)

    stacked_sum = (1 + 1 / 8) * 4096 * spec.hidden_size * 2 / (3350e9 * 0.92)  # read 8 partials, write one
    assert gpu.memory_bandwidth_gbps == 3350
    per_layer = sum(
        forwards * (hidden(gemm[col]) + hidden(gemm[row]) + stacked_sum) + hidden(gemm[row]) + half
        for col, row in (("qkv", "o"), ("gate_up", "down"))
    )
    assert t_async.exposed_comm_seconds == pytest.approx(accum * (L * per_layer + ends), rel=1e-9)
    assert t_eager.exposed_comm_seconds == pytest.approx(accum * (L * 2 * (forwards + 1) * 2 * half + ends), rel=1e-9)
    assert t_eager.comm_seconds == pytest.approx(t_eager.exposed_comm_seconds)
    fused_per_layer = 2 * ((forwards + 1) * 2 - 1)  # every collective of a block but the unmatched reduce-scatter
    assert t_eager.comm_seconds - t_async.comm_seconds == pytest.approx(
        accum * L * fused_per_layer * (half - copy), rel=1e-9
    )
    assert t_async.compute_seconds == t_eager.compute_seconds
    # async TP decomposes all-gathers and reduce-scatters: without sequence parallelism it changes nothing
    plain = dataclasses.replace(eager, plain_tp=True)
    assert step_time_of(spec, dataclasses.replace(plain, async_tp=True), gpu) == step_time_of(spec, plain, gpu)


def test_per_op_sac_gathers_the_tp_input_again_and_keeps_the_reduce_scatters() -> None:
    """torchtitan's per-op SAC saves ``reduce_scatter_tensor``'s output but not ``all_gather_into_tensor``'s: each
    block's all-gather runs once more in backward (eager: exposed, one more half per block). Under async TP the
    micro-pipeline pass fuses it into the ``mm``s SAC runs again on the gathered input — Llama's k (attention)
    and up (MLP), every second ``mm`` — so it hides behind those GEMMs' 7 chunks. Full recompute is unchanged
    (its forward collectives run again anyway)."""
    spec, gpu = load_model("llama-3.1-8b"), get_gpu("h100-sxm-80gb")
    h, i, _q, kv = _llama_dims(spec)
    half = _half(spec, 4096, 8, 370e9)  # NCCL's bus bandwidth on an H100 node
    copy = _half(spec, 4096, 8, 450e9)  # async TP's copy engines
    L, accum = spec.num_layers, 2
    base = {"dtensor_tp": True, "vocab_size": spec.vocab_size}
    eager_none = step_time_of(spec, _tp_inputs(spec, checkpointing="none", **base), gpu)
    eager_sac = step_time_of(spec, _tp_inputs(spec, checkpointing=Checkpointing.SAC, **base), gpu)
    assert eager_sac.comm_seconds - eager_none.comm_seconds == pytest.approx(L * accum * 2 * half, rel=1e-9)
    assert eager_sac.exposed_comm_seconds - eager_none.exposed_comm_seconds == pytest.approx(
        L * accum * 2 * half, rel=1e-9
    )
    async_none = step_time_of(spec, _tp_inputs(spec, checkpointing="none", async_tp=True, **base), gpu)
    async_sac = step_time_of(spec, _tp_inputs(spec, checkpointing=Checkpointing.SAC, async_tp=True, **base), gpu)
    per = 4096 / 8 / (989e12 * MATMUL_EFFICIENCY)
    k, up = 2 * h * kv * per, 2 * h * i * per
    again = max(0.0, copy - k * 7 / 8) + max(0.0, copy - up * 7 / 8)
    assert async_sac.exposed_comm_seconds - async_none.exposed_comm_seconds == pytest.approx(
        L * accum * again, rel=1e-9
    )
    assert again < 2 * copy  # the MLP side's re-gather hides behind up's GEMM


def test_tp_mechanism_follows_what_the_plan_runs() -> None:
    """DTensor plans (``--engine torch``, the exported train_fsdp2.py: eager, no async TP) expose their TP
    collectives; Megatron plans overlap as Megatron's layers do; async TP is the speed model's alone (no Strategy
    option), and Megatron has none."""
    from trainfit.errors import StrategyError
    from trainfit.planner.speed import TpComm, tp_comm
    from trainfit.strategy import Engine, EngineOptions

    spec = load_model("llama-3.1-8b")
    par = Parallelism.for_gpus(16, tensor=8, sequence_parallel=True)
    dtensor = Strategy(seq_len=1024, micro_batch=1, sharding="fsdp", parallelism=par)  # auto: DTensor
    megatron = Strategy(seq_len=1024, micro_batch=1, sharding="zero1", parallelism=par)  # auto: Megatron
    torch_plain = dataclasses.replace(
        dtensor, parallelism=Parallelism.for_gpus(16, tensor=8), engine=EngineOptions(engine=Engine.TORCH)
    )
    x_d, x_m, x_p = (SpeedInputs.of(s, spec) for s in (dtensor, megatron, torch_plain))
    assert (tp_comm(x_d), tp_comm(x_m), tp_comm(x_p)) == (TpComm.EAGER, TpComm.MEGATRON, TpComm.EAGER)
    assert not x_d.plain_tp and x_p.plain_tp
    assert tp_comm(dataclasses.replace(x_d, async_tp=True)) is TpComm.ASYNC_TP
    assert tp_comm(dataclasses.replace(x_p, async_tp=True)) is TpComm.EAGER
    with pytest.raises(StrategyError, match="async TP"):
        step_time_of(spec, dataclasses.replace(x_m, async_tp=True), get_gpu("h100-sxm-80gb"))


@pytest.mark.parametrize("name", ["deepseek-v3", "mixtral-8x7b-v0.1", "llama-3.2-1b", "bert-base-uncased"])
def test_speed_trains_the_memory_models_adapter_parameters(name: str) -> None:
    """What the speed model reduces and steps is the estimate's trainable parameter count: DeepSeek-V3's router and
    expert ParamWrapper pairs sit in its 58 MoE layers, not all 61 (was counted in every layer), BERT's head
    transform is adapted once (all-linear). Its per-token adapter GEMMs are the adapted linears' pairs: all of
    it but the MoE layers' ParamWrapper pairs (PEFT ``ParamWrapper.update_layer``: rank·E·(d_in + d_out) each)."""
    from trainfit.analytic.adapters import moe_param_sites
    from trainfit.estimate import estimate
    from trainfit.planner.speed import _adapter_numbers

    spec = load_model(name)
    adapter, base = finetune_setup("lora", rank=8, targets="all-linear", base_dtype="bf16")
    assert adapter is not None
    s = Strategy(adapter=adapter, base_weights=base, micro_batch=1, seq_len=256, checkpointing="full")
    trainable = estimate(spec, s).trainable_params
    numbers = _adapter_numbers(spec, adapter)
    assert numbers.trained == trainable
    moe = spec.num_moe_layers * sum(p.adapter_numel for p in moe_param_sites(spec, adapter))
    assert (moe > 0) is (spec.moe is not None)
    assert numbers.params == trainable - moe


def test_moe_lora_forms_the_adapted_expert_weight_gradients() -> None:
    """Mixtral-8x7B, all-linear LoRA: PEFT's ParamWrapper makes the router's and both expert stacks' weights new
    tensors that need a gradient (``W + B·A``), so their weight-gradient GEMMs run: per token and layer 2·(h·E +
    top_k·(h·2i + i·h)) FLOPs beyond the frozen base's 2 × 2·P, besides the attention pairs' 3 × 2·r·(d_in + d_out).
    Written out from the config (h 4096, i 14336, kv 1024, E 8, top-2, 32 layers); attention-only targets add none."""
    spec = load_model("mixtral-8x7b-v0.1")
    r, e, k, h, i, kv, n = 8, 8, 2, 4096, 14336, 1024, 32
    frozen = model_flops_per_token(spec, 2048, frozen_base=True)
    a, _ = finetune_setup("lora", rank=r, targets="all-linear", base_dtype="bf16")
    attention = r * (h + h) + 2 * r * (h + kv) + r * (h + h)
    grads = h * e + k * (h * 2 * i + i * h)
    want = frozen + n * (3 * 2 * attention + 2 * grads)
    assert model_flops_per_token(spec, 2048, adapter=a) == pytest.approx(want, rel=1e-12)
    q, _ = finetune_setup("lora", rank=r, targets="q_proj", base_dtype="bf16")
    assert model_flops_per_token(spec, 2048, adapter=q) == pytest.approx(frozen + n * 3 * 2 * r * (h + h), rel=1e-12)


def test_the_step_floor_bounds_every_micro_batch() -> None:
    """``step_floor_seconds`` at the largest micro-batch (the planner's cheap ordering bound) is at most the step
    time, and the compute + optimizer step, of every micro-batch of the candidate; QLoRA's per-micro-step
    dequantisation is the one part of compute that changes with the split."""
    from trainfit.errors import StrategyError
    from trainfit.planner.speed import step_floor_seconds, step_time_of

    rng = random.Random(5)
    varies = 0
    for slug, gpu_id, gpus, allow in (
        ("llama-3.1-8b", "h100-sxm-80gb", 16, ()),
        ("mixtral-8x7b-v0.1", "a100-sxm-80gb", 8, ()),
        ("mistral-7b-v0.1", "rtx-4090", 1, (Finetune.LORA, Finetune.QLORA)),
    ):
        spec, gpu = load_model(slug), get_gpu(gpu_id)
        space = candidates(spec, gpu, gpus=gpus, gpus_per_node=8, global_batch=64, allow=allow)
        for c in rng.sample(space, 60):
            per_rank = 64 // c.data
            micros = [per_rank] if c.optimizer_in_backward else [m for m in range(1, per_rank + 1) if per_rank % m == 0]
            times = []
            for m in micros:
                x = c.speed_inputs(micro_batch=m, grad_accum=per_rank // m, seq_len=2048, gpus_per_node=8, spec=spec)
                try:
                    times.append(step_time_of(spec, x, gpu))
                except StrategyError:  # no peak for this dtype
                    break
            if not times:
                continue
            floor = step_floor_seconds(times[-1])
            for t in times:
                assert floor * (1 - 1e-9) <= step_floor_seconds(t) <= t.step_seconds
            varies += step_floor_seconds(times[0]) > floor * (1 + 1e-9)
    assert varies  # the QLoRA candidates: the test sees the part that depends on the split


def test_eager_elementwise_term_is_the_layers_bytes_over_the_eager_bandwidth() -> None:
    """The layers' elementwise traffic of an eager step runs at EAGER_ELEMENTWISE_EFFICIENCY of the catalog bandwidth,
    a fused engine's at HBM_EFFICIENCY. The bytes are counted here from llama-3.2-1b's shapes (h 2048, q 2048, kv 512,
    intermediate 8192, 16 layers), bf16 throughout, op by op as transformers' Llama layer runs them."""
    spec, gpu = load_model("llama-3.2-1b"), get_gpu("h200-sxm-141gb")
    h, q, kv, i, layers = 2048, 2048, 512, 8192, 16
    assert (spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size, spec.num_layers) == (h, q, kv, i, layers)
    norm_fwd = (2 + 4) + 8 + 4 + 8 + (4 + 2) + 2 * 2  # to fp32, pow, mean, · rsqrt, to bf16, · weight
    norm_bwd = (2 * 2 + 3 * 2 + 2) + (8 + 12 + 4) + 4 + 20 + 12 + 2 * (2 + 4)  # weight, rsqrt, mean, pow, sum, casts
    forward = (
        2 * h * norm_fwd  # two RMSNorms
        + 10 * 2 * (q + kv)  # rotary on q and k: neg, cat, two products, a sum
        + 2 * 2 * q  # the attention output made contiguous
        + 5 * 2 * i  # SiLU, · up
        + 2 * 3 * 2 * h  # two residual adds
    )
    backward = (
        2 * h * norm_bwd
        + (2 + 1) * 3 * 2 * h  # the input gradients of q, k, v and of gate, up summed
        + 15 * 2 * (q + kv)  # rotary
        + 2 * 2 * q
        + 2 * 2 * (q + 2 * kv)  # the output gradient made contiguous; dq, dk, dv reshaped
        + 18 * 2 * i  # SiLU · up
        + 2 * 3 * 2 * h  # the residual stream's gradients summed
    )
    assert (forward, backward) == (313344, 797696)
    s = Strategy(seq_len=2048, micro_batch=4, grad_accum=2, precision="pure-bf16")
    eager = SpeedInputs.of(s, spec)
    assert not eager.fused_elementwise  # the torch engine runs transformers' eager modules
    fused = dataclasses.replace(eager, fused_elementwise=True)
    tokens = 2048 * 4 * 2
    moved = (forward + backward) * layers * tokens
    bandwidth = 4800e9
    assert gpu.memory_bandwidth_gbps == 4800
    gap = step_time_of(spec, eager, gpu).compute_seconds - step_time_of(spec, fused, gpu).compute_seconds
    assert gap == pytest.approx(
        moved / (bandwidth * EAGER_ELEMENTWISE_EFFICIENCY) - moved / (bandwidth * HBM_EFFICIENCY), rel=1e-9
    )
    # full checkpointing runs the forward's kernels once more, at the same rate
    ck = dataclasses.replace(eager, checkpointing=Checkpointing.FULL)
    ck_fused = dataclasses.replace(ck, fused_elementwise=True)
    gap_ck = step_time_of(spec, ck, gpu).compute_seconds - step_time_of(spec, ck_fused, gpu).compute_seconds
    again = forward * layers * tokens
    assert gap_ck - gap == pytest.approx(
        again / (bandwidth * EAGER_ELEMENTWISE_EFFICIENCY) - again / (bandwidth * HBM_EFFICIENCY), rel=1e-9
    )


def test_fused_elementwise_is_a_property_of_the_engine() -> None:
    """Megatron-LM runs fused norm, activation, rotary and softmax kernels; the torch engine (DDP, FSDP2, 2-D FSDP2 ×
    DTensor TP) and DeepSpeed run the model's eager modules."""
    spec = load_model("llama-3.2-1b")
    base = Strategy(seq_len=2048, micro_batch=2, precision="pure-bf16")
    megatron = dataclasses.replace(base, parallelism=Parallelism.for_gpus(8, tensor=2))  # auto: Megatron-LM
    fsdp_tp = dataclasses.replace(
        base, sharding=Sharding.FSDP, parallelism=Parallelism.for_gpus(8, tensor=2, sequence_parallel=True)
    )
    ddp = dataclasses.replace(base, sharding=Sharding.DDP, parallelism=Parallelism.for_gpus(8))
    zero3 = dataclasses.replace(base, sharding=Sharding.ZERO3, parallelism=Parallelism.for_gpus(8))
    assert SpeedInputs.of(megatron, spec).fused_elementwise
    for s in (base, fsdp_tp, ddp, zero3):
        assert not SpeedInputs.of(s, spec).fused_elementwise
    assert elementwise_efficiency(SpeedInputs.of(megatron, spec)) == HBM_EFFICIENCY
    assert elementwise_efficiency(SpeedInputs.of(base, spec)) == EAGER_ELEMENTWISE_EFFICIENCY


def test_eager_elementwise_efficiency_is_liger_kernels_published_hf_timings() -> None:
    """EAGER_ELEMENTWISE_EFFICIENCY is what Liger-Kernel's published A100 timings of Hugging Face's eager
    ``LlamaRMSNorm`` (2048 × 32768, bf16 input, fp32 weight: 38 B per element forward, 106 backward) and
    ``apply_rotary_pos_emb`` (16384 tokens, 32 + 8 heads of 256, bf16: 20 B forward, 30 backward) give: forward +
    backward of both, bytes over time, over 2039 GB/s (benchmarks/eager_bandwidth.py prints each row)."""
    rms = 2048 * 32768 * (38 + 106)
    rope = 16384 * (32 + 8) * 256 * (20 + 30)
    achieved = (rms + rope) / ((6.910431861877441 + 8.365951538085938) * 1e-3) / 2039e9
    assert achieved == pytest.approx(EAGER_ELEMENTWISE_EFFICIENCY, abs=0.005)
    assert EAGER_ELEMENTWISE_EFFICIENCY < HBM_EFFICIENCY
