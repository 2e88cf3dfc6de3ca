"""The MTP objectives (bebop_megatron.losses) against the float64 autograd references.

Reference: ``bebop_megatron.losses.reference`` (full softmaxes, Python loops over chains,
autograd). Shapes are odd (K=3, N=41, V=1271); masks hold fully masked chains and chains
cut in the middle; gradients are taken of ``2.7 * loss`` (grad_output != 1).
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
    e2e_tv_loss,
    tv_distance,
    tv_loss,
)
from bebop_megatron.losses import reference as ref
from bebop_megatron.losses.functions import E2EChain
from bebop_megatron.losses.kernel_torch import Workspace

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
def test_chunking_is_exact_and_grad_in_forward_agrees(kind):
    draft, target = make_logits(4)
    valid = make_valid(4)
    base = run(kind, draft, target, valid, (0.7, 1.3))
    for kw in ({"chunk_tokens": 7}, {"chunk_tokens": 1}, {"chunk_tokens": 7, "grad_in_forward": True}):
        loss, stats, grad = run(kind, draft, target, valid, (0.7, 1.3), **kw)
        assert torch.equal(loss, base[0]), kw
        for name in stats:
            assert torch.equal(stats[name], base[1][name]), (kw, name)
        if kw.get("grad_in_forward"):
            # same direction, scaled by 1/tau_d and grad_output in two roundings instead of one
            assert_close_scaled(grad, base[2], 1e-6, "grad_in_forward")
        else:
            assert torch.equal(grad, base[2]), kw


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


@pytest.mark.parametrize("with_stats", [False, True], ids=["plain", "stats"])
@pytest.mark.parametrize("kind", KINDS)
def test_temporaries_are_chunk_sized(kind, with_stats, monkeypatch):
    """Every [rows, V] temporary comes from a per-call workspace of at most 4 (TV) / 6 chunk buffers."""
    taken: list[set] = []
    original = Workspace.take

    def take(self, name, like, dtype):
        assert like.shape[0] <= 7 and like.dim() == 2, (name, tuple(like.shape))
        if not hasattr(self, "names"):
            self.names = set()
            taken.append(self.names)
        self.names.add(name)
        return original(self, name, like, dtype)

    monkeypatch.setattr(Workspace, "take", take)
    draft, target = make_logits(16, shape=(K, 9, 31))
    for grad_in_forward in (False, True):
        z = draft.clone().requires_grad_()
        out = OBJECTIVES[kind](z, target, make_valid(16, K, 9), chunk_tokens=7, return_stats=with_stats,
                               grad_in_forward=grad_in_forward)
        (out[0] if with_stats else out).backward()
    limit = 4 if kind in ("tv", "e2e_tv", "nla", "e2e_nla") and not with_stats else 6
    assert len(taken) == 4 and all(len(names) <= limit for names in taken), taken


def test_no_host_sync(monkeypatch):
    """No .item()/.tolist()/bool(tensor) in forward or backward of any objective."""
    draft, target = make_logits(14, shape=(K, 9, 31))
    valid = make_valid(14, K, 9)

    def refuse(*args, **kwargs):
        raise AssertionError("host sync in the loss path")

    for kind, fn in OBJECTIVES.items():
        z = draft.clone().requires_grad_()
        with monkeypatch.context() as m:
            for name in ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy"):
                m.setattr(torch.Tensor, name, refuse)
            loss, _ = fn(z, target, valid, tp_group=None, return_stats=True, chunk_tokens=4)
            loss.backward()
        assert z.grad is not None, kind


def test_invalid_arguments():
    draft, target = make_logits(15, shape=(K, 4, 9))
    valid = torch.ones(K, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="impl"):
        e2e_tv_loss(draft, target, valid, impl="triton")
    with pytest.raises(ValueError, match="impl"):
        tv_distance(draft[0], target[0], impl="triton")
    with pytest.raises(ValueError, match="reduction"):
        e2e_tv_loss(draft, target, valid, reduction="none")
    with pytest.raises(ValueError, match="draft_temperature"):
        e2e_tv_loss(draft, target, valid, draft_temperature=0.0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        e2e_tv_loss(draft, target, valid, chunk_tokens=0)
    with pytest.raises(ValueError, match="valid"):
        e2e_tv_loss(draft, target, valid[:, :3])
    with pytest.raises(ValueError, match="V_local"):
        e2e_tv_loss(draft, target[..., :8], valid)


# ---------------------------------------------------------------- fused with the output projection


def _shifted_targets(backbone_SBH, K):
    """Step k's target hidden state at s is the backbone at s + k; zeros past the end."""
    S = backbone_SBH.shape[0]
    out = backbone_SBH.new_zeros((K, *backbone_SBH.shape))
    for k in range(1, K + 1):
        out[k - 1, : S - k] = backbone_SBH[k:]
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk_tokens", [7, 1000])
def test_fused_linear_objective_equals_objective_on_logits(kind, dtype, chunk_tokens):
    """Hidden states + output weight, chunked, shared shifted backbone logits == the
    objective on materialised, explicitly shifted logits."""
    from bebop_megatron.losses import OBJECTIVES, fused_linear_objective

    g = torch.Generator().manual_seed(5)
    K, S, B, H, V = 3, 11, 3, 16, 101
    draft_h = torch.randn(K, S, B, H, generator=g, dtype=dtype, requires_grad=True)
    backbone_h = torch.randn(S, B, H, generator=g, dtype=dtype)
    weight = torch.randn(V, H, generator=g, dtype=dtype) / 2
    valid = torch.rand(K, S, B, generator=g) > 0.2  # also set past the end: must be ignored there
    labels = torch.randint(0, V, (K, S, B), generator=g)
    opts = dict(target_temperature=0.9, draft_temperature=1.1, return_stats=True)
    loss, stats = fused_linear_objective(kind, draft_h, backbone_h, weight, valid, labels=labels,
                                         chunk_tokens=chunk_tokens, **opts)
    (grad,) = torch.autograd.grad(2.5 * loss, draft_h)

    inside = torch.tensor([[s + k < S for s in range(S)] for k in range(1, K + 1)])
    ref_valid = (valid & inside[..., None]).flatten(1)
    ref_h = draft_h.detach().clone().requires_grad_(True)
    draft_logits = (ref_h @ weight.t()).flatten(1, 2)
    target_logits = (_shifted_targets(backbone_h, K) @ weight.t()).flatten(1, 2)
    ref_loss, ref_stats = OBJECTIVES[kind](draft_logits, target_logits, ref_valid, **opts)
    (ref_grad,) = torch.autograd.grad(2.5 * ref_loss, ref_h)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, **tol)
    torch.testing.assert_close(grad, ref_grad, **tol)
    for key in ref_stats:
        torch.testing.assert_close(stats[key], ref_stats[key], **tol, msg=key)
    chain = ref_valid.long().cumprod(0).bool()
    top1 = ((draft_logits.argmax(-1) == labels.flatten(1)) & chain).sum(-1).to(stats["top1"].dtype)
    torch.testing.assert_close(stats["top1"], top1)


def test_fused_linear_objective_rejects_bad_shapes():
    from bebop_megatron.losses import fused_linear_objective

    h, hb, valid = torch.randn(2, 5, 1, 4), torch.randn(5, 1, 4), torch.ones(2, 5, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="weight"):
        fused_linear_objective("e2e_tv", h, hb, torch.randn(7, 3), valid)
    with pytest.raises(ValueError, match="kind"):
        fused_linear_objective("ce", h, hb, torch.randn(7, 4), valid)
    with pytest.raises(ValueError, match="backbone_hidden"):
        fused_linear_objective("tv", h, h, torch.randn(7, 4), valid)
    with pytest.raises(ValueError, match="labels"):
        fused_linear_objective("tv", h, hb, torch.randn(7, 4), valid, labels=torch.zeros(2, 5, dtype=torch.long))
