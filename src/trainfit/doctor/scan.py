"""Range scan (check 1, precision): where do activations and gradients sit against the format's limits?

One fp32 forward + backward over the first batches, from the initial weights, with hooks on every module.
For each module's output, the gradient flowing into that output, and the module's own parameter gradients
we count, against the chosen format (``trainfit.precision.formats``):

* overflow — values ≥ the format's overflow threshold (fp16: 65520), i.e. what becomes inf when cast;
* flush-to-zero — non-zero values ≤ half the smallest subnormal (fp16: 2.98e-8), i.e. what becomes 0;
* headroom — log2(max_finite / absmax): how many doublings are left before overflow.

Gradients are evaluated both unscaled and at the loss scale the run actually used (``g·S``), because under
fp16 autocast the backward runs on scaled values: loss scaling moves gradients up out of the flush zone
(Micikevicius et al. 2018, §3.2) and, if S is too large, into overflow. Values are measured in fp32 and
compared with the format's limits — they say what a cast to the format would do, which is what autocast
does at the inputs of every matmul. (Ops that autocast keeps in fp32 never see the cast.)

Outputs are de-duplicated by tensor identity, so a container that returns its last child's output
(``nn.Sequential``) is not counted twice.

Each module's own weights are scanned too: under fp16 autocast the weights of matmul-type layers (Linear,
Conv, …) are cast to fp16 for every forward, so a weight whose magnitude is ≥ 65520 is inf there (pure-bf16
casts every parameter). Every row says which module *produced* its values (``produced_by``, see
``graph.py``: the gradient of M's output is made by M's consumer's backward) and, for gradients, when it
appeared in the backward pass (``backward_rank``), so that the first out-of-range gradient is found in
backward execution order and blamed on the module whose computation made it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from trainfit.doctor.data import iter_tensors
from trainfit.doctor.graph import CallGraph, module_name
from trainfit.precision.formats import FloatFormat, headroom_binades, json_float

__all__ = ["ModuleRange", "TensorRole", "module_name", "range_scan"]


class TensorRole(StrEnum):
    ACTIVATION = "activation"
    ACTIVATION_GRAD = "activation-grad"
    PARAM_GRAD = "param-grad"
    WEIGHT = "weight"

    @property
    def is_gradient(self) -> bool:
        return self in (TensorRole.ACTIVATION_GRAD, TensorRole.PARAM_GRAD)


@dataclass(slots=True)
class _Acc:
    values: int = 0
    nonzero: int = 0
    nonfinite: int = 0
    absmax: float = 0.0
    overflow: int = 0  # at the scale
    overflow_unscaled: int = 0
    flushed: int = 0  # at the scale
    flushed_unscaled: int = 0

    def add(self, t: torch.Tensor, fmt: FloatFormat, scale: float) -> None:
        a = t.detach().float().abs()
        finite = torch.isfinite(a)
        self.values += a.numel()
        self.nonfinite += int((~finite).sum())
        a = a[finite]
        if a.numel() == 0:
            return
        self.absmax = max(self.absmax, float(a.max()))
        nz = a[a > 0]
        self.nonzero += nz.numel()
        over_u = int((a >= fmt.overflow_threshold).sum())
        flush_u = int((nz <= fmt.flush_threshold).sum())
        self.overflow_unscaled += over_u
        self.flushed_unscaled += flush_u
        if scale == 1.0:
            self.overflow += over_u
            self.flushed += flush_u
        else:
            self.overflow += int((a * scale >= fmt.overflow_threshold).sum())
            self.flushed += int((nz * scale <= fmt.flush_threshold).sum())


@dataclass(frozen=True, slots=True, kw_only=True)
class ModuleRange:
    """One module's tensor of one role, against a format; counts summed over the scanned batches."""

    module: str
    role: TensorRole
    format_id: str
    scale: float  # the loss scale gradients were evaluated at (1 for activations)
    values: int
    nonzero: int
    nonfinite: int
    absmax: float
    overflow: int
    overflow_unscaled: int
    flushed: int
    flushed_unscaled: int
    headroom_binades: float  # at the scale
    #: the module whose computation produced these values (for an activation-grad row: the consumer of
    #: ``module``'s output, whose backward computed that gradient)
    produced_by: str = ""
    #: gradients: the position at which this row's gradient first appeared in the backward pass
    backward_rank: int | None = None
    #: activations: the largest magnitude among the module's floating-point inputs (inf included)
    input_absmax: float = 0.0

    @property
    def headroom_unscaled_binades(self) -> float:
        """log2(max_finite / absmax) of the values themselves (gradients: without loss scaling)."""
        return self.headroom_binades + math.log2(self.scale) if self.scale > 0 else self.headroom_binades

    @property
    def overflow_fraction(self) -> float:
        return self.overflow / self.values if self.values else 0.0

    @property
    def flush_fraction(self) -> float:
        """Fraction of the non-zero values that round to zero (at the scale)."""
        return self.flushed / self.nonzero if self.nonzero else 0.0

    @property
    def flush_fraction_unscaled(self) -> float:
        return self.flushed_unscaled / self.nonzero if self.nonzero else 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "module": self.module,
            "role": self.role.value,
            "format": self.format_id,
            "scale": self.scale,
            "values": self.values,
            "nonzero": self.nonzero,
            "nonfinite": self.nonfinite,
            "absmax": json_float(self.absmax),
            "overflow": self.overflow,
            "overflow_unscaled": self.overflow_unscaled,
            "overflow_fraction": self.overflow_fraction,
            "flushed": self.flushed,
            "flushed_unscaled": self.flushed_unscaled,
            "flush_fraction": self.flush_fraction,
            "flush_fraction_unscaled": self.flush_fraction_unscaled,
            "headroom_binades": json_float(self.headroom_binades),
            "produced_by": self.produced_by or self.module,
            "backward_rank": self.backward_rank,
            "input_absmax": json_float(self.input_absmax),
        }


def range_scan(
    model: torch.nn.Module,
    batches: Sequence[Any],
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    fmt: FloatFormat,
    *,
    grad_scale: float = 1.0,
) -> list[ModuleRange]:
    """Scan ``model`` (fp32, in train mode) on ``batches``; returns rows in forward execution order."""
    accs: dict[tuple[str, TensorRole], _Acc] = {}
    order: list[tuple[str, TensorRole]] = []
    ranks: dict[tuple[str, TensorRole], int] = {}

    def acc(name: str, role: TensorRole) -> _Acc:
        key = (name, role)
        if key not in accs:
            accs[key] = _Acc()
            order.append(key)
        return accs[key]

    def add_grad(name: str, role: TensorRole, g: torch.Tensor) -> None:
        ranks.setdefault((name, role), len(ranks))
        acc(name, role).add(g, fmt, grad_scale)

    seen: dict[int, torch.Tensor] = {}  # keeps the tensors alive so that their ids are not reused
    weighed: set[str] = set()
    inputs_max: dict[str, float] = {}
    handles = []

    def make_hook(name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if name not in weighed:  # the weights, once: they do not change during the scan
                weighed.add(name)
                for p in module.parameters(recurse=False):
                    if p.is_floating_point():
                        acc(name, TensorRole.WEIGHT).add(p, fmt, 1.0)
            for t in iter_tensors((args, kwargs)):
                if t.is_floating_point() and t.numel():
                    a = t.detach().abs()
                    a = a[~torch.isnan(a)]
                    if a.numel():
                        inputs_max[name] = max(inputs_max.get(name, 0.0), float(a.max()))
            for t in iter_tensors(output):
                if not t.is_floating_point() or seen.get(id(t)) is t:
                    continue
                seen[id(t)] = t
                acc(name, TensorRole.ACTIVATION).add(t, fmt, 1.0)
                if t.requires_grad:
                    acc(name, TensorRole.ACTIVATION_GRAD)  # keeps the row next to its activation
                    t.register_hook(lambda g, _n=name: add_grad(_n, TensorRole.ACTIVATION_GRAD, g))  # type: ignore[no-untyped-call]

        return hook

    def make_param_hook(name: str) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if p.grad is not None:
                add_grad(name, TensorRole.PARAM_GRAD, p.grad)

        return hook

    graph = CallGraph(model)
    for name, module in model.named_modules():
        handles.append(module.register_forward_hook(make_hook(module_name(name)), with_kwargs=True))
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(make_param_hook(module_name(name))))
    try:
        model.train()
        for batch in batches:
            seen.clear()
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model, batch)
            loss.backward()  # type: ignore[no-untyped-call]
    finally:
        for h in handles:
            h.remove()
        graph.close()
        model.zero_grad(set_to_none=True)
    rows = []
    for name, role in order:
        a = accs[(name, role)]
        if role is TensorRole.ACTIVATION_GRAD and a.values == 0:
            continue  # no gradient reached this output
        scale = grad_scale if role.is_gradient else 1.0
        rows.append(
            ModuleRange(
                module=name,
                role=role,
                format_id=fmt.id,
                scale=scale,
                values=a.values,
                nonzero=a.nonzero,
                nonfinite=a.nonfinite,
                absmax=a.absmax,
                overflow=a.overflow,
                overflow_unscaled=a.overflow_unscaled,
                flushed=a.flushed,
                flushed_unscaled=a.flushed_unscaled,
                headroom_binades=headroom_binades(a.absmax * scale, fmt) if a.absmax else math.inf,
                produced_by=graph.grad_producer(name) if role is TensorRole.ACTIVATION_GRAD else name,
                backward_rank=ranks.get((name, role)),
                input_absmax=inputs_max.get(name, 0.0) if role is TensorRole.ACTIVATION else 0.0,
            )
        )
    return rows
