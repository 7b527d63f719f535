"""cuBLAS/cuBLASLt workspace sizes (aten/src/ATen/cuda/CublasHandlePool.cpp) and their trace in the H200 data."""

from __future__ import annotations

import pytest

from trainfit.allocator.workspaces import (
    Thread,
    WorkspaceKind,
    cublas_workspace_bytes,
    cublaslt_workspace_bytes,
    parse_torch_version,
    training_workspaces,
)

MiB = 1 << 20


def test_cublas_defaults_by_generation() -> None:
    # parseChosenWorkspaceSize, torch 2.13 (pytorch/pytorch#175344): 32 MiB (:4096:8) on majors 9, 10 and 12
    assert cublas_workspace_bytes((9, 0)) == 32 * MiB  # Hopper: 4096 * 8 KiB
    assert cublas_workspace_bytes((10, 0)) == 32 * MiB  # B200
    assert cublas_workspace_bytes((10, 3)) == 32 * MiB  # B300
    assert cublas_workspace_bytes((12, 0)) == 32 * MiB  # RTX 5090
    assert cublas_workspace_bytes((8, 0)) == 8 * MiB + 128 * 1024  # :4096:2:16:8
    assert cublas_workspace_bytes((8, 9)) == 8 * MiB + 128 * 1024
    assert cublas_workspace_bytes((7, 5)) == 8 * MiB + 128 * 1024
    assert cublas_workspace_bytes((11, 0)) == 8 * MiB + 128 * 1024  # Thor: 32 MiB only from torch 2.14 (#189312)
    # the Lt cap follows the cuBLAS size (getCUDABlasLtWorkspaceSize); a separate Lt workspace needs unified off
    separate = {"CUBLASLT_WORKSPACE_SIZE": "65536", "TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}
    assert cublaslt_workspace_bytes((10, 0), separate) == 64 * MiB  # unified off: no cap either


def test_torch_2_11_rules() -> None:
    """torch <= 2.11 (pytorch/pytorch@26a39059, the H200 data): 32 MiB on 9.0 exactly, a separate Lt workspace."""
    old = (2, 11)
    assert cublas_workspace_bytes((9, 0), torch_version=old) == 32 * MiB
    assert cublas_workspace_bytes((10, 0), torch_version=old) == 8 * MiB + 128 * 1024  # before #175344
    assert cublas_workspace_bytes((12, 0), torch_version=old) == 8 * MiB + 128 * 1024
    assert cublas_workspace_bytes((9, 0), torch_version=(2, 12)) == 32 * MiB
    assert cublas_workspace_bytes((10, 0), torch_version=(2, 12)) == 32 * MiB
    assert cublaslt_workspace_bytes((9, 0), torch_version=old) == MiB  # separate unless set true (before #175879)
    assert cublaslt_workspace_bytes((9, 0), {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}, torch_version=old) == 0
    # the size cap followed the (not yet real) unified default already (#168175): 64 MiB asked, 32 MiB given
    assert cublaslt_workspace_bytes((9, 0), {"CUBLASLT_WORKSPACE_SIZE": "65536"}, torch_version=old) == 32 * MiB
    assert cublaslt_workspace_bytes((10, 0), {"CUBLASLT_WORKSPACE_SIZE": "65536"}, torch_version=old) == (
        8 * MiB + 128 * 1024
    )


def test_parse_torch_version() -> None:
    assert parse_torch_version("2.11") == (2, 11)
    assert parse_torch_version("2.13.0+cu130") == (2, 13)
    assert parse_torch_version("3.0") == (3, 0)
    with pytest.raises(ValueError, match=r"MAJOR\.MINOR"):
        parse_torch_version("latest")
    with pytest.raises(ValueError, match=r"from torch 2\.9 on"):
        parse_torch_version("2.8")


def test_rocm_defaults() -> None:
    # the USE_ROCM branches of parseChosenWorkspaceSize / parseCUDABlasLtWorkspaceSize (pytorch/pytorch@26a39059)
    assert cublas_workspace_bytes((0, 0), rocm_arch="gfx942") == 128 * MiB  # MI300X / MI325X: isGPUArch gfx94
    assert cublas_workspace_bytes((0, 0), rocm_arch="gfx950") == 128 * MiB  # MI355X
    assert cublas_workspace_bytes((0, 0), rocm_arch="gfx90a") == 32 * MiB  # MI250X
    assert cublas_workspace_bytes((0, 0), rocm_arch="") == 32 * MiB  # an AMD part of unknown arch
    assert cublaslt_workspace_bytes((0, 0), rocm_arch="gfx942") == 76 * MiB  # hipBLASLt: 76 * 1024 KiB
    # env: CUBLAS_ first, then HIPBLAS_ / ROCBLAS_WORKSPACE_CONFIG; Lt: CUBLASLT_ then HIPBLASLT_WORKSPACE_SIZE
    assert cublas_workspace_bytes((0, 0), {"HIPBLAS_WORKSPACE_CONFIG": ":1024:4"}, rocm_arch="gfx942") == 4 * MiB
    assert cublas_workspace_bytes((0, 0), {"ROCBLAS_WORKSPACE_CONFIG": ":1024:2"}, rocm_arch="gfx942") == 2 * MiB
    both = {"CUBLAS_WORKSPACE_CONFIG": ":1024:1", "HIPBLAS_WORKSPACE_CONFIG": ":1024:4"}
    assert cublas_workspace_bytes((0, 0), both, rocm_arch="gfx942") == MiB
    assert cublaslt_workspace_bytes((0, 0), {"HIPBLASLT_WORKSPACE_SIZE": "2048"}, rocm_arch="gfx942") == 2 * MiB
    # never capped at the hipBLAS size, never unified (no TORCH_CUBLASLT_UNIFIED_WORKSPACE on ROCm)
    big = {"CUBLAS_WORKSPACE_CONFIG": ":1024:1", "TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}
    assert cublaslt_workspace_bytes((0, 0), big, rocm_arch="gfx942") == 76 * MiB
    ws = training_workspaces((0, 0), rocm_arch="gfx942")
    assert [(w.kind, w.thread, w.size_bytes) for w in ws] == [
        (WorkspaceKind.CUBLAS, Thread.MAIN, 128 * MiB),
        (WorkspaceKind.CUBLASLT, Thread.MAIN, 76 * MiB),
        (WorkspaceKind.CUBLAS, Thread.AUTOGRAD, 128 * MiB),
    ]


def test_catalog_gpus_pick_their_rule() -> None:
    from trainfit.estimate import gpu_workspaces
    from trainfit.hardware.gpus import get_gpu

    def sizes(gpu: str) -> list[int]:
        return [w.size_bytes for w in gpu_workspaces(get_gpu(gpu))]

    # torch 2.13: Lt shares the cuBLAS workspace (no workspace of its own)
    assert sizes("h200-sxm-141gb") == [32 * MiB, 32 * MiB]
    assert sizes("b200-sxm-180gb") == [32 * MiB, 32 * MiB]
    assert sizes("a100-sxm-80gb") == [8 * MiB + 128 * 1024, 8 * MiB + 128 * 1024]
    assert sizes("mi300x") == [128 * MiB, 76 * MiB, 128 * MiB]
    assert sizes("mi250x") == [32 * MiB, 76 * MiB, 32 * MiB]


def test_cublas_workspace_config() -> None:
    assert cublas_workspace_bytes((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * MiB
    assert cublas_workspace_bytes((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * 1024
    assert cublas_workspace_bytes((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"}) == 8 * MiB + 128 * 1024
    assert cublas_workspace_bytes((9, 0), {"CUBLAS_WORKSPACE_CONFIG": "garbage"}) == 32 * MiB


def test_cublaslt() -> None:
    # torch 2.13: unified unless turned off (#175879; torch.backends.cuda.blas_workspace_size's documentation)
    assert cublaslt_workspace_bytes((9, 0)) == 0
    assert cublaslt_workspace_bytes((9, 0), {"CUBLASLT_WORKSPACE_SIZE": "4096"}) == 0
    assert cublaslt_workspace_bytes((9, 0), {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}) == 0
    off = {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}
    assert cublaslt_workspace_bytes((9, 0), off) == MiB
    assert cublaslt_workspace_bytes((9, 0), {**off, "CUBLASLT_WORKSPACE_SIZE": "4096"}) == 4 * MiB
    assert cublaslt_workspace_bytes((9, 0), {**off, "CUBLASLT_WORKSPACE_SIZE": "65536"}) == 64 * MiB


def test_training_workspaces_h200() -> None:
    assert [w.kind for w in training_workspaces((9, 0))] == [WorkspaceKind.CUBLAS, WorkspaceKind.CUBLAS]
    ws = training_workspaces((9, 0), torch_version=(2, 11))  # the H200 data's release
    assert [(w.kind, w.thread, w.size_bytes) for w in ws] == [
        (WorkspaceKind.CUBLAS, Thread.MAIN, 32 * MiB),
        (WorkspaceKind.CUBLASLT, Thread.MAIN, MiB),
        (WorkspaceKind.CUBLAS, Thread.AUTOGRAD, 32 * MiB),
    ]
