"""The GPU catalog describes one device as PyTorch sees it, with the memory a process can use (issue 15 #11)."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from trainfit.hardware import get_gpu, list_gpus
from trainfit.hardware.gpus import MEMORY_BASES, GPUSpec

#: Ids are part of the interface (CLI flags, saved configs): they must not change.
STABLE_IDS = [
    "v100-sxm2-16gb", "v100-sxm2-32gb", "t4", "a10g", "a10", "l4", "l40s", "a40", "a100-sxm-40gb",
    "a100-sxm-80gb", "a100-pcie-80gb", "h100-sxm-80gb", "h100-pcie-80gb", "h100-nvl-94gb", "h200-sxm-141gb",
    "gh200-96gb", "b200-sxm-180gb", "rtx-3090", "rtx-4090", "rtx-5090", "rtx-a6000", "rtx-6000-ada",
    "mi250x", "mi300x", "mi325x",
]  # fmt: skip

#: Driver-reported totals (cudaDeviceProp.totalGlobalMem / HIP) with ECC on, each cited in gpus.json.
DRIVER_BYTES = {
    "t4": 15642329088,  # 14918 MiB, driver 555
    "a10": 23609475072,
    "a10g": 23609475072,  # by analogy with the A10
    "l4": 23612293120,
    "a40": 47608692736,
    "l40s": 47576711168,
    "h200-sxm-141gb": 150109880320,  # measured on our H200
    "mi250x": 68702699520,  # one GCD
}


def test_ids_are_stable() -> None:
    assert [g.id for g in list_gpus()] == STABLE_IDS


def test_mi250x_is_one_gcd_of_64_gib() -> None:
    """PyTorch enumerates each of the MI250X's two GCDs as a device: 64 GiB each, not 128 GiB."""
    g = get_gpu("mi250x")
    assert g.memory_bytes == 68702699520 < 64 * 2**30
    assert g.peak_tflops["bf16"] == pytest.approx(383 / 2) and g.memory_bandwidth_gbps == 1600
    assert "GCD" in g.name


@pytest.mark.parametrize(("gpu_id", "expected"), sorted(DRIVER_BYTES.items()))
def test_ecc_gddr_and_measured_parts_use_the_driver_total(gpu_id: str, expected: int) -> None:
    g = get_gpu(gpu_id)
    assert g.memory_bytes == expected and g.memory_basis == "driver"
    raw = {
        row["id"]: row
        for row in json.loads(resources.files("trainfit.hardware").joinpath("data/gpus.json").read_text())
    }
    assert "memory:" in raw[gpu_id]["source"] or "per-GCD memory" in raw[gpu_id]["source"]


def test_gddr6_with_ecc_is_below_15_16ths_of_nominal() -> None:
    """ECC on GDDR6 takes 1/16 of the memory; the driver keeps a little more."""
    for gpu_id, nominal_gib in (("t4", 16), ("l4", 24), ("a10", 24), ("a10g", 24), ("a40", 48), ("l40s", 48)):
        assert get_gpu(gpu_id).memory_bytes < nominal_gib * 2**30 * 15 // 16


def test_every_entry_says_what_its_memory_figure_is() -> None:
    for g in list_gpus():
        assert g.memory_basis in MEMORY_BASES
        assert g.to_json()["memory_basis"] == g.memory_basis


def test_memory_basis_is_validated() -> None:
    with pytest.raises(ValueError, match="memory_basis"):
        GPUSpec(
            id="x",
            name="x",
            vendor="x",
            memory_bytes=1,
            memory_bandwidth_gbps=None,
            compute_capability=None,
            bf16=False,
            fp8=False,
            tf32=False,
            memory_basis="guess",
        )
