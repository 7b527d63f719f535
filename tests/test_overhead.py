"""What sits outside the allocator is a property of the GPU (issue 9 §3), traced to its sources."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests._gpu_truth import TRUTH, data
from trainfit import estimate
from trainfit.hardware import get_gpu, list_gpus
from trainfit.overhead import (
    DEFAULT_CUDA,
    EAGER_MODULES_BYTES,
    TRAINING_KERNEL_IMAGES_BYTES,
    context_bytes,
    local_memory_bytes,
    measured_context,
    outside_allocator,
)


def _truth_lines() -> list[dict[str, Any]]:
    if TRUTH is None:
        pytest.skip("the H200 calibration data (../shared/gpu-truth) is not here")
    lines: list[dict[str, Any]] = data.rows(TRUTH)
    return lines


def test_every_catalog_gpu_has_a_cited_sm_count() -> None:
    for g in list_gpus():
        assert g.sm_count is not None and g.sm_count > 0, g.id
    raw = json.loads((Path(__file__).resolve().parents[1] / "src/trainfit/hardware/data/gpus.json").read_text())
    assert all(row.get("sm_count_source") for row in raw)


def test_local_memory_is_sms_times_threads_times_one_kib() -> None:
    # CUDA C++ Programming Guide: 2048 resident threads per SM on sm80, 1536 on sm86/sm89, 1024 on sm75.
    assert local_memory_bytes(get_gpu("a100-sxm-80gb")) == 108 * 2048 * 1024
    assert local_memory_bytes(get_gpu("rtx-4090")) == 128 * 1536 * 1024
    assert local_memory_bytes(get_gpu("t4")) == 40 * 1024 * 1024
    assert local_memory_bytes(get_gpu("mi300x")) == 0  # ROCm: scratch on demand


def test_h200_context_is_the_measured_one() -> None:
    meta = [line["meta"] for line in _truth_lines() if "meta" in line]
    outside_at_init = {int(m["used_after_init"]) - int(m["reserved_after_init"]) for m in meta}  # type: ignore[index]
    assert outside_at_init == {context_bytes(get_gpu("h200-sxm-141gb"))[0]}
    (measured,) = get_gpu("h200-sxm-141gb").cuda_contexts  # the catalog's entry, with its software
    assert {str(m["cuda"]) for m in meta} == {measured.cuda}  # type: ignore[index]
    assert {str(m["torch"]) for m in meta} == {measured.torch}  # type: ignore[index]
    assert measured.bytes_ in outside_at_init
    assert "measured" in context_bytes(get_gpu("h200-sxm-141gb"))[1]


def test_kernel_images_lie_in_the_measured_range() -> None:
    lines = _truth_lines()
    init = {int(m["meta"]["used_after_init"]) - int(m["meta"]["reserved_after_init"]) for m in lines if "meta" in m}  # type: ignore[index]
    (context,) = init
    grown = [int(line["outside_allocator"]) - context for line in lines if "outside_allocator" in line]  # type: ignore[call-overload]
    assert grown and min(grown) <= TRAINING_KERNEL_IMAGES_BYTES <= max(grown)


def test_other_gpus_keep_the_runtime_part_and_scale_the_local_memory() -> None:
    h200 = get_gpu("h200-sxm-141gb")
    measured = measured_context(h200)
    assert measured is not None and measured.cuda_release == DEFAULT_CUDA  # the default is the measurement's
    runtime = measured.bytes_ - local_memory_bytes(h200)
    for gpu_id in ("a100-sxm-80gb", "rtx-4090", "l4", "t4"):
        g = get_gpu(gpu_id)
        got, basis = context_bytes(g)
        assert got == runtime + local_memory_bytes(g)
        assert "estimated" in basis
    assert context_bytes(get_gpu("mi300x"))[0] == runtime
    assert "assumed" in context_bytes(get_gpu("mi300x"))[1]


def test_nvidia_smi_is_reserved_plus_everything_outside_the_allocator() -> None:
    r = estimate("qwen2.5-0.5b", gpu="a100-sxm-80gb")
    o = r.overhead
    assert o.outside_allocator_bytes == o.cuda_context_bytes + o.kernel_images_bytes + o.nccl_bytes
    assert r.nvidia_smi_estimate_bytes == r.reserved_estimate_bytes + o.outside_allocator_bytes
    assert o.cuda_context_bytes == context_bytes(get_gpu("a100-sxm-80gb"))[0]
    assert r.fit is not None and r.fit.required_bytes == r.nvidia_smi_estimate_bytes


def test_the_gpu_changes_its_workspaces_and_what_is_outside_the_allocator() -> None:
    from trainfit.result import Component

    a, b = estimate("gpt2", gpu="t4"), estimate("gpt2", gpu="h200-sxm-141gb")
    ws_a, ws_b = a.peak.get(Component.WORKSPACES), b.peak.get(Component.WORKSPACES)
    # cuBLAS: 32 MiB per handle on sm90, 8 MiB + 128 KiB elsewhere; two handles (forward, autograd); from torch
    # 2.12 (the default release is 2.13) cuBLASLt shares that workspace instead of its own 1 MiB.
    assert (ws_a, ws_b) == (2 * (8 * 2**20 + 128 * 2**10), 2 * 32 * 2**20)
    # the same tensors; the blocks the allocator keeps whole beyond them depend on where the workspaces sit
    rd_a, rd_b = a.peak.get(Component.ALLOCATOR_ROUNDING), b.peak.get(Component.ALLOCATOR_ROUNDING)
    assert a.peak_bytes - ws_a - rd_a == b.peak_bytes - ws_b - rd_b
    assert a.overhead.cuda_context_bytes < b.overhead.cuda_context_bytes  # 40 × 1024 threads < 132 × 2048


def test_nccl_buffers_are_outside_the_allocator() -> None:
    o = outside_allocator(get_gpu("h100-sxm-80gb"), allocator_reserve_bytes=0, nccl_bytes=5)
    assert o.outside_allocator_bytes == o.cuda_context_bytes + o.kernel_images_bytes + 5


def test_eager_loading_before_cuda_11_7_adds_pytorchs_published_difference() -> None:
    # pytorch/pytorch#86509: the same command used 666,632,192 B with CUDA_MODULE_LOADING=DEFAULT (eager under
    # CUDA 11.7) and 287,047,680 B with LAZY.
    assert EAGER_MODULES_BYTES == 666_632_192 - 287_047_680
    for gpu in (None, get_gpu("a100-sxm-80gb"), get_gpu("h200-sxm-141gb")):
        lazy, _ = context_bytes(gpu, (11, 7))
        eager, basis = context_bytes(gpu, (11, 6))
        assert eager - lazy == EAGER_MODULES_BYTES
        assert "eagerly" in basis and "lower bound" in basis and "#86509" in basis


def test_cuda_12_and_13_share_the_figures_and_say_so() -> None:
    for gpu in (None, get_gpu("h200-sxm-141gb"), get_gpu("rtx-4090")):
        at_13, basis_13 = context_bytes(gpu, (13, 0))
        at_12, basis_12 = context_bytes(gpu, (12, 8))
        assert at_12 == at_13 == context_bytes(gpu, (11, 8))[0]
        assert "CUDA 13.0 figure used for CUDA 12.8" in basis_12 and "used for" not in basis_13
    assert context_bytes(get_gpu("mi300x"), (11, 0)) == context_bytes(get_gpu("mi300x"))  # ROCm: no CUDA term


def test_estimate_records_the_cuda_release_and_its_context() -> None:
    default = estimate("gpt2", gpu="a100-sxm-80gb")
    old = estimate("gpt2", gpu="a100-sxm-80gb", cuda_version="11.6")
    assert (default.cuda_version, old.cuda_version) == ("13.0", "11.6")
    assert old.overhead.cuda_context_bytes - default.overhead.cuda_context_bytes == EAGER_MODULES_BYTES
    assert old.nvidia_smi_estimate_bytes - default.nvidia_smi_estimate_bytes == EAGER_MODULES_BYTES
    assert old.fit is not None and default.fit is not None
    assert old.fit.required_bytes - default.fit.required_bytes == EAGER_MODULES_BYTES  # the verdict sees it too
    assert "eagerly" in old.overhead.basis
    assert estimate("gpt2", gpu="a100-sxm-80gb", cuda_version="12.4").overhead.cuda_context_bytes == (
        default.overhead.cuda_context_bytes
    )


@pytest.mark.parametrize(
    ("gpu", "cuda", "needle"),
    [
        ("h100-sxm-80gb", "11.7", "needs CUDA 11.8"),
        ("rtx-4090", "11.6", "needs CUDA 11.8"),
        ("b200-sxm-180gb", "12.6", "needs CUDA 12.8"),
        ("rtx-5090", "12.4", "needs CUDA 12.8"),
        ("v100-sxm2-16gb", "13.0", "Turing"),
        ("mi300x", "12.8", "AMD"),
    ],
)
def test_a_cuda_release_that_cannot_run_the_gpu_is_refused(gpu: str, cuda: str, needle: str) -> None:
    from trainfit.errors import StrategyError

    with pytest.raises(StrategyError, match=needle):
        estimate("gpt2", gpu=gpu, cuda_version=cuda)


def test_every_nvidia_catalog_gpu_has_what_the_rescaling_needs() -> None:
    # SM count (cited per entry) and a compute capability with its own resident-threads row (no fall-back), and a
    # CUDA release of the known range that runs it.
    from trainfit.cuda_facts import MAX_THREADS_PER_SM, cuda_supports, parse_compute_capability

    for g in list_gpus():
        if g.compute_capability is None:
            continue
        assert g.sm_count, g.id
        assert parse_compute_capability(g.compute_capability) in MAX_THREADS_PER_SM, g.id
        assert cuda_supports(g.compute_capability, (12, 8)) is None, g.id


@pytest.mark.parametrize(
    ("gpu_id", "bare_context_mib", "source"),
    [
        ("rtx-3090", 256, "invoke-ai/InvokeAI#9413: torch 2.7.1+cu128, driver 610.43.03, a context made at start-up"),
        ("b200-sxm-180gb", 612, "unslothai/unsloth#8669: after torch.cuda.mem_get_info(0)"),
    ],
)
def test_public_bare_contexts_stay_below_the_context_after_cublas(
    gpu_id: str, bare_context_mib: int, source: str
) -> None:
    # A context with no cuBLAS initialised (and no kernels run) cannot be larger than ours after cuBLAS
    # initialisation; docs/accuracy.md, "The CUDA context", lists these figures.
    assert bare_context_mib * 2**20 < context_bytes(get_gpu(gpu_id))[0], source


def test_a_gpu_with_a_catalog_measurement_gets_its_own_context() -> None:
    import dataclasses

    from trainfit.hardware.gpus import ContextMeasurement

    a100 = get_gpu("a100-sxm-80gb")
    assert not a100.cuda_contexts and "estimated" in context_bytes(a100)[1]
    m12 = ContextMeasurement(bytes_=600 * 2**20, cuda="12.8", torch="2.9.0+cu128", driver="570", source="a test")
    m13 = dataclasses.replace(m12, bytes_=610 * 2**20, cuda="13.0", torch="2.11.0+cu130")
    measured = dataclasses.replace(a100, cuda_contexts=(m12, m13))
    assert context_bytes(measured, (12, 4)) == (600 * 2**20, context_bytes(measured, (12, 4))[1])
    assert context_bytes(measured, (13, 0))[0] == 610 * 2**20
    assert "CUDA 12.8" in context_bytes(measured, (12, 4))[1] and "a test" in context_bytes(measured, (12, 4))[1]
    assert context_bytes(measured, (11, 6))[0] == 600 * 2**20 + EAGER_MODULES_BYTES  # nearest: 12.8, then eager


def test_catalog_context_measurements_are_lazy_loading_ones() -> None:
    # The eager-loading term is added on top of a lazy measurement; a catalog measurement under CUDA < 11.7 would
    # need the opposite correction, which trainfit does not model.
    from trainfit.overhead import LAZY_LOADING_CUDA

    for g in list_gpus():
        for m in g.cuda_contexts:
            assert m.cuda_release >= LAZY_LOADING_CUDA and m.source, g.id


def test_the_default_cuda_release_on_a_gpu_it_cannot_run_is_noted() -> None:
    # CUDA 13 runs Turing onwards; a V100 estimate without --cuda-version keeps the (shared) 11.7-13.x figures and
    # says so, where naming 12.8 is silent and gives the same context.
    v100 = estimate("gpt2", gpu="v100-sxm2-16gb")
    named = estimate("gpt2", gpu="v100-sxm2-16gb", cuda_version="12.8")
    assert any("cannot run" in n and "--cuda-version" in n for n in v100.notes)
    assert not any("cannot run" in n for n in named.notes)
    assert v100.overhead.cuda_context_bytes == named.overhead.cuda_context_bytes
