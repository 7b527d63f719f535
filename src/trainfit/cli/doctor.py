"""``trainfit doctor``: run the article's NaN/instability troubleshooting sequence on the user's setup."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from trainfit.errors import TrainfitError

if TYPE_CHECKING:
    from trainfit.doctor.core import DoctorReport

DEMO_TARGET = "trainfit.doctor.demo:setup"


def _f(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return f"{x:.4g}"


def _render(console: Console, r: DoctorReport) -> None:
    console.print(
        f"[bold]trainfit doctor[/bold]: {r.precision.value} ({r.format.id}) vs fp32, {r.steps} steps on {r.device}"
        + ("" if r.loss_scaling else ", loss scaling OFF")
    )
    for note in r.notes:
        console.print(f"[dim]note: {note}[/dim]")
    runs = Table(title="Runs from the same initial weights")
    for col in ("run", "lr", "stable", "loss start → end", "skipped", "problem"):
        runs.add_column(col)
    for res in (r.reference, r.run, *r.remedies):
        h = res.health
        runs.add_row(
            res.spec.label,
            _f(res.lr),
            "yes" if h.stable else "[red]no[/red]",
            f"{_f(h.start_loss)} → {_f(h.end_loss)}",
            f"{h.skip_fraction:.0%}",
            "" if h.stable else h.problem(),
        )
    console.print(runs)
    curve = Table(title="Loss curves (every few steps)")
    curve.add_column("step", justify="right")
    curve.add_column("fp32", justify="right")
    curve.add_column(r.precision.value, justify="right")
    if r.scale_history:
        curve.add_column("loss scale", justify="right")
    stride = max(1, len(r.reference.losses) // 10)
    for i in range(0, len(r.reference.losses), stride):
        row = [str(i), _f(r.reference.losses[i]), _f(r.run.losses[i])]
        if r.scale_history:
            p = r.scale_history[i]
            row.append(f"{p.scale:.4g}" + (" (skipped)" if p.skipped else ""))
        curve.add_row(*row)
    console.print(curve)
    interesting = [m for m in r.scan if m.overflow or m.flush_fraction > 0.01 or m.headroom_binades < 4]
    scan = Table(
        title=f"Range scan vs {r.format.id} (gradients at loss scale {r.grad_scale:g}); "
        f"{len(r.scan) - len(interesting)} unremarkable rows hidden"
    )
    for col in ("module", "tensor", "absmax", "headroom (2^k)", "overflow", "flush to 0"):
        scan.add_column(col)
    for m in interesting[:20]:
        scan.add_row(
            m.module,
            m.role.value,
            _f(m.absmax),
            _f(m.headroom_binades),
            f"{m.overflow_fraction:.2%}",
            f"{m.flush_fraction:.1%}",
        )
    console.print(scan)
    if r.forward_origin or r.backward_origin:
        for o in (r.forward_origin, r.backward_origin):
            if o:
                console.print(
                    f"first {o.what} ({o.direction.value}): [bold]{o.module}[/bold] {o.where.value} at step {o.step}"
                )
    bad = [b for b in r.data if not b.clean]
    console.print(f"data: {len(r.data)} batches scanned, {len(bad)} with problems")
    if r.scale_history:
        skipped = sum(p.skipped for p in r.scale_history)
        console.print(
            f"loss scale: {r.scale_history[0].scale:g} → {r.scale_history[-1].scale:g} "
            f"(min {min(p.scale for p in r.scale_history):g}), {skipped} skipped steps"
        )
    if r.findings:
        table = Table(title="Findings (article order: precision → lr → clipping → data)")
        for col in ("kind", "severity", "module", "where", "message"):
            table.add_column(col)
        for f in r.findings:
            where = f.direction.value if f.direction else ""
            if f.step is not None:
                where += f" step {f.step}"
            table.add_row(f.kind.value, f.severity.value, f.module or "", where.strip(), f.message)
        console.print(table)
    title = (
        "Diagnosis"
        + (f" — cause: {r.cause.value}" if r.cause else "")
        + (f", module: {r.culprit}" if r.culprit else "")
    )
    console.print(Panel(r.diagnosis, title=title))


def doctor(
    target: Annotated[
        str | None, typer.Argument(help="Factory 'file.py:function' or 'package.module:function'.")
    ] = None,
    precision: Annotated[str, typer.Option("--precision", help="auto, amp-fp16, amp-bf16 or pure-bf16.")] = "auto",
    steps: Annotated[int, typer.Option("--steps", help="Optimizer steps per run.")] = 50,
    no_loss_scaling: Annotated[
        bool, typer.Option("--no-loss-scaling", help="Run fp16 without a GradScaler (to show underflow).")
    ] = False,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    demo: Annotated[bool, typer.Option("--demo", help="Diagnose the built-in fp16-overflow demo model.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Find why training goes NaN/unstable: fp32 vs your precision, range scan, first NaN/Inf, lr, clipping, data.

    The factory returns (model, batches, loss_fn, make_optimizer): loss_fn(model, batch) -> scalar loss,
    make_optimizer(params) -> optimizer.
    """
    if demo == (target is not None):
        raise TrainfitError("give either a factory 'file.py:function' or --demo")
    from trainfit.doctor.core import DoctorConfig, diagnose_target  # imports torch

    if demo and precision == "auto":
        precision = "amp-fp16"
    config = DoctorConfig(precision=precision, steps=steps, loss_scaling=not no_loss_scaling, seed=seed)
    report = diagnose_target(DEMO_TARGET if demo else str(target), config)
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
        return
    _render(Console(), report)


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)
