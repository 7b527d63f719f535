"""NCCL's buffers outside the allocator: the figure counted is the one-rank H200 measurement of the framework
(DESIGN §4.1: +67 MiB under FSDP2, +557 MiB after torch DDP), or 0 where none was measured (DeepSpeed, Megatron-LM,
DTensor TP without FSDP2). The output says which, for each engine and world size — above world size 1, where NCCL
also allocates per-peer buffers (NCCL_BUFFSIZE) that are not modelled, FSDP2's figure is a lower bound and DDP's
none either way (512 MiB of it may be NCCL 2.28's buffer of a one-rank communicator, nccl#2363) — in the notes, the
headline, and the JSON's ``overhead`` (``nccl_bytes`` with ``nccl_basis``)."""

from __future__ import annotations

import json

import pytest

from trainfit import Strategy, estimate
from trainfit.analytic.parallel import nccl_basis, nccl_bytes
from trainfit.strategy import EngineOptions, Parallelism

from ..cli._cli_helper import run_cli

MiB = 2**20

# (CLI flags, the one-rank measurement counted in MiB (0: none), what the basis must name)
CASES = [
    ("--gpus 1 --sharding fsdp", 67, "FSDP2"),
    ("--gpus 8 --sharding fsdp", 67, "FSDP2"),
    ("--gpus 16 --sharding hsdp", 67, "FSDP2"),
    ("--gpus 1 --sharding ddp", 557, "torch DDP"),
    ("--gpus 64 --sharding ddp", 557, "torch DDP"),
    ("--gpus 8 --tp 2 --engine torch --sharding fsdp", 67, "FSDP2"),
    ("--gpus 2 --tp 2 --engine torch", 0, "DTensor"),  # no DDP here: the DDP figure does not stand for it
    ("--gpus 8 --sharding zero2", 0, "DeepSpeed"),
    ("--gpus 8 --sharding zero3", 0, "DeepSpeed"),
    ("--gpus 8 --tp 8", 0, "Megatron-LM"),
]


@pytest.mark.parametrize(("flags", "mib", "who"), CASES, ids=[c[0] for c in CASES])
def test_json_carries_the_nccl_figure_and_its_basis(
    capsys: pytest.CaptureFixture[str], flags: str, mib: int, who: str
) -> None:
    res = run_cli(capsys, "estimate", "llama-3.1-8b", *flags.split(), "--gpu", "h200-sxm-141gb", "--json")
    assert res.code == 0, res.err
    out = json.loads(res.out)
    o, gpus = out["overhead"], out["strategy"]["gpus"]
    assert o["nccl_bytes"] == mib * MiB
    assert who in o["nccl_basis"]
    assert o["outside_allocator_bytes"] == o["cuda_context_bytes"] + o["kernel_images_bytes"] + o["nccl_bytes"]
    if mib:
        assert f"NCCL {mib} MiB: measured" in o["nccl_basis"] and "one-rank" in o["nccl_basis"]
        # measured at world size 1; at any other, with the documented per-peer buffer: FSDP2's a lower bound, DDP's
        # not a bound either way (its one-rank figure may hold NCCL's one-rank shared buffer, nccl#2363)
        assert ("lower bound" in o["nccl_basis"]) is (gpus > 1 and who == "FSDP2")
        assert ("not a bound either way" in o["nccl_basis"] and "nccl issue 2363" in o["nccl_basis"]) is (
            gpus > 1 and who == "torch DDP"
        )
        assert ("NCCL_BUFFSIZE, 4 MiB" in o["nccl_basis"]) is (gpus > 1)
    else:
        assert "not counted (0): not measured" in o["nccl_basis"]


@pytest.mark.parametrize(("flags", "mib", "who"), CASES, ids=[c[0] for c in CASES])
def test_text_says_what_the_nccl_term_is(capsys: pytest.CaptureFixture[str], flags: str, mib: int, who: str) -> None:
    res = run_cli(capsys, "estimate", "llama-3.1-8b", *flags.split(), "--gpu", "h200-sxm-141gb")
    text = " ".join(res.out.split())
    gpus = int(flags.split()[1])
    if mib:
        assert "kernels and NCCL" in text and "as measured at world size 1" in text
        assert ("a lower bound at world size" in text) is (gpus > 1 and who == "FSDP2")
        assert ("not a bound either way at world size" in text) is (gpus > 1 and who == "torch DDP")
    else:
        assert "NCCL's buffers not counted" in text
    assert who in text.split("NCCL's own buffers are outside it:")[1]


def test_one_gpu_without_a_process_group_has_no_nccl_term() -> None:
    s = Strategy()
    assert nccl_bytes(s) == 0 and nccl_basis(s) == ""
    r = estimate("llama-3.2-1b", s, gpu="h200-sxm-141gb")
    assert r.overhead.nccl_bytes == 0 and r.overhead.nccl_basis == ""


def test_the_figure_does_not_grow_with_the_world_size() -> None:
    """No per-W model (none is sourced that can be tested here): the counted figure is the same at every world size,
    and the basis says so."""
    fsdp = [Strategy(sharding="fsdp", parallelism=Parallelism(data=w)) for w in (1, 2, 8, 64)]
    assert {nccl_bytes(s) for s in fsdp} == {67 * MiB}
    tp = Strategy(parallelism=Parallelism(tensor=2), engine=EngineOptions(engine="torch"))
    assert nccl_bytes(tp) == 0
