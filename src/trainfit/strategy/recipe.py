"""Precision recipes: which dtype each kind of training state is kept in.

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

**FP8 training** (``Float8``) is not a recipe of its own but a layer swap on top of a bf16 one, as torchtitan
runs it (``--model.converters float8``): torchao's ``convert_to_float8_training`` replaces the block linears by
``Float8Linear`` (torchao/float8/float8_linear.py), whose matmuls cast input, weight and output gradient to
float8 with dynamic tensorwise scales. States are untouched (the weights stay in the recipe's dtype; fp8 copies
exist only inside each matmul), so the states' bytes per parameter are the bf16 recipe's. What changes is what
:mod:`trainfit.analytic.activations` (``float8_*``) describes: the casts' transients and, under autocast, no
cached bf16 copies of the converted weights. Modelled on one GPU and under torch DDP / FSDP2 / HSDP.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from trainfit.strategy.dtypes import DType


class Float8(StrEnum):
    """FP8 training of the transformer blocks' linears (torchao ``Float8LinearConfig`` recipe names):
    ``none`` or ``tensorwise`` (dynamic per-tensor scales for input, weight and grad_output — torchao's
    default ``Float8LinearConfig()``, ``recipe_name="tensorwise"``). Rowwise scaling is not modelled."""

    NONE = "none"
    TENSORWISE = "tensorwise"


#: Recipes an fp8 linear is modelled under: bf16 compute (torchtitan's FSDP2 ``param_dtype=bf16`` and its
#: single-GPU ``torch.autocast(bf16)``; pure bf16).
FLOAT8_RECIPES = ("amp-bf16", "master-bf16", "pure-bf16")


class Precision(StrEnum):
    FP32 = "fp32"
    AMP_BF16 = "amp-bf16"
    AMP_FP16 = "amp-fp16"
    MASTER_BF16 = "master-bf16"
    MASTER_FP16 = "master-fp16"
    PURE_BF16 = "pure-bf16"


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
    def compute(self) -> DType:
        """The format matmuls run in."""
        return DType(self.compute_dtype)

    @property
    def weight_dtype(self) -> DType:
        """The format the model's (trainable) weights are stored in."""
        return DType.FP32 if self.weight_bits == 32 else self.compute

    @property
    def mixed(self) -> bool:
        """16-bit compute over fp32 parameters (amp-*, master-*): what a framework's mixed-precision policy runs
        (FSDP2 ``MixedPrecisionPolicy(param_dtype=<compute>, reduce_dtype=fp32)``, DeepSpeed/Megatron bf16/fp16)."""
        return self.compute_bits == 16 and (self.autocast or self.master_bits > 0)

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
