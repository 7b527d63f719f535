"""Activation checkpointing helper: same gradients, real recomputation, non-reentrant, reversible."""

from __future__ import annotations

import copy

import pytest
import torch

from trainfit.errors import StrategyError
from trainfit.train.checkpoint import CheckpointMethod, checkpointed_modules, set_checkpointing


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.calls = 0

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        self.calls += 1
        return x + scale * torch.tanh(self.fc(x))


class Net(torch.nn.Module):
    def __init__(self, d: int = 8, n: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(d, d)
        self.layers = torch.nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x, scale=0.5)
        return x.sum()


def grads(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    model(x).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_same_gradients_and_blocks_recomputed():
    torch.manual_seed(0)
    plain = Net()
    ckpt = copy.deepcopy(plain)
    state = set_checkpointing(ckpt)
    assert state.method is CheckpointMethod.WRAPPED
    assert state.modules == ("layers.0", "layers.1", "layers.2")
    assert list(plain.state_dict()) == list(ckpt.state_dict())  # names unchanged
    x = torch.randn(4, 8)
    for a, b in zip(grads(plain, x), grads(ckpt, x), strict=True):
        torch.testing.assert_close(a, b)
    assert [b.calls for b in plain.layers] == [1, 1, 1]
    assert [b.calls for b in ckpt.layers] == [2, 2, 2]  # forward + recompute in backward


def test_non_reentrant_gives_parameter_grads_when_input_needs_none():
    torch.manual_seed(0)
    model = Net()
    set_checkpointing(model, blocks=Block)
    x = torch.randn(2, 8)  # input does not require grad and the first block sees a grad-requiring tensor only
    model.layers[0](x).sum().backward()  # call a wrapped block directly on a no-grad input
    assert model.layers[0].fc.weight.grad is not None


def test_disable_restores_plain_forward_and_no_grad_skips_checkpoint():
    model = Net()
    set_checkpointing(model)
    with torch.no_grad():
        model(torch.randn(2, 8))
    assert [b.calls for b in model.layers] == [1, 1, 1]
    assert checkpointed_modules(model) == ("layers.0", "layers.1", "layers.2")
    set_checkpointing(model, False)
    assert checkpointed_modules(model) == ()
    assert "forward" not in model.layers[0].__dict__
    model(torch.randn(2, 8)).backward()
    assert [b.calls for b in model.layers] == [2, 2, 2]


def test_predicate_and_missing_blocks():
    model = Net()
    state = set_checkpointing(model, blocks=lambda name, m: name == "layers.1")
    assert state.modules == ("layers.1",)
    with pytest.raises(StrategyError, match="ModuleList"):
        set_checkpointing(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_uses_the_models_own_switch_when_it_has_one():
    calls = []

    class HFLike(Net):
        supports_gradient_checkpointing = True

        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            calls.append(("on", gradient_checkpointing_kwargs))

        def gradient_checkpointing_disable(self):
            calls.append(("off", None))

    model = HFLike()
    assert set_checkpointing(model).method is CheckpointMethod.MODEL_SWITCH
    set_checkpointing(model, False)
    assert calls == [("on", {"use_reentrant": False}), ("off", None)]
    assert checkpointed_modules(model) == ()


def test_hf_model_switch_really_checkpoints():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.train()
    state = set_checkpointing(model)
    on = getattr(model, "is_activation_checkpointing", None)
    assert state.method is CheckpointMethod.MODEL_SWITCH
    assert on if on is not None else model.is_gradient_checkpointing
    ids = torch.randint(0, 64, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert model.transformer.h[0].attn.c_attn.weight.grad is not None
