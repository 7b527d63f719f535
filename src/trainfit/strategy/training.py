"""Training-loop choices: optimizer and its implementation, activation checkpointing, attention kernel.

``checkpoint_layout`` is the one place that says which layers a checkpointing mode recomputes; the
analytic model and the trace both read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum


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
    # Korthikanti et al. 2022 §5 (Megatron ``--recompute-granularity selective``, megatron/core/transformer/
    # attention.py ``_checkpointed_attention_forward``): only the attention core — scores, softmax, dropout,
    # probs·v — is recomputed; every other saved tensor is kept. No segments.
    SELECTIVE = "selective"
    # torchtitan's per-op selective activation checkpointing (torchtitan/distributed/activation_checkpoint.py
    # ``SelectiveAC``; ``--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op``):
    # every block is checkpointed, but the outputs of compute-intensive ops (matmuls, fused attention) are saved
    # — every second mm recomputed — and everything else is recomputed in backward.
    SAC = "sac"

    @property
    def whole_layers(self) -> bool:
        """Whether the layers run inside ``torch.utils.checkpoint`` segments (full, sqrt, sac: each segment keeps its
        input and is recomputed in backward, :func:`checkpoint_layout`); none and selective (inside the layer: the
        attention core) run the layers as they are."""
        return self not in (Checkpointing.NONE, Checkpointing.SELECTIVE)


class Attention(StrEnum):
    SDPA = "sdpa"
    EAGER = "eager"


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointLayout:
    """Checkpointed segments, their sizes in blocks (empty without checkpointing)."""

    segment_sizes: tuple[int, ...]

    @property
    def largest_segment(self) -> int:
        return max(self.segment_sizes, default=0)


def checkpoint_layout(checkpointing: Checkpointing, num_layers: int) -> CheckpointLayout:
    """Which layers are checkpointed, and in which segments (shared by every estimation method).

    ``full``: every block is its own segment (HF ``gradient_checkpointing_enable``). ``sqrt``: Chen et
    al. 2016 ("Training Deep Nets with Sublinear Memory Cost", §4.1) — segments of ⌈L/⌈√L⌉⌉ blocks
    covering all L blocks (the last one shorter when it does not divide); only each segment's input is kept
    and backward recomputes one segment at a time, so activations scale with ~2√L layers. (Unlike
    ``torch.utils.checkpoint.checkpoint_sequential``, no trailing segment runs unchecked, which keeps
    memory monotonic in the depth.)
    """
    if not Checkpointing(checkpointing).whole_layers:
        return CheckpointLayout(segment_sizes=())
    if checkpointing in (Checkpointing.FULL, Checkpointing.SAC):
        return CheckpointLayout(segment_sizes=(1,) * num_layers)
    size = math.ceil(num_layers / max(1, math.ceil(math.sqrt(num_layers))))
    full_segments, rest = divmod(num_layers, size)
    sizes = (size,) * full_segments + ((rest,) if rest else ())
    return CheckpointLayout(segment_sizes=sizes)
