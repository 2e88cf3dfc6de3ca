"""Float64 plain-torch references of the MTP objectives (used by the tests; also documentation).

Straight from DESIGN.md section 1: full softmaxes, Python loops over positions and chain
steps, autograd for gradients. Nothing here is chunked, vocabulary-parallel or analytic,
and nothing computed is shared with the implementation in ``tv.py``: the objective registry
(:mod:`bebop_megatron.losses.objectives`) only says which divergence an objective is built from
and which float64 per-position loss (:mod:`bebop_megatron.losses.reference_positions`) it has.

The cold-start objectives (nla, e2e_nla, lk, e2e_lk) follow the LK-loss paper's forms as
DESIGN.md section 1 states them; ``sg`` (stop-gradient) is ``.detach()`` here.

Legend: K MTP steps, N positions, V full vocabulary.
"""

from __future__ import annotations

import torch

from bebop_megatron.losses.objectives import objective as entry
from bebop_megatron.losses.reference_positions import NLA_EPS  # noqa: F401  (the tests' floor)


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.double() / temperature, dim=-1)


def chain_lengths(valid_KN: torch.Tensor) -> list[int]:
    """K_t per position: the number of leading valid steps (a chain stops at its first invalid step)."""
    K, N = valid_KN.shape
    lengths = []
    for t in range(N):
        m = 0
        while m < K and bool(valid_KN[m, t]):
            m += 1
        lengths.append(m)
    return lengths


def tv_distance(draft, target, target_temperature=1.0, draft_temperature=1.0) -> torch.Tensor:
    """Eq. 10 per row: d_TV(p, q) = 1 - sum_v min(p(v), q(v)); target detached."""
    p = probs(target.detach(), target_temperature)
    q = probs(draft, draft_temperature)
    return 1.0 - torch.minimum(p, q).sum(-1)


def kl(first_logits, second_logits, first_temperature, second_temperature) -> torch.Tensor:
    """KL(first || second) per row, with 0 log 0 = 0."""
    log_a = torch.log_softmax(first_logits.double() / first_temperature, dim=-1)
    log_b = torch.log_softmax(second_logits.double() / second_temperature, dim=-1)
    a = log_a.exp()
    return torch.where(a > 0, a * (log_a - log_b), 0.0).sum(-1)


def divergence(kernel, draft, target, target_temperature=1.0, draft_temperature=1.0) -> torch.Tensor:
    """The per-step divergence ``[K, N]`` of a kernel kind (d_TV for ``tv`` and ``tv_kl``)."""
    if kernel in ("tv", "tv_kl"):
        return tv_distance(draft, target, target_temperature, draft_temperature)
    if kernel == "kl":
        return kl(target.detach(), draft, target_temperature, draft_temperature)
    if kernel == "reverse_kl":
        return kl(draft, target.detach(), draft_temperature, target_temperature)
    raise ValueError(kernel)


def per_step(kind, draft, target, target_temperature=1.0, draft_temperature=1.0) -> torch.Tensor:
    """The per-step divergence ``[K, N]`` objective ``kind`` is built from (d_TV for nla/e2e_nla/lk/e2e_lk)."""
    return divergence(entry(kind).kernel, draft, target, target_temperature, draft_temperature)


def objective(kind, draft, target, valid, target_temperature=1.0, draft_temperature=1.0, reduction="mean",
              lk_eta=3.0):
    """Scalar loss of DESIGN.md section 1 (e2e: Eq. 13 per position; others: mean per-step value;
    the cold-start objectives as in ``losses.cold_start``'s docstring)."""
    spec = entry(kind)
    if spec.reference is None:
        raise ValueError(f"{kind}: no divergence reference (the data tokens' cross-entropy: torch's cross_entropy)")
    d = divergence(spec.kernel, draft, target, target_temperature, draft_temperature)
    kl_pq = kl(target.detach(), draft, target_temperature, draft_temperature) if spec.kernel == "tv_kl" else None
    K = valid.shape[0]
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    for t, m in enumerate(chain_lengths(valid)):
        if m == 0:
            continue
        count += 1
        total = total + spec.reference(d[:m, t], None if kl_pq is None else kl_pq[:m, t], K, lk_eta)
    if reduction == "sum":
        return total
    return total / max(count, 1)


def stats(draft, target, valid, target_temperature=1.0, draft_temperature=1.0) -> dict[str, torch.Tensor]:
    """Per-step ``[K]`` sums over valid-chain positions: alpha_rs, alpha_to, H(p), H(q), KL(p||q),
    accept_len_rs / accept_len_to (entry g-1: sum_{j<=g} prod_{i<=j} alpha_i of the position), count."""
    K, N = valid.shape
    with torch.no_grad():
        p = probs(target, target_temperature)
        q = probs(draft, draft_temperature)
        rows = {
            "alpha_rs": torch.minimum(p, q).sum(-1),
            # argmax on the scaled logits as the implementation sees them (first maximal index)
            "alpha_to": p.gather(-1, (draft.double() / draft_temperature).argmax(-1, keepdim=True)).squeeze(-1),
            "entropy_target": -torch.where(p > 0, p * p.log(), 0.0).sum(-1),
            "entropy_draft": -torch.where(q > 0, q * q.log(), 0.0).sum(-1),
            "kl": kl(target, draft, target_temperature, draft_temperature),
        }
        names = [*rows, "accept_len_rs", "accept_len_to", "count"]
        out = {name: torch.zeros(K, dtype=torch.float64) for name in names}
        for t, m in enumerate(chain_lengths(valid)):
            accepted = {"rs": 0.0, "to": 0.0}  # E[L](g) of this position, built up over g
            survive = {"rs": 1.0, "to": 1.0}  # prod_{i<=g} alpha_i
            for k in range(m):
                for name, row in rows.items():
                    out[name][k] += row[k, t]
                for v in ("rs", "to"):
                    survive[v] = survive[v] * float(rows[f"alpha_{v}"][k, t])
                    accepted[v] += survive[v]
                    out[f"accept_len_{v}"][k] += accepted[v]
                out["count"][k] += 1
    return out
