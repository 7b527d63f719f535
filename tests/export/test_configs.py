"""Each exported configuration is accepted by the engine's own parser: transformers ``TrainingArguments``,
accelerate's config loader → launch validation → ``FullyShardedDataParallelPlugin``, DeepSpeed's
``DeepSpeedConfig`` at the plan's data-parallel size."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from trainfit import load_model
from trainfit.export import export_plan, layer_class, write_export
from trainfit.strategy import Engine, EngineOptions, Offload, Parallelism, Strategy, finetune_setup

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _qlora() -> Strategy:
    adapter, base = finetune_setup("qlora")
    return Strategy(checkpointing="full", micro_batch=2, grad_accum=32, adapter=adapter, base_weights=base)


STRATEGIES = {
    "ddp": Strategy(micro_batch=4, grad_accum=2, sharding="ddp", parallelism=Parallelism.for_gpus(8)),
    "fsdp": Strategy(
        precision="master-bf16", micro_batch=2, grad_accum=4, checkpointing="full", sharding="fsdp",
        parallelism=Parallelism.for_gpus(16),
    ),
    "fsdp-offload": Strategy(
        micro_batch=1, grad_accum=8, sharding="fsdp", offload=Offload.parse("optimizer+params"),
        parallelism=Parallelism.for_gpus(8),
    ),
    "zero3-offload": Strategy(
        precision="master-bf16", micro_batch=2, grad_accum=4, sharding="zero3",
        offload=Offload.parse("optimizer+params"), parallelism=Parallelism.for_gpus(8),
    ),
    "zero2-fp16": Strategy(precision="master-fp16", micro_batch=3, grad_accum=2, sharding="zero2",
                           parallelism=Parallelism.for_gpus(4)),
    "qlora": _qlora(),
}  # fmt: skip


@pytest.fixture
def bf16_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan targets a GPU; this CPU machine has none, and TrainingArguments refuses bf16 without one."""
    import transformers.training_args as ta

    monkeypatch.setattr(ta, "is_torch_bf16_gpu_available", lambda: True)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_training_arguments_are_accepted(name: str, tmp_path: Path, bf16_gpu: None, monkeypatch: Any) -> None:
    strategy = STRATEGIES[name]
    ex = export_plan(load_model("llama-3.1-8b"), strategy)
    files = write_export(ex, tmp_path)
    kwargs = json.loads((tmp_path / "training_args.json").read_text())
    if "deepspeed" in kwargs:
        pytest.importorskip("deepspeed")
        monkeypatch.chdir(tmp_path)  # the kwargs name ds_config.json next to them
        assert tmp_path / "ds_config.json" in files
    if kwargs.get("fp16"):
        pytest.skip("TrainingArguments refuses fp16 without a CUDA device")
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "out"), **kwargs)
    assert args.per_device_train_batch_size == strategy.micro_batch
    assert args.gradient_accumulation_steps == strategy.grad_accum
    assert args.bf16 == (strategy.recipe.compute_dtype == "bf16")
    if strategy.sharding.value == "fsdp":
        fsdp_config = args.fsdp_config
        assert bool(args.fsdp) and isinstance(fsdp_config, dict) and fsdp_config["version"] == 2
        assert fsdp_config["reshard_after_forward"] is True
        assert fsdp_config["cpu_offload"] == strategy.offload.parameters_on_host


@pytest.mark.parametrize("name", ["fsdp", "fsdp-offload"])
def test_accelerate_fsdp2_config_loads_and_validates(name: str, tmp_path: Path, monkeypatch: Any) -> None:
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin, prepare_multi_gpu_env

    strategy = STRATEGIES[name]
    spec = load_model("llama-3.1-8b")
    write_export(export_plan(spec, strategy), tmp_path)
    path = tmp_path / "accelerate_fsdp2.yaml"
    cfg = load_config_from_file(str(path))
    assert cfg.num_processes == strategy.world_size and cfg.fsdp_config["fsdp_version"] == 2
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _, _ = _validate_launch_command(args)
    for key, value in prepare_multi_gpu_env(args).items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert plugin.transformer_cls_names_to_wrap == [layer_class(spec)]
    assert plugin.activation_checkpointing == (strategy.checkpointing.value != "none")
    assert plugin.reshard_after_forward is True
    assert (type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy") == strategy.offload.parameters_on_host


class _DataParallel:
    """A stand-in for Megatron's ``mpu``: DeepSpeedConfig asks it for the data-parallel size."""

    def __init__(self, size: int) -> None:
        self.size = size

    def get_data_parallel_world_size(self) -> int:
        return self.size


def _deepspeed_config(cfg: dict[str, Any], dp: int, monkeypatch: Any) -> Any:
    pytest.importorskip("deepspeed")
    import deepspeed.runtime.config as dsc

    # Without a process group DeepSpeedConfig falls back to world size 1; its rank query is all it needs of one.
    monkeypatch.setattr(dsc.dist, "get_rank", lambda *a, **k: 0)
    return dsc.DeepSpeedConfig(cfg, mpu=_DataParallel(dp))


@pytest.mark.parametrize("name", ["zero3-offload", "zero2-fp16"])
def test_deepspeed_config_is_accepted_at_the_plans_world_size(name: str, monkeypatch: Any) -> None:
    strategy = STRATEGIES[name]
    ex = export_plan(load_model("llama-3.1-8b"), strategy)
    assert ex.deepspeed_config is not None
    c = _deepspeed_config(ex.deepspeed_config, strategy.parallelism.data, monkeypatch)
    assert c.world_size == strategy.parallelism.data
    assert c.train_micro_batch_size_per_gpu == strategy.micro_batch
    assert c.gradient_accumulation_steps == strategy.grad_accum
    assert c.zero_optimization_stage == int(strategy.sharding.value[-1])
    assert (c.zero_config.offload_optimizer is not None) == strategy.offload.optimizer_on_host
    # the parser can fail: the same config at another data-parallel size breaks the batch identity
    with pytest.raises(AssertionError):
        _deepspeed_config(ex.deepspeed_config, strategy.parallelism.data * 2, monkeypatch)


@pytest.mark.parametrize("slug", ["llama-3.1-8b", "mistral-7b-v0.1", "qwen2.5-0.5b", "gpt2", "gemma-2b"])
def test_layer_class_exists_in_transformers(slug: str) -> None:
    spec = load_model(slug)
    module = importlib.import_module(f"transformers.models.{spec.model_type}.modeling_{spec.model_type}")
    assert hasattr(module, layer_class(spec))


def test_megatron_plan_exports_its_arguments() -> None:
    s = Strategy(
        micro_batch=1,
        checkpointing="full",
        sharding="zero1",
        engine=EngineOptions(engine=Engine.MEGATRON),
        parallelism=Parallelism.for_gpus(16, tensor=4, pipeline=2, sequence_parallel=True, microbatches=16),
    )
    ex = export_plan(load_model("llama-3.1-8b"), s)
    args = " ".join(ex.megatron_args)
    assert "--tensor-model-parallel-size 4" in args and "--pipeline-model-parallel-size 2" in args
    assert "--global-batch-size 32" in args and "--sequence-parallel" in args and "--use-distributed-optimizer" in args
    assert ex.deepspeed_config is None and "--nnodes 2" in ex.launch


def test_selective_and_sac_plans_say_what_the_formats_cannot_express() -> None:
    """Megatron has selective recompute; the Trainer, accelerate and DeepSpeed only checkpoint whole blocks (a
    plan with selective or per-op SAC is exported with full checkpointing, and NOTES.txt says so)."""
    spec = load_model("llama-3.1-8b")
    mega = Strategy(
        micro_batch=1,
        checkpointing="selective",
        sharding="zero1",
        engine=EngineOptions(engine=Engine.MEGATRON),
        parallelism=Parallelism.for_gpus(8, tensor=4, sequence_parallel=True),
    )
    args = " ".join(export_plan(spec, mega).megatron_args)
    assert "--recompute-granularity selective" in args and "--recompute-granularity full" not in args
    sac = Strategy(
        micro_batch=1, grad_accum=2, checkpointing="sac", sharding="fsdp", parallelism=Parallelism.for_gpus(8)
    )
    ex = export_plan(spec, sac)
    assert ex.training_arguments["gradient_checkpointing"] is True
    assert any("per-op SAC" in n and "every block" in n for n in ex.notes)


def test_plan_cli_exports_the_top_plan(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from tests.cli._cli_helper import run_cli

    r = run_cli(capsys, "plan", "qwen2.5-0.5b", "--gpu", "a100-sxm-80gb", "--gpus", "8", "--seq", "2048",
                "--global-batch", "64", "--export", str(tmp_path), "--json")  # fmt: skip
    assert r.code == 0, r.err
    out = json.loads(r.out)
    top = out["plans"][0]["strategy"]
    kwargs = json.loads((tmp_path / "training_args.json").read_text())
    assert kwargs["per_device_train_batch_size"] == top["micro_batch"]
    assert str(tmp_path / "launch.sh") in out["exported"]


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("TRAINFIT_TORCHRUN_TESTS") != "1",
    reason="two torch+transformers processes take ~35 s on 2 cores: TRAINFIT_TORCHRUN_TESTS=1 runs it",
)
@pytest.mark.parametrize("fp8", ["none", "tensorwise"])
def test_fsdp2_script_trains_on_two_cpu_processes(tmp_path: Path, fp8: str) -> None:
    """The exported train_fsdp2.py, run for real by torchrun: 2 processes, gloo, a 2-layer Llama of width 64 (with
    ``--fp8``: torchao's Float8Linear, whose ``torch._scaled_mm`` has a CPU kernel)."""
    import dataclasses
    import subprocess
    import sys

    pytest.importorskip("torch")
    if fp8 != "none":
        pytest.importorskip("torchao.float8")
    strategy = dataclasses.replace(STRATEGIES["fsdp"], float8=fp8)  # type: ignore[arg-type]
    write_export(export_plan(load_model("llama-3.1-8b"), strategy), tmp_path)
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 256,
                "max_position_embeddings": 64,
            }
        )
    )
    env = {**os.environ, "TRAINFIT_MODEL": str(tiny), "TRAINFIT_SEQ": "16", "TRAINFIT_STEPS": "2",
           "TRAINFIT_ACCUM": "2", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(tmp_path / "train_fsdp2.py")]  # fmt: skip
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "step 1 loss" in res.stdout
