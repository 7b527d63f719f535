"""Several training runs in one process: what an earlier run leaves reserved for the next.

A run that ends (its tensors freed, then ``torch.cuda.empty_cache()``) does not give all its memory back. The
cuBLAS and cuBLASLt workspaces belong to the thread's handle, not to the run (``CublasHandlePool.cpp`` keeps them
for the life of the process), so ``empty_cache`` — which releases only segments with no block in use
(``release_cached_blocks``) — cannot release the segment a workspace was carved from. The autograd thread's
cuBLAS workspace is made at the first backward matmul, when the cache is full of logits-sized blocks: on the
H200 (``shared/gpu-truth``: qwen2.5-0.5b, the first case of the measuring process) it sits 259 MiB into a
4748 MiB segment, and every later case of that process starts with that segment reserved, part of its free
space usable. Later runs make no new workspaces (the same threads, the same handles).

:func:`simulate_process` replays that: each run's events in turn through one :class:`Simulator`, the keys a
stream gives its workspaces (negative, :func:`trainfit.allocator.workspaces.workspace_key`) allocated once per
process, everything else freed at the end of a run, then ``empty_cache``; each run's peaks counted from its
start (the measuring script resets the peak statistics per phase). A user's own job is one run in a fresh
process, which is what ``trainfit estimate`` predicts; this module is for comparing with measurements taken the
way ``measure_training.py`` takes them, and for notebooks that train one model after another.

How the model was built matters too. Both measuring scripts build it with ``from_config`` under
``torch.device("cuda")``: a model whose LM head is tied to its token table first allocates the head's own weight
(its module is built after the layers and the final norm), then ``post_init`` ties it and that weight is freed —
a table-sized block left free in its own segment before training starts (H200 snapshots of 2026-12-04:
llama-3.2-1b 525,336,576 B, bert-large 125,018,112 B, each allocated and freed at once after the parameters).
Fed the traced events of llama-3.2-1b (pure bf16, full checkpointing, 4×2048) with that block and the warm-up's
workspace, the simulation gives 24.857 GiB against 24.855 measured; without them 21.05: the free block takes
the first forward's 128 MiB activations that would otherwise have had segments of their own, the optimizer
states made in step 1 then find fewer small holes, spill into a second logits segment and step 2 needs a fifth.
:func:`built_on_device` inserts that block into a run's events. ``from_pretrained`` (weights materialised from
a checkpoint, the tie made before) and a model moved with ``.to("cuda")`` allocate no such block, which is why
``trainfit estimate`` leaves it out unless told otherwise.

:class:`ProcessStart` is the same history for one run at a time: it seeds a fresh :class:`Simulator` with the
warm-up and the earlier runs (torn down, ``empty_cache``, peaks reset) and gives the run's own events as they then
run (the tied head's block inserted, the workspaces already made left out), so ``simulate(..., setup=)`` answers
with everything a fresh run's simulation has (a capacity, the layout at the peak). ``trainfit estimate --build
on-device --warm-up --after ...`` (:mod:`trainfit.history`) replays its run that way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from trainfit.allocator.config import AllocatorConfig
from trainfit.allocator.simulator import Event, Op, Simulator
from trainfit.allocator.workspaces import Thread, Workspace, WorkspaceKind, workspace_key


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessRun:
    """One run of a process simulation (bytes)."""

    #: Reserved when the run started: what the runs before it (and the warm-up) left.
    start_reserved_bytes: int
    #: ``max_memory_reserved`` / ``max_memory_allocated`` over the run.
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    #: Reserved after the run's teardown and ``empty_cache``: what the next run starts from.
    end_reserved_bytes: int


class _Process:
    """One process's allocator and the workspaces its threads have made (the replay both
    :func:`simulate_process` and :class:`ProcessStart` use)."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.kept: set[int] = set()
        self.base = 0

    def apply(self, events: Iterable[Event], base: int) -> None:
        sim = self.sim
        for e in events:
            if e.key < 0:
                if e.op is Op.ALLOC:
                    if e.key in self.kept:  # the handle's workspace exists already
                        continue
                    self.kept.add(e.key)
                    sim.malloc(e.key, e.size_bytes, e.stream)
                    continue
                raise ValueError(f"workspace key {e.key} freed: workspaces live as long as the process")
            sim.apply(e.op, e.key + base, e.size_bytes, e.stream)

    def next_base(self) -> int:
        self.base += 1 << 40  # no run's keys collide with an earlier one's
        return self.base

    def teardown(self) -> None:
        """The run's tensors freed, then ``empty_cache``: what the next run starts from."""
        for k in self.sim.live_keys():
            if k >= 0:
                self.sim.free(k)
        self.sim.empty_cache()


def simulate_process(
    runs: Sequence[Iterable[Event]],
    config: AllocatorConfig | None = None,
    *,
    warm_up: Iterable[Event] = (),
) -> tuple[ProcessRun, ...]:
    """Simulate ``runs`` one after another in one process (see the module docstring). ``warm_up``: events
    before the first run (the measuring script's first matmul makes the main thread's cuBLAS workspace: a
    workspace key's allocation there is the one the runs then skip). A run's non-negative keys are its own
    (renamed per run); a negative key is a workspace, allocated once."""
    sim = Simulator(config)
    proc = _Process(sim)
    proc.apply(warm_up, 0)
    out: list[ProcessRun] = []
    for run in runs:
        base = proc.next_base()
        start = sim.reserved_bytes
        sim.reset_peak_stats()
        proc.apply(run, base)
        peak_reserved, peak_allocated = sim.peak_reserved_bytes, sim.peak_allocated_bytes
        proc.teardown()
        out.append(
            ProcessRun(
                start_reserved_bytes=start,
                peak_reserved_bytes=peak_reserved,
                peak_allocated_bytes=peak_allocated,
                end_reserved_bytes=sim.reserved_bytes,
            )
        )
    return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessStart:
    """Where one run starts in its process (``trainfit.history.ProcessHistory`` resolved into events): the
    ``warm_up``'s events, the ``earlier`` runs' (each torn down and followed by ``empty_cache``, as
    :func:`simulate_process` runs them), and how the run's own model was built (``weights``, ``transient_bytes``:
    :func:`built_on_device`'s). :meth:`setup` puts a fresh :class:`Simulator` in that state with its peaks reset;
    :meth:`events` is the run's own stream as it then runs — the tied head's block inserted, the workspaces the
    process made already left out. ``simulate(start.events(run), config, setup=start.setup)`` is then the run's
    figures as :func:`simulate_process` gives them, with everything :func:`~trainfit.allocator.simulate` adds
    (a capacity, the layout at the peak)."""

    warm_up: tuple[Event, ...] = ()
    earlier: tuple[tuple[Event, ...], ...] = ()
    weights: int = 0
    transient_bytes: int = 0

    @property
    def fresh(self) -> bool:
        return not self.warm_up and not self.earlier and self.transient_bytes <= 0

    def setup(self, sim: Simulator) -> None:
        proc = _Process(sim)
        proc.apply(self.warm_up, 0)
        for run in self.earlier:
            proc.apply(run, proc.next_base())
            proc.teardown()
        sim.reset_peak_stats()

    def workspaces_made(self) -> frozenset[int]:
        """The workspace keys the process allocated before the run (its threads' handles keep them)."""
        return frozenset(e.key for evs in (self.warm_up, *self.earlier) for e in evs if e.key < 0 and e.op is Op.ALLOC)

    def events(self, run: Sequence[Event]) -> list[Event]:
        made = self.workspaces_made()
        built = built_on_device(run, weights=self.weights, transient_bytes=self.transient_bytes)
        return [e for e in built if not (e.key < 0 and e.key in made)]


def built_on_device(events: Sequence[Event], *, weights: int, transient_bytes: int) -> list[Event]:
    """``events`` of a run whose model was built on the GPU by ``from_config`` (see the module docstring): a
    ``transient_bytes`` block allocated and freed right after the first ``weights`` allocations that are not
    workspaces (the parameters: both the synthesised and the traced streams allocate them first, in module
    order). ``transient_bytes`` 0 (no tied head) returns the events unchanged."""
    out = list(events)
    if transient_bytes <= 0:
        return out
    seen = 0
    for i, e in enumerate(out):
        if e.op is Op.ALLOC and e.key >= 0:
            seen += 1
            if seen == weights:
                key = max((x.key for x in out), default=0) + 1
                out[i + 1 : i + 1] = [Event(Op.ALLOC, key, transient_bytes), Event(Op.FREE, key)]
                return out
    raise ValueError(f"the events allocate {seen} tensors, fewer than the {weights} parameters")


def matmul_warm_up(workspaces: Sequence[Workspace], n: int = 256) -> list[Event]:
    """The events of a first ``torch.ones(n, n) @ torch.ones(n, n)`` in fp32 (the measuring script's warm-up):
    its two inputs and its output, then — the first cuBLAS call of the main thread — that thread's cuBLAS
    workspace (keyed as in ``workspaces``), then the three tensors freed."""
    nbytes = 4 * n * n
    out = [Event(Op.ALLOC, k, nbytes) for k in range(3)]
    for k, ws in enumerate(workspaces):
        if ws.thread is Thread.MAIN and ws.kind is WorkspaceKind.CUBLAS:
            out.append(Event(Op.ALLOC, workspace_key(k), ws.size_bytes, ws.stream))
            break
    out += [Event(Op.FREE, k) for k in range(3)]
    return out
