"""Where and why the analytic estimate departs from the article's rule of thumb, term by term."""

from __future__ import annotations

from collections.abc import Mapping

from trainfit.analytic.rule_of_thumb import estimate_rule_of_thumb
from trainfit.arch.spec import ModelSpec
from trainfit.result import AnalyticDetails, Component, Difference, MemoryReport

__all__ = ["Difference", "compare_with_rule_of_thumb"]
from trainfit.strategy import Strategy


def compare_with_rule_of_thumb(spec: ModelSpec, strategy: Strategy, report: MemoryReport) -> list[Difference]:
    """Rows comparing the rule of thumb with ``report`` (an analytic or trace report) at its peak."""
    rot = estimate_rule_of_thumb(spec, strategy)
    rc = rot.peak.components
    pc = report.peak.components
    r = strategy.recipe

    def get(c: Mapping[Component, int], k: Component) -> int:
        return int(c.get(k, 0))

    states_rot = get(rc, Component.WEIGHTS) + get(rc, Component.GRADIENTS) + get(rc, Component.OPTIMIZER_STATES)
    states = sum(
        get(pc, k)
        for k in (
            Component.WEIGHTS,
            Component.GRADIENTS,
            Component.MASTER_WEIGHTS,
            Component.OPTIMIZER_STATES,
        )
    )
    bpp = report.bytes_per_param
    why_states = (
        f"{strategy.precision.value}: weights {bpp.weights:.0f} B + grads "
        f"{bpp.gradients:.0f} B + master {bpp.master_weights:.0f} B + "
        f"{strategy.optimizer.value} {bpp.optimizer_states:.2f} B per param, vs the article's 2+2+8"
    )
    if r.master_bits:
        why_states += "; the article's 12 B omits the fp32 master copy it describes in §6.2"
    if report.peak_phase.value != "optimizer-step":
        why_states += f"; grads are not all alive at the {report.peak_phase.value} peak"
    coeff = report.details.activation_coefficient if isinstance(report.details, AnalyticDetails) else None
    rows = [
        Difference(
            term="weights + grads + optimizer",
            rule_of_thumb_bytes=states_rot,
            analytic_bytes=states,
            why=why_states,
        ),
        Difference(
            term="activations",
            rule_of_thumb_bytes=get(rc, Component.ACTIVATIONS),
            analytic_bytes=get(pc, Component.ACTIVATIONS),
            why=f"c = {coeff} from the block's saved tensors (article: c = 15)"
            if coeff is not None
            else "saved tensors counted by the trace",
        ),
        Difference(
            term="logits + loss",
            rule_of_thumb_bytes=0,
            analytic_bytes=get(pc, Component.LOGITS_LOSS),
            why="b·s·vocab logits, their fp32 upcast and cross-entropy gradients; not in the rule",
        ),
        Difference(
            term="autocast weight copies",
            rule_of_thumb_bytes=0,
            analytic_bytes=get(pc, Component.AUTOCAST_COPIES),
            why="torch.autocast caches a 16-bit copy of each fp32 matmul weight"
            if r.autocast
            else "none for this recipe",
        ),
        Difference(
            term="temporaries",
            rule_of_thumb_bytes=0,
            analytic_bytes=get(pc, Component.TEMPORARIES),
            why="gradient buffers in backward / the optimizer step's scratch",
        ),
        Difference(
            term="framework overhead",
            rule_of_thumb_bytes=rot.overhead.total_bytes,
            analytic_bytes=report.overhead.total_bytes + get(pc, Component.ALLOCATOR_ROUNDING),
            why="CUDA context + the caching allocator's reserve and its blocks' rounding above the tensors",
        ),
    ]
    return rows
