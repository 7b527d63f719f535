"""Which precision recipe to train with on a given accelerator, and why — torch-free.

The decision path is the article's (§2.3 and §5.1): check the hardware first; where bf16 is *native*
use bf16 autocast and no loss scaling; where it is not, use fp16 autocast with dynamic loss scaling
(GradScaler); on a machine without a GPU, train in fp32. Two corrections to the article are built in:

* ``torch.cuda.is_bf16_supported()`` — the check the article recommends — defaults to
  ``including_emulation=True`` and returns True on a T4 or V100, where bf16 runs emulated and slowly
  (DESIGN.md §4). "Native" here means compute capability >= 8.0 on NVIDIA (the Ampere tensor cores that
  added bf16), which is what ``is_bf16_supported(including_emulation=False)`` tests.
* The article's template imports the deprecated ``torch.cuda.amp``; the snippets here use ``torch.amp``
  and put ``unscale_`` before clipping (article §6.4) and divide the loss by the accumulation steps.

FP8 (compute capability >= 8.9) and TF32 (>= 8.0) are reported as notes, never as the default: FP8
training needs per-tensor scaling libraries (Transformer Engine, torchao.float8) and TF32 only changes
how fp32 matmuls run. Sources: NVIDIA CUDA C Programming Guide, "Compute Capabilities" (bf16 tensor cores
from 8.0, FP8 from 8.9); PyTorch AMP docs (torch.amp.autocast, GradScaler, "Working with Unscaled
Gradients"); the article §2.3, §3.1, §5.1, §6.4.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from trainfit.hardware.gpus import GPUSpec
from trainfit.strategy import Precision


class AcceleratorKind(StrEnum):
    CUDA = "cuda"
    ROCM = "rocm"
    CPU = "cpu"


class AcceleratorSource(StrEnum):
    DETECTED = "detected"
    CATALOG = "catalog"


#: (major, minor) from which NVIDIA tensor cores run bf16 natively — CUDA Programming Guide (Ampere, sm_80).
NATIVE_BF16_CC = (8, 0)
#: (major, minor) from which NVIDIA tensor cores run FP8 (E4M3/E5M2) — Ada sm_89 and Hopper sm_90.
FP8_CC = (8, 9)
#: TF32 tensor-core matmuls arrived with Ampere — NVIDIA A100 whitepaper.
TF32_CC = (8, 0)


def parse_compute_capability(cc: str) -> tuple[int, int]:
    """'8.6' → (8, 6)."""
    major, _, minor = cc.partition(".")
    return int(major), int(minor or 0)


def native_bf16_from_cc(cc: str) -> bool:
    """Native bf16 iff compute capability >= 8.0 (not what ``is_bf16_supported()`` says by default)."""
    return parse_compute_capability(cc) >= NATIVE_BF16_CC


def fp8_from_cc(cc: str) -> bool:
    """FP8 tensor cores iff compute capability >= 8.9."""
    return parse_compute_capability(cc) >= FP8_CC


def tf32_from_cc(cc: str) -> bool:
    return parse_compute_capability(cc) >= TF32_CC


@dataclass(frozen=True, slots=True, kw_only=True)
class Accelerator:
    """What the precision decision needs to know about a device (detected locally or from the catalog)."""

    kind: AcceleratorKind
    name: str
    source: AcceleratorSource
    memory_bytes: int | None = None
    compute_capability: str | None = None
    native_bf16: bool = False
    fp8: bool = False
    tf32: bool = False
    count: int = 1
    catalog_id: str | None = None
    #: what ``torch.cuda.is_bf16_supported()`` (emulation included) returned, when detected with torch
    bf16_supported_with_emulation: bool | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "kind": self.kind.value,
            "name": self.name,
            "source": self.source.value,
            "memory_bytes": self.memory_bytes,
            "compute_capability": self.compute_capability,
            "native_bf16": self.native_bf16,
            "fp8": self.fp8,
            "tf32": self.tf32,
            "count": self.count,
            "catalog_id": self.catalog_id,
            "bf16_supported_with_emulation": self.bf16_supported_with_emulation,
        }


def accelerator_from_spec(spec: GPUSpec) -> Accelerator:
    """A catalog GPU as an :class:`Accelerator`. NVIDIA capabilities come from the compute capability
    (tests check they agree with the catalog's flags); AMD parts use the catalog's flags."""
    kind = AcceleratorKind.CUDA if spec.vendor.lower() == "nvidia" else AcceleratorKind.ROCM
    cc = spec.compute_capability
    return Accelerator(
        kind=kind,
        name=spec.name,
        source=AcceleratorSource.CATALOG,
        memory_bytes=spec.memory_bytes,
        compute_capability=cc,
        native_bf16=native_bf16_from_cc(cc) if cc else spec.bf16,
        fp8=fp8_from_cc(cc) if cc else spec.fp8,
        tf32=tf32_from_cc(cc) if cc else spec.tf32,
        catalog_id=spec.id,
        bf16_supported_with_emulation=True if kind is AcceleratorKind.CUDA else None,
    )


def cpu_accelerator(name: str = "CPU (no GPU found)") -> Accelerator:
    return Accelerator(kind=AcceleratorKind.CPU, name=name, source=AcceleratorSource.DETECTED)


@dataclass(frozen=True, slots=True, kw_only=True)
class PrecisionAdvice:
    """A recommended recipe with the reasons for it and a correct training-loop snippet."""

    accelerator: Accelerator
    precision: Precision
    compute_format: str  # format id in trainfit.precision.formats: 'bf16', 'fp16' or 'fp32'
    loss_scaling: bool
    reasons: tuple[str, ...]
    notes: tuple[str, ...]
    snippet: str

    def to_json(self) -> dict[str, object]:
        return {
            "accelerator": self.accelerator.to_json(),
            "precision": self.precision.value,
            "compute_format": self.compute_format,
            "loss_scaling": self.loss_scaling,
            "reasons": list(self.reasons),
            "notes": list(self.notes),
            "snippet": self.snippet,
        }


def recommend(acc: Accelerator) -> PrecisionAdvice:
    """The article's decision path (§2.3, §5.1): native bf16 → amp-bf16; a GPU without it → amp-fp16 with
    dynamic loss scaling; no GPU → fp32."""
    reasons: list[str] = []
    notes: list[str] = []
    where = f"{acc.name}" + (f" (compute capability {acc.compute_capability})" if acc.compute_capability else "")
    if acc.kind is AcceleratorKind.CPU:
        precision, fmt, scaling = Precision.FP32, "fp32", False
        reasons.append("No CUDA/ROCm accelerator: mixed precision exists to use GPU tensor cores, so train in fp32.")
        reasons.append(
            "CPU autocast (bf16) only pays off on CPUs with AMX/AVX512-BF16 and follows a different op "
            "policy from CUDA; it is not the article's path."
        )
    elif acc.native_bf16:
        precision, fmt, scaling = Precision.AMP_BF16, "bf16", False
        units = "tensor cores" if acc.kind is AcceleratorKind.CUDA else "matrix cores (AMD CDNA)"
        reasons.append(f"{where} runs bf16 natively on its {units}.")
        reasons.append(
            "bf16 has fp32's 8 exponent bits, so gradients neither overflow nor underflow in practice: "
            "no loss scaling to tune (article §2.2, §2.3)."
        )
        reasons.append("Weights stay fp32 under autocast, so the optimizer updates full-precision masters.")
    else:
        precision, fmt, scaling = Precision.AMP_FP16, "fp16", True
        if acc.kind is AcceleratorKind.CUDA:
            reasons.append(f"{where} has no native bf16 (needs compute capability >= 8.0); fp16 tensor cores exist.")
        else:
            reasons.append(f"{where} has no native bf16; it runs fp16 natively.")
        reasons.append(
            "fp16 has 5 exponent bits (max 65504, min normal 6.1e-5): small gradients flush to zero, so use "
            "dynamic loss scaling with torch.amp.GradScaler (article §2.2, §3.3)."
        )
        reasons.append(
            "Unscale before clipping: scaler.unscale_(optimizer), then clip_grad_norm_(..., 1.0), then "
            "scaler.step and scaler.update (article §6.4)."
        )
        if acc.kind is AcceleratorKind.CUDA and acc.bf16_supported_with_emulation:
            notes.append(
                "torch.cuda.is_bf16_supported() returns True on this GPU because it counts emulation; "
                "bf16 would run, but without tensor-core speed. "
                "Check is_bf16_supported(including_emulation=False)."
            )
    if acc.kind is not AcceleratorKind.CPU:
        if acc.tf32:
            notes.append(
                "TF32 is available: torch.set_float32_matmul_precision('high') speeds up any fp32 "
                "matmuls left outside autocast (10-bit mantissa inside the tensor core, fp32 range)."
            )
        if acc.fp8:
            notes.append(
                "FP8 tensor cores are present (compute capability >= 8.9): FP8 training (E4M3 forward, E5M2 "
                "gradients) is possible with Transformer Engine or torchao.float8, but needs per-tensor "
                "scaling; start with bf16 and move to FP8 only for throughput."
            )
        notes.append(
            "If the loss goes NaN, troubleshoot in this order: precision (compare with fp32), learning "
            "rate (halve it), gradient clipping (1.0), then the data (article §5.3) — `trainfit doctor` "
            "automates it."
        )
    return PrecisionAdvice(
        accelerator=acc,
        precision=precision,
        compute_format=fmt,
        loss_scaling=scaling,
        reasons=tuple(reasons),
        notes=tuple(notes),
        snippet=training_loop_snippet(precision, device="cpu" if acc.kind is AcceleratorKind.CPU else "cuda"),
    )


def training_loop_snippet(precision: Precision | str, *, device: str = "cuda") -> str:
    """A correct plain-PyTorch loop for ``precision``: torch.amp (not torch.cuda.amp), loss divided by the
    accumulation steps, and for fp16 unscale_ → clip → step → update — PyTorch AMP examples, "Gradient
    accumulation" and "Working with Unscaled Gradients"."""
    p = Precision(precision)
    dtype = {Precision.AMP_BF16: "torch.bfloat16", Precision.AMP_FP16: "torch.float16"}.get(p)
    lines = ["import torch", ""]
    if p is Precision.AMP_FP16:
        lines.append(f'scaler = torch.amp.GradScaler("{device}")  # dynamic loss scale')
    lines += ["accum = 4  # micro-batches per optimizer step", "for i, batch in enumerate(loader):"]
    if dtype:
        lines.append(f'    with torch.autocast("{device}", dtype={dtype}):')
        lines.append("        loss = loss_fn(model, batch) / accum")
    else:
        lines.append("    loss = loss_fn(model, batch) / accum")
    lines.append("    " + ("scaler.scale(loss).backward()" if p is Precision.AMP_FP16 else "loss.backward()"))
    lines.append("    if (i + 1) % accum == 0:")
    if p is Precision.AMP_FP16:
        lines.append("        scaler.unscale_(optimizer)  # clip true, not scaled, gradients")
    lines.append("        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)")
    if p is Precision.AMP_FP16:
        lines.append("        scaler.step(optimizer)  # skipped on inf/NaN gradients")
        lines.append("        scaler.update()  # x0.5 on overflow, x2 after 2000 clean steps")
    else:
        lines.append("        optimizer.step()")
    lines.append("        optimizer.zero_grad(set_to_none=True)")
    lines += [
        "",
        "# or, equivalently, with trainfit:",
        "# from trainfit.train import TrainStep",
        f'# step = TrainStep(model, optimizer, precision="{p.value}",',
        "#                  grad_accum=4, max_grad_norm=1.0)",
        "# for batch in loader:",
        "#     step(loss_fn, model, batch)",
    ]
    return "\n".join(lines)
