"""Which parameters an FSDP2 micro-step gathers once (trainfit.fsdp_units.gathered_once_fraction), and what the
speed model makes of it."""

from __future__ import annotations

import pytest

from trainfit import Strategy, load_model
from trainfit.arch.params import count_params
from trainfit.fsdp_units import gathered_once_fraction
from trainfit.hardware import get_gpu
from trainfit.planner.speed import SpeedInputs, step_time_of
from trainfit.strategy import EngineOptions, FsdpWrap, Parallelism


def test_the_root_and_the_tail_unit_are_gathered_once() -> None:
    """llama-3.1-8b (untied): under ``root`` the token table, final norm and head are the root, never resharded
    after forward; under ``units`` the table is a unit of its own, resharded and gathered again for backward, the
    [final norm, head] unit not; without ``reshard_after_forward`` nothing is gathered twice."""
    spec = load_model("llama-3.1-8b")
    p, table, norm = count_params(spec), spec.vocab_size * spec.hidden_size, spec.hidden_size
    root = gathered_once_fraction(spec, FsdpWrap.ROOT, 1, reshard_after_forward=True)
    units = gathered_once_fraction(spec, FsdpWrap.UNITS, 1, reshard_after_forward=True)
    assert root == pytest.approx((2 * table + norm) / p)
    assert units == pytest.approx((table + norm) / p)
    assert gathered_once_fraction(spec, FsdpWrap.AUTO, 1, reshard_after_forward=True) == units
    assert gathered_once_fraction(spec, FsdpWrap.AUTO, 8, reshard_after_forward=True) == root  # 2-D: root
    assert gathered_once_fraction(spec, FsdpWrap.UNITS, 1, reshard_after_forward=False) == 1.0


def test_without_reshard_after_forward_fsdp_gathers_each_parameter_once() -> None:
    """The speed model's FSDP2 traffic per micro-step: all-gathers of ``(2 − once)`` times the weights, one
    reduce-scatter; ``reshard_after_forward=False`` keeps every group unsharded from its forward to its backward."""
    spec, gpu = load_model("llama-3.1-8b"), get_gpu("h100-sxm-80gb")

    def comm(raf: bool) -> float:
        s = Strategy(
            precision="pure-bf16", seq_len=2048, micro_batch=1, sharding="fsdp", parallelism=Parallelism.for_gpus(8),
            engine=EngineOptions(reshard_after_forward=raf),
        )  # fmt: skip
        return step_time_of(spec, SpeedInputs.of(s, spec), gpu).comm_seconds

    p, ring, bw = count_params(spec), 7 / 8, 370e9  # NCCL's bus bandwidth on an H100 node (planner.speed)
    assert comm(False) == pytest.approx(ring * (2 * p + 2 * p) / bw, rel=1e-3)  # bf16: gathered once, reduced once
    once = gathered_once_fraction(spec, FsdpWrap.AUTO, 1, reshard_after_forward=True)
    assert comm(True) == pytest.approx(ring * ((2 - once) * 2 * p + 2 * p) / bw, rel=1e-3)
