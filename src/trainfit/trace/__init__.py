"""``--method trace``: run real training steps under PyTorch fake tensors and count every live byte.

Importing this package does not import torch; the entry points do, and raise ``DependencyError`` with an
install hint when torch (or transformers, for Hugging Face configs) is missing.

* :func:`trace_spec` — a :class:`~trainfit.arch.spec.ModelSpec` under a :class:`~trainfit.strategy.Strategy`
  (the CLI's ``trainfit estimate MODEL --method trace``);
* :func:`trace` — any ``nn.Module`` from factories for the model, inputs, loss and optimizer.

How it works and what it emulates: ``docs/trace.md``.

``from trainfit import trace`` binds this package (``trainfit.trace`` is a subpackage, and Python binds
the submodule once it is imported), so the package is made callable: ``trace(model_fn, inputs_fn, ...)``
works either way, and ``trainfit.trace.trace`` is the same function.
"""

from __future__ import annotations

import sys
import types
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


class _CallableModule(types.ModuleType):
    """Lets ``from trainfit import trace`` be called like the function it is named after."""

    def __call__(self, *args: Any, **kwargs: Any) -> MemoryReport:
        return trace(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
