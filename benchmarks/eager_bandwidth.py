"""The bandwidth eager PyTorch elementwise kernels reach, from a published micro-benchmark (the source of
``trainfit.planner.speed.EAGER_ELEMENTWISE_EFFICIENCY``; docs/speed.md, "Constants").

    PYTHONPATH=src python benchmarks/eager_bandwidth.py

Liger-Kernel times Hugging Face's eager modules against its Triton kernels (linkedin/Liger-Kernel
``benchmark/data/all_benchmark_data.csv``, provider ``huggingface``, "NVIDIA A100-SXM4-80GB", liger 0.2.1,
2024-09-03; the scripts of that date, commit 26a578e: ``benchmark/scripts/benchmark_rms_norm.py``,
``benchmark_rope.py``). The medians (``y_value_50``, ms) of the largest rows are transcribed below. Each is divided
into the bytes the op moves by the speed model's op-by-op rules (``elementwise_bytes``,
``elementwise_backward_bytes``), written out here for the benchmark's own dtypes:

- ``LlamaRMSNorm`` over x (M × H, bf16) with ``nn.Parameter(torch.ones(H))`` — an **fp32** weight — and a bf16 ``dy``:
  forward ``x.to(fp32)`` 2 + 4, ``pow(2)`` 8, ``mean`` 4, ``* rsqrt`` 8, ``.to(bf16)`` 4 + 2, ``weight *`` a bf16 tensor
  promotes to fp32: 2 + 4 — 38 B per element; backward: autograd casts the bf16 ``dy`` to the fp32 output's dtype
  (2 + 4), ``grad · weight`` (4 + 4) cast to bf16 for the bf16 operand (4 + 2), the weight's gradient ``grad · n``
  (4 + 2 + 4) reduced over tokens (4), the cast back of ``.to(bf16)`` (2 + 4), the rsqrt branch 8 + 12 + 4, ``mean``
  4, ``pow`` 20, the two fp32 gradients of x summed 12, the cast back of ``.to(fp32)`` (4 + 2) — 106 B per element;
- ``apply_rotary_pos_emb`` on q (1, s, 32 heads, 256).transpose(1, 2) and k (8 heads), bf16: 10·2 B per element of
  q and k forward, 15·2 backward (``elementwise_bytes``' rotary rule; cos and sin broadcast, counted as cached).

The fraction is bytes / time / 2039 GB/s (the catalog's A100-SXM4-80GB). Forward + backward of both ops together is
the constant; each row is printed too. The rows are the sweeps' largest (1.9–8.4 ms per call), where launch overheads
weigh least.
"""

from __future__ import annotations

from trainfit.hardware import get_gpu
from trainfit.planner.speed import EAGER_ELEMENTWISE_EFFICIENCY

#: (op, mode, elements, bytes per element, milliseconds): the largest rows of each sweep.
RMS_M, RMS_H = 2048, 32768
ROPE_S, ROPE_Q, ROPE_KV = 16384, 32 * 256, 8 * 256
RMS_FWD, RMS_BWD = 38, 106
ROPE_FWD, ROPE_BWD = 10 * 2, 15 * 2
ROWS: tuple[tuple[str, str, int, int, float], ...] = (
    ("LlamaRMSNorm M 2048, H 32768", "forward", RMS_M * RMS_H, RMS_FWD, 1.9190720319747925),
    ("LlamaRMSNorm M 2048, H 32768", "backward", RMS_M * RMS_H, RMS_BWD, 5.0147199630737305),
    ("LlamaRMSNorm M 2048, H 32768", "full", RMS_M * RMS_H, RMS_FWD + RMS_BWD, 6.910431861877441),
    ("apply_rotary_pos_emb T 16384, h 8192", "forward", ROPE_S * (ROPE_Q + ROPE_KV), ROPE_FWD, 3.8169920444488525),
    ("apply_rotary_pos_emb T 16384, h 8192", "backward", ROPE_S * (ROPE_Q + ROPE_KV), ROPE_BWD, 4.557248115539551),
    (
        "apply_rotary_pos_emb T 16384, h 8192",
        "full",
        ROPE_S * (ROPE_Q + ROPE_KV),
        ROPE_FWD + ROPE_BWD,
        8.365951538085938,
    ),
)


def fraction(bytes_moved: float, ms: float, gbps: float) -> float:
    return bytes_moved / (ms * 1e-3) / (gbps * 1e9)


def combined() -> float:
    """Forward + backward of both ops together: their bytes over their time, as a fraction of the A100's bandwidth."""
    gbps = get_gpu("a100-sxm-80gb").memory_bandwidth_gbps or 0.0
    full = [r for r in ROWS if r[1] == "full"]
    return fraction(sum(n * b for _, _, n, b, _ in full), sum(ms for *_, ms in full), gbps)


def main() -> None:
    gbps = get_gpu("a100-sxm-80gb").memory_bandwidth_gbps or 0.0
    print(f"eager Hugging Face modules on an A100-SXM4-80GB ({gbps:.0f} GB/s), Liger-Kernel's published medians")
    for op, mode, n, b, ms in ROWS:
        moved = n * b
        print(
            f"  {op}, {mode}: {moved / 1e9:.2f} GB in {ms:.3f} ms = {moved / ms / 1e9:.2f} TB/s "
            f"({fraction(moved, ms, gbps):.3f} of peak)"
        )
    print(
        f"  both, forward + backward: {combined():.3f} of peak "
        f"(EAGER_ELEMENTWISE_EFFICIENCY = {EAGER_ELEMENTWISE_EFFICIENCY})"
    )


if __name__ == "__main__":
    main()
