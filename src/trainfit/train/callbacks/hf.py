"""StabilityMonitor for the Hugging Face ``Trainer``.

What the Trainer exposes, and where (transformers 5.x, accelerate 1.x):

* loss, gradient norm and learning rate arrive in ``on_log`` (every ``logging_steps``; the loss is the mean
  since the last log, the gradient norm is the pre-clipping norm of the latest step);
* with ``fp16=True`` the optimizer handed to callbacks is accelerate's ``AcceleratedOptimizer``: its
  ``step_was_skipped`` says whether GradScaler skipped the step and its ``scaler`` holds the scale. They are
  read in ``on_step_end``, once per optimizer step (``get_scale()`` synchronises; the Trainer has already
  synchronised for the skip decision inside ``scaler.step``).

Precision and clipping for the advice come from ``TrainingArguments`` (``fp16``/``bf16``,
``max_grad_norm``). ``stop_on`` event kinds set ``control.should_training_stop``.

Beware ``TrainingArguments.logging_nan_inf_filter`` (default True): the Trainer replaces a NaN/Inf loss in
its logs by the window's average of the finite ones, so the monitor never sees the NaN *loss* — it still
sees the NaN ``grad_norm`` (a ``nonfinite-grad`` event). Set it to False to get ``nonfinite-loss`` events.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from transformers import TrainerCallback

from trainfit.train.monitor import EventKind, StabilityMonitor, StepStats


def precision_of(args: Any) -> str:
    """TrainingArguments → trainfit recipe name (weights stay fp32 under the Trainer's autocast)."""
    if getattr(args, "fp16", False):
        return "amp-fp16"
    if getattr(args, "bf16", False):
        return "amp-bf16"
    return "fp32"


class StabilityCallback(TrainerCallback):
    def __init__(self, monitor: StabilityMonitor | None = None, *, stop_on: Iterable[EventKind | str] = ()) -> None:
        self.monitor = monitor or StabilityMonitor()
        self.stop_on = frozenset(EventKind(k) for k in stop_on)
        self._stop = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        clip = getattr(args, "max_grad_norm", None)
        self.monitor.attach(precision=precision_of(args), max_grad_norm=clip if clip and clip > 0 else None)
        if getattr(args, "logging_nan_inf_filter", False):
            logging.getLogger("trainfit.monitor").info(
                "logging_nan_inf_filter=True hides NaN/Inf losses from the logs; the monitor will flag them "
                "through the gradient norm (set it to False to see nonfinite-loss events)"
            )
        return control

    def _observe(self, stats: StepStats, control: Any) -> Any:
        for event in self.monitor.observe(stats):
            if event.kind in self.stop_on:
                self._stop = True
        if self._stop:
            control.should_training_stop = True
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        optimizer = kwargs.get("optimizer")
        scaler = getattr(optimizer, "scaler", None)
        if scaler is None or not scaler.is_enabled():
            return control
        skipped = bool(getattr(optimizer, "step_was_skipped", False))
        return self._observe(
            StepStats(step=state.global_step, skipped=skipped, loss_scale=float(scaler.get_scale())), control
        )

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        logs = logs or {}
        if "loss" not in logs and "grad_norm" not in logs:
            return control  # an evaluation or summary log
        loss = logs.get("loss")
        grad_norm = logs.get("grad_norm")
        lr = logs.get("learning_rate")
        return self._observe(
            StepStats(
                step=state.global_step,
                loss=float(loss) if loss is not None else None,
                grad_norm=float(grad_norm) if grad_norm is not None else None,
                lr=float(lr) if isinstance(lr, int | float) else None,
                skipped=None,
            ),
            control,
        )
