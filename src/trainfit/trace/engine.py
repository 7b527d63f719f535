"""The trace's earlier single-module interface, kept for existing callers: the runner's helpers, the
read-out functions, and :func:`run_steps` with its options as keywords.

New code uses :mod:`trainfit.trace.runner` (:func:`~trainfit.trace.runner.run_steps` with
:class:`~trainfit.trace.runner.StepFns`, :class:`~trainfit.trace.runner.RunOptions` and
:class:`~trainfit.trace.runner.Execution`), :mod:`trainfit.trace.timeline` and
:mod:`trainfit.trace.readout`. Nothing here has behaviour of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from trainfit.errors import TraceUnsupportedError as TraceUnsupportedError
from trainfit.strategy import Recipe
from trainfit.trace import tracker as tk
from trainfit.trace.readout import module_activations as module_activations
from trainfit.trace.readout import phase_peaks as phase_peaks
from trainfit.trace.readout import region_peaks as region_peaks
from trainfit.trace.runner import DEFAULT_MAX_GRAD_NORM, Execution, Probe, RunOptions, StepFns
from trainfit.trace.runner import StackHooks as StackHooks
from trainfit.trace.runner import TraceRun as TraceRun
from trainfit.trace.runner import compute_dtype as compute_dtype
from trainfit.trace.runner import fake_mode as fake_mode
from trainfit.trace.runner import materialize as materialize
from trainfit.trace.runner import run_backward as run_backward
from trainfit.trace.runner import run_steps as _run
from trainfit.trace.runner import weight_dtype as weight_dtype


def run_steps(
    model: torch.nn.Module,
    mode: FakeTensorMode | None,
    *,
    make_batch: Callable[[], Any],
    forward: Callable[[torch.nn.Module, Any], Any],
    loss_of: Callable[[Any, Any], torch.Tensor],
    make_optimizer: Callable[[list[torch.nn.Parameter]], Any],
    recipe: Recipe,
    steps: int = 2,
    grad_accum: int = 1,
    head_module: torch.nn.Module | None = None,
    stack: StackHooks | None = None,
    max_grad_norm: float | None = DEFAULT_MAX_GRAD_NORM,
    progress: Callable[[str, float], None] | None = None,
    prepare: Callable[[tk.Tracker], None] | None = None,
    emulate_cuda: bool = True,
    track: bool = True,
    annotate: bool = False,
    device: str = "cpu",
    probe: Probe | None = None,
) -> TraceRun:
    """:func:`trainfit.trace.runner.run_steps` with its three option values spelled out as keywords."""
    return _run(
        model,
        StepFns(make_batch=make_batch, forward=forward, loss_of=loss_of, make_optimizer=make_optimizer),
        RunOptions(
            recipe=recipe,
            steps=steps,
            grad_accum=grad_accum,
            max_grad_norm=max_grad_norm,
            head_module=head_module,
            stack=stack or StackHooks(),
            progress=progress,
            prepare=prepare,
        ),
        Execution(mode=mode, device=device, emulate_cuda=emulate_cuda, track=track, annotate=annotate, probe=probe),
    )
