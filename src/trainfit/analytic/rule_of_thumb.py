"""The article's rule of thumb, reproduced exactly (seed article §1.2 and §5.2).

    total ≈ P × (2 + 2 + 8) bytes + b·s·h·L·c + framework overhead

with c between 10 and 20 (15 as the point value) and 1–2 GB of framework overhead (1.5 GB point),
all in decimal GB as the article writes them. Its examples: a 7B model (h 4096, L 32, b 1, s 2048)
needs 84 GB before activations and 2.7–5.4 GB of activations; a 1.3B model (h 2048, L 24, b 4,
s 1024) needs 15.6 + ≈3 + 1.5 ≈ 20 GB.
"""

from __future__ import annotations

from trainfit.arch.params import count_params
from trainfit.arch.spec import ModelSpec
from trainfit.result import (
    BytesPerParam,
    Component,
    MemoryReport,
    Method,
    Overhead,
    PhaseBreakdown,
    RuleOfThumbDetails,
    Term,
)
from trainfit.result import Phase as P
from trainfit.strategy import Strategy
from trainfit.units import GB

BYTES_PER_PARAM = (2, 2, 8)  # fp16 weights, fp16 grads, fp32 Adam m and v
C_LOW, C_POINT, C_HIGH = 10, 15, 20
OVERHEAD_LOW, OVERHEAD_POINT, OVERHEAD_HIGH = 1 * GB, 3 * GB // 2, 2 * GB


def estimate_rule_of_thumb(spec: ModelSpec, strategy: Strategy) -> MemoryReport:
    p = count_params(spec)
    w, g, o = (p * k for k in BYTES_PER_PARAM)
    bshl = strategy.micro_batch * strategy.seq_len * spec.hidden_size * spec.num_layers
    act = bshl * C_POINT
    phase = PhaseBreakdown(
        phase=P.BACKWARD,
        components={
            Component.WEIGHTS: w,
            Component.GRADIENTS: g,
            Component.OPTIMIZER_STATES: o,
            Component.ACTIVATIONS: act,
        },
    )
    states = w + g + o
    return MemoryReport(
        method=Method.RULE_OF_THUMB,
        model_name=spec.name,
        params=p,
        trainable_params=p,
        phases=(phase,),
        # The article's framework overhead is reported apart, like our CUDA context.
        overhead=Overhead(cuda_context_bytes=OVERHEAD_POINT, allocator_reserve_bytes=0),
        bytes_per_param=BytesPerParam(weights=2.0, gradients=2.0, optimizer_states=8.0),
        terms=(
            Term(
                name="weights+grads+optimizer",
                bytes=states,
                formula="P × (2+2+8)",
                source="seed article §1.2, §5.2",
            ),
            Term(
                name="activations",
                bytes=act,
                formula=f"b·s·h·L·{C_POINT} (c = {C_LOW}–{C_HIGH})",
                source="seed article §1.2",
            ),
            Term(name="framework overhead", bytes=OVERHEAD_POINT, formula="1–2 GB", source="seed article §5.2"),
        ),
        notes=("decimal GB as in the article; c = 15 is the point value of its 10–20 range",),
        low_bytes=states + bshl * C_LOW + OVERHEAD_LOW,
        high_bytes=states + bshl * C_HIGH + OVERHEAD_HIGH,
        details=RuleOfThumbDetails(
            states_bytes=states,
            activations_low_bytes=bshl * C_LOW,
            activations_high_bytes=bshl * C_HIGH,
        ),
    )
