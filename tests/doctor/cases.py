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


# ---------------------------------------------------------------------------------------------------------
# The doctor's corpus: one MLP, fc1 → GELU → fc2 → GELU → LayerNorm → head, on 16 random regression
# batches of 32×16 with an MSE loss, and variants that each break it in one known way.


class CorpusMLP(torch.nn.Module):
    def __init__(self, d: int = 16, width: int = 32) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(d, width)
        self.act1 = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(width, width)
        self.act2 = torch.nn.GELU()
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.norm(self.act2(self.fc2(self.act1(self.fc1(x))))))
        return out


def corpus_model(seed: int = 0, **scales: float) -> CorpusMLP:
    """The corpus MLP from ``seed``, with ``name=factor`` multiplying that layer's weight."""
    torch.manual_seed(seed)
    model = CorpusMLP()
    with torch.no_grad():
        for name, factor in scales.items():
            getattr(model, name).weight.mul_(factor)
    return model


def corpus_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return regression_batches(n=16, d=16, seed=1)


def adamw(lr: float = 1e-3):
    return lambda params: torch.optim.AdamW(params, lr=lr)


def corpus_healthy() -> DoctorSetup:
    return DoctorSetup(model=corpus_model(), batches=corpus_batches(), loss_fn=mse, make_optimizer=adamw())


def corpus_healthy_late_calibration() -> DoctorSetup:
    """The healthy corpus MLP from seed 4: under amp-fp16 its GradScaler skips steps 0, 1, 3 and 9 while the
    scale settles at 4096 — calibration, interleaved with clean steps."""
    return DoctorSetup(model=corpus_model(seed=4), batches=corpus_batches(), loss_fn=mse, make_optimizer=adamw())


def corpus_forward_overflow() -> DoctorSetup:
    """fc2's weights ×1e5 (absmax 1.8e4, within fp16): its outputs reach ~9e4 (> fp16's 65504); the LayerNorm
    after it makes that harmless in fp32. In fp16 fc2's own matmul overflows: the module to fix is fc2."""
    return DoctorSetup(model=corpus_model(fc2=1e5), batches=corpus_batches(), loss_fn=mse, make_optimizer=adamw())


def corpus_backward_overflow() -> DoctorSetup:
    """fc1's weights and bias ×3e-6 and fc2's weights ×3e5 (absmax 5.3e4, within fp16): the forward values
    stay within range (fc2 undoes fc1's scale, the LayerNorm the rest), but fc2's backward multiplies the
    gradient by its 3e5-scaled weights: the gradient of act1's output — fc2's input — reaches ~1e5, beyond
    fp16 even unscaled. fc1's parameter gradients overflow too, later in the backward pass and because
    of what fc2 sent back. The module whose backward leaves the range is fc2."""
    model = corpus_model(fc2=3e5)
    with torch.no_grad():
        model.fc1.weight.mul_(3e-6)
        model.fc1.bias.mul_(3e-6)
    return DoctorSetup(model=model, batches=corpus_batches(), loss_fn=mse, make_optimizer=adamw())


def corpus_nan_data() -> DoctorSetup:
    batches = corpus_batches()
    x, y = batches[5]
    x = x.clone()
    x[3, 2] = float("nan")
    batches[5] = (x, y)
    return DoctorSetup(model=corpus_model(), batches=batches, loss_fn=mse, make_optimizer=adamw())


def corpus_inf_label() -> DoctorSetup:
    batches = corpus_batches()
    x, y = batches[7]
    y = y.clone()
    y[10, 0] = float("inf")
    batches[7] = (x, y)
    return DoctorSetup(model=corpus_model(), batches=batches, loss_fn=mse, make_optimizer=adamw())


def corpus_sgd_high_lr() -> DoctorSetup:
    return DoctorSetup(
        model=corpus_model(),
        batches=corpus_batches(),
        loss_fn=mse,
        make_optimizer=lambda params: torch.optim.SGD(params, lr=5.0),
    )


def corpus_adam_high_lr() -> DoctorSetup:
    return DoctorSetup(
        model=corpus_model(),
        batches=corpus_batches(),
        loss_fn=mse,
        make_optimizer=lambda params: torch.optim.Adam(params, lr=10.0),
    )


class ReluHot(torch.nn.Module):
    """``Linear(16,64) → ReLU → Linear(64,64) "hot" → ReLU → head``, ``hot``'s weights multiplied by ``factor``."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(16, 64)
        self.act1 = torch.nn.ReLU()
        self.hot = torch.nn.Linear(64, 64)
        self.act2 = torch.nn.ReLU()
        self.head = torch.nn.Linear(64, 1)
        with torch.no_grad():
            self.hot.weight.mul_(factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.act2(self.hot(self.act1(self.embed(x)))))
        return out


def relu_hot(factor: float, input_scale: float = 1.0) -> DoctorSetup:
    torch.manual_seed(0)
    batches = [(x * input_scale, y) for x, y in corpus_batches()]
    return DoctorSetup(model=ReluHot(factor), batches=batches, loss_fn=mse, make_optimizer=adamw())
