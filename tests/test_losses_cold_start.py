"""The cold-start objectives (nla, e2e_nla, lk, e2e_lk) against the float64 references and
their defining relations.

References: ``bebop_megatron.losses.reference`` (full softmaxes, Python loops over chains,
autograd; ``sg`` = ``.detach()``). Relations: the gradient of nla is (1/alpha) x TV's per
row; lk / e2e_lk with eta = 0 are kl, with a large eta tv / e2e_tv. The generic checks
(chunking, reductions, stats, bf16, cut chains, workspace size, host syncs) run for these
kinds too in ``test_losses.py`` and ``test_losses_chunking.py``, whose ``KINDS`` is every
objective.
"""

from __future__ import annotations

import pytest
import torch

from bebop_megatron.losses import OBJECTIVES, fused_linear_objective, tv_distance
from bebop_megatron.losses import reference as ref
from bebop_megatron.losses.cold_start import NLA_EPS
from bebop_megatron.losses.functions import ChainAcceptLength
from tests.helpers.loss_inputs import GRAD_OUT, K, assert_close_scaled, make_logits, make_valid, shifted_targets

NEW_KINDS = ("nla", "e2e_nla", "lk", "e2e_lk")


def _grad(kind, draft, target, valid, **kw):
    z = draft.clone().requires_grad_()
    loss = OBJECTIVES[kind](z, target, valid, **kw)
    (grad,) = torch.autograd.grad(GRAD_OUT * loss, z)
    return loss.detach(), grad


def _ref_grad(kind, draft, target, valid, temps=(1.0, 1.0), **kw):
    z = draft.double().requires_grad_()
    loss = ref.objective(kind, z, target.double(), valid, *temps, **kw)
    (grad,) = torch.autograd.grad(GRAD_OUT * loss, z)
    return loss.detach(), grad


def test_eps_is_the_references():
    assert NLA_EPS == ref.NLA_EPS


CASES = [("nla", None), ("e2e_nla", None)] + [(kind, eta) for kind in ("lk", "e2e_lk") for eta in (0.5, 3.0, 20.0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("kind,lk_eta", CASES, ids=[f"{kind}-{eta}" for kind, eta in CASES])
def test_padded_vocab_and_cut_chains_match_reference(kind, lk_eta, dtype):
    """vocab_size < V (Megatron's padded columns: zero gradient there) and invalid chain steps."""
    n, v, vocab_size = 23, 301, 257
    draft, target = make_logits(21, dtype, shape=(K, n, v))
    valid = make_valid(21, K, n)
    eta = {} if lk_eta is None else {"lk_eta": lk_eta}
    temps = (0.7, 1.3)
    loss, grad = _grad(kind, draft, target, valid, target_temperature=temps[0], draft_temperature=temps[1],
                       vocab_size=vocab_size, chunk_tokens=8, **eta)
    want_loss, want_grad = _ref_grad(kind, draft[..., :vocab_size], target[..., :vocab_size], valid, temps, **eta)
    rel = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(loss.double(), want_loss, rtol=rel, atol=0)
    assert_close_scaled(grad[..., :vocab_size], want_grad, 10 * rel, "gradient")
    assert grad[..., vocab_size:].abs().max() == 0
    chain = valid.long().cumprod(0).bool()
    assert grad[~chain].abs().max() == 0 and grad[chain].abs().max() > 0


def test_nla_gradient_is_tv_gradient_over_alpha():
    draft, target = make_logits(22, torch.float64, shape=(K, 17, 97))
    valid = make_valid(22, K, 17)
    _, grad_nla = _grad("nla", draft, target, valid, draft_temperature=1.3)
    _, grad_tv = _grad("tv", draft, target, valid, draft_temperature=1.3)
    alpha_KN = 1.0 - tv_distance(draft.flatten(0, 1), target.flatten(0, 1), draft_temperature=1.3).view(K, 17)
    torch.testing.assert_close(grad_nla, grad_tv / alpha_KN[..., None], rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("pair", [("lk", "tv", "kl"), ("e2e_lk", "e2e_tv", "kl")], ids=["lk", "e2e_lk"])
def test_lk_limits_are_tv_and_kl(pair):
    """eta = 0: lambda = 1, the KL objective; eta large: lambda = exp(-eta alpha) ~ 0, the TV one."""
    kind, tv_kind, kl_kind = pair
    draft, target = make_logits(23, torch.float64, shape=(K, 19, 89))
    valid = make_valid(23, K, 19)
    for eta, other in ((0.0, kl_kind), (1e4, tv_kind)):
        loss, grad = _grad(kind, draft, target, valid, lk_eta=eta, target_temperature=0.7)
        want_loss, want_grad = _grad(other, draft, target, valid, target_temperature=0.7)
        torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=0, msg=f"{kind} eta={eta}")
        torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-15, msg=f"{kind} eta={eta}")
    mid, _ = _grad(kind, draft, target, valid, lk_eta=3.0, target_temperature=0.7)
    kl_loss, _ = _grad(kl_kind, draft, target, valid, target_temperature=0.7)
    tv_loss, _ = _grad(tv_kind, draft, target, valid, target_temperature=0.7)
    assert min(kl_loss, tv_loss) < mid < max(kl_loss, tv_loss)  # a strict blend in between


@pytest.mark.parametrize("kind", ["nla", "e2e_nla"])
def test_nla_floor_keeps_log_finite(kind):
    """Disjoint supports (alpha = 0): loss -log(eps) per step / chain, finite, no gradient."""
    draft, target = make_logits(24, shape=(K, 6, 41))
    target[..., 20:] = float("-inf")
    draft[..., :20] = float("-inf")
    valid = torch.ones(K, 6, dtype=torch.bool)
    loss, grad = _grad(kind, draft, target, valid)
    want = -torch.log(torch.tensor(NLA_EPS))  # per step (nla) and per chain (e2e_nla) alike
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    assert torch.isfinite(grad).all() and grad.abs().max() == 0


def test_chain_accept_length_backward_matches_autograd():
    g = torch.Generator().manual_seed(25)
    k, n = 4, 19
    tv = torch.rand(k, n, generator=g, dtype=torch.float64)
    tv[1, ::3] = 1.0  # acceptance 0 inside chains: no division by it
    chain = (torch.rand(k, n, generator=g) > 0.2).long().cumprod(0).bool()
    assert torch.autograd.gradcheck(lambda d: ChainAcceptLength.apply(d, chain), (tv.clone().requires_grad_(),))
    want = torch.where(chain, (1.0 - tv).cumprod(0), 0.0).sum(0)
    torch.testing.assert_close(ChainAcceptLength.apply(tv, chain), want, rtol=1e-14, atol=0)


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_fused_matches_reference_on_hidden_states(kind):
    """Hidden states through a padded output projection, chunked, against the float64
    reference on explicitly shifted, unpadded logits (gradient w.r.t. the hidden states)."""
    g = torch.Generator().manual_seed(26)
    k_steps, S, B, H, V, vocab_size = 3, 9, 2, 12, 67, 60
    draft_h = torch.randn(k_steps, S, B, H, generator=g, dtype=torch.float64)
    backbone_h = torch.randn(S, B, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) / 2
    weight[vocab_size:] = 0.0  # Megatron's padded rows
    valid = torch.rand(k_steps, S, B, generator=g) > 0.2
    eta = {"lk_eta": 2.0} if kind in ("lk", "e2e_lk") else {}
    h = draft_h.clone().requires_grad_()
    loss = fused_linear_objective(kind, h, backbone_h, weight, valid, chunk_tokens=5, vocab_size=vocab_size,
                                  target_temperature=0.8, **eta)
    (grad,) = torch.autograd.grad(GRAD_OUT * loss, h)

    inside = torch.tensor([[s + k < S for s in range(S)] for k in range(1, k_steps + 1)])
    ref_valid = (valid & inside[..., None]).flatten(1)
    ref_h = draft_h.clone().requires_grad_()
    w = weight[:vocab_size]
    draft_logits = (ref_h @ w.t()).flatten(1, 2)
    target_logits = (shifted_targets(backbone_h, k_steps) @ w.t()).flatten(1, 2)
    want = ref.objective(kind, draft_logits, target_logits, ref_valid, 0.8, 1.0, **eta)
    (want_grad,) = torch.autograd.grad(GRAD_OUT * want, ref_h)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-14)


def test_invalid_arguments():
    draft, target = make_logits(27, shape=(K, 4, 9))
    valid = torch.ones(K, 4, dtype=torch.bool)
    for kind in ("lk", "e2e_lk"):
        # Both kernels run the hybrids; the Triton one refuses CPU tensors outside its interpreter.
        with pytest.raises(ValueError, match="impl='triton'"):
            OBJECTIVES[kind](draft, target, valid, impl="triton")
        for bad in (-0.1, float("inf"), float("nan"), "3"):
            with pytest.raises(ValueError, match="lk_eta"):
                OBJECTIVES[kind](draft, target, valid, lk_eta=bad)
    h, hb = torch.randn(2, 5, 1, 4), torch.randn(5, 1, 4)
    with pytest.raises(ValueError, match="lk_eta"):
        fused_linear_objective("lk", h, hb, torch.randn(7, 4), torch.ones(2, 5, 1, dtype=torch.bool), lk_eta=-1.0)


def test_nla_kinds_run_on_the_triton_kernel(tmp_path):
    """nla / e2e_nla use the Triton kernel's unchanged ``tv`` kind: impl="triton" (interpreted,
    CPU) equals impl="torch" (lk / e2e_lk, kind ``tv_kl``: tests/test_lk_triton.py)."""
    import json
    import os
    from unittest import mock

    pytest.importorskip("triton")
    from tests.helpers.launch import run_script

    out = tmp_path / "result.json"
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
        run_script("cold_start_triton_case.py", ["--out", str(out)], nproc=1, timeout=300)
    results = json.loads(out.read_text())
    assert set(results) == {"nla", "e2e_nla"}
    for kind, result in results.items():
        assert result["ok"], f"{kind}: {result['errors']} above {result['tolerance']}"
