"""``trainfit plan``: parse, call :func:`trainfit.planner.api.plan`, render. No arithmetic here. The release and
process options (``--torch-version``, ``--cuda-version``, ``--build``, ``--warm-up``, ``--after``) are
``trainfit estimate``'s own (:mod:`trainfit.cli.estimate`), so the two commands read them alike; so are the run
flags that describe the user's baseline (:data:`BASELINE_FLAGS`, the very parameters of ``estimate``'s signature,
:func:`~trainfit.cli.estimate.with_run_flags`), built into a Strategy by the same
:func:`~trainfit.cli.estimate.strategy_from_flags`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from trainfit.arch.spec import ModelSpec
from trainfit.cli.estimate import (
    AfterOption,
    BuildOption,
    CudaVersionOption,
    HostMemoryOption,
    TorchVersionOption,
    WarmUpOption,
    with_run_flags,
)
from trainfit.planner.speed import DEFAULT_NETWORK_GBPS, NCCL_NETWORK_EFFICIENCY

if TYPE_CHECKING:
    from trainfit.planner.workload import PlanWorkload
    from trainfit.strategy import Strategy

#: ``trainfit estimate``'s flags that ``trainfit plan`` takes to describe the user's current run, the baseline: what
#: each plan's "changes" are relative to and where the search takes what it does not choose (the attention, the
#: optimizer's implementation, the adapter and its base). The plan's own ``--gpus`` (GPUs available), ``--seq`` and
#: ``--gpus-per-node`` are the baseline's too; its world is the default baseline's (:func:`trainfit.planner.api.
#: plan_baseline`: DDP over the GPUs that divide the global batch, all of it in one micro-batch per GPU), and so are
#: ``--batch`` and ``--sharding`` when not given — the plan chooses the micro-batch, so ``--batch``/``--grad-accum``
#: only move what the changes say. Not taken: the engines' buffer and wrapping knobs, ``--sharded-init``, the task
#: head — the search does not carry them into a plan. (The web page's plans tab sends these of its form's run:
#: ``BASELINE_FIELDS`` in ``web/static/app.js``, held to this list by a test.)
BASELINE_FLAGS: tuple[str, ...] = (
    "precision", "optimizer", "optimizer_impl", "checkpointing", "attention", "batch", "grad_accum", "sharding",
    "tp", "pp", "pp_schedule", "virtual_stages", "microbatches", "sequence_parallel", "offload", "engine",
    "reshard_after_forward", "sync_each_batch", "finetune", "lora_rank", "lora_alpha", "lora_targets",
    "lora_dropout", "dora", "adapter_dtype", "base_dtype", "double_quant", "freeze", "fp8", "loss",
    "optimizer_in_backward", "activation_offload", "paged_optimizer",
)  # fmt: skip


def baseline_from_flags(
    spec: ModelSpec,
    flags: Mapping[str, Any],
    given: Iterable[str],
    workload: PlanWorkload,
) -> Strategy | None:
    """The baseline ``trainfit plan`` (and the web API's plan) searches from for ``workload`` (the run's size, the
    same value the search is then given): None (the planner's default, :func:`trainfit.planner.api.plan_baseline`)
    when none of :data:`BASELINE_FLAGS` is ``given``, else that default with the given ones laid over it, built as
    ``trainfit estimate`` builds its run (:func:`strategy_from_flags`, then :func:`refuse_inapplicable` for a
    framework's flag given for a run it does not apply to). ``flags``: the values of :data:`BASELINE_FLAGS`
    (defaults included)."""
    from trainfit.cli.estimate import STRATEGY_FLAGS, estimate_defaults, refuse_inapplicable, strategy_from_flags
    from trainfit.planner.api import plan_baseline

    named = frozenset(given) & frozenset(BASELINE_FLAGS)
    if not named:
        return None
    default = plan_baseline(workload)
    values = {n: v for n, v in estimate_defaults().items() if n in STRATEGY_FLAGS}
    values |= {"seq": workload.seq, "gpus": default.world_size, "gpus_per_node": workload.gpus_per_node}
    values |= {"batch": default.micro_batch, "sharding": default.sharding.value}
    values |= {n: flags[n] for n in BASELINE_FLAGS if n in named or n not in ("batch", "sharding")}
    _, strategy = strategy_from_flags(spec, **values)
    refuse_inapplicable(strategy, named)
    return strategy


def plan_cmd(
    model: Annotated[str, typer.Argument(help="Catalog slug, config.json (file or folder), or Hub repo id.")],
    gpu: Annotated[str, typer.Option("--gpu", help="Catalog GPU id (see 'trainfit gpus').")],
    gpus: Annotated[int | None, typer.Option("--gpus", help="GPUs available (at most this many are used).")] = None,
    nodes: Annotated[int | None, typer.Option("--nodes", help="Nodes (with --gpus-per-node).")] = None,
    gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", help="GPUs per node (where NVLink ends).")] = 8,
    seq: Annotated[
        int | None,
        typer.Option(
            "--seq", "-s", help="Sequence length in tokens (default: 2048, or the model's context when shorter)."
        ),
    ] = None,
    global_batch: Annotated[
        int | None,
        typer.Option(
            "--global-batch",
            help="Sequences per optimizer step, over all GPUs (default, without --tokens-per-step: 8 per GPU given, "
            "the HF Trainer's per_device_train_batch_size).",
        ),
    ] = None,
    tokens_per_step: Annotated[
        str | None, typer.Option("--tokens-per-step", help="Tokens per optimizer step (4M, 2e6); a multiple of --seq.")
    ] = None,
    allow: Annotated[
        str | None,
        typer.Option(
            "--allow",
            help="Also consider: lora,qlora,fp8 (fp8: torchao fp8 linears for full training in bf16 on one GPU or "
            "DDP/FSDP2/HSDP without offload, TP or PP; GPUs with fp8 tensor cores).",
        ),
    ] = None,
    objective: Annotated[str, typer.Option(help="fastest | fewest-gpus | cheapest")] = "fastest",
    price_per_gpu_hour: Annotated[float, typer.Option("--price-per-gpu-hour", help="For --objective cheapest.")] = 1.0,
    headroom: Annotated[float, typer.Option(help="Fraction of GPU memory kept free (article: 0.3).")] = 0.30,
    network_gbps: Annotated[
        float,
        typer.Option(
            "--network-gbps",
            help="Network line rate across nodes in GB/s per GPU per direction (50 = one 400 Gb/s NIC per GPU); "
            f"NCCL's collectives reach about {NCCL_NETWORK_EFFICIENCY:.0%} of it (docs/speed.md).",
        ),
    ] = DEFAULT_NETWORK_GBPS,
    top: Annotated[int, typer.Option("--top", help="Plans to show.")] = 5,
    host_memory_gib: HostMemoryOption = None,
    alloc_conf: Annotated[
        str | None,
        typer.Option(
            "--alloc-conf",
            help="PYTORCH_CUDA_ALLOC_CONF every estimate simulates (default: the environment's); a plan that fits "
            "only with expandable_segments:True says so.",
        ),
    ] = None,
    torch_version: TorchVersionOption = None,
    cuda_version: CudaVersionOption = None,
    build: BuildOption = "from-pretrained",
    warm_up: WarmUpOption = False,
    after: AfterOption = None,
    export: Annotated[
        str | None,
        typer.Option(
            "--export",
            help="Write the top plan's configs here (TrainingArguments, accelerate, DeepSpeed, train_fsdp2.py, "
            "torchtune overrides).",
        ),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
    **run: Any,
) -> None:
    """What to change to make MODEL's training fit, fastest first: ranked plans with per-GPU peak, margin,
    step time, tokens/s and MFU, each checked by the same estimate as 'trainfit estimate'.

    Your current run (the baseline) is described with trainfit estimate's own flags (--precision, --optimizer,
    --optimizer-impl, --checkpointing, --attention, --sharding, --tp/--pp, --offload, --engine, --batch,
    --grad-accum, --finetune and the LoRA flags, --base-dtype, --fp8, --loss, the savers): each plan's changes are
    relative to it, and the attention, optimizer implementation and adapter come from it. It runs on the GPUs that
    divide the global batch; --batch and --sharding default to the whole global batch per GPU under DDP. It does not
    narrow the search; an adapter or --fp8 in it allows LoRA/QLoRA or fp8 as --allow would. A run 'trainfit
    estimate' refuses is refused the same way.

    --torch-version and --cuda-version decide every plan's cuBLAS workspaces and CUDA context, as they do the
    estimate's. --build, --warm-up and --after describe the process the run starts in (modelled on one GPU: with
    them, plan with --gpus 1).

    Examples:

      trainfit plan llama-3.1-8b --gpu a100-sxm-80gb --gpus 8 --seq 4096 --global-batch 256

      trainfit plan llama-3.1-70b --gpu h100-sxm-80gb --nodes 4 --gpus-per-node 8 --seq 8192 --tokens-per-step 4M

      trainfit plan mistral-7b-v0.1 --gpu rtx-4090 --allow lora,qlora --seq 2048 --global-batch 64

      trainfit plan llama-3.1-8b --gpu a100-sxm-80gb --gpus 8 --export ./plan/

      trainfit plan llama-3.2-1b --gpu h200-sxm-141gb --gpus 1 --seq 4096 --global-batch 16 --torch-version 2.11
      --warm-up

      trainfit plan llama-3.2-1b --gpu a100-sxm-40gb --gpus 8 --seq 4096 --global-batch 64 --precision fp32
      --checkpointing full --batch 2    # what to change from this run
    """
    from trainfit.arch import load_model
    from trainfit.cli.common import print_json, stdout_console, warn
    from trainfit.cli.estimate import explicit_flags, process_history
    from trainfit.errors import ConfigError
    from trainfit.export import export_plan, write_export
    from trainfit.export.configs import hf_trainer_lacks
    from trainfit.planner.api import model_workload, plan
    from trainfit.planner.workload import host_memory_bytes
    from trainfit.report.plan import baseline_line, export_check, exported_run_json, plan_json, render_plan

    spec = load_model(model)
    workload = model_workload(spec, gpus=gpus, nodes=nodes, gpus_per_node=gpus_per_node, seq=seq,
                              global_batch=global_batch, tokens_per_step=tokens_per_step)  # fmt: skip
    baseline = baseline_from_flags(spec, run, explicit_flags(), workload)
    result = plan(
        spec,
        gpu,
        workload=workload,
        allow=allow,
        objective=objective,
        price_per_gpu_hour=price_per_gpu_hour,
        headroom=headroom,
        network_gbps=network_gbps,
        top=top,
        alloc_conf=alloc_conf,
        torch_version=torch_version,
        cuda_version=cuda_version,
        history=process_history(build, warm_up, after),
        host_memory_bytes=host_memory_bytes(host_memory_gib),
        baseline=baseline,
    )
    written: tuple[Path, ...] = ()
    exported_run = None
    if export is not None and result.plans:
        files = export_plan(
            spec,
            result.plans[0].strategy,
            alloc_conf=result.plans[0].alloc_conf,
            **export_check(result, gpu, headroom),
        )
        exported_run = files.exported_run
        try:
            written = write_export(files, Path(export))
        except OSError as exc:  # an unwritable or impossible directory: the user's input, one line
            raise ConfigError(f"--export {export}: cannot write there ({exc.strerror or exc})") from None
    # savers only torchtune switches on: said for the top plan (the HF Trainer export cannot carry them)
    notes = hf_trainer_lacks(result.plans[0].strategy) if result.plans else ()
    if json_out:
        ran = {} if exported_run is None else {"exported_run": exported_run_json(exported_run)}
        print_json(plan_json(result) | {"exported": [str(p) for p in written]} | ran)  # each plan's "notes" say it
        return
    render_plan(stdout_console(), result)
    if not workload.batch_given:
        typer.echo(
            f"note: global batch {result.global_batch} sequences of {result.seq_len} tokens (no --global-batch or "
            "--tokens-per-step: 8 per GPU given, the HF Trainer's default per_device_train_batch_size)"
        )
    typer.echo(f"note: {baseline_line(result)}")
    for note in (*result.notes, *notes):
        typer.echo(f"note: {note}")
    if export is not None and not result.plans:
        warn("nothing fits: no configuration exported")
    if exported_run is not None:  # the files cannot say the plan's checkpointing: the run they do say
        if exported_run.fits:
            typer.echo(f"note: {exported_run.note()}")
        else:
            warn(exported_run.note())
    for path in written:
        typer.echo(f"wrote {path}")


plan_cmd = with_run_flags(
    BASELINE_FLAGS,
    panel="Your current run (the baseline; trainfit estimate's flags)",
    own_defaults=("batch", "sharding"),  # the default baseline's: the whole global batch per GPU, DDP over them
)(plan_cmd)


def register(app: typer.Typer) -> None:
    app.command("plan", no_args_is_help=True)(plan_cmd)
