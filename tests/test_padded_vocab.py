"""Megatron's padded vocabulary is excluded from every objective and statistic.

The embedding and output layer have ``padded_vocab_size`` rows; the rows past the model's
real ``vocab_size`` are zero (logit 0). Each test gives the implementation the padded
logits (or hidden states and the padded output weight) with ``vocab_size`` and compares
it with the float64 reference on the *unpadded* vocabulary ``[..., :vocab_size]``: loss,
statistics, and a gradient that is zero on the padded columns. TP=2 (a shard partly or
wholly padded) is in ``tests/distributed/test_losses_tp.py``; the trainer's CE path in
``tests/test_loss_ce.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from bebop_megatron.losses import OBJECTIVES, fused_linear_objective
from bebop_megatron.losses import reference as ref
from bebop_megatron.metrics import acceptance_stats

K, N, V_REAL, V_PAD = 3, 29, 300, 384
GRAD_OUT = 2.7


def padded_logits(seed: int):
    """Correlated draft/target logits over the real vocabulary, then Megatron's padding (logit 0)."""
    g = torch.Generator().manual_seed(seed)
    target = 2.0 * torch.randn(K, N, V_REAL, generator=g, dtype=torch.float64)
    draft = 0.8 * target + torch.randn(K, N, V_REAL, generator=g, dtype=torch.float64)
    pad = torch.zeros(K, N, V_PAD - V_REAL, dtype=torch.float64)
    valid = torch.rand(K, N, generator=g) > 0.2
    valid[:, 0] = True
    return draft, target, torch.cat([draft, pad], -1), torch.cat([target, pad], -1), valid


@pytest.mark.parametrize("kind", list(OBJECTIVES))
def test_objectives_equal_reference_on_unpadded_vocabulary(kind):
    draft, target, draft_pad, target_pad, valid = padded_logits(0)
    x = draft_pad.clone().requires_grad_()
    loss, stats = OBJECTIVES[kind](x, target_pad, valid, target_temperature=0.8, draft_temperature=1.2,
                                   return_stats=True, vocab_size=V_REAL, chunk_tokens=13)
    (grad,) = torch.autograd.grad(GRAD_OUT * loss, x)

    r = draft.clone().requires_grad_()
    want = ref.objective(kind, r, target, valid, 0.8, 1.2)
    (want_grad,) = torch.autograd.grad(GRAD_OUT * want, r)
    want_stats = ref.stats(draft, target, valid, 0.8, 1.2)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad[..., :V_REAL], want_grad, rtol=1e-9, atol=1e-12)
    assert torch.count_nonzero(grad[..., V_REAL:]) == 0
    for key in ("alpha_rs", "alpha_to", "entropy_target", "entropy_draft", "kl", "accept_len_rs", "count"):
        torch.testing.assert_close(stats[key], want_stats[key], rtol=1e-9, atol=1e-12, msg=key)


def test_without_vocab_size_the_padding_counts():
    """The bug this fixes: the padded columns (logit 0) carry mass when nothing masks them."""
    draft, target, draft_pad, target_pad, valid = padded_logits(1)
    masked = OBJECTIVES["tv"](draft_pad, target_pad, valid, vocab_size=V_REAL)
    unmasked = OBJECTIVES["tv"](draft_pad, target_pad, valid)
    assert abs(masked.item() - unmasked.item()) > 1e-4


@pytest.mark.parametrize("kind", ["e2e_tv", "kl"])
def test_fused_objective_equals_reference_on_unpadded_vocabulary(kind):
    g = torch.Generator().manual_seed(2)
    S, B, H = 9, 2, 16
    draft_h = torch.randn(K, S, B, H, generator=g, dtype=torch.float64, requires_grad=True)
    backbone_h = torch.randn(S, B, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V_REAL, H, generator=g, dtype=torch.float64) / 2
    weight_pad = torch.cat([weight, weight.new_zeros(V_PAD - V_REAL, H)])  # Megatron's zero rows
    valid = torch.rand(K, S, B, generator=g) > 0.2
    loss, stats = fused_linear_objective(kind, draft_h, backbone_h, weight_pad, valid, chunk_tokens=5,
                                         return_stats=True, vocab_size=V_REAL)
    (grad,) = torch.autograd.grad(GRAD_OUT * loss, draft_h)
    want, want_stats = fused_linear_objective(kind, draft_h, backbone_h, weight, valid, chunk_tokens=5,
                                              return_stats=True)
    (want_grad,) = torch.autograd.grad(GRAD_OUT * want, draft_h)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-12)
    for key, value in want_stats.items():
        torch.testing.assert_close(stats[key], value, rtol=1e-9, atol=1e-12, msg=key)


def test_acceptance_stats_on_unpadded_vocabulary():
    draft, target, draft_pad, target_pad, valid = padded_logits(3)
    got = acceptance_stats(draft_pad, target_pad, valid, vocab_size=V_REAL, chunk_tokens=11)
    want = acceptance_stats(draft, target, valid)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-10, atol=1e-12, msg=key)
    # A fresh model's near-uniform backbone: H(p) close to ln 300, not ln 384.
    flat = torch.zeros(K, N, V_PAD, dtype=torch.float64)
    stats = acceptance_stats(flat, flat, valid, vocab_size=V_REAL)
    torch.testing.assert_close(stats["entropy_target"], torch.full((K,), math.log(V_REAL), dtype=torch.float64))
    assert not torch.allclose(acceptance_stats(flat, flat, valid)["entropy_target"],
                              torch.full((K,), math.log(V_REAL), dtype=torch.float64))
