"""The GPU catalog shipped as ``data/gpus.json`` (memory, native bf16/fp8, peak TFLOPS, bandwidth).

Each entry records its sources and notes in the data file itself; this module only validates and
serves it. One entry is one device as PyTorch enumerates it: an AMD MI250X package is two GCDs, two
devices of 64 GiB each, so its entry describes one GCD (memory, TFLOPS and bandwidth per GCD).

``memory_bytes`` is the memory one process can use, as precisely as the sources allow, and
``memory_basis`` says which figure it is:

- ``"driver"``: the total the driver reports to CUDA/HIP (``torch.cuda.get_device_properties(i).total_memory``,
  = ``torch.cuda.mem_get_info()[1]``) with ECC on, the datacenter default. GDDR6 parts lose 6.25% to ECC
  and the driver keeps some more: a T4 (16 GB nominal) gives CUDA 14.57 GiB, an L40S (48 GB) 44.31 GiB.
  Each such figure cites the deviceQuery/nvidia-smi/PyTorch report it comes from.
- ``"nominal"``: the vendor's capacity as binary units (80 GB HBM = 80 GiB) where no driver report was
  found; the real total is somewhat lower (an A100 80GB gives CUDA about 79.2 GiB).

``cuda_context`` lists CUDA contexts measured on the GPU after CUDA + cuBLAS initialisation (outside the caching
allocator), each with the CUDA, torch and driver it was measured under and its source; :mod:`trainfit.overhead`
uses the entry of the nearest CUDA major and estimates the context of a GPU without one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

from trainfit._suggest import did_you_mean
from trainfit.errors import UnknownGPUError

#: What ``GPUSpec.memory_bytes`` measures (see the module docstring).
MEMORY_BASES: tuple[str, ...] = ("driver", "nominal")


@dataclass(frozen=True, slots=True, kw_only=True)
class ContextMeasurement:
    """A CUDA context measured on this GPU after CUDA + cuBLAS initialisation, outside the caching allocator
    (``mem_get_info`` used − ``memory_reserved``), with the software it was measured under and where the figure
    comes from (the catalog's ``cuda_context`` list; :mod:`trainfit.overhead` uses it)."""

    bytes_: int
    cuda: str  # "13.0"
    torch: str  # "2.11.0+cu130"
    driver: str
    source: str

    def __post_init__(self) -> None:
        if self.bytes_ <= 0:
            raise ValueError("a measured CUDA context must be positive")
        major, _, minor = self.cuda.partition(".")
        if not (major.isdigit() and minor.isdigit()):
            raise ValueError(f"CUDA release '{self.cuda}' is not MAJOR.MINOR")

    @property
    def cuda_release(self) -> tuple[int, int]:
        major, _, minor = self.cuda.partition(".")
        return int(major), int(minor)


@dataclass(frozen=True, slots=True, kw_only=True)
class GPUSpec:
    """One accelerator model. ``compute_capability`` is None for non-NVIDIA parts."""

    id: str
    name: str
    vendor: str
    memory_bytes: int
    memory_bandwidth_gbps: float | None
    compute_capability: str | None
    bf16: bool
    fp8: bool
    tf32: bool
    peak_tflops: dict[str, float | None] = field(default_factory=dict)
    interconnect: str | None = None
    source: str = ""
    notes: str = ""
    memory_basis: str = "nominal"  # "driver": reported total with ECC on; "nominal": vendor capacity
    # Streaming multiprocessors (AMD: compute units): the CUDA context's local-memory reservation scales
    # with it (trainfit.overhead). Each entry cites its source in ``sm_count_source``.
    sm_count: int | None = None
    # Links (GB/s per direction, per GPU; sources in ``links_source``): NVLink/Infinity Fabric to the other GPUs
    # of an 8-GPU node (None: none that spans the node) and the PCIe link to the host. trainfit.planner.speed.
    nvlink_gbps: float | None = None
    pcie_gbps: float | None = None
    # The catalog's architecture note (AMD: "CDNA3 (gfx942)"): its gfx name picks ROCm's hipBLAS workspace sizes.
    arch: str | None = None
    # CUDA contexts measured on this GPU, one per software stack (``cuda_context`` in the catalog, each with its
    # source); empty where none was measured (trainfit.overhead then estimates it).
    cuda_contexts: tuple[ContextMeasurement, ...] = ()

    @property
    def rocm_arch(self) -> str | None:
        """The gfx name of an AMD part ("gfx942"), "" for an AMD part without one, None for NVIDIA."""
        if self.vendor.upper() != "AMD":
            return None
        m = re.search(r"gfx[0-9a-z]+", self.arch or "")
        return m.group(0) if m else ""

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise ValueError(f"GPU {self.id}: memory_bytes must be positive")
        if self.sm_count is not None and self.sm_count <= 0:
            raise ValueError(f"GPU {self.id}: sm_count must be positive")
        if self.memory_basis not in MEMORY_BASES:
            raise ValueError(f"GPU {self.id}: memory_basis must be one of {', '.join(MEMORY_BASES)}")

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "vendor": self.vendor,
            "memory_bytes": self.memory_bytes,
            "memory_basis": self.memory_basis,
            "memory_bandwidth_gbps": self.memory_bandwidth_gbps,
            "compute_capability": self.compute_capability,
            "sm_count": self.sm_count,
            "bf16": self.bf16,
            "fp8": self.fp8,
            "tf32": self.tf32,
            "peak_tflops": dict(self.peak_tflops),
        }


@cache
def _catalog() -> dict[str, GPUSpec]:
    text = resources.files("trainfit.hardware").joinpath("data/gpus.json").read_text(encoding="utf-8")
    out: dict[str, GPUSpec] = {}
    for row in json.loads(text):
        spec = GPUSpec(
            id=row["id"],
            name=row["name"],
            vendor=row["vendor"],
            memory_bytes=int(row["memory_bytes"]),
            memory_bandwidth_gbps=row.get("memory_bandwidth_gbps"),
            compute_capability=row.get("compute_capability"),
            arch=row.get("arch"),
            bf16=bool(row["bf16"]),
            fp8=bool(row["fp8"]),
            tf32=bool(row.get("tf32", False)),
            peak_tflops=dict(row.get("peak_tflops") or {}),
            interconnect=row.get("interconnect"),
            source=row.get("source", ""),
            notes=row.get("notes", ""),
            memory_basis=row.get("memory_basis", "nominal"),
            sm_count=row.get("sm_count"),
            nvlink_gbps=row.get("nvlink_gbps"),
            pcie_gbps=row.get("pcie_gbps"),
            cuda_contexts=tuple(
                ContextMeasurement(
                    bytes_=int(c["bytes"]), cuda=c["cuda"], torch=c["torch"], driver=c["driver"], source=c["source"]
                )
                for c in row.get("cuda_context") or ()
            ),
        )
        out[spec.id] = spec
    return out


def list_gpus() -> list[GPUSpec]:
    """All catalog GPUs in file order."""
    return list(_catalog().values())


def get_gpu(gpu_id: str) -> GPUSpec:
    """Look up a GPU by catalog id (case-insensitive); unknown ids raise with close suggestions."""
    cat = _catalog()
    key = gpu_id.strip().lower()
    if key in cat:
        return cat[key]
    raise UnknownGPUError(f"unknown GPU '{gpu_id}'.{did_you_mean(key, cat)} Run 'trainfit gpus' for the catalog.")
