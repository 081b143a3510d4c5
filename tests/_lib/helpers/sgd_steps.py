"""A few plain SGD training steps, for tests that compare whole runs bit for bit (a patched option against
stock, or against itself with the option off)."""

from __future__ import annotations

import torch


def sgd_steps(model, batches, autocast: torch.dtype | None = None):
    """(losses, the last step's {name: grad}) of one forward and backward per batch, SGD between them, on the
    model's device; under ``torch.autocast`` to ``autocast`` when given."""
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-2)
    losses, grads = [], {}
    model.train()
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
        loss.backward()
        losses.append(loss.detach())
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        opt.step()
    return losses, grads
