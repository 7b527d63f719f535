"""Find the first module whose output or gradient becomes NaN or Inf (check 1, precision).

``torch.autograd.detect_anomaly`` only checks for NaN (an Inf gradient passes silently, DESIGN.md §4) and
only in backward. Here forward hooks on every module test each output with ``torch.isfinite`` — which
catches Inf as well as NaN — and a module is the *origin* when its output is non-finite while all its
floating-point inputs were finite (a module that merely passes on a NaN it received is not). In backward,
hooks on each module's output tensor and on each parameter (``register_post_accumulate_grad_hook``) see
gradients in the order autograd produces them, so the first non-finite one is the module nearest the loss
whose gradient went bad. Tensor hooks (not ``register_full_backward_hook``) are used because they tolerate
in-place ops such as ``ReLU(inplace=True)`` after a hooked module.

Where a gradient is *seen* is not always where it was *made*: the gradient of M's output is computed by
the backward of whatever consumed that output (``graph.py``). Each origin therefore also names the module
that produced it (``produced_by``): M itself for its output and its parameter gradients, M's consumer for
the gradient of M's output.

Every check synchronises; the doctor is a diagnostic run, not training.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from trainfit.doctor.data import iter_tensors
from trainfit.doctor.findings import Direction
from trainfit.doctor.graph import CallGraph, module_name


class Where(StrEnum):
    OUTPUT = "output"
    OUTPUT_GRAD = "output-grad"
    PARAM_GRAD = "param-grad"


@dataclass(frozen=True, slots=True, kw_only=True)
class Origin:
    step: int
    module: str
    direction: Direction
    where: Where
    nan: bool  # NaN present (else only Inf)
    #: the module whose computation produced the value (for OUTPUT_GRAD: the consumer of ``module``'s output)
    produced_by: str = ""

    @property
    def what(self) -> str:
        return "NaN" if self.nan else "Inf"

    @property
    def producer(self) -> str:
        return self.produced_by or self.module

    def describe(self) -> str:
        """'hot's output', 'the gradient of embed's output (made by hot's backward)', …"""
        if self.where is Where.OUTPUT:
            return f"{self.module}'s output"
        if self.where is Where.PARAM_GRAD:
            return f"{self.module}'s parameter gradients"
        return f"the gradient of {self.module}'s output (made by {self.producer}'s backward)"

    def to_json(self) -> dict[str, object]:
        return {
            "step": self.step,
            "module": self.module,
            "direction": self.direction.value,
            "where": self.where.value,
            "produced_by": self.producer,
            "value": self.what,
        }


def _nonfinite(t: torch.Tensor) -> bool:
    return t.is_floating_point() and not bool(torch.isfinite(t).all())


class NonfiniteTracker:
    """Hooks that record, per step, the first forward origin and the first non-finite gradient."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.step = 0
        self.forward: dict[int, Origin] = {}
        self.backward: dict[int, Origin] = {}
        self._handles: list[Any] = []
        self.graph = CallGraph(model)
        for name, module in model.named_modules():
            label = module_name(name)
            self._handles.append(module.register_forward_hook(self._forward_hook(label), with_kwargs=True))
            for p in module.parameters(recurse=False):
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._param_hook(label)))

    def _record_backward(self, label: str, where: Where, g: torch.Tensor) -> None:
        if self.step in self.backward or not _nonfinite(g):
            return
        self.backward[self.step] = Origin(
            step=self.step,
            module=label,
            direction=Direction.BACKWARD,
            where=where,
            nan=bool(torch.isnan(g).any()),
            produced_by=self.graph.grad_producer(label) if where is Where.OUTPUT_GRAD else label,
        )

    def _forward_hook(self, label: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            outs = [t for t in iter_tensors(output) if t.is_floating_point()]
            for t in outs:
                if t.requires_grad:
                    t.register_hook(lambda g: self._record_backward(label, Where.OUTPUT_GRAD, g))  # type: ignore[no-untyped-call]
            if self.step in self.forward:
                return
            bad = [t for t in outs if _nonfinite(t)]
            if not bad:
                return
            if any(_nonfinite(t) for t in iter_tensors((args, kwargs))):
                return  # it received a non-finite input: not the origin
            nan = any(bool(torch.isnan(t).any()) for t in bad)
            self.forward[self.step] = Origin(
                step=self.step,
                module=label,
                direction=Direction.FORWARD,
                where=Where.OUTPUT,
                nan=nan,
                produced_by=label,
            )

        return hook

    def _param_hook(self, label: str) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if p.grad is not None:
                self._record_backward(label, Where.PARAM_GRAD, p.grad)

        return hook

    def close(self) -> None:
        self.graph.close()
        for h in self._handles:
            h.remove()
        self._handles.clear()
