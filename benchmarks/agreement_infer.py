"""Analytic vs ``generate`` trace for inference, at catalog sizes: one row per model, setup and phase.

    PYTHONPATH=src python benchmarks/agreement_infer.py [--markdown] [--dtype nf4|fp4|int8|...] [MODEL ...]

The trace (``trainfit.trace.generate``) runs transformers' ``generate`` on fake tensors, depth-extrapolated
from 2 and 3 layers; the analytic model is ``trainfit.analytic.inference``. Prints a table (markdown with
``--markdown``, as in docs/accuracy.md). ``--dtype D`` runs every case with weights in ``D`` instead (the
bitsandbytes formats run real ``Linear4bit``/``Linear8bitLt`` layers with their CUDA kernels' memory,
trainfit.trace.bnb); the quantised cases below are always in the table.
"""

from __future__ import annotations

import dataclasses
import sys
import time

from trainfit.analytic.inference import phase_estimates
from trainfit.arch import load_model
from trainfit.result import InferencePhase
from trainfit.strategy.inference import InferenceSetup
from trainfit.trace.generate import trace_generate
from trainfit.units import GiB

CASES: list[tuple[str, InferenceSetup]] = [
    ("llama-3.1-8b", InferenceSetup(batch=4, prompt=2048, new_tokens=8)),
    ("llama-3.1-8b", InferenceSetup(batch=4, prompt=2048, new_tokens=8, cache="static")),
    ("llama-3.1-8b", InferenceSetup(batch=1, prompt=4096, new_tokens=8, attention="eager")),
    ("llama-3.2-1b", InferenceSetup(batch=16, prompt=1024, new_tokens=8, dtype="fp32")),
    ("mistral-7b-v0.1", InferenceSetup(batch=1, prompt=8192, new_tokens=8, cache="sliding")),
    ("qwen2.5-7b", InferenceSetup(batch=8, prompt=1024, new_tokens=8)),
    ("qwen3-8b", InferenceSetup(batch=8, prompt=1024, new_tokens=8, dtype="fp16")),
    ("tinyllama-1.1b", InferenceSetup(batch=32, prompt=512, new_tokens=8)),
    ("gemma-2b", InferenceSetup(batch=8, prompt=1024, new_tokens=8)),
    ("phi-2", InferenceSetup(batch=8, prompt=1024, new_tokens=8)),
    ("qwen3-30b-a3b", InferenceSetup(batch=4, prompt=1024, new_tokens=8)),
    ("mixtral-8x7b-v0.1", InferenceSetup(batch=4, prompt=1024, new_tokens=8)),
    ("gpt2", InferenceSetup(batch=16, prompt=512, new_tokens=8)),
    ("qwen3-30b-a3b", InferenceSetup(batch=16, prompt=4096, new_tokens=4)),
    ("deepseek-v3", InferenceSetup(batch=1, prompt=1024, new_tokens=4)),
    ("deepseek-v3", InferenceSetup(batch=4, prompt=4096, new_tokens=4)),
    # the example: a sliding-window mask whose efficient-kernel bias is the prefill peak
    ("mistral-7b-v0.1", InferenceSetup(batch=1, prompt=32768, new_tokens=8, dtype="nf4")),
    # eager in fp16 (softmax's fp32 output beside its cast back) and with one k/v head (repeat_kv a view)
    ("qwen3-8b", InferenceSetup(batch=4, prompt=1024, new_tokens=8, dtype="fp16", attention="eager")),
    ("gemma-2b", InferenceSetup(batch=8, prompt=1024, new_tokens=8, attention="eager")),
    # --padded: generate keeps the 2-D mask, the model builds [b, 1, q, kv] masks, the masked kernel every pass
    ("llama-3.1-8b", InferenceSetup(batch=4, prompt=2048, new_tokens=8, padded=True)),
    ("qwen3-30b-a3b", InferenceSetup(batch=16, prompt=1024, new_tokens=4, padded=True)),
    # --kv-dtype fp8: transformers' QuantizedCache(backend="fp8"), a dequantised copy per attention call
    ("llama-3.1-8b", InferenceSetup(batch=8, prompt=4096, new_tokens=8, kv_dtype="fp8")),
    ("qwen3-30b-a3b", InferenceSetup(batch=16, prompt=4096, new_tokens=4, kv_dtype="fp8")),
    ("deepseek-v3", InferenceSetup(batch=1, prompt=8192, new_tokens=4, kv_dtype="fp8")),
    # bitsandbytes weights: the dequantised weight (4-bit, > 4 rows) or LLM.int8's activation buffers per linear
    ("llama-3.1-8b", InferenceSetup(batch=4, prompt=2048, new_tokens=8, dtype="nf4")),
    ("llama-3.1-8b", InferenceSetup(batch=1, prompt=512, new_tokens=8, dtype="nf4")),
    ("mistral-7b-v0.1", InferenceSetup(batch=8, prompt=1024, new_tokens=8, dtype="fp4", double_quant=False)),
    ("qwen2.5-7b", InferenceSetup(batch=8, prompt=1024, new_tokens=8, dtype="int8")),
    ("llama-3.2-1b", InferenceSetup(batch=1, prompt=4096, new_tokens=8, dtype="int8", attention="eager")),
    ("qwen3-30b-a3b", InferenceSetup(batch=4, prompt=1024, new_tokens=8, dtype="nf4")),
    ("deepseek-v3", InferenceSetup(batch=2, prompt=1024, new_tokens=4, dtype="int8")),
    # transformers' fine-grained fp8 (FP8Linear, 128x128 blocks): the input's fp8 copy and scales per linear
    ("llama-3.1-8b", InferenceSetup(batch=4, prompt=2048, new_tokens=8, dtype="fp8")),
    ("qwen2.5-7b", InferenceSetup(batch=16, prompt=512, new_tokens=8, dtype="fp8")),
    # fp8 MoE experts (FP8Experts, grouped kernel with fused activation quantisation)
    ("deepseek-v3", InferenceSetup(batch=1, prompt=1024, new_tokens=4, dtype="fp8")),
    ("mixtral-8x7b-v0.1", InferenceSetup(batch=4, prompt=1024, new_tokens=8, dtype="fp8")),
    # tensor parallelism: rank 0 of transformers' own plan (base_model_tp_plan) on the fake process group
    ("qwen2.5-72b", InferenceSetup(batch=4, prompt=2048, new_tokens=8, tp=4)),
    ("llama-3.1-8b", InferenceSetup(batch=4, prompt=2048, new_tokens=8, tp=2, cache="static")),
    ("qwen3-8b", InferenceSetup(batch=8, prompt=1024, new_tokens=8, tp=4)),
    ("qwen3-30b-a3b", InferenceSetup(batch=4, prompt=1024, new_tokens=8, tp=4)),
    ("mixtral-8x7b-v0.1", InferenceSetup(batch=4, prompt=1024, new_tokens=8, tp=8)),
    # tensor parallelism with fine-grained fp8 weights: the block scales sharded with their weights
    ("qwen2.5-72b", InferenceSetup(batch=4, prompt=2048, new_tokens=8, tp=4, dtype="fp8")),
    ("llama-3.1-8b", InferenceSetup(batch=4, prompt=2048, new_tokens=8, tp=2, dtype="fp8")),
    ("qwen3-30b-a3b", InferenceSetup(batch=4, prompt=1024, new_tokens=8, tp=4, dtype="fp8")),
    ("mixtral-8x7b-v0.1", InferenceSetup(batch=4, prompt=1024, new_tokens=8, tp=8, dtype="fp8")),
]


def main(argv: list[str]) -> None:
    markdown = "--markdown" in argv
    dtype = argv[argv.index("--dtype") + 1] if "--dtype" in argv else None
    only = [a for i, a in enumerate(argv) if not a.startswith("--") and (i == 0 or argv[i - 1] != "--dtype")]
    rows = []
    for name, base in CASES:
        if only and name not in only:
            continue
        setup = dataclasses.replace(base, dtype=dtype) if dtype else base
        spec = load_model(name)
        t0 = time.perf_counter()
        try:
            tr = trace_generate(spec, setup)
        except Exception as exc:  # a benchmark reports, it does not stop
            print(f"{name}: trace failed: {exc}", file=sys.stderr)
            continue
        secs = time.perf_counter() - t0
        an = phase_estimates(spec, setup)
        desc = (
            f"{setup.dtype.value}{'' if setup.double_quant or not setup.dtype.bnb else ' no-dq'}"
            f"{' kv-' + setup.kv_format.value if setup.kv_dtype else ''} "
            f"{setup.cache.value} {setup.attention.value} "
            f"{'tp' + str(setup.tp) + ' ' if setup.tp > 1 else ''}"
            f"{'padded ' if setup.padded else ''}"
            f"b{setup.batch} p{setup.prompt}+{setup.new_tokens}"
        )
        for ph in InferencePhase:
            t = sum(tr.phases[ph].values())
            a = an[ph].breakdown.total_bytes
            w = tr.weights_bytes
            rest = 100 * (a - t) / (t - w) if t > w else 0.0  # the error on what is not weights
            rows.append((name, desc, ph.value, t / GiB, a / GiB, 100 * (a - t) / t, an[ph].moment, rest))
        print(f"{name} {desc}: trace {secs:.1f}s", file=sys.stderr, flush=True)
    if markdown:
        print("| model | setup | phase | trace GiB | analytic GiB | error | error beyond weights | worst moment |")
        print("|---|---|---|---:|---:|---:|---:|---|")
        for r in rows:
            print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.3f} | {r[4]:.3f} | {r[5]:+.2f}% | {r[7]:+.2f}% | {r[6]} |")
    else:
        for r in rows:
            print(f"{r[0]:16s} {r[1]:40s} {r[2]:8s} {r[3]:9.3f} {r[4]:9.3f} {r[5]:+7.2f}% {r[7]:+7.2f}%  {r[6]}")
    worst = max((abs(r[5]) for r in rows), default=0.0)
    beyond = max((abs(r[7]) for r in rows), default=0.0)
    print(
        f"worst |error|: {worst:.2f}% of the phase, {beyond:.2f}% of its non-weight bytes, over {len(rows)} phases",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
