"""One FSDP2 rank's synthesised allocator stream (trainfit.analytic.rank_events.FsdpHooks) against the real
``fully_shard`` run's events on the fake process group at full depth, both replayed through the allocator model on one
CUDA stream: allocated and reserved peaks (the figures of docs/distributed.md "The embedding and the head as FSDP2
units"). ``--ddp-buckets``: real DDP on gloo over 2 CPU processes, its buckets (bytes, first parameters) after each
step's forward, before and after the reducer's rebuild (docs/distributed.md "How the trace works").

Usage: python benchmarks/fsdp_stream_vs_trace.py [MODEL] [SEQ] [W] [--wrap root|units|auto] [--ckpt none|full]
       python benchmarks/fsdp_stream_vs_trace.py --ddp-buckets
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_DDP = """import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
m = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
names = {id(p): n for n, p in m.named_parameters()}
d = DDP(m)
opt = torch.optim.SGD(d.parameters(), lr=0.1)
for step in range(3):
    out = d(torch.randn(4, 512))
    if dist.get_rank() == 0:  # the reducer's buckets after this forward (its _pre_forward rebuilds them)
        got = [(b.buffer().numel() * 4, [names[id(p)] for p in b.parameters()][:2])
               for b in d.reducer._get_zeros_like_grad_buckets()]
        print("step", step, "forward: buckets", got)
    out.sum().backward()
    opt.step(); opt.zero_grad(set_to_none=True)
dist.destroy_process_group()
"""


def ddp_buckets() -> None:
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "ddp_buckets.py"
        script.write_text(_DDP)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        print("\n".join(x for x in out.stdout.splitlines() if x.startswith("step")) or out.stderr[-2000:])


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="llama-3.1-8b")
    ap.add_argument("seq", nargs="?", type=int, default=1024)
    ap.add_argument("w", nargs="?", type=int, default=8)
    ap.add_argument("--wrap", default="auto")
    ap.add_argument("--ckpt", default="none")
    ap.add_argument("--ddp-buckets", action="store_true")
    a = ap.parse_args(argv)
    if a.ddp_buckets:
        ddp_buckets()
        return
    from trainfit.allocator import AllocatorConfig, Event, simulate
    from trainfit.analytic.events import Stream, synthesise
    from trainfit.analytic.parallel import compute_strategy
    from trainfit.analytic.rank_events import FsdpHooks
    from trainfit.arch import load_model
    from trainfit.strategy import EngineOptions, Parallelism, Strategy
    from trainfit.trace import depth
    from trainfit.trace.distributed import fake_world, fsdp_run_strategy, run_layout_distributed
    from trainfit.trace.events import tracker_events

    spec = load_model(a.model)
    s = Strategy(
        parallelism=Parallelism(data=a.w), sharding="fsdp", micro_batch=1, seq_len=a.seq, checkpointing=a.ckpt,
        engine=EngineOptions(fsdp_wrap=a.wrap),
    )  # fmt: skip
    t0 = time.perf_counter()
    built, _ = fsdp_run_strategy(s)
    plan = depth.plan_depth(spec, built, extrapolate=False)
    with fake_world(a.w) as mesh:
        run = run_layout_distributed(spec, s, plan, plan.layouts[0][1], mesh, steps=3, adamw_impl="fused")
    traced = simulate(tracker_events(run), AllocatorConfig())
    st = Stream()
    synthesise(st, spec, compute_strategy(s, casts_every_param=True), (), FsdpHooks(spec, s, a.w), steps=3)
    mine = simulate([Event(e.op, e.key, e.size_bytes, 0) for e in st.events], AllocatorConfig())
    g = 2**30
    for what, x, y in (
        ("allocated", mine.peak_allocated_bytes, traced.peak_allocated_bytes),
        ("reserved", mine.peak_reserved_bytes, traced.peak_reserved_bytes),
    ):
        print(f"{a.model} 1 x {a.seq} W{a.w} {a.ckpt} wrap={a.wrap} {what}: stream {x / g:.3f} GiB, trace {y / g:.3f}"
              f" GiB ({x / y - 1:+.2%})")  # fmt: skip
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main(sys.argv[1:])
