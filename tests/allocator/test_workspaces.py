"""cuBLAS/cuBLASLt workspace sizes (aten/src/ATen/cuda/CublasHandlePool.cpp) and their trace in the H200 data."""

from __future__ import annotations

from trainfit.allocator.workspaces import (
    Thread,
    WorkspaceKind,
    cublas_workspace_bytes,
    cublaslt_workspace_bytes,
    training_workspaces,
)

MiB = 1 << 20


def test_cublas_defaults_by_generation() -> None:
    assert cublas_workspace_bytes((9, 0)) == 32 * MiB  # Hopper: 4096 * 8 KiB
    assert cublas_workspace_bytes((8, 0)) == 8 * MiB + 128 * 1024  # :4096:2:16:8
    assert cublas_workspace_bytes((8, 9)) == 8 * MiB + 128 * 1024
    assert cublas_workspace_bytes((10, 0)) == 8 * MiB + 128 * 1024  # only sm90 exactly


def test_cublas_workspace_config() -> None:
    assert cublas_workspace_bytes((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * MiB
    assert cublas_workspace_bytes((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * 1024
    assert cublas_workspace_bytes((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"}) == 8 * MiB + 128 * 1024
    assert cublas_workspace_bytes((9, 0), {"CUBLAS_WORKSPACE_CONFIG": "garbage"}) == 32 * MiB


def test_cublaslt() -> None:
    assert cublaslt_workspace_bytes((9, 0)) == MiB
    assert cublaslt_workspace_bytes((9, 0), {"CUBLASLT_WORKSPACE_SIZE": "4096"}) == 4 * MiB
    # capped at the cuBLAS size unless unification is turned off
    assert cublaslt_workspace_bytes((9, 0), {"CUBLASLT_WORKSPACE_SIZE": "65536"}) == 32 * MiB
    off = {"CUBLASLT_WORKSPACE_SIZE": "65536", "TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}
    assert cublaslt_workspace_bytes((9, 0), off) == 64 * MiB
    assert cublaslt_workspace_bytes((9, 0), {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}) == 0


def test_training_workspaces_h200() -> None:
    ws = training_workspaces((9, 0))
    assert [(w.kind, w.thread, w.size_bytes) for w in ws] == [
        (WorkspaceKind.CUBLAS, Thread.MAIN, 32 * MiB),
        (WorkspaceKind.CUBLASLT, Thread.MAIN, MiB),
        (WorkspaceKind.CUBLAS, Thread.AUTOGRAD, 32 * MiB),
    ]
