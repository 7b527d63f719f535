"""Memory beyond the allocated tensors: what ``nvidia-smi`` shows on top of ``torch.cuda.max_memory_allocated``.
Shared by every method (the analytic model, the trace and ``measure``), so it lives outside ``analytic/``.

Two parts, decided by different things:

* **The caching allocator's reserve** (``max_memory_reserved − max_memory_allocated``): cached free blocks,
  segment rounding, fragmentation. It depends on the exact order of allocations and frees, so it belongs
  to the method that knows that order; until a method simulates the allocator it is
  ``ALLOCATOR_RESERVE_FRACTION`` of the allocated peak (10%; measured 0.7–35% on the H200, median 12%).
* **What sits outside the allocator** (device used − ``memory_reserved``), a property of the GPU and the
  workload, in three terms:

  1. *The CUDA context after CUDA and cuBLAS initialisation*: driver and runtime state, the modules cuBLAS
     loads, and the **local-memory reservation**, which the driver sizes for the whole context as
     ``SMs × max resident threads per SM × local memory per thread`` (NVIDIA Developer Forums, "Local memory
     management", forums.developer.nvidia.com/t/289339: "MAX_THREADS_PER_SM x SMs x LOCAL_MEM_PER_THREAD"; the
     default per-thread stack is
     ``cudaLimitStackSize`` = 1 KiB). On our H200 (torch 2.11 + CUDA 13.0, driver 580) the context measured
     718,077,952 B (``../shared/gpu-truth``: used after init − reserved after init, the same with either
     allocator setting; the catalog keeps it as the H200's ``cuda_context``, with its software and source, and
     any GPU with such an entry gets its own figure); 132 SMs × 2048 threads × 1 KiB = 264 MiB of it is local
     memory, the remaining 420.8 MiB the driver, runtime and library modules. For another NVIDIA GPU we keep
     those 420.8 MiB and recompute the local memory from its SM count and compute capability: an *estimate*,
     not a measurement, and every report says which it is.

     *By CUDA release* (``cuda_version``; default 13.0, the measurement's). Kernels load lazily from CUDA 11.7 on
     (NVIDIA CUDA Programming Guide, "Lazy Loading": introduced in 11.7, the Linux default from 12.2, everywhere
     from 12.3; a library built with an older runtime loads eagerly), and PyTorch turns it on itself from 1.13
     (``CUDA_MODULE_LOADING=LAZY``, pytorch/pytorch#86509), so every CUDA from 11.7 to 13.x gets the same
     figures: no public measurement separates a CUDA 12 context from a CUDA 13 one (the table in
     ``docs/accuracy.md``, "The CUDA context"). Before 11.7 every module of every library loads when the context
     starts. The one like-for-like public figure is PyTorch's own (pytorch/pytorch#86509: 666,632,192 B with
     eager loading against 287,047,680 B lazy, the same command, torch 1.13 on a CUDA ≥ 11.7 runtime — the lazy
     run shrank —, GPU and CUDA release not named): :data:`EAGER_MODULES_BYTES` = 379,584,512 B more, which we
     add below 11.7. Other reports are larger (ptrblck in pytorch/pytorch#107667: "> 1000MB" before 11.7;
     1,687 MB on an RTX 3090 with torch 1.8 + CUDA 11.1 in pytorch/pytorch#55277), that run initialised no
     cuBLAS, and the size depends on the torch build and the GPU, so the basis calls it a lower bound. A CUDA
     release that cannot run the GPU at all is refused (:func:`trainfit.cuda_facts.cuda_supports`).
  2. *Kernel images loaded lazily* as a training step first runs each kernel: 82–88 MiB more after training
     steps than after initialisation on the H200 (seven cases, 2 MiB steps); we count their middle, 86 MiB.
     Inference runs fewer distinct kernels; we count the same figure, an upper bound there.
  3. *NCCL's buffers* for multi-GPU runs (not allocated through PyTorch): 0 on one GPU. With a one-rank NCCL
     group the H200 showed +67 MiB under FSDP2 and +557 MiB after DDP (DESIGN §4.1); the multi-GPU model
     fills this term with them (:func:`trainfit.analytic.parallel.nccl_bytes`; what each figure stands for, and
     that it is a lower bound at world sizes above 1, in ``Overhead.nccl_basis``).

AMD GPUs: ROCm allocates scratch (local) memory per queue when a kernel needs it and no public figure for
its context was found, so the driver/runtime term alone is assumed and the basis says so.
"""

from __future__ import annotations

from trainfit.cuda_facts import ALLOCATOR_BLOCK_BYTES, max_threads_per_sm
from trainfit.hardware.gpus import ContextMeasurement, GPUSpec, get_gpu
from trainfit.result import Overhead
from trainfit.units import MiB

__all__ = [
    "ALLOCATOR_BLOCK_BYTES",
    "ALLOCATOR_RESERVE_FRACTION",
    "DEFAULT_CUDA",
    "EAGER_MODULES_BYTES",
    "LAZY_LOADING_CUDA",
    "LOCAL_MEMORY_PER_THREAD_BYTES",
    "TRAINING_KERNEL_IMAGES_BYTES",
    "context_bytes",
    "local_memory_bytes",
    "measured_context",
    "outside_allocator",
    "overhead_for",
]

ALLOCATOR_RESERVE_FRACTION = 0.10

#: Default per-thread stack (``cudaLimitStackSize``), the local memory a fresh context reserves per thread.
LOCAL_MEMORY_PER_THREAD_BYTES = 1024

#: The CUDA release assumed when none is named: the reference measurement's.
DEFAULT_CUDA = (13, 0)
#: First CUDA release with lazy module loading (NVIDIA CUDA C++ Programming Guide, "Lazy Loading").
LAZY_LOADING_CUDA = (11, 7)
#: Modules loaded eagerly on top of a lazy context: 666,632,192 − 287,047,680 B (pytorch/pytorch#86509, torch 1.13
#: on a CUDA ≥ 11.7 runtime, the same command with ``CUDA_MODULE_LOADING`` DEFAULT vs LAZY; GPU not named).
#: A lower bound.
EAGER_MODULES_BYTES = 666_632_192 - 287_047_680

#: The GPU the reference figures were measured on (and the assumption when no GPU is named).
REFERENCE_GPU = "h200-sxm-141gb"

#: Kernel images a training step loads lazily beyond initialisation (H200: 82–88 MiB; see the docstring).
TRAINING_KERNEL_IMAGES_BYTES = 86 * MiB


def local_memory_bytes(gpu: GPUSpec) -> int:
    """The context's local-memory reservation: SMs × resident threads per SM × 1 KiB (NVIDIA only)."""
    if gpu.compute_capability is None or gpu.sm_count is None:
        return 0
    return gpu.sm_count * max_threads_per_sm(gpu.compute_capability) * LOCAL_MEMORY_PER_THREAD_BYTES


def measured_context(gpu: GPUSpec, cuda_version: tuple[int, int] = DEFAULT_CUDA) -> ContextMeasurement | None:
    """The catalog's measurement of ``gpu``'s context for ``cuda_version``: the newest of the nearest CUDA major
    (None: the catalog has none for this GPU)."""
    if not gpu.cuda_contexts:
        return None
    nearest = min(abs(c.cuda_release[0] - cuda_version[0]) for c in gpu.cuda_contexts)
    return max(
        (c for c in gpu.cuda_contexts if abs(c.cuda_release[0] - cuda_version[0]) == nearest),
        key=lambda c: c.cuda_release,
    )


def _reference(cuda_version: tuple[int, int]) -> tuple[GPUSpec, ContextMeasurement]:
    ref = get_gpu(REFERENCE_GPU)
    measured = measured_context(ref, cuda_version)
    if measured is None:  # the catalog's reference entry lost its measurement
        raise ValueError(f"the GPU catalog has no measured CUDA context for {REFERENCE_GPU}")
    return ref, measured


def _how(m: ContextMeasurement, gpu: GPUSpec) -> str:
    return f"measured on the {gpu.name} with torch {m.torch} + CUDA {m.cuda}, driver {m.driver}"


def _cuda_note(cuda: tuple[int, int], measured_cuda: tuple[int, int]) -> tuple[int, str]:
    """(bytes to add for ``cuda``, what the basis says about it) against a figure measured under ``measured_cuda``."""
    if cuda < LAZY_LOADING_CUDA:
        return EAGER_MODULES_BYTES, (
            f"; CUDA {cuda[0]}.{cuda[1]} loads every module eagerly (lazy loading needs CUDA 11.7): "
            f"+{EAGER_MODULES_BYTES / MiB:.0f} MiB, a lower bound (pytorch/pytorch#86509, torch 1.13: eager "
            "666,632,192 B vs lazy 287,047,680 B; other reports exceed 1 GB, pytorch/pytorch#107667)"
        )
    if cuda[0] != measured_cuda[0]:
        return 0, (
            f"; the CUDA {measured_cuda[0]}.{measured_cuda[1]} figure used for CUDA {cuda[0]}.{cuda[1]}: lazy "
            f"loading either way, and no public measurement separates the two majors"
        )
    return 0, ""


def context_bytes(gpu: GPUSpec | None, cuda_version: tuple[int, int] = DEFAULT_CUDA) -> tuple[int, str]:
    """(bytes of the CUDA context after CUDA + cuBLAS initialisation under ``cuda_version``, where the figure
    comes from). A GPU the catalog has a measurement for gets it; another NVIDIA GPU the reference's
    driver/runtime part plus its own local memory; all of them the eager modules before CUDA 11.7."""
    ref, reference = _reference(cuda_version)
    own = measured_context(gpu, cuda_version) if gpu is not None else None
    if gpu is None or own is not None:
        m, on = (reference, ref) if own is None or gpu is None else (own, gpu)
        extra, cuda_note = _cuda_note(cuda_version, m.cuda_release)
        prefix = "no --gpu: " if gpu is None else ""
        return m.bytes_ + extra, f"{prefix}the CUDA context {_how(m, on)} ({m.source}){cuda_note}"
    runtime = reference.bytes_ - local_memory_bytes(ref)
    if gpu.compute_capability is None:
        return runtime, (
            f"the CUDA context assumed: the driver/runtime part {_how(reference, ref)}, no local-memory term "
            "(ROCm allocates scratch on demand; no public figure for a ROCm context)"
        )
    extra, cuda_note = _cuda_note(cuda_version, reference.cuda_release)
    local = local_memory_bytes(gpu)
    return runtime + local + extra, (
        f"the CUDA context estimated: the driver/runtime part {_how(reference, ref)} plus this GPU's "
        f"local memory ({gpu.sm_count} SMs × {max_threads_per_sm(gpu.compute_capability)} threads × 1 KiB)"
        f"{cuda_note}"
    )


def outside_allocator(
    gpu: GPUSpec | None,
    *,
    allocator_reserve_bytes: int,
    nccl_bytes: int = 0,
    nccl_basis: str = "",
    inference: bool = False,
    cuda_version: tuple[int, int] = DEFAULT_CUDA,
) -> Overhead:
    """The overhead of a training step (or, with ``inference``, of generation) on ``gpu`` under ``cuda_version``
    with the method's allocator reserve."""
    context, basis = context_bytes(gpu, cuda_version)
    return Overhead(
        cuda_context_bytes=context,
        kernel_images_bytes=TRAINING_KERNEL_IMAGES_BYTES,
        nccl_bytes=nccl_bytes,
        nccl_basis=nccl_basis,
        allocator_reserve_bytes=allocator_reserve_bytes,
        basis=f"{basis}; +{TRAINING_KERNEL_IMAGES_BYTES // MiB} MiB of kernels loaded lazily by a training step"
        + (" (counted for generation too: an upper bound)" if inference else ""),
    )


def overhead_for(
    peak_allocated_bytes: int,
    gpu: GPUSpec | None = None,
    *,
    inference: bool = False,
    cuda_version: tuple[int, int] = DEFAULT_CUDA,
) -> Overhead:
    """The overhead with the fixed-fraction allocator reserve (for methods that do not simulate it)."""
    return outside_allocator(
        gpu,
        allocator_reserve_bytes=int(peak_allocated_bytes * ALLOCATOR_RESERVE_FRACTION),
        inference=inference,
        cuda_version=cuda_version,
    )
