"""A DeepSpeed config JSON (``ds_config.json``) as the run trainfit models, parsed by DeepSpeed itself.

Steps: read the JSON; resolve the ``"auto"`` values the way the HF Trainer fills them
(transformers/integrations/deepspeed.py ``HfTrainerDeepSpeedConfig.trainer_config_process`` and
``trainer_config_finalize``: the batch triple and ``bf16``/``fp16.enabled`` from TrainingArguments, which here
are the caller's flags, and ``reduce_bucket_size`` = hidden², ``stage3_prefetch_bucket_size`` = 0.9·hidden²,
``stage3_param_persistence_threshold`` = 10·hidden from the model); then validate with
``deepspeed.runtime.config.DeepSpeedConfig`` and read the parsed values from it. DeepSpeed's batch identity
train_batch_size = micro × accumulation × data-parallel size fixes the world size; without a process group
``DeepSpeedConfig`` checks it at world size 1, so the file is validated with train_batch_size / W (the same
identity) — no monkeypatching.

Mapping (what is not listed is ignored, with a reason, in :attr:`ImportedRun.ignored`):

- ``zero_optimization.stage`` 1/2/3 → ``--sharding zero1|zero2|zero3`` (stage 0, DeepSpeed's own data
  parallelism, is refused: trainfit's DeepSpeed model is ZeRO);
- ``offload_optimizer.device: cpu`` → ``--offload optimizer``; with ``offload_param.device: cpu`` →
  ``optimizer+params``; NVMe, or parameters without the optimizer, are refused (not modelled);
- ``bf16.enabled`` → ``master-bf16``, ``fp16.enabled`` → ``master-fp16`` (DeepSpeed keeps 16-bit parameters and
  gradients with fp32 master weights), neither → ``fp32``; ``bf16_master_weights_and_grads`` is refused;
- ``optimizer.type`` Adam/AdamW/FusedAdam/CPUAdam → ``adamw``, Lion → ``lion``; no optimizer block → the
  client's optimizer (the HF Trainer's ``optim``, default AdamW); anything else is refused;
- ``reduce_bucket_size``, ``allgather_bucket_size``, ``overlap_comm``, ``stage3_prefetch_bucket_size`` →
  the engine options the analytic model reads.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trainfit.errors import ConfigError, DependencyError, StrategyError
from trainfit.imports.result import ConfigKind, Draft, ImportedRun, refuse
from trainfit.strategy import Precision

#: Top-level keys that change nothing trainfit models (learning rate, logging, schedules, clipping).
_NO_MEMORY_EFFECT = {
    "gradient_clipping": "clipping works in place on the gradients",
    "scheduler": "the learning-rate schedule",
    "steps_per_print": "logging",
    "wall_clock_breakdown": "logging",
    "prescale_gradients": "a scale factor",
    "gradient_predivide_factor": "a scale factor",
    "zero_allow_untested_optimizer": "a permission",
    "zero_force_ds_cpu_optimizer": "a permission",
    "communication_data_type": "the dtype of collectives (buckets are modelled in the gradient dtype)",
    "tensorboard": "logging",
    "wandb": "logging",
    "csv_monitor": "logging",
    "comms_logger": "logging",
    "flops_profiler": "profiling",
    "dump_state": "logging",
    "seed": "randomness",
}

_ADAM = {"adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam"}
#: HF's fill rules for the model-size "auto" keys (trainer_config_finalize), hidden → value.
_HIDDEN_AUTO: dict[str, Callable[[int], int]] = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def load_json(path: Path, label: str) -> dict[str, Any]:
    """A JSON object from ``path``, or a one-line ConfigError."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{label}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{label}: expected a JSON object, got {type(data).__name__}")
    return data


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def strategy_from_deepspeed(
    source: str | Path | Mapping[str, Any],
    *,
    gpus: int | None = None,
    micro_batch: int | None = None,
    grad_accum: int | None = None,
    precision: Precision | str | None = None,
    hidden_size: int | None = None,
    seq_len: int | None = None,
    label: str | None = None,
) -> ImportedRun:
    """The run ``source`` (a ds_config.json path or its dict) describes. The keywords answer what the file
    leaves ``"auto"`` or out (as the HF Trainer's TrainingArguments would): an "auto" with no answer is refused
    in one line naming the flag to give. ``label`` names the file in messages."""
    if isinstance(source, Mapping):
        cfg, name = copy.deepcopy(dict(source)), label or "deepspeed config"
    else:
        path = Path(source)
        name = label or path.name
        cfg = load_json(path, name)
    d = Draft(source=name, kind=ConfigKind.DEEPSPEED)
    autos = _resolve_autos(cfg, d, gpus, micro_batch, grad_accum, precision, hidden_size)
    world = _world_size(cfg, d, gpus, micro_batch, grad_accum)
    parsed = _validate(cfg, world, name)
    _read(cfg, parsed, world, d)
    for i, s in enumerate(d.used):  # show what the file wrote ("auto") and what answered it
        if s.key in autos:
            d.used[i] = dataclasses.replace(s, value='"auto"', meaning=f"{s.meaning} (from {autos[s.key]})")
    return d.finish(seq_len=seq_len)


def _resolve_autos(
    cfg: dict[str, Any],
    d: Draft,
    gpus: int | None,
    micro_batch: int | None,
    grad_accum: int | None,
    precision: Precision | str | None,
    hidden: int | None,
) -> dict[str, str]:
    """Replace "auto" where the HF Trainer would, from the answers given; refuse what has no answer. Returns
    the keys replaced, each with what answered it."""
    src = d.source
    autos: dict[str, str] = {}
    if _is_auto(cfg.get("train_micro_batch_size_per_gpu")):
        if micro_batch is None:
            raise refuse(src, 'train_micro_batch_size_per_gpu is "auto" (the HF Trainer fills it): give --batch')
        cfg["train_micro_batch_size_per_gpu"] = micro_batch
        autos["train_micro_batch_size_per_gpu"] = "--batch"
    if _is_auto(cfg.get("gradient_accumulation_steps")):
        if grad_accum is None:
            raise refuse(src, 'gradient_accumulation_steps is "auto" (the HF Trainer fills it): give --grad-accum')
        cfg["gradient_accumulation_steps"] = grad_accum
        autos["gradient_accumulation_steps"] = "--grad-accum"
    if _is_auto(cfg.get("train_batch_size")):
        if gpus is None:
            raise refuse(src, 'train_batch_size is "auto" (world size × micro-batch × accumulation): give --gpus')
        micro, gas = cfg.get("train_micro_batch_size_per_gpu"), cfg.get("gradient_accumulation_steps", 1)
        if not isinstance(micro, int) or not isinstance(gas, int):
            raise refuse(src, 'train_batch_size is "auto": give train_micro_batch_size_per_gpu (or --batch)')
        cfg["train_batch_size"] = gpus * micro * gas
        autos["train_batch_size"] = "--gpus × micro-batch × accumulation"
    for block in ("bf16", "fp16"):
        sub = cfg.get(block)
        if isinstance(sub, dict) and _is_auto(sub.get("enabled")):
            if precision is None:
                raise refuse(src, f'{block}.enabled is "auto" (the HF Trainer fills it): give --precision '
                             "master-bf16, master-fp16 or fp32")  # fmt: skip
            try:
                answer = Precision(precision)
            except ValueError:
                choices = ", ".join(p.value for p in Precision)
                raise StrategyError(f"unknown precision '{precision}'; choose one of: {choices}") from None
            sub["enabled"] = answer.value.endswith(block)
            autos[f"{block}.enabled"] = "--precision"
    zero = cfg.get("zero_optimization")
    if isinstance(zero, dict):
        for key, rule in _HIDDEN_AUTO.items():
            if _is_auto(zero.get(key)):
                if hidden is None:
                    raise refuse(src, f'zero_optimization.{key} is "auto" (HF fills it from the model\'s hidden '
                                 "size): give the model")  # fmt: skip
                zero[key] = rule(hidden)
                autos[f"zero_optimization.{key}"] = "the model's hidden size, as the HF Trainer fills it"
    # Other "auto" values (optimizer.params, scheduler.params, gradient_clipping) change nothing trainfit models;
    # DeepSpeedConfig does not read them, and they are listed as ignored by _read.
    return autos


def _world_size(cfg: dict[str, Any], d: Draft, gpus: int | None, micro: int | None, gas: int | None) -> int:
    """The data-parallel size: from the batch triple when all three are in the file, else ``gpus``."""
    tbs, mb, ga = (cfg.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                         "gradient_accumulation_steps"))  # fmt: skip
    if mb is None and micro is not None:
        cfg["train_micro_batch_size_per_gpu"] = mb = micro
    if ga is None and gas is not None and tbs is None:
        cfg["gradient_accumulation_steps"] = ga = gas
    if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (tbs, mb, ga)):
        assert isinstance(tbs, int) and isinstance(mb, int) and isinstance(ga, int)
        world, rest = divmod(tbs, mb * ga)
        if rest or world < 1:
            raise refuse(d.source, f"train_batch_size {tbs} is not a multiple of train_micro_batch_size_per_gpu "
                         f"{mb} × gradient_accumulation_steps {ga} (DeepSpeed's batch identity)")  # fmt: skip
        if gpus is not None and gpus != world:
            raise refuse(d.source, f"its batch triple means {world} GPUs (train_batch_size {tbs} = {mb} × {ga} × "
                         f"{world}), not --gpus {gpus}")  # fmt: skip
        return world
    if gpus is None:
        raise refuse(d.source, "the world size is not fixed by train_batch_size, train_micro_batch_size_per_gpu and "
                     "gradient_accumulation_steps together: give --gpus")  # fmt: skip
    return gpus


def _validate(cfg: dict[str, Any], world: int, name: str) -> Any:
    """``DeepSpeedConfig`` of ``cfg`` at data-parallel size ``world`` (see the module docstring)."""
    try:
        from deepspeed.runtime.config import DeepSpeedConfig
    except ImportError:
        raise DependencyError("reading a DeepSpeed config needs deepspeed: pip install deepspeed") from None
    check = copy.deepcopy(cfg)
    if isinstance(check.get("train_batch_size"), int):
        check["train_batch_size"] //= world
    try:
        return DeepSpeedConfig(check)
    except (AssertionError, ValueError, TypeError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{name}: DeepSpeed refuses it: {first}") from None


def _device(offload: Any) -> str:
    if offload is None:
        return "none"
    dev = getattr(offload, "device", "none")
    return str(getattr(dev, "value", dev))


def _read(cfg: dict[str, Any], c: Any, world: int, d: Draft) -> None:
    """Fill ``d`` from the parsed DeepSpeedConfig ``c`` (and the raw ``cfg`` for what was written)."""
    src = d.source
    zero = cfg.get("zero_optimization") or {}
    d.use("train_micro_batch_size_per_gpu", cfg.get("train_micro_batch_size_per_gpu"), "batch",
          int(c.train_micro_batch_size_per_gpu))  # fmt: skip
    d.use("gradient_accumulation_steps", cfg.get("gradient_accumulation_steps"), "grad_accum",
          int(c.gradient_accumulation_steps))  # fmt: skip
    d.use("train_batch_size", cfg.get("train_batch_size"), "gpus", world, note="data-parallel size")
    stage = int(c.zero_optimization_stage)
    if stage == 0:
        raise refuse(src, "zero_optimization.stage 0 (DeepSpeed's own data parallelism) is not modelled; trainfit "
                     "models ZeRO stages 1–3 (or --sharding ddp for torch DDP)")  # fmt: skip
    d.use("zero_optimization.stage", zero.get("stage", stage), "sharding", f"zero{stage}")
    z = c.zero_config
    opt_dev, par_dev = _device(z.offload_optimizer), _device(z.offload_param)
    if "nvme" in (opt_dev, par_dev):
        raise refuse(src, "NVMe offload is not modelled (trainfit models offload to CPU memory)")
    if par_dev == "cpu" and opt_dev != "cpu":
        raise refuse(src, "offload_param without offload_optimizer is not modelled (give both, or neither)")
    if opt_dev == "cpu":
        value = "optimizer+params" if par_dev == "cpu" else "optimizer"
        key = "zero_optimization.offload_optimizer" + (" + offload_param" if par_dev == "cpu" else "")
        d.use(key, "cpu", "offload", value)
    if c.bfloat16_config.enabled:
        if getattr(c.bfloat16_config, "bf16_master_weights_and_grads", False):
            raise refuse(src, "bf16.bf16_master_weights_and_grads (bf16 master weights) is not modelled")
        d.use("bf16.enabled", True, "precision", Precision.MASTER_BF16.value,
              note="bf16 params and grads, fp32 master weights and optimizer states")  # fmt: skip
    elif c.float16_config.enabled:
        if getattr(c.float16_config, "fp16_master_weights_and_grads", False):
            raise refuse(src, "fp16.fp16_master_weights_and_grads (fp16 master weights) is not modelled")
        d.use("fp16.enabled", True, "precision", Precision.MASTER_FP16.value,
              note="fp16 params and grads with loss scaling, fp32 master weights and optimizer states")  # fmt: skip
    else:
        d.use("bf16/fp16", None, "precision", Precision.FP32.value, note="neither block is enabled")
    _optimizer(cfg, c, d)
    if "reduce_bucket_size" in zero:
        d.use("zero_optimization.reduce_bucket_size", zero["reduce_bucket_size"], "reduce_bucket_size",
              int(z.reduce_bucket_size))  # fmt: skip
    if "allgather_bucket_size" in zero:
        d.use_extra("zero_optimization.allgather_bucket_size", zero["allgather_bucket_size"],
                    "allgather_bucket_size", int(z.allgather_bucket_size))  # fmt: skip
    if "overlap_comm" in zero:
        if bool(z.overlap_comm) == (stage == 3):  # DeepSpeedZeroConfig's per-stage default: EngineOptions' None
            d.note("zero_optimization.overlap_comm", zero["overlap_comm"], f"as modelled (DeepSpeed's default for "
                   f"stage {stage})")  # fmt: skip
        else:
            d.use_extra("zero_optimization.overlap_comm", zero["overlap_comm"], "overlap_comm", bool(z.overlap_comm))
    if stage == 3 and "stage3_prefetch_bucket_size" in zero:
        d.use_extra("zero_optimization.stage3_prefetch_bucket_size", zero["stage3_prefetch_bucket_size"],
                    "prefetch_bucket_size", int(z.prefetch_bucket_size))  # fmt: skip
    read = {"stage", "offload_optimizer", "offload_param", "reduce_bucket_size", "allgather_bucket_size",
            "overlap_comm"} | ({"stage3_prefetch_bucket_size"} if stage == 3 else set())  # fmt: skip
    for key, value in zero.items():
        if key == "contiguous_gradients" and value is True:
            d.note("zero_optimization.contiguous_gradients", True, "as modelled (DeepSpeed's default)")
        elif key not in read:
            d.ignore(f"zero_optimization.{key}", value, "not modelled (trainfit assumes DeepSpeed's default)")
    handled = {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
               "zero_optimization", "bf16", "fp16", "optimizer"}  # fmt: skip
    for key, value in cfg.items():
        if key in handled:
            continue
        reason = _NO_MEMORY_EFFECT.get(key)
        d.ignore(key, value, f"no effect on memory ({reason})" if reason else "not modelled by trainfit")
    for block in ("bf16", "fp16"):
        for key, value in (cfg.get(block) or {}).items():
            if key != "enabled":
                d.ignore(f"{block}.{key}", value, "loss-scaling settings: no effect on memory")


def _optimizer(cfg: dict[str, Any], c: Any, d: Draft) -> None:
    block = cfg.get("optimizer")
    if not block:
        d.note("optimizer", None, "--optimizer adamw (no block: the client's optimizer, the HF Trainer's default)")
        return
    kind = str(c.optimizer_name or "").lower()
    if kind in _ADAM:
        d.use("optimizer.type", block.get("type"), "optimizer", "adamw")
    elif kind == "lion":
        d.use("optimizer.type", block.get("type"), "optimizer", "lion")
    else:
        raise refuse(d.source, f"optimizer.type {block.get('type')!r} has no trainfit optimizer (Adam, AdamW, Lion "
                     "are modelled)")  # fmt: skip
    for key, value in (block.get("params") or {}).items():
        d.ignore(f"optimizer.params.{key}", value, "a hyper-parameter: no effect on memory")
