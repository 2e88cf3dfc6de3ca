"""Plain-torch chunk kernel (the CPU default, ``impl="torch"``) of the vocabulary-parallel divergences.

Legend: R rows of one chunk (any leading shape, e.g. ``[K, n]``), V this TP rank's
vocabulary shard (rank r holds the global columns ``r*V : (r+1)*V``).

One call handles one chunk of rows; everything it allocates is a few ``R x V`` tensors in
the compute dtype. Every full-vocabulary row quantity (max, sum-exp, |p - q|, S,
entropies, KL terms, p at the argmax of q) is all-reduced over ``tp_group``, so each rank
holds the same per-row scalars as TP=1 and its own shard of the gradient. The backward
needs no collective: it recomputes p and q from the saved per-row max and sum-exp with
exactly the forward's operations (so the mask ``q <= p`` is the one S was summed over).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

KINDS = ("tv", "kl", "reverse_kl")
STAT_KEYS = ("alpha_rs", "alpha_to", "entropy_target", "entropy_draft", "kl")
# Per-row scalars the backward needs: max and sum-exp of q and p, and S (tv) / KL(q||p) (reverse_kl).
SAVED_ROWS = ("max_q", "sumexp_q", "max_p", "sumexp_p", "aux")


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """float32 for bf16/fp16/fp32 logits, float64 when any input is float64."""
    out = torch.float32
    for dtype in dtypes:
        out = torch.promote_types(out, dtype)
    return out


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _scaled(logits_RV: torch.Tensor, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """A fresh compute-dtype copy of ``logits / temperature`` (later shifted in place)."""
    out = logits_RV.to(dtype, copy=True)
    if temperature != 1.0:
        out.div_(temperature)
    return out


def _log_probs_and_probs(shifted_RV: torch.Tensor, exp_RV: torch.Tensor, sumexp_R: torch.Tensor):
    """Rows shifted by their global max, and their exp -> (log-probs, probs), both in place.

    Forward and backward both go through here, so p and q are bitwise the same in both.
    """
    return shifted_RV.sub_(sumexp_R.log()[..., None]), exp_RV.div_(sumexp_R[..., None])


def _xlogy_sum(w_RV: torch.Tensor, log_ratio_RV: torch.Tensor) -> torch.Tensor:
    """sum_v w * log_ratio with 0 * anything = 0 (zero-probability entries, -inf logits)."""
    return torch.where(w_RV > 0, w_RV * log_ratio_RV, 0.0).sum(-1)


def direction(kind: str, q_RV, p_RV, logq_RV, logp_RV, aux_R, draft_temperature: float) -> torch.Tensor:
    """d value / d draft logits per row (before scaling by the incoming gradient)."""
    if kind == "tv":
        # Eq. 11: dL_TV/dz_j = -q_j (1[q_j <= p_j] - S); ties count as "<=".
        out = torch.where(q_RV <= p_RV, aux_R[..., None] - 1.0, aux_R[..., None]).mul_(q_RV)
    elif kind == "kl":
        out = q_RV - p_RV  # d KL(p||q) / dz = q - p (soft cross-entropy)
    else:
        # d KL(q||p) / dz_j = q_j [log(q_j / p_j) - KL(q||p)]
        out = torch.where(q_RV > 0, q_RV * (logq_RV - logp_RV - aux_R[..., None]), 0.0)
    if draft_temperature != 1.0:
        out.div_(draft_temperature)
    return out


@dataclass
class RowResult:
    value_R: torch.Tensor  # the divergence per row (d_TV, KL(p||q) or KL(q||p))
    saved_CR: torch.Tensor  # SAVED_ROWS stacked
    stats_CR: torch.Tensor | None  # STAT_KEYS stacked (per row, not yet summed)
    grad_RV: torch.Tensor | None  # d value / d draft logits (compute dtype), when asked for


def forward_rows(
    draft_RV: torch.Tensor,
    target_RV: torch.Tensor,
    *,
    kind: str,
    target_temperature: float,
    draft_temperature: float,
    tp_group,
    with_stats: bool,
    with_grad: bool,
) -> RowResult:
    """Full-vocabulary divergence of one chunk of rows; see the module docstring."""
    dtype = compute_dtype(draft_RV.dtype, target_RV.dtype)
    logq = _scaled(draft_RV, draft_temperature, dtype)
    logp = _scaled(target_RV, target_temperature, dtype)

    if with_stats:
        local_max_q, local_arg_q = logq.max(dim=-1)  # first maximal index on this shard
    else:
        local_max_q = logq.amax(dim=-1)
    maxes = _all_reduce(torch.stack([local_max_q, logp.amax(dim=-1)]), dist.ReduceOp.MAX, tp_group)
    max_q, max_p = maxes[0], maxes[1]
    logq.sub_(max_q[..., None])
    logp.sub_(max_p[..., None])
    q, p = logq.exp(), logp.exp()  # unnormalised until the global sum-exp is known
    sumexp = _all_reduce(torch.stack([q.sum(-1), p.sum(-1)]), dist.ReduceOp.SUM, tp_group)
    logq, q = _log_probs_and_probs(logq, q, sumexp[0])
    logp, p = _log_probs_and_probs(logp, p, sumexp[1])

    # Local partial sums over this vocabulary shard, all-reduced together below.
    parts: dict[str, torch.Tensor] = {}
    if kind == "tv" or with_stats:
        parts["tv"] = (p - q).abs_().sum(-1).mul_(0.5)  # Eq. 10: d_TV = 1 - sum min(p, q)
    if kind == "tv":
        parts["aux"] = torch.where(q <= p, q, 0.0).sum(-1)  # S of Eq. 11
    if kind == "kl" or with_stats:
        parts["kl"] = _xlogy_sum(p, logp - logq)
    if kind == "reverse_kl":
        parts["reverse_kl"] = parts["aux"] = _xlogy_sum(q, logq - logp)
    if with_stats:
        parts["entropy_target"] = -_xlogy_sum(p, logp)
        parts["entropy_draft"] = -_xlogy_sum(q, logq)
        # Vocabulary-parallel argmax of q: lowest global index among the ranks holding the max.
        num_local = draft_RV.shape[-1]
        start = num_local * (dist.get_rank(tp_group) if tp_group is not None else 0)
        big = torch.iinfo(torch.long).max
        index = torch.where(local_max_q == max_q, local_arg_q + start, big)
        index = _all_reduce(index, dist.ReduceOp.MIN, tp_group)
        mine = (index >= start) & (index < start + num_local)
        local_index = (index - start).clamp_(0, num_local - 1)
        p_at = p.gather(-1, local_index[..., None]).squeeze(-1)
        parts["alpha_to"] = torch.where(mine, p_at, 0.0)
    names = list(parts)
    reduced = _all_reduce(torch.stack([parts[n] for n in names]), dist.ReduceOp.SUM, tp_group)
    sums = dict(zip(names, reduced))

    value = sums["tv" if kind == "tv" else kind]
    aux = sums["aux"] if "aux" in sums else torch.zeros_like(value)
    saved = torch.stack([max_q, sumexp[0], max_p, sumexp[1], aux])
    stats = None
    if with_stats:
        stats = torch.stack([
            1.0 - sums["tv"], sums["alpha_to"], sums["entropy_target"], sums["entropy_draft"], sums["kl"],
        ])
    grad = direction(kind, q, p, logq, logp, aux, draft_temperature) if with_grad else None
    return RowResult(value, saved, stats, grad)


def grad_rows(
    draft_RV: torch.Tensor,
    target_RV: torch.Tensor,
    saved_CR: torch.Tensor,
    *,
    kind: str,
    target_temperature: float,
    draft_temperature: float,
) -> torch.Tensor:
    """d value / d draft logits of one chunk, recomputed from the saved per-row scalars (no collective)."""
    dtype = compute_dtype(draft_RV.dtype, target_RV.dtype)
    max_q, sumexp_q, max_p, sumexp_p, aux = saved_CR.unbind(0)
    logq = _scaled(draft_RV, draft_temperature, dtype).sub_(max_q[..., None])
    logp = _scaled(target_RV, target_temperature, dtype).sub_(max_p[..., None])
    logq, q = _log_probs_and_probs(logq, logq.exp(), sumexp_q)
    logp, p = _log_probs_and_probs(logp, logp.exp(), sumexp_p)
    return direction(kind, q, p, logq, logp, aux, draft_temperature)
