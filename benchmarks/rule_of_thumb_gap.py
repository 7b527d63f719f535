"""Print the analytic estimate next to the article's rule of thumb for a few catalog models.

Usage: python benchmarks/rule_of_thumb_gap.py   (markdown table on stdout; used in docs/accuracy.md)
"""

from __future__ import annotations

from trainfit.analytic import estimate_analytic, estimate_rule_of_thumb
from trainfit.arch import load_model
from trainfit.strategy import Strategy

CASES = [
    ("gpt2", Strategy(precision="amp-bf16", micro_batch=8, seq_len=1024)),
    ("qwen2.5-0.5b", Strategy(precision="amp-bf16", micro_batch=4, seq_len=2048)),
    ("llama-3.2-1b", Strategy(precision="pure-bf16", micro_batch=4, seq_len=2048)),
    ("llama-3.1-8b", Strategy(precision="amp-bf16", micro_batch=1, seq_len=2048)),
    ("llama-3.1-8b", Strategy(precision="amp-bf16", micro_batch=1, seq_len=2048, checkpointing="full")),
    ("llama-2-7b", Strategy(precision="master-bf16", micro_batch=1, seq_len=2048)),
    ("qwen2.5-7b", Strategy(precision="pure-bf16", micro_batch=2, seq_len=4096, checkpointing="full")),
    ("mistral-7b-v0.1", Strategy(precision="amp-bf16", micro_batch=1, seq_len=4096, optimizer="adamw-8bit")),
]


def main() -> None:
    print("| model | recipe | b×s | ckpt | rule of thumb (GB, c=15) | analytic peak (GB) | phase | c (analytic) |")
    print("|---|---|---|---|---:|---:|---|---:|")
    for slug, s in CASES:
        spec = load_model(slug)
        rot = estimate_rule_of_thumb(spec, s)
        an = estimate_analytic(spec, s)
        rot_total = (rot.peak_bytes + rot.overhead.total_bytes) / 1e9
        an_total = an.nvidia_smi_estimate_bytes / 1e9
        print(
            f"| {slug} | {s.precision.value} {s.optimizer.value} | {s.micro_batch}×{s.seq_len} | "
            f"{s.checkpointing.value} | {rot_total:.1f} | {an_total:.1f} | {an.peak_phase.value} | "
            f"{an.extra['activation_coefficient']} |"
        )


if __name__ == "__main__":
    main()
