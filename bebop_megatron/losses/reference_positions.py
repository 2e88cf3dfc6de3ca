"""Float64 plain-torch L_t of one position, per objective (the registry's ``reference``; the
float64 objectives of :mod:`bebop_megatron.losses.reference` sum them over positions).

Each takes the m >= 1 rows of a position's chain: ``d`` ``[m]`` (the objective's per-step divergence),
``kl_pq`` ``[m]`` (KL(p||q), the LK hybrids only, else None), ``K`` steps and ``lk_eta``. Python
loops and autograd, nothing shared with the implementation (DESIGN.md section 1).
"""

from __future__ import annotations

import torch

NLA_EPS = 1e-6  # floor of alpha (nla) and E[L]/K (e2e_nla) before the log


def per_step_position(d, kl_pq, K, lk_eta):
    """tv, kl, reverse_kl, ce: (1/K) sum_j d_j."""
    return sum(d[j] for j in range(len(d))) / K


def _survival(d):
    """prod_{i<=j} alpha_i for j = 1..m, alpha = 1 - d_TV."""
    out, survive = [], 1.0
    for j in range(len(d)):
        survive = survive * (1.0 - d[j])
        out.append(survive)
    return out


def e2e_tv_position(d, kl_pq, K, lk_eta):
    """Eq. 13: (1/K) sum_j (1 - prod_{i<=j} alpha_i)."""
    return sum(1.0 - s for s in _survival(d)) / K


def nla_position(d, kl_pq, K, lk_eta):
    """(1/K) sum_j -log(max(alpha_j, eps))."""
    return sum(-torch.log(torch.clamp(1.0 - d[j], min=NLA_EPS)) for j in range(len(d))) / K


def e2e_nla_position(d, kl_pq, K, lk_eta):
    """-log(max(E[L] / K, eps)), E[L] = sum_j prod_{i<=j} alpha_i (Eq. 12)."""
    return -torch.log(torch.clamp(sum(_survival(d)) / K, min=NLA_EPS))


def lk_position(d, kl_pq, K, lk_eta):
    """(1/K) sum_j lam_j KL_j + (1 - lam_j) d_j, lam_j = exp(-eta sg(alpha_j))."""
    total = 0.0
    for j in range(len(d)):
        lam = torch.exp(-lk_eta * (1.0 - d[j]).detach())
        total = total + lam * kl_pq[j] + (1.0 - lam) * d[j]
    return total / K


def e2e_lk_position(d, kl_pq, K, lk_eta):
    """lam (1/K) sum_j KL_j + (1 - lam) Eq. 13, lam = exp(-eta sg(E[L] / K))."""
    survive = _survival(d)
    lam = torch.exp(-lk_eta * sum(survive).detach() / K)
    return lam * sum(kl_pq[j] for j in range(len(d))) / K + (1.0 - lam) * sum(1.0 - s for s in survive) / K


