"""``plan()``: the planner as the CLI and the web page call it — the flags' values in, a ranked
:class:`~trainfit.planner.rank.PlanResult` out (one place that turns GPUs/nodes and a batch or a token budget
into the search's inputs, and the torch and CUDA releases' names into theirs)."""

from __future__ import annotations

from trainfit.arch import ModelSpec, load_model
from trainfit.errors import ConfigError
from trainfit.hardware import GPUSpec, get_gpu
from trainfit.history import ProcessHistory
from trainfit.planner.rank import PlanResult, search_plans
from trainfit.planner.space import Objective, allows_float8, check_allow_float8, parse_allow
from trainfit.planner.workload import check_knobs, resolve_world, sequences_per_step

__all__ = ["plan"]


def plan(
    model: ModelSpec | str,
    gpu: GPUSpec | str,
    *,
    gpus: int | None = None,
    nodes: int | None = None,
    gpus_per_node: int = 8,
    seq: int = 2048,
    global_batch: int | None = None,
    tokens_per_step: str | None = None,
    allow: str | None = None,
    objective: str = "fastest",
    price_per_gpu_hour: float = 1.0,
    headroom: float = 0.30,
    network_gbps: float = 50.0,
    top: int = 5,
    alloc_conf: str | None = None,
    torch_version: str | tuple[int, int] | None = None,
    cuda_version: str | tuple[int, int] | None = None,
    history: ProcessHistory | None = None,
    host_memory_bytes: int | None = None,
) -> PlanResult:
    """Ranked plans for training ``model`` on ``gpu`` (see ``trainfit plan --help`` for each argument); with
    neither ``global_batch`` nor ``tokens_per_step``, 8 sequences per GPU given (``workload.sequences_per_step``).
    ``torch_version`` / ``cuda_version`` (``"2.11"``, ``"12.8"``; None: 2.13 and 13.0) are checked as
    :func:`trainfit.estimate.estimate` checks them (the CUDA release must run ``gpu``) and decide every plan's
    workspaces and CUDA context; ``history`` (:mod:`trainfit.history`): the process the run starts in, one GPU only
    (:func:`trainfit.planner.rank.check_plan_history`). ``host_memory_bytes`` (``--host-memory-gib``): each node's
    CPU memory; plans whose host memory per node exceeds it less the headroom are ruled out (None: not limited)."""
    if objective not in {o.value for o in Objective}:
        raise ConfigError(f"unknown --objective '{objective}'; choose one of: {', '.join(o.value for o in Objective)}")
    check_knobs(headroom=headroom, top=top, price_per_gpu_hour=price_per_gpu_hour, network_gbps=network_gbps)
    world = resolve_world(gpus=gpus, nodes=nodes, gpus_per_node=gpus_per_node)
    batch = sequences_per_step(global_batch=global_batch, tokens_per_step=tokens_per_step, seq_len=seq, world=world)
    spec = load_model(model) if isinstance(model, str) else model
    gpu_spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    check_allow_float8(gpu_spec, allow)
    from trainfit.estimate import cuda_release, torch_release  # trainfit.estimate imports the planner

    release = torch_release(torch_version)
    cuda = None if cuda_version is None else cuda_release(cuda_version, gpu_spec)
    return search_plans(
        spec,
        gpu_spec,
        gpus=world,
        seq_len=seq,
        global_batch=batch,
        gpus_per_node=gpus_per_node,
        allow=parse_allow(allow),
        fp8=allows_float8(allow),
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
    )
