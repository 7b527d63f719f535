"""Measure on a CUDA device what the trace predicts, phase by phase and region by region.

The step loop is :func:`trainfit.trace.engine.run_steps` on real CUDA tensors (no fake mode, no tracker, no
emulation: the real kernels run). At every mark of the trace — phase starts and ends, the forward entry of
each repeated unit, the backward moment a unit's output gradient is ready — a probe reads
``torch.cuda.max_memory_allocated()`` (and ``max_memory_reserved()``) and resets the peak counters, so each
stretch between two marks has its own measured peak. The caching allocator does its accounting on the host
when a kernel is launched, so no synchronisation is needed for the counters to be right. Regions are then
maxima over their stretches, extrapolated in depth exactly as the trace is (:mod:`trainfit.trace.depth`).

The device reports totals only. Weights, master weights and optimizer states are sized from the live
tensors (512-byte blocks); the rest of each total — gradients, activations, logits, temporaries and the
cuBLAS workspace, which the caching allocator also serves — is reported as temporaries.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from trainfit.arch.spec import ModelSpec
from trainfit.errors import DependencyError
from trainfit.result import Component, MeasureDetails, MemoryReport, Method, ModuleRow, Phase, TraceDetails
from trainfit.strategy import Strategy
from trainfit.trace import engine as eng
from trainfit.trace import hf
from trainfit.trace import tracker as tk
from trainfit.trace.api import _breakdown, _bytes_per_param, _overhead
from trainfit.trace.depth import extrapolate_phases, keyed_regions, plan_depth
from trainfit.trace.optim import make_optimizer, state_tensors

C = Component


class CudaProbe:
    """``probe(label)`` for :func:`run_steps`: the allocator's peak since the previous probe."""

    def __init__(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.allocated = [torch.cuda.memory_allocated()]
        self.reserved = [torch.cuda.memory_reserved()]
        self.labels = ["start"]

    def __call__(self, label: str) -> int:
        self.allocated.append(torch.cuda.max_memory_allocated())
        self.reserved.append(torch.cuda.max_memory_reserved())
        self.labels.append(label)
        torch.cuda.reset_peak_memory_stats()
        return len(self.allocated) - 1

    def peak(self, start: int, end: int, reserved: bool = False) -> int:
        series = self.reserved if reserved else self.allocated
        window = series[start + 1 : end + 1] or [series[start]]
        return max(window)


def _tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = tk.rounded(st.nbytes())
    return sum(seen.values())


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
) -> MemoryReport:
    """Run ``spec`` under ``strategy`` on the current CUDA device and report measured peaks per phase."""
    if not torch.cuda.is_available():
        raise DependencyError(
            "--method measure needs a CUDA GPU and a CUDA build of PyTorch (torch.cuda.is_available() is "
            "False); use --method trace to get the same numbers without a GPU"
        )
    adamw_impl = adamw_impl or strategy.optimizer_impl.value
    t0 = time.perf_counter()
    say = progress or (lambda _m, _f: None)
    plan = plan_depth(spec, strategy, extrapolate=extrapolate)
    keyed: list[dict[Any, dict[Component, int]]] = []
    reserved_by_phase: dict[str, int] = {}
    full_phases: dict[Phase, dict[Component, int]] = {}
    for i, (counts, layout) in enumerate(plan.layouts):
        say(f"measure {i + 1}/{len(plan.layouts)} ({len(layout.layers)} layers)", i / len(plan.layouts))
        model = hf.reduced_model(plan.meta, plan.stack_path, layout.layers, plan.full_layers)
        torch.cuda.empty_cache()
        probe = CudaProbe()
        eng.materialize(model, None, None, device="cuda")
        stack_mod: Any = model.get_submodule(plan.stack_path)
        layers: list[torch.nn.Module] = list(stack_mod)
        hf.install_checkpointing(model, layers, layout.blocks, [])
        first, last = _positions(layout)
        optimizer_box: list[Any] = []

        def make_opt(params: list[torch.nn.Parameter], box: list[Any] = optimizer_box) -> Any:
            opt = make_optimizer(strategy.optimizer, params, adamw_impl=adamw_impl)
            box.append(opt)
            return opt

        run = eng.run_steps(
            model,
            None,
            make_batch=hf.batch_fn(spec, strategy.micro_batch, strategy.seq_len, device="cuda"),
            forward=lambda m, b: m(**b),
            loss_of=lambda out, _b: out.loss,
            make_optimizer=make_opt,
            recipe=strategy.recipe,
            steps=steps,
            head_module=hf.head_of(model),
            stack=eng.StackHooks(layers=layers, unit_first=first, unit_last=last) if plan.ext else None,
            emulate_cuda=False,
            track=False,
            device="cuda",
            probe=probe,
        )
        opt = optimizer_box[0]
        weights = _tensor_bytes(list(model.parameters()))
        states = _tensor_bytes([t for _, t in state_tensors(opt) if t.is_cuda])  # CPU step counters excluded
        opt_params = [p for g in opt.param_groups for p in g["params"]]
        master = _tensor_bytes(opt_params) if strategy.recipe.master_bits else 0

        def split(total: int, w: int = weights, s: int = states, m: int = master) -> dict[Component, int]:
            return {C.WEIGHTS: w, C.MASTER_WEIGHTS: m, C.OPTIMIZER_STATES: s, C.TEMPORARIES: max(0, total - w - s - m)}

        regions: dict[tuple[Phase, str], dict[Component, int]] = {}
        for iv in eng.region_intervals(run):
            _, ph, region = iv.label.split(":", 2)
            key = (Phase(ph), region)
            total = probe.peak(iv.start, iv.end)
            if key not in regions or total > sum(regions[key].values()):
                regions[key] = split(total)
        keyed.append(keyed_regions(regions, layout, counts))
        if not plan.ext:
            for iv in eng.phase_intervals(run):
                ph = Phase(iv.label.split(":", 1)[1])
                total = probe.peak(iv.start, iv.end)
                if ph not in full_phases or total > sum(full_phases[ph].values()):
                    full_phases[ph] = split(total)
                reserved_by_phase[ph.value] = max(
                    reserved_by_phase.get(ph.value, 0), probe.peak(iv.start, iv.end, reserved=True)
                )
        del model, run, optimizer_box
        torch.cuda.empty_cache()
    warnings: list[str] = []
    if plan.ext:
        phases = extrapolate_phases(keyed, plan.ext, plan.runs, warnings)
    else:
        phases = {ph: _breakdown(ph, full_phases[ph]) for ph in Phase}
    trace_totals: dict[Phase, int] | None = None
    gap: dict[Phase, int] | None = None
    rows: tuple[ModuleRow, ...] = ()
    if with_trace:
        from trainfit.trace import trace_spec

        tr = trace_spec(spec, strategy, steps=steps, adamw_impl=adamw_impl, extrapolate=extrapolate, modules=modules)
        trace_totals = {ph: tr.phase(ph).total_bytes for ph in Phase}
        gap = {ph: phases[ph].total_bytes - trace_totals[ph] for ph in Phase}
        rows = tr.details.modules if isinstance(tr.details, TraceDetails) else ()
    details = MeasureDetails(
        layers_traced=tuple(len(layout.layers) for _, layout in plan.layouts),
        extrapolated=bool(plan.ext),
        device=torch.cuda.get_device_name(),
        max_memory_reserved={Phase(k): v for k, v in reserved_by_phase.items()},
        measure_seconds=round(time.perf_counter() - t0, 2),
        modules=rows,
        trace=trace_totals,
        measured_minus_trace=gap,
    )
    peak = max(p.total_bytes for p in phases.values())
    return MemoryReport(
        method=Method.MEASURE,
        model_name=spec.name,
        params=plan.params,
        trainable_params=plan.params,
        phases=tuple(phases[ph] for ph in Phase),
        overhead=_overhead(peak),
        bytes_per_param=_bytes_per_param(phases, plan.params),
        notes=(
            "measured with torch.cuda.max_memory_allocated between the trace's marks, step 2 onwards",
            "the device reports totals: weights, master weights and optimizer states are sized from the live "
            "tensors; gradients, activations, logits and temporaries (and the cuBLAS workspace) are under "
            "temporaries",
        ),
        warnings=tuple(warnings),
        details=details,
    )


def _positions(layout: hf.Layout) -> tuple[list[int], list[int]]:
    from trainfit.trace.depth import _layer_positions

    return _layer_positions(layout)
