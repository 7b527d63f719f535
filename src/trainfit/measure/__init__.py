"""``--method measure``: the trace's training steps on a real CUDA device, read from the allocator.

Importing this package does not import torch. :func:`measure_spec` needs torch with CUDA and a GPU; it runs
exactly the steps ``trace_spec`` traces (same reduced-depth models, same loop, same region marks), reads
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` between marks, extrapolates the same way and
returns a ``MemoryReport`` with ``method=measure`` and the trace's numbers alongside in ``extra``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainfit.result import MemoryReport

__all__ = ["measure_spec"]


def measure_spec(*args: Any, **kwargs: Any) -> MemoryReport:
    """See :func:`trainfit.measure.gpu.measure_spec`."""
    from trainfit.trace._deps import require_torch

    require_torch()
    from trainfit.measure.gpu import measure_spec as impl

    return impl(*args, **kwargs)
