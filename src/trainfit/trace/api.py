"""``trace_spec`` (a catalog/config model under a Strategy) and ``trace`` (any ``nn.Module``).

Both return the same :class:`~trainfit.result.MemoryReport` as the analytic method, with
``method=trace``: per phase, the live bytes by component at that phase's worst moment of a steady-state
step. For Hugging Face models the layer stack is traced at a few depths and every region's peak is
extrapolated linearly in the number of repeated units, then each phase takes the largest region (see
:mod:`trainfit.trace.hf` and :mod:`trainfit.trace.depth`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trainfit.allocator import AllocatorConfig, simulate
from trainfit.allocator.process import ProcessStart
from trainfit.allocator.report import allocator_details, capped_run
from trainfit.allocator.workspaces import TARGET_TORCH, training_workspaces
from trainfit.arch.spec import ModelSpec
from trainfit.errors import StrategyError, TrainfitError
from trainfit.result import Component, MemoryReport, Method, Phase, TraceDetails
from trainfit.strategy import Precision, Strategy, recipe
from trainfit.trace import depth, readout
from trainfit.trace import runner as rn
from trainfit.trace._deps import require_torch, require_transformers
from trainfit.trace.events import reserved_from_trace

Progress = Callable[[str, float], None]


def trace_spec(
    spec: ModelSpec,
    strategy: Strategy,
    *,
    modules: bool = False,
    progress: Progress | None = None,
    steps: int = 2,
    adamw_impl: str | None = None,
    extrapolate: bool = True,
    allocator: AllocatorConfig | None = None,
    compute_capability: tuple[int, int] = (9, 0),
    rocm_arch: str | None = None,
    torch_version: tuple[int, int] = TARGET_TORCH,
    layout: bool = False,
    capacity_bytes: int | None = None,
    start: ProcessStart | None = None,
) -> MemoryReport:
    """Trace ``spec`` trained under ``strategy`` (real HF modules, fake tensors, CUDA policies).

    ``extrapolate=False`` traces the full depth. ``adamw_impl`` overrides ``strategy.optimizer_impl``:
    ``foreach`` (``torch.optim.AdamW``'s default on CUDA) or ``fused`` (the HF Trainer's default on
    torch >= 2.8). With ``allocator``, the trace's events (stitched to full depth, with the cuBLAS workspaces of
    a GPU of ``compute_capability``, or of ``rocm_arch`` for an AMD one, under ``torch_version``) are replayed
    through the caching-allocator simulation for the reserved memory
    (:func:`trainfit.trace.events.reserved_from_trace`: one more trace of three units of the layer stack); without
    it, reserved memory is the fixed fraction of ``trainfit.overhead``. The same simulation gives each phase's blocks
    beyond its requests (``Component.ALLOCATOR_ROUNDING``, :func:`trainfit.trace.events.phase_rounding`): what
    ``max_memory_allocated`` counts; without ``allocator`` the phases are the requests.
    ``capacity_bytes`` (with ``allocator``): the allocator's share of the GPU; when only the uncapped reserve
    exceeds it, the same events run once more under it (``MemoryReport.capped``).
    ``start`` (with ``allocator``): the process the run starts in (``trainfit.history``): the traced events run
    after its history (:class:`~trainfit.allocator.process.ProcessStart`) rather than in a fresh allocator.
    """
    if strategy.beyond_the_trace():
        raise StrategyError(
            f"the trace does not run {', '.join(strategy.beyond_the_trace())} yet; use --method analytic"
        )
    adamw_impl = adamw_impl or strategy.optimizer_impl.value
    require_torch()
    require_transformers()
    report = depth.trace_hf(
        spec,
        strategy,
        modules=modules,
        progress=progress,
        steps=steps,
        adamw_impl=adamw_impl,
        extrapolate=extrapolate,
    )
    if allocator is None:
        return report
    if progress is not None:
        progress("simulating the caching allocator on the full-depth event stream", 1.0)
    traced = reserved_from_trace(
        spec,
        strategy,
        allocator,
        compute_capability=compute_capability,
        rocm_arch=rocm_arch,
        env=os.environ,
        torch_version=torch_version,
        steps=steps,
        layout=layout,
    )
    # max_memory_allocated counts blocks: each phase's blocks beyond its requests, from the same simulated events
    rounding = dict(traced.phase_rounding)
    report = dataclasses.replace(
        report,
        phases=tuple(
            dataclasses.replace(
                p, components={**p.components, Component.ALLOCATOR_ROUNDING: rounding.get(Phase(p.phase), 0)}
            )
            for p in report.phases
        ),
    )
    res = traced.result
    if start is not None:
        res = simulate(start.events(traced.stream), allocator, layout=layout, setup=start.setup)
    workspaces = training_workspaces(compute_capability, os.environ, rocm_arch=rocm_arch, torch_version=torch_version)
    held = report.peak_bytes + sum(w.size_bytes for w in workspaces)
    reserve = max(0, res.peak_reserved_bytes - held)
    details = report.details
    assert isinstance(details, TraceDetails)
    return dataclasses.replace(
        report,
        capped=capped_run(
            lambda c: simulate(
                traced.stream if start is None else start.events(traced.stream),
                allocator,
                capacity_bytes=c,
                setup=None if start is None else start.setup,
            ),
            res,
            held_bytes=held,
            reserve_bytes=reserve,
            capacity_bytes=capacity_bytes,
        ),
        overhead=dataclasses.replace(report.overhead, allocator_reserve_bytes=reserve),
        details=dataclasses.replace(
            details,
            allocator=allocator_details(res, allocator),
        ),
        reserve_simulated=True,
    )


def trace(
    model_fn: Callable[[], Any],
    inputs_fn: Callable[[], Any],
    *,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    optimizer_fn: Callable[[list[Any]], Any] | None = None,
    precision: Precision | str = "amp-bf16",
    steps: int = 2,
    grad_accum: int = 1,
    forward_fn: Callable[[Any, Any], Any] | None = None,
    head_module: str | None = None,
    max_grad_norm: float | None = 1.0,
    modules: bool = False,
    name: str | None = None,
    progress: Progress | None = None,
) -> MemoryReport:
    """Trace any ``nn.Module``: ``model_fn()`` builds it (on the meta device if it likes; parameters are
    replaced by fake tensors of the recipe's dtype), ``inputs_fn()`` builds one batch (called under fake
    tensors), ``forward_fn(model, batch)`` runs it (default: ``model(**batch)`` for a mapping,
    ``model(*batch)`` for a sequence, else ``model(batch)``), ``loss_fn(output, batch)`` returns the
    scalar loss (default: ``output.loss``), ``optimizer_fn(params)`` builds the optimizer (default:
    AdamW, foreach as on CUDA; for master-* recipes it receives the fp32 master parameters). ``head_module`` names a
    submodule whose forward and backward count as logits/loss. ``grad_accum > 1`` runs each step as
    accumulating micro-steps (gradients resident in the forward and backward passes after the first).
    """
    torch = require_torch()
    rec = recipe(precision)
    mode = rn.fake_mode()
    with torch.device("meta"):
        model = model_fn()
    if not isinstance(model, torch.nn.Module):
        raise TrainfitError("model_fn must return a torch.nn.Module")
    model.train()
    rn.materialize(model, mode, rn.weight_dtype(rec))

    def default_forward(m: Any, batch: Any) -> Any:
        if isinstance(batch, Mapping):
            return m(**batch)
        if isinstance(batch, Sequence) and not isinstance(batch, torch.Tensor):
            return m(*batch)
        return m(batch)

    def default_loss(out: Any, _batch: Any) -> Any:
        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, Mapping):
            loss = out.get("loss")
        if loss is None:
            raise TrainfitError("the model output has no .loss; pass loss_fn=(output, batch) -> scalar")
        return loss

    def default_optimizer(params: list[Any]) -> Any:
        return torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, foreach=True)

    fns = rn.StepFns(
        make_batch=inputs_fn,
        forward=forward_fn or default_forward,
        loss_of=loss_fn or default_loss,
        make_optimizer=optimizer_fn or default_optimizer,
    )
    options = rn.RunOptions(
        recipe=rec,
        steps=steps,
        grad_accum=grad_accum,
        max_grad_norm=max_grad_norm,
        head_module=model.get_submodule(head_module) if head_module else None,
        progress=progress,
    )
    run = rn.run_steps(model, fns, options, rn.Execution(mode=mode))
    peaks = readout.phase_peaks(run)
    phases = {ph: readout.breakdown(ph, peaks[ph].components) for ph in Phase}
    rows = readout.module_rows(readout.module_activations(run, peaks[Phase.FORWARD].event), {}, None) if modules else ()
    depth_count = _count_layers(model)
    return MemoryReport(
        method=Method.TRACE,
        model_name=name or type(model).__name__,
        params=run.params,
        trainable_params=run.trainable_params,
        phases=tuple(phases[ph] for ph in Phase),
        overhead=readout.overhead(max(p.total_bytes for p in phases.values())),
        bytes_per_param=readout.bytes_per_param(phases, run.params),
        notes=(
            "fake-tensor trace of the full model for 2+ steps; phases read from step 2 (steady state)",
            f"precision {rec.precision.value}; CUDA autocast policy and kernels emulated",
        ),
        details=TraceDetails(
            layers_traced=(depth_count,) if depth_count else (),
            modules=rows,
            sdpa_backends=dict(run.sdpa_backends),
            peak_events={ph: peaks[ph].event for ph in Phase},
        ),
    )


def _count_layers(model: Any) -> int:
    conf = getattr(model, "config", None)
    n = getattr(conf, "num_hidden_layers", None)
    return int(n) if isinstance(n, int) else 0
