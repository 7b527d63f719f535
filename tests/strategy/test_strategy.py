"""Strategy and its sub-configs: defaults reproduce one GPU / full fine-tuning / training; validation."""

from __future__ import annotations

import pytest

from trainfit.errors import StrategyError
from trainfit.strategy import (
    RECIPES,
    Adapter,
    BaseWeights,
    Checkpointing,
    DType,
    Offload,
    Parallelism,
    Precision,
    Quantization,
    Sharding,
    Strategy,
    Workload,
    checkpoint_layout,
)


def test_defaults_are_single_gpu_full_training() -> None:
    s = Strategy()
    assert s.world_size == 1 and s.trains_every_weight and s.workload is Workload.TRAINING
    assert s.beyond_single_gpu_training() == ()


@pytest.mark.parametrize(
    ("kw", "word"),
    [
        (dict(parallelism=Parallelism(data=8)), "8 GPUs"),
        (dict(sharding="zero3"), "sharding zero3"),
        (dict(offload=Offload(optimizer="cpu")), "offload"),
        (dict(adapter=Adapter(rank=8)), "lora adapters"),
        (dict(adapter=Adapter(rank=8), base_weights=BaseWeights(quantization="nf4")), "nf4"),
        (dict(workload="inference"), "inference"),
    ],
)
def test_each_departure_is_named(kw: dict[str, object], word: str) -> None:
    assert any(word in x for x in Strategy(**kw).beyond_single_gpu_training())  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [2.5, True, "4", 0, -1])
def test_batch_must_be_a_true_positive_integer(bad: object) -> None:
    with pytest.raises(StrategyError, match="batch must be a positive integer"):
        Strategy(micro_batch=bad)  # type: ignore[arg-type]


def test_unknown_enum_lists_choices() -> None:
    with pytest.raises(StrategyError, match="unknown sharding 'zero4'; choose one of: none, ddp"):
        Strategy(sharding="zero4")  # type: ignore[arg-type]


def test_parallelism_world_and_sequence_parallel_rule() -> None:
    assert Parallelism(data=4, tensor=2, pipeline=2).world_size == 16
    with pytest.raises(StrategyError, match="tensor > 1"):
        Parallelism(sequence_parallel=True)


def test_sharding_stages_follow_zero() -> None:
    # ZeRO paper §5: stage 1 optimizer states, 2 + gradients, 3 + parameters.
    assert [(s.shards_optimizer, s.shards_gradients, s.shards_parameters) for s in Sharding] == [
        (False, False, False),
        (False, False, False),
        (True, False, False),
        (True, True, False),
        (True, True, True),
        (True, True, True),
        (True, True, True),
    ]


def test_dtype_widths_are_bits() -> None:
    assert {d.value: d.bits for d in DType} == {
        "fp32": 32,
        "tf32": 32,
        "bf16": 16,
        "fp16": 16,
        "fp8-e4m3": 8,
        "fp8-e5m2": 8,
        "int8": 8,
        "nf4": 4,
        "fp4": 4,
    }
    assert Quantization.NF4.dtype is DType.NF4 and Quantization.NONE.dtype is None


def test_recipe_formats() -> None:
    assert RECIPES[Precision.AMP_BF16].weight_dtype is DType.FP32 and RECIPES[Precision.AMP_BF16].compute is DType.BF16
    assert RECIPES[Precision.PURE_BF16].weight_dtype is DType.BF16


def test_adapter_validation() -> None:
    with pytest.raises(StrategyError, match="rank"):
        Adapter(rank=0)
    with pytest.raises(StrategyError, match="dropout"):
        Adapter(dropout=1.0)
    with pytest.raises(StrategyError, match="16- or 32-bit"):
        Adapter(dtype="nf4")  # type: ignore[arg-type]


@pytest.mark.parametrize("layers", range(1, 130))
def test_sqrt_layout_covers_every_layer(layers: int) -> None:
    sizes = checkpoint_layout("sqrt", layers).segment_sizes  # type: ignore[arg-type]
    assert sum(sizes) == layers and max(sizes) <= -(-layers // max(1, int(layers**0.5)))


def test_whole_layer_checkpointing_is_the_one_with_segments() -> None:
    """``Checkpointing.whole_layers`` (what the trace, the stream and the closed form ask) says what the layout does:
    the modes that wrap whole layers in checkpoint segments; selective recomputes inside the layer."""
    for c in Checkpointing:
        assert c.whole_layers == bool(checkpoint_layout(c, 6).segment_sizes), c
    assert {c for c in Checkpointing if c.whole_layers} == {Checkpointing.FULL, Checkpointing.SQRT, Checkpointing.SAC}


@pytest.mark.parametrize(
    "kw", [dict(parallelism="x"), dict(adapter="lora"), dict(offload=True), dict(base_weights="nf4"), dict(flash_sdp=1)]
)
def test_sub_configs_must_be_their_types(kw: dict[str, object]) -> None:
    with pytest.raises(StrategyError, match="must be"):
        Strategy(**kw)  # type: ignore[arg-type]
