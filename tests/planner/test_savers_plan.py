"""The memory savers in `trainfit plan`'s space: Liger's fused linear cross-entropy on one GPU."""

from __future__ import annotations

import dataclasses

from trainfit import estimate, load_model
from trainfit.hardware import get_gpu
from trainfit.planner.api import plan
from trainfit.planner.space import candidates, saver_candidates
from trainfit.strategy import LossImpl, MemorySavers, Sharding


def test_saver_variants_only_where_the_estimate_models_savers() -> None:
    spec, gpu = load_model("llama-3.2-1b"), get_gpu("a100-sxm-80gb")
    space = candidates(spec, gpu, gpus=8, gpus_per_node=8, global_batch=16)
    fused = [c for c in space if c.loss is LossImpl.FUSED_LINEAR]
    assert fused and all(c.world == 1 and c.sharding is Sharding.NONE for c in fused)
    assert len(fused) == len([c for c in space if c.world == 1 and c.sharding is Sharding.NONE]) // 2
    assert saver_candidates(fused) == []  # no variant of a variant


def test_a_fused_linear_plan_is_there_only_because_its_standard_twin_does_not_fit() -> None:
    """The speed model prices the fused loss like the standard one (the same matmuls), so a plan keeps
    ``--loss fused-linear`` only where the estimate says the same plan with the standard loss does not fit."""
    spec = load_model("llama-3.2-1b")
    r = plan(spec, "rtx-4090", gpus=1, seq=4096, global_batch=16, top=5)
    fused = [p for p in r.plans if p.strategy.savers.loss is LossImpl.FUSED_LINEAR]
    assert fused, [p.changes for p in r.plans]
    for p in fused:
        assert "--loss fused-linear" in p.changes
        again = estimate(spec, p.strategy, gpu="rtx-4090", search_micro_batch=False, fixes=False)
        assert again.fit is not None and again.fit.fits
        twin = dataclasses.replace(p.strategy, savers=MemorySavers())
        standard = estimate(spec, twin, gpu="rtx-4090", search_micro_batch=False, fixes=False)
        assert standard.fit is not None and not standard.fit.fits
