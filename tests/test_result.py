"""The typed result: details and their JSON view, phases, host bytes, model states."""

from __future__ import annotations

import pytest

from trainfit.cuda_facts import SdpaKernel
from trainfit.result import (
    AnalyticDetails,
    Component,
    InferencePhase,
    MemoryReport,
    Method,
    ModuleRow,
    Overhead,
    Phase,
    PhaseBreakdown,
    TraceDetails,
)


def _report(**kw: object) -> MemoryReport:
    phases = (
        PhaseBreakdown(phase=Phase.FORWARD, components={Component.ACTIVATIONS: 10, Component.WEIGHTS: 4}),
        PhaseBreakdown(
            phase=Phase.OPTIMIZER_STEP,
            components={Component.WEIGHTS: 4, Component.GRADIENTS: 4, Component.OPTIMIZER_STATES: 8},
            host_components={Component.OPTIMIZER_STATES: 100},
        ),
    )
    return MemoryReport(
        method=Method.ANALYTIC,
        model_name="m",
        params=1,
        trainable_params=1,
        phases=phases,
        overhead=Overhead(cuda_context_bytes=1, allocator_reserve_bytes=2),
        **kw,  # type: ignore[arg-type]
    )


def test_peak_states_host_and_overheads() -> None:
    r = _report()
    assert r.peak_phase is Phase.OPTIMIZER_STEP and r.peak_bytes == 16
    assert r.states_bytes() == 16 and r.host_peak_bytes == 100
    assert r.reserved_estimate_bytes == 18 and r.nvidia_smi_estimate_bytes == 19
    assert r.extra == {}


def test_extra_is_the_json_view_of_typed_details() -> None:
    r = _report(details=AnalyticDetails(activation_coefficient=34.5, activations_per_layer_bytes=7))
    assert r.extra == {"activation_coefficient": 34.5, "activations_per_layer_bytes": 7}
    t = TraceDetails(
        layers_traced=(2,),
        modules=(ModuleRow(module="a", instances=2, per_instance_bytes=3, activation_bytes=6),),
        sdpa_backends={SdpaKernel.FLASH: 2},
        peak_events={Phase.FORWARD: 11},
    )
    assert t.as_dict() == {
        "layers_traced": [2],
        "modules": [{"module": "a", "instances": 2, "per_instance_bytes": 3, "activation_bytes": 6}],
        "sdpa_backends": {"flash": 2},
        "peak_events": {"forward": 11},
    }


def test_negative_components_are_refused_and_inference_phases_exist() -> None:
    with pytest.raises(ValueError, match="negative"):
        PhaseBreakdown(phase=InferencePhase.DECODE, components={Component.KV_CACHE: -1})
    assert list(Phase) == [Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER_STEP]
    assert [p.value for p in InferencePhase] == ["prefill", "decode"]
