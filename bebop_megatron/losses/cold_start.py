"""Per-position losses of the cold-start objectives (LK-loss paper, arXiv 2602.23881; DESIGN.md section 1).

Legend: K MTP steps, N positions; ``chain_KN`` (bool) says step k is inside position t's
chain (k < K_t); alpha_k = 1 - d_TV(p_k, q_k) (Eq. 10); E[L]_t = sum_{j<=K_t} prod_{i<=j}
alpha_i (Eq. 12); ``sg`` is stop-gradient.

- ``nla``:     L_t = (1/K) sum_{k<=K_t} -log(max(alpha_k, eps))   (gradient (1/alpha) x TV's)
- ``e2e_nla``: L_t = -log(max(E[L]_t / K, eps))                    (0 where K_t = 0)
- ``lk``:      L_t = (1/K) sum_{k<=K_t} [lam_k KL_k + (1 - lam_k) d_TV_k],  lam_k = exp(-eta sg(alpha_k))
- ``e2e_lk``:  L_t = lam_t L_t^kl + (1 - lam_t) L_t^e2e_tv,  lam_t = exp(-eta sg(E[L]_t / K)), where
  L_t^kl = (1/K) sum_{k<=K_t} KL_k and L_t^e2e_tv is Eq. 13 per position (the ``kl`` and
  ``e2e_tv`` objectives' L_t, so eta = 0 gives ``kl`` and eta -> inf gives ``e2e_tv``).

``eps`` (``NLA_EPS`` = 1e-6) keeps log(0) out: alpha is computed as 1 - d_TV, whose float32
rounding is ~1e-7, so below 1e-6 the factor 1/alpha would scale rounding noise; there the
loss is flat at -log(1e-6) = 13.8 and the row gets no gradient (torch.clamp's gradient).
The ``nla``/``e2e_nla`` rows need d_TV only (kernel kind ``tv``); ``lk``/``e2e_lk`` need d_TV
and KL(p||q) of the same row, from one pass of the kernel kind ``tv_kl``.
"""

from __future__ import annotations

import torch

from bebop_megatron.losses.functions import ChainAcceptLength, E2EChain

NLA_EPS = 1e-6
DEFAULT_LK_ETA = 3.0


def nla(tv_KN: torch.Tensor, chain_KN: torch.Tensor, lk_eta: float) -> torch.Tensor:
    """L_t of ``nla`` from d_TV ``[K, N]``: (1/K) sum_{k<=K_t} -log(max(alpha_k, eps))."""
    alpha_KN = (1.0 - tv_KN).clamp(min=NLA_EPS)
    return torch.where(chain_KN, -alpha_KN.log(), 0.0).sum(0) / chain_KN.shape[0]


def e2e_nla(tv_KN: torch.Tensor, chain_KN: torch.Tensor, lk_eta: float) -> torch.Tensor:
    """L_t of ``e2e_nla`` from d_TV ``[K, N]``: -log(max(E[L]_t / K, eps)); 0 where K_t = 0."""
    accept_N = (ChainAcceptLength.apply(tv_KN, chain_KN) / chain_KN.shape[0]).clamp(min=NLA_EPS)
    return torch.where(chain_KN[0], -accept_N.log(), 0.0)


def lk(rows_2KN: torch.Tensor, chain_KN: torch.Tensor, lk_eta: float) -> torch.Tensor:
    """L_t of ``lk`` from (d_TV, KL(p||q)) ``[2, K, N]``: (1/K) sum_{k<=K_t} lam_k KL_k + (1 - lam_k) d_TV_k."""
    tv_KN, kl_KN = rows_2KN.unbind(0)
    lam_KN = torch.exp(-lk_eta * (1.0 - tv_KN.detach()))
    return torch.where(chain_KN, lam_KN * kl_KN + (1.0 - lam_KN) * tv_KN, 0.0).sum(0) / chain_KN.shape[0]


def e2e_lk(rows_2KN: torch.Tensor, chain_KN: torch.Tensor, lk_eta: float) -> torch.Tensor:
    """L_t of ``e2e_lk`` from (d_TV, KL(p||q)) ``[2, K, N]``: lam_t L_t^kl + (1 - lam_t) L_t^e2e_tv."""
    tv_KN, kl_KN = rows_2KN.unbind(0)
    K = chain_KN.shape[0]
    with torch.no_grad():
        lam_N = torch.exp(-lk_eta * ChainAcceptLength.apply(tv_KN, chain_KN) / K)
    kl_N = torch.where(chain_KN, kl_KN, 0.0).sum(0) / K
    return lam_N * kl_N + (1.0 - lam_N) * E2EChain.apply(tv_KN, chain_KN)


def check_lk_eta(lk_eta) -> float:
    """eta of the LK hybrids: a finite float >= 0 (0 gives KL, large gives TV)."""
    if isinstance(lk_eta, bool) or not isinstance(lk_eta, (int, float)) or not 0.0 <= lk_eta < float("inf"):
        raise ValueError(f"lk_eta must be a finite number >= 0, got {lk_eta!r}")
    return float(lk_eta)


__all__ = ["DEFAULT_LK_ETA", "NLA_EPS", "check_lk_eta", "e2e_lk", "e2e_nla", "lk", "nla"]
