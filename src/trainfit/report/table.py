"""Rich tables for ``trainfit estimate``: the answer first (verdict and peak), then where the bytes go.
Binary units, always labelled GiB; only the rule of thumb's own table shows the article's decimal GB.

Everything comes from the :class:`~trainfit.result.MemoryReport`, which echoes its inputs; the renderer
computes nothing but formatting. ``verbose`` adds the bytes per parameter, the comparison with the rule
of thumb, per-module tables and the notes.
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from trainfit.result import (
    AnalyticDetails,
    Component,
    Difference,
    FitTier,
    FitVerdict,
    MeasureDetails,
    MemoryReport,
    Method,
    RankMemory,
    RuleOfThumbDetails,
    Suggestion,
    SuggestionKind,
    TraceDetails,
)
from trainfit.strategy import Optimizer, Strategy
from trainfit.strategy.adapters import AdapterKind, Quantization
from trainfit.strategy.recipe import Float8
from trainfit.units import fmt_binary, fmt_count, fmt_gb, fmt_gib, gib


def _header(report: MemoryReport) -> Text:
    t = Text()
    t.append(report.model_name, style="bold")
    kind = report.model.architecture or report.model.model_type if report.model is not None else ""
    t.append(f"  {fmt_count(report.params)} params  {kind}\n")
    s = report.strategy
    if s is not None:
        t.append(
            f"{s.precision.value}"
            + (f" · fp8 {s.float8.value} linears" if s.float8 is not Float8.NONE else "")
            + f" · {s.optimizer.value}"
            + (f" ({s.optimizer_impl.value})" if s.optimizer is Optimizer.ADAMW else "")
            + f" · checkpointing {s.checkpointing.value} · {s.attention.value}"
            f" · micro-batch {s.micro_batch} × seq {s.seq_len} · "
            + (
                f"{s.parallelism.microbatches} pipeline micro-batches"
                if s.parallelism.pipeline > 1
                else f"grad-accum {s.grad_accum}"
            )
            + f" (effective batch {s.effective_batch}"
            + (f", global {s.global_batch})" if s.parallelism.data > 1 else ")")
        )
        if s.is_distributed:
            par = s.parallelism
            t.append(
                f"\n{s.world_size} GPUs = data {par.data} × tensor {par.tensor} × pipeline {par.pipeline}"
                + (" (sequence parallel)" if par.sequence_parallel else "")
                + f" · sharding {s.sharding.value} · offload {s.offload.flag}"
            )
        what = _what_trains(report)
        if what:
            t.append("\n" + what)
        if s.savers.names():
            t.append("\nsavers: " + " ".join(s.savers.names()))
    return t


def _what_trains(report: MemoryReport) -> str:
    """The fine-tuning setup in one line (nothing for full training of the recipe's weights): the adapter as PEFT
    configures it, the base weights' storage, the frozen patterns, and how many parameters train."""
    s = report.strategy
    assert s is not None
    a, base = s.adapter, s.base_weights
    if a is None and base.is_default:
        return ""
    parts: list[str] = []
    if a is not None:
        name = "DoRA" if a.kind is AdapterKind.DORA else "LoRA"
        if base.kbit_prepared and base.quantization in (Quantization.NF4, Quantization.FP4):
            name = "QLoRA" if a.kind is AdapterKind.LORA else f"{name} (QLoRA-style)"
        parts.append(f"{name} r{a.rank} α{a.alpha} on {', '.join(a.targets)}, {a.dtype.value} adapters")
        if a.dropout:
            parts[-1] += f", dropout {a.dropout:g}"
    if base.quantization is not Quantization.NONE:
        int8 = base.quantization is Quantization.INT8
        parts.append(
            f"base {base.quantization.value}"
            + (" (LLM.int8)" if int8 else " + double quant" if base.double_quant else "")
        )
    elif base.dtype is not None:
        parts.append(f"base {base.dtype.value}")
    if base.frozen:
        parts.append("frozen " + ", ".join(base.frozen))
    if report.params:
        parts.append(f"{fmt_count(report.trainable_params)} trainable ({report.trainable_params / report.params:.2%})")
    return " · ".join(parts)


def _answer(report: MemoryReport) -> Text:
    """The verdict (with a GPU) and the peak, in one or two lines."""
    t = Text()
    if report.fit is not None:
        t.append_text(_verdict(report.fit))
        t.append("\n")
    if report.speed is not None:
        sp = report.speed
        t.append(
            f"Speed model: {sp.step_seconds:.2f} s per optimizer step, {sp.tokens_per_second:,.0f} tokens/s, "
            f"MFU {sp.mfu:.0%} (docs/speed.md)\n"
        )
    if report.method is Method.RULE_OF_THUMB:
        total = report.peak_bytes + report.overhead.total_bytes
        t.append(f"Rule of thumb: {fmt_gib(total)} ({fmt_gb(total)} as the article counts it)", style="bold")
        return t
    t.append(f"Peak allocated {fmt_gib(report.peak_bytes)}", style="bold")
    t.append(
        f" during {report.peak_phase.value} (torch.cuda.max_memory_allocated); "
        f"reserved ≈ {fmt_gib(report.reserved_estimate_bytes)}; "
        f"nvidia-smi ≈ {fmt_gib(report.nvidia_smi_estimate_bytes)} "
        f"(+{fmt_gib(report.overhead.outside_allocator_bytes)} outside the allocator: {_outside_parts(report)})"
    )
    return t


def _outside_parts(report: MemoryReport) -> str:
    """What the outside-allocator figure is made of: with many GPUs, whether NCCL's buffers are in it and on what
    basis (a one-rank measurement, or not counted)."""
    o = report.overhead
    if o.nccl_bytes:
        from trainfit.analytic.parallel import nccl_is_lower_bound

        w = report.world_size
        lower = report.strategy is not None and nccl_is_lower_bound(report.strategy)
        bound = "a lower bound" if lower else "not a bound either way"
        return f"CUDA context, kernels and NCCL {fmt_gib(o.nccl_bytes)} as measured at world size 1" + (
            f", {bound} at world size {w}" if w > 1 else ""
        )
    if o.nccl_basis:
        return "CUDA context and kernels; NCCL's buffers not counted"
    return "CUDA context and kernels"


def _verdict(f: FitVerdict) -> Text:
    t = Text()
    host_short = f.host_free_bytes is not None and f.host_free_bytes < 0
    if host_short:  # --host-memory-gib: what trainfit plan rules out, said first; the GPU's verdict follows
        assert f.host_memory_bytes is not None and f.host_usable_bytes is not None
        t.append("DOES NOT FIT the host", style="bold red")
        t.append(
            f": needs {fmt_gib(f.host_required_bytes)} of CPU memory per node of {fmt_gib(f.host_usable_bytes)} "
            f"usable (--host-memory-gib {gib(f.host_memory_bytes):g} − {f.headroom_fraction:.0%} headroom), short "
            f"by {fmt_gib(f.host_required_bytes - f.host_usable_bytes)}. On the GPU: "
        )
    if f.fits:
        t.append("FITS", style="bold green")
        t.append(f" on {f.gpu_id}: needs {fmt_gib(f.required_bytes)} of {fmt_gib(f.usable_bytes)} usable, ")
        t.append(f"{fmt_gib(f.free_bytes)} free after {f.headroom_fraction:.0%} headroom. ")
    elif f.tier is FitTier.FITS_WITH_FLUSHES:
        t.append(flushes_headline(f), style="bold yellow")
        t.append(
            f" on {f.gpu_id}: the uncapped reserve needs {fmt_gib(f.required_bytes)} of {fmt_gib(f.usable_bytes)} "
            f"usable (short by {fmt_gib(-f.free_bytes)}), but the allocated peak fits and the simulated allocator "
            "runs the steps within it by freeing its cache when cudaMalloc fails (each flush an implicit "
            "empty_cache: slower steps, and fragmentation may vary run to run). "
        )
    else:
        t.append("DOES NOT FIT", style="bold red")
        t.append(f" on {f.gpu_id}: needs {fmt_gib(f.required_bytes)} of {fmt_gib(f.usable_bytes)} usable ")
        t.append(
            f"({fmt_gib(f.gpu_memory_bytes)} − {f.headroom_fraction:.0%} headroom), short by {fmt_gib(-f.free_bytes)}. "
        )
    plain = " without cache flushes" if f.tier is FitTier.FITS_WITH_FLUSHES else ""
    # under --host-memory-gib the search held each micro-batch's host memory to the limit too
    held = plain + (" the GPU and the host" if f.host_usable_bytes is not None else "")
    if f.max_micro_batch is None:
        t.append("Largest micro-batch: not searched with this method (--method analytic searches it).")
    elif f.max_micro_batch == 0:
        t.append(f"Not even micro-batch 1 fits{held}.")
    elif f.max_micro_batch_capped:
        t.append(f"Largest micro-batch that fits{held}: at least {f.max_micro_batch} (the search stops there).")
    else:
        t.append(f"Largest micro-batch that fits{held}: {f.max_micro_batch}.")
    if plain and (f.suggestions or f.fixes):
        t.append(" To fit without cache flushes:")
    for s in f.suggestions:  # why it does not fit
        t.append(_suggestion(s, checked_fixes=bool(f.fixes)))
    if f.host_usable_bytes is not None and not host_short and f.host_required_bytes:
        t.append(
            f" Host memory per node: {fmt_gib(f.host_required_bytes)} of {fmt_gib(f.host_usable_bytes)} usable "
            "(--host-memory-gib less the headroom)."
        )
    if f.fixes_searched and not f.fixes and f.host_memory_bytes is not None:
        t.append(
            f"\nNo checked fix (trainfit plan) fits within --host-memory-gib {gib(f.host_memory_bytes):g}: trainfit "
            "plan with the same flags says what would."
        )
    if f.fixes:  # what fits, checked by the planner with this estimate
        within = "" if f.host_usable_bytes is None else " and within --host-memory-gib"
        t.append(f"\nChecked fixes (trainfit plan; each fits by this estimate{within}):")
        for i, s in enumerate(f.fixes, 1):
            t.append(f"\n  {i}. {' '.join(s.flags) or '(as given)'}: {s.reason}")
    return t


def flushes_headline(f: FitVerdict) -> str:
    """The verdict's head words in the middle tier: "FITS WITH 3 CACHE FLUSHES"."""
    n = f.cache_flushes
    return f"FITS WITH {n} CACHE FLUSH{'' if n == 1 else 'ES'}"


def _suggestion(s: Suggestion, *, checked_fixes: bool) -> str:
    """One suggestion as a sentence. The model-states diagnosis keeps its unchecked example flags (``e.g. ...``)
    only when the planner found no checked fix: its fixes, printed below, replace them (issue 14)."""
    if s.kind in (SuggestionKind.SMALLER_MICRO_BATCH, SuggestionKind.EXPANDABLE_SEGMENTS):
        return f" Try {' '.join(s.flags)}: {s.reason}."
    assert s.states_bytes is not None
    if s.kind is SuggestionKind.NEEDS_SHARDING:
        return (
            " The model states alone (weights, gradients, master weights, optimizer states) take more than the "
            f"usable memory: no batch size or checkpointing can help. Even pure-bf16 with 8-bit AdamW needs "
            f"{fmt_gib(s.states_bytes)} for them: this model needs sharding"
            + ("." if checked_fixes else " (e.g. --gpus 8 --sharding fsdp).")
        )
    return (
        f" The model states alone (weights, gradients, master weights, optimizer states) take "
        f"{fmt_gib(s.states_bytes)}, more than the usable memory: no batch size or checkpointing can help"
        + ("." if checked_fixes else f". A leaner precision recipe or optimizer can (e.g. {', '.join(s.flags)}).")
    )


def _rule_of_thumb(report: MemoryReport) -> Group:
    table = Table(title="The article's rule of thumb (decimal GB)", title_justify="left")
    table.add_column("term")
    table.add_column("formula")
    table.add_column("GB", justify="right")
    for term in report.terms:
        table.add_row(term.name, term.formula, f"{term.bytes / 1e9:.2f}")
    total = report.peak_bytes + report.overhead.total_bytes
    table.add_row("total", "point value (c = 15, 1.5 GB)", f"{total / 1e9:.2f}", style="bold")
    parts: list[Table | Text] = [table]
    d = report.details
    if isinstance(d, RuleOfThumbDetails) and report.low_bytes is not None and report.high_bytes is not None:
        parts.append(
            Text(
                f"range {fmt_gb(report.low_bytes)} – {fmt_gb(report.high_bytes)} (activations "
                f"{fmt_gb(d.activations_low_bytes)} – {fmt_gb(d.activations_high_bytes)}, overhead 1–2 GB)"
            )
        )
    return Group(*parts)


def _phases(report: MemoryReport) -> Table:
    peak_phase = report.peak_phase
    table = Table(title=f"Allocated memory by phase (GiB) — method: {report.method.value}", title_justify="left")
    table.add_column("component")
    for p in report.phases:
        label = p.phase.value + (" (peak)" if p.phase == peak_phase else "")
        table.add_column(label, justify="right", style="bold" if p.phase == peak_phase else None)
    used = [c for c in Component if any(p.get(c) for p in report.phases)]
    for c in used:
        table.add_row(c.value, *(f"{gib(p.get(c)):.2f}" for p in report.phases))
    table.add_row("total", *(f"{gib(p.total_bytes):.2f}" for p in report.phases), style="bold")
    return table


def rank_ranges(ranks: tuple[int, ...]) -> str:
    """``(0, 1, 2, 4, 6, 7)`` → ``0–2, 4, 6–7``."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ", ".join(f"{run[0]}–{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def _ranks(report: MemoryReport) -> Table | None:
    """One row per distinct rank (pipeline stage, ZeRO-1/2 partition): its peak and, with a GPU, whether it fits.
    Ranks whose peak phase, peak and verdict agree share a row (``--json`` keeps each entry's phases)."""
    if not report.ranks:
        return None
    fit = report.fit
    table = Table(title="Per rank (GiB; the headline above is the worst)", title_justify="left")
    piped = any(r.pipeline is not None for r in report.ranks)
    cols = ("ranks", "peak phase", *(("in flight",) if piped else ()), "peak allocated", "fits")
    for col in cols:
        table.add_column(col, justify="left" if col in ("ranks", "peak phase", "in flight") else "right")
    worst = max(r.peak_bytes for r in report.ranks)
    rows: dict[tuple[str, str, int, str], list[int]] = {}
    for i, r in enumerate(report.ranks):
        peak = max(r.phases, key=lambda p: p.total_bytes)
        fits = ""
        if fit is not None and i < len(fit.rank_required_bytes):
            fits = "yes" if fit.rank_required_bytes[i] <= fit.usable_bytes else "NO"
        rows.setdefault((peak.phase.value, _in_flight(r), r.peak_bytes, fits), []).extend(r.ranks)
    for (phase, flight, peak_bytes, fits), ranks in rows.items():
        table.add_row(
            rank_ranges(tuple(ranks)),
            phase,
            *((flight,) if piped else ()),
            f"{gib(peak_bytes):.2f}",
            fits,
            style="bold" if peak_bytes == worst else None,
        )
    return table


def _in_flight(r: RankMemory) -> str:
    """A pipeline stage's in-flight work for the per-rank table: ``4 mb`` (1F1B, GPipe) or ``9 ch (4.5 mb)``
    (interleaved: model-chunk micro-batches and their whole-stage equivalent); empty for a rank of no stage."""
    f = r.pipeline
    if f is None:
        return ""
    if f.model_chunks > 1:
        return f"{f.in_flight_chunks} ch ({f.in_flight_microbatches:g} mb)"
    return f"{f.in_flight_chunks} mb"


def _distributed_notes(report: MemoryReport) -> list[str]:
    """The engine defaults and the worst-rank reason (always shown for many GPUs); on one GPU, an adapter's fp32 base
    under amp and the host memory (offloaded activations, paged optimizer states) when there is any."""
    from trainfit.analytic.adapters import FP32_BASE_NOTE

    s = report.strategy
    if s is None or not s.is_distributed:
        # An adapter's fp32 base under amp: the one fine-tuning default worth a line without --explain.
        out = [n for n in report.notes if n.startswith(FP32_BASE_NOTE)]
        if report.host_peak_bytes and (report.fit is None or report.fit.host_usable_bytes is None):
            out.append(f"host memory: {fmt_gib(report.host_peak_bytes)} (offloaded or paged: outside the device peak)")
        return out
    keys = ("engine", "rank 0 of", "torch DDP", "FSDP2", "DeepSpeed", "Megatron", "worst rank", "every rank", "NCCL")
    out = [n for n in report.notes if any(k in n for k in keys)]
    if report.host_peak_bytes and (report.fit is None or report.fit.host_usable_bytes is None):
        # (under --host-memory-gib the verdict says it, against the limit)
        out.append(
            f"host memory per node: {fmt_gib(report.host_peak_bytes)} (offloaded or paged: outside the device peak)"
        )
    return out


def _bytes_per_param(report: MemoryReport, s: Strategy) -> Text:
    b = report.bytes_per_param
    txt = (
        f"Bytes per parameter ({s.precision.value}, {s.optimizer.value}): weights {b.weights:.2f}"
        f" + grads {b.gradients:.2f} + fp32 master {b.master_weights:.2f}"
        f" + optimizer {b.optimizer_states:.2f} = {b.steady_state:.2f}"
    )
    if b.autocast_copies:
        txt += f" (+{b.autocast_copies:.2f} autocast weight copies during forward/backward)"
    return Text(txt + f" — {s.recipe.description}")


def _differences(rows: list[Difference], phase: str) -> Table:
    table = Table(
        title=f"Where this differs from the article's rule of thumb (at the {phase} peak)", title_justify="left"
    )
    table.add_column("term")
    table.add_column("rule of thumb", justify="right")
    table.add_column("this estimate", justify="right")
    table.add_column("why")
    for r in rows:
        table.add_row(r.term, fmt_gib(r.rule_of_thumb_bytes), fmt_gib(r.analytic_bytes), r.why)
    return table


def _modules(report: MemoryReport) -> Table | None:
    d = report.details
    rows = d.modules if isinstance(d, TraceDetails | MeasureDetails) else ()
    if not rows:
        return None
    table = Table(title="Largest saved-activation owners at the end of forward", title_justify="left")
    table.add_column("module")
    table.add_column("instances", justify="right")
    table.add_column("per instance", justify="right")
    table.add_column("total", justify="right")
    for row in rows[:15]:
        table.add_row(
            row.module, str(row.instances), fmt_gib(row.per_instance_bytes, 3), fmt_gib(row.activation_bytes, 3)
        )
    return table


def _measured_vs_trace(report: MemoryReport) -> Table | None:
    d = report.details
    if not isinstance(d, MeasureDetails) or d.trace is None:
        return None
    table = Table(title="Measured on the GPU vs traced (GiB)", title_justify="left")
    for col in ("phase", "measured", "trace", "measured − trace"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for ph, t in d.trace.items():
        m = report.phase(ph).total_bytes
        table.add_row(ph.value, f"{gib(m):.3f}", f"{gib(t):.3f}", f"{gib(m - t):+.3f}")
    return table


#: Segments listed by ``--segments`` (the most fragmented first; the JSON lists them all).
SEGMENT_ROWS = 12


def _segments(report: MemoryReport) -> Table | None:
    d = report.details
    alloc = d.allocator if isinstance(d, AnalyticDetails | TraceDetails) else None
    if alloc is None or not alloc.layout:
        return None
    segs = alloc.layout
    reserved = sum(x.size_bytes for x in segs)
    free = sum(x.free_bytes for x in segs)
    t = Table(
        title=f"Allocator segments at the reserved peak: {len(segs)} segments, {fmt_gib(reserved)} reserved, "
        f"{fmt_gib(free)} free inside them ({alloc.config or 'default settings'}); the {SEGMENT_ROWS} with the "
        "most free space",
        title_justify="left",
    )
    for col in ("size", "pool", "allocated", "free", "largest free block", "blocks"):
        t.add_column(col, justify="left" if col == "pool" else "right")
    for x in sorted(segs, key=lambda x: -x.free_bytes)[:SEGMENT_ROWS]:
        t.add_row(
            fmt_binary(x.size_bytes),
            x.pool + (" (expandable)" if x.expandable else ""),
            fmt_binary(x.allocated_bytes),
            fmt_binary(x.free_bytes),
            fmt_binary(x.largest_free_bytes),
            str(x.blocks),
        )
    return t


def render(console: Console, report: MemoryReport, *, verbose: bool = False) -> None:
    """The answer first, then the breakdown; with ``verbose`` the explanation (bytes per parameter, the
    comparison with the rule of thumb, module tables, notes)."""
    differences = list(report.comparison)
    console.print(_header(report))
    console.print(_answer(report))
    if report.method is Method.RULE_OF_THUMB:
        console.print(_rule_of_thumb(report))
    else:
        console.print(_phases(report))
        for line in _distributed_notes(report):
            console.print(Text(line, style="dim"))  # notes are plain text: "[final norm, head]" is no markup
        for extra_table in (_ranks(report), _measured_vs_trace(report), _modules(report), _segments(report)):
            if extra_table is not None:
                console.print(extra_table)
    if not verbose:
        if differences:
            rot = sum(d.rule_of_thumb_bytes for d in differences)
            ours = sum(d.analytic_bytes for d in differences)
            console.print(
                f"The article's rule of thumb says {fmt_gib(rot)}; this estimate {fmt_gib(ours)} with overhead. "
                "[dim]--explain: term by term, bytes per parameter and notes[/dim]"
            )
        return
    if report.method is not Method.RULE_OF_THUMB and report.strategy is not None:
        console.print(_bytes_per_param(report, report.strategy))
    if differences:
        console.print(_differences(differences, report.peak_phase.value))
    for note in report.notes:
        console.print(Text(f"note: {note}", style="dim"))
    if report.overhead.basis and report.method is not Method.RULE_OF_THUMB:
        console.print(Text(f"outside the allocator: {report.overhead.basis}", style="dim"))
    if report.overhead.nccl_basis and report.method is not Method.RULE_OF_THUMB:
        console.print(Text(f"outside the allocator: {report.overhead.nccl_basis}", style="dim"))
