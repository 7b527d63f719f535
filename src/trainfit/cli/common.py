"""Helpers shared by CLI commands: JSON printing, tables that never truncate, and warnings to stderr."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def stdout_console() -> Console:
    return Console(soft_wrap=False)


_UNBOUNDED = 100_000  # columns: a width no table reaches, to measure one's natural width


def print_table(table: Table) -> None:
    """Print ``table`` at its natural width, never narrower: rich would otherwise cut cells to fit the
    terminal (or 80 columns when piped), and ``trainfit models | grep llama-3.1-8b`` would find nothing.
    On a narrow terminal the lines run past its edge instead; ids and numbers stay whole."""
    for column in table.columns:
        column.no_wrap = True
        column.overflow = "fold"
    console = stdout_console()
    natural = Measurement.get(console, console.options.update_width(_UNBOUNDED), table).maximum
    if natural > console.width:
        console = Console(soft_wrap=False, width=natural)
    console.print(table)


def warn(message: str) -> None:
    Console(stderr=True).print(f"[yellow]warning:[/yellow] {message}", highlight=False)
