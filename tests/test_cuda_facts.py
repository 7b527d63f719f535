"""Facts shared by the analytic model and the trace, checked against their sources by hand arithmetic."""

from __future__ import annotations

import pytest

from trainfit.cuda_facts import SdpaKernel, allocator_bytes, quantized_weight_tensors, sdpa_kernel_for


def test_allocator_rounds_to_512() -> None:
    assert [allocator_bytes(n) for n in (0, 1, 512, 513, 1024)] == [0, 512, 512, 1024, 1024]


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
