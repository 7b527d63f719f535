"""Training-time helpers for a plain PyTorch loop.

``TrainStep`` does autocast, loss scaling, gradient accumulation and unscale → clip → step → update in the
right order; ``StabilityMonitor`` watches the loss, gradient norm, loss scale and skipped steps and explains
problems in the article's troubleshooting order; ``set_checkpointing`` turns activation checkpointing on
for models without their own switch; ``callbacks`` attaches the monitor to the HF Trainer and Lightning.

Names are imported lazily (PEP 562) so that the torch-free monitor can be used — by the callbacks, or fed
by hand — without importing torch; ``TrainStep`` and ``set_checkpointing`` import it.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainfit.train.checkpoint import CheckpointingState, set_checkpointing
    from trainfit.train.monitor import (
        Advice,
        Check,
        EventKind,
        InstabilityError,
        Severity,
        StabilityEvent,
        StabilityMonitor,
        StepStats,
    )
    from trainfit.train.step import TrainStep, resolve_precision

_WHERE = {
    "CheckpointingState": "checkpoint",
    "set_checkpointing": "checkpoint",
    "Advice": "monitor",
    "Check": "monitor",
    "EventKind": "monitor",
    "InstabilityError": "monitor",
    "Severity": "monitor",
    "StabilityEvent": "monitor",
    "StabilityMonitor": "monitor",
    "StepStats": "monitor",
    "TrainStep": "step",
    "resolve_precision": "step",
}

__all__ = [
    "Advice",
    "Check",
    "CheckpointingState",
    "EventKind",
    "InstabilityError",
    "Severity",
    "StabilityEvent",
    "StabilityMonitor",
    "StepStats",
    "TrainStep",
    "resolve_precision",
    "set_checkpointing",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(import_module(f"trainfit.train.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'trainfit.train' has no attribute {name!r}")
