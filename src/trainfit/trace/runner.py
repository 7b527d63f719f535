"""The step runner: real training steps, on fake tensors under the tracker or on a real device under a probe.

One step is what the Hugging Face Trainer does in ``training_step`` (and what a hand-written loop does):
build the batch; under autocast run the forward pass and the loss; drop the outputs, keeping the loss;
``backward`` (through a GradScaler for fp16); then ``optimizer.step()`` after unscaling and clipping the
gradient norm (``max_grad_norm=1.0`` is the Trainer default), and ``zero_grad(set_to_none=True)``. We run
at least two steps and read phases from step 2 onwards, when optimizer states exist and the previous
step's gradients have been freed — the steady state.

With gradient accumulation (``grad_accum > 1``) a step is several forward/backward passes whose losses are
divided by ``grad_accum`` and whose gradients autograd adds into the existing ``.grad`` tensors in place
(``AccumulateGrad``), then one optimizer step. Every pass after the first of a step runs with all the
gradients resident, and passes 3, 4, ... are the same as pass 2, so steps from the second on run two
passes (the first step only creates optimizer states and runs one). FSDP2/HSDP
(:attr:`RunOptions.accumulate_first_step`) runs its passes in the first step too: there a single pass reduce-scatters
where no real micro-step does (under accelerate's ``no_sync`` a synced pass where none is synced; the HSDP cells of
tests/trace/test_rank_stream.py reserved 13% more so under no_sync, 2% synced); so does DDP, whose reducer rebuilds
its buckets at the second forward, in a real run the first step's second micro-step (trace/distributed.py).

What a run needs comes in three values: :class:`StepFns` (how to build a batch, run the model, take the
loss, build the optimizer), :class:`RunOptions` (recipe, steps, accumulation, clipping, the modules whose
boundaries are marked) and :class:`Execution` (fake tensors or a real device, CUDA emulation, tracker,
probe). :func:`run_steps` runs named stages — hooks, modes, optimizer, passes, optimizer step — and
returns a :class:`TraceRun`: the tracker and the :class:`~trainfit.trace.timeline.Timeline` of marks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)

from trainfit.cuda_facts import SdpaKernel
from trainfit.errors import TraceUnsupportedError, TrainfitError
from trainfit.strategy import Recipe
from trainfit.trace import tracker as tk
from trainfit.trace.autocast import cuda_autocast_policy
from trainfit.trace.kernels import CudaKernels
from trainfit.trace.optim import FakeSafeGradScaler, MasterWeights, host_state_keys, state_tensors
from trainfit.trace.timeline import Mark, PassMarks, StepMarks, Timeline

#: Hugging Face Trainer default ``max_grad_norm``.
DEFAULT_MAX_GRAD_NORM = 1.0

#: Passes run per step (after the first step) under gradient accumulation: from zero gradients, then with
#: every gradient resident; further passes repeat the second.
ACCUMULATION_PASSES = 2

Probe = Callable[[Mark], int]
Progress = Callable[[str, float], None]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def compute_dtype(recipe: Recipe) -> torch.dtype:
    return _DTYPES[recipe.compute_dtype]


def weight_dtype(recipe: Recipe) -> torch.dtype:
    return torch.float32 if recipe.weight_bits == 32 else compute_dtype(recipe)


def fake_mode() -> FakeTensorMode:
    return FakeTensorMode(allow_non_fake_inputs=False)


def materialize(
    model: torch.nn.Module, mode: FakeTensorMode | None, dtype: torch.dtype | None, device: str = "cpu"
) -> torch.nn.Module:
    """Replace every parameter and buffer (meta or real) with a fake CPU tensor of the same shape, keeping
    shared (tied) tensors shared; floating parameters and buffers take ``dtype`` when given (what
    ``model.to(dtype)`` would do, which fake parameters refuse). ``mode=None`` makes real (zeroed) tensors
    on ``device`` instead: for cross-checking the fake trace against real execution, and for measuring."""
    memo: dict[int, torch.Tensor] = {}

    def conv(t: torch.Tensor) -> torch.dtype:
        return dtype if (dtype is not None and t.is_floating_point()) else t.dtype

    with mode if mode is not None else contextlib.nullcontext():
        for mod in model.modules():
            for name, p in list(mod._parameters.items()):
                if p is None:
                    continue
                if id(p) not in memo:
                    memo[id(p)] = torch.nn.Parameter(
                        torch.zeros(p.shape, dtype=conv(p), device=device), requires_grad=p.requires_grad
                    )
                mod._parameters[name] = memo[id(p)]  # type: ignore[assignment]
            for name, b in list(mod._buffers.items()):
                if b is None:
                    continue
                if id(b) not in memo:
                    memo[id(b)] = torch.zeros(b.shape, dtype=conv(b), device=device)
                mod._buffers[name] = memo[id(b)]
    return model


# -- what a run is given -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class StepFns:
    """How one pass is made: ``make_batch()``, ``forward(model, batch)``, ``loss_of(output, batch)``; and
    ``make_optimizer(params)`` (for master-* recipes it receives the fp32 master parameters)."""

    make_batch: Callable[[], Any]
    forward: Callable[[torch.nn.Module, Any], Any]
    loss_of: Callable[[Any, Any], torch.Tensor]
    make_optimizer: Callable[[list[torch.nn.Parameter]], Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class StackHooks:
    """The layer stack cut into units, for region marks (empty when not extrapolating)."""

    layers: Sequence[torch.nn.Module] = ()
    unit_first: Sequence[int] = ()  # index into layers of each unit's first layer
    unit_last: Sequence[int] = ()  # index of each unit's last layer


@dataclass(frozen=True, slots=True, kw_only=True)
class RunOptions:
    """What to run: the recipe, how many steps and passes, clipping, and which modules to mark.

    ``head_module``: the submodule whose forward and backward count as logits/loss (default: the model's
    outputs). ``stack``: the layer stack's units, for region marks. ``prepare(tracker)`` is called before
    the first step (the checkpointing wrappers use it to find the tracker)."""

    recipe: Recipe
    steps: int = 2
    grad_accum: int = 1
    max_grad_norm: float | None = DEFAULT_MAX_GRAD_NORM
    head_module: torch.nn.Module | None = None
    stack: StackHooks = field(default_factory=StackHooks)
    progress: Progress | None = None
    prepare: Callable[[tk.Tracker], None] | None = None
    flash_sdp: bool = True  # the emulated GPU has FlashAttention (Strategy.flash_sdp)
    #: Called before each pass with (pass, passes in the step): a framework's per-micro-step switch (FSDP2's
    #: ``set_requires_gradient_sync`` under accelerate's ``no_sync``).
    before_pass: Callable[[int, int], None] | None = None
    #: Passes per step under accumulation (after the first step): :data:`ACCUMULATION_PASSES`, or three where the
    #: passes between the first and the last differ from both (FSDP2 under accelerate's ``no_sync``).
    accumulation_passes: int = ACCUMULATION_PASSES
    #: Run the accumulation passes in the first step too (FSDP2/HSDP, DDP; see the module docstring).
    accumulate_first_step: bool = False

    def __post_init__(self) -> None:
        if self.steps < 2:
            raise TrainfitError("trace needs at least 2 steps (step 1 creates the optimizer states)")
        if self.grad_accum < 1:
            raise TrainfitError(f"grad_accum must be a positive integer, got {self.grad_accum}")

    def passes(self, step: int) -> int:
        """Forward/backward passes run in ``step`` (see the module docstring)."""
        if step == 0 and not self.accumulate_first_step:
            return 1
        return min(self.grad_accum, self.accumulation_passes)


@dataclass(frozen=True, slots=True, kw_only=True)
class Execution:
    """Where and how the steps run.

    The default traces: fake tensors (``mode``), CUDA's autocast policy and kernels emulated, every storage
    tracked. ``emulate_cuda=False`` keeps PyTorch's CPU behaviour; ``track=False`` runs without the tracker;
    ``annotate=True`` wraps each phase in a profiler ``record_function("trainfit:<step>:<phase>")`` — together
    they let tests measure a real CPU run with ``torch.profiler(profile_memory=True)``. ``device="cuda"`` with
    a ``probe`` runs the same steps on a GPU (:mod:`trainfit.measure`): every mark calls ``probe(mark)``,
    whose return value stands in for the tracker's event number."""

    mode: FakeTensorMode | None = None
    device: str = "cpu"
    emulate_cuda: bool = True
    track: bool = True
    annotate: bool = False
    probe: Probe | None = None
    tracker: Callable[[], tk.Tracker] = tk.Tracker  # a subclass for distributed runs (trace/distributed.py)


@dataclass
class TraceRun:
    """What a run leaves: the tracker's event log and the timeline of marks (no tensors)."""

    tracker: tk.Tracker
    timeline: Timeline
    params: int
    trainable_params: int
    sdpa_backends: dict[SdpaKernel, int]
    notes: list[str] = field(default_factory=list)


# -- the run ------------------------------------------------------------------------------------------------


def run_steps(
    model: torch.nn.Module, fns: StepFns, options: RunOptions, execution: Execution | None = None
) -> TraceRun:
    """Run ``options.steps`` training steps of ``model`` (already materialised) and record them."""
    return _StepLoop(model, fns, options, execution or Execution()).run()


def run_backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` without passing through ``__torch_function__``: a TorchFunctionMode is popped
    while it handles a call, so a backward entered through it would run (and recompute checkpoints)
    without the CUDA kernel emulation."""
    grad = torch.ones_like(loss, memory_format=torch.preserve_format)
    torch.autograd.graph._engine_run_backward(
        (loss,), (grad,), False, False, (), allow_unreachable=True, accumulate_grad=True
    )


def _first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)) and x:
        return _first_tensor(x[0])
    for attr in ("last_hidden_state", "logits", "hidden_states"):
        v = getattr(x, attr, None)
        if isinstance(v, torch.Tensor):
            return v
    return None


def _translate(exc: Exception) -> TraceUnsupportedError:
    func = getattr(exc, "func", None)
    op = str(func) if func is not None else type(exc).__name__
    return TraceUnsupportedError(
        f"the model runs {op}, whose output depends on tensor values, which fake tensors cannot trace "
        "(e.g. data-dependent shapes or a host sync); use --method analytic for this model"
    )


@contextlib.contextmanager
def _module_stack(tr: tk.Tracker, model: torch.nn.Module) -> Iterator[None]:
    """Keep ``tr.module_stack`` at the module being run (the owner of what it allocates)."""
    names = {id(m): n or type(m).__name__ for n, m in model.named_modules()}

    def pre(mod: torch.nn.Module, _args: Any) -> None:
        tr.module_stack.append(names.get(id(mod), type(mod).__name__))

    def post(mod: torch.nn.Module, _args: Any, _out: Any) -> None:
        if tr.module_stack:
            tr.module_stack.pop()

    h1 = torch.nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = torch.nn.modules.module.register_module_forward_hook(post, always_call=True)
    try:
        yield
    finally:
        h1.remove()
        h2.remove()


@dataclass
class _Optim:
    """The optimizer side of a run: the optimizer (or the master-weights wrapper's inner one), the
    parameters it steps, and the loss scaler."""

    optimizer: Any
    master: MasterWeights | None
    scaler: FakeSafeGradScaler | None
    params: list[torch.nn.Parameter]
    host_keys: set[str]


class _StepLoop:
    """One run of :func:`run_steps`, as named stages."""

    def __init__(self, model: torch.nn.Module, fns: StepFns, options: RunOptions, execution: Execution):
        self.model, self.fns, self.opts, self.ex = model, fns, options, execution
        self.tr = execution.tracker()
        if options.prepare is not None:
            options.prepare(self.tr)
        self.params = list(model.parameters())
        self.trainable = [p for p in self.params if p.requires_grad]
        self.timeline = Timeline()
        self.cur = PassMarks()  # the pass being run (hooks write into it)
        self.kernels = CudaKernels(flash=options.flash_sdp)
        self.handles: list[Any] = []
        self.passes = 0  # passes run so far (the tracker's pass counter)
        self.loss: torch.Tensor | None = None  # from forward to backward, owned by no frame in between

    def now(self, mark: Mark) -> int:
        return self.ex.probe(mark) if self.ex.probe is not None else self.tr.t

    # -- stage 1: hooks that mark gradients, the head region and the stack's units ------------------------

    def install_hooks(self) -> None:
        tr = self.tr
        tr.mark(self.params, tk.WEIGHTS)
        tr.mark(self.model.buffers(), tk.WEIGHTS)

        def on_grad(p: torch.Tensor) -> None:
            tr.mark([p.grad], tk.GRAD)

        for p in self.trainable:
            self.handles.append(p.register_post_accumulate_grad_hook(on_grad))  # type: ignore[no-untyped-call]
        if self.opts.head_module is not None:
            self.handles.append(self.opts.head_module.register_forward_pre_hook(self._head_pre, with_kwargs=True))
        self._install_stack_hooks()

    def _head_bwd_done(self, _g: torch.Tensor) -> None:
        self.tr.bwd_head = False

    def _head_pre(self, _m: torch.nn.Module, args: Any, kwargs: Any) -> None:
        """Head region: from the head module's forward entry to the end of the root forward, and in backward
        until the gradient of the head's input is ready."""
        if self.tr.phase != tk.FORWARD:
            return
        self.tr.head_depth = 1
        x = _first_tensor(args) if args else _first_tensor(list(kwargs.values()))
        if x is not None and x.requires_grad:
            x.register_hook(self._head_bwd_done)  # type: ignore[no-untyped-call]

    def _install_stack_hooks(self) -> None:
        stack, tr = self.opts.stack, self.tr
        first_of = {i: u for u, i in enumerate(stack.unit_first)}
        last_of = {i: u for u, i in enumerate(stack.unit_last)}
        for idx, layer in enumerate(stack.layers):
            if idx in first_of or idx == 0:

                def pre(_m: torch.nn.Module, args: Any, kwargs: Any, idx: int = idx) -> None:
                    if tr.phase != tk.FORWARD:
                        return
                    m = self.cur
                    if idx in first_of:
                        m.unit_fwd.append(self.now(Mark.UNIT_FORWARD))
                    if idx == 0:
                        x = _first_tensor(args) if args else _first_tensor(list(kwargs.values()))
                        if x is not None and x.requires_grad:

                            def stack_done(_g: torch.Tensor, m: PassMarks = m) -> None:
                                m.stack_bwd_end = self.now(Mark.STACK_BACKWARD_END)

                            x.register_hook(stack_done)  # type: ignore[no-untyped-call]

                self.handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
            if idx in last_of:

                def post(_m: torch.nn.Module, _a: Any, out: Any, idx: int = idx) -> None:
                    if tr.phase != tk.FORWARD:
                        return
                    m = self.cur
                    y = _first_tensor(out)
                    if y is not None and y.requires_grad:

                        def ready(_g: torch.Tensor, m: PassMarks = m) -> None:
                            m.unit_bwd.append(self.now(Mark.UNIT_BACKWARD))

                        y.register_hook(ready)  # type: ignore[no-untyped-call]
                    if idx == len(stack.layers) - 1:
                        m.stack_fwd_end = self.now(Mark.STACK_FORWARD_END)

                self.handles.append(layer.register_forward_hook(post))

    # -- stage 2: the modes a run executes under --------------------------------------------------------------

    def enter_modes(self, ctx: contextlib.ExitStack) -> None:
        if self.ex.mode is not None:
            ctx.enter_context(self.ex.mode)
        if self.opts.recipe.autocast and self.ex.emulate_cuda:
            ctx.enter_context(cuda_autocast_policy())
        if self.ex.emulate_cuda:
            ctx.enter_context(self.kernels)
        if self.ex.track:
            ctx.enter_context(self.tr)
        ctx.enter_context(_module_stack(self.tr, self.model))

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if not self.opts.recipe.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.ex.device, dtype=compute_dtype(self.opts.recipe))

    def phase(self, name: str, label: str) -> contextlib.AbstractContextManager[Any]:
        self.tr.phase = name
        if self.ex.annotate:
            return torch.profiler.record_function(f"trainfit:{label}:{name}")
        return contextlib.nullcontext()

    # -- stage 3: the optimizer (under the modes: its states are fake or on the device) ---------------------

    def build_optimizer(self) -> _Optim:
        rec = self.opts.recipe
        master: MasterWeights | None = None
        if rec.master_bits:
            master = MasterWeights(self.trainable, self.fns.make_optimizer)
            self.tr.mark(master.master, tk.MASTER)
            optimizer: Any = master.inner
        else:
            optimizer = self.fns.make_optimizer(self.trainable)
        return _Optim(
            optimizer=optimizer,
            master=master,
            scaler=FakeSafeGradScaler(self.ex.device) if rec.loss_scaling else None,
            params=master.master if master is not None else self.trainable,
            host_keys=host_state_keys(optimizer),
        )

    # -- stage 4: one forward/backward pass ----------------------------------------------------------------

    def forward(self, batch: Any, m: PassMarks, label: str) -> None:
        tr, fns = self.tr, self.fns
        with self.phase(tk.FORWARD, label):
            m.fwd_start = self.now(Mark.FORWARD_START)
            with self.autocast():
                out = fns.forward(self.model, batch)
                if self.opts.head_module is None:  # logits/loss backward ends when the output's grad is ready
                    for y in tk.storages_of([out]):
                        if y.requires_grad:
                            y.register_hook(self._head_bwd_done)  # type: ignore[no-untyped-call]
                tr.head_depth = 1
                loss = fns.loss_of(out, batch)
            if self.opts.grad_accum > 1:  # the Trainer divides each micro-step's loss
                loss = loss / self.opts.grad_accum
            tr.head_depth = 0
            tr.mark([t for t in tk.storages_of([out]) if t is not loss], tk.LOGITS, only_unmarked=True)
            del out
            m.fwd_end = self.now(Mark.FORWARD_END)
            tr.forward_end[self.passes] = tr.t if self.ex.probe is None else m.fwd_end
        self.loss = loss

    def backward(self, m: PassMarks, label: str, optim: _Optim) -> None:
        loss, self.loss = self.loss, None
        assert loss is not None
        with self.phase(tk.BACKWARD, label):
            self.tr.bwd_head = True
            m.bwd_start = self.now(Mark.BACKWARD_START)
            run_backward(optim.scaler.scale(loss) if optim.scaler is not None else loss)
            del loss
            self.tr.bwd_head = False
            m.bwd_end = self.now(Mark.BACKWARD_END)

    # -- stage 5: the optimizer step -------------------------------------------------------------------------

    def optimizer_step(self, sm: StepMarks, optim: _Optim) -> None:
        tr = self.tr
        with self.phase(tk.OPTIMIZER, str(sm.step)):
            sm.opt_start = self.now(Mark.OPTIMIZER_START)
            tr.mark([p.grad for p in self.trainable], tk.GRAD)
            if optim.master is not None:
                tr.mark(optim.master.grads_to_master(), tk.GRAD)
            if optim.scaler is not None:
                optim.scaler.unscale_(optim.optimizer)
            if self.opts.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(
                    [p for p in optim.params if p.grad is not None], self.opts.max_grad_norm, foreach=True
                )
            if optim.scaler is not None:
                optim.scaler.step(optim.optimizer)
                optim.scaler.update()
            else:
                optim.optimizer.step()
            if optim.master is not None:
                optim.master.master_to_model()
            for key, t in state_tensors(optim.optimizer):
                tr.mark([t], tk.HOST if key in optim.host_keys else tk.OPT)
            if optim.master is not None:
                optim.master.zero_grad(set_to_none=True)
            else:
                optim.optimizer.zero_grad(set_to_none=True)
            sm.opt_end = self.now(Mark.OPTIMIZER_END)
        tr.phase = tk.SETUP

    # -- the loop ------------------------------------------------------------------------------------------------

    def _say(self, step: int, micro: int, n: int, what: str, frac: float) -> None:
        progress = self.opts.progress
        if progress is None:
            return
        steps = self.opts.steps
        where = f"step {step + 1}/{steps}" + (f", micro-step {micro + 1}/{n}" if n > 1 else "")
        progress(f"{where}: {what}", (step + frac) / steps)

    def run(self) -> TraceRun:
        self.install_hooks()
        tr = self.tr
        try:
            with contextlib.ExitStack() as ctx:
                self.enter_modes(ctx)
                optim = self.build_optimizer()
                for step in range(self.opts.steps):
                    sm = StepMarks(step=step)
                    self.timeline.steps.append(sm)
                    n = self.opts.passes(step)
                    for micro in range(n):
                        m = self.cur = PassMarks()
                        sm.passes.append(m)
                        label = str(step) if micro == 0 else f"{step}.{micro}"
                        tr.step = self.passes
                        tr.phase = tk.SETUP
                        batch = self.fns.make_batch()
                        if self.opts.before_pass is not None:
                            self.opts.before_pass(micro, n)
                        self._say(step, micro, n, "forward", 0.8 * micro / n)
                        self.forward(batch, m, label)
                        self._say(step, micro, n, "backward", 0.8 * (micro + 0.5) / n)
                        self.backward(m, label, optim)
                        self.passes += 1
                    self._say(step, n - 1, n, "optimizer", 0.8)
                    self.optimizer_step(sm, optim)
                del batch
        except (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException) as exc:
            raise _translate(exc) from None
        finally:
            for h in self.handles:
                h.remove()
            self.handles.clear()
        return TraceRun(
            tracker=tr,
            timeline=self.timeline,
            params=sum(p.numel() for p in self.params),
            trainable_params=sum(p.numel() for p in self.trainable),
            sdpa_backends=dict(self.kernels.sdpa_calls),
            notes=[],
        )
