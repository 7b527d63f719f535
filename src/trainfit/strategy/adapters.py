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
        positive_int("adapter rank (--lora-rank)", self.rank)
        if not 0.0 <= self.dropout < 1.0:
            raise StrategyError(f"adapter dropout (--lora-dropout) must be in [0, 1), got {self.dropout}")
        if not self.targets:
            raise StrategyError(
                "an adapter needs at least one target module (--lora-targets q_proj,v_proj, or all-linear)"
            )
        if self.dtype.bits < 16:
            raise StrategyError(
                f"adapters (--adapter-dtype) train in a 16- or 32-bit format (fp32, bf16, fp16), not {self.dtype.value}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class BaseWeights:
    """How the base model's weights are stored. ``dtype=None``: as the precision recipe says.

    ``frozen``: module patterns frozen under full fine-tuning (``embeddings``, ``lm_head``, ``norm``, a
    module name such as ``q_proj``, or a layer range ``layers:0-15``); see
    :func:`trainfit.analytic.adapters.is_frozen`. ``kbit_prepared``: PEFT's
    ``prepare_model_for_kbit_training`` ran (peft/utils/other.py): every parameter that is not 4-bit is cast
    to fp32, and the input embeddings' output requires grad.
    """

    dtype: DType | None = None
    quantization: Quantization = Quantization.NONE
    double_quant: bool = True  # QLoRA's quantised absmax constants (bnb_4bit_use_double_quant)
    frozen: tuple[str, ...] = ()
    kbit_prepared: bool = False

    def __post_init__(self) -> None:
        if self.dtype is not None:
            coerce_enum(self, "dtype", DType)
            if self.dtype.bits < 16:
                raise StrategyError(
                    f"base dtype {self.dtype.value} is a quantised format: give it as quantization, not dtype"
                )
        coerce_enum(self, "quantization", Quantization)
        if isinstance(self.frozen, str):
            object.__setattr__(self, "frozen", tuple(x for x in self.frozen.split(",") if x))
        for pattern in self.frozen:
            check_freeze_pattern(pattern)
        if self.kbit_prepared and self.quantization is Quantization.NONE:
            raise StrategyError("prepare_model_for_kbit_training needs a quantised base (int8, nf4 or fp4)")

    @property
    def is_default(self) -> bool:
        return self.dtype is None and self.quantization is Quantization.NONE and not self.frozen


class Finetune(StrEnum):
    """What trains: every weight, LoRA adapters over a frozen base, QLoRA (LoRA over an nf4 base prepared
    by ``prepare_model_for_kbit_training``), or every weight but the ``--freeze`` patterns."""

    FULL = "full"
    LORA = "lora"
    QLORA = "qlora"
    FREEZE = "freeze"


#: Names ``--freeze`` accepts besides module names and layer ranges.
FREEZE_GROUPS = ("embeddings", "lm_head", "norm")


def check_freeze_pattern(pattern: str) -> None:
    """A freeze pattern is a module name (``q_proj``), a group (``embeddings``) or ``layers:A-B``."""
    if not pattern or pattern != pattern.strip():
        raise StrategyError(f"empty or padded freeze pattern {pattern!r}")
    if pattern.startswith("layers:"):
        lo, sep, hi = pattern[len("layers:") :].partition("-")
        if not (lo.isdigit() and (not sep or hi.isdigit())) or (sep and int(hi) < int(lo)):
            raise StrategyError(f"freeze layer range must look like layers:0-15, got '{pattern}'")


def layer_range(pattern: str) -> range | None:
    """``layers:A-B`` → range(A, B + 1) (inclusive, as users write it); ``None`` for other patterns."""
    if not pattern.startswith("layers:"):
        return None
    lo, sep, hi = pattern[len("layers:") :].partition("-")
    return range(int(lo), int(hi if sep else lo) + 1)


_BASE_DTYPES = {"bf16": DType.BF16, "fp16": DType.FP16, "fp32": DType.FP32}
_BASE_QUANT = {"int8": Quantization.INT8, "nf4": Quantization.NF4, "fp4": Quantization.FP4}


def finetune_setup(
    finetune: Finetune | str,
    *,
    rank: int = 16,
    alpha: int | None = None,
    targets: str | tuple[str, ...] = ALL_LINEAR,
    dropout: float = 0.0,
    dora: bool = False,
    adapter_dtype: DType | str = DType.FP32,
    base_dtype: str | None = None,
    double_quant: bool = True,
    freeze: str | tuple[str, ...] = (),
) -> tuple[Adapter | None, BaseWeights]:
    """The adapter and base-weight settings of one fine-tuning method, as the CLI and JSON spell them.
    ``base_dtype``: bf16 | fp16 | fp32 | int8 | nf4 | fp4 (QLoRA defaults to nf4 and refuses a float base);
    ``alpha`` defaults to 2·rank; ``dora``: DoRA adapters (PEFT ``LoraConfig(use_dora=True)``) instead of LoRA.
    Bad combinations raise :class:`StrategyError`."""
    try:
        how = Finetune(finetune)
    except ValueError:
        raise StrategyError(
            f"unknown finetune '{finetune}'; choose one of: {', '.join(f.value for f in Finetune)}"
        ) from None
    if base_dtype is not None and base_dtype not in _BASE_DTYPES and base_dtype not in _BASE_QUANT:
        choices = ", ".join([*_BASE_DTYPES, *_BASE_QUANT])
        raise StrategyError(f"unknown base-dtype '{base_dtype}'; choose one of: {choices}")
    if isinstance(targets, str):
        targets = tuple(x.strip() for x in targets.split(",") if x.strip())
    if isinstance(freeze, str):
        freeze = tuple(x.strip() for x in freeze.split(",") if x.strip())
    if how is Finetune.QLORA:
        if base_dtype is None:
            base_dtype = "nf4"
        if base_dtype not in ("nf4", "fp4"):
            raise StrategyError(
                f"qlora quantises the base to 4 bits (nf4 or fp4), not {base_dtype}; use --finetune lora"
            )
    if freeze and how is not Finetune.FREEZE:
        raise StrategyError(f"--freeze needs --finetune freeze (with {how.value}, the adapter decides what trains)")
    if dora and how not in (Finetune.LORA, Finetune.QLORA):
        raise StrategyError(f"--dora is a LoRA variant: use it with --finetune lora or qlora, not {how.value}")
    if how is Finetune.FREEZE and not freeze:
        raise StrategyError("--finetune freeze needs --freeze PATTERNS (e.g. embeddings,layers:0-15)")
    quant = _BASE_QUANT.get(base_dtype or "")
    if how in (Finetune.FULL, Finetune.FREEZE):
        if base_dtype is not None:
            raise StrategyError(
                f"--base-dtype sets how a frozen base is stored; with --finetune {how.value} the weights train "
                "in the precision recipe's format"
            )
        return None, BaseWeights(frozen=freeze)
    adapter = Adapter(
        kind=AdapterKind.DORA if dora else AdapterKind.LORA,
        rank=rank,
        alpha=alpha if alpha is not None else 2 * rank,
        targets=targets,
        dropout=dropout,
        dtype=_adapter_dtype(adapter_dtype),
    )
    return adapter, BaseWeights(
        dtype=_BASE_DTYPES.get(base_dtype or ""),
        quantization=quant or Quantization.NONE,
        double_quant=double_quant,
        kbit_prepared=how is Finetune.QLORA,
    )


def _adapter_dtype(value: DType | str) -> DType:
    try:
        return DType(value)
    except ValueError:
        raise StrategyError(f"unknown adapter-dtype '{value}'; choose one of: fp32, bf16, fp16") from None


def check_finetune(adapter: Adapter | None, base: BaseWeights) -> None:
    """Combinations of adapter and base storage that no run can have (one-line :class:`StrategyError`)."""
    if base.quantization is not Quantization.NONE and adapter is None:
        raise StrategyError(
            f"a {base.quantization.value} base cannot be fully fine-tuned (bitsandbytes weights take no "
            "optimizer step): add an adapter (--finetune lora or qlora)"
        )
    if base.quantization is not Quantization.NONE and base.dtype is not None:
        raise StrategyError("give the base either a float dtype or a quantisation, not both")
    if adapter is not None and base.frozen:
        raise StrategyError("freeze patterns apply to full fine-tuning; an adapter already freezes the base")
