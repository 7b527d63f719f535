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
