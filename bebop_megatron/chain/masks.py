"""Which MTP steps a position's chain holds, and what each step is compared with.

Step k (k = 1..K) at position t drafts token t + k + 1 from the hidden state of step k - 1 and the
token at t + k; it is valid when t + k is a trained token of t's document; a chain stops at its
first invalid step (DESIGN.md section 1, "Which target each step uses"). Plain-torch, no model.
"""

from __future__ import annotations

import torch

from bebop_megatron.losses.tv import chain_mask  # valid steps -> the leading ones (the losses' own)


def chain_valid(loss_mask_BS: torch.Tensor, num_steps: int, segment_ids_BS: torch.Tensor | None = None) -> torch.Tensor:
    """Bool ``[K, B, S]``: step k valid at t and every earlier step of the chain valid too.

    Step k is valid at t when t+k < S, ``loss_mask[t+k]`` is set and (with ``segment_ids``)
    t+k lies in t's document."""
    B, S = loss_mask_BS.shape
    ok_BS = loss_mask_BS > 0
    steps = []
    for k in range(1, num_steps + 1):
        shifted = torch.zeros_like(ok_BS)
        if k < S:
            shifted[:, : S - k] = ok_BS[:, k:]
            if segment_ids_BS is not None:
                shifted[:, : S - k] &= segment_ids_BS[:, k:] == segment_ids_BS[:, : S - k]
        steps.append(shifted)
    return chain_mask(torch.stack(steps))


def shift_targets(x_SB: torch.Tensor, num_steps: int) -> torch.Tensor:
    """``[K, S, B, ...]``: row k at t holds ``x[t+k]`` (zeros past the end, where steps are invalid).

    Used for both targets of step k: the backbone hidden state and the data label at t+k."""
    S = x_SB.shape[0]
    shifted_KSB = x_SB.new_zeros((num_steps, *x_SB.shape))
    for k in range(1, num_steps + 1):
        if k < S:
            shifted_KSB[k - 1, : S - k] = x_SB[k:]
    return shifted_KSB
