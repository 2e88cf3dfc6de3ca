"""The e2e TV loss benchmarks' inputs and the naive formula (``benchmark_tv_loss.py``, ``loss_impls.py``)."""

from __future__ import annotations


def inputs(args):
    import torch

    g = torch.Generator().manual_seed(0)
    K, T, H, V = args.steps, args.tokens, args.hidden, args.vocab
    weight = torch.randn(V, H, generator=g) * (2.0 / H**0.5)  # logits of std ~2: entropy ~ a few nats
    backbone = torch.randn(T, 1, H, generator=g)
    draft = (backbone[None] + 0.5 * torch.randn(K, T, 1, H, generator=g)).requires_grad_(True)
    valid = torch.ones(K, T, 1, dtype=torch.bool)
    for k in range(1, K + 1):
        valid[k - 1, T - k:] = False
    return draft, backbone, weight, valid


def naive_loss(draft, backbone, weight, valid):
    """The e2e TV loss as a user would write it: full logits, autograd."""
    import torch

    K, T, _, H = draft.shape
    V = weight.shape[0]
    with torch.no_grad():
        z = torch.cat([backbone[:, 0], backbone.new_zeros(K, H)]) @ weight.t()  # [T + K, V]
        p = torch.softmax(z, -1).as_strided((K, T, V), (V, V, 1), V)  # step k's target: z[t + k]
    q = torch.softmax(draft[:, :, 0] @ weight.t(), -1)  # [K, T, V]
    d = 1.0 - torch.minimum(p, q).sum(-1)  # [K, T]
    chain = valid[:, :, 0].long().cumprod(0).bool()
    acc = torch.where(chain, 1.0 - d, 0.0).cumprod(0)
    per_pos = torch.where(chain, 1.0 - acc, 0.0).sum(0) / K
    return per_pos.sum() / chain[0].sum().clamp(min=1)
