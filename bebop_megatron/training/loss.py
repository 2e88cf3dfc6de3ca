"""The MTP loss computed from the model's concatenated hidden states (CE for now).

Legend: S sequence, B micro-batch, H hidden, K MTP steps, V_local this TP rank's vocab shard.

Step k (1..K) at position t predicts token x_{t+k+1} = labels[t+k]. It is valid when
t+k < S and loss_mask[t+k] is set; a chain stops at its first invalid step
(DESIGN.md section 1), so step k counts only where steps 1..k are all valid.

Per position with K_t >= 1 valid leading steps, L_t = (1/K) sum_{k<=K_t} CE_k(t); the
loss is the mean of L_t over such positions. The loss function returns the *sum* and the
count so that Megatron's per-token normalisation (``calculate_per_token_loss``) divides by
the count of the whole global batch, across micro-batches and data-parallel ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from bebop_megatron.data import Batch

STAT_ROWS = ("ce_sum", "top1_correct", "count")


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
    return torch.stack(steps).to(torch.int8).cumprod(dim=0).bool()


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


def mtp_ce_loss(model, hidden, batch: Batch, num_steps: int, tp_group):
    """Returns ``(loss_sum, num_positions, stats)``; ``stats`` is ``[3, K]`` (``STAT_ROWS``)."""
    chunks = torch.chunk(hidden, 1 + num_steps, dim=0)
    labels_SB = batch.labels.t().contiguous()
    valid_KSB = chain_valid(batch.loss_mask, num_steps).transpose(1, 2)
    S = labels_SB.shape[0]
    per_position_SB = torch.zeros(labels_SB.shape, dtype=torch.float32, device=hidden.device)
    stats = torch.zeros(len(STAT_ROWS), num_steps, dtype=torch.float32, device=hidden.device)
    for k in range(1, num_steps + 1):
        logits_SBV, _ = model.output_layer(chunks[k], weight=model.output_weight())
        target_SB = torch.zeros_like(labels_SB)
        target_SB[: S - k] = labels_SB[k:]
        valid_SB = valid_KSB[k - 1].float()
        with torch.no_grad():  # before the CE, which works in place on its input logits
            stats[1, k - 1] = (_vocab_parallel_top1_correct(logits_SBV, target_SB, tp_group) * valid_SB).sum()
            stats[2, k - 1] = valid_SB.sum()
        ce_SB = tensor_parallel.vocab_parallel_cross_entropy(logits_SBV.float(), target_SB)
        per_position_SB = per_position_SB + ce_SB * valid_SB
        stats[0, k - 1] = (ce_SB.detach() * valid_SB).sum()
    num_positions = valid_KSB[0].sum().to(torch.int)
    return per_position_SB.sum() / num_steps, num_positions, stats
