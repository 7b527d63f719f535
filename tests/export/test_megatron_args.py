"""megatron_args.txt through Megatron-LM's own argument parser.

megatron-core >= 0.17 ships ``megatron/training/arguments.py`` (earlier wheels carry ``megatron/core`` only) and
needs Python >= 3.12 (it imports ``typing.override``), so it cannot live in this project's Python 3.11 venv. The test
runs ``tests/export/_megatron_check.py`` — Megatron's ``parse_args`` + ``validate_args`` + its micro-batch
calculator, as ``pretrain_gpt.py`` initialises — under ``TRAINFIT_MEGATRON_PYTHON`` (a Python with megatron-core and
torch), or under this Python when it has ``megatron.training``; it skips, saying so, otherwise.

Every expected value is the Strategy's or the ModelSpec's, read back from what Megatron parsed; launch.sh's
``export`` lines are the launch environment (and without them Megatron refuses a TP plan before Blackwell)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from trainfit import load_model
from trainfit.arch.spec import MlpKind, ModelSpec
from trainfit.export import export_plan, write_export
from trainfit.strategy import Engine, EngineOptions, Parallelism, Strategy

CHECK = Path(__file__).with_name("_megatron_check.py")


def _megatron_python() -> str | None:
    if os.environ.get("TRAINFIT_MEGATRON_PYTHON"):
        return os.environ["TRAINFIT_MEGATRON_PYTHON"]
    try:
        found = importlib.util.find_spec("megatron.training.arguments") is not None
    except (ImportError, ValueError):
        found = False
    return sys.executable if found else None


PYTHON = _megatron_python()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        PYTHON is None,
        reason="Megatron-LM's parser is not installed: megatron-core>=0.17 (Python>=3.12, extra 'megatron'); "
        "point TRAINFIT_MEGATRON_PYTHON at a Python that has it",
    ),
]


def _mega(world: int, **par: Any) -> Parallelism:
    return Parallelism.for_gpus(world, **par)


# (slug, strategy, compute capability major of the plan's GPU)
CASES: list[tuple[str, Strategy, int]] = [
    (  # H100: TP 4 × PP 2 with SP, distributed optimizer, full recompute
        "llama-3.1-8b",
        Strategy(
            micro_batch=1, checkpointing="full", sharding="zero1", engine=EngineOptions(engine=Engine.MEGATRON),
            parallelism=_mega(16, tensor=4, pipeline=2, sequence_parallel=True, microbatches=16),
        ),
        9,
    ),
    (  # A100: interleaved schedule (virtual stages), selective recompute
        "llama-3.1-70b",
        Strategy(
            micro_batch=1, seq_len=4096, checkpointing="selective", sharding="zero1",
            engine=EngineOptions(engine=Engine.MEGATRON),
            parallelism=_mega(64, tensor=8, pipeline=4, sequence_parallel=True, microbatches=16,
                              pipeline_schedule="interleaved", virtual_stages=2),
        ),
        8,
    ),
    (  # q/k/v biases only, GQA, untied
        "qwen2.5-7b",
        Strategy(
            micro_batch=2, grad_accum=4, sharding="zero1", engine=EngineOptions(engine=Engine.MEGATRON),
            parallelism=_mega(8, tensor=2, sequence_parallel=True),
        ),
        9,
    ),
    (  # mixture of experts (no expert parallelism in the plan: every rank holds every expert's TP shard)
        "mixtral-8x7b-v0.1",
        Strategy(
            micro_batch=1, checkpointing="full", sharding="zero1", engine=EngineOptions(engine=Engine.MEGATRON),
            parallelism=_mega(32, tensor=8, pipeline=4, sequence_parallel=True, microbatches=8),
        ),
        9,
    ),
    (  # pure data parallelism: the distributed optimizer over 8 data-parallel ranks, no TP/PP (no
        # CUDA_DEVICE_MAX_CONNECTIONS needed), the overlapped reduction the speed model assumes
        "llama-3.2-1b",
        Strategy(
            micro_batch=1, grad_accum=8, seq_len=4096, sharding="zero1", engine=EngineOptions(engine=Engine.MEGATRON),
            parallelism=_mega(8),
        ),
        8,
    ),
    (  # V100: fp16 (dynamic loss scaling), the distributed optimizer over 4 data-parallel ranks with TP 2
        "llama-3.2-1b",
        Strategy(
            precision="master-fp16", micro_batch=1, grad_accum=4, seq_len=2048, sharding="zero1",
            engine=EngineOptions(engine=Engine.MEGATRON), parallelism=_mega(8, tensor=2),
        ),
        7,
    ),
    (  # GPT-2: Megatron's own defaults (biases, LayerNorm, learned positions, tied), tanh GeLU
        "gpt2",
        Strategy(
            micro_batch=4, seq_len=1024, engine=EngineOptions(engine=Engine.MEGATRON),
            parallelism=_mega(4, pipeline=2, microbatches=4),
        ),
        8,
    ),
]  # fmt: skip


def _launch_env(launch: str, world: int) -> dict[str, str]:
    env = dict(re.findall(r"^export (\w+)=(\S+)$", launch, flags=re.M))
    return env | {"WORLD_SIZE": str(world)}


def _run(cases: list[dict[str, Any]], tmp_path: Path) -> list[dict[str, Any]]:
    assert PYTHON is not None
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps(cases))
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "CUDA_DEVICE_MAX_CONNECTIONS")}
    run = subprocess.run(
        [PYTHON, "-W", "ignore", str(CHECK), str(spec)], capture_output=True, text=True, timeout=600, env=env
    )
    line = [x for x in run.stdout.splitlines() if x.startswith("MEGATRON_CHECK ")]
    assert run.returncode == 0 and line, run.stderr[-3000:]
    return list(json.loads(line[-1].removeprefix("MEGATRON_CHECK ")))


def _expected(spec: ModelSpec, s: Strategy) -> dict[str, Any]:
    par = s.parallelism
    return {
        "world_size": s.world_size,
        "data_parallel_size": par.data,
        "tensor_model_parallel_size": par.tensor,
        "pipeline_model_parallel_size": par.pipeline,
        "virtual_pipeline_model_parallel_size": par.virtual_stages if par.virtual_stages > 1 else None,
        "sequence_parallel": par.sequence_parallel,
        "use_distributed_optimizer": s.sharding.value == "zero1",
        # the data-parallel reduction overlapped with the backward, as the speed model times it
        "overlap_grad_reduce": par.data > 1,
        "overlap_param_gather": par.data > 1 and s.sharding.value == "zero1",
        # fp32 main gradients under bf16 and fp16 (the memory model's gradient buffer, the speed model's reduction
        # width): Megatron's own choice for bf16, the export's flag for fp16
        "accumulate_allreduce_grads_in_fp32": s.recipe.compute_dtype in ("bf16", "fp16"),
        "micro_batch_size": s.micro_batch,
        "global_batch_size": s.global_batch,
        # Megatron's micro-batches per step and replica: our accumulation × the pipeline's micro-batches
        "num_microbatches": s.grad_accum * (par.microbatches if par.pipeline > 1 else 1),
        "seq_length": s.seq_len,
        "recompute_granularity": None if s.checkpointing.value == "none" else s.checkpointing.value,
        "bf16": s.recipe.compute_dtype == "bf16",
        "fp16": s.recipe.compute_dtype == "fp16",
        "num_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "ffn_hidden_size": spec.intermediate_size,
        "num_attention_heads": spec.num_heads,
        "num_query_groups": spec.num_kv_heads,
        "kv_channels": spec.head_dim,
        "swiglu": spec.mlp is MlpKind.GATED,
        "normalization": "RMSNorm" if spec.norm.value == "rmsnorm" else "LayerNorm",
        "position_embedding_type": "rope" if spec.rotary_dim else "learned_absolute",
        "untie_embeddings_and_output_weights": not spec.tie_word_embeddings,
        "add_bias_linear": spec.mlp_bias,
        "add_qkv_bias": spec.qkv_bias,
        "attention_dropout": spec.attention_dropout,
        "hidden_dropout": spec.hidden_dropout,
        "openai_gelu": spec.activation == "gelu_new",
        "num_experts": spec.moe.num_experts if spec.moe else None,
        "moe_ffn_hidden_size": spec.moe.expert_intermediate_size if spec.moe else None,
        **({"moe_router_topk": spec.moe.experts_per_token} if spec.moe else {}),
    }


def test_megatron_parses_and_validates_the_exported_arguments(tmp_path: Path) -> None:
    cases, wanted = [], []
    for i, (slug, strategy, arch) in enumerate(CASES):
        spec = load_model(slug)
        export = export_plan(spec, strategy)
        assert not any("cannot say" in n for n in export.notes), export.notes
        written = {p.name: p for p in write_export(export, tmp_path / str(i))}
        env = _launch_env(written["launch.sh"].read_text(), strategy.world_size)
        cases.append({"args_file": str(written["megatron_args.txt"]), "arch": arch, "env": env})
        wanted.append(_expected(spec, strategy))
    # launch.sh's CUDA_DEVICE_MAX_CONNECTIONS=1 matters: without it Megatron refuses TP before Blackwell
    cases.append({**cases[0], "env": {"WORLD_SIZE": str(CASES[0][1].world_size)}})
    got = _run(cases, tmp_path)
    for (slug, _, _), want, parsed in zip(CASES, wanted, got, strict=False):
        assert "error" not in parsed, (slug, parsed)
        # Megatron reads --num-query-groups only with --group-query-attention (else every head has its k/v)
        parsed["num_query_groups"] = parsed["num_query_groups"] if parsed["group_query_attention"] else None
        heads = parsed["num_attention_heads"]
        assert {k: parsed[k] for k in want} | {"num_query_groups": parsed["num_query_groups"] or heads} == want, slug
    assert "CUDA_DEVICE_MAX_CONNECTIONS" in got[-1].get("error", ""), got[-1]
