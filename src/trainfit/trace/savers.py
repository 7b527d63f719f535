"""Memory savers the trace runs for real (trainfit.analytic.savers has the closed forms).

* ``--loss chunked[:N]``: torchtune's recipe on the HF model — the base model's last hidden state is split into N
  chunks along the sequence, the output projection runs per chunk (torchtune ``TransformerDecoder`` with
  ``num_output_chunks``: ``[self.output(chunk) for chunk in h.chunk(num_output_chunks, dim=1)]``) and the loss is
  ``CEWithChunkedOutputLoss``: each chunk upcast with ``.float()`` and summed cross-entropy, divided by the number
  of tokens. Written from the behaviour those two functions document; no code is copied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainfit.strategy import LossImpl, Strategy

Forward = Callable[[torch.nn.Module, Any], Any]
LossOf = Callable[[Any, Any], torch.Tensor]


def chunked_loss_fns(strategy: Strategy) -> tuple[Forward, LossOf] | None:
    """(forward, loss) for torchtune's chunked cross-entropy, or None when the strategy does not ask for it."""
    if strategy.savers.loss is not LossImpl.CHUNKED:
        return None
    n = strategy.savers.loss_chunks

    def forward(model: Any, batch: Any) -> Any:
        head: Any = model.get_output_embeddings()
        base: Any = model.get_decoder()
        hidden = base(input_ids=batch["input_ids"]).last_hidden_state
        return [head(c) for c in hidden.chunk(n, dim=1)]

    def loss_of(chunks: Any, batch: Any) -> torch.Tensor:
        labels = batch["labels"].chunk(n, dim=1)
        total: torch.Tensor | None = None
        for logits, lab in zip(chunks, labels, strict=True):
            ce = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), lab.flatten(), reduction="sum")
            total = ce if total is None else total + ce
        assert total is not None
        out: torch.Tensor = total / batch["labels"].numel()
        return out

    return forward, loss_of


class OptimizerInBackward:
    """torchtune's optimizer-in-backward (``torchtune/training/memory.py`` ``register_optim_in_bwd_hooks``): one
    optimizer per parameter, stepped from the parameter's post-accumulate-grad hook, which then drops the gradient.
    Looks like an optimizer to the runner: ``step`` and ``zero_grad`` have nothing left to do, ``state`` and
    ``param_groups`` are the per-parameter optimizers' (so the read-out counts their states)."""

    def __init__(self, params: list[torch.nn.Parameter], make_one: Callable[[list[Any]], Any]) -> None:
        self.per_param = {p: make_one([p]) for p in params}
        self.handles: list[Any] = []
        for p, opt in self.per_param.items():

            def hook(param: torch.Tensor, opt: Any = opt) -> None:
                opt.step()
                opt.zero_grad(set_to_none=True)

            self.handles.append(p.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]

    @property
    def state(self) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        for opt in self.per_param.values():
            out.update(opt.state)
        return out

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.per_param.values() for g in opt.param_groups]

    def step(self) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None
