"""Measure on a CUDA device what the trace predicts, phase by phase and region by region.

The trace's plan, layouts and step runner run unchanged on real device tensors (no fake mode, no tracker,
no emulation: the real kernels run): :func:`trainfit.trace.depth.run_layout` with a probe. At every mark
of the timeline — phase starts and ends, the forward entry of each repeated unit, the backward moment a
unit's output gradient is ready — the probe reads ``torch.cuda.max_memory_allocated()`` (and
``max_memory_reserved()``) and resets the peak counters, so each stretch between two marks has its own
measured peak. The caching allocator does its accounting on the host when a kernel is launched, so no
synchronisation is needed for the counters to be right. Regions are then maxima over their stretches,
extrapolated in depth exactly as the trace is (:mod:`trainfit.trace.depth`).

Depth extrapolation takes differences between runs, so whatever one run leaves allocated is multiplied
by the number of units in the next: a run's model, optimizer and batches live only inside
``run_layout``; after each run the garbage collector and ``empty_cache`` run, and the memory still
allocated before each run is compared with the first run's (a warning names any difference). Before the
first run a small matmul forward and backward creates the cuBLAS handles and workspaces of both the
main and the autograd thread, which the caching allocator serves and keeps, so every run starts from the
same baseline.

The allocator counts two totals, and only one of them is linear in depth. ``requested_bytes`` (in
``torch.cuda.memory_stats()``) sums what the tensors asked for; ``allocated_bytes`` (what
``max_memory_allocated`` reads) sums the blocks handed out, and a block can be larger than its request: a
large-pool request served from a cached free block keeps the whole block when the remainder is not over
1 MiB (``should_split`` in c10/cuda/CUDACachingAllocator.cpp; :mod:`trainfit.allocator.simulator`). Which
cached blocks are free when a request comes depends on everything freed before it, not on the number of
layers: on the H200 the fp32 master gradients of the master-bf16 tiny Llama (3 MiB each for the MLP
matrices, made at the optimizer step from cached 4 MiB activation blocks) were allocated 1.0, 10.0 and
13.0 MiB over their request at 1, 2 and 6 layers. Extrapolating ``allocated`` multiplied that step of 9 MiB
by the five missing layers (+45 MiB at the optimizer step). So the regions are read and extrapolated in
requested bytes, and each phase then gets the rounding of the deepest run measured (allocated peak minus
requested peak, as ``allocator_rounding``) unscaled; a full-depth measurement is its allocated peak as it is.

The device reports totals only. Weights, master weights and optimizer states are sized from the live
tensors (512-byte blocks); the rest of each total — gradients, activations, logits, temporaries and
the cuBLAS workspace, which the caching allocator also serves — is reported as temporaries, and the allocator's
rounding (allocated minus requested bytes at each phase's peak) as ``allocator_rounding``, the component the analytic
method and the trace read from their simulated event streams (:mod:`trainfit.analytic.blocks`).

The reserve (``max_memory_reserved`` − ``max_memory_allocated``, what the fit verdict adds to the allocated
peak) is the device's own at full depth: the largest reserved reading over the measured phases less the allocated
peak. Extrapolated, the reserved bytes are not linear in depth (they depend on which segments the allocator made and
kept), so the reserve is the trace's: its events, stitched to full depth with this device's cuBLAS workspaces,
replayed through the caching-allocator simulation under this process's ``PYTORCH_CUDA_ALLOC_CONF``
(:func:`trainfit.trace.events.reserved_from_trace`, what ``--method trace`` reports) — the measurement runs that
trace anyway. Only without the trace (``with_trace=False``) does it fall back to the fixed fraction of
:mod:`trainfit.overhead`; the report's notes say which (before 2026-12-04 it was always the fixed fraction).

The device is a :class:`DeviceMemory`: :class:`CudaMemory` by default; tests pass a stand-in that counts
real CPU storages, so the bookkeeping runs in CI without a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from trainfit.allocator import AllocatorConfig
from trainfit.allocator.workspaces import parse_torch_version
from trainfit.arch.spec import ModelSpec
from trainfit.errors import DependencyError
from trainfit.result import (
    Component,
    MeasureDetails,
    MemoryReport,
    Method,
    ModuleRow,
    Overhead,
    Phase,
    PhaseBreakdown,
    TraceDetails,
)
from trainfit.strategy import Strategy
from trainfit.trace import depth, hf, readout
from trainfit.trace.api import trace_spec
from trainfit.trace.runner import compute_dtype
from trainfit.trace.timeline import Interval, Label, Mark, Peak, Region

C = Component

#: A difference in the memory allocated before two layout runs larger than this is reported.
BASELINE_DRIFT_BYTES = 2 * 2**20


class DeviceMemory(Protocol):
    """What the measurement reads from a device (``torch.cuda``'s memory functions)."""

    @property
    def device(self) -> str:
        """The torch device type the run's tensors are made on."""
        ...

    def name(self) -> str: ...
    def synchronize(self) -> None: ...
    def empty_cache(self) -> None: ...
    def memory_allocated(self) -> int: ...
    def max_memory_allocated(self) -> int: ...
    def memory_reserved(self) -> int: ...
    def max_memory_reserved(self) -> int: ...
    def memory_requested(self) -> int:
        """The bytes the live tensors requested (``allocated`` less the blocks' rounding)."""
        ...

    def max_memory_requested(self) -> int: ...
    def reset_peak_memory_stats(self) -> None: ...


class CudaMemory:
    """The current CUDA device."""

    device = "cuda"

    def name(self) -> str:
        return str(torch.cuda.get_device_name())

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self) -> int:
        return int(torch.cuda.memory_allocated())

    def max_memory_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated())

    def memory_reserved(self) -> int:
        return int(torch.cuda.memory_reserved())

    def max_memory_reserved(self) -> int:
        return int(torch.cuda.max_memory_reserved())

    def memory_requested(self) -> int:
        return int(torch.cuda.memory_stats().get("requested_bytes.all.current", 0))

    def max_memory_requested(self) -> int:
        return int(torch.cuda.memory_stats().get("requested_bytes.all.peak", 0))

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats()


class DeviceProbe:
    """``probe(mark)`` for the runner: the device's peak since the previous mark, and its level now.

    Reading ``i`` holds the largest allocation between mark ``i - 1`` and mark ``i`` (the peak counters
    are reset at every mark, which sets them to the level at that moment) and the allocation at mark
    ``i``, each as allocated, requested and reserved bytes. Reading 0 is taken when the probe is made."""

    def __init__(self, memory: DeviceMemory) -> None:
        self.memory = memory
        memory.synchronize()
        memory.reset_peak_memory_stats()
        self.level = [memory.memory_allocated()]
        self.level_requested = [memory.memory_requested()]
        self.level_reserved = [memory.memory_reserved()]
        self.peaks = list(self.level)
        self.peaks_requested = list(self.level_requested)
        self.peaks_reserved = list(self.level_reserved)
        self.marks: list[Mark | None] = [None]

    def __call__(self, mark: Mark) -> int:
        mem = self.memory
        self.peaks.append(mem.max_memory_allocated())
        self.peaks_requested.append(mem.max_memory_requested())
        self.peaks_reserved.append(mem.max_memory_reserved())
        self.level.append(mem.memory_allocated())
        self.level_requested.append(mem.memory_requested())
        self.level_reserved.append(mem.memory_reserved())
        self.marks.append(mark)
        mem.reset_peak_memory_stats()
        return len(self.peaks) - 1

    def peak(self, start: int, end: int, reserved: bool = False, *, requested: bool = False) -> int:
        """The largest allocation from mark ``start`` to mark ``end`` (inclusive): the level at ``start``
        and the peaks of the stretches after it up to ``end`` (in requested bytes with ``requested``)."""
        if not 0 <= start <= end < len(self.peaks):
            raise ValueError(f"no readings for marks {start}..{end} ({len(self.peaks)} readings)")
        level, peaks = (
            (self.level_reserved, self.peaks_reserved)
            if reserved
            else (self.level_requested, self.peaks_requested)
            if requested
            else (self.level, self.peaks)
        )
        return max([level[start], *peaks[start + 1 : end + 1]])


@dataclass
class _LayoutMeasurement:
    """One layout run's numbers (no tensors): region breakdowns in requested bytes (what extrapolation
    takes), phase breakdowns in allocated bytes, the allocator's rounding per phase (allocated peak minus
    requested peak) and the reserved peaks per phase."""

    regions: dict[tuple[Phase, Region], dict[Component, int]]
    phases: dict[Phase, dict[Component, int]]
    rounding: dict[Phase, int] = field(default_factory=dict)
    reserved: dict[Phase, int] = field(default_factory=dict)


def _worst(
    intervals: list[Interval[Label]],
    probe: DeviceProbe,
    split: Callable[[int], dict[Component, int]],
    *,
    requested: bool = False,
) -> list[Peak[Label]]:
    return [
        Peak(
            label=iv.label,
            event=iv.end,
            total_bytes=(t := probe.peak(iv.start, iv.end, requested=requested)),
            components=split(t),
        )
        for iv in intervals
    ]


def _measure_layout(
    spec: ModelSpec,
    strategy: Strategy,
    plan: depth.DepthPlan,
    layout: hf.Layout,
    memory: DeviceMemory,
    *,
    steps: int,
    adamw_impl: str,
    progress: Callable[[str, float], None] | None,
) -> _LayoutMeasurement:
    probe = DeviceProbe(memory)
    done = depth.run_layout(
        spec,
        strategy,
        plan,
        layout,
        steps=steps,
        adamw_impl=adamw_impl,
        progress=progress,
        on_device=depth.DeviceRun(device=memory.device, probe=probe),
    )
    res = done.resident
    held = {C.WEIGHTS: res.weights, C.MASTER_WEIGHTS: res.master_weights, C.OPTIMIZER_STATES: res.optimizer_states}

    def split(total: int) -> dict[Component, int]:
        return {**held, C.TEMPORARIES: max(0, total - sum(held.values()))}

    timeline = done.run.timeline
    regions = readout.worst_by(
        ((pk.label.phase, pk.label.region), pk)
        for pk in _worst(timeline.region_intervals(), probe, split, requested=True)
    )
    phase_intervals = timeline.phase_intervals()
    phases = readout.worst_by((pk.label.phase, pk) for pk in _worst(phase_intervals, probe, split))
    requested = readout.worst_by((pk.label.phase, pk) for pk in _worst(phase_intervals, probe, split, requested=True))
    reserved: dict[Phase, int] = {}
    for iv in phase_intervals:
        ph = iv.label.phase
        reserved[ph] = max(reserved.get(ph, 0), probe.peak(iv.start, iv.end, reserved=True))
    return _LayoutMeasurement(
        regions={k: pk.components for k, pk in regions.items()},
        phases={k: pk.components for k, pk in phases.items()},
        rounding={ph: max(0, phases[ph].total_bytes - requested[ph].total_bytes) for ph in phases},
        reserved=reserved,
    )


def warm_up(memory: DeviceMemory, strategy: Strategy) -> None:
    """A linear layer's forward and backward on the device, in the recipe's dtypes (under autocast for the
    amp recipes): creates the cuBLAS/cuBLASLt handles and workspaces of the main thread and of autograd's
    device thread before the first measured run (the caching allocator serves and keeps them), so that
    every run starts from the same allocation."""
    rec = strategy.recipe
    dtype = torch.float32 if rec.autocast else compute_dtype(rec)

    def param(*shape: int) -> torch.Tensor:
        return torch.ones(*shape, device=memory.device, dtype=dtype, requires_grad=True)

    x, w, b = param(64, 64), param(64, 64), param(64)
    ctx = torch.autocast(memory.device, dtype=compute_dtype(rec)) if rec.autocast else contextlib.nullcontext()
    with ctx:
        y = torch.nn.functional.linear(x, w, b) @ w
    y.float().sum().backward()  # type: ignore[no-untyped-call]
    del x, w, b, y
    memory.synchronize()


def measure_spec(
    spec: ModelSpec,
    strategy: Strategy,
    *,
    progress: Callable[[str, float], None] | None = None,
    steps: int = 2,
    adamw_impl: str | None = None,
    extrapolate: bool = True,
    with_trace: bool = True,
    modules: bool = False,
    memory: DeviceMemory | None = None,
    allocator: AllocatorConfig | None = None,
    compute_capability: tuple[int, int] | None = None,
) -> MemoryReport:
    """Run ``spec`` under ``strategy`` on the current CUDA device (or ``memory``'s) and report measured
    peaks per phase. ``allocator`` and ``compute_capability``: what the trace's simulated reserve assumes when the
    measurement is extrapolated (module docstring; None: this process's ``PYTORCH_CUDA_ALLOC_CONF`` and the CUDA
    device's capability, 9.0 for a stand-in device)."""
    if memory is None:
        if not torch.cuda.is_available():
            raise DependencyError(
                "--method measure needs a CUDA GPU and a CUDA build of PyTorch (torch.cuda.is_available() is "
                "False); use --method trace to get the same numbers without a GPU"
            )
        memory = CudaMemory()
    adamw_impl = adamw_impl or strategy.optimizer_impl.value
    t0 = time.perf_counter()
    say = progress or (lambda _m, _f: None)
    plan = depth.plan_depth(spec, strategy, extrapolate=extrapolate)
    warm_up(memory, strategy)

    def measure_plan(
        plan: depth.DepthPlan, memory: DeviceMemory
    ) -> tuple[depth.Keyed, list[_LayoutMeasurement], list[int]]:
        keyed: depth.Keyed = []
        measured: list[_LayoutMeasurement] = []
        baselines: list[int] = []
        n = len(plan.layouts)
        for i, (counts, layout) in enumerate(plan.layouts):

            def sub(msg: str, frac: float, i: int = i, layers: int = len(layout.layers)) -> None:
                say(f"measure {i + 1}/{n} ({layers} layers): {msg}", (i + frac) / n)

            gc.collect()
            memory.empty_cache()
            baselines.append(memory.memory_allocated())
            m = _measure_layout(spec, strategy, plan, layout, memory, steps=steps, adamw_impl=adamw_impl, progress=sub)
            measured.append(m)
            keyed.append(depth.keyed_regions(m.regions, layout, counts))
        gc.collect()
        memory.empty_cache()
        baselines.append(memory.memory_allocated())
        return keyed, measured, baselines

    outcome = depth.extrapolated_depth(
        spec,
        strategy,
        plan,
        lambda plan: measure_plan(plan, memory),
        lambda done: done[0],
        lambda done: {ph: readout.breakdown(ph, done[1][0].phases[ph]) for ph in Phase},
        replan=lambda base: depth.plan_depth(spec, strategy, extrapolate=extrapolate, base_units=base),
        say=say,
    )
    plan, (_, measured, baselines), warnings, phases = outcome.plan, outcome.results, outcome.warnings, outcome.phases
    say("extrapolating", 1.0)
    rounding: dict[Phase, int] = {}
    if plan.ext:
        phases, rounding = _with_rounding(phases, measured, plan)
    else:  # a full-depth measurement is its allocated peak as it is: its rounding told apart from the temporaries
        phases = _rounding_apart(phases, measured[0].rounding)

    drift = [b - baselines[0] for b in baselines]
    if any(abs(d) > BASELINE_DRIFT_BYTES for d in drift):
        warnings.append(
            "memory allocated before each measured run (MiB, relative to the first): "
            + ", ".join(f"{d / 2**20:+.1f}" for d in drift)
            + "; what one run leaves behind is counted in the next and multiplied by extrapolation"
        )
    trace_totals: dict[Phase, int] | None = None
    gap: dict[Phase, int] | None = None
    rows: tuple[ModuleRow, ...] = ()
    tr: MemoryReport | None = None
    if with_trace:
        simulated = None
        if plan.ext:  # the reserve from the trace's simulated allocator (module docstring)
            simulated = {
                "allocator": allocator if allocator is not None else AllocatorConfig.from_env(),
                "compute_capability": compute_capability or _capability(memory),
                "torch_version": parse_torch_version(torch.__version__),
            }
        tr = trace_spec(
            spec,
            strategy,
            steps=steps,
            adamw_impl=adamw_impl,
            extrapolate=extrapolate,
            modules=modules,
            **simulated or {},  # type: ignore[arg-type]
        )
        trace_totals = {ph: tr.phase(ph).total_bytes for ph in Phase}
        gap = {ph: phases[ph].total_bytes - trace_totals[ph] for ph in Phase}
        rows = tr.details.modules if isinstance(tr.details, TraceDetails) else ()
    reserved = _reserved(measured, plan.ext)
    details = MeasureDetails(
        layers_traced=tuple(len(layout.layers) for _, layout in plan.layouts),
        extrapolated=bool(plan.ext),
        device=memory.name(),
        max_memory_reserved=reserved,
        measure_seconds=round(time.perf_counter() - t0, 2),
        modules=rows,
        trace=trace_totals,
        measured_minus_trace=gap,
        allocator_rounding=rounding or None,
    )
    peak = max(p.total_bytes for p in phases.values())
    overhead, reserve_note = _reserve(peak, reserved, tr)
    return MemoryReport(
        method=Method.MEASURE,
        model_name=spec.name,
        params=plan.params,
        trainable_params=plan.params,
        phases=tuple(phases[ph] for ph in Phase),
        overhead=overhead,
        bytes_per_param=readout.bytes_per_param(phases, plan.params),
        notes=(
            "measured with torch.cuda.max_memory_allocated between the trace's marks, step 2 onwards",
            *(
                [
                    "extrapolated in depth from the allocator's requested bytes; the blocks' rounding "
                    "(allocated minus requested) is the deepest measured run's, not extrapolated: "
                    + ", ".join(f"{ph.value} {n / 2**20:.1f} MiB" for ph, n in rounding.items())
                ]
                if plan.ext
                else []
            ),
            "the device reports totals: weights, master weights and optimizer states are sized from the live "
            "tensors; gradients, activations, logits and temporaries (and the cuBLAS workspace) are under "
            "temporaries, the allocator's blocks beyond the requests (allocated minus requested) under "
            "allocator_rounding",
            reserve_note,
        ),
        warnings=tuple(warnings),
        details=details,
    )


def _with_rounding(
    phases: dict[Phase, PhaseBreakdown], measured: list[_LayoutMeasurement], plan: depth.DepthPlan
) -> tuple[dict[Phase, PhaseBreakdown], dict[Phase, int]]:
    """The extrapolated phases (requested bytes) plus the allocator's rounding of the deepest layout run,
    as ``allocator_rounding`` (module docstring): the rounding depends on which cached blocks are free, not on the
    number of units, so it is carried as measured rather than extrapolated."""
    deepest = max(range(len(measured)), key=lambda i: len(plan.layouts[i][1].layers))
    rounding = dict(measured[deepest].rounding)
    out = {}
    for ph, b in phases.items():
        comps = dict(b.components)
        comps[C.ALLOCATOR_ROUNDING] = comps.get(C.ALLOCATOR_ROUNDING, 0) + rounding.get(ph, 0)
        out[ph] = readout.breakdown(ph, comps)
    return out, rounding


def _rounding_apart(phases: dict[Phase, PhaseBreakdown], rounding: dict[Phase, int]) -> dict[Phase, PhaseBreakdown]:
    """Full-depth phases (allocated bytes, the rest of each total under temporaries) with the allocator's rounding
    (allocated peak minus requested peak) moved from the temporaries to ``allocator_rounding``; the totals stay."""
    out = {}
    for ph, b in phases.items():
        comps = dict(b.components)
        moved = min(rounding.get(ph, 0), comps.get(C.TEMPORARIES, 0))
        comps[C.TEMPORARIES] = comps.get(C.TEMPORARIES, 0) - moved
        comps[C.ALLOCATOR_ROUNDING] = comps.get(C.ALLOCATOR_ROUNDING, 0) + moved
        out[ph] = readout.breakdown(ph, comps)
    return out


def _reserve(peak: int, reserved: Mapping[Phase, int], trace: MemoryReport | None) -> tuple[Overhead, str]:
    """The report's overhead and the note on where its allocator reserve comes from (module docstring): the
    device's own reserved peak at full depth, else the trace's simulated reserve, else the fixed fraction."""
    fixed = readout.overhead(peak)
    if reserved:
        top = max(reserved.values())
        return dataclasses.replace(fixed, allocator_reserve_bytes=max(0, top - peak)), (
            f"reserved memory as measured: max_memory_reserved {top / 2**30:.2f} GiB at full depth"
        )
    if trace is not None and isinstance(trace.details, TraceDetails) and trace.details.allocator is not None:
        reserve = trace.overhead.allocator_reserve_bytes
        return dataclasses.replace(fixed, allocator_reserve_bytes=reserve), (
            f"reserved memory: extrapolated runs do not measure it; the trace's simulated allocator reserves "
            f"{reserve / 2**30:.2f} GiB above its allocated peak (--method trace's figure), added to the measured peak"
        )
    return fixed, (
        "reserved memory: the fixed fraction of the allocated peak (an extrapolated measurement without the trace "
        "measures no reserve)"
    )


def _capability(memory: DeviceMemory) -> tuple[int, int]:
    """The compute capability whose cuBLAS workspaces the trace's simulated reserve counts: the CUDA device's, or
    an H100/H200's (9.0) for a stand-in device."""
    if isinstance(memory, CudaMemory):
        major, minor = torch.cuda.get_device_capability()
        return int(major), int(minor)
    return (9, 0)


def _reserved(measured: list[_LayoutMeasurement], ext: list[int]) -> Mapping[Phase, int]:
    """``max_memory_reserved`` per phase of a full-depth run (not extrapolated: the reserve is not linear
    in depth)."""
    return {} if ext else dict(measured[0].reserved)
