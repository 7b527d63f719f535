"""Reading a run: the worst moment of each phase and region, who holds the activations, and the parts of a
:class:`~trainfit.result.MemoryReport` that every trace-like method builds the same way.

A phase's number is the live total at its worst moment over the steady-state steps (step 2 on), split by
component at that moment; a region's likewise (regions are what depth extrapolation works with, see
:mod:`trainfit.trace.depth`). The tracker computes each interval's peak; here we keep the worst per phase
or region. Bytes per parameter, the overhead and the per-module table are derived from those breakdowns
the same way for the trace and for ``--method measure``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, TypeVar

from trainfit.overhead import overhead_for
from trainfit.result import BytesPerParam, Component, ModuleRow, Overhead, Phase, PhaseBreakdown
from trainfit.trace.timeline import Label, Peak, Region

if TYPE_CHECKING:
    import torch

    from trainfit.trace.runner import TraceRun

K = TypeVar("K")

#: Rows of the per-module table.
MODULE_ROWS = 30


def worst_by(peaks: Iterable[tuple[K, Peak[Label]]]) -> dict[K, Peak[Label]]:
    """The largest peak per key (the first one on ties, as the timeline runs)."""
    best: dict[K, Peak[Label]] = {}
    for key, pk in peaks:
        if key not in best or pk.total_bytes > best[key].total_bytes:
            best[key] = pk
    return best


def phase_peaks(run: TraceRun, first_step: int = 1) -> dict[Phase, Peak[Label]]:
    """Per phase, the worst moment over steps ``first_step..`` (every pass of a step)."""
    peaks = run.tracker.peaks(run.timeline.phase_intervals(first_step))
    return worst_by((pk.label.phase, pk) for pk in peaks)


def region_peaks(run: TraceRun, first_step: int = 1) -> dict[tuple[Phase, Region], Peak[Label]]:
    """Per (phase, region), the worst moment over steps ``first_step..``."""
    peaks = run.tracker.peaks(run.timeline.region_intervals(first_step))
    return worst_by(((pk.label.phase, pk.label.region), pk) for pk in peaks)


def module_activations(run: TraceRun, event: int) -> dict[str, int]:
    """Saved-activation bytes alive at ``event``, by the module that created them."""
    tr = run.tracker
    out: dict[str, int] = {}
    for rec in tr.live_at(event):
        if tr.component(rec) is Component.ACTIVATIONS:
            out[rec.owner] = out.get(rec.owner, 0) + rec.nbytes
    return out


def breakdown(phase: Phase, comps: Mapping[Component, int]) -> PhaseBreakdown:
    """A phase's breakdown with every component present (zero where absent)."""
    return PhaseBreakdown(phase=phase, components={c: int(comps.get(c, 0)) for c in Component})


def bytes_per_param(phases: Mapping[Phase, PhaseBreakdown], params: int) -> BytesPerParam:
    """Model states per parameter: weights, gradients, master weights and optimizer states at the optimizer
    step; autocast copies at the end of the forward pass."""
    if params <= 0:
        return BytesPerParam()
    opt = phases[Phase.OPTIMIZER_STEP]
    fwd = phases[Phase.FORWARD]

    def per(n: int) -> float:
        return round(n / params, 4)

    return BytesPerParam(
        weights=per(opt.get(Component.WEIGHTS)),
        gradients=per(opt.get(Component.GRADIENTS)),
        master_weights=per(opt.get(Component.MASTER_WEIGHTS)),
        optimizer_states=per(opt.get(Component.OPTIMIZER_STATES)),
        autocast_copies=per(fwd.get(Component.AUTOCAST_COPIES)),
    )


def overhead(peak_bytes: int) -> Overhead:
    """The memory outside the allocated tensors, as the analytic model states it for this peak."""
    return overhead_for(peak_bytes)


def module_rows(
    by_owner: Mapping[str, int], full_counts: Mapping[str, int], stack_path: str | None
) -> tuple[ModuleRow, ...]:
    """Largest saved-activation owners. Owners inside the layer stack are folded over the layer index
    (``model.layers.*.mlp``) and scaled to the full depth with ``full_counts[pattern]`` instances."""
    folded: dict[str, list[int]] = {}
    pat = re.compile(rf"^{re.escape(stack_path)}\.(\d+)(\.|$)") if stack_path else None
    for owner, nbytes in by_owner.items():
        key = owner
        if pat is not None:
            m = pat.match(owner)
            if m:
                key = f"{stack_path}.*{owner[m.end(1) :]}"
        folded.setdefault(key, []).append(nbytes)
    rows = []
    for key, vals in folded.items():
        per = sum(vals) // len(vals)
        n = full_counts.get(key, len(vals))
        rows.append(
            ModuleRow(
                module=key or "(root)",
                instances=n,
                per_instance_bytes=per,
                activation_bytes=per * n if key in full_counts else sum(vals),
            )
        )
    rows.sort(key=lambda r: -r.activation_bytes)
    return tuple(rows[:MODULE_ROWS])


def stack_instance_counts(full_stack: Iterable[torch.nn.Module], stack_path: str) -> dict[str, int]:
    """How many layers of the full model hold each submodule path (``stack.*.rest``)."""
    counts: dict[str, int] = {}
    for layer in full_stack:
        for name, _m in layer.named_modules():
            key = f"{stack_path}.*" + (f".{name}" if name else "")
            counts[key] = counts.get(key, 0) + 1
    return counts
