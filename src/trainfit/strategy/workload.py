"""What the GPU is asked to do: a training step, or inference (prefill a prompt, then decode tokens),
and optional memory savers that change how a training step spends memory."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from trainfit.strategy._validate import positive_int


class Workload(StrEnum):
    TRAINING = "training"
    INFERENCE = "inference"


@dataclass(frozen=True, slots=True, kw_only=True)
class Generation:
    """Inference shape: ``seq_len`` of the strategy is the prompt; this many tokens are generated."""

    new_tokens: int = 256

    def __post_init__(self) -> None:
        positive_int("new tokens", self.new_tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class MemorySavers:
    """Training-memory savers beyond checkpointing (all off by default)."""

    fused_cross_entropy: bool = False  # chunked/fused loss (Liger kernels): no full fp32 logits
    cpu_offload_checkpoints: bool = False  # torch.autograd.graph.save_on_cpu for checkpoint inputs

    @property
    def any(self) -> bool:
        return self.fused_cross_entropy or self.cpu_offload_checkpoints
