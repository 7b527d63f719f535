"""``trainfit plan``: the ranked search (best-first, checked by the estimate itself).

Every candidate's memory is :func:`trainfit.estimate.estimate` of the very Strategy the plan prints, on the
GPU, with the headroom (``search_micro_batch=False``: the planner bisects the micro-batch itself), so a plan
fits exactly when ``trainfit estimate`` with those flags says it fits — without cache flushes: the estimate's
``fits-with-flushes`` tier is not a fit here (those estimates skip the capped simulation; docs/plan.md).

Speed is cheap (:mod:`trainfit.planner.speed`, microseconds) and memory is not (milliseconds), so the search
is best-first: for each candidate, the best step time over the micro-batches that hit the global batch is a
lower bound on what it can achieve; candidates are visited in order of that bound and the search stops once
``top`` plans are found and the next bound is worse than the last of them. For a visited candidate, the
micro-batch is bisected over the divisors (memory grows with the micro-batch: a property test holds the
analytic model to it), and the best micro-batch among those that fit is kept. When nothing fits, the
candidate that comes closest (least memory above the usable bytes at micro-batch 1, by the estimate: the
candidates a bound ruled out are estimated smallest bound first, until no bound can beat the best) is
reported with what would make it fit.

A memory saver never makes a step faster than the same plan without it (:meth:`~trainfit.planner.space.
Candidate.twin`): a saver's plan is dropped when its twin, or for a combination of savers any subset of them
(:meth:`~trainfit.planner.space.Candidate.fewer_savers`), fits at the same micro-batch (that candidate, one of its
own, is then at least as good), so every saver a plan prints is one the plan needs.

The caching allocator is part of the plan. Every estimate simulates the allocator the search is given (``--alloc-conf``;
default: this process's ``PYTORCH_CUDA_ALLOC_CONF``), and a strategy gets one second chance: when it does not fit
with that allocator but its lower bound (allocated peak + workspaces + what sits outside the allocator, which no
allocator setting can go below) does, and the report's reserve was simulated (``MemoryReport.reserve_simulated``:
one GPU, or a many-GPU rank ``analytic.rank_events.rank_simulated`` names — DDP, FSDP2, ZeRO, Megatron; not the
fixed fraction), it is
re-estimated with ``expandable_segments:True`` added — the check :func:`trainfit.estimate.estimate` makes for its
own suggestion. If that fits, the plan carries that allocator (:attr:`Plan.alloc_conf`) and its changes say
``PYTORCH_CUDA_ALLOC_CONF=...``. Its speed is taken as the same — an assumption: expandable segments change how
the allocator maps memory (cuMemCreate/cuMemMap of 2 MiB pages, c10/cuda/CUDACachingAllocator.cpp
``ExpandableSegment``), not the kernels; PyTorch's "CUDA memory management" notes (docs/source/notes/cuda.rst,
``expandable_segments``) present it as a fragmentation fix and state no cost either way, NVIDIA's NeMo
Megatron-Bridge memory-tuning guide calls it a fix "with zero performance cost"; the driver calls when a
segment grows are not modelled.

The GPU machine's software and the process are the estimate's too (``trainfit estimate --torch-version/--cuda-version/
--build/--warm-up/--after``): every estimate of a search gets its torch release (the cuBLAS/cuBLASLt workspaces,
:mod:`trainfit.allocator.workspaces`), its CUDA release (the context, :mod:`trainfit.overhead`) and its process
history (:mod:`trainfit.history`), and every lower bound counts the same workspaces and context (a bound for other
releases could pass the estimate it bounds). They are fixed for a search, so the search's memos, keyed by strategy
and allocator, never mix releases; the allocator simulations' own memo is keyed by the workspaces. A process history
is modelled for a plain one-GPU run only: a search over more GPUs with one is refused in one line, and on one GPU
the candidates that run a rank's stream (ZeRO, FSDP2, offload, a DeepSpeed engine) are left out with a note
(:attr:`PlanResult.notes`) — never estimated for a fresh process among plans estimated after the history.

Host memory: every plan carries its estimate's ``host_peak_bytes`` (per node). ``--host-memory-gib`` rules out the
setups whose host memory exceeds it less the headroom (:func:`host_usable_bytes`; :meth:`_Search.fits`), and without
it a note says the host was not checked when a plan offloads (docs/plan.md: no default limit is true for every host).

The baseline (``search_plans(baseline=...)``; ``trainfit plan``'s run flags, ``trainfit estimate --fixes``' own
command) is the run the user has: each plan's :attr:`Plan.changes` are its differences from it, ties between equal
bounds go to the fewest of them, and what the search does not choose comes from it (:meth:`_Search.strategy`; the
adapter's shape, :attr:`~trainfit.planner.space.Candidate.adapter`). It never narrows the space; a baseline that
fine-tunes with an adapter or trains fp8 linears opens the space to them as ``--allow`` would
(:func:`~trainfit.planner.space.baseline_allows`). Without one: :func:`default_baseline`.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass, field

from trainfit.allocator import AllocatorConfig
from trainfit.allocator.workspaces import TARGET_TORCH
from trainfit.arch.spec import ModelSpec
from trainfit.errors import StrategyError
from trainfit.hardware import GPUSpec
from trainfit.history import ProcessHistory, history_note
from trainfit.overhead import DEFAULT_CUDA
from trainfit.planner.search import largest_below, lower_bound_bytes
from trainfit.planner.space import Candidate, Finetune, Objective, baseline_method, candidates
from trainfit.planner.speed import DEFAULT_NETWORK_GBPS, StepTime, step_floor_seconds, step_time, step_time_of
from trainfit.strategy import Parallelism, Precision, Sharding, Strategy

__all__ = [
    "HISTORY_SCOPE",
    "Plan",
    "PlanResult",
    "baseline_flags",
    "check_plan_history",
    "default_baseline",
    "describe_changes",
    "host_usable_bytes",
    "search_plans",
]


def host_usable_bytes(host_memory_bytes: int, headroom: float) -> int:
    """What a plan's host memory per node may reach under ``--host-memory-gib``: the node's memory less the same
    ``--headroom`` fraction the GPU keeps free (the host estimate counts what the engines allocate — offloaded
    states, DeepSpeed's pinned buffers, offloaded activations — not the OS, the data loader's workers or the
    page cache, which the headroom stands for)."""
    return int(host_memory_bytes * (1 - headroom))


#: What a process history is modelled for (``trainfit.estimate._require_history_modelled``), as the planner says it
#: when it leaves the other candidates out.
HISTORY_SCOPE = (
    "a process history is modelled for a plain one-GPU run (ZeRO, FSDP, offload and DeepSpeed run a rank's stream, "
    "which does not take one yet)"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    candidate: Candidate
    strategy: Strategy
    required_bytes: int  # per-GPU nvidia-smi estimate from trainfit.estimate (the worst rank)
    usable_bytes: int
    speed: StepTime
    changes: tuple[str, ...]  # what differs from the baseline, as CLI flags (and PYTORCH_CUDA_ALLOC_CONF=...)
    alloc_conf: str = ""  # the PYTORCH_CUDA_ALLOC_CONF the estimate simulated ("" PyTorch's defaults)
    #: The estimate's host memory per node (``MemoryReport.host_peak_bytes``: offloaded states, pinned buffers,
    #: offloaded activations; 0 without offload) — what ``--host-memory-gib`` is held to.
    host_peak_bytes: int = 0

    @property
    def fits(self) -> bool:
        return self.required_bytes <= self.usable_bytes

    @property
    def margin_bytes(self) -> int:
        return self.usable_bytes - self.required_bytes

    @property
    def gpus(self) -> int:
        return self.strategy.world_size

    def cost_per_step(self, price_per_gpu_hour: float) -> float:
        return self.gpus * self.speed.step_seconds / 3600 * price_per_gpu_hour


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanResult:
    plans: tuple[Plan, ...]  # ranked, best first; empty when nothing fits
    closest: Plan | None  # when nothing fits: the candidate nearest to fitting (micro-batch 1)
    needs: tuple[str, ...]  # when nothing fits: what would make the closest fit
    objective: Objective
    global_batch: int
    seq_len: int
    candidates: int  # candidates in the space
    estimates: int  # memory estimates run
    price_per_gpu_hour: float = 1.0  # what --objective cheapest ranks by (Plan.cost_per_step)
    torch_version: tuple[int, int] = TARGET_TORCH  # the release whose cuBLAS/cuBLASLt workspaces every plan counts
    cuda_version: tuple[int, int] = DEFAULT_CUDA  # the release whose CUDA context every plan counts
    history: ProcessHistory = field(default_factory=ProcessHistory)  # the process every (one-GPU) plan starts in
    notes: tuple[str, ...] = ()  # what the search assumed (the process history it simulated)
    #: ``--host-memory-gib`` as bytes (None: host memory not limited) and what a plan's host peak per node may reach:
    #: that × (1 − headroom), the GPU's rule (:func:`host_usable_bytes`).
    host_memory_bytes: int | None = None
    host_usable_bytes: int | None = None
    #: The setups (candidate × micro-batch) the search found to fit the GPU but ruled out by their host memory per
    #: node, and the least host memory among them (0: none).
    host_rejected: int = 0
    host_rejected_min_bytes: int = 0
    #: What every plan's :attr:`Plan.changes` are relative to: the user's run (``trainfit plan``'s run flags), or
    #: :func:`default_baseline` (search_plans always sets it; None only for a result built by hand).
    baseline: Strategy | None = None


def default_baseline(*, gpus: int, global_batch: int, seq_len: int, gpus_per_node: int = 8) -> Strategy:
    """The setup a user starts from when none is given: trainfit's defaults (amp-bf16, fused AdamW, no
    checkpointing — ``trainfit estimate``'s), data parallel (DDP) over the largest number of the GPUs that divides
    the global batch, the whole global batch in one micro-batch per GPU. ``trainfit plan``'s run flags are laid over
    it (what they do not give stays this)."""
    data = math.gcd(gpus, global_batch)
    return Strategy(
        seq_len=seq_len,
        micro_batch=global_batch // data,
        parallelism=Parallelism.for_gpus(data, gpus_per_node=gpus_per_node),
        sharding=Sharding.DDP if data > 1 else Sharding.NONE,
    )


def describe_changes(strategy: Strategy, baseline: Strategy) -> tuple[str, ...]:
    """``strategy``'s differences from ``baseline`` as ``trainfit estimate`` flags."""
    out: list[str] = []
    if strategy.world_size != baseline.world_size:
        out.append(f"--gpus {strategy.world_size}")
    paged, was_paged = strategy.savers.paged_optimizer, baseline.savers.paged_optimizer
    for name in ("precision", "optimizer", "checkpointing", "sharding", "attention"):
        if name == "optimizer" and (strategy.optimizer != baseline.optimizer or paged != was_paged):
            # bitsandbytes' paged optimizers are named paged-*; a baseline paged by --paged-optimizer keeps paging
            # whatever --optimizer says, so a plan that does not page says so
            unpaged = " without --paged-optimizer" if was_paged and not paged else ""
            out.append(f"--optimizer {'paged-' if paged else ''}{strategy.optimizer.value}{unpaged}")
        elif name != "optimizer" and getattr(strategy, name) != getattr(baseline, name):
            out.append(f"--{name} {getattr(strategy, name).value}")
    if strategy.optimizer_impl != baseline.optimizer_impl:
        out.append(f"--optimizer-impl {strategy.optimizer_impl.value}")
    par, bpar = strategy.parallelism, baseline.parallelism
    if par.tensor != bpar.tensor:
        out.append(f"--tp {par.tensor} --sequence-parallel" if par.sequence_parallel else f"--tp {par.tensor}")
    if par.pipeline != bpar.pipeline:
        out.append(f"--pp {par.pipeline} --microbatches {par.microbatches}")
    if strategy.offload != baseline.offload:
        out.append(f"--offload {strategy.offload.flag}")
    if strategy.engine.engine != baseline.engine.engine:
        out.append(f"--engine {strategy.engine.engine.value}")
    fsdp = (Sharding.FSDP, Sharding.HSDP)
    raf = strategy.engine.reshard_after_forward
    if strategy.sharding in fsdp and raf != baseline.engine.reshard_after_forward:
        # FSDP2 only (the setting means nothing to other layouts): False keeps each layer unsharded to its backward
        out.append("--reshard-after-forward" if raf else "--no-reshard-after-forward")
    if (strategy.adapter is None) != (baseline.adapter is None) or strategy.base_weights != baseline.base_weights:
        out.append(_finetune_change(strategy, baseline))
    if strategy.float8 != baseline.float8:
        out.append(f"--fp8 {strategy.float8.value}")
    if strategy.savers.loss != baseline.savers.loss:
        out.append(f"--loss {strategy.savers.loss.value}")
    sv, bsv = strategy.savers, baseline.savers
    if sv.activation_offload and not bsv.activation_offload:
        out.append("--activation-offload")
    if sv.optimizer_in_backward and not bsv.optimizer_in_backward:
        out.append("--optimizer-in-backward")
    # a saver the baseline turned on and the plan does not use (there is no --no-… flag: drop it from the command)
    if bsv.activation_offload and not sv.activation_offload:
        out.append("without --activation-offload")
    if bsv.optimizer_in_backward and not sv.optimizer_in_backward:
        out.append("without --optimizer-in-backward")
    if strategy.micro_batch != baseline.micro_batch or strategy.grad_accum != baseline.grad_accum:
        accum = f" --grad-accum {strategy.grad_accum}" if strategy.parallelism.pipeline == 1 else ""
        out.append(f"--batch {strategy.micro_batch}{accum}")
    if (
        strategy.sharding in fsdp
        and strategy.grad_accum > 1
        and strategy.engine.sync_each_batch
        and not baseline.engine.sync_each_batch
    ):
        # the baseline's no_sync (the HF Trainer's default): the plan reduce-scatters every micro-step
        out.append("--sync-each-batch")
    return tuple(out)


def baseline_flags(baseline: Strategy) -> tuple[str, ...]:
    """A baseline as ``trainfit estimate`` flags beyond its defaults (:func:`describe_changes` from the default
    Strategy at its sequence length; an adapter's shape is in its JSON, not here)."""
    return describe_changes(baseline, Strategy(seq_len=baseline.seq_len))


def _base_flag(strategy: Strategy) -> str | None:
    """The ``--base-dtype`` a run's frozen base stands for (None: none given)."""
    b = strategy.base_weights
    return b.quantization.value if b.quantization.value != "none" else b.dtype.value if b.dtype is not None else None


def _finetune_change(strategy: Strategy, baseline: Strategy) -> str:
    """The fine-tuning method of ``strategy`` as flags that apply to the baseline's command: ``--finetune`` and,
    where the baseline gave a ``--base-dtype`` (or ``--freeze``) the plan's method does not run, what replaces it."""
    method = baseline_method(strategy)
    if method is Finetune.FULL and baseline.base_weights.frozen:  # --finetune full --freeze X is still freeze
        return "without --finetune freeze --freeze"
    out = f"--finetune {method.value}" + (" without --freeze" if baseline.base_weights.frozen else "")
    base, was = _base_flag(strategy), _base_flag(baseline)
    implied = "nf4" if method is Finetune.QLORA else None  # what --finetune qlora stores the base in by itself
    was_implied = "nf4" if baseline_method(baseline) is Finetune.QLORA else None
    if base != was:
        if base is not None and (base != implied or was not in (None, was_implied)):
            out += f" --base-dtype {base}"
        elif base is None and was is not None and was != was_implied:
            out += " without --base-dtype"
    return out


def _distance(c: Candidate, baseline: Strategy) -> int:
    """How many of the candidate's choices differ from the baseline (the tie-break between equal bounds)."""
    return sum(
        (
            c.world != baseline.world_size,
            c.precision != baseline.precision,
            c.optimizer != baseline.optimizer,
            c.checkpointing != baseline.checkpointing,
            c.sharding != baseline.sharding,
            c.tensor != baseline.parallelism.tensor,
            c.pipeline != baseline.parallelism.pipeline,
            c.offload != baseline.offload.flag,
            c.finetune is not baseline_method(baseline),
            c.float8 != baseline.float8,
            c.loss != baseline.savers.loss,
            c.activation_offload != baseline.savers.activation_offload,
            c.optimizer_in_backward != baseline.savers.optimizer_in_backward,
            c.reshard_after_forward != baseline.engine.reshard_after_forward,
        )
    )


def _candidate_layout(c: Candidate) -> tuple[object, ...]:
    """The layout a plan table tells apart: GPUs, parallel degrees, sharding, offload, checkpointing, method, fp8
    linears (fp8 changes the speed: not the same layout). Not FSDP2's ``reshard_after_forward``: like the recipe
    and the optimizer, a variant within the layout (its plan is skipped where one of the layout's is already at
    least as fast)."""
    return (c.world, c.tensor, c.pipeline, c.sharding, c.offload, c.checkpointing, c.finetune, c.float8)


def _speed_signature(c: Candidate) -> tuple[object, ...]:
    """What the speed model reads of a candidate: all but the optimizer (one bound per candidate without it)."""
    return (
        *_candidate_layout(c),
        c.engine,
        c.precision,
        c.activation_offload,  # its PCIe traffic
        c.optimizer_in_backward,  # its micro-batches (no accumulation)
        c.reshard_after_forward,  # FSDP2's all-gathers per micro-step
    )


def _layout(p: Plan) -> tuple[object, ...]:
    return (*_candidate_layout(p.candidate), p.strategy.micro_batch)


def _distinct(ranked: list[Plan], s: _Search) -> list[Plan]:
    """``ranked`` without plans that repeat an earlier one's layout at the same speed (they differ only in the
    precision recipe, the optimizer or FSDP2's ``reshard_after_forward`` — the speed model does not tell the first
    two apart, nor the last where the all-gathers hide behind compute): the first — fewest changes, then most
    margin — stands for them."""
    seen: set[tuple[object, ...]] = set()
    out: list[Plan] = []
    for p in ranked:
        sig = (*_layout(p), s.key(p.gpus, p.speed))
        if sig not in seen:
            seen.add(sig)
            out.append(p)
    return out


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, by trial division up to √n (a global batch can be huge)."""
    low = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return low + [n // k for k in reversed(low) if k * k != n]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Near:
    """A candidate that does not fit at its smallest micro-batch, and by how many bytes (a bound or the estimate)."""

    candidate: Candidate
    micro: int
    bytes: int


class _Search:
    def __init__(
        self,
        spec: ModelSpec,
        gpu: GPUSpec,
        *,
        seq_len: int,
        global_batch: int,
        gpus_per_node: int,
        headroom: float,
        network_gbps: float,
        objective: Objective,
        price: float,
        baseline: Strategy,
        allocator: AllocatorConfig,
        retry_expandable: bool = True,
        torch_version: tuple[int, int] = TARGET_TORCH,
        cuda_version: tuple[int, int] | None = None,
        history: ProcessHistory | None = None,
        host_memory_bytes: int | None = None,
    ) -> None:
        self.spec, self.gpu = spec, gpu
        # --host-memory-gib: a plan's host memory per node must stay within this (None: not limited)
        self.host_memory = host_memory_bytes
        self.host_usable = None if host_memory_bytes is None else host_usable_bytes(host_memory_bytes, headroom)
        self._host: dict[Strategy, int] = {}  # the estimate's host_peak_bytes (per node), by strategy
        self.host_rejected: set[Strategy] = set()  # fit the GPU, not the host
        self.allocator = allocator
        # What every estimate and bound of this search is for besides the strategy and the allocator: the torch
        # release (workspaces), the CUDA release (context; None: the estimate's default) and the process history.
        # They are fixed for a search, so the memos below (keyed by strategy and allocator) cannot mix releases.
        self.torch_version, self.cuda_version, self.history = torch_version, cuda_version, history
        # The second chance (module docstring): None when the allocator already has expandable segments.
        self.expandable = (
            None
            if allocator.expandable_segments or not retry_expandable
            else dataclasses.replace(allocator, expandable_segments=True)
        )
        self.seq_len, self.global_batch, self.gpn = seq_len, global_batch, gpus_per_node
        self.headroom, self.network, self.objective, self.price = headroom, network_gbps, objective, price
        self.baseline = baseline
        self.usable = int(gpu.memory_bytes * (1 - headroom))
        self.estimates = 0
        self._memory: dict[tuple[Strategy, AllocatorConfig], tuple[int, bool, bool] | None] = {}
        self._speed_keys: dict[tuple[tuple[object, ...], int], tuple[float, ...]] = {}
        self._cheap: dict[tuple[object, ...], tuple[float, ...] | None] = {}
        self._bounds: dict[tuple[object, ...], tuple[float, ...] | None] = {}
        self._lower: dict[Strategy, int] = {}
        self._closed: dict[Strategy, int] = {}

    def strategy(self, c: Candidate, micro: int) -> Strategy:
        """The candidate at ``micro``, with what the search does not choose taken from the baseline (the command
        the fixes are for): the attention implementation, whether SDPA may pick FlashAttention and the optimizer's
        implementation (none of which the speed model reads; the adapter's shape, which it does, is the candidate's
        own, :attr:`Candidate.adapter`). A plan evaluated with another attention than the user's had a memory figure
        for another run, and flags that omitted the difference (``--checkpointing sac`` for an eager-attention
        command, which the estimate refuses)."""
        accum = self.global_batch // (c.data * micro)
        s = c.strategy(micro_batch=micro, grad_accum=accum, seq_len=self.seq_len, gpus_per_node=self.gpn)
        b = self.baseline
        return dataclasses.replace(s, attention=b.attention, flash_sdp=b.flash_sdp, optimizer_impl=b.optimizer_impl)

    def _estimate(self, s: Strategy, allocator: AllocatorConfig, exact: bool = False) -> tuple[int, bool] | None:
        """(the estimate's per-GPU requirement with ``allocator``, whether its reserve was simulated); None: no
        framework runs this strategy. The estimates are ``verdict_only``: one that does not fit may stop its
        simulation early, and its requirement is then a lower bound above the usable bytes (all the search
        needs to know of it); ``exact``: the whole requirement (the closest candidate when nothing fits)."""
        key = (s, allocator)
        known = key in self._memory
        hit = self._memory.get(key)
        if not known or (exact and hit is not None and hit[2]):
            from trainfit.estimate import estimate  # trainfit.estimate imports this package

            self.estimates += 1
            try:
                rep = estimate(
                    self.spec,
                    s,
                    gpu=self.gpu,
                    headroom=self.headroom,
                    search_micro_batch=False,
                    allocator=allocator.to_env(),
                    verdict_only=not exact,
                    torch_version=self.torch_version,
                    cuda_version=self.cuda_version,
                    history=self.history,
                )
            except StrategyError:
                hit = self._memory[key] = None
            else:
                assert rep.fit is not None
                hit = self._memory[key] = (rep.fit.required_bytes, rep.reserve_simulated, rep.reserve_stopped)
                self._host[s] = rep.host_peak_bytes  # host memory does not depend on the device's allocator
        return None if hit is None else hit[:2]

    def need(self, s: Strategy, missed: bool = False, exact: bool = False) -> tuple[int, AllocatorConfig] | None:
        """(the per-GPU requirement, the allocator it holds for): the search's allocator, or — when that does not
        fit, the lower bound does and the reserve was simulated — with expandable segments if that fits
        (the module docstring's second chance). None: no framework runs this strategy. ``missed``: the search's
        allocator is known not to fit (a smaller micro-batch of the same candidate did not: memory grows with
        the micro-batch), so only the second chance is estimated; when it misses too, its requirement is
        returned (a lower bound of nothing else: callers only compare it with the usable bytes). ``exact``: the
        requirement of a setup that does not fit in full (:meth:`_estimate`)."""
        if missed and not exact and self.expandable is not None and (s, self.allocator) not in self._memory:
            second = self._estimate(s, self.expandable)
            if second is None or not second[1]:  # not simulated: no second chance, ask the first allocator
                return self.need(s)
            return second[0], self.expandable
        first = self._estimate(s, self.allocator)
        if first is None:
            return None
        need, simulated = first
        if need > self.usable and self.expandable is not None and simulated and self.lower_bound(s) <= self.usable:
            second = self._estimate(s, self.expandable)
            if second is not None and second[0] <= self.usable:
                return second[0], self.expandable
        if exact and need > self.usable:
            whole = self._estimate(s, self.allocator, exact=True)
            assert whole is not None  # the same strategy, estimated before
            need = whole[0]
        return need, self.allocator

    def required(self, s: Strategy, missed: bool = False) -> int | None:
        """The per-GPU requirement of :meth:`need` (None: no framework runs this strategy)."""
        n = self.need(s, missed)
        return None if n is None else n[0]

    def lower_bound(self, s: Strategy) -> int:
        """:func:`trainfit.planner.search.lower_bound_bytes`: no allocator simulation (kept per strategy: a kept
        candidate asks for its resharding twin's, :meth:`evaluate`). Looser above the usable bytes (its ``above``):
        the search only compares it with them."""
        hit = self._lower.get(s)
        if hit is None:
            hit = self._lower[s] = lower_bound_bytes(
                self.spec,
                s,
                self.gpu,
                above=self.usable,
                torch_version=self.torch_version,
                cuda_version=self.cuda_version or DEFAULT_CUDA,
            )
        return hit

    def closed_bound(self, s: Strategy) -> int:
        """:meth:`lower_bound` without the looser form: the closed form's own (what :func:`_closest` ranks by)."""
        hit = self._closed.get(s)
        if hit is None:
            hit = self._closed[s] = lower_bound_bytes(
                self.spec, s, self.gpu, torch_version=self.torch_version, cuda_version=self.cuda_version or DEFAULT_CUDA
            )
        return hit

    def takes_history(self, c: Candidate) -> bool:
        """Whether the estimate models a process history for ``c``: a plain one-GPU run, not a rank's stream (ZeRO,
        FSDP, offload or a named engine, even on one GPU: ``Strategy.is_distributed``)."""
        try:
            return not self.strategy(c, self.micro_options(c)[0]).is_distributed
        except StrategyError:  # not a runnable strategy: the search skips it anyway
            return True

    def host_bytes(self, s: Strategy) -> int:
        """The estimate's host memory per node of ``s`` (estimated before: every plan's strategy is)."""
        return self._host.get(s, 0)

    def host_fits(self, s: Strategy) -> bool:
        """Whether ``s``'s host memory per node (estimated before) is within ``--host-memory-gib``'s usable part."""
        return self.host_usable is None or self.host_bytes(s) <= self.host_usable

    def fits(self, s: Strategy, missed: bool = False) -> bool:
        """The GPU holds ``s`` (the estimate's requirement within the usable bytes) and so does the host
        (:meth:`host_fits`; host memory grows with the micro-batch too — offloaded activations — or stays)."""
        if self.lower_bound(s) > self.usable:
            return False
        r = self.required(s, missed)
        if r is None or r > self.usable:
            return False
        if not self.host_fits(s):
            self.host_rejected.add(s)
            return False
        return True

    def known_fit(self, s: Strategy) -> bool:
        """:meth:`fits` of a strategy estimated before (False: not estimated yet, or it does not fit); it may still
        estimate the expandable-segments second chance of one that missed with the search's allocator."""
        known = (s, self.allocator) in self._memory or (
            self.expandable is not None and (s, self.expandable) in self._memory
        )
        return known and self.fits(s)

    def dominated(self, c: Candidate, limit: tuple[float, ...] | None) -> bool:
        """Whether a saver candidate's plan is known to be dropped before its estimates (one GPU): the search drops
        the plan of a candidate with savers when one with fewer of them fits at its micro-batch (:func:`search_plans`).
        Memory grows with the micro-batch, so a fewer-savers twin estimated to fit at micro-batch m fits at every
        smaller one; when every micro-batch the candidate's lower bound allows is so covered, or the candidate does not
        fit at the smallest that is not (its fitting micro-batches, smaller ones, are then all covered), its plan would
        be dropped — at the cost of the estimates down to it. Exact by the search's own rules; False where unknown."""
        twins = c.fewer_savers()
        micros = self.contenders(c, limit)
        if not twins or not micros:
            return False
        try:
            if self.strategy(c, micros[0]).is_distributed:
                return False
            allowed = [m for m in micros if self.lower_bound(self.strategy(c, m)) <= self.usable]
            covered = max(
                (m for m in micros for f in twins if self.known_fit(self.strategy(f, m))),
                default=0,
            )
        except StrategyError:
            return False
        rest = [m for m in allowed if m > covered]
        if not allowed or (rest and rest[0] == allowed[0]):
            return False  # nothing allowed (evaluate says how far off) or nothing covered: the usual search
        return not rest or not self.fits(self.strategy(c, rest[0]))

    def speed(self, s: Strategy) -> StepTime:
        return step_time(self.spec, s, self.gpu, network_gbps=self.network)

    def fast_speed(self, c: Candidate, micro: int) -> StepTime:
        x = c.speed_inputs(
            micro_batch=micro,
            grad_accum=self.global_batch // (c.data * micro),
            seq_len=self.seq_len,
            gpus_per_node=self.gpn,
            spec=self.spec,
        )
        return step_time_of(self.spec, x, self.gpu, network_gbps=self.network)

    def cheap_key(self, c: Candidate) -> tuple[float, ...] | None:
        """A lower bound of :meth:`bound` from one timing (:func:`~trainfit.planner.speed.step_floor_seconds`
        at the largest micro-batch, a billionth under for rounding); None: no peak for this dtype in the catalog.
        The floor is compute and the optimizer step, no communication: FSDP2's two ``reshard_after_forward``
        settings share one (kept under the resharding twin's signature)."""
        k = _speed_signature(dataclasses.replace(c, reshard_after_forward=True))
        if k not in self._cheap:
            try:
                t = self.fast_speed(c, self.micro_options(c)[-1])
            except StrategyError:
                self._cheap[k] = None
            else:
                key = self.key(c.world, dataclasses.replace(t, step_seconds=step_floor_seconds(t)))
                self._cheap[k] = tuple(v * (1 - 1e-9) for v in key)
        return self._cheap[k]

    def bound(self, c: Candidate) -> tuple[float, ...] | None:
        """The best :meth:`key` over the candidate's micro-batches (None: no peak for this dtype)."""
        k = _speed_signature(c)
        if k not in self._bounds:
            try:
                self._bounds[k] = min(self.speed_key(c, m) for m in self.micro_options(c))
            except StrategyError:
                self._bounds[k] = None
        return self._bounds[k]

    def speed_key(self, c: Candidate, micro: int) -> tuple[float, ...]:
        """:meth:`key` of :meth:`fast_speed`, kept per speed signature and micro-batch."""
        k = (_speed_signature(c), micro)
        hit = self._speed_keys.get(k)
        if hit is None:
            hit = self._speed_keys[k] = self.key(c.world, self.fast_speed(c, micro))
        return hit

    def key(self, gpus: int, t: StepTime) -> tuple[float, ...]:
        if self.objective is Objective.FEWEST_GPUS:
            return (gpus, t.step_seconds)
        if self.objective is Objective.CHEAPEST:
            return (gpus * t.step_seconds, t.step_seconds)
        return (t.step_seconds,)

    def micro_options(self, c: Candidate) -> list[int]:
        """The micro-batches that hit the global batch; optimizer-in-backward only without accumulation."""
        per_rank = self.global_batch // c.data
        return [per_rank] if c.optimizer_in_backward else _divisors(per_rank)

    def contenders(self, c: Candidate, limit: tuple[float, ...] | None) -> list[int]:
        """:meth:`micro_options` whose step time can still enter the ranking: with ``top`` plans found, the
        micro-batches no faster than the last of them (``limit``) are left out — whether they fit cannot change
        the result, and each costs an estimate (ties kept: fewer changes may rank a tie ahead)."""
        micros = self.micro_options(c)
        if limit is None:
            return micros
        return [m for m in micros if self.speed_key(c, m) <= limit]

    def plan(self, c: Candidate, micro: int, required: int, allocator: AllocatorConfig) -> Plan:
        s = self.strategy(c, micro)
        env = allocator.to_env()
        alloc = (f"PYTORCH_CUDA_ALLOC_CONF={env}",) if allocator != self.allocator else ()
        return Plan(
            candidate=c,
            strategy=s,
            required_bytes=required,
            usable_bytes=self.usable,
            speed=self.speed(s),
            changes=describe_changes(s, self.baseline) + alloc,
            alloc_conf=env,
            host_peak_bytes=self.host_bytes(s),
        )

    def evaluate(self, c: Candidate, limit: tuple[float, ...] | None = None) -> tuple[Plan | None, _Near | None]:
        """(the best fitting plan of ``c``, or None; ``c`` at micro-batch 1 when even that does not fit), over the
        micro-batches that can beat ``limit`` (:meth:`contenders`; None: all of them).

        On one GPU the largest micro-batch the lower bound allows is found first (no estimate); when the estimate
        says it fits, every larger one is ruled out by the bound, otherwise the micro-batch is bisected below it.
        Many GPUs have no bound: bisected from micro-batch 1 up."""
        micros = self.contenders(c, limit)
        if not micros:
            return None, None
        try:
            first = self.strategy(c, micros[0])
        except StrategyError:
            return None, None
        if not c.reshard_after_forward:
            # Without reshard_after_forward no moment of the closed form holds fewer unsharded layers (the forward:
            # every layer, not the current one; the backward: every layer above, not two), so the resharding twin's
            # lower bound is below this one's (tests/planner/test_reshard_plan.py holds it on random setups): where
            # it rules the twin out, it rules this candidate out — one closed form for the pair, as the twin's own
            # visit (usually later: its bound is no better) reuses it. Not its estimate: the simulated reserve is
            # not monotonic in the setting (planner.space's docstring).
            twin = self.lower_bound(self.strategy(dataclasses.replace(c, reshard_after_forward=True), micros[0]))
            if twin > self.usable:
                return None, _Near(candidate=c, micro=micros[0], bytes=twin)
        bound = self.lower_bound(first)
        if bound > self.usable:
            return None, _Near(candidate=c, micro=micros[0], bytes=bound)
        if first.is_distributed:  # many GPUs: no bound (0), bisect with estimates
            # Up to the fastest micro-batch only (ties: the largest): a larger one is slower, and fits only where
            # that one does (memory grows with the micro-batch) — a pipeline's bubble shrinks with more, smaller
            # micro-batches, so its fastest is often not the largest. The answer is the same, with fewer estimates.
            top = min(range(len(micros)), key=lambda i: (self.speed_key(c, micros[i]), -micros[i])) + 1
            return self._bisect_from_smallest(c, micros[:top], top)
        lo, hi = 0, len(micros)  # the bound allows micros[lo]; it rules out micros[hi] (if any)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.lower_bound(self.strategy(c, micros[mid])) <= self.usable else (lo, mid)
        if lo > 0 and self.fits(self.strategy(c, micros[lo])):
            return self._best(c, micros[: lo + 1]), None
        if lo == 0:
            return self._bisect_from_smallest(c, micros, 1)
        below = largest_below(lambda i: self.fits(self.strategy(c, micros[i])), lo, 0)
        if below is None:  # not even the smallest: how far off it is, by the estimate
            return self._bisect_from_smallest(c, micros, 1)
        return self._best(c, micros[: below + 1]), None

    def _bisect_from_smallest(self, c: Candidate, micros: list[int], hi: int) -> tuple[Plan | None, _Near | None]:
        """Whether ``micros[0]`` fits, then the largest that fits below ``micros[hi]`` (known not to fit)."""
        first = self.need(self.strategy(c, micros[0]))
        if first is None:
            return None, None
        if first[0] > self.usable:
            return None, _Near(candidate=c, micro=micros[0], bytes=first[0])
        if not self.host_fits(self.strategy(c, micros[0])):  # nor at a larger micro-batch: host bytes never shrink
            self.host_rejected.add(self.strategy(c, micros[0]))
            return None, None
        missed = first[1] != self.allocator  # the search's allocator misses here, so at every larger micro-batch
        lo = 0
        while hi - lo > 1:  # micros[lo] fits; micros[hi] (if any) does not
            mid = (lo + hi) // 2
            if self.fits(self.strategy(c, micros[mid]), missed):
                lo = mid
            else:
                hi = mid
        return self._best(c, micros[: lo + 1], missed), None

    def _best(self, c: Candidate, fitting: list[int], missed: bool = False) -> Plan:
        """The plan of the fastest micro-batch among ``fitting`` (ties: the larger; ``missed``: :meth:`need`'s)."""
        best = min(fitting, key=lambda m: (self.key(c.world, self.speed(self.strategy(c, m))), -m))
        need = self.need(self.strategy(c, best), missed and best != fitting[0])
        assert need is not None
        return self.plan(c, best, *need)


def search_plans(
    spec: ModelSpec,
    gpu: GPUSpec,
    *,
    gpus: int,
    seq_len: int,
    global_batch: int,
    gpus_per_node: int = 8,
    allow: tuple[Finetune, ...] = (),
    fp8: bool = False,
    objective: Objective = Objective.FASTEST,
    price_per_gpu_hour: float = 1.0,
    headroom: float = 0.30,
    network_gbps: float = DEFAULT_NETWORK_GBPS,
    baseline: Strategy | None = None,
    top: int = 5,
    explain_needs: bool = True,
    alloc_conf: str | None = None,
    retry_expandable: bool = True,
    torch_version: tuple[int, int] = TARGET_TORCH,
    cuda_version: tuple[int, int] | None = None,
    history: ProcessHistory | None = None,
    host_memory_bytes: int | None = None,
) -> PlanResult:
    """The ``top`` plans for ``global_batch`` sequences of ``seq_len`` tokens on up to ``gpus`` × ``gpu``.
    ``explain_needs``: when nothing fits, find the closest candidate and what it would need (False: plans only).
    ``alloc_conf``: the ``PYTORCH_CUDA_ALLOC_CONF`` every estimate simulates (None: this process's environment
    variable, else PyTorch's defaults); ``retry_expandable``: a candidate that misses may still fit with expandable
    segments (module docstring; False: that allocator only). ``torch_version``, ``cuda_version`` (None: the
    estimate's default, 13.0) and ``history``: passed to every estimate and counted by every lower bound, as
    ``trainfit estimate --torch-version/--cuda-version/--build/--warm-up/--after`` take them. A process history is
    modelled for one GPU only (a many-GPU rank's stream does not take one): with more than one GPU it is refused
    (:func:`check_plan_history`), rather than applied to some plans and not to others. ``host_memory_bytes``
    (``--host-memory-gib``): each node's memory; a plan whose estimated host memory per node exceeds
    :func:`host_usable_bytes` of it is ruled out (None: not limited; every plan still carries its host need)."""
    if global_batch < 1 or gpus < 1 or gpus_per_node < 1:
        raise StrategyError("--global-batch, --gpus and --gpus-per-node must be positive")
    if host_memory_bytes is not None and host_memory_bytes <= 0:
        raise StrategyError("--host-memory-gib must be positive")
    history = check_plan_history(history, gpu, gpus=gpus)
    allocator = AllocatorConfig.parse(alloc_conf) if alloc_conf is not None else AllocatorConfig.from_env()
    objective = Objective(objective)
    if baseline is None:
        baseline = default_baseline(gpus=gpus, global_batch=global_batch, seq_len=seq_len, gpus_per_node=gpus_per_node)
    s = _Search(
        spec,
        gpu,
        seq_len=seq_len,
        global_batch=global_batch,
        gpus_per_node=gpus_per_node,
        headroom=headroom,
        network_gbps=network_gbps,
        objective=objective,
        price=price_per_gpu_hour,
        baseline=baseline,
        allocator=allocator,
        retry_expandable=retry_expandable,
        torch_version=torch_version,
        cuda_version=cuda_version,
        history=history,
        host_memory_bytes=host_memory_bytes,
    )
    space = candidates(
        spec,
        gpu,
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        global_batch=global_batch,
        allow=allow,
        fp8=fp8,
        adapter=baseline.adapter,
        adapter_base=baseline.base_weights if baseline.adapter is not None else None,
    )
    # Best-first by each candidate's bound, (bound, kind, changes from the baseline, index): a candidate enters with
    # the cheap bound (kind 0: one timing, :func:`step_floor_seconds`) and goes back in with its exact one
    # (kind 1: the best over its micro-batches) when it comes up, so the exact bounds leave the heap in the order
    # of a sort of all of them — at equal values every cheap entry first — and most are never computed.
    searched = space if history is None else [c for c in space if s.takes_history(c)]
    notes: list[str] = [] if history is None else [history_note(history)]
    from trainfit.estimate import context_warning  # trainfit.estimate imports this package

    if (past_context := context_warning(spec, seq_len, "every plan")) is not None:
        notes.insert(0, past_context)
    if len(searched) < len(space):
        notes.append(
            f"{len(space) - len(searched)} of {len(space)} candidates not searched: {HISTORY_SCOPE}; without "
            "--build/--warm-up/--after they are planned for a fresh process"
        )
    heap: list[tuple[tuple[float, ...], int, int, int, Candidate]] = []
    for i, c in enumerate(searched):
        cheap = s.cheap_key(c)
        if cheap is not None:  # None: no peak for this dtype in the catalog
            heap.append((cheap, 0, _distance(c, baseline), i, c))
    heapq.heapify(heap)
    found: list[Plan] = []
    nears: list[_Near] = []
    while heap:
        bound, kind, changes, i, c = heapq.heappop(heap)
        if len(found) >= top and bound >= s.key(found[-1].gpus, found[-1].speed):
            break
        if kind == 0:
            exact = s.bound(c)
            if exact is not None:
                heapq.heappush(heap, (exact, 1, changes, i, c))
            continue
        same = _candidate_layout(c)
        if any(_layout(p)[:-1] == same and s.key(p.gpus, p.speed) <= bound for p in found):
            continue  # a plan of this layout already reaches this candidate's best time: it could only tie
        limit = s.key(found[-1].gpus, found[-1].speed) if len(found) >= top else None
        if s.dominated(c, limit):
            continue  # its plan would be dropped below, known without estimating it
        plan, near = s.evaluate(c, limit)
        if plan is not None and any(s.fits(s.strategy(f, plan.strategy.micro_batch)) for f in c.fewer_savers()):
            # A saver is never faster than the same plan without it at the same micro-batch: where the twin, or a
            # combination's subset, fits there, its own plan is at least as good (each is a candidate of its own).
            plan = None
        if plan is not None:
            found.append(plan)
            found.sort(key=lambda p: (s.key(p.gpus, p.speed), len(p.changes), -p.margin_bytes))
            found = _distinct(found, s)[:top]
        elif near is not None:
            nears.append(near)
    needs: tuple[str, ...] = ()
    nearest: Plan | None = None
    if not found and explain_needs:  # (callers that want plans only — fixes, the re-searches — skip both)
        nearest = _closest(s, nears)
        needs = _needs(spec, gpu, nearest, s, gpus=gpus, seq_len=seq_len, global_batch=global_batch, allow=allow)
    notes += _host_notes(s, found) + _pure_bf16_notes(found)
    return PlanResult(
        plans=tuple(found),
        closest=nearest,
        needs=needs,
        objective=objective,
        global_batch=global_batch,
        seq_len=seq_len,
        candidates=len(space),
        estimates=s.estimates,
        price_per_gpu_hour=price_per_gpu_hour,
        torch_version=torch_version,
        cuda_version=cuda_version or DEFAULT_CUDA,
        history=history or ProcessHistory(),
        notes=tuple(notes),
        host_memory_bytes=host_memory_bytes,
        host_usable_bytes=s.host_usable,
        host_rejected=len(s.host_rejected),
        host_rejected_min_bytes=min((s.host_bytes(x) for x in s.host_rejected), default=0),
        baseline=baseline,
    )


#: Why a pure-bf16 top plan under full training gets a note (:func:`_pure_bf16_notes`; docs/plan.md).
PURE_BF16_RISK = (
    "no fp32 master copy: an AdamW update below half a bf16 ulp of its weight rounds away (bf16(256) + bf16(1) = 256, "
    "docs/precision.md), which long full training such as pretraining accumulates — pure bf16 needs stochastic "
    "rounding or Kahan-compensated updates to match fp32 (Zamirai et al. 2020, 'Revisiting BFloat16 Training'), "
    "which torch's AdamW does not do; fine for short fine-tuning (torchtune's default recipe)"
)


def _pure_bf16_notes(found: list[Plan]) -> list[str]:
    """A note when the top plan trains every weight in pure bf16 (full training, not LoRA/QLoRA, whose trained
    adapters PEFT keeps in fp32): legitimate and ranked on its speed and memory, but a risk for long runs that the
    ranking cannot see — the ranking is not changed (the project states no policy against it), the user is told,
    with the best listed plan that keeps an fp32 master copy where there is one."""

    if not found:
        return []
    top = found[0]
    if top.strategy.precision is not Precision.PURE_BF16 or top.candidate.finetune is not Finetune.FULL:
        return []
    alt = next(
        (
            (i, p)
            for i, p in enumerate(found, 1)
            if p.strategy.precision is not Precision.PURE_BF16 and p.candidate.finetune is Finetune.FULL
        ),
        None,
    )
    instead = (
        f"; plan {alt[0]} updates fp32 weights ({alt[1].strategy.precision.value}, "
        f"{alt[1].speed.step_seconds:.2f} s/step)"
        if alt is not None
        else "; for pretraining consider --precision master-bf16 or amp-bf16 (trainfit estimate checks the fit)"
    )
    return [f"plan 1 is pure-bf16 — {PURE_BF16_RISK}{instead}"]


def _host_notes(s: _Search, found: list[Plan]) -> list[str]:
    """What the search says of host memory: the setups ``--host-memory-gib`` ruled out; without it, that the plans
    which offload need the host memory per node shown and that it was not checked (no default limit: the same GPU
    sits in 64 GiB workstations and 2 TiB servers, and the catalog knows GPUs, not hosts)."""
    from trainfit.units import fmt_gib, gib

    if s.host_memory is not None and s.host_usable is not None:
        if not s.host_rejected:
            return []
        least = min(s.host_bytes(x) for x in s.host_rejected)
        return [
            f"--host-memory-gib {gib(s.host_memory):g}: {len(s.host_rejected)} setup(s) that fit the GPU were ruled "
            f"out by their host memory per node (the least needs {fmt_gib(least)} of {fmt_gib(s.host_usable)} usable "
            f"with the {s.headroom:.0%} headroom)"
        ]
    need = max((p.host_peak_bytes for p in found), default=0)
    if not need:
        return []
    return [
        f"host memory not checked: plans that offload need up to {fmt_gib(need)} of CPU RAM per node (the host "
        "GiB/node column); pass --host-memory-gib to rule out what your nodes cannot hold"
    ]


def check_plan_history(history: ProcessHistory | None, gpu: GPUSpec, *, gpus: int) -> ProcessHistory | None:
    """``history`` as the search uses it: None for a fresh process (nothing to simulate); refused with one line
    when the search may use more than one GPU (the estimate models a process history for one GPU only,
    ``trainfit.estimate._require_history_modelled``: skipping it for the many-GPU candidates would rank plans
    estimated for different processes against each other) or when an earlier run is not one the estimate can
    replay (:func:`trainfit.estimate.check_earlier_runs` — otherwise every candidate's estimate would fail and the
    search would say that nothing fits)."""
    if history is None or history.fresh:
        return None
    if gpus > 1:
        raise StrategyError(
            f"--build, --warm-up and --after are modelled for one GPU only (a many-GPU rank's stream does not take a "
            f"process history yet): plan with --gpus 1, or drop them to plan over {gpus} GPUs"
        )
    from trainfit.estimate import check_earlier_runs  # trainfit.estimate imports this package

    check_earlier_runs(history, gpu)
    return history


def _closest(s: _Search, nears: list[_Near]) -> Plan | None:
    """The candidate nearest to fitting by the estimate's own numbers. A near candidate's bytes are either the
    estimate's or a lower bound of it (the closed-form bound; one data-parallel replica's activations, far below
    the estimate), so they are visited smallest first and estimated until the next one's bytes cannot beat
    the best estimate found."""
    best: tuple[int, AllocatorConfig, _Near] | None = None
    # (bytes, tightened, index, near): a bound the search loosened (:meth:`_Search.lower_bound`) is tightened to the
    # closed form's before its candidate is estimated, and goes back in with it
    heap = [(n.bytes, False, i, n) for i, n in enumerate(nears)]
    heapq.heapify(heap)
    while heap:
        bytes_, tight, i, near = heapq.heappop(heap)
        if best is not None and bytes_ >= best[0]:
            break
        strategy = s.strategy(near.candidate, near.micro)
        if not tight and (closed := s.closed_bound(strategy)) > bytes_:
            heapq.heappush(heap, (closed, True, i, near))
            continue
        need = s.need(strategy, exact=True)
        if need is not None and (best is None or need[0] < best[0]):
            best = (*need, near)
    if best is None:
        return None
    return s.plan(best[2].candidate, best[2].micro, best[0], best[1])


def _needs(
    spec: ModelSpec,
    gpu: GPUSpec,
    closest: Plan | None,
    s: _Search,
    *,
    gpus: int,
    seq_len: int,
    global_batch: int,
    allow: tuple[Finetune, ...],
) -> tuple[str, ...]:
    """What would make it fit: a GPU with enough memory, more GPUs (checked), LoRA/QLoRA (checked)."""
    out: list[str] = []
    if s.host_rejected:  # some setups fit the GPU: a node with more memory runs the least hungry of them
        least = min(s.host_bytes(x) for x in s.host_rejected)
        gib = math.ceil(least / (1 - s.headroom) / 2**30)
        out.append(f"--host-memory-gib {gib} (a setup that fits the GPU needs {least / 2**30:.1f} GiB per node)")
    if closest is not None:
        # rounded up: a GPU of the stated size must hold the plan with the headroom kept free
        gib = math.ceil(closest.required_bytes / (1 - s.headroom) / 2**30)
        out.append(f"a GPU with at least {gib} GiB (the closest plan needs {closest.required_bytes / 2**30:.1f} GiB)")
    common = {
        "seq_len": seq_len,
        "global_batch": global_batch,
        "gpus_per_node": s.gpn,
        "headroom": s.headroom,
        "network_gbps": s.network,
        "top": 1,
        "explain_needs": False,
        "alloc_conf": s.allocator.to_env(),
        "retry_expandable": s.expandable is not None,
        "torch_version": s.torch_version,
        "cuda_version": s.cuda_version,
        "host_memory_bytes": s.host_memory,  # more GPUs must fit the host too
    }
    # more GPUs: fresh processes (a process history is one GPU's, check_plan_history), and said so where one was given
    fresh = " in fresh processes: the process history is modelled for one GPU" if s.history is not None else ""
    for more in (2 * gpus, 4 * gpus, 8 * gpus):
        r = search_plans(spec, gpu, gpus=more, allow=allow, **common)  # type: ignore[arg-type]
        if r.plans:
            out.append(f"{r.plans[0].gpus} GPUs ({', '.join(r.plans[0].changes)}){fresh}")
            break
    missing = tuple(f for f in (Finetune.LORA, Finetune.QLORA) if f not in allow)
    if missing:
        r = search_plans(
            spec,
            gpu,
            gpus=gpus,
            allow=allow + missing,
            history=s.history,
            **common,  # type: ignore[arg-type]
        )
        if r.plans:
            out.append(f"--allow {','.join(m.value for m in missing)} ({', '.join(r.plans[0].changes)})")
    return tuple(out)
