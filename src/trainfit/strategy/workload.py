"""What the GPU is asked to do: a training step, or inference (prefill a prompt, then decode tokens),
and optional memory savers that change how a training step spends memory (issue 11; the closed forms are in
``trainfit.analytic.savers``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from trainfit.errors import StrategyError
from trainfit.strategy._validate import coerce_enum, positive_int


class Workload(StrEnum):
    TRAINING = "training"
    INFERENCE = "inference"


@dataclass(frozen=True, slots=True, kw_only=True)
class Generation:
    """Inference shape: ``seq_len`` of the strategy is the prompt; this many tokens are generated."""

    new_tokens: int = 256

    def __post_init__(self) -> None:
        positive_int("new tokens", self.new_tokens)


class LossImpl(StrEnum):
    """How the loss meets the logits (``--loss``)."""

    STANDARD = "standard"  # HF: full logits, logits.float(), cross_entropy
    CHUNKED = "chunked"  # torchtune CEWithChunkedOutputLoss: the fp32 upcast one chunk at a time
    FUSED_LINEAR = "fused-linear"  # Liger LigerFusedLinearCrossEntropyLoss: no full logits at all


#: torchtune's CEWithChunkedOutputLoss default (``num_output_chunks=8``).
DEFAULT_LOSS_CHUNKS = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class MemorySavers:
    """Training-memory savers beyond checkpointing (all off by default)."""

    loss: LossImpl = LossImpl.STANDARD
    loss_chunks: int = DEFAULT_LOSS_CHUNKS  # --loss chunked:N
    optimizer_in_backward: bool = False  # torchtune register_optim_in_bwd_hooks: grads freed as each tensor steps
    activation_offload: bool = False  # torchtune OffloadActivations: saved tensors to pinned host memory
    paged_optimizer: bool = False  # bitsandbytes Paged* optimizers: states in CUDA unified memory

    def __post_init__(self) -> None:
        coerce_enum(self, "loss", LossImpl)
        positive_int("loss chunks", self.loss_chunks)
        for name in ("optimizer_in_backward", "activation_offload", "paged_optimizer"):
            if not isinstance(getattr(self, name), bool):
                raise StrategyError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @classmethod
    def parse_loss(cls, text: str) -> tuple[LossImpl, int]:
        """``standard`` | ``chunked`` | ``chunked:N`` | ``fused-linear`` → (loss, chunks)."""
        kind, _, n = text.strip().partition(":")
        try:
            loss = LossImpl(kind)
        except ValueError:
            raise StrategyError(f"unknown loss '{text}'; choose one of: standard, chunked[:N], fused-linear") from None
        if n and loss is not LossImpl.CHUNKED:
            raise StrategyError(f"only --loss chunked takes a chunk count, got '{text}'")
        if not n:
            return loss, DEFAULT_LOSS_CHUNKS
        if not n.isdigit() or int(n) < 1:
            raise StrategyError(f"--loss chunked:N needs a whole number N ≥ 1, got '{n}'")
        return loss, int(n)

    @property
    def any(self) -> bool:
        return (
            self.loss is not LossImpl.STANDARD
            or self.optimizer_in_backward
            or self.activation_offload
            or self.paged_optimizer
        )

    def names(self) -> tuple[str, ...]:
        """The savers in use, as the CLI spells them."""
        out = []
        if self.loss is LossImpl.CHUNKED:
            out.append(f"--loss chunked:{self.loss_chunks}")
        elif self.loss is LossImpl.FUSED_LINEAR:
            out.append("--loss fused-linear")
        if self.optimizer_in_backward:
            out.append("--optimizer-in-backward")
        if self.activation_offload:
            out.append("--activation-offload")
        if self.paged_optimizer:
            out.append("--paged-optimizer")
        return tuple(out)
