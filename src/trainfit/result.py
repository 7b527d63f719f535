"""The typed result every estimation method returns: bytes by component, by phase, and the peak.

A training step's memory is not the sum of all its parts: parts live at different times. We keep one
breakdown per *phase* of a steady-state step (step 2 onwards, optimizer states resident):

* ``forward``        — the end of the forward pass, including the loss computation;
* ``backward``       — the worst moment of the backward pass;
* ``optimizer-step`` — inside ``optimizer.step()`` (weights + grads + states + the step's temporaries).

Inference has its own phases (:class:`InferencePhase`): ``prefill`` (the prompt's forward, KV cache
written) and ``decode`` (one token at a time against the full cache). They are a separate enum so that
iterating :class:`Phase` stays "the phases of a training step".

The peak is the largest phase total; its components sum to it exactly. Bytes are *allocated* bytes
(what ``torch.cuda.max_memory_allocated`` reports), on the device; what a setup keeps in host memory
(offloaded optimizer states, pinned buffers) is counted apart per phase, in ``host_components``.
Non-tensor overhead (CUDA context, allocator reserve/fragmentation) is kept apart in :class:`Overhead`
because ``max_memory_allocated`` never sees it.

With many ranks the report's ``phases`` are the *worst rank's* (the headline: the rank that must fit);
``ranks`` lists each distinct rank when they differ. Per-method details are typed (:class:`AnalyticDetails`,
...), and the report echoes its inputs (model, strategy, GPU) so a renderer needs nothing beside it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from trainfit.cuda_facts import SdpaKernel

if TYPE_CHECKING:
    from trainfit.arch.spec import ModelSpec
    from trainfit.hardware.gpus import GPUSpec
    from trainfit.history import ProcessHistory
    from trainfit.planner.speed import StepTime
    from trainfit.strategy import Strategy

#: Version of the JSON of every command (``estimate``, ``formats``, ``precision``, ``doctor``). It changes
#: only when a key changes meaning or goes away; new keys do not bump it.
SCHEMA_VERSION = 1


class Phase(StrEnum):
    """Phases of a training step."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER_STEP = "optimizer-step"


class InferencePhase(StrEnum):
    """Phases of an inference request."""

    PREFILL = "prefill"
    DECODE = "decode"


AnyPhase = Phase | InferencePhase


class Component(StrEnum):
    WEIGHTS = "weights"
    GRADIENTS = "gradients"
    MASTER_WEIGHTS = "master_weights"
    OPTIMIZER_STATES = "optimizer_states"
    ACTIVATIONS = "activations"
    AUTOCAST_COPIES = "autocast_copies"
    LOGITS_LOSS = "logits_loss"
    TEMPORARIES = "temporaries"
    # Setups beyond one GPU, full fine-tuning, training (filled by the methods that model them).
    KV_CACHE = "kv_cache"
    ADAPTER_WEIGHTS = "adapter_weights"
    UNSHARDED_PARAMS = "unsharded_params"  # ZeRO-3/FSDP: parameters all-gathered for the current layer(s)
    COMM_BUFFERS = "comm_buffers"  # DDP buckets, reduce-scatter/all-gather staging buffers
    WORKSPACES = "workspaces"  # cuBLAS/cuBLASLt workspaces: allocator blocks no tensor owns (per GPU)
    # Blocks larger than their tensors' requests: a cached block kept whole when its remainder is too small to split
    # (what max_memory_allocated counts beyond the tensors; trainfit.analytic.blocks)
    ALLOCATOR_ROUNDING = "allocator_rounding"


#: Components that make up the model states (weights and what training keeps per weight).
STATE_COMPONENTS: tuple[Component, ...] = (
    Component.WEIGHTS,
    Component.GRADIENTS,
    Component.MASTER_WEIGHTS,
    Component.OPTIMIZER_STATES,
    Component.ADAPTER_WEIGHTS,
)


class Method(StrEnum):
    ANALYTIC = "analytic"
    RULE_OF_THUMB = "rule-of-thumb"
    TRACE = "trace"
    MEASURE = "measure"


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseBreakdown:
    """Live bytes per component at the worst moment of one phase (device), and on the host then."""

    phase: AnyPhase
    components: Mapping[Component, int]
    host_components: Mapping[Component, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for where in (self.components, self.host_components):
            for comp, n in where.items():
                if n < 0:
                    raise ValueError(f"{self.phase}: component {comp} is negative ({n})")

    @property
    def total_bytes(self) -> int:
        return sum(self.components.values())

    @property
    def host_bytes(self) -> int:
        return sum(self.host_components.values())

    def get(self, component: Component) -> int:
        return self.components.get(component, 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineInFlight:
    """What one pipeline stage holds in flight at its peak: the model-chunk micro-batches whose saved activations
    are alive (``in_flight_chunks``: 1F1B min(pp − s, m), interleaved min(2·(pp − s − 1) + (v − 1)·pp + 1, m·v),
    GPipe m — :func:`trainfit.analytic.parallel.in_flight_chunks`, which cites Megatron's schedules), of
    ``model_chunks`` chunks per stage (v; 1 outside the interleaved schedule)."""

    stage: int
    in_flight_chunks: int
    model_chunks: int = 1

    def __post_init__(self) -> None:
        if self.stage < 0 or self.in_flight_chunks < 1 or self.model_chunks < 1:
            raise ValueError(f"pipeline stage {self.stage}: {self.in_flight_chunks} chunks of {self.model_chunks}")

    @property
    def in_flight_microbatches(self) -> float:
        """Micro-batches in flight in units of the stage's whole layer set (chunks / v): under 1F1B and GPipe the
        micro-batch count itself; interleaved, a fraction when the chunks do not fill whole micro-batches."""
        return self.in_flight_chunks / self.model_chunks


@dataclass(frozen=True, slots=True, kw_only=True)
class RankMemory:
    """One rank's phases, when ranks differ (pipeline stages, uneven shards). ``ranks`` are the rank
    indices that share this breakdown; ``pipeline``, for a pipeline stage, what it holds in flight."""

    ranks: tuple[int, ...]
    phases: tuple[PhaseBreakdown, ...]
    pipeline: PipelineInFlight | None = None

    @property
    def peak_bytes(self) -> int:
        return max(p.total_bytes for p in self.phases)

    def phase(self, phase: AnyPhase) -> PhaseBreakdown:
        for p in self.phases:
            if p.phase == phase:
                return p
        raise KeyError(phase)


@dataclass(frozen=True, slots=True, kw_only=True)
class Overhead:
    """Memory beyond the allocated peak (see :mod:`trainfit.overhead`): what the caching allocator reserves on
    top of it, and what sits outside the allocator (CUDA context, lazily loaded kernels, NCCL buffers)."""

    cuda_context_bytes: int  # the context after CUDA + cuBLAS initialisation, outside the allocator
    allocator_reserve_bytes: int  # max_memory_reserved − max_memory_allocated
    kernel_images_bytes: int = 0  # kernel modules loaded lazily as the workload first runs them
    nccl_bytes: int = 0  # NCCL's own buffers (many GPUs), outside the allocator
    basis: str = ""  # where the outside-allocator figures come from (one sentence)
    nccl_basis: str = ""  # where ``nccl_bytes`` comes from and what it leaves out (empty on one GPU)

    @property
    def outside_allocator_bytes(self) -> int:
        """What ``nvidia-smi`` shows beyond ``torch.cuda.memory_reserved``."""
        return self.cuda_context_bytes + self.kernel_images_bytes + self.nccl_bytes

    @property
    def total_bytes(self) -> int:
        return self.outside_allocator_bytes + self.allocator_reserve_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Term:
    """One explained term: what it is, how many bytes, the formula and its source."""

    name: str
    bytes: int
    formula: str
    source: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Difference:
    """One row of the comparison with the article's rule of thumb: its bytes, ours, and why they differ."""

    term: str
    rule_of_thumb_bytes: int
    analytic_bytes: int
    why: str


@dataclass(frozen=True, slots=True, kw_only=True)
class BytesPerParam:
    """Steady-state bytes per parameter of each model state (autocast copies: during forward/backward)."""

    weights: float = 0.0
    gradients: float = 0.0
    master_weights: float = 0.0
    optimizer_states: float = 0.0
    autocast_copies: float = 0.0

    @property
    def steady_state(self) -> float:
        return self.weights + self.gradients + self.master_weights + self.optimizer_states

    def as_dict(self) -> dict[str, float]:
        """The JSON view (keys as in ``schema_version`` 1; zero entries kept)."""
        return {
            "weights": self.weights,
            "gradients": self.gradients,
            "master_weights": self.master_weights,
            "optimizer_states": self.optimizer_states,
            "autocast_copies": self.autocast_copies,
        }


# --- per-method details -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SegmentSummary:
    """One segment of the simulated allocator at the reserved peak (``--segments``)."""

    size_bytes: int
    pool: str  # "small" (≤ 1 MiB requests) or "large"
    expandable: bool
    allocated_bytes: int
    free_bytes: int
    blocks: int
    largest_free_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "size_bytes": self.size_bytes,
            "pool": self.pool,
            "expandable": self.expandable,
            "allocated_bytes": self.allocated_bytes,
            "free_bytes": self.free_bytes,
            "blocks": self.blocks,
            "largest_free_bytes": self.largest_free_bytes,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocatorDetails:
    """What the caching-allocator simulation said (:mod:`trainfit.allocator`)."""

    config: str  # the PYTORCH_CUDA_ALLOC_CONF simulated ("" = the defaults)
    reserved_peak_bytes: int  # predicted torch.cuda.max_memory_reserved
    fragmentation_bytes: int  # reserved − allocated when reserved peaked
    segments: int  # segments (expandable: mapped ranges) at the reserved peak
    layout: tuple[SegmentSummary, ...] = ()  # the segments at the reserved peak, when asked for (by address)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "config": self.config,
            "reserved_peak_bytes": self.reserved_peak_bytes,
            "fragmentation_bytes": self.fragmentation_bytes,
            "segments": self.segments,
        }
        if self.layout:
            out["layout"] = [x.as_dict() for x in self.layout]
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class AnalyticDetails:
    activation_coefficient: float  # saved activation bytes / (b·s·h·L): the article's c, computed
    activations_per_layer_bytes: int
    allocator: AllocatorDetails | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "activation_coefficient": self.activation_coefficient,
            "activations_per_layer_bytes": self.activations_per_layer_bytes,
        }
        if self.allocator is not None:
            out["allocator"] = self.allocator.as_dict()
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class RuleOfThumbDetails:
    states_bytes: int
    activations_low_bytes: int
    activations_high_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "states_bytes": self.states_bytes,
            "activations_low_bytes": self.activations_low_bytes,
            "activations_high_bytes": self.activations_high_bytes,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class ModuleRow:
    """A saved-activation owner at the end of forward (``--modules``)."""

    module: str
    instances: int
    per_instance_bytes: int
    activation_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "instances": self.instances,
            "per_instance_bytes": self.per_instance_bytes,
            "activation_bytes": self.activation_bytes,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class RepeatedRun:
    """A run of identical layer units that depth extrapolation varied."""

    start_block: int
    unit_blocks: int
    units: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceDetails:
    layers_traced: tuple[int, ...]
    modules: tuple[ModuleRow, ...] = ()
    sdpa_backends: Mapping[SdpaKernel, int] = field(default_factory=dict)
    extrapolated: bool | None = None  # None: an nn.Module traced whole (``trace()``)
    runs: tuple[RepeatedRun, ...] = ()
    optimizer_impl: str | None = None
    trace_seconds: float | None = None
    peak_events: Mapping[Phase, int] = field(default_factory=dict)
    allocator: AllocatorDetails | None = None  # the traced events replayed through the allocator simulation

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "layers_traced": list(self.layers_traced),
            "modules": [m.as_dict() for m in self.modules],
        }
        if self.extrapolated is not None:
            out["extrapolated"] = self.extrapolated
            out["runs"] = [
                {"start_block": r.start_block, "unit_blocks": r.unit_blocks, "units": r.units} for r in self.runs
            ]
        out["sdpa_backends"] = {k.value: n for k, n in self.sdpa_backends.items()}
        if self.optimizer_impl is not None:
            out["optimizer_impl"] = self.optimizer_impl
        if self.trace_seconds is not None:
            out["trace_seconds"] = self.trace_seconds
        if self.peak_events:
            out["peak_events"] = {ph.value: ev for ph, ev in self.peak_events.items()}
        if self.allocator is not None:
            out["allocator"] = self.allocator.as_dict()
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class MeasureDetails:
    layers_traced: tuple[int, ...]
    extrapolated: bool
    device: str
    max_memory_reserved: Mapping[Phase, int]
    measure_seconds: float
    modules: tuple[ModuleRow, ...] = ()
    trace: Mapping[Phase, int] | None = None  # the trace's phase totals, for comparison
    measured_minus_trace: Mapping[Phase, int] | None = None
    #: depth-extrapolated only: the allocator's rounding (allocated minus requested peak) per phase of the
    #: deepest measured run, added unscaled (measure/gpu.py)
    allocator_rounding: Mapping[Phase, int] | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "layers_traced": list(self.layers_traced),
            "extrapolated": self.extrapolated,
            "device": self.device,
            "max_memory_reserved": {ph.value: n for ph, n in self.max_memory_reserved.items()},
            "measure_seconds": self.measure_seconds,
            "modules": [m.as_dict() for m in self.modules],
        }
        if self.trace is not None:
            out["trace"] = {ph.value: n for ph, n in self.trace.items()}
        if self.measured_minus_trace is not None:
            out["measured_minus_trace"] = {ph.value: n for ph, n in self.measured_minus_trace.items()}
        if self.allocator_rounding is not None:
            out["allocator_rounding"] = {ph.value: n for ph, n in self.allocator_rounding.items()}
        return out


Details = AnalyticDetails | RuleOfThumbDetails | TraceDetails | MeasureDetails


# --- fit ----------------------------------------------------------------------------------------------


class SuggestionKind(StrEnum):
    SMALLER_MICRO_BATCH = "smaller-micro-batch"  # the largest micro-batch that fits, accumulate the rest
    LEANER_STATES = "leaner-states"  # the states alone exceed the GPU; a leaner recipe/optimizer fits them
    NEEDS_SHARDING = "needs-sharding"  # even the leanest recipe's states exceed one GPU
    PLAN = "plan"  # a plan the planner checked with the estimate itself (trainfit.planner.rank)
    EXPANDABLE_SEGMENTS = "expandable-segments"  # the reserve is fragmentation that expandable segments avoid


@dataclass(frozen=True, slots=True, kw_only=True)
class Suggestion:
    kind: SuggestionKind
    reason: str  # one sentence: why, with the numbers
    flags: tuple[str, ...] = ()  # CLI flags that apply it (empty: nothing trainfit can express yet)
    states_bytes: int | None = None  # the model states it is about, when it is about them


class FitTier(StrEnum):
    """The verdict's three answers. ``fits-with-flushes``: the uncapped reserved peak (what ``max_memory_reserved``
    shows with room to spare) does not fit, but the allocated peak does and the same allocator stream, simulated
    under the usable capacity, completes: when ``cudaMalloc`` fails the caching allocator frees its cached blocks
    (``release_cached_blocks``, an implicit ``empty_cache``) and retries (c10/cuda/CUDACachingAllocator.cpp
    ``malloc`` → ``alloc_block`` → retry; ``num_alloc_retries``). Each flush synchronises the device: slower steps,
    and where the blocks land then varies from run to run."""

    FITS = "fits"
    FITS_WITH_FLUSHES = "fits-with-flushes"
    DOES_NOT_FIT = "does-not-fit"


@dataclass(frozen=True, slots=True, kw_only=True)
class CappedRun:
    """The report's own allocator stream simulated once more under a device capacity (the borderline case only:
    the allocated peak fits the capacity, the uncapped reserved peak does not; :mod:`trainfit.allocator.capped`).

    ``capacity_bytes`` is what the verdict compares the reserved estimate with (usable memory minus what sits
    outside the allocator); ``stream_capacity_bytes`` the capacity the stream ran under, the same less whatever the
    method adds above the stream's own reserved peak (zero unless the stream leaves tensors out)."""

    capacity_bytes: int
    stream_capacity_bytes: int
    completed: bool  # no out-of-memory error even after the flush-and-retry
    num_alloc_retries: int  # the cache flushes (release_cached_blocks + retry) over the replayed steps
    peak_reserved_bytes: int  # the capped run's reserved peak (≤ stream_capacity_bytes)

    def as_dict(self) -> dict[str, Any]:
        return {
            "capacity_bytes": self.capacity_bytes,
            "stream_capacity_bytes": self.stream_capacity_bytes,
            "completed": self.completed,
            "num_alloc_retries": self.num_alloc_retries,
            "peak_reserved_bytes": self.peak_reserved_bytes,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class FitVerdict:
    gpu_id: str
    gpu_memory_bytes: int
    headroom_fraction: float
    usable_bytes: int  # memory after the headroom
    required_bytes: int  # what we compare: the nvidia-smi estimate (allocated + overhead)
    fits: bool  # fits without cache flushes: required_bytes <= usable_bytes (tier FITS)
    free_bytes: int  # usable - required (negative when it does not fit)
    # 0 when even batch 1 does not fit (under a host limit: the host must hold it too); None when not searched
    max_micro_batch: int | None
    max_micro_batch_capped: bool = False  # the search stopped at its cap: "at least max_micro_batch"
    suggestions: tuple[Suggestion, ...] = ()  # what would make it fit (trainfit.planner.search)
    rank_required_bytes: tuple[int, ...] = ()  # per entry of MemoryReport.ranks, what must fit (same rule)
    # Checked fixes from the planner (trainfit.planner.rank): its top plans for the same GPUs, global batch and
    # sequence, each a set of flags that ``trainfit estimate`` says fits. Empty when it fits or none was found;
    # ``fixes_searched`` says whether the planner was asked (not for trace/measure, nor with ``fixes=False``).
    fixes: tuple[Suggestion, ...] = ()
    fixes_searched: bool = False
    # FITS iff ``fits``; FITS_WITH_FLUSHES when the capped simulation of the report's stream completed
    # (MemoryReport.capped), with its ``cache_flushes`` (num_alloc_retries over the replayed steps; 0 otherwise).
    tier: FitTier = FitTier.DOES_NOT_FIT
    cache_flushes: int = 0
    # The host (``trainfit estimate --host-memory-gib``; ``trainfit.estimate(host_memory_bytes=...)``): each node's CPU
    # memory, and what the run's host memory per node may reach — that × (1 − headroom), the planner's rule
    # (:func:`trainfit.planner.rank.host_usable_bytes`); both None when not limited. ``host_required_bytes``: the
    # report's host memory per node (``MemoryReport.host_peak_bytes``: offloaded states, pinned buffers, offloaded
    # activations, paged optimizer states). ``fits`` and ``tier`` stay the GPU's; :attr:`host_fits` is the host's.
    host_memory_bytes: int | None = None
    host_usable_bytes: int | None = None
    host_required_bytes: int = 0

    def __post_init__(self) -> None:
        if self.fits != (self.tier is FitTier.FITS):
            raise ValueError(f"fits={self.fits} contradicts tier {self.tier}")
        if self.cache_flushes and self.tier is not FitTier.FITS_WITH_FLUSHES:
            raise ValueError(f"cache_flushes={self.cache_flushes} without the {FitTier.FITS_WITH_FLUSHES} tier")
        if (self.host_memory_bytes is None) != (self.host_usable_bytes is None):
            raise ValueError("host_memory_bytes and host_usable_bytes are given together")
        if self.host_memory_bytes is not None and self.host_memory_bytes <= 0:
            raise ValueError(f"host_memory_bytes must be positive, got {self.host_memory_bytes}")
        if self.host_required_bytes < 0:
            raise ValueError(f"host_required_bytes must not be negative, got {self.host_required_bytes}")

    @property
    def host_fits(self) -> bool | None:
        """Whether the run's host memory per node stays within :attr:`host_usable_bytes` (None: not limited) — the
        rule by which ``trainfit plan --host-memory-gib`` rules a plan out."""
        if self.host_usable_bytes is None:
            return None
        return self.host_required_bytes <= self.host_usable_bytes

    @property
    def host_free_bytes(self) -> int | None:
        """Usable host memory per node less what the run needs there (negative: short; None: not limited)."""
        if self.host_usable_bytes is None:
            return None
        return self.host_usable_bytes - self.host_required_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryReport:
    method: Method
    model_name: str
    params: int
    trainable_params: int
    phases: tuple[PhaseBreakdown, ...]
    overhead: Overhead
    bytes_per_param: BytesPerParam = field(default_factory=BytesPerParam)
    terms: tuple[Term, ...] = ()
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    low_bytes: int | None = None  # rule-of-thumb range
    high_bytes: int | None = None
    fit: FitVerdict | None = None
    details: Details | None = None
    ranks: tuple[RankMemory, ...] = ()  # empty: every rank holds ``phases``
    comparison: tuple[Difference, ...] = ()  # with the rule of thumb, term by term (set by trainfit.estimate)
    # The inputs this report answers (set by ``trainfit.estimate``; None when a method is called directly
    # on something that has none, e.g. ``trace()`` of an arbitrary module has no ModelSpec).
    model: ModelSpec | None = None
    strategy: Strategy | None = None
    gpu: GPUSpec | None = None
    # With a GPU: the speed model's step time for exactly this configuration (trainfit.planner.speed).
    speed: StepTime | None = None
    # The process the run starts in (``trainfit.history``; set by ``trainfit.estimate``, a fresh one by default).
    history: ProcessHistory | None = None
    # With a GPU, when the reserve was simulated and only the uncapped reserve keeps it off the GPU: the same
    # stream under the usable capacity (FitVerdict.tier FITS_WITH_FLUSHES when it completed).
    capped: CappedRun | None = None
    # Whether ``overhead.allocator_reserve_bytes`` comes from a caching-allocator simulation of this report's own
    # event stream (one GPU: ``details.allocator`` says which allocator; many GPUs: the rank
    # ``analytic.rank_events.rank_simulated`` names) rather than the fixed reserve fraction: only then can an
    # allocator setting such as expandable segments change the requirement (the planner's second chance).
    reserve_simulated: bool = False
    # The simulation stopped once its reserve passed the allocator's share of the usable memory
    # (``trainfit.estimate(..., verdict_only=True)``, the planner's probes): the reserve, and so the requirement,
    # is a lower bound, already above the usable memory — the verdict (does not fit) is exact, the number is not.
    reserve_stopped: bool = False
    # The torch release on the GPU machine whose cuBLAS/cuBLASLt workspaces the report counts ("2.13"; set by
    # trainfit.estimate, "" elsewhere: trainfit.allocator.workspaces).
    torch_version: str = ""
    # The CUDA release whose context the overhead counts ("13.0"; set by trainfit.estimate: trainfit.overhead).
    cuda_version: str = ""

    def __post_init__(self) -> None:
        if not self.phases:
            raise ValueError("a MemoryReport needs at least one phase")

    @property
    def extra(self) -> Mapping[str, Any]:
        """The per-method details as the JSON ``extra`` object (read-only view of :attr:`details`)."""
        return self.details.as_dict() if self.details is not None else {}

    @property
    def peak(self) -> PhaseBreakdown:
        return max(self.phases, key=lambda p: p.total_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.peak.total_bytes

    @property
    def peak_phase(self) -> AnyPhase:
        return self.peak.phase

    @property
    def host_peak_bytes(self) -> int:
        """Largest host-memory total over the phases (offloaded states, pinned buffers)."""
        return max(p.host_bytes for p in self.phases)

    @property
    def world_size(self) -> int:
        return self.strategy.world_size if self.strategy is not None else 1

    @property
    def reserved_estimate_bytes(self) -> int:
        """Estimate of ``torch.cuda.max_memory_reserved``: peak allocated + allocator reserve."""
        return self.peak_bytes + self.overhead.allocator_reserve_bytes

    @property
    def nvidia_smi_estimate_bytes(self) -> int:
        """Estimate of what ``nvidia-smi`` shows for the process: reserved + everything outside the allocator."""
        return self.reserved_estimate_bytes + self.overhead.outside_allocator_bytes

    def phase(self, phase: AnyPhase) -> PhaseBreakdown:
        for p in self.phases:
            if p.phase == phase:
                return p
        raise KeyError(phase)

    def rank(self, rank: int) -> RankMemory:
        """The entry of :attr:`ranks` that holds ``rank`` (every rank's, :attr:`phases`, when all hold the same)."""
        for r in self.ranks:
            if rank in r.ranks:
                return r
        if self.ranks or rank < 0 or (self.strategy is not None and rank >= self.world_size):
            raise KeyError(rank)
        every = range(self.world_size) if self.strategy is not None else (rank,)  # (a report without its strategy)
        return RankMemory(ranks=tuple(every), phases=self.phases)

    def states_bytes(self) -> int | None:
        """The model states held through the optimizer step (None for a method with no such phase)."""
        try:
            step = self.phase(Phase.OPTIMIZER_STEP)
        except KeyError:
            return None
        return sum(step.get(c) for c in STATE_COMPONENTS)
