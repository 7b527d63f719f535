"""Range scan counts agree with real torch casts; the tracker finds Inf that detect_anomaly misses."""

from __future__ import annotations

import math

import pytest
import torch

from trainfit.doctor.graph import LOSS_FUNCTION, CallGraph
from trainfit.doctor.locate import NonfiniteTracker, Where
from trainfit.doctor.scan import TensorRole, range_scan
from trainfit.precision.formats import BF16, FP16


class Emit(torch.nn.Module):
    """Outputs a fixed tensor times a trainable scalar (so it has gradients)."""

    def __init__(self, values: torch.Tensor) -> None:
        super().__init__()
        self.values = values
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.values * self.w + 0 * x.sum()


def log_uniform(n: int, lo: float, hi: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    exps = torch.empty(n).uniform_(lo, hi, generator=g)
    signs = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    return signs * torch.pow(10.0, exps)


def test_activation_counts_match_torch_casts():
    values = log_uniform(5000, -12, 7)
    model = torch.nn.Sequential(Emit(values))
    rows = range_scan(model, [torch.zeros(1)], lambda m, b: m(b).sum(), FP16)
    (act,) = [r for r in rows if r.module == "0" and r.role is TensorRole.ACTIVATION]
    half = values.half()
    assert act.overflow == int(torch.isinf(half).sum())
    assert act.flushed == int(((values != 0) & (half == 0)).sum())
    assert act.absmax == float(values.abs().max())
    rows_bf16 = range_scan(model, [torch.zeros(1)], lambda m, b: m(b).sum(), BF16)
    assert next(r for r in rows_bf16 if r.role is TensorRole.ACTIVATION).overflow == 0


def test_gradients_are_evaluated_at_the_loss_scale():
    grads = log_uniform(4000, -12, -2, seed=3)
    model = torch.nn.Sequential(Emit(torch.ones(4000)))
    loss_fn = lambda m, b: (m(b) * grads).sum()  # noqa: E731 — d loss / d output = grads
    unscaled = range_scan(model, [torch.zeros(1)], loss_fn, FP16, grad_scale=1.0)
    scaled = range_scan(model, [torch.zeros(1)], loss_fn, FP16, grad_scale=65536.0)
    u = next(r for r in unscaled if r.role is TensorRole.ACTIVATION_GRAD)
    s = next(r for r in scaled if r.role is TensorRole.ACTIVATION_GRAD)
    assert u.flushed == int((grads.half() == 0).sum())
    assert s.flushed == int(((grads * 65536.0).half() == 0).sum()) < u.flushed
    assert s.flushed_unscaled == u.flushed


class ZeroThenSqrt(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.weight.zero_()
            self.lin.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(self.lin(x)).sum()  # forward 0; d sqrt/du at 0 = +inf


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
def test_backward_inf_found_where_detect_anomaly_is_silent():
    model = ZeroThenSqrt()
    x = torch.rand(2, 4) + 0.1
    with torch.autograd.detect_anomaly():
        model(x).backward()  # no error: detect_anomaly only looks for NaN
    assert torch.isinf(model.lin.weight.grad).all()
    model.zero_grad()
    tracker = NonfiniteTracker(model)
    tracker.step = 7
    model(x).backward()
    tracker.close()
    assert tracker.forward == {}
    origin = tracker.backward[7]
    assert (origin.module, origin.where, origin.what) == ("lin", Where.OUTPUT_GRAD, "Inf")
    assert origin.producer == "(model)"  # the sqrt inline in the model's forward made it


def test_forward_origin_is_the_module_not_its_consumers():
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)
            self.c = torch.nn.Linear(4, 1)
            with torch.no_grad():
                self.b.weight.fill_(1e30)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(self.b(self.a(x)) * 1e30)

    model = Net()
    tracker = NonfiniteTracker(model)
    model(torch.ones(1, 4))
    tracker.close()
    # b's output is finite (1e30·…), the multiplication by 1e30 inside the root's forward overflows fp32;
    # c receives inf and is not the origin: the root module is.
    assert tracker.forward[0].module == "(model)"


def test_hooks_tolerate_inplace_relu():
    """Full backward hooks raise on ReLU(inplace=True) after a hooked module; the doctor's hooks do not."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(inplace=True), torch.nn.Linear(4, 1))
    tracker = NonfiniteTracker(model)
    model(torch.randn(2, 4)).sum().backward()
    tracker.close()
    assert tracker.forward == {} and tracker.backward == {}
    rows = range_scan(model, [torch.randn(2, 4)], lambda m, b: m(b).sum(), FP16)
    # the in-place ReLU returns the very tensor Linear 0 produced, which is counted once, under "0"
    assert {r.module for r in rows if r.role is TensorRole.ACTIVATION} == {"0", "2"}


class _BlowUpGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by inf."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g * math.inf


class BlowUp(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _BlowUpGrad.apply(x)


def test_a_gradient_is_blamed_on_the_module_whose_backward_made_it():
    """The first non-finite gradient is *seen* at a's output but *made* by `blow`'s backward."""
    model = torch.nn.Sequential()
    model.add_module("a", torch.nn.Linear(4, 4))
    model.add_module("blow", BlowUp())
    model.add_module("c", torch.nn.Linear(4, 1))
    tracker = NonfiniteTracker(model)
    model(torch.randn(2, 4)).sum().backward()
    tracker.close()
    origin = tracker.backward[0]
    assert (origin.module, origin.where, origin.producer) == ("a", Where.OUTPUT_GRAD, "blow")
    assert "made by blow's backward" in origin.describe()
    # parameter gradients are made by the module's own backward
    assert not tracker.forward


def test_call_graph_attribution():
    """Who makes the gradient of each module's output: the next module, through pass-through modules
    (in-place ReLU, Identity) and containers; inline code in the caller; the loss for the model's output."""

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x))) + x

    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.ReLU(inplace=True), Block(), torch.nn.Identity(), torch.nn.Linear(4, 1)
    )
    graph = CallGraph(model)
    model(torch.randn(2, 4)).sum()
    graph.close()
    produced = {name or "(model)": graph.grad_producer(name or "(model)") for name, _ in model.named_modules()}
    assert produced == {
        "(model)": LOSS_FUNCTION,
        "0": "2.a",  # ReLU(inplace=True) passes 0's tensor on; Block's first consumer is its child a
        "1": "2.a",
        "2": "4",  # through the Identity
        "2.a": "2",  # tanh, inline in Block.forward
        "2.b": "2",  # the residual add, inline in Block.forward
        "3": "4",
        "4": LOSS_FUNCTION,  # returned by the Sequential, consumed by the loss
    }


def test_range_scan_rows_say_who_produced_them_and_when():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    rows = range_scan(model, [torch.randn(3, 4)], lambda m, b: m(b).sum(), FP16)
    act_grad = {r.module: r for r in rows if r.role is TensorRole.ACTIVATION_GRAD}
    assert act_grad["0"].produced_by == "1" and act_grad["1"].produced_by == "2"
    assert act_grad["2"].produced_by == LOSS_FUNCTION
    # backward order: the gradient of 2's output first, then 2's parameters and 1's output, …, 0's parameters
    ranks = {(r.module, r.role): r.backward_rank for r in rows if r.role.is_gradient}
    assert ranks[("2", TensorRole.ACTIVATION_GRAD)] == 0
    assert ranks[("0", TensorRole.PARAM_GRAD)] == max(ranks.values())
    weights = [r for r in rows if r.role is TensorRole.WEIGHT]
    assert {r.module for r in weights} == {"0", "2"}
    w = next(r for r in weights if r.module == "0")
    assert w.values == 4 * 8 + 8 and w.absmax == float(
        torch.cat([p.detach().abs().flatten() for p in model[0].parameters()]).max()
    )
