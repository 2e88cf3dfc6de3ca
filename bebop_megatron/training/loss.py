"""The MTP loss computed from the model's concatenated hidden states.

Legend: S sequence, B micro-batch, H hidden, K MTP steps, V_local this TP rank's vocab shard.

Step k (1..K) at position t predicts token x_{t+k+1} = labels[t+k]. It is valid when
t+k < S and loss_mask[t+k] is set; a chain stops at its first invalid step
(DESIGN.md section 1), so step k counts only where steps 1..k are all valid.

Per position with K_t >= 1 valid leading steps, L_t = (1/K) sum_{k<=K_t} CE_k(t) for CE,
or the objective's L_t (e2e TV, Eq. 13; see :mod:`bebop_megatron.losses`); the loss is the
mean of L_t over such positions. The loss function returns the *sum* and the
count so that Megatron's per-token normalisation (``calculate_per_token_loss``) divides by
the count of the whole global batch, across micro-batches and data-parallel ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from bebop_megatron.config import LossConfig
from bebop_megatron.data import Batch
from bebop_megatron.losses import OBJECTIVES, STAT_KEYS, chain_mask

STAT_ROWS = ("ce_sum", "top1_correct", "count", *STAT_KEYS)


def chain_valid(loss_mask_BS: torch.Tensor, num_steps: int) -> torch.Tensor:
    """Bool ``[K, B, S]``: step k valid at t and every earlier step of the chain valid too."""
    B, S = loss_mask_BS.shape
    ok_BS = loss_mask_BS > 0
    steps = []
    for k in range(1, num_steps + 1):
        shifted = torch.zeros_like(ok_BS)
        if k < S:
            shifted[:, : S - k] = ok_BS[:, k:]
        steps.append(shifted)
    return chain_mask(torch.stack(steps))


def _vocab_parallel_top1_correct(logits_SBV: torch.Tensor, target_SB: torch.Tensor, tp_group) -> torch.Tensor:
    """1 where the target token holds the (global) maximum logit. Ties count as correct."""
    v_local = logits_SBV.shape[-1]
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    start = rank * v_local
    local = (target_SB >= start) & (target_SB < start + v_local)
    idx = (target_SB - start).clamp(0, v_local - 1)
    target_logit = logits_SBV.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
    target_logit = torch.where(local, target_logit, torch.full_like(target_logit, float("-inf")))
    max_logit = logits_SBV.max(dim=-1).values
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        both = torch.stack([target_logit, max_logit])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=tp_group)
        target_logit, max_logit = both[0], both[1]
    return (target_logit >= max_logit).float()


def _shift_targets(main_SBV: torch.Tensor, num_steps: int) -> torch.Tensor:
    """``[K, S, B, V]``: step k's target at t is the backbone at t+k (zeros past the end, invalid)."""
    S = main_SBV.shape[0]
    target_KSBV = main_SBV.new_zeros((num_steps, *main_SBV.shape))
    for k in range(1, num_steps + 1):
        if k < S:
            target_KSBV[k - 1, : S - k] = main_SBV[k:]
    return target_KSBV


def mtp_loss(model, hidden, batch: Batch, num_steps: int, tp_group, loss_cfg: LossConfig):
    """Returns ``(loss_sum, num_positions, stats)``; ``stats`` is ``[len(STAT_ROWS), K]`` sums.

    ``loss_cfg.type``: ``ce`` (data tokens) or a distribution objective of
    :mod:`bebop_megatron.losses` against the frozen backbone (``e2e_tv``, ``tv``, ``kl``,
    ``reverse_kl``). The acceptance statistics (alpha_RS, alpha_TO, entropies, KL) are
    computed for every objective, so runs with different objectives compare directly.
    """
    chunks = torch.chunk(hidden, 1 + num_steps, dim=0)
    weight = model.output_weight()
    labels_SB = batch.labels.t().contiguous()
    valid_KSB = chain_valid(batch.loss_mask, num_steps).transpose(1, 2)
    S = labels_SB.shape[0]
    K = num_steps
    stats = torch.zeros(len(STAT_ROWS), K, dtype=torch.float32, device=hidden.device)
    with torch.no_grad():  # the frozen backbone's distribution, shifted per step
        main_SBV, _ = model.output_layer(chunks[0], weight=weight)
        target_KSBV = _shift_targets(main_SBV, K)
    draft_logits, targets = [], []
    for k in range(1, K + 1):
        logits_SBV, _ = model.output_layer(chunks[k], weight=weight)
        target_SB = torch.zeros_like(labels_SB)
        target_SB[: S - k] = labels_SB[k:]
        with torch.no_grad():
            stats[1, k - 1] = (_vocab_parallel_top1_correct(logits_SBV, target_SB, tp_group) * valid_KSB[k - 1]).sum()
        draft_logits.append(logits_SBV)
        targets.append(target_SB)
    stats[2] = valid_KSB.flatten(1).sum(-1).float()
    num_positions = valid_KSB[0].sum().to(torch.int)

    draft_KNV = torch.stack(draft_logits).flatten(1, 2)
    target_KNV = target_KSBV.flatten(1, 2)
    valid_KN = valid_KSB.flatten(1)
    objective = "e2e_tv" if loss_cfg.type == "ce" else loss_cfg.type
    kwargs = dict(
        tp_group=tp_group, target_temperature=loss_cfg.target_temperature,
        draft_temperature=loss_cfg.draft_temperature, reduction="sum",
        chunk_tokens=loss_cfg.chunk_tokens, return_stats=True,
    )
    if loss_cfg.type == "ce":
        with torch.no_grad():
            _, dist_stats = OBJECTIVES[objective](draft_KNV.detach(), target_KNV, valid_KN, **kwargs)
        per_position_SB = torch.zeros(labels_SB.shape, dtype=torch.float32, device=hidden.device)
        for k, (logits_SBV, target_SB) in enumerate(zip(draft_logits, targets), start=1):
            valid_SB = valid_KSB[k - 1].float()
            # Megatron's vocab-parallel CE works in place on its input logits: keep ours intact.
            ce_SB = tensor_parallel.vocab_parallel_cross_entropy(logits_SBV.float().clone(), target_SB)
            per_position_SB = per_position_SB + ce_SB * valid_SB
            stats[0, k - 1] = (ce_SB.detach() * valid_SB).sum()
        loss_sum = per_position_SB.sum() / K
    else:
        loss_sum, dist_stats = OBJECTIVES[objective](draft_KNV, target_KNV, valid_KN, **kwargs)
    for row, key in enumerate(STAT_KEYS, start=3):
        stats[row] = dist_stats[key].float()
    return loss_sum.float(), num_positions, stats


def mtp_ce_loss(model, hidden, batch: Batch, num_steps: int, tp_group):
    """:func:`mtp_loss` with Megatron-style cross-entropy on the data tokens."""
    return mtp_loss(model, hidden, batch, num_steps, tp_group, LossConfig(type="ce"))
