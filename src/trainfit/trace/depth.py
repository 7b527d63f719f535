"""Depth extrapolation: trace a few repetitions of the layer stack, extrapolate each region, then take maxima.

The peak of a phase is a maximum over moments, and a maximum of linear functions is not linear — the
worst moment of backward can move from its start (logits gradients) to its end (all gradients) as layers
are added. So we never extrapolate a phase's peak directly. We cut every phase into regions whose position
is fixed relative to the stack — before the stack, each repeated unit, after the stack (the timeline's
:class:`~trainfit.trace.timeline.Region`) — and take each region's worst moment. At a fixed moment every
live tensor either belongs to one unit (weights, grads, saved activations of that unit: a constant per
unit) or not, so a region's breakdown is exactly linear in the number of units ``k`` of each run. For a
run traced at ``k = 1`` and ``k = 2`` (``BASE_UNITS`` and one more):

    v(K) = v(1) + (v(2) − v(1)) · (K − 1)          (per component, in bytes)

for the places that exist at every ``k`` (:class:`Place`): before and after the stack, the run's first
unit and its last unit. Within a run, the worst unit is its first or last one, because consecutive units
differ by a constant (what one unit adds, minus what it releases). With several runs, each is varied in
its own trace and the slopes add. Each phase of the full model is then the largest of its extrapolated
places. A test holds the result to a full-depth trace.

The line needs its base points to be alike. When the hidden states entering the stack require no grad (a frozen
token table without checkpointing: LoRA, ``--freeze embeddings``), the lowest layer computes no input gradient and,
frozen, saves less than the others; at ``k = 1`` it is also the top layer, so the one-unit trace is off the line
(Falcon-7B LoRA: the 1→2 slope 44 MiB per layer high). Such plans trace ``k = 2`` and ``k = 3``
(:func:`stack_input_requires_grad`), as FSDP2 (3 and 4) and DeepSpeed (2 and 3) do for their own reasons. So do
activation offloading over a checkpointed stack whose input is a leaf (a frozen token table under checkpointing:
the first checkpoint input, held by its ``AccumulateGrad``, is at ``k = 1`` also the one the forward stash keeps;
:func:`offloaded_leaf_input`) and
a trace whose forward peaks inside the top unit of a stack that is not checkpointed (eager attention's score
chain): the model's ``inputs_embeds`` and the top layer's ``residual``, held unsaved over a 16-bit residual, are
one tensor at ``k = 1`` — found only after the run, so such a trace runs again (:func:`forward_peak_off_line`).

Which parameters train is part of a layer's signature: ``--freeze layers:0-15`` makes the frozen and the
trainable layers two runs, each varied in its own trace (frozen layers save and hold different things). The
kept layers of such a layout are not a prefix of the stack; they are renumbered (``layer_idx``) to their
reduced positions.

:func:`plan_depth` chooses the layouts, :func:`run_layout` builds one reduced model and runs it — on fake
tensors for the trace, on a real device for ``--method measure``, which shares the plan, the run, the
keying and the extrapolation — and :func:`trace_hf` makes the trace's report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Generic, TypeVar

import torch

from trainfit.arch.spec import ModelSpec
from trainfit.cuda_facts import SdpaKernel
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
from trainfit.strategy import Checkpointing, Float8, Strategy
from trainfit.trace import hf, readout
from trainfit.trace import runner as rn
from trainfit.trace import tracker as tk
from trainfit.trace.float8 import inner_ops_tracked as float8_inner_ops
from trainfit.trace.optim import host_state_keys, make_optimizer, state_tensors
from trainfit.trace.savers import (
    OffloadActivations,
    OptimizerInBackward,
    chunked_loss_fns,
    fused_linear_loss_fns,
    selective_recompute,
)
from trainfit.trace.timeline import Region, Span

#: Repetitions of each extrapolated unit in the base trace; each variant trace adds one.
BASE_UNITS = 1


class RunEnd(StrEnum):
    """Which unit of a repeated run a region belongs to."""

    FIRST = "first"
    MID = "mid"
    LAST = "last"
    #: the unit before the last (the second to run backward) and the one after the first, keyed besides their
    #: own ends when asked (:func:`keyed_regions` ``inner``)
    BELOW_LAST = "below-last"
    ABOVE_FIRST = "above-first"


@dataclass(frozen=True, slots=True)
class Place:
    """Where a region sits relative to the repeated runs: a span outside the units (before or after the
    stack, or the whole phase), or an end of run ``run``. Places are what a depth-varied trace has in
    common with the full model; they are extrapolated one by one."""

    span: Span
    run: int | None = None
    end: RunEnd | None = None

    @staticmethod
    def of(region: Region) -> Place:
        """The place of a region that is not a unit."""
        if region.span is Span.UNIT:
            raise ValueError("a unit region's place depends on the layout")
        return Place(region.span)


Key = tuple[Phase, Place]


def layer_positions(layout: hf.Layout) -> tuple[list[int], list[int]]:
    """Index (in the reduced stack) of each unit's first and last layer."""
    starts, acc = [], 0
    for b in layout.blocks:
        starts.append(acc)
        acc += len(b.layers)
    first = [starts[fb] for fb, _ in layout.unit_blocks]
    last = [starts[lb] + len(layout.blocks[lb].layers) - 1 for _, lb in layout.unit_blocks]
    return first, last


def keyed_regions(
    regions: Mapping[tuple[Phase, Region], Mapping[Component, int]],
    layout: hf.Layout,
    counts: list[int],
    *,
    inner: bool = False,
) -> dict[Key, dict[Component, int]]:
    """Region breakdowns keyed by their place relative to the runs: pre/post/whole, or (run, first|last|mid).
    ``inner``: the unit before a run's last and, from three units on, the one after its first are also keyed
    as such, for runs whose worst moment can sit next to an end at any depth (FSDP2's backward: each layer's
    post-backward reshards it and leaves a reduce-scatter input in flight, trace/distributed.py); trace at
    least three units then, so that neither is an end in the base layout."""
    within: list[int] = []
    seen: dict[int, int] = {}
    for r in layout.unit_run:
        within.append(seen.get(r, 0))
        seen[r] = seen.get(r, 0) + 1
    out: dict[Key, dict[Component, int]] = {}
    for (phase, region), comps in regions.items():
        if region.span is Span.UNIT:
            assert region.unit is not None
            r, j = layout.unit_run[region.unit], within[region.unit]
            c = counts[r]
            end = RunEnd.FIRST if j == 0 else RunEnd.LAST if j == c - 1 else RunEnd.MID
            place = Place(Span.UNIT, r, end)
            if c == 1:  # the only unit is both the first and the last
                _keep_max(out, (phase, Place(Span.UNIT, r, RunEnd.LAST)), comps)
            if inner and c >= 2 and j == c - 2:
                _keep_max(out, (phase, Place(Span.UNIT, r, RunEnd.BELOW_LAST)), comps)
            if inner and c >= 3 and j == 1:
                _keep_max(out, (phase, Place(Span.UNIT, r, RunEnd.ABOVE_FIRST)), comps)
        else:
            place = Place.of(region)
        _keep_max(out, (phase, place), comps)
    return out


def _keep_max(out: dict[Key, dict[Component, int]], k: Key, comps: Mapping[Component, int]) -> None:
    if k not in out or sum(comps.values()) > sum(out[k].values()):
        out[k] = dict(comps)


# -- one layout, built and run ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceRun:
    """Run a layout on a real device instead of fake tensors: real kernels, no tracker, no CUDA emulation;
    ``probe`` reads the device at every mark (:mod:`trainfit.measure`)."""

    device: str
    probe: rn.Probe


@dataclass(frozen=True, slots=True, kw_only=True)
class ResidentBytes:
    """What the model states occupied on the run's device after the last step (512-byte blocks, each
    storage once; host-side optimizer counters excluded)."""

    weights: int
    master_weights: int
    optimizer_states: int


@dataclass(frozen=True, slots=True, kw_only=True)
class LayoutRun:
    """What running a layout leaves: the run's timeline and tracker, and the resident states' sizes. It
    holds no tensor, module or optimizer of the run, so the run's memory is free once nothing else holds
    them (``--method measure`` relies on it between the depth-varied runs)."""

    run: rn.TraceRun
    resident: ResidentBytes
    host_activation_bytes: int = 0  # --activation-offload: the most saved-tensor bytes on the host at once
    #: (parameters, trainable ones) of each traced layer of the stack, adapters included: the per-parameter blocks
    #: the event stitching repeats (trace/events.py)
    layer_params: tuple[tuple[int, int], ...] = ()


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st._cdata] = tk.rounded(st.nbytes())
    return sum(seen.values())


def resident_bytes(model: torch.nn.Module, optimizer: Any, *, master: bool, device: str) -> ResidentBytes:
    """Sizes of the weights (parameters and buffers), the master weights (the optimizer's parameters under
    a master-* recipe) and the optimizer states on ``device`` (not the host-side step counters)."""
    host = host_state_keys(optimizer)
    states = [t for k, t in state_tensors(optimizer) if k not in host and t.device.type == device]
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    return ResidentBytes(
        weights=_storage_bytes([*model.parameters(), *model.buffers()]),
        master_weights=_storage_bytes(opt_params) if master else 0,
        optimizer_states=_storage_bytes(states),
    )


def run_layout(
    spec: ModelSpec,
    strategy: Strategy,
    plan: DepthPlan,
    layout: hf.Layout,
    *,
    steps: int,
    adamw_impl: str,
    progress: Callable[[str, float], None] | None = None,
    on_device: DeviceRun | None = None,
) -> LayoutRun:
    """Build the reduced model of ``layout`` from the plan's meta model and run the training steps on it:
    on fake tensors under the tracker and the CUDA emulation (the trace), or on a real device under a
    probe (``on_device``; ``--method measure``). The model, optimizer and batches live only in this call."""
    rec = strategy.recipe
    device = on_device.device if on_device is not None else "cpu"
    mode = rn.fake_mode() if on_device is None else None
    model = hf.reduced_model(plan.meta, plan.stack_path, layout.layers, plan.full_layers)
    renumber_layers(model, plan.stack_path)
    if strategy.float8 is not Float8.NONE:
        from trainfit.trace.float8 import apply_float8

        apply_float8(model, plan.stack_path, strategy)  # torchao Float8Linear, on meta (trace/float8.py)
    quantised: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if strategy.adapter is not None or not strategy.base_weights.is_default:
        from trainfit.trace.peft import apply_finetuning, quantised_weights

        model = apply_finetuning(model, strategy)  # on meta: PEFT adapters, frozen base (trace/peft.py)
        rn.materialize(model, mode, None, device=device)
        quantised = quantised_weights(model, mode, strategy)  # bitsandbytes 4-bit weights on fake tensors
    else:
        rn.materialize(model, mode, None, device=device)
    stack: Any = model.get_submodule(plan.stack_path)
    layers: list[torch.nn.Module] = list(stack)
    box: list[tk.Tracker] = []
    hf.install_checkpointing(model, layers, layout.blocks, box, sac=strategy.checkpointing is Checkpointing.SAC)
    first, last = layer_positions(layout)
    optimizers: list[Any] = []

    def build_optimizer(params: list[torch.nn.Parameter]) -> Any:
        if strategy.savers.optimizer_in_backward:  # trace/savers.py: torchtune's per-parameter hooks
            in_bwd = OptimizerInBackward(
                params, lambda ps: make_optimizer(strategy.optimizer, ps, adamw_impl=adamw_impl)
            )
            optimizers.append(in_bwd)
            return in_bwd
        opt = make_optimizer(strategy.optimizer, params, adamw_impl=adamw_impl)
        optimizers.append(opt)
        return opt

    chunked = chunked_loss_fns(strategy) or fused_linear_loss_fns(strategy)  # trace/savers.py
    forward: Callable[[Any, Any], Any] = chunked[0] if chunked else lambda m, batch: m(**batch)
    offload = OffloadActivations(hf.head_of(model), box) if strategy.savers.activation_offload else None
    if offload is not None:
        forward = offload.forward(forward)  # trace/savers.py: torchtune's OffloadActivations around the forward
    fns = rn.StepFns(
        make_batch=hf.batch_fn(spec, strategy.micro_batch, strategy.seq_len, device=device),
        forward=forward,
        loss_of=chunked[1] if chunked else hf.loss_of(spec),
        make_optimizer=build_optimizer,
    )
    options = rn.RunOptions(
        recipe=rec,
        steps=steps,
        grad_accum=strategy.grad_accum,
        head_module=hf.head_of(model),
        stack=rn.StackHooks(layers=layers, unit_first=first, unit_last=last) if plan.ext else rn.StackHooks(),
        progress=progress,
        prepare=box.append,
        flash_sdp=strategy.flash_sdp,
    )
    if on_device is None:
        execution = rn.Execution(mode=mode)
    else:
        execution = rn.Execution(device=device, emulate_cuda=False, track=False, probe=on_device.probe)
    selective: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if strategy.checkpointing is Checkpointing.SELECTIVE:
        selective = selective_recompute(model, box)  # trace/savers.py: the attention core checkpointed
    with hf.runtime_patches(), quantised, float8_inner_ops(box, strategy), selective:
        run = rn.run_steps(model, fns, options, execution)
        resident = resident_bytes(model, optimizers[0], master=bool(rec.master_bits), device=device)
    counts = tuple(
        (len(list(layer.parameters())), sum(p.requires_grad for p in layer.parameters())) for layer in layers
    )
    return LayoutRun(
        run=run,
        resident=resident,
        host_activation_bytes=offload.host_peak_bytes if offload else 0,
        layer_params=counts,
    )


def renumber_layers(model: torch.nn.Module, stack_path: str) -> None:
    """Give each kept layer its position in the reduced stack as ``layer_idx`` (the index transformers' caches
    and per-layer config lists are read with). A layout of two extrapolated runs keeps layers that are not a
    prefix of the stack (say 0 and 16 of a half-frozen model); their full-depth indices would run past the
    reduced model's ``DynamicCache``. The per-layer config lists are sliced in the same order
    (``hf.reduced_model``), so a layer reads its own entry; for a prefix this changes nothing."""
    stack: Any = model.get_submodule(stack_path)
    for pos, layer in enumerate(stack):
        for mod in layer.modules():
            if isinstance(getattr(mod, "layer_idx", None), int):
                mod.layer_idx = pos


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
    base_units: int = BASE_UNITS


def plan_depth(spec: ModelSpec, strategy: Strategy, *, extrapolate: bool, base_units: int = BASE_UNITS) -> DepthPlan:
    """The meta model and the layouts to trace: each repeated run at ``base_units`` and one more unit
    (FSDP2 needs 2: with one layer there is no next layer to prefetch)."""
    meta, notes = hf.build_meta(spec, strategy, rn.weight_dtype(strategy.recipe))
    meta_config: Any = meta.config
    conf = meta_config.get_text_config() if hasattr(meta_config, "get_text_config") else meta_config
    full_layers = int(conf.num_hidden_layers)
    stack_path, stack = hf.find_stack(meta, full_layers)
    params = sum(p.numel() for p in meta.parameters())
    if strategy.base_weights.frozen:
        from trainfit.trace.peft import freeze_patterns

        freeze_patterns(meta, stack_path, strategy.base_weights.frozen)  # full-depth layer indices
    sig_ids: dict[Any, int] = {}
    # A frozen layer costs what a trainable one does not (no gradients, no states, fewer saved tensors), so
    # which parameters train is part of a layer's signature: a freeze range splits the stack into runs that
    # are extrapolated separately.
    keys = [(hf.layer_signature(layer), tuple(p.requires_grad for p in layer.parameters())) for layer in stack]
    sigs = [sig_ids.setdefault(k, len(sig_ids)) for k in keys]
    blocks = hf.blocks_for(full_layers, strategy.checkpointing)
    if base_units < 2 and (
        not stack_input_requires_grad(meta, strategy, blocks) or offloaded_leaf_input(meta, strategy, blocks)
    ):
        # The lowest layer computes no input gradient (and, when frozen, saves less), or its input is a leaf that
        # offloading cannot free: at one unit it is also the top one, so the one-unit trace is off the line the
        # deeper ones lie on. Trace 2 and 3 units instead.
        base_units = 2
    tokens = [(b.checkpointed, tuple(sigs[i] for i in b.layers)) for b in blocks]
    runs = hf.find_runs(tokens)
    ext = [r for r, run in enumerate(runs) if run.count >= hf.MIN_EXTRAPOLATED_COUNT] if extrapolate else []
    configs: list[list[int]] = []
    if ext:
        base = [base_units if r in ext else run.count for r, run in enumerate(runs)]
        configs.append(base)
        for r in ext:
            c = list(base)
            c[r] = base_units + 1
            configs.append(c)
        if len(hf.layout_for(blocks, runs, configs[-1]).layers) >= full_layers:
            ext, configs = [], []
    if not ext:
        configs = [[run.count for run in runs]]
    layouts = [(counts, hf.layout_for(blocks, runs, counts)) for counts in configs]
    return DepthPlan(meta, notes, stack_path, stack, full_layers, params, runs, ext, layouts, base_units)


def stack_input_requires_grad(meta: torch.nn.Module, strategy: Strategy, blocks: list[hf.Block]) -> bool:
    """Whether the hidden states entering the layer stack surely require grad, so that its lowest layer computes
    an input gradient like every other (a ``False`` may be wrong only towards tracing one more unit).

    They do under checkpointing: transformers' ``_activation_checkpointing_enable`` (modeling_utils.py) calls
    ``enable_input_require_grads`` for every ``input_ids`` model (a forward hook that sets the embeddings' output
    to require grad). PEFT calls it too, but only when the model checkpoints (peft/peft_model.py
    ``PeftModel.__init__``: ``if getattr(model, "is_gradient_checkpointing", True)``), so without checkpointing a
    LoRA model's lowest layer gets a plain tensor. Otherwise they do when the input embedding table trains
    (full fine-tuning, ``--freeze`` not naming it)."""
    if any(b.checkpointed for b in blocks):
        return getattr(meta, "main_input_name", None) == "input_ids"
    if strategy.adapter is not None:
        return False  # get_peft_model freezes every base parameter
    m: Any = meta
    embed = m.get_input_embeddings() if hasattr(m, "get_input_embeddings") else None
    weight = getattr(embed, "weight", None)
    return isinstance(weight, torch.nn.Parameter) and weight.requires_grad


def offloaded_leaf_input(meta: torch.nn.Module, strategy: Strategy, blocks: list[hf.Block]) -> bool:
    """Whether ``--activation-offload`` runs over a checkpointed stack whose input is a leaf: a frozen token table
    (an adapter, ``--freeze embeddings``) whose output ``enable_input_require_grads`` marks as requiring grad. That
    leaf is the first segment's checkpoint input, and its ``AccumulateGrad`` node holds it for the whole step
    whatever the offloading hooks do; at one unit it is also the input the forward stash (the last 5 packs) keeps
    at the forward's end, at two units the stash keeps the second layer's besides: the 1→2 slope is one checkpoint
    input per layer where the deeper ones add none (llama-3.2-1b LoRA over LLM.int8, 2 × 1024: the extrapolated
    forward 4.1% above the full-depth trace)."""
    if not strategy.savers.activation_offload or not any(b.checkpointed for b in blocks):
        return False
    if strategy.adapter is not None:
        return True  # get_peft_model freezes every base parameter
    m: Any = meta
    embed = m.get_input_embeddings() if hasattr(m, "get_input_embeddings") else None
    weight = getattr(embed, "weight", None)
    return isinstance(weight, torch.nn.Parameter) and not weight.requires_grad


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
    """The trace of a Hugging Face model: every layout of the plan on fake tensors, extrapolated."""
    t0 = time.perf_counter()
    say = progress or (lambda _msg, _frac: None)
    say("building the model on the meta device", 0.0)
    plan = plan_depth(spec, strategy, extrapolate=extrapolate)

    def run_plan(plan: DepthPlan) -> tuple[Traced, list[int]]:
        results: Traced = []
        host: list[int] = []
        n_layouts = len(plan.layouts)
        for i, (counts, layout) in enumerate(plan.layouts):

            def sub(msg: str, frac: float, i: int = i, n: int = len(layout.layers)) -> None:
                say(f"trace {i + 1}/{n_layouts} ({n} layers): {msg}", (i + frac) / n_layouts)

            done = run_layout(spec, strategy, plan, layout, steps=steps, adamw_impl=adamw_impl, progress=sub)
            results.append((counts, layout, done.run))
            host.append(done.host_activation_bytes)
        return results, host

    outcome = extrapolated_depth(
        spec,
        strategy,
        plan,
        run_plan,
        lambda done: keyed_traces(done[0]),
        lambda done: whole_phases(done[0]),
        replan=lambda base: plan_depth(spec, strategy, extrapolate=extrapolate, base_units=base),
        say=say,
    )
    plan, (results, host), warnings, phases = outcome.plan, outcome.results, outcome.warnings, outcome.phases
    say("extrapolating", 1.0)
    notes, runs, ext = plan.notes, plan.runs, plan.ext
    base_run = results[0][2]

    if strategy.savers.activation_offload:
        # The offloaded bytes grow by the same amount per repeated unit (runs as the device regions).
        full_host = host[0] + sum((host[n] - host[0]) * (runs[r].count - plan.base_units) for n, r in enumerate(ext, 1))
        for ph in (Phase.FORWARD, Phase.BACKWARD):
            phases[ph] = dataclasses.replace(phases[ph], host_components={Component.ACTIVATIONS: full_host})

    rows: tuple[ModuleRow, ...] = ()
    if modules:
        fwd_event = readout.phase_peaks(base_run)[Phase.FORWARD].event
        counts_full = readout.stack_instance_counts(plan.stack, plan.stack_path)
        rows = readout.module_rows(readout.module_activations(base_run, fwd_event), counts_full, plan.stack_path)

    traced = [len(layout.layers) for _, layout, _ in results]
    if ext:
        notes.append(
            f"traced {', '.join(map(str, traced))} of {plan.full_layers} layers and extrapolated each region "
            f"linearly in the repeated units ({_describe(runs, ext)})"
        )
    else:
        notes.append(f"traced the full depth ({plan.full_layers} layers)")
    notes += [
        "fake-tensor trace of real transformers modules, 2+ training steps; phases read from step 2 (steady state)",
        f"CUDA emulated: autocast op lists, SDPA kernel ({_fmt(base_run.sdpa_backends) or 'none'}), fused dropout; "
        f"allocator granularity 512 B",
        f"optimizer: {strategy.optimizer.value}"
        + (f" ({adamw_impl})" if strategy.optimizer.value == "adamw" else "")
        + f"; grad-norm clipping {rn.DEFAULT_MAX_GRAD_NORM}",
    ]
    if strategy.grad_accum > 1:
        notes.append(
            f"gradient accumulation x{strategy.grad_accum}: each step traced as a pass from zero gradients and "
            "a pass accumulating into them (gradients resident); later passes repeat the second"
        )
    if spec.params_override is not None:
        warnings.append("explicit --params cannot be traced; traced the Llama-style model built from the dimensions")
    peak = max(p.total_bytes for p in phases.values())
    return MemoryReport(
        method=Method.TRACE,
        model_name=spec.name,
        params=plan.params,
        trainable_params=_trainable_params(results, ext, runs),
        phases=tuple(phases[ph] for ph in Phase),
        overhead=readout.overhead(peak),
        bytes_per_param=readout.bytes_per_param(phases, plan.params),
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


def forward_peak_off_line(plan: DepthPlan, place: Place, spec: ModelSpec, strategy: Strategy) -> bool:
    """Whether the one-unit base trace is off the line for the forward's worst moment: inside the top layer of a
    stack that is not checkpointed, where the model's own locals hold the embedding output (``inputs_embeds``) and
    the layer's input (``residual``) unsaved where its norm saves a copy (RMSNorm over a 16-bit residual) — one
    tensor at one unit, two from two on (Llama pure-bf16 eager: the 1→2 slope one t·h too high per layer, +1.2% at
    four layers). Such traces are run again at 2 and 3 units. Checked by where the peak is, not by the norm or the
    residual's width: a LayerNorm or fp32 model whose forward peaks inside a layer is traced twice too (right,
    only slower)."""
    if plan.base_units != 1 or place.span is not Span.UNIT:
        return False
    return strategy.checkpoint_segments(spec.num_layers) == 0


Keyed = list[dict[Key, dict[Component, int]]]


R = TypeVar("R")
#: Each traced layout: its unit counts per run, the layout and the run.
Traced = list[tuple[list[int], hf.Layout, rn.TraceRun]]


def keyed_traces(results: Traced, *, inner: bool = False) -> Keyed:
    """Each traced layout's region peaks keyed by place (:func:`keyed_regions`)."""
    return [
        keyed_regions({k: pk.components for k, pk in readout.region_peaks(run).items()}, layout, counts, inner=inner)
        for counts, layout, run in results
    ]


def whole_phases(results: Traced) -> dict[Phase, PhaseBreakdown]:
    """The phases of a plan that traced the full depth: read off its one run."""
    pk = readout.phase_peaks(results[0][2])
    return {ph: readout.breakdown(ph, pk[ph].components) for ph in Phase}


@dataclass
class DepthOutcome(Generic[R]):
    """What :func:`extrapolated_depth` settled on: the plan it ran last, that plan's per-layout results, the
    full-depth phases and the warnings of the extrapolation that counts."""

    plan: DepthPlan
    results: R
    phases: dict[Phase, PhaseBreakdown]
    warnings: list[str]


def extrapolated_depth(
    spec: ModelSpec,
    strategy: Strategy,
    plan: DepthPlan,
    run: Callable[[DepthPlan], R],
    keyed: Callable[[R], Keyed],
    whole: Callable[[R], dict[Phase, PhaseBreakdown]],
    *,
    replan: Callable[[int], DepthPlan],
    say: Callable[[str, float], None] | None = None,
) -> DepthOutcome[R]:
    """Run ``plan``'s layouts (``run``), key and extrapolate them (``whole`` when the plan runs the full depth);
    when the forward's worst moment is off the line of a one-unit base (:func:`forward_peak_off_line`), run
    ``replan(2)`` instead. One place for the single-GPU trace, the DDP and TP ranks and ``--method measure``, so
    that none of them forgets the re-run (DDP did: tiny Llama pure-bf16 eager, forward +0.62% over the full
    depth)."""
    results = run(plan)
    if not plan.ext:
        return DepthOutcome(plan, results, whole(results), [])
    warnings: list[str] = []
    chosen: dict[Phase, Place] = {}
    phases = extrapolate_phases(keyed(results), plan.ext, plan.runs, warnings, plan.base_units, chosen)
    if not forward_peak_off_line(plan, chosen[Phase.FORWARD], spec, strategy):
        return DepthOutcome(plan, results, phases, warnings)
    if say is not None:
        say("the forward peaks inside a layer: running 2 and 3 units instead", 0.0)
    plan = replan(2)
    results = run(plan)
    if not plan.ext:
        return DepthOutcome(plan, results, whole(results), [])
    warnings = []
    phases = extrapolate_phases(keyed(results), plan.ext, plan.runs, warnings, plan.base_units)
    return DepthOutcome(plan, results, phases, warnings)


def _trainable_params(
    results: list[tuple[list[int], hf.Layout, rn.TraceRun]], ext: list[int], runs: list[hf.Run]
) -> int:
    """Trainable parameters at full depth: the base layout's, plus each extrapolated run's per-unit increment
    (the difference of two depths) times its missing units — every parameter when fully fine-tuning."""
    base = total = results[0][2].trainable_params
    for k, r in enumerate(ext):
        per_unit = results[k + 1][2].trainable_params - base  # each variant differs from the base by one unit
        total += per_unit * (runs[r].count - results[0][0][r])
    return total


def _fmt(d: Mapping[SdpaKernel, int]) -> str:
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
    base_units: int = BASE_UNITS,
    chosen: dict[Phase, Place] | None = None,
) -> dict[Phase, PhaseBreakdown]:
    """Each place of the base layout extrapolated to the full run counts, then each phase's largest place
    (recorded in ``chosen`` when given). ``keyed[0]`` is the base layout, ``keyed[n]`` the layout with one more
    unit of run ``ext[n - 1]``."""
    base = keyed[0]
    full: dict[Key, dict[Component, int]] = {}
    for key, comps in base.items():
        if key[1].end is RunEnd.MID:
            continue
        out = dict(comps)
        for n, r in enumerate(ext, start=1):
            other = keyed[n].get(key)
            if other is None:
                continue
            scale = runs[r].count - base_units
            for c in Component:
                out[c] = out.get(c, 0) + (other.get(c, 0) - comps.get(c, 0)) * scale
        full[key] = out
    # sanity: a middle unit never beats the extrapolated ones
    for n in range(1, len(keyed)):
        for (phase, place), comps in keyed[n].items():
            if place.end is RunEnd.MID:
                kept = (RunEnd.FIRST, RunEnd.LAST, RunEnd.BELOW_LAST, RunEnd.ABOVE_FIRST)  # the extrapolated units
                ends = [keyed[n].get((phase, Place(Span.UNIT, place.run, e))) for e in kept]
                top = max(sum(e.values()) for e in ends if e)
                if sum(comps.values()) > top:
                    warnings.append(f"{phase.value}: a middle unit peaks above the ends; extrapolation may be low")
    phases: dict[Phase, PhaseBreakdown] = {}
    for ph in Phase:
        cands = [(sum(v.values()), k[1], v) for k, v in full.items() if k[0] == ph]
        _, place, comps = max(cands, key=lambda x: x[0])
        if chosen is not None:
            chosen[ph] = place
        if any(v < 0 for v in comps.values()):
            warnings.append(f"{ph.value}: extrapolation produced a negative component; clamped to 0")
            comps = {c: max(0, v) for c, v in comps.items()}
        phases[ph] = readout.breakdown(ph, comps)
    return phases
