"""The planner under the estimate's torch release, CUDA release and process history (``trainfit.planner.api.plan``,
``search_plans``): every plan's required bytes count the given release's cuBLAS/cuBLASLt workspaces and CUDA context,
and the process the run starts in — each expected delta derived from the library's own facts, not written down."""

from __future__ import annotations

import os

import pytest

from trainfit.allocator.workspaces import TARGET_TORCH, training_workspaces
from trainfit.arch import load_model
from trainfit.errors import StrategyError
from trainfit.estimate import estimate
from trainfit.hardware import get_gpu
from trainfit.history import Build, EarlierRun, ProcessHistory
from trainfit.overhead import DEFAULT_CUDA, context_bytes
from trainfit.planner.api import plan
from trainfit.planner.rank import PlanResult
from trainfit.planner.search import lower_bound_bytes
from trainfit.strategy import Parallelism, Sharding, Strategy

#: llama-3.2-1b, 8 sequences of 2048 tokens on one GPU: three plans, each with room to spare (the same plans under
#: either release).
CASE = {"gpus": 1, "seq": 2048, "global_batch": 8, "top": 3}
OLDER = (2, 11)  # before 2.12: cuBLASLt has its own workspace next to cuBLAS's (allocator.workspaces)


def _required(result: PlanResult) -> list[tuple[tuple[str, ...], int]]:
    return [(p.changes, p.required_bytes) for p in result.plans]


def _workspace_bytes(gpu: str, torch_version: tuple[int, int]) -> int:
    cc = get_gpu(gpu).compute_capability
    assert cc is not None
    major, minor = (int(x) for x in cc.split("."))
    return sum(w.size_bytes for w in training_workspaces((major, minor), os.environ, torch_version=torch_version))


@pytest.mark.parametrize("gpu", ["h100-sxm-80gb", "h200-sxm-141gb"])
def test_an_older_torch_adds_the_separate_cublaslt_workspace_to_every_plan(
    gpu: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A 20 MiB cuBLASLt workspace is a large-pool request in a segment of its own, so the simulated reserve moves by
    # exactly its size (the default 1 MiB one lands in the small pool's 2 MiB segments, where the slack of a
    # segment may absorb it: the lower bound below holds the default to the exact delta).
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", str(20 * 1024))
    delta = _workspace_bytes(gpu, OLDER) - _workspace_bytes(gpu, TARGET_TORCH)
    assert delta == 20 * 2**20  # torch 2.13 unifies the Lt workspace with cuBLAS's on sm90 (none of its own)
    new = plan("llama-3.2-1b", gpu, **CASE)  # type: ignore[arg-type]
    old = plan("llama-3.2-1b", gpu, torch_version="2.11", **CASE)  # type: ignore[arg-type]
    assert new.torch_version == TARGET_TORCH and old.torch_version == OLDER
    assert new.plans and [c for c, _ in _required(old)] == [c for c, _ in _required(new)]
    for (_, before), (_, after) in zip(_required(new), _required(old), strict=True):
        assert after - before == delta
    # asked again at 2.13 after 2.11: nothing of the 2.11 search is served from a memo
    assert _required(plan("llama-3.2-1b", gpu, **CASE)) == _required(new)  # type: ignore[arg-type]


@pytest.mark.parametrize("gpu", ["h100-sxm-80gb", "a100-sxm-80gb"])
def test_the_lower_bound_counts_the_releases_workspaces_and_context(gpu: str) -> None:
    """The search's closed-form bound (and the estimate's micro-batch search's) moves with the releases exactly as
    the workspaces and the context do — a bound for the default releases could exceed the estimate of another."""
    spec, g = load_model("llama-3.2-1b"), get_gpu(gpu)
    s = Strategy(micro_batch=4, seq_len=2048)
    base = lower_bound_bytes(spec, s, g)
    older = lower_bound_bytes(spec, s, g, torch_version=OLDER)
    assert older - base == _workspace_bytes(gpu, OLDER) - _workspace_bytes(gpu, TARGET_TORCH)
    eager = lower_bound_bytes(spec, s, g, cuda_version=(11, 6))
    assert eager - base == context_bytes(g, (11, 6))[0] - context_bytes(g, DEFAULT_CUDA)[0] > 0


def test_cuda_before_11_7_adds_the_eager_loading_context_to_every_plan() -> None:
    gpu = "a100-sxm-80gb"  # CUDA 11.6 runs an A100 (an H100 needs 11.8)
    g = get_gpu(gpu)
    eager = context_bytes(g, (11, 6))[0] - context_bytes(g, DEFAULT_CUDA)[0]
    assert eager > 0
    new = plan("llama-3.2-1b", gpu, **CASE)  # type: ignore[arg-type]
    old = plan("llama-3.2-1b", gpu, cuda_version="11.6", **CASE)  # type: ignore[arg-type]
    assert new.cuda_version == DEFAULT_CUDA and old.cuda_version == (11, 6)
    assert new.plans and [c for c, _ in _required(old)] == [c for c, _ in _required(new)]
    for (_, before), (_, after) in zip(_required(new), _required(old), strict=True):
        assert after - before == eager


def test_each_plan_is_what_the_estimate_says_under_the_same_releases_and_history() -> None:
    """A plan's required bytes are ``estimate``'s for its strategy with the same releases and process history (one
    GPU: the process history moves the simulated reserve), and the history moves at least one plan."""
    spec, gpu = load_model("llama-3.2-1b"), "h100-sxm-80gb"
    history = ProcessHistory(
        build=Build.ON_DEVICE,
        warm_up=True,
        after=(EarlierRun(model=load_model("qwen2.5-0.5b"), strategy=Strategy(micro_batch=4, seq_len=2048)),),
    )
    fresh = plan(spec, gpu, torch_version="2.11", cuda_version="12.8", **CASE)  # type: ignore[arg-type]
    after = plan(spec, gpu, torch_version="2.11", cuda_version="12.8", history=history, **CASE)  # type: ignore[arg-type]
    assert after.history == history and fresh.history == ProcessHistory()
    assert after.notes and "warm-up" in after.notes[0] and not fresh.notes
    assert _required(after) != _required(fresh)
    for p in after.plans:
        rep = estimate(
            spec,
            p.strategy,
            gpu=gpu,
            search_micro_batch=False,
            allocator=p.alloc_conf,
            torch_version="2.11",
            cuda_version="12.8",
            history=history,
        )
        assert rep.fit is not None and rep.fit.required_bytes == p.required_bytes


def test_a_process_history_over_many_gpus_is_refused_not_ignored() -> None:
    """The estimate models a process history for one GPU: a search over more would rank plans estimated for
    different processes against each other, so it is one line, not a silent fresh process."""
    with pytest.raises(StrategyError, match=r"one GPU only.*--gpus 1"):
        plan("llama-3.2-1b", "h100-sxm-80gb", gpus=8, global_batch=64, history=ProcessHistory(warm_up=True))
    # a fresh process is no history at all: many GPUs are planned as before
    assert plan("llama-3.2-1b", "h100-sxm-80gb", gpus=2, global_batch=16, top=1, history=ProcessHistory()).plans


def test_an_earlier_run_the_estimate_cannot_replay_is_one_line_before_the_search() -> None:
    """Not "nothing fits": every candidate's estimate would refuse the same earlier run."""
    many = Strategy(parallelism=Parallelism.for_gpus(2), sharding=Sharding.DDP)
    history = ProcessHistory(after=(EarlierRun(model=load_model("gpt2"), strategy=many),))
    with pytest.raises(StrategyError, match="--after: an earlier run in the process is one GPU's"):
        plan("llama-3.2-1b", "h100-sxm-80gb", gpus=1, global_batch=8, history=history)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"torch_version": "2.5"}, "--torch-version: torch 2.5: the workspace rules are known from torch 2.9 on"),
        ({"torch_version": "new"}, "--torch-version: torch version 'new' is not MAJOR.MINOR"),
        ({"cuda_version": "11.6"}, "--cuda-version: h100-sxm-80gb"),
        ({"cuda_version": "twelve"}, "--cuda-version"),
    ],
)
def test_bad_releases_are_refused_as_the_estimate_refuses_them(kwargs: dict[str, str], says: str) -> None:
    with pytest.raises(StrategyError) as exc:
        plan("llama-3.2-1b", "h100-sxm-80gb", gpus=1, global_batch=8, **kwargs)  # type: ignore[arg-type]
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_one_gpu_rank_streams_are_left_out_with_a_note_under_a_history() -> None:
    """On one GPU, ZeRO/FSDP/offload/DeepSpeed candidates run a rank's stream, which takes no process history: the
    search leaves them out and says how many, rather than estimating them for a fresh process unsaid."""
    spec, gpu = load_model("qwen2.5-1.5b"), "t4"
    fresh = plan(spec, gpu, gpus=1, seq=2048, global_batch=8, top=3)
    assert any(p.strategy.is_distributed for p in fresh.plans)  # offloading plans rank here for a fresh process
    warm = plan(spec, gpu, gpus=1, seq=2048, global_batch=8, top=3, history=ProcessHistory(warm_up=True))
    assert not any(p.strategy.is_distributed for p in warm.plans)
    assert warm.closest is None or not warm.closest.strategy.is_distributed
    (skipped,) = [n for n in warm.notes if "candidates not searched" in n]
    assert f"of {warm.candidates} candidates" in skipped and "rank's stream" in skipped
