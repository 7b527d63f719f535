"""``trainfit estimate --host-memory-gib``: the same declaration and check as ``trainfit plan``'s, the run's own host
memory per node held to it in the verdict, and the checked fixes searched within it (issue 14)."""

from __future__ import annotations

import json
import shlex

import pytest

from tests.cli._cli_helper import run_cli

GiB = 2**30

# Llama 3.2 3B on one RTX 4090 at 8 × 1024 tokens: nothing fits without ZeRO-3 offload, whose host memory per node
# (about 60 GiB) is more than 64 GiB less the 30% headroom (44.8 GiB) and less than 100 GiB less it (70 GiB)
BASE = ("estimate", "llama-3.2-3b", "--gpu", "rtx-4090", "--seq", "1024")
OFFLOAD = ("--precision", "master-bf16", "--checkpointing", "full", "--sharding", "zero3", "--offload",
           "optimizer+params", "--engine", "deepspeed", "--batch", "4", "--grad-accum", "2")  # fmt: skip


def _json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    r = run_cli(capsys, *BASE, *args, "--json")
    assert r.code == 0, r.err
    out = json.loads(r.out)
    assert isinstance(out, dict)
    return out


def test_a_host_limit_drops_the_fixes_that_offload_beyond_it(capsys: pytest.CaptureFixture[str]) -> None:
    """Without a limit the run's checked fixes all offload to the host; with --host-memory-gib 64 they do not fit the
    host and none is listed (searched: an empty list, and a line says so); with 100 they are, each with its host
    GiB/node, and each fits by the estimate with its flags under the same limit, the host included."""
    free = _json(capsys, "--batch", "8")
    fixes = free["fixes"]
    assert isinstance(fixes, list) and fixes and not free["fits"] and "host_fits" not in free
    assert all(any(f.startswith("--offload ") for f in fix["flags"]) for fix in fixes)
    tight = _json(capsys, "--batch", "8", "--host-memory-gib", "64")
    assert tight["fixes"] == [] and tight["host_fits"] is True and tight["host_peak_bytes"] == 0
    assert tight["host_usable_bytes"] == int(64 * GiB * 0.7) and tight["host_memory_bytes"] == 64 * GiB
    text = " ".join(run_cli(capsys, *BASE, "--batch", "8", "--host-memory-gib", "64").out.split())
    assert "No checked fix (trainfit plan) fits within --host-memory-gib 64" in text
    roomy = _json(capsys, "--batch", "8", "--host-memory-gib", "100")
    kept = roomy["fixes"]
    assert isinstance(kept, list) and [f["flags"] for f in kept] == [f["flags"] for f in fixes]
    assert all("GiB/node of 70.0 GiB usable" in f["reason"] for f in kept)
    for fix in kept:
        flags = [f for change in fix["flags"] for f in shlex.split(change)]
        e = _json(capsys, "--batch", "8", *flags, "--host-memory-gib", "100", "--no-fixes")
        assert e["fits"] and e["host_fits"] is True and e["host_peak_bytes"] > 44.8 * GiB, fix


def test_the_verdict_says_when_the_run_exceeds_the_host(capsys: pytest.CaptureFixture[str]) -> None:
    """The offloading run fits the GPU; under --host-memory-gib 64 its host memory per node does not fit 44.8 GiB:
    the verdict says so first (the GPU's follows, and JSON's fits/verdict stay the GPU's, as a plan's do), and the
    fixes are searched as for a run that does not fit (none within 64 here). Under 100 GiB it fits the host and the
    verdict says how much of it the run takes."""
    out = _json(capsys, *OFFLOAD, "--host-memory-gib", "64")
    assert out["fits"] and out["verdict"] == "fits" and out["host_fits"] is False
    assert isinstance(out["host_peak_bytes"], int) and isinstance(out["host_usable_bytes"], int)
    assert out["host_peak_bytes"] > out["host_usable_bytes"] == int(64 * GiB * 0.7)
    assert out["fixes"] == []  # searched: the run is not one the host can hold
    r = run_cli(capsys, *BASE, *OFFLOAD, "--host-memory-gib", "64")
    text = " ".join(r.out.split())
    assert r.code == 0 and text.count("DOES NOT FIT the host: needs ") == 1
    assert "usable (--host-memory-gib 64 − 30% headroom), short by" in text
    assert text.index("DOES NOT FIT the host") < text.index("On the GPU: FITS on rtx-4090")
    quick = _json(capsys, *OFFLOAD, "--host-memory-gib", "64", "--no-fixes")
    assert quick["fixes"] is None and quick["host_fits"] is False  # not searched: null, not "none needed"
    roomy = _json(capsys, *OFFLOAD, "--host-memory-gib", "100")
    assert roomy["fits"] and roomy["host_fits"] is True and roomy["fixes"] == []
    text = " ".join(run_cli(capsys, *BASE, *OFFLOAD, "--host-memory-gib", "100").out.split())
    assert "DOES NOT FIT" not in text and "Host memory per node: " in text and "of 70.00 GiB usable" in text
    unlimited = _json(capsys, *OFFLOAD)
    assert "host_fits" not in unlimited and unlimited["fits"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu", "t4", "--host-memory-gib", "0"], "--host-memory-gib must be positive"),
        (["--gpu", "t4", "--host-memory-gib", "-8"], "--host-memory-gib must be positive"),
        (["--gpu", "t4", "--host-memory-gib", "nan"], "--host-memory-gib must be positive"),
        (["--gpu", "t4", "--host-memory-gib", "inf"], "--host-memory-gib must be positive"),
        (["--host-memory-gib", "64"], "--host-memory-gib is held in the fit verdict: give --gpu too"),
    ],
)
def test_bad_host_limits_are_one_line(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    r = run_cli(capsys, "estimate", "gpt2", "--seq", "1024", *args)
    assert r.code == 2
    assert message in r.err and r.err.count("\n") == 1


def test_estimate_and_plan_share_one_declaration() -> None:
    """One ``--host-memory-gib``: the same annotation (flag, type, help) in both commands' signatures."""
    import inspect

    from trainfit.cli.estimate import HostMemoryOption, estimate_cmd
    from trainfit.cli.plan import plan_cmd

    for cmd in (estimate_cmd, plan_cmd):
        param = inspect.signature(cmd, eval_str=True).parameters["host_memory_gib"]
        assert param.annotation == HostMemoryOption and param.default is None


def test_the_largest_micro_batch_is_one_the_host_holds_too(capsys: pytest.CaptureFixture[str]) -> None:
    """Offloaded activations grow the host memory with the micro-batch: under a limit between micro-batch 2's and 3's
    host memory, the largest micro-batch is 2 though the GPU holds 3 (each micro-batch's host bytes are the estimate's
    own), and the verdict says the search held both; the host figure is said once, in the verdict."""
    run = ("estimate", "qwen2.5-0.5b", "--gpu", "rtx-4090", "--seq", "1024", "--activation-offload", "--no-fixes")

    def out(*args: str) -> dict[str, object]:
        r = run_cli(capsys, *run, *args, "--json")
        assert r.code == 0, r.err
        d = json.loads(r.out)
        assert isinstance(d, dict)
        return d

    host = {b: out("--batch", str(b), "--host-memory-gib", "1000")["host_peak_bytes"] for b in (2, 3)}
    assert isinstance(host[2], int) and isinstance(host[3], int) and host[2] < host[3]
    unlimited = out("--batch", "1")
    assert isinstance(unlimited["max_micro_batch"], int) and unlimited["max_micro_batch"] >= 3
    limit = f"{(host[2] + host[3]) / 2 / 0.7 / GiB:.3f}"  # usable: the limit less the 30% headroom
    held = out("--batch", "1", "--host-memory-gib", limit)
    assert held["max_micro_batch"] == 2 and held["host_fits"] is True and held["fits"]
    tight = out("--batch", "3", "--host-memory-gib", limit)
    assert tight["host_fits"] is False and tight["max_micro_batch"] == 2
    text = " ".join(run_cli(capsys, *run, "--batch", "1", "--host-memory-gib", limit).out.split())
    assert "Largest micro-batch that fits the GPU and the host: 2." in text
    line = "(offloaded or paged: outside the device peak)"  # the host line of a run without a limit
    assert text.count("Host memory per node: ") == 1 and line not in text
    assert line in " ".join(run_cli(capsys, *run, "--batch", "1").out.split())


def test_every_estimate_says_its_host_memory_in_json(capsys: pytest.CaptureFixture[str]) -> None:
    """``host_peak_bytes`` is in every estimate's JSON, one GPU too, limit or not: the offloaded activations' bytes
    (as the text's "host memory" line), 0 without anything on the host."""
    off = run_cli(capsys, "estimate", "qwen2.5-0.5b", "--seq", "1024", "--activation-offload", "--json")
    plain = run_cli(capsys, "estimate", "qwen2.5-0.5b", "--seq", "1024", "--json")
    assert off.code == plain.code == 0
    host = json.loads(off.out)["host_peak_bytes"]
    assert isinstance(host, int) and host > 0 and json.loads(plain.out)["host_peak_bytes"] == 0
    limited = run_cli(capsys, "estimate", "qwen2.5-0.5b", "--seq", "1024", "--activation-offload", "--json",
                      "--gpu", "rtx-4090", "--host-memory-gib", "1000", "--no-fixes")  # fmt: skip
    assert json.loads(limited.out)["host_peak_bytes"] == host
