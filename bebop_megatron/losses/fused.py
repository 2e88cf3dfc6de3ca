"""The MTP objectives fused with the output projection: hidden states in, no logits kept.

Legend: K MTP steps, N positions, H hidden, V this TP rank's vocabulary shard, R rows of a chunk.

``FusedLinearDivergence`` is :class:`~bebop_megatron.losses.functions.VocabDivergence` with
the logits computed chunk by chunk from hidden states and the (frozen) output weight:
``draft = h_draft @ W.T``, ``target = h_target @ W.T``. At most ``chunk_tokens x V``
logits of each kind (and the kernel's few buffers of that size) are alive at once, in
forward and in backward; what is saved is the hidden states (H-sized) and five per-row
scalars. Backward recomputes both logits of a chunk (2 GEMMs), the analytic direction
(Eq. 11 for TV) and ``grad_h = grad_logits @ W`` (1 GEMM).

Under tensor parallelism each rank holds a vocabulary shard of ``W``: the row reductions
inside the kernel are all-reduced over ``tp_group``, and the gradient w.r.t. the hidden
states returned here is this shard's *partial* sum; the caller reduces it over the TP group
(Megatron's ``copy_to_tensor_model_parallel_region`` or, with sequence parallelism,
``gather_from_sequence_parallel_region``, whose backward passes do exactly that).
"""

from __future__ import annotations

import torch

from bebop_megatron.losses.functions import DivergenceOptions, _chunks, forward_chunks
from bebop_megatron.losses.kernel_torch import Workspace, compute_dtype, grad_rows


class FusedLinearDivergence(torch.autograd.Function):
    """(h_draft ``[K, N, H]``, h_target ``[K, N, H]``, W ``[V, H]``) -> (value ``[K, N]``, stats ``[C, K, N]``).

    Differentiable w.r.t. ``h_draft`` only (the target is the frozen backbone, ``W`` is the
    frozen output layer).
    """

    @staticmethod
    def forward(ctx, h_draft_KNH, h_target_KNH, weight_VH, opts: DivergenceOptions):
        K, N, H = h_draft_KNH.shape
        draft_RH, target_RH = h_draft_KNH.reshape(K * N, H), h_target_KNH.reshape(K * N, H)
        with torch.no_grad():
            value_R, saved_CR, stats_CR, _ = forward_chunks(
                lambda rows: (draft_RH[rows] @ weight_VH.t(), target_RH[rows] @ weight_VH.t()),
                K * N, opts, compute_dtype(h_draft_KNH.dtype, weight_VH.dtype), h_draft_KNH,
            )
        ctx.opts = opts
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(h_draft_KNH, h_target_KNH, weight_VH, saved_CR)
        stats_CKN = stats_CR.view(-1, K, N)
        ctx.mark_non_differentiable(stats_CKN)
        return value_R.view(K, N), stats_CKN

    @staticmethod
    def backward(ctx, grad_value_KN, _grad_stats):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        opts = ctx.opts
        h_draft_KNH, h_target_KNH, weight_VH, saved_CR = ctx.saved_tensors
        K, N, H = h_draft_KNH.shape
        draft_RH, target_RH = h_draft_KNH.reshape(K * N, H), h_target_KNH.reshape(K * N, H)
        grad_value_R = grad_value_KN.reshape(K * N)
        grad_RH = torch.empty_like(draft_RH)
        ws = Workspace()
        for rows in _chunks(K * N, opts.chunk_tokens):
            grad_logits_RV = grad_rows(
                draft_RH[rows] @ weight_VH.t(), target_RH[rows] @ weight_VH.t(), saved_CR[:, rows],
                grad_value_R[rows], kind=opts.kind, target_temperature=opts.target_temperature,
                draft_temperature=opts.draft_temperature, ws=ws,
            )
            torch.matmul(grad_logits_RV.to(weight_VH.dtype), weight_VH, out=grad_RH[rows])
        return grad_RH.view(K, N, H), None, None, None
