"""Speed of the caching-allocator simulator on a synthetic event stream shaped like a 70B training step.

The stream imitates what a full-depth trace of Llama-3.1-70B-like dimensions (80 layers, hidden 8192,
MLP 28672, 64 heads, 8 KV heads, micro-batch 1 x 4096, bf16 weights, fp32 AdamW states) produces: per layer
in the forward pass the saved activations stay live and the temporaries die at once; the backward pass frees
the saved activations in reverse and allocates gradients and temporaries; a foreach AdamW step allocates
and frees per-parameter temporaries. The real H200 trace of Qwen2.5-0.5B has about 525 allocator events per
layer per step; this generator makes about as many (``--events-per-layer`` to change).

Usage: python benchmarks/allocator_speed.py [--steps 3] [--million]
Prints events, seconds and events per second; ``--million`` also times a stream of at least 2 million events.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Iterator

from trainfit.allocator import AllocatorConfig, Event, Op, simulate

LAYERS = 80
HIDDEN = 8192
MLP = 28672
KV = 1024
TOKENS = 4096
BF16 = 2


def _stream(steps: int, seed: int = 0) -> Iterator[Event]:
    rng = random.Random(seed)
    key = 0

    def new() -> int:
        nonlocal key
        key += 1
        return key

    act = TOKENS * HIDDEN * BF16
    mlp = TOKENS * MLP * BF16
    shapes = [act, act, act, mlp, mlp, mlp, TOKENS * KV * BF16, TOKENS * KV * BF16, TOKENS * 4, 8 * TOKENS]
    params = [HIDDEN * HIDDEN, HIDDEN * KV, HIDDEN * KV, HIDDEN * HIDDEN, HIDDEN * MLP, HIDDEN * MLP, MLP * HIDDEN]
    for _ in range(steps):
        saved: list[list[int]] = []
        for _layer in range(LAYERS):
            keep: list[int] = []
            for _op in range(60):  # ~60 ops per layer forward: 1 alloc each, half saved
                k = new()
                yield Event(Op.ALLOC, k, rng.choice(shapes))
                if rng.random() < 0.15:
                    keep.append(k)
                else:
                    k2 = new()  # a temporary used by the next op and freed
                    yield Event(Op.ALLOC, k2, rng.choice(shapes))
                    yield Event(Op.FREE, k2)
                    yield Event(Op.FREE, k)
            saved.append(keep)
        grads: list[int] = []
        for keep in reversed(saved):
            for _op in range(70):
                k = new()
                yield Event(Op.ALLOC, k, rng.choice(shapes))
                yield Event(Op.FREE, k)
            for p in params:
                g = new()
                grads.append(g)
                yield Event(Op.ALLOC, g, p * 4)
            for k in reversed(keep):
                yield Event(Op.FREE, k)
        # foreach AdamW: per chunk of parameters, a few list-sized temporaries
        for g in grads:
            tmp = [new() for _ in range(4)]
            for t in tmp:
                yield Event(Op.ALLOC, t, 4 * params[g % len(params)])
            for t in tmp:
                yield Event(Op.FREE, t)
        for g in grads:
            yield Event(Op.FREE, g)


def _time(events: list[Event], conf: str) -> tuple[float, int]:
    t = time.perf_counter()
    res = simulate(events, AllocatorConfig.parse(conf))
    return time.perf_counter() - t, res.peak_reserved_bytes


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--million", action="store_true")
    a = ap.parse_args()
    runs = [a.steps]
    if a.million:
        per_step = sum(1 for _ in _stream(1))
        runs.append(-(-2_000_000 // per_step))
    for steps in runs:
        events = list(_stream(steps))
        for conf in ("", "expandable_segments:True"):
            dt, peak = _time(events, conf)
            print(
                f"{steps} steps, {len(events):,} events, {conf or 'default'}: {dt:.2f} s, "
                f"{len(events) / dt:,.0f} events/s, peak reserved {peak / 2**30:.1f} GiB"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
