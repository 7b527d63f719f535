"""HF ``TrainingArguments`` saved as JSON (``args.to_json_string()``, or the keyword arguments a script passes)
as the run trainfit models, validated by constructing ``transformers.TrainingArguments`` itself.

The arguments are built with ``use_cpu=True`` (and without ``tf32``) unless the file says otherwise, because
``TrainingArguments`` refuses ``bf16``/``tf32`` on a machine without a suitable GPU and trainfit usually runs on
one that has none; neither changes memory. ``deepspeed`` (a path or a dict) is taken out and read by
:func:`trainfit.imports.deepspeed.strategy_from_deepspeed`, its ``"auto"`` values answered by these arguments
exactly as the Trainer answers them (batch, accumulation, ``bf16``/``fp16``).

Mapping: ``per_device_train_batch_size`` → ``--batch``; ``gradient_accumulation_steps`` → ``--grad-accum``;
``bf16`` → ``amp-bf16``, ``fp16`` → ``amp-fp16`` (autocast over the loaded weights; a model loaded in bf16 is
``pure-bf16``, which the file cannot say — the Trainer callback sees it), neither → ``fp32``;
``gradient_checkpointing`` / ``activation_checkpointing`` → ``--checkpointing full`` (``every_n_layers`` > 1 and
``offload`` in its kwargs are refused: not modelled); ``optim`` → :data:`OPTIMIZERS`; ``fsdp`` +
``fsdp_config`` (version 2) → ``--sharding fsdp`` with ``reshard_after_forward``, ``cpu_offload`` and
``activation_checkpointing``; ``ddp_bucket_cap_mb`` → ``--bucket-cap-mb``. The world size is not in the
arguments: ``gpus`` (``--gpus``); more than one GPU without FSDP or DeepSpeed is DDP, as the Trainer wraps it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from trainfit.errors import ConfigError, DependencyError
from trainfit.imports.deepspeed import load_json, strategy_from_deepspeed
from trainfit.imports.result import ConfigKind, Draft, ImportedRun, refuse

#: TrainingArguments.optim → (trainfit --optimizer, --optimizer-impl or None). transformers'
#: ``OptimizerNames`` (training_args.py) and trainer_optimizer.py: adamw_torch is torch.optim.AdamW with torch's
#: default implementation (foreach on CUDA), adamw_torch_fused passes fused=True, the bnb names are
#: bitsandbytes' AdamW/Lion with 8-bit or 32-bit states, paged_* their paged versions, sgd torch.optim.SGD
#: (no momentum unless optim_args give it), adafactor transformers' Adafactor.
OPTIMIZERS: dict[str, tuple[str, str | None]] = {
    "adamw_torch": ("adamw", "foreach"),
    "adamw_torch_fused": ("adamw", "fused"),
    "adamw_apex_fused": ("adamw", "fused"),
    "adamw_bnb_8bit": ("adamw-8bit", None),
    "adamw_8bit": ("adamw-8bit", None),
    "paged_adamw_8bit": ("paged-adamw-8bit", None),
    "paged_adamw_32bit": ("paged-adamw", None),
    "lion_32bit": ("lion", None),
    "paged_lion_32bit": ("paged-lion", None),
    "adafactor": ("adafactor", None),
    "sgd": ("sgd", None),
}

_NO_MEMORY_EFFECT = (
    "output_dir", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
    "num_train_epochs", "max_steps", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio",
    "logging_steps", "logging_strategy", "logging_dir", "logging_first_step", "save_steps", "save_strategy",
    "save_total_limit", "seed", "data_seed", "run_name", "report_to", "eval_strategy", "eval_steps",
    "per_device_eval_batch_size", "dataloader_num_workers", "push_to_hub", "hub_model_id", "hub_token",
    "disable_tqdm", "remove_unused_columns", "label_names", "do_train", "do_eval", "do_predict",
)  # fmt: skip


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """TrainingArguments logs deprecations and advice through transformers' logger and warnings."""
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


def strategy_from_training_args(
    source: str | Path | Mapping[str, Any],
    *,
    gpus: int | None = None,
    seq_len: int | None = None,
    hidden_size: int | None = None,
    label: str | None = None,
) -> ImportedRun:
    """The run the TrainingArguments in ``source`` (a JSON path, a dict, or a ``TrainingArguments``) describe."""
    if isinstance(source, Mapping):
        raw, name, base = dict(source), label or "training arguments", Path.cwd()
    elif isinstance(source, (str, Path)):
        path = Path(source)
        name = label or path.name
        raw, base = load_json(path, name), path.parent
    else:  # a live TrainingArguments (the Trainer callback)
        return _from_args(source, {}, Draft(source=label or "TrainingArguments", kind=ConfigKind.TRAINING_ARGS),
                          gpus, seq_len, hidden_size, Path.cwd())  # fmt: skip
    try:
        from trainfit.trace._deps import import_bitsandbytes_offline, import_torchao_quietly

        import_bitsandbytes_offline()  # transformers (and torchao) import bitsandbytes: without the kernel hub
        import_torchao_quietly()  # transformers imports torchao when it is installed; its import logs noise
        from transformers import TrainingArguments
    except ImportError:
        raise DependencyError("reading TrainingArguments needs transformers: pip install transformers") from None
    d = Draft(source=name, kind=ConfigKind.TRAINING_ARGS)
    fields = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in fields:
            d.ignore(key, value, "not a TrainingArguments field in this transformers")
        elif key == "tf32":
            if value:
                d.ignore(key, value, "matmul precision: no effect on memory")
        elif key == "use_cpu":
            if value:
                d.ignore(key, value, "trainfit estimates the run on a GPU")
        elif key == "deepspeed":
            kwargs["_deepspeed"] = value
        else:
            kwargs[key] = value
    ds = kwargs.pop("_deepspeed", None)
    kwargs["use_cpu"] = True  # construction only: bf16=True is refused on a machine without a bf16 GPU
    kwargs.setdefault("output_dir", "trainfit_import")
    try:
        with _quiet():
            args = TrainingArguments(**kwargs)
    except (ValueError, TypeError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{name}: TrainingArguments refuses it: {first}") from None
    return _from_args(args, {**raw, "deepspeed": ds} if ds is not None else raw, d, gpus, seq_len, hidden_size, base)


def _from_args(
    args: Any,
    raw: Mapping[str, Any],
    d: Draft,
    gpus: int | None,
    seq_len: int | None,
    hidden_size: int | None,
    base: Path,
) -> ImportedRun:
    """Fill ``d`` from a constructed TrainingArguments (``raw``: the file as written, for the listing)."""
    src = d.source

    def written(key: str, default: Any) -> Any:
        return raw.get(key, default) if raw else default

    micro, gas = int(args.per_device_train_batch_size), int(args.gradient_accumulation_steps)
    d.use("per_device_train_batch_size", written("per_device_train_batch_size", micro), "batch", micro)
    d.use("gradient_accumulation_steps", written("gradient_accumulation_steps", gas), "grad_accum", gas)
    ds = raw.get("deepspeed") if raw else getattr(args, "deepspeed", None)
    precision = "amp-bf16" if args.bf16 else "amp-fp16" if args.fp16 else "fp32"
    key = "bf16" if args.bf16 else "fp16" if args.fp16 else "bf16/fp16"
    if ds:
        d.note(key, bool(args.bf16 or args.fp16), 'answers the DeepSpeed config\'s bf16/fp16 "auto" (below)')
    else:
        d.use(key, bool(args.bf16 or args.fp16), "precision", precision,
              note="autocast over the loaded weights" if precision != "fp32" else "neither is set")  # fmt: skip
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in OPTIMIZERS:
        raise refuse(src, f"optim {optim!r} has no trainfit optimizer; modelled: {', '.join(OPTIMIZERS)}")
    name, impl = OPTIMIZERS[optim]
    d.use("optim", written("optim", optim), "optimizer", name)
    if impl is not None:
        d.flags["optimizer_impl"] = impl
        d.used[-1] = dataclasses.replace(d.used[-1], meaning=f"{d.used[-1].meaning} --optimizer-impl {impl}")
    ckpt = bool(getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False))
    ckpt_kwargs = getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs or {}
    if ckpt:
        if int(ckpt_kwargs.get("every_n_layers", 1)) != 1:
            raise refuse(src, "activation_checkpointing_kwargs.every_n_layers > 1 (some layers unchecked) is not "
                         "modelled; trainfit checkpoints every layer (--checkpointing full) or none")  # fmt: skip
        if ckpt_kwargs.get("offload"):
            raise refuse(src, "activation_checkpointing_kwargs.offload (checkpoints in host memory) is not modelled")
        key = "activation_checkpointing" if "activation_checkpointing" in raw else "gradient_checkpointing"
        d.use(key, True, "checkpointing", "full", note="every decoder layer")
    for k, v in ckpt_kwargs.items():
        if k not in ("every_n_layers", "offload"):
            d.ignore(f"activation_checkpointing_kwargs.{k}", v, "passed to torch.utils.checkpoint: not modelled")
    if getattr(args, "use_liger_kernel", False):
        _liger(args, d)
    if args.torch_compile:
        d.ignore("torch_compile", True, "torch.compile may fuse kernels and save activations; trainfit estimates eager")
    if args.ddp_bucket_cap_mb is not None:
        d.use("ddp_bucket_cap_mb", args.ddp_bucket_cap_mb, "bucket_cap_mb", int(args.ddp_bucket_cap_mb))
    if args.fsdp and ds:
        raise refuse(src, "both fsdp and deepspeed are set")
    if args.fsdp:
        _fsdp(args, d)
    elif ds:
        _deepspeed(ds, args, d, gpus, hidden_size, base)
    if gpus is not None and "gpus" not in d.flags:
        d.flags["gpus"] = gpus
        if gpus > 1 and "sharding" not in d.flags:
            d.note("(world size)", gpus, f"--gpus {gpus} --sharding ddp (the Trainer wraps the model in DDP)")
            d.flags["sharding"] = "ddp"
    ignored = {s.key for s in d.ignored}
    for key in _NO_MEMORY_EFFECT:
        if raw and key in raw and key != "output_dir" and key not in ignored:
            d.ignore(key, raw[key], "no effect on memory")
    return d.finish(seq_len=seq_len)


def _liger(args: Any, d: Draft) -> None:
    """``use_liger_kernel``: the Trainer calls ``apply_liger_kernel(model, liger_kernel_config)``; each
    ``apply_liger_kernel_to_*`` defaults its kernels on (rope, swiglu, rms_norm, fused linear cross-entropy).
    trainfit models the fused linear cross-entropy (``--loss fused-linear``); the other kernels save other
    activations and are listed as ignored (the estimate then stays an upper bound for them)."""
    config = dict(getattr(args, "liger_kernel_config", None) or {})
    if config.get("fused_linear_cross_entropy", True):
        d.use("use_liger_kernel", True, "loss", "fused-linear",
              note="Liger's fused linear cross-entropy: no full logits")  # fmt: skip
    else:
        d.ignore("use_liger_kernel", True, "Liger kernels without its fused linear cross-entropy: not modelled")
    others = [k for k in ("rope", "swiglu", "rms_norm") if config.get(k, True)]
    if others:
        why = "Liger's fused rope/swiglu/rms_norm keep other activations: not modelled (an upper bound)"
        d.ignore("liger_kernel_config", {k: True for k in others}, why)


def _fsdp(args: Any, d: Draft) -> None:
    cfg = dict(args.fsdp_config or {})
    plugin = dict(getattr(args, "fsdp_plugin_args", None) or {})
    version = int(plugin.get("fsdp_version") or cfg.get("version") or 2)
    if version != 2:
        raise refuse(d.source, f"fsdp_config.version {version}: trainfit models FSDP2 (version 2)")
    d.use("fsdp", True, "sharding", "fsdp", note="FSDP2 fully_shard per layer + root")
    reshard = bool(plugin.get("reshard_after_forward", True))
    d.use("fsdp_config.reshard_after_forward", cfg.get("reshard_after_forward", True), "reshard_after_forward",
          reshard)  # fmt: skip
    if plugin.get("cpu_offload"):
        d.use("fsdp_config.cpu_offload", True, "offload", "optimizer+params",
              note="CPUOffloadPolicy: parameters, gradients and optimizer states on the host")  # fmt: skip
    if plugin.get("activation_checkpointing"):
        d.use("fsdp_config.activation_checkpointing", True, "checkpointing", "full")
    if int(args.gradient_accumulation_steps) > 1:
        # The Trainer runs every micro-step but the last under accelerate's no_sync unless sync_each_batch
        # (transformers/trainer.py; accelerate/accelerator.py ``no_sync``: ``set_requires_gradient_sync(False)``)
        kwargs = dict(getattr(args.accelerator_config, "gradient_accumulation_kwargs", None) or {})
        sync = bool(kwargs.get("sync_each_batch", False))
        d.use("accelerator_config.gradient_accumulation_kwargs.sync_each_batch", sync, "sync_each_batch", sync)
    for key, value in cfg.items():
        if key in ("version", "reshard_after_forward", "cpu_offload", "activation_checkpointing", "min_num_params",
                   "xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt"):  # fmt: skip
            continue
        if key in ("transformer_layer_cls_to_wrap", "auto_wrap_policy"):
            d.note(f"fsdp_config.{key}", value, "trainfit wraps each decoder layer plus the root")
        else:
            d.ignore(f"fsdp_config.{key}", value, "no effect on the training step's memory in trainfit's model")


def _deepspeed(ds: Any, args: Any, d: Draft, gpus: int | None, hidden: int | None, base: Path) -> None:
    """The nested DeepSpeed config, its "auto" values answered by these arguments (HfTrainerDeepSpeedConfig)."""
    if isinstance(ds, str):
        path = Path(ds) if Path(ds).is_absolute() else base / ds
        if not path.is_file():
            raise ConfigError(f"{d.source}: deepspeed config {ds} not found (looked in {path.parent})")
        source: Any = path
        prefix = f"{ds}: "
    elif isinstance(ds, Mapping):
        source, prefix = ds, "deepspeed."
    else:
        raise ConfigError(f"{d.source}: deepspeed must be a path or a dict, got {type(ds).__name__}")
    precision = "master-bf16" if args.bf16 else "master-fp16" if args.fp16 else "fp32"
    inner = strategy_from_deepspeed(
        source,
        gpus=gpus,
        micro_batch=int(args.per_device_train_batch_size),
        grad_accum=int(args.gradient_accumulation_steps),
        precision=precision,
        hidden_size=hidden,
        label=f"{d.source} → {prefix.rstrip(': .')}",
    )
    for what, ours, theirs in (
        ("train_micro_batch_size_per_gpu", inner.micro_batch, args.per_device_train_batch_size),
        ("gradient_accumulation_steps", inner.grad_accum, args.gradient_accumulation_steps),
    ):
        if ours is not None and ours != theirs:  # HfTrainerDeepSpeedConfig.fill_match's mismatch, refused the same
            raise refuse(d.source, f"the DeepSpeed config's {what} {ours} differs from the TrainingArguments' {theirs}")
    client: dict[str, Any] = {k: d.flags[k] for k in ("optimizer", "optimizer_impl") if k in d.flags}
    d.absorb(inner, prefix)
    if not any(s.key == "optimizer.type" for s in inner.used):  # no optimizer block: the Trainer's optim runs
        d.flags.update(client)
        d.used = [s for s in d.used if s.key != f"{prefix}optimizer"]
