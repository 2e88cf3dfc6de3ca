"""Reference verification of a chain of gamma drafted tokens: rejection sampling and target-only.

Legend: G gamma (drafted tokens), V vocabulary, B independent chains (batched variants).

Row i of ``target_probs`` is the target distribution p_{i+1} the (i+1)-th draft is
verified against, row G the distribution of the bonus token after G acceptances; row i of
``draft_probs`` is the draft distribution q_{i+1}. Both are probabilities (rows summing to
1), not logits.

Randomness: a chain consumes ``torch.rand(G)`` (one uniform per step) and then one more
uniform for the emitted token (inverse CDF), from ``generator``, in float64. The batched
variants draw ``torch.rand(B, G)`` and ``torch.rand(B)``, so with B = 1 they return exactly
what the per-chain functions return for the same generator state (tested).
"""

from __future__ import annotations

import torch


def inverse_cdf(weights_BV: torch.Tensor, u_B: torch.Tensor) -> torch.Tensor:
    """One index per row with probability weights / weights.sum() (weights >= 0, unnormalised)."""
    cdf_BV = weights_BV.cumsum(-1)
    index_B = torch.searchsorted(cdf_BV, (u_B * cdf_BV[:, -1])[:, None], right=True)[:, 0]
    # u * total may round up to total: fall back to the last index with positive weight.
    last_B = torch.where(weights_BV > 0, torch.arange(weights_BV.shape[-1], device=weights_BV.device), -1).amax(-1)
    return torch.minimum(index_B, last_B)


def _check(target_probs, draft_probs, batched: bool) -> None:
    lead = 1 if batched else 0
    if draft_probs.dim() != 2 + lead or target_probs.dim() != 2 + lead:
        shape = "[B, G+1, V] and [B, G, V]" if batched else "[G+1, V] and [G, V]"
        raise ValueError(f"target_probs and draft_probs must be {shape}, got {tuple(target_probs.shape)} "
                         f"and {tuple(draft_probs.shape)}")
    G = draft_probs.shape[-2]
    if target_probs.shape[-2] != G + 1 or target_probs.shape[-1] != draft_probs.shape[-1] or G < 1:
        raise ValueError(f"target_probs needs G+1 rows for G={G} drafts and the same vocabulary, got "
                         f"{tuple(target_probs.shape)} and {tuple(draft_probs.shape)}")


def sample_drafts(draft_probs_BGV: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``[B, G]`` tokens, token (b, i) drawn from ``draft_probs[b, i]`` (one uniform each)."""
    B, G, V = draft_probs_BGV.shape
    u = torch.rand(B * G, generator=generator, dtype=torch.float64, device=draft_probs_BGV.device)
    return inverse_cdf(draft_probs_BGV.reshape(B * G, V).double(), u).view(B, G)


def chain_rejection_sample(target_probs, draft_probs, draft_tokens, generator=None) -> tuple[int, int]:
    """Verify G drafts ``draft_tokens`` (sampled from ``draft_probs``) by rejection sampling.

    Step i accepts y_i with probability min(1, p_i(y_i) / q_i(y_i)); the chain stops at the
    first rejection and emits a token resampled from max(0, p_i - q_i) normalised (p_i itself
    if that is all zero); when all G are accepted it emits a bonus token from row G of
    ``target_probs``. Whatever q is, every emitted token is distributed as its p (the
    acceptance of step i is alpha_RS = sum_v min(p_i, q_i)).

    Returns ``(num_accepted, next_token)``: 0..G accepted drafts, and the token emitted after them.
    """
    _check(target_probs, draft_probs, batched=False)
    p, q = target_probs.double(), draft_probs.double()
    G = q.shape[0]
    u = torch.rand(G, generator=generator, dtype=torch.float64, device=p.device)
    u_token = torch.rand(1, generator=generator, dtype=torch.float64, device=p.device)
    for i in range(G):
        y = int(draft_tokens[i])
        if u[i] * q[i, y] < p[i, y]:  # u < p/q without dividing by q
            continue
        residual = (p[i] - q[i]).clamp_(min=0.0)
        if not residual.sum() > 0:
            residual = p[i]
        return i, int(inverse_cdf(residual[None], u_token)[0])
    return G, int(inverse_cdf(p[G][None], u_token)[0])


def chain_target_only(target_probs, draft_probs, generator=None) -> tuple[int, int]:
    """Verify the greedy drafts y_i = argmax q_i (lowest index on ties) target-only.

    Step i accepts y_i with probability p_i(y_i) (alpha_TO); on the first rejection the
    emitted token is resampled from p_i without y_i (renormalised); after G acceptances the
    bonus token comes from row G of ``target_probs``. Emitted tokens are distributed as p.

    Returns ``(num_accepted, next_token)``.
    """
    _check(target_probs, draft_probs, batched=False)
    p = target_probs.double()
    G = draft_probs.shape[0]
    u = torch.rand(G, generator=generator, dtype=torch.float64, device=p.device)
    u_token = torch.rand(1, generator=generator, dtype=torch.float64, device=p.device)
    for i in range(G):
        y = int(draft_probs[i].argmax())
        if u[i] < p[i, y]:
            continue
        rest = p[i].clone()
        rest[y] = 0.0
        return i, int(inverse_cdf(rest[None], u_token)[0])
    return G, int(inverse_cdf(p[G][None], u_token)[0])


def _first_rejection(accept_BG: torch.Tensor) -> torch.Tensor:
    """Number of leading accepted steps per chain."""
    return accept_BG.long().cumprod(-1).sum(-1)


def batched_rejection_sample(target_probs, draft_probs, draft_tokens, generator=None):
    """:func:`chain_rejection_sample` for B independent chains at once: ``[B, G+1, V]``,
    ``[B, G, V]``, ``[B, G]`` -> ``(num_accepted [B], next_token [B])``."""
    _check(target_probs, draft_probs, batched=True)
    p, q = target_probs.double(), draft_probs.double()
    B, G, V = q.shape
    u = torch.rand(B, G, generator=generator, dtype=torch.float64, device=p.device)
    u_token = torch.rand(B, generator=generator, dtype=torch.float64, device=p.device)
    y = draft_tokens.long()[..., None]
    accept = u * q.gather(-1, y)[..., 0] < p[:, :G].gather(-1, y)[..., 0]
    num = _first_rejection(accept)
    rows = torch.arange(B, device=p.device)
    p_row = p[rows, num]  # p_i at the first rejection, or the bonus row G
    q_row = torch.cat([q, torch.zeros_like(q[:, :1])], 1)[rows, num]  # 0 for the bonus row
    residual = (p_row - q_row).clamp_(min=0.0)
    residual = torch.where((residual.sum(-1) > 0)[:, None], residual, p_row)
    return num, inverse_cdf(residual, u_token)


def batched_target_only(target_probs, draft_probs, generator=None):
    """:func:`chain_target_only` for B chains at once -> ``(num_accepted [B], next_token [B])``."""
    _check(target_probs, draft_probs, batched=True)
    p = target_probs.double()
    B, G, V = draft_probs.shape
    u = torch.rand(B, G, generator=generator, dtype=torch.float64, device=p.device)
    u_token = torch.rand(B, generator=generator, dtype=torch.float64, device=p.device)
    y = draft_probs.argmax(-1)  # [B, G]
    num = _first_rejection(u < p[:, :G].gather(-1, y[..., None])[..., 0])
    rows = torch.arange(B, device=p.device)
    weights = p[rows, num].clone()
    rejected = num < G
    weights[rows[rejected], y[rows[rejected], num[rejected]]] = 0.0  # p without the rejected draft
    return num, inverse_cdf(weights, u_token)
