"""Step time of TrainStep + StabilityMonitor versus the hand-written loop it replaces.

Both loops do the same work — autocast forward, loss / accumulation steps, (scaled) backward, and on the
boundary unscale_ → clip_grad_norm_ → step → update → zero_grad — on a small transformer encoder. The
difference is TrainStep's bookkeeping: the detached-loss accumulator, the skipped-step flag, and one stacked
record per optimizer step for the monitor (copied to the host every ``--check-every`` steps).

Timing: warm up, then ``--rounds`` rounds; each round times ``--steps`` micro-steps of each loop, in
alternating order (CUDA is synchronised at the end of each timed block). Printed: the median of each loop
and the median of the per-round differences (the two blocks of a round run back to back, so slow drifts
caused by other processes on a shared machine largely cancel). A second table measures the absolute overhead per
micro-step on a model so small that the bookkeeping dominates. This is a script that prints numbers, not a
test with a threshold.

    python benchmarks/trainstep_overhead.py --threads 1          # CPU: fp32 (CPU autocast is emulated)
    python benchmarks/trainstep_overhead.py --precisions fp32,amp-bf16,amp-fp16 --threads 1
    python benchmarks/trainstep_overhead.py --device cuda        # on a GPU: all three precisions
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trainfit.train import StabilityMonitor, TrainStep

DTYPES = {"fp32": None, "amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}


def make_model(device: str, width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, batch_first=True)
    return torch.nn.Sequential(torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
                               torch.nn.Linear(width, 1)).to(device)  # fmt: skip


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).float().mean(dim=1), y)  # (batch, seq, 1) -> (batch, 1)


def hand_loop(model, optimizer, scaler, dtype, device, accum, batches):
    for i, batch in enumerate(batches):
        with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = loss_fn(model, batch) / accum
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        if (i + 1) % accum == 0:
            if scaler is not None:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precisions", default=None, help="default: fp32 on CPU, fp32,amp-bf16,amp-fp16 on CUDA")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="micro-steps per timed block")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--check-every", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = leave as is)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = args.device
    precisions = (args.precisions or ("fp32" if dev == "cpu" else "fp32,amp-bf16,amp-fp16")).split(",")
    print(
        f"torch {torch.__version__}, device {dev}, threads {torch.get_num_threads()}, accum {args.accum}, "
        f"{args.steps} micro-steps x {args.rounds} rounds, check_every {args.check_every}"
    )
    print(f"\nsmall model: {args.layers}-layer encoder width {args.width}, batch {args.batch}x{args.seq}")
    print(f"{'precision':<10} {'hand ms':>9} {'TrainStep ms':>13} {'ratio':>7} {'paired overhead':>16}")
    for precision in precisions:
        make = lambda: make_model(dev, args.width, args.layers)  # noqa: E731
        batch_fn = lambda g: (  # noqa: E731
            torch.randn(args.batch, args.seq, args.width, generator=g).to(dev),
            torch.randn(args.batch, 1, generator=g).to(dev),
        )
        ref, ours = compare(make, batch_fn, precision, dev, args)
        report(precision, ref, ours, scale=1e3, unit="ms")
    print("\nbookkeeping cost on a tiny model (Linear(16,16)+Linear(16,1), batch 4), per micro-step")
    print(f"{'precision':<10} {'hand us':>9} {'TrainStep us':>13} {'ratio':>7} {'paired overhead':>16}")
    for precision in precisions:
        make = lambda: torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1)).to(dev)  # noqa: E731
        batch_fn = lambda g: (torch.randn(4, 1, 16, generator=g).to(dev), torch.randn(4, 1, generator=g).to(dev))  # noqa: E731
        ref, ours = compare(make, batch_fn, precision, dev, args, rounds=max(args.rounds, 101))
        report(precision, ref, ours, scale=1e6, unit="us")


def report(precision: str, ref: list[float], ours: list[float], *, scale: float, unit: str) -> None:
    """Medians of each loop and the median of the per-round (paired, adjacent in time) differences."""
    r, o = statistics.median(ref), statistics.median(ours)
    paired = statistics.median(b - a for a, b in zip(ref, ours, strict=True))
    print(
        f"{precision:<10} {r * scale:>9.3f} {o * scale:>13.3f} {o / r:>7.3f} "
        f"{paired * scale:>+10.3f} {unit} ({100 * paired / r:+.2f}%)"
    )


def compare(make, batch_fn, precision: str, dev: str, args, rounds: int | None = None):
    dtype = DTYPES[precision]
    g = torch.Generator().manual_seed(0)
    batches = [batch_fn(g) for _ in range(args.steps)]
    torch.manual_seed(0)
    ref_model = make()
    torch.manual_seed(0)
    our_model = make()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-4)
    our_opt = torch.optim.AdamW(our_model.parameters(), lr=1e-4)
    fp16 = precision == "amp-fp16"
    ref_scaler = torch.amp.GradScaler(dev, init_scale=1024.0) if fp16 else None
    step = TrainStep(our_model, our_opt, precision=precision, grad_accum=args.accum, max_grad_norm=1.0,
                     monitor=StabilityMonitor(check_every=args.check_every, log_events=False),
                     scaler=torch.amp.GradScaler(dev, init_scale=1024.0) if fp16 else None)  # fmt: skip

    def run_ref() -> None:
        hand_loop(ref_model, ref_opt, ref_scaler, dtype, dev, args.accum, batches)

    def run_ours() -> None:
        for b in batches:
            step(loss_fn, our_model, b)

    for _ in range(2):
        run_ref()
        run_ours()
    ref_t: list[float] = []
    our_t: list[float] = []
    for r in range(rounds or args.rounds):
        pair = [(run_ref, ref_t), (run_ours, our_t)]
        for fn, sink in pair if r % 2 == 0 else reversed(pair):
            sink.append(timed(fn, dev) / args.steps)
    return ref_t, our_t


if __name__ == "__main__":
    main()
