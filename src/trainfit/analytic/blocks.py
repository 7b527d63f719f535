"""What ``torch.cuda.max_memory_allocated`` counts beyond the tensors: the caching allocator's blocks, per phase.

The closed form counts every tensor's request rounded up to 512 B (``round_size``; ``allocator_bytes`` in
:mod:`trainfit.cuda_facts`). ``max_memory_allocated`` counts the *blocks* handed out (``stats.allocated_bytes`` grows by
``block->size`` in ``DeviceCachingAllocator::malloc``, c10/cuda/CUDACachingAllocator.cpp), and a block is larger than
its request in two cases, both decided by the allocator's state, not by the tensor alone:

* a large-pool request (> 1 MiB) served from a cached free block whose remainder is not over 1 MiB keeps the whole
  block (``should_split``: ``remaining > kSmallSize`` for the large pool; the small pool and expandable segments
  split any remainder of ≥ 512 B), and a new segment of a request of 10 MiB or more is the request rounded up to
  2 MiB (``get_allocation_size``, ``kRoundLarge``), kept whole by the same rule;
* with ``roundup_power2_divisions`` the request itself rounds to the next division (``round_size``).

Which cached blocks are free when a request comes depends on everything freed before it, so this is not a factor on
the peak and cannot be a per-tensor closed form: a 1.18 MB BERT-base projection gradient lands in a cached 2 MiB block
and takes all of it, or in a 20 MiB segment and takes its size. It is read from the allocator simulation
(:class:`~trainfit.allocator.Simulator`) of the analytic model's own event stream
(:func:`~trainfit.analytic.events.synthesise`, the one the reserve comes from, in the same pass:
:func:`simulate_with_rounding`), with a mark at each phase's start:
per phase of the steady-state steps (every step after the first, which creates the optimizer's states), the largest
block total less the largest request total, both over the phase, exactly as ``--method measure`` takes its rounding
from a device (:mod:`trainfit.measure.gpu`: allocated peak minus requested peak). The closed form adds it to its
phase as :attr:`~trainfit.result.Component.ALLOCATOR_ROUNDING`.

Where it matters: models with many tensors just over 1 MiB, such as BERT-base's 768×768 projections (1.18 MB in
bf16), their gradients and Adam states: on the H200 the bf16 BERT-base optimizer step measured 989.7 MB against
944.4 MB of requests (−4.6%); the stream's blocks give 988.1 MB (docs/accuracy.md). Models whose large tensors are
multiples of 2 MiB (Llama 3's) have almost none; a tensor of 10 MiB or more that gets a segment of its own keeps up to
1 MiB more (qwen2.5-7b's 129.5 MiB MLP matrices, pure bf16, full checkpointing: +124.5 MiB at the backward peak).
Expandable segments split every remainder: none there, as measured (the H200's q05 case: −0.23% by default, −0.00%
with expandable segments).

A fresh process; a many-GPU rank's stream is marked too (:class:`PhaseMarking` mixed into its hooks, :func:`marked`;
:func:`trainfit.analytic.rank_events.simulate_rank_with_rounding`; not a Megatron stage's). A process history
(``estimate(history=)``) moves which blocks are cached but is not replayed here. Under the optimizer
in backward the stream has no separate optimizer step (the hooks step each gradient): its rounding is in backward's.
"""

from __future__ import annotations

from trainfit._memo import Memo, spec_key
from trainfit.allocator import AllocatorConfig, AllocatorResult, Simulator
from trainfit.allocator.workspaces import Workspace
from trainfit.analytic.events import (
    RankHooks,
    Stream,
    simulation_memo,
    steady_state,
    stream_strategy,
    synthesise,
)
from trainfit.arch.spec import ModelSpec
from trainfit.result import Phase
from trainfit.strategy import Strategy

__all__ = ["PhaseMarking", "PhaseRounding", "marked", "phase_rounding", "simulate_with_rounding"]

#: Per phase: the block bytes above the requests at that phase's peak, steady state.
PhaseRounding = tuple[tuple[Phase, int], ...]


class PhaseMarking:
    """Hooks that mark each phase's start, mixed in before a :class:`RankHooks` (one GPU's defaults, or a many-GPU
    rank's: :func:`marked`): every micro-step's forward (before its inputs), its backward (after the loss) and the
    optimizer step (its temporaries; a rank that writes its step's events from ``step_temp_bytes`` writes them after
    the mark); at each mark the phase that ends gets its block peak less its request peak — the simulator's window
    since the last mark (``Simulator.window_allocated_bytes``/``window_requested_bytes``, kept beside its own peaks,
    which stay the run's result) — and the window restarts. Each hook then does what the rank's own does."""

    _sim: Simulator
    _phase: Phase | None
    _step: int
    rounding: dict[Phase, int]

    def start_marks(self, sim: Simulator) -> None:
        self._sim = sim
        self._phase = None
        self._step = 0
        self.rounding = dict.fromkeys(Phase, 0)

    def mark(self, phase: Phase | None, *, new_step: bool = False) -> None:
        """``phase`` starts (None: the stream ended); ``new_step``: with the first micro-step of a step."""
        sim = self._sim
        if self._phase is not None:
            if self._step >= 1:  # the steady state: the optimizer's states exist
                extra = sim.window_allocated_bytes - sim.window_requested_bytes
                self.rounding[self._phase] = max(self.rounding[self._phase], extra)
            self._step += new_step
        self._phase = phase
        sim.start_window()

    def micro_step_begin(self, s: Stream, micro: int) -> None:
        self.mark(Phase.FORWARD, new_step=micro == 0)
        super().micro_step_begin(s, micro)  # type: ignore[misc]

    def backward_begin(self, s: Stream) -> None:
        self.mark(Phase.BACKWARD)
        super().backward_begin(s)  # type: ignore[misc]

    def step_temp_bytes(self, default: int) -> int:
        self.mark(Phase.OPTIMIZER_STEP)
        out: int = super().step_temp_bytes(default)  # type: ignore[misc]
        return out


class _PhaseMarks(PhaseMarking, RankHooks):
    """One GPU's hooks (:class:`RankHooks`' defaults: the stream is the one GPU's, call for call), marked."""

    def __init__(self, sim: Simulator) -> None:
        self.start_marks(sim)


_MARKED: dict[type[RankHooks], type[RankHooks]] = {}


def marked(hooks: RankHooks, sim: Simulator) -> PhaseMarking:
    """``hooks`` (a many-GPU rank's: FSDP2, DDP, ZeRO, DTensor TP) with :class:`PhaseMarking` mixed in: the same
    object, its class swapped for a subclass that marks each phase's start on ``sim`` and otherwise behaves as it."""
    base = type(hooks)
    cls = _MARKED.get(base)
    if cls is None:
        cls = _MARKED[base] = type(f"Marked{base.__name__}", (PhaseMarking, base), {})
    hooks.__class__ = cls
    assert isinstance(hooks, PhaseMarking)
    hooks.start_marks(sim)
    return hooks


_MEMO: Memo[tuple[AllocatorResult, PhaseRounding]] = Memo(256)


def simulate_with_rounding(
    spec: ModelSpec,
    strategy: Strategy,
    config: AllocatorConfig | None = None,
    workspaces: tuple[Workspace, ...] = (),
    *,
    stop_above_bytes: int | None = None,
) -> tuple[AllocatorResult, dict[Phase, int]]:
    """One pass of the allocator simulation over the analytic stream for both: the run
    :func:`~trainfit.analytic.events.simulate_training` gives (the same calls, the same result; a whole run is also
    left in that function's memo) and each phase's rounding (:func:`phase_rounding`). ``stop_above_bytes``: as
    ``simulate_training``'s, a run that stops once reserved passes it (``AllocatorResult.stopped``; its rounding, like
    its reserve, then a lower bound), answered by the whole run when one is kept. Memoised."""
    strategy = stream_strategy(spec, strategy)
    config = config or AllocatorConfig()
    key = (spec_key(spec), strategy, config, workspaces)
    whole = _MEMO.peek(key)
    if whole is None and stop_above_bytes is not None:
        part = _MEMO.get(
            (*key, "stop above", stop_above_bytes),
            lambda: _simulate(spec, strategy, config, workspaces, stop_above_bytes),
        )
        if part[0].stopped:
            return part[0], dict(part[1])
        _MEMO.put(key, part)
        whole = part
    if whole is None:
        whole = _MEMO.get(key, lambda: _simulate(spec, strategy, config, workspaces, None))
    simulation_memo().put(
        (*key, False), whole[0]
    )  # simulate_training's key: (spec, strategy, config, workspaces, layout)
    return whole[0], dict(whole[1])


def phase_rounding(
    spec: ModelSpec,
    strategy: Strategy,
    config: AllocatorConfig | None = None,
    workspaces: tuple[Workspace, ...] = (),
) -> dict[Phase, int]:
    """The bytes ``max_memory_allocated`` counts above the 512-byte-rounded requests at each phase's peak, for one GPU
    (see the module docstring): the allocator simulation of the analytic stream under ``config`` with ``workspaces``,
    each phase's block peak less its request peak, the largest over the steady-state steps. Memoised."""
    return simulate_with_rounding(spec, strategy, config, workspaces)[1]


def _simulate(
    spec: ModelSpec,
    strategy: Strategy,
    config: AllocatorConfig,
    workspaces: tuple[Workspace, ...],
    stop_above_bytes: int | None,
) -> tuple[AllocatorResult, PhaseRounding]:
    sim = Simulator(config, stop_above_bytes=stop_above_bytes)
    marks = _PhaseMarks(sim)
    stop = steady_state(sim, None)  # the steps after a repeated one repeat it: their peaks add nothing
    oom = sim.drive(lambda _: synthesise(Stream(sim), spec, strategy, workspaces, rank=marks, stop=stop))
    marks.mark(None)
    return sim.result(oom=oom), tuple(marks.rounding.items())
