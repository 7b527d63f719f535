"""Hold the analytic model to the trace: per phase and per component, how far apart the two reports are.

The trace is the reference CI can afford (a fake-tensor run of the real modules, equal to a real CPU run
of the same steps up to CPU-only tensors); the analytic model must agree with it within a tolerance on the
peak. This module only compares two :class:`~trainfit.result.MemoryReport` objects; the matrix of models
and strategies lives in ``tests/trace/test_agreement.py`` (small configs) and ``benchmarks/agreement.py``
(catalog sizes, the table in ``docs/accuracy.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainfit.result import AnyPhase, Component, MemoryReport, Phase

#: The agreement target on the peak (issue 3: "peak within 5%").
PEAK_TOLERANCE = 0.05


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseGap:
    phase: Phase
    analytic_bytes: int
    trace_bytes: int
    components: dict[Component, tuple[int, int]]  # component -> (analytic, trace), only where they differ

    @property
    def rel(self) -> float:
        return (self.analytic_bytes - self.trace_bytes) / self.trace_bytes if self.trace_bytes else 0.0

    def largest_component_gap(self) -> tuple[Component, int] | None:
        if not self.components:
            return None
        comp, (a, t) = max(self.components.items(), key=lambda kv: abs(kv[1][0] - kv[1][1]))
        return comp, a - t


@dataclass(frozen=True, slots=True, kw_only=True)
class Agreement:
    analytic_peak_bytes: int
    trace_peak_bytes: int
    analytic_peak_phase: AnyPhase
    trace_peak_phase: AnyPhase
    phases: tuple[PhaseGap, ...]

    @property
    def peak_rel(self) -> float:
        return (self.analytic_peak_bytes - self.trace_peak_bytes) / self.trace_peak_bytes

    @property
    def ok(self) -> bool:
        return abs(self.peak_rel) <= PEAK_TOLERANCE


def compare(analytic: MemoryReport, trace: MemoryReport) -> Agreement:
    gaps = []
    for ph in Phase:
        a, t = analytic.phase(ph), trace.phase(ph)
        comps = {
            c: (a.components.get(c, 0), t.components.get(c, 0))
            for c in Component
            if a.components.get(c, 0) != t.components.get(c, 0)
        }
        gaps.append(PhaseGap(phase=ph, analytic_bytes=a.total_bytes, trace_bytes=t.total_bytes, components=comps))
    return Agreement(
        analytic_peak_bytes=analytic.peak_bytes,
        trace_peak_bytes=trace.peak_bytes,
        analytic_peak_phase=analytic.peak_phase,
        trace_peak_phase=trace.peak_phase,
        phases=tuple(gaps),
    )
