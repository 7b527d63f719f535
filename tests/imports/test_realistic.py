"""Hand-written configurations as people have them (tests/imports/data): the HF docs' ds_config with "auto"
values, ``accelerate config``'s FSDP2 and DeepSpeed YAML, TrainingArguments JSON — what each maps to, the
"auto" values resolved as the HF Trainer resolves them (checked against ``HfTrainerDeepSpeedConfig`` itself),
and the refusals."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from trainfit.errors import ConfigError, StrategyError, TrainfitError

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

from trainfit.imports import (
    import_config,
    strategy_from_accelerate,
    strategy_from_deepspeed,
    strategy_from_training_args,
)

DATA = Path(__file__).parent / "data"


def _used(run: Any) -> dict[str, str]:
    return {s.key: s.meaning for s in run.used}


def test_hf_zero3_config_with_auto_values_resolves_like_the_hf_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Our "auto" resolution against transformers' own (trainer_config_process + trainer_config_finalize) for
    the same TrainingArguments and model width; at world size 1, where TrainingArguments can compute it."""
    import transformers.training_args as ta
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    monkeypatch.setattr(ta, "is_torch_bf16_gpu_available", lambda: True)
    args = TrainingArguments(
        output_dir="x", per_device_train_batch_size=3, gradient_accumulation_steps=5, bf16=True, use_cpu=True
    )
    hf = HfTrainerDeepSpeedConfig(str(DATA / "ds_config_zero3.json"))
    try:
        hf.trainer_config_process(args)
        hf.trainer_config_finalize(args, SimpleNamespace(config=SimpleNamespace(hidden_size=96)), 100)
        cfg = hf.config
    finally:
        unset_hf_deepspeed_config()
    run = strategy_from_deepspeed(
        DATA / "ds_config_zero3.json", gpus=1, micro_batch=3, grad_accum=5, precision="master-bf16", hidden_size=96
    )
    s = run.strategy
    assert (s.micro_batch, s.grad_accum, s.world_size) == (
        cfg["train_micro_batch_size_per_gpu"],
        cfg["gradient_accumulation_steps"],
        cfg["train_batch_size"] // (3 * 5),
    )
    z = cfg["zero_optimization"]
    assert s.engine.reduce_bucket_size == z["reduce_bucket_size"]
    assert s.engine.prefetch_bucket_size == z["stage3_prefetch_bucket_size"]
    assert cfg["bf16"]["enabled"] is True and s.precision.value == "master-bf16"
    assert s.sharding.value == "zero3" and s.offload.flag == "optimizer+params"
    assert s.engine.overlap_comm is None  # true is stage 3's default
    ignored = {i.key for i in run.ignored}
    assert "zero_optimization.stage3_param_persistence_threshold" in ignored  # not modelled: listed, not hidden
    assert "scheduler" in ignored and "optimizer.params.lr" in ignored


def test_hf_zero2_config_needs_the_flags_its_auto_values_stand_for() -> None:
    path = DATA / "ds_config_zero2.json"
    with pytest.raises(StrategyError, match="give --batch"):
        strategy_from_deepspeed(path)
    with pytest.raises(StrategyError, match="give --grad-accum"):
        strategy_from_deepspeed(path, micro_batch=4)
    with pytest.raises(StrategyError, match="give --gpus"):
        strategy_from_deepspeed(path, micro_batch=4, grad_accum=2)
    with pytest.raises(StrategyError, match="give --precision"):
        strategy_from_deepspeed(path, micro_batch=4, grad_accum=2, gpus=8)
    run = strategy_from_deepspeed(path, micro_batch=4, grad_accum=2, gpus=8, precision="master-fp16")
    s = run.strategy
    assert s.precision.value == "master-fp16" and s.sharding.value == "zero2" and s.offload.flag == "optimizer"
    assert s.engine.reduce_bucket_size == 200_000_000 and s.engine.allgather_bucket_size == 200_000_000
    assert s.engine.overlap_comm is True  # not stage 2's default: kept
    assert _used(run)["train_micro_batch_size_per_gpu"] == "--batch 4 (from --batch)"


def test_batch_triple_fixes_the_world_size_and_contradictions_are_refused() -> None:
    cfg = {"train_batch_size": 96, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3,
           "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}  # fmt: skip
    assert strategy_from_deepspeed(cfg).strategy.world_size == 8
    with pytest.raises(StrategyError, match="means 8 GPUs"):
        strategy_from_deepspeed(cfg, gpus=16)
    with pytest.raises(StrategyError, match="not a multiple"):
        strategy_from_deepspeed({**cfg, "train_batch_size": 100})
    # DeepSpeed derives the missing member of the triple itself
    run = strategy_from_deepspeed({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2,
                                   "zero_optimization": {"stage": 2}}, gpus=4)  # fmt: skip
    assert run.strategy.grad_accum == 8


@pytest.mark.parametrize(
    ("zero", "match"),
    [
        ({"stage": 0}, "stage 0"),
        ({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}, "NVMe"),
        ({"stage": 3, "offload_param": {"device": "cpu"}}, "offload_param without offload_optimizer"),
    ],
)
def test_deepspeed_settings_that_are_not_modelled_are_refused(zero: dict[str, Any], match: str) -> None:
    cfg = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
    }
    with pytest.raises(StrategyError, match=match):
        strategy_from_deepspeed(cfg)


def test_deepspeeds_own_validation_errors_are_one_line() -> None:
    cfg = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 8,
        "zero_optimization": {"stage": 7},
    }
    with pytest.raises(ConfigError, match="DeepSpeed refuses it") as exc:
        strategy_from_deepspeed(cfg)
    assert "\n" not in str(exc.value)
    with pytest.raises(StrategyError, match=r"optimizer\.type 'OneBitAdam'"):
        strategy_from_deepspeed({**cfg, "zero_optimization": {"stage": 1}, "optimizer": {"type": "OneBitAdam"}})


def test_accelerate_fsdp2_yaml_as_accelerate_config_writes_it() -> None:
    run = strategy_from_accelerate(DATA / "accelerate_fsdp2.yaml")
    s = run.strategy
    assert s.sharding.value == "fsdp" and s.world_size == 8 and s.engine.reshard_after_forward is True
    assert s.checkpointing.value == "full" and s.precision.value == "amp-bf16" and not s.offload.any
    assert {"fsdp_config.fsdp_state_dict_type", "main_training_function", "rdzv_backend"} <= {
        i.key for i in run.ignored
    }


def test_accelerate_fsdp1_and_fp8_are_refused(tmp_path: Path) -> None:
    text = (DATA / "accelerate_fsdp2.yaml").read_text()
    v1 = tmp_path / "v1.yaml"
    v1.write_text(text.replace("fsdp_version: 2", "fsdp_version: 1"))
    with pytest.raises(StrategyError, match="FSDP2"):
        strategy_from_accelerate(v1)
    fp8 = tmp_path / "fp8.yaml"
    fp8.write_text(text.replace("mixed_precision: bf16", "mixed_precision: fp8"))
    with pytest.raises(StrategyError, match="fp8"):
        strategy_from_accelerate(fp8)


def test_accelerate_deepspeed_yaml_goes_through_the_deepspeed_plugin() -> None:
    with pytest.raises(StrategyError, match="give --batch"):
        strategy_from_accelerate(DATA / "accelerate_deepspeed.yaml")
    run = strategy_from_accelerate(DATA / "accelerate_deepspeed.yaml", micro_batch=2)
    s = run.strategy
    assert (s.sharding.value, s.offload.flag, s.world_size, s.grad_accum) == ("zero2", "optimizer", 4, 4)
    assert s.precision.value == "master-bf16"  # mixed_precision bf16 → DeepSpeedPlugin.set_mixed_precision


def test_accelerate_nested_deepspeed_config_file(tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text((DATA / "ds_config_zero3.json").read_text())
    yaml = (
        (DATA / "accelerate_deepspeed.yaml")
        .read_text()
        .replace("  gradient_accumulation_steps: 4\n", "  deepspeed_config_file: ds.json\n")
    )
    (tmp_path / "acc.yaml").write_text(yaml)
    run = strategy_from_accelerate(tmp_path / "acc.yaml", micro_batch=1, grad_accum=2, hidden_size=64)
    s = run.strategy
    assert (s.sharding.value, s.offload.flag, s.world_size, s.precision.value) == (
        "zero3", "optimizer+params", 4, "master-bf16"
    )  # fmt: skip
    assert s.engine.reduce_bucket_size == 64 * 64


def test_training_args_json_maps_its_keys() -> None:
    run = strategy_from_training_args(DATA / "training_args.json", seq_len=1024)
    s = run.strategy
    assert (s.micro_batch, s.grad_accum, s.seq_len) == (4, 8, 1024)
    assert s.precision.value == "amp-bf16" and s.checkpointing.value == "full"
    assert s.optimizer.value == "adamw-8bit" and s.savers.paged_optimizer
    ignored = {i.key: i.meaning for i in run.ignored}
    assert "tf32" in ignored and "learning_rate" in ignored


def test_training_args_naming_a_deepspeed_file_answer_its_autos() -> None:
    run = strategy_from_training_args(DATA / "training_args_deepspeed.json", gpus=8, hidden_size=4096)
    s = run.strategy
    assert (s.micro_batch, s.grad_accum, s.world_size, s.sharding.value) == (2, 4, 8, "zero3")
    assert s.precision.value == "master-bf16" and s.checkpointing.value == "full"
    assert s.engine.reduce_bucket_size == 4096 * 4096


def test_training_args_as_saved_by_to_json_string_load(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=6, gradient_accumulation_steps=2,
                             fp16=True, use_cpu=True, optim="adamw_torch", gradient_checkpointing=True)  # fmt: skip
    path = tmp_path / "training_args.json"
    path.write_text(args.to_json_string())
    s = strategy_from_training_args(path, gpus=2).strategy
    assert (s.micro_batch, s.grad_accum, s.world_size, s.sharding.value) == (6, 2, 2, "ddp")
    assert s.precision.value == "amp-fp16" and s.optimizer_impl.value == "foreach"
    assert s.checkpointing.value == "full"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"optim": "adagrad"}, StrategyError, "optim 'adagrad'"),
        ({"optim": "not-an-optimizer"}, ConfigError, "TrainingArguments refuses it"),
        ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"every_n_layers": 2}}, StrategyError,
         "every_n_layers"),
    ],
)  # fmt: skip
def test_training_args_refusals(kwargs: dict[str, Any], error: type[TrainfitError], match: str) -> None:
    with pytest.raises(error, match=match):
        strategy_from_training_args({"output_dir": "x", **kwargs})


def test_unknown_files_are_refused_in_one_line(tmp_path: Path) -> None:
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ConfigError, match="not a DeepSpeed config"):
        import_config(p)
    with pytest.raises(ConfigError, match="no such file"):
        import_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed_type: [unclosed\n")
    with pytest.raises(ConfigError, match="accelerate cannot load it"):
        import_config(bad)


def test_importing_trainfit_imports_stays_torch_free() -> None:
    import subprocess
    import sys

    code = (
        "import sys, trainfit.imports, trainfit.integrations; "
        "print([m for m in ('torch', 'transformers', 'deepspeed', 'accelerate') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_an_unknown_precision_answer_is_one_line() -> None:
    with pytest.raises(StrategyError, match="unknown precision 'bf17'"):
        strategy_from_deepspeed(DATA / "ds_config_zero3.json", gpus=1, micro_batch=1, grad_accum=1, precision="bf17")


def test_training_args_legacy_fsdp_string_is_resolved_by_transformers() -> None:
    """``fsdp="shard_grad_op offload"`` (deprecated): TrainingArguments turns it into reshard_after_forward=False and
    cpu_offload (``_apply_legacy_fsdp_to_config``); the importer reads what transformers resolved."""
    run = strategy_from_training_args({"output_dir": "x", "fsdp": "shard_grad_op offload"}, gpus=8)
    s = run.strategy
    assert (s.sharding.value, s.engine.reshard_after_forward, s.offload.flag) == ("fsdp", False, "optimizer+params")
    with pytest.raises(ConfigError, match="TrainingArguments refuses it"):
        strategy_from_training_args({"output_dir": "x", "fsdp": "hybrid_shard"}, gpus=8)


@pytest.mark.parametrize(
    ("dist", "mp", "procs", "expected"),
    [
        ("MULTI_GPU", "fp16", 4, ("ddp", "amp-fp16", 4)),
        ("'NO'", "'no'", 1, ("none", "fp32", 1)),  # as accelerate config writes them
        ("NO", "no", 1, ("none", "fp32", 1)),  # unquoted: YAML 1.1 booleans
    ],
)
def test_accelerate_plain_configs(
    dist: str, mp: str, procs: int, expected: tuple[str, str, int], tmp_path: Path
) -> None:
    text = (DATA / "accelerate_fsdp2.yaml").read_text().split("fsdp_config:")[0]  # the keys before fsdp_config
    text = text.replace("distributed_type: FSDP", f"distributed_type: {dist}")
    path = tmp_path / "acc.yaml"
    path.write_text(text + f"mixed_precision: {mp}\nnum_machines: 1\nnum_processes: {procs}\n")
    run = strategy_from_accelerate(path)
    s = run.strategy
    assert (s.sharding.value, s.precision.value, s.world_size) == expected
    # the file's own keys are listed as ignored; the defaults accelerate's loader fills in (main_training_function,
    # rdzv_backend: in the full file, not in these lines) are not the file's: before 2026-12-05 they were listed too
    ignored = {i.key for i in run.ignored}
    assert "compute_environment" in ignored and not ignored & {"main_training_function", "rdzv_backend"}


def test_training_args_fsdp_accumulation_reads_sync_each_batch() -> None:
    """The Trainer's default under accumulation is accelerate's no_sync (``sync_each_batch`` False), which the
    estimate then models (the unsharded gradients between micro-steps); the config can ask for a reduce-scatter
    every micro-step instead, as trainfit's exports do."""
    base = {"output_dir": "x", "fsdp": "full_shard", "gradient_accumulation_steps": 4}
    run = strategy_from_training_args(base, gpus=8)
    assert run.strategy.engine.sync_each_batch is False
    assert "accelerator_config.gradient_accumulation_kwargs.sync_each_batch" in {i.key for i in run.used}
    synced = {**base, "accelerator_config": {"gradient_accumulation_kwargs": {"sync_each_batch": True}}}
    assert strategy_from_training_args(synced, gpus=8).strategy.engine.sync_each_batch is True
    one = strategy_from_training_args({**base, "gradient_accumulation_steps": 1}, gpus=8)
    assert one.strategy.engine.sync_each_batch is True  # nothing to accumulate: the default stands


def test_accelerate_fsdp_accumulation_is_no_sync_as_accelerate_accumulates() -> None:
    """An accelerate config has no key for it: ``accelerator.accumulate()`` runs every micro-step but the last
    under ``no_sync`` unless the script's GradientAccumulationPlugin sets ``sync_each_batch``."""
    path = DATA / "accelerate_fsdp2.yaml"
    run = strategy_from_accelerate(path, grad_accum=4)
    assert run.strategy.engine.sync_each_batch is False
    setting = next(i for i in run.used if i.key == "GradientAccumulationPlugin.sync_each_batch")
    assert "--no-sync-each-batch" in setting.meaning and "not in the file" in setting.meaning
    for accum in (None, 1):  # nothing accumulated: the default stands, and nothing is said of it
        one = strategy_from_accelerate(path, grad_accum=accum)
        assert one.strategy.engine.sync_each_batch is True
        assert "GradientAccumulationPlugin.sync_each_batch" not in {i.key for i in one.used}
