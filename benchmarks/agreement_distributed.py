"""Analytic vs trace for one rank of a many-GPU run at catalog sizes: the table in docs/accuracy.md
("Many GPUs: analytic vs trace").

Each row traces rank 0 of the real FSDP2 ``fully_shard``, torch DDP or DTensor tensor parallelism
(``parallelize_module`` with torchtitan's Llama plan, ± sequence parallelism; trainfit.trace.tensor_parallel)
on PyTorch's fake process group (trainfit.trace.distributed; 1–2 layers, extrapolated in depth) and
compares every phase with the closed-form model (trainfit.analytic.parallel). The trace time is the wall
time of the whole trace; it does not grow with the world size. DeepSpeed ZeRO-1/2 rows run the closed form's worst
rank of the real DeepSpeed engine (trainfit.trace.deepspeed, at its whole depth), whose phases the analytic column
gives; ZeRO-3 rows trace the whole depth too. The fine-tuning rows
(``--finetune``) wrap real PEFT LoRA models (QLoRA: bitsandbytes 4-bit layers) before the framework does.
2-D FSDP2 × TP rows (``--fsdp-tp``) run ``parallelize_module`` then ``fully_shard`` per layer and root on the
``dp`` mesh dimension, as torchtitan's ``parallelize_llama`` does.
DeepSpeed's CPU offload rows (``--offload``: ZeRO-Offload, ZeRO-Infinity to CPU; trainfit.trace.deepspeed_offload)
also compare the host bytes per node (what DeepSpeed pins, Adam's states on the host).
``--units``: FSDP2 rows with ``--fsdp-wrap units`` (the token embedding and [final norm, head] as units of their
own, torchtitan and accelerate 1.15).
``--reshard``: FSDP2's matrix, both ``reshard_after_forward`` settings × checkpointing none/full/selective at
W ∈ {2, 8, 64} (llama-3.1-8b; ``--quick``: W = 2 only).
``--reserve``: no trace; the analytic rank's predicted reserved memory from its simulated allocator event stream
(trainfit.analytic.rank_events: DDP, FSDP2, ZeRO, DTensor TP and the worst Megatron stage under 1F1B, interleaved and
GPipe), default allocator and ``expandable_segments:True`` — the "What it predicts" table
of docs/accuracy.md ("Reserved memory with many GPUs"); ``--megatron-schedules``: its interleaved and GPipe rows only.
Usage: python benchmarks/agreement_distributed.py [--quick] [--tp-only | --fsdp-tp | --deepspeed | --zero3 | --finetune
| --finetune-zero | --offload | --reshard | --units | --reserve | --megatron-schedules]
"""

from __future__ import annotations

import dataclasses
import sys
import time

from trainfit.analytic.parallel import estimate_parallel
from trainfit.arch import load_model
from trainfit.strategy import EngineOptions, Offload, Parallelism, Strategy, finetune_setup
from trainfit.trace.distributed import trace_distributed

# (model, sharding, world size, reshard_after_forward / gradient_as_bucket_view, checkpointing)
CASES = (
    ("llama-3.1-8b", "fsdp", 8, True, "none"),
    ("llama-3.1-8b", "fsdp", 8, False, "none"),
    ("llama-3.1-8b", "fsdp", 64, True, "full"),
    ("qwen2.5-7b", "fsdp", 2, True, "none"),
    ("qwen2.5-7b", "ddp", 2, False, "none"),
    ("qwen2.5-7b", "ddp", 8, True, "none"),
    ("llama-3.2-1b", "ddp", 64, False, "full"),
    ("llama-3.1-70b", "fsdp", 64, True, "full"),
    # DeepSpeed ZeRO (trainfit.trace.deepspeed; the flag is unused): the exported ds_config.json, default buckets
    ("llama-2-7b", "zero2", 8, False, "none"),
    ("llama-2-7b", "zero1", 64, False, "none"),
    ("qwen2.5-7b", "zero2", 2, False, "full"),
    # ZeRO-3 is traced at full depth (the gathered parameters depend on the recorded module order)
    ("llama-2-7b", "zero3", 8, False, "none"),
    ("qwen2.5-7b", "zero3", 64, False, "full"),
)
QUICK = CASES[:1]
# (model, tensor-parallel degree, sequence parallel, checkpointing): --engine torch, W = tp, micro-batch 1 × 2048
TP_CASES = (
    ("llama-3.1-8b", 2, False, "none"),
    ("llama-3.1-8b", 2, True, "none"),
    ("llama-3.1-8b", 4, False, "none"),
    ("llama-3.1-8b", 4, True, "none"),
    ("llama-3.1-8b", 8, False, "none"),
    ("llama-3.1-8b", 8, True, "none"),
    ("llama-3.1-8b", 8, True, "full"),
    ("qwen2.5-7b", 4, True, "none"),
)
# (model, tp, dp, sequence parallel, checkpointing): --engine torch --sharding fsdp, W = tp·dp, 1 × 2048
FSDP_TP_CASES = (
    ("llama-3.1-8b", 2, 4, True, "none"),
    ("llama-3.1-8b", 8, 8, False, "none"),
    ("llama-3.1-8b", 4, 16, True, "full"),
    ("llama-3.1-70b", 8, 8, True, "full"),
)
# (model, sharding, world size, flag, checkpointing, finetune, LoRA targets): rank 16, PEFT's fp32 adapters
FINETUNE = (
    ("llama-3.1-8b", "fsdp", 8, True, "none", "lora", "all-linear"),
    ("llama-3.1-8b", "fsdp", 8, False, "full", "lora", "q_proj,v_proj"),
    ("llama-3.1-8b", "fsdp", 64, True, "full", "lora", "all-linear"),
    ("llama-3.1-8b", "fsdp", 8, True, "full", "qlora", "all-linear"),
    ("llama-3.1-8b", "ddp", 8, False, "full", "lora", "all-linear"),
    ("qwen2.5-7b", "hsdp", 16, True, "none", "lora", "q_proj,v_proj"),
    # DeepSpeed ZeRO with real PEFT (traced since 2026-12-03; --finetune-zero runs only these)
    ("llama-3.1-8b", "zero2", 8, True, "full", "lora", "all-linear"),
    ("llama-3.1-8b", "zero1", 8, True, "full", "lora", "q_proj,v_proj"),
    ("llama-3.1-8b", "zero3", 8, True, "full", "lora", "all-linear"),
)

# (model, sharding, world size, --offload, checkpointing): DeepSpeed with the exported offload blocks, master-bf16
OFFLOAD_CASES = (
    ("llama-2-7b", "zero2", 8, "optimizer", "none"),
    ("llama-2-7b", "zero1", 64, "optimizer", "none"),
    ("llama-2-7b", "zero3", 8, "optimizer", "none"),
    ("qwen2.5-7b", "zero3", 64, "optimizer+params", "full"),
)


def gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def strategy(
    sharding: str, w: int, flag: bool, ckpt: str, how: str = "full", targets: str = "all-linear", wrap: str = "root"
) -> Strategy:
    adapter, base = finetune_setup(how, rank=16, targets=targets) if how != "full" else (None, None)
    extra = {"adapter": adapter, "base_weights": base} if adapter is not None else {}
    return Strategy(
        **extra,
        parallelism=Parallelism(data=w),
        sharding=sharding,
        checkpointing=ckpt,
        micro_batch=1,
        seq_len=2048,
        engine=EngineOptions(
            reshard_after_forward=flag if sharding in ("fsdp", "hsdp") else True,
            gradient_as_bucket_view=flag if sharding == "ddp" else False,
            fsdp_wrap=wrap if sharding in ("fsdp", "hsdp") else "root",
        ),
    )


#: ``--units``: (model, W, reshard_after_forward, checkpointing); llama-3.2-1b's table is tied (in [final norm, head])
UNITS_CASES = (
    ("llama-3.1-8b", 8, True, "none"),
    ("llama-3.1-8b", 8, False, "none"),
    ("llama-3.1-8b", 64, True, "full"),
    ("qwen2.5-7b", 2, True, "none"),
    ("llama-3.2-1b", 8, True, "none"),
    ("llama-3.1-70b", 64, True, "full"),
)


def tp_strategy(tp: int, sp: bool, ckpt: str, dp: int = 1) -> Strategy:
    return Strategy(
        sharding="fsdp" if dp > 1 else "none",
        parallelism=Parallelism(data=dp, tensor=tp, sequence_parallel=sp),
        checkpointing=ckpt,
        engine=EngineOptions(engine="torch"),
        micro_batch=1,
        seq_len=2048,
    )


def row(slug: str, setup: str, w: int, ckpt: str, s: Strategy) -> None:
    spec = load_model(slug)
    t0 = time.perf_counter()
    tr = trace_distributed(spec, s)
    secs = time.perf_counter() - t0
    an = estimate_parallel(spec, s)
    worst = max(abs(a.total_bytes - t.total_bytes) / t.total_bytes for a, t in zip(an.phases, tr.phases, strict=True))
    d = (an.peak_bytes - tr.peak_bytes) / tr.peak_bytes
    print(
        f"| {slug} | {setup} | {w} | {ckpt} | {gib(an.peak_bytes)} ({an.peak_phase.value}) | "
        f"{gib(tr.peak_bytes)} ({tr.peak_phase.value}) | {d:+.2%} | {worst:.2%} | {secs:.1f} |",
        flush=True,
    )


def _header() -> None:
    print(
        "| model | setup | W | ckpt | analytic GiB (phase) | trace GiB (phase) | Δ peak | worst Δ of a phase "
        "| trace s |"
    )
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")


def offload_rows(quick: bool) -> None:
    print(
        "| model | setup | W | ckpt | analytic GiB (phase) | trace GiB (phase) | Δ peak | worst Δ of a phase "
        "| host/node analytic GiB | host/node trace GiB | Δ host | trace s |"
    )
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for slug, sharding, w, offload, ckpt in OFFLOAD_CASES[:1] if quick else OFFLOAD_CASES:
        spec = load_model(slug)
        s = Strategy(
            precision="master-bf16",
            parallelism=Parallelism(data=w),
            sharding=sharding,
            checkpointing=ckpt,
            micro_batch=1,
            seq_len=2048,
            offload=Offload.parse(offload),
        )
        t0 = time.perf_counter()
        tr = trace_distributed(spec, s)
        secs = time.perf_counter() - t0
        an = estimate_parallel(spec, s)
        pairs = zip(an.phases, tr.phases, strict=True)
        worst = max(abs(a.total_bytes - t.total_bytes) / t.total_bytes for a, t in pairs)
        d = (an.peak_bytes - tr.peak_bytes) / tr.peak_bytes
        dh = (an.host_peak_bytes - tr.host_peak_bytes) / tr.host_peak_bytes
        print(
            f"| {slug} | ZeRO-{sharding[-1]}, --offload {offload} | {w} | {ckpt} | {gib(an.peak_bytes)} "
            f"({an.peak_phase.value}) | {gib(tr.peak_bytes)} ({tr.peak_phase.value}) | {d:+.2%} | {worst:.2%} | "
            f"{gib(an.host_peak_bytes)} | {gib(tr.host_peak_bytes)} | {dh:+.2%} | {secs:.1f} |",
            flush=True,
        )


#: (model, world sizes) of the ``--reshard`` matrix: FSDP2 × both reshard settings × checkpointing none/full/selective
RESHARD = ("llama-3.1-8b", (2, 8, 64))


def reshard_matrix(quick: bool) -> None:
    """FSDP2 per layer + root, ``reshard_after_forward`` True/False × checkpointing none/full/selective."""
    slug, worlds = RESHARD
    _header()
    for w in worlds[:1] if quick else worlds:
        for flag in (True, False):
            for ckpt in ("none", "full", "selective"):
                row(slug, f"FSDP2, reshard_after_forward={flag}", w, ckpt, strategy("fsdp", w, flag, ckpt))


#: (model, sharding, W, reshard_after_forward / gradient_as_bucket_view / overlap_comm, checkpointing)
RESERVE_CASES = (
    *CASES[:8],
    ("llama-3.1-8b", "zero2", 8, False, "none"),
    ("llama-3.1-8b", "zero2", 8, True, "none"),
    ("llama-3.1-8b", "zero2", 64, False, "full"),
    ("qwen2.5-7b", "zero2", 2, False, "none"),
    ("llama-3.1-70b", "zero2", 64, False, "full"),
    ("llama-3.1-8b", "zero1", 8, False, "none"),
    ("llama-3.1-8b", "zero1", 64, False, "full"),
    ("llama-3.1-70b", "zero1", 64, False, "full"),
    ("llama-3.1-8b", "zero3", 8, False, "none"),
    ("llama-3.1-8b", "zero3", 64, False, "full"),
    ("llama-3.1-70b", "zero3", 64, False, "full"),
)


# Megatron ranks (the worst pipeline stage's stream, 1F1B): (model, tp, pp, sequence parallel, micro-batches,
# sharding — zero1: the distributed optimizer —, world size, checkpointing)
MEGATRON_RESERVE_CASES = (
    ("llama-3.1-8b", 4, 1, False, 1, "ddp", 8, "none"),
    ("llama-3.1-8b", 4, 1, True, 1, "zero1", 8, "none"),
    ("llama-3.1-8b", 2, 2, True, 8, "zero1", 16, "full"),
    ("llama-3.1-70b", 8, 4, True, 16, "ddp", 64, "none"),
    ("llama-3.1-70b", 8, 4, True, 16, "zero1", 64, "selective"),
    ("llama-3.1-70b", 8, 8, True, 32, "zero1", 128, "full"),
)


# Megatron's other pipeline schedules: (model, tp, pp, sp, micro-batches, virtual stages, schedule, sharding, W, ckpt)
MEGATRON_SCHEDULE_RESERVE_CASES = (
    ("llama-3.1-8b", 2, 2, True, 8, 2, "interleaved", "zero1", 16, "full"),
    ("llama-3.1-70b", 8, 4, True, 16, 5, "interleaved", "zero1", 64, "selective"),
    ("llama-3.1-8b", 2, 4, False, 8, 1, "gpipe", "ddp", 8, "none"),
    ("llama-3.1-70b", 8, 4, True, 16, 1, "gpipe", "zero1", 64, "selective"),
)

# DTensor TP ranks (no sequence parallelism, no sharding): (model, tp, checkpointing)
DTENSOR_RESERVE_CASES = (("llama-3.1-8b", 4, "none"), ("llama-3.1-8b", 8, "full"), ("llama-3.1-70b", 8, "full"))


def megatron_strategy(tp: int, pp: int, sp: bool, m: int, sharding: str, w: int, ckpt: str) -> Strategy:
    return Strategy(
        parallelism=Parallelism(data=w // (tp * pp), tensor=tp, pipeline=pp, sequence_parallel=sp, microbatches=m),
        sharding=sharding,
        checkpointing=ckpt,
        micro_batch=1,
        seq_len=2048,
    )


def _reserve_row(slug: str, setup: str, w: object, ckpt: str, s: Strategy) -> None:
    """One row: the closed form's allocated peak, the simulated reserved memory (default allocator and
    ``expandable_segments:True``) and its reserve over the allocated peak."""
    from trainfit import estimate

    plain, grown = (estimate(slug, s, allocator=conf) for conf in ("", "expandable_segments:True"))
    cells = [f"{r.reserved_estimate_bytes / 2**30:.2f} ({r.reserved_estimate_bytes / r.peak_bytes - 1:+.1%})"
             for r in (plain, grown)]  # fmt: skip
    print(f"| {slug} | {setup} | {w} | {ckpt} | {plain.peak_bytes / 2**30:.2f} | {cells[0]} | {cells[1]} |")


def reserve_rows() -> None:
    """The analytic rank's allocated peak and predicted reserved memory (micro-batch 1 × 2048, amp-bf16) with the
    default allocator and with expandable segments (``estimate(..., allocator=...)``)."""
    print("| model | setup | W | ckpt | allocated GiB | reserved GiB (reserve) | expandable |")
    print("|---|---|---:|---|---:|---:|---:|")
    for slug, sharding, w, flag, ckpt in RESERVE_CASES:
        s = strategy(str(sharding), int(str(w)), bool(flag), str(ckpt))
        if str(sharding).startswith("zero"):
            s = dataclasses.replace(s, engine=dataclasses.replace(s.engine, overlap_comm=True if flag else None))
            setup = f"ZeRO-{str(sharding)[-1]}{', overlap_comm' if flag else ''}"
        elif sharding == "ddp":
            setup = "DDP, gradient_as_bucket_view" if flag else "DDP"
        else:
            setup = f"FSDP2, reshard_after_forward={flag}"
        _reserve_row(str(slug), setup, w, str(ckpt), s)
    for slug, tp, ckpt in DTENSOR_RESERVE_CASES:
        _reserve_row(str(slug), f"DTensor TP {tp}", tp, str(ckpt), tp_strategy(int(tp), False, str(ckpt)))
    for slug, tp, pp, sp, m, sharding, w, ckpt in MEGATRON_RESERVE_CASES:
        s = megatron_strategy(int(tp), int(pp), bool(sp), int(m), str(sharding), int(w), str(ckpt))
        pipe = f", PP {pp} (1F1B, {m} micro-batches)" if int(pp) > 1 else ""
        opt = "distributed optimizer" if sharding == "zero1" else "DDP"
        _reserve_row(str(slug), f"Megatron TP {tp}{' + SP' if sp else ''}{pipe}, {opt}", w, str(ckpt), s)
    megatron_schedule_rows()


def megatron_schedule_rows() -> None:
    """The reserve rows of Megatron's interleaved and GPipe schedules (in ``--reserve``; alone:
    ``--megatron-schedules``)."""
    for slug, tp, pp, sp, m, v, sched, sharding, w, ckpt in MEGATRON_SCHEDULE_RESERVE_CASES:
        s = megatron_strategy(int(tp), int(pp), bool(sp), int(m), str(sharding), int(w), str(ckpt))
        par = dataclasses.replace(s.parallelism, pipeline_schedule=str(sched), virtual_stages=int(v))
        s = dataclasses.replace(s, parallelism=par)
        chunks = f", v {v}" if int(v) > 1 else ""
        opt = "distributed optimizer" if sharding == "zero1" else "DDP"
        setup = f"Megatron TP {tp}{' + SP' if sp else ''}, PP {pp} ({sched}{chunks}, {m} micro-batches), {opt}"
        _reserve_row(str(slug), setup, w, str(ckpt), s)


def main(argv: list[str]) -> None:
    if "--reserve" in argv:
        reserve_rows()
        return
    if "--megatron-schedules" in argv:
        megatron_schedule_rows()
        return
    if "--offload" in argv:
        offload_rows("--quick" in argv)
        return
    if "--reshard" in argv:
        reshard_matrix("--quick" in argv)
        return
    if "--units" in argv:
        _header()
        for slug, w, flag, ckpt in UNITS_CASES[:1] if "--quick" in argv else UNITS_CASES:
            s = strategy("fsdp", w, flag, ckpt, wrap="units")
            row(slug, f"FSDP2 units, reshard_after_forward={flag}", w, ckpt, s)
        return
    if "--fsdp-tp" in argv:
        _header()
        for slug, tp, dp, sp, ckpt in FSDP_TP_CASES[:1] if "--quick" in argv else FSDP_TP_CASES:
            setup = f"FSDP2 {dp} × DTensor TP {tp}{' + SP' if sp else ''}"
            row(str(slug), setup, int(tp) * int(dp), str(ckpt), tp_strategy(int(tp), bool(sp), str(ckpt), int(dp)))
        return
    finetune = "--finetune" in argv or "--finetune-zero" in argv
    cases: tuple[tuple[object, ...], ...] = (
        FINETUNE if finetune else () if "--tp-only" in argv else QUICK if "--quick" in argv else CASES
    )
    if "--finetune-zero" in argv:
        cases = tuple(c for c in FINETUNE if str(c[1]).startswith("zero"))
    if "--deepspeed" in argv:
        cases = tuple(c for c in CASES if str(c[1]).startswith("zero"))
    if "--zero3" in argv:
        cases = tuple(c for c in CASES if c[1] == "zero3")
    only_zero = "--deepspeed" in argv or "--zero3" in argv
    tp_cases = () if finetune or only_zero else TP_CASES[:1] if "--quick" in argv else TP_CASES
    _header()
    for slug, sharding, w, flag, ckpt, *ft in cases:
        setup = (
            f"{'HSDP' if sharding == 'hsdp' else 'FSDP2'}, reshard_after_forward={flag}"
            if sharding in ("fsdp", "hsdp")
            else f"DeepSpeed ZeRO-{str(sharding)[-1]}"
            if str(sharding).startswith("zero")
            else f"DDP, gradient_as_bucket_view={flag}"
        )
        if ft:
            setup += f", {ft[0]} r16 {ft[1]}"
        s = strategy(str(sharding), int(str(w)), bool(flag), str(ckpt), *map(str, ft))
        row(str(slug), setup, int(str(w)), str(ckpt), s)
    for slug, tp, sp, ckpt in tp_cases:
        row(slug, f"DTensor TP {tp}{' + SP' if sp else ''}", tp, ckpt, tp_strategy(tp, sp, ckpt))


if __name__ == "__main__":
    main(sys.argv[1:])
