"""The MTP objectives (bebop_megatron.losses) against the float64 autograd references.

Reference: ``bebop_megatron.losses.reference`` (full softmaxes, Python loops over chains,
autograd). Shapes are odd (K=3, N=41, V=1271); masks hold fully masked chains and chains
cut in the middle; gradients are taken of ``2.7 * loss`` (grad_output != 1): the inputs and
runners are tests/helpers/loss_inputs.py. Chunking, workspace size, host syncs, argument
checks and the objectives fused with the output projection: tests/test_losses_chunking.py.
"""

from __future__ import annotations

import pytest
import torch

from bebop_megatron.losses import (
    ACCEPT_LEN_KEYS,
    OBJECTIVES,
    STAT_KEYS,
    chain_lengths,
    chain_mask,
    tv_distance,
    tv_loss,
)
from bebop_megatron.losses import reference as ref
from bebop_megatron.losses.functions import E2EChain
from tests.helpers.loss_inputs import (
    KINDS,
    TEMPS,
    K,
    N,
    V,
    assert_close_scaled,
    make_logits,
    make_valid,
    run,
    run_reference,
)


# --------------------------------------------------------------------------- chains


@pytest.mark.parametrize("seed", range(4))
def test_chain_lengths_match_reference(seed):
    valid = make_valid(seed)
    assert chain_lengths(valid).dtype == torch.long
    assert chain_lengths(valid).tolist() == ref.chain_lengths(valid)
    assert chain_lengths(valid)[:4].tolist() == [0, 1, K, 0]
    mask = chain_mask(valid)
    assert torch.equal(mask.sum(0), chain_lengths(valid))
    assert torch.equal(mask, mask.int().cumprod(0).bool())


def test_e2e_chain_backward_without_division_by_zero_acceptance():
    """d_TV = 1 (acceptance 0) in the middle of chains: analytic prefix/suffix backward = autograd."""
    g = torch.Generator().manual_seed(3)
    k, n = 5, 23
    tv = torch.rand(k, n, generator=g, dtype=torch.float64)
    tv[1, ::3] = 1.0
    tv[0, 5] = 1.0
    tv[:, 7] = 1.0
    tv[2, ::4] = 0.0
    valid = torch.rand(k, n, generator=g) > 0.15
    chain = chain_mask(valid)
    weights = torch.rand(n, generator=g, dtype=torch.float64)  # a per-position incoming gradient
    tv_impl = tv.clone().requires_grad_()
    (E2EChain.apply(tv_impl, chain) * weights).sum().backward()
    tv_ref = tv.clone().requires_grad_()
    total = 0.0
    for t, m in enumerate(ref.chain_lengths(valid)):
        accepted, position = 1.0, 0.0
        for j in range(m):
            accepted = accepted * (1.0 - tv_ref[j, t])
            position = position + (1.0 - accepted)
        total = total + weights[t] * position / k
    total.backward()
    torch.testing.assert_close(tv_impl.grad, tv_ref.grad, rtol=1e-12, atol=1e-14)
    assert tv_impl.grad[:, 7].abs().max() > 0  # step 1 still gets a gradient when a_1 = 0
    inputs = torch.rand(k, n, generator=g, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda d: E2EChain.apply(d, chain), (inputs,))


# --------------------------------------------------------------------------- vs reference


@pytest.mark.parametrize("temps", TEMPS.values(), ids=TEMPS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("kind", KINDS)
def test_matches_reference(kind, dtype, temps):
    draft, target = make_logits(1, dtype)
    valid = make_valid(1)
    loss, stats, grad = run(kind, draft, target, valid, temps, chunk_tokens=16)
    want_loss, want_stats, want_grad = run_reference(kind, draft, target, valid, temps)
    rel = 1e-12 if dtype == torch.float64 else 2e-6
    assert loss.dtype == dtype and grad.dtype == dtype
    torch.testing.assert_close(loss.double(), want_loss, rtol=rel, atol=0)
    assert_close_scaled(grad, want_grad, 10 * rel, "gradient")
    assert set(stats) == {*STAT_KEYS, *ACCEPT_LEN_KEYS, "count"}
    for name in STAT_KEYS:
        assert stats[name].shape == (K,)
        torch.testing.assert_close(stats[name].double(), want_stats[name], rtol=10 * rel, atol=10 * rel, msg=name)
    assert stats["count"].tolist() == want_stats["count"].tolist()
    # ignored steps get exactly no gradient
    assert grad[~chain_mask(valid)].abs().max() == 0


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_inputs_use_fp32_math(kind):
    draft, target = make_logits(2, torch.bfloat16)
    valid = make_valid(2)
    loss, stats, grad = run(kind, draft, target, valid, (0.7, 1.3))
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    assert all(v.dtype == torch.float32 for v in stats.values())
    # the reference sees the same bf16 values, so only fp32 math and the bf16 gradient round
    want_loss, want_stats, want_grad = run_reference(kind, draft, target, valid, (0.7, 1.3))
    torch.testing.assert_close(loss.double(), want_loss, rtol=2e-6, atol=0)
    assert_close_scaled(grad, want_grad, 1e-2, "bf16 gradient")
    for name in STAT_KEYS:
        torch.testing.assert_close(stats[name].double(), want_stats[name], rtol=2e-5, atol=2e-5, msg=name)


@pytest.mark.parametrize("kind", KINDS)
def test_reduction_sum_is_mean_times_count(kind):
    draft, target = make_logits(5)
    valid = make_valid(5)
    mean, stats, grad_mean = run(kind, draft, target, valid, reduction="mean")
    total, _, grad_sum = run(kind, draft, target, valid, reduction="sum")
    count = stats["count"][0]
    assert count == (chain_lengths(valid) > 0).sum()
    torch.testing.assert_close(total, mean * count, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad_sum, grad_mean * count, rtol=1e-5, atol=1e-12)
    want_total = ref.objective(kind, draft.double(), target.double(), valid, reduction="sum")
    torch.testing.assert_close(total.double(), want_total, rtol=2e-6, atol=0)


def test_cut_chain_ignores_later_steps():
    """Position 1 has valid steps [1, 0, 1]: step 3 must not move the loss nor get a gradient."""
    draft, target = make_logits(6)
    valid = make_valid(6)
    for kind in KINDS:
        loss, _, grad = run(kind, draft, target, valid)
        changed = draft.clone()
        changed[2, 1] = 5.0 * torch.randn(V)
        changed[1:, 3] = 5.0 * torch.randn(V)  # position 3: step 1 invalid, steps 2-3 set
        loss_changed, _, _ = run(kind, changed, target, valid)
        assert torch.equal(loss, loss_changed), kind
        assert grad[1:, 1].abs().max() == 0 and grad[:, 3].abs().max() == 0 and grad[:, 0].abs().max() == 0
        assert grad[0, 1].abs().max() > 0


@pytest.mark.parametrize("kind", KINDS)
def test_fully_masked_batch_gives_zero(kind):
    draft, target = make_logits(7, shape=(K, 5, 33))
    valid = torch.zeros(K, 5, dtype=torch.bool)
    valid[1:] = True  # set, but every chain breaks at step 1
    for reduction in ("mean", "sum"):
        loss, stats, grad = run(kind, draft, target, valid, reduction=reduction)
        assert loss.item() == 0.0 and torch.isfinite(loss)
        assert grad.abs().max() == 0
        assert all(v.abs().max() == 0 for v in stats.values())


@pytest.mark.parametrize("kind", KINDS)
def test_draft_equal_to_target(kind):
    _, target = make_logits(8)
    valid = make_valid(8)
    loss, stats, grad = run(kind, target, target, valid)
    want = 0.0
    if kind == "e2e_nla":  # E[L]_t = K_t: -log(K_t / K) on chains cut short
        lengths = chain_lengths(valid)
        want = -torch.log(lengths[lengths > 0] / K).mean().item()
    assert abs(loss.item() - want) < 1e-6
    assert grad.abs().max() < 1e-8
    count = stats["count"]
    torch.testing.assert_close(stats["alpha_rs"], count, rtol=1e-6, atol=0)
    assert stats["kl"].abs().max() < 1e-4
    torch.testing.assert_close(stats["entropy_draft"], stats["entropy_target"])


@pytest.mark.parametrize("negative", [-1e4, float("-inf")], ids=["large_negative", "minus_inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_disjoint_supports_give_tv_one(negative, dtype):
    draft, target = make_logits(9, shape=(K, 11, 101))
    target[..., 50:] = negative  # p lives on [0, 50), q on [50, 101)
    draft[..., :50] = negative
    draft, target = draft.to(dtype), target.to(dtype)
    valid = torch.ones(K, 11, dtype=torch.bool)
    d = tv_distance(draft[0], target[0])
    torch.testing.assert_close(d, torch.ones_like(d), rtol=0, atol=1e-6)
    for kind in ("tv", "e2e_tv"):
        loss, stats, grad = run(kind, draft, target, valid)
        assert abs(loss.item() - 1.0) < 1e-6, kind
        assert torch.isfinite(grad).all() and grad.abs().max() == 0, kind  # Eq. 11: S = 0, 1[q <= p] = 0 on q's support
        assert stats["alpha_rs"].abs().max() < 1e-5 and stats["alpha_to"].abs().max() < 1e-5
        if negative == -1e4:
            _, _, want_grad = run_reference(kind, draft, target, valid)
            assert want_grad.abs().max() < 1e-12


@pytest.mark.parametrize("kind", KINDS)
def test_no_gradient_for_target(kind):
    draft, target = make_logits(10, shape=(K, 6, 17))
    draft.requires_grad_()
    target.requires_grad_()
    loss = OBJECTIVES[kind](draft, target, make_valid(10, K, 6))
    assert torch.autograd.grad(loss, target, allow_unused=True) == (None,)
    loss = OBJECTIVES[kind](draft, target, make_valid(10, K, 6))
    loss.backward()
    assert target.grad is None and draft.grad is not None


def test_argmax_ties_go_to_the_lowest_index():
    draft, target = make_logits(11, shape=(K, 4, 29))
    draft[:, :, 3] = draft[:, :, 20] = 50.0
    target[:, :, 20] = 30.0  # p(20) ~ 1, p(3) small
    valid = torch.ones(K, 4, dtype=torch.bool)
    _, stats = tv_loss(draft, target, valid, return_stats=True)
    p = torch.softmax(target.double(), -1)
    torch.testing.assert_close(stats["alpha_to"].double(), p[..., 3].sum(-1), rtol=1e-5, atol=1e-7)


def test_tv_distance_matches_reference():
    draft, target = make_logits(12, torch.float64, shape=(N, V))
    for temps in TEMPS.values():
        d_impl = draft.clone().requires_grad_()
        got = tv_distance(d_impl, target, target_temperature=temps[0], draft_temperature=temps[1], chunk_tokens=9)
        d_ref = draft.clone().requires_grad_()
        want = ref.tv_distance(d_ref, target, *temps)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        w = torch.randn(N, dtype=torch.float64)
        (g_impl,) = torch.autograd.grad((got * w).sum(), d_impl)
        (g_ref,) = torch.autograd.grad((want * w).sum(), d_ref)
        torch.testing.assert_close(g_impl, g_ref, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck_float64(kind):
    """lk / e2e_lk with lk_eta = 0 only: their lambda is stop-gradient, so for eta > 0 the
    analytic gradient is by design not the finite difference (the reference test covers it)."""
    draft, target = make_logits(13, torch.float64, shape=(K, 5, 7))
    valid = make_valid(13, K, 5)
    fn = OBJECTIVES[kind]
    extra = {"lk_eta": 0.0} if kind in ("lk", "e2e_lk") else {}

    def loss(z):
        return fn(z, target, valid, target_temperature=0.7, draft_temperature=1.3, chunk_tokens=2, **extra)

    assert torch.autograd.gradcheck(loss, (draft.requires_grad_(),))
    assert torch.autograd.gradcheck(
        lambda z: tv_distance(z, target[0], draft_temperature=1.3), (draft[0].detach().requires_grad_(),)
    )
