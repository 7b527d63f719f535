"""``trainfit estimate``: parse, call :func:`trainfit.estimate.estimate`, render. No arithmetic here."""

from __future__ import annotations

import copy
import inspect
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from trainfit.arch.spec import ModelSpec
from trainfit.errors import ConfigError, StrategyError
from trainfit.strategy import Strategy

if TYPE_CHECKING:
    from trainfit.history import EarlierRun, ProcessHistory
    from trainfit.imports import ImportedRun

_Command = TypeVar("_Command", bound=Callable[..., Any])


def parse_count(text: str | None, flag: str) -> int | None:
    if text is None:
        return None
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise ConfigError(f"{flag} expects a number such as 1.3e9 or 7000000000, got '{text}'") from None
    if value <= 0 or value != value or value == float("inf"):
        raise ConfigError(f"{flag} must be a positive number, got '{text}'")
    if not value.is_integer():
        raise ConfigError(f"{flag} must be a whole number of parameters, got '{text}'")
    return int(value)


#: The flags of ``trainfit estimate`` that describe the run (the Strategy, and the task head of the model);
#: :func:`strategy_from_flags` takes exactly these, so the CLI and the web page build one thing the same way.
STRATEGY_FLAGS: tuple[str, ...] = (
    "precision", "optimizer", "checkpointing", "attention", "optimizer_impl", "batch", "seq", "grad_accum",
    "gpus", "tp", "pp", "pp_schedule", "virtual_stages", "microbatches", "sequence_parallel", "gpus_per_node",
    "sharding", "offload", "engine", "reshard_after_forward", "sync_each_batch", "sharded_init", "fsdp_wrap",
    "bucket_cap_mb",
    "gradient_as_bucket_view",
    "reduce_bucket_size", "finetune", "lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "dora",
    "adapter_dtype", "base_dtype", "double_quant", "freeze", "loss", "optimizer_in_backward", "activation_offload",
    "paged_optimizer", "head", "num_labels", "fp8",
)  # fmt: skip


def strategy_from_flags(spec: ModelSpec, **flags: Any) -> tuple[ModelSpec, Strategy]:
    """(the model with the requested task head, the Strategy) from the values of :data:`STRATEGY_FLAGS`
    (each as ``trainfit estimate`` declares it, defaults included); bad values raise a one-line error."""
    from trainfit.arch.heads import with_head
    from trainfit.estimate import default_seq_len
    from trainfit.strategy import EngineOptions, MemorySavers, Offload, Parallelism, finetune_setup

    missing = [f for f in STRATEGY_FLAGS if f not in flags]
    if missing or len(flags) != len(STRATEGY_FLAGS):
        raise TypeError(f"strategy_from_flags needs exactly {STRATEGY_FLAGS}; missing {missing}")
    f = flags
    head, num_labels, optimizer, paged_optimizer = f["head"], f["num_labels"], f["optimizer"], f["paged_optimizer"]
    finetune, freeze = f["finetune"], f["freeze"]
    if head is not None or num_labels is not None:
        spec = with_head(spec, head, num_labels)
    if optimizer.startswith("paged-"):  # bitsandbytes' names: paged-adamw-8bit, paged-adamw, paged-lion
        optimizer, paged_optimizer = optimizer.removeprefix("paged-"), True
    loss_impl, loss_chunks = MemorySavers.parse_loss(f["loss"])
    fields: dict[str, Any] = {  # strings are validated and coerced to enums by Strategy
        "precision": f["precision"],
        "optimizer": optimizer,
        "checkpointing": f["checkpointing"],
        "attention": f["attention"],
        "optimizer_impl": f["optimizer_impl"],
        "micro_batch": f["batch"],
        "seq_len": f["seq"] if f["seq"] is not None else default_seq_len(spec),
        "grad_accum": f["grad_accum"],
        "float8": f["fp8"],
        "savers": MemorySavers(
            loss=loss_impl,
            loss_chunks=loss_chunks,
            optimizer_in_backward=f["optimizer_in_backward"],
            activation_offload=f["activation_offload"],
            paged_optimizer=paged_optimizer,
        ),
        "parallelism": Parallelism.for_gpus(
            f["gpus"],
            tensor=f["tp"],
            pipeline=f["pp"],
            pipeline_schedule=f["pp_schedule"],
            virtual_stages=f["virtual_stages"],
            microbatches=f["microbatches"],
            sequence_parallel=f["sequence_parallel"],
            gpus_per_node=f["gpus_per_node"],
        ),
        "sharding": f["sharding"],
        "offload": Offload.parse(f["offload"]),
        "engine": EngineOptions(
            engine=f["engine"],  # a string, validated and coerced by EngineOptions
            reshard_after_forward=f["reshard_after_forward"],
            sync_each_batch=f["sync_each_batch"],
            sharded_init=f["sharded_init"],
            fsdp_wrap=f["fsdp_wrap"],  # a string, validated and coerced by EngineOptions
            bucket_cap_mb=f["bucket_cap_mb"],
            gradient_as_bucket_view=f["gradient_as_bucket_view"],
            reduce_bucket_size=parse_count(str(f["reduce_bucket_size"]), "--reduce-bucket-size") or 0,
        ),
    }
    if finetune != "full" or freeze is not None or f["base_dtype"] is not None:
        if freeze is not None and finetune == "full":
            finetune = "freeze"
        fields["adapter"], fields["base_weights"] = finetune_setup(
            finetune,
            rank=f["lora_rank"],
            alpha=f["lora_alpha"],
            targets=f["lora_targets"],
            dropout=f["lora_dropout"],
            dora=f["dora"],
            adapter_dtype=f["adapter_dtype"],
            base_dtype=f["base_dtype"],
            double_quant=f["double_quant"],
            freeze=freeze or (),
        )
    strategy = Strategy(**fields)
    return spec, strategy


#: The options of the process a run starts in and the releases on the GPU machine, shared by ``trainfit estimate``
#: and ``trainfit plan`` (one help text; the web API reads both commands' signatures, trainfit.web.options).
BuildOption = Annotated[
    str,
    typer.Option(
        "--build",
        help="How the model gets onto the GPU: from-pretrained (from_pretrained, or built on the CPU and moved "
        "with .to('cuda')) | on-device (from_config under torch.device('cuda'): a tied LM head's own weight is "
        "made and freed before training, which can change reserved memory).",
    ),
]
WarmUpOption = Annotated[
    bool,
    typer.Option(
        "--warm-up",
        help="The process ran a small matmul before building the model (its cuBLAS workspace is made then).",
    ),
]
AfterOption = Annotated[
    list[str] | None,
    typer.Option(
        "--after",
        help="An earlier training run in the same process (ended, then torch.cuda.empty_cache()), as MODEL and its "
        "run flags in quotes; repeat in the order they ran. Its cuBLAS workspaces stay and pin their segments. "
        "E.g. --after 'qwen2.5-0.5b --precision amp-bf16 --optimizer-impl foreach -b 4 -s 2048 --build on-device'",
        show_default=False,
    ),
]
TorchVersionOption = Annotated[
    str | None,
    typer.Option(
        "--torch-version",
        help="The torch release on the GPU machine, e.g. 2.11: it decides the cuBLAS/cuBLASLt workspaces "
        "(default: 2.13, the release trainfit is tested with).",
    ),
]
CudaVersionOption = Annotated[
    str | None,
    typer.Option(
        "--cuda-version",
        help="The CUDA release torch was built with, e.g. 12.8: before 11.7 every kernel module loads at "
        "start-up (a larger CUDA context); it must run the --gpu (default: 13.0, the H200 measurement's).",
    ),
]
#: ``--host-memory-gib``, one declaration for ``trainfit estimate`` and ``trainfit plan`` (and so the web API's field of
#: each): converted and checked by :func:`trainfit.planner.workload.host_memory_bytes` (a finite positive number, else
#: one line and exit 2), held to by the same rule (:func:`trainfit.planner.rank.host_usable_bytes`).
HostMemoryOption = Annotated[
    float | None,
    typer.Option(
        "--host-memory-gib",
        help="CPU memory per node in GiB, less --headroom, for the host memory per node the estimate counts "
        "(offloaded optimizer states and parameters, pinned buffers, offloaded activations, paged optimizer "
        "states). plan: rules out the plans that exceed it (the table shows each plan's host GiB/node when any "
        "offloads). estimate (with --gpu): the verdict says DOES NOT FIT the host when the run exceeds it (JSON "
        "host_fits; fits, verdict and the largest micro-batch stay the GPU's), and the checked fixes keep within it "
        "(default: not limited).",
    ),
]


def estimate_cmd(
    model: Annotated[
        str | None, typer.Argument(help="Catalog slug, config.json (file or folder), or Hub repo id.")
    ] = None,
    gpu: Annotated[
        str | None, typer.Option("--gpu", help="Catalog GPU id for a fit verdict (see 'trainfit gpus').")
    ] = None,
    batch: Annotated[int, typer.Option("--batch", "-b", help="Micro-batch size per GPU.")] = 1,
    seq: Annotated[
        int | None,
        typer.Option(
            "--seq", "-s", help="Sequence length in tokens (default 2048, or the model's context if shorter)."
        ),
    ] = None,
    precision: Annotated[
        str, typer.Option(help="fp32 | amp-bf16 | amp-fp16 | master-bf16 | master-fp16 | pure-bf16")
    ] = "amp-bf16",
    optimizer: Annotated[
        str,
        typer.Option(help="adamw | adamw-8bit | sgd | sgd-momentum | adafactor | lion (paged-*: bitsandbytes paged)"),
    ] = "adamw",
    checkpointing: Annotated[
        str,
        typer.Option(
            help="Activation checkpointing: none | full | sqrt | selective (attention core only) | "
            "sac (torchtitan's per-op policy)"
        ),
    ] = "none",
    attention: Annotated[str, typer.Option(help="Attention kernel: sdpa (flash/mem-efficient) | eager")] = "sdpa",
    optimizer_impl: Annotated[
        str, typer.Option("--optimizer-impl", help="fused (HF Trainer default) | foreach (torch's own default).")
    ] = "fused",
    grad_accum: Annotated[int, typer.Option("--grad-accum", help="Gradient accumulation steps.")] = 1,
    fp8: Annotated[
        str,
        typer.Option(
            "--fp8",
            help="FP8 training of the blocks' linears (torchao Float8Linear, as torchtitan runs it; compute "
            "capability >= 8.9): none | tensorwise.",
        ),
    ] = "none",
    headroom: Annotated[float, typer.Option(help="Fraction of GPU memory kept free (article: 0.3).")] = 0.30,
    method: Annotated[str, typer.Option(help="analytic | rule-of-thumb | trace | measure")] = "analytic",
    modules: Annotated[bool, typer.Option("--modules", help="trace: per-module saved-activation table.")] = False,
    gpus: Annotated[int, typer.Option("--gpus", help="World size: GPUs in the job (data × tensor × pipeline).")] = 1,
    tp: Annotated[
        int, typer.Option("--tp", help="Tensor-parallel degree (Megatron; DTensor with --engine torch).")
    ] = 1,
    pp: Annotated[int, typer.Option("--pp", help="Pipeline-parallel degree (Megatron).")] = 1,
    pp_schedule: Annotated[str, typer.Option("--pp-schedule", help="1f1b | interleaved | gpipe")] = "1f1b",
    virtual_stages: Annotated[
        int, typer.Option("--virtual-stages", help="Model chunks per pipeline rank (interleaved).")
    ] = 1,
    microbatches: Annotated[int, typer.Option("--microbatches", help="Micro-batches per step in the pipeline.")] = 1,
    sequence_parallel: Annotated[
        bool, typer.Option("--sequence-parallel", help="Sequence parallelism (needs --tp > 1).")
    ] = False,
    sharding: Annotated[str, typer.Option(help="none | ddp | zero1 | zero2 | zero3 | fsdp | hsdp")] = "none",
    reshard_after_forward: Annotated[
        bool,
        typer.Option("--reshard-after-forward/--no-reshard-after-forward", help="FSDP2: free layers after forward."),
    ] = True,
    sync_each_batch: Annotated[
        bool,
        typer.Option(
            "--sync-each-batch/--no-sync-each-batch",
            help="FSDP2 with --grad-accum: reduce-scatter every micro-step (accelerate's sync_each_batch); "
            "--no-sync-each-batch: the HF Trainer's default no_sync, unsharded gradients held to the last.",
        ),
    ] = True,
    sharded_init: Annotated[
        bool,
        typer.Option(
            "--sharded-init",
            help="FSDP2: the model is built on the meta device and sharded before its weights exist (torchtitan); "
            "default: wrapped after loading (accelerate, the HF Trainer), each group's whole weights on the GPU "
            "while fully_shard splits them.",
        ),
    ] = False,
    fsdp_wrap: Annotated[
        str,
        typer.Option(
            "--fsdp-wrap",
            help="FSDP2's units: auto (units where the analytic model has them, else root; a note says which) | "
            "units (each layer, the embedding and [final norm, head] as units, then the root: torchtitan, accelerate "
            "1.15) | root (each layer, then the root holding embeddings, final norm and head: accelerate before 1.15).",
        ),
    ] = "auto",
    offload: Annotated[str, typer.Option(help="CPU offload: none | optimizer | optimizer+params")] = "none",
    engine: Annotated[
        str, typer.Option(help="auto | torch (ddp, fsdp) | deepspeed (zero*) | megatron (tp, pp, zero1)")
    ] = "auto",
    bucket_cap_mb: Annotated[int, typer.Option("--bucket-cap-mb", help="DDP bucket size (MiB).")] = 25,
    gradient_as_bucket_view: Annotated[
        bool, typer.Option("--gradient-as-bucket-view", help="DDP: gradients are views of the buckets.")
    ] = False,
    reduce_bucket_size: Annotated[
        float, typer.Option("--reduce-bucket-size", help="DeepSpeed reduce bucket (elements).")
    ] = 5e8,
    gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", help="HSDP shard group; host memory per node.")] = 8,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
    alloc_conf: Annotated[
        str | None,
        typer.Option(
            "--alloc-conf",
            help="PYTORCH_CUDA_ALLOC_CONF to simulate, e.g. expandable_segments:True (default: the environment's).",
        ),
    ] = None,
    segments: Annotated[
        bool, typer.Option("--segments", help="Show the simulated allocator segments at the reserved peak.")
    ] = False,
    build: BuildOption = "from-pretrained",
    warm_up: WarmUpOption = False,
    after: AfterOption = None,
    torch_version: TorchVersionOption = None,
    cuda_version: CudaVersionOption = None,
    fixes: Annotated[
        bool,
        typer.Option(
            "--fixes/--no-fixes",
            help="With --gpu, when it does not fit (the GPU, or the host under --host-memory-gib): search the "
            "planner's top three checked fixes (--no-fixes: faster).",
        ),
    ] = True,
    host_memory_gib: HostMemoryOption = None,
    explain: Annotated[
        bool,
        typer.Option("--explain", "-v", help="Also show bytes per parameter, the rule-of-thumb comparison and notes."),
    ] = False,
    finetune: Annotated[
        str, typer.Option("--finetune", help="full | lora | qlora (nf4 base + LoRA) | freeze (with --freeze).")
    ] = "full",
    lora_rank: Annotated[int, typer.Option("--lora-rank", help="LoRA rank r.")] = 16,
    lora_alpha: Annotated[int | None, typer.Option("--lora-alpha", help="LoRA alpha (default 2·rank).")] = None,
    lora_targets: Annotated[
        str, typer.Option("--lora-targets", help="Module names as PEFT spells them (q_proj,v_proj) or all-linear.")
    ] = "all-linear",
    lora_dropout: Annotated[float, typer.Option("--lora-dropout", help="LoRA dropout probability.")] = 0.0,
    dora: Annotated[
        bool,
        typer.Option(
            "--dora", help="DoRA (PEFT use_dora=True) instead of LoRA (a float or bitsandbytes base; qlora: QDoRA)."
        ),
    ] = False,
    adapter_dtype: Annotated[
        str, typer.Option("--adapter-dtype", help="fp32 (PEFT's default on a 16-bit base) | bf16 | fp16.")
    ] = "fp32",
    base_dtype: Annotated[
        str | None,
        typer.Option("--base-dtype", help="Frozen base storage: bf16 | fp16 | fp32 | int8 | nf4 | fp4."),
    ] = None,
    double_quant: Annotated[
        bool, typer.Option("--double-quant/--no-double-quant", help="4-bit base: quantise the absmax constants.")
    ] = True,
    freeze: Annotated[
        str | None,
        typer.Option("--freeze", help="With --finetune freeze: embeddings, lm_head, norm, module names, layers:0-15."),
    ] = None,
    loss: Annotated[
        str,
        typer.Option("--loss", help="standard | chunked[:N] (torchtune) | fused-linear (Liger): no full fp32 logits."),
    ] = "standard",
    optimizer_in_backward: Annotated[
        bool, typer.Option("--optimizer-in-backward", help="Step each parameter as its gradient arrives (torchtune).")
    ] = False,
    activation_offload: Annotated[
        bool, typer.Option("--activation-offload", help="Saved activations to pinned host memory (torchtune).")
    ] = False,
    paged_optimizer: Annotated[
        bool,
        typer.Option("--paged-optimizer", help="bitsandbytes paged optimizer: states in CUDA unified memory."),
    ] = False,
    head: Annotated[
        str | None,
        typer.Option("--head", help="Task head: causal-lm | masked-lm | seq-cls | token-cls | none (default: config)."),
    ] = None,
    num_labels: Annotated[
        int | None, typer.Option("--num-labels", help="Classes of a seq-cls/token-cls head (default: config, else 2).")
    ] = None,
    from_path: Annotated[
        str | None,
        typer.Option(
            "--from",
            help="Estimate the run a config file describes: a DeepSpeed ds_config.json, an accelerate config "
            "(.yaml) or TrainingArguments JSON (docs/imports.md). Flags given explicitly override the file.",
        ),
    ] = None,
    params: Annotated[str | None, typer.Option("--params", help="What-if: total parameters, e.g. 1.3e9.")] = None,
    hidden_size: Annotated[int | None, typer.Option("--hidden-size", help="What-if: hidden size.")] = None,
    num_layers: Annotated[int | None, typer.Option("--num-layers", help="What-if: number of layers.")] = None,
    num_heads: Annotated[int | None, typer.Option("--num-heads", help="What-if: attention heads.")] = None,
    num_kv_heads: Annotated[int | None, typer.Option("--num-kv-heads", help="What-if: KV heads (GQA).")] = None,
    vocab_size: Annotated[int | None, typer.Option("--vocab-size", help="What-if: vocabulary size.")] = None,
    intermediate_size: Annotated[int | None, typer.Option("--intermediate-size", help="What-if: MLP width.")] = None,
) -> None:
    """Estimate GPU memory for training MODEL: each component in GiB, the phase of the peak,
    bytes per parameter, and with --gpu whether it fits and the largest micro-batch that does.

    Examples:

      trainfit estimate llama-3.1-8b --gpu a100-sxm-80gb --batch 4 --seq 2048 --precision amp-bf16

      trainfit estimate ./my-model/config.json --gpu rtx-4090 --checkpointing full --optimizer adamw-8bit

      trainfit estimate --params 1.3e9 --hidden-size 2048 --num-layers 24 --batch 4 --seq 1024 --method rule-of-thumb

      trainfit estimate llama-3.1-70b --gpus 64 --tp 8 --pp 4 --sequence-parallel --microbatches 16

      trainfit estimate mistral-7b-v0.1 --finetune qlora --lora-rank 64 --lora-targets q_proj,v_proj --gpu rtx-4090

      trainfit estimate llama-3.1-8b --from ds_config.json --gpus 8 --batch 4 --grad-accum 2 --gpu h100-sxm-80gb

      trainfit estimate llama-3.2-1b --precision pure-bf16 --checkpointing full -b 4 -s 2048 --gpu h200-sxm-141gb
      --build on-device --warm-up --after 'qwen2.5-0.5b --optimizer-impl foreach -b 4 -s 2048 --build on-device'
    """
    from trainfit.arch import explicit_model, load_model
    from trainfit.cli.common import print_json, stdout_console, warn
    from trainfit.estimate import estimate
    from trainfit.planner.workload import host_memory_bytes
    from trainfit.report.json import report_json
    from trainfit.report.table import render
    from trainfit.result import Method

    host_limit = host_memory_bytes(host_memory_gib)  # a bad value: one line before any model is loaded
    explicit = [params, hidden_size, num_layers]
    if model is not None and any(v is not None for v in explicit):
        raise ConfigError("give either MODEL or --params/--hidden-size/--num-layers, not both")
    if model is None:
        if any(v is None for v in explicit):
            raise ConfigError(
                "give a MODEL (catalog slug, config.json or Hub id; see 'trainfit models') or all of "
                "--params, --hidden-size and --num-layers"
            )
        assert hidden_size is not None and num_layers is not None
        spec = explicit_model(
            params=parse_count(params, "--params") or 0,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            vocab_size=vocab_size,
            intermediate_size=intermediate_size,
        )
    else:
        spec = load_model(model)
    flags = dict(locals())  # before any comprehension: its own scope would have its own locals()
    imported = None
    if from_path is not None:
        spec, strategy, imported = strategy_from_file(spec, from_path, flags, explicit_flags())
    else:
        spec, strategy = strategy_from_flags(spec, **{name: flags[name] for name in STRATEGY_FLAGS})
    refuse_inapplicable(strategy, explicit_flags())
    try:
        m = Method(method)
    except ValueError:
        raise StrategyError(f"unknown method '{method}'; choose one of: {', '.join(x.value for x in Method)}") from None
    options: dict[str, object] | None = None
    if m in (Method.TRACE, Method.MEASURE):
        options = {"modules": modules} if m is Method.TRACE else {}
    elif modules:
        raise StrategyError("--modules needs --method trace")
    with _progress(enabled=options is not None and not json_out) as progress:
        if options is not None and progress is not None:
            options["progress"] = progress
        report = estimate(
            spec,
            strategy,
            history=process_history(build, warm_up, after),
            method=m,
            gpu=gpu,
            headroom=headroom,
            method_options=options or None,
            allocator=alloc_conf,
            allocator_layout=segments,
            torch_version=torch_version,
            cuda_version=cuda_version,
            fixes=fixes,
            host_memory_bytes=host_limit,
        )
    for w in report.warnings:
        warn(w)
    if json_out:
        out = report_json(report)
        if imported is not None:
            out["imported"] = imported.as_dict()
        print_json(out)
        return
    if imported is not None:
        render_imported(imported, {name: flags[name] for name in STRATEGY_FLAGS}, explicit_flags(), strategy)
    render(stdout_console(), report, verbose=explain)


def with_run_flags(
    names: tuple[str, ...], *, panel: str | None = None, own_defaults: tuple[str, ...] = ()
) -> Callable[[_Command], _Command]:
    """Give a command :func:`estimate_cmd`'s own declarations of the run flags ``names`` — the same parameters of
    its signature: flag, help, type and default — after the command's own; the command takes them as ``**flags``.
    ``trainfit plan`` describes the user's run with them (its baseline), so a flag is declared once and reads
    alike in both commands, in both helps and in the web API (which reads the commands' signatures). ``panel``:
    the help section they are listed under (a copy of each declaration with ``rich_help_panel`` set);
    ``own_defaults``: flags whose default the command decides when they are not given (the help shows none)."""

    def declared(param: inspect.Parameter) -> inspect.Parameter:
        if (panel is None and param.name not in own_defaults) or typing.get_origin(param.annotation) is not Annotated:
            return param
        base, *meta = typing.get_args(param.annotation)
        for i, m in enumerate(meta):
            if isinstance(m, typer.models.OptionInfo):
                meta[i] = copy.copy(m)  # estimate's own declaration stays as it is
                if panel is not None:
                    meta[i].rich_help_panel = panel
                if param.name in own_defaults:
                    meta[i].show_default = False
        return param.replace(annotation=Annotated[(base, *meta)])

    def wrap(fn: _Command) -> _Command:
        own = inspect.signature(fn, eval_str=True)
        theirs = inspect.signature(estimate_cmd, eval_str=True).parameters
        clash = sorted(set(names) & set(own.parameters))
        if clash:
            raise TypeError(f"{fn.__name__} already declares {clash}")
        params = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        fn.__signature__ = own.replace(parameters=[*params, *(declared(theirs[n]) for n in names)])  # type: ignore[attr-defined]
        return fn

    return wrap


def estimate_defaults() -> dict[str, Any]:
    """Every :func:`estimate_cmd` parameter's default, by name (what a flag not given stands for)."""
    return {n: p.default for n, p in inspect.signature(estimate_cmd).parameters.items()}


#: What ``--after`` takes besides :data:`STRATEGY_FLAGS`: the earlier run's model and how it was built. The GPU,
#: the allocator setting and the method are the process's (this command's own flags).
AFTER_FLAGS: frozenset[str] = frozenset({"model", "build", *STRATEGY_FLAGS})


def process_history(build: str, warm_up: bool, after: list[str] | None) -> ProcessHistory:
    """``--build``, ``--warm-up`` and ``--after`` as a :class:`~trainfit.history.ProcessHistory` (``trainfit estimate``,
    ``trainfit plan`` and the web API build it the same way)."""
    from trainfit.history import Build, ProcessHistory

    return ProcessHistory(build=Build.parse(build), warm_up=warm_up, after=earlier_runs(after or []))


@cache
def _estimate_command() -> Any:
    """``trainfit estimate``'s click command: what parses an ``--after`` value, whichever command (or the web API)
    was given it."""
    app = typer.Typer(add_completion=False)
    app.command("estimate")(estimate_cmd)
    return typer.main.get_command(app)


def earlier_runs(values: list[str]) -> tuple[EarlierRun, ...]:
    """``--after`` values: each a run's MODEL and flags as ``trainfit estimate`` takes them, parsed by that
    command's own parser (its defaults included) and built by :func:`strategy_from_flags`."""
    import shlex

    from trainfit.arch import load_model
    from trainfit.history import Build, EarlierRun

    try:
        from typer._click import exceptions as click_errors
    except ImportError:  # pragma: no cover - older typer re-exports click's
        from click import exceptions as click_errors  # type: ignore[no-redef]

    if not values:
        return ()
    command = _estimate_command()
    out: list[EarlierRun] = []
    for value in values:
        try:
            args = shlex.split(value)
            if "--help" in args or "-h" in args:  # click would print the help and exit mid-command
                raise ConfigError(f"--after '{value}': --help is not a run flag (see 'trainfit estimate --help')")
            ctx = command.make_context("--after", args)
        except ValueError as exc:
            raise ConfigError(f"--after '{value}': {exc}") from None
        except click_errors.ClickException as exc:
            raise ConfigError(f"--after '{value}': {' '.join(exc.format_message().split())}") from None
        given = {
            name
            for name in ctx.params
            if (src := ctx.get_parameter_source(name)) is not None and src.name == "COMMANDLINE"
        }
        if "after" in given:
            raise ConfigError(f"--after '{value}': repeat --after for each earlier run, in order, not inside another")
        other = sorted(given - AFTER_FLAGS)
        if other:
            flags = ", ".join("--" + n.replace("_", "-") for n in other)
            raise ConfigError(
                f"--after '{value}': {flags} belongs to the whole process; give it outside --after "
                "(--after takes a model and its run flags)"
            )
        if ctx.params["model"] is None:
            raise ConfigError(f"--after '{value}': give the earlier run's MODEL first, e.g. --after 'gpt2 -b 8'")
        spec, strategy = strategy_from_flags(
            load_model(ctx.params["model"]), **{name: ctx.params[name] for name in STRATEGY_FLAGS}
        )
        try:  # as the command's own flags: a framework's flag for a run it does not apply to is refused
            refuse_inapplicable(strategy, frozenset(given))
        except StrategyError as exc:
            raise StrategyError(f"--after '{value}': {exc}") from None
        out.append(EarlierRun(model=spec, strategy=strategy, build=Build.parse(ctx.params["build"])))
    return tuple(out)


def refuse_inapplicable(strategy: Strategy, explicit: frozenset[str]) -> None:
    """A framework's flag given explicitly for a run it does not apply to (``--no-reshard-after-forward`` with
    ``--sharding zero2``, ``--bucket-cap-mb`` under FSDP2, ``--microbatches`` without ``--pp``…) is refused in one
    line, even at its default value: it would be ignored silently. The library refuses only values other than the
    default (:func:`trainfit.analytic.parallel.check_options`), having no way to tell a default given on purpose."""
    from trainfit.analytic.parallel import inapplicable_options

    bad = {**inapplicable_options(strategy), **_inapplicable_finetune_flags(strategy, explicit)}
    for name in STRATEGY_FLAGS:
        if name in explicit and name in bad:
            raise StrategyError(bad[name])


#: The flags that shape a LoRA/DoRA adapter: they do nothing without one (``--finetune full`` or ``freeze``).
_ADAPTER_FLAGS = ("lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "dora", "adapter_dtype")


def _inapplicable_finetune_flags(strategy: Strategy, explicit: frozenset[str]) -> dict[str, str]:
    """The fine-tuning flags that do nothing for ``strategy`` in a command that names no ``--finetune`` (the flag
    forgotten), each with its refusal: the adapter's without an adapter, ``--double-quant`` without a 4-bit base
    (bitsandbytes' ``bnb_4bit_use_double_quant`` quantises the 4-bit blocks' absmax constants) unless
    ``--base-dtype`` is named. A command that names ``--finetune`` keeps them: a plan's changes appended to the
    user's LoRA command (``--finetune full without --base-dtype``) leave its ``--lora-rank`` behind."""
    from trainfit.strategy import Quantization

    if "finetune" in explicit:
        return {}
    out = {}
    if strategy.adapter is None:
        kind = "freeze (by --freeze)" if strategy.base_weights.frozen else "full"
        for name in _ADAPTER_FLAGS:
            flag = f"--{name.replace('_', '-')}"
            out[name] = (
                f"{flag} shapes a LoRA adapter; this run is --finetune {kind}: add --finetune lora|qlora or drop {flag}"
            )
    four_bit = strategy.base_weights.quantization in (Quantization.NF4, Quantization.FP4)
    if not four_bit and "base_dtype" not in explicit:
        out["double_quant"] = (
            "--double-quant/--no-double-quant quantises a 4-bit base's absmax constants: it needs --finetune qlora "
            "or --base-dtype nf4|fp4"
        )
    return out


def explicit_flags() -> frozenset[str]:
    """The parameters of the running command given on the command line (or by environment), not defaulted."""
    try:
        from typer._click.globals import get_current_context
    except ImportError:  # pragma: no cover - older typer re-exports click's
        from click import get_current_context  # type: ignore[no-redef]
    ctx = get_current_context(silent=True)
    if ctx is None:
        return frozenset()
    return frozenset(
        name
        for name in ctx.params
        if (src := ctx.get_parameter_source(name)) is not None and src.name in ("COMMANDLINE", "ENVIRONMENT")
    )


def strategy_from_file(
    spec: ModelSpec, path: str, flags: dict[str, Any], explicit: frozenset[str]
) -> tuple[ModelSpec, Strategy, ImportedRun]:
    """``--from PATH``: the file's settings (:func:`trainfit.imports.import_config`) with the explicitly given
    flags laid over them, built by :func:`strategy_from_flags` like any other run; the ZeRO bucket settings
    that have no flag are taken from the file. Returns the model, the Strategy and the ``ImportedRun``."""
    from dataclasses import replace

    from trainfit.imports import import_config

    def given(name: str) -> Any:
        return flags[name] if name in explicit else None

    imported = import_config(
        path,
        gpus=given("gpus"),
        micro_batch=given("batch"),
        grad_accum=given("grad_accum"),
        precision=given("precision"),
        seq_len=given("seq"),
        hidden_size=spec.hidden_size,
    )
    from trainfit.analytic.parallel import inapplicable_options
    from trainfit.imports.result import ImportedSetting, show

    merged = {name: flags[name] for name in STRATEGY_FLAGS}
    for name, value in imported.flags:
        if name not in explicit:
            merged[name] = value
    spec, strategy = strategy_from_flags(spec, **merged)
    # A file's setting for another framework than the run's (a TrainingArguments' ddp_bucket_cap_mb beside its FSDP
    # config, a DeepSpeed file run with an explicit --sharding fsdp) is not applied, and said so, rather than refused.
    bad = inapplicable_options(strategy)
    dropped = [(name, value) for name, value in imported.flags if name in bad and name not in explicit]
    dropped += [(name, value) for name, value in imported.engine_extras if name in bad]
    if dropped:
        for name, _value in dropped:
            if name in merged:  # a flag: back to the command's own (default) value; an engine extra is left out
                merged[name] = flags[name]
        spec, strategy = strategy_from_flags(spec, **merged)
        notes = tuple(
            ImportedSetting(key=f"({name})", value=show(v), meaning=f"not applied: {bad[name]}") for name, v in dropped
        )
        imported = replace(imported, ignored=imported.ignored + notes)
    extras = {name: v for name, v in imported.engine_extras if name not in bad}
    if extras:
        strategy = replace(strategy, engine=replace(strategy.engine, **extras))
    return spec, strategy, imported


def render_imported(imported: ImportedRun, flags: dict[str, Any], explicit: frozenset[str], strategy: Strategy) -> None:
    """What ``--from`` used and ignored, one line each, before the report."""
    from rich.markup import escape

    from trainfit.cli.common import stdout_console

    console = stdout_console()

    def say(text: str) -> None:
        console.print(text, highlight=False, soft_wrap=True)

    say(f"[bold]from {escape(imported.source)}[/bold] ({imported.kind.value}):")
    for s in imported.used:
        say(f"  used    {escape(s.key)}={escape(s.value)} → {escape(s.meaning)}")
    for s in imported.ignored:
        say(f"  ignored {escape(s.key)}={escape(s.value)}: {escape(s.meaning)}")
    from_file = dict(imported.flags)
    over = sorted(n for n in explicit & set(from_file) if n in STRATEGY_FLAGS and flags[n] != from_file[n])
    if over:
        say("  overridden by flags: " + ", ".join(f"--{n.replace('_', '-')} {flags[n]}" for n in over))
    unset = [
        f"--{n.replace('_', '-')} {v}"
        for n, v in (("batch", strategy.micro_batch), ("seq", strategy.seq_len), ("grad_accum", strategy.grad_accum))
        if n not in from_file and n not in explicit
    ]
    if unset:
        say("  not in the file (defaults): " + ", ".join(unset))
    say("")


@contextmanager
def _progress(*, enabled: bool) -> Iterator[Callable[[str, float], None] | None]:
    """A rich progress bar on stderr for trace/measure runs (transient: gone once the report prints).

    Only on a terminal: off one, rich's transient bar still writes a newline when it stops, so a refusal
    raised inside the run printed a blank line before its one-line error."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if not console.is_terminal:
        yield None
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task("starting", total=1.0)

        def update(message: str, fraction: float) -> None:
            bar.update(task, description=message, completed=max(0.0, min(1.0, fraction)))

        yield update


def register(app: typer.Typer) -> None:
    app.command("estimate", no_args_is_help=False)(estimate_cmd)
