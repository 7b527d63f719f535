"""The HF Trainer and Lightning callbacks feed the monitor (tested when those packages are installed)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from trainfit.train import EventKind, StabilityMonitor


class TinyRegressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.lin(x)
        loss = torch.nn.functional.mse_loss(out.float(), y) if y is not None else out.sum()
        return {"loss": loss, "logits": out}


def rows(n: int, nan_at: int | None = None) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    data = []
    for i in range(n):
        x = torch.randn(4, generator=g)
        if i == nan_at:
            x[0] = math.nan
        data.append({"x": x, "y": x.sum(0, keepdim=True)})
    return data


# ----------------------------------------------------------------------------- Hugging Face
def test_hf_callback_reads_accelerate_optimizer_skip_and_scale():
    pytest.importorskip("transformers")
    from trainfit.train.callbacks.hf import StabilityCallback

    cb = StabilityCallback(StabilityMonitor(log_events=False))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    opt = SimpleNamespace(scaler=scaler, step_was_skipped=True)
    control = SimpleNamespace(should_training_stop=False)
    cb.on_train_begin(SimpleNamespace(fp16=True, bf16=False, max_grad_norm=1.0), None, control)
    cb.on_step_end(None, SimpleNamespace(global_step=1), control, optimizer=opt)
    (stats,) = cb.monitor.history
    assert stats.skipped is True and stats.loss_scale == 1024.0
    assert cb.monitor.precision == "amp-fp16" and cb.monitor.max_grad_norm == 1.0


@pytest.mark.parametrize(("nan_filter", "kind"), [(False, EventKind.NONFINITE_LOSS), (True, EventKind.NONFINITE_GRAD)])
def test_hf_trainer_nan_event_stops_training(tmp_path, nan_filter, kind):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from trainfit.train.callbacks.hf import StabilityCallback

    cb = StabilityCallback(StabilityMonitor(log_events=False), stop_on={kind})
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=12, per_device_train_batch_size=1, logging_steps=1,
        learning_rate=1e-2, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0, logging_nan_inf_filter=nan_filter,
    )  # fmt: skip
    trainer = transformers.Trainer(model=TinyRegressor(), args=args, train_dataset=rows(12, nan_at=4), callbacks=[cb])
    trainer.train()
    first = cb.monitor.events[0]
    assert first.kind is kind
    # stopped right after the step that produced the NaN (the sampler shuffles, so which step varies)
    assert trainer.state.global_step == first.step < 12
    assert all(s.grad_norm is not None for s in cb.monitor.history)


# ----------------------------------------------------------------------------- Lightning
def _lightning_module(nan_at: int | None):
    pl = pytest.importorskip("lightning.pytorch")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = TinyRegressor()

        def training_step(self, batch, batch_idx):
            return self.net(batch["x"], batch["y"])["loss"]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(rows(12, nan_at=nan_at), batch_size=1)

    return pl, Module()


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*")
def test_lightning_callback_nan_event_and_stop():
    pl, module = _lightning_module(nan_at=4)
    from trainfit.train.callbacks.lightning import StabilityCallback

    cb = StabilityCallback(StabilityMonitor(log_events=False), stop_on={"nonfinite-loss"})
    trainer = pl.Trainer(max_steps=12, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
                         gradient_clip_val=1.0)  # fmt: skip
    trainer.fit(module)
    assert cb.monitor.events[0].kind is EventKind.NONFINITE_LOSS
    assert cb.monitor.events[0].step == 4
    assert trainer.global_step == 5
    assert cb.monitor.max_grad_norm == 1.0 and cb.monitor.precision == "fp32"
    assert cb.monitor.history[0].grad_norm is not None and math.isfinite(cb.monitor.history[0].grad_norm)


def test_lightning_callback_infers_skips_from_the_scaler():
    """Lightning turns 16-mixed into bf16-mixed on the CPU, so the fp16 path is driven with a stand-in trainer
    holding a real GradScaler."""
    pytest.importorskip("lightning.pytorch")
    from trainfit.train.callbacks.lightning import StabilityCallback

    cb = StabilityCallback(StabilityMonitor(log_events=False))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.tensor(1.0))  # creates the scale tensor, as the first backward would
    opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    trainer = SimpleNamespace(global_step=0, precision_plugin=SimpleNamespace(scaler=scaler), optimizers=[opt])
    for step, new_scale in enumerate([1024.0, 512.0, 512.0]):
        scaler.update(new_scale)  # what GradScaler.update does after a clean step / an overflow
        trainer.global_step = step + 1
        cb.on_train_batch_end(trainer, None, {"loss": torch.tensor(1.0)}, None, step)
    assert [s.skipped for s in cb.monitor.history] == [False, True, False]
    assert [s.loss_scale for s in cb.monitor.history] == [1024.0, 512.0, 512.0]
