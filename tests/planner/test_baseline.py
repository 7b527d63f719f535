"""The planner's baseline: ``plan(baseline=...)`` is what ``trainfit plan`` runs for its run flags, its default is
:func:`plan_baseline`, and each plan's changes are flags that apply to the baseline's own command."""

from __future__ import annotations

import json

import pytest

from tests.cli._cli_helper import run_cli
from trainfit.arch import load_model
from trainfit.errors import ConfigError, StrategyError
from trainfit.planner.api import plan, plan_baseline
from trainfit.planner.rank import baseline_flags, describe_changes
from trainfit.planner.space import Finetune, baseline_allows, baseline_method
from trainfit.planner.workload import PlanWorkload
from trainfit.report.plan import plan_json
from trainfit.strategy import Float8, MemorySavers, Parallelism, Sharding, Strategy, finetune_setup

ARGS = {"seq": 1024, "global_batch": 8, "gpus": 1, "top": 3}


def _tuned(method: str, **kw: object) -> Strategy:
    adapter, base = finetune_setup(method, **kw)  # type: ignore[arg-type]
    return Strategy(seq_len=1024, micro_batch=8, adapter=adapter, base_weights=base)


def test_library_baseline_equals_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    """``plan(baseline=...)`` with the Strategy the flags describe gives the CLI's JSON, key for key."""
    spec = load_model("qwen2.5-0.5b")
    baseline = Strategy(seq_len=1024, micro_batch=2, precision="fp32", checkpointing="full")
    result = plan(spec, "rtx-4090", baseline=baseline, **ARGS)  # type: ignore[arg-type]
    r = run_cli(capsys, "plan", "qwen2.5-0.5b", "--gpu", "rtx-4090", "--gpus", "1", "--seq", "1024",
                "--global-batch", "8", "--top", "3", "--precision", "fp32", "--checkpointing", "full", "--batch", "2",
                "--json")  # fmt: skip
    assert r.code == 0, r.err
    assert plan_json(result) | {"exported": []} == json.loads(r.out)
    assert result.baseline == baseline


def test_without_a_baseline_the_default_is_plan_baseline() -> None:
    spec = load_model("qwen2.5-0.5b")
    default = plan(spec, "rtx-4090", **ARGS)  # type: ignore[arg-type]
    b = plan_baseline(gpus=1, seq=1024, global_batch=8)
    assert default.baseline == b and b.micro_batch == 8 and b.sharding is Sharding.NONE
    given = plan(spec, "rtx-4090", baseline=b, **ARGS)  # type: ignore[arg-type]
    assert given.plans == default.plans
    # many GPUs: DDP over the GPUs that divide the global batch, all of it in one micro-batch each
    many = plan_baseline(gpus=8, seq=1024, global_batch=12)
    assert many.world_size == 4 and many.micro_batch == 3 and many.sharding is Sharding.DDP


def test_one_workload_for_the_baseline_and_the_search() -> None:
    """``PlanWorkload`` (what ``trainfit plan`` builds once from --gpus/--nodes/--gpus-per-node/--seq/--global-batch/
    --tokens-per-step) gives ``plan_baseline`` and ``plan`` what the same keywords give; not both at once."""
    spec = load_model("qwen2.5-0.5b")
    w = PlanWorkload(gpus=1, seq=1024, global_batch=8)
    assert (w.world, w.sequences, w.batch_given) == (1, 8, True)
    assert plan_baseline(w) == plan_baseline(gpus=1, seq=1024, global_batch=8)
    by_value = plan(spec, "rtx-4090", workload=w, top=3)
    assert by_value.plans == plan(spec, "rtx-4090", **ARGS).plans  # type: ignore[arg-type]
    assert by_value.baseline == plan_baseline(w)
    nodes = PlanWorkload(nodes=2, gpus_per_node=4, tokens_per_step="64k", seq=2048)
    assert (nodes.world, nodes.sequences, PlanWorkload().sequences) == (8, 32, 8)
    with pytest.raises(ConfigError, match=r"give a PlanWorkload or its sizes \(gpus, seq\), not both"):
        plan(spec, "rtx-4090", workload=w, gpus=1, seq=1024)
    with pytest.raises(ConfigError, match="not both"):
        plan_baseline(w, global_batch=8)


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ({"gpus": 0}, "--gpus must be positive"),
        ({"gpus": 3, "nodes": 1}, "is not --nodes 1 × --gpus-per-node 8"),
        ({"gpus_per_node": 0}, "--gpus-per-node must be positive"),
        ({"seq": 0}, "--seq must be positive"),
        ({"global_batch": 8, "tokens_per_step": "8192"}, "not both"),
        ({"tokens_per_step": "1000", "seq": 1024}, "whole number of sequences"),
        ({"global_batch": 0}, "--global-batch must be positive"),
    ],
)
def test_a_bad_workload_is_refused_when_built(sizes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PlanWorkload(**sizes)  # type: ignore[arg-type]


def test_a_baseline_at_another_sequence_length_is_refused() -> None:
    with pytest.raises(ConfigError, match="not the plan's --seq 1024"):
        plan("qwen2.5-0.5b", "rtx-4090", baseline=Strategy(seq_len=2048), **ARGS)  # type: ignore[arg-type]


def test_a_baseline_the_estimate_refuses_is_refused() -> None:
    bad = Strategy(seq_len=1024, micro_batch=8, checkpointing="sac", attention="eager")
    with pytest.raises(StrategyError, match="--checkpointing sac"):
        plan("qwen2.5-0.5b", "rtx-4090", baseline=bad, **ARGS)  # type: ignore[arg-type]


def test_what_a_baseline_opens_the_search_to() -> None:
    full = Strategy(seq_len=1024)
    assert baseline_allows(full) == ((), False)
    assert baseline_allows(_tuned("lora")) == ((Finetune.LORA, Finetune.QLORA), False)
    assert baseline_allows(Strategy(seq_len=1024, float8=Float8.TENSORWISE))[1]
    assert baseline_method(_tuned("qlora")) is Finetune.QLORA
    assert baseline_method(_tuned("lora", base_dtype="nf4")) is Finetune.LORA  # not k-bit prepared
    assert baseline_method(_tuned("freeze", freeze="embeddings")) is Finetune.FULL


@pytest.mark.parametrize(
    ("plan_run", "baseline", "change"),
    [
        (("lora", {}), ("full", {}), "--finetune lora"),
        (("qlora", {}), ("full", {}), "--finetune qlora"),
        (("qlora", {}), ("lora", {"base_dtype": "int8"}), "--finetune qlora --base-dtype nf4"),
        (("full", {}), ("lora", {"base_dtype": "int8"}), "--finetune full without --base-dtype"),
        (("lora", {}), ("qlora", {}), "--finetune lora"),
        (("lora", {}), ("qlora", {"base_dtype": "fp4"}), "--finetune lora without --base-dtype"),
        (("full", {}), ("qlora", {}), "--finetune full"),
        (("full", {}), ("freeze", {"freeze": "embeddings"}), "without --finetune freeze --freeze"),
        (("lora", {}), ("freeze", {"freeze": "embeddings"}), "--finetune lora without --freeze"),
    ],
)
def test_a_fine_tuning_change_applies_to_the_baseline_command(
    plan_run: tuple[str, dict[str, object]], baseline: tuple[str, dict[str, object]], change: str
) -> None:
    assert describe_changes(_tuned(plan_run[0], **plan_run[1]), _tuned(baseline[0], **baseline[1])) == (change,)


def test_changes_name_the_attention_implementation_and_paging() -> None:
    """What the search takes from the baseline never differs in a plan; a baseline described from the defaults
    says it (and the paged optimizer, which the search does not carry)."""
    b = Strategy(seq_len=1024, attention="eager", optimizer_impl="foreach", optimizer="adamw-8bit")
    assert baseline_flags(b) == ("--optimizer adamw-8bit", "--attention eager", "--optimizer-impl foreach")
    paged = Strategy(seq_len=1024, optimizer="adamw-8bit", savers=MemorySavers(paged_optimizer=True))
    assert describe_changes(b, paged)[0] == "--optimizer adamw-8bit without --paged-optimizer"
    assert describe_changes(paged, b)[0] == "--optimizer paged-adamw-8bit"
    ddp = Strategy(seq_len=1024, micro_batch=4, parallelism=Parallelism.for_gpus(2), sharding="ddp")
    assert baseline_flags(ddp) == ("--gpus 2", "--sharding ddp", "--batch 4 --grad-accum 1")
