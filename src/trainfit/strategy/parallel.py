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


class PipelineSchedule(StrEnum):
    """Pipeline schedules (Megatron-LM ``schedules.py``): how many micro-batches a stage holds at once."""

    ONE_F_ONE_B = "1f1b"  # PipeDream-Flush: stage s holds min(pp − s, m) micro-batches (Narayanan et al. 2021)
    INTERLEAVED = "interleaved"  # virtual stages: first stage ⌈pp·(1 + (pp − 1)/(pp·v))⌉ (Megatron)
    GPIPE = "gpipe"  # all m micro-batches forward, then all backward (Huang et al. 2019)


class Engine(StrEnum):
    """Which framework's rules the numbers follow. ``auto`` picks the one users expect for the setup:
    megatron when tensor or pipeline parallelism is asked, deepspeed for zero*, torch for ddp/fsdp/hsdp."""

    AUTO = "auto"
    TORCH = "torch"
    DEEPSPEED = "deepspeed"
    MEGATRON = "megatron"


class FsdpWrap(StrEnum):
    """Which modules FSDP2 shards as units. ``root``: each decoder layer, then the root, which holds the embeddings,
    the final norm and the head (torchtitan's earlier ``apply_fsdp``, accelerate before PR #4015). ``units``: also the
    token embedding (``reshard_after_forward`` as set) and [final norm, head] (not resharded after forward; a tied
    table inside it) as units of their own before the root (torchtitan's ``apply_fsdp`` now; accelerate's
    ``fsdp2_prepare_model`` since PR #4015, 1.15)."""

    ROOT = "root"
    UNITS = "units"
    #: the default: ``units`` (what current frameworks do) where trainfit's analytic model has it, ``root`` elsewhere
    #: (a note says so; :func:`trainfit.analytic.parallel.resolved_fsdp_wrap`)
    AUTO = "auto"


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
    pipeline_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedule)
    microbatches: int = 1  # micro-batches per optimizer step and pipeline (Megatron's global/micro/dp)

    def __post_init__(self) -> None:
        coerce_enum(self, "pipeline_schedule", PipelineSchedule)
        for name in ("data", "tensor", "pipeline", "gpus_per_node", "virtual_stages", "microbatches"):
            positive_int(
                f"{name} parallel degree" if name in ("data", "tensor", "pipeline") else name, getattr(self, name)
            )
        if self.sequence_parallel and self.tensor == 1:
            raise StrategyError("sequence parallelism splits over the tensor-parallel group: it needs tensor > 1")
        if (self.pipeline_schedule is PipelineSchedule.INTERLEAVED or self.virtual_stages > 1) and self.pipeline == 1:
            raise StrategyError("an interleaved schedule (--virtual-stages) splits pipeline stages: it needs --pp > 1")

    @property
    def world_size(self) -> int:
        return self.data * self.tensor * self.pipeline

    @classmethod
    def for_gpus(cls, gpus: int, *, tensor: int = 1, pipeline: int = 1, **kwargs: object) -> Parallelism:
        """``gpus`` ranks split as data × tensor × pipeline: the data degree is gpus / (tensor·pipeline),
        and a world size that is not a multiple of tensor·pipeline is refused."""
        positive_int("gpus", gpus)
        positive_int("tensor parallel degree", tensor)
        positive_int("pipeline parallel degree", pipeline)
        if gpus % (tensor * pipeline):
            raise StrategyError(
                f"--gpus {gpus} is not a multiple of --tp {tensor} × --pp {pipeline} = {tensor * pipeline}"
            )
        return cls(data=gpus // (tensor * pipeline), tensor=tensor, pipeline=pipeline, **kwargs)  # type: ignore[arg-type]

    @property
    def is_single_gpu(self) -> bool:
        return self.world_size == 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Offload:
    """What lives in host memory (or on NVMe) instead of the GPU (ZeRO-Offload, Ren et al. 2021)."""

    optimizer: OffloadTarget = OffloadTarget.NONE
    parameters: OffloadTarget = OffloadTarget.NONE
    activations: bool = False  # activation checkpoints kept on the host (torch.autograd.graph.save_on_cpu)

    @classmethod
    def parse(cls, flag: str) -> Offload:
        """``none`` | ``optimizer`` (ZeRO-Offload) | ``optimizer+params`` (ZeRO-Infinity, FSDP2 CPUOffloadPolicy)."""
        choices = {
            "none": cls(),
            "optimizer": cls(optimizer=OffloadTarget.CPU),
            "optimizer+params": cls(optimizer=OffloadTarget.CPU, parameters=OffloadTarget.CPU),
        }
        if flag not in choices:
            raise StrategyError(f"unknown --offload '{flag}'; choose one of: {', '.join(choices)}")
        return choices[flag]

    @property
    def flag(self) -> str:
        """The ``--offload`` value this stands for."""
        if self.parameters is not OffloadTarget.NONE:
            return "optimizer+params"
        return "optimizer" if self.optimizer is not OffloadTarget.NONE else "none"

    def __post_init__(self) -> None:
        coerce_enum(self, "optimizer", OffloadTarget)
        coerce_enum(self, "parameters", OffloadTarget)

    @property
    def optimizer_on_host(self) -> bool:
        return self.optimizer is not OffloadTarget.NONE

    @property
    def parameters_on_host(self) -> bool:
        return self.parameters is not OffloadTarget.NONE

    @property
    def any(self) -> bool:
        return self.optimizer is not OffloadTarget.NONE or self.parameters is not OffloadTarget.NONE or self.activations


#: torch DDP's ``bucket_cap_mb`` when none is passed (torch/nn/parallel/distributed.py ``_DEFAULT_BUCKET_CAP_MB``).
TORCH_BUCKET_CAP_MB = 25


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineOptions:
    """The framework and the settings of it that move memory, at each framework's documented default.

    torch DDP: ``bucket_cap_mb`` 25 and a first bucket of 1 MiB (``dist._DEFAULT_FIRST_BUCKET_BYTES``),
    ``gradient_as_bucket_view`` False (torch/nn/parallel/distributed.py ``DistributedDataParallel.__init__``).
    FSDP2: ``reshard_after_forward`` True (torch/distributed/fsdp/_fully_shard/_fully_shard.py ``fully_shard``).
    DeepSpeed ZeRO: ``reduce_bucket_size`` and ``allgather_bucket_size`` 5e8 elements, ``contiguous_gradients``
    True, ``overlap_comm`` False for stages 1–2 and True for stage 3, ``stage3_prefetch_bucket_size`` 5e7,
    ``stage3_max_live_parameters`` and ``stage3_max_reuse_distance`` 1e9 (deepspeed/runtime/zero/config.py
    ``DeepSpeedZeroConfig``).
    """

    engine: Engine = Engine.AUTO
    reshard_after_forward: bool = True
    bucket_cap_mb: int = TORCH_BUCKET_CAP_MB
    first_bucket_bytes: int = 1024 * 1024
    gradient_as_bucket_view: bool = False
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool | None = None  # None: DeepSpeed's per-stage default
    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    #: FSDP2 under gradient accumulation: reduce-scatter after every micro-step (accelerate's ``sync_each_batch``,
    #: trainfit's exports); False: the HF Trainer's default, accelerate's ``no_sync`` on every micro-step but the
    #: last, which keeps each parameter's unsharded gradient (in the reduce dtype) until then.
    sync_each_batch: bool = True
    #: FSDP2: the model is built on the meta device and wrapped before its weights exist, then materialised
    #: shard by shard (``to_empty``: torchtitan). False: wrapped after it was loaded (accelerate, the HF Trainer),
    #: so each ``fully_shard`` call has its group's whole weights on the device, which leaves cached segments.
    sharded_init: bool = False
    #: FSDP2's units (:class:`FsdpWrap`).
    fsdp_wrap: FsdpWrap = FsdpWrap.AUTO

    @property
    def ddp_first_bucket_bytes(self) -> int:
        """The cap of DDP's first rebuilt bucket: ``first_bucket_bytes`` under torch's default ``bucket_cap_mb`` (the
        HF Trainer and accelerate pass none), the cap itself when one is given — torch 2.13 gives an explicit
        ``bucket_cap_mb`` to the first bucket too (torch/nn/parallel/distributed.py ``_BucketCapacityConfig.create``:
        ``dist._DEFAULT_FIRST_BUCKET_BYTES if is_using_default else bucket_bytes_cap``)."""
        return (
            self.first_bucket_bytes if self.bucket_cap_mb == TORCH_BUCKET_CAP_MB else self.bucket_cap_mb * 1024 * 1024
        )

    def __post_init__(self) -> None:
        coerce_enum(self, "engine", Engine)
        coerce_enum(self, "fsdp_wrap", FsdpWrap)
        for name in ("bucket_cap_mb", "first_bucket_bytes", "reduce_bucket_size", "allgather_bucket_size"):
            positive_int(name.replace("_", "-"), getattr(self, name))
        for name in ("prefetch_bucket_size", "max_live_parameters", "max_reuse_distance"):
            if getattr(self, name) < 0:
                raise StrategyError(f"{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
