"""Time ``trainfit plan`` searches (torch-free) and print the speed model against published throughput.

    PYTHONPATH=src python benchmarks/plan_speed.py

The first table is the search time of the issue's examples (the goal: under 2 s each; wall and CPU seconds —
on a shared machine the CPU time is the search's own — and whether torch got imported: it must not). The second is the
speed model's tokens/s per GPU against figures torchtitan published for named setups (docs/speed.md keeps the
table, its sources and how each setup was matched: torchtitan's selective op AC is ``sac``; its H100s are a
500 W HBM2e part whose peak it gives as a range, so those predictions are ranges). The third is the same against
MosaicML llm-foundry's MPT benchmark tables (Composer FSDP, amp_bf16), whose models are built here from the
yamls' numbers (:func:`mpt`; each one's parameter count is checked against the table's ``NumParams``). The fourth
is Narayanan et al. 2021's Table 1 (Megatron-LM GPT on A100s, the rows without pipeline parallelism), its teraFLOP/s
converted to tokens/s by the paper's own FLOP count. The fifth is DeepSpeed's: Megatron-DeepSpeed 3D runs (BLOOM-176B,
MT-NLG 530B) whose sources state the layout and the measured step time (:data:`DEEPSPEED_PUBLISHED`).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass

from trainfit.arch import load_model
from trainfit.arch.params import count_params
from trainfit.arch.spec import MlpKind, ModelSpec, NormKind
from trainfit.hardware import GPUSpec, get_gpu
from trainfit.planner.rank import search_plans
from trainfit.planner.space import parse_allow
from trainfit.planner.speed import SpeedInputs, step_time_of
from trainfit.strategy import Engine, EngineOptions, Parallelism, Strategy

SEARCHES = (
    ("llama-3.1-8b", "a100-sxm-80gb", 8, 4096, 256, ""),
    ("llama-3.1-70b", "h100-sxm-80gb", 32, 8192, 512, ""),  # --nodes 4 --gpus-per-node 8 --tokens-per-step 4M
    ("mistral-7b-v0.1", "rtx-4090", 1, 2048, 64, "lora,qlora"),
)


@dataclass(frozen=True)
class Published:
    name: str
    source: str
    model: str
    gpu: str  # "torchtitan-h100": the HBM2e, 500 W H100 of torchtitan's benchmark hosts (torchtitan_h100 below)
    gpus: int
    tensor: int
    micro_batch: int
    seq_len: int
    checkpointing: str
    tokens_per_second_per_gpu: float
    float8: bool = False  # torchao Float8Linear (the speed model's fp8 rate; the estimate refuses it with TP)
    sharding: str = "fsdp"
    async_tp: bool = False  # torchtitan's async TP (torch.compile + Inductor's micro-pipeline TP pass)
    precision: str = "master-bf16"  # torchtitan: bf16 parameters for compute, fp32 reduce (FSDP2 mixed precision)
    grad_accum: int = 1
    #: ``torch.compile`` ran (the row says so, or async TP, which needs it, ran): Inductor fuses the
    #: layers' elementwise kernels — ``SpeedInputs.fused_elementwise``, a property of how the engine runs, set for
    #: every compiled row alike
    compiled: bool = False


TT = "torchtitan docs/performance.md"
#: June 2025, torch 38410cf9, torchtitan 820504e; same Grand Teton hosts (500 W HBM2e H100s); sequence length: the
#: train configs' default 8192 (not stated on the page)
ASYNC_TP = "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
PUBLISHED: tuple[Published, ...] = (
    Published(
        "Llama 3.1 8B, 8×H100, FSDP, local batch 2, selective op AC",
        f"torchtitan benchmarks/llama3_h100_202412_torchtitan.md (= {TT} since 2025-01) Table 1, FSDP, no compile",
        "llama-3.1-8b",
        "torchtitan-h100",
        8,
        1,
        2,
        8192,
        "sac",  # train_configs/llama3_8b.toml at the benchmark's commit 9dec370: selective_ac_option = 'op'
        5762,
    ),
    Published(
        "Llama 3.1 8B, 128×H100, FSDP, local batch 2, selective op AC",
        "same, Table 3, FSDP, no compile",
        "llama-3.1-8b",
        "torchtitan-h100",
        128,
        1,
        2,
        8192,
        "sac",
        5605,
    ),
    Published(
        "Llama 3 8B, 64×A100-80GB, FSDP2, local batch 1, selective op AC",
        f"{TT} at 4d88a8a (2024-12), Llama 3 numbers: 2,973 WPS, 58.2% MFU",
        "llama-3.1-8b",
        "a100-sxm-80gb",
        64,
        1,
        1,
        8192,
        "sac",
        2973,
    ),
    Published(
        "Llama 3 70B, 64×A100-80GB, FSDP2, local batch 1, full AC",
        "same: 331 WPS, 51.7% MFU",
        "llama-3.1-70b",
        "a100-sxm-80gb",
        64,
        1,
        1,
        8192,
        "full",
        331,
    ),
    Published(
        "Llama 3.1 405B, 128×H100, FSDP 16 × TP 8, local batch 2, full AC",
        "same, Llama 3.1 numbers: 109 WPS, 29.0% MFU (no Float8 or async TP)",
        "llama-3.1-405b",
        "torchtitan-h100",
        128,
        8,
        2,
        8192,
        "full",
        109,
    ),
    Published(
        "Llama 3.1 70B, 256×H100, FSDP 32 × TP 8 (2-D), local batch 16, full AC, Float8 + compile",
        "torchtitan docs/performance.md (benchmark commit 9dec370) Table 4, '2D' row (no AsyncTP)",
        "llama-3.1-70b",
        "torchtitan-h100",
        256,
        8,
        16,
        8192,
        "full",
        829,
        float8=True,
        compiled=True,
    ),
    Published(
        "Llama 3.1 405B, 128×H100, FSDP 16 × TP 8, local batch 2, full AC, Float8",
        f"{TT} at 4d88a8a, Llama 3.1 numbers: 177 WPS (compile not stated)",
        "llama-3.1-405b",
        "torchtitan-h100",
        128,
        8,
        2,
        8192,
        "full",
        177,
        float8=True,
    ),
    Published(
        "Llama 3.1 70B, 256×H100, FSDP 32 × TP 8, local batch 16, full AC, bf16, compile",
        f"{ASYNC_TP}, 70B table, bf16 'Vanilla TP'",
        "llama-3.1-70b",
        "torchtitan-h100",
        256,
        8,
        16,
        8192,
        "full",
        597.3,
        compiled=True,
    ),
    Published(
        "Llama 3.1 8B, 64×H100, FSDP 8 × TP 8, local batch 12, per-op SAC, bf16, compile",
        f"{ASYNC_TP}, 8B table, bf16 'Vanilla TP'",
        "llama-3.1-8b",
        "torchtitan-h100",
        64,
        8,
        12,
        8192,
        "sac",
        4378,
        compiled=True,
    ),
)


def _async_twin(vanilla: Published, tokens_per_second_per_gpu: float, source: str) -> Published:
    """The same published setup run with torchtitan's async TP (same table, same hosts)."""
    return dataclasses.replace(
        vanilla,
        name=f"{vanilla.name} + AsyncTP",
        source=source,
        tokens_per_second_per_gpu=tokens_per_second_per_gpu,
        async_tp=True,
        compiled=True,
    )


PUBLISHED += (
    _async_twin(PUBLISHED[5], 876, "same, Table 4, '2D + AsyncTP' row"),
    _async_twin(PUBLISHED[6], 185, "same: 185 WPS, 'Float8 + Async TP' (async TP needs torch.compile)"),
    _async_twin(PUBLISHED[7], 652.4, f"{ASYNC_TP}, 70B table, bf16 'Async TP'"),
    _async_twin(PUBLISHED[8], 4809.4, f"{ASYNC_TP}, 8B table, bf16 'Async TP'"),
)


def torchtitan_h100() -> tuple[GPUSpec, GPUSpec]:
    """torchtitan's H100s, as its benchmark page states: "96GB HBM2e with 2.4 TB/sec peak memory bandwidth",
    "the default 500W power limit", and "the actual peak TFLOPs number is between SXM and NVL, and we don't
    know its exact value". Returned as (SXM peak, NVL peak), both at 2.4 TB/s: the prediction is a range."""
    sxm, nvl = get_gpu("h100-sxm-80gb"), get_gpu("h100-nvl-94gb")
    hi = dataclasses.replace(sxm, memory_bandwidth_gbps=2400.0)
    # The catalog has no sourced fp8 peak for the NVL part: Hopper's dense fp8 is twice its bf16 (SXM: 1979 vs
    # 989), so the NVL-peak variant keeps that ratio.
    bf16 = nvl.peak_tflops["bf16"]
    fp8 = sxm.peak_tflops["fp8"] * bf16 / sxm.peak_tflops["bf16"] if bf16 and sxm.peak_tflops["fp8"] else None
    lo = dataclasses.replace(hi, peak_tflops={**sxm.peak_tflops, "bf16": bf16, "fp8": fp8})
    return hi, lo


#: llm-foundry scripts/train/benchmarking/README.md (mosaicml/llm-foundry @061f2c7c): "H100 80GB BF16" and "A100 80GB
#: with 1600 Gbps node-node interconnect (RoCE)" tables; every row used: amp_bf16, MP mode DEFAULT, FULL_SHARD, no
#: activation CPU offload.
FOUNDRY = "llm-foundry scripts/train/benchmarking/README.md"

#: MPT sizes from llm-foundry's scripts/train/yamls/pretrain/mpt-*.yaml: (d_model, n_layers, n_heads), expansion
#: ratio 4, vocabulary 50368, and the parameter count the benchmark table gives at sequence 2048 (NumParams).
MPT_SIZES: dict[str, tuple[int, int, int, int]] = {
    "mpt-3b": (2560, 32, 20, 2651837440),
    "mpt-7b": (4096, 32, 32, 6658859008),
    "mpt-13b": (5120, 40, 40, 12853954560),
    "mpt-30b": (7168, 48, 64, 29975214080),
    "mpt-70b": (8192, 80, 64, 64862437376),
}


def biased_gpt(name: str, model_type: str, hidden: int, layers: int, heads: int, vocab: int, seq_len: int) -> ModelSpec:
    """A GPT-style model with every linear and norm biased: LayerNorm, fused QKV, GELU MLP of 4·h, tied embeddings,
    a learned position table of ``seq_len`` rows (MPT's ALiBi adds none) — 12·h² + 13·h parameters per block (4 norm
    vectors, 9 bias vectors), 2·h for the final norm, (vocab + seq_len)·h for the embeddings."""
    return ModelSpec(
        name=name,
        source="explicit",
        model_type=model_type,
        architecture=model_type,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=4 * hidden,
        vocab_size=vocab,
        max_position_embeddings=seq_len,
        tie_word_embeddings=True,
        norm=NormKind.LAYERNORM,
        norm_bias=True,
        mlp=MlpKind.DENSE,
        activation="gelu",
        qkv_bias=True,
        fused_qkv=True,
        out_bias=True,
        mlp_bias=True,
        learned_positions=seq_len,
    )


def mpt(slug: str, seq_len: int) -> ModelSpec:
    """An MPT model as llm-foundry's benchmark ran it (:func:`biased_gpt`, vocabulary 50368, ALiBi: no rotary). The
    biases are not in today's yamls (``no_bias``) but the table's NumParams count them."""
    d, layers, heads, _ = MPT_SIZES[slug]
    return biased_gpt(slug, "mpt", d, layers, heads, 50368, seq_len)


def _foundry(slug: str, gpu: str, gpus: int, seq: int, micro: int, accum: int, ac: bool, tps: float) -> Published:
    return Published(
        f"MPT-{slug[4:].upper()}, {gpus}×{'H100' if gpu.startswith('h100') else 'A100-80GB'}, FSDP, seq {seq}, "
        f"micro-batch {micro} × {accum}, {'full AC' if ac else 'no AC'}",
        f"{FOUNDRY} @061f2c7c, {'H100 80GB BF16' if gpu.startswith('h100') else 'A100 80GB'} table",
        slug,
        gpu,
        gpus,
        1,
        micro,
        seq,
        "full" if ac else "none",
        tps,
        precision="amp-bf16",
        grad_accum=accum,
    )


FOUNDRY_PUBLISHED: tuple[Published, ...] = (
    _foundry("mpt-3b", "h100-sxm-80gb", 8, 8192, 3, 6, False, 16578),
    _foundry("mpt-7b", "h100-sxm-80gb", 8, 2048, 6, 1, False, 10643),
    _foundry("mpt-13b", "h100-sxm-80gb", 8, 2048, 2, 1, False, 4792),
    _foundry("mpt-30b", "h100-sxm-80gb", 8, 2048, 3, 21, True, 2002),
    _foundry("mpt-70b", "h100-sxm-80gb", 64, 2048, 8, 4, True, 1039),
    _foundry("mpt-3b", "a100-sxm-80gb", 8, 8192, 3, 6, False, 7695),
    _foundry("mpt-7b", "a100-sxm-80gb", 8, 2048, 6, 2, False, 4641),
    _foundry("mpt-13b", "a100-sxm-80gb", 8, 2048, 2, 3, False, 2262),
    _foundry("mpt-30b", "a100-sxm-80gb", 8, 2048, 3, 21, True, 916),
)


#: Narayanan et al. 2021 (arXiv 2104.04473) Table 1, the rows without pipeline parallelism: (parameters in billions,
#: attention heads, hidden size, layers, tensor-parallel size, GPUs, global batch, achieved teraFLOP/s per GPU). Read
#: from a transcription of the table (github SotaroKaneda/MLCarbon data/megatron_table.csv @69070b2), not the paper.
#: All: GPT, sequence 2048, vocabulary 51,200, A100 80GB (Selene: 8 × 200 Gb/s InfiniBand per node), mixed precision,
#: activation recomputation. The PP > 1 rows are left out: the table gives no micro-batch size or interleaving.
MEGATRON_TABLE1: tuple[tuple[float, int, int, int, int, int, int, float], ...] = (
    (1.7, 24, 2304, 24, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 256, 1024, 135),
)
MEGATRON_VOCAB, MEGATRON_SEQ = 51200, 2048
#: Selene's 8 × 200 Gb/s HDR InfiniBand per 8-GPU node: 25 GB/s per GPU and direction.
SELENE_NETWORK_GBPS = 25.0


def megatron_gpt(hidden: int, layers: int, heads: int) -> ModelSpec:
    """Megatron-LM's GPT (megatron/model/gpt_model.py of 2021): :func:`biased_gpt`, the output layer tied to the word
    embedding, learned positions."""
    return biased_gpt(f"megatron-gpt-{hidden}x{layers}", "gpt2", hidden, layers, heads, MEGATRON_VOCAB, MEGATRON_SEQ)


def megatron_tokens_per_second(hidden: int, layers: int, tflops: float) -> float:
    """Table 1's teraFLOP/s per GPU as tokens/s per GPU, by the paper's own count (§5.1, Eq. (3)): F = 96·B·s·l·h²·
    (1 + s/(6h) + V/(16·l·h)) FLOPs per iteration of B sequences of s tokens — activation recomputation included."""
    s, v = MEGATRON_SEQ, MEGATRON_VOCAB
    return tflops * 1e12 / (96 * layers * hidden**2 * (1 + s / (6 * hidden) + v / (16 * layers * hidden)))


def megatron_predicted(row: tuple[float, int, int, int, int, int, int, float]) -> list[float]:
    """Tokens/s per GPU the speed model predicts for one Table 1 row, for each micro-batch 1, 2, 4, 8 (not stated):
    Megatron-LM TP (today's linear layers: the column-parallel backward's all-reduce overlapped), no sequence
    parallelism (2022), data parallelism over the rest, full recomputation, master-fp16."""
    _, heads, hidden, layers, tp, gpus, batch, _ = row
    spec, dp = megatron_gpt(hidden, layers, heads), gpus // tp
    out = []
    for micro in (1, 2, 4, 8):
        s = Strategy(
            precision="master-fp16",
            micro_batch=micro,
            grad_accum=batch // (dp * micro),
            seq_len=MEGATRON_SEQ,
            checkpointing="full",
            engine=EngineOptions(engine=Engine.MEGATRON),
            parallelism=Parallelism.for_gpus(gpus, tensor=tp),
        )
        x = SpeedInputs.of(s, spec)
        out.append(step_time_of(spec, x, get_gpu("a100-sxm-80gb"), network_gbps=SELENE_NETWORK_GBPS).tokens_per_second)
    return [v / gpus for v in out]


@dataclass(frozen=True)
class DeepSpeedRun:
    """A published DeepSpeed (Megatron-DeepSpeed 3D: Megatron TP, DeepSpeed's pipeline engine, ZeRO-1 data
    parallelism) training run: its setup and measured step time."""

    name: str
    source: str
    model: ModelSpec
    gpu: str
    gpus: int
    tensor: int
    pipeline: int
    global_batch: int
    micro_batches: tuple[int, ...]  # the micro-batch size; several where the source does not state it
    network_gbps: float  # across nodes, per GPU and direction
    precision: str
    step_seconds: float  # measured, per optimizer step

    @property
    def tokens_per_second_per_gpu(self) -> float:
        return self.global_batch * self.model.max_position_embeddings / self.step_seconds / self.gpus


def bloom_176b() -> ModelSpec:
    """BLOOM-176B as bigscience trained it (bigscience-workshop/bigscience train/tr11-176B-ml/README.md @9e64ede:
    NHIDDEN 14336, NLAYERS 70, NHEADS 112, sequence 2048, vocabulary 250,680 padded to 250,880 — its "embedding
    size: v*h: 250880*14336"): :func:`biased_gpt` with ALiBi (no position table) and a LayerNorm after the embedding
    (bloom's ``word_embeddings_layernorm``)."""
    return dataclasses.replace(
        biased_gpt("bloom-176b", "bloom", 14336, 70, 112, 250880, 2048), learned_positions=0, embedding_norm=True
    )


def mt_nlg_530b() -> ModelSpec:
    """Megatron-Turing NLG 530B (Smith et al. 2022, arXiv 2201.11990; 105 layers, hidden 20480, 128 heads, sequence
    2048 — the paper's configuration as llm-analysis transcribes it, cli99/llm-analysis examples/megatron-turing-nlg):
    Megatron's GPT (:func:`megatron_gpt`'s block), GPT-2's vocabulary 50,257 padded to 51,200 as Megatron pads it for
    TP 8 (a multiple of 128 × 8)."""
    return biased_gpt("mt-nlg-530b", "gpt2", 20480, 105, 128, 51200, 2048)


#: Jean Zay's A100 nodes (BLOOM's README: "8 GPUs per node", "4 OmniPath links"): Omni-Path is 100 Gb/s per link, so
#: 4 × 100 Gb/s per 8 GPUs = 6.25 GB/s per GPU and direction.
JEAN_ZAY_NETWORK_GBPS = 4 * 100 / 8 / 8

DEEPSPEED_PUBLISHED: tuple[DeepSpeedRun, ...] = (
    DeepSpeedRun(
        "BLOOM-176B, 384×A100-80GB, TP 4 × PP 12 × DP 8 (ZeRO-1), micro-batch 2, global 2048, full AC, bf16",
        "bigscience train/tr11-176B-ml/README.md: iteration 85376, 104.70 s per iteration, 19.561 samples/s",
        bloom_176b(),
        "a100-sxm-80gb",
        384,
        4,
        12,
        2048,
        (2,),
        JEAN_ZAY_NETWORK_GBPS,
        "master-bf16",  # DeepSpeed's BF16_Optimizer: bf16 weights, fp32 master and gradient accumulation, ZeRO-1
        104.70,
    ),
    *(
        DeepSpeedRun(
            f"MT-NLG 530B, {nodes * 8}×A100-80GB, TP 8 × PP 35 × DP {nodes // 35} (ZeRO-1), global 1920, full AC",
            f"Smith et al. 2022 (arXiv 2201.11990) §2.4: {seconds} s per iteration on {nodes} DGX A100 nodes",
            mt_nlg_530b(),
            "a100-sxm-80gb",  # Selene's DGX A100s, "each with an 80GB Tensor Core GPU" (Microsoft's MT-NLG blog)
            nodes * 8,
            8,
            35,
            1920,
            (1, 2, 4),  # not stated
            SELENE_NETWORK_GBPS,
            "master-fp16",
            seconds,
        )
        for nodes, seconds in ((280, 60.1), (350, 50.2), (420, 44.4))
    ),
)


def deepspeed_predicted(run: DeepSpeedRun) -> list[float]:
    """Tokens/s per GPU the speed model predicts for ``run``, one per micro-batch size: Megatron TP (no sequence
    parallelism in 2021–2022), DeepSpeed's 1F1B pipeline (no interleaving: ``PipelineEngine``), ZeRO-1 data
    parallelism, full recomputation."""
    out = []
    for micro in run.micro_batches:
        dp = run.gpus // (run.tensor * run.pipeline)
        s = Strategy(
            precision=run.precision,
            micro_batch=micro,
            seq_len=run.model.max_position_embeddings,
            checkpointing="full",
            sharding="zero1",
            engine=EngineOptions(engine=Engine.MEGATRON),
            parallelism=Parallelism.for_gpus(
                run.gpus, tensor=run.tensor, pipeline=run.pipeline, microbatches=run.global_batch // (micro * dp)
            ),
        )
        x = SpeedInputs.of(s, run.model)
        t = step_time_of(run.model, x, get_gpu(run.gpu), network_gbps=run.network_gbps)
        out.append(t.tokens_per_second / run.gpus)
    return out


def predicted(p: Published) -> list[float]:
    """Tokens/s per GPU the speed model predicts for ``p`` (two values — SXM and NVL peak — on torchtitan's H100).
    TP runs are torchtitan's 2-D FSDP2 × DTensor TP with sequence parallelism (``--engine torch``, what ``auto``
    resolves FSDP + TP to); Float8 runs set the speed model's fp8 rate on the same inputs; compiled runs fuse the
    elementwise kernels (``fused_elementwise``)."""
    s = Strategy(
        precision=p.precision,
        micro_batch=p.micro_batch,
        grad_accum=p.grad_accum,
        seq_len=p.seq_len,
        checkpointing=p.checkpointing,
        sharding=p.sharding,
        parallelism=Parallelism.for_gpus(p.gpus, tensor=p.tensor, sequence_parallel=p.tensor > 1),
    )
    spec = mpt(p.model, p.seq_len) if p.model in MPT_SIZES else load_model(p.model)
    x = SpeedInputs.of(s, spec)
    x = dataclasses.replace(
        x, float8=p.float8, async_tp=p.async_tp, fused_elementwise=x.fused_elementwise or p.compiled
    )
    gpus = torchtitan_h100() if p.gpu == "torchtitan-h100" else (get_gpu(p.gpu),)
    return [step_time_of(spec, x, g).tokens_per_second / p.gpus for g in gpus]


#: torchtitan benchmarks/llama3_h100_202412_torchtitan.md Table 1 (8 GPUs, FSDP, torch.compile on both sides):
#: FSDP + compile 6,667 and FSDP + compile + Float8 8,532 tokens/s/GPU.
FLOAT8_PUBLISHED_RATIO = 8532 / 6667


def float8_ratio() -> list[float]:
    """The speed model's fp8 ÷ bf16 tokens/s for the first published setup (Llama 3.1 8B, 8 GPUs, FSDP), on both
    of torchtitan's H100 peaks: the same inputs with ``float8`` set (the speed model alone; the memory estimate
    refuses --fp8 with sac, which is why the inputs are replaced rather than a Strategy built)."""
    p = PUBLISHED[0]
    s = Strategy(
        precision="master-bf16",
        micro_batch=p.micro_batch,
        seq_len=p.seq_len,
        checkpointing=p.checkpointing,
        sharding="fsdp",
        parallelism=Parallelism.for_gpus(p.gpus, tensor=p.tensor),
    )
    spec = load_model(p.model)
    x = dataclasses.replace(SpeedInputs.of(s), fused_elementwise=True)  # both published runs: torch.compile
    fp8 = dataclasses.replace(x, float8=True)
    return [step_time_of(spec, x, g).step_seconds / step_time_of(spec, fp8, g).step_seconds for g in torchtitan_h100()]


def async_tp_pairs() -> list[tuple[Published, Published]]:
    """Each published async TP run with the same setup run without it (same table)."""

    def key(p: Published) -> tuple[object, ...]:
        return (p.model, p.gpus, p.tensor, p.micro_batch, p.checkpointing, p.float8)

    vanilla = {key(p): p for p in PUBLISHED if not p.async_tp}
    return [(vanilla[key(p)], p) for p in PUBLISHED if p.async_tp]


def main() -> int:
    print("search time (torch-free)")
    worst = 0.0
    for slug, gpu, gpus, seq, gb, allow in SEARCHES:
        spec, g = load_model(slug), get_gpu(gpu)
        t0, c0 = time.perf_counter(), time.process_time()
        r = search_plans(spec, g, gpus=gpus, seq_len=seq, global_batch=gb, allow=parse_allow(allow))
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        worst = max(worst, dt)
        print(
            f"  {slug} on {gpus}× {gpu}: {dt:.2f} s wall, {cpu:.2f} s CPU, {r.candidates} candidates, "
            f"{r.estimates} estimates"
        )
    # the goal is a torch-free search: the planner, the estimates it runs and the speed model never import torch
    print(f"  slowest: {worst:.2f} s wall; torch imported: {'torch' in sys.modules}")
    print("\nspeed model vs published tokens/s per GPU (torchtitan's H100: SXM … NVL peak)")
    for p in PUBLISHED:
        pred = predicted(p)
        published = p.tokens_per_second_per_gpu
        values = " … ".join(f"{x:,.0f}" for x in pred)
        errors = " … ".join(f"{x / published - 1:+.0%}" for x in pred)
        print(f"  {p.name}: predicted {values}, published {published:,.0f} ({errors})")
    print("\nspeed model vs llm-foundry's MPT benchmark (tokens/s per GPU; parameters: ours = the table's)")
    for slug, (*_, params) in MPT_SIZES.items():
        assert count_params(mpt(slug, 2048)) == params, slug
    for p in FOUNDRY_PUBLISHED:
        (pred,) = predicted(p)
        published = p.tokens_per_second_per_gpu
        print(f"  {p.name}: predicted {pred:,.0f}, published {published:,.0f} ({pred / published - 1:+.0%})")
    print("\nspeed model vs Megatron-LM (Narayanan et al. 2021 Table 1, PP 1; tokens/s per GPU by the paper's Eq. 3)")
    for row in MEGATRON_TABLE1:
        pred, published = megatron_predicted(row), megatron_tokens_per_second(row[2], row[3], row[7])
        spec = megatron_gpt(row[2], row[3], row[1])
        print(
            f"  GPT {row[0]}B ({count_params(spec) / 1e9:.2f}B), {row[5]}×A100, TP {row[4]}, batch {row[6]}: "
            f"{row[7]:.0f} TFLOP/s = {published:,.0f} tokens/s; predicted {min(pred):,.0f} … {max(pred):,.0f} "
            f"(over micro-batch 1, 2, 4, 8: {min(pred) / published - 1:+.0%} … {max(pred) / published - 1:+.0%})"
        )
    print("\nspeed model vs DeepSpeed (Megatron-DeepSpeed 3D runs; tokens/s per GPU from the measured step time)")
    for run in DEEPSPEED_PUBLISHED:
        pred, published = deepspeed_predicted(run), run.tokens_per_second_per_gpu
        if len(pred) == 1:
            what = f"{pred[0]:,.1f} ({pred[0] / published - 1:+.0%})"
        else:  # one per micro-batch size, in the order given
            what = (
                " … ".join(f"{v:,.1f}" for v in pred)
                + f" (micro-batch {', '.join(map(str, run.micro_batches))}: "
                + " … ".join(f"{v / published - 1:+.0%}" for v in pred)
                + ")"
            )
        print(f"  {run.name} ({count_params(run.model) / 1e9:.1f}B): {published:,.1f} tokens/s; predicted {what}")
    print("\nasync TP speed-up (same setup without it; predicted SXM … NVL peak vs published)")
    for vanilla, fast in async_tp_pairs():
        # the same setup but async TP: compiled like its twin (async TP needs torch.compile)
        same = dataclasses.replace(vanilla, compiled=fast.compiled)
        pred = [b / a for a, b in zip(predicted(same), predicted(fast), strict=True)]
        published = fast.tokens_per_second_per_gpu / vanilla.tokens_per_second_per_gpu
        print(f"  {fast.name}: predicted " + " … ".join(f"×{r:.3f}" for r in pred) + f", published ×{published:.3f}")
    ratios = float8_ratio()
    print(
        f"\nfp8 (torchao Float8Linear) speed-up, {PUBLISHED[0].name}: predicted "
        + " … ".join(f"×{r:.2f}" for r in ratios)
        + f", published ×{FLOAT8_PUBLISHED_RATIO:.2f} (with torch.compile)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
