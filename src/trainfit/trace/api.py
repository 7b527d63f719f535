"""``trace_spec`` (a catalog/config model under a Strategy) and ``trace`` (any ``nn.Module``).

Both return the same :class:`~trainfit.result.MemoryReport` as the analytic method, with
``method=trace``: per phase, the live bytes by component at that phase's worst moment of a steady-state
step. For Hugging Face models the layer stack is traced at a few depths and every region's peak is
extrapolated linearly in the number of repeated units, then each phase takes the largest region (see
:mod:`trainfit.trace.hf` and :mod:`trainfit.trace.depth`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trainfit.arch.spec import ModelSpec
from trainfit.errors import TrainfitError
from trainfit.result import (
    BytesPerParam,
    Component,
    MemoryReport,
    Method,
    ModuleRow,
    Phase,
    PhaseBreakdown,
    TraceDetails,
)
from trainfit.strategy import Precision, Strategy, recipe
from trainfit.trace._deps import require_torch, require_transformers

Progress = Callable[[str, float], None]

#: Rows of the per-module table.
MODULE_ROWS = 30


def _overhead(peak: int) -> Any:
    from trainfit.analytic.overhead import overhead_for

    return overhead_for(peak)


def _bytes_per_param(phases: Mapping[Phase, PhaseBreakdown], params: int) -> BytesPerParam:
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


def _breakdown(phase: Phase, comps: Mapping[Component, int]) -> PhaseBreakdown:
    return PhaseBreakdown(phase=phase, components={c: int(comps.get(c, 0)) for c in Component})


def trace_spec(
    spec: ModelSpec,
    strategy: Strategy,
    *,
    modules: bool = False,
    progress: Progress | None = None,
    steps: int = 2,
    adamw_impl: str | None = None,
    extrapolate: bool = True,
) -> MemoryReport:
    """Trace ``spec`` trained under ``strategy`` (real HF modules, fake tensors, CUDA policies).

    ``extrapolate=False`` traces the full depth. ``adamw_impl`` overrides ``strategy.optimizer_impl``:
    ``foreach`` (``torch.optim.AdamW``'s default on CUDA) or ``fused`` (the HF Trainer's default on
    torch >= 2.8).
    """
    adamw_impl = adamw_impl or strategy.optimizer_impl.value
    require_torch()
    require_transformers()
    from trainfit.trace import depth

    return depth.trace_hf(
        spec,
        strategy,
        modules=modules,
        progress=progress,
        steps=steps,
        adamw_impl=adamw_impl,
        extrapolate=extrapolate,
    )


def trace(
    model_fn: Callable[[], Any],
    inputs_fn: Callable[[], Any],
    *,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    optimizer_fn: Callable[[list[Any]], Any] | None = None,
    precision: Precision | str = "amp-bf16",
    steps: int = 2,
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
    submodule whose forward and backward count as logits/loss.
    """
    torch = require_torch()
    from trainfit.trace import engine as eng

    rec = recipe(precision)
    mode = eng.fake_mode()
    with torch.device("meta"):
        model = model_fn()
    if not isinstance(model, torch.nn.Module):
        raise TrainfitError("model_fn must return a torch.nn.Module")
    model.train()
    eng.materialize(model, mode, eng.weight_dtype(rec))

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

    head = model.get_submodule(head_module) if head_module else None
    run = eng.run_steps(
        model,
        mode,
        make_batch=inputs_fn,
        forward=forward_fn or default_forward,
        loss_of=loss_fn or default_loss,
        make_optimizer=optimizer_fn or default_optimizer,
        recipe=rec,
        steps=steps,
        head_module=head,
        max_grad_norm=max_grad_norm,
        progress=progress,
    )
    peaks = eng.phase_peaks(run)
    phases = {ph: _breakdown(ph, peaks[ph].components) for ph in Phase}
    rows = module_rows(eng.module_activations(run, peaks[Phase.FORWARD].event), {}, None, 0) if modules else ()
    depth_count = _count_layers(model)
    return MemoryReport(
        method=Method.TRACE,
        model_name=name or type(model).__name__,
        params=run.params,
        trainable_params=run.trainable_params,
        phases=tuple(phases[ph] for ph in Phase),
        overhead=_overhead(max(p.total_bytes for p in phases.values())),
        bytes_per_param=_bytes_per_param(phases, run.params),
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


def module_rows(
    by_owner: Mapping[str, int], full_counts: Mapping[str, int], stack_path: str | None, traced_units: int
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
