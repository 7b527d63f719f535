"""Number formats a tensor can be stored in, with their widths in bits.

Widths are bits, never bytes: a 4-bit format is 4, not ``0.5`` bytes and not ``0`` (llm-analysis's
``BYTES_INT4 == 0`` is the bug this avoids); divide by 8 only at the last step, over a whole tensor.
Formats that store per-block scales beside the packed values (nf4, fp4, LLM.int8) report the width of
the packed values here; :mod:`trainfit.cuda_facts` owns the exact bytes of a quantised tensor.

``tf32`` is a *compute* format (fp32 storage, 10-bit mantissa inside tensor-core matmuls): it stores
in 32 bits. Formats: IEEE 754 (fp32/fp16), Google Brain bfloat16, Micikevicius et al. 2022 ("FP8
Formats for Deep Learning": e4m3, e5m2), Dettmers et al. 2023 (QLoRA: nf4), bitsandbytes (fp4, int8).
"""

from __future__ import annotations

from enum import StrEnum


class DType(StrEnum):
    FP32 = "fp32"
    TF32 = "tf32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8_E4M3 = "fp8-e4m3"
    FP8_E5M2 = "fp8-e5m2"
    INT8 = "int8"
    NF4 = "nf4"
    FP4 = "fp4"

    @property
    def bits(self) -> int:
        return _BITS[self]

    @property
    def is_float16(self) -> bool:
        """A 16-bit floating format (what autocast computes in)."""
        return self in (DType.BF16, DType.FP16)


_BITS: dict[DType, int] = {
    DType.FP32: 32,
    DType.TF32: 32,
    DType.BF16: 16,
    DType.FP16: 16,
    DType.FP8_E4M3: 8,
    DType.FP8_E5M2: 8,
    DType.INT8: 8,
    DType.NF4: 4,
    DType.FP4: 4,
}
