"""ZeRO-3's collectives without a loop over the ranks (``trainfit.trace.deepspeed_comm``, issue 10): the same values
as DeepSpeed's own functions on real tensors, and a traced rank whose dispatched ops do not depend on W."""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

import pytest

from trainfit.strategy import EngineOptions, Parallelism, Strategy

from .conftest import tiny_spec

pytest.importorskip("torch")
pytest.importorskip("deepspeed")
import torch

from trainfit.trace import deepspeed_comm as dc
from trainfit.trace.deepspeed import DeepSpeedTracker, _deepspeed_world, _quiet_deepspeed
from trainfit.trace.distributed import trace_distributed


@pytest.mark.parametrize(
    ("sizes", "world", "rank"),
    [
        ((5, 8, 1, 13), 4, 1),  # short chunks, a gradient smaller than W (three paddings), mixed
        ((5, 8, 1, 13), 4, 3),
        ((8,), 4, 2),  # one gradient W divides: DeepSpeed's shortcut, its own buffer
        ((8, 12, 4), 4, 1),  # several, W divides each: no padding
        ((7,), 4, 0),
        ((130, 64), 64, 63),
    ],
)
def test_reduce_scatter_matches_deepspeeds(
    sizes: tuple[int, ...], world: int, rank: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On real tensors: the buffer handed to the reduce-scatter holds DeepSpeed's values wherever they are a
    gradient's (the paddings are ``torch.empty`` in both), the same padding tensors are allocated in the same order,
    and the outputs are the same views of this rank's chunk."""
    from deepspeed.runtime.comm import coalesced_collectives as cc

    def grads() -> list[torch.Tensor]:
        return [torch.arange(1, n + 1, dtype=torch.float32) * (i + 1) for i, n in enumerate(sizes)]

    def run(fn: Any) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
        seen: list[torch.Tensor] = []
        pads: list[int] = []
        empty = torch.empty

        def padding(*a: Any, **k: Any) -> torch.Tensor:
            t = empty(*a, **k)
            pads.append(t.numel())
            return t

        with monkeypatch.context() as m:
            m.setattr(cc, "_torch_reduce_scatter_fn", lambda inp, out, group=None: seen.append(inp))
            m.setattr(torch, "empty", padding)
            out = fn(grads())
        return seen[0], out, pads

    with _quiet_deepspeed(), _deepspeed_world(world, rank):
        ref_buf, ref_out, ref_pads = run(cc.reduce_scatter_coalesced)
        buf, out, pads = run(dc.reduce_scatter_coalesced)
    width = sum(-(-n // world) for n in sizes)
    assert buf.shape == ref_buf.shape == (world * width,) and buf.dtype == ref_buf.dtype
    filled = torch.zeros(world, width, dtype=torch.bool)
    col = 0
    for n in sizes:
        c = -(-n // world)
        for r in range(world):
            filled[r, col : col + max(0, min(c, n - r * c))] = True
        col += c
    mask = filled.view(-1)
    assert torch.equal(buf[mask], ref_buf[mask])
    if not ref_pads:  # W divides every gradient: no padding (one gradient: DeepSpeed's shortcut, its own buffer)
        assert pads == []
    else:  # the same paddings in the same order, then the buffer (``torch.cat``'s output in DeepSpeed's)
        assert pads == [*ref_pads, world * width]
    assert [t.shape for t in out] == [t.shape for t in ref_out]
    for mine, ref in zip(out, ref_out, strict=True):
        assert torch.equal(mine, ref)


def _handle(params: list[Any], flat: torch.Tensor, world: int, lazy: bool) -> Any:
    from deepspeed.runtime.zero import partition_parameters as pp

    size = flat.numel() // world
    parts = dc.Partitions(flat, size, world) if lazy else [flat.narrow(0, size * r, size) for r in range(world)]

    class Done:
        def wait(self) -> None:
            return None

    return pp.AllGatherCoalescedHandle(allgather_handle=Done(), params=params, partitions=parts, world_size=world)


def _params(shapes: list[tuple[int, ...]], world: int) -> list[Any]:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    out = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        p.ds_shape = torch.Size(shape)
        p.ds_numel = p.ds_shape.numel()
        p.ds_tensor = torch.empty(-(-p.ds_numel // world))
        p.ds_tensor.ds_numel = p.ds_tensor.numel()
        p.ds_status = ZeroParamStatus.INFLIGHT
        out.append(p)
    return out


@pytest.mark.parametrize("lazy", [False, True])
def test_gathered_parameters_match_deepspeeds(lazy: bool) -> None:
    """``AllGatherCoalescedHandle.wait``: each parameter's whole copy, read out of a flat buffer of W partitions (a
    parameter W does not divide: its last piece is short; one smaller than W: in fewer ranks than W), equals what
    DeepSpeed's own ``wait`` concatenates, with DeepSpeed's list of views or :class:`Partitions`."""
    from deepspeed.runtime.zero import partition_parameters as pp

    world, shapes = 4, [(3, 5), (8,), (2,), (4, 4)]
    size = sum(-(-math.prod(s) // world) for s in shapes)
    flat = torch.arange(world * size, dtype=torch.float32)
    ref = _params(shapes, world)
    pp.AllGatherCoalescedHandle.wait(_handle(ref, flat, world, lazy=False))
    mine = _params(shapes, world)
    dc._wait(pp.AllGatherCoalescedHandle.wait, _handle(mine, flat, world, lazy=lazy))
    for a, b in zip(mine, ref, strict=True):
        assert a.shape == b.shape and torch.equal(a.data, b.data)
        assert a.ds_status == b.ds_status == pp.ZeroParamStatus.AVAILABLE


def _ops_per_phase(world: int, monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    orig = DeepSpeedTracker.__torch_dispatch__

    def counted(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        counts[self.phase] += 1
        return orig(self, func, types, args, kwargs)

    # a 2-layer llama whose every tensor W = 64 divides (DeepSpeed allocates a padding per short rank: W-sized by
    # right); DeepSpeed's default prefetch bucket gathers every partitioned parameter in one coalesced handle
    spec, s = _tiny_zero3(world)
    s = dataclasses.replace(s, engine=EngineOptions(reduce_bucket_size=50_000, allgather_bucket_size=50_000))
    with monkeypatch.context() as m:
        m.setattr(DeepSpeedTracker, "__torch_dispatch__", counted)
        trace_distributed(spec, s)
    return counts


@pytest.mark.slow
def test_zero3_trace_ops_do_not_depend_on_the_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 10: the ops the traced ZeRO-3 rank dispatches, phase by phase, are the same at W = 2 and W = 64.
    DeepSpeed's own ``reduce_scatter_coalesced`` made W views of every gradient it reduced, its
    ``_all_gather_dtype`` W views of each flat gather buffer and the handle's ``wait`` W of every gathered parameter
    (this setup, with them: 1,929 ops in the forward and 3,831 in the backward at W = 2, 3,045 and 15,611 at W = 64);
    the trace now runs
    :mod:`trainfit.trace.deepspeed_comm`'s equivalents (what they allocate is checked byte for byte by
    ``test_deepspeed.py``'s ZeRO-3 cells, and against DeepSpeed's values above)."""
    assert _ops_per_phase(2, monkeypatch) == _ops_per_phase(64, monkeypatch)


def test_installed_deepspeed_is_the_verified_code() -> None:
    """A tripwire for DeepSpeed upgrades: the functions the stand-ins replace are, source for source, those they were
    checked against. Where this fails, run this file's value tests on the new release and, if they pass, add its
    digests to ``VERIFIED_SOURCES`` (until then the trace runs DeepSpeed's own functions, slower but right)."""
    digests = dc.source_digests()
    unverified = {k: d for k, d in digests.items() if d not in dc.VERIFIED_SOURCES[k]}
    assert not unverified, f"DeepSpeed's code changed; unverified digests: {unverified}"


def _tiny_zero3(world: int) -> tuple[Any, Strategy]:
    spec = tiny_spec("llama", hidden_size=128, intermediate_size=1024, vocab_size=1024, num_hidden_layers=2)
    s = Strategy(parallelism=Parallelism(data=world), sharding="zero3", micro_batch=1, seq_len=32)
    return spec, s


def test_unverified_deepspeed_keeps_its_own_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the installed DeepSpeed's code is not the verified one, nothing is replaced: its own functions run."""
    from deepspeed.runtime.zero import partition_parameters as pp
    from deepspeed.runtime.zero import stage3 as s3

    def current() -> tuple[Any, ...]:
        return s3.reduce_scatter_coalesced, pp.AllGatherCoalescedHandle.wait, pp.Init._convert_to_deepspeed_param

    own = current()
    with dc.world_flat_collectives() as replaced:
        assert replaced and s3.reduce_scatter_coalesced is dc.reduce_scatter_coalesced
    monkeypatch.setattr(dc, "VERIFIED_SOURCES", {k: frozenset() for k in dc.VERIFIED_SOURCES})
    with dc.world_flat_collectives() as replaced:
        assert not replaced and current() == own
    assert current() == own


@pytest.mark.slow
def test_unverified_deepspeed_traces_the_same_bytes_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ZeRO-3 trace with DeepSpeed's own collectives (as on an unverified release) reports the same bytes in every
    phase as with the stand-ins, and its notes say which ran."""
    spec, s = _tiny_zero3(4)
    fast = trace_distributed(spec, s)
    assert not any("not the code" in n for n in fast.notes)
    monkeypatch.setattr(dc, "VERIFIED_SOURCES", {k: frozenset() for k in dc.VERIFIED_SOURCES})
    own = trace_distributed(spec, s)
    assert [(p.phase, dict(p.components)) for p in own.phases] == [(p.phase, dict(p.components)) for p in fast.phases]
    assert any("not the code trainfit's loop-free stand-ins were checked against" in n for n in own.notes)
