"""Rich tables for ``trainfit estimate``. Binary units, always labelled GiB; the rule of thumb is
shown in the article's decimal GB, labelled GB."""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from trainfit.analytic.explain import Difference
from trainfit.arch.spec import ModelSpec
from trainfit.result import Component, MemoryReport, Method, Phase
from trainfit.strategy import Strategy
from trainfit.units import fmt_count, fmt_gb, fmt_gib, gib


def _header(report: MemoryReport, spec: ModelSpec, s: Strategy) -> Text:
    t = Text()
    t.append(f"{spec.name}", style="bold")
    t.append(f"  {fmt_count(report.params)} params  {spec.architecture or spec.model_type}\n")
    t.append(
        f"{s.precision.value} · {s.optimizer.value} ({s.optimizer_impl.value})"
        f" · checkpointing {s.checkpointing.value} · {s.attention.value}"
        f" · micro-batch {s.micro_batch} × seq {s.seq_len} · grad-accum {s.grad_accum}"
        f" (effective batch {s.effective_batch})"
    )
    return t


def _rule_of_thumb(report: MemoryReport) -> Group:
    table = Table(title="The article's rule of thumb (decimal GB)", title_justify="left")
    table.add_column("term")
    table.add_column("formula")
    table.add_column("GB", justify="right")
    for term in report.terms:
        table.add_row(term.name, term.formula, f"{term.bytes / 1e9:.2f}")
    total = report.peak_bytes + report.overhead.total_bytes
    table.add_row("total", "point value (c = 15, 1.5 GB)", f"{total / 1e9:.2f}", style="bold")
    lo, hi = report.low_bytes or 0, report.high_bytes or 0
    act = report.extra
    line = Text(
        f"range {fmt_gb(lo)} – {fmt_gb(hi)} (activations {fmt_gb(int(str(act['activations_low_bytes'])))} – "
        f"{fmt_gb(int(str(act['activations_high_bytes'])))}, overhead 1–2 GB)"
    )
    return Group(table, line)


def _phases(report: MemoryReport) -> Table:
    peak_phase = report.peak_phase
    table = Table(title=f"Allocated memory by phase (GiB) — method: {report.method.value}", title_justify="left")
    table.add_column("component")
    for p in report.phases:
        label = p.phase.value + (" (peak)" if p.phase == peak_phase else "")
        table.add_column(label, justify="right", style="bold" if p.phase == peak_phase else None)
    used = [c for c in Component if any(p.components.get(c, 0) for p in report.phases)]
    for c in used:
        table.add_row(c.value, *(f"{gib(p.components.get(c, 0)):.2f}" for p in report.phases))
    table.add_row("total", *(f"{gib(p.total_bytes):.2f}" for p in report.phases), style="bold")
    return table


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


def _differences(rows: list[Difference]) -> Table:
    table = Table(title="Where this differs from the article's rule of thumb", title_justify="left")
    table.add_column("term")
    table.add_column("rule of thumb", justify="right")
    table.add_column("this estimate", justify="right")
    table.add_column("why")
    for r in rows:
        table.add_row(r.term, fmt_gib(r.rule_of_thumb_bytes), fmt_gib(r.analytic_bytes), r.why)
    return table


#: What the model itself holds through the optimizer step, whatever the batch.
STATE_COMPONENTS = (
    Component.WEIGHTS,
    Component.GRADIENTS,
    Component.MASTER_WEIGHTS,
    Component.OPTIMIZER_STATES,
)


def _fit(report: MemoryReport) -> Text:
    f = report.fit
    assert f is not None
    t = Text()
    t.append(
        f"GPU {f.gpu_id}: {fmt_gib(f.gpu_memory_bytes)}, {f.headroom_fraction:.0%} headroom → "
        f"{fmt_gib(f.usable_bytes)} usable; needs {fmt_gib(f.required_bytes)} (nvidia-smi estimate). "
    )
    if f.fits:
        t.append(f"FITS, {fmt_gib(f.free_bytes)} free after headroom. ", style="bold green")
    else:
        t.append(f"DOES NOT FIT, short by {fmt_gib(-f.free_bytes)}. ", style="bold red")
    t.append(f"Largest micro-batch that fits: {f.max_micro_batch}.")
    if f.max_micro_batch == 0:
        t.append(_states_hint(report, f.usable_bytes))
    return t


#: Bytes per parameter of the leanest single-GPU recipe trainfit models: bf16 weights and gradients and
#: bitsandbytes 8-bit AdamW states (pure-bf16 + adamw-8bit).
LEANEST_STATE_BYTES_PER_PARAM = 2 + 2 + 2


def _states_hint(report: MemoryReport, usable_bytes: int) -> str:
    """Why not even one sequence fits, when the model states alone are the reason."""
    step = next((p.components for p in report.phases if p.phase is Phase.OPTIMIZER_STEP), None)
    if step is None:  # the rule of thumb has no per-phase states
        return ""
    states = sum(step.get(c, 0) for c in STATE_COMPONENTS)
    if states <= usable_bytes:
        return ""
    out = (
        f" The model states alone (weights, gradients, master weights, optimizer states) take {fmt_gib(states)}, "
        "more than the usable memory: no batch size or checkpointing can help."
    )
    leanest = report.params * LEANEST_STATE_BYTES_PER_PARAM
    if leanest > usable_bytes:
        out += (
            f" Even pure-bf16 with 8-bit AdamW needs {fmt_gib(leanest)} for them: this model needs sharding "
            "across GPUs (not modelled by trainfit yet)."
        )
    else:
        out += " A leaner precision recipe or optimizer can (e.g. --precision pure-bf16, --optimizer adamw-8bit)."
    return out


def _modules(report: MemoryReport) -> Table | None:
    rows = report.extra.get("modules")
    if not isinstance(rows, list) or not rows:
        return None
    table = Table(title="Largest saved-activation owners at the end of forward", title_justify="left")
    table.add_column("module")
    table.add_column("instances", justify="right")
    table.add_column("per instance", justify="right")
    table.add_column("total", justify="right")
    for row in rows[:15]:
        table.add_row(
            str(row["module"]),
            str(row["instances"]),
            fmt_gib(int(row["per_instance_bytes"]), 3),
            fmt_gib(int(row["activation_bytes"]), 3),
        )
    return table


def _measured_vs_trace(report: MemoryReport) -> Table | None:
    traced = report.extra.get("trace")
    if report.method is not Method.MEASURE or not isinstance(traced, dict):
        return None
    table = Table(title="Measured on the GPU vs traced (GiB)", title_justify="left")
    for col in ("phase", "measured", "trace", "measured − trace"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for p in report.phases:
        t = int(traced.get(p.phase.value, 0))
        table.add_row(p.phase.value, f"{gib(p.total_bytes):.3f}", f"{gib(t):.3f}", f"{gib(p.total_bytes - t):+.3f}")
    return table


def render(
    console: Console,
    report: MemoryReport,
    spec: ModelSpec,
    strategy: Strategy,
    differences: list[Difference] | None = None,
) -> None:
    console.print(_header(report, spec, strategy))
    if report.method is Method.RULE_OF_THUMB:
        console.print(_rule_of_thumb(report))
    else:
        console.print(_phases(report))
        console.print(
            f"Peak allocated: [bold]{fmt_gib(report.peak_bytes)}[/bold] during {report.peak_phase.value} "
            f"(torch.cuda.max_memory_allocated); reserved ≈ {fmt_gib(report.reserved_estimate_bytes)}; "
            f"nvidia-smi ≈ {fmt_gib(report.nvidia_smi_estimate_bytes)} "
            f"(+{fmt_gib(report.overhead.cuda_context_bytes)} CUDA context)"
        )
        console.print(_bytes_per_param(report, strategy))
        for extra_table in (_measured_vs_trace(report), _modules(report)):
            if extra_table is not None:
                console.print(extra_table)
        if differences:
            console.print(_differences(differences))
    for note in report.notes:
        console.print(f"[dim]note: {note}[/dim]")
    if report.fit is not None:
        console.print(_fit(report))
