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


def _sharded(tp_group) -> bool:
    return tp_group is not None and dist.get_world_size(tp_group) > 1


def _num_real_local(num_local: int, vocab_size: int | None, tp_group) -> int:
    """How many of this rank's ``num_local`` columns are real tokens (0 .. num_local)."""
    if vocab_size is None:
        return num_local
    rank = dist.get_rank(tp_group) if _sharded(tp_group) else 0
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


def _label_columns(labels_R, num_local: int, tp_group, device):
    """``(mine_R, index_R1)``: whether each row's label (a global id) is a column of this rank's
    vocabulary shard, and its local column (clamped into the shard where it is not)."""
    start = num_local * (dist.get_rank(tp_group) if _sharded(tp_group) else 0)
    local = labels_R.to(device).long() - start
    return (local >= 0) & (local < num_local), local.clamp(0, num_local - 1)[:, None]


def label_accept_rs(draft_RV, target_RV, labels_R, saved_CR, *, target_temperature: float, draft_temperature: float,
                    tp_group=None) -> torch.Tensor:
    """``[R]``: min(1, q(x) / p(x)) at each row's realized token ``x = labels_R`` (global ids),
    the probability that a rejection-sampling draft at that position was accepted given that
    the token there is x (DESIGN.md, "What decoding measures").

    ``saved_CR``: the chunk kernel's saved rows (``max_q, sumexp_q, max_p, sumexp_p``: the
    unscaled logits' maxima and the sums of exp((logit - max) / T) over the whole vocabulary),
    so only the two label logits are gathered here, from the shard that holds them (one
    all-reduce over ``tp_group``). A token with p(x) = 0 (not sampled from p) counts as
    accepted when q(x) > 0 and rejected when q(x) = 0."""
    mine, index = _label_columns(labels_R, draft_RV.shape[-1], tp_group, draft_RV.device)
    dtype = saved_CR.dtype
    picked = torch.stack([draft_RV.gather(-1, index)[:, 0].to(dtype), target_RV.gather(-1, index)[:, 0].to(dtype)])
    picked = torch.where(mine, picked, torch.zeros((), dtype=dtype, device=picked.device))
    if _sharded(tp_group):
        dist.all_reduce(picked, group=tp_group)
    max_q, sumexp_q, max_p, sumexp_p = saved_CR[:4]
    log_q = (picked[0] - max_q) / draft_temperature - sumexp_q.log()
    log_p = (picked[1] - max_p) / target_temperature - sumexp_p.log()
    return (log_q - log_p).clamp(max=0.0).exp().nan_to_num(nan=0.0)


def label_cross_entropy_(logits_RV, labels_R, *, tp_group=None, ws=None) -> torch.Tensor:
    """``[R]``: -log softmax(logits)[x] at each row's label ``x = labels_R`` (global ids; the
    raw logits, temperature 1: Megatron's MTP cross-entropy), over the vocabulary sharded on
    ``tp_group``. ``logits_RV`` is overwritten with d value / d logits = softmax - onehot(x)
    (this shard's columns). Math in float32 (float64 for float64 logits); two all-reduces
    (the row max, then the sum of exp and the label's logit). ``ws``: a
    :class:`~bebop_megatron.losses.kernel_torch.Workspace` for the float32 buffer."""
    from bebop_megatron.losses.kernel_torch import compute_dtype

    sharded = _sharded(tp_group)
    dtype = compute_dtype(logits_RV.dtype)
    if logits_RV.dtype == dtype:
        e_RV = logits_RV
    elif ws is not None:
        e_RV = ws.take("label_ce", logits_RV, dtype).copy_(logits_RV)
    else:
        e_RV = logits_RV.to(dtype)
    max_R = e_RV.max(dim=-1).values
    if sharded:
        dist.all_reduce(max_R, op=dist.ReduceOp.MAX, group=tp_group)
    mine, index = _label_columns(labels_R, logits_RV.shape[-1], tp_group, logits_RV.device)
    picked_R = torch.where(mine, e_RV.gather(-1, index)[:, 0] - max_R, 0.0)
    e_RV.sub_(max_R[:, None]).exp_()
    sums_2R = torch.stack([e_RV.sum(dim=-1), picked_R])
    if sharded:
        dist.all_reduce(sums_2R, group=tp_group)
    sumexp_R, picked_R = sums_2R
    value_R = sumexp_R.log() - picked_R
    e_RV.div_(sumexp_R[:, None])
    e_RV.scatter_add_(-1, index, torch.where(mine, -1.0, 0.0).to(dtype)[:, None])
    if e_RV is not logits_RV:
        logits_RV.copy_(e_RV)
    return value_R


__all__ = ["label_accept_rs", "label_cross_entropy_", "mask_padded_vocab_", "masked_padded_vocab"]
