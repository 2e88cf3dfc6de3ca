"""The loss benchmarks' inputs and baselines (``benchmark_tv_loss.py``, ``loss_impls.py``); their
float64 reference is ``bebop_megatron/losses/reference.py``."""

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


def megatron_ce_loss(draft, backbone, weight, valid, labels, chunk_tokens):
    """The trainer's ``ce`` before it was fused (commit 09143fa): the acceptance statistics
    from the fused kernel without gradients, then the cross-entropy of the full draft logits
    ``[K, T, V]`` by Megatron's ``vocab_parallel_cross_entropy`` (float logits, autograd
    through the projection). Needs Megatron's parallel state (one rank)."""
    import torch
    from megatron.core import tensor_parallel

    from bebop_megatron.losses import fused_linear_objective

    K = draft.shape[0]
    with torch.no_grad():
        fused_linear_objective("e2e_tv", draft, backbone, weight, valid, labels=labels, chunk_tokens=chunk_tokens,
                               return_stats=True, reduction="sum")
    chain = valid[:, :, 0].long().cumprod(0).bool()  # [K, T]
    per_pos = draft.new_zeros(chain.shape[1])
    for k in range(K):
        logits = (draft[k] @ weight.t()).float()  # [T, 1, V], as Megatron's output layer returns
        ce = tensor_parallel.vocab_parallel_cross_entropy(logits, labels[k])[:, 0]
        per_pos = per_pos + torch.where(chain[k], ce, 0.0)
    return (per_pos / K).sum() / chain[0].sum().clamp(min=1)


def naive_loss(draft, backbone, weight, valid):
    """The timed baseline of ``benchmark_tv_loss.py``: the e2e TV loss as a user would write it, in
    the inputs' dtype (float32), full ``[K, T, V]`` logits, autograd. Not a reference: a tiny test
    checks it against ``losses.reference.objective`` (tests/test_bench_loss.py)."""
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
