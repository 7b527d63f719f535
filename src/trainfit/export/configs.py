"""A plan's Strategy as the engines spell it: HF ``TrainingArguments`` keyword arguments, an accelerate config
for FSDP2 or DeepSpeed, a DeepSpeed config, a Megatron argument list and the ``torchrun`` / ``accelerate launch``
command.

Each mapping follows the engine's own documented keys:

- transformers ``TrainingArguments``: ``optim`` ``adamw_torch_fused`` / ``adamw_bnb_8bit``; ``fsdp=True`` with
  ``fsdp_config`` (``version`` 2, ``reshard_after_forward``, ``cpu_offload``, ``transformer_layer_cls_to_wrap``):
  transformers 5.24's ``_apply_legacy_fsdp_to_config`` deprecates the string form and refuses hybrid_shard
  under FSDP2.
- accelerate's ``fsdp_config``: ``fsdp_version: 2``, ``TRANSFORMER_BASED_WRAP``, ``fsdp_reshard_after_forward``,
  ``fsdp_offload_params``; for HSDP its ``parallelism_config`` (``dp_replicate_size`` × ``dp_shard_size``), and
  launch.sh runs ``accelerate launch`` (the Trainer's ``fsdp_config`` has no replica dimension). 2-D FSDP2 × TP
  plans get none: accelerate's ``tp_size`` is the model's transformers ``tp_plan``, without sequence parallelism.
- DeepSpeed's ``zero_optimization`` (``stage``, ``offload_optimizer`` / ``offload_param`` with ``device: cpu``)
  and its batch identity train_batch_size = micro × accumulation × data degree.
- accelerate's DeepSpeed config for the same ZeRO plans (``accelerate_deepspeed.yaml``): ``distributed_type:
  DEEPSPEED`` with ``deepspeed_config_file: ds_config.json`` — the form ``accelerate config`` writes when given a
  DeepSpeed file (commands/config/cluster.py: ``mixed_precision`` left unset, precision and batch from the file;
  ``DeepSpeedPlugin._deepspeed_config_checks`` refuses ``mixed_precision``, ``zero_stage``, accumulation or
  offload keys beside the file), ``zero3_init_flag`` for stage 3 (the model is built sharded: a full replica per
  GPU would not fit at load time), ``deepspeed_multinode_launcher: standard`` (torchrun on each node, no pdsh
  hostfile) across nodes. launch.sh keeps ``torchrun``; ``accelerate launch --config_file
  accelerate_deepspeed.yaml`` is the alternative for Accelerator-based scripts (NOTES.txt).
- Megatron-LM: the model's shape (``--num-layers``, ``--hidden-size``, ``--num-query-groups``, ``--swiglu``, …:
  Megatron's GPT defaults are GPT-2's, so Llama-style models spell every departure) and the plan's layout
  (``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``, ``--sequence-parallel``,
  ``--use-distributed-optimizer``, batch sizes, recompute, precision) for plans whose engine resolves to Megatron;
  launch.sh exports ``CUDA_DEVICE_MAX_CONNECTIONS=1`` with TP (``validate_args`` asserts it before Blackwell).
  Such plans get no ``TrainingArguments``: the HF Trainer runs data parallelism over every process, not TP × PP,
  and its batch would be micro × accumulation × world size, not Megatron's micro × micro-batches × data size.
  Checked by Megatron's own ``parse_args`` + ``validate_args`` (megatron-core ≥ 0.17 ships
  ``megatron/training/arguments.py``; Python ≥ 3.12) where it is installed (tests/export/test_megatron_args.py).
  2-D FSDP2 × DTensor TP plans get ``train_fsdp2.py`` with the TP plan instead (:mod:`trainfit.export.fsdp2_script`),
  and no ``TrainingArguments`` either: the Trainer's ``parallelism_config`` would give their batch, but its TP is the
  model's transformers ``tp_plan`` (no sequence parallelism, the embedding whole), not the plan's.
- torchtune's ``full_finetune_single_device`` recipe overrides (``torchtune_overrides.txt``, ``tune run`` in
  launch.sh) for the one-GPU savers only torchtune has: ``loss._component_=...CEWithChunkedOutputLoss``,
  ``enable_activation_offloading``, ``optimizer_in_bwd``, alone or combined (:func:`torchtune_overrides`; the
  keys and ``_component_`` paths are checked against torchtune 0.6.1's shipped configs where it is installed).
  The HF Trainer has no switch for them (:func:`hf_trainer_lacks`).

The caching allocator's configuration a plan was estimated with (``Plan.alloc_conf``, e.g. the planner's
``expandable_segments:True`` second chance) is exported by launch.sh (``export PYTORCH_CUDA_ALLOC_CONF=...`` before
the launch: torchrun and accelerate pass the environment to every worker) and NOTES.txt says why.

Tests load each file with the engine's own parser (tests/export). What a format cannot say is listed in
``Export.notes``. Where that is the plan's checkpointing (sqrt, selective, per-op SAC: the Trainer, accelerate,
DeepSpeed and train_fsdp2.py checkpoint every block), the files describe another run, and given the plan's GPU
:func:`export_plan` estimates it (:class:`ExportedRun`: its requirement, and whether it fits — full checkpointing
does not always need less than sqrt). The foreign configurations are plain JSON-shaped mappings, as the engines
take them.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainfit.analytic.parallel import megatron_chunk_segments
from trainfit.arch.spec import MlpKind, ModelSpec, NormKind
from trainfit.errors import StrategyError
from trainfit.export.fsdp2_script import fsdp2_script
from trainfit.hardware import GPUSpec
from trainfit.history import ProcessHistory
from trainfit.strategy import Checkpointing, Engine, LossImpl, Optimizer, Precision, Sharding, Strategy
from trainfit.units import fmt_gib

__all__ = [
    "LIGER_LOSS_ONLY",
    "Export",
    "ExportedRun",
    "export_files",
    "export_plan",
    "hf_trainer_lacks",
    "layer_class",
    "torchtune_overrides",
    "write_export",
]

#: The decoder-layer class transformers defines, where it is not ``<Prefix>DecoderLayer`` of ``<Prefix>ForCausalLM``.
_LAYER_CLASSES = {
    "gpt2": "GPT2Block",
    "gpt_neox": "GPTNeoXLayer",
    "bert": "BertLayer",
    "starcoder2": "Starcoder2DecoderLayer",
}

DEEPSPEED_FILE = "ds_config.json"
ACCELERATE_FILE = "accelerate_fsdp2.yaml"
ACCELERATE_DEEPSPEED_FILE = "accelerate_deepspeed.yaml"

#: TrainingArguments.liger_kernel_config with Liger's fused linear cross-entropy alone (the keys are
#: ``liger_kernel.transformers.apply_liger_kernel_to_*``'s arguments; ``trainfit.imports`` reads them back).
LIGER_LOSS_ONLY = {
    "fused_linear_cross_entropy": True,
    "cross_entropy": False,
    "rope": False,
    "swiglu": False,
    "rms_norm": False,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Export:
    training_arguments: dict[str, Any] | None  # transformers.TrainingArguments(**this, output_dir=...); None: Megatron
    accelerate_config: dict[str, Any] | None  # FSDP / HSDP plans: accelerate's config YAML (as a mapping)
    deepspeed_config: dict[str, Any] | None  # ZeRO plans: DeepSpeed's config JSON
    megatron_args: tuple[str, ...]  # Megatron-LM plans: its pretrain_gpt.py arguments
    launch: str  # the command that starts the job on one node (run it on each node with its --node-rank)
    script: str | None = None  # FSDP plans: train_fsdp2.py (trainfit.export.fsdp2_script)
    notes: tuple[str, ...]  # what the formats cannot express, and what the user must still do
    torchtune_overrides: tuple[str, ...] = ()  # torchtune-only savers: `tune run` key=value overrides
    accelerate_deepspeed_config: dict[str, Any] | None = None  # ZeRO plans: accelerate's config naming ds_config.json
    #: The run the Trainer/accelerate/DeepSpeed files and train_fsdp2.py stand for when they cannot say the plan's
    #: checkpointing (full for sqrt/selective/sac), estimated on the plan's GPU (None: they say the plan, or no GPU
    #: was given to :func:`export_plan`).
    exported_run: ExportedRun | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ExportedRun:
    """The run the exported files describe where it differs from the plan: the plan's strategy with
    ``checkpointing`` in place of ``plan_checkpointing``, estimated by :func:`trainfit.estimate.estimate` with the
    plan's GPU, headroom, allocator and releases."""

    checkpointing: Checkpointing  # what the files run (full: gradient_checkpointing, every block)
    plan_checkpointing: Checkpointing  # what the plan runs (sqrt, selective, sac)
    gpu_id: str
    required_bytes: int  # per GPU (the worst rank), the estimate's nvidia-smi figure
    usable_bytes: int

    @property
    def fits(self) -> bool:
        return self.required_bytes <= self.usable_bytes

    def note(self) -> str:
        """NOTES.txt's line (and the CLI's warning when it does not fit)."""
        head = (
            f"the exported configs run --checkpointing {self.checkpointing.value}, not the plan's "
            f"{self.plan_checkpointing.value}: estimated {fmt_gib(self.required_bytes)} per GPU of "
            f"{fmt_gib(self.usable_bytes)} usable on {self.gpu_id}"
        )
        if self.fits:
            return f"{head} — fits ({fmt_gib(self.usable_bytes - self.required_bytes)} to spare)"
        return (
            f"{head} — DOES NOT FIT (short by {fmt_gib(self.required_bytes - self.usable_bytes)}): apply the "
            f"plan's {self.plan_checkpointing.value} checkpointing in your own training code, or plan without it"
        )


def layer_class(spec: ModelSpec) -> str:
    """The transformer block class FSDP wraps (``LlamaForCausalLM`` → ``LlamaDecoderLayer``)."""
    if spec.model_type in _LAYER_CLASSES:
        return _LAYER_CLASSES[spec.model_type]
    for suffix in ("ForCausalLM", "LMHeadModel", "Model"):
        if spec.architecture.endswith(suffix):
            return spec.architecture[: -len(suffix)] + "DecoderLayer"
    return spec.architecture + "DecoderLayer"


def _mixed(strategy: Strategy) -> str:
    return {"bf16": "bf16", "fp16": "fp16"}.get(strategy.recipe.compute_dtype, "no")


def _nodes(strategy: Strategy) -> int:
    gpn = strategy.parallelism.gpus_per_node
    return max(1, -(-strategy.world_size // gpn))


def _deepspeed(strategy: Strategy) -> dict[str, Any]:
    stage = {Sharding.ZERO1: 1, Sharding.ZERO2: 2, Sharding.ZERO3: 3}[strategy.sharding]
    zero: dict[str, Any] = {
        "stage": stage,
        "contiguous_gradients": True,
        "overlap_comm": strategy.engine.overlap_comm if strategy.engine.overlap_comm is not None else stage == 3,
        "reduce_bucket_size": strategy.engine.reduce_bucket_size,
        "allgather_bucket_size": strategy.engine.allgather_bucket_size,
    }
    if stage == 3:  # the analytic model's fetch window (``prefetch_bucket_size``) is the one DeepSpeed runs with
        zero["stage3_prefetch_bucket_size"] = strategy.engine.prefetch_bucket_size
        zero["stage3_max_live_parameters"] = strategy.engine.max_live_parameters
        zero["stage3_max_reuse_distance"] = strategy.engine.max_reuse_distance
    if strategy.offload.optimizer_on_host:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if strategy.offload.parameters_on_host:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg: dict[str, Any] = {
        "train_batch_size": strategy.global_batch,
        "train_micro_batch_size_per_gpu": strategy.micro_batch,
        "gradient_accumulation_steps": strategy.effective_batch // strategy.micro_batch,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
    }
    if strategy.recipe.compute_dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif strategy.recipe.compute_dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    if strategy.optimizer is Optimizer.ADAMW:  # DeepSpeed's own (CPU Adam under offload); lr is the user's choice
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8}}
    else:
        # The Trainer's own optimizer (SGD, Lion, Adafactor, 8-bit AdamW) goes to DeepSpeed as a client optimizer,
        # which ZeRO refuses unless allowed: runtime/engine.py ``_do_optimizer_sanity_check`` asserts
        # ``zero_allow_untested_optimizer`` for any type outside runtime/zero/utils.py ``ZERO_SUPPORTED_OPTIMIZERS``
        cfg["zero_allow_untested_optimizer"] = True
    return cfg


def _accelerate_machine(strategy: Strategy, distributed_type: str) -> dict[str, Any]:
    """The keys every accelerate config of a plan has (``accelerate config``'s LOCAL_MACHINE answers): the processes,
    the machines and, across nodes, the main process (``MASTER_ADDR``: yours to fill in)."""
    cfg: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": distributed_type,
        "num_machines": _nodes(strategy),
        "num_processes": strategy.world_size,
        "machine_rank": 0,
        "main_training_function": "main",
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if cfg["num_machines"] > 1:
        cfg["main_process_ip"] = "MASTER_ADDR"
        cfg["main_process_port"] = 29500
    return cfg


def _accelerate(spec: ModelSpec, strategy: Strategy) -> dict[str, Any]:
    cfg = _accelerate_machine(strategy, "FSDP") | {
        "mixed_precision": _mixed(strategy),
        "downcast_bf16": "no",
        "fsdp_config": {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": layer_class(spec),
            "fsdp_reshard_after_forward": strategy.engine.reshard_after_forward,
            "fsdp_offload_params": strategy.offload.parameters_on_host,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_activation_checkpointing": strategy.checkpointing is not Checkpointing.NONE,
        },
    }
    if strategy.sharding is Sharding.HSDP:
        cfg["parallelism_config"] = _hsdp_mesh(strategy)
    return cfg


def _accelerate_deepspeed(strategy: Strategy) -> dict[str, Any]:
    """accelerate's config for a ZeRO plan: ``ds_config.json`` by reference, nothing that duplicates it (see the
    module docstring)."""
    ds: dict[str, Any] = {
        "deepspeed_config_file": DEEPSPEED_FILE,
        "zero3_init_flag": strategy.sharding is Sharding.ZERO3,
    }
    if _nodes(strategy) > 1:
        ds["deepspeed_multinode_launcher"] = "standard"
    return _accelerate_machine(strategy, "DEEPSPEED") | {"deepspeed_config": ds}


def _hsdp_mesh(strategy: Strategy) -> dict[str, int]:
    """accelerate's ``parallelism_config`` section for HSDP (the keys ``accelerate config`` writes,
    commands/config/cluster.py; ``accelerate launch`` exports them as ``PARALLELISM_CONFIG_*`` and
    ``Accelerator()`` builds ``ParallelismConfig()`` from them): replicated over the nodes, sharded over each node's
    GPUs — the ``("dp_replicate", "dp_shard_cp")`` mesh accelerate hands ``fully_shard``
    (utils/fsdp_utils.py ``fsdp2_prepare_model``), trainfit's HSDP (shard group ``min(dp, gpus_per_node)``)."""
    shard = min(strategy.world_size, strategy.parallelism.gpus_per_node)
    return {
        "parallelism_config_dp_replicate_size": strategy.world_size // shard,
        "parallelism_config_dp_shard_size": shard,
        "parallelism_config_tp_size": 1,
        "parallelism_config_cp_size": 1,
    }


def _training_arguments(spec: ModelSpec, strategy: Strategy, notes: list[str]) -> dict[str, Any]:
    args: dict[str, Any] = {
        "per_device_train_batch_size": strategy.micro_batch,
        "gradient_accumulation_steps": strategy.grad_accum,
        "gradient_checkpointing": strategy.checkpointing is not Checkpointing.NONE,
        "optim": "adamw_bnb_8bit" if strategy.optimizer is Optimizer.ADAMW_8BIT else "adamw_torch_fused",
        "bf16": strategy.recipe.compute_dtype == "bf16",
        "fp16": strategy.recipe.compute_dtype == "fp16",
    }
    if strategy.optimizer not in (Optimizer.ADAMW, Optimizer.ADAMW_8BIT):
        notes.append(f"optimizer {strategy.optimizer.value}: set TrainingArguments.optim yourself")
    if strategy.savers.loss is LossImpl.FUSED_LINEAR:
        # transformers Trainer: apply_liger_kernel(model, liger_kernel_config); only the fused linear
        # cross-entropy, the saver the plan's memory counts (Liger's rope/swiglu/rms_norm kernels save differently).
        args["use_liger_kernel"] = True
        args["liger_kernel_config"] = dict(LIGER_LOSS_ONLY)
        notes.append("--loss fused-linear: pip install liger-kernel (the Trainer applies only its fused linear "
                     "cross-entropy, per liger_kernel_config)")  # fmt: skip
    for line in hf_trainer_lacks(strategy):
        notes.append(line)
    if strategy.sharding in (Sharding.FSDP, Sharding.HSDP):
        # transformers ≥ 5: fsdp=True with everything in fsdp_config (the string form is deprecated, and FSDP2
        # takes no hybrid_shard there: HSDP is accelerate's ParallelismConfig, see the notes).
        args["fsdp"] = True
        args["fsdp_config"] = {
            "version": 2,
            "reshard_after_forward": strategy.engine.reshard_after_forward,
            "cpu_offload": strategy.offload.parameters_on_host,
            "transformer_layer_cls_to_wrap": [layer_class(spec)],
        }
        if strategy.grad_accum > 1:
            # The plan's memory reduce-scatters the gradients after every micro-step; the Trainer's default
            # (accelerate's no_sync: FSDP2 set_requires_gradient_sync(False)) would keep every unsharded gradient
            # until the last one (analytic.parallel.fsdp_no_sync_grad_bytes).
            args["accelerator_config"] = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
            notes.append(
                "accelerator_config gradient_accumulation_kwargs sync_each_batch=True: FSDP2 reduce-scatters after "
                "every micro-step, as the plan's memory assumes (the Trainer's default keeps unsharded gradients "
                "between micro-steps)"
            )
        if strategy.sharding is Sharding.HSDP:
            mesh = _hsdp_mesh(strategy)
            notes.append(
                f"HSDP ({mesh['parallelism_config_dp_replicate_size']} replicas × "
                f"{mesh['parallelism_config_dp_shard_size']} shards): the Trainer's fsdp_config has no replica "
                "dimension; launch.sh runs it with accelerate_fsdp2.yaml, whose parallelism_config carries the mesh"
            )
    elif strategy.sharding.value.startswith("zero"):
        args["deepspeed"] = DEEPSPEED_FILE
    elif strategy.sharding is Sharding.DDP:
        # The Trainer passes find_unused_parameters=True unless told otherwise whenever the model is not a
        # checkpointing PreTrainedModel (a PeftModel, or any model without checkpointing: trainer.py
        # ``_build_accelerator_args``): DDP then buckets by bucket_cap_mb from the start, never rebuilds, and walks
        # the graph every step. The plan's memory is DDP's default (False).
        args["ddp_find_unused_parameters"] = False
        notes.append(
            "ddp_find_unused_parameters=False: DDP's default, which the plan's memory assumes (the Trainer would "
            "set True for a PEFT model or a model without gradient checkpointing)"
        )
    if strategy.checkpointing is Checkpointing.SQRT:
        notes.append(
            "sqrt checkpointing (segments of ⌈L/⌈√L⌉⌉ blocks) has no TrainingArguments switch: gradient_checkpointing"
            " checkpoints every block — a different run from the plan's, with its own memory (not always less than "
            "sqrt's: the checkpointed inputs are fewer, the recomputed block's live activations the same, and the "
            "allocator's reserve differs)"
        )
    elif strategy.checkpointing in (Checkpointing.SELECTIVE, Checkpointing.SAC):
        selective = strategy.checkpointing is Checkpointing.SELECTIVE
        how = (
            "Megatron's --recompute-granularity selective (the attention core only)"
            if selective
            else "torchtitan's per-op SAC (--activation_checkpoint.mode selective --activation_checkpoint"
            ".selective_ac_option op)"
        )
        notes.append(
            f"the plan uses {how}: TrainingArguments, accelerate and DeepSpeed have no switch for it, so their "
            "configs checkpoint every block (more recompute: --checkpointing full's step time, and its own memory)"
            + ("; megatron_args.txt keeps selective recompute" if selective else "")
        )
    if strategy.precision is Precision.PURE_BF16:
        notes.append("pure-bf16: load the model with torch_dtype=torch.bfloat16 (weights and Adam states in bf16)")
    elif strategy.precision in (
        Precision.MASTER_BF16,
        Precision.MASTER_FP16,
    ) and not strategy.sharding.value.startswith("zero"):
        notes.append(
            f"{strategy.precision.value}: 16-bit weights with an fp32 master copy is what DeepSpeed and FSDP2's "
            "MixedPrecisionPolicy do; under the plain Trainer use the amp recipe or --sharding zero*"
        )
    if strategy.adapter is not None:
        q = strategy.base_weights.quantization.value
        notes.append(
            f"LoRA rank {strategy.adapter.rank} on {', '.join(strategy.adapter.targets)} (peft.LoraConfig)"
            + (", base in nf4 with double quantisation (BitsAndBytesConfig load_in_4bit=True)" if q == "nf4" else "")
        )
    return args


def _script_notes(strategy: Strategy) -> list[str]:
    """What train_fsdp2.py does not carry of an FSDP2 plan (1-D beside training_args.json, 2-D alone): the note
    :func:`_training_arguments` gives the Trainer's plans about checkpointing modes, for the script (which builds a
    pure-bf16 plan's model in bf16 itself)."""
    notes: list[str] = []
    if strategy.checkpointing in (Checkpointing.SQRT, Checkpointing.SELECTIVE, Checkpointing.SAC):
        notes.append(
            f"--checkpointing {strategy.checkpointing.value}: train_fsdp2.py checkpoints every block "
            "(gradient_checkpointing_enable) — more recompute: --checkpointing full's step time, and its own memory"
        )
    return notes


#: torchtune's single-device full fine-tuning recipe, and the config to start from (the user's model's).
TORCHTUNE_RECIPE = "full_finetune_single_device"
TORCHTUNE_CONFIG = '"${TORCHTUNE_CONFIG:?set TORCHTUNE_CONFIG, e.g. llama3_1/8B_full_single_device}"'

#: The savers only torchtune switches on: flag → (what the HF Trainer lacks, the torchtune override).
_TORCHTUNE_SAVERS = {
    "--loss chunked": "torchtune's CEWithChunkedOutputLoss (loss._component_)",
    "--activation-offload": "torchtune's OffloadActivations (enable_activation_offloading=True)",
    "--optimizer-in-backward": "torchtune's per-parameter optimizer hooks (optimizer_in_bwd=True)",
}


def hf_trainer_lacks(strategy: Strategy) -> tuple[str, ...]:
    """One line per memory saver of ``strategy`` that the HF Trainer has no switch for (torchtune has: the plan's
    output and NOTES.txt say so)."""
    return tuple(
        f"{flag}: {what}; the HF Trainer has no switch for it (training_args.json leaves it out)"
        for flag, what in _TORCHTUNE_SAVERS.items()
        if any(n.startswith(flag) for n in strategy.savers.names())
    )


def torchtune_overrides(strategy: Strategy) -> tuple[str, ...]:
    """``key=value`` overrides of torchtune's ``full_finetune_single_device`` config (recipes/configs/*/
    *_full_single_device.yaml keys: ``batch_size``, ``gradient_accumulation_steps``, ``optimizer_in_bwd``,
    ``enable_activation_checkpointing``, ``enable_activation_offloading``, ``dtype``, ``loss._component_``,
    ``optimizer._component_``, ``tokenizer.max_seq_len``) for a one-GPU plan with savers only torchtune has (any
    combination of them); () otherwise. The recipe sets the model's output chunks from
    ``CEWithChunkedOutputLoss.num_output_chunks``; its ``__init__`` refuses optimizer_in_bwd with accumulation
    (``Strategy`` does too) and activation offloading without activation checkpointing (refused here).
    tests/export/test_torchtune.py checks every key against each config torchtune 0.6.1 registers for the recipe
    (``torchtune/_recipe_registry.py``) and resolves every ``_component_``."""
    sv = strategy.savers
    if not (sv.loss is LossImpl.CHUNKED or sv.activation_offload or sv.optimizer_in_backward):
        return ()
    if not strategy.parallelism.is_single_gpu or strategy.adapter is not None:
        return ()
    dtype = {Precision.PURE_BF16: "bf16", Precision.FP32: "fp32"}.get(strategy.precision)
    if dtype is None:
        raise StrategyError(
            f"torchtune trains in bf16 or fp32 without autocast (dtype: bf16|fp32): {strategy.precision.value} has "
            "no torchtune export; use --precision pure-bf16"
        )
    if strategy.checkpointing not in (Checkpointing.NONE, Checkpointing.FULL):
        raise StrategyError(
            f"torchtune checkpoints every layer or none (enable_activation_checkpointing): --checkpointing "
            f"{strategy.checkpointing.value} has no torchtune export"
        )
    if sv.activation_offload and strategy.checkpointing is not Checkpointing.FULL:
        # recipes/full_finetune_single_device.py __init__ raises RuntimeError("enable_activation_offloading should
        # only be True when enable_activation_checkpointing is True") (torchtune 0.6.1)
        raise StrategyError(
            "torchtune offloads activations only with activation checkpointing (enable_activation_checkpointing="
            "True): --activation-offload needs --checkpointing full for a torchtune export"
        )
    optimizer = {
        Optimizer.ADAMW: "torch.optim.AdamW",
        Optimizer.ADAMW_8BIT: "bitsandbytes.optim.AdamW8bit",
    }.get(strategy.optimizer)
    if optimizer is None:
        raise StrategyError(f"--optimizer {strategy.optimizer.value} has no torchtune export")
    if sv.loss is LossImpl.CHUNKED:
        loss = [
            "loss._component_=torchtune.modules.loss.CEWithChunkedOutputLoss",
            f"loss.num_output_chunks={sv.loss_chunks}",
        ]
    else:
        loss = ["loss._component_=torch.nn.CrossEntropyLoss"]
    return (
        f"batch_size={strategy.micro_batch}",
        f"gradient_accumulation_steps={strategy.grad_accum}",
        f"optimizer_in_bwd={sv.optimizer_in_backward}",
        f"enable_activation_checkpointing={strategy.checkpointing is Checkpointing.FULL}",
        f"enable_activation_offloading={sv.activation_offload}",
        f"dtype={dtype}",
        f"optimizer._component_={optimizer}",
        *loss,
        f"tokenizer.max_seq_len={strategy.seq_len}",
    )


def _megatron_model(spec: ModelSpec, seq_len: int) -> tuple[list[str], list[str]]:
    """(Megatron-LM's model arguments for ``spec``, what of the model they cannot say). Megatron's GPT defaults
    are GPT-2's — biased linears, GeLU, LayerNorm, learned positions, tied embeddings, dropout 0.1 (megatron-core
    0.19.2 ``megatron/training/arguments.py`` ``add_megatron_arguments`` and ``TransformerConfig``'s defaults) —
    so each departure of the model from them is spelled out (Megatron-LM's ``examples/llama`` scripts use the same
    flags)."""
    args = [
        f"--num-layers {spec.num_layers}",
        f"--hidden-size {spec.hidden_size}",
        f"--ffn-hidden-size {spec.intermediate_size}",
        f"--num-attention-heads {spec.num_heads}",
    ]
    lacks: list[str] = []
    if spec.head_dim * spec.num_heads != spec.hidden_size:
        args.append(f"--kv-channels {spec.head_dim}")
    if spec.num_kv_heads != spec.num_heads:
        args.append(f"--group-query-attention --num-query-groups {spec.num_kv_heads}")
    args.append(f"--max-position-embeddings {max(spec.max_position_embeddings or 0, seq_len)}")
    if spec.rotary_dim:
        args.append("--position-embedding-type rope")
        if spec.rotary_dim != spec.head_dim:
            args.append(f"--rotary-percent {spec.rotary_dim / spec.head_dim:g}")
    elif not spec.learned_positions:
        args.append("--position-embedding-type none")
    if spec.norm is NormKind.RMSNORM:
        args.append("--normalization RMSNorm")
    if spec.norm_unit_offset:
        args.append("--apply-layernorm-1p")
    if spec.qk_norm:
        args.append("--qk-layernorm")
    if spec.mlp is MlpKind.GATED and spec.activation == "silu":
        args.append("--swiglu")
    elif spec.mlp is MlpKind.DENSE and spec.activation in ("gelu_new", "gelu_pytorch_tanh"):
        args.append("--openai-gelu")  # Megatron's name for GeLU's tanh approximation
    elif spec.mlp is MlpKind.GATED or spec.activation != "gelu":
        lacks.append(f"the {spec.mlp.value} MLP with {spec.activation}")
    if not (spec.out_bias or spec.mlp_bias):
        args.append("--disable-bias-linear" + (" --add-qkv-bias" if spec.qkv_bias else ""))
    elif not spec.qkv_bias:
        lacks.append("output/MLP biases without q/k/v biases")
    if not spec.tie_word_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    args.append(f"--attention-dropout {spec.attention_dropout:g} --hidden-dropout {spec.hidden_dropout:g}")
    if spec.moe is not None:
        moe = spec.moe
        args.append(
            f"--num-experts {moe.num_experts} --moe-router-topk {moe.experts_per_token} "
            f"--moe-ffn-hidden-size {moe.expert_intermediate_size}"
        )
        if moe.num_shared_experts:
            shared = moe.num_shared_experts * moe.shared_expert_intermediate_size
            args.append(f"--moe-shared-expert-intermediate-size {shared}")
        if moe.num_dense_layers:
            lacks.append(f"the {moe.num_dense_layers} leading dense layers (--moe-layer-freq)")
    for name, present in (
        ("multi-latent attention", spec.mla is not None),
        ("parallel attention/MLP blocks", spec.parallel_attn),
        ("sliding-window attention", spec.sliding_window is not None and spec.sliding_layers > 0),
        ("logit soft-capping", spec.attn_logit_softcapping is not None or spec.final_logit_softcapping is not None),
        ("the embedding scale", spec.embedding_scale),
    ):
        if present:
            lacks.append(name)
    return args, lacks


def _megatron(strategy: Strategy, spec: ModelSpec) -> tuple[str, ...]:
    par = strategy.parallelism
    args = [
        *_megatron_model(spec, strategy.seq_len)[0],
        f"--tensor-model-parallel-size {par.tensor}",
        f"--pipeline-model-parallel-size {par.pipeline}",
        f"--micro-batch-size {strategy.micro_batch}",
        f"--global-batch-size {strategy.global_batch}",
        f"--seq-length {strategy.seq_len}",
    ]
    if par.sequence_parallel:
        args.append("--sequence-parallel")
    if par.virtual_stages > 1:
        args.append(f"--num-layers-per-virtual-pipeline-stage {spec.num_layers // (par.pipeline * par.virtual_stages)}")
    if strategy.sharding is Sharding.ZERO1:
        args.append("--use-distributed-optimizer")
    if par.data > 1:
        # The speed model hides the data-parallel gradient reduction behind the last micro-batch's backward
        # (planner.speed.step_time_of); Megatron overlaps it only when asked (--overlap-grad-reduce, default off:
        # megatron/training/arguments.py), and the distributed optimizer's parameter all-gather with the next forward
        # with --overlap-param-gather, which validate_args accepts only with both of the others. Megatron-LM's own
        # recipe sets all three (examples/llama/train_llama3_8b_h100_fp8.sh). Neither changes what is allocated: the
        # gradients and parameters already live in the contiguous buffers (param_and_grad_buffer.py).
        args.append("--overlap-grad-reduce")
        if strategy.sharding is Sharding.ZERO1:
            args.append("--overlap-param-gather")
    if strategy.checkpointing is Checkpointing.SELECTIVE:
        args.append("--recompute-granularity selective")
    elif strategy.checkpointing is not Checkpointing.NONE:
        # full: every layer its own group; sqrt: each model chunk's ⌈c/⌈√c⌉⌉ (the analytic model's segments)
        k = max(megatron_chunk_segments(spec, strategy))
        args.append(f"--recompute-granularity full --recompute-method uniform --recompute-num-layers {k}")
    if strategy.recipe.compute_dtype in ("bf16", "fp16"):
        args.append(f"--{strategy.recipe.compute_dtype}")
    if strategy.recipe.compute_dtype == "fp16":
        # fp32 main gradients, as the memory model holds them (4 B/param) and as Megatron sets itself for bf16
        # (megatron/training/arguments.py validate_args); under --fp16 alone they would be fp16, and the optimizer
        # would make an fp32 copy of each at the step (Float16OptimizerWithFloat16Params, main_grad.float())
        args.append("--accumulate-allreduce-grads-in-fp32")
    return tuple(args)


def export_plan(
    spec: ModelSpec,
    strategy: Strategy,
    *,
    script: str = "train.py",
    alloc_conf: str = "",
    gpu: GPUSpec | str | None = None,
    headroom: float = 0.30,
    torch_version: tuple[int, int] | None = None,
    cuda_version: tuple[int, int] | None = None,
    history: ProcessHistory | None = None,
) -> Export:
    """The engines' configurations for ``strategy`` (a plan's); ``alloc_conf``: the ``PYTORCH_CUDA_ALLOC_CONF`` the
    plan's memory was estimated with ("" PyTorch's defaults: launch.sh sets nothing). ``gpu`` (with the plan's
    ``headroom``, releases and process ``history``): where the files cannot say the plan's checkpointing (sqrt,
    selective, sac: they checkpoint every block), the run they do describe is estimated there
    (:attr:`Export.exported_run`) and NOTES.txt gives its figure and whether it fits."""
    from trainfit.analytic.parallel import resolve_engine

    notes: list[str] = []
    engine = resolve_engine(strategy)
    megatron = engine is Engine.MEGATRON
    two_d = strategy.parallelism.tensor > 1 and engine is Engine.TORCH  # 2-D FSDP2 × DTensor TP
    ds = _deepspeed(strategy) if strategy.sharding.value.startswith("zero") and not megatron else None
    acc_ds = _accelerate_deepspeed(strategy) if ds is not None else None
    acc = _accelerate(spec, strategy) if strategy.sharding in (Sharding.FSDP, Sharding.HSDP) and not two_d else None
    # The HF Trainer runs data parallelism only (DDP, FSDP, DeepSpeed ZeRO over every process): a Megatron plan's
    # TP × PP layout, and its batch (Megatron's micro-batches per step × the data-parallel size, not the world size),
    # has no TrainingArguments form, so none is written (NOTES.txt says what runs it). Nor for 2-D FSDP2 × DTensor
    # TP: TrainingArguments.parallelism_config (accelerate's ParallelismConfig(dp_shard_size, tp_size)) would give
    # the plan's batch, micro × accumulation × world / tp (Trainer._get_total_train_batch_size), but its TP is the
    # model's transformers tp_plan applied at load time — rowwise outputs replicated (all-reduce, no sequence-sharded
    # reduce-scatter), DistributedConfig.enable_sequence_parallel "not wired up yet", the embedding whole and the
    # logits gathered — not the sequence-parallel plan whose memory trainfit estimated; train_fsdp2.py runs that one.
    targs = None if megatron or two_d else _training_arguments(spec, strategy, notes)
    if two_d:
        tp = strategy.parallelism.tensor
        dp = strategy.world_size // tp
        notes.append(
            f"2-D FSDP2 × tensor parallel {tp}: run train_fsdp2.py (DTensor parallelize_module with sequence "
            "parallelism, then fully_shard over the dp mesh dimension); its global batch is MICRO_BATCH "
            f"{strategy.micro_batch} × ACCUM {strategy.grad_accum} × data-parallel size {dp} = {strategy.global_batch}"
        )
        notes.append(
            "no training_args.json and no accelerate config: the HF Trainer's and accelerate's tensor parallelism "
            f"(TrainingArguments.parallelism_config / accelerate's parallelism_config, dp_shard_size={dp}, "
            f"tp_size={tp}) is the model's transformers tp_plan (from_pretrained with tp_plan/DistributedConfig), "
            "which has no sequence parallelism (its row-parallel outputs are all-reduced and replicated; "
            "DistributedConfig.enable_sequence_parallel is not wired up) and keeps the embedding whole on each TP "
            "rank — not the plan whose memory trainfit estimated"
        )
        notes.extend(_script_notes(strategy))
    tune = torchtune_overrides(strategy)
    if tune:
        notes.append(
            "memory savers with no TrainingArguments switch ("
            + ", ".join(n for n in strategy.savers.names() if not n.startswith("--loss fused"))
            + "): training_args.json leaves them out; torchtune's full_finetune_single_device runs them with "
            "torchtune_overrides.txt (launch.sh)"
        )
    nodes, gpn = _nodes(strategy), min(strategy.world_size, strategy.parallelism.gpus_per_node)
    rdzv = " --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500" if nodes > 1 else ""
    code = None
    if strategy.sharding is Sharding.FSDP and strategy.adapter is None:  # with adapters: the Trainer and PEFT
        code, script = fsdp2_script(spec, strategy, layer_class(spec)), "train_fsdp2.py"
        if not two_d:  # (2-D plans said it above, with their batch)
            notes.extend(_script_notes(strategy))
    if strategy.float8.value != "none":
        notes.append(
            "--fp8: the Trainer, accelerate and DeepSpeed configs do not carry it; swap the blocks' linears with "
            "torchao's convert_to_float8_training (torchtitan: --model.converters float8)"
            + (" as train_fsdp2.py does" if code is not None else "")
        )
    launch = f"torchrun --nnodes {nodes} --nproc-per-node {gpn}{rdzv} {shlex.quote(script)}"
    if acc_ds is not None and not tune:
        notes.append(
            f"{ACCELERATE_DEEPSPEED_FILE}: for a script built on accelerate's Accelerator, launch with `accelerate "
            f"launch --config_file {ACCELERATE_DEEPSPEED_FILE} {script}` instead (it reads {DEEPSPEED_FILE}; run it "
            "where both files are)"
        )
    if strategy.sharding is Sharding.HSDP and code is None:  # the mesh is accelerate's (parallelism_config)
        machine = " --machine_rank $NODE_RANK --main_process_ip $MASTER_ADDR" if nodes > 1 else ""
        launch = f"accelerate launch --config_file {ACCELERATE_FILE}{machine} {shlex.quote(script)}"
    if tune:
        launch = f"tune run {TORCHTUNE_RECIPE} --config {TORCHTUNE_CONFIG} " + " ".join(shlex.quote(a) for a in tune)
    if megatron:
        par = strategy.parallelism
        layout = f"tensor {par.tensor} × pipeline {par.pipeline} × data {par.data}"
        notes.append(
            f"Megatron-LM ({layout}): run its pretrain_gpt.py with megatron_args.txt (the model's "
            "shape and the plan's layout; add your data and tokenizer: --data-path or --mock-data, --tokenizer-type "
            "…, and the schedule)"
        )
        why = (
            f"not this plan's {layout} layout"
            if par.tensor > 1 or par.pipeline > 1
            # pure data parallelism: the Trainer runs that layout, but not the engine whose memory and speed were
            # estimated (Megatron's fp32 main-gradient buffer and distributed optimizer, its fused kernels)
            else "not Megatron-LM, whose fp32 main-gradient buffer, distributed optimizer and fused kernels this "
            "plan's memory and speed are"
        )
        notes.append(
            f"no training_args.json: the HF Trainer runs data parallelism over every process (DDP, FSDP or DeepSpeed "
            f"ZeRO), {why}; launch.sh "
            f"runs it with Megatron-LM: --global-batch-size {strategy.global_batch} = --micro-batch-size "
            f"{strategy.micro_batch} × {strategy.effective_batch // strategy.micro_batch} micro-batches per step × "
            f"data-parallel size {par.data} (Megatron derives the micro-batches from the three)"
        )
        lacks = _megatron_model(spec, strategy.seq_len)[1]
        if lacks:
            notes.append(f"megatron_args.txt cannot say {', '.join(lacks)}: Megatron's GPT model would differ there")
        launch = f"torchrun --nnodes {nodes} --nproc-per-node {gpn}{rdzv} pretrain_gpt.py " + " ".join(
            _megatron(strategy, spec)
        )
        if strategy.parallelism.tensor > 1:
            # validate_args asserts it for TP (or CP) before Blackwell (megatron/training/arguments.py); Megatron-LM's
            # example launch scripts export it unconditionally (examples/gpt3/train_gpt3_175b_distributed.sh)
            launch = f"export CUDA_DEVICE_MAX_CONNECTIONS=1\n{launch}"
    if alloc_conf:
        notes.append(
            f"launch.sh exports PYTORCH_CUDA_ALLOC_CONF={alloc_conf}: the plan's memory estimate simulated the caching "
            "allocator with that setting"
            + (
                " (expandable segments grow one segment per stream in 2 MiB pages, so freed blocks do not strand "
                "reserved memory; without it the fragmentation does not leave the plan enough room)"
                if "expandable_segments:True" in alloc_conf
                else ""
            )
        )
        launch = f"export PYTORCH_CUDA_ALLOC_CONF={shlex.quote(alloc_conf)}\n{launch}"
    exported_run = None
    if gpu is not None and (targs is not None or code is not None):
        exported_run = _exported_run(spec, strategy, gpu, headroom, alloc_conf, torch_version, cuda_version, history)
        if exported_run is not None:
            notes.append(exported_run.note())
    return Export(
        exported_run=exported_run,
        training_arguments=targs,
        accelerate_config=acc,
        deepspeed_config=ds,
        megatron_args=_megatron(strategy, spec) if megatron else (),
        launch=launch,
        notes=tuple(notes),
        script=code,
        torchtune_overrides=tune,
        accelerate_deepspeed_config=acc_ds,
    )


#: The checkpointing modes the Trainer, accelerate, DeepSpeed and train_fsdp2.py cannot say: they checkpoint every
#: block (``gradient_checkpointing`` / ``gradient_checkpointing_enable``) instead.
_UNEXPRESSED = (Checkpointing.SQRT, Checkpointing.SELECTIVE, Checkpointing.SAC)


def _exported_run(
    spec: ModelSpec,
    strategy: Strategy,
    gpu: GPUSpec | str,
    headroom: float,
    alloc_conf: str,
    torch_version: tuple[int, int] | None,
    cuda_version: tuple[int, int] | None,
    history: ProcessHistory | None,
) -> ExportedRun | None:
    """The files' run where its checkpointing is not the plan's (:data:`_UNEXPRESSED` → full), by the estimate the
    plan's own memory came from (same GPU, headroom, allocator, releases, process); None where the files say the
    plan or no framework runs the substitute."""
    if strategy.checkpointing not in _UNEXPRESSED:
        return None
    import dataclasses

    from trainfit.errors import TrainfitError
    from trainfit.estimate import estimate  # trainfit.estimate imports the planner, whose report imports this

    run = dataclasses.replace(strategy, checkpointing=Checkpointing.FULL)
    try:
        rep = estimate(
            spec,
            run,
            gpu=gpu,
            headroom=headroom,
            search_micro_batch=False,
            allocator=alloc_conf,
            torch_version=torch_version,
            cuda_version=cuda_version,
            history=history,
        )
    except TrainfitError:
        return None
    assert rep.fit is not None  # a GPU was given
    return ExportedRun(
        checkpointing=Checkpointing.FULL,
        plan_checkpointing=strategy.checkpointing,
        gpu_id=rep.fit.gpu_id,
        required_bytes=rep.fit.required_bytes,
        usable_bytes=rep.fit.usable_bytes,
    )


def export_files(export: Export) -> dict[str, str]:
    """The files of ``export``, name → text, in the order :func:`write_export` writes them: training_args.json,
    ds_config.json, accelerate_deepspeed.yaml, accelerate_fsdp2.yaml, megatron_args.txt, train_fsdp2.py, launch.sh,
    NOTES.txt (those that apply: Megatron plans get no training_args.json). The accelerate configs are JSON, which
    is YAML (YAML 1.2 §1.3), so no YAML writer is needed."""
    files: dict[str, str] = {}
    if export.training_arguments is not None:
        files["training_args.json"] = json.dumps(export.training_arguments, indent=2) + "\n"
    if export.deepspeed_config is not None:
        files[DEEPSPEED_FILE] = json.dumps(export.deepspeed_config, indent=2) + "\n"
    if export.accelerate_deepspeed_config is not None:
        files[ACCELERATE_DEEPSPEED_FILE] = json.dumps(export.accelerate_deepspeed_config, indent=2) + "\n"
    if export.accelerate_config is not None:
        files[ACCELERATE_FILE] = json.dumps(export.accelerate_config, indent=2) + "\n"
    if export.megatron_args:
        files["megatron_args.txt"] = "\n".join(export.megatron_args) + "\n"
    if export.script is not None:
        files["train_fsdp2.py"] = export.script
    if export.torchtune_overrides:
        files["torchtune_overrides.txt"] = "\n".join(export.torchtune_overrides) + "\n"
    files["launch.sh"] = "#!/bin/sh\n" + export.launch + "\n"
    if export.notes:
        files["NOTES.txt"] = "\n".join(export.notes) + "\n"
    return files


def write_export(export: Export, directory: Path) -> tuple[Path, ...]:
    """Write :func:`export_files` of ``export`` into ``directory``; the paths written, in order."""
    directory.mkdir(parents=True, exist_ok=True)
    out: list[Path] = []
    for name, text in export_files(export).items():
        path = directory / name
        path.write_text(text, encoding="utf-8")
        out.append(path)
    return tuple(out)
