"""Number formats used in training and inference, derived from their bit layouts.

Every limit here is computed from three integers (exponent bits, mantissa bits, encoding) by the
IEEE 754 rules, not typed in; tests cross-check the results against ``torch.finfo``, ``numpy.finfo``
and ``ml_dtypes.finfo`` where those exist, and :func:`quantize` against the libraries' casts. The
point of deriving them is that the same arithmetic then answers the questions users actually trip on
— why 65520 (not 65504) is where fp16 overflows, why Adam's ``eps=1e-8`` vanishes in fp16, why
``256 + 1 == 256`` in bf16 — and that the answers cannot drift from the table they are printed beside.

Two encodings cover every float format here:

* ``ieee``: the all-ones exponent is reserved for inf and NaN (fp32, tf32, fp16, bf16, fp8 E5M2).
* ``fn`` ("finite, NaN"): there is no inf; the all-ones exponent is an ordinary binade except that the
  all-ones mantissa there is NaN (OCP FP8 E4M3, ``torch.float8_e4m3fn``). This buys one more binade of
  range (max 448 instead of 240).

What happens to an out-of-range value when it is *cast* to ``fn`` is not fixed by the format: the OCP
spec allows saturation or NaN, and libraries differ (torch's CPU cast saturates to 448, ml_dtypes gives
NaN — DESIGN.md §4). :func:`quantize` therefore reports overflow as inf for ``ieee`` formats and NaN for
``fn`` formats and says so; it does not pretend one library is the oracle for another.

Sources: IEEE 754-2019 §3.3–3.4 (binary interchange formats, subnormals, round-to-nearest-even);
Micikevicius et al. 2022, "FP8 Formats for Deep Learning" (E4M3/E5M2 layouts, Table 1); OCP 8-bit
Floating Point Specification (OFP8) v1.0; NVIDIA A100 whitepaper (TF32: 8-bit exponent, 10-bit
mantissa, used inside tensor-core matmuls); Kalamkar et al. 2019, "A Study of BFLOAT16 for Deep
Learning Training".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from trainfit._suggest import did_you_mean
from trainfit.errors import TrainfitError


class UnknownFormatError(TrainfitError):
    """A number-format id is not one trainfit knows."""


class Encoding(StrEnum):
    IEEE = "ieee"  # all-ones exponent = inf/NaN
    FN = "fn"  # no inf; all-ones exponent with all-ones mantissa = NaN (OCP E4M3)


def json_float(x: float) -> float | str:
    """A float for JSON: finite values as numbers, inf/NaN as the strings 'inf', '-inf', 'nan'."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


@dataclass(frozen=True, slots=True, kw_only=True)
class FloatFormat:
    """A binary floating-point format: 1 sign bit, ``exponent_bits``, ``mantissa_bits`` (no hidden bit).

    All limits are properties computed from the layout by IEEE 754-2019 §3.3 rules.
    """

    id: str
    name: str
    exponent_bits: int
    mantissa_bits: int
    encoding: Encoding = Encoding.IEEE
    storage_bits: int | None = None  # bits a value occupies in memory, when that differs (tf32 lives in 32)
    torch_dtype: str | None = None  # attribute of ``torch`` naming the dtype, if torch has one
    ml_dtypes_name: str | None = None
    numpy_name: str | None = None
    used_for: str = ""
    hardware: str = ""

    def __post_init__(self) -> None:
        if self.exponent_bits < 2 or self.mantissa_bits < 1:
            raise ValueError(f"format {self.id}: needs >= 2 exponent bits and >= 1 mantissa bit")

    @property
    def bits(self) -> int:
        """Layout width: 1 + exponent + mantissa."""
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def memory_bits(self) -> int:
        return self.storage_bits if self.storage_bits is not None else self.bits

    @property
    def bias(self) -> int:
        """Exponent bias 2^(e-1) − 1 — IEEE 754-2019 §3.4 (also used by both OCP FP8 formats)."""
        return (1 << (self.exponent_bits - 1)) - 1

    @property
    def emax(self) -> int:
        """Largest unbiased exponent of a finite value: all-ones is reserved in ``ieee``, usable in ``fn``."""
        top = (1 << self.exponent_bits) - 1
        return (top - 1 if self.encoding is Encoding.IEEE else top) - self.bias

    @property
    def emin(self) -> int:
        """Smallest normal exponent 1 − bias (exponent field 0 encodes zero and subnormals)."""
        return 1 - self.bias

    @property
    def has_inf(self) -> bool:
        return self.encoding is Encoding.IEEE

    @property
    def max_finite(self) -> float:
        """(2 − 2^−m)·2^emax for ``ieee``; (2 − 2^(1−m))·2^emax for ``fn`` (top mantissa = NaN) — OFP8."""
        m = self.mantissa_bits
        top_mantissa = (1 << m) - 1 if self.encoding is Encoding.IEEE else (1 << m) - 2
        return math.ldexp((1 << m) + top_mantissa, self.emax - m)

    @property
    def min_normal(self) -> float:
        """2^emin."""
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float:
        """2^(emin − m): the quantum of the subnormal range — IEEE 754-2019 §3.4."""
        return math.ldexp(1.0, self.emin - self.mantissa_bits)

    @property
    def epsilon(self) -> float:
        """Machine epsilon 2^−m: the gap between 1 and the next representable value."""
        return math.ldexp(1.0, -self.mantissa_bits)

    @property
    def unit_roundoff(self) -> float:
        """Largest relative rounding error under round-to-nearest: ε/2 = 2^−(m+1)."""
        return math.ldexp(1.0, -self.mantissa_bits - 1)

    @property
    def decimal_digits(self) -> float:
        """Significant decimal digits p·log10(2) with p = m + 1 (hidden bit included)."""
        return (self.mantissa_bits + 1) * math.log10(2.0)

    @property
    def overflow_threshold(self) -> float:
        """max + ulp(max)/2: under round-to-nearest-even this is the tie between max and the next binade.

        Whether the tie itself overflows depends on the parity of max's last mantissa bit
        (:attr:`overflow_at_threshold`): fp16's max 65504 ends in 1, so 65520 rounds up to inf; E4M3's max
        448 ends in 0, so 464 rounds down to 448 and only values above 464 overflow.
        """
        return self.max_finite + math.ldexp(1.0, self.emax - self.mantissa_bits - 1)

    @property
    def overflow_at_threshold(self) -> bool:
        """True when the value exactly at :attr:`overflow_threshold` rounds up (max's mantissa is odd)."""
        return self.encoding is Encoding.IEEE

    @property
    def flush_threshold(self) -> float:
        """min_subnormal / 2: magnitudes at or below this round to zero (the tie goes to even, i.e. 0)."""
        return self.min_subnormal / 2

    @property
    def dynamic_range_binades(self) -> float:
        """log2(max_finite / min_subnormal): how many powers of two the format spans."""
        return math.log2(self.max_finite / self.min_subnormal)

    @property
    def overflow_value(self) -> float:
        """What an overflowing value becomes in our reference rounding: inf (``ieee``) or NaN (``fn``)."""
        return math.inf if self.has_inf else math.nan

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.id,
            "name": self.name,
            "bits": self.bits,
            "memory_bits": self.memory_bits,
            "sign_bits": 1,
            "exponent_bits": self.exponent_bits,
            "mantissa_bits": self.mantissa_bits,
            "bias": self.bias,
            "encoding": self.encoding.value,
            "emax": self.emax,
            "emin": self.emin,
            "has_inf": self.has_inf,
            "max_finite": self.max_finite,
            "min_normal": self.min_normal,
            "min_subnormal": self.min_subnormal,
            "epsilon": self.epsilon,
            "decimal_digits": round(self.decimal_digits, 3),
            "overflow_threshold": self.overflow_threshold,
            "overflow_at_threshold": self.overflow_at_threshold,
            "flush_threshold": self.flush_threshold,
            "dynamic_range_binades": round(self.dynamic_range_binades, 3),
            "torch_dtype": self.torch_dtype,
            "used_for": self.used_for,
            "hardware": self.hardware,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class IntegerFormat:
    """A two's-complement integer format used for quantisation (values are ``q·scale``)."""

    id: str
    name: str
    bits: int
    used_for: str = ""
    hardware: str = ""

    @property
    def min_value(self) -> int:
        """−2^(bits−1) (two's complement)."""
        return -(1 << (self.bits - 1))

    @property
    def max_value(self) -> int:
        """2^(bits−1) − 1."""
        return (1 << (self.bits - 1)) - 1

    @property
    def levels(self) -> int:
        return 1 << self.bits

    @property
    def symmetric_max(self) -> int:
        """Symmetric absmax quantisation uses [−(2^(b−1)−1), 2^(b−1)−1] so that 0 is exact and the range
        is symmetric — Dettmers et al. 2022, "LLM.int8()", §2."""
        return self.max_value

    def absmax_step(self, absmax: float) -> float:
        """Spacing of the grid a tensor with this absmax is quantised to: absmax/(2^(b−1)−1)."""
        return absmax / self.symmetric_max

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.id,
            "name": self.name,
            "bits": self.bits,
            "min_value": self.min_value,
            "max_value": self.max_value,
            "levels": self.levels,
            "used_for": self.used_for,
            "hardware": self.hardware,
        }


FP32 = FloatFormat(
    id="fp32", name="FP32 (IEEE binary32)", exponent_bits=8, mantissa_bits=23,
    torch_dtype="float32", numpy_name="float32",
    used_for="reference precision; master weights, gradients and Adam states in mixed precision; "
    "softmax/norm/loss under autocast",
    hardware="every GPU and CPU",
)  # fmt: skip
TF32 = FloatFormat(
    id="tf32", name="TF32 (tensor-float 32)", exponent_bits=8, mantissa_bits=10, storage_bits=32,
    used_for="not a storage type: fp32 tensors multiplied on tensor cores with a 10-bit mantissa "
    "(torch.set_float32_matmul_precision('high'))",
    hardware="NVIDIA compute capability >= 8.0 (A100, RTX 30xx and later)",
)  # fmt: skip
FP16 = FloatFormat(
    id="fp16", name="FP16 (IEEE binary16)", exponent_bits=5, mantissa_bits=10,
    torch_dtype="float16", numpy_name="float16",
    used_for="mixed-precision compute on GPUs without bf16 (V100, T4); needs dynamic loss scaling",
    hardware="every CUDA GPU with tensor cores (compute capability >= 7.0)",
)  # fmt: skip
BF16 = FloatFormat(
    id="bf16", name="BF16 (brain float 16)", exponent_bits=8, mantissa_bits=7,
    torch_dtype="bfloat16", ml_dtypes_name="bfloat16",
    used_for="default mixed-precision training format: fp32's range, no loss scaling",
    hardware="NVIDIA compute capability >= 8.0 (A100, H100, RTX 30xx/40xx), AMD MI200+, TPUs",
)  # fmt: skip
FP8_E4M3 = FloatFormat(
    id="fp8-e4m3", name="FP8 E4M3 (OCP, finite-only)", exponent_bits=4, mantissa_bits=3,
    encoding=Encoding.FN, torch_dtype="float8_e4m3fn", ml_dtypes_name="float8_e4m3fn",
    used_for="FP8 training: weights and activations in the forward pass (with per-tensor scales)",
    hardware="NVIDIA compute capability >= 8.9 (L4, L40S, RTX 40xx, H100); AMD MI300 uses FNUZ variants",
)  # fmt: skip
FP8_E5M2 = FloatFormat(
    id="fp8-e5m2", name="FP8 E5M2 (OCP, IEEE-like)", exponent_bits=5, mantissa_bits=2,
    torch_dtype="float8_e5m2", ml_dtypes_name="float8_e5m2",
    used_for="FP8 training: gradients in the backward pass (range over precision)",
    hardware="NVIDIA compute capability >= 8.9 (L4, L40S, RTX 40xx, H100); AMD MI300 uses FNUZ variants",
)  # fmt: skip
INT8 = IntegerFormat(
    id="int8", name="INT8 (two's complement)", bits=8,
    used_for="inference quantisation of weights/activations (value = q·scale); not a training format",
    hardware="integer tensor cores (compute capability >= 7.5 for int8 MMA), most CPUs",
)  # fmt: skip

FLOAT_FORMATS: tuple[FloatFormat, ...] = (FP32, TF32, FP16, BF16, FP8_E4M3, FP8_E5M2)
INTEGER_FORMATS: tuple[IntegerFormat, ...] = (INT8,)


def get_format(format_id: str) -> FloatFormat:
    """Look up a float format by id ('fp16', 'bf16', 'fp8-e4m3', ...)."""
    key = format_id.strip().lower()
    aliases = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "e4m3": "fp8-e4m3",
               "e5m2": "fp8-e5m2"}  # fmt: skip
    key = aliases.get(key, key)
    for fmt in FLOAT_FORMATS:
        if fmt.id == key:
            return fmt
    ids = [f.id for f in FLOAT_FORMATS]
    raise UnknownFormatError(f"unknown number format '{format_id}'.{did_you_mean(key, ids)}")


def quantize(x: float, fmt: FloatFormat) -> float:
    """Round a Python float to the nearest value of ``fmt`` (round-half-to-even, subnormals kept).

    First principles — IEEE 754-2019 §4.3.1 roundTiesToEven: find the binade 2^e ≤ |x| < 2^(e+1)
    (clamped below at emin, which makes the subnormal range uniform), round |x|/2^(e−m) to the nearest
    integer with ties to even, and scale back. A result above ``max_finite`` overflows to inf (``ieee``) or
    NaN (``fn``; torch saturates instead, see the module docstring). Exact for every input whose binade
    quantum is representable in a double, i.e. all formats here.
    """
    if math.isnan(x) or math.isinf(x):
        return x if not math.isinf(x) or fmt.has_inf else math.nan
    if x == 0.0:
        return x
    a = abs(x)
    _, k = math.frexp(a)  # a = f·2^k with 0.5 <= f < 1, so the binade exponent is k − 1
    e = max(k - 1, fmt.emin)
    if e > fmt.emax:
        return math.copysign(fmt.overflow_value, x)
    quantum_exp = e - fmt.mantissa_bits
    n = round(math.ldexp(a, -quantum_exp))  # Python's round() is round-half-even on exact floats
    q = math.ldexp(float(n), quantum_exp)
    if q > fmt.max_finite:
        q = fmt.overflow_value
    return math.copysign(q, x)


def ulp(x: float, fmt: FloatFormat) -> float:
    """Gap between ``x`` (assumed representable) and the next larger-magnitude value: 2^(max(e, emin) − m)."""
    if x == 0.0:
        return fmt.min_subnormal
    _, k = math.frexp(abs(x))
    return math.ldexp(1.0, max(k - 1, fmt.emin) - fmt.mantissa_bits)


def headroom_binades(absmax: float, fmt: FloatFormat) -> float:
    """log2(max_finite / absmax): how many doublings a tensor with this absmax survives before overflowing.

    Negative means it already overflows; inf for an all-zero tensor.
    """
    if absmax == 0.0:
        return math.inf
    if not math.isfinite(absmax):
        return -math.inf
    return math.log2(fmt.max_finite / absmax)


@dataclass(frozen=True, slots=True, kw_only=True)
class EdgeFact:
    """One surprising consequence of a format's layout, with the computation that shows it."""

    id: str
    format_id: str
    expression: str
    result: float
    explanation: str
    source: str

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.id,
            "format": self.format_id,
            "expression": self.expression,
            "result": json_float(self.result),
            "explanation": self.explanation,
            "source": self.source,
        }


def _fmt_num(x: float) -> str:
    if math.isinf(x) or math.isnan(x):
        return str(x)
    if x == int(x) and abs(x) < 1e16:
        return str(int(x))
    return f"{x:.6g}"


def edge_facts() -> tuple[EdgeFact, ...]:
    """The facts users trip on, each computed with :func:`quantize` (nothing is typed in)."""
    t = FP16.overflow_threshold
    below = t - ulp(t, FP32)  # the largest float32 below the threshold
    adam_eps = 1e-8
    grad = 1e-8
    scale = 65536.0
    b = quantize(quantize(256.0, BF16) + quantize(1.0, BF16), BF16)
    e4 = quantize(FP8_E4M3.max_finite + 20.0, FP8_E4M3)
    return (
        EdgeFact(
            id="fp16-overflow-threshold",
            format_id="fp16",
            expression=f"fp16({_fmt_num(t)}) = {_fmt_num(quantize(t, FP16))}; "
            f"fp16({below!r}) = {_fmt_num(quantize(below, FP16))}",
            result=t,
            explanation=(
                f"fp16's largest finite value is {_fmt_num(FP16.max_finite)}, but rounding only overflows at "
                f"{_fmt_num(t)} = max + ulp/2: anything from {_fmt_num(t)} up becomes inf."
            ),
            source="IEEE 754-2019 §4.3.1 (roundTiesToEven) and §7.4 (overflow)",
        ),
        EdgeFact(
            id="fp16-adam-eps",
            format_id="fp16",
            expression=f"fp16(1e-8) = {_fmt_num(quantize(adam_eps, FP16))}",
            result=quantize(adam_eps, FP16),
            explanation=(
                f"Adam's default eps=1e-8 is below fp16's flush threshold {FP16.flush_threshold:.3g} "
                f"(half the smallest subnormal {FP16.min_subnormal:.3g}), so it rounds to 0: with fp16 "
                "optimizer states, m/(sqrt(v)+eps) divides by zero wherever v underflows. Keep optimizer "
                "states in fp32 (torch AMP does), or raise eps well above the flush threshold."
            ),
            source="torch.optim.AdamW default eps=1e-8; IEEE 754 subnormal range",
        ),
        EdgeFact(
            id="fp16-gradient-underflow",
            format_id="fp16",
            expression=f"fp16(1e-8) = {_fmt_num(quantize(grad, FP16))}; "
            f"fp16(1e-8 × {int(scale)}) = {quantize(grad * scale, FP16):.6g}",
            result=quantize(grad * scale, FP16),
            explanation=(
                "A gradient of 1e-8 is lost in fp16; multiplied by GradScaler's initial scale 65536 it "
                "survives, and dividing by the scale in fp32 afterwards restores it. This is loss scaling."
            ),
            source="Micikevicius et al. 2018, 'Mixed Precision Training', §3.2; GradScaler init_scale",
        ),
        EdgeFact(
            id="bf16-256-plus-1",
            format_id="bf16",
            expression=f"bf16(256) + bf16(1) = {_fmt_num(b)}",
            result=b,
            explanation=(
                f"bf16 keeps {BF16.mantissa_bits + 1} significant bits; 257 needs 9, and the tie between 256 "
                "and 258 goes to the even mantissa, 256. Small updates to large weights vanish in pure bf16 "
                "(why master weights or Kahan summation exist)."
            ),
            source="IEEE 754-2019 §4.3.1 roundTiesToEven; Kalamkar et al. 2019",
        ),
        EdgeFact(
            id="bf16-vs-fp16-range",
            format_id="bf16",
            expression=f"bf16 max = {BF16.max_finite:.4g}, min normal = {BF16.min_normal:.4g}; "
            f"fp16 max = {_fmt_num(FP16.max_finite)}, min normal = {FP16.min_normal:.4g}",
            result=BF16.max_finite,
            explanation=(
                "bf16 has fp32's 8 exponent bits, so its range matches fp32 (~1e-38 to ~3e38) and overflow "
                "is practically impossible; fp16 trades 3 exponent bits for 3 more mantissa bits "
                f"(eps {FP16.epsilon:.3g} vs {BF16.epsilon:.3g})."
            ),
            source="IEEE 754-2019 Table 3.5 (binary16); Kalamkar et al. 2019 (bfloat16 layout)",
        ),
        EdgeFact(
            id="fp8-e4m3-no-inf",
            format_id="fp8-e4m3",
            expression=f"e4m3({_fmt_num(FP8_E4M3.max_finite + 20.0)}) = {_fmt_num(e4)} (spec); "
            "torch's CPU cast saturates to 448",
            result=e4,
            explanation=(
                f"E4M3 has no inf: its max is {_fmt_num(FP8_E4M3.max_finite)} and an out-of-range cast is "
                "NaN or saturates depending on the library, which is why FP8 recipes keep per-tensor scales."
            ),
            source="OCP OFP8 spec v1.0 §5; Micikevicius et al. 2022, Table 1",
        ),
    )


INT8_VS_BF16 = (
    "int8 and bf16 are not two sizes of the same thing. int8 is a fixed-point integer code for inference "
    "quantisation: a tensor is stored as q·scale with q in [-127, 127], so every value in the tensor shares "
    "one absolute step (absmax/127) and small values next to a large outlier are crushed to 0 — hence "
    "per-channel scales and outlier handling (LLM.int8()). It halves memory versus fp16/bf16 for serving, "
    "but gradients do not survive a 256-level grid, so it is not used to train. bf16 is a floating-point "
    "format: every value keeps ~2.4 significant digits relative to its own magnitude across fp32's whole "
    "range, which is what training needs. Quantise with int8 for inference; train in bf16 (or fp16 with loss "
    "scaling)."
)
"""The article's §6.3 distinction, with the arithmetic of :class:`IntegerFormat` behind it."""
