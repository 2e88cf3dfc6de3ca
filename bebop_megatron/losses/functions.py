"""Autograd Functions of the MTP objectives, with analytic backward.

Legend: K MTP steps, N positions, V this TP rank's vocabulary shard, C stacked row quantities.

Two Functions compose every objective:

- ``VocabDivergence``: per-row d_TV / KL(p||q) / KL(q||p) ``[K, N]`` over the (sharded)
  vocabulary, chunked over rows; backward = incoming per-row gradient x the row's
  analytic direction (Eq. 11 for TV).
- ``E2EChain``: the end-to-end product of Eq. 13 over a chain of per-step TVs, per position;
  backward by prefix/suffix products (no division by 1 - d_i, which may be 0).
  ``ChainAcceptLength`` is the same chain's expected accepted length E[L]_t (Eq. 12), with
  the same backward (L_t of Eq. 13 = (K_t - E[L]_t) / K).

Kind ``tv_kl`` (the LK hybrids) gives two values per row, d_TV and KL(p||q) (``[2, K, N]``),
from one kernel pass; the backward takes both incoming gradients and recomputes the
softmaxes once (``grad_in_forward=True`` stores both directions: two logits-sized buffers).

What is saved for backward (default, ``grad_in_forward=False``): the logits the caller
already holds plus five per-row scalars (max and sum-exp of q and p, and S or KL(q||p));
backward recomputes the softmaxes chunk by chunk. This keeps the loss's own memory at a
few ``chunk_tokens x V`` buffers at the price of one more exp pass per element. ``grad_in_forward=True``
instead stores d value/d logits (a ``[K, N, V]`` buffer in the logits' dtype) during the
forward and only rescales it in backward: faster, one more logits-sized tensor alive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bebop_megatron.losses import kernel_torch
from bebop_megatron.losses.kernel_torch import SAVED_ROWS, STAT_KEYS, TV_KL, Workspace, compute_dtype


DEFAULT_CHUNK_TOKENS = 512


@dataclass(frozen=True)
class DivergenceOptions:
    kind: str  # "tv", "kl" (KL(p||q)), "reverse_kl" (KL(q||p)) or "tv_kl" (d_TV and KL(p||q))
    target_temperature: float = 1.0
    draft_temperature: float = 1.0
    tp_group: object = None
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS  # rows (token positions of any step) per kernel call
    with_stats: bool = False
    grad_in_forward: bool = False
    impl: str = "torch"  # the chunk kernel: "torch" (kernel_torch) or "triton" (kernel_triton, CUDA)
    vocab_size: int | None = None  # global columns >= vocab_size are Megatron's padding: logits -inf
    label_accept: bool = False  # fused, with labels and stats: also min(1, q(x)/p(x)) at each row's label x
    label_ce: bool = False  # fused, with labels: value and gradient are -log softmax(draft logits)[label] ("ce")


def row_kernel(impl: str):
    """The chunk-kernel module of ``impl`` (``forward_rows``/``grad_rows`` with one signature)."""
    if impl == "torch":
        return kernel_torch
    try:
        from bebop_megatron.losses import kernel_triton
    except ImportError as err:
        raise ValueError(f"impl='triton' needs the triton package (pip install triton): {err}") from None
    return kernel_triton


def _chunks(num_rows: int, chunk_tokens: int):
    for start in range(0, num_rows, chunk_tokens):
        yield slice(start, min(start + chunk_tokens, num_rows))


def forward_chunks(logits_of, num_rows: int, opts: DivergenceOptions, dtype, like: torch.Tensor, grad_like=None):
    """Run the kernel over ``chunk_tokens`` rows at a time; ``logits_of(rows)`` gives the
    (draft, target) logits of those rows. Returns per-row value, saved scalars, stats and
    (with ``grad_like``) d value / d draft logits. Kind ``tv_kl``: value ``[2, R]`` and
    gradient ``[2, R, V]`` (TV's and KL's)."""
    pair = opts.kind == TV_KL
    value_R = like.new_empty((2, num_rows) if pair else (num_rows,), dtype=dtype)
    saved_CR = like.new_empty((len(SAVED_ROWS), num_rows), dtype=dtype)
    stats_CR = like.new_empty((len(STAT_KEYS) if opts.with_stats else 0, num_rows), dtype=dtype)
    grad_RV = None
    if grad_like is not None:
        grad_RV = grad_like.new_empty((2, *grad_like.shape)) if pair else torch.empty_like(grad_like)
    ws = Workspace()
    kernel = row_kernel(opts.impl)
    for rows in _chunks(num_rows, opts.chunk_tokens):
        draft_rows, target_rows = logits_of(rows)
        out = kernel.forward_rows(
            draft_rows, target_rows, kind=opts.kind,
            target_temperature=opts.target_temperature, draft_temperature=opts.draft_temperature,
            tp_group=opts.tp_group, with_stats=opts.with_stats, with_grad=grad_RV is not None, ws=ws,
        )
        value_R[..., rows] = out.value_R
        saved_CR[:, rows] = out.saved_CR
        if opts.with_stats:
            stats_CR[:, rows] = out.stats_CR
        if grad_RV is not None and pair:
            grad_RV[0, rows].copy_(out.grad_RV)
            grad_RV[1, rows].copy_(out.grad_kl_RV)
        elif grad_RV is not None:
            grad_RV[rows].copy_(out.grad_RV)
    return value_R, saved_CR, stats_CR, grad_RV


class VocabDivergence(torch.autograd.Function):
    """(draft ``[K, N, V]``, target ``[K, N, V]``) -> (value ``[K, N]``, stats ``[C, K, N]``).

    Kind ``tv_kl``: value ``[2, K, N]`` (d_TV, KL(p||q)), both differentiable.

    The K x N rows are processed ``chunk_tokens`` at a time (steps one after another for
    contiguous logits). Differentiable w.r.t. the draft logits only; ``stats``
    (``STAT_KEYS`` per row, empty when not asked for) is not differentiable.
    """

    @staticmethod
    def forward(ctx, draft_KNV: torch.Tensor, target_KNV: torch.Tensor, opts: DivergenceOptions):
        K, N, V = draft_KNV.shape
        draft_RV, target_RV = draft_KNV.reshape(K * N, V), target_KNV.reshape(K * N, V)
        store_grad = ctx.needs_input_grad[0] and opts.grad_in_forward
        value_R, saved_CR, stats_CR, grad_RV = forward_chunks(
            lambda rows: (draft_RV[rows], target_RV[rows]), K * N, opts,
            compute_dtype(draft_KNV.dtype, target_KNV.dtype), draft_KNV, grad_like=draft_RV if store_grad else None,
        )
        ctx.opts = opts
        ctx.store_grad = store_grad
        if store_grad:
            ctx.save_for_backward(grad_RV)
        elif ctx.needs_input_grad[0]:
            ctx.save_for_backward(draft_KNV, target_KNV, saved_CR)
        stats_CKN = stats_CR.view(-1, K, N)
        ctx.mark_non_differentiable(stats_CKN)
        return value_R.view(*value_R.shape[:-1], K, N), stats_CKN

    @staticmethod
    def backward(ctx, grad_value_KN: torch.Tensor, _grad_stats):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        opts = ctx.opts
        K, N = grad_value_KN.shape[-2:]
        grad_value_R = grad_value_KN.reshape(*grad_value_KN.shape[:-2], K * N)  # [2, K * N] for tv_kl
        if ctx.store_grad:
            (stored_RV,) = ctx.saved_tensors  # rescaled out of place: a retained graph may run backward again
            V = stored_RV.shape[-1]
        else:
            draft_KNV, target_KNV, saved_CR = ctx.saved_tensors
            V = draft_KNV.shape[-1]
            draft_RV, target_RV = draft_KNV.reshape(K * N, V), target_KNV.reshape(K * N, V)
        grad_RV = (stored_RV if ctx.store_grad else draft_RV).new_empty((K * N, V))
        ws = Workspace()
        for rows in _chunks(K * N, opts.chunk_tokens):
            if ctx.store_grad and opts.kind == TV_KL:  # TV's and KL's stored directions, weighted
                chunk = stored_RV[0, rows]
                g = torch.mul(chunk, grad_value_R[0, rows, None], out=ws.take("grad", chunk, grad_value_R.dtype))
                g.addcmul_(stored_RV[1, rows], grad_value_R[1, rows, None])
            elif ctx.store_grad:
                chunk = stored_RV[rows]
                g = torch.mul(chunk, grad_value_R[rows, None], out=ws.take("grad", chunk, grad_value_R.dtype))
            else:
                g = row_kernel(opts.impl).grad_rows(
                    draft_RV[rows], target_RV[rows], saved_CR[:, rows], grad_value_R[..., rows], kind=opts.kind,
                    target_temperature=opts.target_temperature, draft_temperature=opts.draft_temperature, ws=ws,
                )
            grad_RV[rows].copy_(g)
        return grad_RV.view(K, N, V), None, None


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
        # dL_t/da_i = -(1/K) dE[L]_t/da_i, and dd = -da
        return _accept_len_grad_a(a_KN, chain_KN) * (grad_N / K), None


def _accept_len_grad_a(a_KN: torch.Tensor, chain_KN: torch.Tensor) -> torch.Tensor:
    """d E[L]_t / d a_i for E[L]_t = sum_{j<=K_t} prod_{l<=j} a_l (Eq. 12), ``[K, N]``.

    = sum_{j=i..K_t} prod_{l<=j, l!=i} a_l = E_i R_i with E_i = prod_{l<i} a_l (prefix) and
    R_i = 1 + a_{i+1} R_{i+1}, R_K = 1 (suffix); a_l = 0 past the chain's end truncates R at
    K_t. No division by a_i (may be 0)."""
    K = a_KN.shape[0]
    prefix_KN = torch.ones_like(a_KN)
    prefix_KN[1:] = a_KN[:-1].cumprod(0)
    suffix_KN = torch.ones_like(a_KN)
    for i in range(K - 2, -1, -1):
        suffix_KN[i] = 1.0 + a_KN[i + 1] * suffix_KN[i + 1]
    return torch.where(chain_KN, prefix_KN * suffix_KN, 0.0)


class ChainAcceptLength(torch.autograd.Function):
    """(d_TV ``[K, N]``, chain ``[K, N]`` bool) -> E[L] ``[N]``, Eq. 12 over each position's chain:

    E[L]_t = sum_{j <= K_t} prod_{i <= j} a_i,  a_i = 1 - d_TV_i  (0 when K_t = 0).

    Backward by the prefix/suffix products of :class:`E2EChain` (whose L_t = (K_t - E[L]_t) / K).
    """

    @staticmethod
    def forward(ctx, tv_KN: torch.Tensor, chain_KN: torch.Tensor):
        a_KN = torch.where(chain_KN, 1.0 - tv_KN, 0.0)
        accept_len_N = torch.where(chain_KN, a_KN.cumprod(0), 0.0).sum(0)
        ctx.save_for_backward(a_KN, chain_KN)
        return accept_len_N

    @staticmethod
    def backward(ctx, grad_N: torch.Tensor):
        a_KN, chain_KN = ctx.saved_tensors
        return -_accept_len_grad_a(a_KN, chain_KN) * grad_N, None  # da = -dd
