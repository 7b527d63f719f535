"""A Hugging Face ``Trainer`` callback that estimates the run before its first step and warns when it will not fit.

At ``on_train_begin`` (transformers/trainer_callback.py: called once the model is wrapped and the optimizer built,
before the first batch) :class:`TrainfitCallback` builds

- the model from the live ``model.config`` (:func:`trainfit.arch.config.spec_from_config`; a PEFT model's base
  config), with its LoRA adapter from ``peft_config`` (rank, alpha, targets, dropout; DoRA is refused by trainfit);
- the Strategy from the live ``TrainingArguments`` (:func:`trainfit.imports.strategy_from_training_args`, the
  same mapping as ``trainfit estimate --from training_args.json``, world size ``args.world_size``); weights
  already in bf16 with ``bf16=True`` are ``pure-bf16`` (autocast casts nothing, AdamW keeps bf16 states);
- the GPU from the ``gpu=`` argument, else the local CUDA device when it is in trainfit's catalog;
- the sequence length from ``seq_len=``, else the model's context (trainfit's default, 2048 at most), with a
  warning that the real batches may be shorter;

runs :func:`trainfit.estimate` and logs one line (peak allocated, reserved, the GPU's usable memory). When it
does not fit it also calls ``warnings.warn`` (:class:`TrainfitMemoryWarning`) with the top fix. It never
raises into training: a trainfit error (an architecture or setup it does not model) is logged and the run
goes on. ``callback.report`` keeps the :class:`~trainfit.result.MemoryReport` (None when none was made).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from transformers import TrainerCallback

from trainfit.errors import TrainfitError
from trainfit.result import FitTier, MemoryReport

__all__ = ["TrainfitCallback", "TrainfitMemoryWarning", "estimate_trainer_run"]

logger = logging.getLogger("trainfit")


class TrainfitMemoryWarning(UserWarning):
    """The run trainfit estimated does not fit the GPU."""


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _base_model(model: Any) -> Any:
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _adapter(model: Any) -> tuple[Any, Any] | None:
    """(Adapter, BaseWeights) of a PEFT model's active LoRA adapter; None for a plain model."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        return None
    from trainfit.strategy import finetune_setup

    name = getattr(model, "active_adapter", None) or next(iter(configs))
    if isinstance(name, list):
        name = name[0]
    cfg = configs[name]
    kind = str(getattr(cfg, "peft_type", "")).split(".")[-1].lower()
    if kind != "lora":
        raise TrainfitError(f"PEFT {kind} adapters are not modelled (LoRA is)")
    if getattr(cfg, "use_dora", False):
        raise TrainfitError("DoRA adapters from PEFT are not modelled by this callback yet")
    targets = cfg.target_modules
    targets = targets if isinstance(targets, str) else ",".join(sorted(targets))
    base = _base_model(model)
    dtype = str(getattr(base, "dtype", "")).removeprefix("torch.")
    base_dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype)
    how = "lora"
    if getattr(base, "is_loaded_in_4bit", False):
        qc = getattr(base.config, "quantization_config", None)
        qtype = qc.get("bnb_4bit_quant_type") if isinstance(qc, dict) else getattr(qc, "bnb_4bit_quant_type", None)
        how, base_dtype = "qlora", qtype or "nf4"
    elif getattr(base, "is_loaded_in_8bit", False):
        base_dtype = "int8"
    return finetune_setup(
        how,
        rank=int(cfg.r),
        alpha=int(cfg.lora_alpha),
        targets=targets,
        dropout=float(cfg.lora_dropout),
        base_dtype=base_dtype,
    )


def estimate_trainer_run(
    args: Any, model: Any, *, gpu: Any = None, seq_len: int | None = None, headroom: float = 0.30
) -> MemoryReport:
    """The estimate :class:`TrainfitCallback` makes, for a live TrainingArguments ``args`` and ``model``."""
    import dataclasses

    from trainfit.arch.config import spec_from_config
    from trainfit.estimate import default_seq_len, estimate
    from trainfit.imports import strategy_from_training_args
    from trainfit.strategy import Precision

    base = _base_model(model)
    config = base.config.to_dict()
    spec = spec_from_config(config, name=str(config.get("_name_or_path") or config.get("model_type")), source="model")
    seq = seq_len if seq_len is not None else default_seq_len(spec)
    run = strategy_from_training_args(
        args, gpus=int(getattr(args, "world_size", 1) or 1), seq_len=seq, hidden_size=spec.hidden_size
    )
    strategy = run.strategy
    adapter = _adapter(model)
    if adapter is not None:
        strategy = dataclasses.replace(strategy, adapter=adapter[0], base_weights=adapter[1])
    elif str(getattr(base, "dtype", "")) == "torch.bfloat16" and strategy.recipe.compute_dtype == "bf16":
        strategy = dataclasses.replace(strategy, precision=Precision.PURE_BF16)
    if gpu is None:
        gpu = _local_gpu()
    return estimate(spec, strategy, gpu=gpu, headroom=headroom)


def _local_gpu() -> str | None:
    try:
        import torch
    except ImportError:  # pragma: no cover - the Trainer needs torch
        return None
    if not torch.cuda.is_available():
        return None
    from trainfit.hardware.detect import accelerator_for_device

    acc = accelerator_for_device(torch.cuda.current_device())
    if acc.catalog_id is None:
        logger.warning("trainfit: %s is not in trainfit's GPU catalog; pass gpu= for a fit verdict", acc.name)
    return acc.catalog_id


class TrainfitCallback(TrainerCallback):
    """Estimate the run at ``on_train_begin``; log it, and warn before the first step when it will not fit.

    ``gpu``: a catalog id (``"l4"``, ``"a100-sxm-80gb"``) or GPUSpec; default the local CUDA device.
    ``seq_len``: the tokens per sequence the run trains on; default the model's context (at most 2048).
    """

    def __init__(self, *, gpu: Any = None, seq_len: int | None = None, headroom: float = 0.30) -> None:
        self.gpu = gpu
        self.seq_len = seq_len
        self.headroom = headroom
        self.report: MemoryReport | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.report = None
        if model is None:
            logger.warning("trainfit: no model passed to on_train_begin; nothing estimated")
            return
        if self.seq_len is None:
            logger.warning(
                "trainfit: no seq_len given; estimating with the model's context (at most 2048 tokens) — pass "
                "TrainfitCallback(seq_len=...) for the length your batches have"
            )
        try:
            report = estimate_trainer_run(args, model, gpu=self.gpu, seq_len=self.seq_len, headroom=self.headroom)
        except TrainfitError as exc:
            logger.warning("trainfit: could not estimate this run: %s", exc)
            return
        except Exception as exc:  # never break training over an estimate
            logger.warning("trainfit: estimate failed (%s: %s)", type(exc).__name__, exc)
            return
        self.report = report
        line = (
            f"trainfit: peak {_gib(report.peak_bytes)} allocated per GPU ({report.peak_phase.value}), "
            f"reserved ≈ {_gib(report.reserved_estimate_bytes)}"
        )
        fit = report.fit
        if fit is None:
            logger.info(line)
            return
        line += f"; {fit.gpu_id}: {_gib(fit.required_bytes)} needed of {_gib(fit.usable_bytes)} usable"
        if fit.fits:
            logger.info(line + " — fits")
            return
        top = (fit.fixes or fit.suggestions or (None,))[0]
        fix = f" Top fix: {' '.join(top.flags) or top.reason}" if top is not None else ""
        verdict = (
            f"fits with {fit.cache_flushes} cache flush(es), each an implicit empty_cache (slower steps)"
            if fit.tier is FitTier.FITS_WITH_FLUSHES
            else "DOES NOT FIT"
        )
        message = f"{line} — {verdict} (short by {_gib(-fit.free_bytes)} without flushes).{fix}"
        logger.warning(message)
        warnings.warn(message, TrainfitMemoryWarning, stacklevel=2)
