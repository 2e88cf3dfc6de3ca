"""Autograd Functions of the MTP objectives, with analytic backward.

Legend: K MTP steps, N positions, V this TP rank's vocabulary shard, C stacked row quantities.

Two Functions compose every objective:

- ``VocabDivergence``: per-row d_TV / KL(p||q) / KL(q||p) ``[K, N]`` over the (sharded)
  vocabulary, chunked over positions; backward = incoming per-row gradient x the row's
  analytic direction (Eq. 11 for TV).
- ``E2EChain``: the end-to-end product of Eq. 13 over a chain of per-step TVs, per position;
  backward by prefix/suffix products (no division by 1 - d_i, which may be 0).

What is saved for backward (default, ``grad_in_forward=False``): the logits the caller
already holds plus five per-row scalars (max and sum-exp of q and p, and S or KL(q||p));
backward recomputes the softmaxes chunk by chunk. This keeps the loss's own memory at
O(K x chunk x V) at the price of one more exp pass per element. ``grad_in_forward=True``
instead stores d value/d logits (a ``[K, N, V]`` buffer in the logits' dtype) during the
forward and only rescales it in backward: faster, one more logits-sized tensor alive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bebop_megatron.losses.kernel_torch import SAVED_ROWS, STAT_KEYS, compute_dtype, forward_rows, grad_rows


@dataclass(frozen=True)
class DivergenceOptions:
    kind: str  # "tv", "kl" (KL(p||q)) or "reverse_kl" (KL(q||p))
    target_temperature: float = 1.0
    draft_temperature: float = 1.0
    tp_group: object = None
    chunk_tokens: int = 4096
    with_stats: bool = False
    grad_in_forward: bool = False


class VocabDivergence(torch.autograd.Function):
    """(draft ``[K, N, V]``, target ``[K, N, V]``) -> (value ``[K, N]``, stats ``[C, K, N]``).

    Differentiable w.r.t. the draft logits only; ``stats`` (``STAT_KEYS`` per row, empty
    when not asked for) is not differentiable.
    """

    @staticmethod
    def forward(ctx, draft_KNV: torch.Tensor, target_KNV: torch.Tensor, opts: DivergenceOptions):
        K, N, _ = draft_KNV.shape
        dtype = compute_dtype(draft_KNV.dtype, target_KNV.dtype)
        value_KN = draft_KNV.new_empty((K, N), dtype=dtype)
        saved_CKN = draft_KNV.new_empty((len(SAVED_ROWS), K, N), dtype=dtype)
        num_stats = len(STAT_KEYS) if opts.with_stats else 0
        stats_CKN = draft_KNV.new_empty((num_stats, K, N), dtype=dtype)
        store_grad = ctx.needs_input_grad[0] and opts.grad_in_forward
        grad_KNV = torch.empty_like(draft_KNV) if store_grad else None
        for start in range(0, N, opts.chunk_tokens):
            rows = slice(start, min(start + opts.chunk_tokens, N))
            out = forward_rows(
                draft_KNV[:, rows], target_KNV[:, rows], kind=opts.kind,
                target_temperature=opts.target_temperature, draft_temperature=opts.draft_temperature,
                tp_group=opts.tp_group, with_stats=opts.with_stats, with_grad=store_grad,
            )
            value_KN[:, rows] = out.value_R
            saved_CKN[:, :, rows] = out.saved_CR
            if opts.with_stats:
                stats_CKN[:, :, rows] = out.stats_CR
            if store_grad:
                grad_KNV[:, rows] = out.grad_RV
        ctx.opts = opts
        ctx.store_grad = store_grad
        if store_grad:
            ctx.save_for_backward(grad_KNV)
        elif ctx.needs_input_grad[0]:
            ctx.save_for_backward(draft_KNV, target_KNV, saved_CKN)
        ctx.mark_non_differentiable(stats_CKN)
        return value_KN, stats_CKN

    @staticmethod
    def backward(ctx, grad_value_KN: torch.Tensor, _grad_stats):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        opts = ctx.opts
        if ctx.store_grad:
            (stored_KNV,) = ctx.saved_tensors  # rescaled out of place: a retained graph may run backward again
        else:
            draft_KNV, target_KNV, saved_CKN = ctx.saved_tensors
        grad_KNV = torch.empty_like(stored_KNV if ctx.store_grad else draft_KNV)
        N = grad_KNV.shape[1]
        for start in range(0, N, opts.chunk_tokens):
            rows = slice(start, min(start + opts.chunk_tokens, N))
            if ctx.store_grad:
                g = stored_KNV[:, rows].to(grad_value_KN.dtype, copy=True)
            else:
                g = grad_rows(
                    draft_KNV[:, rows], target_KNV[:, rows], saved_CKN[:, :, rows], kind=opts.kind,
                    target_temperature=opts.target_temperature, draft_temperature=opts.draft_temperature,
                )
            grad_KNV[:, rows] = g.mul_(grad_value_KN[:, rows, None].to(g.dtype))
        return grad_KNV, None, None


class E2EChain(torch.autograd.Function):
    """(d_TV ``[K, N]``, chain ``[K, N]`` bool) -> L ``[N]``, Eq. 13 per position:

    L_t = (1/K) sum_{j <= K_t} (1 - prod_{i <= j} a_i),  a_i = 1 - d_TV_i,

    where ``chain[k, t]`` says step k is inside position t's chain (k < K_t); the
    prod_{i<=j} a_i are the per-step acceptance products of Eq. 12.
    """

    @staticmethod
    def forward(ctx, tv_KN: torch.Tensor, chain_KN: torch.Tensor):
        K = tv_KN.shape[0]
        a_KN = torch.where(chain_KN, 1.0 - tv_KN, 0.0)
        loss_N = torch.where(chain_KN, 1.0 - a_KN.cumprod(0), 0.0).sum(0) / K
        ctx.save_for_backward(a_KN, chain_KN)
        return loss_N

    @staticmethod
    def backward(ctx, grad_N: torch.Tensor):
        a_KN, chain_KN = ctx.saved_tensors
        K = a_KN.shape[0]
        # dL_t/da_i = -(1/K) sum_{j=i..K_t} prod_{l<=j, l!=i} a_l = -(1/K) E_i R_i with
        # E_i = prod_{l<i} a_l (prefix) and R_i = 1 + a_{i+1} R_{i+1}, R_K = 1 (suffix);
        # a_l = 0 past the chain's end truncates R at K_t. No division by a_i (may be 0).
        prefix_KN = torch.ones_like(a_KN)
        prefix_KN[1:] = a_KN[:-1].cumprod(0)
        suffix_KN = torch.ones_like(a_KN)
        for i in range(K - 2, -1, -1):
            suffix_KN[i] = 1.0 + a_KN[i + 1] * suffix_KN[i + 1]
        grad_tv_KN = torch.where(chain_KN, prefix_KN * suffix_KN, 0.0) * (grad_N / K)  # dd = -da
        return grad_tv_KN, None
