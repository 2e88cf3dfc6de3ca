"""The MTP objectives fused with the output projection: hidden states in, no logits kept.

Legend: K MTP steps, S sequence positions, B micro-batch, H hidden, V this TP rank's
vocabulary shard, c positions of a chunk, R = c x B rows of a chunk.

``FusedLinearDivergence`` computes the per-step divergences of
:class:`~bebop_megatron.losses.functions.VocabDivergence` from hidden states and the
(frozen) output weight ``W``: ``draft_k = h_draft[k] @ W.T`` and the backbone logits
``z = h_backbone @ W.T``, where step k (1..K) at position s is compared with the backbone
at position s + k (DESIGN.md section 1, "Which target each step uses").

The sequence is processed c positions at a time (c x B <= ``chunk_tokens`` rows):

* the backbone logits of positions ``s + 1 .. s + c + K - 1`` are computed **once** per
  chunk and shared by the K steps (step k reads rows ``k - 1 .. k - 1 + c``);
* each step's draft logits (``R x V``) go through the chunk kernel, then are dropped.

The gradient is computed **during the forward**, as fused linear-loss kernels do: the
kernel returns ``g = d value / d draft logits`` for the chunk's rows, written over the
draft logits it has just read, and the forward keeps only its projection ``u = g @ W``
(``R x H``). Backward then needs no recomputation: the incoming per-row gradient (from the
e2e chain or the mean) scales ``u`` row by row, which commutes with the projection. Per
step and chunk this is 2 GEMMs plus the shared backbone GEMM, against the naive autograd
formula's 2 + 1 in backward on top of its ``K x N x V`` logits, probabilities and gradients.

Alive at once: the chunk's backbone logits ((c + K - 1) x B x V), one step's draft logits
(R x V, then its gradient) and the elementwise kernel's 4-6 buffers of ``R / KERNEL_BLOCKS``
rows (the kernel runs on that many rows at a time), whatever S is; saved for backward:
``u`` (``K x S x B x H``, one draft-hidden-state-sized tensor).

Kind ``tv_kl`` (the LK hybrids: d_TV and KL(p||q) of each row from one kernel pass) keeps
two projections, ``u`` of the TV direction and of the KL direction (``2 x K x S x B x H``,
two GEMMs per step and chunk), because the hybrids' per-row weights of the two are known only
in backward (``e2e_lk``'s depend on the whole chain); the KL direction of a chunk needs one
more ``R x V`` buffer, so the bound stays a few ``chunk_tokens x V`` buffers.

Columns at and beyond ``opts.vocab_size`` (Megatron's vocabulary padding) get logit -inf
in both distributions as soon as a chunk's logits exist (:mod:`bebop_megatron.losses.vocab`).

With ``opts.label_ce`` (objective ``ce``) the value and the gradient are the cross-entropy of
the draft's raw logits at each row's data token instead (``label_cross_entropy_``: softmax
minus one-hot, written over the draft logits like any other kind's gradient), and the kernel
runs for the statistics alone (kind ``tv``, no gradient): the acceptance statistics against
the backbone come from the same draft logits, so each step's draft logits are computed once
and no full logits tensor is held (``benchmarks/benchmark_tv_loss.py --objective ce`` measures
it against Megatron's cross-entropy on full logits).

Positions past the end of the sequence (s + k >= S) read zero hidden states (uniform
target, finite); their steps are invalid, so they get zero gradient.

Under tensor parallelism each rank holds a vocabulary shard of ``W``: the row reductions
inside the kernel are all-reduced over ``tp_group``, and the gradient w.r.t. the hidden
states returned here is this shard's *partial* sum; the caller reduces it over the TP group
(Megatron's ``copy_to_tensor_model_parallel_region`` or, with sequence parallelism,
``gather_from_sequence_parallel_region``, whose backward passes do exactly that).
"""

from __future__ import annotations

import torch

from bebop_megatron.losses.functions import DivergenceOptions, row_kernel
from bebop_megatron.losses.kernel_torch import STAT_KEYS, TV_KL, Workspace, compute_dtype
from bebop_megatron.losses.vocab import label_accept_rs, label_cross_entropy_, mask_padded_vocab_

TOP1 = "top1"  # extra stat row when labels are given: 1 where argmax q is the data token
ACCEPT_RS_LABEL = "accept_rs_label"  # with opts.label_accept: min(1, q(x) / p(x)) at the data token x
KERNEL_BLOCKS = 8  # the elementwise kernel runs on chunk_tokens / KERNEL_BLOCKS rows at a time


def _blocks(num_rows: int, size: int):
    for start in range(0, num_rows, size):
        yield slice(start, min(start + size, num_rows))


class FusedLinearDivergence(torch.autograd.Function):
    """(h_draft ``[K, S, B, H]``, h_backbone ``[S, B, H]``, W ``[V, H]``, labels ``[K, S, B]`` or None)
    -> (value ``[K, S, B]``, stats ``[C, K, S, B]``).

    Differentiable w.r.t. ``h_draft`` only (the backbone is frozen, ``W`` is the frozen
    output layer). ``stats`` holds ``STAT_KEYS`` (and ``top1`` with labels) per row when
    ``opts.with_stats``; it is empty otherwise. Kind ``tv_kl``: value ``[2, K, S, B]`` (d_TV, KL).
    """

    @staticmethod
    def forward(ctx, h_draft_KSBH, h_backbone_SBH, weight_VH, labels_KSB, opts: DivergenceOptions):
        K, S, B, H = h_draft_KSBH.shape
        V = weight_VH.shape[0]
        dtype = compute_dtype(h_draft_KSBH.dtype, weight_VH.dtype)
        with_grad = ctx.needs_input_grad[0]
        if opts.label_ce and labels_KSB is None:
            raise ValueError("label_ce needs labels")
        kernel = row_kernel(opts.impl)
        label_accept = opts.label_accept and labels_KSB is not None and opts.with_stats
        num_stats = (len(STAT_KEYS) + (labels_KSB is not None) + label_accept) if opts.with_stats else 0
        pair = opts.kind == TV_KL  # two values and two gradient directions per row
        lead = (2,) if pair else ()
        value_KN = h_draft_KSBH.new_empty((*lead, K, S * B), dtype=dtype)
        stats_CKN = h_draft_KSBH.new_empty((num_stats, K, S * B), dtype=dtype)
        u_KNH = h_draft_KSBH.new_empty((*lead, K, S * B, H), dtype=weight_VH.dtype) if with_grad else None
        labels_KN = labels_KSB.reshape(K, S * B) if labels_KSB is not None else None
        # K zero positions past the end: every chunk reads exactly c + K - 1 backbone rows.
        backbone_pad = torch.cat([h_backbone_SBH, h_backbone_SBH.new_zeros((K, B, H))])
        positions = max(1, opts.chunk_tokens // B)
        ws = Workspace()
        kl_dir_RV = None
        if pair and with_grad:  # the KL direction of one step's chunk (the TV one goes over the draft logits)
            kl_dir_RV = h_draft_KSBH.new_empty((min(positions, S) * B, V), dtype=weight_VH.dtype)
        with torch.no_grad():
            for a in range(0, S, positions):
                b = min(a + positions, S)
                c = b - a
                target_cKBV = backbone_pad[a + 1 : b + K] @ weight_VH.t()  # shared by the K steps
                mask_padded_vocab_(target_cKBV, opts.vocab_size, opts.tp_group)
                for k in range(1, K + 1):
                    draft_RV = (h_draft_KSBH[k - 1, a:b] @ weight_VH.t()).view(c * B, V)
                    mask_padded_vocab_(draft_RV, opts.vocab_size, opts.tp_group)  # their gradient is then 0
                    target_RV = target_cKBV[k - 1 : k - 1 + c].view(c * B, V)
                    for rows in _blocks(c * B, max(1, opts.chunk_tokens // KERNEL_BLOCKS)):
                        out = kernel.forward_rows(
                            draft_RV[rows], target_RV[rows], kind=opts.kind,
                            target_temperature=opts.target_temperature, draft_temperature=opts.draft_temperature,
                            tp_group=opts.tp_group, with_stats=opts.with_stats,
                            with_grad=with_grad and not opts.label_ce, ws=ws,
                        )
                        flat = slice(a * B + rows.start, a * B + rows.stop)  # rows of the [S * B] positions
                        value_KN[..., k - 1, flat] = out.value_R
                        if opts.with_stats:
                            stats_CKN[: len(STAT_KEYS), k - 1, flat] = out.stats_CR
                            if labels_KN is not None:
                                stats_CKN[len(STAT_KEYS), k - 1, flat] = out.argmax_R == labels_KN[k - 1, flat]
                            if label_accept:  # before the gradient overwrites the draft logits
                                stats_CKN[-1, k - 1, flat] = label_accept_rs(
                                    draft_RV[rows], target_RV[rows], labels_KN[k - 1, flat], out.saved_CR,
                                    target_temperature=opts.target_temperature,
                                    draft_temperature=opts.draft_temperature, tp_group=opts.tp_group)
                        if opts.label_ce:  # the value and gradient are the data token's cross-entropy
                            value_KN[k - 1, flat] = label_cross_entropy_(
                                draft_RV[rows], labels_KN[k - 1, flat], tp_group=opts.tp_group, ws=ws)
                        elif with_grad:  # these draft logits are read: their rows now hold the gradient
                            draft_RV[rows].copy_(out.grad_RV)
                        if kl_dir_RV is not None:
                            kl_dir_RV[rows].copy_(out.grad_kl_RV)
                    if pair and with_grad:
                        torch.matmul(draft_RV, weight_VH, out=u_KNH[0, k - 1, a * B : b * B])
                        torch.matmul(kl_dir_RV[: c * B], weight_VH,
                                     out=u_KNH[1, k - 1, a * B : b * B])
                    elif with_grad:
                        torch.matmul(draft_RV, weight_VH, out=u_KNH[k - 1, a * B : b * B])
                    del draft_RV, target_RV
                del target_cKBV
        if with_grad:
            ctx.save_for_backward(u_KNH.view(*lead, K, S, B, H))
            ctx.draft_dtype = h_draft_KSBH.dtype
        stats_CKSB = stats_CKN.view(num_stats, K, S, B)
        ctx.mark_non_differentiable(stats_CKSB)
        return value_KN.view(*lead, K, S, B), stats_CKSB

    @staticmethod
    def backward(ctx, grad_value_KSB, _grad_stats):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        (u_KSBH,) = ctx.saved_tensors
        # Out of place: a retained graph may run backward again.
        grad = u_KSBH.to(grad_value_KSB.dtype) * grad_value_KSB[..., None]
        if grad.dim() == 5:  # tv_kl: TV's and KL's projections, each with its incoming gradient
            grad = grad.sum(0)
        return grad.to(ctx.draft_dtype), None, None, None, None


__all__ = ["ACCEPT_RS_LABEL", "FusedLinearDivergence", "TOP1"]
