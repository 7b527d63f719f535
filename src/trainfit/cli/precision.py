"""``trainfit precision``: detect (or look up) the accelerator and recommend a precision recipe."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table

from trainfit.precision.advice import Accelerator, PrecisionAdvice, accelerator_from_spec, recommend
from trainfit.result import SCHEMA_VERSION
from trainfit.units import fmt_gib


def _accelerators(gpu: str | None) -> tuple[Accelerator, ...]:
    if gpu is not None:
        from trainfit.hardware.gpus import get_gpu

        return (accelerator_from_spec(get_gpu(gpu)),)
    from trainfit.hardware.detect import detect_accelerators  # imports torch

    return detect_accelerators()


def _render(console: Console, advice: PrecisionAdvice) -> None:
    acc = advice.accelerator
    table = Table(title=f"Accelerator ({acc.source.value})", show_header=False)
    table.add_column("field")
    table.add_column("value")
    table.add_row("name", acc.name + (f" × {acc.count}" if acc.count > 1 else ""))
    table.add_row("kind", acc.kind.value)
    if acc.memory_bytes is not None:
        table.add_row("memory", fmt_gib(acc.memory_bytes))
    if acc.compute_capability is not None:
        table.add_row("compute capability", acc.compute_capability)
    if acc.kind.value != "cpu":
        table.add_row("native bf16", "yes" if acc.native_bf16 else "no")
        table.add_row("fp8", "yes" if acc.fp8 else "no")
        table.add_row("tf32", "yes" if acc.tf32 else "no")
    if acc.bf16_supported_with_emulation is not None:
        table.add_row("is_bf16_supported()", str(acc.bf16_supported_with_emulation) + " (counts emulation)")
    console.print(table)
    scaling = " + dynamic loss scaling (GradScaler)" if advice.loss_scaling else ""
    console.print(f"[bold]Recommended:[/bold] [green]{advice.precision.value}[/green]{scaling}")
    for reason in advice.reasons:
        console.print(f"  • {reason}")
    if advice.notes:
        console.print("[bold]Notes[/bold]")
        for note in advice.notes:
            console.print(f"  • {note}")
    console.print(Syntax(advice.snippet, "python", theme="ansi_dark", background_color="default", word_wrap=True))


def precision(
    gpu: Annotated[
        str | None, typer.Option("--gpu", help="Catalog GPU id instead of detecting this machine's.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Recommend bf16, fp16 + loss scaling or fp32 for this machine's GPU (or a catalog GPU), with reasons."""
    advices = [recommend(acc) for acc in _accelerators(gpu)]
    if as_json:
        payload = {
            "schema_version": SCHEMA_VERSION,
            "recommendation": advices[0].to_json(),
            "devices": [a.accelerator.to_json() for a in advices],
        }
        typer.echo(json.dumps(payload, indent=2))
        return
    console = Console()
    for advice in advices:
        _render(console, advice)


def register(app: typer.Typer) -> None:
    app.command("precision")(precision)
