"""HOW a model runs: :class:`Strategy` and its value types (see :mod:`trainfit.strategy.core`).

Modules: ``dtypes`` (number formats and widths), ``recipe`` (precision recipes), ``training``
(optimizer, checkpointing, attention), ``parallel`` (degrees, sharding, offload), ``adapters``
(LoRA and base-weight storage), ``workload`` (training or inference, memory savers), ``core``
(the Strategy itself).
"""

from trainfit.strategy.adapters import (
    ALL_LINEAR,
    Adapter,
    AdapterKind,
    BaseWeights,
    Finetune,
    Quantization,
    finetune_setup,
)
from trainfit.strategy.core import Strategy
from trainfit.strategy.dtypes import DType
from trainfit.strategy.parallel import (
    Engine,
    EngineOptions,
    FsdpWrap,
    Offload,
    OffloadTarget,
    Parallelism,
    PipelineSchedule,
    Sharding,
)
from trainfit.strategy.recipe import FLOAT8_RECIPES, RECIPES, Float8, Precision, Recipe, recipe
from trainfit.strategy.training import (
    Attention,
    Checkpointing,
    CheckpointLayout,
    Optimizer,
    OptimizerImpl,
    checkpoint_layout,
)
from trainfit.strategy.workload import Generation, LossImpl, MemorySavers, Workload

__all__ = [
    "ALL_LINEAR",
    "FLOAT8_RECIPES",
    "RECIPES",
    "Adapter",
    "AdapterKind",
    "Attention",
    "BaseWeights",
    "CheckpointLayout",
    "Checkpointing",
    "DType",
    "Engine",
    "EngineOptions",
    "Finetune",
    "Float8",
    "FsdpWrap",
    "Generation",
    "LossImpl",
    "MemorySavers",
    "Offload",
    "OffloadTarget",
    "Optimizer",
    "OptimizerImpl",
    "Parallelism",
    "PipelineSchedule",
    "Precision",
    "Quantization",
    "Recipe",
    "Sharding",
    "Strategy",
    "Workload",
    "checkpoint_layout",
    "finetune_setup",
    "recipe",
]
