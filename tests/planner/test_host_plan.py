"""``--host-memory-gib``: plans carry the estimate's host memory per node, and a limit rules out the plans (offload)
whose host memory exceeds it less the headroom (issue 14's audit: a 70B full fine-tune on one RTX 4090 was proposed
with ZeRO-3 offload needing more than a terabyte of CPU RAM, without a word)."""

from __future__ import annotations

import math

import pytest

from trainfit import estimate
from trainfit.errors import StrategyError
from trainfit.planner.api import plan
from trainfit.planner.rank import host_usable_bytes

GiB = 2**30
#: Llama 3.2 3B on one RTX 4090: only ZeRO-3 with parameters and optimizer offloaded fits the GPU (~60 GiB of host)
SETUP = {"seq": 1024, "global_batch": 8, "top": 3}


def test_plans_carry_the_estimates_host_memory_and_say_it_was_not_checked() -> None:
    r = plan("llama-3.2-3b", "rtx-4090", gpus=1, **SETUP)  # type: ignore[arg-type]
    assert r.plans and r.host_memory_bytes is None and r.host_rejected == 0
    for p in r.plans:
        rep = estimate("llama-3.2-3b", p.strategy, gpu="rtx-4090", search_micro_batch=False, allocator=p.alloc_conf)
        assert p.host_peak_bytes == rep.host_peak_bytes > 0
    assert any("host memory not checked" in n for n in r.notes)


def test_a_host_limit_rules_out_offload_and_says_what_would_do() -> None:
    free = plan("llama-3.2-3b", "rtx-4090", gpus=1, **SETUP)  # type: ignore[arg-type]
    need = free.plans[0].host_peak_bytes
    tight = plan("llama-3.2-3b", "rtx-4090", gpus=1, host_memory_bytes=64 * GiB, **SETUP)  # type: ignore[arg-type]
    assert host_usable_bytes(64 * GiB, 0.3) < need  # 64 GiB less the 30% headroom cannot hold it
    assert tight.plans == () and tight.host_rejected > 0
    assert any("--host-memory-gib 64:" in n for n in tight.notes)
    gib = math.ceil(min(p.host_peak_bytes for p in free.plans) / 0.7 / GiB)
    assert tight.needs[0].startswith(f"--host-memory-gib {gib} ")
    # what the needs line names is enough, and then the plans are the unlimited search's
    enough = plan("llama-3.2-3b", "rtx-4090", gpus=1, host_memory_bytes=gib * GiB, **SETUP)  # type: ignore[arg-type]
    assert [p.strategy for p in enough.plans] == [p.strategy for p in free.plans]
    assert enough.host_rejected == 0 and not any("not checked" in n for n in enough.notes)


def test_under_a_host_limit_every_plan_holds_it() -> None:
    r = plan("llama-3.2-3b", "rtx-4090", gpus=2, host_memory_bytes=16 * GiB, **SETUP)  # type: ignore[arg-type]
    assert r.plans and r.host_usable_bytes == host_usable_bytes(16 * GiB, 0.3)
    assert all(p.host_peak_bytes <= r.host_usable_bytes for p in r.plans)


def test_a_host_limit_must_be_positive() -> None:
    with pytest.raises(StrategyError, match="--host-memory-gib must be positive"):
        plan("gpt2", "t4", gpus=1, host_memory_bytes=0)
