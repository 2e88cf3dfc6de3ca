"""The MTP objectives' implementation (bebop_megatron.losses): chunking is exact, every
[rows, V] temporary is chunk-sized, no host sync, the argument checks, and the objectives
fused with the output projection against the objective on materialised logits.

Inputs and runners: tests/helpers/loss_inputs.py (shared with tests/test_losses.py, the
comparison with the float64 references).
"""

from __future__ import annotations

import pytest
import torch

from bebop_megatron.losses import OBJECTIVES, e2e_tv_loss, tv_distance
from bebop_megatron.losses.kernel_torch import Workspace
from tests.helpers.loss_inputs import KINDS, K, assert_close_scaled, make_logits, make_valid, run, shifted_targets


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
    target_logits = (shifted_targets(backbone_h, K) @ weight.t()).flatten(1, 2)
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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk_tokens", [7, 1000])
def test_fused_ce_equals_float64_cross_entropy(dtype, chunk_tokens):
    """Kind ``ce``: the data tokens' cross-entropy of the raw draft logits (the draft
    temperature does not enter), L_t = (1/K) sum over t's chain, its gradient, ``ce_sum`` per
    step, and the acceptance statistics of the same call equal to e2e_tv's (against the backbone)."""
    from bebop_megatron.losses import fused_linear_objective

    g = torch.Generator().manual_seed(6)
    K, S, B, H, V = 3, 11, 3, 16, 101
    draft_h = torch.randn(K, S, B, H, generator=g, dtype=dtype, requires_grad=True)
    backbone_h = torch.randn(S, B, H, generator=g, dtype=dtype)
    weight = torch.randn(V, H, generator=g, dtype=dtype) / 2
    valid = torch.rand(K, S, B, generator=g) > 0.2
    labels = torch.randint(0, V, (K, S, B), generator=g)
    opts = dict(labels=labels, target_temperature=0.9, draft_temperature=1.1, return_stats=True,
                chunk_tokens=chunk_tokens, reduction="sum")
    loss, stats = fused_linear_objective("ce", draft_h, backbone_h, weight, valid, **opts)
    (grad,) = torch.autograd.grad(2.5 * loss, draft_h)

    ref_h = draft_h.detach().double().requires_grad_(True)
    inside = torch.tensor([[s + k < S for s in range(S)] for k in range(1, K + 1)])
    chain = (valid & inside[..., None]).flatten(1).long().cumprod(0).bool()  # [K, S * B]
    logits = (ref_h @ weight.double().t()).flatten(1, 2)  # [K, S * B, V]
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(K, -1)
    ref_loss = torch.where(chain, ce, 0.0).sum() / K
    (ref_grad,) = torch.autograd.grad(2.5 * ref_loss, ref_h)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss.double(), ref_loss.detach(), **tol)
    torch.testing.assert_close(grad.double(), ref_grad, **tol)
    torch.testing.assert_close(stats["ce_sum"].double(), torch.where(chain, ce, 0.0).sum(-1).detach(), **tol)

    _, tv_stats = fused_linear_objective("e2e_tv", draft_h.detach(), backbone_h, weight, valid, **opts)
    for key, value in tv_stats.items():
        torch.testing.assert_close(stats[key], value, rtol=0, atol=0, msg=key)


def test_fused_linear_objective_rejects_bad_shapes():
    from bebop_megatron.losses import fused_linear_objective

    h, hb, valid = torch.randn(2, 5, 1, 4), torch.randn(5, 1, 4), torch.ones(2, 5, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="weight"):
        fused_linear_objective("e2e_tv", h, hb, torch.randn(7, 3), valid)
    with pytest.raises(ValueError, match="kind"):
        fused_linear_objective("bogus", h, hb, torch.randn(7, 4), valid)
    with pytest.raises(ValueError, match="'ce' needs labels"):
        fused_linear_objective("ce", h, hb, torch.randn(7, 4), valid)
    with pytest.raises(ValueError, match="backbone_hidden"):
        fused_linear_objective("tv", h, h, torch.randn(7, 4), valid)
    with pytest.raises(ValueError, match="labels"):
        fused_linear_objective("tv", h, hb, torch.randn(7, 4), valid, labels=torch.zeros(2, 5, dtype=torch.long))
