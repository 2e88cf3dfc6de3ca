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
from bebop_megatron.losses.kernel_torch import TV_KL

NLA_EPS = 1e-6
DEFAULT_LK_ETA = 3.0
COLD_START_KINDS = ("nla", "e2e_nla", "lk", "e2e_lk")
HYBRID_KINDS = ("lk", "e2e_lk")  # need KL and TV per row (kernel kind tv_kl, both kernels)
KERNEL_KIND = {"nla": "tv", "e2e_nla": "tv", "lk": TV_KL, "e2e_lk": TV_KL}


def per_position(kind: str, value: torch.Tensor, chain_KN: torch.Tensor, lk_eta: float) -> torch.Tensor:
    """L_t ``[N]`` of ``kind`` from the kernel's per-row values: d_TV ``[K, N]`` (nla, e2e_nla) or
    (d_TV, KL(p||q)) ``[2, K, N]`` (lk, e2e_lk); 0 where K_t = 0."""
    K = chain_KN.shape[0]
    if kind == "nla":
        alpha_KN = (1.0 - value).clamp(min=NLA_EPS)
        return torch.where(chain_KN, -alpha_KN.log(), 0.0).sum(0) / K
    if kind == "e2e_nla":
        accept_N = (ChainAcceptLength.apply(value, chain_KN) / K).clamp(min=NLA_EPS)
        return torch.where(chain_KN[0], -accept_N.log(), 0.0)
    tv_KN, kl_KN = value.unbind(0)
    if kind == "lk":
        lam_KN = torch.exp(-lk_eta * (1.0 - tv_KN.detach()))
        return torch.where(chain_KN, lam_KN * kl_KN + (1.0 - lam_KN) * tv_KN, 0.0).sum(0) / K
    if kind == "e2e_lk":
        with torch.no_grad():
            lam_N = torch.exp(-lk_eta * ChainAcceptLength.apply(tv_KN, chain_KN) / K)
        kl_N = torch.where(chain_KN, kl_KN, 0.0).sum(0) / K
        return lam_N * kl_N + (1.0 - lam_N) * E2EChain.apply(tv_KN, chain_KN)
    raise ValueError(f"kind must be one of {COLD_START_KINDS}, got {kind!r}")


def check_lk_eta(lk_eta) -> float:
    """eta of the LK hybrids: a finite float >= 0 (0 gives KL, large gives TV)."""
    if isinstance(lk_eta, bool) or not isinstance(lk_eta, (int, float)) or not 0.0 <= lk_eta < float("inf"):
        raise ValueError(f"lk_eta must be a finite number >= 0, got {lk_eta!r}")
    return float(lk_eta)


__all__ = ["COLD_START_KINDS", "DEFAULT_LK_ETA", "HYBRID_KINDS", "KERNEL_KIND", "NLA_EPS", "check_lk_eta",
           "per_position"]
