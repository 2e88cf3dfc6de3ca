"""The objective registry: every ``loss.type``, one entry each, and the one place their names are listed.

An entry says which per-row divergence the fused kernel computes for it (``kernel``: ``tv``, ``kl``,
``reverse_kl``, or ``tv_kl``, d_TV and KL(p||q) of the same row from one pass), how the rows of a
position's chain make its loss L_t (``loss``), the float64 reference of that L_t
(:mod:`bebop_megatron.losses.reference`), and the line of docs/objectives.md's table (``doc``).
The config's validation (``loss.type``), the study's objectives, the losses' entry points
(:data:`bebop_megatron.losses.OBJECTIVES`), the docs table and the tests read it.

Plain-torch meaning of an entry, for rows ``value [K, N]`` of its kernel and the chain mask::

    L_t = objective.loss(value, chain, lk_eta)[t]        # 0 where the chain is empty (K_t = 0)
    loss = L_t.sum() / (chain[0].sum())                   # reduction "mean"

Adding an objective that reuses an existing kernel kind: its per-position function and entry here,
its float64 reference in reference.py (docs/developing.md, "Adding an objective").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from bebop_megatron.losses import cold_start
from bebop_megatron.losses import reference_positions as reference
from bebop_megatron.losses.functions import E2EChain
from bebop_megatron.losses.kernel_torch import TV_KL


def per_step_mean(value_KN: torch.Tensor, chain_KN: torch.Tensor, lk_eta: float) -> torch.Tensor:
    """L_t = (1/K) sum_{k<=K_t} value_k: the per-step objectives (tv, kl, reverse_kl, ce)."""
    return torch.where(chain_KN, value_KN, 0.0).sum(0) / chain_KN.shape[0]


def e2e_tv(value_KN: torch.Tensor, chain_KN: torch.Tensor, lk_eta: float) -> torch.Tensor:
    """Eq. 13 per position: L_t = (1/K) sum_{j<=K_t} (1 - prod_{i<=j} (1 - d_TV_i))."""
    return E2EChain.apply(value_KN, chain_KN)


@dataclass(frozen=True)
class Objective:
    name: str
    kernel: str
    """The per-row divergence of the kernel: ``tv``, ``kl``, ``reverse_kl`` or ``tv_kl`` (rows ``[2, K, N]``)."""
    loss: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    """(rows, chain_KN, lk_eta) -> L_t ``[N]``."""
    reference: Callable | None
    """float64 L_t of one position from its chain's rows: (d ``[m]``, kl ``[m]`` or None, K, lk_eta);
    None for ce, whose reference is torch's cross_entropy at the data tokens (tests/test_loss_ce.py)."""
    doc: str
    """What it minimises: docs/objectives.md's table line."""
    data_tokens: bool = False
    """Trains on the data tokens' cross-entropy (ce), not against the backbone's p; fused only."""


_ENTRIES = (
    Objective("e2e_nla", "tv", cold_start.e2e_nla, reference.e2e_nla_position,
              "-log(E[L]/K) per chain: the negative log of the expected accepted length over the chain"),
    Objective("e2e_tv", "tv", e2e_tv, reference.e2e_tv_position, "Eq. 13, the paper's: end-to-end TV over the chain"),
    Objective("tv", "tv", per_step_mean, reference.per_step_position, "per-step TV (Eq. 10)"),
    Objective("kl", "kl", per_step_mean, reference.per_step_position, "forward KL(p\\|\\|q) per step"),
    Objective("reverse_kl", "reverse_kl", per_step_mean, reference.per_step_position,
              "reverse KL(q\\|\\|p) per step"),
    Objective("nla", "tv", cold_start.nla, reference.nla_position,
              "cold-start objective (LK-loss paper, arXiv 2602.23881): -log alpha per step"),
    Objective("lk", TV_KL, cold_start.lk, reference.lk_position,
              "lambda KL + (1 - lambda) TV per step, lambda = exp(-eta sg(alpha))"),
    Objective("e2e_lk", TV_KL, cold_start.e2e_lk, reference.e2e_lk_position,
              "lambda KL + (1 - lambda) e2e TV per chain, lambda = exp(-eta sg(E[L]/K))"),
    Objective("ce", "tv", per_step_mean, None,
              "cross-entropy on the data tokens, Megatron's default MTP loss (of the raw draft logits: the temperatures "
              "apply to its statistics only); fused with the output projection like the others, no full logits",
              data_tokens=True),
)
OBJECTIVES: dict[str, Objective] = {o.name: o for o in _ENTRIES}
"""``loss.type`` -> its entry; the first is the default."""
NAMES = tuple(OBJECTIVES)
DEFAULT = NAMES[0]
DISTRIBUTION_NAMES = tuple(n for n, o in OBJECTIVES.items() if not o.data_tokens)
"""The objectives against the backbone's distribution p (every one but ce): the unfused entry points'."""


def objective(name: str) -> Objective:
    """The entry of ``name``; ValueError naming the registry's names."""
    if name not in OBJECTIVES:
        raise ValueError(f"kind must be one of {NAMES}, got {name!r}")
    return OBJECTIVES[name]


__all__ = ["DEFAULT", "DISTRIBUTION_NAMES", "NAMES", "OBJECTIVES", "Objective", "e2e_tv", "objective",
           "per_step_mean"]
