"""``trainfit plan``: the ranked search (best-first, checked by the estimate itself).

Every candidate's memory is :func:`trainfit.estimate.estimate` of the very Strategy the plan prints, on the
GPU, with the headroom (``search_micro_batch=False``: the planner bisects the micro-batch itself), so a plan
fits exactly when ``trainfit estimate`` with those flags says it fits.

Speed is cheap (:mod:`trainfit.planner.speed`, microseconds) and memory is not (milliseconds), so the search
is best-first: for each candidate, the best step time over the micro-batches that hit the global batch is a
lower bound on what it can achieve; candidates are visited in order of that bound and the search stops once
``top`` plans are found and the next bound is worse than the last of them. For a visited candidate, the
micro-batch is bisected over the divisors (memory grows with the micro-batch: a property test holds the
analytic model to it), and the best micro-batch among those that fit is kept. When nothing fits, the
candidate that comes closest (least memory above the usable bytes at micro-batch 1) is reported with
what would make it fit.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from trainfit.arch.spec import ModelSpec
from trainfit.errors import StrategyError
from trainfit.hardware import GPUSpec
from trainfit.planner.space import Candidate, Finetune, Objective, candidates
from trainfit.planner.speed import DEFAULT_NETWORK_GBPS, StepTime, step_time
from trainfit.strategy import Strategy

__all__ = ["Plan", "PlanResult", "describe_changes", "search_plans"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    candidate: Candidate
    strategy: Strategy
    required_bytes: int  # per-GPU nvidia-smi estimate from trainfit.estimate (the worst rank)
    usable_bytes: int
    speed: StepTime
    changes: tuple[str, ...]  # what differs from the baseline, as CLI flags

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


def describe_changes(strategy: Strategy, baseline: Strategy) -> tuple[str, ...]:
    """``strategy``'s differences from ``baseline`` as ``trainfit estimate`` flags."""
    out: list[str] = []
    if strategy.world_size != baseline.world_size:
        out.append(f"--gpus {strategy.world_size}")
    for name in ("precision", "optimizer", "checkpointing", "sharding"):
        if getattr(strategy, name) != getattr(baseline, name):
            out.append(f"--{name} {getattr(strategy, name).value}")
    par, bpar = strategy.parallelism, baseline.parallelism
    if par.tensor != bpar.tensor:
        out.append(f"--tp {par.tensor} --sequence-parallel" if par.sequence_parallel else f"--tp {par.tensor}")
    if par.pipeline != bpar.pipeline:
        out.append(f"--pp {par.pipeline} --microbatches {par.microbatches}")
    if strategy.offload != baseline.offload:
        out.append(f"--offload {strategy.offload.flag}")
    if strategy.engine.engine != baseline.engine.engine:
        out.append(f"--engine {strategy.engine.engine.value}")
    if (strategy.adapter is None) != (baseline.adapter is None) or strategy.base_weights != baseline.base_weights:
        q = strategy.base_weights.quantization.value
        out.append("--finetune " + ("qlora" if q == "nf4" else "lora" if strategy.adapter is not None else "full"))
    if strategy.micro_batch != baseline.micro_batch or strategy.grad_accum != baseline.grad_accum:
        out.append(f"--batch {strategy.micro_batch} --grad-accum {strategy.grad_accum}")
    return tuple(out)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


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
    ) -> None:
        self.spec, self.gpu = spec, gpu
        self.seq_len, self.global_batch, self.gpn = seq_len, global_batch, gpus_per_node
        self.headroom, self.network, self.objective, self.price = headroom, network_gbps, objective, price
        self.baseline = baseline
        self.usable = int(gpu.memory_bytes * (1 - headroom))
        self.estimates = 0
        self._memory: dict[Strategy, int | None] = {}

    def strategy(self, c: Candidate, micro: int) -> Strategy:
        accum = self.global_batch // (c.data * micro)
        return c.strategy(micro_batch=micro, grad_accum=accum, seq_len=self.seq_len, gpus_per_node=self.gpn)

    def required(self, s: Strategy) -> int | None:
        """The estimate's per-GPU requirement (None: no framework runs this strategy)."""
        if s not in self._memory:
            from trainfit.estimate import estimate  # trainfit.estimate imports this package

            self.estimates += 1
            try:
                rep = estimate(self.spec, s, gpu=self.gpu, headroom=self.headroom, search_micro_batch=False)
            except StrategyError:
                self._memory[s] = None
            else:
                assert rep.fit is not None
                self._memory[s] = rep.fit.required_bytes
        return self._memory[s]

    def speed(self, s: Strategy) -> StepTime:
        return step_time(self.spec, s, self.gpu, network_gbps=self.network)

    def key(self, gpus: int, t: StepTime) -> tuple[float, ...]:
        if self.objective is Objective.FEWEST_GPUS:
            return (gpus, t.step_seconds)
        if self.objective is Objective.CHEAPEST:
            return (gpus * t.step_seconds, t.step_seconds)
        return (t.step_seconds,)

    def micro_options(self, c: Candidate) -> list[int]:
        return _divisors(self.global_batch // c.data)

    def plan(self, c: Candidate, micro: int, required: int) -> Plan:
        s = self.strategy(c, micro)
        return Plan(
            candidate=c,
            strategy=s,
            required_bytes=required,
            usable_bytes=self.usable,
            speed=self.speed(s),
            changes=describe_changes(s, self.baseline),
        )

    def evaluate(self, c: Candidate) -> tuple[Plan | None, Plan | None]:
        """(the best fitting plan of ``c``, or None; ``c`` at micro-batch 1 when even that does not fit)."""
        micros = self.micro_options(c)
        try:
            first = self.strategy(c, micros[0])
        except StrategyError:
            return None, None
        need = self.required(first)
        if need is None:
            return None, None
        if need > self.usable:
            return None, self.plan(c, micros[0], need)
        lo, hi = 0, len(micros)  # micros[lo] fits; micros[hi] (if any) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            r = self.required(self.strategy(c, micros[mid]))
            if r is not None and r <= self.usable:
                lo = mid
            else:
                hi = mid
        fitting = micros[: lo + 1]
        best = min(fitting, key=lambda m: (self.key(c.world, self.speed(self.strategy(c, m))), -m))
        req = self.required(self.strategy(c, best))
        assert req is not None
        return self.plan(c, best, req), None


def search_plans(
    spec: ModelSpec,
    gpu: GPUSpec,
    *,
    gpus: int,
    seq_len: int,
    global_batch: int,
    gpus_per_node: int = 8,
    allow: tuple[Finetune, ...] = (),
    objective: Objective = Objective.FASTEST,
    price_per_gpu_hour: float = 1.0,
    headroom: float = 0.30,
    network_gbps: float = DEFAULT_NETWORK_GBPS,
    baseline: Strategy | None = None,
    top: int = 5,
    explain_needs: bool = True,
) -> PlanResult:
    """The ``top`` plans for ``global_batch`` sequences of ``seq_len`` tokens on up to ``gpus`` × ``gpu``."""
    if global_batch < 1 or gpus < 1 or gpus_per_node < 1:
        raise StrategyError("--global-batch, --gpus and --gpus-per-node must be positive")
    objective = Objective(objective)
    if baseline is None:
        data = math.gcd(gpus, global_batch)
        baseline = Strategy(
            seq_len=seq_len,
            micro_batch=global_batch // data,
            parallelism=Candidate(world=data)
            .strategy(micro_batch=1, grad_accum=1, seq_len=seq_len, gpus_per_node=gpus_per_node)
            .parallelism,
            sharding="ddp" if data > 1 else "none",
        )
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
    )
    space = candidates(spec, gpu, gpus=gpus, gpus_per_node=gpus_per_node, global_batch=global_batch, allow=allow)
    bounded: list[tuple[tuple[float, ...], int, int, Candidate]] = []
    speed_cache: dict[tuple[object, ...], tuple[float, ...] | None] = {}
    for i, c in enumerate(space):
        # Speed does not depend on the optimizer: one bound per candidate without it.
        skey = (dataclasses.replace(c, optimizer=baseline.optimizer),)
        if skey not in speed_cache:
            keys = []
            for m in s.micro_options(c):
                try:
                    keys.append(s.key(c.world, s.speed(s.strategy(c, m))))
                except StrategyError:
                    continue
            speed_cache[skey] = min(keys) if keys else None
        bound = speed_cache[skey]
        if bound is not None:
            changes = len(describe_changes(s.strategy(c, s.micro_options(c)[-1]), baseline))
            bounded.append((bound, changes, i, c))
    bounded.sort(key=lambda x: (x[0], x[1], x[2]))
    found: list[Plan] = []
    closest: Plan | None = None
    for bound, _changes, _i, c in bounded:
        if len(found) >= top and bound >= s.key(found[-1].gpus, found[-1].speed):
            break
        plan, near = s.evaluate(c)
        if plan is not None:
            found.append(plan)
            found.sort(key=lambda p: (s.key(p.gpus, p.speed), len(p.changes), -p.margin_bytes))
            del found[top:]
        elif near is not None and (closest is None or near.required_bytes < closest.required_bytes):
            closest = near
    needs: tuple[str, ...] = ()
    if not found and explain_needs:
        needs = _needs(spec, gpu, closest, s, gpus=gpus, seq_len=seq_len, global_batch=global_batch, allow=allow)
    return PlanResult(
        plans=tuple(found),
        closest=None if found else closest,
        needs=needs,
        objective=objective,
        global_batch=global_batch,
        seq_len=seq_len,
        candidates=len(space),
        estimates=s.estimates,
    )


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
    if closest is not None:
        gib = closest.required_bytes / (1 - s.headroom) / 2**30
        out.append(
            f"a GPU with at least {gib:.0f} GiB (the closest plan needs {closest.required_bytes / 2**30:.1f} GiB)"
        )
    common = {
        "seq_len": seq_len,
        "global_batch": global_batch,
        "gpus_per_node": s.gpn,
        "headroom": s.headroom,
        "network_gbps": s.network,
        "top": 1,
        "explain_needs": False,
    }
    for more in (2 * gpus, 4 * gpus, 8 * gpus):
        r = search_plans(spec, gpu, gpus=more, allow=allow, **common)  # type: ignore[arg-type]
        if r.plans:
            out.append(f"{r.plans[0].gpus} GPUs ({', '.join(r.plans[0].changes)})")
            break
    missing = tuple(f for f in (Finetune.LORA, Finetune.QLORA) if f not in allow)
    if missing:
        r = search_plans(spec, gpu, gpus=gpus, allow=allow + missing, **common)  # type: ignore[arg-type]
        if r.plans:
            out.append(f"--allow {','.join(m.value for m in missing)} ({', '.join(r.plans[0].changes)})")
    return tuple(out)
