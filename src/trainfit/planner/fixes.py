"""What ``trainfit estimate`` adds from the planner: the speed of exactly the configuration asked, and — when
it does not fit (the GPU, or the host under ``--host-memory-gib``) — the planner's top three checked plans for the
same GPUs, global batch and sequence length, within the same host memory,
searched under the estimate's torch and CUDA releases and in its process history (each fix's required bytes are
then what ``trainfit estimate`` with the fix's flags and the same ``--torch-version``, ``--cuda-version``,
``--build``, ``--warm-up`` and ``--after`` reports)."""

from __future__ import annotations

from trainfit.allocator.workspaces import TARGET_TORCH
from trainfit.arch.spec import ModelSpec
from trainfit.errors import StrategyError
from trainfit.hardware import GPUSpec
from trainfit.history import ProcessHistory
from trainfit.planner.speed import StepTime, step_time
from trainfit.result import Suggestion, SuggestionKind
from trainfit.strategy import Strategy

__all__ = ["FIXES", "checked_fixes", "speed_of"]

#: How many checked fixes ``trainfit estimate`` shows.
FIXES = 3


def speed_of(spec: ModelSpec, strategy: Strategy, gpu: GPUSpec) -> StepTime | None:
    """The speed model's step time (None where the catalog has no peak for the recipe's dtype)."""
    try:
        return step_time(spec, strategy, gpu)
    except StrategyError:
        return None


def checked_fixes(
    spec: ModelSpec,
    strategy: Strategy,
    gpu: GPUSpec,
    headroom: float,
    alloc_conf: str | None = None,
    *,
    torch_version: tuple[int, int] = TARGET_TORCH,
    cuda_version: tuple[int, int] | None = None,
    history: ProcessHistory | None = None,
    host_memory_bytes: int | None = None,
) -> tuple[Suggestion, ...]:
    """The planner's top plans for ``strategy``'s GPUs, global batch and sequence, as suggestions whose flags
    are the changes from ``strategy`` (each checked by the estimate; LoRA/QLoRA only if already fine-tuning, fp8
    linears only if already training them: :func:`trainfit.planner.space.baseline_allows`).
    ``alloc_conf``: the allocator the estimate simulated (None: the environment's); a plan that needs another one
    says so as ``--alloc-conf`` (the estimate's flag that reproduces it). ``torch_version``, ``cuda_version`` (None:
    the default) and ``history``: the estimate's own, so that each fix is checked against the same workspaces,
    CUDA context and process as the estimate that did not fit (a history only comes with one GPU: the estimate
    refuses it for more). ``host_memory_bytes`` (``--host-memory-gib``): each node's CPU memory; a plan whose host
    memory per node exceeds it less the headroom is no fix (:func:`trainfit.planner.rank.host_usable_bytes`; None:
    not limited), and each fix that keeps memory on the host says how much per node."""
    from trainfit.planner.rank import search_plans
    from trainfit.planner.space import baseline_allows

    par = strategy.parallelism
    allow, fp8 = baseline_allows(strategy)  # adapters / fp8 linears only where the command already has them
    try:
        result = search_plans(
            spec,
            gpu,
            gpus=strategy.world_size,
            gpus_per_node=par.gpus_per_node,
            seq_len=strategy.seq_len,
            global_batch=strategy.global_batch,
            allow=allow,
            fp8=fp8,
            headroom=headroom,
            baseline=strategy,
            top=FIXES,
            explain_needs=False,
            alloc_conf=alloc_conf,
            torch_version=torch_version,
            cuda_version=cuda_version,
            history=history,
            host_memory_bytes=host_memory_bytes,
        )
    except StrategyError:
        return ()
    return tuple(
        Suggestion(
            kind=SuggestionKind.PLAN,
            reason=(
                f"fits with {p.required_bytes / 2**30:.1f} GiB of {p.usable_bytes / 2**30:.1f} GiB usable; "
                f"{p.speed.step_seconds:.2f} s/step, {p.speed.tokens_per_second:,.0f} tokens/s (speed model)"
                + _host_clause(p.host_peak_bytes, result.host_usable_bytes)
            ),
            flags=tuple(_as_flag(c) for c in p.changes),
        )
        for p in result.plans
    )


def _host_clause(host_peak_bytes: int, host_usable_bytes: int | None) -> str:
    """A fix's host memory per node, said under ``--host-memory-gib`` only (without it the fixes read as before)."""
    if host_usable_bytes is None or not host_peak_bytes:
        return ""
    return f"; host {host_peak_bytes / 2**30:.1f} GiB/node of {host_usable_bytes / 2**30:.1f} GiB usable"


def _as_flag(change: str) -> str:
    """A plan's change as ``trainfit estimate`` spells it (``PYTORCH_CUDA_ALLOC_CONF=X`` → ``--alloc-conf X``)."""
    env = "PYTORCH_CUDA_ALLOC_CONF="
    return f"--alloc-conf {change.removeprefix(env)}" if change.startswith(env) else change
