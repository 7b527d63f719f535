"""trainfit.estimate: echoes its inputs, refuses what it does not model, shared warnings."""

from __future__ import annotations

import dataclasses

import pytest

from trainfit import Strategy, estimate, load_model
from trainfit.errors import StrategyError
from trainfit.report.json import report_json
from trainfit.strategy import Adapter, BaseWeights, MemorySavers, Parallelism


def test_report_echoes_its_inputs_and_renders_alone() -> None:
    spec = load_model("gpt2")
    s = Strategy(micro_batch=2, seq_len=512)
    r = estimate(spec, s, gpu="rtx-4090")
    assert r.model is spec and r.strategy == s and r.gpu is not None and r.gpu.id == "rtx-4090"
    assert report_json(r) == report_json(r, spec, s)


@pytest.mark.parametrize(
    "strategy",
    [
        Strategy(parallelism=Parallelism(data=2), workload="inference"),  # many GPUs: training only
        # many GPUs with adapters: not with Megatron TP/PP
        Strategy(adapter=Adapter(), parallelism=Parallelism(data=2, tensor=2), sharding="zero1"),
        Strategy(workload="inference"),
    ],
)
def test_unmodelled_setups_are_refused_not_ignored(strategy: Strategy) -> None:
    with pytest.raises(StrategyError, match=r"use trainfit.infer|are not modelled"):
        estimate("llama-3.1-8b" if strategy.adapter is not None else "gpt2", strategy)


def test_many_gpus_are_modelled_by_the_analytic_method_only() -> None:
    assert estimate("gpt2", Strategy(parallelism=Parallelism(data=2), sharding="ddp")).peak_bytes > 0
    with pytest.raises(StrategyError, match=r"models one GPU and full training only; .*2 GPUs: use --method analytic"):
        estimate("gpt2", Strategy(parallelism=Parallelism(data=2)), method="rule-of-thumb")


@pytest.mark.parametrize(("gpus", "sharding"), [(4, "ddp"), (4, "fsdp"), (1, "zero2")])
def test_memory_savers_beyond_one_plain_gpu_are_refused_saying_where_they_are_modelled(
    gpus: int, sharding: str
) -> None:
    """Each saver is modelled on one GPU without a sharding framework (analytic/savers.py): over many GPUs, or under
    ZeRO on one, the refusal names the savers and what to drop, by either method (it once said that the analytic
    method modelled one GPU and full fine-tuning only, and that trainfit did not model the rest)."""
    s = Strategy(
        parallelism=Parallelism(data=gpus),
        sharding=sharding,  # type: ignore[arg-type]
        savers=MemorySavers(loss="chunked", optimizer_in_backward=True),  # type: ignore[arg-type]
    )
    for method in ("analytic", "trace"):
        with pytest.raises(
            StrategyError,
            match=r"^the memory savers \(--loss chunked:\d+, --optimizer-in-backward\) are modelled on one GPU",
        ):
            estimate("gpt2", s, method=method)
    assert estimate("gpt2", dataclasses.replace(s, parallelism=Parallelism(), sharding="none")).peak_bytes > 0  # type: ignore[arg-type]


def test_adapters_on_a_layout_without_closed_forms_are_refused_in_one_line() -> None:
    # GPT-2's fused c_attn (a Conv1D) is modelled, over a 4-bit base too (transformers converts Conv1D); Falcon's
    # FalconLinear layers are no nn.Linear, which transformers' bitsandbytes integration leaves float: refused.
    assert estimate("gpt2", Strategy(adapter=Adapter(targets=("c_attn",)))).peak_bytes > 0
    assert estimate("gpt2", Strategy(adapter=Adapter(), base_weights=BaseWeights(quantization="nf4"))).peak_bytes > 0
    with pytest.raises(StrategyError, match="not its FalconLinear layers, which would stay float"):
        estimate("falcon-7b", Strategy(adapter=Adapter(), base_weights=BaseWeights(quantization="nf4")))
    with pytest.raises(StrategyError, match="--method rule-of-thumb models one GPU and full training only"):
        estimate("gpt2", Strategy(adapter=Adapter()), method="rule-of-thumb")


def test_gemma2_falls_back_to_eager_once() -> None:
    from pathlib import Path

    gemma2 = load_model(str(Path(__file__).parent / "fixtures" / "configs" / "tiny-gemma2.json"))
    r = estimate(gemma2, Strategy(seq_len=64))
    assert [w for w in r.warnings if "no SDPA attention" in w] == [
        f"{gemma2.name} (gemma2) has no SDPA attention in transformers; estimating eager attention"
    ]
    assert r.strategy is not None and r.strategy.attention.value == "sdpa"  # the echo is what was asked
    assert not any("no SDPA" in w for w in estimate("gemma-2b", Strategy()).warnings)  # Gemma 1 has SDPA


def test_rule_of_thumb_says_what_it_ignores_and_brackets_the_nvidia_smi_total() -> None:
    r = estimate("llama-3.2-1b", Strategy(precision="fp32", checkpointing="full"), method="rule-of-thumb")
    (w,) = r.warnings  # no SDPA warning: the rule has no attention kernel (analytic warns for fp32 GQA)
    assert "ignores --precision fp32, --checkpointing full" in w
    assert r.low_bytes is not None and r.high_bytes is not None
    assert r.low_bytes <= r.nvidia_smi_estimate_bytes <= r.high_bytes
    assert any("math kernel" in x for x in estimate("llama-3.2-1b", Strategy(precision="fp32")).warnings)
    assert estimate("llama-3.2-1b", Strategy(), method="rule-of-thumb").warnings == ()
    savers = Strategy(checkpointing="selective", savers=MemorySavers(loss="fused-linear", activation_offload=True))
    (w,) = estimate("llama-3.2-1b", savers, method="rule-of-thumb").warnings
    assert "--checkpointing selective, --loss fused-linear, --activation-offload" in w


def test_flash_attention_follows_the_gpu() -> None:
    """PyTorch has no flash kernel below compute capability 8.0: a GQA model in fp16 on a T4 gets SDPA's math
    kernel (fp32 scores), on an A100 flash; the same strategy therefore needs more memory on the T4."""
    s = Strategy(precision="amp-fp16", seq_len=1024)
    t4, a100 = estimate("qwen2.5-0.5b", s, gpu="t4"), estimate("qwen2.5-0.5b", s, gpu="a100-sxm-80gb")
    assert t4.peak_bytes > a100.peak_bytes
    assert any("has no FlashAttention kernel in PyTorch" in n for n in t4.notes)
    assert any("this GPU has no FlashAttention" in w and "math kernel" in w for w in t4.warnings)
    assert not any("FlashAttention" in x for x in (*a100.warnings, *a100.notes))
    # Without grouped heads the memory-efficient kernel takes over from flash: no fall-back to math.
    gpt2 = estimate("gpt2", Strategy(precision="amp-fp16", seq_len=1024), gpu="t4")
    assert not any("falls back to the math kernel" in w for w in gpt2.warnings)


def test_default_sequence_is_the_models_context_when_shorter() -> None:
    from typer.testing import CliRunner

    from trainfit.cli.app import app
    from trainfit.estimate import DEFAULT_SEQ_LEN, default_seq_len

    assert default_seq_len(load_model("gpt2")) == 1024 and default_seq_len(load_model("bert-base-uncased")) == 512
    assert default_seq_len(load_model("llama-3.1-8b")) == DEFAULT_SEQ_LEN
    res = CliRunner().invoke(app, ["estimate", "gpt2", "--json"])
    assert res.exit_code == 0 and "max_position_embeddings" not in res.output
    assert '"seq_len": 1024' in res.stdout and '"optimizer_impl": "fused"' in res.stdout
    # The library without a strategy takes the same default: no run GPT-2 cannot make, no warning about it.
    library = estimate("gpt2")
    assert library.strategy.seq_len == 1024 and not any("max_position_embeddings" in w for w in library.warnings)
    assert estimate("llama-3.2-1b").strategy.seq_len == DEFAULT_SEQ_LEN


@pytest.mark.parametrize("slug", ["gpt2", "bert-base-uncased", "opt-6.7b"])
def test_a_sequence_past_a_learned_position_table_is_warned_as_such(slug: str) -> None:
    """GPT-2's, BERT's and OPT's position tables end at max_position_embeddings: one token more and the lookup fails,
    so the warning says the model as configured cannot run there (a rotary model's says the estimate assumes it can:
    long-context fine-tuning runs it); at the table's length there is no warning."""
    spec = load_model(slug)
    n = spec.max_position_embeddings
    assert spec.learned_positions and n
    past = estimate(spec, Strategy(seq_len=n + 1)).warnings
    assert any("its learned position table ends there" in w and f"--seq {n})" in w for w in past), past
    assert not any("max_position_embeddings" in w for w in estimate(spec, Strategy(seq_len=n)).warnings)
    rotary = load_model("tinyllama-1.1b")
    assert rotary.max_position_embeddings is not None and not rotary.learned_positions
    longer = estimate(rotary, Strategy(seq_len=rotary.max_position_embeddings + 1)).warnings
    assert any("the estimate assumes the model can run at that length" in w for w in longer), longer


def test_deepspeed_optimizer_offload_with_a_client_optimizer_is_warned() -> None:
    """DeepSpeed refuses a client optimizer under ZeRO-Offload unless ``zero_force_ds_cpu_optimizer`` is false."""
    from trainfit.strategy import Offload, Parallelism

    base = Strategy(parallelism=Parallelism(data=8), sharding="zero2", offload=Offload.parse("optimizer"))
    said = [w for w in estimate("llama-3.2-1b", dataclasses.replace(base, optimizer="adamw-8bit")).warnings]
    assert any("zero_force_ds_cpu_optimizer" in w for w in said)
    assert not any("zero_force_ds_cpu_optimizer" in w for w in estimate("llama-3.2-1b", base).warnings)
    fsdp = dataclasses.replace(base, sharding="fsdp", offload=Offload.parse("optimizer+params"), optimizer="adamw-8bit")
    assert not any("zero_force_ds_cpu_optimizer" in w for w in estimate("llama-3.2-1b", fsdp).warnings)


def test_fsdp2_accumulation_warns_what_the_trainers_default_would_add() -> None:
    """FSDP2 with accumulation: the estimate reduce-scatters every micro-step; the HF Trainer's default (accelerate's
    no_sync) keeps every trainable parameter's unsharded gradient in the reduce dtype (fp32 under the policy) — the
    whole model's, less the 1/8 shards the estimate already holds."""
    from trainfit.analytic.parallel import fsdp_no_sync_grad_bytes
    from trainfit.strategy import Parallelism

    spec = load_model("llama-3.2-1b")
    s = Strategy(parallelism=Parallelism(data=8), sharding="fsdp", checkpointing="full", grad_accum=4)
    said = [w for w in estimate(spec, s).warnings if "accumulation steps" in w]
    assert len(said) == 1 and "sync_each_batch" in said[0]
    extra = fsdp_no_sync_grad_bytes(spec, s, 8)
    assert extra == pytest.approx(estimate(spec, s).trainable_params * 4 * 7 / 8, rel=0.01)
    assert not [w for w in estimate(spec, dataclasses.replace(s, grad_accum=1)).warnings if "accumulation steps" in w]
    zero = dataclasses.replace(s, sharding="zero3")  # DeepSpeed accumulates its own way
    assert not [w for w in estimate(spec, zero).warnings if "accumulation steps" in w]


def test_an_absurd_micro_batch_is_answered_not_crashed() -> None:
    """A micro-batch of 10⁹ on llama-3.2-1b asks for exabytes: past the expandable-segment range the simulator used
    to assert (the estimate tries expandable segments too); now it does not fit, with a smaller micro-batch."""
    r = estimate("llama-3.2-1b", Strategy(micro_batch=10**9), gpu="h100-sxm-80gb", fixes=False)
    assert r.fit is not None and not r.fit.fits and r.fit.max_micro_batch is not None
    assert r.fit.max_micro_batch < 10**9 and r.fit.required_bytes > 1000 * r.fit.gpu_memory_bytes


def test_the_fixes_for_a_micro_batch_with_many_divisors_are_searched_quickly() -> None:
    """The planner lists the divisors of the per-rank batch for its micro-batches: by trial division up to √n,
    so a batch of 2⁴⁰ is 41 divisors, not a trillion-step scan."""
    from trainfit.planner.rank import _divisors

    assert all(_divisors(n) == [k for k in range(1, n + 1) if n % k == 0] for n in range(1, 200))
    assert _divisors(1 << 40) == [1 << k for k in range(41)]
