"""Helpers shared by CLI commands: JSON printing and warnings to stderr."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def stdout_console() -> Console:
    return Console(soft_wrap=False)


def warn(message: str) -> None:
    Console(stderr=True).print(f"[yellow]warning:[/yellow] {message}", highlight=False)
