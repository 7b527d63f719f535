"""The traced training loop: real steps on fake tensors, with phase and region marks on the timeline.

One step is what the Hugging Face Trainer does in ``training_step`` (and what a hand-written loop does):
build the batch; under autocast run the forward pass and the loss; drop the outputs, keeping the loss;
``backward`` (through a GradScaler for fp16); then ``optimizer.step()`` after unscaling and clipping the
gradient norm (``max_grad_norm=1.0`` is the Trainer default), and ``zero_grad(set_to_none=True)``. We run
at least two steps and read phases from step 2 onwards, when optimizer states exist and the previous
step's gradients have been freed — the steady state. Everything runs under ``FakeTensorMode`` (no memory
is allocated), the live-storage :class:`~trainfit.trace.tracker.Tracker`, the CUDA kernel emulation and,
for the amp recipes, CUDA's autocast policy.

Marks recorded per step: start/end of each phase; for depth extrapolation the forward entry of the first
layer of every *unit* of the layer stack and the backward moment the gradient of every unit's output is
ready (a tensor hook), so the timeline can be cut into pre-stack, per-unit and post-stack regions.
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

from trainfit.errors import TraceUnsupportedError, TrainfitError
from trainfit.result import Component, Phase
from trainfit.strategy import Recipe
from trainfit.trace import tracker as tk
from trainfit.trace.autocast import cuda_autocast_policy
from trainfit.trace.kernels import CudaKernels
from trainfit.trace.optim import FakeSafeGradScaler, MasterWeights, host_state_keys, state_tensors

#: Hugging Face Trainer default ``max_grad_norm``.
DEFAULT_MAX_GRAD_NORM = 1.0

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def compute_dtype(recipe: Recipe) -> torch.dtype:
    return _DTYPES[recipe.compute_dtype]


def weight_dtype(recipe: Recipe) -> torch.dtype:
    return torch.float32 if recipe.weight_bits == 32 else compute_dtype(recipe)


@dataclass
class StepMarks:
    fwd_start: int = 0
    fwd_end: int = 0
    bwd_start: int = 0
    bwd_end: int = 0
    opt_start: int = 0
    opt_end: int = 0
    unit_fwd: list[int] = field(default_factory=list)  # forward entry of unit u
    stack_fwd_end: int = -1  # forward exit of the last stack layer
    unit_bwd: list[int] = field(default_factory=list)  # grad of unit u's output ready
    stack_bwd_end: int = -1  # grad of the stack input ready


@dataclass
class TraceRun:
    tracker: tk.Tracker
    marks: list[StepMarks]
    params: int
    trainable_params: int
    sdpa_backends: dict[str, int]
    notes: list[str] = field(default_factory=list)


@dataclass
class StackHooks:
    """The layer stack cut into units, for region marks (empty when not extrapolating)."""

    layers: Sequence[torch.nn.Module] = ()
    unit_first: Sequence[int] = ()  # index into layers of each unit's first layer
    unit_last: Sequence[int] = ()  # index of each unit's last layer


def fake_mode() -> FakeTensorMode:
    return FakeTensorMode(allow_non_fake_inputs=False)


def materialize(
    model: torch.nn.Module, mode: FakeTensorMode | None, dtype: torch.dtype | None, device: str = "cpu"
) -> torch.nn.Module:
    """Replace every parameter and buffer (meta or real) with a fake CPU tensor of the same shape, keeping
    shared (tied) tensors shared; floating parameters and buffers take ``dtype`` when given (what
    ``model.to(dtype)`` would do, which fake parameters refuse). ``mode=None`` makes real (zeroed) CPU
    tensors instead, for cross-checking the fake trace against real execution in tests."""
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


@contextlib.contextmanager
def _module_stack(tr: tk.Tracker, model: torch.nn.Module) -> Iterator[None]:
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


def _hook_outputs(out: Any, fn: Callable[[torch.Tensor], None]) -> None:
    for y in tk.storages_of([out]):
        if y.requires_grad:
            y.register_hook(fn)  # type: ignore[no-untyped-call]


def run_backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` without passing through ``__torch_function__``: a TorchFunctionMode is popped
    while it handles a call, so a backward entered through it would run (and recompute checkpoints)
    without the CUDA kernel emulation."""
    grad = torch.ones_like(loss, memory_format=torch.preserve_format)
    torch.autograd.graph._engine_run_backward(
        (loss,), (grad,), False, False, (), allow_unreachable=True, accumulate_grad=True
    )


def _translate(exc: Exception) -> TraceUnsupportedError:
    func = getattr(exc, "func", None)
    op = str(func) if func is not None else type(exc).__name__
    return TraceUnsupportedError(
        f"the model runs {op}, whose output depends on tensor values, which fake tensors cannot trace "
        "(e.g. data-dependent shapes or a host sync); use --method analytic for this model"
    )


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
    head_module: torch.nn.Module | None = None,
    stack: StackHooks | None = None,
    max_grad_norm: float | None = DEFAULT_MAX_GRAD_NORM,
    progress: Callable[[str, float], None] | None = None,
    prepare: Callable[[tk.Tracker], None] | None = None,
    emulate_cuda: bool = True,
    track: bool = True,
    annotate: bool = False,
    device: str = "cpu",
    probe: Callable[[str], int] | None = None,
) -> TraceRun:
    """Run ``steps`` training steps of ``model`` (already materialised on fake tensors) and record them.

    ``emulate_cuda=False`` keeps PyTorch's CPU behaviour (CPU autocast lists, CPU SDPA and dropout);
    ``track=False`` runs without the tracker and ``annotate=True`` wraps each phase in a profiler
    ``record_function("trainfit:<step>:<phase>")`` — together they let tests measure a real CPU run with
    ``torch.profiler(profile_memory=True)`` as ground truth for the tracker. ``device="cuda"`` with
    ``probe`` runs the same steps on a GPU (``trainfit.measure``): every mark calls ``probe(label)``, whose
    return value stands in for the tracker's event number."""
    if steps < 2:
        raise TrainfitError("trace needs at least 2 steps (step 1 creates the optimizer states)")
    tr = tk.Tracker()
    if prepare is not None:
        prepare(tr)

    def now(label: str) -> int:
        return probe(label) if probe is not None else tr.t

    marks = [StepMarks() for _ in range(steps)]
    stack = stack or StackHooks()
    params = [p for p in model.parameters()]
    trainable = [p for p in params if p.requires_grad]
    tr.mark(params, tk.WEIGHTS)
    tr.mark(model.buffers(), tk.WEIGHTS)
    kernels = CudaKernels()
    handles: list[Any] = []
    cur: dict[str, Any] = {"marks": marks[0]}

    def on_grad(p: torch.Tensor) -> None:
        tr.mark([p.grad], tk.GRAD)

    for p in trainable:
        handles.append(p.register_post_accumulate_grad_hook(on_grad))  # type: ignore[no-untyped-call]

    # Head region: from the head module's forward entry to the end of the root forward, and in backward
    # until the gradient of the head's input is ready.
    def head_pre(_m: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if tr.phase != tk.FORWARD:
            return
        tr.head_depth = 1
        x = _first_tensor(args) if args else _first_tensor(list(kwargs.values()))
        if x is not None and x.requires_grad:
            x.register_hook(_head_bwd_done)  # type: ignore[no-untyped-call]

    def _head_bwd_done(g: torch.Tensor) -> None:
        tr.bwd_head = False

    if head_module is not None:
        handles.append(head_module.register_forward_pre_hook(head_pre, with_kwargs=True))

    # Unit boundaries of the layer stack.
    first_of = {i: u for u, i in enumerate(stack.unit_first)}
    last_of = {i: u for u, i in enumerate(stack.unit_last)}
    for idx, layer in enumerate(stack.layers):
        if idx in first_of or idx == 0:

            def pre(_m: torch.nn.Module, args: Any, kwargs: Any, idx: int = idx) -> None:
                if tr.phase != tk.FORWARD:
                    return
                m: StepMarks = cur["marks"]
                if idx in first_of:
                    m.unit_fwd.append(now("unit_fwd"))
                if idx == 0:
                    x = _first_tensor(args) if args else _first_tensor(list(kwargs.values()))
                    if x is not None and x.requires_grad:
                        x.register_hook(lambda g, m=m: setattr(m, "stack_bwd_end", now("stack_bwd_end")))  # type: ignore[no-untyped-call]

            handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        if idx in last_of:

            def post(_m: torch.nn.Module, _a: Any, out: Any, idx: int = idx) -> None:
                if tr.phase != tk.FORWARD:
                    return
                m: StepMarks = cur["marks"]
                y = _first_tensor(out)
                if y is not None and y.requires_grad:

                    def ready(_g: torch.Tensor, m: StepMarks = m) -> None:
                        m.unit_bwd.append(now("unit_bwd"))

                    y.register_hook(ready)  # type: ignore[no-untyped-call]
                if idx == len(stack.layers) - 1:
                    m.stack_fwd_end = now("stack_fwd_end")

            handles.append(layer.register_forward_hook(post))

    autocast_ctx: Callable[[], contextlib.AbstractContextManager[Any]]
    if recipe.autocast:
        dt = compute_dtype(recipe)

        def autocast_ctx() -> contextlib.AbstractContextManager[Any]:
            return torch.autocast(device, dtype=dt)
    else:
        autocast_ctx = contextlib.nullcontext

    notes: list[str] = []
    try:
        with contextlib.ExitStack() as stack_ctx:
            if mode is not None:
                stack_ctx.enter_context(mode)
            if recipe.autocast and emulate_cuda:
                stack_ctx.enter_context(cuda_autocast_policy())
            if emulate_cuda:
                stack_ctx.enter_context(kernels)
            if track:
                stack_ctx.enter_context(tr)
            stack_ctx.enter_context(_module_stack(tr, model))

            master: MasterWeights | None = None
            if recipe.master_bits:
                master = MasterWeights(trainable, make_optimizer)
                tr.mark(master.master, tk.MASTER)
                optimizer: Any = master.inner
            else:
                optimizer = make_optimizer(trainable)
            scaler = FakeSafeGradScaler(device) if recipe.loss_scaling else None
            opt_params = master.master if master is not None else trainable
            host_keys = host_state_keys(optimizer)

            def phase(name: str, step: int) -> contextlib.AbstractContextManager[Any]:
                tr.phase = name
                if annotate:
                    return torch.profiler.record_function(f"trainfit:{step}:{name}")
                return contextlib.nullcontext()

            for step in range(steps):
                m = marks[step]
                cur["marks"] = m
                tr.step = step
                tr.phase = tk.SETUP
                batch = make_batch()
                if progress:
                    progress(f"step {step + 1}/{steps}: forward", step / steps)
                with phase(tk.FORWARD, step):
                    m.fwd_start = now("fwd_start")
                    with autocast_ctx():
                        out = forward(model, batch)
                        if head_module is None:  # logits/loss backward ends when the output's grad is ready
                            _hook_outputs(out, _head_bwd_done)
                        tr.head_depth = 1
                        loss = loss_of(out, batch)
                    tr.head_depth = 0
                    tr.mark([t for t in tk.storages_of([out]) if t is not loss], tk.LOGITS, only_unmarked=True)
                    del out
                    m.fwd_end = now("fwd_end")
                    tr.forward_end[step] = tr.t if probe is None else m.fwd_end

                if progress:
                    progress(f"step {step + 1}/{steps}: backward", (step + 0.4) / steps)
                with phase(tk.BACKWARD, step):
                    tr.bwd_head = True
                    m.bwd_start = now("bwd_start")
                    run_backward(scaler.scale(loss) if scaler is not None else loss)
                    del loss
                    tr.bwd_head = False
                    m.bwd_end = now("bwd_end")

                if progress:
                    progress(f"step {step + 1}/{steps}: optimizer", (step + 0.8) / steps)
                with phase(tk.OPTIMIZER, step):
                    m.opt_start = now("opt_start")
                    tr.mark([p.grad for p in trainable], tk.GRAD)
                    if master is not None:
                        tr.mark(master.grads_to_master(), tk.GRAD)
                    if scaler is not None:
                        scaler.unscale_(optimizer)
                    if max_grad_norm is not None:
                        torch.nn.utils.clip_grad_norm_(
                            [p for p in opt_params if p.grad is not None], max_grad_norm, foreach=True
                        )
                    if scaler is not None:
                        scaler.step(optimizer)
                        scaler.update()
                    else:
                        optimizer.step()
                    if master is not None:
                        master.master_to_model()
                    for key, t in state_tensors(optimizer):
                        tr.mark([t], tk.HOST if key in host_keys else tk.OPT)
                    if master is not None:
                        master.zero_grad(set_to_none=True)
                    else:
                        optimizer.zero_grad(set_to_none=True)
                    m.opt_end = now("opt_end")
                tr.phase = tk.SETUP
            del batch
    except (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException) as exc:
        raise _translate(exc) from None
    finally:
        for h in handles:
            h.remove()
    n_params = sum(p.numel() for p in params)
    return TraceRun(
        tracker=tr,
        marks=marks,
        params=n_params,
        trainable_params=sum(p.numel() for p in trainable),
        sdpa_backends=dict(kernels.sdpa_calls),
        notes=notes,
    )


# -- reading the timeline -------------------------------------------------------------------------------


def phase_intervals(run: TraceRun, first_step: int = 1) -> list[tk.Interval]:
    out = []
    for s, m in enumerate(run.marks):
        if s < first_step:
            continue
        out += [
            tk.Interval(f"{s}:{Phase.FORWARD.value}", m.fwd_start, m.fwd_end),
            tk.Interval(f"{s}:{Phase.BACKWARD.value}", m.bwd_start, m.bwd_end),
            tk.Interval(f"{s}:{Phase.OPTIMIZER_STEP.value}", m.opt_start, m.opt_end),
        ]
    return out


def phase_peaks(run: TraceRun, first_step: int = 1) -> dict[Phase, tk.Peak]:
    """Per phase, the worst moment over steps ``first_step..``."""
    best: dict[Phase, tk.Peak] = {}
    for pk in run.tracker.peaks(phase_intervals(run, first_step)):
        ph = Phase(pk.label.split(":", 1)[1])
        if ph not in best or pk.total_bytes > best[ph].total_bytes:
            best[ph] = pk
    return best


def region_intervals(run: TraceRun, first_step: int = 1) -> list[tk.Interval]:
    """Pre-stack, per-unit and post-stack slices of each phase (labels ``step:phase:region``)."""
    out: list[tk.Interval] = []
    for s, m in enumerate(run.marks):
        if s < first_step:
            continue
        fwd, bwd = Phase.FORWARD.value, Phase.BACKWARD.value
        k = len(m.unit_fwd)
        if k:
            out.append(tk.Interval(f"{s}:{fwd}:pre", m.fwd_start, m.unit_fwd[0]))
            for u in range(k):
                end = m.unit_fwd[u + 1] if u + 1 < k else m.stack_fwd_end
                out.append(tk.Interval(f"{s}:{fwd}:unit{u}", m.unit_fwd[u], end))
            out.append(tk.Interval(f"{s}:{fwd}:post", m.stack_fwd_end, m.fwd_end))
        else:
            out.append(tk.Interval(f"{s}:{fwd}:all", m.fwd_start, m.fwd_end))
        kb = len(m.unit_bwd)
        if kb and m.stack_bwd_end >= 0:
            # unit_bwd is in backward order: last unit first.
            out.append(tk.Interval(f"{s}:{bwd}:post", m.bwd_start, m.unit_bwd[0]))
            for j in range(kb):
                u = kb - 1 - j
                end = m.unit_bwd[j + 1] if j + 1 < kb else m.stack_bwd_end
                out.append(tk.Interval(f"{s}:{bwd}:unit{u}", m.unit_bwd[j], end))
            out.append(tk.Interval(f"{s}:{bwd}:pre", m.stack_bwd_end, m.bwd_end))
        else:
            out.append(tk.Interval(f"{s}:{bwd}:all", m.bwd_start, m.bwd_end))
        out.append(tk.Interval(f"{s}:{Phase.OPTIMIZER_STEP.value}:all", m.opt_start, m.opt_end))
    return out


def region_peaks(run: TraceRun, first_step: int = 1) -> dict[tuple[Phase, str], tk.Peak]:
    """Per (phase, region), the worst moment over steps ``first_step..``."""
    best: dict[tuple[Phase, str], tk.Peak] = {}
    for pk in run.tracker.peaks(region_intervals(run, first_step)):
        _, ph, region = pk.label.split(":", 2)
        key = (Phase(ph), region)
        if key not in best or pk.total_bytes > best[key].total_bytes:
            best[key] = pk
    return best


def module_activations(run: TraceRun, event: int) -> dict[str, int]:
    """Saved-activation bytes alive at ``event``, by the module that created them."""
    tr = run.tracker
    out: dict[str, int] = {}
    for rec in tr.live_at(event):
        if tr.component(rec) is Component.ACTIVATIONS:
            out[rec.owner] = out.get(rec.owner, 0) + rec.nbytes
    return out
