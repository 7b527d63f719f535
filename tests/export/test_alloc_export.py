"""launch.sh exports the caching allocator's configuration a plan was estimated with, NOTES.txt says why, and the
estimate with the exported setting fits (torch-free; no engine parser needed)."""

from __future__ import annotations

import shlex

from trainfit import estimate, get_gpu, load_model
from trainfit.export import export_plan
from trainfit.export.configs import export_files
from trainfit.planner.rank import search_plans


def test_launch_exports_the_plans_allocator_and_the_estimate_with_it_fits() -> None:
    spec, gpu = load_model("qwen3-8b"), get_gpu("a100-sxm-80gb")  # tests/planner/test_alloc_plan.py's search
    plans = search_plans(spec, gpu, gpus=1, seq_len=6144, global_batch=1, top=5, alloc_conf="").plans
    grown = [p for p in plans if p.alloc_conf]
    plain = [p for p in plans if not p.alloc_conf]
    assert grown and plain
    for p in grown:
        files = export_files(export_plan(spec, p.strategy, alloc_conf=p.alloc_conf))
        lines = files["launch.sh"].splitlines()
        assert lines[0] == "#!/bin/sh"
        exported = [ln for ln in lines if ln.startswith("export PYTORCH_CUDA_ALLOC_CONF=")]
        assert len(exported) == 1 and lines.index(exported[0]) < len(lines) - 1  # set before the launch line
        conf = shlex.split(exported[0].removeprefix("export "))[0].split("=", 1)[1]
        assert "expandable_segments" in files["NOTES.txt"] and conf in files["NOTES.txt"]
        rep = estimate(spec, p.strategy, gpu=gpu, headroom=0.3, search_micro_batch=False, fixes=False, allocator=conf)
        assert rep.fit is not None and rep.fit.fits and rep.fit.required_bytes == p.required_bytes
    for p in plain:  # PyTorch's defaults: launch.sh sets nothing
        assert "PYTORCH_CUDA_ALLOC_CONF" not in export_files(export_plan(spec, p.strategy))["launch.sh"]
