"""The closed-form, phase-aware memory model (no torch). Entry point: :func:`estimate_analytic`."""

from trainfit.analytic.model import estimate_analytic
from trainfit.analytic.rule_of_thumb import estimate_rule_of_thumb

__all__ = ["estimate_analytic", "estimate_rule_of_thumb"]
