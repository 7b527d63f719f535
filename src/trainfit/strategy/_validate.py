"""Validation shared by the strategy's value types: strict integers and enum coercion with one-line errors."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, TypeVar

from trainfit.errors import StrategyError

E = TypeVar("E", bound=StrEnum)


def positive_int(name: str, value: object) -> None:
    """``value`` must be a true integer ≥ 1 (not a bool, not 2.5, not "4")."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise StrategyError(f"{name} must be a positive integer, got {value!r}")
    if value <= 0:
        raise StrategyError(f"{name} must be a positive integer, got {value}")


def coerce_enum(owner: Any, name: str, enum: type[E]) -> None:
    """Accept a plain string for a str-enum field of a frozen dataclass and store the enum member."""
    value = getattr(owner, name)
    try:
        object.__setattr__(owner, name, enum(value))
    except ValueError:
        choices = ", ".join(e.value for e in enum)
        raise StrategyError(f"unknown {name.replace('_', '-')} '{value}'; choose one of: {choices}") from None
