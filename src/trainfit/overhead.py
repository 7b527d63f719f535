"""Non-tensor memory: what ``nvidia-smi`` shows beyond ``torch.cuda.max_memory_allocated``. Shared by every
method (the analytic model, the trace and ``measure``), so it lives outside ``analytic/``.

Two named constants, both estimates to be calibrated by ``--method measure`` on real hardware:

* ``CUDA_CONTEXT_BYTES`` — the CUDA context, kernel images and cuBLAS/cuDNN handles and workspaces
  that exist as soon as the first kernel runs. Commonly 300–800 MiB depending on GPU, driver and
  which libraries load (PyTorch "CUDA semantics" notes; cuBLAS workspace defaults ``:4096:8`` plus a
  32 MiB cuBLASLt workspace on Hopper). We use 512 MiB.
* ``ALLOCATOR_RESERVE_FRACTION`` — the caching allocator keeps freed blocks and rounds requests (2 MiB
  granularity for large blocks, 20 MiB segments; PyTorch "CUDA memory management" docs), so
  ``max_memory_reserved`` exceeds ``max_memory_allocated``. We assume 10% of the allocated peak,
  the middle of the 5–15% gap commonly seen in training; ``expandable_segments`` lowers it.
"""

from __future__ import annotations

from trainfit.cuda_facts import ALLOCATOR_BLOCK_BYTES
from trainfit.result import Overhead
from trainfit.units import MiB

CUDA_CONTEXT_BYTES = 512 * MiB
ALLOCATOR_RESERVE_FRACTION = 0.10


__all__ = ["ALLOCATOR_BLOCK_BYTES", "ALLOCATOR_RESERVE_FRACTION", "CUDA_CONTEXT_BYTES", "overhead_for"]


def overhead_for(peak_allocated_bytes: int) -> Overhead:
    return Overhead(
        cuda_context_bytes=CUDA_CONTEXT_BYTES,
        allocator_reserve_bytes=int(peak_allocated_bytes * ALLOCATOR_RESERVE_FRACTION),
    )
