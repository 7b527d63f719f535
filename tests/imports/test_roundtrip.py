"""Export a Strategy with trainfit.export, import the files back with trainfit.imports (each parsed by its own
library): the same Strategy. DeepSpeed's 16-bit modes are master-* (16-bit params and grads, fp32 master
weights), the torch engines' are amp-* (autocast over fp32 parameters): the strategies below use each engine's
own spelling, the only one a config file can say."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from trainfit import load_model
from trainfit.export import export_plan, write_export
from trainfit.strategy import MemorySavers, Offload, Parallelism, Strategy

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

from trainfit.imports import (
    import_config,
    strategy_from_accelerate,
    strategy_from_deepspeed,
    strategy_from_training_args,
)

SPEC = load_model("llama-3.1-8b")


def _s(**kw: Any) -> Strategy:
    return Strategy(**kw)


ZERO = {
    f"zero{stage}-{prec}-{off}": _s(
        precision=prec, micro_batch=2, grad_accum=3, sharding=f"zero{stage}", offload=Offload.parse(off),
        parallelism=Parallelism.for_gpus(8), checkpointing="full" if stage == 2 else "none",
    )
    for stage in (1, 2, 3)
    for prec in ("master-bf16", "master-fp16", "fp32")
    for off in ("none", "optimizer", "optimizer+params")
    if off != "optimizer+params" or stage == 3
}  # fmt: skip

FSDP = {
    f"fsdp-{prec}-reshard{r}-{ck}-{off}": _s(
        precision=prec, micro_batch=4, grad_accum=2, sharding="fsdp", checkpointing=ck, offload=Offload.parse(off),
        parallelism=Parallelism.for_gpus(16), engine=dataclasses.replace(Strategy().engine, reshard_after_forward=r),
    )
    for prec in ("amp-bf16", "amp-fp16", "fp32")
    for r in (True, False)
    for ck in ("none", "full")
    for off in ("none", "optimizer+params")
}  # fmt: skip

DDP = {
    f"ddp-{prec}-{opt}-{ck}": _s(
        precision=prec, optimizer=opt, micro_batch=8, grad_accum=1, sharding="ddp", checkpointing=ck,
        parallelism=Parallelism.for_gpus(4),
    )
    for prec in ("amp-bf16", "amp-fp16", "fp32")
    for opt in ("adamw", "adamw-8bit")
    for ck in ("none", "full")
}  # fmt: skip

SINGLE = {
    "single-amp-bf16-full": _s(micro_batch=2, grad_accum=16, checkpointing="full"),
    # Liger's fused linear cross-entropy: TrainingArguments(use_liger_kernel=True, liger_kernel_config=loss only)
    "single-amp-bf16-fused-linear": _s(micro_batch=2, grad_accum=16, savers=MemorySavers(loss="fused-linear")),
}


def _files(strategy: Strategy, tmp_path: Path) -> Path:
    write_export(export_plan(SPEC, strategy), tmp_path)
    return tmp_path


@pytest.mark.parametrize("name", sorted(ZERO))
def test_deepspeed_config_round_trips(name: str) -> None:
    s = ZERO[name]
    ds = export_plan(SPEC, s).deepspeed_config
    assert ds is not None
    run = strategy_from_deepspeed(ds, seq_len=s.seq_len)
    # a DeepSpeed config does not say whether the model checkpoints activations (the training script does)
    assert run.strategy == dataclasses.replace(s, checkpointing="none")
    assert (run.world_size, run.micro_batch, run.grad_accum) == (s.world_size, s.micro_batch, s.grad_accum)


@pytest.mark.parametrize("name", sorted(ZERO))
def test_training_arguments_naming_a_deepspeed_config_round_trip(name: str, tmp_path: Path) -> None:
    s = ZERO[name]
    d = _files(s, tmp_path)
    run = strategy_from_training_args(d / "training_args.json", gpus=s.world_size, seq_len=s.seq_len)
    # TrainingArguments' gradient_checkpointing is the one switch DeepSpeed's file does not carry
    assert run.strategy == s


@pytest.mark.parametrize("name", sorted(ZERO))
def test_accelerate_deepspeed_config_round_trips(name: str, tmp_path: Path) -> None:
    """accelerate_deepspeed.yaml names ds_config.json: read back through DeepSpeedPlugin, the same ZeRO plan."""
    s = ZERO[name]
    run = strategy_from_accelerate(_files(s, tmp_path) / "accelerate_deepspeed.yaml", seq_len=s.seq_len)
    assert run.strategy == dataclasses.replace(s, checkpointing="none")  # the DeepSpeed file does not say it
    assert (run.world_size, run.micro_batch, run.grad_accum) == (s.world_size, s.micro_batch, s.grad_accum)


@pytest.mark.parametrize("name", sorted(FSDP))
def test_accelerate_fsdp2_config_round_trips(name: str, tmp_path: Path) -> None:
    s = FSDP[name]
    d = _files(s, tmp_path)
    run = strategy_from_accelerate(d / "accelerate_fsdp2.yaml", seq_len=s.seq_len)
    # an accelerate config has no batch shape: micro-batch and accumulation come from the flags
    assert run.micro_batch is None and run.grad_accum is None
    assert dataclasses.replace(run.strategy, micro_batch=s.micro_batch, grad_accum=s.grad_accum) == s


@pytest.mark.parametrize("world", [8, 16, 32])
def test_accelerate_hsdp_config_round_trips(world: int, tmp_path: Path) -> None:
    """HSDP's accelerate config carries its mesh in ``parallelism_config``: read back as HSDP, a replica per node."""
    s = _s(precision="amp-bf16", micro_batch=2, grad_accum=2, sharding="hsdp", checkpointing="full",
           parallelism=Parallelism.for_gpus(world))  # fmt: skip
    run = strategy_from_accelerate(_files(s, tmp_path) / "accelerate_fsdp2.yaml", seq_len=s.seq_len)
    # one node is one replica: FSDP over the node (trainfit's HSDP on one node is the same mesh)
    want = s if world > 8 else dataclasses.replace(s, sharding="fsdp")
    assert dataclasses.replace(run.strategy, micro_batch=s.micro_batch, grad_accum=s.grad_accum) == want


def test_accelerate_tensor_parallel_mesh_is_refused(tmp_path: Path) -> None:
    """accelerate's tp_size is the model's transformers tp_plan (no sequence parallelism): not read as a plan."""
    from trainfit.errors import StrategyError

    s = _s(micro_batch=2, sharding="hsdp", parallelism=Parallelism.for_gpus(16))
    path = _files(s, tmp_path) / "accelerate_fsdp2.yaml"
    cfg = json.loads(path.read_text())
    cfg["parallelism_config"].update(parallelism_config_dp_shard_size=4, parallelism_config_tp_size=2)
    path.write_text(json.dumps(cfg))
    with pytest.raises(StrategyError, match="tp_size 2 is not modelled"):
        strategy_from_accelerate(path)


@pytest.mark.parametrize("name", sorted(FSDP | DDP | SINGLE))
def test_training_arguments_round_trip(name: str, tmp_path: Path) -> None:
    s = (FSDP | DDP | SINGLE)[name]
    d = _files(s, tmp_path)
    run = strategy_from_training_args(d / "training_args.json", gpus=s.world_size, seq_len=s.seq_len)
    assert run.strategy == s


def test_import_config_detects_each_kind(tmp_path: Path) -> None:
    s = ZERO["zero3-master-bf16-optimizer+params"]
    d = _files(s, tmp_path)
    assert import_config(d / "ds_config.json").kind.value == "deepspeed"
    assert import_config(d / "training_args.json", gpus=8).kind.value == "training-args"
    f = FSDP["fsdp-amp-bf16-reshardTrue-full-none"]
    d2 = _files(f, tmp_path / "fsdp")
    assert import_config(d2 / "accelerate_fsdp2.yaml").kind.value == "accelerate"
    # the accelerate config is JSON text in a .yaml file (export_files): the same file named .json is detected too
    as_json = d2 / "accelerate.json"
    as_json.write_text((d2 / "accelerate_fsdp2.yaml").read_text())
    assert json.loads(as_json.read_text())["distributed_type"] == "FSDP"
    assert import_config(as_json).kind.value == "accelerate"


def test_liger_kernels_beyond_the_loss_are_listed_as_ignored() -> None:
    """``use_liger_kernel=True`` with Liger's default config also fuses rope, swiglu and rms_norm, which trainfit
    does not model: the loss is read, the rest is said to be ignored."""
    run = strategy_from_training_args({"output_dir": "x", "use_liger_kernel": True})
    assert run.strategy.savers.loss.value == "fused-linear"
    assert any(s.key == "liger_kernel_config" for s in run.ignored)
