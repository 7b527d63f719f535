"""``trainfit.trace.trace`` on a plain nn.Module: exact bytes per component for every recipe and optimizer."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from trainfit.errors import TraceUnsupportedError, TrainfitError  # noqa: E402
from trainfit.result import Component, Method, Phase  # noqa: E402
from trainfit.strategy import Optimizer  # noqa: E402
from trainfit.trace import trace  # noqa: E402
from trainfit.trace.optim import make_optimizer  # noqa: E402

C = Component


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(256, 1024)
        self.l2 = torch.nn.Linear(1024, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.nn.functional.gelu(self.l1(x)))


N_MATRIX = 2 * 256 * 1024  # weight elements (two 256x1024 matrices)
N_BIAS = (1024, 256)
P = N_MATRIX + sum(N_BIAS)


def r512(n: int) -> int:
    return -(-n // 512) * 512


def sized(width: int) -> int:
    """Bytes of one copy of all parameters at ``width`` bytes/element, 512-rounded per tensor."""
    return 2 * r512(256 * 1024 * width) + sum(r512(n * width) for n in N_BIAS)


def run(precision: str = "fp32", **kw: object):
    return trace(
        MLP,
        lambda: {"x": torch.zeros(8, 256)},
        loss_fn=lambda out, _b: out.float().pow(2).mean(),
        precision=precision,
        **kw,
    )


def test_report_shape_and_fp32_states() -> None:
    r = run("fp32", modules=True)
    assert r.method is Method.TRACE and r.params == r.trainable_params == P
    assert [p.phase for p in r.phases] == list(Phase)
    opt = r.phase(Phase.OPTIMIZER_STEP).components
    assert opt[C.WEIGHTS] == sized(4)
    assert opt[C.GRADIENTS] == sized(4)
    # foreach AdamW (the default): exp_avg + exp_avg_sq; its step counters are CPU tensors on CUDA
    assert opt[C.OPTIMIZER_STATES] == 2 * sized(4)
    assert opt[C.TEMPORARIES] >= sized(4)  # torch._foreach_sqrt(exp_avg_sqs)
    assert r.phase(Phase.FORWARD).components[C.GRADIENTS] == 0  # set_to_none between steps
    json.dumps(dict(r.extra))  # JSON-friendly
    assert r.extra["modules"] and r.extra["modules"][0]["activation_bytes"] > 0


def test_amp_keeps_fp32_weights_and_caches_16bit_copies() -> None:
    r = run("amp-bf16")
    fwd = r.phase(Phase.FORWARD).components
    assert fwd[C.WEIGHTS] == sized(4)
    assert fwd[C.AUTOCAST_COPIES] == sized(2)  # every linear weight and bias cast once per forward
    assert r.phase(Phase.OPTIMIZER_STEP).components[C.AUTOCAST_COPIES] == 0


def test_master_weights() -> None:
    r = run("master-bf16")
    opt = r.phase(Phase.OPTIMIZER_STEP).components
    assert opt[C.WEIGHTS] == sized(2)
    assert opt[C.MASTER_WEIGHTS] == sized(4)
    # 16-bit model grads plus the fp32 master grads made for the step
    assert opt[C.GRADIENTS] == sized(2) + sized(4)
    assert opt[C.OPTIMIZER_STATES] == 2 * sized(4)


def test_pure_bf16_states_are_bf16() -> None:
    opt = run("pure-bf16").phase(Phase.OPTIMIZER_STEP).components
    assert opt[C.WEIGHTS] == opt[C.GRADIENTS] == sized(2)
    assert opt[C.OPTIMIZER_STATES] == 2 * sized(2)


def test_fused_adamw_has_no_step_buffer_and_device_steps() -> None:
    r = run("fp32", optimizer_fn=lambda ps: make_optimizer(Optimizer.ADAMW, ps, adamw_impl="fused"))
    opt = r.phase(Phase.OPTIMIZER_STEP).components
    assert opt[C.OPTIMIZER_STATES] == 2 * sized(4) + 4 * 512  # fused keeps its step counters on the device
    assert opt[C.TEMPORARIES] < sized(4) // 100


@pytest.mark.parametrize(
    ("name", "states"),
    [
        (Optimizer.SGD, 0),
        (Optimizer.SGD_MOMENTUM, sized(4)),
        (Optimizer.LION, sized(4)),
        # bitsandbytes: uint8 x2 + fp32 absmax per 256 block x2 for big tensors, shared qmaps, fp32 for small
        (
            Optimizer.ADAMW_8BIT,
            2 * (2 * r512(256 * 1024) + 2 * r512(256 * 1024 // 256 * 4))
            + 2 * 1024
            + 2 * sum(r512(4 * n) for n in N_BIAS),
        ),
    ],
)
def test_optimizer_states(name: Optimizer, states: int) -> None:
    r = run("fp32", optimizer_fn=lambda ps: make_optimizer(name, ps))
    assert r.phase(Phase.OPTIMIZER_STEP).components[C.OPTIMIZER_STATES] == states


def test_adafactor_states_are_factored() -> None:
    r = run("fp32", optimizer_fn=lambda ps: make_optimizer(Optimizer.ADAFACTOR, ps))
    assert 0 < r.phase(Phase.OPTIMIZER_STEP).components[C.OPTIMIZER_STATES] < sized(4) // 10


def test_data_dependent_op_names_the_op_and_the_way_out() -> None:
    class Masked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            return y[y > 0].sum()

    with pytest.raises(TraceUnsupportedError) as err:
        trace(Masked, lambda: (torch.zeros(4, 8),), loss_fn=lambda out, _b: out, precision="fp32")
    msg = str(err.value)
    assert "aten." in msg and "--method analytic" in msg
    assert isinstance(err.value, TrainfitError)


def test_missing_loss_is_a_user_error() -> None:
    with pytest.raises(TrainfitError, match="loss_fn"):
        trace(MLP, lambda: {"x": torch.zeros(2, 256)}, precision="fp32")
