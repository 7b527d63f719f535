"""The built-in demo for ``trainfit doctor --demo``: a small network engineered to overflow in fp16.

An MLP regression whose middle layer (``amplify``) has weights ×30000, so its outputs reach ~1e5 — beyond
fp16's 65504 but harmless in fp32 because a LayerNorm right after it rescales them. In fp32 it trains;
under fp16 autocast ``amplify``'s output is inf, the LayerNorm turns it into NaN and every step fails.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from trainfit.doctor.setup import DoctorSetup


class DemoNet(torch.nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, width)
        self.act = torch.nn.GELU()
        self.amplify = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, 1)
        with torch.no_grad():
            self.amplify.weight.mul_(30000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.embed(x))
        out: torch.Tensor = self.head(self.norm(self.amplify(h)))
        return out


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).float(), y)


def _optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def setup() -> DoctorSetup:
    """Factory in the form ``trainfit doctor`` expects (``trainfit.doctor.demo:setup``)."""
    torch.manual_seed(0)
    model = DemoNet()
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 1, generator=g)
    batches = []
    for _ in range(16):
        x = torch.randn(32, 8, generator=g) * 3
        batches.append((x, x @ w))
    return DoctorSetup(model=model, batches=batches, loss_fn=_loss, make_optimizer=_optimizer)
