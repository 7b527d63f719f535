"""Detect this machine's accelerator with torch (imported lazily, only when detection is asked for).

What is reported is what the precision decision needs: name, memory, compute capability and *native*
bf16/FP8 support. Native bf16 on NVIDIA is compute capability >= 8.0 — deliberately not
``torch.cuda.is_bf16_supported()``, whose default ``including_emulation=True`` answers True on a T4
(DESIGN.md §4); that answer is recorded separately so the advice can warn about it. On ROCm,
``is_bf16_supported()`` returns True unconditionally, so the architecture name (``gcnArchName``) is used:
bf16 matrix instructions from CDNA1 (gfx908) on, FP8 from CDNA3 (gfx94x) and RDNA4 (gfx12) — AMD
"Data types and precision support" table for ROCm.
"""

from __future__ import annotations

import re
from typing import Any

from trainfit.errors import DependencyError
from trainfit.hardware.gpus import GPUSpec, list_gpus
from trainfit.precision.advice import (
    Accelerator,
    AcceleratorKind,
    AcceleratorSource,
    cpu_accelerator,
    fp8_from_cc,
    native_bf16_from_cc,
    tf32_from_cc,
)

_ROCM_BF16 = re.compile(r"gfx(908|90a|94\d|95\d|11\d\d|12\d\d)")
_ROCM_FP8 = re.compile(r"gfx(94\d|95\d|12\d\d)")


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is installed in dev environments
        raise DependencyError(
            "torch is needed to detect the local GPU; install it or pass --gpu ID to use the catalog"
        ) from exc
    return torch


def match_catalog(name: str, memory_bytes: int | None = None) -> GPUSpec | None:
    """Best-effort match of a device name ('NVIDIA A100-SXM4-80GB') to a catalog entry.

    Picks the catalog entry whose distinctive model token (e.g. 'a100', 'h100', '4090') appears in the
    name, preferring the one whose memory is closest to the detected memory.
    """
    lowered = name.lower().replace(" ", "-")
    best: tuple[int, GPUSpec] | None = None
    for spec in list_gpus():
        token = spec.id.split("-")[0] if not spec.id.startswith("rtx-") else spec.id.split("-")[1]
        if token in {"rtx", ""} or not re.search(rf"(?<![a-z0-9]){re.escape(token)}(?![0-9])", lowered):
            continue
        distance = abs(spec.memory_bytes - memory_bytes) if memory_bytes else 0
        if best is None or distance < best[0]:
            best = (distance, spec)
    return best[1] if best else None


def accelerator_for_device(index: int) -> Accelerator:
    """Describe CUDA/ROCm device ``index``. Imports torch; the device must exist."""
    torch = _import_torch()
    props = torch.cuda.get_device_properties(index)
    name = str(props.name)
    memory = int(props.total_memory)
    cc: str | None
    if getattr(torch.version, "hip", None):
        arch = str(getattr(props, "gcnArchName", ""))
        native_bf16, fp8, tf32 = bool(_ROCM_BF16.search(arch)), bool(_ROCM_FP8.search(arch)), False
        cc, kind = None, AcceleratorKind.ROCM
    else:
        cc = f"{props.major}.{props.minor}"
        native_bf16, fp8, tf32 = native_bf16_from_cc(cc), fp8_from_cc(cc), tf32_from_cc(cc)
        kind = AcceleratorKind.CUDA
    with torch.cuda.device(index):
        emulated = bool(torch.cuda.is_bf16_supported())
    spec = match_catalog(name, memory)
    return Accelerator(
        kind=kind,
        name=name,
        source=AcceleratorSource.DETECTED,
        memory_bytes=memory,
        compute_capability=cc,
        native_bf16=native_bf16,
        fp8=fp8,
        tf32=tf32,
        catalog_id=spec.id if spec else None,
        bf16_supported_with_emulation=emulated,
    )


def detect_accelerators() -> tuple[Accelerator, ...]:
    """All local CUDA/ROCm devices, or one CPU entry when there is none. Imports torch."""
    torch = _import_torch()
    if not torch.cuda.is_available():
        return (cpu_accelerator(),)
    return _group([accelerator_for_device(i) for i in range(torch.cuda.device_count())])


def _group(devices: list[Accelerator]) -> tuple[Accelerator, ...]:
    """Collapse identical devices into one entry with a count (a node of 8 H100s is one line)."""
    grouped: dict[tuple[str, int | None, str | None], Accelerator] = {}
    for dev in devices:
        key = (dev.name, dev.memory_bytes, dev.compute_capability)
        if key in grouped:
            prev = grouped[key]
            grouped[key] = Accelerator(
                kind=prev.kind, name=prev.name, source=prev.source, memory_bytes=prev.memory_bytes,
                compute_capability=prev.compute_capability, native_bf16=prev.native_bf16, fp8=prev.fp8,
                tf32=prev.tf32, count=prev.count + 1, catalog_id=prev.catalog_id,
                bf16_supported_with_emulation=prev.bf16_supported_with_emulation,
            )  # fmt: skip
        else:
            grouped[key] = dev
    return tuple(grouped.values())


def detect_accelerator() -> Accelerator:
    """The device training would use by default: CUDA device 0's kind (the first group), else the CPU."""
    return detect_accelerators()[0]
