"""Facts about CUDA, PyTorch and bitsandbytes that the analytic model *and* the trace rely on, kept in one
place so the two methods cannot drift apart.

* The caching allocator hands out blocks in multiples of 512 bytes (``kMinBlockSize`` in
  c10/cuda/CUDACachingAllocator.cpp); ``max_memory_allocated`` counts the rounded sizes.
* Which kernel ``scaled_dot_product_attention`` runs on CUDA (``select_sdp_backend`` in
  aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, default priority flash > memory-efficient > math).
  FlashAttention needs 16-bit inputs, no mask, equal q/v head dims ≤ 256 (other dims are padded to 8), and
  equal head counts unless ``enable_gqa``; it needs compute capability ≥ 8.0 (``check_sm_version``). The
  memory-efficient kernel takes masks and fp32 but no grouped k/v heads (built without GQA support) and
  needs head dims aligned to 8 (16-bit) or 4 (fp32) on sm80+ (``minimum_gemm_alignment``). Everything else
  runs the math kernel, which materialises fp32 b·heads·s² scores.
* bitsandbytes block sizes: 8-bit optimizers quantise states in blocks of 256 with fp32 absmax and keep
  tensors under 4096 elements in 32 bits (``Optimizer2State``, ``min_8bit_size``); 4-bit weights (nf4/fp4)
  use blocks of 64 with fp32 absmax, or with double quantisation uint8 absmax plus an fp32 absmax per 256
  blocks and a 256-entry fp32 code (``quantize_4bit``, ``QuantState``; checked on CPU, see DESIGN §4.4);
  LLM.int8 stores int8 weights plus one fp32 scale per output row (``Int8Params``).
* The most threads an SM keeps resident, by compute capability (CUDA C++ Programming Guide, "Technical
  Specifications per Compute Capability": 2048 on 7.0, 8.0, 9.0 and 10.0; 1024 on 7.5; 1536 on 8.6, 8.7,
  8.9 and 12.x). The driver sizes the context's local memory (thread stacks) by it.
"""

from __future__ import annotations

from enum import StrEnum

#: Allocation granularity of the CUDA caching allocator.
ALLOCATOR_BLOCK_BYTES = 512

#: bitsandbytes 8-bit optimizer states.
BNB_OPTIM_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096

#: bitsandbytes 4-bit weights.
BNB_4BIT_BLOCK = 64
BNB_NESTED_BLOCK = 256
BNB_4BIT_CODE_ENTRIES = 16  # nf4/fp4 lookup table, fp32
BNB_NESTED_CODE_ENTRIES = 256  # the dynamic map used by double quantisation, fp32
#: Rows (tokens × batch) up to which every CUDA architecture runs bitsandbytes' fused 4-bit matmul in
#: inference (``_GEMM_4BIT_CUSTOM_FLOOR_M``, bitsandbytes 0.50 backends/cuda/ops.py ``gemm_4bit``); above it the
#: weight may be dequantised whole (always above 1536 rows; between, a per-architecture table decides, and
#: the dequantised weight is the larger memory, which both methods assume).
BNB_4BIT_FUSED_MAX_ROWS = 4
#: bitsandbytes' LLM.int8 quantises activations with an outlier threshold (transformers'
#: ``llm_int8_threshold`` default).
BNB_INT8_THRESHOLD = 6.0

#: FlashAttention's largest head dim and minimum compute capability.
FLASH_MAX_HEAD_DIM = 256
FLASH_MIN_COMPUTE_CAPABILITY = (8, 0)


#: Resident threads per SM by compute capability (major, minor); see the module docstring.
MAX_THREADS_PER_SM: dict[tuple[int, int], int] = {
    (7, 0): 2048,
    (7, 2): 2048,
    (7, 5): 1024,
    (8, 0): 2048,
    (8, 6): 1536,
    (8, 7): 1536,
    (8, 9): 1536,
    (9, 0): 2048,
    (10, 0): 2048,
    (12, 0): 1536,
}


def parse_compute_capability(compute_capability: str) -> tuple[int, int]:
    """``"8.6"`` → ``(8, 6)``."""
    major, _, minor = compute_capability.partition(".")
    return int(major), int(minor or 0)


def max_threads_per_sm(compute_capability: str) -> int:
    """Resident threads per SM for an NVIDIA compute capability (unknown future minors: their major's value)."""
    cc = parse_compute_capability(compute_capability)
    if cc in MAX_THREADS_PER_SM:
        return MAX_THREADS_PER_SM[cc]
    same_major = [v for (major, _), v in sorted(MAX_THREADS_PER_SM.items()) if major == cc[0]]
    return same_major[0] if same_major else 2048


def allocator_bytes(nbytes: int) -> int:
    """Bytes the caching allocator hands out for a request of ``nbytes`` (0 stays 0)."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // ALLOCATOR_BLOCK_BYTES) * ALLOCATOR_BLOCK_BYTES


class SdpaKernel(StrEnum):
    FLASH = "flash"
    EFFICIENT = "efficient"
    MATH = "math"


def sdpa_kernel_for(
    *,
    half: bool,
    masked: bool,
    same_heads: bool,
    gqa_ok: bool,
    head_dim: int,
    v_head_dim: int,
    causal_cross: bool = False,
    flash_capable: bool = True,
) -> SdpaKernel:
    """The kernel SDPA picks. ``half``: 16-bit q/k/v (else fp32); ``same_heads``: q, k and v have equal head
    counts; ``gqa_ok``: fewer k/v heads are acceptable to flash (``enable_gqa`` with a valid grouping);
    ``causal_cross``: ``is_causal`` with different q and k lengths (flash refuses it); ``flash_capable``: the
    GPU has compute capability ≥ 8.0."""
    d, dv = head_dim, v_head_dim
    flash_shapes = d == dv and d <= FLASH_MAX_HEAD_DIM and not causal_cross
    if flash_capable and half and not masked and flash_shapes and (same_heads or gqa_ok):
        return SdpaKernel.FLASH
    align = 8 if half else 4
    if same_heads and d % align == 0 and dv % align == 0:
        return SdpaKernel.EFFICIENT
    return SdpaKernel.MATH


def has_flash_attention(compute_capability: str | None) -> bool:
    """Whether PyTorch's FlashAttention kernel runs on a GPU of this compute capability (NVIDIA "8.6" etc.).
    ``None`` (AMD): ROCm builds ship flash attention for MI200/MI300 (aotriton), so it is assumed."""
    if compute_capability is None:
        return True
    return parse_compute_capability(compute_capability) >= FLASH_MIN_COMPUTE_CAPABILITY


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


def quantized_weight_tensors(numel: int, rows: int, kind: str, *, double_quant: bool = True) -> tuple[int, ...]:
    """Bytes of each tensor a quantised weight of ``numel`` elements (``rows`` output features) keeps, before
    allocator rounding. ``kind``: ``nf4``/``fp4`` (4-bit, packed two per byte) or ``int8`` (LLM.int8)."""
    if kind == "int8":
        return (numel, 4 * rows)  # int8 weight, fp32 row scale (SCB)
    if kind not in ("nf4", "fp4"):
        raise ValueError(f"unknown quantisation {kind!r}")
    packed = _blocks(numel, 2)
    blocks = _blocks(numel, BNB_4BIT_BLOCK)
    code = 4 * BNB_4BIT_CODE_ENTRIES
    if not double_quant:
        return (packed, 4 * blocks, code)
    nested = _blocks(blocks, BNB_NESTED_BLOCK)
    # uint8 absmax, fp32 nested absmax, fp32 nested code, fp32 offset, the 4-bit code.
    return (packed, blocks, 4 * nested, 4 * BNB_NESTED_CODE_ENTRIES, 4, code)
