"""Fine-tuning methods: which weights train (adapters), and how the frozen base weights are stored.

A LoRA adapter (Hu et al. 2021) adds ``A`` (r × d_in) and ``B`` (d_out × r) beside each targeted linear;
only adapters get gradients and optimizer states. PEFT keeps the adapters in fp32 on a 16-bit base by
default (``autocast_adapter_dtype=True``). QLoRA (Dettmers et al. 2023) is LoRA over 4-bit nf4 base
weights with double quantisation of the scales. The quantised formats' exact bytes are in
:mod:`trainfit.cuda_facts`; the per-tensor rule that turns these settings into bytes is
:func:`trainfit.analytic.states.param_states`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from trainfit.errors import StrategyError
from trainfit.strategy._validate import coerce_enum, positive_int
from trainfit.strategy.dtypes import DType


class AdapterKind(StrEnum):
    LORA = "lora"
    DORA = "dora"  # LoRA with a learned magnitude vector per output feature (Liu et al. 2024)


class Quantization(StrEnum):
    NONE = "none"
    INT8 = "int8"  # bitsandbytes LLM.int8 (Dettmers et al. 2022)
    NF4 = "nf4"  # bitsandbytes 4-bit NormalFloat (QLoRA)
    FP4 = "fp4"  # bitsandbytes 4-bit float

    @property
    def dtype(self) -> DType | None:
        return {Quantization.INT8: DType.INT8, Quantization.NF4: DType.NF4, Quantization.FP4: DType.FP4}.get(self)


#: PEFT's ``target_modules="all-linear"``: every linear except the output head.
ALL_LINEAR = "all-linear"


@dataclass(frozen=True, slots=True, kw_only=True)
class Adapter:
    kind: AdapterKind = AdapterKind.LORA
    rank: int = 16
    alpha: int = 32
    targets: tuple[str, ...] = (ALL_LINEAR,)  # module-name suffixes (q_proj, v_proj, ...) or all-linear
    dropout: float = 0.0
    dtype: DType = DType.FP32  # PEFT autocast_adapter_dtype=True keeps adapters in fp32

    def __post_init__(self) -> None:
        coerce_enum(self, "kind", AdapterKind)
        coerce_enum(self, "dtype", DType)
        positive_int("adapter rank", self.rank)
        if not 0.0 <= self.dropout < 1.0:
            raise StrategyError(f"adapter dropout must be in [0, 1), got {self.dropout}")
        if not self.targets:
            raise StrategyError("an adapter needs at least one target module (or 'all-linear')")
        if self.dtype.bits < 16:
            raise StrategyError(f"adapters train in a 16- or 32-bit format, not {self.dtype.value}")


@dataclass(frozen=True, slots=True, kw_only=True)
class BaseWeights:
    """How the base model's weights are stored. ``dtype=None``: as the precision recipe says."""

    dtype: DType | None = None
    quantization: Quantization = Quantization.NONE
    double_quant: bool = True  # QLoRA's quantised absmax constants (bnb_4bit_use_double_quant)

    def __post_init__(self) -> None:
        if self.dtype is not None:
            coerce_enum(self, "dtype", DType)
        coerce_enum(self, "quantization", Quantization)

    @property
    def is_default(self) -> bool:
        return self.dtype is None and self.quantization is Quantization.NONE
