"""Facts shared by the analytic model and the trace, checked against their sources by hand arithmetic."""

from __future__ import annotations

from typing import Any

import pytest

from trainfit.cuda_facts import SdpaKernel, allocator_bytes, quantized_weight_tensors, sdpa_kernel_for


def test_allocator_rounds_to_512() -> None:
    assert [allocator_bytes(n) for n in (0, 1, 512, 513, 1024)] == [0, 512, 512, 1024, 1024]


def test_allocator_bytes_is_the_simulators_round_size() -> None:
    """The closed form's per-tensor rounding is the simulator's ``round_size`` under the default setting (one fact;
    ``allocator_bytes`` stays a plain function for the closed form's hot loops, and what the default allocator hands
    out beyond it is ``Component.ALLOCATOR_ROUNDING``, read from the simulation)."""
    from trainfit.allocator import AllocatorConfig, round_size

    c = AllocatorConfig()
    sizes = [1, 511, 512, 513, 2**20 - 1, 2**20, 2**20 + 1, 10 * 2**20 + 7, 1_179_648, 3 * 10**9 + 1]
    assert [allocator_bytes(n) for n in sizes] == [round_size(n, c) for n in sizes]


@pytest.mark.parametrize("n", [4096 * 4096, 4096 * 14336, 64 * 1000 + 3])
def test_4bit_bytes_match_design_4_4(n: int) -> None:
    blocks = -(-n // 64)
    # DESIGN §4.4 (bitsandbytes 0.50 on CPU): nf4 = n/2 + 4·⌈n/64⌉ + 64; double quant adds the nested parts.
    assert sum(quantized_weight_tensors(n, 1, "nf4", double_quant=False)) == -(-n // 2) + 4 * blocks + 64
    assert sum(quantized_weight_tensors(n, 1, "nf4")) == -(-n // 2) + blocks + 4 * -(-blocks // 256) + 1024 + 4 + 64


def test_int8_bytes() -> None:
    # LLM.int8: N·K int8 + one fp32 scale per output row.
    assert sum(quantized_weight_tensors(4096 * 11008, 11008, "int8")) == 4096 * 11008 + 4 * 11008


@pytest.mark.parametrize(
    ("kw", "kernel"),
    [
        (dict(half=True, masked=False, same_heads=True, gqa_ok=False, head_dim=128, v_head_dim=128), "flash"),
        (dict(half=True, masked=True, same_heads=True, gqa_ok=False, head_dim=128, v_head_dim=128), "efficient"),
        (dict(half=False, masked=False, same_heads=True, gqa_ok=False, head_dim=64, v_head_dim=64), "efficient"),
        # fp32 GQA: no flash (16-bit only), no memory-efficient (no grouped heads) -> math.
        (dict(half=False, masked=False, same_heads=False, gqa_ok=True, head_dim=64, v_head_dim=64), "math"),
        (dict(half=True, masked=False, same_heads=False, gqa_ok=True, head_dim=64, v_head_dim=64), "flash"),
        (dict(half=True, masked=False, same_heads=True, gqa_ok=False, head_dim=288, v_head_dim=288), "efficient"),
        # A pre-Ampere GPU has no flash kernel.
        (
            dict(
                half=True, masked=False, same_heads=False, gqa_ok=True, head_dim=64, v_head_dim=64, flash_capable=False
            ),
            "math",
        ),
    ],
)
def test_sdpa_kernel_rules(kw: dict[str, object], kernel: str) -> None:
    assert sdpa_kernel_for(**kw) is SdpaKernel(kernel)  # type: ignore[arg-type]


def test_flash_needs_compute_capability_8() -> None:
    from trainfit.cuda_facts import has_flash_attention

    assert [has_flash_attention(cc) for cc in ("7.0", "7.5", "8.0", "8.9", "9.0", None)] == [
        False,
        False,
        True,
        True,
        True,
        True,
    ]


# -- bitsandbytes' 4-bit kernel choice --------------------------------------------------------------------

#: (compute capability, SMs) of the GPUs the rule names: V100, T4, A100, A10, Jetson Orin, L4, H100, B200,
#: RTX 5090, GB10, and a pre-Volta part.
_ARCHS = [("7.0", 80), ("7.5", 40), ("8.0", 108), ("8.6", 72), ("8.7", 16), ("8.9", 58), ("9.0", 132),
          ("10.0", 148), ("12.0", 170), ("12.1", 48), ("6.1", 28)]  # fmt: skip
#: Weight shapes (n, k): small and large, short/square/tall K, a few waves of 64-column blocks.
_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096), (128256, 4096), (512, 2048),
           (8192, 512), (2048, 2048), (3072, 1024), (4096, 12288), (6144, 640), (2304, 9216), (256, 4096),
           (12800, 5120), (27648, 5120), (8192, 8192), (1536, 7168)]  # fmt: skip
_ROWS = [1, 4, 5, 6, 7, 8, 9, 12, 16, 17, 23, 24, 32, 33, 48, 49, 64, 65, 96, 97, 128, 129, 192, 256, 257, 320,
         321, 384, 385, 512, 513, 1536, 1537]  # fmt: skip


def _bitsandbytes_rule() -> tuple[Any, list[int]]:
    """bitsandbytes' own ``_gemm_4bit_use_custom_cuda``, taken from the installed backends/cuda/ops.py by its
    syntax tree (the module itself needs a CUDA build of torch to import) and run with the GPU query
    ``_gpu_dispatch_props`` answered from a list the caller sets to [SMs, major, minor]."""
    import ast
    import importlib.util
    from pathlib import Path

    import torch

    spec = importlib.util.find_spec("bitsandbytes")
    if spec is None or spec.origin is None:
        pytest.skip("bitsandbytes is not installed")
    path = Path(spec.origin).parent / "backends" / "cuda" / "ops.py"
    tree = ast.parse(path.read_text())
    fn = next((f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "_gemm_4bit_use_custom_cuda"), None)
    floor = [
        a for a in tree.body if isinstance(a, ast.Assign) and ast.unparse(a.targets[0]) == "_GEMM_4BIT_CUSTOM_FLOOR_M"
    ]
    if fn is None or not floor:
        pytest.skip("bitsandbytes older than 0.50.2 (no per-architecture 4-bit rule)")
    fn.decorator_list = []
    answer: list[int] = [0, 0, 0]
    scope: dict[str, Any] = {"torch": torch, "_gpu_dispatch_props": lambda _index: tuple(answer)}
    exec(compile(ast.Module(body=[*floor, fn], type_ignores=[]), str(path), "exec"), scope)
    return scope["_gemm_4bit_use_custom_cuda"], answer


def test_bnb_4bit_rule_follows_bitsandbytes_own_table() -> None:
    """``bnb_gemm_4bit_fused`` against bitsandbytes' own ``_gemm_4bit_use_custom_cuda`` (backends/cuda/ops.py),
    its GPU query answered per architecture: every row count, shape, dtype and GPU above agrees."""
    torch = pytest.importorskip("torch")
    real, answer = _bitsandbytes_rule()
    from trainfit.cuda_facts import BNB_4BIT_CUSTOM_MAX_ROWS, bnb_gemm_4bit_fused

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    checked = 0
    for cc, sms in _ARCHS:
        major, minor = (int(x) for x in cc.split("."))
        answer[:] = [sms, major, minor]
        for n, k in _SHAPES:
            for compute, dt in dtypes.items():
                for m in _ROWS:
                    want = m <= BNB_4BIT_CUSTOM_MAX_ROWS and real(0, dt, m, n, k)
                    got = bnb_gemm_4bit_fused(m, n, k, compute=compute, compute_capability=cc, sm_count=sms)
                    assert got == want, (cc, sms, n, k, compute, m)
                    checked += 1
    assert checked == len(_ARCHS) * len(_SHAPES) * 3 * len(_ROWS)


def test_bnb_4bit_rule_without_a_gpu_is_the_bound_every_gpu_keeps() -> None:
    """No --gpu: fused only where every CUDA architecture fuses (the 4-row floor; fp32's SIMT range up to 7
    rows), and never for a k that is not a multiple of the 64-element block (``gemm_4bit``'s alignment check)."""
    from trainfit.cuda_facts import bnb_gemm_4bit_fused

    assert bnb_gemm_4bit_fused(4, 4096, 4096, compute="bf16")
    assert not bnb_gemm_4bit_fused(5, 4096, 4096, compute="bf16")
    assert bnb_gemm_4bit_fused(7, 4096, 4096, compute="fp32")
    assert not bnb_gemm_4bit_fused(8, 4096, 4096, compute="fp32")
    assert not bnb_gemm_4bit_fused(1, 4096, 688, compute="bf16")  # 688 % 64 != 0
    for cc, sms in _ARCHS:  # the bound holds on every architecture
        for n, k in _SHAPES:
            assert bnb_gemm_4bit_fused(4, n, k, compute="bf16", compute_capability=cc, sm_count=sms)


def test_cuda_versions_parse_and_stay_in_the_known_range() -> None:
    from trainfit.cuda_facts import parse_cuda_version

    assert parse_cuda_version("12.8") == (12, 8)
    assert parse_cuda_version("13.0.2") == (13, 0)
    for bad in ("12", "cu128", "10.2", "14.0", ""):
        with pytest.raises(ValueError):
            parse_cuda_version(bad)


def test_cuda_supports_follows_nvidias_architecture_tables() -> None:
    from trainfit.cuda_facts import cuda_supports

    assert cuda_supports("8.0", (11, 0)) is None
    assert cuda_supports("8.6", (11, 0)) is not None and cuda_supports("8.6", (11, 1)) is None
    assert cuda_supports("9.0", (11, 7)) is not None and cuda_supports("9.0", (11, 8)) is None
    assert cuda_supports("8.9", (11, 7)) is not None and cuda_supports("8.9", (11, 8)) is None
    assert cuda_supports("10.0", (12, 6)) is not None and cuda_supports("10.0", (12, 8)) is None
    assert cuda_supports("12.0", (12, 6)) is not None and cuda_supports("12.0", (13, 0)) is None
    assert cuda_supports("7.0", (12, 9)) is None and "Turing" in (cuda_supports("7.0", (13, 0)) or "")
    assert cuda_supports("7.5", (13, 0)) is None


def test_resident_threads_per_sm_follow_nvidias_arch_traits() -> None:
    # NVIDIA CCCL libcudacxx/include/cuda/__device/arch_traits.h (max_threads_per_multiprocessor); 8.8 and 11.0
    # are 1536 although their majors' first rows (8.0, none) would say 2048.
    from trainfit.cuda_facts import max_threads_per_sm

    expected = {"7.0": 2048, "7.5": 1024, "8.0": 2048, "8.6": 1536, "8.7": 1536, "8.8": 1536, "8.9": 1536}
    expected |= {"9.0": 2048, "10.0": 2048, "10.3": 2048, "11.0": 1536, "12.0": 1536, "12.1": 1536}
    assert {cc: max_threads_per_sm(cc) for cc in expected} == expected
