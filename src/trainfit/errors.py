"""One exception tree for everything trainfit reports to a user.

Every error a user can cause by bad input is a ``TrainfitError``; the CLI prints its message on one
line and exits with status 2. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class TrainfitError(Exception):
    """Base class: a problem with the user's input or environment, explained in one line."""


class ConfigError(TrainfitError):
    """A model config is unreadable, incomplete or inconsistent."""


class UnsupportedArchitectureError(ConfigError):
    """The config describes an architecture trainfit cannot model."""


class UnknownModelError(TrainfitError):
    """A model name is neither a catalog slug, a local path nor a reachable Hub repo."""


class UnknownGPUError(TrainfitError):
    """A GPU id is not in the catalog."""


class StrategyError(TrainfitError):
    """A training strategy (precision, optimizer, batch, ...) is invalid."""


class DependencyError(TrainfitError):
    """An optional dependency (torch, transformers, huggingface_hub) is needed but missing."""


class TraceError(TrainfitError):
    """The trace engine cannot run this model or step (``--method trace``)."""


class TraceUnsupportedError(TraceError):
    """The model runs an operation fake tensors cannot evaluate (its output depends on tensor values)."""
