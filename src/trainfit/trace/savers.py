"""Memory savers the trace runs for real (trainfit.analytic.savers has the closed forms).

* ``--loss chunked[:N]``: torchtune's recipe on the HF model — the base model's last hidden state is split into N
  chunks along the sequence, the output projection runs per chunk (torchtune ``TransformerDecoder`` with
  ``num_output_chunks``: ``[self.output(chunk) for chunk in h.chunk(num_output_chunks, dim=1)]``) and the loss is
  ``CEWithChunkedOutputLoss``: each chunk upcast with ``.float()`` and summed cross-entropy, divided by the number
  of tokens. Written from the behaviour those two functions document; no code is copied.
* ``--checkpointing sac``: torchtitan's per-op selective activation checkpointing
  (torchtitan/distributed/activation_checkpoint.py ``SelectiveAC``) as the ``context_fn`` of each layer's
  non-reentrant checkpoint: ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` with its policy —
  save the outputs of torch's compute-intensive ops (``torch._functorch.partitioners.get_default_op_list``)
  and of the fused attention kernels, except every second ``mm`` of a call; recompute everything else. The
  trace's fused attention is an emulation (trainfit.trace.kernels), so the outputs it allocates stand for
  the kernel's.
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


def sac_context_fn() -> Callable[[], Any]:
    """The ``context_fn`` of a layer's checkpoint under ``--checkpointing sac`` (fresh contexts and a fresh mm
    count per call, as torchtitan's ``_get_custom_policy``)."""
    from torch._functorch.partitioners import get_default_op_list
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from trainfit.trace.kernels import FUSED_ATTENTION_OUTPUTS

    aten = torch.ops.aten
    save_ops: set[Any] = {getattr(op, "default") for op in get_default_op_list().compute_intensive_ops}  # noqa: B009
    save_ops |= {aten.linear.default, aten.max.default, aten.topk.default}
    mm_ops = (aten.mm.default, aten.linear.default)

    def policy_factory() -> Any:
        counts = {"forward": 0, "recompute": 0}

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            mode = "recompute" if ctx.is_recompute else "forward"
            if func in mm_ops:
                counts[mode] += 1
            if FUSED_ATTENTION_OUTPUTS[0]:
                return CheckpointPolicy.MUST_SAVE
            if func in save_ops:
                if func in mm_ops and counts[mode] % 2 == 0:
                    return CheckpointPolicy.PREFER_RECOMPUTE
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return policy

    def context_fn() -> Any:
        return create_selective_checkpoint_contexts(policy_factory())  # type: ignore[no-untyped-call]

    return context_fn
