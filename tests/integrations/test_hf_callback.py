"""TrainfitCallback inside a real transformers Trainer on the CPU: a tiny Llama (tests/trace/conftest.py's config),
one real training step. It warns before the first step when the run will not fit the GPU named, with the numbers
of a direct ``trainfit.estimate`` of the same run (its Strategy written here by hand), and stays quiet when it
fits; it never raises into training."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from tests.trace.conftest import TINY, tiny_spec
from trainfit import estimate
from trainfit.integrations.hf import TrainfitCallback, TrainfitMemoryWarning
from trainfit.strategy import Strategy


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _train(tmp_path: Path, callback: TrainfitCallback, *, batch: int, **extra: Any) -> tuple[Trainer, list[Any]]:
    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in TINY["llama"].items() if k != "model_type"})
    model = LlamaForCausalLM(cfg)
    data = [{"input_ids": torch.randint(0, 256, (16,)), "labels": torch.randint(0, 256, (16,))} for _ in range(4)]
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=1, per_device_train_batch_size=batch, report_to="none",
        save_strategy="no", logging_strategy="no", **extra,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return trainer, [w for w in caught if issubclass(w.category, TrainfitMemoryWarning)]


def test_warns_before_the_first_step_when_it_does_not_fit(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cb = TrainfitCallback(gpu="l4", seq_len=512)
    with caplog.at_level(logging.INFO, logger="trainfit"):
        trainer, caught = _train(tmp_path, cb, batch=100_000)
    assert trainer.state.global_step == 1  # training went on
    # the same run, spelled out: fp32 (no bf16/fp16), HF's default optim adamw_torch_fused, one GPU
    direct = estimate(
        tiny_spec("llama"),
        Strategy(precision="fp32", optimizer="adamw", optimizer_impl="fused", micro_batch=100_000, seq_len=512),
        gpu="l4",
    )
    assert direct.fit is not None and not direct.fit.fits
    assert cb.report is not None and cb.report.peak_bytes == direct.peak_bytes
    assert len(caught) == 1
    message = str(caught[0].message)
    assert f"peak {_gib(direct.peak_bytes)} allocated" in message
    assert f"{_gib(direct.fit.required_bytes)} needed of {_gib(direct.fit.usable_bytes)} usable" in message
    assert "DOES NOT FIT" in message and "Top fix:" in message
    assert any("DOES NOT FIT" in r.getMessage() for r in caplog.records)


def test_quiet_when_it_fits(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cb = TrainfitCallback(gpu="l4", seq_len=16)
    with caplog.at_level(logging.INFO, logger="trainfit"):
        _, caught = _train(tmp_path, cb, batch=2, gradient_accumulation_steps=2)
    direct = estimate(tiny_spec("llama"), Strategy(precision="fp32", micro_batch=2, grad_accum=2, seq_len=16), gpu="l4")
    assert direct.fit is not None and direct.fit.fits
    assert cb.report is not None and cb.report.peak_bytes == direct.peak_bytes
    assert caught == []
    assert any("— fits" in r.getMessage() for r in caplog.records)


def test_a_trainfit_error_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cb = TrainfitCallback(gpu="no-such-gpu", seq_len=16)
    with caplog.at_level(logging.WARNING, logger="trainfit"):
        trainer, caught = _train(tmp_path, cb, batch=2)
    assert trainer.state.global_step == 1 and caught == [] and cb.report is None
    assert any("could not estimate this run" in r.getMessage() for r in caplog.records)


def test_a_peft_lora_model_is_estimated_with_its_adapter(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    from trainfit.strategy import finetune_setup

    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in TINY["llama"].items() if k != "model_type"})
    model = get_peft_model(
        LlamaForCausalLM(cfg), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    data = [{"input_ids": torch.randint(0, 256, (16,)), "labels": torch.randint(0, 256, (16,))} for _ in range(4)]
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, max_steps=1, per_device_train_batch_size=2,
                             report_to="none", save_strategy="no", logging_strategy="no")  # fmt: skip
    cb = TrainfitCallback(gpu="l4", seq_len=16)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]).train()
    adapter, base = finetune_setup("lora", rank=4, alpha=8, targets="q_proj,v_proj", base_dtype="fp32")
    # PEFT/Trainer turn the live config's use_cache off by on_train_begin (no DynamicCache copies in the forward,
    # DESIGN §4.5): the callback reads the live config, so the direct estimate is of that model
    assert cb.report is not None and cb.report.model is not None and cb.report.model.use_cache is False
    direct = estimate(
        tiny_spec("llama", use_cache=False),
        Strategy(precision="fp32", micro_batch=2, seq_len=16, adapter=adapter, base_weights=base),
        gpu="l4",
    )
    assert cb.report.trainable_params == direct.trainable_params
    assert cb.report.trainable_params == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert cb.report.peak_bytes == direct.peak_bytes


def test_bf16_weights_with_bf16_arguments_are_pure_bf16() -> None:
    """A model loaded in bf16 under ``bf16=True``: autocast casts nothing and AdamW keeps bf16 states."""
    from trainfit.integrations.hf import estimate_trainer_run

    cfg = LlamaConfig(**{k: v for k, v in TINY["llama"].items() if k != "model_type"})
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    args = TrainingArguments(output_dir="x", use_cpu=True, bf16=True, per_device_train_batch_size=2, report_to="none")
    report = estimate_trainer_run(args, model, gpu="l4", seq_len=32)
    assert report.strategy is not None and report.strategy.precision.value == "pure-bf16"
    direct = estimate(tiny_spec("llama"), Strategy(precision="pure-bf16", micro_batch=2, seq_len=32), gpu="l4")
    assert report.peak_bytes == direct.peak_bytes
