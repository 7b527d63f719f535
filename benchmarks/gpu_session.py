"""Every GPU check the open issues ask for, in one prepared run of a few minutes on one CUDA GPU.

On the device machine (torch, transformers, peft present; nothing downloaded; no trainfit install):

    PYTHONUNBUFFERED=1 PYTHONPATH=src python3 benchmarks/gpu_session.py --out "$OUT" --budget 480

Here, without a GPU, every section runs on the CPU with tiny shapes and no CUDA numbers (the plumbing only):

    PYTHONPATH=src python benchmarks/gpu_session.py --dry-run --out /tmp/gpu-session [--sections measure,lora]

Sections, in priority order, each with its share of ``--budget`` (time a section leaves unused goes to the
next ones); docs/accuracy.md "How to run the GPU checks" says what each records:

1. ``measure`` (issue 9): ``estimate(..., method="measure")`` (depth-extrapolated, the CLI's path) and a
   full-depth measurement for qwen2.5-0.5b amp-bf16 2×1024 against the trace and the analytic model per phase;
   two training cases, **each in a fresh process**, with per-phase ``max_memory_allocated`` /
   ``max_memory_reserved`` and the device's used memory against the analytic ``reserved_estimate_bytes`` and
   ``nvidia_smi_estimate_bytes`` (llama-3.2-1b pure-bf16 full checkpointing 4×2048 with its
   ``torch.cuda.memory._snapshot()`` allocator trace, replayed through trainfit's simulator; bert-large fp32
   eager 4×512, also with its allocator trace: both sims show ~0.5 GiB of 20 MiB-segment holes at step 1's
   peak that the H200 did not have); the same l1b case once more after qwen2.5-0.5b amp-bf16 4×2048 in one
   process, as the published figures were taken (does the earlier case change l1b's reserved memory?); then
   ``pytest -m gpu tests/measure tests/train`` with what time is left.
2. ``distributed`` (issue 10): FSDP2 ``fully_shard`` (per decoder layer, then the root, as the trace wraps) and
   DDP at world size 1 on a one-GPU NCCL process group, qwen2.5-0.5b pure-bf16, against
   ``estimate(--gpus 1 --sharding fsdp|ddp)`` analytic and trace; device used shows NCCL's buffers; DDP once
   more with a 0.3 s pause after each optimizer step (does NCCL's stash then let the first bucket go?).
3. ``lora`` (issue 11): a PEFT LoRA step (rank 16, all-linear) on qwen2.5-0.5b; QLoRA (nf4, loaded by
   ``from_pretrained`` from a random checkpoint on local disk), recorded as skipped without bitsandbytes.
4. ``generate`` (issue 12): Hugging Face ``generate`` (greedy, a fixed number of new tokens) for three models ×
   dynamic and static cache, peak allocated in prefill and decode against ``infer`` analytic and trace.
5. ``speed`` (issue 14): wall time of training steps (after warm-up, synchronised) of three single-GPU setups
   against the speed model's ``trainfit.planner.speed.step_time``.
6. ``tied`` (issue 11): does autograd add a tied token table's two gradients in place on CUDA
   (trainfit.analytic.states ``tied_gradient_sum``: out of place when the head reads the table itself, in place
   behind autocast's cast)? qwen2.5-0.5b cut to 2 layers (its 151936×896 table dominates), pure-bf16 and
   amp-bf16, per phase against analytic and trace; and a bare probe: an fp32 table read by ``F.embedding`` and
   ``F.linear`` (plain, 4 chunks, behind a bf16 cast), ``max_memory_allocated`` over ``backward()`` in tables
   (about 3 out of place, 2 in place; behind the cast 1.5 in place, 2.5 out of place: its 16-bit copy, alive
   before, is freed in backward).

How: the parent process never imports torch. Each case runs in its own child process (``--child``), so a
case starts from a fresh CUDA context and allocator and an earlier case cannot change its reserved memory;
the predictions (analytic, trace) run in a second child at the same time, on the CPU. A child that runs past
its section's time is killed and recorded as a timeout; an exception is recorded with its error; the run
goes on. Models are built as the trace builds them (``trainfit.trace.hf``: the catalog config, the
recipe's weight dtype, SDPA or eager, ``use_cache`` as the trace sets it), with random weights, directly on
the GPU; batches are ``hf.batch_fn``'s; the optimizer is ``trace.optim.make_optimizer``'s.

Output (at most 8 files under ``--out``): ``session.jsonl`` (one JSON object per line, each with
``section``, ``issue``, ``case`` and ``record``: predicted | measured | comparison | error | skipped;
appended as produced), ``summary.md`` (rewritten after every case), ``log.txt`` (the children's output),
``pytest.txt``, ``snapshot_l1b.pickle`` and ``snapshot_bertl.pickle`` (each ``.pickle.xz`` when over 15 MiB).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib.util
import json
import lzma
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GPU = "h200-sxm-141gb"
PHASES = ("forward", "backward", "optimizer-step")
MAX_FILE_BYTES = 15 * 2**20
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Case:
    id: str
    section: str
    kind: str  # measure | train | dist | lora | qlora | generate | speed | tied | pytest
    model: str = ""
    strategy: dict[str, Any] = field(default_factory=dict)  # Strategy keyword arguments
    trace: bool = True  # also predict with --method trace
    snapshot: bool = False  # record the allocator trace
    caches: tuple[str, ...] = ()  # generate
    prompt: int = 0
    new_tokens: int = 0
    batch: int = 0
    #: (model, Strategy keywords) trained first in the same process, as the published figures were taken.
    preceded_by: tuple[tuple[str, dict[str, Any]], ...] = ()
    #: seconds to sleep after each optimizer step (the DDP check: NCCL's watchdog, every 100 ms, must see the
    #: first iteration's all-reduce complete before the next collective can release its stashed bucket)
    pause_s: float = 0.0


#: (name, issue, share of the budget), in priority order.
SECTIONS = (
    ("measure", 9, 0.40),
    ("distributed", 10, 0.15),
    ("lora", 11, 0.10),
    ("generate", 12, 0.20),
    ("speed", 14, 0.10),
    ("tied", 11, 0.05),
)
ISSUE = {name: issue for name, issue, _ in SECTIONS}

#: The published l1b case (../shared/gpu-truth/h200-training.jsonl), and the case run before it there.
L1B = {
    "precision": "pure-bf16",
    "optimizer_impl": "foreach",
    "checkpointing": "full",
    "micro_batch": 4,
    "seq_len": 2048,
}
Q05_PUBLISHED = {"precision": "amp-bf16", "optimizer_impl": "foreach", "micro_batch": 4, "seq_len": 2048}

CASES = (
    Case(
        id="q05-measure-amp-b2s1024",
        section="measure",
        kind="measure",
        model="qwen2.5-0.5b",
        strategy={"precision": "amp-bf16", "micro_batch": 2, "seq_len": 1024},
    ),
    Case(
        id="l1b-pure-foreach-full-b4s2048",
        section="measure",
        kind="train",
        model="llama-3.2-1b",
        strategy=L1B,
        snapshot=True,
    ),
    Case(
        id="bertl-fp32-foreach-eager-b4s512",
        section="measure",
        kind="train",
        model="bert-large-uncased",
        strategy={
            "precision": "fp32",
            "optimizer_impl": "foreach",
            "attention": "eager",
            "micro_batch": 4,
            "seq_len": 512,
        },
        snapshot=True,
    ),
    Case(
        id="l1b-after-q05-same-process",
        section="measure",
        kind="train",
        model="llama-3.2-1b",
        strategy=L1B,
        trace=False,
        preceded_by=(("qwen2.5-0.5b", Q05_PUBLISHED),),
    ),
    Case(id="pytest-gpu", section="measure", kind="pytest"),
    *(
        Case(
            id=f"q05-{sh}-w1-pure-b2s1024",
            section="distributed",
            kind="dist",
            model="qwen2.5-0.5b",
            strategy={"precision": "pure-bf16", "sharding": sh, "micro_batch": 2, "seq_len": 1024},
        )
        for sh in ("fsdp", "ddp")
    ),
    Case(
        id="q05-ddp-w1-pure-b2s1024-pause300ms",
        section="distributed",
        kind="dist",
        model="qwen2.5-0.5b",
        strategy={"precision": "pure-bf16", "sharding": "ddp", "micro_batch": 2, "seq_len": 1024},
        trace=False,
        pause_s=0.3,
    ),
    Case(
        id="q05-lora-r16-all-linear-pure-b4s1024",
        section="lora",
        kind="lora",
        model="qwen2.5-0.5b",
        strategy={"precision": "pure-bf16", "micro_batch": 4, "seq_len": 1024, "lora": 16},
    ),
    Case(
        id="q05-qlora-nf4-r16-all-linear-amp-b4s1024",
        section="lora",
        kind="qlora",
        model="qwen2.5-0.5b",
        strategy={"precision": "amp-bf16", "micro_batch": 4, "seq_len": 1024, "qlora": 16},
    ),
    # The cells of benchmarks/reserve_agreement.py --finetune whose base is the recipe's weights (the
    # analytic stream's adapter flows against the trace there; here both against the GPU's reserved memory).
    *(
        Case(
            id=cid,
            section="lora",
            kind="qlora" if ft["how"] == "qlora" else "lora",
            model=m,
            strategy={"precision": p, "checkpointing": ck, "micro_batch": b, "seq_len": s, "finetune": ft},
        )
        for cid, m, p, ck, b, s, ft in (
            (
                "q05-lora-qv-pure-b4s1024",
                "qwen2.5-0.5b",
                "pure-bf16",
                "none",
                4,
                1024,
                {"how": "lora", "targets": "q_proj,v_proj"},
            ),
            ("q05-lora-full-ckpt-pure-b4s1024", "qwen2.5-0.5b", "pure-bf16", "full", 4, 1024, {"how": "lora"}),
            (
                "l1b-dora-qv-pure-b2s1024",
                "llama-3.2-1b",
                "pure-bf16",
                "none",
                2,
                1024,
                {"how": "lora", "dora": True, "targets": "q_proj,v_proj"},
            ),
            ("l1b-dora-all-amp-b2s1024", "llama-3.2-1b", "amp-bf16", "none", 2, 1024, {"how": "lora", "dora": True}),
            (
                "l1b-dora-qv-drop05-pure-b2s1024",
                "llama-3.2-1b",
                "pure-bf16",
                "none",
                2,
                1024,
                {"how": "lora", "dora": True, "targets": "q_proj,v_proj", "dropout": 0.05},
            ),
            ("l1b-qlora-all-amp-b2s1024", "llama-3.2-1b", "amp-bf16", "none", 2, 1024, {"how": "qlora"}),
            ("l1b-qlora-all-amp-full-ckpt-b2s1024", "llama-3.2-1b", "amp-bf16", "full", 2, 1024, {"how": "qlora"}),
            (
                "q05-qlora-all-drop05-amp-b4s1024",
                "qwen2.5-0.5b",
                "amp-bf16",
                "none",
                4,
                1024,
                {"how": "qlora", "dropout": 0.05},
            ),
        )
    ),
    *(
        Case(
            id=f"gen-{m}",
            section="generate",
            kind="generate",
            model=m,
            caches=("dynamic", "static"),
            batch=4,
            prompt=1024,
            new_tokens=32,
        )
        for m in ("qwen2.5-0.5b", "llama-3.2-1b", "mistral-7b-v0.1")
    ),
    *(
        Case(id=f"speed-{cid}", section="speed", kind="speed", model=m, strategy=kw, trace=False)
        for cid, m, kw in (
            ("q05-amp-fused-b4s2048", "qwen2.5-0.5b", {"precision": "amp-bf16", "micro_batch": 4, "seq_len": 2048}),
            (
                "l1b-pure-fused-full-b4s2048",
                "llama-3.2-1b",
                {"precision": "pure-bf16", "checkpointing": "full", "micro_batch": 4, "seq_len": 2048},
            ),
            ("l3b-pure-fused-b2s4096", "llama-3.2-3b", {"precision": "pure-bf16", "micro_batch": 2, "seq_len": 4096}),
        )
    ),
)
CASES += tuple(
    Case(
        id=f"tied-q05-2layers-{p.split('-')[0]}-b1s256",
        section="tied",
        kind="tied",
        model="qwen2.5-0.5b",
        strategy={"precision": p, "micro_batch": 1, "seq_len": 256},
    )
    for p in ("pure-bf16", "amp-bf16")
)
BY_ID = {c.id: c for c in CASES}

#: Layers of the tied cases' model: few, so that the token table's gradients decide the backward peak.
TIED_LAYERS = 2

#: Dry-run shrinking of a catalog config: depth, width, vocabulary (the family stays).
TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 512,
}


# -- shared helpers -----------------------------------------------------------------------------------------


def spec_of(slug: str, dry: bool) -> Any:
    from trainfit.arch import load_model
    from trainfit.arch.catalog import catalog_config
    from trainfit.arch.loader import spec_from_config

    if not dry:
        return load_model(slug)
    cfg = dict(catalog_config(slug))
    for k, v in TINY.items():
        if k in cfg:
            cfg[k] = v
    return spec_from_config(cfg, name=f"{slug}-tiny", source="dry-run")


def case_spec(case: Case, dry: bool) -> Any:
    """The case's model: the catalog's, cut to :data:`TIED_LAYERS` layers for the tied cases."""
    if case.kind != "tied":
        return spec_of(case.model, dry)
    from trainfit.arch.catalog import catalog_config
    from trainfit.arch.loader import spec_from_config

    cfg = dict(catalog_config(case.model))
    for k, v in TINY.items() if dry else ():
        if k in cfg:
            cfg[k] = v
    cfg["num_hidden_layers"] = TIED_LAYERS
    return spec_from_config(cfg, name=f"{case.model}-{TIED_LAYERS}layers", source="gpu-session")


def strategy_of(case: Case, dry: bool, kw: dict[str, Any] | None = None) -> Any:
    from trainfit.strategy import Adapter, Strategy

    kw = dict(case.strategy if kw is None else kw)
    rank = kw.pop("lora", None)
    if rank:
        kw["adapter"] = Adapter(rank=rank, alpha=2 * rank)
    qrank = kw.pop("qlora", None)
    finetune = dict(kw.pop("finetune", None) or {})  # finetune_setup's keywords, the method under "how"
    if qrank:
        finetune = {"how": "qlora", "rank": qrank}
    if finetune:
        from trainfit.strategy import finetune_setup

        kw["adapter"], kw["base_weights"] = finetune_setup(finetune.pop("how"), **finetune)
    if dry:
        kw["micro_batch"], kw["seq_len"] = min(kw.get("micro_batch", 1), 2), 32
    return Strategy(**kw)


def gen_shape(case: Case, dry: bool) -> tuple[int, int, int]:
    return (2, 16, 4) if dry else (case.batch, case.prompt, case.new_tokens)


def rel(pred: int | float | None, meas: int | float | None) -> float | None:
    return None if not pred or not meas else round(pred / meas - 1, 5)


def by_phase(rep: Any) -> dict[str, int]:
    return {str(p.phase.value): int(p.total_bytes) for p in rep.phases}


SESSION = "session.jsonl"


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The records of a session file (a line cut short by a killed writer is skipped)."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows


class Sink:
    """Appends JSON lines to a file, flushed one by one (a killed writer keeps what it wrote)."""

    def __init__(self, path: Path, case: Case) -> None:
        self.path, self.case = path, case

    def write(self, record: str, **fields: Any) -> dict[str, Any]:
        row = {"section": self.case.section, "issue": ISSUE[self.case.section], "case": self.case.id, "record": record}
        row.update(fields)
        # One write(2) per line on an O_APPEND file: two children can append to the same file.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(row, default=str) + "\n").encode())
        finally:
            os.close(fd)
        return row


# -- predictions (CPU child, torch only for the trace) --------------------------------------------------------


def predict(case: Case, sink: Sink, dry: bool) -> None:
    if case.kind == "pytest":
        return
    from trainfit import estimate
    from trainfit.hardware import get_gpu

    spec = case_spec(case, dry)
    if case.kind == "generate":
        from trainfit.infer import infer

        b, p, n = gen_shape(case, dry)
        for cache in case.caches:
            for method in ("analytic", "trace"):
                t0 = time.perf_counter()
                try:
                    r = infer(spec, batch=b, prompt=p, new_tokens=n, cache=cache, dtype="bf16", method=method)
                    sink.write(
                        "predicted",
                        cache=cache,
                        method=method,
                        phases=by_phase(r),
                        kv_cache_bytes=r.kv_cache_bytes,
                        weights_bytes=r.weights_bytes,
                        seconds=round(time.perf_counter() - t0, 1),
                    )
                except Exception as exc:
                    sink.write("error", cache=cache, method=method, error=f"{type(exc).__name__}: {exc}"[:400])
        return
    st = strategy_of(case, dry)
    if case.kind == "speed":
        from trainfit.planner.speed import step_time

        t = step_time(spec, st, get_gpu(GPU))
        sink.write(
            "predicted",
            method="speed-model",
            step_seconds=t.step_seconds,
            tokens_per_second=t.tokens_per_second,
            mfu=t.mfu,
            compute_seconds=t.compute_seconds,
        )
        return
    for method in ("analytic", "trace") if case.trace else ("analytic",):
        t0 = time.perf_counter()
        try:
            r = estimate(spec, st, method=method, gpu=GPU, search_micro_batch=False, fixes=False)
            sink.write(
                "predicted",
                method=method,
                phases=by_phase(r),
                peak_bytes=r.peak_bytes,
                reserved_estimate_bytes=r.reserved_estimate_bytes,
                nvidia_smi_estimate_bytes=r.nvidia_smi_estimate_bytes,
                outside_allocator_bytes=r.overhead.outside_allocator_bytes,
                warnings=list(r.warnings),
                seconds=round(time.perf_counter() - t0, 1),
                **as_measured(case, spec, st, method),
            )
        except Exception as exc:
            sink.write("error", method=method, error=f"{type(exc).__name__}: {exc}"[:400])


def as_measured(case: Case, spec: Any, st: Any, method: str) -> dict[str, int]:
    """For a one-GPU training case measured alone in a fresh process: ``max_memory_reserved`` predicted as the
    measuring child runs it — ``_Dev.env``'s warm-up matmul (the main thread's cuBLAS workspace) before the
    model, the model built by ``from_config`` on the GPU (a tied head's own weight made and freed,
    trainfit.allocator.process.built_on_device), then the steps. ``estimate`` predicts a job without that
    history; on llama-3.2-1b the two differ by 3.8 GiB (docs/accuracy.md, "Against a real GPU")."""
    if case.kind not in ("train", "lora", "tied") or case.preceded_by:
        return {}
    from trainfit.allocator.process import built_on_device, matmul_warm_up, simulate_process
    from trainfit.analytic.activations import effective_strategy
    from trainfit.analytic.events import built_on_device_sizes, training_events
    from trainfit.estimate import gpu_workspaces
    from trainfit.hardware import get_gpu

    eff, _ = effective_strategy(spec, st)
    ws = gpu_workspaces(get_gpu(GPU))
    if method == "trace":
        from trainfit.trace.events import reserved_from_trace

        events = list(reserved_from_trace(spec, eff, compute_capability=(9, 0), steps=3).stream)
    else:
        events = training_events(spec, eff, ws)
    n, head = built_on_device_sizes(spec, eff)
    run = simulate_process([built_on_device(events, weights=n, transient_bytes=head)], warm_up=matmul_warm_up(ws))
    return {"reserved_as_measured_bytes": run[0].peak_reserved_bytes}


# -- measurements (device child) -------------------------------------------------------------------------------


class _Dev:
    """The run's device and its memory counters (all empty on the CPU)."""

    def __init__(self, dry: bool) -> None:
        import torch

        self.torch = torch
        self.cuda = not dry
        if self.cuda and not torch.cuda.is_available():
            raise RuntimeError("no CUDA device: run with --dry-run to check the plumbing")
        self.name = "cuda" if self.cuda else "cpu"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def reset(self) -> None:
        if self.cuda:
            self.sync()
            self.torch.cuda.reset_peak_memory_stats()

    def stats(self) -> dict[str, int]:
        if not self.cuda:
            return {}
        c = self.torch.cuda
        free, total = c.mem_get_info()
        return {
            "allocated": c.memory_allocated(),
            "max_allocated": c.max_memory_allocated(),
            "reserved": c.memory_reserved(),
            "max_reserved": c.max_memory_reserved(),
            "device_used": total - free,
        }

    def env(self) -> dict[str, Any]:
        """Versions, and the memory used outside the allocator after CUDA and cuBLAS initialisation."""
        import transformers

        out: dict[str, Any] = {"torch": self.torch.__version__, "transformers": transformers.__version__}
        if self.cuda:
            t = self.torch
            x = t.ones(256, 256, device="cuda") @ t.ones(256, 256, device="cuda")
            del x
            t.cuda.synchronize()
            free, total = t.cuda.mem_get_info()
            out.update(
                device=t.cuda.get_device_name(),
                cuda=t.version.cuda,
                alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                total=total,
                used_after_init=total - free,
                reserved_after_init=t.cuda.memory_reserved(),
            )
        return out


def build_model(spec: Any, st: Any, dev: _Dev, *, dtype: Any = None) -> Any:
    """The Hugging Face model as the trace builds it (trainfit.trace.hf.build_meta), with random weights on
    the run's device: the catalog config with ``use_cache`` as the trace sets it, the recipe's weight dtype,
    SDPA (eager when asked, or when the model has no SDPA)."""
    torch = dev.torch
    from trainfit.strategy import Attention
    from trainfit.trace import hf
    from trainfit.trace import runner as rn

    conf = hf.hf_config(spec)
    auto = hf.auto_class(spec)
    wdtype = dtype or rn.weight_dtype(st.recipe)
    attn = "eager" if st.attention is Attention.EAGER else "sdpa"
    with hf.quiet_transformers(), torch.device(dev.name):
        try:
            model = auto.from_config(conf, attn_implementation=attn, dtype=wdtype)
        except ValueError:
            model = auto.from_config(conf, attn_implementation="eager", dtype=wdtype)
    return model


def enable_checkpointing(model: Any) -> None:
    """Full checkpointing as the trace turns it on (trace/hf.py ``_enable_hf_checkpointing``): the model's own
    ``activation_checkpointing_enable`` (or ``gradient_checkpointing_enable``), non-reentrant — said
    explicitly, as measure_training.py did for the published figures, whatever this transformers' default."""
    fn = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    fn({"use_reentrant": False})


def prepare(spec: Any, st: Any, model: Any, dev: _Dev) -> tuple[Any, ...]:
    """(trainable parameters, optimizer, grad scaler, batch maker, loss, autocast context) of the trace's step
    for ``st`` (trace.optim ``make_optimizer``, hf ``batch_fn`` / ``loss_of``, the recipe's autocast and loss
    scaling), with checkpointing on when asked and the model in training mode."""
    torch = dev.torch
    from trainfit.strategy import Checkpointing
    from trainfit.trace import hf
    from trainfit.trace import runner as rn
    from trainfit.trace.optim import make_optimizer

    if st.checkpointing is Checkpointing.FULL:
        enable_checkpointing(model)
    model.train()
    rec = st.recipe
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(st.optimizer, params, adamw_impl=st.optimizer_impl.value if dev.cuda else "foreach")
    scaler = torch.amp.GradScaler(dev.name, enabled=bool(rec.loss_scaling) and dev.cuda)
    zeros = hf.batch_fn(spec, st.micro_batch, st.seq_len, device=dev.name)
    classes = spec.num_labels if spec.kind.value in ("seq-cls", "token-cls") else spec.vocab_size
    high = {"input_ids": max(2, spec.vocab_size), "labels": max(2, classes)}

    def make_batch() -> dict[str, Any]:
        # the trace's batch (its shapes and dtypes), filled in place with random ids: all-zero ids run every
        # matmul on identical rows, faster than real data (the H200 did 894 TFLOP/s on zeros, 788 on random
        # data; 2026-12-04's speed figures were taken on zeros)
        batch = zeros()
        for k, v in batch.items():
            v.random_(0, high.get(k, 2))
        return batch

    def autocast() -> Any:
        return torch.autocast(dev.name, dtype=rn.compute_dtype(rec), enabled=bool(rec.autocast))

    return params, opt, scaler, make_batch, hf.loss_of(spec), autocast


def train_loop(spec: Any, st: Any, model: Any, dev: _Dev, *, steps: int = 3, pause_s: float = 0.0) -> dict[str, Any]:
    """The trace's training step on real tensors, measured per phase like ../shared/gpu-truth's
    measure_training.py: the peak counter is reset before forward, backward and the optimizer step; the
    phases' peaks are the maxima of steps 1.. (optimizer states resident). ``pause_s``: a sleep after each
    step (outside its timing)."""
    torch = dev.torch
    params, opt, scaler, make_batch, loss_of, autocast = prepare(spec, st, model, dev)
    phases = dict.fromkeys(PHASES, 0)
    phases_reserved = dict.fromkeys(PHASES, 0)
    phases_used = dict.fromkeys(PHASES, 0)
    rows: list[dict[str, Any]] = []
    seconds: list[float] = []
    for step in range(steps):
        t0 = time.perf_counter()
        batch = make_batch()
        dev.reset()
        with autocast():
            out = model(**batch)
        loss = loss_of(out, batch)
        del out
        f = dev.stats()
        dev.reset()
        scaler.scale(loss).backward()
        del loss
        b = dev.stats()
        dev.reset()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        o = dev.stats()
        dev.sync()
        seconds.append(round(time.perf_counter() - t0, 4))
        rows.append({"forward": f, "backward": b, "optimizer-step": o})
        if pause_s:
            time.sleep(pause_s)
        if step >= 1 and dev.cuda:
            for ph, s in zip(PHASES, (f, b, o), strict=True):
                phases[ph] = max(phases[ph], s["max_allocated"])
                phases_reserved[ph] = max(phases_reserved[ph], s["max_reserved"])
                phases_used[ph] = max(phases_used[ph], s["device_used"])
    out_row: dict[str, Any] = {"phases": phases if dev.cuda else {}, "steps": rows, "step_seconds": seconds}
    if dev.cuda:
        out_row.update(phases_max_reserved=phases_reserved, phases_device_used=phases_used)
    out_row["params"] = sum(p.numel() for p in model.parameters())
    out_row["trainable_params"] = sum(p.numel() for p in params)
    if dev.cuda:
        c = torch.cuda
        free, total = c.mem_get_info()
        out_row.update(
            max_reserved=c.max_memory_reserved(),  # = the run's peak: reserved only grows (no empty_cache)
            reserved_end=c.memory_reserved(),
            device_used_end=total - free,
            outside_allocator=total - free - c.memory_reserved(),
            peak_allocated=max(phases.values()),
        )
    del opt, params
    return out_row


def _free(dev: _Dev) -> None:
    gc.collect()
    if dev.cuda:
        dev.torch.cuda.empty_cache()


def measure_case(case: Case, sink: Sink, out: Path, dry: bool) -> None:
    if case.kind == "qlora" and importlib.util.find_spec("bitsandbytes") is None:  # looked up, not imported
        sink.write("skipped", reason="no bitsandbytes (carry its wheel: docs/accuracy.md, How to run the GPU checks)")
        return
    if case.kind == "qlora" and dry:
        sink.write("skipped", reason="dry run: bitsandbytes quantises on CUDA")
        return
    dev = _Dev(dry)
    env = dev.env()
    spec = case_spec(case, dry)
    fn = {
        "measure": _measure_method,
        "train": _train,
        "dist": _dist,
        "lora": _lora,
        "qlora": _qlora,
        "generate": _generate,
        "speed": _speed,
        "tied": _tied,
    }[case.kind]
    fn(case, spec, dev, sink, out, env, dry)


def _measure_method(case: Case, spec: Any, dev: _Dev, sink: Sink, out: Path, env: dict[str, Any], dry: bool) -> None:
    """``--method measure`` as the CLI runs it (depth-extrapolated), then at full depth without extrapolation."""
    from trainfit import estimate
    from trainfit.measure.gpu import measure_spec

    st = strategy_of(case, dry)
    for label, extrapolate in (("extrapolated", True), ("full-depth", False)):
        t0 = time.perf_counter()
        if dry:  # the measurement's bookkeeping on CPU tensors, counters reading zero
            rep = measure_spec(spec, st, extrapolate=extrapolate, with_trace=False, memory=_CpuMemory())
        elif extrapolate:
            rep = estimate(spec, st, method="measure", gpu=GPU, search_micro_batch=False, fixes=False)
        else:
            rep = measure_spec(spec, st, extrapolate=False, with_trace=False)
        _free(dev)
        details = rep.details.as_dict() if rep.details is not None else {}
        details.pop("modules", None)
        sink.write(
            "measured",
            how=f"method=measure, {label}",
            phases=by_phase(rep),
            components={str(p.phase.value): {str(k.value): v for k, v in p.components.items()} for p in rep.phases},
            details=details,
            warnings=list(rep.warnings),
            env=env,
            seconds=round(time.perf_counter() - t0, 1),
        )


class _CpuMemory:
    """The measurement's device protocol on the CPU, every counter zero (dry-run only)."""

    device = "cpu"

    def name(self) -> str:
        return "cpu (dry-run)"

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def memory_allocated(self) -> int:
        return 0

    max_memory_allocated = memory_reserved = max_memory_reserved = memory_requested = max_memory_requested = (
        memory_allocated
    )

    def reset_peak_memory_stats(self) -> None:
        pass


def _train(case: Case, spec: Any, dev: _Dev, sink: Sink, out: Path, env: dict[str, Any], dry: bool) -> None:
    torch = dev.torch
    st = strategy_of(case, dry)
    for slug, kw in case.preceded_by:  # as one process measured case after case: gc + empty_cache between
        first = strategy_of(case, dry, kw)
        t0 = time.perf_counter()
        row = train_loop(spec_of(slug, dry), first, build_model(spec_of(slug, dry), first, dev), dev)
        sink.write("preceding", model=slug, strategy=kw, **row, seconds=round(time.perf_counter() - t0, 1))
        _free(dev)
        sink.write("preceding-freed", stats=dev.stats())
    record = case.snapshot and dev.cuda
    if record:  # from before the model exists: the weights' allocations are in the event list too
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=3_000_000)
    t0 = time.perf_counter()
    model = build_model(spec, st, dev)
    extra: dict[str, Any] = {"after_build": dev.stats()}  # what construction left reserved before step 1
    row = train_loop(spec, st, model, dev)
    if record:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        extra["snapshot"] = _write_snapshot(snap, out / f"snapshot_{case.id.split('-')[0]}.pickle")
    sink.write(
        "measured",
        how="plain training loop, " + ("after the preceding case(s)" if case.preceded_by else "fresh process"),
        **row,
        **extra,
        env=env,
        seconds=round(time.perf_counter() - t0, 1),
    )


def _write_snapshot(snap: Any, path: Path) -> dict[str, Any]:
    data = pickle.dumps(snap)
    info: dict[str, Any] = {"pickle_bytes": len(data), "events": len(snap["device_traces"][0])}
    if len(data) > MAX_FILE_BYTES:
        data = lzma.compress(data, preset=6)
        path = path.with_suffix(".pickle.xz")
        info["xz_bytes"] = len(data)
    if len(data) > MAX_FILE_BYTES:
        info["written"] = None
        return info
    path.write_bytes(data)
    info["written"] = path.name
    return info


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _dist(case: Case, spec: Any, dev: _Dev, sink: Sink, out: Path, env: dict[str, Any], dry: bool) -> None:
    """World size 1 on a real process group: NCCL on the GPU (gloo for the dry run), wrapped as the trace
    wraps (trainfit.trace.distributed ``_wrap_fsdp`` / ``_wrap_ddp``: per decoder layer then the root; DDP
    with the strategy's bucket_cap_mb and gradient_as_bucket_view)."""
    import torch.distributed as dist

    torch = dev.torch
    from trainfit.strategy import Sharding
    from trainfit.trace import hf

    st = strategy_of(case, dry)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(_free_port())
    if dev.cuda:
        torch.cuda.set_device(0)
    before = dev.stats()
    dist.init_process_group("nccl" if dev.cuda else "gloo", rank=0, world_size=1)
    model = run_model = None
    try:
        t0 = time.perf_counter()
        model = build_model(spec, st, dev)
        if st.sharding is Sharding.FSDP:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            if st.recipe.mixed:
                raise RuntimeError("this check runs pure recipes only (FSDP2 mixed precision not prepared)")
            mesh = init_device_mesh(dev.name, (1,))
            _, stack = hf.find_stack(model, spec.num_layers)
            raf = st.engine.reshard_after_forward
            for layer in stack:
                fully_shard(layer, mesh=mesh, mp_policy=MixedPrecisionPolicy(), reshard_after_forward=raf)
            fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(), reshard_after_forward=raf)
            run_model = model
            how = f"FSDP2 fully_shard per layer + root, reshard_after_forward={raf}"
        else:
            from torch.nn.parallel import DistributedDataParallel

            eo = st.engine
            run_model = DistributedDataParallel(
                model, bucket_cap_mb=eo.bucket_cap_mb, gradient_as_bucket_view=eo.gradient_as_bucket_view
            )
            how = f"DDP bucket_cap_mb={eo.bucket_cap_mb}, gradient_as_bucket_view={eo.gradient_as_bucket_view}"
        row = train_loop(spec, st, run_model, dev, pause_s=case.pause_s)
        if case.pause_s:
            how += f", {case.pause_s:g} s pause after each optimizer step"
        sink.write(
            "measured",
            how=how + ", world size 1, fresh process",
            **row,
            before_init=before,
            env=env,
            seconds=round(time.perf_counter() - t0, 1),
        )
    finally:
        # DDP's Reducer holds the process group: drop it while the group lives. Freed after
        # destroy_process_group, ~ProcessGroupGloo's thread join hung the dry run (seen in the test suite).
        del model, run_model
        gc.collect()
        dist.destroy_process_group()


def _lora(case: Case, spec: Any, dev: _Dev, sink: Sink, out: Path, env: dict[str, Any], dry: bool) -> None:
    """PEFT LoRA as the trace applies it (trainfit.trace.peft ``apply_finetuning``): LoraConfig with the
    adapter's rank, alpha, dropout and targets, fp32 adapters (``autocast_adapter_dtype``); the inner
    transformers model is trained."""
    try:
        import peft
    except ImportError:
        sink.write("skipped", reason="no peft")
        return
    st = strategy_of(case, dry)
    t0 = time.perf_counter()
    inner = wrap_peft(peft, build_model(spec, st, dev), st)
    row = train_loop(spec, st, inner, dev)
    how = "PEFT DoRA" if st.adapter.kind.value == "dora" else "PEFT LoRA"
    sink.write("measured", how=f"{how}, fresh process", **row, env=env, seconds=round(time.perf_counter() - t0, 1))


def wrap_peft(peft: Any, model: Any, st: Any) -> Any:
    """``get_peft_model`` as the trace applies it (trainfit.trace.peft ``apply_finetuning``): LoraConfig with the
    adapter's rank, alpha, dropout, targets and DoRA switch, fp32 adapters (``autocast_adapter_dtype``), after
    checkpointing is on when asked (the trace's model has it on before PEFT wraps it, so PeftModel's
    ``_prepare_model_for_gradient_checkpointing`` sees it); the inner transformers model, to be trained."""
    from trainfit.strategy import Checkpointing

    a = st.adapter
    if st.checkpointing is Checkpointing.FULL:
        enable_checkpointing(model)
    targets: Any = "all-linear" if a.targets == ("all-linear",) else list(a.targets)
    config = peft.LoraConfig(
        r=a.rank,
        lora_alpha=a.alpha,
        lora_dropout=a.dropout,
        target_modules=targets,
        bias="none",
        use_dora=a.kind.value == "dora",
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, config, autocast_adapter_dtype=a.dtype.value == "fp32").base_model.model


def _qlora(case: Case, spec: Any, dev: _Dev, sink: Sink, out: Path, env: dict[str, Any], dry: bool) -> None:
    """QLoRA as a user runs it: a checkpoint (random bf16 weights, saved to local disk) loaded by
    ``from_pretrained`` with ``BitsAndBytesConfig`` (4-bit, the strategy's quant type and double quantisation,
    bf16 compute) onto the GPU, ``prepare_model_for_kbit_training`` (fp32 for every tensor not in 4 bits; its own
    checkpointing off: :func:`wrap_peft` turns on the trace's when asked), then PEFT LoRA with fp32 adapters —
    what the trace applies (trainfit.trace.peft ``apply_finetuning``: ``Linear4bit`` layers, ``kbit_prepared``)."""
    import shutil
    import tempfile

    import peft
    import transformers

    from trainfit.trace import hf

    torch = dev.torch
    st = strategy_of(case, dry)
    bw = st.base_weights
    t0 = time.perf_counter()
    ckpt = Path(tempfile.mkdtemp(prefix="trainfit-qlora-"))
    try:
        model = build_model(spec, st, dev, dtype=torch.bfloat16)
        model.save_pretrained(ckpt)
        del model
        _free(dev)
        quant = transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=bw.quantization.value,
            bnb_4bit_use_double_quant=bw.double_quant,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
        with hf.quiet_transformers():
            model = hf.auto_class(spec).from_pretrained(
                ckpt, quantization_config=quant, device_map={"": 0 if dev.cuda else "cpu"}, attn_implementation="sdpa"
            )
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    row = train_loop(spec, st, wrap_peft(peft, model, st), dev)
    sink.write(
        "measured",
        how=f"QLoRA ({bw.quantization.value}, double quant {bw.double_quant}), from_pretrained, fresh process",
        **row,
        env=env,
        seconds=round(time.perf_counter() - t0, 1),
    )


def tied_probe(dev: _Dev, variant: str, *, vocab: int, hidden: int, tokens: int = 8) -> float | None:
    """``max_memory_allocated`` over ``backward()`` of a bare tied table, in tables (None on the CPU): an fp32
    ``vocab × hidden`` parameter read by ``F.embedding`` and then by ``F.linear`` — ``plain`` (the head reads the
    table: its gradient is a view, so torch/csrc/autograd/input_buffer.cpp ``accumulate`` adds out of place, about
    3 tables: the head's gradient, the embedding's, the sum), ``chunked`` (4 chunks: the first two chunk gradients'
    sum is out of place, about 3 too, then in place) or ``cast`` (behind a bf16 cast, as autocast: the cast's
    backward makes a fresh fp32 tensor, added into in place: about 1.5)."""
    torch = dev.torch
    import torch.nn.functional as F

    w = torch.nn.Parameter(torch.zeros(vocab, hidden, device=dev.name))
    ids = torch.randint(0, vocab, (1, tokens), device=dev.name)
    x = F.embedding(ids, w) * 1.0
    if variant == "plain":
        loss = F.linear(x, w).float().logsumexp(-1).sum()
    elif variant == "chunked":
        loss = sum(F.linear(c, w).float().logsumexp(-1).sum() for c in x.chunk(4, dim=1))
    else:
        loss = F.linear(x.bfloat16(), w.bfloat16()).float().logsumexp(-1).sum()
    dev.reset()
    before = torch.cuda.memory_allocated() if dev.cuda else 0
    loss.backward()
    peak = torch.cuda.max_memory_allocated() - before if dev.cuda else None
    del w, ids, x, loss
    _free(dev)
    return None if peak is None else round(peak / (vocab * hidden * 4), 4)


def _tied(case: Case, spec: Any, dev: _Dev, sink: Sink, out: Path, env: dict[str, Any], dry: bool) -> None:
    """The tied model's training step (per phase, as ``_train``), then the bare probe at its table's size."""
    from trainfit.analytic.states import tied_gradient_sum

    st = strategy_of(case, dry)
    t0 = time.perf_counter()
    row = train_loop(spec, st, build_model(spec, st, dev), dev)
    _free(dev)
    tied = tied_gradient_sum(spec, st)
    probe = {
        v: tied_probe(dev, v, vocab=spec.vocab_size, hidden=spec.hidden_size) for v in ("plain", "chunked", "cast")
    }
    sink.write(
        "measured",
        how="plain training loop, fresh process; probe: backward peak over the table's fp32 bytes",
        **row,
        probe=probe,
        analytic_out_of_place=bool(tied and tied.out_of_place_bytes),
        table_grad_bytes=tied.embedding_grad_bytes if tied else 0,
        env=env,
        seconds=round(time.perf_counter() - t0, 1),
    )


def _generate(case: Case, spec: Any, dev: _Dev, sink: Sink, out: Path, env: dict[str, Any], dry: bool) -> None:
    """``generate`` as the trace runs it (trainfit.trace.generate): eval mode, ``use_cache``, greedy, all-ones
    mask, a static cache of max_cache_len = prompt + new tokens, no auto-compilation (transformers compiles the
    forward for a static cache on CUDA, ``_valid_auto_compile_criteria``; the trace is eager); EOS is switched
    off so every run makes the asked number of tokens. The peak counter is read and reset as each forward pass
    starts: prefill is the first pass and the logits work up to the second, decode every later pass."""
    torch = dev.torch
    from trainfit.strategy import Strategy

    b, p, n = gen_shape(case, dry)
    model = build_model(spec, Strategy(), dev, dtype=torch.bfloat16)
    model.eval()
    model.config.use_cache = True
    gc_ = model.generation_config
    gc_.eos_token_id = None
    gc_.pad_token_id = 0
    weights = dev.stats()
    for cache in case.caches:
        _free(dev)
        t0 = time.perf_counter()
        stretches: list[int] = []
        forward = model.forward

        @functools.wraps(forward)
        def marked(*args: Any, _fw: Any = forward, _st: list[int] = stretches, **kwargs: Any) -> Any:
            if dev.cuda:
                _st.append(torch.cuda.max_memory_allocated())
                torch.cuda.reset_peak_memory_stats()
            else:
                _st.append(0)
            return _fw(*args, **kwargs)

        model.forward = marked
        try:
            dev.reset()
            base = dev.stats()
            ids = torch.randint(0, spec.vocab_size, (b, p), device=dev.name)
            mask = torch.ones((b, p), dtype=torch.long, device=dev.name)
            extra: dict[str, Any] = {"max_cache_len": p + n} if cache == "static" else {}
            with torch.no_grad():
                res = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=n,
                    do_sample=False,
                    cache_implementation="static" if cache == "static" else None,
                    disable_compile=True,  # CUDA + a static cache would torch.compile the decode step
                    **extra,
                )
            dev.sync()
            last = torch.cuda.max_memory_allocated() if dev.cuda else 0
            new = int(res.shape[1] - p)
            del res, ids, mask
        finally:
            model.forward = forward
        # stretches[i]: the peak from pass i-1's start to pass i's start (i = 0: before the first pass).
        seg = [*stretches[1:], last]  # seg[j]: pass j and what follows it until pass j+1
        phases = {"prefill": max([stretches[0], seg[0]]), "decode": max(seg[1:], default=0)} if dev.cuda else {}
        sink.write(
            "measured",
            cache=cache,
            how="HF generate, greedy",
            batch=b,
            prompt=p,
            new_tokens=n,
            generated=new,
            passes=len(stretches),
            phases=phases,
            baseline=base,
            weights=weights,
            end=dev.stats(),
            env=env,
            seconds=round(time.perf_counter() - t0, 2),
        )


def _speed(case: Case, spec: Any, dev: _Dev, sink: Sink, out: Path, env: dict[str, Any], dry: bool) -> None:
    """Wall time of optimizer steps: 2 warm-up steps, then each step synchronised, no per-phase resets."""
    torch = dev.torch
    st = strategy_of(case, dry)
    model = build_model(spec, st, dev)
    _params, opt, scaler, make_batch, loss_of, autocast = prepare(spec, st, model, dev)
    batch = make_batch()
    times: list[float] = []
    for step in range(2 + (2 if dry else 6)):
        dev.sync()
        t0 = time.perf_counter()
        with autocast():
            loss = loss_of(model(**batch), batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        del loss
        dev.sync()
        if step >= 2:
            times.append(time.perf_counter() - t0)
    times.sort()
    median = times[len(times) // 2]
    sink.write(
        "measured",
        how="synchronised optimizer steps after 2 warm-up steps",
        step_seconds=median,
        all_step_seconds=[round(t, 5) for t in times],
        tokens_per_second=st.micro_batch * st.seq_len / median,
        peak_allocated=torch.cuda.max_memory_allocated() if dev.cuda else None,
        env=env,
    )


# -- comparison and summary (parent, torch-free) ------------------------------------------------------------


def compare(case: Case, rows: list[dict[str, Any]], out: Path) -> list[dict[str, Any]]:
    """Comparison records from a case's predicted and measured rows."""
    pred = {(r.get("cache"), r.get("method")): r for r in rows if r["record"] == "predicted"}
    meas = [r for r in rows if r["record"] == "measured"]
    cmp: list[dict[str, Any]] = []
    for m in meas:
        if case.kind == "speed":
            p = pred.get((None, "speed-model"), {})
            cmp.append(
                {
                    "measured_step_seconds": m["step_seconds"],
                    "predicted_step_seconds": p.get("step_seconds"),
                    "rel_error": rel(p.get("step_seconds"), m["step_seconds"]),
                }
            )
            continue
        cache = m.get("cache")
        phases = m.get("phases") or {}
        c: dict[str, Any] = {"cache": cache} if cache else {}
        if m.get("how"):
            c["how"] = m["how"]
        c["measured"] = phases
        for method in ("analytic", "trace"):
            p = pred.get((cache, method))
            if p is None:
                continue
            c[method] = p["phases"]
            c[f"{method}_rel_error"] = {ph: rel(p["phases"].get(ph), v) for ph, v in phases.items()}
            if "reserved_estimate_bytes" in p and m.get("max_reserved"):
                c[f"{method}_reserved"] = {
                    "measured_max_reserved": m["max_reserved"],
                    "reserved_estimate_bytes": p["reserved_estimate_bytes"],
                    "rel_error": rel(p["reserved_estimate_bytes"], m["max_reserved"]),
                    "measured_device_used": m.get("device_used_end"),
                    "nvidia_smi_estimate_bytes": p["nvidia_smi_estimate_bytes"],
                    "device_used_rel_error": rel(p["nvidia_smi_estimate_bytes"], m.get("device_used_end")),
                }
                if "reserved_as_measured_bytes" in p:
                    c[f"{method}_reserved"]["as_measured_bytes"] = p["reserved_as_measured_bytes"]
                    c[f"{method}_reserved"]["as_measured_rel_error"] = rel(
                        p["reserved_as_measured_bytes"], m["max_reserved"]
                    )
        if m.get("probe") is not None:
            c["probe"] = m["probe"]
            c["analytic_out_of_place"] = m.get("analytic_out_of_place")
            c["table_grad_bytes"] = m.get("table_grad_bytes")
        trace_in_measure = (m.get("details") or {}).get("trace")
        if trace_in_measure:
            c["own_trace"] = trace_in_measure  # the trace measure_spec ran beside the measurement
            c["own_trace_rel_error"] = {ph: rel(v, phases.get(ph)) for ph, v in trace_in_measure.items()}
        cmp.append(c)
    if case.snapshot:
        cmp.extend(_replay(out, case.id.split("-")[0]))
    return cmp


def _replay(out: Path, tag: str) -> list[dict[str, Any]]:
    """A case's allocator trace through trainfit's simulator: simulated against real reserved."""
    from trainfit.allocator import replay_snapshot

    for name in (f"snapshot_{tag}.pickle", f"snapshot_{tag}.pickle.xz"):
        path = out / name
        if path.exists():
            raw = path.read_bytes()
            snap = pickle.loads(lzma.decompress(raw) if name.endswith(".xz") else raw)  # our own file
            r = replay_snapshot(snap)
            return [
                {
                    "how": "allocator snapshot replayed through trainfit.allocator.replay_snapshot",
                    "file": name,
                    "simulated_peak_reserved": r.simulated.peak_reserved_bytes,
                    "real_peak_reserved": r.real_peak_reserved_bytes,
                    "rel_error": round(r.peak_reserved_error, 5),
                    "address_matches": r.address_matches,
                    "alloc_events": r.alloc_events,
                }
            ]
    return []


def _gib(n: Any) -> str:
    return f"{n / 2**30:.2f}" if isinstance(n, int | float) and n else "—"


def _pct(x: Any) -> str:
    return f"{x:+.1%}" if isinstance(x, float) else "—"


def summary(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    env = next((r["env"] for r in rows if isinstance(r.get("env"), dict) and r["env"].get("device")), None)
    out = ["# GPU session", "", "```", json.dumps(meta), json.dumps(env) if env else "(no device seen)", "```", ""]
    out.append("Errors are predicted / measured − 1; every record, with the raw per-step numbers, is in session.jsonl.")
    out.append("")
    for name, issue, _ in SECTIONS:
        sec = [r for r in rows if r.get("section") == name]
        if not sec:
            continue
        out += [f"## {name} (issue {issue})", ""]
        out += ["| case | what | phase | measured GiB | analytic GiB | trace GiB | analytic err | trace err |"]
        out += ["|---|---|---|---:|---:|---:|---:|---:|"]
        for r in sec:
            if r["record"] in ("error", "skipped"):
                what = r.get("error") or r.get("reason") or ""
                extra = " ".join(str(r.get(k)) for k in ("method", "cache") if r.get(k))
                out.append(f"| {r['case']} | {r['record']} {extra}: {str(what)[:160]} | | | | | | |")
            if r["record"] != "comparison":
                continue
            if "measured_step_seconds" in r:
                out.append(
                    f"| {r['case']} | step seconds | — | {r['measured_step_seconds']:.4g} s | "
                    f"{r.get('predicted_step_seconds') or 0:.4g} s (speed model) | | {_pct(r.get('rel_error'))} | |"
                )
                continue
            if "simulated_peak_reserved" in r:
                out.append(
                    f"| {r['case']} | snapshot replay: reserved | — | {_gib(r['real_peak_reserved'])} | "
                    f"{_gib(r['simulated_peak_reserved'])} (simulated) | | {_pct(r['rel_error'])} | |"
                )
                continue
            what = r.get("cache") or r.get("how", "")
            measured = r.get("measured") or {}
            for ph in measured or r.get("analytic") or r.get("trace") or {}:  # dry-run: predictions only
                v = measured.get(ph)
                a, t = (r.get("analytic") or {}).get(ph), (r.get("trace") or {}).get(ph)
                ae, te = (r.get("analytic_rel_error") or {}).get(ph), (r.get("trace_rel_error") or {}).get(ph)
                out.append(
                    f"| {r['case']} | {what} | {ph} | {_gib(v)} | {_gib(a)} | {_gib(t)} | {_pct(ae)} | {_pct(te)} |"
                )
            if r.get("probe"):
                probe = ", ".join(f"{k} {v}" for k, v in r["probe"].items())
                out.append(
                    f"| {r['case']} | probe, tables over backward ({probe}); the analytic adds "
                    f"{'out of place' if r.get('analytic_out_of_place') else 'in place'} | | | | | | |"
                )
            res, tres = r.get("analytic_reserved"), r.get("trace_reserved") or {}
            if res:
                out.append(
                    f"| {r['case']} | max_memory_reserved | — | {_gib(res['measured_max_reserved'])} | "
                    f"{_gib(res['reserved_estimate_bytes'])} | {_gib(tres.get('reserved_estimate_bytes'))} | "
                    f"{_pct(res['rel_error'])} | {_pct(tres.get('rel_error'))} |"
                )
                if "as_measured_bytes" in res:
                    out.append(
                        f"| {r['case']} | max_memory_reserved as measured (warm-up, built on the GPU) | — | "
                        f"{_gib(res['measured_max_reserved'])} | {_gib(res['as_measured_bytes'])} | "
                        f"{_gib(tres.get('as_measured_bytes'))} | {_pct(res['as_measured_rel_error'])} | "
                        f"{_pct(tres.get('as_measured_rel_error'))} |"
                    )
                out.append(
                    f"| {r['case']} | device used (nvidia-smi) | — | {_gib(res['measured_device_used'])} | "
                    f"{_gib(res['nvidia_smi_estimate_bytes'])} | | {_pct(res['device_used_rel_error'])} | |"
                )
        pyt = [r for r in sec if r.get("case") == "pytest-gpu" and r["record"] == "measured"]
        for r in pyt:
            out += ["", f"`{r['command']}` → exit {r['returncode']}: {r.get('tail', '').strip().splitlines()[-1:]}"]
        out.append("")
    return "\n".join(out) + "\n"


# -- orchestration -------------------------------------------------------------------------------------------


def child_main(case_id: str, role: str, out: Path, dry: bool) -> None:
    case = BY_ID[case_id]
    sink = Sink(out / SESSION, case)
    try:
        if role == "predict":
            predict(case, sink, dry)
        else:
            measure_case(case, sink, out, dry)
    except Exception as exc:
        traceback.print_exc()
        sink.write("error", role=role, error=f"{type(exc).__name__}: {exc}"[:600])


def _spawn(args: list[str], log: Any, *, hide_gpu: bool = False) -> subprocess.Popen[bytes]:
    """A child in its own session (so a timeout kills its whole group), run from the repository with src/
    on its path whatever this process's working directory. ``hide_gpu``: the prediction child sees no GPU, so
    it cannot create a CUDA context that the measuring child's ``mem_get_info`` would count."""
    env = dict(os.environ)
    if hide_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO, env=env)


def _wait(proc: subprocess.Popen[bytes], deadline: float) -> str | None:
    """Wait for ``proc`` until ``deadline``; kill its process group (it started it) when it runs over."""
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        return None if proc.returncode == 0 else f"exit status {proc.returncode}"
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "timeout: killed at the section's time limit"


def run_pytest(case: Case, sink: Sink, deadline: float, out: Path, dry: bool) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "tests/measure",
        "tests/train",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
    ]
    if dry:  # no GPU: the command and its paths, not a run (they would all skip)
        missing = [p for p in ("tests/measure", "tests/train") if not (REPO / p).is_dir()]
        sink.write("skipped", reason="dry-run: pytest not run", command=" ".join(cmd[1:]), missing=missing)
        return
    t0 = time.perf_counter()
    with (out / "pytest.txt").open("w") as fh:
        proc = _spawn(cmd, fh)
        err = _wait(proc, deadline)
    tail = (out / "pytest.txt").read_text(errors="replace")[-3000:]
    sink.write(
        "measured",
        command="pytest " + " ".join(cmd[3:]),
        returncode=proc.returncode,
        error=err,
        tail=tail,
        seconds=round(time.perf_counter() - t0, 1),
    )


def run_case(case: Case, deadline: float, out: Path, sink_path: Path, log: Any, dry: bool, inline: bool) -> None:
    main_sink = Sink(sink_path, case)
    if case.kind == "pytest":
        run_pytest(case, main_sink, deadline, out, dry)
        return
    roles = ("measure", "predict")
    errors: dict[str, str | None] = {}
    if inline:
        for role in roles:
            child_main(case.id, role, out, dry)
    else:
        procs = {}
        for role in roles:
            args = [sys.executable, str(Path(__file__).resolve()), "--child", case.id, "--role", role]
            args += ["--out", str(out)] + (["--dry-run"] if dry else [])
            procs[role] = _spawn(args, log, hide_gpu=role == "predict")
        for role, proc in procs.items():
            errors[role] = _wait(proc, deadline)
    # The children appended their records to session.jsonl as they went (one write per line).
    rows = [r for r in read_rows(sink_path) if r.get("case") == case.id]
    for role in roles:
        if errors.get(role):  # a timeout or a crash the child could not record itself
            rows.append(main_sink.write("error", role=role, error=errors[role]))
    try:
        for c in compare(case, rows, out):
            main_sink.write("comparison", **c)
    except Exception as exc:
        main_sink.write("error", role="compare", error=f"{type(exc).__name__}: {exc}"[:400])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, no CUDA numbers")
    ap.add_argument("--sections", default=",".join(s for s, _, _ in SECTIONS))
    ap.add_argument("--cases", default="", help="only these case ids (comma-separated; default: every case)")
    ap.add_argument("--inline", action="store_true", help="run cases in this process (tests; no time limits)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--role", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.child:
        child_main(a.child, a.role, a.out, a.dry_run)
        return 0
    wanted = a.sections.split(",")
    unknown = [s for s in wanted if s not in ISSUE]
    if unknown:
        print(f"unknown section(s) {unknown}; choose from {list(ISSUE)}", file=sys.stderr)
        return 2
    only = set(filter(None, a.cases.split(",")))
    if only - set(BY_ID):
        print(f"unknown case(s) {sorted(only - set(BY_ID))}; see CASES in {Path(__file__).name}", file=sys.stderr)
        return 2
    start = time.monotonic()
    end = start + a.budget
    sink_path = a.out / SESSION
    meta = {"budget_s": a.budget, "dry_run": a.dry_run, "sections": wanted, "python": sys.version.split()[0]}
    with sink_path.open("a") as fh:
        fh.write(json.dumps({"record": "meta", **meta}) + "\n")
    section_end = start
    chosen = sum(share for name, _, share in SECTIONS if name in wanted)  # the shares of the sections run
    with (a.out / "log.txt").open("a") as log:
        for name, _, share in SECTIONS:
            if name not in wanted:
                continue
            # A section's share of the budget (of the sections run), plus what earlier sections left unused.
            section_end = min(end, max(section_end, time.monotonic()) + share / chosen * a.budget)
            for case in (c for c in CASES if c.section == name and (not only or c.id in only)):
                left = section_end - time.monotonic()
                if left < 5 and not a.inline:
                    Sink(sink_path, case).write("skipped", reason=f"no time left in section {name}")
                    continue
                t0 = time.monotonic()
                print(f"[{time.monotonic() - start:6.1f}s] {case.id} ({left:.0f}s left in {name})", flush=True)
                log.write(f"\n===== {case.id}\n")
                log.flush()
                try:
                    run_case(case, section_end, a.out, sink_path, log, a.dry_run, a.inline)
                except Exception as exc:
                    traceback.print_exc()
                    Sink(sink_path, case).write("error", role="parent", error=f"{type(exc).__name__}: {exc}"[:400])
                rows = read_rows(sink_path)
                (a.out / "summary.md").write_text(summary([r for r in rows if r.get("case")], meta))
                print(f"         done in {time.monotonic() - t0:.1f}s", flush=True)
            section_end = max(section_end, time.monotonic())
    print((a.out / "summary.md").read_text() if (a.out / "summary.md").exists() else "(no summary)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
