"""The inference entry point: ``infer(model, setup, method=..., gpu=...) -> InferenceReport``.

It resolves the model and GPU, refuses what no run could do (:func:`trainfit.analytic.inference.validate`),
runs the method — the closed forms (:mod:`trainfit.analytic.inference`, torch-free) or the ``generate`` trace
(:mod:`trainfit.trace.generate`, imported only when asked for) — and, with a GPU, adds the fit verdict and the
capacities (always from the closed forms: a capacity search is dozens of estimates). On request
(``simulate_allocator``, ``--simulate-allocator``) the analytic method's allocator reserve comes from simulating
the caching allocator over the ``generate`` call's event stream
(:func:`trainfit.analytic.inference.simulate_generate`), else it is the fixed reserve fraction; the capacity
search applies the same reserve as a fraction of each probe's peak, so the verdict and the largest batch agree.
The report echoes its inputs, so the renderers (:mod:`trainfit.report.infer`) need nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from fractions import Fraction
from importlib import import_module
from typing import Any

from trainfit.allocator import AllocatorConfig
from trainfit.allocator.workspaces import Thread
from trainfit.analytic import inference as an
from trainfit.analytic.inference import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_INFER_HEADROOM,
    CacheKind,
    Capacity,
    InferenceSetup,
    PagedCapacity,
    WeightFormat,
)
from trainfit.arch import ModelSpec, load_model
from trainfit.arch.params import count_params
from trainfit.errors import StrategyError
from trainfit.hardware import GPUSpec, get_gpu
from trainfit.overhead import outside_allocator, overhead_for
from trainfit.result import Component, InferencePhase, Method, Overhead, PhaseBreakdown, Term

__all__ = ["DEFAULT_PROMPT", "InferenceFit", "InferenceReport", "Server", "default_prompt", "infer"]

#: Prompt tokens per sequence when none are given, unless the model's context is shorter (:func:`default_prompt`).
DEFAULT_PROMPT = 2048


def default_prompt(spec: ModelSpec, new_tokens: int) -> int:
    """``trainfit infer``'s prompt when none is given: 2048 tokens, or what the model's context leaves after
    ``new_tokens`` when that is shorter (GPT-2: 1024 − 256 = 768), as ``trainfit estimate`` takes the context as
    its sequence. A model whose every layer slides (Mistral v0.1) runs past its context, and a context that
    leaves no prompt is the validation's to refuse: both keep 2048."""
    ctx = spec.max_position_embeddings
    all_sliding = bool(spec.sliding_window) and spec.sliding_layers == spec.num_layers
    if ctx is None or all_sliding or DEFAULT_PROMPT + new_tokens <= ctx or ctx - new_tokens < 1:
        return DEFAULT_PROMPT
    return ctx - new_tokens


class Server(StrEnum):
    GENERATE = "generate"  # Hugging Face generate, one batch
    PAGED = "paged"  # a vLLM-style server: a KV block pool sized at start-up


@dataclass(frozen=True, slots=True, kw_only=True)
class InferenceFit:
    gpu_id: str
    gpu_memory_bytes: int
    headroom_fraction: float
    usable_bytes: int
    required_bytes: int  # the nvidia-smi estimate: peak + allocator reserve + CUDA context
    fits: bool
    free_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class InferenceReport:
    method: Method
    model: ModelSpec
    setup: InferenceSetup
    params: int
    phases: tuple[PhaseBreakdown, ...]
    moments: Mapping[InferencePhase, str]  # what each phase's worst moment is
    weights_bytes: int
    kv_cache_bytes: int  # the cache at full length (after the last decode step)
    kv_bytes_per_token: int  # one token of one sequence, all layers (the paged-block unit)
    overhead: Overhead
    rule_of_thumb_bytes: int  # the article: weights × 1.2
    gpus: int = 1
    server: Server = Server.GENERATE
    terms: tuple[Term, ...] = ()
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    gpu: GPUSpec | None = None
    fit: InferenceFit | None = None
    capacity: Capacity | None = None
    paged: PagedCapacity | None = None
    trace_seconds: float | None = None
    layers_traced: tuple[int, ...] = ()

    @property
    def peak(self) -> PhaseBreakdown:
        return max(self.phases, key=lambda p: p.total_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.peak.total_bytes

    @property
    def peak_phase(self) -> InferencePhase:
        ph = self.peak.phase
        assert isinstance(ph, InferencePhase)
        return ph

    @property
    def steady_state_bytes(self) -> int:
        """What stays allocated once the cache is full, between steps: weights + the KV cache at full length
        (the phases add the transients on top: the prefill's layer, the decode step's ``cat`` copy and logits)."""
        return self.weights_bytes + self.kv_cache_bytes

    @property
    def nvidia_smi_estimate_bytes(self) -> int:
        return self.peak_bytes + self.overhead.total_bytes

    @property
    def replicas(self) -> int:
        """Data-parallel copies of the tensor-parallel group across ``gpus``."""
        return self.gpus // self.setup.tp

    def phase(self, phase: InferencePhase) -> PhaseBreakdown:
        for p in self.phases:
            if p.phase == phase:
                return p
        raise KeyError(phase)


def _setup(spec: ModelSpec, setup: InferenceSetup | None, fields: Mapping[str, Any]) -> InferenceSetup:
    """The setup given, or one from its fields, the prompt :func:`default_prompt` when they name none."""
    if setup is not None and fields:
        raise StrategyError("give either an InferenceSetup or its fields, not both")
    if setup is not None:
        return setup
    if "prompt" not in fields:
        new_tokens = fields.get("new_tokens", InferenceSetup().new_tokens)
        if isinstance(new_tokens, int):  # else InferenceSetup refuses it
            fields = {**fields, "prompt": default_prompt(spec, new_tokens)}
    return InferenceSetup(**fields)


def generate_workspaces_bytes(gpu: GPUSpec | None) -> int:
    """The workspaces a ``generate`` call allocates on ``gpu`` (its compute capability; none given: the H200's): the
    main thread's cuBLAS workspace and its separate cuBLASLt one, made at the first matmul and kept by the handle
    (``CublasHandlePool.cpp``); no backward, so no autograd thread's. Blocks no tensor owns: the trace cannot see
    them (H200, 2026-12-04: every ``generate`` peak 30–50 MB over both methods, 33 MiB of it these)."""
    from trainfit.estimate import gpu_workspaces

    return sum(w.size_bytes for w in gpu_workspaces(gpu) if w.thread is Thread.MAIN)


def infer(
    model: str | ModelSpec,
    setup: InferenceSetup | None = None,
    *,
    method: Method | str = Method.ANALYTIC,
    gpu: str | GPUSpec | None = None,
    gpus: int | None = None,
    server: Server | str = Server.GENERATE,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    headroom: float = DEFAULT_INFER_HEADROOM,
    progress: Callable[[str, float], None] | None = None,
    allocator: str | None = None,
    simulate_allocator: bool = False,
    **setup_fields: Any,
) -> InferenceReport:
    """Inference memory for ``model`` under ``setup`` (or its fields as keywords: ``batch``, ``prompt``,
    ``new_tokens``, ``dtype``, ``kv_dtype``, ``cache``, ``block_size``, ``attention``, ``tp``, ``padded``; without
    ``prompt``, :func:`default_prompt`, as ``trainfit infer`` without ``--prompt``).

    With ``simulate_allocator`` the analytic method's allocator reserve comes from replaying the ``generate``
    call's allocations through the caching-allocator simulation
    (:func:`trainfit.analytic.inference.simulate_generate`) under ``allocator`` (a ``PYTORCH_CUDA_ALLOC_CONF``
    string; None: this process's environment, else PyTorch's defaults). Off by default: one decode step per
    new token makes the stream long (0.5–2 s for catalog models, against milliseconds for the closed forms),
    and it is not yet checked against a GPU; without it, a paged cache and the trace keep the fixed reserve
    fraction."""
    spec = load_model(model) if isinstance(model, str) else model
    st = _setup(spec, setup, setup_fields)
    gpu_spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    try:
        m = Method(method)
        srv = Server(server)
    except ValueError as exc:
        raise StrategyError(f"{exc}; methods: analytic, trace; servers: generate, paged") from None
    if m not in (Method.ANALYTIC, Method.TRACE):
        raise StrategyError(f"trainfit infer offers --method analytic or trace, not {m.value}")
    n_gpus = st.tp if gpus is None else gpus
    if n_gpus < st.tp or n_gpus % st.tp:
        raise StrategyError(f"--gpus {n_gpus} must be a multiple of --tp {st.tp}")
    if st.padded and (srv is Server.PAGED or st.cache is CacheKind.PAGED):
        raise StrategyError("--padded is Hugging Face generate's batching; a paged server schedules unpadded sequences")
    if srv is Server.PAGED:
        if gpu_spec is None:
            raise StrategyError("--server paged sizes the KV pool of a GPU: give --gpu")
        if st.cache is not CacheKind.PAGED:
            st = dataclasses.replace(st, cache=CacheKind.PAGED)
    if not 0.0 <= headroom < 1.0:
        raise StrategyError(f"--headroom must be in [0, 1), got {headroom}")
    if st.dtype in (WeightFormat.NF4, WeightFormat.FP4) and gpu_spec is not None:
        # bitsandbytes' 4-bit kernel choice for 5-1536 rows depends on the GPU (cuda_facts.bnb_gemm_4bit_fused)
        st = dataclasses.replace(st, compute_capability=gpu_spec.compute_capability, sm_count=gpu_spec.sm_count)
    warnings = list(an.validate(spec, st, gpu_spec))
    if st.attention.value == "sdpa" and not spec.supports_sdpa:
        warnings.append(f"{spec.name} ({spec.model_type}) has no SDPA attention in transformers; estimating eager")
    flash = an.flash_for(gpu_spec)
    weights = an.weight_bytes(spec, st)
    estimates = an.phase_estimates(spec, st, flash=flash, weights=weights)
    notes: list[str] = [
        "Hugging Face generate: greedy, logits_to_keep=1, fp32 copy of the last-token logits"
        if st.cache is not CacheKind.PAGED
        else "paged cache: blocks of --block-size tokens per sequence and layer (vLLM PagedAttention)"
    ]
    if an.hf_fp8(st):
        notes.append(
            "fp8 cache: transformers QuantizedCache(backend='fp8') - float8_e4m3fn K/V with a per-tensor scale; "
            "attention reads a dequantised copy of the running layer's cache"
        )
    notes += an.engine_notes(spec, st)
    warnings += an.bnb_expert_warnings(spec, st)  # a warning: the weights look like a 16-bit model's
    if st.dtype in (WeightFormat.NF4, WeightFormat.FP4) and not an.vllm_bnb(st):
        notes.append(
            f"bitsandbytes 4-bit matmul: fused or dequantised per linear as bitsandbytes 0.50.2 chooses on "
            f"sm{st.compute_capability} with {st.sm_count} SMs"
            if st.compute_capability and st.sm_count
            else "bitsandbytes 4-bit matmul: no --gpu, so every linear over 4 rows dequantises its weight "
            "(an upper bound; the fused kernel's range depends on the GPU)"
        )
    if spec.mla is not None:
        notes.append("MLA: the cache holds the compressed latent (kv_lora_rank + qk_rope_head_dim per token and layer)")
    phases: dict[InferencePhase, dict[Component, int]] = {
        ph: dict(e.breakdown.components) for ph, e in estimates.items()
    }
    moments = {ph: e.moment for ph, e in estimates.items()}
    kv_full = an.kv_cache_bytes(spec, st)
    trace_seconds: float | None = None
    layers: tuple[int, ...] = ()
    if m is Method.TRACE:
        if st.cache is CacheKind.PAGED:
            raise StrategyError("--method trace runs Hugging Face generate: --cache dynamic, static or sliding")
        from trainfit.trace._deps import require_transformers

        require_transformers()
        gen = import_module("trainfit.trace.generate")
        tr = gen.trace_generate(spec, st, flash=flash, progress=progress)
        phases = {ph: dict(v) for ph, v in tr.phases.items()}
        moments = {ph: "traced" for ph in phases}
        kv_full, weights = tr.kv_cache_bytes, tr.weights_bytes
        trace_seconds, layers = tr.seconds, tr.layers_traced
        notes += list(tr.notes)
    workspaces = generate_workspaces_bytes(gpu_spec)
    phases = {ph: {**c, Component.WORKSPACES: workspaces} for ph, c in phases.items()}
    breakdowns = tuple(PhaseBreakdown(phase=ph, components=c) for ph, c in phases.items())
    peak = max(b.total_bytes for b in breakdowns)
    overhead = overhead_for(peak, gpu_spec, inference=True)
    reserve: Fraction | None = None
    if simulate_allocator and st.padded:
        raise StrategyError(
            "--simulate-allocator replays an unpadded generate call; drop it with --padded (the fixed reserve applies)"
        )
    if m is Method.ANALYTIC and simulate_allocator and st.cache is not CacheKind.PAGED:
        config = AllocatorConfig.parse(allocator) if allocator is not None else AllocatorConfig.from_env()
        sim = an.simulate_generate(spec, st, config, flash=flash)
        held = max(0, sim.peak_reserved_bytes - sim.peak_allocated_bytes)
        overhead = outside_allocator(gpu_spec, allocator_reserve_bytes=held, inference=True)
        reserve = Fraction(held, peak)
        notes.append(
            f"allocator reserve from the caching-allocator simulation of the generate call "
            f"({config.to_env() or 'PyTorch defaults'}): {held / 2**20:.0f} MiB, {100 * held / peak:.1f}% of the "
            "peak; the capacity search applies that fraction to every probe"
        )
    params = count_params(spec)
    fit = cap = paged = None
    if gpu_spec is not None:
        usable = int(gpu_spec.memory_bytes * (1 - headroom))
        required = peak + overhead.total_bytes
        fit = InferenceFit(
            gpu_id=gpu_spec.id,
            gpu_memory_bytes=gpu_spec.memory_bytes,
            headroom_fraction=headroom,
            usable_bytes=usable,
            required_bytes=required,
            fits=required <= usable,
            free_bytes=usable - required,
        )
        cap = an.capacity(spec, st, usable, flash=flash, gpu=gpu_spec, reserve=reserve, extra_bytes=workspaces)
        if srv is Server.PAGED:
            paged = an.paged_capacity(
                spec, st, gpu_spec.memory_bytes, gpu_memory_utilization, flash=flash, gpu=gpu_spec
            )
            # A paged server fits when its pool holds one sequence at the requested context.
            one_seq = -(-st.context // st.block_size) * paged.block_bytes
            need = paged.weights_bytes + paged.profile_peak_bytes + paged.non_torch_bytes + one_seq
            fit = InferenceFit(
                gpu_id=gpu_spec.id,
                gpu_memory_bytes=gpu_spec.memory_bytes,
                headroom_fraction=round(1 - gpu_memory_utilization, 6),
                usable_bytes=paged.requested_bytes,
                required_bytes=need,
                fits=need <= paged.requested_bytes,
                free_bytes=paged.requested_bytes - need,
            )
    return InferenceReport(
        method=m,
        model=spec,
        setup=st,
        params=params,
        phases=breakdowns,
        moments=moments,
        weights_bytes=weights,
        kv_cache_bytes=kv_full,
        kv_bytes_per_token=an.kv_bytes_per_token(spec, st),
        overhead=overhead,
        rule_of_thumb_bytes=an.rule_of_thumb_bytes(params, st),
        gpus=n_gpus,
        server=srv,
        terms=an.explain_terms(spec, st, estimates),
        notes=tuple(notes),
        warnings=tuple(warnings),
        gpu=gpu_spec,
        fit=fit,
        capacity=cap,
        paged=paged,
        trace_seconds=trace_seconds,
        layers_traced=layers,
    )
