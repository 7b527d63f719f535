"""The library entry point: ``estimate(model, strategy, method=..., gpu=...) -> MemoryReport``.

It resolves the model and GPU, refuses setups the chosen method does not model (rather than silently
answering a different question), runs the method, adds the warnings every method shares (SDPA fallbacks,
sequence beyond the model's context, bf16 without native support) and — with a GPU — the fit verdict from
:mod:`trainfit.planner.search` (for a simulated reserve the method is told the allocator's share of the usable
memory, so that in the borderline case it runs its stream once more under it: the "fits with cache flushes"
tier). The report it returns echoes its inputs (model, strategy, GPU), so a renderer needs nothing else.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from importlib import import_module

from trainfit._memo import Memo, spec_key
from trainfit.allocator import AllocatorConfig, Event
from trainfit.allocator.process import ProcessStart, built_on_device, matmul_warm_up
from trainfit.allocator.workspaces import TARGET_TORCH, Workspace, parse_torch_version, training_workspaces
from trainfit.analytic import estimate_analytic, estimate_rule_of_thumb
from trainfit.analytic.activations import (
    MATH,
    Widths,
    attention_width,
    effective_strategy,
    sdpa_kernel,
    sdpa_kv_heads,
)
from trainfit.analytic.adapters import check_dora, check_finetune_model
from trainfit.analytic.blocks import phase_rounding
from trainfit.analytic.events import built_on_device_sizes, training_events
from trainfit.analytic.explain import compare_with_rule_of_thumb
from trainfit.analytic.parallel import (
    check_options,
    estimate_parallel,
    fsdp_no_sync_grad_bytes,
    nccl_basis,
    nccl_bytes,
    resolve_engine,
)
from trainfit.analytic.parallel import plan as parallel_plan
from trainfit.arch import ModelSpec, load_model
from trainfit.cuda_facts import cuda_supports, has_flash_attention, parse_compute_capability, parse_cuda_version
from trainfit.errors import DependencyError, StrategyError, TrainfitError
from trainfit.hardware import GPUSpec, get_gpu
from trainfit.history import Build, ProcessHistory, history_note
from trainfit.overhead import DEFAULT_CUDA, REFERENCE_GPU, outside_allocator
from trainfit.planner.search import (
    DEFAULT_HEADROOM,
    MAX_SEARCH_BATCH,
    allocator_capacity_bytes,
    fit_verdict,
    lower_bound_bytes,
    required_bytes,
    usable_bytes,
)
from trainfit.precision.advice import fp8_from_cc
from trainfit.result import (
    Component,
    FitVerdict,
    MemoryReport,
    Method,
    Phase,
    PhaseBreakdown,
    Suggestion,
    SuggestionKind,
)
from trainfit.strategy import (
    Attention,
    Checkpointing,
    Engine,
    OffloadTarget,
    Optimizer,
    Sharding,
    Strategy,
    Workload,
)
from trainfit.units import fmt_gib

__all__ = [
    "DEFAULT_HEADROOM",
    "DEFAULT_SEQ_LEN",
    "MAX_SEARCH_BATCH",
    "attention_warnings",
    "context_warning",
    "cuda_release",
    "default_seq_len",
    "effective_strategy",
    "estimate",
    "precision_warnings",
    "required_bytes",
    "torch_release",
]


#: The sequence length when none is given, unless the model's context is shorter.
DEFAULT_SEQ_LEN = 2048


def default_seq_len(spec: ModelSpec) -> int:
    """2048 tokens, or the model's ``max_position_embeddings`` when shorter (GPT-2, BERT: 1024, 512)."""
    context = spec.max_position_embeddings
    return min(DEFAULT_SEQ_LEN, context) if context else DEFAULT_SEQ_LEN


def context_warning(spec: ModelSpec, seq_len: int, what: str = "the estimate") -> str | None:
    """The warning for a sequence past the model's ``max_position_embeddings`` (None within it): past a learned
    position table (GPT-2's ``wpe``, BERT's, OPT's) the embedding lookup fails, so ``what`` is for a table extended
    to that length; a rotary model is assumed to run there (long-context fine-tuning does). ``what``: the subject
    of the sentence (``"every plan"`` for the planner's note)."""
    context = spec.max_position_embeddings
    if not context or seq_len <= context:
        return None
    head = f"--seq {seq_len} exceeds {spec.name}'s max_position_embeddings ({context}); "
    if spec.learned_positions:
        return head + (
            f"its learned position table ends there, so the model as configured cannot run at that length: "
            f"{what} is for a table extended to {seq_len} (or use --seq {context})"
        )
    return head + f"{what} assumes the model can run at that length"


def _method_fn(method: Method, strategy: Strategy | None = None) -> Callable[..., MemoryReport]:
    if strategy is not None and strategy.is_distributed:
        if method is Method.ANALYTIC:
            return estimate_parallel
        if method is Method.TRACE:  # lazy: needs torch + transformers
            dfn: Callable[..., MemoryReport] = import_module("trainfit.trace.distributed").trace_distributed
            return dfn
        raise StrategyError(
            f"--method {method.value} models one GPU; many GPUs are modelled by --method analytic (and trace for "
            "ddp, fsdp, hsdp, zero1, zero2 and DTensor --tp)"
        )
    if method is Method.ANALYTIC:
        return estimate_analytic
    if method is Method.RULE_OF_THUMB:
        return estimate_rule_of_thumb
    if method is Method.TRACE:
        # Lazy: needs torch + transformers.
        fn: Callable[..., MemoryReport] = import_module("trainfit.trace").trace_spec
        return fn
    try:  # lazy: needs torch + CUDA
        mfn: Callable[..., MemoryReport] = import_module("trainfit.measure").measure_spec
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("trainfit"):
            raise StrategyError("--method measure is not available in this build yet") from None
        raise DependencyError(f"--method measure needs {exc.name}: pip install torch (a CUDA build)") from None
    return mfn


def precision_warnings(strategy: Strategy, gpu: GPUSpec) -> list[str]:
    r = strategy.recipe
    if r.needs_bf16 and not gpu.bf16:
        alt = strategy.precision.value.replace("bf16", "fp16") if "pure" not in strategy.precision.value else "amp-fp16"
        return [
            f"{gpu.id} has no native bf16 (compute capability {gpu.compute_capability}); "
            f"bf16 would be emulated and slow — use --precision {alt} (fp16 with dynamic loss scaling)"
        ]
    return []


def offload_optimizer_warnings(strategy: Strategy) -> list[str]:
    """DeepSpeed's optimizer offload runs its own CPU Adam: a client optimizer (8-bit AdamW, SGD, ...) under
    ZeRO-Offload raises ``ZeRORuntimeException`` unless ``zero_force_ds_cpu_optimizer`` is false
    (deepspeed/runtime/engine.py ``_configure_optimizer``; the default is true, runtime/constants.py)."""
    if strategy.offload.optimizer is OffloadTarget.NONE or strategy.optimizer is Optimizer.ADAMW:
        return []
    if resolve_engine(strategy) is not Engine.DEEPSPEED:
        return []
    return [
        f"DeepSpeed runs its own CPU Adam when it offloads the optimizer: with --optimizer "
        f"{strategy.optimizer.value} it stops at initialisation unless the config sets "
        '"zero_force_ds_cpu_optimizer": false (the estimate assumes it does)'
    ]


def fsdp_accumulation_warnings(spec: ModelSpec, strategy: Strategy) -> list[str]:
    """FSDP2 with gradient accumulation: the estimate reduce-scatters every micro-step; the HF Trainer's default
    (accelerate's ``no_sync``) keeps unsharded gradients between micro-steps (:func:`fsdp_no_sync_grad_bytes`)."""
    if (
        strategy.grad_accum < 2
        or strategy.sharding not in (Sharding.FSDP, Sharding.HSDP)
        or not strategy.engine.sync_each_batch  # the no-sync layout is the estimate's own
    ):
        return []
    try:
        p = parallel_plan(spec, strategy)
    except StrategyError:
        return []
    if p.engine is not Engine.TORCH or p.tp > 1:
        return []
    extra = fsdp_no_sync_grad_bytes(spec, strategy, p.shard)
    return [
        f"FSDP2 with {strategy.grad_accum} accumulation steps: this estimate reduce-scatters the gradients after every "
        "micro-step (accelerate's sync_each_batch=True; trainfit plan's exports set it). The HF Trainer's default "
        f"skips that until the last micro-step and keeps every unsharded gradient meanwhile: +{fmt_gib(extra)} per GPU "
        "(--no-sync-each-batch estimates that)"
    ]


def attention_warnings(spec: ModelSpec, strategy: Strategy) -> list[str]:
    """Say when SDPA cannot use a fused kernel and falls back to the math kernel, which keeps fp32
    b·heads·s² scores per layer, and what would avoid it."""
    if strategy.attention is not Attention.SDPA or sdpa_kernel(spec, strategy) != MATH:
        return []
    grouped = sdpa_kv_heads(spec, strategy) < spec.num_heads
    fix = ""
    if grouped and not spec.sdpa_gqa:
        why = f"{spec.model_type} passes {spec.num_kv_heads} k/v head(s) to SDPA without enable_gqa"
        if strategy.checkpointing is Checkpointing.NONE:
            fix = "; --checkpointing full keeps them for one layer at a time"
    elif grouped and not strategy.flash_sdp:
        why = "this GPU has no FlashAttention and the memory-efficient kernel takes no grouped k/v heads"
    elif grouped and strategy.recipe.compute_bits == 32:
        why = "fp32 inputs rule out FlashAttention and the memory-efficient kernel takes no grouped k/v heads"
        fix = "; a 16-bit recipe such as amp-bf16 gets a fused kernel"
    elif grouped and attention_width(strategy, Widths.of(strategy)) == 4:
        why = (
            "the 4-bit base's q/k/v come out fp32 over prepare_model_for_kbit_training's fp32 residual stream and "
            "nothing casts them without autocast: no FlashAttention, and the memory-efficient kernel takes no "
            "grouped k/v heads"
        )
        fix = "; --precision amp-bf16 casts them to bf16 and gets a fused kernel"
    else:
        why = f"head dim {spec.head_dim} suits neither fused kernel"
    window = spec.sliding_window
    if window is not None and spec.sliding_layers and strategy.seq_len < window:
        fix += (
            f"; from --seq {window} on, transformers passes the sliding-window mask and repeats k/v, and SDPA runs "
            "the memory-efficient kernel: memory drops there"
        )
    return [f"SDPA falls back to the math kernel ({why}): fp32 scores of b·heads·s² per layer{fix}"]


def quantized_moe_warnings(spec: ModelSpec, strategy: Strategy) -> list[str]:
    """A bitsandbytes base (``--finetune qlora``, ``--base-dtype int8|nf4|fp4``) on an MoE model leaves the fused
    experts unquantised: transformers 5 stores them as 3-D ``nn.Parameter`` tensors (``MixtralExperts``), and
    ``replace_with_bnb_linear`` converts ``nn.Linear`` modules only; PEFT's ``prepare_model_for_kbit_training``
    then casts every parameter that is not 4-bit to fp32 (peft/utils/other.py), the experts included. Said because
    the weights then dwarf what a quantised base suggests (Mixtral QLoRA: 170 GiB of weights)."""
    from trainfit.arch.params import FUSED_EXPERTS_NOT_BNB, count_params, fused_expert_params
    from trainfit.strategy import Quantization

    base = strategy.base_weights
    if spec.moe is None or base.quantization is Quantization.NONE:
        return []
    experts = fused_expert_params(spec)
    if not experts:
        return []
    if base.kbit_prepared:
        stored = "fp32, as prepare_model_for_kbit_training casts them"
    else:
        stored = base.dtype.value if base.dtype is not None else "the precision recipe's weight dtype"
    return [
        f"{spec.name}'s fused MoE experts ({experts / count_params(spec):.0%} of the parameters) stay unquantised "
        f"under the {base.quantization.value} base, in {stored}: {FUSED_EXPERTS_NOT_BNB}"
    ]


def rule_of_thumb_warnings(strategy: Strategy) -> list[str]:
    """The article's formula has fixed terms (fp16 weights and grads, fp32 Adam: 2 + 2 + 8 B/param; c = 10–20
    without checkpointing): say which of the user's settings it does not take into account."""
    default = Strategy()
    ignored = []
    for field in ("precision", "optimizer", "checkpointing", "attention", "optimizer_impl", "grad_accum"):
        value = getattr(strategy, field)
        if value != getattr(default, field):
            ignored.append(f"--{field.replace('_', '-')} {value}")
    ignored += strategy.savers.names()  # the memory savers (--loss, --optimizer-in-backward, ...)
    if strategy.float8 != default.float8:
        ignored.append(f"--fp8 {strategy.float8.value}")
    if not ignored:
        return []
    return [
        f"the rule of thumb is the article's fixed formula (2 + 2 + 8 B/param, c = 10–20): it ignores "
        f"{', '.join(ignored)}; --method analytic takes them into account"
    ]


#: What each method models beyond one GPU (``Strategy.beyond_single_gpu_training`` items it accepts).
_DISTRIBUTED_ITEMS = ("GPUs", "sharding", "offload", "engine")


def torch_release(torch_version: str | tuple[int, int] | None) -> tuple[int, int]:
    """The torch release ``torch_version`` names (``"2.11"``, ``(2, 11)``; None:
    :data:`~trainfit.allocator.workspaces.TARGET_TORCH`); a bad one is a one-line ``--torch-version`` error."""
    if torch_version is None:
        return TARGET_TORCH
    if isinstance(torch_version, tuple):
        return torch_version
    try:
        return parse_torch_version(torch_version)
    except ValueError as exc:
        raise StrategyError(f"--torch-version: {exc}") from None


def cuda_release(cuda_version: str | tuple[int, int] | None, gpu: GPUSpec | None) -> tuple[int, int]:
    """The CUDA release the context figures are for (None: the reference measurement's); a named release must be
    able to run ``gpu`` (:func:`trainfit.cuda_facts.cuda_supports`)."""
    if cuda_version is None:
        return DEFAULT_CUDA
    try:
        release = cuda_version if isinstance(cuda_version, tuple) else parse_cuda_version(cuda_version)
    except ValueError as exc:
        raise StrategyError(f"--cuda-version: {exc}") from None
    if gpu is not None and gpu.compute_capability is None:
        raise StrategyError(f"--cuda-version: {gpu.id} is an AMD GPU (ROCm, not CUDA)")
    if gpu is not None and gpu.compute_capability is not None:
        why_not = cuda_supports(gpu.compute_capability, release)
        if why_not is not None:
            raise StrategyError(f"--cuda-version: {gpu.id}: {why_not}")
    return release


def gpu_compute_capability(gpu: GPUSpec | None) -> tuple[int, int]:
    """``gpu``'s compute capability (no GPU: the H200 the context figures come from; AMD: (0, 0))."""
    if gpu is None:
        gpu = get_gpu(REFERENCE_GPU)
    return parse_compute_capability(gpu.compute_capability) if gpu.compute_capability else (0, 0)


def gpu_workspaces(gpu: GPUSpec | None, torch_version: tuple[int, int] = TARGET_TORCH) -> tuple[Workspace, ...]:
    """The cuBLAS/cuBLASLt workspaces a training step allocates on ``gpu`` under ``torch_version``, sized by this
    process's ``CUBLAS_WORKSPACE_CONFIG`` / ``CUBLASLT_WORKSPACE_SIZE`` / ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` (an
    AMD part: hipBLAS/hipBLASLt's sizes)."""
    rocm_arch = gpu.rocm_arch if gpu is not None else None
    return training_workspaces(
        gpu_compute_capability(gpu), os.environ, rocm_arch=rocm_arch, torch_version=torch_version
    )


def resolved_strategy(spec: ModelSpec, asked: Strategy, gpu: GPUSpec | None) -> tuple[Strategy, list[str], list[str]]:
    """(the strategy the methods run, its warning, its notes): the model's attention fallbacks
    (``effective_strategy``), and no FlashAttention on a GPU that has none."""
    strategy, fallback = effective_strategy(spec, asked)
    warnings = [fallback] if fallback else []
    notes: list[str] = []
    if gpu is not None and strategy.flash_sdp and not has_flash_attention(gpu.compute_capability):
        # A note: where it matters (a fall-back to the math kernel) the attention warning says it again.
        strategy = dataclasses.replace(strategy, flash_sdp=False)
        if strategy.attention is Attention.SDPA:
            notes.append(
                f"{gpu.id} (compute capability {gpu.compute_capability}) has no FlashAttention kernel in "
                "PyTorch: SDPA runs the memory-efficient or the math kernel"
            )
    return strategy, warnings, notes


#: The traced streams of :func:`run_events` (each a few hundred thousand events: a handful kept).
_TRACED: Memo[tuple[Event, ...]] = Memo(4)


def run_events(
    spec: ModelSpec,
    strategy: Strategy,
    method: Method,
    gpu: GPUSpec | None,
    config: AllocatorConfig,
    torch_version: tuple[int, int] = TARGET_TORCH,
) -> list[Event]:
    """One GPU's training run (``strategy`` as :func:`resolved_strategy` gives it) as the allocator event stream
    ``method`` replays for reserved memory, alone in a fresh process: the analytic method's synthesised stream
    (:func:`trainfit.analytic.events.training_events`) or the trace's, stitched to full depth
    (:func:`trainfit.trace.events.reserved_from_trace`: a trace of the model, seconds to minutes), with ``gpu``'s
    workspaces under ``torch_version``."""
    if method is Method.ANALYTIC:
        return training_events(spec, strategy, gpu_workspaces(gpu, torch_version))
    if method is not Method.TRACE:
        raise StrategyError(f"--method {method.value} has no allocator event stream: --method analytic or trace")
    reserved_from_trace = import_module("trainfit.trace.events").reserved_from_trace  # lazy: torch
    rocm_arch = gpu.rocm_arch if gpu is not None else None
    cc = gpu_compute_capability(gpu)

    def traced() -> tuple[Event, ...]:
        run = reserved_from_trace(
            spec,
            strategy,
            config,
            compute_capability=cc,
            rocm_arch=rocm_arch,
            env=os.environ,
            torch_version=torch_version,
        )
        return tuple(run.stream)

    # a process's earlier runs are traced again for every later run asked about (benchmarks, tests): keep a few
    key = (spec_key(spec), strategy, config, cc, rocm_arch, gpu_workspaces(gpu, torch_version))
    return list(_TRACED.get(key, traced))


def built_events(spec: ModelSpec, strategy: Strategy, build: Build, events: list[Event]) -> list[Event]:
    """``events`` of a run whose model was built as ``build`` says (``Build.ON_DEVICE``: a tied head's own weight
    made and freed after the parameters, :func:`trainfit.allocator.process.built_on_device`)."""
    if build is Build.FROM_PRETRAINED:
        return events
    weights, transient = built_on_device_sizes(spec, strategy)
    return built_on_device(events, weights=weights, transient_bytes=transient)


def check_earlier_runs(
    history: ProcessHistory, gpu: GPUSpec | None, method: Method = Method.ANALYTIC
) -> tuple[Strategy, ...]:
    """The resolved strategy of each of ``history``'s earlier runs (:func:`resolved_strategy`), or a one-line error
    for one that ``method`` cannot replay: one GPU's runs only, each modelled by ``method`` (the planner checks a
    history with it before its search, so that a bad earlier run is not every candidate's failure)."""
    out: list[Strategy] = []
    for run in history.after:
        st, _, _ = resolved_strategy(run.model, run.strategy, gpu)
        if st.is_distributed:
            raise StrategyError("--after: an earlier run in the process is one GPU's (no --gpus, sharding or offload)")
        _require_modelled(run.strategy, method, run.model)
        if method is Method.TRACE and run.model.source == "explicit":
            raise StrategyError(
                "--after with --method trace needs a real model config; use a catalog slug or config.json"
            )
        out.append(st)
    return tuple(out)


def process_start(
    spec: ModelSpec,
    strategy: Strategy,
    history: ProcessHistory,
    method: Method,
    gpu: GPUSpec | None,
    config: AllocatorConfig,
    torch_version: tuple[int, int] = TARGET_TORCH,
) -> ProcessStart:
    """``history`` as the allocator's starting state for a run of ``spec`` under ``strategy`` (resolved): the
    warm-up matmul's events (:func:`trainfit.allocator.process.matmul_warm_up`, with ``gpu``'s workspaces), each
    earlier run's events by the same ``method`` (one GPU each), and the run's own build."""
    earlier: list[tuple[Event, ...]] = []
    for run, st in zip(history.after, check_earlier_runs(history, gpu, method), strict=True):
        events = run_events(run.model, st, method, gpu, config, torch_version)
        earlier.append(tuple(built_events(run.model, st, run.build, events)))
    weights, transient = built_on_device_sizes(spec, strategy) if history.build is Build.ON_DEVICE else (0, 0)
    return ProcessStart(
        warm_up=tuple(matmul_warm_up(gpu_workspaces(gpu, torch_version))) if history.warm_up else (),
        earlier=tuple(earlier),
        weights=weights,
        transient_bytes=transient,
    )


def _require_history_modelled(strategy: Strategy, method: Method, simulate_allocator: bool) -> None:
    """The process history moves the simulated reserve of one GPU: refuse what would ignore it."""
    if method not in (Method.ANALYTIC, Method.TRACE) or (method is Method.TRACE and not simulate_allocator):
        raise StrategyError(
            "--build, --warm-up and --after change the caching allocator's simulated reserve: use --method analytic "
            "or trace"
        )
    if strategy.is_distributed:
        raise StrategyError(
            "--build, --warm-up and --after are modelled for one GPU only (a many-GPU rank's stream does not take "
            "a process history yet)"
        )


def _with_stream_rounding(
    report: MemoryReport,
    spec: ModelSpec,
    strategy: Strategy,
    allocator: str | AllocatorConfig | None,
    workspaces: tuple[Workspace, ...],
) -> MemoryReport:
    """A trace run without its allocator simulation (``simulate_allocator=False``) has its requests only: it takes
    each phase's blocks beyond them from the analytic stream's simulation (:mod:`trainfit.analytic.blocks`), as a
    traced rank takes its reserve (``trace.distributed.with_rank_reserve``); none where the analytic model refuses
    the setup."""
    config = (
        allocator
        if isinstance(allocator, AllocatorConfig)
        else AllocatorConfig.parse(allocator)
        if allocator is not None
        else AllocatorConfig.from_env()
    )
    try:
        rounding = phase_rounding(spec, strategy, config, workspaces)
    except TrainfitError:
        return report
    return dataclasses.replace(
        report,
        phases=tuple(
            dataclasses.replace(
                p, components={**p.components, Component.ALLOCATOR_ROUNDING: rounding.get(Phase(p.phase), 0)}
            )
            for p in report.phases
        ),
    )


def with_workspaces(report: MemoryReport, workspaces_bytes: int) -> MemoryReport:
    """``report`` with the workspaces in every phase (allocated in step 1, held from then on), of every rank."""

    def add(phases: tuple[PhaseBreakdown, ...]) -> tuple[PhaseBreakdown, ...]:
        return tuple(
            dataclasses.replace(p, components={**p.components, Component.WORKSPACES: workspaces_bytes}) for p in phases
        )

    ranks = tuple(dataclasses.replace(r, phases=add(r.phases)) for r in report.ranks)
    return dataclasses.replace(report, phases=add(report.phases), ranks=ranks)


def check_float8_gpu(strategy: Strategy, gpu: GPUSpec | None) -> None:
    """``--fp8`` needs fp8 tensor cores: compute capability >= 8.9 (``precision.advice.fp8_from_cc``; torchtitan's
    float8 converter refuses below ``has_cuda_capability(8, 9)``), or the catalog's fp8 flag where no capability
    is listed (AMD)."""
    if strategy.float8.value == "none" or gpu is None:
        return
    has = fp8_from_cc(gpu.compute_capability) if gpu.compute_capability else gpu.fp8
    if not has:
        raise StrategyError(
            f"--fp8 {strategy.float8.value} needs fp8 tensor cores (compute capability >= 8.9); {gpu.id} has "
            f"{gpu.compute_capability or 'none'}: drop --fp8 or pick an fp8 GPU (L4, L40S, H100, H200, B200, RTX 4090)"
        )


def _with_expandable_segments(
    fit: FitVerdict,
    report: MemoryReport,
    spec: ModelSpec,
    strategy: Strategy,
    options: dict[str, object],
    fn: Callable[..., MemoryReport],
) -> FitVerdict:
    """When the simulated reserve is what keeps the setup off the GPU, say so: the same estimate with
    ``expandable_segments:True`` (one segment per stream grows in 2 MiB pages and frees pages back, so freed large
    blocks cannot strand memory the way fixed segments do: c10/cuda/CUDACachingAllocator.cpp ``ExpandableSegment``;
    PyTorch's "CUDA memory management" notes). Checked by the allocator simulation itself, not assumed; only for
    the simulated setups (the fixed reserve fraction does not depend on the setting) and only when the
    allocator was not already set so."""
    config = options.get("allocator")
    if not isinstance(config, AllocatorConfig) or config.expandable_segments:
        return fit
    expandable = dataclasses.replace(config, expandable_segments=True)
    alt = fn(spec, strategy, **{**options, "allocator": expandable})
    need = required_bytes(alt)
    if need > fit.usable_bytes or need >= fit.required_bytes:
        return fit
    hint = Suggestion(
        kind=SuggestionKind.EXPANDABLE_SEGMENTS,
        reason=(
            f"the caching allocator's fragmentation is the difference: with "
            f"PYTORCH_CUDA_ALLOC_CONF={expandable.to_env()} in the training job's environment it needs "
            f"{need / 2**30:.2f} GiB of {fit.usable_bytes / 2**30:.2f} GiB usable (simulated reserve "
            f"{(alt.reserved_estimate_bytes - alt.peak_bytes) / 2**30:.2f} GiB above the allocated peak instead of "
            f"{(report.reserved_estimate_bytes - report.peak_bytes) / 2**30:.2f} GiB)"
        ),
        flags=(f"--alloc-conf {expandable.to_env()}",),
    )
    return dataclasses.replace(fit, suggestions=(hint, *fit.suggestions))


def _require_modelled(strategy: Strategy, method: Method, spec: ModelSpec | None = None) -> None:
    if strategy.float8.value != "none" and method in (Method.RULE_OF_THUMB, Method.MEASURE):
        raise StrategyError(f"--fp8 is modelled by --method analytic and trace, not {method.value}")
    finetunes = method in (Method.ANALYTIC, Method.TRACE) and spec is not None
    beyond = strategy.beyond_single_gpu_finetuning() if finetunes else strategy.beyond_single_gpu_training()
    if strategy.is_distributed and method in (Method.ANALYTIC, Method.TRACE):
        # Many GPUs are modelled by the analytic method (trainfit.analytic.parallel) and, for DDP and FSDP2,
        # traced (trainfit.trace.distributed), fine-tuning included; what else the strategy asks is still
        # refused below (the many-GPU paths refuse the fine-tuning layouts they do not model themselves).
        beyond = tuple(b for b in beyond if not any(k in b for k in _DISTRIBUTED_ITEMS))
    if method in (Method.TRACE, Method.MEASURE, Method.RULE_OF_THUMB) and strategy.beyond_the_trace():
        raise StrategyError(
            f"--method {method.value} does not model {', '.join(strategy.beyond_the_trace())} yet; "
            "use --method analytic"
        )
    if finetunes and spec is not None and not beyond and not strategy.is_distributed:
        check_finetune_model(spec, strategy, analytic=method is Method.ANALYTIC)
        check_dora(strategy, analytic=method is Method.ANALYTIC)
    if not beyond:
        return
    if strategy.workload is not Workload.TRAINING:
        raise StrategyError(
            f"estimate models a training step; for {strategy.workload.value} use trainfit.infer "
            "(on the command line: trainfit infer)"
        )
    if method in (Method.ANALYTIC, Method.TRACE) and "memory savers" in beyond:
        # what the many-GPU paths leave: the memory savers, each modelled on one GPU only (analytic/savers.py)
        raise StrategyError(
            f"the memory savers ({', '.join(strategy.savers.names())}) are modelled on one GPU, not over "
            f"{strategy.world_size} GPUs; drop them or use --gpus 1"
        )
    if method in (Method.ANALYTIC, Method.TRACE):
        raise StrategyError(f"--method {method.value} does not model {', '.join(beyond)}")
    raise StrategyError(
        f"--method {method.value} models one GPU and full training only; this strategy asks for "
        f"{', '.join(beyond)}: use --method analytic (or trace)"
    )


def estimate(
    model: ModelSpec | str,
    strategy: Strategy | None = None,
    *,
    method: Method | str = Method.ANALYTIC,
    gpu: GPUSpec | str | None = None,
    headroom: float = DEFAULT_HEADROOM,
    method_options: dict[str, object] | None = None,
    allocator: str | None = None,
    allocator_layout: bool = False,
    simulate_allocator: bool = True,
    search_micro_batch: bool = True,
    fixes: bool = True,
    verdict_only: bool = False,
    history: ProcessHistory | None = None,
    torch_version: str | tuple[int, int] | None = None,
    cuda_version: str | tuple[int, int] | None = None,
    host_memory_bytes: int | None = None,
) -> MemoryReport:
    """Estimate per-GPU training memory. ``model`` is a ModelSpec or anything ``load_model`` takes; ``strategy``
    None: the defaults of :class:`Strategy` at :func:`default_seq_len` tokens, as ``trainfit estimate`` without flags.
    ``allocator``: the ``PYTORCH_CUDA_ALLOC_CONF`` whose caching allocator predicts reserved memory (None: this
    process's environment variable, else PyTorch's defaults); ``allocator_layout``: also report the simulated
    segments at the reserved peak (``AllocatorDetails.layout``); ``simulate_allocator=False``: the trace skips
    the allocator simulation (one trace fewer) and reports the fixed reserve fraction — for callers that only
    need the allocated phases. ``search_micro_batch``: with a GPU, search the largest micro-batch that fits
    (False: the verdict for this micro-batch only; what the planner asks). ``fixes``: when it does not fit on the
    GPU, search the planner's top three checked fixes (False: ``FitVerdict.fixes_searched`` stays False).
    ``verdict_only`` (with a GPU and ``search_micro_batch=False``; the planner's probes): a simulated reserve stops
    once it passes the allocator's share of the usable memory — the verdict is the same, the requirement of a
    setup that does not fit is then a lower bound (``MemoryReport.reserve_stopped``). ``history``: the process the
    run starts in (:mod:`trainfit.history`; None: a fresh one, the model from ``from_pretrained``) — how its model
    was built, a warm-up matmul, earlier runs; it moves the simulated reserve (analytic and trace, one GPU; the
    micro-batch search probes each batch after the same history, and so do the fixes: one GPU's plans).
    ``torch_version``: the torch release on the GPU machine (``"2.11"``; None:
    :data:`trainfit.allocator.workspaces.TARGET_TORCH`), which decides the cuBLAS/cuBLASLt workspaces
    (:mod:`trainfit.allocator.workspaces`). ``cuda_version``: the CUDA release (``"12.8"``; None: 13.0, the reference
    measurement's), which decides the CUDA context (eager module loading before 11.7, :mod:`trainfit.overhead`) and
    must run the GPU. The fixes are searched under the same torch and CUDA releases. ``host_memory_bytes``
    (``--host-memory-gib``; with a GPU): each node's CPU memory. The verdict holds the run's host memory per node
    (:attr:`MemoryReport.host_peak_bytes`) to it less the headroom, as the planner rules plans out
    (``FitVerdict.host_fits``; ``fits`` stays the GPU's), a run that exceeds it gets fixes as one that does not fit
    the GPU, and the fixes keep within it (None: not limited)."""
    spec = load_model(model) if isinstance(model, str) else model
    release = torch_release(torch_version)
    asked = strategy or Strategy(seq_len=default_seq_len(spec))  # as `trainfit estimate` without --seq
    try:
        method = Method(method)
    except ValueError:
        raise StrategyError(f"unknown method '{method}'; choose one of: {', '.join(m.value for m in Method)}") from None
    if not 0 <= headroom < 1:
        raise StrategyError(f"--headroom must be in [0, 1), got {headroom}")
    if host_memory_bytes is not None and host_memory_bytes <= 0:
        raise StrategyError("--host-memory-gib must be positive")
    if host_memory_bytes is not None and gpu is None:
        raise StrategyError("--host-memory-gib is held in the fit verdict: give --gpu too")
    _require_modelled(asked, method, spec)
    check_options(asked)  # a framework's option set for a run it does not apply to (one GPU included)
    gpu_spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if method in (Method.TRACE, Method.MEASURE) and spec.source == "explicit":
        raise StrategyError(f"--method {method.value} needs a real model config; use a catalog slug or config.json")
    check_float8_gpu(asked, gpu_spec)
    cuda = cuda_release(cuda_version, gpu_spec)
    strategy, warnings, gpu_notes = resolved_strategy(spec, asked, gpu_spec)
    if cuda_version is None and gpu_spec is not None and gpu_spec.compute_capability is not None:
        why_not = cuda_supports(gpu_spec.compute_capability, cuda)
        if why_not is not None:  # a V100 under the default 13.0: 12.x has the same context figures
            gpu_notes.insert(
                0,
                f"the CUDA context is counted as for CUDA {cuda[0]}.{cuda[1]}, which {gpu_spec.id} cannot run "
                f"({why_not}); CUDA 11.7 to 13.x share the figures, --cuda-version names the release",
            )
    method_fn = _method_fn(method, strategy)
    options = dict(method_options or {})
    workspaces = gpu_workspaces(gpu_spec, release)
    # The allocator simulation runs for one GPU and for the ranks rank_events.rank_simulated names (the analytic
    # stream's; estimate_parallel keeps the fixed reserve fraction for the other many-GPU setups).
    simulated = not strategy.is_distributed
    if method is Method.ANALYTIC or (method is Method.TRACE and simulate_allocator):
        # (many GPUs: a traced rank takes its analytic stream's reserve, trace.distributed.with_rank_reserve)
        options.setdefault(
            "allocator", AllocatorConfig.parse(allocator) if allocator is not None else AllocatorConfig.from_env()
        )
    if strategy.is_distributed and (method is Method.ANALYTIC or (method is Method.TRACE and simulate_allocator)):
        options.setdefault("workspaces", workspaces)
        if gpu_spec is not None:  # DeepSpeed ZeRO-1/2 tests the GPU's free memory at init (rank_events.Zero2Hooks)
            outside = outside_allocator(
                gpu_spec, allocator_reserve_bytes=0, nccl_bytes=nccl_bytes(strategy), cuda_version=cuda
            )
            options.setdefault("device_bytes", gpu_spec.memory_bytes - outside.outside_allocator_bytes)
    if simulated and method is Method.ANALYTIC:
        options.setdefault("workspaces", workspaces)
    if simulated and method is Method.TRACE:
        options.setdefault("compute_capability", gpu_compute_capability(gpu_spec))
        options.setdefault("torch_version", release)
        if gpu_spec is not None and gpu_spec.rocm_arch is not None:
            options.setdefault("rocm_arch", gpu_spec.rocm_arch)
    if history is not None and not history.fresh:
        _require_history_modelled(strategy, method, simulate_allocator)
        config = options["allocator"]
        assert isinstance(config, AllocatorConfig)  # set above for both methods
        options["start"] = process_start(spec, strategy, history, method, gpu_spec, config, release)

    def fn(spec: ModelSpec, strategy: Strategy, **kw: object) -> MemoryReport:
        """The method, with this GPU's cuBLAS workspaces (a real run's measurement has them already) and the
        overhead outside its allocator (the rule of thumb keeps its own)."""
        rep = method_fn(spec, strategy, **kw)
        if method is Method.RULE_OF_THUMB:
            return rep
        if method is Method.TRACE and not simulate_allocator and not strategy.is_distributed:
            rep = _with_stream_rounding(rep, spec, strategy, allocator, workspaces)
        if method is not Method.MEASURE:
            rep = with_workspaces(rep, sum(w.size_bytes for w in workspaces))
        return dataclasses.replace(
            rep,
            torch_version=f"{release[0]}.{release[1]}",
            cuda_version=f"{cuda[0]}.{cuda[1]}",
            overhead=outside_allocator(
                gpu_spec,
                allocator_reserve_bytes=rep.overhead.allocator_reserve_bytes,
                nccl_bytes=nccl_bytes(strategy),
                nccl_basis=nccl_basis(strategy),
                cuda_version=cuda,
            ),
        )

    def with_options(spec: ModelSpec, strategy: Strategy) -> MemoryReport:
        return fn(spec, strategy, **options)

    if allocator_layout and (method not in (Method.ANALYTIC, Method.TRACE) or strategy.is_distributed):
        raise StrategyError(
            "--segments shows the allocator simulation's segments: --method analytic or trace, on one GPU (a "
            "many-GPU rank's simulation does not report its layout yet)"
        )
    # The borderline case of the verdict (planner.search.fit_tier): a method whose reserve comes from a simulated
    # stream gets the allocator's share of the usable memory and, only when the uncapped reserve alone exceeds
    # it, simulates its stream once more under it. Not for the micro-batch probes, nor the planner's
    # search_micro_batch=False estimates: a plan must fit without cache flushes.
    main = dict(options)
    if gpu_spec is not None and search_micro_batch and "allocator" in options and method is not Method.MEASURE:
        outside = outside_allocator(
            gpu_spec, allocator_reserve_bytes=0, nccl_bytes=nccl_bytes(strategy), cuda_version=cuda
        )
        main["capacity_bytes"] = allocator_capacity_bytes(
            usable_bytes(gpu_spec, headroom), outside.outside_allocator_bytes
        )
    elif gpu_spec is not None and verdict_only and "allocator" in options and method is Method.ANALYTIC:
        outside = outside_allocator(
            gpu_spec, allocator_reserve_bytes=0, nccl_bytes=nccl_bytes(strategy), cuda_version=cuda
        )
        main["stop_above_bytes"] = allocator_capacity_bytes(
            usable_bytes(gpu_spec, headroom), outside.outside_allocator_bytes
        )
    report = fn(spec, strategy, **main, layout=True) if allocator_layout else fn(spec, strategy, **main)
    warnings += list(report.warnings)
    if (past_context := context_warning(spec, strategy.seq_len)) is not None:
        warnings.append(past_context)
    if method is Method.RULE_OF_THUMB:
        warnings += rule_of_thumb_warnings(asked)
    else:
        warnings += attention_warnings(spec, strategy)
    warnings += offload_optimizer_warnings(strategy)
    warnings += quantized_moe_warnings(spec, strategy)
    if strategy.is_distributed and method is not Method.RULE_OF_THUMB:
        warnings += fsdp_accumulation_warnings(spec, strategy)
    fit = None
    notes = list(report.notes) + gpu_notes
    if history is not None and not history.fresh:
        notes.append(history_note(history))
    if gpu_spec is not None:
        warnings += precision_warnings(strategy, gpu_spec)
        # The batch search re-runs cheap methods only; trace/measure report the verdict for this batch.
        searchable = method in (Method.ANALYTIC, Method.RULE_OF_THUMB) and search_micro_batch
        gpu_for_bound = gpu_spec  # the analytic requirement is at least its allocated peak + what is outside

        def bound(sp: ModelSpec, st: Strategy) -> int:
            return lower_bound_bytes(sp, st, gpu_for_bound, torch_version=release, cuda_version=cuda)

        host_usable = None
        if host_memory_bytes is not None:  # the planner's rule (planner.rank.host_usable_bytes)
            from trainfit.planner.rank import host_usable_bytes  # trainfit.planner.rank imports this module

            host_usable = host_usable_bytes(host_memory_bytes, headroom)
        fit = fit_verdict(
            spec,
            strategy,
            report,
            gpu_spec,
            headroom,
            with_options if searchable else None,
            bound if method is Method.ANALYTIC else None,
            host_usable,  # the largest micro-batch the host holds too
        )
        if not fit.fits and method is Method.ANALYTIC and search_micro_batch:
            fit = _with_expandable_segments(fit, report, spec, strategy, options, fn)
        if host_memory_bytes is not None:
            fit = dataclasses.replace(
                fit,
                host_memory_bytes=host_memory_bytes,
                host_usable_bytes=host_usable,
                host_required_bytes=report.host_peak_bytes,
            )
        if not searchable and search_micro_batch:
            notes.append(
                f"fit verdict for micro-batch {strategy.micro_batch} from the {method.value} peak; the largest "
                "micro-batch is not searched (one probe per batch would take minutes): --method analytic searches it"
            )
    speed = None
    if gpu_spec is not None and fit is not None and method is not Method.RULE_OF_THUMB and search_micro_batch:
        from trainfit.planner.fixes import checked_fixes, speed_of

        speed = speed_of(spec, strategy, gpu_spec)
        if (not fit.fits or fit.host_fits is False) and method is Method.ANALYTIC and fixes:
            fixes_found = checked_fixes(
                spec,
                asked,
                gpu_spec,
                headroom,
                alloc_conf=allocator,
                torch_version=release,
                cuda_version=None if cuda_version is None else cuda,  # None: the default, noted where it cannot run
                history=history,
                host_memory_bytes=host_memory_bytes,
            )
            fit = dataclasses.replace(fit, fixes=fixes_found, fixes_searched=True)
            if history is not None and not history.fresh:
                from trainfit.planner.rank import HISTORY_SCOPE

                notes.append(
                    f"the fixes were searched after the same process history, among one-GPU runs: {HISTORY_SCOPE}"
                )
    comparison = (
        ()
        if method is Method.RULE_OF_THUMB or strategy.is_distributed
        else tuple(compare_with_rule_of_thumb(spec, strategy, report))
    )
    return dataclasses.replace(
        report,
        warnings=tuple(warnings),
        notes=tuple(notes),
        fit=fit,
        model=spec,
        strategy=asked,
        gpu=gpu_spec,
        comparison=comparison,
        speed=speed,
        history=history or ProcessHistory(),
    )
