"""The Strategy: one value that says HOW a model runs — precision recipe, optimizer, batch shape and
checkpointing, and (as defaulted sub-configs) parallelism, sharding, offload, adapters, base-weight
storage, memory savers and the workload. Every default reproduces the single-GPU, full fine-tuning,
training-only model, so a capability arrives by reading one more sub-config, not by a new argument
threaded through every function.

Memory is per micro-step; ``grad_accum`` only scales the effective batch (accumulated gradients live in
the same gradient buffers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainfit.errors import StrategyError
from trainfit.strategy._validate import coerce_enum, positive_int
from trainfit.strategy.adapters import Adapter, BaseWeights, check_finetune
from trainfit.strategy.parallel import Engine, EngineOptions, FsdpWrap, Offload, Parallelism, Sharding
from trainfit.strategy.recipe import FLOAT8_RECIPES, RECIPES, Float8, Precision, Recipe
from trainfit.strategy.training import (
    Attention,
    Checkpointing,
    CheckpointLayout,
    Optimizer,
    OptimizerImpl,
    checkpoint_layout,
)
from trainfit.strategy.workload import Generation, MemorySavers, Workload


@dataclass(frozen=True, slots=True, kw_only=True)
class Strategy:
    precision: Precision = Precision.AMP_BF16
    optimizer: Optimizer = Optimizer.ADAMW
    checkpointing: Checkpointing = Checkpointing.NONE
    attention: Attention = Attention.SDPA
    # SDPA may use FlashAttention (torch.backends.cuda.enable_flash_sdp). PyTorch has no flash kernel below
    # compute capability 8.0: trainfit.estimate turns it off for such a --gpu.
    flash_sdp: bool = True
    # The HF Trainer's default (adamw_torch_fused with torch >= 2.8), like every other default here.
    optimizer_impl: OptimizerImpl = OptimizerImpl.FUSED
    micro_batch: int = 1
    seq_len: int = 2048
    grad_accum: int = 1
    # Sub-configs; the defaults are one GPU, full fine-tuning, a training step.
    parallelism: Parallelism = field(default_factory=Parallelism)
    sharding: Sharding = Sharding.NONE
    offload: Offload = field(default_factory=Offload)
    engine: EngineOptions = field(default_factory=EngineOptions)  # the multi-GPU framework and its settings
    adapter: Adapter | None = None
    base_weights: BaseWeights = field(default_factory=BaseWeights)
    savers: MemorySavers = field(default_factory=MemorySavers)
    workload: Workload = Workload.TRAINING
    generation: Generation = field(default_factory=Generation)
    # torchao Float8Linear on the transformer blocks' linears (torchtitan's float8 converter); see recipe.Float8.
    float8: Float8 = Float8.NONE

    def __post_init__(self) -> None:
        positive_int("batch", self.micro_batch)
        positive_int("seq", self.seq_len)
        positive_int("grad-accum", self.grad_accum)
        # Accept plain strings from kwargs and coerce to enums (frozen: coerce_enum uses object.__setattr__).
        coerce_enum(self, "precision", Precision)
        coerce_enum(self, "optimizer", Optimizer)
        coerce_enum(self, "checkpointing", Checkpointing)
        coerce_enum(self, "attention", Attention)
        coerce_enum(self, "optimizer_impl", OptimizerImpl)
        coerce_enum(self, "sharding", Sharding)
        coerce_enum(self, "workload", Workload)
        try:
            coerce_enum(self, "float8", Float8)
        except StrategyError:
            raise StrategyError(
                f"unknown --fp8 '{self.float8}'; choose one of: {', '.join(f.value for f in Float8)}"
            ) from None
        for name, kind in (
            ("parallelism", Parallelism),
            ("offload", Offload),
            ("engine", EngineOptions),
            ("base_weights", BaseWeights),
            ("savers", MemorySavers),
            ("generation", Generation),
        ):
            if not isinstance(getattr(self, name), kind):
                raise StrategyError(f"{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        if self.adapter is not None and not isinstance(self.adapter, Adapter):
            raise StrategyError(f"adapter must be an Adapter or None, got {self.adapter!r}")
        if (
            self.engine.engine is Engine.TORCH
            and self.parallelism.is_single_gpu
            and self.sharding is Sharding.NONE
            and not self.offload.any
        ):
            raise StrategyError(
                "--engine torch on one GPU without --sharding is plain single-GPU training: drop --engine, or add "
                "--sharding ddp|fsdp to model that wrapper"
            )
        if self.engine.fsdp_wrap is FsdpWrap.UNITS and self.sharding not in (Sharding.FSDP, Sharding.HSDP):
            raise StrategyError(
                f"--fsdp-wrap chooses FSDP2's units; it needs --sharding fsdp|hsdp, not {self.sharding.value}"
            )
        if self.engine.sharded_init and self.sharding not in (Sharding.FSDP, Sharding.HSDP):
            raise StrategyError(
                f"--sharded-init is how an FSDP2 model is built (on the meta device, sharded before its weights "
                f"exist); it needs --sharding fsdp|hsdp, not {self.sharding.value}"
            )
        if self.parallelism.pipeline > 1 and self.grad_accum > 1:
            raise StrategyError(
                "with pipeline parallelism the micro-batches of a step are --microbatches; --grad-accum is for "
                "data parallelism alone"
            )
        if not isinstance(self.flash_sdp, bool):
            raise StrategyError(f"flash_sdp must be True or False, got {self.flash_sdp!r}")
        check_finetune(self.adapter, self.base_weights)
        if self.savers.optimizer_in_backward and self.grad_accum > 1:
            # torchtune's recipes refuse it: the gradients are gone before the next micro-step could add to them.
            raise StrategyError(
                "--optimizer-in-backward steps each parameter as its gradient arrives; it cannot accumulate "
                f"gradients (--grad-accum {self.grad_accum}): use --grad-accum 1"
            )
        if self.savers.paged_optimizer and self.optimizer not in (
            Optimizer.ADAMW,
            Optimizer.ADAMW_8BIT,
            Optimizer.LION,
        ):
            raise StrategyError(
                f"bitsandbytes has paged AdamW, AdamW8bit and Lion optimizers, not {self.optimizer.value}"
            )

        self._check_float8()

    def _check_float8(self) -> None:
        """What ``--fp8`` is modelled with: a bf16 recipe, full training of every weight, one GPU."""
        if self.float8 is Float8.NONE:
            return
        why = ""
        if self.precision.value not in FLOAT8_RECIPES:
            why = f"--precision {self.precision.value} (fp8 linears are modelled over {', '.join(FLOAT8_RECIPES)})"
        elif self.adapter is not None or not self.base_weights.is_default:
            why = "adapters or frozen/quantised base weights (torchao's Float8Linear trains full weights)"
        elif self.is_distributed and not self._float8_layout():
            why = (
                "this layout (modelled: one GPU, or torch DDP / FSDP2 / HSDP without offload, tensor or pipeline "
                "parallelism; FSDP2's fp8 all-gather is not modelled)"
            )
        elif self.workload is not Workload.TRAINING:
            why = self.workload.value
        if why:
            raise StrategyError(f"--fp8 {self.float8.value} is not modelled with {why}")

    def _float8_layout(self) -> bool:
        """torch data parallelism (DDP, FSDP2, HSDP) over torchao Float8Linear modules (torchtitan's 1-D runs)."""
        return (
            self.sharding in (Sharding.DDP, Sharding.FSDP, Sharding.HSDP)
            and self.engine.engine in (Engine.AUTO, Engine.TORCH)
            and not self.offload.any
            and self.parallelism.tensor == 1
            and self.parallelism.pipeline == 1
        )

    @property
    def recipe(self) -> Recipe:
        return RECIPES[self.precision]

    @property
    def effective_batch(self) -> int:
        """Sequences per optimizer step on one data-parallel replica: micro-batch × accumulation steps (with
        pipeline parallelism, × the micro-batches the pipeline runs per step). × data degree: the global batch."""
        pipelined = self.parallelism.microbatches if self.parallelism.pipeline > 1 else 1
        return self.micro_batch * self.grad_accum * pipelined

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over every data-parallel replica."""
        return self.effective_batch * self.parallelism.data

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def world_size(self) -> int:
        return self.parallelism.world_size

    @property
    def trains_every_weight(self) -> bool:
        """Full fine-tuning: no adapter, so every parameter is trainable."""
        return self.adapter is None

    def checkpoint_layout(self, num_layers: int) -> CheckpointLayout:
        """Which layers are checkpointed, and in which segments (see :func:`checkpoint_layout`)."""
        return checkpoint_layout(self.checkpointing, num_layers)

    def checkpoint_segments(self, num_layers: int) -> int:
        """Number of checkpointed segments (0 without checkpointing)."""
        return len(self.checkpoint_layout(num_layers).segment_sizes)

    @property
    def is_distributed(self) -> bool:
        """More than one GPU, a sharding framework, offload or a named engine: what
        :mod:`trainfit.analytic.parallel` models (one GPU under a named engine is a world of one)."""
        return (
            not self.parallelism.is_single_gpu
            or self.sharding is not Sharding.NONE
            or self.offload.any
            or self.engine.engine is not Engine.AUTO
        )

    def beyond_single_gpu_finetuning(self) -> tuple[str, ...]:
        """As :meth:`beyond_single_gpu_training`, but adapters, frozen and quantised base weights are in scope
        (what a method that models single-GPU fine-tuning must still refuse)."""
        finetune = (
            f"{self.adapter.kind.value} adapters" if self.adapter is not None else None,
            "frozen base weights" if self.base_weights.frozen else None,
        )
        return tuple(
            x for x in self.beyond_single_gpu_training() if x not in finetune and not x.startswith("base weights")
        )

    def beyond_the_trace(self) -> tuple[str, ...]:
        """The memory savers the fake-tensor trace (and the real-GPU measurement, which reuses its runner) do not
        run: the analytic method models them alone. trace/savers.py runs the others (selective recompute is a
        checkpointing mode it runs too). Paged optimizers stay here: bitsandbytes allocates their states with
        ``cudaMallocManaged`` (``F.get_paged``), which a fake tensor cannot stand for."""
        # trace/savers.py runs them
        runs = ("--loss chunked", "--loss fused-linear", "--optimizer-in-backward", "--activation-offload")
        out = [n for n in self.savers.names() if not n.startswith(runs)]
        if self.savers.optimizer_in_backward and self.recipe.master_bits:
            out.append("--optimizer-in-backward with fp32 master weights")
        return tuple(out)

    def beyond_single_gpu_training(self) -> tuple[str, ...]:
        """The sub-configs that differ from one GPU, full fine-tuning, a training step (what a method
        that models only that setup must refuse rather than silently ignore)."""
        out: list[str] = []
        if not self.parallelism.is_single_gpu:
            out.append(f"{self.world_size} GPUs")
        if self.sharding is not Sharding.NONE:
            out.append(f"sharding {self.sharding.value}")
        if self.offload.any:
            out.append("offload")
        if self.engine.engine is not Engine.AUTO:
            out.append(f"engine {self.engine.engine.value}")
        if self.adapter is not None:
            out.append(f"{self.adapter.kind.value} adapters")
        if self.base_weights.frozen:
            out.append("frozen base weights")
        if self.base_weights.dtype is not None or self.base_weights.quantization.value != "none":
            out.append(
                "base weights "
                + (
                    self.base_weights.quantization.value
                    if self.base_weights.quantization.value != "none"
                    else str(self.base_weights.dtype)
                )
            )
        if self.savers.any and not self.parallelism.is_single_gpu:
            out.append("memory savers")
        if self.workload is not Workload.TRAINING:
            out.append(self.workload.value)
        return tuple(out)
