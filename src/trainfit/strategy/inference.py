"""What an inference request is (the input of ``trainfit infer``): batch, prompt and new tokens, the
weights' storage format, the cache's dtype and kind, the attention kernel and the tensor-parallel degree.

Shared by both methods (the closed forms in :mod:`trainfit.analytic.inference` and the ``generate`` trace in
:mod:`trainfit.trace.generate`), so it lives here, beside the training :class:`~trainfit.strategy.Strategy`.
Formats are widths in bits (:class:`WeightFormat`, :class:`KVFormat`); quantised weights' exact bytes are in
:mod:`trainfit.cuda_facts`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from trainfit.errors import StrategyError
from trainfit.strategy.training import Attention

#: Tokens in a paged-attention block (vLLM's default ``--block-size``).
DEFAULT_BLOCK_SIZE = 16


class WeightFormat(StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    INT8 = "int8"
    NF4 = "nf4"
    FP4 = "fp4"

    @property
    def bits(self) -> int:
        return {"fp32": 32, "bf16": 16, "fp16": 16, "fp8": 8, "int8": 8, "nf4": 4, "fp4": 4}[self.value]

    @property
    def compute(self) -> KVFormat:
        """The dtype activations (and a default cache) take: the weights' own 16/32-bit format, else bf16."""
        if self is WeightFormat.FP32:
            return KVFormat.FP32
        if self is WeightFormat.FP16:
            return KVFormat.FP16
        return KVFormat.BF16

    @property
    def bnb(self) -> bool:
        return self in (WeightFormat.INT8, WeightFormat.NF4, WeightFormat.FP4)


class KVFormat(StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"

    @property
    def bits(self) -> int:
        return {"fp32": 32, "bf16": 16, "fp16": 16, "fp8": 8}[self.value]


class CacheKind(StrEnum):
    DYNAMIC = "dynamic"  # transformers DynamicCache (sliding layers windowed, as transformers does)
    STATIC = "static"  # transformers StaticCache, max_cache_len = prompt + new tokens
    SLIDING = "sliding"  # DynamicCache on a model with a sliding window (refused without one)
    PAGED = "paged"  # vLLM-style blocks of block_size tokens


def _coerce(obj: object, name: str, enum: type[StrEnum]) -> None:
    value = getattr(obj, name)
    if value is None or isinstance(value, enum):
        return
    try:
        object.__setattr__(obj, name, enum(str(value).lower()))
    except ValueError:
        choices = ", ".join(m.value for m in enum)
        raise StrategyError(f"unknown {name.replace('_', '-')} '{value}'; choose one of: {choices}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class InferenceSetup:
    """One inference request shape and how it runs. ``kv_dtype=None``: the cache in the compute dtype.

    ``compute_dtype``: bitsandbytes 4-bit's ``bnb_4bit_compute_dtype`` (nf4/fp4 only). None means bf16, the
    activations' dtype (``BitsAndBytesConfig(bnb_4bit_compute_dtype=torch.bfloat16)``, the usual QLoRA recipe).
    transformers' own default is fp32 (``BitsAndBytesConfig.__init__``: None → ``torch.float32``), and it hands
    it to every ``Linear4bit``, which then skips its switch to the input's dtype (bitsandbytes
    ``Linear4bit.compute_type_is_set``): each 4-bit linear casts its bf16 input to fp32, dequantises the weight
    to fp32 and casts the fp32 output back. The activations between layers stay in the model's dtype.

    ``compute_capability`` ("9.0") and ``sm_count``: the GPU that bitsandbytes' 4-bit matmul asks which kernel
    to run for 5–1536 rows (``trainfit.cuda_facts.bnb_gemm_4bit_fused``); :func:`trainfit.infer.infer` takes them
    from the ``--gpu`` catalog entry. None: the choice every CUDA GPU makes (fused up to 4 rows)."""

    batch: int = 1
    prompt: int = 2048
    new_tokens: int = 256
    dtype: WeightFormat = WeightFormat.BF16
    kv_dtype: KVFormat | None = None
    cache: CacheKind = CacheKind.DYNAMIC
    block_size: int = DEFAULT_BLOCK_SIZE
    attention: Attention = Attention.SDPA
    tp: int = 1
    double_quant: bool = True
    compute_dtype: KVFormat | None = None
    compute_capability: str | None = None
    sm_count: int | None = None
    padded: bool = False  # prompts of unequal length, left-padded: generate keeps the 2-D mask, models build 4-D ones

    def __post_init__(self) -> None:
        _coerce(self, "dtype", WeightFormat)
        _coerce(self, "kv_dtype", KVFormat)
        _coerce(self, "compute_dtype", KVFormat)
        if self.compute_dtype is not None:
            if self.dtype not in (WeightFormat.NF4, WeightFormat.FP4):
                raise StrategyError(
                    "--compute-dtype is bitsandbytes 4-bit's bnb_4bit_compute_dtype: use it with --dtype nf4|fp4"
                )
            if self.compute_dtype is KVFormat.FP8:
                raise StrategyError("--compute-dtype: bitsandbytes 4-bit computes in bf16, fp16 or fp32, not fp8")
        _coerce(self, "cache", CacheKind)
        _coerce(self, "attention", Attention)
        cc = self.compute_capability
        if cc is not None and not re.fullmatch(r"\d+\.\d+", cc):
            raise StrategyError(f"compute capability must look like 9.0, got {cc!r}")
        for name in ("batch", "prompt", "new_tokens", "block_size", "tp", "sm_count"):
            v = getattr(self, name)
            if name == "sm_count" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise StrategyError(f"{name.replace('_', ' ')} must be a positive whole number, got {v!r}")

    @property
    def compute_bits(self) -> int:
        return self.dtype.compute.bits

    @property
    def dtype_bits(self) -> int:
        return self.dtype.bits

    @property
    def four_bit_compute(self) -> KVFormat:
        """The dtype a 4-bit linear computes in: ``compute_dtype``, else the activations' dtype."""
        return self.compute_dtype or self.dtype.compute

    @property
    def kv_format(self) -> KVFormat:
        return self.kv_dtype or self.dtype.compute

    @property
    def context(self) -> int:
        """Tokens a sequence reaches: prompt + new tokens."""
        return self.prompt + self.new_tokens
