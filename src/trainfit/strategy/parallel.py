"""Many GPUs: how the work is split (parallelism degrees), how model states are sharded, what is offloaded.

Degrees follow Megatron-LM's naming: the world is ``data × tensor × pipeline`` ranks (Narayanan et al.
2021, "Efficient Large-Scale Language Model Training on GPU Clusters", §2); sequence parallelism
(Korthikanti et al. 2022, §4.2.2) splits the LayerNorm/dropout activations over the tensor-parallel group,
so it needs ``tensor > 1``. Sharding stages follow the ZeRO paper (Rajbhandari et al. 2020, §5):
stage 1 shards optimizer states, 2 adds gradients, 3 adds parameters, each over the data-parallel group;
PyTorch FSDP ``FULL_SHARD`` is stage 3 and ``SHARD_GRAD_OP`` stage 2; HSDP shards within a node and
replicates across nodes. The default (one GPU, no sharding, nothing offloaded) is today's single-GPU model.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from trainfit.errors import StrategyError
from trainfit.strategy._validate import coerce_enum, positive_int


class Sharding(StrEnum):
    NONE = "none"  # one GPU, or data parallel without DDP buckets (not a real multi-GPU setup)
    DDP = "ddp"  # replicated states + gradient buckets (torch DistributedDataParallel)
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"
    FSDP = "fsdp"  # FSDP2 fully_shard (= ZeRO-3 placement, per-module all-gather)
    HSDP = "hsdp"  # sharded within a node, replicated across nodes

    @property
    def shards_optimizer(self) -> bool:
        return self in (Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3, Sharding.FSDP, Sharding.HSDP)

    @property
    def shards_gradients(self) -> bool:
        return self in (Sharding.ZERO2, Sharding.ZERO3, Sharding.FSDP, Sharding.HSDP)

    @property
    def shards_parameters(self) -> bool:
        return self in (Sharding.ZERO3, Sharding.FSDP, Sharding.HSDP)


class OffloadTarget(StrEnum):
    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


@dataclass(frozen=True, slots=True, kw_only=True)
class Parallelism:
    """Parallel degrees; ``world_size`` is their product."""

    data: int = 1
    tensor: int = 1
    pipeline: int = 1
    sequence_parallel: bool = False
    gpus_per_node: int = 8  # HSDP's shard group and where NVLink ends

    def __post_init__(self) -> None:
        for name in ("data", "tensor", "pipeline", "gpus_per_node"):
            positive_int(f"{name} parallel degree" if name != "gpus_per_node" else name, getattr(self, name))
        if self.sequence_parallel and self.tensor == 1:
            raise StrategyError("sequence parallelism splits over the tensor-parallel group: it needs tensor > 1")

    @property
    def world_size(self) -> int:
        return self.data * self.tensor * self.pipeline

    @property
    def is_single_gpu(self) -> bool:
        return self.world_size == 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Offload:
    """What lives in host memory (or on NVMe) instead of the GPU (ZeRO-Offload, Ren et al. 2021)."""

    optimizer: OffloadTarget = OffloadTarget.NONE
    parameters: OffloadTarget = OffloadTarget.NONE
    activations: bool = False  # activation checkpoints kept on the host (torch.autograd.graph.save_on_cpu)

    def __post_init__(self) -> None:
        coerce_enum(self, "optimizer", OffloadTarget)
        coerce_enum(self, "parameters", OffloadTarget)

    @property
    def any(self) -> bool:
        return self.optimizer is not OffloadTarget.NONE or self.parameters is not OffloadTarget.NONE or self.activations
