"""Which module's computation produced a gradient: the attribution the doctor's headline needs.

Hooks see a gradient where it *arrives*, not where it was *made*. A module M's parameter gradients and
the gradient of its inputs are computed by M's backward; but the gradient of M's *output* is computed by
whatever consumed that output — the next module, or code written inline in the caller's ``forward``, or
the loss function for the model's final output. Blaming the module whose output gradient overflowed
therefore blames the layer *before* the one to fix.

:class:`CallGraph` records, during a forward pass, for every module's output tensor the first module that
took it as an input (the *consumer*), the module that called it (its *caller*), and whether a container
returned it unchanged (``nn.Sequential`` returns its last child's output). :meth:`grad_producer` then
answers "whose backward made the gradient of M's output": the consumer; else, if a container returned
the output, whoever produced the gradient of the container's output; else the caller (inline code in its
``forward``); else, for the model's own output, the loss function.

A module that returns one of its inputs itself (``nn.Identity``, ``ReLU(inplace=True)``) passes the tensor
on: it is not recorded as its consumer, and the gradient of its output is attributed like that of the
tensor's producer. With a residual connection the gradient of a tensor is the sum
over its consumers; it is attributed to the first module that consumed it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from trainfit.doctor.data import iter_tensors

LOSS_FUNCTION = "(loss function)"


def module_name(name: str) -> str:
    return name or "(model)"


class CallGraph:
    """Forward hooks that record who consumed each module's output (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.caller: dict[str, str | None] = {}
        self.consumer: dict[str, str] = {}
        self.returned_by: dict[str, str] = {}
        #: modules that returned a tensor they received (in place or unchanged) → the tensor's producer
        self.passes: dict[str, str] = {}
        #: forward execution order: the position of each module's first call
        self.order: dict[str, int] = {}
        self._stack: list[str] = []
        self._producer: dict[int, tuple[str, weakref.ref[torch.Tensor]]] = {}
        self._handles: list[Any] = []
        for name, module in model.named_modules():
            label = module_name(name)
            self._handles.append(module.register_forward_pre_hook(self._pre(label)))
            self._handles.append(module.register_forward_hook(self._post(label), with_kwargs=True))

    def _pre(self, label: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if not self._stack:
                self._producer.clear()  # a new forward pass: tensor ids of the last one mean nothing
            self.caller.setdefault(label, self._stack[-1] if self._stack else None)
            self.order.setdefault(label, len(self.order))
            self._stack.append(label)

        return hook

    def _post(self, label: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if self._stack and self._stack[-1] == label:
                self._stack.pop()
            inputs = [t for t in iter_tensors((args, kwargs)) if t.is_floating_point()]
            outputs = [t for t in iter_tensors(output) if t.is_floating_point()]
            passed_on = {id(t) for t in outputs} & {id(t) for t in inputs}
            for t in inputs:
                entry = self._producer.get(id(t))
                if id(t) in passed_on or entry is None or entry[1]() is not t or entry[0] == label:
                    continue
                self.consumer.setdefault(entry[0], label)
            for t in outputs:
                entry = self._producer.get(id(t))
                if id(t) in passed_on:
                    if entry is not None and entry[1]() is t and entry[0] != label:
                        self.passes.setdefault(label, entry[0])
                    continue
                if entry is None or entry[1]() is not t:
                    self._producer[id(t)] = (label, weakref.ref(t))
                elif entry[0] != label:
                    self.returned_by.setdefault(entry[0], label)

        return hook

    def grad_producer(self, label: str) -> str:
        """The module whose backward computed the gradient of ``label``'s output."""
        seen = set()
        while label not in seen:
            seen.add(label)
            if label in self.consumer:
                return self.consumer[label]
            if label in self.passes:
                label = self.passes[label]
                continue
            if label in self.returned_by:
                label = self.returned_by[label]
                continue
            caller = self.caller.get(label)
            return caller if caller is not None else LOSS_FUNCTION
        return label

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
