"""What happened in the training process before the run: how its model was built, and earlier runs.

Reserved memory is not a property of the run alone. The caching allocator keeps what the process did before
(``trainfit.allocator.process``): a model built by ``from_config`` under ``torch.device("cuda")`` makes its tied
LM head's own weight and frees it when ``post_init`` ties it, a table-sized free block before training; a matmul
run before the model (a warm-up) makes the main thread's cuBLAS workspace then, not at the first forward; an
earlier training run in the same process leaves its workspaces, which ``empty_cache`` cannot release, and the
segments they sit in. On the published H200 cases (``../shared/gpu-truth``, measured one after another in one
process) these moved ``max_memory_reserved`` by up to 5.6% (llama-3.2-1b after qwen2.5-0.5b) and, on a fresh
process of the 2026-12-04 session, by 15% (llama-3.2-1b built on the GPU: docs/accuracy.md).

:class:`ProcessHistory` says which of these happened; the default is what ``trainfit estimate`` always predicted
and a user's job usually is: a fresh process, the model loaded by ``from_pretrained`` (or moved with
``.to("cuda")``), no warm-up. ``trainfit.estimate`` turns a history into the allocator's starting state
(``trainfit.allocator.process.ProcessStart``) for the methods that simulate the allocator on one GPU (analytic and
trace), each earlier run's events made by the same method as the run's own. The planner (``trainfit plan``, and the
checked fixes of ``trainfit estimate``) passes a history to every estimate it runs, for the one-GPU candidates that
take one (``trainfit.planner.rank.check_plan_history``: a search over more GPUs is refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from trainfit.errors import StrategyError

if TYPE_CHECKING:
    from trainfit.arch.spec import ModelSpec
    from trainfit.strategy import Strategy

__all__ = ["Build", "EarlierRun", "ProcessHistory", "history_note"]


class Build(StrEnum):
    """How the model's weights came onto the GPU."""

    #: ``from_pretrained`` (weights materialised from a checkpoint, a tied head tied before), or a model built on
    #: the CPU and moved with ``.to("cuda")``: the parameters are the first allocations, nothing is freed.
    FROM_PRETRAINED = "from-pretrained"
    #: ``AutoModel.from_config(cfg)`` under ``torch.device("cuda")``: a tied head's own weight is allocated after the
    #: parameters and freed when ``post_init`` ties it (``trainfit.allocator.process.built_on_device``).
    ON_DEVICE = "on-device"

    @classmethod
    def parse(cls, value: Build | str) -> Build:
        """A Build from its name (the CLI's ``--build``); an unknown one is a one-line error."""
        try:
            return cls(value)
        except ValueError:
            raise StrategyError(f"unknown build '{value}'; choose one of: {', '.join(b.value for b in cls)}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class EarlierRun:
    """A training run that ran to its end earlier in the same process (then its tensors were freed and
    ``torch.cuda.empty_cache()`` called): its model, strategy and how its model was built."""

    model: ModelSpec
    strategy: Strategy
    build: Build = Build.FROM_PRETRAINED

    def __post_init__(self) -> None:
        object.__setattr__(self, "build", Build.parse(self.build))


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessHistory:
    """The process a run starts in (the default: a fresh one, the model from ``from_pretrained``)."""

    build: Build = Build.FROM_PRETRAINED
    #: A small fp32 matmul ran before anything else (``torch.ones(256, 256) @ torch.ones(256, 256)``, as the
    #: measuring scripts of ``../shared/gpu-truth`` do): the main thread's cuBLAS workspace is made then.
    warm_up: bool = False
    #: Earlier training runs in this process, in the order they ran.
    after: tuple[EarlierRun, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "build", Build.parse(self.build))
        object.__setattr__(self, "after", tuple(self.after))

    @property
    def fresh(self) -> bool:
        """Nothing before the run: the allocator starts empty and the parameters are its first allocations."""
        return self.build is Build.FROM_PRETRAINED and not self.warm_up and not self.after


def history_note(history: ProcessHistory) -> str:
    """The note of a report or a plan on a process history: what the simulated reserve ran after."""
    parts = [
        f"the model built {'by from_config on the GPU' if history.build is Build.ON_DEVICE else 'from_pretrained'}"
    ]
    if history.warm_up:
        parts.append("a warm-up matmul before it")
    if history.after:
        parts.append("after " + ", then ".join(r.model.name for r in history.after) + " in the same process")
    return "reserved memory simulated for " + "; ".join(parts) + " (a fresh process may reserve differently)"
