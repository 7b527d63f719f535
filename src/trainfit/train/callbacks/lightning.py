"""StabilityMonitor for Lightning (``lightning.pytorch``).

* the gradient norm is computed in ``on_before_optimizer_step`` — Lightning calls it after its precision
  plugin has unscaled the gradients, so it is the true norm (one extra reduction per optimizer step);
* the loss comes from ``training_step``'s output in ``on_train_batch_end``;
* with ``precision="16-mixed"`` the plugin's ``scaler`` gives the loss scale. Lightning does not say whether
  the scaler skipped a step, so a skip is inferred from the scale going down (GradScaler only lowers it
  on overflow). That misses skips once the scale has reached 0, which the collapse rule reports anyway.

Precision and clipping for the advice come from the Trainer (``trainer.precision``,
``trainer.gradient_clip_val``). ``stop_on`` event kinds set ``trainer.should_stop``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from lightning.pytorch import Callback

from trainfit.train.monitor import EventKind, StabilityMonitor, StepStats

_PRECISION = {"16-mixed": "amp-fp16", "bf16-mixed": "amp-bf16", "32-true": "fp32", "bf16-true": "pure-bf16"}


class StabilityCallback(Callback):
    def __init__(self, monitor: StabilityMonitor | None = None, *, stop_on: Iterable[EventKind | str] = ()) -> None:
        self.monitor = monitor or StabilityMonitor()
        self.stop_on = frozenset(EventKind(k) for k in stop_on)
        self._grad_norm: float | None = None
        self._last_scale: float | None = None
        self._last_step = -1

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        clip = trainer.gradient_clip_val
        self.monitor.attach(
            precision=_PRECISION.get(str(trainer.precision)), max_grad_norm=float(clip) if clip else None
        )

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self._grad_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._last_step:
            return  # inside a gradient-accumulation window: no optimizer step yet
        self._last_step = trainer.global_step
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        scale = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None
        skipped = None
        if scale is not None:
            skipped = self._last_scale is not None and scale < self._last_scale
            self._last_scale = scale
        stats = StepStats(
            step=trainer.global_step - 1,
            loss=float(loss.detach()) if isinstance(loss, torch.Tensor) else None,
            grad_norm=self._grad_norm,
            loss_scale=scale,
            skipped=skipped,
            lr=float(trainer.optimizers[0].param_groups[0]["lr"]) if trainer.optimizers else None,
        )
        for event in self.monitor.observe(stats):
            if event.kind in self.stop_on:
                trainer.should_stop = True
