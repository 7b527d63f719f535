"""TrainStep: one micro-step of a plain PyTorch loop, with mixed precision done right by construction.

Each call runs the user's loss function under ``torch.autocast`` (``torch.amp``, not the deprecated
``torch.cuda.amp``), divides the loss by the accumulation steps, and back-propagates — through
``scaler.scale(loss)`` for fp16. On the accumulation boundary it performs, in this order, the sequence
the PyTorch AMP docs ("Working with Unscaled Gradients", "Gradient accumulation") and the article (§6.4)
prescribe::

    scaler.unscale_(optimizer)                 # fp16 only: clip the true gradients, not the scaled ones
    clip_grad_norm_(params, max_grad_norm)     # if clipping is on
    scaler.step(optimizer) / optimizer.step()  # the scaler skips the step on inf/NaN gradients
    scaler.update()                            # fp16 only: ×0.5 on overflow, ×2 after 2000 clean steps
    optimizer.zero_grad(set_to_none=True)

**Skipped steps without extra synchronisation.** Whether the scaler skipped the step is read from the
same ``found_inf`` tensors the scaler itself uses (see ``_scaler.py`` for why and what else was
considered). They stay on the device; the loss, the gradient norm, ``found_inf`` and the scale are stacked
into one small tensor per optimizer step and copied to the host by the monitor every ``check_every``
steps. Nothing here calls ``.item()`` per micro-step. (``scaler.step`` itself synchronises once per
optimizer step for non-fused optimizers; that is torch's, not ours.)

Precisions: ``fp32``; ``amp-bf16`` and ``amp-fp16`` (autocast over fp32 weights, the latter with a
GradScaler); ``pure-bf16`` (a bf16 model, no autocast, no scaler). ``auto`` follows the article's path via
:func:`trainfit.precision.advice.recommend`: native bf16 → amp-bf16, other GPUs → amp-fp16, CPU → fp32.
The ``master-*`` recipes need an optimizer that keeps fp32 master copies (DeepSpeed, Megatron) and are
refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import torch

from trainfit.errors import StrategyError
from trainfit.strategy import Precision
from trainfit.train import _scaler
from trainfit.train.monitor import StabilityMonitor

_AUTOCAST_DTYPE: dict[Precision, torch.dtype] = {
    Precision.AMP_BF16: torch.bfloat16,
    Precision.AMP_FP16: torch.float16,
}
SUPPORTED = (Precision.FP32, Precision.AMP_BF16, Precision.AMP_FP16, Precision.PURE_BF16)


def resolve_precision(precision: Precision | str, device: torch.device) -> Precision:
    """``'auto'`` → the article's choice for ``device``; anything else is validated and returned."""
    if str(precision) == "auto":
        from trainfit.precision.advice import cpu_accelerator, recommend

        if device.type == "cuda":
            from trainfit.hardware.detect import accelerator_for_device

            index = device.index if device.index is not None else torch.cuda.current_device()
            return recommend(accelerator_for_device(index)).precision
        return recommend(cpu_accelerator()).precision
    try:
        p = Precision(precision)
    except ValueError:
        choices = ", ".join(["auto", *(s.value for s in SUPPORTED)])
        raise StrategyError(f"unknown precision '{precision}'; choose one of: {choices}") from None
    if p not in SUPPORTED:
        raise StrategyError(
            f"TrainStep does not implement '{p.value}': it needs an optimizer with fp32 master copies "
            "(DeepSpeed/Megatron). Use amp-bf16/amp-fp16 (fp32 weights under autocast) instead."
        )
    return p


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all gradients together, as clip_grad_norm_ computes it (no clipping, no sync)."""
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
    if get_total_norm is not None:
        return get_total_norm(grads)  # type: ignore[no-any-return]
    norms = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
    return cast(torch.Tensor, torch.linalg.vector_norm(norms))


class TrainStep:
    """Call once per micro-batch: ``loss = step(loss_fn, *args, **kwargs)``.

    Args:
        model: the module being trained (used for its device, its dtype checks and checkpointing).
        optimizer: any ``torch.optim.Optimizer`` over the model's parameters.
        precision: ``'auto'``, ``'fp32'``, ``'amp-bf16'``, ``'amp-fp16'`` or ``'pure-bf16'``.
        grad_accum: micro-steps per optimizer step; each loss is divided by it before backward.
        max_grad_norm: clip the (unscaled) total gradient norm to this; None disables clipping.
        monitor: a :class:`StabilityMonitor` fed once per optimizer step.
        scaler: a ``torch.amp.GradScaler`` to use for fp16 (default: a fresh one with torch's defaults;
            pass ``GradScaler(device, enabled=False)`` to train fp16 without loss scaling).
        checkpointing: wrap the model's blocks with non-reentrant activation checkpointing
            (see :func:`trainfit.train.checkpoint.set_checkpointing`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        precision: Precision | str = "auto",
        grad_accum: int = 1,
        max_grad_norm: float | None = None,
        monitor: StabilityMonitor | None = None,
        scaler: torch.amp.GradScaler | None = None,
        checkpointing: bool = False,
    ) -> None:
        if grad_accum < 1:
            raise StrategyError(f"grad_accum must be a positive integer, got {grad_accum}")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise StrategyError(f"max_grad_norm must be positive, got {max_grad_norm}")
        self.model = model
        self.optimizer = optimizer
        self.grad_accum = grad_accum
        self.max_grad_norm = max_grad_norm
        self.monitor = monitor
        first = next(iter(model.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.device_type = self.device.type
        self.precision = resolve_precision(precision, self.device)
        self.autocast_dtype = _AUTOCAST_DTYPE.get(self.precision)
        self._params = _optimizer_params(optimizer)
        self._check_param_dtypes()
        if self.precision is Precision.AMP_FP16:
            self.scaler: torch.amp.GradScaler | None = scaler or torch.amp.GradScaler(self.device_type)
        elif scaler is not None:
            raise StrategyError(f"a GradScaler is only used with amp-fp16, not {self.precision.value}")
        else:
            self.scaler = None
        if checkpointing:
            from trainfit.train.checkpoint import set_checkpointing

            set_checkpointing(model, True)
        if monitor is not None:
            monitor.attach(precision=self.precision.value, max_grad_norm=max_grad_norm)
        self.micro_step = 0  # micro-steps accumulated towards the next optimizer step
        self.optimizer_steps = 0
        self.last_grad_norm: torch.Tensor | None = None
        self._loss_sum: torch.Tensor | None = None
        self._last_found_inf: torch.Tensor | None = None
        self._skipped_total: torch.Tensor | None = None
        self._zero: torch.Tensor | None = None
        self.boundary = False  # whether the latest call ended with an optimizer step

    def _check_param_dtypes(self) -> None:
        dtypes = {p.dtype for p in self._params if p.is_floating_point()}
        if self.precision in (Precision.AMP_BF16, Precision.AMP_FP16) and dtypes - {torch.float32}:
            found = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
            hint = " (use precision='pure-bf16' for a bf16 model)" if torch.bfloat16 in dtypes else ""
            raise StrategyError(
                f"{self.precision.value} expects fp32 trainable parameters (autocast casts per op and the "
                f"scaler refuses to unscale fp16 gradients); found {found}{hint}"
            )
        if self.precision is Precision.PURE_BF16 and dtypes - {torch.bfloat16}:
            raise StrategyError("pure-bf16 expects a bf16 model: call model.to(torch.bfloat16) first")

    # ------------------------------------------------------------------ the step
    def autocast(self) -> torch.autocast:
        """The autocast context this step uses (disabled for fp32/pure-bf16)."""
        return torch.autocast(
            self.device_type,
            dtype=self.autocast_dtype or torch.float32,
            enabled=self.autocast_dtype is not None,
        )

    def __call__(self, loss_fn: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        """Forward + backward for one micro-batch; on the accumulation boundary, the optimizer step.

        Returns the detached loss as computed (not divided by ``grad_accum``); no host sync.
        """
        with self.autocast():
            loss = loss_fn(*args, **kwargs)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise StrategyError("the loss function must return a scalar tensor")
        to_backward = loss / self.grad_accum if self.grad_accum > 1 else loss
        if self.scaler is not None:
            self.scaler.scale(to_backward).backward()  # type: ignore[no-untyped-call]
        else:
            to_backward.backward()  # type: ignore[no-untyped-call]
        detached = loss.detach()
        if detached.dtype != torch.float32:
            detached = detached.float()
        if detached.dim():
            detached = detached.reshape(())
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        self.micro_step += 1
        self.boundary = False
        if self.micro_step == self.grad_accum:
            self._optimizer_step()
        return loss.detach()

    def flush(self) -> bool:
        """Apply the optimizer step for a partial accumulation window (e.g. the end of an epoch) and sync
        the monitor. The accumulated gradients keep their 1/grad_accum weighting. Returns whether a step ran."""
        ran = False
        if self.micro_step > 0:
            self._optimizer_step()
            ran = True
        if self.monitor is not None:
            self.monitor.sync()
        return ran

    def _optimizer_step(self) -> None:
        scaler, optimizer = self.scaler, self.optimizer
        found_inf: torch.Tensor | None = None
        if scaler is not None and scaler.is_enabled():
            scaler.unscale_(optimizer)
            found_inf = _scaler.found_inf(scaler, optimizer)
        grad_norm: torch.Tensor | None = None
        if self.max_grad_norm is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(self._params, self.max_grad_norm)
        elif self.monitor is not None:
            grads = [p.grad for p in self._params if p.grad is not None]
            grad_norm = _total_norm(grads) if grads else None
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.last_grad_norm = grad_norm
        self._last_found_inf = found_inf
        if found_inf is not None:
            skipped = found_inf.gt(0).to(torch.int64)  # bool + bool would be a logical or
            self._skipped_total = skipped if self._skipped_total is None else self._skipped_total + skipped
        if self.monitor is not None:
            self._push_to_monitor(grad_norm, found_inf)
        self._loss_sum = None
        self.micro_step = 0
        self.optimizer_steps += 1
        self.boundary = True

    def _push_to_monitor(self, grad_norm: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        assert self.monitor is not None and self._loss_sum is not None
        loss_mean = self._loss_sum / self.micro_step if self.micro_step > 1 else self._loss_sum
        device = loss_mean.device
        if self._zero is None or self._zero.device != device:
            self._zero = torch.zeros((), device=device)
        zero = self._zero
        scaling = self.scaler is not None and self.scaler.is_enabled()
        parts = [
            loss_mean,
            grad_norm.detach() if grad_norm is not None else zero,
            found_inf if found_inf is not None else zero,
            _scaler.scale_tensor(self.scaler) if scaling and self.scaler is not None else zero,
        ]
        values = torch.stack(
            [p if p.device == device and p.dtype == torch.float32 else p.to(device, torch.float32) for p in parts]
        )
        lr = self.optimizer.param_groups[0].get("lr")
        self.monitor.push(
            self.optimizer_steps,
            values,
            has_grad_norm=grad_norm is not None,
            has_scaler=scaling,
            lr=float(lr) if isinstance(lr, (int, float)) else None,
        )

    # ------------------------------------------------------------------ state (these synchronise)
    @property
    def last_skipped(self) -> bool:
        """Whether the latest optimizer step was skipped for inf/NaN gradients (synchronises)."""
        return bool(self._last_found_inf is not None and self._last_found_inf.item() > 0)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far (synchronises)."""
        return int(self._skipped_total.item()) if self._skipped_total is not None else 0

    @property
    def loss_scale(self) -> float | None:
        """The scaler's current scale, or None without loss scaling (synchronises)."""
        return self.scaler.get_scale() if self.scaler is not None and self.scaler.is_enabled() else None


def train_steps(step: TrainStep, loss_fn: Callable[..., torch.Tensor], batches: Iterable[Any]) -> list[torch.Tensor]:
    """Run ``step(loss_fn, batch)`` over ``batches`` and flush; returns the per-micro-step losses."""
    losses = [step(loss_fn, batch) for batch in batches]
    step.flush()
    return losses
