"""Quantised weights in ``trainfit infer --method trace`` (``--dtype int8|nf4|fp4|fp8``): real bitsandbytes
``Linear4bit`` / ``Linear8bitLt`` layers built and quantised on fake tensors (trainfit.trace.bnb), and
transformers' ``FP8Linear`` (trainfit.trace.fp8), run through Hugging Face ``generate`` with bitsandbytes'
custom ops given their CUDA kernels' memory and a stand-in for the fp8 matmul kernel, against the closed forms of
trainfit.analytic.inference. Two levels: one linear's worst moment (the emulated kernel run by the real
bitsandbytes module vs :func:`linear_transient_bytes`), then each ``generate`` phase within 2% (the issue's
target), weights and cache byte-exact. The trace runs bitsandbytes' own modules; nothing in it is computed
from the analytic formulas."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.cli._cli_helper import run_cli
from trainfit.analytic.inference import kv_cache_bytes, linear_transient_bytes, phase_estimates, weight_bytes
from trainfit.arch import load_model
from trainfit.arch.config import spec_from_config
from trainfit.arch.spec import ModelSpec
from trainfit.cuda_facts import BNB_4BIT_FUSED_MAX_ROWS
from trainfit.result import Component, InferencePhase
from trainfit.strategy.inference import InferenceSetup

from .conftest import assert_decode_logits_exact

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("bitsandbytes")

import torch

from trainfit.trace import runner as rn
from trainfit.trace import tracker as tk
from trainfit.trace.generate import _quantised, _to_bnb_layers, trace_generate

TINY: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}  # fmt: skip


def _tiny(**kw: Any) -> ModelSpec:
    return spec_from_config({**TINY, **kw}, name="tiny-llama", source="explicit")


@pytest.mark.parametrize("dtype", ["nf4", "fp4", "int8", "fp8"])
@pytest.mark.parametrize("rows", [1, BNB_4BIT_FUSED_MAX_ROWS, BNB_4BIT_FUSED_MAX_ROWS + 1, 96])
@pytest.mark.parametrize("double_quant", [True, False])
def test_one_linear_holds_what_the_closed_form_says(dtype: str, rows: int, double_quant: bool) -> None:
    """A real quantised layer's forward under the kernel emulation: the live bytes beyond its weights and its
    input peak at :func:`linear_transient_bytes` (bitsandbytes: the fused 4-bit kernel up to 4 rows, the
    dequantised weight above; LLM.int8's quantised input, outlier mask, int32 product and fp16 dequantisation;
    transformers' ``FP8Linear``: the fp8 input and its per-group scales beside the output)."""
    if dtype in ("int8", "fp8") and not double_quant:
        pytest.skip("double quantisation is a 4-bit option")
    k, n = 384, 448
    setup = InferenceSetup(dtype=dtype, double_quant=double_quant)
    assert _linear_peak(setup, rows, k, n)[0] == linear_transient_bytes(setup, rows, k, n)


def _linear_peak(setup: InferenceSetup, rows: int, k: int, n: int) -> tuple[int, list[int]]:
    """One quantised ``k → n`` linear (``setup.dtype``) run on ``rows`` bf16 rows under the CUDA kernel emulation
    (the setup's GPU): the peak of the live bytes beyond its weights and input, and every storage it made."""
    from trainfit.trace.bnb import CudaBnbKernels

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16))
    if setup.dtype.value == "fp8":  # transformers' own replacement (a bare Sequential has no skip list to compute)
        from transformers import FineGrainedFP8Config
        from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

        config = FineGrainedFP8Config(weight_block_size=[128, 128])
        replace_with_fp8_linear(model, modules_to_not_convert=[], quantization_config=config)
    else:
        _to_bnb_layers(model, setup)
    mode = rn.fake_mode()
    rn.materialize(model, mode, None)
    kernels = CudaBnbKernels(compute_capability=setup.compute_capability, sm_count=setup.sm_count)
    with _quantised(model, mode, setup):
        model.eval()
        tr = tk.Tracker()
        tr.mark(list(model.parameters()) + list(model.buffers()), tk.WEIGHTS)
        with mode, tr, kernels, torch.no_grad():
            x = torch.zeros(rows, k, dtype=torch.bfloat16)
            tr.mark([x], tk.WEIGHTS)  # the input is the caller's, not the linear's
            y = model(x)
            assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    made = [r for r in tr.records if r.kind != tk.WEIGHTS]
    live, peak = 0, 0
    for t in range(tr.t + 1):
        live += sum(r.nbytes for r in made if r.alloc_t == t) - sum(r.nbytes for r in made if r.free_t == t)
        peak = max(peak, live)
    return peak, [r.nbytes for r in made]


CASES = [
    ("nf4-b2", _tiny(), InferenceSetup(batch=2, prompt=128, new_tokens=6, dtype="nf4")),
    ("nf4-b1-fused-decode", _tiny(), InferenceSetup(batch=1, prompt=64, new_tokens=6, dtype="nf4")),
    ("nf4-b8-dequant-decode", _tiny(), InferenceSetup(batch=8, prompt=32, new_tokens=5, dtype="nf4")),
    ("fp4-no-double-quant", _tiny(), InferenceSetup(batch=8, prompt=32, new_tokens=5, dtype="fp4", double_quant=False)),
    ("int8-b2", _tiny(), InferenceSetup(batch=2, prompt=128, new_tokens=6, dtype="int8")),
    ("int8-b8", _tiny(), InferenceSetup(batch=8, prompt=32, new_tokens=5, dtype="int8")),
    ("int8-eager", _tiny(), InferenceSetup(batch=2, prompt=64, new_tokens=5, dtype="int8", attention="eager")),
    ("nf4-static", _tiny(), InferenceSetup(batch=2, prompt=64, new_tokens=5, dtype="nf4", cache="static")),
    ("int8-fp8-cache", _tiny(), InferenceSetup(batch=2, prompt=64, new_tokens=5, dtype="int8", kv_dtype="fp8")),
    (
        "nf4-mha-bias",
        _tiny(model_type="qwen2", num_key_value_heads=8),
        InferenceSetup(batch=4, prompt=64, new_tokens=5, dtype="nf4"),
    ),
    # BitsAndBytesConfig's default bnb_4bit_compute_dtype (fp32): Linear4bit casts in and out, dequantises to fp32
    (
        "nf4-compute-fp32-b2",
        _tiny(),
        InferenceSetup(batch=2, prompt=128, new_tokens=5, dtype="nf4", compute_dtype="fp32"),
    ),
    (
        "nf4-compute-fp32-b8",
        _tiny(),
        InferenceSetup(batch=8, prompt=32, new_tokens=5, dtype="nf4", compute_dtype="fp32"),
    ),
    # transformers' FP8Linear (fine-grained 128 × 128 blocks; widths multiples of 128, as the Triton kernel needs)
    ("fp8-b2", _tiny(intermediate_size=768), InferenceSetup(batch=2, prompt=128, new_tokens=5, dtype="fp8")),
    ("fp8-b8", _tiny(intermediate_size=768), InferenceSetup(batch=8, prompt=32, new_tokens=5, dtype="fp8")),
    (
        "fp8-qwen2-bias-eager",
        _tiny(model_type="qwen2", intermediate_size=768),
        InferenceSetup(batch=2, prompt=64, new_tokens=5, dtype="fp8", attention="eager"),
    ),
]


@pytest.mark.parametrize(("name", "spec", "setup"), CASES, ids=[c[0] for c in CASES])
def test_generate_phases_within_2_percent(name: str, spec: ModelSpec, setup: InferenceSetup) -> None:
    """Dense GQA and MHA-with-bias layers; fused (batch ≤ 4) and dequantising (batch 8) decode; double
    quantisation on and off; SDPA and eager; dynamic, static and fp8 caches; fp8 weights."""
    _agree(name, spec, setup, {InferencePhase.PREFILL: 0.02, InferencePhase.DECODE: 0.02})


def _agree(name: str, spec: ModelSpec, setup: InferenceSetup, tolerance: dict[InferencePhase, float]) -> None:
    """Each phase's trace and closed form within its tolerance; weights, the final cache and the decode's logits
    to the byte."""
    traced = trace_generate(spec, setup)
    closed = phase_estimates(spec, setup)
    for ph, tol in tolerance.items():
        t = sum(traced.phases[ph].values())
        a = closed[ph].breakdown.total_bytes
        assert abs(a - t) <= tol * t, f"{name} {ph.value}: analytic {a} vs trace {t} ({closed[ph].moment})"
    assert traced.weights_bytes == weight_bytes(spec, setup)
    assert traced.kv_cache_bytes == kv_cache_bytes(spec, setup)
    assert_decode_logits_exact(name, traced, closed)


def test_quantised_transients_are_what_sets_the_prefill() -> None:
    """The agreement is not carried by the weights: in prefill the quantised linears' transients are the worst
    moment (the closed form names it), and the traced int8 prefill holds more activations than the bf16 one."""
    spec = _tiny()
    int8 = InferenceSetup(batch=2, prompt=128, new_tokens=3, dtype="int8")
    bf16 = InferenceSetup(batch=2, prompt=128, new_tokens=3)
    assert "(int8)" in phase_estimates(spec, int8)[InferencePhase.PREFILL].moment
    act = [trace_generate(spec, s).phases[InferencePhase.PREFILL][Component.ACTIVATIONS] for s in (int8, bf16)]
    assert act[0] > act[1]


FIXTURES = ["tiny-qwen2-moe", "tiny-deepseek-v2-lite", "tiny-gemma2", "tiny-phi3", "tiny-opt-proj"]


@pytest.mark.parametrize("dtype", ["nf4", "int8"])
@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_families(name: str, dtype: str) -> None:
    """MoE (shared experts quantised, fused routed experts kept in bf16 as bitsandbytes leaves them), MLA
    (kv_b_proj over the whole cache at decode), Gemma-2's eager attention, Phi-3's fused projections, OPT's
    project_in/out: weights and cache byte-exact, both phases within 2% (these toy models weigh 0.3 MB, so
    ``generate``'s own bookkeeping — the fp32 logits, the re-made ids, positions and mask, a few 512-byte
    tensors — is a visible share of the decode; the closed forms list it, analytic.inference._step_bytes)."""
    spec = load_model(str(Path(__file__).parents[1] / "fixtures" / "configs" / f"{name}.json"))
    setup = InferenceSetup(batch=2, prompt=96, new_tokens=5, dtype=dtype)
    _agree(name, spec, setup, {InferencePhase.PREFILL: 0.02, InferencePhase.DECODE: 0.02})


@pytest.mark.parametrize("name", ["tiny-qwen2-moe", "tiny-deepseek-v2-lite"])
def test_fp8_experts(name: str) -> None:
    """``--dtype fp8`` on MoE models: transformers' ``FP8Experts`` (fp8 [E, out, in] weights, fp32 block scales)
    through ``fp8_grouped_mm_experts_forward``, its grouped kernel replaced by a stand-in that allocates what
    the Triton kernel does (the output; activation quantisation is fused, trainfit.trace.fp8). Weights and cache
    byte-exact against the closed forms' ``FP8Experts`` tensors; decode within 3% as for the other formats on
    these toy fixtures (see above)."""
    spec = load_model(str(Path(__file__).parents[1] / "fixtures" / "configs" / f"{name}.json"))
    setup = InferenceSetup(batch=2, prompt=96, new_tokens=5, dtype="fp8")
    _agree(name, spec, setup, {InferencePhase.PREFILL: 0.02, InferencePhase.DECODE: 0.03})


def test_fp32_compute_dtype_costs_more_than_bf16() -> None:
    """transformers' default ``bnb_4bit_compute_dtype`` (fp32) against bf16, both traced: the fp32 input copy,
    the fp32 dequantised weight and output raise the prefill peak; the weights are the same."""
    spec = _tiny()
    bf16 = trace_generate(spec, InferenceSetup(batch=2, prompt=128, new_tokens=3, dtype="nf4"))
    fp32 = trace_generate(spec, InferenceSetup(batch=2, prompt=128, new_tokens=3, dtype="nf4", compute_dtype="fp32"))
    assert fp32.weights_bytes == bf16.weights_bytes
    pre = InferencePhase.PREFILL
    assert sum(fp32.phases[pre].values()) > 1.1 * sum(bf16.phases[pre].values())


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--dtype", "int8", "--compute-dtype", "fp32"), "nf4|fp4"),
        (("--dtype", "nf4", "--compute-dtype", "fp8"), "fp8"),
    ],
)
def test_compute_dtype_refusals(capsys: pytest.CaptureFixture[str], args: tuple[str, ...], needle: str) -> None:
    res = run_cli(capsys, "infer", "llama-3.2-1b", *args)
    assert res.code == 2 and needle in res.err and len(res.err.strip().splitlines()) == 1, res.err


def test_cli_method_trace_nf4(capsys: pytest.CaptureFixture[str]) -> None:
    args = ("infer", "llama-3.2-1b", "--dtype", "nf4", "--prompt", "64", "--new-tokens", "3", "--json")
    res = run_cli(capsys, *args, "--method", "trace")
    assert res.code == 0, res.err
    doc = json.loads(res.out)
    analytic = json.loads(run_cli(capsys, *args).out)
    assert doc["weights_bytes"] == analytic["weights_bytes"]
    for ph in ("prefill", "decode"):
        t, a = doc["phases"][ph]["total_bytes"], analytic["phases"][ph]["total_bytes"]
        assert abs(a - t) <= 0.02 * t


@pytest.mark.parametrize("dtype", ["nf4", "int8"])
def test_gpt2_conv1d_is_quantised_as_transformers_quantises_it(dtype: str) -> None:
    """transformers' ``replace_with_bnb_linear`` converts GPT-2's ``Conv1D`` layers too (weights transposed to
    (out, in)); a trace that left them in bf16 held 33% more than the closed form in prefill. Weights and cache
    byte-exact, prefill within 2%, decode within 3% (the toy fixtures' bookkeeping, as above)."""
    cfg = {"model_type": "gpt2", "n_embd": 128, "n_layer": 2, "n_head": 4, "vocab_size": 500, "n_positions": 256}
    spec = spec_from_config(cfg, name="tiny-gpt2", source="test")
    setup = InferenceSetup(batch=2, prompt=96, new_tokens=5, dtype=dtype)
    _agree("tiny-gpt2", spec, setup, {InferencePhase.PREFILL: 0.02, InferencePhase.DECODE: 0.03})


#: (compute capability, SMs): H100 SXM and B200 from the GPU catalog.
_H100, _B200 = ("9.0", 132), ("10.0", 148)


@pytest.mark.parametrize(("gpu", "fused"), [(_H100, True), (_B200, False), (None, False)])
def test_one_4bit_linear_follows_the_gpu_kernel_rule(gpu: tuple[str, int] | None, fused: bool) -> None:
    """Eight rows through a 448 × 384 nf4 linear: bitsandbytes' table fuses it on an H100 (a small weight under
    a quarter of a wave: up to 32 rows on HBM GPUs) and dequantises it on a B200 (under one wave of SMs); with
    no GPU the 4-row floor dequantises. The emulated kernel's live bytes equal the closed form's in each case,
    and only the dequantising ones hold the n × k bf16 weight."""
    from trainfit.cuda_facts import bnb_gemm_4bit_fused

    rows, k, n = 8, 384, 448
    cc, sms = gpu if gpu else (None, None)
    assert bnb_gemm_4bit_fused(rows, n, k, compute="bf16", compute_capability=cc, sm_count=sms) is fused
    setup = InferenceSetup(dtype="nf4", compute_capability=cc, sm_count=sms)
    peak, made = _linear_peak(setup, rows, k, n)
    assert (n * k * 2 in made) is not fused
    assert peak == linear_transient_bytes(setup, rows, k, n)


def test_generate_decode_on_a_gpu_that_fuses_small_batches() -> None:
    """Decode at batch 8 (8 rows per linear) with nf4 weights: on an H100 bitsandbytes fuses every linear of
    this model (no dequantised weight), on a B200 it dequantises each; the trace and the closed forms agree to
    the byte on both (every component of both phases), and the H100's decode holds less."""
    spec = _tiny(intermediate_size=704)  # block-aligned (704 = 11 · 64): the down projection may fuse too
    decode = {}
    for gpu in (_H100, _B200):
        setup = InferenceSetup(
            batch=8, prompt=32, new_tokens=4, dtype="nf4", compute_capability=gpu[0], sm_count=gpu[1]
        )
        traced = trace_generate(spec, setup)
        closed = phase_estimates(spec, setup)
        for ph in InferencePhase:
            assert closed[ph].breakdown.components == dict(traced.phases[ph]), (gpu, ph)
        decode[gpu] = sum(traced.phases[InferencePhase.DECODE].values())
        assert "(nf4)" in closed[InferencePhase.DECODE].moment or gpu == _H100
    assert decode[_H100] < decode[_B200]
