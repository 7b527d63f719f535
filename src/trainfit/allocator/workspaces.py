"""cuBLAS and cuBLASLt workspaces: allocations of the caching allocator that no tensor owns.

PyTorch gives every cuBLAS handle a workspace per stream, allocated through the caching allocator and kept
for the life of the process (``setWorkspaceForHandle`` / ``getCUDABlasLtWorkspace`` in
aten/src/ATen/cuda/CublasHandlePool.cpp, read at pytorch/pytorch@26a39059). Handles come from a per-thread
pool window (``getCurrentCUDABlasHandle``), so each CPU thread that runs a matmul on a device gets its own
handle and therefore its own workspace:

* **cuBLAS** (``parseChosenWorkspaceSize``): ``CUBLAS_WORKSPACE_CONFIG`` as ``:SIZE:COUNT`` pairs, SIZE in
  KiB, summed; without it 32 MiB (``:4096:8``, ``4096 * 8 * 1024``) on the big-workspace majors and
  ``:4096:2:16:8`` = 8 MiB + 128 KiB elsewhere. An unparsable value falls back to the default. The big-workspace
  majors depend on the torch release (``torch_version``): 9, 10 and 12 (Hopper and Blackwell) from 2.12
  (pytorch/pytorch#175344, merged 2026-02-19, after the 2.11 branch cut and before the 2.12 and 2.13 cuts of
  April and June 2026); 9.0 alone in 2.11 and earlier (pytorch/pytorch@26a39059). Major 11 (Thor) joined in
  July 2026 (#189312: torch 2.14), so it keeps 8 MiB + 128 KiB here.
* **cuBLASLt** (``parseCUDABlasLtWorkspaceSize``, ``getCUDABlasLtWorkspaceSize``): ``CUBLASLT_WORKSPACE_SIZE``
  in KiB, default 1024 (1 MiB), capped at the cuBLAS size unless ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` is set
  false. Whether Lt gets a workspace of its own depends on the release too. Up to torch 2.11 a separate Lt
  workspace is allocated per handle and stream unless that variable is set *true* (then Lt borrows the cuBLAS
  one): the size parsing already treated "unset" as unified (#168175) but the allocation did not — the 1 MiB
  block the H200 trace below shows (torch 2.11). #175879 (merged 2026-03-02: "previously diverged between size
  parsing and actually using unified workspaces") made the allocation follow, so from 2.12 Lt shares the cuBLAS
  workspace unless the variable is set *false*; torch 2.13's own documentation says so
  (``torch.backends.cuda.blas_workspace_size``: "When ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` is enabled (the
  default on open-source CUDA builds), the cuBLASLt workspace is capped at the cuBLAS workspace size and
  physically reuses the same allocation"). A later ``main`` (#189312, torch 2.14) also keeps CUDA workspaces in
  the caching allocator only under ``TORCH_CUBLAS_WORKSPACE_CACHE=1``: not modelled (no release has it here).
  The default release is :data:`TARGET_TORCH` (the torch trainfit is built and tested against); releases before
  :data:`OLDEST_TORCH` (whose Lt workspace was not persistent, #156495 of June 2025) are refused by
  :func:`parse_torch_version`.
* **ROCm** (the ``USE_ROCM`` branches of the same functions, at 26a39059; ``rocm_arch``: the gfx name): the
  hipBLAS workspace reads ``CUBLAS_WORKSPACE_CONFIG``, then ``HIPBLAS_WORKSPACE_CONFIG``, then
  ``ROCBLAS_WORKSPACE_CONFIG``, default 128 MiB on an arch matching ``gfx94`` or ``gfx95`` (``isGPUArch``, a
  substring test: MI300X/MI325X are gfx942) and 32 MiB otherwise (MI250X, gfx90a); hipBLASLt reads
  ``CUBLASLT_WORKSPACE_SIZE``, then ``HIPBLASLT_WORKSPACE_SIZE``, default 76 MiB (``76*1024`` KiB), never
  capped or unified (a separate Lt handle pool, Note [hipblaslt handles]). Which threads touch which handle in
  a training step is the CUDA layout below: no ROCm trace has checked it.

In a training step two threads run matmuls: the Python thread (forward, optimizer) and the autograd
engine's device thread (backward, ``torch/csrc/autograd/engine.cpp`` runs each device's work on its own
thread). Checked on the H200 traces in ``shared/gpu-truth`` (torch 2.11, CUDA 13): the main thread's
32 MiB cuBLAS workspace predates the recording (the measuring script's warm-up matmul); the trace then
allocates a 1 MiB block never freed at the first forward matmuls (the cuBLASLt workspace, event 43) and a
32 MiB block never freed at the very first backward matmul (event 3254: right after that matmul's output, the
tied table's gradient, and before the next one's, the hidden-sized input gradient — the backward thread's cuBLAS
workspace). Where it lands outlives the run: ``empty_cache`` cannot release the segment it sits in
(:mod:`trainfit.allocator.process`). No second Lt workspace appears in backward: that thread's matmuls
went through plain cuBLAS. These are 33 MiB of reserved memory that no tensor explains.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

KIB = 1024
MIB = 1024 * KIB
_PAIR = re.compile(r":([0-9]+):([0-9]+)")


class WorkspaceKind(StrEnum):
    CUBLAS = "cublas"
    CUBLASLT = "cublaslt"


class Thread(StrEnum):
    """The CPU threads of a training step that hold a cuBLAS handle."""

    MAIN = "main"  # forward, loss, optimizer step
    AUTOGRAD = "autograd"  # the autograd engine's device thread: backward


@dataclass(frozen=True, slots=True, kw_only=True)
class Workspace:
    kind: WorkspaceKind
    thread: Thread
    stream: int
    size_bytes: int


#: The torch release whose workspace rules apply unless the caller names another (module docstring).
TARGET_TORCH = (2, 13)
#: The oldest release these rules describe: a persistent Lt workspace per handle and stream (#156495, merged at the
#: end of June 2025, near 2.8's branch cut: 2.9 is the first release certain to have it).
OLDEST_TORCH = (2, 9)
#: The release that gave Blackwell the 32 MiB default (#175344) and made the unified Lt workspace real (#175879).
_UNIFIED_AND_BLACKWELL_FROM = (2, 12)
#: Compute-capability majors with the 32 MiB cuBLAS default from torch 2.12 (Hopper and Blackwell).
_CUBLAS_32MIB_MAJORS = frozenset({9, 10, 12})
#: Before 2.12 the 32 MiB default went to compute capability 9.0 exactly.
_HOPPER = (9, 0)
#: ``isGPUArch`` substrings with the 128 MiB hipBLAS default (MI300 series and later).
_HIPBLAS_128MIB_ARCHS = ("gfx94", "gfx95")


def _first(env: Mapping[str, str], *names: str) -> str | None:
    for name in names:
        if name in env:
            return env[name]
    return None


def parse_torch_version(text: str) -> tuple[int, int]:
    """``"2.11"`` / ``"2.11.0+cu130"`` → ``(2, 11)``; a ``ValueError`` that says what is accepted otherwise."""
    match = re.match(r"\s*([0-9]+)\.([0-9]+)", text)
    if match is None:
        raise ValueError(f"torch version '{text}' is not MAJOR.MINOR (e.g. 2.11)")
    version = (int(match.group(1)), int(match.group(2)))
    if version < OLDEST_TORCH:
        oldest = ".".join(map(str, OLDEST_TORCH))
        raise ValueError(f"torch {version[0]}.{version[1]}: the workspace rules are known from torch {oldest} on")
    return version


def cublas_workspace_bytes(
    compute_capability: tuple[int, int],
    env: Mapping[str, str] | None = None,
    *,
    rocm_arch: str | None = None,
    torch_version: tuple[int, int] = TARGET_TORCH,
) -> int:
    """Bytes of one cuBLAS (or, with ``rocm_arch``, hipBLAS) workspace (``parseChosenWorkspaceSize``) under
    ``torch_version``."""
    env = env or {}
    if rocm_arch is not None:
        big = any(a in rocm_arch for a in _HIPBLAS_128MIB_ARCHS)
        default = (128 if big else 32) * MIB
        conf = _first(env, "CUBLAS_WORKSPACE_CONFIG", "HIPBLAS_WORKSPACE_CONFIG", "ROCBLAS_WORKSPACE_CONFIG")
    else:
        if torch_version >= _UNIFIED_AND_BLACKWELL_FROM:
            big = compute_capability[0] in _CUBLAS_32MIB_MAJORS
        else:  # computeCapability == 90 (pytorch/pytorch@26a39059)
            big = compute_capability == _HOPPER
        default = 4096 * 8 * KIB if big else 4096 * KIB * 2 + 16 * KIB * 8
        conf = env.get("CUBLAS_WORKSPACE_CONFIG")
    if conf is None:
        return default
    pairs = _PAIR.findall(conf)
    if not pairs:
        return default
    return sum(int(size) * KIB * int(count) for size, count in pairs)


def _unified(env: Mapping[str, str]) -> bool | None:
    raw = env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE")
    if raw is None:
        return None
    return raw.strip().lower() in ("1", "true", "on", "yes", "y")


def cublaslt_workspace_bytes(
    compute_capability: tuple[int, int],
    env: Mapping[str, str] | None = None,
    *,
    rocm_arch: str | None = None,
    torch_version: tuple[int, int] = TARGET_TORCH,
) -> int:
    """Bytes of one separate cuBLASLt (hipBLASLt) workspace under ``torch_version``; 0 when Lt shares the cuBLAS
    one (CUDA only: by default from torch 2.12, opt-in before)."""
    env = env or {}
    if rocm_arch is not None:
        size = 76 * MIB
        raw = _first(env, "CUBLASLT_WORKSPACE_SIZE", "HIPBLASLT_WORKSPACE_SIZE")
        if raw is not None:
            with contextlib.suppress(ValueError):
                size = int(raw) * KIB
        return size
    unified = _unified(env)
    if unified is True or (unified is None and torch_version >= _UNIFIED_AND_BLACKWELL_FROM):
        return 0
    size = 1024 * KIB
    raw = env.get("CUBLASLT_WORKSPACE_SIZE")
    if raw is not None:
        with contextlib.suppress(ValueError):
            size = int(raw) * KIB
    if unified is not False:  # unset counts as unified for the size cap (getCUDABlasLtWorkspaceSize, #168175)
        size = min(size, cublas_workspace_bytes(compute_capability, env, torch_version=torch_version))
    return size


def training_workspaces(
    compute_capability: tuple[int, int],
    env: Mapping[str, str] | None = None,
    *,
    stream: int = 0,
    backward_lt: bool = False,
    rocm_arch: str | None = None,
    torch_version: tuple[int, int] = TARGET_TORCH,
) -> tuple[Workspace, ...]:
    """The workspaces a single-stream training step creates, in the order they appear.

    Main thread: cuBLAS (first matmul) and cuBLASLt (first Lt matmul, in the forward); autograd thread:
    cuBLAS at the first backward matmul, plus cuBLASLt if ``backward_lt`` (not seen on the H200 trace).
    ``rocm_arch``: an AMD GPU's gfx name, for the hipBLAS/hipBLASLt sizes (same layout, unchecked on ROCm).
    ``torch_version``: the release on the GPU machine (module docstring; the H200 data is torch 2.11).
    """
    cublas = cublas_workspace_bytes(compute_capability, env, rocm_arch=rocm_arch, torch_version=torch_version)
    lt = cublaslt_workspace_bytes(compute_capability, env, rocm_arch=rocm_arch, torch_version=torch_version)
    out = [Workspace(kind=WorkspaceKind.CUBLAS, thread=Thread.MAIN, stream=stream, size_bytes=cublas)]
    if lt:
        out.append(Workspace(kind=WorkspaceKind.CUBLASLT, thread=Thread.MAIN, stream=stream, size_bytes=lt))
    out.append(Workspace(kind=WorkspaceKind.CUBLAS, thread=Thread.AUTOGRAD, stream=stream, size_bytes=cublas))
    if lt and backward_lt:
        out.append(Workspace(kind=WorkspaceKind.CUBLASLT, thread=Thread.AUTOGRAD, stream=stream, size_bytes=lt))
    return tuple(out)


def workspace_key(index: int) -> int:
    """The event key of the ``index``-th of a stream's workspaces (in :func:`training_workspaces`' order): negative,
    as no tensor's is, so that a process simulation (:mod:`trainfit.allocator.process`) can keep them between runs."""
    return -1 - index
