"""Engineered training setups for the doctor tests: each fails in one known way (or not at all).

Every factory returns ``(model, batches, loss_fn, make_optimizer)`` or a DoctorSetup, as
``trainfit doctor file.py:function`` expects.
"""

from __future__ import annotations

import torch

from trainfit.doctor import DoctorSetup


def mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).float(), y)


def regression_batches(n: int = 16, d: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d, 1, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(32, d, generator=g)
        out.append((x, x @ w))
    return out


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 1))


def healthy():
    return mlp(), regression_batches(), mse, lambda params: torch.optim.AdamW(params, lr=1e-2)


class Overflowing(torch.nn.Module):
    """``big``'s outputs reach ~1e5 (> fp16's 65504); the LayerNorm after it makes that harmless in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 32)
        self.big = torch.nn.Linear(32, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.out = torch.nn.Linear(32, 1)
        with torch.no_grad():
            self.big.weight.mul_(1e5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.big(torch.tanh(self.inp(x)))))


def overflow():
    torch.manual_seed(0)
    return Overflowing(), regression_batches(), mse, lambda params: torch.optim.AdamW(params, lr=1e-3)


def nan_batch():
    model, batches, loss_fn, make_optimizer = healthy()
    x, y = batches[5]
    x = x.clone()
    x[3, 2] = float("nan")
    batches[5] = (x, y)
    return model, batches, loss_fn, make_optimizer


def diverging_lr():
    """Least squares with SGD diverges when lr > 2/λmax of the Hessian (here ~2·E[xxᵀ] ≈ 2I): lr 1.6 does,
    0.8 does not."""
    torch.manual_seed(0)
    return torch.nn.Linear(8, 1), regression_batches(), mse, lambda params: torch.optim.SGD(params, lr=1.6)


class SqrtOfTiny(torch.nn.Module):
    """``fc``'s outputs are ~1e-7·x: representable in fp32, flushed to 0 in fp16, and d sqrt(u)/du at u = 0 is
    inf — so every fp16 gradient is non-finite at any loss scale and GradScaler halves the scale each step."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)
        with torch.no_grad():
            self.fc.weight.mul_(1e-7)
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.sqrt(self.fc(x).abs()))


def scale_collapse():
    torch.manual_seed(0)
    return SqrtOfTiny(), regression_batches(), mse, lambda params: torch.optim.AdamW(params, lr=1e-2)


def tiny_gradients():
    """A loss multiplied by 1e-8: gradients ~1e-9, below fp16's flush threshold (2.98e-8) unless scaled."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return DoctorSetup(
        model=model,
        batches=regression_batches(),
        loss_fn=lambda m, b: 1e-8 * mse(m, b),
        make_optimizer=lambda params: torch.optim.SGD(params, lr=3e6),
    )


def raises():
    raise RuntimeError("cannot build the model")


def wrong_shape():
    return torch.nn.Linear(2, 2), []
