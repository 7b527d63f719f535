"""Activation checkpointing on/off for models without their own switch.

Hugging Face models have ``activation_checkpointing_enable()`` (transformers 5; ``gradient_checkpointing_enable()``
in 4.x); a hand-written model usually has nothing.
:func:`set_checkpointing` uses the model's own switch when it exists (asking for the non-reentrant
implementation) and otherwise replaces the ``forward`` of each selected block — by default every child of
every ``nn.ModuleList``, which is where transformer layers live — with a call through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. The replacement is an instance attribute,
so parameter names and ``state_dict`` keys do not change, and disabling removes it.

Non-reentrant, because it is what the PyTorch docs recommend (``use_reentrant=True`` will stop being the
default): it supports keyword arguments, works when no input requires grad (the reentrant version then
silently produces no parameter gradients), and records the autocast state for recomputation. Checkpointing
is bypassed under ``torch.no_grad()`` where there is nothing to save. Source: ``torch.utils.checkpoint``
docs; Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from trainfit.errors import StrategyError

_ORIGINAL = "_trainfit_checkpoint_original_forward"

BlockSelector = type[torch.nn.Module] | tuple[type[torch.nn.Module], ...] | Callable[[str, torch.nn.Module], bool]


class CheckpointMethod(StrEnum):
    MODEL_SWITCH = "model-switch"  # the model's own gradient_checkpointing_enable/disable
    WRAPPED = "wrapped"  # trainfit wrapped each block's forward
    NONE = "none"


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointingState:
    enabled: bool
    method: CheckpointMethod
    modules: tuple[str, ...]  # names of the wrapped blocks (empty for MODEL_SWITCH)


def _select(model: torch.nn.Module, blocks: BlockSelector | None) -> list[tuple[str, torch.nn.Module]]:
    if blocks is None:
        picked: list[tuple[str, torch.nn.Module]] = []
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.ModuleList):
                picked += [(f"{name}.{child_name}" if name else child_name, child)
                           for child_name, child in module.named_children()]  # fmt: skip
        if not picked:
            raise StrategyError(
                "no nn.ModuleList of blocks found to checkpoint; pass blocks=<block class> or a predicate"
            )
        return picked
    out: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if not name:
            continue
        hit = isinstance(module, blocks) if isinstance(blocks, (type, tuple)) else blocks(name, module)
        if hit:
            out.append((name, module))
    return out


def _wrap(module: torch.nn.Module) -> None:
    if _ORIGINAL in module.__dict__:
        return
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            return checkpoint(original, *args, use_reentrant=False, **kwargs)
        return original(*args, **kwargs)

    module.__dict__[_ORIGINAL] = original
    module.forward = forward


def _unwrap(module: torch.nn.Module) -> None:
    original = module.__dict__.pop(_ORIGINAL, None)
    if original is None:
        return
    if getattr(original, "__self__", None) is module and getattr(original, "__func__", None) is getattr(
        type(module), "forward", None
    ):
        module.__dict__.pop("forward", None)  # back to the class's forward
    else:
        module.forward = original


def set_checkpointing(
    model: torch.nn.Module, enabled: bool = True, *, blocks: BlockSelector | None = None
) -> CheckpointingState:
    """Turn activation checkpointing on or off. ``blocks`` selects what to wrap (a class, a tuple of classes
    or ``predicate(name, module)``); by default the model's own switch, else every ``ModuleList`` child."""
    own = blocks is None and getattr(model, "supports_gradient_checkpointing", False)
    if own and hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        if enabled:
            getattr(model, "activation_checkpointing_enable")(  # noqa: B009 (nn.Module typing)
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
        else:
            getattr(model, "activation_checkpointing_disable")()  # noqa: B009
        return CheckpointingState(enabled=enabled, method=CheckpointMethod.MODEL_SWITCH, modules=())
    if own and hasattr(model, "gradient_checkpointing_enable"):  # transformers 4.x
        if enabled:
            getattr(model, "gradient_checkpointing_enable")(  # noqa: B009
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        else:
            getattr(model, "gradient_checkpointing_disable")()  # noqa: B009
        return CheckpointingState(enabled=enabled, method=CheckpointMethod.MODEL_SWITCH, modules=())
    if not enabled:
        names = []
        for name, module in model.named_modules():
            if _ORIGINAL in module.__dict__:
                _unwrap(module)
                names.append(name)
        return CheckpointingState(enabled=False, method=CheckpointMethod.NONE, modules=tuple(names))
    selected = _select(model, blocks)
    for _, module in selected:
        _wrap(module)
    return CheckpointingState(
        enabled=True, method=CheckpointMethod.WRAPPED, modules=tuple(name for name, _ in selected)
    )


def checkpointed_modules(model: torch.nn.Module) -> tuple[str, ...]:
    """Names of the blocks trainfit has wrapped."""
    return tuple(name for name, module in model.named_modules() if _ORIGINAL in module.__dict__)
