"""The speed model: seconds per optimizer step of a Strategy on a GPU, torch-free (``docs/speed.md``).

A step is compute plus whatever communication, pipeline bubble and offload traffic is not hidden behind it.

- **Compute.** Matmul FLOPs per token, forward: 2·P_matmul (P_matmul = active parameters that are matmul
  weights: MoE counts only the routed top-k experts; an untied input embedding is a lookup and does no FLOPs)
  plus attention's 2·2·s·(heads·head_dim) per layer, halved for causal masks (fused kernels skip the masked
  half). Training = forward + backward = 3× forward for trained weights (Kaplan et al. 2020, §2.1: 6·N per
  token); a frozen weight (LoRA, QLoRA) needs only the input gradient, 2× forward. Checkpointing recomputes
  the blocks' forward once more (``full`` and ``sqrt`` alike: every block is inside a segment; Chen et al.
  2016). FLOPs run at the catalog peak for the recipe's compute dtype times :data:`MATMUL_EFFICIENCY`.
- **Memory-bound work** (norms, activations, residual adds, rotary): per layer and token the forward writes
  the 34·h bytes Korthikanti et al. 2022 (Table 2, no attention-score terms under fused attention) count as
  saved activations; backward reads them and writes gradients of the same size, so 3 × 34·h bytes move per
  pass, over the catalog HBM bandwidth × :data:`HBM_EFFICIENCY`.
- **Communication** (ring collectives: each rank sends and receives (n−1)/n of the buffer per reduce-scatter
  or all-gather, twice that per all-reduce; Patarasuk & Yuan 2009) over the link the group spans: NVLink
  within a node when the GPU has one, else PCIe; the network across nodes (:data:`DEFAULT_NETWORK_GBPS`).
  DDP and ZeRO-1/2 all-reduce the gradients once per step, overlapped with the last micro-step's backward
  (Li et al. 2020, PyTorch DDP §3.2.3 bucketing); ZeRO-3/FSDP all-gather the weights in forward and backward
  and reduce-scatter gradients every micro-step, prefetched so they overlap that micro-step's compute
  (Rajbhandari et al. 2020 §7; FSDP2 prefetching); HSDP does so within a node and all-reduces the shards
  across nodes once per step. Tensor parallelism all-reduces b·s·h activations twice in forward and twice
  in backward per layer, not overlapped (Narayanan et al. 2021 §3.2 / Shoeybi et al. 2019 §3); sequence
  parallelism moves the same bytes as all-gather + reduce-scatter (Korthikanti et al. 2022 §4.2.2).
- **Pipeline bubble**: (p − 1)/(v·m) of the ideal time for m micro-batches and v virtual stages (Narayanan
  et al. 2021, §2.2.1 and §2.2.2); GPipe has the same bubble (Huang et al. 2019).
- **Offload**: each step moves the gradient shard to the host and the updated 16-bit weights back over PCIe
  and runs Adam on the CPU (:data:`HOST_ADAM_GBPS`); parameter offload also uploads each weight shard for the
  forward and the backward gather of every micro-step. Not overlapped (DeepSpeed's default, no delayed
  parameter update; Ren et al. 2021 §4.2).

What it does not model (stated in docs/speed.md): kernel-launch gaps, GEMM shape efficiency (small hidden
sizes run below peak), the micro-batch's effect on GEMM efficiency, NCCL protocol efficiency, power caps.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainfit.arch.params import active_params_per_token, count_params
from trainfit.arch.spec import ModelSpec
from trainfit.errors import StrategyError
from trainfit.hardware import GPUSpec
from trainfit.strategy import Checkpointing, PipelineSchedule, Sharding, Strategy

__all__ = [
    "DEFAULT_NETWORK_GBPS",
    "HBM_EFFICIENCY",
    "HOST_ADAM_GBPS",
    "MATMUL_EFFICIENCY",
    "SpeedInputs",
    "StepTime",
    "model_flops_per_token",
    "step_time",
    "step_time_of",
]

#: Sustained fraction of the dense tensor-core peak for large GEMMs: cuBLAS bf16 8192³ on a B200 ran at 1610 of
#: 2250 TFLOPS (pyptx.dev/performance, "Blackwell GEMM" table) = 0.716. One figure for every GPU and shape.
MATMUL_EFFICIENCY = 0.72

#: Sustained fraction of the catalog HBM bandwidth: an H100 80GB HBM3 D2D copy / STREAM triad measured
#: 3089 GB/s of the 3350 GB/s spec = 0.92 (fate-oracle.com trace of an H100 bandwidth probe, "peak_bandwidth").
HBM_EFFICIENCY = 0.92

#: Network bandwidth per GPU across nodes, GB/s per direction: 400 Gb/s RDMA per GPU (torchtitan's benchmark
#: platform, docs/performance.md "Hosts are inter-connected with backend RDMA network with 400 Gb/s per GPU";
#: DGX H100 has one 400 Gb/s ConnectX-7 port per GPU). Override with ``network_gbps``.
DEFAULT_NETWORK_GBPS = 50.0

#: Host memory traffic a CPU Adam step can sustain per GPU, GB/s: an ASSUMPTION (no source found this
#: session): ~200 GB/s of a two-socket server's DRAM bandwidth shared by 8 GPUs' processes = 25 GB/s each.
HOST_ADAM_GBPS = 25.0

#: Bytes of host memory traffic per parameter in a CPU Adam step: read fp32 weight, gradient, m, v (16 B),
#: write weight, m, v (12 B) — the fp32 states of Rajbhandari et al. 2020's 16Ψ recipe.
HOST_ADAM_BYTES_PER_PARAM = 28

#: Korthikanti et al. 2022, Table 2: 34·s·b·h bytes of saved activations per layer (fused attention: no 5·a·s/h).
ACTIVATION_BYTES_PER_HIDDEN = 34


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTime:
    """Seconds per optimizer step and what they are made of (per rank; every rank waits for the slowest)."""

    compute_seconds: float  # matmuls + memory-bound work, including recompute
    recompute_seconds: float  # the part of compute_seconds checkpointing adds
    comm_seconds: float  # all communication, hidden or not
    exposed_comm_seconds: float  # the part of comm_seconds not hidden behind compute
    bubble_seconds: float  # pipeline bubble
    offload_seconds: float  # PCIe transfers and the CPU optimizer step
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
    frozen_base: bool = False
    compute_dtype: str = "bf16"
    compute_bits: int = 16
    grad_bits: int = 32
    weight_bits: int = 32
    recompute: bool = False
    sharding: Sharding = Sharding.NONE
    offload_optimizer: bool = False
    offload_parameters: bool = False
    float8: bool = False  # --fp8: the converted block linears run at the fp8 peak (float8_rate)

    @classmethod
    def of(cls, strategy: Strategy) -> SpeedInputs:
        par, r = strategy.parallelism, strategy.recipe
        return cls(
            data=par.data,
            tensor=par.tensor,
            pipeline=par.pipeline,
            gpus_per_node=par.gpus_per_node,
            virtual_stages=par.virtual_stages if par.pipeline_schedule is PipelineSchedule.INTERLEAVED else 1,
            seq_len=strategy.seq_len,
            micro_batch=strategy.micro_batch,
            grad_accum=strategy.effective_batch // strategy.micro_batch,  # pipeline micro-batches included
            frozen_base=strategy.adapter is not None,
            compute_dtype=r.compute_dtype,
            compute_bits=r.compute_bits,
            grad_bits=r.grad_bits,
            weight_bits=r.weight_bits,
            recompute=strategy.checkpointing is not Checkpointing.NONE,
            sharding=strategy.sharding,
            offload_optimizer=strategy.offload.optimizer_on_host,
            offload_parameters=strategy.offload.parameters_on_host,
            float8=strategy.float8.value != "none",
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class _ModelNumbers:
    params: int
    matmul_params: int  # active parameters that are matmul weights


_MODEL_CACHE: dict[int, tuple[ModelSpec, _ModelNumbers]] = {}


def _numbers(spec: ModelSpec) -> _ModelNumbers:
    hit = _MODEL_CACHE.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    nums = _ModelNumbers(
        params=count_params(spec), matmul_params=active_params_per_token(spec) - _embedding_lookup_params(spec)
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


def model_flops_per_token(spec: ModelSpec, seq_len: int, *, frozen_base: bool = False) -> float:
    """Training FLOPs per token without recompute: 3 × (2·P_matmul + attention); 2 × with a frozen base (no
    weight gradients; the LoRA adapters' own FLOPs, < 1% of the total at rank 16, are left out)."""
    attn = _attention_flops_per_token(spec, seq_len)
    passes = 2 if frozen_base else 3
    return passes * (2 * _numbers(spec).matmul_params + attn)


def float8_flops_fraction(spec: ModelSpec, seq_len: int) -> float:
    """Share of a training step's FLOPs that run in fp8 under ``--fp8``: the converted block linears
    (:func:`trainfit.analytic.float8.block_linears`: torchtitan's filter, dims ÷ 16; all three GEMMs of each —
    output, grad_input, grad_weight — are ``torch._scaled_mm`` in ``matmul_with_hp_or_float8_args``) over the
    forward's matmul + attention FLOPs; the LM head and attention stay in bf16. Forward and backward have the same
    share (each backward GEMM is twice its forward's), and a recompute's share is close to it (no head)."""
    from trainfit.analytic.float8 import block_linears

    converted = sum(x.in_features * x.out_features for x in block_linears(spec) if x.converted) * spec.num_layers
    total = 2 * _numbers(spec).matmul_params + _attention_flops_per_token(spec, seq_len)
    return min(1.0, 2 * converted / total) if total else 0.0


def float8_rate(spec: ModelSpec, gpu: GPUSpec, seq_len: int, rate: float, peak: float) -> float:
    """The sustained FLOP rate with a fraction φ of the FLOPs at the GPU's fp8 peak (the catalog's dense fp8
    tensor-core figure, twice bf16 on Ada/Hopper/Blackwell) and the rest at ``rate``: the time-weighted (harmonic)
    mean, 1 / ((1 − φ)/rate + φ/(rate·fp8/peak)). Same :data:`MATMUL_EFFICIENCY` for both; the casts' memory
    traffic (amax, scale, cast: fused under torch.compile) is not in it. Without an fp8 peak, ``rate``."""
    fp8 = gpu.peak_tflops.get("fp8")
    if not fp8:
        return rate
    phi = float8_flops_fraction(spec, seq_len)
    fast = rate * float(fp8) * 1e12 / peak
    return 1.0 / ((1.0 - phi) / rate + phi / fast)


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


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
    return step_time_of(spec, SpeedInputs.of(strategy), gpu, network_gbps=network_gbps)


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
    attn = _attention_flops_per_token(spec, seq)
    layer_matmul = nums.matmul_params - spec.vocab_size * spec.hidden_size  # blocks only (the head is not recomputed)
    passes = 2 if x.frozen_base else 3
    fwd = 2 * nums.matmul_params + attn
    recompute_fwd = (2 * max(layer_matmul, 0) + attn) if x.recompute else 0.0
    model_flops_rank = passes * fwd * tokens_micro * accum / (t * p)
    recompute_flops_rank = recompute_fwd * tokens_micro * accum / (t * p)
    flops_rate = peak * MATMUL_EFFICIENCY
    if x.float8:
        flops_rate = float8_rate(spec, gpu, seq, flops_rate, peak)
    hbm = (gpu.memory_bandwidth_gbps or 1000.0) * 1e9 * HBM_EFFICIENCY
    layers_rank = spec.num_layers / p
    act_traffic = ACTIVATION_BYTES_PER_HIDDEN * spec.hidden_size * layers_rank * tokens_micro * accum / t / hbm
    mem_time = (3 + (1 if x.recompute else 0)) * act_traffic
    recompute_time = recompute_flops_rank / flops_rate + (act_traffic if x.recompute else 0.0)
    compute = (model_flops_rank + recompute_flops_rank) / flops_rate + mem_time
    compute_micro = compute / accum

    pcie = (gpu.pcie_gbps or 16.0) * 1e9
    intra = gpu.nvlink_gbps * 1e9 if gpu.nvlink_gbps else pcie
    net = network_gbps * 1e9
    tp_bw = intra if t <= gpn else net
    dp_bw = net if d * t > gpn else intra

    local_params = nums.params / (t * p)
    # Trained parameters: all, or with a frozen base only the adapters (~1% at rank 16; their gradients are
    # all that is reduced).
    local_trained = local_params if not x.frozen_base else local_params / 100
    gb, wb = x.grad_bits / 8, x.weight_bits / 8
    sh = x.sharding

    comm = exposed = 0.0
    if d > 1 and sh in (Sharding.DDP, Sharding.NONE, Sharding.ZERO1, Sharding.ZERO2):
        c = 2 * _ring(d) * local_trained * gb / dp_bw
        comm += c
        exposed += max(0.0, c - compute_micro * 2 / 3)  # hidden behind the last micro-step's backward (2/3)
    elif d > 1 and sh in (Sharding.ZERO3, Sharding.FSDP):
        per_micro = (2 * _ring(d) * local_params * wb + _ring(d) * local_trained * gb) / dp_bw
        comm += per_micro * accum
        exposed += accum * max(0.0, per_micro - compute_micro)
    elif d > 1 and sh is Sharding.HSDP:
        shard = min(gpn, d)
        replicas = d // shard
        per_micro = (2 * _ring(shard) * local_params * wb + _ring(shard) * local_trained * gb) / intra
        across = 2 * _ring(replicas) * local_trained / shard * gb / net if replicas > 1 else 0.0
        comm += per_micro * accum + across
        exposed += accum * max(0.0, per_micro - compute_micro) + max(0.0, across - compute_micro * 2 / 3)
    act = micro * seq * spec.hidden_size * x.compute_bits / 8
    if t > 1:
        calls = 4 + (2 if x.recompute else 0)
        c = calls * layers_rank * 2 * _ring(t) * act / tp_bw * accum
        comm += c
        exposed += c
    bubble = 0.0
    if p > 1:
        bubble = compute * (p - 1) / (x.virtual_stages * accum)
        c = 2 * accum * act / t / (net if world > gpn else intra)  # activations forward, gradients back
        comm += c
        exposed += c
    offload = 0.0
    if x.offload_optimizer:
        shard_params = local_trained / d
        offload += shard_params * (gb + 2) / pcie + shard_params * HOST_ADAM_BYTES_PER_PARAM / (HOST_ADAM_GBPS * 1e9)
    if x.offload_parameters:
        offload += accum * 2 * local_params / d * 2 / pcie
    step = compute + exposed + bubble + offload
    return StepTime(
        compute_seconds=compute,
        recompute_seconds=recompute_time,
        comm_seconds=comm,
        exposed_comm_seconds=exposed,
        bubble_seconds=bubble,
        offload_seconds=offload,
        step_seconds=step,
        tokens_per_step=tokens_step,
        tokens_per_second=tokens_step / step,
        model_flops_per_step=model_flops_rank,
        mfu=model_flops_rank / step / peak,
    )
