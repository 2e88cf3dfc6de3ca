"""The context-parallel attention's blocks (model/cp_attention.py) against fused SDPA on whole rows.

No process group: each CP rank's local queries run against the whole row's keys and values
(what the all-gather gives it), and the ranks' outputs and gradients are put back together.
Causal rows and packed rows whose documents span chunks and ranks; C = 2 and 3; value heads of the
query/key width and, as in MLA, narrower or wider; float64 on CPU
(the CPU flash kernel), float32 on CUDA (the memory-efficient kernel; skipped without a GPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bebop_megatron.model.cp_attention import _BlockAttention, _segments, shard_sequence, unshard_sequence

SCALE = 0.3


def _reference(q, k, v, starts):
    if starts is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE)
    ends = starts[1:] + [q.shape[2]]
    return torch.cat([F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True,
                                                     scale=SCALE) for s, e in zip(starts, ends)], dim=2)


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("cp_size", [2, 3])
@pytest.mark.parametrize("starts", [None, [0, 5, 14, 20]], ids=["causal", "packed"])
@pytest.mark.parametrize("v_width", [8, 5, 12], ids=["same-widths", "mla-narrow-v", "mla-wide-v"])
def test_blocks_match_whole_row_attention(cp_size, starts, device, v_width):
    torch.manual_seed(0)
    dtype = torch.float64 if device == "cpu" else torch.float32
    q, k, v = (torch.randn(2, 3, 24, width, dtype=dtype, device=device, requires_grad=True)
               for width in (8, 8, v_width))
    ref = _reference(q, k, v, starts)
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    outs, dqs, dk, dv = [], [], 0, 0
    for rank in range(cp_size):
        q_local = shard_sequence(q.detach(), rank, cp_size, dim=2).requires_grad_()
        k_row, v_row = k.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()
        out = _BlockAttention.apply(q_local, k_row, v_row, _segments(starts, rank, cp_size, 24), SCALE)
        gq, gk, gv = torch.autograd.grad(out, (q_local, k_row, v_row), shard_sequence(grad, rank, cp_size, dim=2))
        outs.append(out)
        dqs.append(gq)
        dk, dv = dk + gk, dv + gv  # the gather's backward sums the ranks' gradients
    torch.testing.assert_close(unshard_sequence(outs, dim=2), ref)
    for got, want in zip((unshard_sequence(dqs, dim=2), dk, dv), ref_grads):
        torch.testing.assert_close(got, want)
