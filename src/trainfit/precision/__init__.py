"""Number formats, precision recipes and hardware-aware precision advice (torch-free).

``formats`` derives every limit of fp32/tf32/fp16/bf16/fp8/int8 from the bit layout; ``advice`` turns an
accelerator's capabilities into a recipe with reasons, following the article's decision path.
"""

from trainfit.precision.advice import Accelerator, PrecisionAdvice, recommend
from trainfit.precision.formats import FLOAT_FORMATS, FloatFormat, edge_facts, get_format, quantize

__all__ = [
    "FLOAT_FORMATS",
    "Accelerator",
    "FloatFormat",
    "PrecisionAdvice",
    "edge_facts",
    "get_format",
    "quantize",
    "recommend",
]
