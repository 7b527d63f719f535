"""The fit search and the first "what would make it fit" suggestions.

Usable memory = GPU memory × (1 − headroom) (30% by default: the seed article's closing advice), compared
with the ``nvidia-smi`` estimate (predicted reserved memory + everything outside the allocator). The largest
micro-batch that fits is found by doubling then bisecting — first on a closed-form lower bound
(:func:`lower_bound_bytes`, no allocator simulation), then with the estimate at that micro-batch and just
below it (:func:`largest_below`). Allocated memory is monotonic in the batch (a
property test holds the analytic model to it); reserved memory almost is, but the simulated allocator can
need one segment more at a smaller batch (llama-3.1-8b pure-bf16: 74.8 GiB at micro-batch 8, 73.4 at 9), so
the answer is a micro-batch that fits whose successor does not. Only cheap methods are searched: one probe of the trace
is seconds, of ``measure`` a GPU run, so for those the verdict is for the given batch only.

The verdict has three tiers (:func:`fit_tier`, :class:`~trainfit.result.FitTier`): it fits; it fits with cache
flushes — the uncapped requirement is over, the allocated peak is not, and the report's own allocator stream ran
under the allocator's share of the usable memory (:func:`allocator_capacity_bytes`) with the flush-and-retry of
``release_cached_blocks`` (``MemoryReport.capped``); or it does not fit. ``FitVerdict.fits`` stays "fits without
flushes", and so do the micro-batch search, the suggestions and the planner (a plan must fit without flushes).

Suggestions are typed (:class:`Suggestion`), and only cover micro-batch, precision recipe and optimizer
for now: when the model states alone (weights, gradients, master weights, optimizer states) exceed the
usable memory, no batch or checkpointing helps; the leanest recipe trainfit models (pure-bf16 with 8-bit
AdamW: 2 + 2 + 2 bytes/param) either fits the states or only sharding can.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from trainfit.allocator.workspaces import TARGET_TORCH
from trainfit.arch.spec import ModelSpec
from trainfit.hardware import GPUSpec
from trainfit.overhead import DEFAULT_CUDA, overhead_for
from trainfit.result import FitTier, FitVerdict, MemoryReport, Suggestion, SuggestionKind
from trainfit.strategy import Optimizer, Precision, Strategy

__all__ = [
    "DEFAULT_HEADROOM",
    "LEANEST_STATE_BYTES_PER_PARAM",
    "MAX_SEARCH_BATCH",
    "Suggestion",
    "SuggestionKind",
    "accumulation_plan",
    "allocator_capacity_bytes",
    "fit_tier",
    "fit_verdict",
    "largest_below",
    "lower_bound_bytes",
    "max_micro_batch",
    "required_bytes",
    "suggestions",
    "usable_bytes",
]

DEFAULT_HEADROOM = 0.30
MAX_SEARCH_BATCH = 1 << 16

#: Bytes per parameter of the leanest single-GPU recipe trainfit models: bf16 weights and gradients and
#: bitsandbytes 8-bit AdamW states (pure-bf16 + adamw-8bit).
LEANEST_STATE_BYTES_PER_PARAM = 2 + 2 + 2

Estimator = Callable[[ModelSpec, Strategy], MemoryReport]
Bound = Callable[[ModelSpec, Strategy], int]


def required_bytes(report: MemoryReport) -> int:
    """What must fit on the GPU: the nvidia-smi estimate (allocated peak + reserve + context)."""
    return report.nvidia_smi_estimate_bytes


def usable_bytes(gpu: GPUSpec, headroom: float) -> int:
    return int(gpu.memory_bytes * (1 - headroom))


def _largest(pred: Callable[[int], bool]) -> tuple[int, bool]:
    """(largest ``b`` with ``pred(b)``, whether the search hit its cap), given ``pred(1)``: doubling, then bisecting."""
    lo, hi = 1, 2
    while hi <= MAX_SEARCH_BATCH and pred(hi):
        lo, hi = hi, hi * 2
    if hi > MAX_SEARCH_BATCH:
        return lo, True
    return _bisect(pred, lo, hi), False


def _bisect(pred: Callable[[int], bool], lo: int, hi: int) -> int:
    """A ``b`` in [lo, hi) with ``pred(b)`` and not ``pred(b + 1)``, given ``pred(lo)`` and not ``pred(hi)``."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if pred(mid) else (lo, mid)
    return lo


def largest_below(pred: Callable[[int], bool], hi: int, lowest: int) -> int | None:
    """The largest ``x`` in [lowest, hi) with ``pred(x)`` whose successor fails, given ``not pred(hi)``; None when
    ``pred(lowest)`` fails. Probes hi − 1, hi − 3, hi − 7, … then bisects: after a closed-form bound has ruled
    out everything above ``hi``, the answer is usually just below it (the allocator's reserve is a few percent)."""
    step = 1
    while True:
        lo = max(lowest, hi - step)
        if pred(lo):
            return _bisect(pred, lo, hi)
        if lo == lowest:
            return None
        hi, step = lo, step * 2


def max_micro_batch(
    spec: ModelSpec,
    strategy: Strategy,
    usable: int,
    fn: Estimator,
    bound: Bound | None = None,
    host_usable: int | None = None,
) -> tuple[int, bool]:
    """(largest micro-batch whose estimate fits ``usable``, whether the search hit its cap). ``host_usable``
    (``--host-memory-gib`` less the headroom): the estimate's host memory per node must stay within it too — it grows
    with the micro-batch (offloaded activations) or stays, as the device's does.

    ``bound``: a cheap lower bound of the estimate's requirement (:func:`lower_bound_bytes`). The search first
    finds the largest micro-batch the bound allows without running ``fn``; when ``fn`` says that one fits, it
    is the answer (its successor cannot fit), else the micro-batch is searched below it with ``fn``
    (:func:`largest_below`). The
    answer has the same contract either way (it fits, its successor does not); the bound saves the allocator
    simulations of every probe the bound already rules out."""

    def fits(b: int) -> bool:
        r = fn(spec, dataclasses.replace(strategy, micro_batch=b))
        return required_bytes(r) <= usable and (host_usable is None or r.host_peak_bytes <= host_usable)

    if bound is None:
        return _largest(fits) if fits(1) else (0, False)

    def allowed(b: int) -> bool:
        return bound(spec, dataclasses.replace(strategy, micro_batch=b)) <= usable

    if not allowed(1):
        return 0, False
    top, capped = _largest(allowed)
    if fits(top):
        return top, capped
    return (largest_below(fits, top, 1) or 0), False


def lower_bound_bytes(
    spec: ModelSpec,
    strategy: Strategy,
    gpu: GPUSpec,
    *,
    above: int | None = None,
    torch_version: tuple[int, int] = TARGET_TORCH,
    cuda_version: tuple[int, int] = DEFAULT_CUDA,
) -> int:
    """A cheap bound below the analytic estimate's requirement: the closed-form allocated peak (the moments
    :func:`trainfit.analytic.estimate_analytic` reports; many GPUs: :func:`trainfit.analytic.parallel.
    estimate_parallel`'s, without its allocator simulation) + the GPU's cuBLAS workspaces + the memory
    outside the allocator (with NCCL's buffers), without the allocator's reserve (which is ≥ 0: the simulated
    reserved bytes are taken above this peak, never below; the fixed fraction is ≥ 0). ``above``: a caller that
    only asks whether the bound passes it (the planner, against the usable bytes) may get a looser bound that
    already does — many GPUs: what a rank holds at every moment (:func:`trainfit.analytic.parallel.
    resident_floor_bytes`) in place of the closed form. ``torch_version`` and ``cuda_version``: the releases whose
    workspaces (:func:`trainfit.allocator.workspaces.training_workspaces`) and CUDA context
    (:func:`trainfit.overhead.outside_allocator`) the estimate counts — the bound must use the same ones, or a
    release with smaller workspaces or context than the default would put the bound above the estimate."""
    if strategy.is_distributed:
        return _parallel_lower_bound(spec, strategy, gpu, above, torch_version, cuda_version)
    from trainfit.analytic.model import step_inputs, training_moments
    from trainfit.errors import StrategyError
    from trainfit.estimate import gpu_workspaces  # trainfit.estimate imports this module
    from trainfit.overhead import outside_allocator

    try:
        moments = training_moments(step_inputs(spec, _on_gpu(spec, strategy, gpu), keep_logits=False))
    except StrategyError:
        return 0
    peak = max(m.breakdown().total_bytes for m in moments.values())
    work = sum(w.size_bytes for w in gpu_workspaces(gpu, torch_version))
    outside = outside_allocator(gpu, allocator_reserve_bytes=0, cuda_version=cuda_version)
    return peak + work + outside.outside_allocator_bytes


def _on_gpu(spec: ModelSpec, strategy: Strategy, gpu: GPUSpec) -> Strategy:
    """The strategy the analytic model runs (``effective_strategy``), without FlashAttention where ``gpu`` has
    none — as :func:`trainfit.estimate.estimate` adjusts it before any method."""
    from trainfit.analytic.activations import effective_strategy
    from trainfit.cuda_facts import has_flash_attention

    eff, _ = effective_strategy(spec, strategy)
    if eff.flash_sdp and not has_flash_attention(gpu.compute_capability):
        eff = dataclasses.replace(eff, flash_sdp=False)
    return eff


def _parallel_lower_bound(
    spec: ModelSpec,
    strategy: Strategy,
    gpu: GPUSpec,
    above: int | None,
    torch_version: tuple[int, int],
    cuda_version: tuple[int, int],
) -> int:
    from trainfit.analytic.parallel import estimate_parallel, nccl_bytes, resident_floor_bytes
    from trainfit.cuda_facts import has_flash_attention
    from trainfit.errors import StrategyError
    from trainfit.estimate import gpu_workspaces  # trainfit.estimate imports this module
    from trainfit.overhead import outside_allocator

    if strategy.flash_sdp and not has_flash_attention(gpu.compute_capability):
        strategy = dataclasses.replace(strategy, flash_sdp=False)
    work = sum(w.size_bytes for w in gpu_workspaces(gpu, torch_version))
    outside = outside_allocator(
        gpu, allocator_reserve_bytes=0, nccl_bytes=nccl_bytes(strategy), cuda_version=cuda_version
    )
    fixed = work + outside.outside_allocator_bytes
    try:
        if above is not None and (floor := resident_floor_bytes(spec, strategy) + fixed) > above:
            return floor
        peak = estimate_parallel(spec, strategy).peak_bytes  # no allocator: the fixed fraction, not simulated
    except StrategyError:
        return 0
    return peak + fixed


def accumulation_plan(
    spec: ModelSpec, strategy: Strategy, usable: int, fn: Estimator, bound: Bound | None = None
) -> Suggestion | None:
    """A smaller micro-batch with gradient accumulation that keeps (at least) the effective batch and fits.

    Accumulating keeps every gradient resident through forward and backward, so the micro-batch is searched
    with accumulation on (the memory is the same for any number of steps ≥ 2); the micro-batch is then
    evened out over the steps: ``steps = ⌈effective / largest⌉``, ``micro = ⌈effective / steps⌉``."""
    effective = strategy.effective_batch
    if effective < 2 or strategy.parallelism.pipeline > 1:  # a pipeline's micro-batches are --microbatches
        return None
    if strategy.savers.optimizer_in_backward:  # it steps as gradients arrive: nothing to accumulate (torchtune refuses)
        return None
    largest, _ = max_micro_batch(
        spec, dataclasses.replace(strategy, grad_accum=max(2, strategy.grad_accum)), usable, fn, bound
    )
    if largest == 0:
        return None
    steps = -(-effective // largest)
    if steps < 2:  # only when the method that judged the setup is not the one searched (trace, measure)
        return None
    micro = -(-effective // steps)
    kept = micro * steps
    batch = (
        f"keeps the effective batch {effective}" if kept == effective else f"effective batch {kept} (was {effective})"
    )
    return Suggestion(
        kind=SuggestionKind.SMALLER_MICRO_BATCH,
        reason=f"micro-batch {micro} with {steps} accumulation steps fits and {batch}",
        flags=(f"--batch {micro}", f"--grad-accum {steps}"),
    )


def suggestions(
    spec: ModelSpec,
    report: MemoryReport,
    strategy: Strategy,
    usable: int,
    fn: Estimator | None,
    bound: Bound | None = None,
) -> tuple[Suggestion, ...]:
    """What would make ``report``'s setup fit ``usable`` bytes (empty when it fits). ``fn``: the estimator to
    search micro-batches with (None: no search)."""
    if required_bytes(report) <= usable:
        return ()
    plan = accumulation_plan(spec, strategy, usable, fn, bound) if fn is not None else None
    if plan is not None:
        return (plan,)
    states = report.states_bytes()
    if states is None or states <= usable:
        return ()
    leanest = report.params * LEANEST_STATE_BYTES_PER_PARAM
    flags = tuple(
        flag
        for flag, in_use in (
            ("--precision pure-bf16", strategy.precision is Precision.PURE_BF16),
            ("--optimizer adamw-8bit", strategy.optimizer is Optimizer.ADAMW_8BIT),
        )
        if not in_use
    )
    if leanest > usable or not flags:
        return (
            Suggestion(
                kind=SuggestionKind.NEEDS_SHARDING,
                reason="even pure-bf16 with 8-bit AdamW needs more than the usable memory for the model states",
                states_bytes=leanest,
            ),
        )
    return (
        Suggestion(
            kind=SuggestionKind.LEANER_STATES,
            reason="a leaner precision recipe or optimizer shrinks the model states",
            flags=flags,
            states_bytes=states,
        ),
    )


def allocator_capacity_bytes(usable: int, outside_allocator_bytes: int) -> int:
    """What the caching allocator may reserve: the usable memory less what sits outside it (context, kernels,
    NCCL) — the bound :func:`fit_verdict` holds the reserved estimate to (``required_bytes`` is reserved +
    outside)."""
    return usable - outside_allocator_bytes


def fit_tier(report: MemoryReport, usable: int) -> tuple[FitTier, int]:
    """(the verdict's tier, its cache flushes). FITS: the uncapped requirement fits ``usable``. FITS_WITH_FLUSHES:
    it does not, but the allocated peak does and ``report.capped`` (the same stream simulated under
    :func:`allocator_capacity_bytes`, :func:`trainfit.allocator.report.capped_run`) completed. Otherwise —
    including every fixed-fraction reserve, which has no stream to cap — DOES_NOT_FIT."""
    if required_bytes(report) <= usable:
        return FitTier.FITS, 0
    capacity = allocator_capacity_bytes(usable, report.overhead.outside_allocator_bytes)
    capped = report.capped
    if (
        capped is not None
        and capped.completed
        and capped.capacity_bytes == capacity  # capped for this GPU and headroom, not another
        and report.peak_bytes <= capacity
    ):
        return FitTier.FITS_WITH_FLUSHES, capped.num_alloc_retries
    return FitTier.DOES_NOT_FIT, 0


def fit_verdict(
    spec: ModelSpec,
    strategy: Strategy,
    report: MemoryReport,
    gpu: GPUSpec,
    headroom: float,
    search_fn: Estimator | None,
    bound: Bound | None = None,
    host_usable: int | None = None,
) -> FitVerdict:
    """Does ``report`` fit ``gpu`` with ``headroom`` kept free; the largest micro-batch by ``search_fn``
    (None: not searched, the method is too slow to probe), skipping the probes ``bound`` (a lower bound of
    ``search_fn``'s requirement) already rules out, and — with ``host_usable`` — one the host holds too
    (:func:`max_micro_batch`). The host's own verdict is the caller's (``FitVerdict.host_*``)."""
    usable = usable_bytes(gpu, headroom)
    need = required_bytes(report)
    if search_fn is None:
        best, capped = None, False
    else:
        best, capped = max_micro_batch(spec, strategy, usable, search_fn, bound, host_usable)
    rank_required = tuple(r.peak_bytes + overhead_for(r.peak_bytes).total_bytes for r in report.ranks)
    tier, flushes = fit_tier(report, usable)
    return FitVerdict(
        tier=tier,
        cache_flushes=flushes,
        rank_required_bytes=rank_required,
        gpu_id=gpu.id,
        gpu_memory_bytes=gpu.memory_bytes,
        headroom_fraction=headroom,
        usable_bytes=usable,
        required_bytes=need,
        fits=need <= usable,
        free_bytes=usable - need,
        max_micro_batch=best,
        max_micro_batch_capped=capped,
        suggestions=suggestions(spec, report, strategy, usable, search_fn, bound),
    )
