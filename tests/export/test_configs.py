"""Each exported configuration is accepted by the engine's own parser: transformers ``TrainingArguments``,
accelerate's config loader → launch validation → ``FullyShardedDataParallelPlugin``, DeepSpeed's
``DeepSpeedConfig`` at the plan's data-parallel size."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
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


def _two_d(world: int = 16, tensor: int = 8, sp: bool = True) -> Strategy:
    return Strategy(
        precision="master-bf16",
        micro_batch=2,
        grad_accum=2,
        checkpointing="full",
        sharding="fsdp",
        engine=EngineOptions(engine=Engine.TORCH),
        parallelism=Parallelism.for_gpus(world, tensor=tensor, sequence_parallel=sp),
    )


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
    "fsdp-no-reshard": Strategy(
        precision="pure-bf16", micro_batch=1, grad_accum=2, checkpointing="sac", sharding="fsdp",
        parallelism=Parallelism.for_gpus(8), engine=EngineOptions(reshard_after_forward=False),
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
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "out"), **kwargs)
    assert args.per_device_train_batch_size == strategy.micro_batch
    assert args.gradient_accumulation_steps == strategy.grad_accum
    assert args.bf16 == (strategy.recipe.compute_dtype == "bf16")
    assert args.fp16 == (strategy.recipe.compute_dtype == "fp16")  # transformers 5 takes fp16 without a GPU
    if strategy.sharding.value == "fsdp":
        fsdp_config = args.fsdp_config
        assert bool(args.fsdp) and isinstance(fsdp_config, dict) and fsdp_config["version"] == 2
        assert fsdp_config["reshard_after_forward"] is strategy.engine.reshard_after_forward
        assert fsdp_config["cpu_offload"] == strategy.offload.parameters_on_host
        # every micro-step reduce-scatters, as the plan's memory assumes: the Trainer's accelerator gets the kwarg
        assert args.accelerator_config.gradient_accumulation_kwargs == {"sync_each_batch": True}
        from accelerate.utils import GradientAccumulationPlugin

        plugin = GradientAccumulationPlugin(
            num_steps=strategy.grad_accum, **args.accelerator_config.gradient_accumulation_kwargs
        )
        assert plugin.sync_each_batch is True
    else:
        assert "accelerator_config" not in kwargs
    if strategy.sharding.value == "ddp":
        # The Trainer's DDP kwargs for a model that is not a checkpointing PreTrainedModel (a PeftModel, or no
        # checkpointing): find_unused_parameters=True unless the arguments say otherwise; the plan's memory is False
        from types import SimpleNamespace

        from transformers import Trainer

        handlers = Trainer._build_accelerator_args(SimpleNamespace(args=args, model=object()))["kwargs_handlers"]
        assert [h.find_unused_parameters for h in handlers] == [False]


def _fsdp_plugin(path: Path, monkeypatch: Any) -> Any:
    """The ``FullyShardedDataParallelPlugin`` an accelerate config gives: accelerate's loader, ``accelerate launch``'s
    parser and validation, the environment it hands the processes, the plugin built from it (as ``Accelerator()``)."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin, prepare_multi_gpu_env

    assert load_config_from_file(str(path)).fsdp_config["fsdp_version"] == 2
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _, _ = _validate_launch_command(args)
    for key, value in prepare_multi_gpu_env(args).items():
        monkeypatch.setenv(key, value)
    return FullyShardedDataParallelPlugin()


@pytest.mark.parametrize("name", ["fsdp", "fsdp-offload", "fsdp-no-reshard"])
def test_accelerate_fsdp2_config_loads_and_validates(name: str, tmp_path: Path, monkeypatch: Any) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    strategy = STRATEGIES[name]
    spec = load_model("llama-3.1-8b")
    write_export(export_plan(spec, strategy), tmp_path)
    path = tmp_path / "accelerate_fsdp2.yaml"
    cfg = load_config_from_file(str(path))
    assert cfg.num_processes == strategy.world_size and cfg.fsdp_config["fsdp_version"] == 2
    plugin = _fsdp_plugin(path, monkeypatch)
    assert plugin.fsdp_version == 2
    assert plugin.transformer_cls_names_to_wrap == [layer_class(spec)]
    assert plugin.activation_checkpointing == (strategy.checkpointing.value != "none")
    assert plugin.reshard_after_forward is strategy.engine.reshard_after_forward
    assert (type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy") == strategy.offload.parameters_on_host


def test_a_plan_without_reshard_exports_it_everywhere(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, bf16_gpu: None, monkeypatch: Any
) -> None:
    """``trainfit plan --export`` for a plan that keeps FSDP2's layers unsharded after forward (Llama 3.2 3B on 8
    L40S: tests/planner/test_reshard_plan.py): accelerate's plugin, TrainingArguments' ``fsdp_config`` and
    train_fsdp2.py's ``fully_shard`` calls all get ``reshard_after_forward=False``."""
    from transformers import TrainingArguments

    from tests.cli._cli_helper import run_cli

    r = run_cli(capsys, "plan", "llama-3.2-3b", "--gpu", "l40s", "--gpus", "8", "--seq", "1024",
                "--global-batch", "16", "--export", str(tmp_path), "--json")  # fmt: skip
    assert r.code == 0, r.err
    top = json.loads(r.out)["plans"][0]
    assert top["strategy"]["reshard_after_forward"] is False and "--no-reshard-after-forward" in top["changes"]
    cfg = json.loads((tmp_path / "accelerate_fsdp2.yaml").read_text())  # (JSON: a YAML accelerate loads)
    assert cfg["fsdp_config"]["fsdp_reshard_after_forward"] is False
    assert _fsdp_plugin(tmp_path / "accelerate_fsdp2.yaml", monkeypatch).reshard_after_forward is False
    kwargs = json.loads((tmp_path / "training_args.json").read_text())
    args = TrainingArguments(output_dir=str(tmp_path / "out"), **kwargs)
    assert isinstance(args.fsdp_config, dict) and args.fsdp_config["reshard_after_forward"] is False
    script = (tmp_path / "train_fsdp2.py").read_text()
    compile(script, "train_fsdp2.py", "exec")
    assert "RESHARD_AFTER_FORWARD = False" in script
    assert 'kw = {"reshard_after_forward": RESHARD_AFTER_FORWARD}' in script  # every layer's fully_shard


def _hsdp(world: int = 16) -> Strategy:
    return Strategy(
        precision="master-bf16", micro_batch=2, grad_accum=2, checkpointing="full", sharding="hsdp",
        parallelism=Parallelism.for_gpus(world),
    )  # fmt: skip


def test_hsdp_accelerate_config_carries_the_mesh(tmp_path: Path, monkeypatch: Any) -> None:
    """HSDP on 2 nodes × 8: accelerate's own chain — the config file, the launch line of launch.sh parsed and
    validated by ``accelerate launch``'s parser, the environment it gives the processes, then ``ParallelismConfig()``
    and ``FullyShardedDataParallelPlugin()`` built from that environment as ``Accelerator()`` builds them — gives a
    (2, 8) ``dp_replicate`` × ``dp_shard`` mesh for FSDP2, the trainfit HSDP (replicated across nodes, sharded
    within one) the plan's memory is for."""
    import shlex

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin, prepare_multi_gpu_env

    strategy = _hsdp()
    ex = export_plan(load_model("llama-3.1-8b"), strategy)
    write_export(ex, tmp_path)
    assert ex.script is None and ex.launch.startswith("accelerate launch --config_file accelerate_fsdp2.yaml")
    argv = shlex.split(ex.launch.replace("$NODE_RANK", "1").replace("$MASTER_ADDR", "10.0.0.1"))[2:]
    monkeypatch.chdir(tmp_path)
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
    assert args.use_parallelism_config and args.num_processes == 16 and args.num_machines == 2
    assert args.machine_rank == 1 and args.main_process_ip == "10.0.0.1"
    for key, value in prepare_multi_gpu_env(args).items():
        monkeypatch.setenv(key, value)
    pc = ParallelismConfig()
    assert (pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.total_size) == (2, 8, 1, strategy.world_size)
    assert pc.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"] and pc._get_mesh() == (
        ("dp_replicate", "dp_shard"),
        (2, 8),
    )
    assert FullyShardedDataParallelPlugin().fsdp_version == 2
    assert not any("not validated" in n for n in ex.notes) and any("parallelism_config" in n for n in ex.notes)
    # one node: HSDP with a single replica, and no machine rank to pass
    one = export_plan(load_model("llama-3.1-8b"), _hsdp(world=8))
    assert one.accelerate_config is not None and "--machine_rank" not in one.launch
    assert one.accelerate_config["parallelism_config"]["parallelism_config_dp_replicate_size"] == 1


def test_2d_plan_says_why_accelerate_cannot_carry_it() -> None:
    """No accelerate config for 2-D FSDP2 × TP: accelerate's ``tp_size`` is the tensor parallelism transformers
    applied at load time (``get_model_tp_size``, or it refuses the model), and transformers' Llama ``tp_plan`` has
    no sequence-parallel norms and no sharded embedding, with ``DistributedConfig.enable_sequence_parallel`` read
    nowhere — so accelerate would run a plan other than the estimated one. If transformers wires sequence
    parallelism up, this test fails: revisit the export."""
    import torch
    from accelerate.utils import get_model_tp_size
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    plan = LlamaConfig.base_model_tp_plan
    assert plan and not any("norm" in k or "embed" in k for k in plan)
    assert set(plan.values()) <= {"colwise", "rowwise"}
    assert LlamaForCausalLM._tp_plan == {"lm_head": "colwise_gather_output"}  # the logits gathered, not loss-parallel
    root = Path(importlib.import_module("transformers").__file__ or "").parent
    users = [p for p in root.rglob("*.py") if "enable_sequence_parallel" in p.read_text(encoding="utf-8")]
    assert [p.name for p in users] == ["configuration_utils.py"], users
    assert get_model_tp_size(torch.nn.Linear(2, 2)) is None  # accelerate refuses tp_size for such a model
    ex = export_plan(load_model("llama-3.1-8b"), _two_d())
    assert ex.accelerate_config is None
    assert any("no sequence parallelism" in n and "tp_size=8" in n and "dp_shard_size=2" in n for n in ex.notes)


def test_2d_plan_writes_no_training_arguments() -> None:
    """The HF Trainer could carry a 2-D plan's batch — ``TrainingArguments(parallelism_config=ParallelismConfig(
    dp_shard_size=2, tp_size=8))`` is accepted, and the Trainer's total batch is then micro × accumulation × world /
    tp — but not its tensor parallelism: the Trainer's TP is the model's transformers ``tp_plan``, whose row-parallel
    styles all return a replicated output (an all-reduce; none reduce-scatters into sequence shards, as the plan's
    sequence parallelism does). So no training_args.json is written for such plans (as for Megatron's), and
    NOTES.txt says why and what gives the batch. If transformers gains a sequence-sharded row-parallel style, the
    assertion on the styles fails: revisit the export."""
    from accelerate import ParallelismConfig
    from torch.distributed.tensor import Shard
    from transformers import TrainingArguments
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, RowwiseParallel

    strategy = _two_d()
    tp, dp = strategy.parallelism.tensor, strategy.parallelism.data
    pc = ParallelismConfig(dp_shard_size=dp, tp_size=tp)
    args = TrainingArguments(
        output_dir="unused", per_device_train_batch_size=strategy.micro_batch,
        gradient_accumulation_steps=strategy.grad_accum, parallelism_config=pc,
    )  # fmt: skip
    assert args.parallelism_config is pc and pc.total_size == strategy.world_size
    # Trainer._get_total_train_batch_size: micro × accumulation × world // tp — the plan's batch
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps * (pc.total_size // tp) == (
        strategy.global_batch
    )
    rowwise = [v for v in ALL_PARALLEL_STYLES.values() if isinstance(v, RowwiseParallel)]
    outputs = [getattr(v, "output_layouts", None) for v in rowwise]
    layouts = [x for o in outputs for x in (o if isinstance(o, tuple) else (o,))]
    assert rowwise and not any(isinstance(x, Shard) for x in layouts), "a row-parallel style reduce-scatters now"
    ex = export_plan(load_model("llama-3.1-8b"), strategy)
    assert ex.training_arguments is None and ex.script is not None
    notes = "\n".join(ex.notes)
    assert "no training_args.json" in notes and f"= {strategy.global_batch}" in notes
    # what the Trainer's notes said of checkpointing is said of the script instead
    selective = dataclasses.replace(strategy, checkpointing="selective")
    notes = "\n".join(export_plan(load_model("llama-3.1-8b"), selective).notes)
    assert "--checkpointing selective: train_fsdp2.py checkpoints every block" in notes


@pytest.mark.parametrize("checkpointing", ["sqrt", "selective"])
def test_a_1d_fsdp_plan_s_notes_say_what_the_script_checkpoints(checkpointing: str) -> None:
    """A 1-D FSDP2 plan exports train_fsdp2.py beside training_args.json; the script checkpoints every block whatever
    the plan's mode, and NOTES.txt says so for the script as it does for the Trainer (it said it only for 2-D plans)."""
    strategy = Strategy(
        sharding="fsdp", parallelism=Parallelism.for_gpus(8), checkpointing=checkpointing, micro_batch=1
    )  # type: ignore[arg-type]
    ex = export_plan(load_model("llama-3.1-8b"), strategy)
    assert ex.training_arguments is not None and ex.script is not None
    notes = "\n".join(ex.notes)
    assert f"--checkpointing {checkpointing}: train_fsdp2.py checkpoints every block" in notes


@pytest.mark.parametrize("precision", ["pure-bf16", "master-bf16"])
def test_fsdp2_script_builds_a_pure_bf16_plan_in_bf16(precision: str) -> None:
    """A pure-bf16 plan's memory has bf16 weights, gradients and optimizer states, and FSDP2 moving bf16 both ways
    (``analytic.parallel.fsdp_wire_bits``): train_fsdp2.py builds the model in bf16 and sets no MixedPrecisionPolicy.
    master-bf16 keeps fp32 parameters under the policy (bf16 gathers, fp32 reduce-scatters). Until 2026-12-04 the
    script built every plan in fp32 under the policy: a pure-bf16 plan ran with twice its weights and Adam states."""
    for strategy in (_two_d(), STRATEGIES["fsdp"]):
        s = dataclasses.replace(strategy, precision=precision)
        script = export_plan(load_model("llama-3.1-8b"), s).script
        assert script is not None
        assert re.search(rf"^PURE_BF16 = {precision == 'pure-bf16'}\b", script, re.M)
        assert (
            "from_config(config, dtype=DTYPE)" in script
            and "from_pretrained(MODEL, config=config, dtype=DTYPE)" in script
        )
        compile(script, "train_fsdp2.py", "exec")


def _script_module(script: str, folder: Path) -> Any:
    """The generated train_fsdp2.py imported as a module (``main()`` runs only under ``__main__``): its parts."""
    import importlib.util

    pytest.importorskip("torch")
    path = folder / f"train_fsdp2_{abs(hash(script))}.py"
    path.write_text(script)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16", "master-bf16", "pure-bf16", "amp-fp16", "master-fp16"])
def test_fsdp2_script_trains_each_recipe_as_the_estimate_models_it(precision: str, tmp_path: Path) -> None:
    """The estimate models FSDP2 under every mixed recipe (amp-*, master-*: ``Recipe.mixed``) as fp32 shards with
    ``MixedPrecisionPolicy(param_dtype=<compute>, reduce_dtype=fp32)`` and no autocast (``analytic.parallel
    .fsdp_wire_bits``, ``trace.distributed._wrap_fsdp``); train_fsdp2.py's ``mixed_precision`` returns that policy on
    a GPU, and fp16 recipes scale the loss with ``torch.amp.GradScaler``. Until 2026-12-04 an amp-/master-fp16 plan
    got no policy and no scaler: it trained in fp32. (bf16 keeps no policy on the CPU, as before: the CPU runs of the
    tests; fp16 keeps its policy there.)"""
    import torch

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    for strategy in (_two_d(), STRATEGIES["fsdp"], STRATEGIES["fsdp-offload"]):
        s = dataclasses.replace(strategy, precision=precision)
        script = export_plan(load_model("llama-3.1-8b"), s).script
        assert script is not None
        module = _script_module(script, tmp_path)
        fp16 = s.recipe.compute_dtype == "fp16"
        assert module.FP16 is fp16 and module.PURE_BF16 is (precision == "pure-bf16")
        # built in the dtype of the estimate's shards (fp32 under every recipe but pure-bf16), explicitly: the
        # from_pretrained the script points real runs to would otherwise load the checkpoint's dtype ("auto")
        assert module.DTYPE is (torch.bfloat16 if precision == "pure-bf16" else torch.float32)
        for cuda in (True, False):
            policy = module.mixed_precision(cuda)
            if s.recipe.mixed and (cuda or fp16):
                assert policy.param_dtype is dtypes[s.recipe.compute_dtype], (precision, cuda)
                assert policy.reduce_dtype is torch.float32 and policy.output_dtype is None
            else:
                assert policy is None, (precision, cuda)
        assert "scaler = torch.amp.GradScaler(device.type, enabled=FP16)" in script
        scaled = "scaler.scale(loss).backward()"
        assert scaled in script and "loss.backward()" not in script.replace(scaled, "")
        assert "scaler.step(opt)" in script and "scaler.update()" in script and "opt.step()" not in script


@pytest.mark.parametrize(("precision", "offload", "backend"), [
    ("master-fp16", True, "cuda:nccl,cpu:gloo"),
    ("master-fp16", False, "nccl"),
    ("master-bf16", True, "nccl"),
])  # fmt: skip
def test_fsdp2_script_gives_offloaded_fp16_a_cpu_backend(
    precision: str, offload: bool, backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With offloaded shards the fp16 scaler's found_inf reduction (DTensor's handler, over the shards' mesh) runs on
    CPU tensors: the script initialises NCCL with a gloo backend for the CPU (torchtitan's ``init_distributed`` for
    its CPU offload). Shown by the backend main() asks for on a (patched) GPU machine."""
    base = STRATEGIES["fsdp-offload"] if offload else STRATEGIES["fsdp"]
    script = export_plan(load_model("llama-3.1-8b"), dataclasses.replace(base, precision=precision)).script
    assert script is not None
    module = _script_module(script, tmp_path)
    asked: list[str] = []

    class _Stop(Exception):
        pass

    def init(name: str) -> None:
        asked.append(name)
        raise _Stop

    monkeypatch.setattr(module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(module.dist, "init_process_group", init)
    with pytest.raises(_Stop):
        module.main()
    assert asked == [backend]


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


@pytest.mark.parametrize(("optimizer", "allowed"), [("sgd-momentum", True), ("adamw", False)])
def test_deepspeed_engine_takes_the_trainers_own_optimizer(optimizer: str, allowed: bool) -> None:
    """A plan with another optimizer than AdamW hands the Trainer's (here torch's SGD) to DeepSpeed as a client
    optimizer: the real ``deepspeed.initialize`` (its CPU accelerator, a 4-rank fake process group) builds the ZeRO
    optimizer around it only because the export allows untested optimizers; without the key it refuses. AdamW
    plans name DeepSpeed's own AdamW and need no such key."""
    pytest.importorskip("deepspeed")
    import deepspeed
    import torch

    from trainfit.trace.deepspeed import _deepspeed_world, _quiet_deepspeed

    s = dataclasses.replace(STRATEGIES["zero2-fp16"], optimizer=optimizer)  # type: ignore[arg-type]
    cfg = export_plan(load_model("llama-3.1-8b"), s).deepspeed_config
    assert cfg is not None and cfg.get("zero_allow_untested_optimizer", False) is allowed
    if not allowed:
        assert cfg["optimizer"]["type"] == "AdamW"
        return
    # the exported ZeRO and precision settings at a batch a 4-rank world of a tiny model takes
    cfg |= {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    results = []
    for c in (cfg, {k: v for k, v in cfg.items() if k != "zero_allow_untested_optimizer"}):
        model = torch.nn.Linear(64, 64).to(torch.float16)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with _quiet_deepspeed(), _deepspeed_world(4):
            try:
                engine, *_ = deepspeed.initialize(model=model, optimizer=sgd, config=c)
                results.append(type(engine.optimizer).__name__)
            except AssertionError as exc:
                results.append(str(exc))
    assert results[0] == "DeepSpeedZeroOptimizer"
    assert "zero_allow_untested_optimizer" in results[1]  # the key is what makes it pass


@pytest.mark.parametrize(("name", "nodes"), [("zero3-offload", 1), ("zero3-offload", 2), ("zero2-fp16", 1)])
def test_accelerate_deepspeed_config_loads_and_validates(
    name: str, nodes: int, tmp_path: Path, monkeypatch: Any
) -> None:
    """accelerate's own chain for a ZeRO plan: the config file through ``accelerate launch``'s parser and
    validation, the environment its DeepSpeed launcher gives the processes, then ``DeepSpeedPlugin()`` built from
    that environment as ``Accelerator()`` builds it — which reads the exported ds_config.json (the plan's stage,
    batch and precision) and refuses a config that repeats one of the file's settings."""
    pytest.importorskip("deepspeed")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    strategy = STRATEGIES[name]
    if nodes > 1:
        strategy = dataclasses.replace(strategy, parallelism=Parallelism.for_gpus(8 * nodes))
    ex = export_plan(load_model("llama-3.1-8b"), strategy)
    write_export(ex, tmp_path)
    assert ex.deepspeed_config is not None and any("accelerate_deepspeed.yaml" in n for n in ex.notes)
    monkeypatch.chdir(tmp_path)  # the config names ds_config.json beside it, as accelerate resolves it

    def plugin(config: str) -> Any:
        argv = ["--config_file", config, "--machine_rank", str(nodes - 1), "--main_process_ip", "10.0.0.1", "t.py"]
        args, defaults, mp_from_config = _validate_launch_command(launch_command_parser().parse_args(argv))
        assert args.use_deepspeed and args.num_processes == strategy.world_size and args.num_machines == nodes
        # what launch_command hands the DeepSpeed launcher (commands/launch.py)
        fields = [*defaults.deepspeed_config, *(["mixed_precision"] if mp_from_config else [])]
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        for key, value in prepare_deepspeed_cmd_env(args)[1].items():
            monkeypatch.setenv(key, value)
        return DeepSpeedPlugin()

    p = plugin("accelerate_deepspeed.yaml")
    c = p.deepspeed_config
    assert p.zero_stage == int(strategy.sharding.value[-1]) and p.is_zero3_init_enabled() == (p.zero_stage == 3)
    assert (c["train_batch_size"], c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"]) == (
        strategy.global_batch, strategy.micro_batch, strategy.grad_accum
    )  # fmt: skip
    assert c.get(strategy.recipe.compute_dtype, {}).get("enabled") is True
    # the validation can fail: a mixed_precision beside the DeepSpeed file is refused
    cfg = json.loads(Path("accelerate_deepspeed.yaml").read_text())
    Path("bad.yaml").write_text(json.dumps(cfg | {"mixed_precision": strategy.recipe.compute_dtype}))
    with pytest.raises(ValueError, match="deepspeed_config_file"):
        plugin("bad.yaml")


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


def _flags(args: str) -> dict[str, str]:
    """``--name value`` pairs of a command line (flags without a value map to "")."""
    words, out = args.split(), {}
    for i, w in enumerate(words):
        if w.startswith("--"):
            nxt = words[i + 1] if i + 1 < len(words) else ""
            out[w] = "" if nxt.startswith("--") else nxt
    return out


def test_megatron_plan_from_the_cli_exports_what_megatron_runs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The audit's repro: Llama 3.1 8B on 8 × A100-40GB at 4096 tokens, global batch 64, plans TP 4 × PP 2 with
    Megatron's distributed optimizer (``--sharding zero1 --engine megatron``). The HF Trainer cannot run tensor or
    pipeline parallelism, so no training_args.json is written (it used to name a ds_config.json that Megatron plans
    do not get, which ``TrainingArguments`` refuses, with accumulation 1: 8 sequences a step, not 64); NOTES.txt says
    what to run instead, and the plan's global batch is what Megatron derives from the exported arguments
    (``--global-batch-size`` = micro-batch × micro-batches per step × data-parallel size, data-parallel size =
    launch.sh's processes / (TP × PP): megatron/training/arguments.py ``validate_args``)."""
    from tests.cli._cli_helper import run_cli

    r = run_cli(capsys, "plan", "llama-3.1-8b", "--gpu", "a100-sxm-40gb", "--gpus", "8", "--seq", "4096",
                "--global-batch", "64", "--export", str(tmp_path), "--json")  # fmt: skip
    assert r.code == 0, r.err
    top = json.loads(r.out)["plans"][0]["strategy"]
    assert top["engine"] == "megatron" and top["sharding"] == "zero1" and top["global_batch"] == 64
    names = {p.name for p in tmp_path.iterdir()}
    assert "training_args.json" not in names and "ds_config.json" not in names, names
    assert {"megatron_args.txt", "launch.sh", "NOTES.txt"} <= names
    launch = _flags((tmp_path / "launch.sh").read_text())
    args = _flags((tmp_path / "megatron_args.txt").read_text())
    world = int(launch["--nnodes"]) * int(launch["--nproc-per-node"])
    tp, pp = int(args["--tensor-model-parallel-size"]), int(args["--pipeline-model-parallel-size"])
    micro, global_batch = int(args["--micro-batch-size"]), int(args["--global-batch-size"])
    dp = world // (tp * pp)
    assert (world, tp, pp, dp) == (top["gpus"], top["tensor_parallel"], top["pipeline_parallel"], top["data_parallel"])
    assert global_batch == 64 and global_batch % (micro * dp) == 0
    assert global_batch // (micro * dp) == top["microbatches"]  # Megatron's micro-batches per step
    notes = (tmp_path / "NOTES.txt").read_text()
    assert "no training_args.json" in notes and "pretrain_gpt.py" in notes


@pytest.mark.parametrize(
    "strategy",
    [
        *STRATEGIES.values(),
        Strategy(  # TP 8 alone: Megatron's micro-batches are the accumulation steps
            micro_batch=2, grad_accum=4, sharding="zero1", engine=EngineOptions(engine=Engine.MEGATRON),
            parallelism=Parallelism.for_gpus(16, tensor=8, sequence_parallel=True),
        ),
        Strategy(  # TP 4 × PP 2 × DP 2, DDP's gradients (no distributed optimizer)
            micro_batch=1, sharding="ddp", engine=EngineOptions(engine=Engine.MEGATRON),
            parallelism=Parallelism.for_gpus(16, tensor=4, pipeline=2, microbatches=16),
        ),
        _two_d(),  # 2-D FSDP2 × DTensor TP: train_fsdp2.py's micro-batch × accumulation × dp size
    ],
    ids=[*sorted(STRATEGIES), "megatron-tp8", "megatron-tp4-pp2-ddp", "fsdp2-tp8"],
)  # fmt: skip
def test_exported_batch_is_the_plans(strategy: Strategy, tmp_path: Path) -> None:
    """The plan's global batch is what the exported files give: the Trainer's per-device batch × accumulation ×
    every process (its data-parallel size), or Megatron's ``--global-batch-size`` with its micro-batch at the plan's
    data-parallel size, or train_fsdp2.py's micro-batch × accumulation × data-parallel size; a Megatron or 2-D
    FSDP2 × TP plan gets no training_args.json (the Trainer runs no TP/PP, and its TP is not the plan's)."""
    ex = export_plan(load_model("llama-3.1-8b"), strategy)
    names = {p.name for p in write_export(ex, tmp_path)}
    if strategy.engine.engine is Engine.TORCH and strategy.parallelism.tensor > 1:
        assert ex.training_arguments is None and "training_args.json" not in names, names
        assert ex.script is not None and "train_fsdp2.py" in names
        micro = int(re.search(r"^MICRO_BATCH = .*, (\d+)\)\)$", ex.script, re.M).group(1))  # type: ignore[union-attr]
        accum = int(re.search(r"^ACCUM = .*, (\d+)\)\)$", ex.script, re.M).group(1))  # type: ignore[union-attr]
        assert micro * accum * strategy.parallelism.data == strategy.global_batch
        assert "no training_args.json" in (tmp_path / "NOTES.txt").read_text()
        return
    if strategy.parallelism.tensor > 1 or strategy.parallelism.pipeline > 1:
        assert ex.training_arguments is None and "training_args.json" not in names and "ds_config.json" not in names
        args = _flags(" ".join(ex.megatron_args))
        assert int(args["--global-batch-size"]) == strategy.global_batch
        per_step = strategy.global_batch // (int(args["--micro-batch-size"]) * strategy.parallelism.data)
        assert per_step * strategy.micro_batch * strategy.parallelism.data == strategy.global_batch
        assert f"× {per_step} micro-batches per step" in (tmp_path / "NOTES.txt").read_text()
        return
    kwargs = json.loads((tmp_path / "training_args.json").read_text())
    steps = kwargs["per_device_train_batch_size"] * kwargs["gradient_accumulation_steps"]
    assert steps * strategy.world_size == strategy.global_batch
    if "deepspeed" in kwargs:
        assert kwargs["deepspeed"] in names
        assert json.loads((tmp_path / kwargs["deepspeed"]).read_text())["train_batch_size"] == strategy.global_batch


@pytest.mark.parametrize(
    ("ckpt", "schedule", "v", "k"),
    [
        ("full", "1f1b", 1, 1),
        ("sqrt", "1f1b", 1, 4),  # 32 layers over 2 stages: 16 per stage, groups of ⌈16/⌈√16⌉⌉
        ("sqrt", "interleaved", 2, 3),  # 8 layers per model chunk: groups of ⌈8/3⌉ (3, 3, 2)
    ],
)
def test_megatron_recompute_groups_are_the_estimates_segments(ckpt: str, schedule: str, v: int, k: int) -> None:
    """``--recompute-method uniform --recompute-num-layers k`` per model chunk: the segments the estimate holds
    (``analytic.parallel.megatron_chunk_segments``), not every layer on its own for sqrt."""
    spec = load_model("llama-3.1-8b")
    s = Strategy(
        micro_batch=1,
        checkpointing=ckpt,  # type: ignore[arg-type]
        engine=EngineOptions(engine=Engine.MEGATRON),
        parallelism=Parallelism.for_gpus(
            8,
            tensor=2,
            pipeline=2,
            microbatches=4,
            pipeline_schedule=schedule,
            virtual_stages=v,  # type: ignore[arg-type]
        ),
    )
    args = " ".join(export_plan(spec, s).megatron_args)
    assert f"--recompute-granularity full --recompute-method uniform --recompute-num-layers {k}" in args


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

    # one GPU: a torch-engine plan (on 8 GPUs Megatron-LM's fused elementwise kernels put its TP/PP plans first)
    r = run_cli(capsys, "plan", "qwen2.5-0.5b", "--gpu", "a100-sxm-80gb", "--gpus", "1", "--seq", "2048",
                "--global-batch", "64", "--export", str(tmp_path), "--json")  # fmt: skip
    assert r.code == 0, r.err
    out = json.loads(r.out)
    top = out["plans"][0]["strategy"]
    kwargs = json.loads((tmp_path / "training_args.json").read_text())
    assert kwargs["per_device_train_batch_size"] == top["micro_batch"]
    assert str(tmp_path / "launch.sh") in out["exported"]


def test_an_fp16_fsdp_plan_trains_in_fp16_and_reads_back_as_the_plan(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A T4 has no bf16: the planner's FSDP2 plans for Llama 3.2 3B on 2 of them are fp16, and the exported
    train_fsdp2.py gathers in fp16 over fp32 shards and scales the loss (before 2026-12-04 it trained fp32). Its
    training_args.json read back by ``estimate --from`` (the Trainer's spelling of the recipe is amp-fp16, which
    FSDP2's policy makes the same run as master-fp16) gives the plan's memory and the plan's speed, exactly (before
    2026-12-04 the speed model charged the amp-* spelling autocast's casts: 14% slower). The first FSDP2 plan, not
    the top one: ZeRO-3's 16-bit offloaded gradients now rank it first by 0.3%."""
    from tests.cli._cli_helper import run_cli
    from trainfit.planner.api import plan

    spec = load_model("llama-3.2-3b")
    plans = plan(spec, "t4", gpus=2, seq=2048, global_batch=64, top=8).plans
    fsdp = next(p for p in plans if p.strategy.sharding.value == "fsdp")
    assert fsdp.strategy.recipe.compute_dtype == "fp16" and fsdp.strategy.recipe.mixed, fsdp.strategy
    write_export(export_plan(spec, fsdp.strategy), tmp_path)
    script = (tmp_path / "train_fsdp2.py").read_text()
    assert re.search(r"^FP16 = True\b", script, re.M) and re.search(r"^BF16 = False\b", script, re.M)
    assert "MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)" in script
    back = run_cli(capsys, "estimate", "llama-3.2-3b", "--from", str(tmp_path / "training_args.json"), "--gpus", "2",
                   "--seq", "2048", "--gpu", "t4", "--json")  # fmt: skip
    assert back.code == 0, back.err
    est = json.loads(back.out)
    assert (est["strategy"]["precision"], est["strategy"]["sharding"]) == ("amp-fp16", "fsdp")
    assert (est["required_bytes"], est["usable_bytes"]) == (fsdp.required_bytes, fsdp.usable_bytes)
    assert est["step_seconds"] == pytest.approx(fsdp.speed.step_seconds, rel=1e-12)


def test_2d_plan_exports_a_tp_then_fsdp2_script() -> None:
    """2-D FSDP2 × DTensor TP: train_fsdp2.py builds the ("dp", "tp") mesh, applies ``parallelize_module`` (the
    estimate's Llama plan with SP) and only then ``fully_shard`` over the dp dimension; no Megatron arguments and no
    accelerate config (neither carries DTensor TP), and NOTES.txt says so."""
    import ast

    ex = export_plan(load_model("llama-3.1-8b"), _two_d())
    assert ex.script is not None and ex.megatron_args == () and ex.accelerate_config is None
    assert (
        ex.deepspeed_config is None and "train_fsdp2.py" in ex.launch and "--nnodes 2 --nproc-per-node 8" in ex.launch
    )
    tree = ast.parse(ex.script)
    main = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "main")
    nodes = sorted(
        (n for n in ast.walk(main) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name | ast.Attribute)),
        key=lambda n: (n.lineno, n.col_offset),
    )  # source order
    calls = [n.func.id if isinstance(n.func, ast.Name) else n.func.attr for n in nodes]  # type: ignore[union-attr]
    order = [c for c in calls if c in ("init_device_mesh", "tensor_parallel", "fully_shard")]
    assert order[:3] == ["init_device_mesh", "tensor_parallel", "fully_shard"], order
    assert re.search(r"^TP = 8\b", ex.script, re.M) and 'kw["mesh"] = mesh["dp"]' in ex.script
    from trainfit.trace.tensor_parallel import COLWISE, NORMS, ROWWISE  # the plan the trace runs

    consts = {
        n.targets[0].id: ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and isinstance(n.value, ast.Tuple)
    }
    assert (consts["COLWISE"], consts["ROWWISE"], consts["NORMS"]) == (COLWISE, ROWWISE, NORMS)
    assert any("2-D FSDP2" in n for n in ex.notes)
    one_d = export_plan(load_model("llama-3.1-8b"), STRATEGIES["fsdp"])
    assert one_d.script is not None and re.search(r"^TP = 1\b", one_d.script, re.M)
    assert one_d.accelerate_config is not None


def test_2d_script_without_sequence_parallel_is_refused() -> None:
    from trainfit.errors import StrategyError

    with pytest.raises(StrategyError, match="sequence-parallel"):
        export_plan(load_model("llama-3.1-8b"), _two_d(sp=False))


def _saver(**savers: Any) -> Strategy:
    from trainfit.strategy import MemorySavers

    micro, accum = (4, 1) if savers.get("optimizer_in_backward") else (2, 2)
    return Strategy(precision="pure-bf16", optimizer="adamw-8bit", checkpointing="full", micro_batch=micro,
                    grad_accum=accum, seq_len=4096, savers=MemorySavers(**savers))  # fmt: skip


@pytest.mark.parametrize(
    ("savers", "override"),
    [
        ({"loss": "chunked"}, "loss._component_=torchtune.modules.loss.CEWithChunkedOutputLoss"),
        ({"activation_offload": True}, "enable_activation_offloading=True"),
        ({"optimizer_in_backward": True}, "optimizer_in_bwd=True"),
    ],
)
def test_torchtune_savers_export_recipe_overrides(savers: dict[str, Any], override: str, tmp_path: Path) -> None:
    """The savers the HF Trainer has no switch for are exported as torchtune ``full_finetune_single_device``
    overrides (the keys of its *_full_single_device.yaml configs); NOTES.txt and the plan say the Trainer lacks them."""
    s = _saver(**savers)
    ex = export_plan(load_model("llama-3.1-8b"), s)
    tune = ex.torchtune_overrides
    assert override in tune and "dtype=bf16" in tune and "enable_activation_checkpointing=True" in tune
    assert f"batch_size={s.micro_batch}" in tune and f"gradient_accumulation_steps={s.grad_accum}" in tune
    assert "optimizer._component_=bitsandbytes.optim.AdamW8bit" in tune and "tokenizer.max_seq_len=4096" in tune
    assert ex.launch.startswith("tune run full_finetune_single_device --config ")
    assert any("no TrainingArguments switch" in n for n in ex.notes)
    assert any("the HF Trainer has no switch" in n for n in ex.notes)
    files = write_export(ex, tmp_path)
    assert tmp_path / "torchtune_overrides.txt" in files
    assert (tmp_path / "torchtune_overrides.txt").read_text().split() == list(tune)


def test_torchtune_export_refuses_what_torchtune_does_not_run() -> None:
    import dataclasses

    from trainfit.errors import StrategyError

    for change in ({"precision": "amp-bf16"}, {"checkpointing": "sac"}, {"checkpointing": "none"}):
        with pytest.raises(StrategyError, match="torchtune"):
            export_plan(load_model("llama-3.1-8b"), dataclasses.replace(_saver(activation_offload=True), **change))
    # the fused loss is the Trainer's (Liger): no torchtune file
    from trainfit.strategy import MemorySavers

    fused = dataclasses.replace(_saver(), savers=MemorySavers(loss="fused-linear"))
    assert export_plan(load_model("llama-3.1-8b"), fused).torchtune_overrides == ()


def test_plan_cli_says_the_trainer_lacks_the_top_plans_saver(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Llama 3.2 3B on one RTX 4090 at sequence 1024: bf16 weights and 8-bit states fit only without gradients
    (optimizer-in-backward, accumulation 1); the plan says the HF Trainer has no switch for it and exports
    torchtune's overrides."""
    from tests.cli._cli_helper import run_cli

    r = run_cli(capsys, "plan", "llama-3.2-3b", "--gpu", "rtx-4090", "--seq", "1024", "--global-batch", "1",
                "--top", "1", "--export", str(tmp_path), "--json")  # fmt: skip
    assert r.code == 0, r.err
    out = json.loads(r.out)
    assert "--optimizer-in-backward" in out["plans"][0]["changes"]
    assert any("HF Trainer has no switch" in n for n in out["plans"][0]["notes"])
    assert "optimizer_in_bwd=True" in (tmp_path / "torchtune_overrides.txt").read_text()
    text = run_cli(capsys, "plan", "llama-3.2-3b", "--gpu", "rtx-4090", "--seq", "1024", "--global-batch", "1",
                   "--top", "1")  # fmt: skip
    assert "note: --optimizer-in-backward" in text.out


def _tiny_llama(folder: Path, *, tied: bool = False) -> Path:
    tiny = folder / "tiny"
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
                "tie_word_embeddings": tied,
            }
        )
    )
    return tiny


#: The variants beyond plain FSDP2 (``none``, which always runs: the issue's "a test runs it for real") start 2 or 4
#: more torch+transformers processes each: TRAINFIT_TORCHRUN_TESTS=1 runs them too.
_TORCHRUN_OPT_IN = pytest.mark.skipif(
    os.environ.get("TRAINFIT_TORCHRUN_TESTS") != "1",
    reason="2 or 4 torch+transformers processes take ~35 s on 2 cores: TRAINFIT_TORCHRUN_TESTS=1 runs it",
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "fp8",
    [
        "none",
        *(
            pytest.param(v, marks=_TORCHRUN_OPT_IN)
            for v in ("tied", "tensorwise", "2d", "no-reshard", "pure-bf16", "fp16", "fp16-2d", "fp16-offload")
        ),
    ],
)
def test_fsdp2_script_trains_on_two_cpu_processes(tmp_path: Path, fp8: str) -> None:
    """The exported train_fsdp2.py, run for real by torchrun: 2 processes, gloo, a 2-layer Llama of width 64 — its
    token embedding and [final norm, head] as units of their own (``UNITS``; ``tied``: the table tied to the head,
    inside that tail unit) — (with ``--fp8``: torchao's Float8Linear, whose ``torch._scaled_mm`` has a CPU kernel;
    ``2d``: 4 processes, FSDP2 over 2 data-parallel ranks × DTensor TP 2 with sequence parallelism — DTensor's
    collectives run on gloo; layers and root; ``no-reshard``: the layers kept unsharded after forward;
    ``pure-bf16``: the model built in bf16, no MixedPrecisionPolicy; ``fp16``: master-fp16, fp32 shards gathered in
    fp16 with fp32 reduce-scatters and torch.amp.GradScaler over the DTensor gradients — the CPU wheel runs every op of
    the fp16 step —, also over the 2-D mesh and with amp-fp16 and offloaded parameters and optimizer, unpinned)."""
    import dataclasses
    import subprocess
    import sys

    pytest.importorskip("torch")
    if fp8 == "tensorwise":
        pytest.importorskip("torchao.float8")
    if fp8 == "2d":
        strategy, procs = _two_d(world=4, tensor=2), 4
    elif fp8 == "fp16":
        strategy, procs = dataclasses.replace(STRATEGIES["fsdp"], precision="master-fp16"), 2
    elif fp8 == "fp16-2d":
        strategy, procs = dataclasses.replace(_two_d(world=4, tensor=2), precision="master-fp16"), 4
    elif fp8 == "fp16-offload":
        strategy, procs = dataclasses.replace(STRATEGIES["fsdp-offload"], precision="amp-fp16"), 2
    elif fp8 == "pure-bf16":
        strategy, procs = dataclasses.replace(STRATEGIES["fsdp"], precision="pure-bf16"), 2
    elif fp8 == "no-reshard":
        strategy, procs = dataclasses.replace(STRATEGIES["fsdp-no-reshard"], parallelism=Parallelism.for_gpus(2)), 2
    else:
        strategy, procs = dataclasses.replace(STRATEGIES["fsdp"], float8=fp8.replace("tied", "none")), 2  # type: ignore[arg-type]
    plan = export_plan(load_model("llama-3.1-8b"), strategy)
    assert plan.script is not None and ("UNITS = False" if fp8.endswith("2d") else "UNITS = True") in plan.script
    assert f"RESHARD_AFTER_FORWARD = {fp8 != 'no-reshard'}" in plan.script
    write_export(plan, tmp_path)
    tiny = _tiny_llama(tmp_path, tied=fp8 == "tied")
    env = {**os.environ, "TRAINFIT_MODEL": str(tiny), "TRAINFIT_SEQ": "16", "TRAINFIT_STEPS": "2",
           "TRAINFIT_ACCUM": "2", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs),
           str(tmp_path / "train_fsdp2.py")]  # fmt: skip
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    if res.returncode != 0 and _aborted_after_training(res, steps=2):
        # Seen twice on this 2-core machine under a full parallel test run: every step trained, then a process
        # aborted with a C++ terminate on its way out (gloo's threads at teardown). Run it once more; a second
        # failure, or any failure before the last step, fails the test.
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-1000:] + res.stderr[-3000:]
    assert "step 1 loss" in res.stdout
    if fp8.startswith("fp16"):  # gathered in fp16, reduced in fp32, the loss scaled (no overflow: 2**16 kept)
        assert "param_dtype=torch.float16, reduce_dtype=torch.float32" in res.stdout
        assert " scale 65536" in res.stdout
    else:
        assert " scale " not in res.stdout


def _aborted_after_training(res: Any, steps: int) -> bool:
    """A torchrun whose rank 0 printed every step's loss and whose failure is a process aborted by a C++
    ``std::terminate`` (SIGABRT): a teardown crash, not a training failure."""
    return f"step {steps - 1} loss" in res.stdout and "terminate called without an active exception" in res.stderr


_SCALER_CHECK = """
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, ".")
import train_fsdp2 as script  # the exported script's own policy and recipe switches

dist.init_process_group("gloo")
rank = dist.get_rank()
for fused in (False, True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    for module in (*model, model):
        fully_shard(module, mp_policy=script.mixed_precision(False))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused, foreach=not fused)
    scaler = torch.amp.GradScaler("cpu", enabled=script.FP16)
    x = torch.randn(4, 8)
    for step, inf in ((0, True), (1, False)):
        before = [p.to_local().clone() for p in model.parameters()]
        out = model(x)
        scaler.scale(out.float().mean()).backward()
        grad = next(model.parameters()).grad
        if inf and rank == 1:  # one rank's shard only
            grad.to_local()[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        moved = any(not torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters()))
        print(f"rank {rank} fused {fused} step {step} {out.dtype} {type(grad).__name__} {grad.dtype} "
              f"moved {moved} scale {scaler.get_scale():g}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
@_TORCHRUN_OPT_IN
def test_fsdp2_grad_scaler_skips_an_inf_on_every_rank(tmp_path: Path) -> None:
    """What the fp16 script relies on, shown on torch's own code over 2 gloo processes: under the script's policy the
    outputs are fp16 and the gradients fp32 DTensor shards; an inf in one rank's shard makes *every* rank skip the
    step and halve the scale (DTensor's ``found_inf_reduce_handler`` max-reduces found_inf over the mesh), and the
    next clean step is taken everywhere — with AdamW's foreach and fused kernels (the fused one reads the scaler's
    ``found_inf`` itself)."""
    import subprocess
    import sys

    pytest.importorskip("torch")
    strategy = dataclasses.replace(STRATEGIES["fsdp"], precision="master-fp16")
    write_export(export_plan(load_model("llama-3.1-8b"), strategy), tmp_path)
    (tmp_path / "check.py").write_text(_SCALER_CHECK)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "check.py"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = sorted(line for line in res.stdout.splitlines() if line.startswith("rank "))
    assert lines == sorted(
        f"rank {r} fused {f} step {s} torch.float16 DTensor torch.float32 moved {s == 1} scale 32768"
        for r in (0, 1)
        for f in (False, True)
        for s in (0, 1)
    ), res.stdout


@pytest.mark.parametrize(
    ("optimizer", "impl", "builds"),
    [
        ("adamw", "fused", "torch.optim.AdamW"),
        ("adamw", "foreach", "torch.optim.AdamW"),
        ("adamw-8bit", "fused", "bnb.optim.AdamW8bit"),
        ("sgd-momentum", "fused", "torch.optim.SGD"),
        ("adafactor", "fused", "Adafactor(params)"),
        ("lion", "fused", "Lion(params"),
    ],
)
def test_fsdp2_script_builds_the_plans_optimizer(optimizer: str, impl: str, builds: str) -> None:
    """The exported script steps the optimizer whose states the plan's memory counts (it used to write torch's
    AdamW whatever the plan chose), with AdamW's fused or foreach kernel as planned; the text is valid Python."""
    s = Strategy(parallelism=Parallelism(data=8), sharding="fsdp", optimizer=optimizer, optimizer_impl=impl)
    script = export_plan(load_model("llama-3.1-8b"), s).script
    assert script is not None
    compile(script, "train_fsdp2.py", "exec")
    assert f"OPTIMIZER = {optimizer!r}" in script and builds in script
    assert f"FUSED = {impl == 'fused'}" in script


def test_megatron_arguments_carry_the_model_and_say_what_they_cannot() -> None:
    """megatron_args.txt spells the model's departures from Megatron's GPT-2 defaults (read back from the ModelSpec;
    Megatron's own parser checks them in test_megatron_args.py where it is installed), launch.sh exports
    CUDA_DEVICE_MAX_CONNECTIONS=1 with TP (validate_args asserts it before Blackwell) and not without, and what
    the flags cannot express is a note."""
    mega = EngineOptions(engine=Engine.MEGATRON)
    spec = load_model("llama-3.1-8b")
    tp = Strategy(sharding="zero1", engine=mega, parallelism=Parallelism.for_gpus(8, tensor=4, sequence_parallel=True))
    ex = export_plan(spec, tp)
    args = " ".join(ex.megatron_args)
    for flag in (
        f"--num-layers {spec.num_layers}",
        f"--hidden-size {spec.hidden_size}",
        f"--ffn-hidden-size {spec.intermediate_size}",
        f"--num-attention-heads {spec.num_heads}",
        f"--group-query-attention --num-query-groups {spec.num_kv_heads}",
        "--swiglu",
        "--normalization RMSNorm",
        "--position-embedding-type rope",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
    ):
        assert flag in args, flag
    assert ex.launch.startswith("export CUDA_DEVICE_MAX_CONNECTIONS=1\n") and "pretrain_gpt.py" in ex.launch
    pp = Strategy(engine=mega, parallelism=Parallelism.for_gpus(2, pipeline=2, microbatches=2))
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in export_plan(spec, pp).launch
    gpt2 = " ".join(export_plan(load_model("gpt2"), pp).megatron_args)
    assert "--openai-gelu" in gpt2 and "--disable-bias-linear" not in gpt2 and "--untie" not in gpt2
    deepseek = export_plan(load_model("deepseek-v3"), pp)
    said = [n for n in deepseek.notes if "cannot say" in n]
    assert said and "multi-latent attention" in said[0] and "leading dense layers" in said[0]
