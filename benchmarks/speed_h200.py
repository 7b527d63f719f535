"""The speed model against the H200 step times of 2026-12-04 (docs/speed.md, "Against a real GPU").

    PYTHONPATH=src python benchmarks/speed_h200.py

Prints, for the three ``speed`` cases of ``benchmarks/gpu_session.py``, the model's step time against each
measurement — token ids all 0 (``benchmarks/h200/2026-12-04/session.jsonl``) and random ids, two runs
(``benchmarks/h200/2026-12-04b/session.jsonl``, ``session-speed-rerun.jsonl``) — and its terms: matmuls, attention,
the elementwise work (forward, backward, recompute; eager PyTorch: ``EAGER_ELEMENTWISE_EFFICIENCY``), the loss over
the logits, autocast's weight casts, the optimizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from trainfit import Strategy, get_gpu, load_model
from trainfit.planner import speed as sp

H200 = Path(__file__).parent / "h200"
ZEROS = (H200 / "2026-12-04" / "session.jsonl",)
RANDOM = (H200 / "2026-12-04b" / "session.jsonl", H200 / "2026-12-04b" / "session-speed-rerun.jsonl")
CASES = (
    ("speed-q05-amp-fused-b4s2048", "qwen2.5-0.5b", {"precision": "amp-bf16", "micro_batch": 4, "seq_len": 2048}),
    (
        "speed-l1b-pure-fused-full-b4s2048",
        "llama-3.2-1b",
        {"precision": "pure-bf16", "checkpointing": "full", "micro_batch": 4, "seq_len": 2048},
    ),
    ("speed-l3b-pure-fused-b2s4096", "llama-3.2-3b", {"precision": "pure-bf16", "micro_batch": 2, "seq_len": 4096}),
)


def measured(session: Path) -> dict[str, float]:
    rows = (json.loads(line) for line in session.read_text().splitlines())
    return {r["case"]: r["step_seconds"] for r in rows if r.get("section") == "speed" and r["record"] == "measured"}


def main() -> None:
    gpu = get_gpu("h200-sxm-141gb")
    zeros = [measured(f) for f in ZEROS]
    rand = [measured(f) for f in RANDOM]
    peak = gpu.peak_tflops["bf16"] * 1e12
    bandwidth = (gpu.memory_bandwidth_gbps or 0) * 1e9
    hbm = bandwidth * sp.HBM_EFFICIENCY
    for case, slug, kw in CASES:
        spec, st = load_model(slug), Strategy(**kw)  # type: ignore[arg-type]
        x = sp.SpeedInputs.of(st, spec)
        t = sp.step_time(spec, st, gpu)
        attn, flops, rc, fwd, bwd = sp._per_token(spec, x)
        tok = x.micro_batch * x.seq_len * x.grad_accum
        matmul = (flops - 3 * attn + rc.flops) * tok / (peak * sp.MATMUL_EFFICIENCY)
        attention = (
            ((3 + sp.FLASH_BACKWARD_RECOMPUTE) * attn + rc.attention_flops)
            * tok
            / (peak * sp.attention_efficiency(gpu))
        )
        ew = bandwidth * sp.elementwise_efficiency(x)
        elementwise = ((1 + rc.memory_passes) * fwd + bwd) * spec.num_layers * tok / ew
        loss = sp.loss_bytes_per_token(spec, x) * tok / hbm
        cast_f, cast_b = sp.autocast_cast_bytes(spec, x)
        casts = ((1 + rc.memory_passes) * cast_f + cast_b) * x.grad_accum / hbm
        runs = "; ".join(
            f"{what} " + ", ".join(f"{m[case] * 1e3:.1f} ms ({t.step_seconds / m[case] - 1:+.1%})" for m in ms)
            for what, ms in (("ids 0", zeros), ("random ids", rand))
        )
        print(
            f"{slug} {kw}: model {t.step_seconds * 1e3:.1f} ms; measured {runs}\n"
            f"    matmul {matmul * 1e3:.1f}, attention {attention * 1e3:.1f}, "
            f"elementwise {elementwise * 1e3:.1f} (at {sp.elementwise_efficiency(x):.2f} of HBM), "
            f"loss {loss * 1e3:.1f}, casts {casts * 1e3:.1f}, optimizer {t.optimizer_seconds * 1e3:.1f} ms; "
            f"mfu {t.mfu:.3f}"
        )


if __name__ == "__main__":
    main()
