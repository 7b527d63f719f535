"""Run by a Python that has Megatron-LM's argument parser (megatron-core >= 0.17 ships megatron/training/arguments.py;
it needs Python >= 3.12): parse each megatron_args.txt the way pretrain_gpt.py does (``parse_args`` then
``validate_args``, as ``initialize_megatron`` calls them; then Megatron's micro-batch calculator) and print what
Megatron made of it, or the assertion it failed, as one JSON line.

Usage: python _megatron_check.py CASES_JSON, a list of {"args_file", "arch", "env"}: ``env`` is the launch
environment (WORLD_SIZE and what launch.sh exports). ``validate_args`` asks the local GPU for its architecture
(``get_device_arch_version``); there is none here, so it is answered with the plan's GPU's compute-capability major.
Nothing else is replaced."""

import json
import os
import shlex
import sys

import megatron.training.arguments as megatron_arguments
from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator

KEYS = (
    "world_size", "data_parallel_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size", "sequence_parallel", "use_distributed_optimizer", "micro_batch_size",
    "global_batch_size", "seq_length", "recompute_granularity", "recompute_method", "bf16", "fp16", "num_layers",
    "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "swiglu",
    "normalization", "position_embedding_type", "untie_embeddings_and_output_weights", "add_bias_linear",
    "add_qkv_bias", "attention_dropout", "hidden_dropout", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
    "openai_gelu", "max_position_embeddings", "group_query_attention", "overlap_grad_reduce", "overlap_param_gather",
    "accumulate_allreduce_grads_in_fp32",
)  # fmt: skip

with open(sys.argv[1], encoding="utf-8") as f:
    cases = json.load(f)
results = []
base_env = dict(os.environ)
for case in cases:
    os.environ.clear()
    os.environ.update(base_env | case["env"])
    with open(case["args_file"], encoding="utf-8") as f:
        sys.argv = ["pretrain_gpt.py", *shlex.split(f.read())]
    megatron_arguments.get_device_arch_version = lambda arch=case["arch"]: int(arch)
    try:
        args = megatron_arguments.parse_args()
        megatron_arguments.validate_args(args, {})
        calc = ConstantNumMicroBatchesCalculator(
            args.global_batch_size, args.micro_batch_size, args.data_parallel_size, False, 0
        )
    except (AssertionError, SystemExit) as exc:
        results.append({"error": f"{type(exc).__name__}: {exc}"})
        continue
    results.append({k: getattr(args, k, None) for k in KEYS} | {"num_microbatches": calc.get()})
print("MEGATRON_CHECK " + json.dumps(results, default=str))
