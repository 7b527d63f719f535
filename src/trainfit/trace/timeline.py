"""The step's timeline: marks at phase and layer-stack boundaries, cut into typed, labelled intervals.

The runner (:mod:`trainfit.trace.runner`) numbers moments with the tracker's event counter — or, on a real
device, with the probe's reading index — and writes them into :class:`StepMarks`: one per optimizer step,
holding one :class:`PassMarks` per forward/backward pass (a micro-step under gradient accumulation) and the
start and end of the optimizer step. For depth extrapolation a pass also records the forward entry of every
repeated *unit* of the layer stack and the backward moment each unit's output gradient is ready.

:class:`Timeline` turns those marks into :class:`Interval` s labelled by a :class:`Label` — step, micro-step,
phase and :class:`Region` (the whole phase, before the stack, one unit, after the stack). Labels are values
to compare and group by, never strings to parse. This module is torch-free: the tracker computes the peaks
of the intervals (:meth:`trainfit.trace.tracker.Tracker.peaks`), a device probe reads them
(:mod:`trainfit.measure`), and :mod:`trainfit.trace.readout` takes the worst per phase or region.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

from trainfit.result import Component, Phase

L = TypeVar("L")


@dataclass(slots=True)
class Interval(Generic[L]):
    """A slice of the event timeline: events ``start..end`` inclusive (the state after each event)."""

    label: L
    start: int
    end: int


@dataclass(slots=True)
class Peak(Generic[L]):
    """The worst moment of an interval: its event, the live total then and its split by component."""

    label: L
    event: int
    total_bytes: int
    components: dict[Component, int] = field(default_factory=dict)


class Mark(StrEnum):
    """The moments the runner marks (what a device probe is told it is reading)."""

    FORWARD_START = "forward-start"
    FORWARD_END = "forward-end"
    BACKWARD_START = "backward-start"
    BACKWARD_END = "backward-end"
    OPTIMIZER_START = "optimizer-start"
    OPTIMIZER_END = "optimizer-end"
    UNIT_FORWARD = "unit-forward"  # forward entry of a unit's first layer
    STACK_FORWARD_END = "stack-forward-end"  # forward exit of the stack's last layer
    UNIT_BACKWARD = "unit-backward"  # gradient of a unit's output ready
    STACK_BACKWARD_END = "stack-backward-end"  # gradient of the stack's input ready


class Span(StrEnum):
    """Where a region sits in its phase relative to the layer stack."""

    WHOLE = "whole"  # the phase is not cut (no stack marks, or the optimizer step)
    PRE_STACK = "pre-stack"  # embeddings: before the stack in forward, after it in backward
    UNIT = "unit"  # one repeated unit of the stack
    POST_STACK = "post-stack"  # final norm, head and loss: after the stack in forward, before it in backward


@dataclass(frozen=True, slots=True)
class Region:
    """A region of a phase: a :class:`Span`, and for ``UNIT`` the unit's index in the traced stack (forward
    order)."""

    span: Span
    unit: int | None = None

    def __post_init__(self) -> None:
        if (self.span is Span.UNIT) != (self.unit is not None):
            raise ValueError(f"a {self.span.value} region {'needs' if self.span is Span.UNIT else 'has no'} unit")

    @staticmethod
    def of_unit(index: int) -> Region:
        return Region(Span.UNIT, index)


WHOLE = Region(Span.WHOLE)
PRE_STACK = Region(Span.PRE_STACK)
POST_STACK = Region(Span.POST_STACK)


@dataclass(frozen=True, slots=True, kw_only=True)
class Label:
    """What an interval is: which step and micro-step, which phase, which region of it."""

    step: int
    micro_step: int = 0
    phase: Phase
    region: Region = WHOLE


@dataclass(slots=True)
class PassMarks:
    """Moments of one forward and backward pass (one micro-step)."""

    fwd_start: int = 0
    fwd_end: int = 0
    bwd_start: int = 0
    bwd_end: int = 0
    unit_fwd: list[int] = field(default_factory=list)  # forward entry of unit u
    stack_fwd_end: int = -1  # forward exit of the last stack layer
    unit_bwd: list[int] = field(default_factory=list)  # grad of a unit's output ready, in backward order
    stack_bwd_end: int = -1  # grad of the stack input ready


@dataclass(slots=True)
class StepMarks:
    """Moments of one optimizer step: its passes, then the optimizer step itself."""

    step: int
    passes: list[PassMarks] = field(default_factory=list)
    opt_start: int = 0
    opt_end: int = 0


@dataclass(slots=True)
class Timeline:
    """Every step's marks, and the intervals they cut (steps ``first_step..``: the steady state)."""

    steps: list[StepMarks] = field(default_factory=list)

    def phase_intervals(self, first_step: int = 1) -> list[Interval[Label]]:
        """Each phase of each step (every pass's forward and backward), in time order."""
        out: list[Interval[Label]] = []
        for sm in self.steps[first_step:]:
            for micro, pm in enumerate(sm.passes):
                fwd = Label(step=sm.step, micro_step=micro, phase=Phase.FORWARD)
                bwd = Label(step=sm.step, micro_step=micro, phase=Phase.BACKWARD)
                out.append(Interval(fwd, pm.fwd_start, pm.fwd_end))
                out.append(Interval(bwd, pm.bwd_start, pm.bwd_end))
            out.append(Interval(Label(step=sm.step, phase=Phase.OPTIMIZER_STEP), sm.opt_start, sm.opt_end))
        return out

    def region_intervals(self, first_step: int = 1) -> list[Interval[Label]]:
        """Pre-stack, per-unit and post-stack slices of each pass's forward and backward (the whole phase
        where there are no stack marks), and the whole optimizer step."""
        out: list[Interval[Label]] = []
        for sm in self.steps[first_step:]:
            for micro, pm in enumerate(sm.passes):
                out += _forward_regions(sm.step, micro, pm)
                out += _backward_regions(sm.step, micro, pm)
            out.append(Interval(Label(step=sm.step, phase=Phase.OPTIMIZER_STEP), sm.opt_start, sm.opt_end))
        return out


def _forward_regions(step: int, micro: int, pm: PassMarks) -> list[Interval[Label]]:
    def iv(region: Region, start: int, end: int) -> Interval[Label]:
        return Interval(Label(step=step, micro_step=micro, phase=Phase.FORWARD, region=region), start, end)

    k = len(pm.unit_fwd)
    if not k:
        return [iv(WHOLE, pm.fwd_start, pm.fwd_end)]
    out = [iv(PRE_STACK, pm.fwd_start, pm.unit_fwd[0])]
    for u in range(k):
        end = pm.unit_fwd[u + 1] if u + 1 < k else pm.stack_fwd_end
        out.append(iv(Region.of_unit(u), pm.unit_fwd[u], end))
    out.append(iv(POST_STACK, pm.stack_fwd_end, pm.fwd_end))
    return out


def _backward_regions(step: int, micro: int, pm: PassMarks) -> list[Interval[Label]]:
    def iv(region: Region, start: int, end: int) -> Interval[Label]:
        return Interval(Label(step=step, micro_step=micro, phase=Phase.BACKWARD, region=region), start, end)

    kb = len(pm.unit_bwd)
    if not kb or pm.stack_bwd_end < 0:
        return [iv(WHOLE, pm.bwd_start, pm.bwd_end)]
    # unit_bwd is in backward order: the last unit first.
    out = [iv(POST_STACK, pm.bwd_start, pm.unit_bwd[0])]
    for j in range(kb):
        end = pm.unit_bwd[j + 1] if j + 1 < kb else pm.stack_bwd_end
        out.append(iv(Region.of_unit(kb - 1 - j), pm.unit_bwd[j], end))
    out.append(iv(PRE_STACK, pm.stack_bwd_end, pm.bwd_end))
    return out
