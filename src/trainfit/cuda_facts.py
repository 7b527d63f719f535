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
  8.9 and 12.x; NVIDIA's CCCL, libcudacxx/include/cuda/__device/arch_traits.h, ``max_threads_per_multiprocessor``,
  agrees and adds 1536 on 8.8 and 11.0 (Thor), 2048 on 10.3, 1536 on 12.1). The driver sizes the context's local
  memory (thread stacks) by it.
* Which CUDA releases run which GPUs (:func:`cuda_supports`): compute capability 8.0 from CUDA 11.0 and 8.6 from
  11.1 (PyTorch's nvrtc table, pytorch/pytorch#87611: "11.0 supports 3-8.0", 11.1–11.7 "only up to sm_86");
  8.9 (Ada) and 9.0 (Hopper) from 11.8 (the same thread; GROMACS merge request 3180, "Ada (89) and Hopper (90)
  support now exists in CUDA 11.8"); Blackwell 10.0 and 12.0 from 12.8 (NVIDIA Blackwell Compatibility Guide,
  "Building Applications Using CUDA Toolkit 12.8"); CUDA 13.0 "supports all NVIDIA architectures from Turing
  through Grace Blackwell" (CUDA Features Archive, docs.nvidia.com/cuda/cuda-features-archive), so Volta (7.0,
  7.2) stops at 12.x.
"""

from __future__ import annotations

import re
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
#: inference (``_GEMM_4BIT_CUSTOM_FLOOR_M``, bitsandbytes 0.50 backends/cuda/ops.py ``gemm_4bit``), given a
#: block-aligned inner dimension; between it and :data:`BNB_4BIT_CUSTOM_MAX_ROWS` the GPU decides
#: (:func:`bnb_gemm_4bit_fused`).
BNB_4BIT_FUSED_MAX_ROWS = 4
#: Rows above which bitsandbytes' CUDA ``gemm_4bit`` always dequantises (``_gemm_4bit_custom_max_m``).
BNB_4BIT_CUSTOM_MAX_ROWS = 1536
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
    (8, 8): 1536,
    (8, 9): 1536,
    (9, 0): 2048,
    (10, 0): 2048,
    (10, 3): 2048,
    (11, 0): 1536,
    (12, 0): 1536,
    (12, 1): 1536,
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


#: The CUDA releases trainfit knows (:func:`parse_cuda_version` refuses others).
OLDEST_CUDA = (11, 0)
NEWEST_CUDA_MAJOR = 13
#: First CUDA release that runs each compute capability newer than CUDA 11.0's (see the module docstring).
MIN_CUDA_FOR_CAPABILITY: dict[tuple[int, int], tuple[int, int]] = {
    (8, 6): (11, 1),
    (8, 9): (11, 8),
    (9, 0): (11, 8),
    (10, 0): (12, 8),
    (12, 0): (12, 8),
}
#: Oldest compute capability a CUDA major still runs (13.x: Turing onwards).
MIN_CAPABILITY_FOR_CUDA_MAJOR: dict[int, tuple[int, int]] = {13: (7, 5)}


def parse_cuda_version(text: str) -> tuple[int, int]:
    """``"12.8"`` / ``"13.0.2"`` → ``(12, 8)``; a ``ValueError`` saying what is accepted otherwise."""
    match = re.fullmatch(r"\s*([0-9]+)\.([0-9]+)(?:\.[0-9]+)?\s*", text)
    if match is None:
        raise ValueError(f"CUDA version '{text}' is not MAJOR.MINOR (e.g. 12.8)")
    version = (int(match.group(1)), int(match.group(2)))
    if version < OLDEST_CUDA or version[0] > NEWEST_CUDA_MAJOR:
        raise ValueError(
            f"CUDA {version[0]}.{version[1]}: trainfit knows CUDA {OLDEST_CUDA[0]}.{OLDEST_CUDA[1]} to "
            f"{NEWEST_CUDA_MAJOR}.x"
        )
    return version


def cuda_supports(compute_capability: str, cuda: tuple[int, int]) -> str | None:
    """None when CUDA ``cuda`` runs a GPU of ``compute_capability``, else why not (one sentence)."""
    cc = parse_compute_capability(compute_capability)
    first = MIN_CUDA_FOR_CAPABILITY.get(cc)
    if first is not None and cuda < first:
        return (
            f"compute capability {compute_capability} needs CUDA {first[0]}.{first[1]} or newer, "
            f"not {cuda[0]}.{cuda[1]}"
        )
    oldest = MIN_CAPABILITY_FOR_CUDA_MAJOR.get(cuda[0])
    if oldest is not None and cc < oldest:
        return (
            f"CUDA {cuda[0]}.x runs compute capability {oldest[0]}.{oldest[1]} (Turing) and newer, not "
            f"{compute_capability}: use CUDA 12.x"
        )
    return None


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


def bnb_gemm_4bit_fused(
    rows: int,
    n: int,
    k: int,
    *,
    compute: str,
    blocksize: int = BNB_4BIT_BLOCK,
    compute_capability: str | None = None,
    sm_count: int | None = None,
) -> bool:
    """Whether bitsandbytes' CUDA ``gemm_4bit`` (every ``Linear4bit`` without grad: ``matmul_4bit``) runs its
    fused kernel — the output only — rather than ``_dequant_linear_fallback`` (the whole ``n × k`` weight
    dequantised, then ``F.linear``), for ``rows`` (tokens × batch) of ``k`` inputs, ``n`` outputs, in
    ``compute`` ("fp32" | "bf16" | "fp16"). bitsandbytes 0.50.2 ``backends/cuda/ops.py``: the registered
    ``gemm_4bit`` kernel dequantises above :data:`BNB_4BIT_CUSTOM_MAX_ROWS` rows and when ``k`` is not a
    multiple of the block size; otherwise ``_gemm_4bit_use_custom_cuda(device, dtype, M, N, K)`` decides: up
    to :data:`BNB_4BIT_FUSED_MAX_ROWS` rows fused on every GPU, beyond that a table calibrated per
    architecture on the compute capability, the SM count (``multi_processor_count``) against
    ``n_blocks = ⌈n/64⌉`` (waves of SMs), the weight's size (``n·k`` under 4 Mi) and its shape (``k`` against
    ``n``). This function follows that table branch for branch. Without the GPU (``compute_capability`` or
    ``sm_count`` None) it answers what holds on every CUDA GPU: fused up to 4 rows (fp32: up to 7)."""
    if rows > BNB_4BIT_CUSTOM_MAX_ROWS or k % blocksize:
        return False
    if rows <= BNB_4BIT_FUSED_MAX_ROWS:
        return True
    fp32 = compute == "fp32"
    if compute_capability is None or sm_count is None:
        return fp32 and rows < 8
    major, minor = (int(x) for x in compute_capability.split(".")[:2])
    return _bnb_custom_by_arch(rows, n, k, major=major, minor=minor, sms=sm_count, fp32=fp32, fp16=compute == "fp16")


def _bnb_custom_by_arch(rows: int, n: int, k: int, *, major: int, minor: int, sms: int, fp32: bool, fp16: bool) -> bool:
    """``_gemm_4bit_use_custom_cuda`` past its 4-row floor (bitsandbytes 0.50.2 ``backends/cuda/ops.py``),
    the branches in its order; each comment names the block it follows."""
    nb = -(-n // 64)
    # no MMA kernel: fp32, pre-sm75, sm70/72, sm75 without fp16 — the SIMT range only
    if fp32 or major < 7 or (major == 7 and (minor < 5 or not fp16)):
        return rows < 8
    if (major, minor) == (8, 7) or major == 11:  # no calibration data
        return False
    if major == 10:  # sm100: dequantise + F.linear wins early
        if nb >= 3 * sms:
            return rows <= 32
        if nb >= sms:
            return k < n and rows <= 8
        return False
    sm75, sm80, sm86 = (major, minor) == (7, 5), (major, minor) == (8, 0), (major, minor) == (8, 6)
    sm90, sm120, sm121 = major == 9, (major, minor) == (12, 0), (major, minor) == (12, 1)
    hbm = sm80 or sm90
    tall2 = k > 2 * n
    if n * k < 4 * 1024 * 1024:  # small weight
        if 2 * k < n:  # very short K
            if hbm:
                low_wave = 3 * nb < sms
                return rows <= ((1536 if low_wave else 512) if sm80 else (512 if low_wave else 320))
            if sm75:
                if nb >= 3 * sms:
                    return rows <= 320
                return rows <= (64 if k >= 1024 else 96 if k >= 704 else 320)
            if nb >= sms:
                return rows <= 320
            return rows <= (192 if nb * k > sms * 320 else 320)
        quarter = 4 * nb <= sms
        if sm80 and quarter:
            if k >= n:
                return rows <= (32 if 8 * nb <= sms else 128)
            return rows <= 384
        if sm75 and nb < sms and rows > 8:
            return rows <= 64
        if quarter:
            return rows <= (32 if (k < n or hbm) else 23)
        return 2 * nb <= sms and rows <= 16
    if rows > 512:
        return False
    if rows < 8:  # 5-7 rows: SIMT, but for HBM tall-K / square shapes at some occupancies
        if hbm and rows >= 6 and nb >= (36 if sm90 else 48):
            lt75, lt60 = 4 * nb < 3 * sms, 5 * nb < 3 * sms
            if k > n and lt75:
                return False
            if k == n and ((sm80 and lt60) or (sm90 and lt75 and not lt60)):
                return False
        return True
    if sm75:
        if nb >= 3 * sms:
            return rows <= (128 if k < n else 64)
        return rows <= (64 if nb >= sms // 2 else 32)
    if sm80:
        if nb >= 3 * sms:
            return rows <= 128
        if nb >= sms:
            return rows <= (64 if k < n else 32)
        if k >= 3 * n and 4 * nb > sms:
            return False
        if k == n and nb >= 48 and 5 * nb < 3 * sms:
            return False
        if 2 * nb < sms:
            if k <= n:
                return rows <= 128
            if 3 * nb >= sms:
                return False
        if nb >= sms // 2 and k < n:
            return rows <= 128
        return rows <= 16
    if sm86:
        return rows <= (128 if nb >= sms else 64 if nb >= sms // 2 else 16)
    if sm90:
        for waves, cap in ((3, 64), (2, 48), (1, 32)):
            if nb >= waves * sms:
                return rows <= cap
        if nb >= sms // 2:
            return not (k >= n and 4 * nb < 3 * sms) and rows <= 16
        return False
    if sm121 and nb >= sms:
        return rows <= 256
    if sm120:
        if nb >= 3 * sms:
            return rows <= 256
        if nb >= 2 * sms:
            return rows <= 128
        if 5 * nb >= 4 * sms:
            return rows <= (96 if k >= n else 64)
        if nb >= sms:
            return rows <= 64
        if nb >= sms // 2:
            return rows <= (64 if (2 * k >= n and nb >= 128) else 8)
        return rows <= (16 if tall2 and nb > 64 else 8)
    # the fallback tiers: sm89 (L4, L40S, RTX 4090), sm121 under one wave, architectures not named
    if nb >= 3 * sms:
        return rows <= 256
    if nb >= 2 * sms:
        return rows <= 128
    if 5 * nb >= 4 * sms:
        if tall2 or nb >= 200:
            return rows <= 128
        if k >= n:
            return rows <= (128 if sms >= 60 else 32)
        return rows <= 64
    if nb >= sms // 2:
        return rows <= (64 if tall2 else 8 if nb >= 64 else 32)
    if k > n and nb <= 48:
        return rows <= (12 if k >= 3 * n else 10)
    return rows <= (16 if (tall2 or nb < 48) else 8)
