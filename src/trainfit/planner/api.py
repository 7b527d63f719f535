"""``plan()``: the planner as the CLI and the web page call it — the flags' values in, a ranked
:class:`~trainfit.planner.rank.PlanResult` out (one place that turns GPUs/nodes and a batch or a token budget
into the search's inputs, :class:`~trainfit.planner.workload.PlanWorkload`, and the torch and CUDA releases' names
into theirs). ``baseline``: the user's run (``trainfit plan``'s run flags), checked as ``trainfit estimate`` checks
it before the search."""

from __future__ import annotations

from typing import Any

from trainfit.arch import ModelSpec, load_model
from trainfit.errors import ConfigError
from trainfit.hardware import GPUSpec, get_gpu
from trainfit.history import ProcessHistory
from trainfit.planner.rank import PlanResult, check_plan_history, default_baseline, search_plans
from trainfit.planner.space import Objective, allows_float8, baseline_allows, check_allow_float8, parse_allow
from trainfit.planner.speed import DEFAULT_NETWORK_GBPS
from trainfit.planner.workload import PlanWorkload, check_knobs
from trainfit.strategy import Strategy

__all__ = ["PlanWorkload", "model_workload", "plan", "plan_baseline"]


def model_workload(spec: ModelSpec, *, seq: int | None = None, **sizes: Any) -> PlanWorkload:
    """The :class:`PlanWorkload` of these sizes for ``spec`` (``trainfit plan``'s size flags, the web API's fields):
    without ``seq``, ``trainfit estimate``'s default, 2048 tokens or the model's context when shorter (GPT-2's
    learned positions end at 1024)."""
    from trainfit.estimate import default_seq_len  # trainfit.estimate imports the planner

    return PlanWorkload(seq=seq if seq is not None else default_seq_len(spec), **sizes)


def _workload(workload: PlanWorkload | None, **sizes: int | str | None) -> PlanWorkload:
    """``workload``, or one built from the keyword sizes (those not None; the rest :class:`PlanWorkload`'s defaults);
    both at once are refused in one line rather than one silently preferred."""
    given = {name: value for name, value in sizes.items() if value is not None}
    if workload is None:
        return PlanWorkload(**given)  # type: ignore[arg-type]
    if given:
        raise ConfigError(f"give a PlanWorkload or its sizes ({', '.join(sorted(given))}), not both")
    return workload


def plan_baseline(
    workload: PlanWorkload | None = None,
    *,
    gpus: int | None = None,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    seq: int | None = None,
    global_batch: int | None = None,
    tokens_per_step: str | None = None,
) -> Strategy:
    """The baseline :func:`plan` assumes for ``workload`` (or these sizes, :class:`PlanWorkload`'s fields) when none
    is given (:func:`trainfit.planner.rank.default_baseline` of the world and global batch they resolve to): what
    ``trainfit plan``'s run flags are laid over."""
    w = _workload(workload, gpus=gpus, nodes=nodes, gpus_per_node=gpus_per_node, seq=seq,
                  global_batch=global_batch, tokens_per_step=tokens_per_step)  # fmt: skip
    return default_baseline(gpus=w.world, global_batch=w.sequences, seq_len=w.seq, gpus_per_node=w.gpus_per_node)


def plan(
    model: ModelSpec | str,
    gpu: GPUSpec | str,
    *,
    workload: PlanWorkload | None = None,
    gpus: int | None = None,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    seq: int | None = None,
    global_batch: int | None = None,
    tokens_per_step: str | None = None,
    allow: str | None = None,
    objective: str = "fastest",
    price_per_gpu_hour: float = 1.0,
    headroom: float = 0.30,
    network_gbps: float = DEFAULT_NETWORK_GBPS,
    top: int = 5,
    alloc_conf: str | None = None,
    torch_version: str | tuple[int, int] | None = None,
    cuda_version: str | tuple[int, int] | None = None,
    history: ProcessHistory | None = None,
    host_memory_bytes: int | None = None,
    baseline: Strategy | None = None,
) -> PlanResult:
    """Ranked plans for training ``model`` on ``gpu`` (see ``trainfit plan --help`` for each argument). The run's
    size: ``workload``, or the same fields as keywords (``gpus``, ``nodes``, ``gpus_per_node`` — default 8 —, ``seq``
    — default: ``baseline``'s, else :func:`trainfit.estimate.default_seq_len`, 2048 or the context when shorter —,
    ``global_batch``, ``tokens_per_step``; not both); with neither ``global_batch`` nor
    ``tokens_per_step``, 8 sequences per GPU given (``workload.sequences_per_step``).
    ``torch_version`` / ``cuda_version`` (``"2.11"``, ``"12.8"``; None: 2.13 and 13.0) are checked as
    :func:`trainfit.estimate.estimate` checks them (the CUDA release must run ``gpu``) and decide every plan's
    workspaces and CUDA context; ``history`` (:mod:`trainfit.history`): the process the run starts in, one GPU only
    (:func:`trainfit.planner.rank.check_plan_history`). ``host_memory_bytes`` (``--host-memory-gib``): each node's
    CPU memory; plans whose host memory per node exceeds it less the headroom are ruled out (None: not limited).
    ``baseline``: the user's run, what each plan's changes are relative to (None: :func:`plan_baseline`); its
    sequence length must be the workload's. It is refused in one line where ``trainfit estimate`` would refuse it (an
    estimate of it on ``gpu`` with these releases and process); an adapter or fp8 linears in it open the search to
    them as ``allow`` would (:func:`trainfit.planner.space.baseline_allows`)."""
    if objective not in {o.value for o in Objective}:
        raise ConfigError(f"unknown --objective '{objective}'; choose one of: {', '.join(o.value for o in Objective)}")
    check_knobs(headroom=headroom, top=top, price_per_gpu_hour=price_per_gpu_hour, network_gbps=network_gbps)
    spec = load_model(model) if isinstance(model, str) else model
    sizes = {"gpus": gpus, "nodes": nodes, "gpus_per_node": gpus_per_node, "global_batch": global_batch,
             "tokens_per_step": tokens_per_step}  # fmt: skip
    if workload is not None:
        w = _workload(workload, seq=seq, **sizes)  # refuses sizes beside it
    else:  # without seq: the baseline's, else trainfit estimate's default (2048 or the model's context)
        given = {name: value for name, value in sizes.items() if value is not None}
        w = model_workload(spec, seq=seq if seq is not None or baseline is None else baseline.seq_len, **given)
    world, batch, seq_len = w.world, w.sequences, w.seq
    gpu_spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    check_allow_float8(gpu_spec, allow)
    from trainfit.estimate import cuda_release, torch_release  # trainfit.estimate imports the planner

    release = torch_release(torch_version)
    cuda = None if cuda_version is None else cuda_release(cuda_version, gpu_spec)
    methods, fp8 = parse_allow(allow), allows_float8(allow)
    if baseline is not None:
        history = check_plan_history(history, gpu_spec, gpus=world)  # the plan's own refusal first
        check_baseline(spec, baseline, gpu_spec, seq=seq_len, headroom=headroom, alloc_conf=alloc_conf,
                       torch_version=release, cuda_version=cuda, history=history)  # fmt: skip
        more, more_fp8 = baseline_allows(baseline)
        methods += tuple(m for m in more if m not in methods)
        fp8 = fp8 or more_fp8
    return search_plans(
        spec,
        gpu_spec,
        gpus=world,
        seq_len=seq_len,
        global_batch=batch,
        gpus_per_node=w.gpus_per_node,
        allow=methods,
        fp8=fp8,
        objective=Objective(objective),
        price_per_gpu_hour=price_per_gpu_hour,
        headroom=headroom,
        network_gbps=network_gbps,
        top=top,
        alloc_conf=alloc_conf,
        torch_version=release,
        cuda_version=cuda,
        history=history,
        host_memory_bytes=host_memory_bytes,
        baseline=baseline,
    )


def check_baseline(
    spec: ModelSpec,
    baseline: Strategy,
    gpu: GPUSpec,
    *,
    seq: int,
    headroom: float,
    alloc_conf: str | None,
    torch_version: tuple[int, int],
    cuda_version: tuple[int, int] | None,
    history: ProcessHistory | None,
) -> None:
    """Refuse a baseline ``trainfit estimate`` would refuse, with its one line: the estimate of the baseline itself
    (the verdict only, no micro-batch search or fixes) on the plan's GPU, releases and process — whether it fits is
    not asked, only whether the estimate takes it. Its sequence length must be the plan's (``--seq``)."""
    from trainfit.estimate import estimate

    if baseline.seq_len != seq:
        raise ConfigError(f"the baseline's sequence length ({baseline.seq_len}) is not the plan's --seq {seq}")
    estimate(
        spec,
        baseline,
        gpu=gpu,
        headroom=headroom,
        allocator=alloc_conf,
        search_micro_batch=False,
        fixes=False,
        verdict_only=True,
        torch_version=torch_version,
        cuda_version=cuda_version,
        history=history,
    )
