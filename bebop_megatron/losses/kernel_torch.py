"""Plain-torch chunk kernel (the CPU default, ``impl="torch"``) of the vocabulary-parallel divergences.

Legend: R rows of one chunk (any leading shape, e.g. ``[K, n]``), V this TP rank's
vocabulary shard (rank r holds the global columns ``r*V : (r+1)*V``).

One call handles one chunk of rows. Its ``R x V`` temporaries live in a ``Workspace``
reused by every chunk of a call (fresh large allocations cost page faults that dominate
these memory-bound passes on CPU): four compute-dtype buffers for TV without stats (the
shifted logits' buffers are reused once p and q are known), six otherwise. Every
full-vocabulary row quantity (max, sum-exp, |p - q|, S, entropies, KL terms, p at the
argmax of q) is all-reduced over ``tp_group``, so each rank holds the same per-row scalars
as TP=1 and its own shard of the gradient. The backward needs no collective: it recomputes
p and q from the saved per-row max and sum-exp with exactly the forward's operations (so
the mask ``q <= p`` is the one S was summed over).

Kind ``tv_kl`` (the LK hybrids of ``tv.py``; kernel_triton has it too, with the same
results) takes d_TV and KL(p||q) of a row from the same softmaxes in one pass: the value is
``[2, R]`` (d_TV, KL), the forward gradient is the two directions (``grad_RV`` for TV,
``grad_kl_RV`` for KL), and ``grad_rows`` takes a ``[2, R]`` scale and returns
``scale_tv x TV direction + scale_kl x KL direction`` in one buffer. Its buffers are those
of TV with stats (six; four in backward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

KINDS = ("tv", "kl", "reverse_kl")  # the single-divergence kinds of both kernels (torch and Triton)
TV_KL = "tv_kl"  # d_TV and KL(p||q) of a row together (both kernels)
STAT_KEYS = ("alpha_rs", "alpha_to", "entropy_target", "entropy_draft", "kl")
# Per-row scalars the backward needs: max and sum-exp of q and p, and S (tv) / KL(q||p) (reverse_kl).
SAVED_ROWS = ("max_q", "sumexp_q", "max_p", "sumexp_p", "aux")


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """float32 for bf16/fp16/fp32 logits, float64 when any input is float64."""
    out = torch.float32
    for dtype in dtypes:
        out = torch.promote_types(out, dtype)
    return out


class Workspace:
    """Named flat buffers handed out as views of the requested shape, reused across chunks."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(like.shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(numel, dtype=dtype, device=like.device)
            self._buffers[name] = buf
        return buf[:numel].view(like.shape)


def all_reduce_(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _q_where_le(q_RV, p_RV, out_RV) -> torch.Tensor:
    """q * 1[q <= p] (ties count as "<="); the mask is made as 0/1 floats in ``out_RV``
    because multiplying by a bool tensor is several times slower on CPU."""
    return torch.le(q_RV, p_RV, out=out_RV).mul_(q_RV)


def _shifted(logits_RV, max_R, temperature: float, out_RV) -> torch.Tensor:
    """(logits - max) / temperature in the compute dtype; max is of the unscaled logits."""
    torch.sub(logits_RV, max_R[..., None], out=out_RV)
    if temperature != 1.0:
        out_RV.div_(temperature)
    return out_RV


def _zero_nan_(t: torch.Tensor) -> torch.Tensor:
    """0 log 0 = 0: a zero probability from a -inf logit gives 0 * -inf = nan; infinities stay."""
    return t.nan_to_num_(nan=0.0, posinf=math.inf, neginf=-math.inf)


def _sum_plogratio(w_RV, log_w_RV, log_other_RV, out_RV) -> torch.Tensor:
    """sum_v w (log w - log other), 0 where w = 0."""
    return _zero_nan_(torch.sub(log_w_RV, log_other_RV, out=out_RV).mul_(w_RV)).sum(-1)


def direction(kind, q_RV, p_RV, logq_RV, logp_RV, q_where_le_RV, aux_R, scale_R, out_RV) -> torch.Tensor:
    """``scale_R`` x d value / d (scaled draft logits), per row, into ``out_RV``.

    ``q_where_le_RV`` (tv, tv_kl) holds q * 1[q <= p] and is overwritten (it may be ``out_RV``).
    For ``tv_kl``, ``scale_R`` is ``[2, ...]`` (the TV and KL scales) and the result is their
    weighted sum of the two directions.
    """
    if kind == TV_KL:
        scale_tv, scale_kl = scale_R[0][..., None], scale_R[1][..., None]
        # scale_tv (S q - q 1[q <= p]) + scale_kl (q - p), with one R x V buffer
        out_RV = torch.neg(q_where_le_RV, out=out_RV).mul_(scale_tv)
        return out_RV.addcmul_(q_RV, aux_R[..., None] * scale_tv + scale_kl).addcmul_(p_RV, scale_kl, value=-1.0)
    if kind == "tv":
        # Eq. 11: dL_TV/dz_j = -q_j (1[q_j <= p_j] - S) = S q_j - q_j 1[q_j <= p_j]; ties count as "<=".
        out_RV = torch.neg(q_where_le_RV, out=out_RV).addcmul_(q_RV, aux_R[..., None])
    elif kind == "kl":
        torch.sub(q_RV, p_RV, out=out_RV)  # d KL(p||q) / dz = q - p (soft cross-entropy)
    else:
        # d KL(q||p) / dz_j = q_j [log(q_j / p_j) - KL(q||p)]; 0 where q_j = 0
        _zero_nan_(torch.sub(logq_RV, logp_RV, out=out_RV).sub_(aux_R[..., None]).mul_(q_RV))
    return out_RV.mul_(scale_R[..., None])


@dataclass
class RowResult:
    value_R: torch.Tensor  # the divergence per row (d_TV, KL(p||q) or KL(q||p)); [2, R] (d_TV, KL) for tv_kl
    saved_CR: torch.Tensor  # SAVED_ROWS stacked
    stats_CR: torch.Tensor | None  # STAT_KEYS stacked (per row, not yet summed)
    grad_RV: torch.Tensor | None  # d value / d draft logits (a workspace view), when asked for
    argmax_R: torch.Tensor | None = None  # global argmax of q (lowest index on ties), with stats
    grad_kl_RV: torch.Tensor | None = None  # tv_kl: d KL / d draft logits (grad_RV is then TV's)


def _probs(draft_RV, target_RV, max_q, max_p, *, target_temperature, draft_temperature, ws, dtype):
    """Shifted logits and unnormalised probabilities of q and p (workspace views)."""
    logq = _shifted(draft_RV, max_q, draft_temperature, ws.take("logq", draft_RV, dtype))
    logp = _shifted(target_RV, max_p, target_temperature, ws.take("logp", target_RV, dtype))
    q = torch.exp(logq, out=ws.take("q", draft_RV, dtype))
    p = torch.exp(logp, out=ws.take("p", draft_RV, dtype))
    return logq, logp, q, p


def forward_rows(draft_RV, target_RV, *, kind, target_temperature, draft_temperature, tp_group,
                 with_stats, with_grad, ws: Workspace) -> RowResult:
    """Full-vocabulary divergence of one chunk of rows; see the module docstring."""
    dtype = compute_dtype(draft_RV.dtype, target_RV.dtype)
    if with_stats:
        local_max_q, local_arg_q = draft_RV.max(dim=-1)  # first maximal index on this shard
    else:
        local_max_q = draft_RV.amax(dim=-1)
    maxes = torch.stack([local_max_q.to(dtype), target_RV.amax(dim=-1).to(dtype)])
    max_q, max_p = all_reduce_(maxes, dist.ReduceOp.MAX, tp_group).unbind(0)
    logq, logp, q, p = _probs(draft_RV, target_RV, max_q, max_p, target_temperature=target_temperature,
                              draft_temperature=draft_temperature, ws=ws, dtype=dtype)
    sumexp_q, sumexp_p = all_reduce_(torch.stack([q.sum(-1), p.sum(-1)]), dist.ReduceOp.SUM, tp_group).unbind(0)
    q.div_(sumexp_q[..., None])
    p.div_(sumexp_p[..., None])
    need_logs = kind != "tv" or with_stats
    if need_logs:
        logq.sub_(sumexp_q.log()[..., None])
        logp.sub_(sumexp_p.log()[..., None])

    # Local partial sums over this vocabulary shard, all-reduced together below.
    parts: dict[str, torch.Tensor] = {}
    # Without logs (TV, no stats) the shifted-logit buffers are free once p and q exist.
    scratch = ws.take("scratch" if need_logs else "logq", draft_RV, dtype)
    with_tv = kind in ("tv", TV_KL)
    if with_tv or with_stats:
        parts["tv"] = torch.sub(p, q, out=scratch).abs_().sum(-1).mul_(0.5)  # Eq. 10: = 1 - sum min(p, q)
    q_where_le = None
    if with_tv:
        q_where_le = _q_where_le(q, p, ws.take("q_where_le" if need_logs else "logp", draft_RV, dtype))
        parts["aux"] = q_where_le.sum(-1)  # S of Eq. 11
    if kind in ("kl", TV_KL) or with_stats:
        parts["kl"] = _sum_plogratio(p, logp, logq, scratch)
    if kind == "reverse_kl":
        parts["reverse_kl"] = parts["aux"] = _sum_plogratio(q, logq, logp, scratch)
    index = None
    if with_stats:
        parts["entropy_target"] = -_zero_nan_(torch.mul(p, logp, out=scratch)).sum(-1)
        parts["entropy_draft"] = -_zero_nan_(torch.mul(q, logq, out=scratch)).sum(-1)
        # Vocabulary-parallel argmax of q: lowest global index among the ranks holding the max.
        num_local = draft_RV.shape[-1]
        start = num_local * (dist.get_rank(tp_group) if tp_group is not None else 0)
        index = torch.where(local_max_q.to(dtype) == max_q, local_arg_q + start, torch.iinfo(torch.long).max)
        index = all_reduce_(index, dist.ReduceOp.MIN, tp_group)
        mine = (index >= start) & (index < start + num_local)
        p_at = p.gather(-1, (index - start).clamp_(0, num_local - 1)[..., None]).squeeze(-1)
        parts["alpha_to"] = torch.where(mine, p_at, 0.0)
    names = list(parts)
    sums = dict(zip(names, all_reduce_(torch.stack([parts[n] for n in names]), dist.ReduceOp.SUM, tp_group)))

    if kind == TV_KL:
        value = torch.stack([sums["tv"], sums["kl"]])
    else:
        value = sums["tv" if kind == "tv" else kind]
    aux = sums["aux"] if "aux" in sums else torch.zeros_like(max_q)
    saved = torch.stack([max_q, sumexp_q, max_p, sumexp_p, aux])
    stats = None
    if with_stats:
        stats = torch.stack([
            1.0 - sums["tv"], sums["alpha_to"], sums["entropy_target"], sums["entropy_draft"], sums["kl"],
        ])
    grad = grad_kl = None
    if with_grad:
        scale = torch.full_like(aux, 1.0 / draft_temperature)
        if kind == TV_KL:  # both directions alive at once: KL's in scratch, TV's over q * 1[q <= p]
            grad_kl = direction("kl", q, p, logq, logp, None, aux, scale, scratch)
            grad = direction("tv", q, p, logq, logp, q_where_le, aux, scale, q_where_le)
        else:
            grad = direction(kind, q, p, logq, logp, q_where_le, aux, scale, scratch)
    return RowResult(value, saved, stats, grad, index, grad_kl)


def grad_rows(draft_RV, target_RV, saved_CR, scale_R, *, kind, target_temperature, draft_temperature,
              ws: Workspace) -> torch.Tensor:
    """``scale_R`` x d value / d draft logits of one chunk (a workspace view), recomputed from
    the saved per-row scalars, with the forward's exact operations and no collective.
    For ``tv_kl``, ``scale_R`` is ``[2, R]`` (TV's and KL's) and the directions are summed."""
    dtype = compute_dtype(draft_RV.dtype, target_RV.dtype)
    max_q, sumexp_q, max_p, sumexp_p, aux = saved_CR.unbind(0)
    logq, logp, q, p = _probs(draft_RV, target_RV, max_q, max_p, target_temperature=target_temperature,
                              draft_temperature=draft_temperature, ws=ws, dtype=dtype)
    q.div_(sumexp_q[..., None])
    p.div_(sumexp_p[..., None])
    out = ws.take("scratch" if kind == "reverse_kl" else "logq", draft_RV, dtype)  # logs only for reverse KL
    q_where_le = None
    if kind in ("tv", TV_KL):
        q_where_le = _q_where_le(q, p, out)
    elif kind == "reverse_kl":
        logq.sub_(sumexp_q.log()[..., None])
        logp.sub_(sumexp_p.log()[..., None])
    return direction(kind, q, p, logq, logp, q_where_le, aux, scale_R / draft_temperature, out)
