"""The model's real vocabulary inside Megatron's padded one.

Megatron pads the embedding and output layer to ``padded_vocab_size`` rows (a multiple of
``make_vocab_size_divisible_by * TP``, so every TP rank holds an equal shard). The padded
rows are zero, so their logits are 0: left in, they put probability mass on tokens that do
not exist (a fresh model over vocab 300 padded to 384 shows H(p) = ln 384), which the
serving engines never sample. Every objective and statistic therefore sets the logits of
global columns ``>= vocab_size`` to -inf (p = q = 0 there, zero gradient), on every TP rank.

Legend: V_local this TP rank's vocabulary shard (rank r holds global columns r*V_local ..).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _num_real_local(num_local: int, vocab_size: int | None, tp_group) -> int:
    """How many of this rank's ``num_local`` columns are real tokens (0 .. num_local)."""
    if vocab_size is None:
        return num_local
    rank = dist.get_rank(tp_group) if tp_group is not None and dist.get_world_size(tp_group) > 1 else 0
    return max(0, min(num_local, vocab_size - rank * num_local))


def mask_padded_vocab_(logits_xV: torch.Tensor, vocab_size: int | None, tp_group=None) -> torch.Tensor:
    """In place: this shard's columns at global index ``>= vocab_size`` set to -inf (None: none)."""
    keep = _num_real_local(logits_xV.shape[-1], vocab_size, tp_group)
    if keep < logits_xV.shape[-1]:
        logits_xV[..., keep:] = float("-inf")
    return logits_xV


def masked_padded_vocab(logits_xV: torch.Tensor, vocab_size: int | None, tp_group=None) -> torch.Tensor:
    """Out of place (autograd-safe) :func:`mask_padded_vocab_`; the input itself when nothing is padded."""
    num_local = logits_xV.shape[-1]
    keep = _num_real_local(num_local, vocab_size, tp_group)
    if keep == num_local:
        return logits_xV
    padded_V = torch.arange(num_local, device=logits_xV.device) >= keep
    return logits_xV.masked_fill(padded_V, float("-inf"))


__all__ = ["mask_padded_vocab_", "masked_padded_vocab"]
