"""The trace as an allocator event stream, and the reserved memory the caching allocator would hold for it.

The tracker (:mod:`trainfit.trace.tracker`) numbers every storage allocation and every free with one tick
each, so its records *are* the ordered sequence of ``malloc`` / ``free`` calls a CUDA run makes (sizes
already rounded to 512 B, which the allocator's own rounding leaves unchanged by default). What the trace
cannot see are the allocations no tensor owns: the cuBLAS and cuBLASLt workspaces
(:mod:`trainfit.allocator.workspaces`). We add them where the H200 trace shows them: the main thread's
cuBLAS and cuBLASLt workspaces at the first forward pass, the autograd thread's cuBLAS workspace right after
the output of the first backward matmul (the head's: the real trace has it between the head's weight-gradient
and input-gradient matmuls). Where it lands matters beyond its 32 MiB: it is never freed, so ``empty_cache``
cannot release the segment it sits in (on the H200 a 4.6 GiB logits segment after the first case of a process).

Full depth by stitching. Fragmentation is not linear in depth, so we do not extrapolate reserved bytes; we
rebuild the *event stream* of the full model from a trace with three units of the repeated layer run
(first, middle, last) by repeating the middle unit's events, forward and backward, to the real count
(backward copies run last-first). A storage keeps its identity across the copies:

* one allocated by the middle unit gets a fresh key per copy;
* inside a copy, a free of a storage born in the unit before (the first unit, or the previous copy) frees
  that unit's corresponding storage (the k-th allocation of one unit's region corresponds to the k-th of the
  next one's; :attr:`Stitched.size_mismatches` counts pairs of different sizes), and symmetrically in
  backward for the unit after;
* a middle-unit storage freed by the last unit is the last copy's, by the first unit the first copy's, and
  outside the units (``zero_grad``, the end of the stack) every copy's that is still live;
* outside the units' regions, the per-parameter work (weights at setup, optimizer states, each foreach
  op's outputs) shows up as three equal consecutive blocks of allocations, one per unit
  (``_mark_repeats``); the middle block is repeated like a unit. Never inside the head's region: a chunked
  loss repeats its ops per chunk in blocks as long as a unit's parameter count (tests/trace/test_events.py).

The stitched stream is checked (:func:`check_stream`: every free names a live allocation); if the units
are not alike enough for that, or the model has several repeated runs, or a free lands several units after the
storage's own (:func:`frees_units_later`), :func:`reserved_from_trace` traces the full depth instead. On tiny
models (with and without checkpointing, pure bf16 and fused AdamW, gradient accumulation, multi-layer checkpoint
segments, GPT-2, tied Qwen2) the stitched stream has exactly the events and the peaks of a full-depth trace
(tests/trace/test_events.py)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from trainfit.allocator import AllocatorConfig, AllocatorResult, Event, Op, Simulator, simulate
from trainfit.allocator.workspaces import TARGET_TORCH, Thread, training_workspaces, workspace_key
from trainfit.arch.spec import ModelSpec
from trainfit.cuda_facts import allocator_bytes
from trainfit.result import Phase
from trainfit.strategy import Strategy
from trainfit.trace import runner as rn
from trainfit.trace.timeline import Interval, Label

#: aten ops that call cuBLAS/cuBLASLt on CUDA (aten/src/ATen/native/cuda/Blas.cpp): the first one a thread runs
#: creates its handle's workspace (``getCurrentCUDABlasHandle`` → ``setWorkspaceForHandle``), after the op has
#: allocated its output.
BLAS_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "_scaled_mm", "_int_mm"})


def tracker_events(run: rn.TraceRun) -> list[Event]:
    """The run's allocations and frees in order (storages the step never puts on the device excluded)."""
    tr = run.tracker
    tr.merge_inplace_accumulations()
    slots: list[Event | None] = [None] * (tr.t + 2)
    for idx, rec in enumerate(tr.records):
        if tr.component(rec) is None:
            continue
        slots[rec.alloc_t] = Event(Op.ALLOC, idx, rec.nbytes)
        if rec.free_t is not None:
            slots[rec.free_t] = Event(Op.FREE, idx)
    return [e for e in slots if e is not None]


def tracker_ticks(run: rn.TraceRun) -> list[int]:
    """The tick of each event of :func:`tracker_events`, in the same order."""
    tr = run.tracker
    tr.merge_inplace_accumulations()  # (a no-op after the first reader; it freezes the ticks)
    kept = [False] * (tr.t + 2)
    for rec in tr.records:
        if tr.component(rec) is None:
            continue
        kept[rec.alloc_t] = True
        if rec.free_t is not None:
            kept[rec.free_t] = True
    return [t for t, k in enumerate(kept) if k]


def with_inserts(
    events: list[Event], ticks: list[int], inserts: Mapping[int, list[Event]]
) -> tuple[list[Event], list[int]]:
    """``events`` (at ``ticks``) with each tick's ``inserts`` after every event at or before that tick; the inserted
    events take their tick."""
    pending = sorted(inserts.items())
    out: list[Event] = []
    out_ticks: list[int] = []
    for e, t in zip(events, ticks, strict=True):
        while pending and pending[0][0] < t:
            tick, inserted = pending.pop(0)
            out += inserted
            out_ticks += [tick] * len(inserted)
        out.append(e)
        out_ticks.append(t)
    for tick, inserted in pending:
        out += inserted
        out_ticks += [tick] * len(inserted)
    return out, out_ticks


def with_workspaces(
    events: list[Event],
    run: rn.TraceRun,
    compute_capability: tuple[int, int],
    env: Mapping[str, str] | None = None,
    *,
    rocm_arch: str | None = None,
    torch_version: tuple[int, int] = TARGET_TORCH,
) -> list[Event]:
    """Insert the cuBLAS/cuBLASLt workspace allocations (never freed) at the first forward and backward
    (``rocm_arch``: an AMD GPU's, sized as hipBLAS/hipBLASLt's: :mod:`trainfit.allocator.workspaces`)."""
    inserts = workspace_inserts(run, compute_capability, env, rocm_arch=rocm_arch, torch_version=torch_version)
    return with_inserts(events, tracker_ticks(run), inserts)[0]


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceReserved:
    """Reserved memory predicted for a traced run."""

    result: AllocatorResult
    events: int
    layers_traced: int
    layers_full: int
    stitched: bool
    #: Unit storages matched across units with different sizes (0: the repeated units are alike).
    size_mismatches: int = 0
    #: Why a stitched stream was rejected (and the full depth traced instead); None if it was not.
    stitch_problem: str | None = None
    #: The replayed events (workspaces included), to simulate again under a capacity (the fit verdict's
    #: borderline case, :func:`trainfit.allocator.report.capped_run`) without tracing again.
    stream: tuple[Event, ...] = field(default=(), repr=False, compare=False)
    #: Per phase, the allocator's blocks above the requests at its peak (:func:`phase_rounding`; fresh process).
    phase_rounding: tuple[tuple[Phase, int], ...] = ()


def reserved_from_run(
    run: rn.TraceRun,
    config: AllocatorConfig | None = None,
    *,
    compute_capability: tuple[int, int] = (9, 0),
    rocm_arch: str | None = None,
    env: Mapping[str, str] | None = None,
    torch_version: tuple[int, int] = TARGET_TORCH,
    capacity_bytes: int | None = None,
    layout: bool = False,
) -> AllocatorResult:
    """Replay a (full-depth) run's events plus the workspaces through the allocator model."""
    events = with_workspaces(
        tracker_events(run), run, compute_capability, env, rocm_arch=rocm_arch, torch_version=torch_version
    )
    return simulate(events, config, capacity_bytes=capacity_bytes, layout=layout)


# -- full depth by stitching ---------------------------------------------------------------------------

#: Units of the extrapolated run in the trace that is stitched: the first, one middle unit, the last.
STITCH_UNITS = 3


def frees_units_later(strategy: Strategy) -> bool:
    """Activation offloading under whole-layer checkpointing: each checkpoint input's device tensor is freed when the
    forward stash drops it, ``OFFLOAD_FWD_STASH`` segments later (trainfit.analytic.savers), beyond the unit before
    that stitching follows; in a three-unit trace every such free falls at the final norm, so the stitched stream
    kept every layer's input to the end of the forward (llama-3.2-1b amp-bf16 2 × 1024: reserved −4.11% of the
    full-depth trace's, LoRA over qwen2.5-0.5b +3.09%, its allocated peak +3.1%). Such a run is traced at full depth."""
    return strategy.savers.activation_offload and strategy.checkpointing.whole_layers


@dataclass(slots=True)
class _Ev:
    alloc: bool
    rec: int
    size: int
    tick: int
    unit: int | None = None  # 0, 1, 2: which traced unit's event this is; None: not a unit's
    group: int = -1  # the region (or repeated block) the unit event belongs to
    backward: bool = False  # a backward region: copies run last-first


def _raw_events(run: rn.TraceRun) -> list[_Ev]:
    tr = run.tracker
    tr.merge_inplace_accumulations()
    slots: list[_Ev | None] = [None] * (tr.t + 2)
    for idx, rec in enumerate(tr.records):
        if tr.component(rec) is None:
            continue
        slots[rec.alloc_t] = _Ev(True, idx, rec.nbytes, rec.alloc_t)
        if rec.free_t is not None:
            slots[rec.free_t] = _Ev(False, idx, rec.nbytes, rec.free_t)
    return [e for e in slots if e is not None]


def _unit_intervals(run: rn.TraceRun, units: tuple[int, int, int]) -> list[tuple[int, int, int, bool]]:
    """(first tick, last tick, which of the three units, backward?) of every pass's unit regions."""
    out: list[tuple[int, int, int, bool]] = []
    for sm in run.timeline.steps:
        for pm in sm.passes:
            k = len(pm.unit_fwd)
            for which, u in enumerate(units):
                if u < k:
                    end = pm.unit_fwd[u + 1] if u + 1 < k else pm.stack_fwd_end
                    out.append((pm.unit_fwd[u] + 1, end, which, False))
            kb = len(pm.unit_bwd)
            if kb and pm.stack_bwd_end >= 0:
                for j in range(kb):
                    u = kb - 1 - j
                    if u in units:
                        end = pm.unit_bwd[j + 1] if j + 1 < kb else pm.stack_bwd_end
                        out.append((pm.unit_bwd[j] + 1, end, units.index(u), True))
    return out


def _tokens(evs: list[_Ev]) -> list[tuple[bool, int]]:
    return [(e.alloc, e.size) for e in evs]


def _mark_repeats(evs: list[_Ev], lo: int, hi: int, periods: tuple[int, ...], next_group: int) -> int:
    """In ``evs[lo:hi]`` (outside the unit regions), find three equal consecutive blocks of a multiple of one of
    ``periods`` events (the per-parameter work of a foreach op, the weights, the optimizer states: one block
    per unit; a unit's parameters, or under an adapter or --freeze its trainable ones) and label them units 0, 1,
    2."""
    toks = _tokens(evs[lo:hi])
    n = len(toks)
    lengths = sorted({p * mult for p in periods if p > 0 for mult in (4, 3, 2, 1)}, reverse=True)
    i = 0
    while i < n:
        found = 0
        for L in lengths:
            if i + 3 * L <= n and toks[i : i + L] == toks[i + L : i + 2 * L] == toks[i + 2 * L : i + 3 * L]:
                found = L
                break
        if not found:
            i += 1
            continue
        for which in range(3):
            for e in evs[lo + i + which * found : lo + i + (which + 1) * found]:
                if e.alloc:  # a free follows its storage: every copy's, where unit 1's is freed
                    e.unit, e.group = which, next_group
        next_group += 1
        i += 3 * found
    return next_group


@dataclass(frozen=True, slots=True, kw_only=True)
class Stitched:
    events: list[Event]
    #: Unit-0/unit-2 storages matched to a unit-1 storage of another size (0 when the units are alike).
    size_mismatches: int
    #: The traced tick each event comes from (a unit-1 copy's: the traced unit 1's; an insert: its tick).
    ticks: list[int] = field(default_factory=list)


def stitch_events(
    run: rn.TraceRun,
    *,
    units: tuple[int, int, int],
    full_units: int,
    params_per_unit: int | tuple[int, ...],
    inserts: Mapping[int, list[Event]] | None = None,
) -> Stitched:
    """The event stream of the model with ``full_units`` units, from a run whose ``units`` (indices in the
    traced stack) are three consecutive units of the repeated run: unit 1's events are emitted
    ``full_units − 2`` times (see the module docstring). ``inserts``: events to emit after a tick."""
    evs = _raw_events(run)
    copies = full_units - 2
    if copies < 1:
        raise ValueError("stitching needs at least three units in the full model")
    # 1. events inside the three units' regions
    ivs = sorted(_unit_intervals(run, units))
    ticks = [e.tick for e in evs]

    group = 0
    covered = [False] * len(evs)
    # one group per pass and direction: the unit-0/1/2 regions of that pass share it
    by_pass: dict[tuple[int, bool], int] = {}
    for lo_t, hi_t, which, backward in ivs:
        lo, hi = bisect_left(ticks, lo_t), bisect_right(ticks, hi_t)
        key = (_pass_of(run, lo_t), backward)
        if key not in by_pass:
            by_pass[key] = group
            group += 1
        for i in range(lo, hi):
            evs[i].unit, evs[i].group, evs[i].backward = which, by_pass[key], backward
            covered[i] = True
    # 2. per-parameter repeats outside them; never in the head's region, whose ops may repeat per chunk of a chunked
    # loss (torchtune's) in blocks as long as a unit's parameter count — no unit's work
    recs = run.tracker.records
    barrier = [c or recs[e.rec].head for c, e in zip(covered, evs, strict=True)]
    i = 0
    while i < len(evs):
        if barrier[i]:
            i += 1
            continue
        j = i
        while j < len(evs) and not barrier[j]:
            j += 1
        periods = params_per_unit if isinstance(params_per_unit, tuple) else (params_per_unit,)
        group = _mark_repeats(evs, i, j, periods, group)
        i = j
    # 3. which unit each storage belongs to, and the unit-0 -> unit-1 -> unit-2 correspondence
    rec_unit: dict[int, int] = {}
    allocs: dict[tuple[int, int], list[_Ev]] = {}
    for e in evs:
        if e.alloc and e.unit is not None:
            rec_unit[e.rec] = e.unit
            allocs.setdefault((e.group, e.unit), []).append(e)
    phi10: dict[int, int] = {}
    phi21: dict[int, int] = {}
    mismatches = 0
    for (g, u), lst in allocs.items():
        if u == 1:
            continue
        mid = allocs.get((g, 1), [])
        for a, b in zip(lst, mid, strict=False):
            (phi10 if u == 0 else phi21)[a.rec] = b.rec
            mismatches += a.size != b.size
        mismatches += abs(len(lst) - len(mid))
    # 4. emit
    nrec = len(run.tracker.records)

    def copy_key(rec: int, c: int) -> int:
        return rec + c * nrec

    out: list[Event] = []
    out_ticks: list[int] = []
    live: set[int] = set()
    pending = sorted((inserts or {}).items())
    now = 0  # the tick of the traced event being emitted

    def flush(tick: int | None) -> None:
        while pending and (tick is None or pending[0][0] <= tick):
            at, inserted = pending.pop(0)
            out.extend(inserted)
            out_ticks.extend([at] * len(inserted))

    def alloc(key: int, size: int) -> None:
        live.add(key)
        out.append(Event(Op.ALLOC, key, size))
        out_ticks.append(now)

    def free(key: int) -> None:
        live.discard(key)
        out.append(Event(Op.FREE, key))
        out_ticks.append(now)

    def emit_block(block: list[_Ev]) -> None:
        order = range(copies, 0, -1) if block[0].backward else range(1, copies + 1)
        first = order[0]
        nonlocal now
        for c in order:
            for e in block:
                now = e.tick
                if e.alloc:
                    alloc(copy_key(e.rec, c), e.size)
                    continue
                ru = rec_unit.get(e.rec)
                if ru == 1:
                    free(copy_key(e.rec, c))
                elif ru == 0:  # the unit before this copy: the first unit, or the previous copy
                    free(e.rec if c == 1 else copy_key(phi10.get(e.rec, e.rec), c - 1))
                elif ru == 2:  # the unit after this copy (backward): the last unit, or the next copy
                    free(e.rec if c == copies else copy_key(phi21.get(e.rec, e.rec), c + 1))
                elif c == first:
                    free(e.rec)

    i = 0
    n = len(evs)
    while i < n:
        e = evs[i]
        if e.unit == 1:
            j = i
            while j < n and evs[j].unit == 1 and evs[j].group == e.group:
                j += 1
            emit_block(evs[i:j])
            flush(evs[j - 1].tick)
            i = j
            continue
        now = e.tick
        if e.alloc:
            alloc(e.rec, e.size)
        elif rec_unit.get(e.rec) == 1:
            # unit 1's storage freed by another unit (its neighbour: the adjacent copy) or outside the units
            # (every copy whose storage is still live: the others went with their neighbour copy)
            if e.unit == 2 and copy_key(e.rec, copies) in live:
                free(copy_key(e.rec, copies))
            elif e.unit == 0 and copy_key(e.rec, 1) in live:
                free(copy_key(e.rec, 1))
            else:
                for c in range(1, copies + 1):
                    if copy_key(e.rec, c) in live:
                        free(copy_key(e.rec, c))
        else:
            free(e.rec)
        flush(e.tick)
        i += 1
    flush(None)
    return Stitched(events=out, size_mismatches=mismatches, ticks=out_ticks)


def _pass_of(run: rn.TraceRun, tick: int) -> int:
    p = 0
    for sm in run.timeline.steps:
        for pm in sm.passes:
            if tick <= pm.bwd_end:
                return p
            p += 1
    return p


def check_stream(events: list[Event]) -> str | None:
    """``None`` if every free names a live allocation and no live key is allocated again, else why not."""
    live: set[int] = set()
    for i, e in enumerate(events):
        if e.op is Op.ALLOC:
            if e.key in live:
                return f"event {i}: key {e.key} allocated twice"
            live.add(e.key)
        elif e.op is Op.FREE:
            if e.key not in live:
                return f"event {i}: key {e.key} freed but not live"
            live.discard(e.key)
    return None


def first_blas_output(run: rn.TraceRun, start: int, end: int) -> int | None:
    """The tick of the first device storage an op that runs on cuBLAS (:data:`BLAS_OPS`) makes between ticks
    ``start`` and ``end``; None if there is none."""
    tr = run.tracker
    for rec in tr.records:  # in the order they were made
        if rec.alloc_t < start:
            continue
        if rec.alloc_t > end:
            return None
        if rec.op.partition(".")[0] in BLAS_OPS and tr.component(rec) is not None:
            return rec.alloc_t
    return None


def workspace_inserts(
    run: rn.TraceRun,
    compute_capability: tuple[int, int],
    env: Mapping[str, str] | None,
    *,
    rocm_arch: str | None = None,
    torch_version: tuple[int, int] = TARGET_TORCH,
) -> dict[int, list[Event]]:
    """The workspace allocations to emit after a tick of ``run``: the main thread's at the first forward, the
    autograd thread's right after the first backward matmul's output (where the H200 trace has it)."""
    steps = run.timeline.steps
    if not steps or not steps[0].passes:
        return {}
    first = steps[0].passes[0]
    bwd = first_blas_output(run, first.bwd_start, first.bwd_end)
    at: dict[int, list[Event]] = {}
    workspaces = training_workspaces(compute_capability, env, rocm_arch=rocm_arch, torch_version=torch_version)
    for k, ws in enumerate(workspaces):  # keys: workspace_key (records' are ≥ 0)
        tick = first.fwd_start if ws.thread is Thread.MAIN else first.bwd_start if bwd is None else bwd
        at.setdefault(tick, []).append(Event(Op.ALLOC, workspace_key(k), ws.size_bytes))
    return at


def phase_rounding(
    events: list[Event], ticks: list[int], intervals: list[Interval[Label]], config: AllocatorConfig | None = None
) -> tuple[tuple[Phase, int], ...]:
    """Per phase, the bytes ``max_memory_allocated`` counts above the requests at that phase's peak: ``events`` (at
    the traced ``ticks``) through the caching-allocator simulation, each phase interval's block peak less its request
    peak (both from the level where it starts), the largest over the ``intervals`` (the steady-state steps'); what
    :mod:`trainfit.analytic.blocks` reads from the analytic stream, here from the trace's own events."""
    starts = [iv.start for iv in intervals]

    def label_of(tick: int) -> Label | None:
        # the last interval that starts before the tick: an interval's start is the tick of the mark, the last event
        # before it, whose state is the interval's level at the start (reset_peak_stats there)
        k = bisect_left(starts, tick) - 1
        return intervals[k].label if k >= 0 and tick <= intervals[k].end else None

    sim = Simulator(config)
    requests: dict[int, int] = {}
    requested = peak_requested = 0
    rounding = dict.fromkeys(Phase, 0)
    current: Label | None = None
    for e, t in zip(events, ticks, strict=True):
        label = label_of(t)
        if label != current:
            if current is not None:
                ph = current.phase
                rounding[ph] = max(rounding[ph], sim.peak_allocated_bytes - peak_requested)
            current = label
            sim.reset_peak_stats()
            peak_requested = requested
        sim.event_index += 1
        if e.op is Op.ALLOC:
            sim.malloc(e.key, e.size_bytes, e.stream)
            requests[e.key] = r = allocator_bytes(e.size_bytes)
            requested += r
            peak_requested = max(peak_requested, requested)
        elif e.op is Op.FREE or e.op is Op.FREE_COMPLETED:
            sim.free_completed(e.key)
            requested -= requests.pop(e.key, 0)
        elif e.op is Op.FREE_REQUESTED:
            sim.free_requested(e.key)
        else:
            sim.empty_cache()
    if current is not None:
        rounding[current.phase] = max(rounding[current.phase], sim.peak_allocated_bytes - peak_requested)
    return tuple(rounding.items())


def reserved_from_trace(
    spec: ModelSpec,
    strategy: Strategy,
    config: AllocatorConfig | None = None,
    *,
    compute_capability: tuple[int, int] = (9, 0),
    rocm_arch: str | None = None,
    env: Mapping[str, str] | None = None,
    torch_version: tuple[int, int] = TARGET_TORCH,
    capacity_bytes: int | None = None,
    stitch: bool = True,
    steps: int = 2,
    layout: bool = False,
) -> TraceReserved:
    """Predicted ``max_memory_reserved`` of ``spec`` trained under ``strategy``: trace the model (three
    units of its repeated layer run, stitched to full depth; or the full depth when there is no run to
    stitch or ``stitch=False``), add the workspaces, and replay the events through the allocator model."""
    from trainfit.trace import depth, hf

    adamw_impl = strategy.optimizer_impl.value
    stitch = stitch and not frees_units_later(strategy)
    plan = depth.plan_depth(spec, strategy, extrapolate=stitch)
    if stitch and len(plan.ext) == 1 and plan.runs[plan.ext[0]].count > STITCH_UNITS:
        r = plan.ext[0]
        counts = [STITCH_UNITS if k == r else run.count for k, run in enumerate(plan.runs)]
        blocks = hf.blocks_for(plan.full_layers, strategy.checkpointing)
        lay = hf.layout_for(blocks, plan.runs, counts)
        plan3 = replace(plan, layouts=[(counts, lay)])
        done = depth.run_layout(spec, strategy, plan3, lay, steps=steps, adamw_impl=adamw_impl)
        unit_ids = [u for u, rr in enumerate(lay.unit_run) if rr == r]
        run = plan.runs[r]
        unit_layers = [i for b in blocks[run.start : run.start + run.period] for i in b.layers]
        per_unit = sum(len(list(plan.stack[i].parameters())) for i in unit_layers)
        # with adapters or --freeze a unit's parameters (its adapters too) and its trainable ones make blocks of
        # their own (the weights; the optimizer states): the traced unit's counts, its last layer's being alike
        n = len(unit_layers)
        every, trainable = done.layer_params[-1] if done.layer_params else (0, 0)
        st = stitch_events(
            done.run,
            units=(unit_ids[0], unit_ids[1], unit_ids[2]),
            full_units=run.count,
            params_per_unit=(per_unit, every * n, trainable * n),
            inserts=workspace_inserts(
                done.run, compute_capability, env, rocm_arch=rocm_arch, torch_version=torch_version
            ),
        )
        problem = check_stream(st.events)
        if problem is not None:  # the units are not alike enough to stitch: trace the full depth
            return replace(
                reserved_from_trace(
                    spec,
                    strategy,
                    config,
                    compute_capability=compute_capability,
                    rocm_arch=rocm_arch,
                    env=env,
                    torch_version=torch_version,
                    capacity_bytes=capacity_bytes,
                    stitch=False,
                    steps=steps,
                    layout=layout,
                ),
                stitch_problem=problem,
            )
        res = simulate(st.events, config, capacity_bytes=capacity_bytes, layout=layout)
        return TraceReserved(
            result=res,
            stream=tuple(st.events),
            events=len(st.events),
            layers_traced=len(lay.layers),
            layers_full=plan.full_layers,
            stitched=True,
            size_mismatches=st.size_mismatches,
            phase_rounding=phase_rounding(st.events, st.ticks, done.run.timeline.phase_intervals(), config),
        )
    if plan.ext:
        plan = depth.plan_depth(spec, strategy, extrapolate=False)
    counts, lay = plan.layouts[0]
    done = depth.run_layout(spec, strategy, plan, lay, steps=steps, adamw_impl=adamw_impl)
    events, ticks = with_inserts(
        tracker_events(done.run),
        tracker_ticks(done.run),
        workspace_inserts(done.run, compute_capability, env, rocm_arch=rocm_arch, torch_version=torch_version),
    )
    res = simulate(events, config, capacity_bytes=capacity_bytes, layout=layout)
    return TraceReserved(
        result=res,
        stream=tuple(events),
        events=len(events),
        layers_traced=len(lay.layers),
        layers_full=plan.full_layers,
        stitched=False,
        phase_rounding=phase_rounding(events, ticks, done.run.timeline.phase_intervals(), config),
    )
