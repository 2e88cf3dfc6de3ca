"""Inputs and runners shared by the objective tests (tests/test_losses.py,
tests/test_losses_chunking.py, tests/test_losses_cold_start.py).

Shapes are odd (K=3, N=41, V=1271); masks hold fully masked chains and chains cut in the
middle; gradients are taken of ``2.7 * loss`` (grad_output != 1). The reference is
``bebop_megatron.losses.reference`` (float64, autograd).
"""

from __future__ import annotations

import torch

from bebop_megatron.losses import OBJECTIVES
from bebop_megatron.losses import reference as ref

K, N, V = 3, 41, 1271
TEMPS = {"tau1": (1.0, 1.0), "tau_0.7_1.3": (0.7, 1.3)}
GRAD_OUT = 2.7
KINDS = list(OBJECTIVES)


def make_logits(seed: int, dtype=torch.float32, shape=(K, N, V)):
    """Correlated target/draft logits (moderate TV), drawn in float64 and then cast."""
    g = torch.Generator().manual_seed(seed)
    target = 2.0 * torch.randn(*shape, generator=g, dtype=torch.float64)
    draft = 0.8 * target + torch.randn(*shape, generator=g, dtype=torch.float64)
    return draft.to(dtype), target.to(dtype)


def make_valid(seed: int, k: int = K, n: int = N) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    valid = torch.rand(k, n, generator=g) > 0.2
    valid[:, 0] = False  # fully masked chain
    valid[:, 1] = torch.tensor([True, False, True])[:k]  # cut in the middle: step 3 ignored
    valid[:, 2] = True  # full chain
    valid[:, 3] = torch.tensor([False, True, True])[:k]  # K_t = 0 although later steps are set
    return valid


def assert_close_scaled(got, want, rel: float, what: str = ""):
    """max |got - want| <= rel * max |want| (+ a tiny floor)."""
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    assert err <= rel * scale + 1e-300, f"{what}: max err {err:.3e} vs scale {scale:.3e} (rel {rel})"


def run(kind, draft, target, valid, temps=(1.0, 1.0), **kw):
    """(loss, stats, d(2.7 * loss)/d draft) of the implementation."""
    draft = draft.clone().requires_grad_()
    loss, stats = OBJECTIVES[kind](
        draft, target, valid, target_temperature=temps[0], draft_temperature=temps[1], return_stats=True, **kw
    )
    (grad,) = torch.autograd.grad(GRAD_OUT * loss, draft)
    return loss.detach(), stats, grad


def run_reference(kind, draft, target, valid, temps=(1.0, 1.0), reduction="mean"):
    draft = draft.double().requires_grad_()
    loss = ref.objective(kind, draft, target.double(), valid, temps[0], temps[1], reduction)
    (grad,) = torch.autograd.grad(GRAD_OUT * loss, draft)
    return loss.detach(), ref.stats(draft.detach(), target.double(), valid, temps[0], temps[1]), grad


def shifted_targets(backbone_SBH, K):
    """Step k's target hidden state at s is the backbone at s + k; zeros past the end."""
    S = backbone_SBH.shape[0]
    out = backbone_SBH.new_zeros((K, *backbone_SBH.shape))
    for k in range(1, K + 1):
        out[k - 1, : S - k] = backbone_SBH[k:]
    return out
