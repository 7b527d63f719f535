"""HOW a model is trained: precision recipe, optimizer, shape, activation checkpointing, attention kernel.

Recipes are named as users know them. Bytes per parameter for each (weights + grads + master + Adam
states; autocast's transient low-precision weight copies are extra and listed separately):

=============  ================================================  =====================================
recipe         what it is                                        bytes/param with AdamW (steady state)
=============  ================================================  =====================================
fp32           everything fp32                                   4 + 4 + 8 = 16
amp-bf16       torch.autocast(bf16) over fp32 weights; HF        4 + 4 + 8 = 16, +2 (autocast copies
               Trainer ``bf16=True`` on an fp32-loaded model     saved for backward)
amp-fp16       same with fp16 and a GradScaler                   as amp-bf16
master-bf16    bf16 weights+grads, fp32 master copy (DeepSpeed,  2 + 2 + 4 + 8 = 16 (ZeRO paper 16Ψ)
               Megatron without fp32 main grads)
master-fp16    same in fp16, with loss scaling                   as master-bf16
pure-bf16      weights, grads and optimizer states in bf16       2 + 2 + 4 = 8
=============  ================================================  =====================================

Sources: Micikevicius et al. 2018 (master weights, loss scaling); Rajbhandari et al. 2020 (ZeRO, 16Ψ);
PyTorch AMP docs (autocast over fp32 weights). The article's "2 + 2 + 8 = 12" counts fp16 weights and
grads plus fp32 Adam states but omits the fp32 master copy it describes in its own section 6.2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from trainfit.errors import StrategyError


class Precision(StrEnum):
    FP32 = "fp32"
    AMP_BF16 = "amp-bf16"
    AMP_FP16 = "amp-fp16"
    MASTER_BF16 = "master-bf16"
    MASTER_FP16 = "master-fp16"
    PURE_BF16 = "pure-bf16"


class Optimizer(StrEnum):
    ADAMW = "adamw"
    ADAMW_8BIT = "adamw-8bit"
    SGD = "sgd"
    SGD_MOMENTUM = "sgd-momentum"
    ADAFACTOR = "adafactor"
    LION = "lion"


class OptimizerImpl(StrEnum):
    """How torch.optim runs the update (torch/optim/optimizer.py ``_default_to_fused_or_foreach``).

    ``foreach`` is torch's default on CUDA (what a hand-written loop gets): its intermediates are
    whole tensor lists, e.g. AdamW's ``sqrt(exp_avg_sq)`` for every parameter at once. ``fused`` runs
    one kernel per tensor with no list-sized temporaries; the HF Trainer defaults to it
    (``adamw_torch_fused``) with torch ≥ 2.8.
    """

    FOREACH = "foreach"
    FUSED = "fused"


class Checkpointing(StrEnum):
    NONE = "none"
    FULL = "full"
    SQRT = "sqrt"


class Attention(StrEnum):
    SDPA = "sdpa"
    EAGER = "eager"


@dataclass(frozen=True, slots=True, kw_only=True)
class Recipe:
    """Dtype widths (bits) of each kind of state under a precision recipe."""

    precision: Precision
    weight_bits: int
    grad_bits: int
    master_bits: int  # 0 when there is no separate fp32 master copy
    compute_bits: int  # dtype matmuls run in
    autocast: bool  # torch.autocast over the weights (casts and caches low-precision weight copies)
    loss_scaling: bool  # a (dynamic) loss scaler is needed
    state_bits: int  # optimizer-state dtype (torch creates states like the parameter they update)
    compute_dtype: str  # "bf16" | "fp16" | "fp32"
    description: str

    @property
    def needs_bf16(self) -> bool:
        return self.compute_dtype == "bf16"

    @property
    def needs_fp16(self) -> bool:
        return self.compute_dtype == "fp16"


RECIPES: dict[Precision, Recipe] = {
    Precision.FP32: Recipe(
        precision=Precision.FP32,
        weight_bits=32,
        grad_bits=32,
        master_bits=0,
        compute_bits=32,
        autocast=False,
        loss_scaling=False,
        state_bits=32,
        compute_dtype="fp32",
        description="everything in fp32",
    ),
    Precision.AMP_BF16: Recipe(
        precision=Precision.AMP_BF16,
        weight_bits=32,
        grad_bits=32,
        master_bits=0,
        compute_bits=16,
        autocast=True,
        loss_scaling=False,
        state_bits=32,
        compute_dtype="bf16",
        description="torch.autocast(bfloat16) over fp32 weights (HF Trainer bf16=True)",
    ),
    Precision.AMP_FP16: Recipe(
        precision=Precision.AMP_FP16,
        weight_bits=32,
        grad_bits=32,
        master_bits=0,
        compute_bits=16,
        autocast=True,
        loss_scaling=True,
        state_bits=32,
        compute_dtype="fp16",
        description="torch.autocast(float16) over fp32 weights + GradScaler (HF Trainer fp16=True)",
    ),
    Precision.MASTER_BF16: Recipe(
        precision=Precision.MASTER_BF16,
        weight_bits=16,
        grad_bits=16,
        master_bits=32,
        compute_bits=16,
        autocast=False,
        loss_scaling=False,
        state_bits=32,
        compute_dtype="bf16",
        description="bf16 weights and grads with an fp32 master copy (DeepSpeed/Megatron style)",
    ),
    Precision.MASTER_FP16: Recipe(
        precision=Precision.MASTER_FP16,
        weight_bits=16,
        grad_bits=16,
        master_bits=32,
        compute_bits=16,
        autocast=False,
        loss_scaling=True,
        state_bits=32,
        compute_dtype="fp16",
        description="fp16 weights and grads with an fp32 master copy and loss scaling",
    ),
    Precision.PURE_BF16: Recipe(
        precision=Precision.PURE_BF16,
        weight_bits=16,
        grad_bits=16,
        master_bits=0,
        compute_bits=16,
        autocast=False,
        loss_scaling=False,
        state_bits=16,
        compute_dtype="bf16",
        description="weights, grads and optimizer states all in bf16",
    ),
}


def recipe(precision: Precision | str) -> Recipe:
    return RECIPES[Precision(precision)]


def _positive(name: str, value: int) -> None:
    if value <= 0:
        raise StrategyError(f"{name} must be a positive integer, got {value}")


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointLayout:
    """Checkpointed segments, their sizes in blocks (empty without checkpointing)."""

    segment_sizes: tuple[int, ...]

    @property
    def largest_segment(self) -> int:
        return max(self.segment_sizes, default=0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Strategy:
    """One training configuration on one GPU. Memory is per micro-step; ``grad_accum`` only scales the
    effective batch (accumulated gradients live in the same gradient buffers)."""

    precision: Precision = Precision.AMP_BF16
    optimizer: Optimizer = Optimizer.ADAMW
    checkpointing: Checkpointing = Checkpointing.NONE
    attention: Attention = Attention.SDPA
    optimizer_impl: OptimizerImpl = OptimizerImpl.FOREACH
    micro_batch: int = 1
    seq_len: int = 2048
    grad_accum: int = 1

    def __post_init__(self) -> None:
        _positive("batch", self.micro_batch)
        _positive("seq", self.seq_len)
        _positive("grad-accum", self.grad_accum)
        # Accept plain strings from kwargs and coerce to enums (frozen: use object.__setattr__).
        for name, enum in (
            ("precision", Precision),
            ("optimizer", Optimizer),
            ("checkpointing", Checkpointing),
            ("attention", Attention),
            ("optimizer_impl", OptimizerImpl),
        ):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, enum(value))
            except ValueError:
                choices = ", ".join(e.value for e in enum)
                raise StrategyError(f"unknown {name} '{value}'; choose one of: {choices}") from None

    @property
    def recipe(self) -> Recipe:
        return RECIPES[self.precision]

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.grad_accum

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch * self.seq_len

    def checkpoint_layout(self, num_layers: int) -> CheckpointLayout:
        """Which layers are checkpointed, and in which segments (shared by every estimation method).

        ``full``: every block is its own segment (HF ``gradient_checkpointing_enable``). ``sqrt``: Chen et
        al. 2016 ("Training Deep Nets with Sublinear Memory Cost", §4.1) — segments of ⌈L/⌈√L⌉⌉ blocks
        covering all L blocks (the last one shorter when it does not divide); only each segment's input is kept
        and backward recomputes one segment at a time, so activations scale with ~2√L layers. (Unlike
        ``torch.utils.checkpoint.checkpoint_sequential``, no trailing segment runs unchecked, which keeps
        memory monotonic in the depth.)
        """
        if self.checkpointing is Checkpointing.NONE:
            return CheckpointLayout(segment_sizes=())
        if self.checkpointing is Checkpointing.FULL:
            return CheckpointLayout(segment_sizes=(1,) * num_layers)
        size = math.ceil(num_layers / max(1, math.ceil(math.sqrt(num_layers))))
        full_segments, rest = divmod(num_layers, size)
        sizes = (size,) * full_segments + ((rest,) if rest else ())
        return CheckpointLayout(segment_sizes=sizes)

    def checkpoint_segments(self, num_layers: int) -> int:
        """Number of checkpointed segments (0 without checkpointing)."""
        return len(self.checkpoint_layout(num_layers).segment_sizes)
