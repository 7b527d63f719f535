"""Depth extrapolation: trace a few repetitions of the layer stack, extrapolate each region, then take maxima.

The peak of a phase is a maximum over moments, and a maximum of linear functions is not linear — the
worst moment of backward can move from its start (logits gradients) to its end (all gradients) as layers
are added. So we never extrapolate a phase's peak directly. We cut every phase into regions whose position
is fixed relative to the stack — before the stack, each repeated unit, after the stack — and take each
region's worst moment. At a fixed moment every live tensor either belongs to one unit (weights, grads,
saved activations of that unit: a constant per unit) or not, so a region's breakdown is exactly linear in
the number of units ``k`` of each run. For a run traced at ``k = 2`` and ``k = 3``:

    v(K) = v(2) + (v(3) − v(2)) · (K − 2)          (per component, in bytes)

for the regions that exist at every ``k``: pre, post, the run's first unit and its last unit. Within a
run, the worst unit is its first or last one, because consecutive units differ by a constant (what one
unit adds, minus what it releases). With several runs, each is varied in its own trace and the slopes
add. Each phase of the full model is then the largest of its extrapolated regions. A test holds the
result to a full-depth trace.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trainfit.arch.spec import ModelSpec
from trainfit.result import (
    Component,
    MemoryReport,
    Method,
    ModuleRow,
    Phase,
    PhaseBreakdown,
    RepeatedRun,
    TraceDetails,
)
from trainfit.strategy import Strategy
from trainfit.trace import engine as eng
from trainfit.trace import hf
from trainfit.trace.api import _breakdown, _bytes_per_param, _overhead, module_rows
from trainfit.trace.optim import make_optimizer

Key = tuple[Phase, Any]

#: Repetitions of each extrapolated unit in the base trace; each variant trace adds one.
BASE_UNITS = 1


def _layer_positions(layout: hf.Layout) -> tuple[list[int], list[int]]:
    starts, acc = [], 0
    for b in layout.blocks:
        starts.append(acc)
        acc += len(b.layers)
    first = [starts[fb] for fb, _ in layout.unit_blocks]
    last = [starts[lb] + len(layout.blocks[lb].layers) - 1 for _, lb in layout.unit_blocks]
    return first, last


def _run_layout(
    spec: ModelSpec,
    strategy: Strategy,
    meta: torch.nn.Module,
    stack_path: str,
    full_layers: int,
    layout: hf.Layout,
    *,
    steps: int,
    adamw_impl: str,
    full_depth: bool,
    progress: Callable[[str, float], None] | None,
) -> tuple[eng.TraceRun, torch.nn.Module]:
    rec = strategy.recipe
    mode = eng.fake_mode()
    keep = layout.layers
    model = hf.reduced_model(meta, stack_path, keep, full_layers)
    eng.materialize(model, mode, None)
    stack_mod: Any = model.get_submodule(stack_path)
    layers: list[torch.nn.Module] = list(stack_mod)
    box: list[Any] = []
    hf.install_checkpointing(model, layers, layout.blocks, box)
    first, last = _layer_positions(layout)
    stack = eng.StackHooks(layers=layers, unit_first=first, unit_last=last) if not full_depth else None
    make_batch = hf.batch_fn(spec, strategy.micro_batch, strategy.seq_len)
    with hf.runtime_patches():
        run = _steps(
            model,
            mode,
            make_batch=make_batch,
            forward=lambda m, batch: m(**batch),
            loss_of=lambda out, _batch: out.loss,
            make_optimizer=lambda params: make_optimizer(strategy.optimizer, params, adamw_impl=adamw_impl),
            recipe=rec,
            steps=steps,
            head_module=hf.head_of(model),
            stack=stack,
            progress=progress,
            prepare=box.append,
        )
    return run, model


_steps = eng.run_steps


def _keyed(run: eng.TraceRun, layout: hf.Layout, counts: list[int]) -> dict[Key, dict[Component, int]]:
    return keyed_regions({k: pk.components for k, pk in eng.region_peaks(run).items()}, layout, counts)


def keyed_regions(
    regions: dict[tuple[Phase, str], dict[Component, int]], layout: hf.Layout, counts: list[int]
) -> dict[Key, dict[Component, int]]:
    """Region peaks keyed by position relative to the runs: pre/post, (run, first|last|mid)."""
    within: list[int] = []
    seen: dict[int, int] = {}
    for r in layout.unit_run:
        within.append(seen.get(r, 0))
        seen[r] = seen.get(r, 0) + 1
    out: dict[Key, dict[Component, int]] = {}
    for (phase, region), comps in regions.items():
        key: Any = region
        if region.startswith("unit"):
            u = int(region[4:])
            r, j = layout.unit_run[u], within[u]
            c = counts[r]
            key = (r, "first" if j == 0 else "last" if j == c - 1 else "mid")
            if c == 1:  # the only unit is both the first and the last
                _keep_max(out, (phase, (r, "last")), comps)
        _keep_max(out, (phase, key), comps)
    return out


def _keep_max(out: dict[Key, dict[Component, int]], k: Key, comps: dict[Component, int]) -> None:
    if k not in out or sum(comps.values()) > sum(out[k].values()):
        out[k] = dict(comps)


@dataclass
class DepthPlan:
    """The full model on meta and the reduced layouts to run (one, at full depth, when not extrapolating)."""

    meta: torch.nn.Module
    notes: list[str]
    stack_path: str
    stack: torch.nn.ModuleList
    full_layers: int
    params: int
    runs: list[hf.Run]
    ext: list[int]
    layouts: list[tuple[list[int], hf.Layout]]


def plan_depth(spec: ModelSpec, strategy: Strategy, *, extrapolate: bool) -> DepthPlan:
    meta, notes = hf.build_meta(spec, strategy, eng.weight_dtype(strategy.recipe))
    meta_config: Any = meta.config
    conf = meta_config.get_text_config() if hasattr(meta_config, "get_text_config") else meta_config
    full_layers = int(conf.num_hidden_layers)
    stack_path, stack = hf.find_stack(meta, full_layers)
    params = sum(p.numel() for p in meta.parameters())
    sig_ids: dict[Any, int] = {}
    sigs = [sig_ids.setdefault(hf.layer_signature(layer), len(sig_ids)) for layer in stack]
    blocks = hf.blocks_for(full_layers, strategy.checkpointing)
    tokens = [(b.checkpointed, tuple(sigs[i] for i in b.layers)) for b in blocks]
    runs = hf.find_runs(tokens)
    ext = [r for r, run in enumerate(runs) if run.count >= hf.MIN_EXTRAPOLATED_COUNT] if extrapolate else []
    configs: list[list[int]] = []
    if ext:
        base = [BASE_UNITS if r in ext else run.count for r, run in enumerate(runs)]
        configs.append(base)
        for r in ext:
            c = list(base)
            c[r] = BASE_UNITS + 1
            configs.append(c)
        if len(hf.layout_for(blocks, runs, configs[-1]).layers) >= full_layers:
            ext, configs = [], []
    if not ext:
        configs = [[run.count for run in runs]]
    layouts = [(counts, hf.layout_for(blocks, runs, counts)) for counts in configs]
    return DepthPlan(meta, notes, stack_path, stack, full_layers, params, runs, ext, layouts)


def trace_hf(
    spec: ModelSpec,
    strategy: Strategy,
    *,
    modules: bool,
    progress: Callable[[str, float], None] | None,
    steps: int,
    adamw_impl: str,
    extrapolate: bool,
) -> MemoryReport:
    t0 = time.perf_counter()
    say = progress or (lambda _msg, _frac: None)
    say("building the model on the meta device", 0.0)
    plan = plan_depth(spec, strategy, extrapolate=extrapolate)
    meta, notes, stack_path, stack = plan.meta, plan.notes, plan.stack_path, plan.stack
    full_layers, params, runs, ext = plan.full_layers, plan.params, plan.runs, plan.ext
    configs = [counts for counts, _ in plan.layouts]

    results: list[tuple[list[int], hf.Layout, eng.TraceRun]] = []
    for i, (counts, layout) in enumerate(plan.layouts):

        def sub(msg: str, frac: float, i: int = i, n: int = len(layout.layers)) -> None:
            say(f"trace {i + 1}/{len(configs)} ({n} layers): {msg}", (i + frac) / len(configs))

        run, _model = _run_layout(
            spec,
            strategy,
            meta,
            stack_path,
            full_layers,
            layout,
            steps=steps,
            adamw_impl=adamw_impl,
            full_depth=not ext,
            progress=sub,
        )
        results.append((counts, layout, run))
    say("extrapolating", 1.0)

    warnings: list[str] = []
    _, base_layout, base_run = results[0]
    if ext:
        keyed = [_keyed(run, layout, counts) for counts, layout, run in results]
        phases = extrapolate_phases(keyed, ext, runs, warnings)
    else:
        pk = eng.phase_peaks(base_run)
        phases = {ph: _breakdown(ph, pk[ph].components) for ph in Phase}

    rows: tuple[ModuleRow, ...] = ()
    if modules:
        fwd_event = eng.phase_peaks(base_run)[Phase.FORWARD].event
        counts_full = _instance_counts(stack, stack_path, base_layout)
        rows = module_rows(eng.module_activations(base_run, fwd_event), counts_full, stack_path, 0)

    traced = [len(layout.layers) for _, layout, _ in results]
    if ext:
        notes.append(
            f"traced {', '.join(map(str, traced))} of {full_layers} layers and extrapolated each region linearly "
            f"in the repeated units ({_describe(runs, ext)})"
        )
    else:
        notes.append(f"traced the full depth ({full_layers} layers)")
    notes += [
        "fake-tensor trace of real transformers modules, 2+ training steps; phases read from step 2 (steady state)",
        f"CUDA emulated: autocast op lists, SDPA kernel ({_fmt(base_run.sdpa_backends) or 'none'}), fused dropout; "
        f"allocator granularity 512 B",
        f"optimizer: {strategy.optimizer.value}"
        + (f" ({adamw_impl})" if strategy.optimizer.value == "adamw" else "")
        + f"; grad-norm clipping {eng.DEFAULT_MAX_GRAD_NORM}",
    ]
    if spec.params_override is not None:
        warnings.append("explicit --params cannot be traced; traced the Llama-style model built from the dimensions")
    peak = max(p.total_bytes for p in phases.values())
    return MemoryReport(
        method=Method.TRACE,
        model_name=spec.name,
        params=params,
        trainable_params=params,
        phases=tuple(phases[ph] for ph in Phase),
        overhead=_overhead(peak),
        bytes_per_param=_bytes_per_param(phases, params),
        notes=tuple(notes),
        warnings=tuple(warnings),
        details=TraceDetails(
            layers_traced=tuple(traced),
            modules=rows,
            extrapolated=bool(ext),
            runs=tuple(RepeatedRun(start_block=r.start, unit_blocks=r.period, units=r.count) for r in runs),
            sdpa_backends=dict(base_run.sdpa_backends),
            optimizer_impl=adamw_impl if strategy.optimizer.value == "adamw" else strategy.optimizer.value,
            trace_seconds=round(time.perf_counter() - t0, 2),
        ),
    )


def _fmt(d: dict[str, int]) -> str:
    return ", ".join(sorted(d))


def _describe(runs: list[hf.Run], ext: list[int]) -> str:
    parts = []
    for r in ext:
        run = runs[r]
        parts.append(f"{run.count} units of {run.period} block{'s' if run.period > 1 else ''}")
    return "; ".join(parts)


def extrapolate_phases(
    keyed: list[dict[Key, dict[Component, int]]],
    ext: list[int],
    runs: list[hf.Run],
    warnings: list[str],
) -> dict[Phase, PhaseBreakdown]:
    base = keyed[0]
    full: dict[Key, dict[Component, int]] = {}
    for key, comps in base.items():
        if key[1] != "pre" and key[1] != "post" and isinstance(key[1], tuple) and key[1][1] == "mid":
            continue
        out = dict(comps)
        for n, r in enumerate(ext, start=1):
            other = keyed[n].get(key)
            if other is None:
                continue
            scale = runs[r].count - BASE_UNITS
            for c in Component:
                out[c] = out.get(c, 0) + (other.get(c, 0) - comps.get(c, 0)) * scale
        full[key] = out
    # sanity: a middle unit never beats both ends
    for n in range(1, len(keyed)):
        for key, comps in keyed[n].items():
            if isinstance(key[1], tuple) and key[1][1] == "mid":
                r = key[1][0]
                ends = [keyed[n].get((key[0], (r, e))) for e in ("first", "last")]
                top = max(sum(e.values()) for e in ends if e)
                if sum(comps.values()) > top:
                    warnings.append(f"{key[0].value}: a middle unit peaks above the ends; extrapolation may be low")
    phases: dict[Phase, PhaseBreakdown] = {}
    for ph in Phase:
        cands = [(sum(v.values()), v) for k, v in full.items() if k[0] == ph]
        _, comps = max(cands, key=lambda x: x[0])
        if any(v < 0 for v in comps.values()):
            warnings.append(f"{ph.value}: extrapolation produced a negative component; clamped to 0")
            comps = {c: max(0, v) for c, v in comps.items()}
        phases[ph] = _breakdown(ph, comps)
    return phases


def _instance_counts(full_stack: torch.nn.ModuleList, stack_path: str, layout: hf.Layout) -> dict[str, int]:
    """How many layers of the full model hold each submodule path (``stack.*.rest``)."""
    counts: dict[str, int] = {}
    for layer in full_stack:
        for name, _m in layer.named_modules():
            key = f"{stack_path}.*" + (f".{name}" if name else "")
            counts[key] = counts.get(key, 0) + 1
    return counts
