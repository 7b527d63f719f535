"""``trainfit plan --allow fp8`` and the speed model's fp8 share (torch-free)."""

from __future__ import annotations

import pytest

from trainfit.arch import load_model
from trainfit.errors import StrategyError
from trainfit.estimate import estimate
from trainfit.hardware import get_gpu
from trainfit.planner.api import plan
from trainfit.planner.space import (
    Finetune,
    allows_float8,
    candidates,
    float8_candidates,
    parse_allow,
)
from trainfit.planner.speed import (
    MATMUL_EFFICIENCY,
    SpeedInputs,
    float8_flops_fraction,
    step_time_of,
)
from trainfit.strategy import Float8


def test_allow_parses_fp8_beside_the_finetuning_methods() -> None:
    assert parse_allow("lora,fp8") == (Finetune.LORA,)
    assert allows_float8("lora, fp8") and not allows_float8("lora,qlora") and not allows_float8(None)


def test_fp8_candidates_only_where_the_gpu_has_fp8() -> None:
    spec = load_model("llama-3.2-1b")
    for gpu_id, expected in (("a100-sxm-80gb", False), ("h100-sxm-80gb", True), ("rtx-4090", True), ("t4", False)):
        gpu = get_gpu(gpu_id)
        base = candidates(spec, gpu, gpus=8, gpus_per_node=8, global_batch=64)
        fp8 = float8_candidates(gpu, base)
        assert bool(fp8) is expected, gpu_id
        assert all(
            c.float8 is Float8.TENSORWISE
            and c.precision.value.endswith("bf16")
            and c.sharding.value in ("none", "ddp", "fsdp", "hsdp")
            and c.tensor == c.pipeline == 1
            and c.offload == "none"
            for c in fp8
        )
        assert not expected or {c.sharding.value for c in fp8} == {"none", "ddp", "fsdp"}


def test_fp8_candidate_speed_inputs_match_the_strategy() -> None:
    spec, gpu = load_model("llama-3.2-1b"), get_gpu("h100-sxm-80gb")
    for c in candidates(spec, gpu, gpus=8, gpus_per_node=8, global_batch=8, fp8=True):
        micro = 8 // c.data if c.optimizer_in_backward else 1  # optimizer-in-backward: no accumulation
        accum = 8 // (c.data * micro)
        s = c.strategy(micro_batch=micro, grad_accum=accum, seq_len=1024, gpus_per_node=8)
        x = c.speed_inputs(micro_batch=micro, grad_accum=accum, seq_len=1024, gpus_per_node=8, spec=spec)
        assert SpeedInputs.of(s, spec) == x


def test_fp8_share_from_the_config_numbers() -> None:
    """Llama-3.1-8B: every block linear converts (4096, 1024, 14336 are ÷ 16); the LM head (4096 × 128256,
    untied) stays bf16. The speed model's matmul FLOPs follow Kaplan's 2·N over the non-embedding parameters,
    the 65 RMSNorm weights of 4096 included, so the share is blocks / (blocks + head + norms)."""
    spec = load_model("llama-3.1-8b")
    linears = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    head, norms = 4096 * 128256, (2 * 32 + 1) * 4096
    assert float8_flops_fraction(spec) == pytest.approx(linears / (linears + head + norms), rel=1e-12)


def test_fp8_matmuls_run_at_the_fp8_peak() -> None:
    """H100 SXM: fp8 1979 = 2 × bf16 989.5 (dense). Without recompute the step's matmuls execute 3 × 2·P_matmul
    FLOPs per token; the converted share φ of them runs at the fp8 rate, so the compute time drops by
    M/R · φ · (1 − bf16/fp8) (R: the bf16 matmul rate); attention and the memory-bound work do not change."""
    spec, gpu = load_model("llama-3.1-8b"), get_gpu("h100-sxm-80gb")
    x = SpeedInputs(seq_len=4096, micro_batch=1, grad_accum=8)
    bf16, fp8 = step_time_of(spec, x, gpu), step_time_of(spec, SpeedInputs(**{**_fields(x), "float8": True}), gpu)
    phi = float8_flops_fraction(spec)
    ratio = gpu.peak_tflops["fp8"] / gpu.peak_tflops["bf16"]  # type: ignore[operator]
    matmul_params = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 4096 * 128256 + 65 * 4096
    matmul_flops = 3 * 2 * matmul_params * 4096 * 8
    rate = gpu.peak_tflops["bf16"] * 1e12 * MATMUL_EFFICIENCY  # type: ignore[operator]
    saved = matmul_flops / rate * phi * (1 - 1 / ratio)
    assert bf16.compute_seconds - fp8.compute_seconds == pytest.approx(saved, rel=1e-6)
    assert fp8.model_flops_per_step == bf16.model_flops_per_step


def _fields(x: SpeedInputs) -> dict[str, object]:
    return {f: getattr(x, f) for f in x.__dataclass_fields__}


def test_plan_with_fp8_fits_by_the_estimate_and_is_refused_without_fp8() -> None:
    spec, gpu = load_model("llama-3.2-1b"), get_gpu("h100-sxm-80gb")
    r = plan(spec, gpu, gpus=1, seq=2048, global_batch=16, allow="fp8", top=3)
    best = r.plans[0]
    assert best.strategy.float8 is Float8.TENSORWISE and "--fp8 tensorwise" in best.changes
    again = estimate(spec, best.strategy, gpu=gpu, search_micro_batch=False, fixes=False, allocator=best.alloc_conf)
    assert again.fit is not None and again.fit.fits
    with pytest.raises(StrategyError, match="no fp8 tensor cores"):
        plan(spec, "a100-sxm-80gb", gpus=1, seq=2048, global_batch=16, allow="fp8")
