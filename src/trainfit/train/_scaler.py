"""The two places trainfit reads GradScaler internals, kept in one file with a canary test.

torch 2.13 has no public "was this optimizer step skipped" and no sync-free way to read the scale
(``get_scale()`` calls ``.item()``). We need both without adding a host synchronisation:

* ``GradScaler._found_inf_per_device(optimizer)`` — after ``unscale_``, a dict of 0-dim float tensors
  (one per device) that are non-zero iff a gradient held inf/NaN. ``scaler.step`` uses exactly these to
  decide whether to call ``optimizer.step`` (and fused optimizers receive their sum as ``found_inf``), so
  "skipped" computed from them agrees with the scaler by construction, for fused optimizers too.
* ``GradScaler._scale`` (via ``_get_scale_async()``) — the device tensor that ``update()`` modifies in
  place; we clone it after ``update()``.

Alternatives considered: comparing ``get_scale()`` before and after ``update()`` (two syncs per step, and
wrong once the scale has collapsed to 0, where 0 × 0.5 = 0 shows no change); an optimizer step
post-hook (public, but it fires for fused optimizers even when their kernel skipped the update).
``tests/train/test_scaler_internals.py`` fails loudly if a torch upgrade moves these.
"""

from __future__ import annotations

import torch


def found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """After ``scaler.unscale_(optimizer)``: a 0-dim fp32 tensor, > 0 iff the step will be skipped. No sync."""
    per_device = scaler._found_inf_per_device(optimizer)
    tensors: list[torch.Tensor] = list(per_device.values())
    if not tensors:
        raise RuntimeError("GradScaler recorded no inf checks; call unscale_ before reading found_inf")
    if len(tensors) == 1:
        # safe to keep: update() only adds into found_infs[0] in place when there are several devices, and the
        # next unscale_ allocates fresh tensors
        return tensors[0]
    device = tensors[0].device
    return torch.stack([t.to(device, non_blocking=True) for t in tensors]).sum()


def scale_tensor(scaler: torch.amp.GradScaler) -> torch.Tensor:
    """The current loss scale as a 0-dim fp32 device tensor (a copy). No sync."""
    scale = scaler._get_scale_async()
    if scale is None:  # before the first scale() call
        return torch.tensor(float(scaler._init_scale))
    return scale.detach().clone().reshape(())
