"""Rendering of ``trainfit plan`` results: a ranked table, the top plan in two lines (a third says why where it keeps
FSDP2's layers unsharded after forward), or "nothing fits" with the closest plan and what it would need; and the JSON
for scripts (each plan's ``strategy.reshard_after_forward``, and ``--no-reshard-after-forward`` in its ``changes``
where it differs from the baseline).

JSON (``schema_version`` :data:`PLAN_SCHEMA_VERSION`, bumped only when a key changes meaning or goes; new keys
do not bump it): each plan's ``alloc_conf`` is the ``PYTORCH_CUDA_ALLOC_CONF`` its estimate simulated
(:attr:`trainfit.planner.rank.Plan.alloc_conf`: the search's ``--alloc-conf``, or that plus
``expandable_segments:True`` for a plan that fits only with it), ``null`` for PyTorch's default allocator. Under
``--objective cheapest`` the result carries ``price_per_gpu_hour`` and each plan its ``cost_per_step`` (GPUs × step
seconds / 3600 × price, what that objective ranks by; the table's "cost/step" column). Like ``trainfit estimate
--json``, the result records ``torch_version`` and ``cuda_version`` (the releases whose workspaces and CUDA context
every plan counts; the table's title says them too), the process ``history`` (``--build``, ``--warm-up``,
``--after``) and the search's ``notes``. Each plan has its ``host_peak_bytes`` (the estimate's host memory per node:
offloaded states and buffers, 0 without offload; the table's "host GiB/node" column, shown when any listed plan
offloads); with ``--host-memory-gib`` the result has ``host_memory_bytes`` and ``host_usable_bytes`` (what a plan's
host memory per node may reach) and ``host_rejected`` (setups that fit the GPU but not the host). ``baseline`` is the
run every plan's ``changes`` are relative to (the user's run flags, or the default: ``strategy_json`` as a plan's
``strategy``), and ``baseline_flags`` it as ``trainfit estimate`` flags beyond its defaults (the text's
"changes are from" note)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from trainfit.export.configs import ExportedRun, hf_trainer_lacks
from trainfit.planner.rank import Plan, PlanResult, baseline_flags
from trainfit.planner.space import Objective
from trainfit.report.json import history_json, strategy_json
from trainfit.strategy import Sharding
from trainfit.units import fmt_gib, gib

PLAN_SCHEMA_VERSION = 1


def _plan_json(p: Plan, price_per_gpu_hour: float | None = None) -> dict[str, Any]:
    sp = p.speed
    cost = {} if price_per_gpu_hour is None else {"cost_per_step": p.cost_per_step(price_per_gpu_hour)}
    return {
        "gpus": p.gpus,
        "strategy": strategy_json(p.strategy),
        "required_bytes": p.required_bytes,
        "usable_bytes": p.usable_bytes,
        "margin_bytes": p.margin_bytes,
        "host_peak_bytes": p.host_peak_bytes,  # per node (offload); 0: nothing on the host
        "fits": p.fits,
        "changes": list(p.changes),
        "alloc_conf": p.alloc_conf or None,  # the allocator the plan assumes; null: PyTorch's defaults
        "step_seconds": sp.step_seconds,
        "tokens_per_second": sp.tokens_per_second,
        "mfu": sp.mfu,
        "compute_seconds": sp.compute_seconds,
        "recompute_seconds": sp.recompute_seconds,
        "exposed_comm_seconds": sp.exposed_comm_seconds,
        "bubble_seconds": sp.bubble_seconds,
        "offload_seconds": sp.offload_seconds,
        "notes": list(hf_trainer_lacks(p.strategy)),  # savers the HF Trainer export cannot carry (torchtune's)
    } | cost


def export_check(result: PlanResult, gpu: str, headroom: float) -> dict[str, Any]:
    """The keyword arguments of :func:`trainfit.export.configs.export_plan` that estimate the run the exported files
    describe on the plan's own terms (GPU, headroom, releases, process) — ``trainfit plan --export`` and the web's
    export pass the same."""
    return {
        "gpu": gpu,
        "headroom": headroom,
        "torch_version": result.torch_version,
        "cuda_version": result.cuda_version,
        "history": None if result.history.fresh else result.history,
    }


def exported_run_json(run: ExportedRun) -> dict[str, Any]:
    """``--export --json``'s ``exported_run``: the files' checkpointing where it is not the plan's, and its estimate."""
    return {
        "checkpointing": run.checkpointing.value,
        "plan_checkpointing": run.plan_checkpointing.value,
        "required_bytes": run.required_bytes,
        "usable_bytes": run.usable_bytes,
        "fits": run.fits,
        "note": run.note(),
    }


def _cheapest(result: PlanResult) -> bool:
    return result.objective is Objective.CHEAPEST


def plan_json(result: PlanResult) -> dict[str, Any]:
    return {
        "schema_version": PLAN_SCHEMA_VERSION,
        "objective": result.objective.value,
        "global_batch": result.global_batch,
        "seq_len": result.seq_len,
        "candidates": result.candidates,
        "estimates": result.estimates,
        # --objective cheapest: each plan's cost per optimizer step at --price-per-gpu-hour (what it ranks by)
        **({"price_per_gpu_hour": result.price_per_gpu_hour} if _cheapest(result) else {}),
        "plans": [_plan_json(p, result.price_per_gpu_hour if _cheapest(result) else None) for p in result.plans],
        "closest": _plan_json(result.closest) if result.closest is not None else None,
        "needs": list(result.needs),
        # what every plan's estimate counted, as `trainfit estimate --json` records them
        "torch_version": _release(result.torch_version),  # the release whose cuBLAS workspaces are counted
        "cuda_version": _release(result.cuda_version),  # the release whose CUDA context is counted
        "history": history_json(result.history),  # the process each plan starts in (one GPU)
        "notes": list(result.notes),
        # what every plan's "changes" are relative to: the user's run flags, or the planner's default
        **(
            {"baseline": strategy_json(result.baseline), "baseline_flags": list(baseline_flags(result.baseline))}
            if result.baseline is not None
            else {}
        ),
        **(
            {
                "host_memory_bytes": result.host_memory_bytes,
                "host_usable_bytes": result.host_usable_bytes,
                "host_rejected": result.host_rejected,
            }
            if result.host_memory_bytes is not None
            else {}
        ),
    }


def baseline_line(result: PlanResult) -> str:
    """The text's note on what the "changes" column is relative to."""
    if result.baseline is None:
        return "changes are from trainfit estimate's defaults"
    flags = " ".join(baseline_flags(result.baseline)) or "trainfit estimate's defaults"
    return f"changes are from the baseline: {flags} (--seq {result.baseline.seq_len})"


def _release(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def explain_top(p: Plan) -> str:
    """The top plan in two lines (three when it keeps FSDP2's layers unsharded after forward: why)."""
    sp = p.speed
    what = ", ".join(p.changes) if p.changes else "the baseline as given"
    s = p.strategy
    why = ""
    if s.sharding in (Sharding.FSDP, Sharding.HSDP) and not s.engine.reshard_after_forward:
        why = (
            "\nno reshard after forward: FSDP2 keeps each layer unsharded from its forward to its backward — one "
            "all-gather per layer and micro-step instead of two, for more memory."
        )
    return (
        f"{p.gpus} GPU(s): {what}.\n"
        f"peak {fmt_gib(p.required_bytes)} of {fmt_gib(p.usable_bytes)} usable; "
        f"{sp.step_seconds:.2f} s/step, {sp.tokens_per_second:,.0f} tokens/s, MFU {sp.mfu:.0%} (speed model)." + why
    )


def render_plan(console: Console, result: PlanResult) -> None:
    """The ranked table and the top plan in two lines, or "nothing fits" with the closest plan and its needs."""
    if not result.plans:
        console.print("[bold red]nothing fits[/bold red] within the usable memory.")
        if result.closest is not None:
            console.print("closest: " + explain_top(result.closest))
        for need in result.needs:
            console.print(f"  would fit with {need}")
        return
    table = Table(
        title=f"plans ({result.objective.value}; {result.candidates} candidates, {result.estimates} estimates; "
        f"torch {_release(result.torch_version)}, CUDA {_release(result.cuda_version)})"
    )
    cost = ("cost/step",) if _cheapest(result) else ()
    host = ("host GiB/node",) if any(p.host_peak_bytes for p in result.plans) else ()
    cols = ("#", "GPUs", "peak/GPU", "margin", *host, "step s", "tokens/s", "MFU", *cost, "changes from the baseline")
    for col in cols:
        table.add_column(col, justify="left" if col.startswith("changes") else "right")
    for i, p in enumerate(result.plans, 1):
        costs = (f"{p.cost_per_step(result.price_per_gpu_hour):.4g}",) if cost else ()
        table.add_row(
            str(i),
            str(p.gpus),
            fmt_gib(p.required_bytes),
            fmt_gib(p.margin_bytes),
            *((f"{gib(p.host_peak_bytes):,.1f}",) if host else ()),
            f"{p.speed.step_seconds:.2f}",
            f"{p.speed.tokens_per_second:,.0f}",
            f"{p.speed.mfu:.0%}",
            *costs,
            ", ".join(p.changes) or "(baseline)",
        )
    for column in table.columns:  # never cut a cell: the table at its natural width (as cli.common.print_table)
        column.no_wrap = True
    natural = Measurement.get(console, console.options.update_width(100_000), table).maximum
    if natural > console.width:
        console = Console(soft_wrap=False, width=natural)
    console.print(table)
    console.print(explain_top(result.plans[0]))
