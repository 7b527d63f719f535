"""``trainfit formats``: fp32, tf32, fp16, bf16, fp8 and int8 side by side, with the edge cases."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from trainfit.precision.formats import (
    FLOAT_FORMATS,
    INT8_VS_BF16,
    INTEGER_FORMATS,
    edge_facts,
)
from trainfit.result import SCHEMA_VERSION


def _num(x: float) -> str:
    if x == int(x) and abs(x) < 1e7:
        return f"{int(x)}"
    if 1e-3 <= abs(x) < 1e7:
        return f"{x:.3g}"
    return f"{x:.2e}"


def formats(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Number formats side by side: bit layout, range, precision, what each is for."""
    facts = edge_facts()
    if as_json:
        payload = {
            "schema_version": SCHEMA_VERSION,
            "formats": [f.to_json() for f in FLOAT_FORMATS],
            "integer_formats": [f.to_json() for f in INTEGER_FORMATS],
            "edge_facts": [f.to_json() for f in facts],
            "int8_vs_bf16": INT8_VS_BF16,
        }
        typer.echo(json.dumps(payload, indent=2))
        return
    console = Console()
    table = Table(title="Floating-point formats (computed from the bit layout)", box=box.SIMPLE_HEAD)
    for col in ("format", "s/e/m", "max finite", "min normal", "min sub", "eps", "digits"):
        table.add_column(col, justify="left" if col == "format" else "right", no_wrap=True)
    for f in FLOAT_FORMATS:
        table.add_row(
            f.id + ("*" if f.memory_bits != f.bits else ""),
            f"1/{f.exponent_bits}/{f.mantissa_bits}",
            _num(f.max_finite),
            _num(f.min_normal),
            _num(f.min_subnormal),
            _num(f.epsilon),
            f"{f.decimal_digits:.2f}",
        )
    for i in INTEGER_FORMATS:
        table.add_row(i.id, "int", f"{i.max_value}", "-", "-", "1 (step)", "-")
    table.caption = "* tf32 is a tensor-core compute mode; values are stored in 32 bits"
    console.print(table)
    edges = Table(title="Where values stop being representable", box=box.SIMPLE_HEAD)
    for col in ("format", "bias", "overflows at", "overflow gives", "→ 0 at/below", "binades"):
        edges.add_column(col, justify="left" if col == "format" else "right", no_wrap=True)
    for f in FLOAT_FORMATS:
        edges.add_row(
            f.id,
            str(f.bias),
            ("≥ " if f.overflow_at_threshold else "> ") + _num(f.overflow_threshold),
            "inf" if f.has_inf else "NaN/saturate",
            _num(f.flush_threshold),
            f"{f.dynamic_range_binades:.0f}",
        )
    console.print(edges)
    uses = Table(title="What each format is for", box=box.SIMPLE_HEAD)
    uses.add_column("format")
    uses.add_column("used for")
    uses.add_column("hardware")
    for fmt in FLOAT_FORMATS:
        uses.add_row(fmt.id, fmt.used_for, fmt.hardware)
    for ifmt in INTEGER_FORMATS:
        uses.add_row(ifmt.id, ifmt.used_for, ifmt.hardware)
    console.print(uses)
    console.print("[bold]Edge cases[/bold]")
    for fact in facts:
        console.print(f"• [cyan]{fact.expression}[/cyan]\n  {fact.explanation}")
    console.print("\n[bold]int8 vs bf16[/bold]")
    console.print(INT8_VS_BF16)


def register(app: typer.Typer) -> None:
    app.command("formats")(formats)
