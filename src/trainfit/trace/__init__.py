"""``--method trace``: run real training steps under PyTorch fake tensors and count every live byte.

Importing this package does not import torch; the entry points do, and raise ``DependencyError`` with an
install hint when torch (or transformers, for Hugging Face configs) is missing.

* :func:`trace_spec` — a :class:`~trainfit.arch.spec.ModelSpec` under a :class:`~trainfit.strategy.Strategy`
  (the CLI's ``trainfit estimate MODEL --method trace``);
* :func:`trace` — any ``nn.Module`` from factories for the model, inputs, loss and optimizer.

How it works and what it emulates: ``docs/trace.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainfit.result import MemoryReport

__all__ = ["trace", "trace_spec"]


def trace_spec(*args: Any, **kwargs: Any) -> MemoryReport:
    """See :func:`trainfit.trace.api.trace_spec`."""
    from trainfit.trace._deps import require_torch

    require_torch()
    from trainfit.trace.api import trace_spec as impl

    return impl(*args, **kwargs)


def trace(*args: Any, **kwargs: Any) -> MemoryReport:
    """See :func:`trainfit.trace.api.trace`."""
    from trainfit.trace._deps import require_torch

    require_torch()
    from trainfit.trace.api import trace as impl

    return impl(*args, **kwargs)
