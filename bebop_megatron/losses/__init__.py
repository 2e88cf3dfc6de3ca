"""MTP training objectives on logits: e2e TV (Eq. 13), per-step TV (Eq. 10), forward and reverse KL,
and the cold-start objectives nla, e2e_nla, lk, e2e_lk (``cold_start``).

Exact over the full (tensor-parallel sharded) vocabulary, chunked over positions, with
analytic backward. ``reference`` holds the float64 plain-torch definitions the tests use.
"""

from bebop_megatron.losses.kernel_torch import STAT_KEYS
from bebop_megatron.losses.tv import (
    ACCEPT_LEN_KEYS,
    ENTRY_POINTS,
    accept_length_rows,
    chain_lengths,
    chain_mask,
    e2e_lk_loss,
    e2e_nla_loss,
    e2e_tv_loss,
    forward_kl_loss,
    fused_linear_objective,
    lk_loss,
    nla_loss,
    reverse_kl_loss,
    tv_distance,
    tv_loss,
)

OBJECTIVES = ENTRY_POINTS  # the registry's distribution objectives (losses/objectives.py) -> their functions

__all__ = [
    "ACCEPT_LEN_KEYS", "OBJECTIVES", "STAT_KEYS", "accept_length_rows", "chain_lengths", "chain_mask",
    "e2e_lk_loss", "e2e_nla_loss", "e2e_tv_loss", "forward_kl_loss", "fused_linear_objective", "lk_loss", "nla_loss",
    "reverse_kl_loss", "tv_distance", "tv_loss",
]
