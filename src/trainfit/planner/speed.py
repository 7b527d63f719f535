"""The speed model: seconds per optimizer step of a Strategy on a GPU, torch-free (``docs/speed.md``).

A step is compute plus whatever communication, pipeline bubble and offload traffic is not hidden behind it.

- **Compute.** Matmul FLOPs per token, forward: 2·P_matmul (P_matmul = active parameters that are matmul
  weights: MoE counts only the routed top-k experts; an untied input embedding is a lookup and does no FLOPs)
  plus attention's 2·2·s·(heads·head_dim) per layer, halved for causal masks (fused kernels skip the masked
  half). Training = forward + backward = 3× forward for trained weights (Kaplan et al. 2020, §2.1: 6·N per
  token); a frozen weight (LoRA, QLoRA) needs only the input gradient, 2× forward; attention's backward is
  2× its forward either way, plus the QKᵀ FlashAttention recomputes (:data:`FLASH_BACKWARD_RECOMPUTE`); LoRA
  adapters train (3 × 2·r·(d_in + d_out)). Each checkpointing mode recomputes what it dropped
  (:func:`_recompute`: full/sqrt a forward of the blocks, selective the attention core, sac every second
  ``mm`` and the elementwise ops). Matmuls run at the catalog peak for the recipe's compute dtype ×
  :data:`MATMUL_EFFICIENCY`, attention at × :data:`ATTENTION_EFFICIENCY` (FlashAttention-2's measured
  utilisation by GPU generation).
- **Memory-bound work**: the eager elementwise kernels of a layer (:func:`elementwise_bytes`, op by op from
  transformers' Llama layer: the fp32 RMSNorm chain, rotary, SiLU·up, residual adds, autocast's activation
  casts) forward, their backward op by op from autograd's formulas (:func:`elementwise_backward_bytes`), the
  forward once more under full/sqrt/sac; the loss over the vocabulary-sized logits (:func:`loss_bytes_per_token`:
  ``logits.float()``, log-softmax and NLL, 48 B per bf16 logit); autocast's cast of every weight each micro-step
  and of its gradient back (:func:`autocast_cast_bytes`); LoRA's own elementwise traffic (PEFT ``lora.Linear.forward``);
  QLoRA's dequantisation of every 4-bit weight in forward and backward (:func:`dequant_bytes`, bitsandbytes
  ``MatMul4Bit``); the optimizer step (fused AdamW, 28 B per stepped parameter: the adapters only under
  LoRA) — over the catalog HBM bandwidth × :data:`HBM_EFFICIENCY`, except the layers' elementwise kernels and
  LoRA's, which run at :data:`EAGER_ELEMENTWISE_EFFICIENCY` where the engine is eager (:func:`elementwise_efficiency`:
  the torch engine and DeepSpeed; Megatron-LM and ``torch.compile`` fuse them).
- **Communication** (ring collectives: each rank sends and receives (n−1)/n of the buffer per reduce-scatter
  or all-gather, twice that per all-reduce; Patarasuk & Yuan 2009 — nccl-tests' bus-bandwidth volumes) over the
  link the group spans, at the bus bandwidth NCCL reaches on it (:func:`nccl_nvlink_gbps`,
  :func:`nccl_network_gbps`: its maintainers' published figures, 230 of 300 GB/s on an A100 node, 370 of 450 on
  an H100 node, 24 of 25 GB/s per 200 Gb/s NIC): NVLink within a node when the GPU has one, else PCIe (its line
  rate: no figure); the network across nodes (:data:`DEFAULT_NETWORK_GBPS`, a line rate).
  DDP and ZeRO-1/2 all-reduce the gradients once per step, overlapped with the last micro-step's backward
  (Li et al. 2020, PyTorch DDP §3.2.3 bucketing) — a sharded optimizer as a reduce-scatter of the gradients and an
  all-gather of the parameters, each in its width: Megatron-LM's are its engine's, not the recipe's
  (:func:`engine_widths`: fp32 main gradients under ``--bf16``, 16-bit parameters, no autocast); ZeRO-3/FSDP
  all-gather the weights in forward and backward and reduce-scatter gradients every micro-step, prefetched so they
  overlap that micro-step's compute
  (Rajbhandari et al. 2020 §7; FSDP2 prefetching) — except, under FSDP2, the first all-gather and the last
  reduce-scatter of each micro-step (:func:`fsdp_edge_seconds`: the root's, the embedding's unit's and one
  layer's, which no compute precedes or follows); HSDP does so within a node and all-reduces the shards
  across nodes once per step. FSDP2 moves the widths of its ``MixedPrecisionPolicy``, the memory model's
  (:func:`fsdp_collective_bytes`: bf16 gathers and fp32 reduce-scatters under amp-*/master-*). Tensor
  parallelism all-reduces b·s·h activations twice in forward and twice in backward per layer (Narayanan et
  al. 2021 §3.2 / Shoeybi et al. 2019 §3); sequence parallelism moves the same bytes as all-gather +
  reduce-scatter (Korthikanti et al. 2022 §4.2.2). What is hidden depends on the engine
  (:func:`tp_layer_seconds`): the exported eager DTensor plan hides nothing, Megatron's linear layers hide the
  column-parallel backward's collectives behind its GEMMs, torchtitan's async TP (``async_tp``, no Strategy
  option) pipelines the matched all-gather/reduce-scatter + GEMM pairs chunk by chunk and pays, for each fused
  reduce-scatter, a sum of the t pulled partials over HBM that NCCL's reduce-scatter does on the wire.
  DTensor tensor parallelism (``--engine torch``; 2-D FSDP2 × TP, torchtitan's ``parallelize_llama``: TP within
  a node, FSDP2 over the data-parallel dimension — across nodes when data × tensor exceeds a node) adds its
  plan's ends (:func:`_dtensor_ends`: the vocabulary-sharded embedding, the head's input and the all-gathered
  logits); its FSDP2 collectives are the 1-D ones over the TP-local parameters (P/t per rank).
- **Pipeline bubble**: (p − 1)/(v·m) of the ideal time for m micro-batches and v virtual stages (Narayanan
  et al. 2021, §2.2.1 and §2.2.2); GPipe has the same bubble (Huang et al. 2019).
- **Offload**: each step moves the gradient shard to the host (DeepSpeed: cast to fp32 first) and the updated
  16-bit weights back over PCIe and runs Adam on the CPU (:func:`host_adam_seconds`: ZeRO-Offload's Table 4 host
  rate, shared by the node's ranks); with gradient accumulation DeepSpeed ZeRO-1/2 also round-trip the gradient
  partition through the host, ZeRO-2 every micro-step (:func:`zero_offload_gradient_copies`); parameter offload also
  uploads each weight shard for the forward and the backward gather of every micro-step. Not overlapped
  (DeepSpeed's default, no delayed parameter update; Ren et al. 2021 §4.2). ``--activation-offload`` (torchtune
  ``OffloadActivations``) copies the saved tensors down in forward and up in backward on a side stream: only what a
  pass does not hide counts (:func:`_activation_offload_exposed`). The chunked loss and optimizer-in-backward run
  the same FLOPs and the same optimizer traffic as their twins: no term.

What it does not model (stated in docs/speed.md, with an H200 profile): the elementwise bandwidth by op and tensor
size (one eager rate for every op), a fused byte count for compiled or Megatron kernels, the attention rate by head
dim and backend (cuDNN's on Hopper), the optimizer's bytes by state dtype, kernel-launch gaps, GEMM shape
efficiency (small hidden sizes run below peak), the micro-batch's effect on GEMM efficiency, NCCL over PCIe below
its line rate, NVLink SHARP's faster all-reduce, the SMs overlapped collectives take from the GEMMs, DeepSpeed
ZeRO-3's unhideable first gather and last reduce-scatter, power caps, LLM.int8 bases, ``--freeze`` patterns (run as full
training), ZeRO-3 Offload's gradient copies over PCIe on every micro-step (stage3.py ``partition_grads``: the offload
term moves them once per step there; stages 1–2 are modelled).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from trainfit._memo import Memo, spec_key
from trainfit.arch.params import active_params_per_token, count_params, inventory
from trainfit.arch.spec import MlpKind, ModelKind, ModelSpec, NormKind
from trainfit.cuda_facts import BNB_4BIT_BLOCK, quantized_weight_tensors
from trainfit.errors import StrategyError
from trainfit.fsdp_units import edge_units_fraction, gathered_once_fraction
from trainfit.hardware import GPUSpec
from trainfit.strategy import (
    Adapter,
    Checkpointing,
    LossImpl,
    PipelineSchedule,
    Quantization,
    Recipe,
    Sharding,
    Strategy,
)

__all__ = [
    "ATTENTION_EFFICIENCY",
    "DEFAULT_NETWORK_GBPS",
    "EAGER_ELEMENTWISE_EFFICIENCY",
    "FLASH_BACKWARD_RECOMPUTE",
    "HBM_EFFICIENCY",
    "HOST_ADAM_BYTES_PER_PARAM",
    "HOST_ADAM_NODE_GBPS",
    "MATMUL_EFFICIENCY",
    "NCCL_NETWORK_EFFICIENCY",
    "NCCL_NVLINK_EFFICIENCY",
    "NVLINK_PROTOCOL_EFFICIENCY",
    "EngineWidths",
    "SpeedInputs",
    "StepTime",
    "TpBlockGemms",
    "TpComm",
    "async_tp_reduction_bytes",
    "attention_efficiency",
    "autocast_cast_bytes",
    "dequant_bytes",
    "elementwise_backward_bytes",
    "elementwise_bytes",
    "elementwise_efficiency",
    "engine_widths",
    "fsdp_collective_bytes",
    "fsdp_edge_seconds",
    "fsdp_gathered_once",
    "host_adam_seconds",
    "loss_bytes_per_token",
    "model_flops_per_token",
    "nccl_network_gbps",
    "nccl_nvlink_gbps",
    "step_time",
    "step_time_of",
    "tp_comm",
    "tp_layer_seconds",
    "zero_offload_gradient_copies",
]

#: Sustained fraction of the dense tensor-core peak for large GEMMs: cuBLAS bf16 8192³ on a B200 ran at 1610 of
#: 2250 TFLOPS (pyptx.dev/performance, "Blackwell GEMM" table) = 0.716. One figure for every GPU and shape.
MATMUL_EFFICIENCY = 0.72

#: Sustained fraction of the catalog HBM bandwidth: an H100 80GB HBM3 D2D copy / STREAM triad measured
#: 3089 GB/s of the 3350 GB/s spec = 0.92 (fate-oracle.com trace of an H100 bandwidth probe, "peak_bandwidth").
HBM_EFFICIENCY = 0.92

#: Sustained fraction of the catalog HBM bandwidth that PyTorch's *eager* elementwise kernels reach on the
#: transformer layer's ops (the fp32 RMSNorm chain, rotary on transposed q/k views, broadcast products: much of it
#: the non-vectorised ``elementwise_kernel`` path and short-row reductions), measured on their own by Liger-Kernel's
#: published benchmark of Hugging Face's eager modules (linkedin/Liger-Kernel ``benchmark/data/all_benchmark_data.csv``,
#: provider ``huggingface``, NVIDIA A100-SXM4-80GB, liger 0.2.1, 2024-09-03; ``benchmark/scripts/benchmark_rms_norm.py``
#: and ``benchmark_rope.py`` at 26a578e): ``LlamaRMSNorm`` forward + backward over 2048 × 32768 bf16 (fp32 weight)
#: 6.910 ms, ``apply_rotary_pos_emb`` forward + backward on 16384 tokens, 32 q and 8 kv heads of 256 (h 8192)
#: 8.366 ms. By this module's op-by-op counts (144 and 50 bytes per element: ``benchmarks/eager_bandwidth.py``
#: derives them for the benchmark's dtypes and prints the fraction) the two moved 18.05 GB in 15.28 ms: 1.18 TB/s,
#: 0.58 of the A100's 2039 GB/s — against :data:`HBM_EFFICIENCY`'s 0.92 for a copy. Taken as a fraction of the
#: catalog bandwidth on every GPU (the H200 profile of docs/speed.md, a calibration case not used here, gave 0.56).
#: Fused kernels (Megatron-LM's, ``torch.compile``'s) run at :data:`HBM_EFFICIENCY` (:func:`elementwise_efficiency`).
EAGER_ELEMENTWISE_EFFICIENCY = 0.58

#: Network bandwidth per GPU across nodes, GB/s per direction: 400 Gb/s RDMA per GPU (torchtitan's benchmark
#: platform, docs/performance.md "Hosts are inter-connected with backend RDMA network with 400 Gb/s per GPU";
#: DGX H100 has one 400 Gb/s ConnectX-7 port per GPU). Override with ``network_gbps``.
DEFAULT_NETWORK_GBPS = 50.0

#: The bus bandwidth NCCL reaches over NVLink, as a fraction of the link's line rate per direction (the catalog's
#: ``nvlink_gbps``), by compute capability. The speed model's collective volumes are nccl-tests' "bus bandwidth"
#: volumes — (n−1)/n of the buffer per all-gather or reduce-scatter, twice that per all-reduce (NVIDIA/nccl-tests
#: doc/PERFORMANCE.md) — so the rate they run at is the measured busbw. A100 (8.0): "Each NVLink has a line rate
#: of 25GB/s (in each direction) which converts to ~20GB/s effective bandwidth with a 128B payload size ... 240GB/s
#: on A100, but some other bottlenecks on the GPUs limits it to ~230GB/s" (NCCL's maintainer, NVIDIA/nccl-tests
#: issue 149, 2023-07-05): 230 of 300. H100/H200 (9.0): "450GB/s is the line rate. With the protocol overhead
#: (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s, which you can observe as 'BusBw' when running
#: non-allreduce operations, or when running with NCCL_ALGO=RING" (NVIDIA/nccl-tests issue 212, 2024-05-06; again
#: in NVIDIA/nccl issue 1442, 2025-01-06: "the real target for NCCL BusBW intra-node"): 370 of 450. NVLink SHARP's
#: faster all-reduce on NVSwitch (~480 GB/s busbw on 8 H100s, the same two threads) is not modelled.
NCCL_NVLINK_EFFICIENCY = {"8.0": 230 / 300, "9.0": 370 / 450}

#: Other NVIDIA GPUs with NVLink (V100, B200): the protocol's share alone — SM-driven copies carry 128-byte payloads,
#: "25GB/s ... converts to ~20GB/s effective bandwidth with a 128B payload size" (NVIDIA/nccl-tests issue 149). AMD's
#: Infinity Fabric (RCCL) keeps its line rate: no published figure was found.
NVLINK_PROTOCOL_EFFICIENCY = 20 / 25

#: The bus bandwidth NCCL reaches over the network, as a fraction of the NICs' line rate per GPU
#: (``network_gbps``): "you should get ~160GB/s intra-node and 24GB/s inter-node" for one 200 Gb/s HDR NIC (25 GB/s)
#: per node (NCCL's maintainer, NVIDIA/nccl issue 412, 2023-04-24); the same ratio for 100 Gb/s EDR, "12.2 GB/s (for a
#: 100Gbps card) is as good as you can get" (NVIDIA/nccl-tests issue 29, 2019-12-06: 0.976).
NCCL_NETWORK_EFFICIENCY = 24 / 25


def nccl_nvlink_gbps(gpu: GPUSpec) -> float | None:
    """GB/s per direction NCCL's collectives and send/recv reach over the GPU's NVLink (None: no NVLink spanning the
    node): the line rate × :data:`NCCL_NVLINK_EFFICIENCY` for its compute capability, else
    :data:`NVLINK_PROTOCOL_EFFICIENCY` on NVIDIA parts and the line rate on others (no published figure)."""
    if not gpu.nvlink_gbps:
        return None
    if gpu.vendor.upper() != "NVIDIA":
        return gpu.nvlink_gbps
    return gpu.nvlink_gbps * NCCL_NVLINK_EFFICIENCY.get(gpu.compute_capability or "", NVLINK_PROTOCOL_EFFICIENCY)


def nccl_network_gbps(network_gbps: float) -> float:
    """GB/s per GPU and direction NCCL reaches across nodes over NICs of ``network_gbps`` line rate."""
    return network_gbps * NCCL_NETWORK_EFFICIENCY


#: Bytes of host memory traffic per parameter in a CPU Adam step: read fp32 weight, gradient, m, v (16 B),
#: write weight, m, v (12 B) — the fp32 states of Rajbhandari et al. 2020's 16Ψ recipe.
HOST_ADAM_BYTES_PER_PARAM = 28

#: Seconds DeepSpeed's CPU-Adam took to step 10 billion parameters in one process on a DGX-2's host (2 × Intel Xeon
#: Platinum 8168, 1.5 TB DDR4-2666): Ren et al. 2021, ZeRO-Offload (USENIX ATC '21, arXiv 2101.06840), Table 4
#: "Adam latency (s) for PyTorch (PT) and CPU-Adam" (hardware: its Table 2). Its other rows, 1/2/4/8 billion in
#: 0.22/0.51/1.03/2.41 s, give 127/110/109/93 GB/s by the same count (median 109, as this row).
ZERO_OFFLOAD_CPU_ADAM_10B_SECONDS = 2.57

#: A host's CPU-Adam throughput in GB/s of :data:`HOST_ADAM_BYTES_PER_PARAM` traffic, shared by the GPU processes
#: of its node that step their shards at the same time: 10e9 × 28 B / 2.57 s = 108.9 GB/s (the Table 4 row above; 43%
#: of the two sockets' 12 × DDR4-2666 channels, 256 GB/s: Adam is bound by DRAM bandwidth, not by the cores). A
#: host of today has 2–4× that DRAM bandwidth; the model keeps the published host's figure (docs/speed.md).
HOST_ADAM_NODE_GBPS = 10e9 * HOST_ADAM_BYTES_PER_PARAM / ZERO_OFFLOAD_CPU_ADAM_10B_SECONDS / 1e9


def host_adam_seconds(shard_params: float, processes_per_node: int) -> float:
    """Seconds of one rank's CPU Adam step over ``shard_params`` parameters while ``processes_per_node`` ranks of
    its node step theirs on the same host (:data:`HOST_ADAM_NODE_GBPS` split between them)."""
    return shard_params * HOST_ADAM_BYTES_PER_PARAM * processes_per_node / (HOST_ADAM_NODE_GBPS * 1e9)


#: Attention FLOPs a fused kernel's backward runs beyond the 2 × forward it is credited with, per forward: the
#: FlashAttention backward recomputes S = QKᵀ (one of the forward's two matmuls) from the saved logsumexp
#: instead of reading the scores (Dao 2023, FlashAttention-2 Algorithm 2 line 11; torchtitan's
#: ``get_num_flop_per_token`` notes "the flash attention does 1 more matmul recomputation in the backward").
#: Executed, not model FLOPs (MFU leaves it out).
FLASH_BACKWARD_RECOMPUTE = 0.5

#: Sustained fraction of the tensor-core peak the attention kernel reaches, by compute capability; the SDPA
#: flash backend is FlashAttention-2 (ported into PyTorch 2.2). A100 (8.0): "50-73% of the theoretical maximum
#: FLOPs/s" (Dao 2023, FlashAttention-2, abstract; the forward pass — its backward is slower, so the low end);
#: H100 (9.0): "FlashAttention-2 achieves only 35% utilization on H100" (Shah et al. 2024, FlashAttention-3,
#: abstract). Elsewhere no figure was found: :data:`MATMUL_EFFICIENCY`.
ATTENTION_EFFICIENCY = {"8.0": 0.50, "9.0": 0.35}


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTime:
    """Seconds per optimizer step and what they are made of (per rank; every rank waits for the slowest)."""

    compute_seconds: float  # matmuls + memory-bound work, including recompute
    recompute_seconds: float  # the part of compute_seconds checkpointing adds
    comm_seconds: float  # all communication, hidden or not
    exposed_comm_seconds: float  # the part of comm_seconds not hidden behind compute
    bubble_seconds: float  # pipeline bubble
    offload_seconds: float  # PCIe transfers and the CPU optimizer step
    optimizer_seconds: float = 0.0  # the optimizer step on the GPU (memory-bound)
    step_seconds: float
    tokens_per_step: int  # the whole job
    tokens_per_second: float  # the whole job
    model_flops_per_step: float  # per GPU, without recompute (what MFU counts)
    mfu: float  # model FLOPs per second per GPU / the catalog peak


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeedInputs:
    """What the speed model reads of a Strategy (built by :meth:`of`; the planner builds it directly)."""

    data: int = 1
    tensor: int = 1
    pipeline: int = 1
    gpus_per_node: int = 8
    virtual_stages: int = 1  # > 1 only with the interleaved schedule
    seq_len: int
    micro_batch: int
    grad_accum: int
    adapter: Adapter | None = None  # LoRA/DoRA over a frozen base
    base_quantization: Quantization = Quantization.NONE  # the frozen base's storage (QLoRA: nf4)
    double_quant: bool = True
    compute_dtype: str = "bf16"
    compute_bits: int = 16
    grad_bits: int = 32
    weight_bits: int = 32  # the weights the layers compute with (:func:`engine_widths`)
    checkpointing: Checkpointing = Checkpointing.NONE
    sharding: Sharding = Sharding.NONE
    offload_optimizer: bool = False
    offload_parameters: bool = False
    float8: bool = False  # --fp8: the converted block linears run at the fp8 peak (float8_rate)
    dtensor_tp: bool = False  # DTensor TP (--engine torch): embedding/head collectives, the logits gather
    async_tp: bool = False  # torchtitan's async TP (torch.compile + Inductor's micro-pipeline TP pass): no Strategy
    plain_tp: bool = False  # tensor parallelism without sequence parallelism (all-reduces, no all-gather/scatter)
    mixed: bool = False  # Recipe.mixed: FSDP2 runs MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=fp32)
    vocab_size: int = 0  # the gathered logits' width (dtensor_tp)
    offload_activation_bytes: int = 0  # --activation-offload: saved bytes copied to the host per micro-step
    #: FSDP2/HSDP: the share of the parameters gathered once per micro-step, not again for backward
    #: (:func:`trainfit.fsdp_units.gathered_once_fraction`; 0 without the model: every one twice).
    fsdp_gathered_once: float = 0.0
    autocast: bool = False  # torch.autocast over wider weights (amp-*: casts each step; :func:`engine_widths`)
    loss: LossImpl = LossImpl.STANDARD  # how the loss meets the logits (--loss): its memory traffic
    #: The layers' elementwise work runs in fused kernels (:func:`elementwise_efficiency`): Megatron-LM's engine, or
    #: ``torch.compile`` (no Strategy option: the speed model alone, like ``async_tp``). False: eager PyTorch.
    fused_elementwise: bool = False

    @property
    def frozen_base(self) -> bool:
        return self.adapter is not None

    @classmethod
    def of(cls, strategy: Strategy, spec: ModelSpec | None = None) -> SpeedInputs:
        """The inputs of ``strategy``; ``spec`` is needed for ``--activation-offload`` (the bytes it moves) and
        DTensor tensor parallelism (the vocabulary of the gathered logits)."""
        par, r = strategy.parallelism, strategy.recipe
        dtensor = dtensor_tensor_parallel(strategy)
        if spec is None and (dtensor or strategy.savers.activation_offload):
            raise ValueError("SpeedInputs.of needs the model for activation offload or DTensor tensor parallelism")
        megatron = fused_elementwise_engine(strategy)
        widths = engine_widths(r, megatron=megatron, sharding=strategy.sharding)
        return cls(
            data=par.data,
            tensor=par.tensor,
            pipeline=par.pipeline,
            gpus_per_node=par.gpus_per_node,
            virtual_stages=par.virtual_stages if par.pipeline_schedule is PipelineSchedule.INTERLEAVED else 1,
            seq_len=strategy.seq_len,
            micro_batch=strategy.micro_batch,
            grad_accum=strategy.effective_batch // strategy.micro_batch,  # pipeline micro-batches included
            adapter=strategy.adapter,
            base_quantization=strategy.base_weights.quantization,
            double_quant=strategy.base_weights.double_quant,
            compute_dtype=r.compute_dtype,
            compute_bits=r.compute_bits,
            grad_bits=widths.grad_bits,
            weight_bits=widths.weight_bits,
            checkpointing=strategy.checkpointing,
            sharding=strategy.sharding,
            offload_optimizer=strategy.offload.optimizer_on_host,
            offload_parameters=strategy.offload.parameters_on_host,
            float8=strategy.float8.value != "none",
            dtensor_tp=dtensor,
            plain_tp=par.tensor > 1 and not par.sequence_parallel,
            mixed=widths.mixed,
            vocab_size=spec.vocab_size if dtensor and spec is not None else 0,
            offload_activation_bytes=offloaded_activation_bytes(spec, strategy) if spec is not None else 0,
            fsdp_gathered_once=fsdp_gathered_once(spec, strategy) if spec is not None else 0.0,
            autocast=widths.autocast,
            loss=strategy.savers.loss,
            fused_elementwise=megatron,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineWidths:
    """The widths the engine really runs a recipe with (:func:`engine_widths`)."""

    weight_bits: int  # the parameters the model computes with (and the data-parallel all-gather moves)
    grad_bits: int  # the gradients the data-parallel reduction moves
    autocast: bool  # torch.autocast over wider weights (amp-*): a cast of every weight each micro-step
    mixed: bool  # FSDP2's MixedPrecisionPolicy (Recipe.mixed); an FSDP2 setting, not Megatron's


def engine_widths(recipe: Recipe, *, megatron: bool, sharding: Sharding = Sharding.NONE) -> EngineWidths:
    """The recipe's own widths, except under FSDP2 with a mixed recipe and under Megatron-LM.

    FSDP2/HSDP under a mixed recipe (amp-*, master-*): ``MixedPrecisionPolicy(param_dtype=compute,
    reduce_dtype=fp32)`` over fp32 shards unshards every parameter in the compute dtype — the layers see compute-dtype
    weights, the residual stream is in it, and autocast (if any runs) has nothing to cast — and leaves fp32 gradients
    on the shards: the run the trace makes (trainfit.trace.distributed ``_run_strategy``: no autocast, the recipe's
    amp-* twin) and the memory model holds (the same activations for amp-*, master-* and pure-* under FSDP2, no
    autocast copies). Before 2026-12-04 the speed model charged an amp-* FSDP2 plan autocast's weight casts and an
    fp32 stream, and a master-* one 16-bit gradients to offload: the same run 14% slower spelt amp-fp16 than
    master-fp16 (llama-3.2-3b on 2 T4s, offloaded), which is how ``estimate --from training_args.json`` reads the plan
    back. (``weight_bits`` here is what the layers compute with; the gathers' widths are
    :func:`fsdp_collective_bytes`'s, from ``mixed``.)

    Megatron-LM, whose precision is its engine's, not the recipe's: ``--bf16``
    / ``--fp16`` cast the model to 16-bit parameters (``args.params_dtype``; Float16Module, no torch.autocast) and
    keep the main gradients in a buffer of ``torch.float if grad_reduce_in_fp32 else param.dtype``
    (megatron/core/distributed/param_and_grad_buffer.py ``_ParamAndGradBuffer``), ``grad_reduce_in_fp32`` being
    ``accumulate_allreduce_grads_in_fp32``, which ``validate_args`` turns on for bf16 (megatron/training/arguments.py:
    "bfloat16 requires gradient accumulation and all-reduce to be done in fp32") and leaves off for fp16, where
    trainfit's export asks for it (``--accumulate-allreduce-grads-in-fp32``: the memory model's 4 B/param gradient
    buffer, and no fp32 copy of every gradient at the step, which ``Float16OptimizerWithFloat16Params`` makes of fp16
    main grads) — so the data-parallel reduction moves fp32 gradients and the distributed optimizer's all-gather
    16-bit parameters, whatever 16-bit recipe the Strategy names."""
    if not megatron and sharding in (Sharding.FSDP, Sharding.HSDP) and recipe.mixed:
        return EngineWidths(weight_bits=recipe.compute_bits, grad_bits=32, autocast=False, mixed=True)
    if not megatron:
        return EngineWidths(
            weight_bits=recipe.weight_bits,
            grad_bits=recipe.grad_bits,
            autocast=bool(recipe.autocast),
            mixed=recipe.mixed,
        )
    return EngineWidths(weight_bits=recipe.compute_bits, grad_bits=32, autocast=False, mixed=False)


def fused_elementwise_engine(strategy: Strategy) -> bool:
    """Whether ``strategy``'s engine runs the layers' elementwise work in fused kernels: Megatron-LM
    (TransformerEngine's or apex's fused LayerNorm/RMSNorm, and the bias-GeLU/SwiGLU, rope, bias-dropout-add and
    masked-softmax fusions, each on unless switched off: megatron/training/arguments.py ``--no-bias-gelu-fusion``,
    ``--no-bias-swiglu-fusion``, ``--no-rope-fusion``, ``--no-bias-dropout-fusion``, ``--no-masked-softmax-fusion``
    are ``store_false``) — the engine :func:`trainfit.analytic.parallel.resolve_engine` decides for the memory
    estimate. The torch engine (DDP, FSDP2, the HF Trainer, accelerate) and DeepSpeed run the model's own eager
    modules: False."""
    from trainfit.analytic.parallel import resolve_engine
    from trainfit.strategy import Engine

    return resolve_engine(strategy) is Engine.MEGATRON


def elementwise_efficiency(x: SpeedInputs) -> float:
    """Fraction of the catalog HBM bandwidth the layers' elementwise work (:func:`elementwise_bytes`,
    :func:`elementwise_backward_bytes`, LoRA's adapter traffic) runs at: :data:`EAGER_ELEMENTWISE_EFFICIENCY` for
    eager PyTorch, :data:`HBM_EFFICIENCY` where the engine fuses them (``x.fused_elementwise``; the byte count stays
    the eager one, an upper bound there). The loss's softmax kernels, autocast's weight casts (contiguous,
    vectorised copies), QLoRA's dequantisation and the fused optimizer step keep :data:`HBM_EFFICIENCY`."""
    return HBM_EFFICIENCY if x.fused_elementwise else EAGER_ELEMENTWISE_EFFICIENCY


def dtensor_tensor_parallel(strategy: Strategy) -> bool:
    """Tensor parallelism run by DTensor (``--engine torch``, or ``auto`` with ``--sharding fsdp``: 2-D FSDP2 × TP),
    as :func:`trainfit.analytic.parallel.resolve_engine` decides for the memory estimate."""
    from trainfit.analytic.parallel import resolve_engine
    from trainfit.strategy import Engine

    return strategy.parallelism.tensor > 1 and resolve_engine(strategy) is Engine.TORCH


_OFFLOADED: Memo[int] = Memo(512)


def offloaded_activation_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """Bytes ``--activation-offload`` copies to the host per micro-step (and back in backward): the estimate's host
    activation bytes — torchtune ``OffloadActivations`` copies each saved tensor of at least ``min_offload_size``
    bytes once, the ones its stash keeps on the GPU too (:mod:`trainfit.analytic.savers`) — or, under checkpointing,
    every checkpoint input. Read from :func:`trainfit.analytic.model.step_inputs`, the memory estimate's own inputs:
    0 without offloading."""
    if not strategy.savers.activation_offload:
        return 0

    def build() -> int:
        from trainfit.analytic.activations import effective_strategy
        from trainfit.analytic.model import step_inputs

        eff, _ = effective_strategy(spec, strategy)
        return step_inputs(spec, eff, keep_logits=False).host_activations

    return _OFFLOADED.get((spec_key(spec), strategy), build)


@dataclass(frozen=True, slots=True, kw_only=True)
class _ModelNumbers:
    params: int
    matmul_params: int  # active parameters that are matmul weights
    sac_recompute_params: int  # weights of the matmuls per-op SAC runs again, all layers (:func:`_sac_params`)


_MODEL_CACHE: dict[int, tuple[ModelSpec, _ModelNumbers]] = {}


def _numbers(spec: ModelSpec) -> _ModelNumbers:
    hit = _MODEL_CACHE.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    nums = _ModelNumbers(
        params=count_params(spec),
        matmul_params=active_params_per_token(spec) - _embedding_lookup_params(spec),
        sac_recompute_params=_sac_params(spec),
    )
    if len(_MODEL_CACHE) > 256:
        _MODEL_CACHE.clear()
    _MODEL_CACHE[id(spec)] = (spec, nums)
    return nums


def _peak_flops(gpu: GPUSpec, dtype: str) -> float:
    peak = gpu.peak_tflops.get(dtype)
    if not peak:
        raise StrategyError(f"{gpu.id} has no {dtype} peak in the GPU catalog: no speed estimate for {dtype}")
    return float(peak) * 1e12


def _embedding_lookup_params(spec: ModelSpec) -> int:
    """Input-embedding parameters (a lookup, no FLOPs) unless tied to the LM head (then they are a matmul)."""
    if spec.tie_word_embeddings:
        return 0
    return spec.vocab_size * (spec.word_embed_dim or spec.hidden_size) + spec.learned_positions * spec.hidden_size


def _attention_flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    """Forward attention FLOPs per token: QKᵀ and AV, 2·2·s·heads·head_dim per layer, halved by the causal
    mask (Dao 2023, FlashAttention-2 §4 counts causal attention as half of the full product)."""
    span = seq_len
    if spec.sliding_window is not None and spec.sliding_layers:
        span = min(seq_len, spec.sliding_window)
    return 4 * span * spec.num_heads * spec.head_dim * spec.num_layers * 0.5


def model_flops_per_token(
    spec: ModelSpec, seq_len: int, *, frozen_base: bool = False, adapter: Adapter | None = None
) -> float:
    """Training FLOPs per token without recompute: 3 × (2·P_matmul + attention) — forward, then the input and
    the weight gradients. A frozen base weight (``frozen_base``, or any ``adapter``) has no weight gradient:
    2 × 2·P_matmul. Attention has no weights: its backward (dQ, dK, dV) is 2 × its forward either way. An
    adapter's own matmuls train: 3 × 2·P_adapter; an MoE router or expert stack under PEFT's ``ParamWrapper`` has
    its weight gradient formed (2·P per token of the weights it reaches, :func:`_adapter_numbers`)."""
    attn = _attention_flops_per_token(spec, seq_len)
    frozen = frozen_base or adapter is not None
    adapters = 0
    if adapter is not None:
        ad = _adapter_numbers(spec, adapter)
        adapters = 3 * 2 * ad.params + 2 * ad.weight_grads
    return (2 if frozen else 3) * 2 * _numbers(spec).matmul_params + 3 * attn + adapters


def _sac_params(spec: ModelSpec) -> int:
    """Weights of the matmuls torchtitan's per-op SAC recomputes, all layers: every second ``mm`` of a block
    (:func:`trainfit.analytic.activations.sac_recomputed_linears`, the policy ``sac_saved_terms`` follows).
    Each costs 2·d_in·d_out FLOPs per token again in backward."""
    from trainfit.analytic.activations import sac_recomputed_linears

    return spec.num_layers * sum(d_in * d_out for _n, d_in, d_out in sac_recomputed_linears(spec))


@dataclass(frozen=True, slots=True, kw_only=True)
class _AdapterNumbers:
    params: int  # adapter matmul weights of the adapted linears (layers and head): r·(d_in + d_out) each
    elements_fwd: int  # elementwise traffic per token, forward (PEFT lora.Linear.forward)
    elements_bwd: int  # the same, backward
    trained: int  # every adapter parameter (DoRA's magnitudes too): what is reduced and stepped
    weight_grads: int  # per token: frozen weights whose gradient is formed anyway (MoE ParamWrapper; see below)


_ADAPTERS: Memo[_AdapterNumbers] = Memo(64)
_DEQUANT: Memo[int] = Memo(64)


def _adapter_numbers(spec: ModelSpec, adapter: Adapter) -> _AdapterNumbers:
    """Per-token cost of LoRA adapters beside the frozen linears (Hu et al. 2021; PEFT
    peft/tuners/lora/layer.py ``Linear.forward``: ``result = base_layer(x)``, then ``result = result +
    lora_B(lora_A(dropout(x))) * scaling``; dropout 0 is ``nn.Identity``). The rank-r GEMMs are FLOP-light
    (2·r·(d_in + d_out) per token forward) but memory-bound; elements moved per token and adapted linear:
    forward ``lora_A`` reads x (d_in), ``lora_B`` writes d_out, ``* scaling`` reads and writes d_out, the add
    reads 2·d_out and writes d_out → d_in + 6·d_out; backward: the scaling's gradient (read and write d_out),
    ``lora_B``'s input and weight gradients (read the d_out gradient twice), ``lora_A``'s (write the d_in
    input gradient, read x), and autograd's sum of the two input gradients of x (read 2·d_in, write d_in)
    → 5·d_in + 4·d_out. The r-wide tensors are left out (r ≪ d). The adapted linears are every layer's
    (:func:`trainfit.analytic.adapters.adapter_sites`) and the head's (BERT's transform, ``head_sites``, once).

    ``trained`` is the memory model's count (:func:`trainfit.analytic.adapters.trainable_adapter_counts`): an MoE
    router's and expert stacks' ``ParamWrapper`` pairs exist in the MoE layers only (DeepSeek-V3: 58 of 61). Those
    pairs have no rank-r GEMMs per token: PEFT forms a new weight ``W + B·A`` per call (``_LoraFactorsProxy``'s
    ``baddbmm`` for a stack, ``_LoraParameterProxy`` for the router), which needs a gradient, so the router's linear
    and the stack's ``grouped_mm`` form their full weight gradient in backward (``weight_grads``: E·h for the router,
    top-k·d_in·d_out for a stack, per token and MoE layer; the memory side's
    :func:`trainfit.analytic.activations.moe_adapter_backward_bytes` holds that gradient). Forming ``W + B·A`` and
    reducing its gradient to the factors (2·rank·E·d_in·d_out FLOPs each way per stack and micro-batch, not per
    token) is left out: the speed model is per token."""
    from trainfit.analytic.adapters import adapter_sites, head_sites, moe_param_sites, trainable_adapter_counts

    def build() -> _AdapterNumbers:
        n = spec.num_layers
        sites = [(x, n) for x in adapter_sites(spec, adapter)] + [(x, 1) for x in head_sites(spec, adapter)]
        top_k = spec.moe.experts_per_token if spec.moe is not None else 0
        return _AdapterNumbers(
            params=sum(c * adapter.rank * (x.d_in + x.d_out) for x, c in sites),
            elements_fwd=sum(c * (x.d_in + 6 * x.d_out) for x, c in sites),
            elements_bwd=sum(c * (5 * x.d_in + 4 * x.d_out) for x, c in sites),
            trained=sum(c * t.numel for t, c in trainable_adapter_counts(spec, adapter)),
            weight_grads=spec.num_moe_layers
            * sum(
                p.weight_numel if p.experts == 1 else top_k * p.d_in * p.d_out for p in moe_param_sites(spec, adapter)
            ),
        )

    return _ADAPTERS.get((spec_key(spec), adapter), build)


def dequant_bytes(spec: ModelSpec, quantization: Quantization, *, double_quant: bool, out_bits: int) -> int:
    """HBM bytes one dequantisation of every 4-bit block weight moves (0 for an unquantised base): bitsandbytes
    ``MatMul4Bit`` (bitsandbytes/autograd/_functions.py) multiplies by ``dequantize_4bit(W)`` in backward, and in
    forward for more than 1536 rows (``gemm_4bit`` on CUDA, bitsandbytes/backends/cuda/ops.py, falls back to
    ``_gemm_4bit_default_impl``: dequantise, then ``F.linear``) — every training micro-batch. The kernel is
    memory-bound: it reads the packed weight and its absmax (:func:`trainfit.cuda_facts.quantized_weight_tensors`)
    and writes the weight in the compute dtype; with double quantisation the uint8 absmax is first expanded to
    fp32 (``dequantize_blockwise``: 4 bytes per block written, then read). LLM.int8 bases (``MatMul8bitLt``)
    are not modelled (0). The LM head stays unquantised (transformers keeps the output embedding out of
    bitsandbytes' conversion)."""
    if quantization not in (Quantization.NF4, Quantization.FP4):
        return 0

    def build() -> int:
        total = 0
        for g in inventory(spec).layers:
            for t in g.tensors:
                if not t.matmul:
                    continue
                kind = quantization.value
                stored = sum(quantized_weight_tensors(t.numel, t.shape[0], kind, double_quant=double_quant))
                nested = 2 * 4 * -(-t.numel // BNB_4BIT_BLOCK) if double_quant else 0
                total += g.count * (stored + nested + t.numel * out_bits // 8)
        return total

    return _DEQUANT.get((spec_key(spec), quantization, double_quant, out_bits), build)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Recompute:
    """What a checkpointing mode runs again in backward, per token of a micro-batch (before sharding)."""

    flops: float  # matmul FLOPs
    attention_flops: float  # attention-core FLOPs (they run at the attention kernel's efficiency)
    memory_passes: int  # extra forward passes of the memory-bound work (the 34·h bytes)
    tp_collectives: int  # extra tensor-parallel all-reduces per layer (the forward's two)
    linears_again: bool  # the block linears run again (QLoRA dequantises again, adapters run again)
    tp_regather: bool = False  # the forward's TP all-gathers run again, its reduce-scatters are saved (per-op SAC)


def _recompute(spec: ModelSpec, x: SpeedInputs, attn: float) -> _Recompute:
    """The recompute of each checkpointing mode (``attn``: forward attention FLOPs per token).

    - ``full``/``sqrt``: one more forward of every block (Chen et al. 2016: every block is inside a
      recomputed segment; the LM head is not): 2·P_blocks + attention, the memory-bound work, the forward's
      two tensor-parallel collectives per layer.
    - ``selective``: the attention core only (Korthikanti et al. 2022 §5; Megatron ``--recompute-granularity
      selective``): one more forward of attention (under a fused kernel, its score traffic stays on chip).
    - ``sac``: torchtitan's per-op SAC (torchtitan/distributed/activation_checkpoint.py): the saved ops'
      outputs — every other ``mm``, the fused attention, ``addmm`` — are not run again; every second ``mm``
      is (:func:`_sac_params`) and so is every op outside the save list (norms, rotary, SiLU, products,
      residual adds): one more forward pass of the memory-bound work. With tensor parallelism the save list
      keeps ``_c10d_functional.reduce_scatter_tensor``'s output but not ``all_gather_into_tensor``'s, so each
      block's all-gather runs again: the backward needs the gathered input (the weight gradients read it) —
      torchtitan's ``_save_list`` (torchtitan/models/llama3/infra/parallelize.py, mid-2025; today
      activation_checkpoint.py's ``comm_ops``), and under ``torch.compile`` the partitioner recomputes collectives
      of a user's checkpoint region (torch/_functorch/partitioners.py ``force_save_collectives`` spares
      ``must_recompute`` nodes)."""
    ck = x.checkpointing
    nums = _numbers(spec)
    if ck in (Checkpointing.FULL, Checkpointing.SQRT):
        blocks = max(nums.matmul_params - spec.vocab_size * spec.hidden_size, 0)
        adapters = 2 * _adapter_numbers(spec, x.adapter).params if x.adapter is not None else 0
        return _Recompute(
            flops=2 * blocks + adapters, attention_flops=attn, memory_passes=1, tp_collectives=2, linears_again=True
        )
    if ck is Checkpointing.SELECTIVE:
        return _Recompute(flops=0.0, attention_flops=attn, memory_passes=0, tp_collectives=0, linears_again=False)
    if ck is Checkpointing.SAC:
        sac = 2 * nums.sac_recompute_params
        return _Recompute(
            flops=sac, attention_flops=0.0, memory_passes=1, tp_collectives=0, linears_again=False, tp_regather=True
        )
    return _Recompute(flops=0.0, attention_flops=0.0, memory_passes=0, tp_collectives=0, linears_again=False)


_PER_TOKEN: Memo[tuple[float, float, _Recompute, float, float]] = Memo(256)


def _per_token(spec: ModelSpec, x: SpeedInputs) -> tuple[float, float, _Recompute, float, float]:
    """(forward attention FLOPs, model FLOPs, the recompute, elementwise bytes per layer forward, and backward)
    per token: what depends on the model, the sequence, checkpointing, the adapter and the dtypes, not on the
    layout (the planner asks for thousands of layouts)."""

    def build() -> tuple[float, float, _Recompute, float, float]:
        attn = _attention_flops_per_token(spec, x.seq_len)
        return (
            attn,
            model_flops_per_token(spec, x.seq_len, adapter=x.adapter),
            _recompute(spec, x, attn),
            elementwise_bytes(spec, x.compute_bits, x.weight_bits),
            elementwise_backward_bytes(spec, x.compute_bits, x.weight_bits),
        )

    key = (spec_key(spec), x.seq_len, x.checkpointing, x.adapter, x.compute_bits, x.weight_bits)
    return _PER_TOKEN.get(key, build)


def _frozen_base_seconds(
    spec: ModelSpec, x: SpeedInputs, tokens_rank: float, hbm: float, ew_hbm: float, *, linears_again: bool
) -> tuple[float, float]:
    """(seconds per step, the part a recomputed forward repeats) of the memory-bound work a frozen base adds:
    the adapters' elementwise traffic (:func:`_adapter_numbers`, compute-dtype elements) and QLoRA's
    dequantisation of every 4-bit weight (:func:`dequant_bytes`) in forward and in backward of each
    micro-step, once more when checkpointing runs the linears again. Their FLOPs are in
    :func:`model_flops_per_token`. The adapters' traffic is PEFT's eager code (``ew_hbm``, bytes per second:
    :func:`elementwise_efficiency`), the dequantisation bitsandbytes' kernels (``hbm``)."""
    if x.adapter is None:
        return 0.0, 0.0
    ad = _adapter_numbers(spec, x.adapter)
    a = x.compute_bits / 8
    rank_share = 1 / (x.tensor * x.pipeline)
    dq = dequant_bytes(spec, x.base_quantization, double_quant=x.double_quant, out_bits=x.compute_bits)
    micro_steps = x.grad_accum
    fwd = ad.elements_fwd * a * tokens_rank / ew_hbm + dq * rank_share * micro_steps / hbm
    bwd = ad.elements_bwd * a * tokens_rank / ew_hbm + dq * rank_share * micro_steps / hbm
    again = fwd if linears_again else 0.0
    return fwd + bwd + again, again


def attention_efficiency(gpu: GPUSpec) -> float:
    """:data:`ATTENTION_EFFICIENCY` of ``gpu``'s compute capability, else :data:`MATMUL_EFFICIENCY`."""
    return ATTENTION_EFFICIENCY.get(gpu.compute_capability or "", MATMUL_EFFICIENCY)


_ELEMENTWISE: Memo[float] = Memo(64)

#: Bytes per element of the fp32 intermediates of the eager RMSNorm chain (``LlamaRMSNorm`` upcasts to fp32).
_F32 = 4


def _norm_forward(spec: ModelSpec, r: float) -> float:
    """Forward bytes per element of one norm over an ``r``-byte input (:func:`elementwise_bytes`)."""
    if spec.norm is not NormKind.RMSNORM:
        return 2 * r  # a fused LayerNorm kernel: read x, write y
    casts = 2 * (r + _F32) if r != _F32 else 0.0  # .to(fp32) and back; no kernel when already fp32 (to() returns self)
    return casts + 2 * _F32 + _F32 + 2 * _F32 + 2 * r  # pow(2), mean, · rsqrt, · weight


def _norm_backward(spec: ModelSpec, r: float) -> float:
    """Backward bytes per element of one norm over an ``r``-byte input (:func:`elementwise_backward_bytes`)."""
    if spec.norm is not NormKind.RMSNORM:
        return 4 * r  # native_layer_norm_backward: read the gradient and x, write the input gradient; the weight's
    f = _F32
    casts = 2 * (r + f) if r != f else 0.0  # ToCopyBackward0 of both casts
    weight = 2 * r + 3 * r + r  # grad · weight; grad · normed, reduced over tokens (the weight's gradient)
    rsqrt = 2 * f + 3 * f + f  # grad · rsqrt; grad · x reduced (the rsqrt branch)
    mean = f  # MeanBackward0: the expanded gradient / n, written in full
    power = 2 * f + 3 * f  # PowBackward0: grad · (2 · x)
    accumulate = 3 * f  # the two gradients of the fp32 x summed by autograd
    return casts + weight + rsqrt + mean + power + accumulate


def _input_fanout(spec: ModelSpec) -> tuple[int, int]:
    """(linears reading the attention norm's output, linears reading the MLP norm's output): q, k, v (one fused
    linear for fused-QKV models) and gate, up (one up for a plain MLP)."""
    return (1 if spec.fused_qkv else 3), (2 if spec.mlp is MlpKind.GATED else 1)


def elementwise_bytes(spec: ModelSpec, bits: int, stream_bits: int | None = None) -> float:
    """HBM bytes the forward's elementwise (memory-bound) kernels move per layer and token, eager PyTorch, op by
    op as transformers' Llama-style layer runs them (``a`` = ``bits``/8 bytes per element of what the matmuls
    write; ``r`` = ``stream_bits``/8 of the residual stream, which the norms and residual adds work on — the
    weights' dtype: fp32 under autocast over fp32 weights; default ``bits``). The backward is
    :func:`elementwise_backward_bytes`; a recomputed forward moves this once more:

    - RMSNorm (``LlamaRMSNorm.forward``: to fp32, ``pow(2)``, ``mean``, ``* rsqrt``, back to the input dtype,
      ``weight *``): (r + 4) + 8 + 4 + 8 + (4 + r) + 2r = 28 + 4r bytes per element, 28 when the stream is
      already fp32 (``Tensor.to`` returns the tensor itself: no kernel); a fused LayerNorm 2r; per norm of the
      layer, and over q and k under per-head q/k norms (on ``a``-wide q and k);
    - autocast's casts of the activations (only when r ≠ a, autocast over fp32 weights): each linear that reads
      the fp32 normed stream casts it to the compute dtype itself (autocast caches only leaf weights,
      aten/src/ATen/autocast_mode.cpp ``cached_cast``): (r + a) per element for q, k, v and gate, up
      (:func:`_input_fanout`);
    - rotary (``apply_rotary_pos_emb``: ``rotate_half``'s neg and cat, two products, a sum) on the rotated
      part of q and k: 10a per element;
    - the attention output's ``transpose(1, 2).contiguous()``: 2a per element of q;
    - the MLP activation: SiLU then the product with ``up`` (5a per intermediate element) for gated MLPs, the
      activation alone (2a) otherwise;
    - two residual adds: 3r per element each.

    Leaves out dropout (0 in the catalog's decoders) and the embedding and head's own elementwise work (the loss
    is :func:`loss_bytes_per_token`). This replaces the 34·h bytes of *saved* activations (Korthikanti et al.
    2022) the model used before: eager kernels move each tensor several times (the fp32 norm chain alone is 36
    bytes per element in bf16)."""

    def build() -> float:
        a, r = bits / 8, (stream_bits or bits) / 8
        h, q, kv, i = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size
        out = spec.norms_per_layer * h * _norm_forward(spec, r)
        if spec.qk_norm:
            out += (q + kv) * _norm_forward(spec, a)
        if r != a:
            out += sum(_input_fanout(spec)) * h * (r + a)
        if spec.rotary_dim:
            out += 10 * a * (q + kv) * spec.rotary_dim / spec.head_dim
        out += 2 * a * q
        out += (5 if spec.mlp is MlpKind.GATED else 2) * a * i
        out += 2 * 3 * r * h
        return out

    return _ELEMENTWISE.get((spec_key(spec), bits, stream_bits), build)


_ELEMENTWISE_BWD: Memo[float] = Memo(64)


def elementwise_backward_bytes(spec: ModelSpec, bits: int, stream_bits: int | None = None) -> float:
    """HBM bytes the backward of :func:`elementwise_bytes`' ops moves per layer and token, op by op from autograd's
    derivative formulas (tools/autograd/derivatives.yaml: ``mul`` → grad·other for each input, ``pow`` →
    grad·2·x, ``mean`` → the gradient expanded / n, ``_to_copy`` → a cast back, ``neg``, ``cat`` → slices,
    ``slice_backward`` → zeros + a copy, ``silu_backward``) and autograd's sum of the gradients of a tensor read
    twice (torch/csrc/autograd/input_buffer.cpp ``accumulate``: an add per extra gradient). Per element, ``a``
    and ``r`` as there:

    - RMSNorm: the weight's product (grad·w 2r; grad·normed 3r reduced over tokens r), the fp32 product with
      rsqrt (grad·rsqrt 8, grad·x 12 reduced 4), ``mean``'s expanded gradient 4, ``pow``'s 2·x and its product
      20, the sum of the two fp32 gradients of x 12, the two casts back 2·(r + 4) (none over an fp32 stream):
      6r + 60 + 2(r + 4), 84 in bf16; a fused LayerNorm's backward 4r;
    - autocast's activation casts (r ≠ a): each cast's backward (a + r), their gradients summed in r;
    - the input gradients of the linears that read one tensor (q, k, v; gate, up) summed: an add (3 bytes of
      the gradient's width) per extra linear;
    - rotary: grad·cos and grad·sin (2a each; cos and sin broadcast), ``neg``'s gradient on half a, each half's
      ``slice_backward`` (a zero-filled tensor, then the half copied: 2a), and the three gradients of q summed
      (two adds, 6a): 15a per rotated element (forward 10a);
    - attention layout: the output gradient made contiguous for the fused kernel (2a per q element) and dq, dk,
      dv reshaped from the kernel's (b, heads, s, d) layout back to (b, s, heads·d) (2a per element of each);
    - the gated MLP: the product's two gradients (6a + 6a) and ``silu_backward`` (read the gradient and the
      input, write: 6a) = 18a per intermediate element; a plain activation's backward 3a;
    - two residual branch points, the stream's two gradients summed: 3r each.

    About 2.2× the forward for a bf16 Llama layer (the model took 2× before)."""

    def build() -> float:
        a, r = bits / 8, (stream_bits or bits) / 8
        h, q, kv, i = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size
        out = spec.norms_per_layer * h * _norm_backward(spec, r)
        if spec.qk_norm:
            out += (q + kv) * _norm_backward(spec, a)
        attn_in, mlp_in = _input_fanout(spec)
        grad = r if r != a else a  # the width the linears' input gradients are summed in
        if r != a:
            out += (attn_in + mlp_in) * h * (a + r)
        out += (attn_in - 1 + mlp_in - 1) * 3 * grad * h
        if spec.rotary_dim:
            out += 15 * a * (q + kv) * spec.rotary_dim / spec.head_dim
        out += 2 * a * q + 2 * a * (q + 2 * kv)
        out += (18 if spec.mlp is MlpKind.GATED else 3) * a * i
        out += 2 * 3 * r * h
        return out

    return _ELEMENTWISE_BWD.get((spec_key(spec), bits, stream_bits), build)


def loss_bytes_per_token(spec: ModelSpec, x: SpeedInputs) -> float:
    """HBM bytes the loss moves per token over the vocabulary-sized logits (0 without them: classifiers, a
    headless model), eager CUDA kernels, per logit element; the head's GEMM itself is in the matmul FLOPs:

    - causal LM, transformers ``ForCausalLMLoss`` (``logits.float()``, then ``cross_entropy`` =
      ``log_softmax`` + ``nll_loss``; :mod:`trainfit.analytic.logits` holds the same tensors): the upcast
      (a + 4; none for fp32 logits) and its backward (4 + a); ``log_softmax`` forward 16 — a 150k-wide fp32 row
      (600 KB) is larger than shared memory, so ``cunn_SoftMaxForward`` (aten/src/ATen/native/cuda/SoftMax.cu)
      reads the row three times (max, sum of exp, the write pass) and writes it once; ``nll_loss``'s backward
      writes a dense zero-filled fp32 gradient (4; LossNLL.cu ``grad_input.zero_()``) and
      ``cunn_SoftMaxBackward`` reads that gradient twice and the saved output once and writes (16): 36 + 2(a + 4)
      per element, 48 in bf16 — of the order of a layer of Qwen2.5-0.5B (vocabulary 151,936, h 896) per token;
    - masked LM (BERT, ``CrossEntropyLoss`` on the logits as they are): ``log_softmax`` in the logits' dtype
      (4a forward, 4a backward); under autocast ``nll_loss`` reads an fp32 copy (a + 4, back 4 + a) and its
      gradient is fp32 (4): 10a + 12; else 9a;
    - ``--loss chunked`` (torchtune ``CEWithChunkedOutputLoss``: the same ``.float()`` and ``cross_entropy`` per
      chunk) moves the same; ``--loss fused-linear`` (Liger ``LigerFusedLinearCrossEntropyLoss``) never
      materialises the full logits: per chunk its Triton kernel reads each 16-bit row twice (online max and
      sum, then the gradient) and writes the gradient in place, 3a.

    A final logit soft-cap (Gemma-2) is left out."""
    if not spec.kind.has_vocab_logits:
        return 0.0
    a = x.compute_bits / 8
    if x.loss is LossImpl.FUSED_LINEAR:
        per = 3 * a
    elif spec.kind is ModelKind.MASKED_LM:
        per = 10 * a + 12 if x.autocast and a != 4 else 9 * a
    else:
        per = 36 + (2 * (a + 4) if a != 4 else 0.0)
    return per * spec.vocab_size


def autocast_cast_bytes(spec: ModelSpec, x: SpeedInputs) -> tuple[float, float]:
    """(forward, backward) HBM bytes per micro-step of autocast's weight casts (0 unless autocast runs over
    weights wider than the compute dtype: amp-*): each matmul weight is cast once per autocast region (read 4,
    write a: aten/src/ATen/autocast_mode.cpp ``cached_cast`` caches the cast of a leaf fp32 weight until the
    region ends, so a tied head is cast once), and its gradient is cast back in backward (``ToCopyBackward0``:
    read a, write 4) when the weight is trained. A recomputed forward casts again (:func:`step_time_of`). Per
    rank: the weights of its tensor and pipeline shard. Sharded data parallelism gathers and casts the same
    weights (FSDP2's ``MixedPrecisionPolicy`` casts at the gather instead: counted the same)."""
    if not x.autocast or x.weight_bits <= x.compute_bits:
        return 0.0, 0.0
    a, w = x.compute_bits / 8, x.weight_bits / 8
    matmul = _numbers(spec).matmul_params / (x.tensor * x.pipeline)
    return matmul * (w + a), (matmul * (a + w) if x.adapter is None else 0.0)


def float8_flops_fraction(spec: ModelSpec) -> float:
    """Share of a training step's matmul FLOPs that run in fp8 under ``--fp8``: the converted block linears
    (:func:`trainfit.analytic.float8.block_linears`: torchtitan's filter, dims ÷ 16; all three GEMMs of each —
    output, grad_input, grad_weight — are ``torch._scaled_mm`` in ``matmul_with_hp_or_float8_args``) over the
    forward's matmul FLOPs; the LM head stays in bf16 (attention has its own rate and stays bf16 too). Forward
    and backward have the same share (each backward GEMM is twice its forward's), and a recompute's share is
    close to it (no head)."""
    from trainfit.analytic.float8 import block_linears

    converted = sum(x.in_features * x.out_features for x in block_linears(spec) if x.converted) * spec.num_layers
    total = 2 * _numbers(spec).matmul_params
    return min(1.0, 2 * converted / total) if total else 0.0


def float8_rate(spec: ModelSpec, gpu: GPUSpec, rate: float, peak: float) -> float:
    """The sustained FLOP rate with a fraction φ of the FLOPs at the GPU's fp8 peak (the catalog's dense fp8
    tensor-core figure, twice bf16 on Ada/Hopper/Blackwell) and the rest at ``rate``: the time-weighted (harmonic)
    mean, 1 / ((1 − φ)/rate + φ/(rate·fp8/peak)). Same :data:`MATMUL_EFFICIENCY` for both; the casts' memory
    traffic (amax, scale, cast: fused under torch.compile) is not in it. Without an fp8 peak, ``rate``."""
    fp8 = gpu.peak_tflops.get("fp8")
    if not fp8:
        return rate
    phi = float8_flops_fraction(spec)
    fast = rate * float(fp8) * 1e12 / peak
    return 1.0 / ((1.0 - phi) / rate + phi / fast)


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def fsdp_gathered_once(spec: ModelSpec, strategy: Strategy) -> float:
    """:attr:`SpeedInputs.fsdp_gathered_once` of ``strategy`` (0 unless FSDP2/HSDP)."""
    if strategy.sharding not in (Sharding.FSDP, Sharding.HSDP):
        return 0.0
    eo = strategy.engine
    return gathered_once_fraction(
        spec, eo.fsdp_wrap, strategy.parallelism.tensor, reshard_after_forward=eo.reshard_after_forward
    )


def fsdp_collective_bytes(x: SpeedInputs, params: float, adapters: float) -> tuple[float, float]:
    """(bytes one all-gather of ``params`` base parameters and ``adapters`` adapter parameters moves, bytes one
    reduce-scatter of the trained ones' gradients moves) under FSDP2 (``--sharding fsdp|hsdp``), at the widths
    the memory model gives the same collectives (:func:`trainfit.analytic.parallel.fsdp_wire_bits`): a mixed
    recipe (amp-*, master-*: fp32 shards) gathers in the compute dtype and reduces in fp32
    (``MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)``), a 16-bit or fp32 recipe moves its own width both
    ways, an adapter (PEFT: fp32 by default) its own dtype without a policy. A 4-bit base gathers its packed
    storage, which the policy does not cast: 0.5 + 1/64 bytes per parameter (packed weight and uint8 absmax).
    Trained: the base without an adapter, else the adapters."""
    from trainfit.analytic.parallel import fsdp_wire_bits

    held = 32 if x.mixed else x.weight_bits  # under the policy the model is built in fp32 (held_tensors)
    gather, reduce = fsdp_wire_bits(held, mixed=x.mixed, compute_bits=x.compute_bits)
    base = gather / 8
    if x.base_quantization in (Quantization.NF4, Quantization.FP4):
        base = 0.5 + 1 / BNB_4BIT_BLOCK
    if x.adapter is None:
        return params * base, params * reduce / 8
    ad_gather, ad_reduce = fsdp_wire_bits(x.adapter.dtype.bits, mixed=x.mixed, compute_bits=x.compute_bits)
    return params * base + adapters * ad_gather / 8, adapters * ad_reduce / 8


def fsdp_edge_seconds(
    spec: ModelSpec, x: SpeedInputs, local_params: float, local_trained: float, group: int, bandwidth: float
) -> float:
    """Seconds per micro-step of FSDP2 collectives that no compute can hide: the all-gather of the groups the first
    forward compute waits for and the reduce-scatter of those the last backward compute produces
    (:func:`trainfit.fsdp_units.edge_units_fraction`: the root's own parameters, the unit holding the input
    embedding, the first decoder layer). Prefetching overlaps every other group's all-gather with the previous
    layer's compute and its reduce-scatter with the next layer's backward, but the first all-gather is issued when
    the forward starts (``_root_pre_forward``) and the step waits for the last reduce-scatter before it ends
    (``_root_post_backward_final_callback`` waits on the reduce-scatter stream; torch
    torch/distributed/fsdp/_fully_shard/_fsdp_state.py). Each micro-step, since FSDP2 reshards after every backward
    and reduce-scatters every micro-step by default (``set_requires_gradient_sync``). Ring volumes over ``group``
    ranks at ``bandwidth`` bytes/s, at the widths of :func:`fsdp_collective_bytes`; an adapter's share is one
    layer's (adapters live in the layers). ``fsdp_wrap`` is read as ``auto`` (the Strategy's explicit wrap is not a
    speed input)."""
    if group <= 1:
        return 0.0
    share = edge_units_fraction(spec, x.tensor)
    if x.adapter is None:
        ag, rs = fsdp_collective_bytes(x, local_params * share, 0.0)
    else:
        ag, rs = fsdp_collective_bytes(x, local_params * share, local_trained / max(1, spec.num_layers))
    return _ring(group) * (ag + rs) / bandwidth


class TpComm(StrEnum):
    """How a tensor-parallel engine runs its per-layer collectives (:func:`tp_layer_seconds`)."""

    EAGER = "eager"  # DTensor TP as train_fsdp2.py (and torchtitan without async TP) runs it
    MEGATRON = "megatron"  # Megatron-LM's own linear layers, as megatron_args.txt runs them (no --tp-comm-overlap)
    ASYNC_TP = "async-tp"  # torchtitan's async TP: Inductor's micro-pipeline TP pass over symmetric memory


def tp_comm(x: SpeedInputs) -> TpComm:
    """The mechanism the plan's engine runs: DTensor plans are eager (the exported ``train_fsdp2.py`` neither
    compiles nor enables async TP) unless ``async_tp`` says otherwise (the speed model alone: no Strategy option
    asks for it); the other TP engine is Megatron-LM. Async TP decomposes all-gathers and reduce-scatters only:
    without sequence parallelism (all-reduces) it runs eager."""
    if not x.dtensor_tp:
        if x.async_tp:
            raise StrategyError("async TP is torch's (DTensor, --engine torch): Megatron-LM has --tp-comm-overlap")
        return TpComm.MEGATRON
    return TpComm.ASYNC_TP if x.async_tp and not x.plain_tp else TpComm.EAGER


@dataclass(frozen=True, slots=True, kw_only=True)
class TpBlockGemms:
    """Per-rank seconds of one micro-step's forward GEMMs around a block's collectives (each backward GEMM — the
    input gradient (dgrad) and the weight gradient (wgrad) — costs the same FLOPs as its forward)."""

    column: tuple[float, float]  # (attention, MLP): the column-parallel GEMMs after the all-gather (q+k+v, gate+up)
    row: tuple[float, float]  # (attention, MLP): the row-parallel GEMMs before the reduce-scatter (o, down)
    column_fused: tuple[bool, bool]  # the column side is one ``mm`` (a non-gated MLP's up; q, k, v are three)
    column_recomputed: tuple[float, float] = (0.0, 0.0)  # per-op SAC: the column-side ``mm``s it runs again


def _tp_block_gemms(spec: ModelSpec, seconds_per_flop: float) -> TpBlockGemms:
    """:class:`TpBlockGemms` of a dense decoder layer (MoE layers are refused with tensor parallelism), 2·d_in·d_out
    FLOPs per token per linear, the micro-step's tokens spread over the tensor-parallel ranks (``seconds_per_flop``
    = tokens / (t · rate)): the collectives run at the matmul rate the step uses. ``column_recomputed``: the
    column-side linears per-op SAC runs again (:func:`trainfit.analytic.activations.sac_recomputed_linears`; Llama:
    k, up)."""
    from trainfit.analytic.activations import sac_recomputed_linears

    h, q, kv, i = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size
    gated = spec.mlp is MlpKind.GATED
    up = (2 if gated else 1) * h * i
    again = [(n, d_in * d_out) for n, d_in, d_out in sac_recomputed_linears(spec) if n != "attn.o" and d_in == h]
    attn_again = sum(w for n, w in again if n.startswith("attn."))
    mlp_again = sum(w for n, w in again if not n.startswith("attn."))
    return TpBlockGemms(
        column=(2 * h * (q + 2 * kv) * seconds_per_flop, 2 * up * seconds_per_flop),
        row=(2 * q * h * seconds_per_flop, 2 * i * h * seconds_per_flop),
        column_fused=(False, not gated),
        column_recomputed=(2 * attn_again * seconds_per_flop, 2 * mlp_again * seconds_per_flop),
    )


def tp_layer_seconds(
    mechanism: TpComm,
    half: float,
    gemms: TpBlockGemms,
    *,
    t: int,
    sequence_parallel: bool,
    recompute: bool,
    reduction: float = 0.0,
    regather: bool = False,
    copy_half: float | None = None,
) -> tuple[float, float]:
    """(communication, the part of it exposed) per layer and micro-step of tensor parallelism; ``half`` is the
    time of one all-gather or reduce-scatter of the b·s·h activations over the ring ((t−1)/t of the bytes), an
    all-reduce two of them. Per block (attention, MLP) the forward moves 2·half: with sequence parallelism an
    all-gather before the column-parallel GEMMs and a reduce-scatter after the row-parallel one, without it an
    all-reduce after the row-parallel one (Korthikanti et al. 2022 §4.2.2: the same bytes); the backward the
    same in reverse; ``recompute`` (full/sqrt) runs the forward's again (Megatron's
    ``tensor_parallel.checkpoint``, torch's checkpoint replay the same modules).

    - ``EAGER`` (DTensor, ``parallelize_module``): each redistribute is a functional collective waited on by the
      next op, which needs its result: every collective is exposed. Compiled without the micro-pipeline pass the
      same: Inductor moves collectives for overlap only under ``reorder_for_compute_comm_overlap`` (False by
      default, torch/_inductor/config.py) — an assumption that the graph order leaves nothing to overlap.
    - ``MEGATRON`` (megatron/core/tensor_parallel/layers.py ``LinearWithGradAccumulationAndAsyncCommunication``,
      CUDA_DEVICE_MAX_CONNECTIONS=1): forward collectives are exposed (``gather_from_sequence_parallel_region``,
      ``reduce_scatter_to_sequence_parallel_region``, ``reduce_from_tensor_model_parallel_region``), and so is
      the row-parallel backward's all-gather of the output gradient; the column-parallel backward with sequence
      parallelism all-gathers its saved input shard again (one more half: it saves the shard, not the
      gathered input) asynchronously behind the input-gradient GEMM, then reduce-scatters the input gradient
      behind the weight-gradient GEMM; without sequence parallelism it all-reduces the input gradient behind
      the weight-gradient GEMM (``allreduce_dgrad``). Exposed: what the GEMM does not cover. These are
      Megatron's own layers (``--transformer-impl local``); TransformerEngine's (the default) are taken to do the
      same, unchecked. With ``--tp-comm-overlap`` (TransformerEngine userbuffers) the forward's would overlap
      too: megatron_args.txt does not ask for it, and it is not modelled.
    - ``ASYNC_TP`` (torch/_inductor/fx_passes/micro_pipeline_tp.py ``fuse_all_gather_matmul``,
      ``fuse_matmul_reduce_scatter``; torch/distributed/_symmetric_memory ``_pipelined_all_gather_and_consume``,
      ``_pipelined_produce_and_all2all``; enabled by torchtitan/distributed/compile.py ``_maybe_enable_async_tp``
      for the compiled blocks): an all-gather whose result is the left operand of ``mm``s (the column-parallel
      inputs in forward; the gathered output gradient of o/down feeding their input-gradient GEMM in backward)
      and a reduce-scatter of one ``mm``'s output (o, down in forward) are split into t chunks copied by the
      copy engines while the chunks' GEMMs run: exposed max(0, half − GEMM·(t−1)/t) (the local chunk's GEMM runs
      uncovered). The backward reduce-scatter of the column side's input gradient sums several ``mm``s (q, k, v;
      gate, up) and is not matched: exposed. The weight-gradient GEMMs, whose operands are transposed, are not
      consumers either. A fused matmul + reduce-scatter does not reduce on the wire as NCCL's reduce-scatter
      does: each rank pulls the t partial products of its own rows into a stacked buffer and sums them after the
      pipeline, one ``torch.sum`` over the stack on the compute stream (torch/distributed/_symmetric_memory
      ``_fused_matmul_reduce_scatter_impl``: ``reduce_fn(stacked_partials…)``), which the next op waits for:
      ``reduction`` seconds (reading t partials of b·s/t·h and writing one, :func:`async_tp_reduction_bytes`,
      over HBM), exposed once per fused reduce-scatter (o and down in each forward; a non-gated MLP's up in
      backward).

    ``regather`` (per-op SAC, :func:`_recompute`): each block's forward all-gather runs once more in backward
    (one more half); exposed, except under async TP, where the pass fuses it into the ``mm``s SAC runs again on
    the gathered input (``gemms.column_recomputed``: Llama's k and up) when there are any.

    ``copy_half``: the time of ``half``'s bytes over the copy engines, which async TP's fused collectives use
    instead of NCCL's kernels (default ``half``); the unmatched reduce-scatter stays NCCL's."""
    ce = half if copy_half is None else copy_half
    passes = 2 if recompute else 1  # forwards per micro-step
    pipelined = (t - 1) / t
    comm = exposed = 0.0
    for col, row, col_fused, col_again in zip(
        gemms.column, gemms.row, gemms.column_fused, gemms.column_recomputed, strict=True
    ):
        if regather:
            fused = mechanism is TpComm.ASYNC_TP and col_again > 0
            comm += ce if fused else half
            exposed += max(0.0, ce - col_again * pipelined) if fused else half
        if mechanism is TpComm.EAGER:
            comm += (passes + 1) * 2 * half
            exposed += (passes + 1) * 2 * half
        elif mechanism is TpComm.MEGATRON and not sequence_parallel:
            comm += (passes + 1) * 2 * half
            exposed += passes * 2 * half + max(0.0, 2 * half - col)  # all-reduce of dgrad behind wgrad
        elif mechanism is TpComm.MEGATRON:
            comm += passes * 2 * half + 3 * half  # + the input's re-gather in backward
            exposed += passes * 2 * half + half + 2 * max(0.0, half - col)  # re-gather behind dgrad, RS behind wgrad
        else:
            forward = max(0.0, ce - col * pipelined) + max(0.0, ce - row * pipelined) + reduction
            grad_gather = max(0.0, ce - row * pipelined)  # the output gradient gathered into o/down's dgrad
            grad_scatter = max(0.0, ce - col * pipelined) + reduction if col_fused else half
            comm += passes * 2 * ce + ce + (ce if col_fused else half)
            exposed += passes * forward + grad_gather + grad_scatter
    return comm, exposed


def async_tp_reduction_bytes(act: float, t: int) -> float:
    """HBM bytes of the sum that ends a fused matmul + reduce-scatter (:func:`tp_layer_seconds`, ``ASYNC_TP``): the
    t stacked partials of this rank's b·s/t rows read (``act`` bytes in all: b·s·h in the output dtype) and the
    reduced shard written (act/t)."""
    return act * (1 + 1 / t)


def _dtensor_ends(x: SpeedInputs, act: float) -> float:
    """Bytes per micro-step each rank sends for the ends of DTensor's Llama plan (the plan
    :mod:`trainfit.trace.tensor_parallel` traces and the memory estimate models, torchtitan's ``apply_tp``
    without loss parallel), beyond the layers' collectives, ring algorithm:

    - the vocabulary-sharded embedding (``RowwiseParallel(input_layouts=Replicate())``): its partial output is
      all-reduced (2·(t−1)/t·act), or reduce-scattered with SP (forward) and its gradient all-gathered
      (backward): the same bytes;
    - the head's input (``ColwiseParallel``): with SP all-gathered in forward and its gradient reduce-scattered
      in backward; without SP its partial gradient all-reduced: 2·(t−1)/t·act either way;
    - the logits (``output_layouts=Replicate()``): all-gathered for the model's own loss, (t−1)/t·b·s·V in the
      compute dtype; their gradient is sliced back locally (Replicate → Shard needs no collective).

    Megatron's vocabulary-parallel cross-entropy needs no logits gather; its embedding and head collectives
    (the first two terms) are not counted for it (two of its 4·L + 2 per micro-step)."""
    t = x.tensor
    logits = x.micro_batch * x.seq_len * x.vocab_size * x.compute_bits / 8
    return 2 * 2 * _ring(t) * act + _ring(t) * logits


def _activation_offload_exposed(transfer: float, compute_micro: float, recompute_micro: float) -> float:
    """Seconds per micro-step that ``--activation-offload`` adds: torchtune ``OffloadActivations`` with
    ``use_streams`` copies each saved tensor to pinned host memory on a side stream while the forward computes,
    and prefetches the next layer's back while the backward computes
    (torchtune/training/_activation_offloading.py): each direction costs the part of its PCIe transfer
    (``transfer`` seconds) its pass does not hide — the forward is a third of the compute without recompute
    (Kaplan et al. 2020: backward = 2 × forward), the backward the rest, recompute included."""
    forward = (compute_micro - recompute_micro) / 3
    backward = compute_micro - forward
    return max(0.0, transfer - forward) + max(0.0, transfer - backward)


def zero_offload_gradient_copies(sharding: Sharding, grad_accum: int) -> tuple[int, int]:
    """(device-to-host, host-to-device) copies per optimizer step of a rank's gradient partition, in the model's
    16-bit dtype (fp32 under the fp32 recipe), that DeepSpeed ZeRO-Offload (``offload_optimizer``) makes with
    ``grad_accum`` micro-steps besides the accumulation boundary's copy into the fp32 gradients of the CPU optimizer
    (``async_inplace_copy_grad_to_fp32_buffer_from_gpu``: cast to fp32 on the GPU, then copied — 4 B per element; the
    boundary term of :func:`step_time_of`). deepspeed/runtime/zero/stage_1_and_2.py (DeepSpeed edaa722)
    ``copy_grads_in_partition``: with ``cpu_offload``, each time the partition's gradients are reduced and it is not
    the step's lone backward (``micro_step_id > 0 or not is_gradient_accumulation_boundary()``) it calls
    ``async_accumulate_grad_in_cpu_via_gpu``, which keeps the running sum in host memory and adds on the GPU: after
    the first micro-step it copies the host sum up into ``temp_grad_buffer_for_gpu_offload`` and adds it to the new
    gradient (``accumulate_gradients``), then copies the result back down (``copy_gradients_to_cpu``). ZeRO-2
    (``partition_gradients``) reduces every micro-step (``reduce_ready_partitions_and_remove_grads``): k copies down
    and k − 1 up. ZeRO-1 reduces only at the boundary (the gradients accumulate in the parameters' ``.grad`` on the
    GPU), where ``micro_step_id`` is k − 1 > 0: one copy down and one up. One micro-step: none.

    Not overlapped with compute: without ``overlap_comm`` — stages 1–2's default (zero/config.py
    ``overlap_comm_valid``) and what the DeepSpeed export writes for them — ``reduce_ipg_grads`` issues the copies on
    the current stream (the offload's ``copy_grad_stream`` is disabled there: "race with reduce"), so the backward's
    kernels queue behind them. ZeRO-3 is not modelled here: stage3.py ``partition_grads`` also round-trips its host
    gradient buffer every micro-step, on its reduce-and-partition stream (docs/speed.md)."""
    if grad_accum <= 1:
        return 0, 0
    if sharding is Sharding.ZERO2:
        return grad_accum, grad_accum - 1
    if sharding is Sharding.ZERO1:
        return 1, 1
    return 0, 0


def step_time(
    spec: ModelSpec,
    strategy: Strategy,
    gpu: GPUSpec,
    *,
    network_gbps: float = DEFAULT_NETWORK_GBPS,
) -> StepTime:
    """Seconds per optimizer step of ``strategy`` on ``gpu`` (module docstring: each term and its source).

    Tokens per step = micro-batch × grad_accum × data degree × sequence length; with a pipeline the
    micro-batches per step are ``grad_accum`` (Megatron: global / (micro·dp))."""
    return step_time_of(spec, SpeedInputs.of(strategy, spec), gpu, network_gbps=network_gbps)


def step_floor_seconds(t: StepTime) -> float:
    """A step's compute and optimizer step. Of the same setup's micro-batch splits, the one with the fewest
    micro-steps (the largest micro-batch) has the least of both — compute counts the rank's token-passes, the
    same for every split, plus a frozen quantised base's dequantisation once per micro-step
    (:func:`_frozen_base_seconds`); the optimizer step does not depend on the split — and every other term is
    ≥ 0, so its value bounds ``step_seconds`` at every micro-batch from below: the planner orders its search by it
    before it times every micro-batch (tests/planner/test_speed.py holds it)."""
    return t.compute_seconds + t.optimizer_seconds


def step_time_of(
    spec: ModelSpec, x: SpeedInputs, gpu: GPUSpec, *, network_gbps: float = DEFAULT_NETWORK_GBPS
) -> StepTime:
    """:func:`step_time` of the inputs the speed model reads."""
    d, t, p, gpn = x.data, x.tensor, x.pipeline, x.gpus_per_node
    world = d * t * p
    seq, micro, accum = x.seq_len, x.micro_batch, x.grad_accum
    tokens_micro = micro * seq
    tokens_step = tokens_micro * accum * d
    nums = _numbers(spec)

    peak = _peak_flops(gpu, x.compute_dtype)
    attn, model_flops, rc, elementwise, elementwise_bwd = _per_token(spec, x)
    tokens_rank = tokens_micro * accum / (t * p)  # token-passes of the whole model per rank and step
    model_flops_rank = model_flops * tokens_rank
    # Attention-core FLOPs, executed: the 3 × forward of the model count, FlashAttention's backward recompute
    # and a recomputed forward; the rest of the model FLOPs (and the rest of the recompute) are matmuls.
    attn_rank = (3 + FLASH_BACKWARD_RECOMPUTE) * attn * tokens_rank
    matmul_rank = model_flops_rank - 3 * attn * tokens_rank
    flops_rate = peak * MATMUL_EFFICIENCY
    if x.float8:
        flops_rate = float8_rate(spec, gpu, flops_rate, peak)
    attn_rate = peak * attention_efficiency(gpu)
    bandwidth = (gpu.memory_bandwidth_gbps or 1000.0) * 1e9
    hbm = bandwidth * HBM_EFFICIENCY
    ew_hbm = bandwidth * elementwise_efficiency(x)  # the layers' elementwise kernels: eager or fused
    layers_rank = spec.num_layers / p
    act_traffic = elementwise * layers_rank * tokens_micro * accum / t / ew_hbm
    cast_fwd, cast_bwd = autocast_cast_bytes(spec, x)
    cast_fwd, cast_bwd = cast_fwd * accum / hbm, cast_bwd * accum / hbm  # once per micro-step (autocast region)
    # The loss runs on the last pipeline stage, averaged over the stages like the layers; DTensor TP gathers the
    # logits and every tensor-parallel rank runs the whole loss, Megatron's vocabulary-parallel loss its shard.
    loss_time = loss_bytes_per_token(spec, x) * tokens_micro * accum / (p * (1 if x.dtensor_tp else t)) / hbm
    mem_time = (
        (1 + rc.memory_passes) * act_traffic
        + act_traffic * elementwise_bwd / elementwise
        + loss_time
        + cast_fwd * (1 + rc.memory_passes)
        + cast_bwd
    )
    recompute_time = (
        rc.flops * tokens_rank / flops_rate
        + rc.attention_flops * tokens_rank / attn_rate
        + rc.memory_passes * (act_traffic + cast_fwd)
    )
    frozen_time, frozen_again = _frozen_base_seconds(spec, x, tokens_rank, hbm, ew_hbm, linears_again=rc.linears_again)
    if rc.linears_again:
        recompute_time += frozen_again
    compute = (
        (matmul_rank + rc.flops * tokens_rank) / flops_rate
        + (attn_rank + rc.attention_flops * tokens_rank) / attn_rate
        + mem_time
        + frozen_time
    )
    compute_micro = compute / accum

    pcie = (gpu.pcie_gbps or 16.0) * 1e9
    nvlink = nccl_nvlink_gbps(gpu)
    intra = nvlink * 1e9 if nvlink else pcie  # NCCL's bus bandwidth (PCIe: the line rate, no figure)
    net = nccl_network_gbps(network_gbps) * 1e9
    # async TP's fused collectives are copy-engine copies, not NCCL kernels: the link's line rate (docs/speed.md)
    copy_bw = gpu.nvlink_gbps * 1e9 if gpu.nvlink_gbps and t <= gpn else None
    tp_bw = intra if t <= gpn else net
    dp_bw = net if d * t > gpn else intra

    local_params = nums.params / (t * p)
    # Trained parameters: all, or with an adapter only its parameters (their gradients are all that is reduced).
    local_trained = local_params if x.adapter is None else _adapter_numbers(spec, x.adapter).trained / (t * p)
    gb, wb = x.grad_bits / 8, x.weight_bits / 8
    if x.base_quantization in (Quantization.NF4, Quantization.FP4):
        wb = 0.5 + 1 / BNB_4BIT_BLOCK  # sharded 4-bit storage is what is gathered: packed weight + uint8 absmax
    sh = x.sharding

    comm = exposed = 0.0
    if d > 1 and sh in (Sharding.DDP, Sharding.NONE, Sharding.ZERO1, Sharding.ZERO2):
        # An all-reduce is a reduce-scatter and an all-gather of the same buffer; a sharded optimizer (ZeRO-1/2,
        # Megatron's distributed optimizer) reduce-scatters the gradients and all-gathers the updated parameters in
        # their own width (Megatron: fp32 gradients, 16-bit parameters — engine_widths; every recipe's weights and
        # gradients are equally wide otherwise).
        sharded = sh in (Sharding.ZERO1, Sharding.ZERO2) and x.adapter is None
        c = _ring(d) * local_trained * (gb + (x.weight_bits / 8 if sharded else gb)) / dp_bw
        comm += c
        exposed += max(0.0, c - compute_micro * 2 / 3)  # hidden behind the last micro-step's backward (2/3)
    elif d > 1 and sh is Sharding.ZERO3:
        per_micro = (2 * _ring(d) * local_params * wb + _ring(d) * local_trained * gb) / dp_bw
        comm += per_micro * accum
        exposed += accum * max(0.0, per_micro - compute_micro)
    elif d > 1 and sh is Sharding.FSDP:
        ag, rs = fsdp_collective_bytes(x, local_params, local_trained if x.adapter is not None else 0.0)
        ag2 = 2 * ag - x.fsdp_gathered_once * fsdp_collective_bytes(x, local_params, 0.0)[0]  # adapters: in layers
        per_micro = (_ring(d) * ag2 + _ring(d) * rs) / dp_bw
        edge = fsdp_edge_seconds(spec, x, local_params, local_trained, d, dp_bw)
        comm += per_micro * accum
        exposed += accum * (edge + max(0.0, per_micro - edge - compute_micro))
    elif d > 1 and sh is Sharding.HSDP:
        ag, rs = fsdp_collective_bytes(x, local_params, local_trained if x.adapter is not None else 0.0)
        shard = min(gpn, d)
        replicas = d // shard
        ag2 = 2 * ag - x.fsdp_gathered_once * fsdp_collective_bytes(x, local_params, 0.0)[0]
        per_micro = (_ring(shard) * ag2 + _ring(shard) * rs) / intra
        edge = fsdp_edge_seconds(spec, x, local_params, local_trained, shard, intra)
        across = 2 * _ring(replicas) * rs / shard / net if replicas > 1 else 0.0
        comm += per_micro * accum + across
        exposed += accum * (edge + max(0.0, per_micro - edge - compute_micro))
        exposed += max(0.0, across - compute_micro * 2 / 3)
    act = micro * seq * spec.hidden_size * x.compute_bits / 8
    if t > 1:
        half = _ring(t) * act / tp_bw  # one all-gather or reduce-scatter of the b·s·h activations
        gemms = _tp_block_gemms(spec, tokens_micro / (t * flops_rate))
        layer_comm, layer_exposed = tp_layer_seconds(
            tp_comm(x),
            half,
            gemms,
            t=t,
            sequence_parallel=not x.plain_tp,
            recompute=rc.tp_collectives > 0,
            reduction=async_tp_reduction_bytes(act, t) / hbm,
            regather=rc.tp_regather,
            copy_half=_ring(t) * act / copy_bw if copy_bw else None,
        )
        c = layer_comm * layers_rank * accum
        e = layer_exposed * layers_rank * accum
        if x.dtensor_tp:
            ends = _dtensor_ends(x, act) / tp_bw * accum  # outside the compiled blocks: eager, exposed
            c += ends
            e += ends
        comm += c
        exposed += e
    bubble = 0.0
    if p > 1:
        bubble = compute * (p - 1) / (x.virtual_stages * accum)
        c = 2 * accum * act / t / (net if world > gpn else intra)  # activations forward, gradients back
        comm += c
        exposed += c
    offload = 0.0
    if x.offload_optimizer:
        shard_params = local_trained / d
        down, up = zero_offload_gradient_copies(sh, accum)
        boundary = 4 if sh in (Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3) else gb  # DeepSpeed: fp32 (below)
        offload += shard_params * (boundary + 2) / pcie + host_adam_seconds(shard_params, min(world, gpn))
        offload += (down + up) * shard_params * x.compute_bits / 8 / pcie  # not overlapped (the function's note)
    if x.offload_parameters:
        offload += accum * 2 * local_params / d * 2 / pcie
    if x.offload_activation_bytes:
        transfer = x.offload_activation_bytes / pcie
        offload += accum * _activation_offload_exposed(transfer, compute_micro, recompute_time / accum)
    optimizer = 0.0
    if not x.offload_optimizer:
        stepped = local_trained if sh in (Sharding.NONE, Sharding.DDP) else local_trained / d
        optimizer = stepped * HOST_ADAM_BYTES_PER_PARAM / hbm  # fused AdamW: memory-bound, same 28 B/param
    step = compute + exposed + bubble + offload + optimizer
    return StepTime(
        compute_seconds=compute,
        recompute_seconds=recompute_time,
        comm_seconds=comm,
        exposed_comm_seconds=exposed,
        bubble_seconds=bubble,
        offload_seconds=offload,
        optimizer_seconds=optimizer,
        step_seconds=step,
        tokens_per_step=tokens_step,
        tokens_per_second=tokens_step / step,
        model_flops_per_step=model_flops_rank,
        mfu=model_flops_rank / step / peak,
    )
