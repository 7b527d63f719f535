"""``trainfit infer``: parse, call :func:`trainfit.infer.infer`, render. No arithmetic here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from trainfit.errors import StrategyError

if TYPE_CHECKING:
    from trainfit.analytic.inference import InferenceSetup
    from trainfit.arch import ModelSpec

#: The flags of ``trainfit infer`` that describe the generation (the :class:`InferenceSetup`):
#: :func:`setup_from_flags` takes exactly these, so the CLI and the web page build one thing the same way.
SETUP_FLAGS: tuple[str, ...] = (
    "batch", "prompt", "new_tokens", "dtype", "kv_dtype", "double_quant", "compute_dtype", "cache", "block_size",
    "attention", "padded", "gpus", "tp",
)  # fmt: skip


def setup_from_flags(spec: ModelSpec, **flags: Any) -> InferenceSetup:
    """The :class:`InferenceSetup` from the values of :data:`SETUP_FLAGS` (each as ``trainfit infer`` declares it,
    defaults included): ``--prompt`` None takes :func:`trainfit.infer.default_prompt`, the TP degree is ``--tp``,
    else ``--gpus``, else 1; bad values raise a one-line error."""
    from trainfit.analytic.inference import InferenceSetup
    from trainfit.infer import default_prompt

    if set(flags) != set(SETUP_FLAGS):
        raise TypeError(f"setup_from_flags needs exactly {SETUP_FLAGS}; got {sorted(flags)}")
    f = flags
    degree = f["tp"] if f["tp"] is not None else (f["gpus"] if f["gpus"] is not None else 1)
    return InferenceSetup(
        batch=f["batch"],
        prompt=f["prompt"] if f["prompt"] is not None else default_prompt(spec, f["new_tokens"]),
        new_tokens=f["new_tokens"],
        dtype=f["dtype"],  # coerced and validated by InferenceSetup
        kv_dtype=f["kv_dtype"],
        cache=f["cache"],
        block_size=f["block_size"],
        attention=f["attention"],
        tp=degree,
        double_quant=f["double_quant"],
        compute_dtype=f["compute_dtype"],
        padded=f["padded"],
    )


def infer_cmd(
    model: Annotated[str, typer.Argument(help="Catalog slug, config.json (file or folder), or Hub repo id.")],
    batch: Annotated[int, typer.Option("--batch", "-b", help="Sequences decoded together.")] = 1,
    prompt: Annotated[
        int | None,
        typer.Option(
            "--prompt",
            "-p",
            help="Prompt tokens per sequence (default 2048, or what the model's context leaves after --new-tokens "
            "when shorter: GPT-2 768).",
        ),
    ] = None,
    new_tokens: Annotated[int, typer.Option("--new-tokens", "-n", help="Tokens generated per sequence.")] = 256,
    dtype: Annotated[str, typer.Option(help="Weights: fp32 | bf16 | fp16 | fp8 | int8 | nf4 | fp4")] = "bf16",
    kv_dtype: Annotated[
        str | None, typer.Option("--kv-dtype", help="KV cache: fp32 | bf16 | fp16 | fp8 (default: compute dtype)")
    ] = None,
    double_quant: Annotated[
        bool, typer.Option("--double-quant/--no-double-quant", help="nf4/fp4: quantise the absmax constants.")
    ] = True,
    compute_dtype: Annotated[
        str | None,
        typer.Option(
            "--compute-dtype",
            help="nf4/fp4: bnb_4bit_compute_dtype, bf16 | fp16 | fp32 (default bf16; transformers' default: fp32).",
        ),
    ] = None,
    cache: Annotated[str, typer.Option(help="dynamic | static | sliding | paged")] = "dynamic",
    block_size: Annotated[int, typer.Option("--block-size", help="Tokens per paged KV block.")] = 16,
    attention: Annotated[str, typer.Option(help="sdpa | eager")] = "sdpa",
    padded: Annotated[
        bool,
        typer.Option(
            "--padded/--no-padded",
            help="Prompts of unequal length, left-padded: generate keeps the 2-D mask, models build 4-D ones.",
        ),
    ] = False,
    gpu: Annotated[str | None, typer.Option("--gpu", help="Catalog GPU id: fit verdict and capacities.")] = None,
    gpus: Annotated[int | None, typer.Option("--gpus", help="GPUs in all (default: --tp).")] = None,
    tp: Annotated[int | None, typer.Option("--tp", help="Tensor-parallel degree (default: --gpus, else 1).")] = None,
    max_batch: Annotated[
        bool,
        typer.Option("--max-batch", help="Show the capacity search: largest batch, longest context (needs --gpu)."),
    ] = False,
    server: Annotated[str, typer.Option(help="generate (Hugging Face) | paged (a vLLM-style server)")] = "generate",
    gpu_memory_utilization: Annotated[
        float, typer.Option("--gpu-memory-utilization", help="Paged server: fraction of GPU memory it may take.")
    ] = 0.9,
    headroom: Annotated[float, typer.Option(help="generate: fraction of GPU memory kept free.")] = 0.10,
    simulate_allocator: Annotated[
        bool,
        typer.Option(
            "--simulate-allocator",
            help="Allocator reserve from simulating the caching allocator over generate's allocations "
            "(0.5–2 s; default: a 10% reserve).",
        ),
    ] = False,
    alloc_conf: Annotated[
        str | None,
        typer.Option("--alloc-conf", help="PYTORCH_CUDA_ALLOC_CONF to simulate (implies --simulate-allocator)."),
    ] = None,
    method: Annotated[str, typer.Option(help="analytic | trace (Hugging Face generate on fake tensors)")] = "analytic",
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
    explain: Annotated[bool, typer.Option("--explain", "-v", help="Also show each term's formula and source.")] = False,
) -> None:
    """Estimate GPU memory for inference with MODEL: weights, KV cache, the prefill and decode peaks, and with
    --gpu whether it fits, the largest batch and the longest context; with --server paged, the KV blocks and
    concurrent tokens a vLLM-style server gets.

    Examples:

      trainfit infer llama-3.1-8b --batch 8 --prompt 2048 --new-tokens 256 --gpu l4

      trainfit infer mistral-7b-v0.1 --dtype nf4 --prompt 32000 --batch 1

      trainfit infer qwen2.5-72b --gpus 4 --tp 4 --gpu h100-sxm-80gb --max-batch

      trainfit infer llama-3.1-70b --server paged --gpu-memory-utilization 0.9 --gpu h200-sxm-141gb

      trainfit infer deepseek-v3 --dtype fp8 --kv-dtype fp8 --prompt 8192 --gpu h200-sxm-141gb --gpus 8
    """
    flags = dict(locals())  # before any comprehension: its own scope would have its own locals()
    from trainfit.arch import load_model
    from trainfit.cli.common import print_json, stdout_console, warn
    from trainfit.infer import infer
    from trainfit.report.infer import infer_json, render_infer

    if max_batch and gpu is None:
        raise StrategyError("--max-batch searches what fits on a GPU: give --gpu")
    spec = load_model(model)
    setup = setup_from_flags(spec, **{name: flags[name] for name in SETUP_FLAGS})
    report = infer(
        spec,
        setup,
        method=method,
        gpu=gpu,
        gpus=gpus,
        server=server,
        gpu_memory_utilization=gpu_memory_utilization,
        headroom=headroom,
        allocator=alloc_conf,
        simulate_allocator=simulate_allocator or alloc_conf is not None,
    )
    for w in report.warnings:
        warn(w)
    if json_out:
        print_json(infer_json(report))
        return
    render_infer(stdout_console(), report, verbose=explain, capacity=max_batch)


def register(app: typer.Typer) -> None:
    app.command("infer", no_args_is_help=True)(infer_cmd)
