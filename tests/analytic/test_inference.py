"""The inference closed forms, held to hand-derived numbers and to invariants (torch-free).

Every expected number here is written from the formula in the docstring it tests (KV = 2·L·kv·hd·T·b·bytes,
bitsandbytes' nf4 layout, vLLM's block arithmetic), not read back from the code.
"""

from __future__ import annotations

import dataclasses

import pytest

from trainfit.analytic import inference as an
from trainfit.analytic.inference import CacheKind, InferenceSetup
from trainfit.arch import load_model
from trainfit.arch.params import inventory
from trainfit.errors import StrategyError
from trainfit.hardware import get_gpu
from trainfit.result import Component, InferencePhase
from trainfit.units import GiB


def _r512(n: int) -> int:
    return -(-n // 512) * 512


def test_kv_cache_llama_3_1_8b_by_hand() -> None:
    # 32 layers, 8 kv heads, head dim 128, bf16; the last decode pass holds prompt + new − 1 tokens.
    spec = load_model("llama-3.1-8b")
    s = InferenceSetup(batch=4, prompt=1000, new_tokens=25)
    tokens = 1000 + 25 - 1
    one = 4 * 8 * tokens * 128 * 2  # one K (or V) tensor of one layer
    assert an.kv_cache_bytes(spec, s) == 32 * 2 * _r512(one)
    # per token, all layers: 2 · 32 · 8 · 128 · 2 bytes = 131072 (the figure every KV calculator prints)
    assert an.kv_bytes_per_token(spec, s) == 131072


def test_kv_dtype_fp8_halves_the_cache() -> None:
    """fp8 storage is half of bf16; transformers' fp8 cache (``Fp8QuantizedLayer``) adds a 0-dim fp32 scale
    (one 512-byte block) per tensor, a static cache (no transformers fp8 variant: storage only) none."""
    spec = load_model("llama-3.1-8b")  # 32 layers, K and V each
    s = InferenceSetup(batch=2, prompt=4096, new_tokens=1)
    dyn = an.kv_cache_bytes(spec, dataclasses.replace(s, kv_dtype="fp8"))
    assert (dyn - 32 * 2 * 512) * 2 == an.kv_cache_bytes(spec, s)
    st = dataclasses.replace(s, cache="static")
    assert an.kv_cache_bytes(spec, dataclasses.replace(st, kv_dtype="fp8")) * 2 == an.kv_cache_bytes(spec, st)


def test_fp8_cache_decode_holds_a_dequantised_copy_by_hand() -> None:
    """Decode with transformers' fp8 cache, the running layer's update (``Fp8QuantizedLayer.update``):
    old fp8 K and V (its locals) beside the new ones, the step's quantised token, the dequantised bf16 K,
    and V's ``q.float()`` and its product with the scale (two fp32 copies)."""
    spec = load_model("llama-3.1-8b")  # 8 kv heads, head dim 128
    s = InferenceSetup(batch=4, prompt=1000, new_tokens=25, kv_dtype="fp8")
    t = 1000 + 24  # tokens stored after the last pass
    old, transient = an.fp8_dequantise_bytes(spec, s, t)
    assert old == 2 * _r512(4 * 8 * (t - 1) * 128)
    assert transient == 2 * _r512(4 * 8 * 128) + _r512(4 * 8 * t * 128 * 2) + 2 * _r512(4 * 8 * t * 128 * 4)
    dec = an.phase_estimates(spec, s)[InferencePhase.DECODE]
    assert dec.moment.endswith("fp8 dequantise")
    assert dec.breakdown.get(Component.KV_CACHE) == an.kv_cache_bytes(spec, s) + old
    # the bf16 cache of the same request never holds those fp32 copies
    bf16 = an.phase_estimates(spec, dataclasses.replace(s, kv_dtype=None))[InferencePhase.DECODE]
    assert dec.breakdown.get(Component.ACTIVATIONS) - bf16.breakdown.get(Component.ACTIVATIONS) >= transient


def test_static_cache_holds_prompt_plus_new_from_the_prefill() -> None:
    spec = load_model("llama-3.2-1b")  # 16 layers, 8 kv heads, head dim 64
    s = InferenceSetup(batch=1, prompt=512, new_tokens=512, cache="static")
    one = 1 * 8 * 1024 * 64 * 2
    expected = 16 * 2 * _r512(one)
    assert an.kv_cache_bytes(spec, s, 0) == expected
    assert an.kv_cache_bytes(spec, s) == expected


def test_sliding_window_caps_the_cache_after_the_first_decode_step() -> None:
    spec = load_model("mistral-7b-v0.1")  # window 4096 on all 32 layers, 8 kv heads, head dim 128
    s = InferenceSetup(batch=1, prompt=8000, new_tokens=100)
    prefill_tokens, window = 8000, 4096
    assert an.kv_cache_bytes(spec, s, 0) == 32 * 2 * _r512(8 * prefill_tokens * 128 * 2)
    assert an.kv_cache_bytes(spec, s) == 32 * 2 * _r512(8 * window * 128 * 2)


def test_mla_caches_the_latent() -> None:
    spec = load_model("deepseek-v3")  # kv_lora_rank 512, qk_rope_head_dim 64, 61 layers
    s = InferenceSetup(batch=1, prompt=1024, new_tokens=1)
    assert an.kv_bytes_per_token(spec, s) == 61 * (512 + 64) * 2
    assert an.kv_cache_bytes(spec, s) == 61 * (_r512(1024 * 512 * 2) + _r512(1024 * 64 * 2))


def test_tensor_parallel_splits_kv_heads_and_replicates_when_fewer() -> None:
    spec = load_model("llama-3.1-70b")  # 8 kv heads
    base = InferenceSetup(batch=1, prompt=128, new_tokens=1)
    assert an.kv_bytes_per_token(spec, dataclasses.replace(base, tp=4)) * 4 == an.kv_bytes_per_token(spec, base)
    # tp 16 > 8 kv heads: one head per rank, replicated (vLLM get_num_kv_heads)
    per16 = an.kv_bytes_per_token(spec, dataclasses.replace(base, tp=16))
    assert per16 == an.kv_bytes_per_token(spec, dataclasses.replace(base, tp=8))


def test_bf16_weights_are_two_bytes_per_parameter_up_to_rounding() -> None:
    spec = load_model("qwen2.5-7b")
    w = an.weight_bytes(spec, InferenceSetup(dtype="bf16"))
    params = inventory(spec).total
    assert 2 * params <= w <= 2 * params + 512 * 2000


def test_nf4_weights_by_hand_for_one_linear() -> None:
    # nf4 with double quant: n/2 + n/64 + 4·⌈n/64/256⌉ + 1024 + 4 + 64 (QLoRA layout, DESIGN §4.4)
    spec = load_model("llama-3.2-1b")
    bf16 = an.weight_bytes(spec, InferenceSetup(dtype="bf16"))
    nf4 = an.weight_bytes(spec, InferenceSetup(dtype="nf4"))
    n = 2048 * 8192  # one gate_proj of llama-3.2-1b
    blocks = n // 64
    one_nf4 = _r512(n // 2) + _r512(blocks) + _r512(4 * -(-blocks // 256)) + _r512(1024) + _r512(4) + _r512(64)
    saved_per_gate = 2 * n - one_nf4
    assert nf4 < bf16
    # 16 layers × (gate, up, down) of this size: at least that much saved, and the embedding stays bf16
    assert bf16 - nf4 > 16 * 3 * saved_per_gate
    assert nf4 > 2 * spec.vocab_size * spec.hidden_size


def test_prefill_logits_are_last_token_only() -> None:
    spec = load_model("llama-3.1-8b")
    s = InferenceSetup(batch=1, prompt=4096, new_tokens=2)
    est = an.phase_estimates(spec, s)
    logits = est[InferencePhase.DECODE].breakdown.get(Component.LOGITS_LOSS)
    # at most the bf16 logits and two fp32 copies of one position: b · vocab · (2 + 4 + 4)
    assert logits <= 10 * spec.vocab_size + 3 * 512


def test_memory_grows_with_batch_and_prompt() -> None:
    spec = load_model("qwen2.5-0.5b")
    prev = 0
    for b in (1, 2, 4, 8):
        peak = an.peak_bytes(spec, InferenceSetup(batch=b, prompt=512, new_tokens=16))
        assert peak > prev
        prev = peak
    prev = 0
    for p in (128, 1024, 4096):
        peak = an.peak_bytes(spec, InferenceSetup(batch=2, prompt=p, new_tokens=16))
        assert peak > prev
        prev = peak


def test_capacity_is_the_boundary() -> None:
    spec = load_model("llama-3.1-8b")
    gpu = get_gpu("a100-sxm-80gb")
    s = InferenceSetup(batch=1, prompt=2048, new_tokens=256)
    usable = int(gpu.memory_bytes * 0.9)
    cap = an.capacity(spec, s, usable)
    assert cap.max_batch > 1 and not cap.max_batch_capped

    def need(b: int) -> int:
        return an.required_bytes(an.peak_bytes(spec, dataclasses.replace(s, batch=b)))

    assert need(cap.max_batch) <= usable < need(cap.max_batch + 1)


def test_paged_blocks_follow_vllm_arithmetic() -> None:
    spec = load_model("llama-3.1-8b")
    s = InferenceSetup(batch=1, prompt=1000, new_tokens=24, cache="paged", block_size=16)
    p = an.paged_capacity(spec, s, 80 * GiB, 0.9)
    assert p.requested_bytes == int(80 * GiB * 0.9)
    assert p.kv_budget_bytes == p.requested_bytes - p.weights_bytes - p.profile_peak_bytes - p.non_torch_bytes
    assert p.block_bytes == 16 * 131072
    assert p.kv_blocks == p.kv_budget_bytes // p.block_bytes
    assert p.max_concurrent_tokens == 16 * p.kv_blocks
    assert p.max_concurrent_sequences == p.max_concurrent_tokens // 1024  # 1024 = 64 blocks of 16


def test_bad_input_is_refused() -> None:
    spec = load_model("llama-3.2-1b")
    with pytest.raises(StrategyError):
        InferenceSetup(batch=0)
    with pytest.raises(StrategyError):
        an.validate(spec, InferenceSetup(prompt=spec.max_position_embeddings or 0, new_tokens=1))
    with pytest.raises(StrategyError, match="fp8"):
        an.validate(spec, InferenceSetup(dtype="fp8"), get_gpu("a100-sxm-80gb"))
    with pytest.raises(StrategyError, match="sliding"):
        an.validate(spec, InferenceSetup(cache=CacheKind.SLIDING))
    with pytest.raises(StrategyError):
        InferenceSetup(dtype="int3")


# -- invariants ---------------------------------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_MODELS = ["llama-3.2-1b", "mistral-7b-v0.1", "qwen3-30b-a3b", "gpt2", "deepseek-v3", "gemma-2b"]


@settings(max_examples=40, deadline=None)
@given(
    model=st.sampled_from(_MODELS),
    batch=st.integers(1, 16),
    prompt=st.integers(1, 900),
    new=st.integers(1, 100),
    cache=st.sampled_from(["dynamic", "static", "paged"]),
    dtype=st.sampled_from(["bf16", "fp32", "nf4", "int8"]),
)
def test_memory_is_monotone_and_tp_never_adds(
    model: str, batch: int, prompt: int, new: int, cache: str, dtype: str
) -> None:
    spec = load_model(model)
    s = InferenceSetup(batch=batch, prompt=prompt, new_tokens=new, cache=cache, dtype=dtype)
    peak = an.peak_bytes(spec, s)
    assert an.peak_bytes(spec, dataclasses.replace(s, batch=batch + 1)) >= peak
    assert an.peak_bytes(spec, dataclasses.replace(s, prompt=prompt + 7)) >= peak
    assert an.peak_bytes(spec, dataclasses.replace(s, new_tokens=new + 3)) >= peak
    if spec.num_heads % 2 == 0:
        assert an.peak_bytes(spec, dataclasses.replace(s, tp=2)) <= peak
    for est in an.phase_estimates(spec, s).values():
        assert est.breakdown.total_bytes == sum(est.breakdown.components.values())
        assert est.breakdown.get(Component.WEIGHTS) == an.weight_bytes(spec, s)


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        ("llama-3.1-8b", {"batch": 8, "prompt": 2048, "new_tokens": 64}),
        ("llama-3.1-8b", {"batch": 8, "prompt": 2048, "new_tokens": 64, "kv_dtype": "fp8"}),
        ("llama-3.1-8b", {"batch": 8, "prompt": 2048, "new_tokens": 64, "cache": "static"}),
        ("mistral-7b-v0.1", {"batch": 1, "prompt": 8192, "new_tokens": 16, "cache": "sliding"}),
        ("qwen3-30b-a3b", {"batch": 16, "prompt": 4096, "new_tokens": 8}),
        ("deepseek-v3", {"batch": 1, "prompt": 2048, "new_tokens": 8, "kv_dtype": "fp8"}),
    ],
)
def test_generate_stream_reaches_the_closed_form_peak(name: str, fields: dict[str, object]) -> None:
    """The allocator event stream (one block per moment, the cache's own cat/free sequence, ids re-made each
    step) peaks where the phase-by-phase maximum does: the two are assembled independently from the same
    per-layer quantities, so a tensor dropped or double-freed in the stream shows here."""
    from trainfit.allocator import simulate

    spec = load_model(name)
    s = InferenceSetup(**fields)  # type: ignore[arg-type]
    sim = simulate(an.generate_events(spec, s))
    peak = an.peak_bytes(spec, s)
    assert abs(sim.peak_allocated_bytes - peak) <= 0.01 * peak
    assert sim.peak_reserved_bytes >= sim.peak_allocated_bytes


def test_infer_reserve_is_simulated_and_the_capacity_search_agrees_with_the_fit() -> None:
    from trainfit.infer import infer
    from trainfit.overhead import ALLOCATOR_RESERVE_FRACTION

    spec = load_model("llama-3.1-8b")
    for batch in (1, 6, 7, 8, 9, 10, 16):
        rep = infer(spec, batch=batch, prompt=2048, new_tokens=32, gpu="l4", simulate_allocator=True)
        assert rep.overhead.allocator_reserve_bytes != int(rep.peak_bytes * ALLOCATOR_RESERVE_FRACTION)
        assert rep.fit is not None and rep.capacity is not None
        # the fit verdict and the batch search use the same reserve: the asked batch fits iff it is ≤ max
        assert rep.fit.fits == (batch <= rep.capacity.max_batch), batch
    fixed = infer(spec, batch=8, prompt=2048, new_tokens=32, gpu="l4")  # the default: the fixed fraction
    assert fixed.overhead.allocator_reserve_bytes == int(fixed.peak_bytes * ALLOCATOR_RESERVE_FRACTION)


def test_4bit_kernel_rule_per_gpu_is_bounded_by_the_gpu_free_answer() -> None:
    """``--gpu`` hands bitsandbytes' 4-bit kernel choice the GPU's compute capability and SM count; on every
    catalog GPU the decode (batch 8: 8 rows per linear) holds at most what the GPU-free answer (dequantise
    above 4 rows) holds. Llama-3.1-8B at 8 rows, by bitsandbytes' table (backends/cuda/ops.py
    ``_gemm_4bit_use_custom_cuda``): an H100 (sm90, 132 SMs) fuses the 14336 × 4096 ``up_proj`` (224 blocks of
    64 columns, at least one wave: up to 32 rows) but dequantises the 4096 × 14336 ``down_proj`` (64 blocks, under
    half a wave: never fused); an L4 (sm89, 58 SMs) fuses both (224 blocks ≥ 3 waves: 256 rows; 64 blocks ≥ 0.8
    wave with K > 2N: 128 rows), so its decode holds no dequantised weight."""
    from trainfit.hardware.gpus import list_gpus
    from trainfit.infer import infer

    spec = load_model("llama-3.1-8b")
    base = InferenceSetup(batch=8, prompt=512, new_tokens=4, dtype="nf4")
    bound = an.phase_estimates(spec, base)[InferencePhase.DECODE].breakdown.total_bytes
    for gpu in list_gpus():
        if gpu.compute_capability is None:
            continue
        rep = infer(spec, base, gpu=gpu)
        assert (rep.setup.compute_capability, rep.setup.sm_count) == (gpu.compute_capability, gpu.sm_count)
        phase = next(p for p in rep.phases if p.phase is InferencePhase.DECODE)
        decode = phase.total_bytes - phase.get(Component.WORKSPACES)  # the closed form's part (infer adds cuBLAS's)
        assert decode <= bound, gpu.id
    weight = 14336 * 4096 * 2  # one dequantised bf16 up_proj or down_proj
    h100 = an.phase_estimates(spec, dataclasses.replace(base, compute_capability="9.0", sm_count=132))
    assert h100[InferencePhase.DECODE].moment.endswith("down_proj (nf4)")
    l4 = an.phase_estimates(spec, dataclasses.replace(base, compute_capability="8.9", sm_count=58))
    assert "(nf4)" not in l4[InferencePhase.DECODE].moment
    assert l4[InferencePhase.DECODE].breakdown.components[Component.ACTIVATIONS] < weight


def test_inference_setup_checks_the_gpu_fields() -> None:
    with pytest.raises(StrategyError, match="compute capability"):
        InferenceSetup(compute_capability="sm90")
    with pytest.raises(StrategyError, match="sm count"):
        InferenceSetup(sm_count=0)


def test_bitsandbytes_on_a_fused_moe_warns_that_the_experts_stay_16_bit() -> None:
    """transformers 5 stores Mixtral's experts as 3-D nn.Parameter tensors, which replace_with_bnb_linear does not
    convert: ``--dtype nf4`` leaves 97% of the parameters in bf16, and the weights say so — a warning naming the
    share, whose bytes are inside the reported weights. Not under vLLM's nf4 (``--tp`` > 1), not for a dense model,
    not in bf16; a QLoRA base on Mixtral warns the same way in ``trainfit estimate`` (fp32 after PEFT's
    prepare_model_for_kbit_training)."""
    from trainfit import Strategy, estimate, infer
    from trainfit.arch import load_model
    from trainfit.arch.params import count_params, fused_expert_params
    from trainfit.strategy import finetune_setup

    mixtral = load_model("mixtral-8x7b-v0.1")
    experts = fused_expert_params(mixtral)
    share = f"{experts / count_params(mixtral):.0%} of the parameters"
    nf4 = infer(mixtral, dtype="nf4")
    said = [w for w in nf4.warnings if "fused MoE experts in bf16" in w]
    assert len(said) == 1 and share in said[0] and nf4.weights_bytes >= 2 * experts
    assert not any("fused MoE experts" in w for w in infer(mixtral, dtype="nf4", tp=2).warnings)
    assert not any("fused MoE experts" in w for w in infer(mixtral, dtype="bf16").warnings)
    assert fused_expert_params(load_model("llama-3.1-8b")) == 0
    assert not any("fused MoE experts" in w for w in infer("llama-3.1-8b", dtype="nf4").warnings)
    adapter, base = finetune_setup("qlora")
    qlora = estimate(mixtral, Strategy(adapter=adapter, base_weights=base))
    trained = [w for w in qlora.warnings if "fused MoE experts" in w]
    assert len(trained) == 1 and share in trained[0] and "fp32" in trained[0]
    assert qlora.phases[0].components["weights"] >= 4 * experts
    assert not any("fused MoE experts" in w for w in estimate(mixtral).warnings)
