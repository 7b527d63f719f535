"""The typed result every estimation method returns: bytes by component, by phase, and the peak.

A training step's memory is not the sum of all its parts: parts live at different times. We keep one
breakdown per *phase* of a steady-state step (step 2 onwards, optimizer states resident):

* ``forward``        — the end of the forward pass, including the loss computation;
* ``backward``       — the worst moment of the backward pass;
* ``optimizer-step`` — inside ``optimizer.step()`` (weights + grads + states + the step's temporaries).

The peak is the largest phase total; its components sum to it exactly. Bytes are *allocated* bytes
(what ``torch.cuda.max_memory_allocated`` reports). Non-tensor overhead (CUDA context, allocator
reserve/fragmentation) is kept apart in :class:`Overhead` because ``max_memory_allocated`` never sees it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

SCHEMA_VERSION = 1


class Phase(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER_STEP = "optimizer-step"


class Component(StrEnum):
    WEIGHTS = "weights"
    GRADIENTS = "gradients"
    MASTER_WEIGHTS = "master_weights"
    OPTIMIZER_STATES = "optimizer_states"
    ACTIVATIONS = "activations"
    AUTOCAST_COPIES = "autocast_copies"
    LOGITS_LOSS = "logits_loss"
    TEMPORARIES = "temporaries"


class Method(StrEnum):
    ANALYTIC = "analytic"
    RULE_OF_THUMB = "rule-of-thumb"
    TRACE = "trace"
    MEASURE = "measure"


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseBreakdown:
    """Live bytes per component at the worst moment of one phase."""

    phase: Phase
    components: Mapping[Component, int]

    def __post_init__(self) -> None:
        for comp, n in self.components.items():
            if n < 0:
                raise ValueError(f"{self.phase}: component {comp} is negative ({n})")

    @property
    def total_bytes(self) -> int:
        return sum(self.components.values())


@dataclass(frozen=True, slots=True, kw_only=True)
class Overhead:
    """Memory outside PyTorch's allocated tensors (documented constants, see ``analytic.overhead``)."""

    cuda_context_bytes: int
    allocator_reserve_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.cuda_context_bytes + self.allocator_reserve_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Term:
    """One explained term: what it is, how many bytes, the formula and its source."""

    name: str
    bytes: int
    formula: str
    source: str


@dataclass(frozen=True, slots=True, kw_only=True)
class FitVerdict:
    gpu_id: str
    gpu_memory_bytes: int
    headroom_fraction: float
    usable_bytes: int  # memory after the headroom
    required_bytes: int  # what we compare: the nvidia-smi estimate (allocated + overhead)
    fits: bool
    free_bytes: int  # usable - required (negative when it does not fit)
    max_micro_batch: int  # 0 when even batch 1 does not fit


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryReport:
    method: Method
    model_name: str
    params: int
    trainable_params: int
    phases: tuple[PhaseBreakdown, ...]
    overhead: Overhead
    bytes_per_param: Mapping[str, float] = field(default_factory=dict)
    terms: tuple[Term, ...] = ()
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    low_bytes: int | None = None  # rule-of-thumb range
    high_bytes: int | None = None
    fit: FitVerdict | None = None
    extra: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.phases:
            raise ValueError("a MemoryReport needs at least one phase")

    @property
    def peak(self) -> PhaseBreakdown:
        return max(self.phases, key=lambda p: p.total_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.peak.total_bytes

    @property
    def peak_phase(self) -> Phase:
        return self.peak.phase

    @property
    def reserved_estimate_bytes(self) -> int:
        """Estimate of ``torch.cuda.max_memory_reserved``: peak allocated + allocator reserve."""
        return self.peak_bytes + self.overhead.allocator_reserve_bytes

    @property
    def nvidia_smi_estimate_bytes(self) -> int:
        """Estimate of what ``nvidia-smi`` shows for the process: reserved + CUDA context."""
        return self.reserved_estimate_bytes + self.overhead.cuda_context_bytes

    def phase(self, phase: Phase) -> PhaseBreakdown:
        for p in self.phases:
            if p.phase == phase:
                return p
        raise KeyError(phase)
