"""Analytic vs trace for one rank of a many-GPU fine-tuning run: real PEFT LoRA models (and QLoRA's
bitsandbytes 4-bit layers) wrapped by the real FSDP2 ``fully_shard`` (both reshard settings, HSDP) and torch
DDP on PyTorch's fake process group (trainfit.trace.distributed), against the closed forms of
trainfit.analytic.parallel. Each phase must agree within 3%, and both must count the same trainable
parameters. ``python benchmarks/agreement_distributed.py`` prints the same at catalog sizes.

The configs are small but not tiny (hidden 256; 512 for QLoRA, whose per-tensor quant-state pieces would
otherwise dominate a rank's few bytes); one trace takes seconds."""

from __future__ import annotations

from typing import Any

import pytest

from trainfit.arch.config import spec_from_config
from trainfit.result import Component, Phase
from trainfit.strategy import EngineOptions, Parallelism, Strategy, finetune_setup

from .conftest import assert_phases_agree

pytest.importorskip("torch")
pytest.importorskip("peft")
from trainfit.analytic.parallel import estimate_parallel
from trainfit.trace.distributed import trace_distributed

TOLERANCE = 0.03

SMALL: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
    "max_position_embeddings": 512, "tie_word_embeddings": False,
}  # fmt: skip
WIDE = {**SMALL, "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8}

# (sharding, W, reshard_after_forward / gradient_as_bucket_view, finetune, targets, base dtype, precision)
CELLS = [
    ("fsdp", 8, True, "lora", "q_proj,v_proj", None, "amp-bf16"),
    ("fsdp", 8, False, "lora", "all-linear", None, "amp-bf16"),
    ("fsdp", 2, True, "lora", "all-linear", None, "amp-bf16"),
    ("fsdp", 2, False, "lora", "q_proj,v_proj", "bf16", "amp-bf16"),
    ("fsdp", 4, True, "lora", "all-linear", "bf16", "pure-bf16"),  # no policy: fp32 adapters on bf16 shards
    ("hsdp", 16, True, "lora", "all-linear", "bf16", "amp-bf16"),
    ("ddp", 2, False, "lora", "all-linear", None, "amp-bf16"),
    ("ddp", 8, True, "lora", "q_proj,v_proj", "bf16", "amp-bf16"),
    ("fsdp", 8, False, "qlora", "q_proj,v_proj", None, "amp-bf16"),
    ("ddp", 4, False, "qlora", "all-linear", None, "amp-bf16"),
]


def _strategy(sharding: str, w: int, flag: bool, how: str, targets: str, base: str | None, precision: str) -> Strategy:
    adapter, base_weights = finetune_setup(how, rank=8, targets=targets, base_dtype=base)
    return Strategy(
        adapter=adapter,
        base_weights=base_weights,
        precision=precision,
        parallelism=Parallelism(data=w, gpus_per_node=8),
        sharding=sharding,
        micro_batch=2,
        seq_len=128,
        engine=EngineOptions(
            reshard_after_forward=flag if sharding != "ddp" else True,
            gradient_as_bucket_view=flag if sharding == "ddp" else False,
        ),
    )


@pytest.mark.parametrize(
    ("sharding", "w", "flag", "how", "targets", "base", "precision"),
    [pytest.param(*c, id="-".join(map(str, c))) for c in CELLS],
)
def test_finetuning_rank_agrees_with_trace(
    sharding: str, w: int, flag: bool, how: str, targets: str, base: str | None, precision: str
) -> None:
    spec = spec_from_config(WIDE if how == "qlora" else SMALL, name=f"small-llama-{how}", source="test")
    s = _strategy(sharding, w, flag, how, targets, base, precision)
    traced = trace_distributed(spec, s)
    closed = estimate_parallel(spec, s)
    assert closed.trainable_params == traced.trainable_params
    # The traced step's grad clipping: one 512-byte norm per trainable tensor, their stack and the clip coefficient
    # (torch/nn/utils/clip_grad.py ``_get_total_norm``), which neither model counts; FSDP2's four layers are traced
    # whole (three and four layers are traced to extrapolate), where they are 3.4% of a tiny HSDP step.
    assert_phases_agree(closed, traced, TOLERANCE, step_slack=512 * (len(_trainable_tensors(spec, s)) + 2))
    # The resident states on their own: the trace counts the adapters among the weights; it also holds the
    # rotary embedding's two inv_freq buffers (one 512-byte block each), which the analytic model leaves out.
    step_a, step_t = closed.phase(Phase.OPTIMIZER_STEP), traced.phase(Phase.OPTIMIZER_STEP)
    held_a = step_a.get(Component.WEIGHTS) + step_a.get(Component.ADAPTER_WEIGHTS)
    assert abs(held_a - step_t.get(Component.WEIGHTS)) <= 0.01 * step_t.get(Component.WEIGHTS) + 2048
    assert step_a.get(Component.OPTIMIZER_STATES) == pytest.approx(step_t.get(Component.OPTIMIZER_STATES), rel=0.01)


def _trainable_tensors(spec: Any, s: Strategy) -> list[Any]:
    from trainfit.analytic.parallel import held_tensors

    return [h for h in held_tensors(spec, s) if h.trainable for _ in range(h.count)]


def test_trace_refuses_freeze_with_many_gpus_in_one_line() -> None:
    from trainfit.errors import StrategyError

    spec = spec_from_config(SMALL, name="small-llama", source="test")
    _, base = finetune_setup("freeze", freeze="embeddings")
    s = Strategy(base_weights=base, parallelism=Parallelism(data=2), sharding="fsdp")
    with pytest.raises(StrategyError, match="--freeze with many GPUs"):
        trace_distributed(spec, s)
