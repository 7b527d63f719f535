"""An accelerate config (the YAML ``accelerate config`` writes, or its JSON form) as the run trainfit models,
read by accelerate's own loader (``accelerate.commands.config.config_args.load_config_from_file``).

- ``distributed_type``: ``NO`` → one GPU; ``MULTI_GPU`` → ``--sharding ddp``; ``FSDP`` → ``--sharding fsdp`` (FSDP2
  only: ``fsdp_version: 1`` is refused) with the plugin's ``reshard_after_forward``, ``cpu_offload`` (→ ``--offload
  optimizer+params``, FSDP2's ``CPUOffloadPolicy``) and ``activation_checkpointing`` (→ ``--checkpointing full``; a
  ``parallelism_config`` replica dimension → ``--sharding hsdp``), read from a ``FullyShardedDataParallelPlugin``
  built the way ``accelerate launch`` builds it (``_validate_launch_command`` → ``prepare_multi_gpu_env`` → the plugin
  reads the environment; the environment is restored afterwards); ``DEEPSPEED`` → ``DeepSpeedPlugin`` (its
  ``deepspeed_config``, from ``zero_stage``/``offload_*_device`` or the nested ``deepspeed_config_file``, with
  ``set_mixed_precision``) read by :func:`trainfit.imports.deepspeed.strategy_from_deepspeed`; others refused.
  With ``grad_accum`` > 1 an FSDP run takes ``--no-sync-each-batch``: no config key says whether micro-steps
  reduce (the script's ``GradientAccumulationPlugin`` does), and its default under ``accelerator.accumulate()`` is
  ``no_sync`` between them, as the HF Trainer's.
- ``mixed_precision``: ``no`` → ``fp32``, ``bf16`` → ``amp-bf16``, ``fp16`` → ``amp-fp16`` (autocast over fp32
  parameters; under FSDP2 the plugin's MixedPrecisionPolicy, which trainfit's FSDP model applies to any 16-bit
  recipe); ``fp8`` is refused.
- ``num_processes`` (all machines) → ``--gpus``; ``num_processes / num_machines`` → ``--gpus-per-node``.

An accelerate config has no micro-batch or sequence length: they come from ``--batch`` and ``--seq``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainfit.errors import ConfigError, DependencyError
from trainfit.imports.deepspeed import strategy_from_deepspeed
from trainfit.imports.result import ConfigKind, Draft, ImportedRun, refuse

_IGNORED_NOTE = {
    "compute_environment": "where it runs",
    "machine_rank": "launch detail",
    "main_process_ip": "launch detail",
    "main_process_port": "launch detail",
    "main_training_function": "launch detail",
    "rdzv_backend": "launch detail",
    "same_network": "launch detail",
    "gpu_ids": "launch detail",
    "enable_cpu_affinity": "launch detail",
    "tpu_env": "TPU only",
    "tpu_use_cluster": "TPU only",
    "tpu_use_sudo": "TPU only",
    "downcast_bf16": "TPU only",
    "debug": "debugging",
    "dynamo_config": "torch.compile: trainfit estimates eager execution",
}


@contextlib.contextmanager
def _restored_environ() -> Iterator[None]:
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _fsdp_plugin(path: Path) -> Any:
    """accelerate's FSDP plugin for the config at ``path``, as ``accelerate launch`` would build it."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin, prepare_multi_gpu_env

    with _restored_environ():
        args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
        args, _, _ = _validate_launch_command(args)
        os.environ.update(prepare_multi_gpu_env(args))
        return FullyShardedDataParallelPlugin()


def strategy_from_accelerate(
    source: str | Path,
    *,
    micro_batch: int | None = None,
    grad_accum: int | None = None,
    seq_len: int | None = None,
    hidden_size: int | None = None,
    label: str | None = None,
) -> ImportedRun:
    """The run the accelerate config at ``source`` describes (see the module docstring). ``micro_batch`` and
    ``grad_accum`` answer a nested DeepSpeed config's ``"auto"`` values, and are the run's otherwise (an accelerate
    config has neither)."""
    path = Path(source)
    name = label or path.name
    if not path.is_file():
        raise ConfigError(f"no such file: {path}")
    try:
        from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    except ImportError:
        raise DependencyError("reading an accelerate config needs accelerate: pip install accelerate") from None
    try:
        cfg = load_config_from_file(str(path))
    except Exception as exc:  # yaml/json parse errors, unknown keys (TypeError): all one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{name}: accelerate cannot load it: {first}") from None
    if not isinstance(cfg, ClusterConfig):
        raise refuse(name, "a SageMaker config: trainfit reads LOCAL_MACHINE configs")
    d = Draft(source=name, kind=ConfigKind.ACCELERATE)
    # YAML 1.1 reads an unquoted NO as false (accelerate's writer quotes it: 'NO')
    dist = "NO" if cfg.distributed_type is False else str(getattr(cfg.distributed_type, "value", cfg.distributed_type))
    mp = str(getattr(cfg.mixed_precision, "value", cfg.mixed_precision) or "no").lower()
    procs, machines = int(cfg.num_processes), max(1, int(cfg.num_machines))
    if procs < 1:
        procs = 1
    precision = {"no": "fp32", "bf16": "amp-bf16", "fp16": "amp-fp16"}.get(mp)
    if precision is None:
        raise refuse(name, f"mixed_precision {mp} is not modelled (no, bf16, fp16)")
    if dist == "DEEPSPEED":
        _deepspeed(cfg, d, procs, mp, micro_batch, grad_accum, hidden_size, path)
    else:
        d.use("mixed_precision", mp, "precision", precision)
        if dist == "NO":
            d.note("distributed_type", dist, "one GPU")
        elif dist == "MULTI_GPU":
            d.use("distributed_type", dist, "sharding", "ddp", note="torch DistributedDataParallel")
        elif dist == "FSDP":
            _fsdp(cfg, d, path, grad_accum)
        else:
            raise refuse(name, f"distributed_type {dist} is not modelled (NO, MULTI_GPU, FSDP, DEEPSPEED are)")
    if (dist != "NO" or procs > 1) and "gpus" not in d.flags:
        d.use("num_processes", cfg.num_processes, "gpus", procs)
    if machines > 1:
        if procs % machines:
            raise refuse(name, f"num_processes {procs} is not a multiple of num_machines {machines}")
        d.use("num_machines", cfg.num_machines, "gpus_per_node", procs // machines)
    written = _written_keys(path)
    for key in sorted(vars(cfg)):
        value = getattr(cfg, key)
        if key in _IGNORED_NOTE and key in written and value not in (None, False, {}, [], "NO"):
            d.ignore(key, getattr(value, "value", value), _IGNORED_NOTE[key])
    return d.finish(seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum)


def _written_keys(path: Path) -> frozenset[str]:
    """The top-level keys the file itself has: accelerate's loader fills the rest with its defaults
    (``main_training_function: main``, ``rdzv_backend: static``…), which the report should not list as the file's."""
    import json

    import yaml  # accelerate's own dependency

    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    return frozenset(data) if isinstance(data, dict) else frozenset()


def _fsdp(cfg: Any, d: Draft, path: Path, grad_accum: int | None) -> None:
    raw = {k.removeprefix("fsdp_"): v for k, v in (cfg.fsdp_config or {}).items()}
    version = int(raw.get("version", 1))
    if version != 2:
        raise refuse(d.source, f"fsdp_version {version}: trainfit models FSDP2 (fsdp_version: 2)")
    try:
        plugin = _fsdp_plugin(path)
    except Exception as exc:  # accelerate's launch validation raises what it likes: one line either way
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{d.source}: accelerate refuses it: {first}") from None
    d.use("distributed_type", "FSDP", "sharding", "fsdp", note="FSDP2 fully_shard per layer + root")
    _parallelism(cfg, d)
    d.use("fsdp_config.fsdp_reshard_after_forward", raw.get("reshard_after_forward", True),
          "reshard_after_forward", bool(plugin.reshard_after_forward))  # fmt: skip
    if plugin.cpu_offload is not None and type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy":
        d.use("fsdp_config.fsdp_offload_params", raw.get("offload_params"), "offload", "optimizer+params",
              note="CPUOffloadPolicy: parameters, gradients and optimizer states on the host")  # fmt: skip
    if plugin.activation_checkpointing:
        d.use("fsdp_config.fsdp_activation_checkpointing", True, "checkpointing", "full")
    if grad_accum is not None and grad_accum > 1:
        # No config key says whether micro-steps reduce: the script's GradientAccumulationPlugin does, and its
        # default (``sync_each_batch=False``) runs every micro-step but the last of ``accelerator.accumulate()``
        # under ``no_sync`` (accelerate/utils/dataclasses.py ``GradientAccumulationPlugin``; accelerator.py
        # ``accumulate``).
        note = "not in the file: accelerator.accumulate()'s default; --sync-each-batch if the script sets it"
        d.use("GradientAccumulationPlugin.sync_each_batch", False, "sync_each_batch", False, note=note)
    read = {"version", "reshard_after_forward", "offload_params", "activation_checkpointing"}
    for key, value in raw.items():
        if key in read:
            continue
        if key in ("auto_wrap_policy", "transformer_layer_cls_to_wrap"):
            d.note(f"fsdp_config.fsdp_{key}", value, "trainfit wraps each decoder layer plus the root")
        else:
            d.ignore(f"fsdp_config.fsdp_{key}", value, "no effect on the training step's memory in trainfit's model")


def _deepspeed(
    cfg: Any,
    d: Draft,
    procs: int,
    mp: str,
    micro_batch: int | None,
    grad_accum: int | None,
    hidden_size: int | None,
    path: Path,
) -> None:
    from accelerate.utils import DeepSpeedPlugin

    raw = dict(cfg.deepspeed_config or {})
    kwargs: dict[str, Any] = {}
    nested = raw.get("deepspeed_config_file")
    if nested:
        nested_path = Path(nested) if Path(nested).is_absolute() else path.parent / nested
        if not nested_path.is_file():
            raise ConfigError(f"{d.source}: deepspeed_config_file {nested} not found")
        kwargs["hf_ds_config"] = str(nested_path)
    else:
        for key in ("zero_stage", "offload_optimizer_device", "offload_param_device", "gradient_clipping"):
            if key in raw:
                kwargs[key] = raw[key]
    if "gradient_accumulation_steps" in raw:
        kwargs["gradient_accumulation_steps"] = raw["gradient_accumulation_steps"]
    elif grad_accum is not None:
        kwargs["gradient_accumulation_steps"] = grad_accum
    try:
        with _restored_environ():
            plugin = DeepSpeedPlugin(**kwargs)
            plugin.set_mixed_precision(mp)
    except Exception as exc:  # the plugin validates with asserts, ValueErrors and its own checks
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{d.source}: accelerate refuses its DeepSpeed settings: {first}") from None
    ds = {k: v for k, v in plugin.deepspeed_config.items() if k != "steps_per_print"}
    inner = strategy_from_deepspeed(
        ds, gpus=procs, micro_batch=micro_batch, grad_accum=grad_accum, hidden_size=hidden_size,
        label=f"{d.source} (DeepSpeed)",
    )  # fmt: skip
    d.absorb(inner, "deepspeed: " if not nested else f"{nested}: ")
    for key, value in raw.items():
        if key in ("zero3_init_flag", "zero3_save_16bit_model", "deepspeed_multinode_launcher"):
            d.ignore(f"deepspeed_config.{key}", value, "loading, saving or launching: no effect on the step")


def _parallelism(cfg: Any, d: Draft) -> None:
    """``parallelism_config`` (the ``parallelism_config_*`` keys ``accelerate config`` writes): a replica dimension
    is HSDP, whose shard group trainfit takes to be a node (``num_processes / num_machines``); tensor, context and
    sequence parallelism are refused (accelerate's TP is the model's transformers ``tp_plan``: not modelled)."""
    pc = {k.removeprefix("parallelism_config_"): v for k, v in (getattr(cfg, "parallelism_config", None) or {}).items()}
    for key in ("tp_size", "cp_size", "sp_size"):
        if int(pc.get(key, 1) or 1) > 1:
            raise refuse(d.source, f"parallelism_config {key} {pc[key]} is not modelled from an accelerate config")
    replicate, shard = int(pc.get("dp_replicate_size", 1) or 1), int(pc.get("dp_shard_size", 1) or 1)
    if replicate > 1:
        procs, machines = int(cfg.num_processes), max(1, int(cfg.num_machines))
        if shard * machines != procs:
            raise refuse(d.source, f"parallelism_config dp_shard_size {shard}: trainfit's HSDP shards within a node "
                         f"({procs} processes on {machines} machines)")  # fmt: skip
        d.use("parallelism_config.parallelism_config_dp_replicate_size", replicate, "sharding", "hsdp",
              note=f"HSDP: {replicate} replicas of {shard} shards")  # fmt: skip
