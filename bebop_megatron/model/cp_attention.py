"""Exact causal attention under context parallelism (``parallel.context = C > 1``), SDPA kernels.

Legend: C context-parallel ranks, S the whole row, L = S / (2C) positions of a chunk, b micro-batch,
h heads, d head width.

Each row is split into 2C chunks and CP rank r holds chunks r and 2C-1-r (Megatron-Core's
load-balanced order, ``get_batch_on_this_cp_rank``): its local sequence is their concatenation,
2L positions. Attention of the local queries against the keys and values of the whole row:

1. K and V are all-gathered over the CP group (:class:`_GatherSequence`; the backward sums the
   ranks' gradients of the whole row and keeps this rank's chunks: a reduce-scatter) and put
   back in row order.
2. Each query chunk (global chunk i, positions ``[iL, (i+1)L)``) attends to its own chunk
   causally (a square block: the fused kernel's ``is_causal``) and to the keys before it without
   a mask; the two partial results are merged with their log-sum-exps. Packed rows (document
   starts of the whole row) split this per document: a document's queries in chunk i attend to
   the document's keys in chunk i causally and to its keys before ``iL`` (in earlier chunks, on
   any rank) without a mask. No ``S x S`` (or ``L x S``) tensor is ever built.
3. The backward runs the kernels' own backward per block with the *merged* output and
   log-sum-exp (the flash-attention identity), so every block's gradient is exact.

Kernels: ``_scaled_dot_product_flash_attention_for_cpu`` on CPU and
``_scaled_dot_product_efficient_attention`` on CUDA, torch's fused SDPA kernels that also
return the log-sum-exp. GQA: K/V heads are repeated to the query heads after the gather.
MLA (value heads of another width than the query/key heads): the CPU kernel takes one width
only, so q, k and v are zero-padded to the wider one there (no score changes; the padded output
and gradient columns are dropped); CUDA's memory-efficient kernel takes the two widths as they are.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


# ----------------------------------------------------------------------------- sharding

def cp_chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two global chunks (of 2C) that CP rank r holds: r and 2C-1-r."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def shard_sequence(x: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's part of ``x`` along ``dim`` (a whole row): chunks r and 2C-1-r, concatenated."""
    if cp_size == 1:
        return x
    chunks = x.chunk(2 * cp_size, dim=dim)
    a, b = cp_chunk_ids(cp_rank, cp_size)
    return torch.cat([chunks[a], chunks[b]], dim=dim).contiguous()


def unshard_sequence(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: every rank's local part (rank order) -> the whole row."""
    C = len(parts)
    halves = [p.chunk(2, dim=dim) for p in parts]
    ordered = [halves[c][0] for c in range(C)] + [halves[2 * C - 1 - c][1] for c in range(C, 2 * C)]
    return torch.cat(ordered, dim=dim)


class _GatherSequence(torch.autograd.Function):
    """Local part ``[..., 2L, d]`` (sequence on dim -2) -> the whole row ``[..., S, d]`` over the
    CP group; backward: the gradient summed over the group, this rank's chunks kept."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return unshard_sequence(parts, dim=-2)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        grad = grad.contiguous()
        # A reduce-scatter of the row's gradient; gloo has none, so all-reduce and keep ours.
        dist.all_reduce(grad, group=group)
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        return shard_sequence(grad, rank, size, dim=-2), None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherSequence.apply(x, group)


# ----------------------------------------------------------------------------- kernels

def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _pad_width(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _kernel_forward(q, k, v, causal: bool, scale: float):
    """(out ``[b, h, lq, dv]``, lse ``[b, h, lq]`` in :func:`_lse_dtype`)."""
    if q.device.type == "cpu":
        # The CPU flash kernel needs one head width for q, k and v; MLA's value heads are narrower
        # (or wider) than its query/key heads. Zero columns change no score (the scale is given)
        # and add zero output columns, which are dropped.
        dv, width = v.shape[-1], max(q.shape[-1], v.shape[-1])
        q, k, v = (_pad_width(x, width) for x in (q, k, v))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out[..., :dv], lse
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                            scale=scale)
    return out, lse[..., : q.shape[-2]]


def _kernel_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float):
    if q.device.type == "cpu":
        dk, dv, width = q.shape[-1], v.shape[-1], max(q.shape[-1], v.shape[-1])
        padded = (_pad_width(x, width) for x in (grad_out, q, k, v, out))
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *padded, lse, 0.0, causal, scale=scale)
        return gq[..., :dk], gk[..., :dk], gv[..., :dv]
    # No dropout: the philox seed and offset are not read. The kernel's log-sum-exp rows are padded
    # to a multiple of 32 (as its forward returns them).
    seed = torch.zeros((), dtype=torch.int64)
    offset = torch.zeros((), dtype=torch.int64)
    lse = torch.nn.functional.pad(lse, (0, -lse.shape[-1] % 32)).contiguous()
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


class _BlockAttention(torch.autograd.Function):
    """q ``[b, h, lq, d]`` (local queries), k/v ``[b, h, S, d]`` (the whole row), segments
    ``(q0, q1, g0, p0)``: local queries ``q0:q1`` sit at row positions ``g0 : g0 + q1 - q0`` and
    attend causally to the keys there and, without a mask, to the keys ``p0 : g0`` (none when
    ``p0 == g0``). Every local query lies in exactly one segment."""

    @staticmethod
    def forward(ctx, q, k, v, segments, scale):
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = q.new_empty(q.shape[:-1], dtype=_lse_dtype(q.dtype))
        for q0, q1, g0, p0 in segments:
            g1 = g0 + q1 - q0
            qs = q[..., q0:q1, :]
            o, l = _kernel_forward(qs, k[..., g0:g1, :], v[..., g0:g1, :], True, scale)
            if p0 < g0:
                o2, l2 = _kernel_forward(qs, k[..., p0:g0, :], v[..., p0:g0, :], False, scale)
                m = torch.logaddexp(l, l2)
                o = (o.to(l.dtype) * torch.exp(l - m)[..., None] + o2.to(l.dtype) * torch.exp(l2 - m)[..., None]).to(o.dtype)
                l = m
            out[..., q0:q1, :] = o
            lse[..., q0:q1] = l
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.segments, ctx.scale = segments, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for q0, q1, g0, p0 in ctx.segments:
            g1 = g0 + q1 - q0
            args = (grad_out[..., q0:q1, :].contiguous(), q[..., q0:q1, :].contiguous())
            saved = (out[..., q0:q1, :].contiguous(), lse[..., q0:q1].contiguous())
            for a, b, causal in ((g0, g1, True), (p0, g0, False)):
                if a == b:
                    continue
                gq, gk, gv = _kernel_backward(args[0], args[1], k[..., a:b, :].contiguous(),
                                              v[..., a:b, :].contiguous(), *saved, causal, ctx.scale)
                dq[..., q0:q1, :] += gq
                dk[..., a:b, :] += gk
                dv[..., a:b, :] += gv
        return dq, dk, dv, None, None


def _segments(starts: list[int] | None, cp_rank: int, cp_size: int, S: int) -> list[tuple[int, int, int, int]]:
    """:class:`_BlockAttention`'s segments of this rank's two chunks; ``starts``: the row's
    document starts (None: one document)."""
    L = S // (2 * cp_size)
    starts = [0] if starts is None else starts
    ends = starts[1:] + [S]
    out = []
    for local, chunk in enumerate(cp_chunk_ids(cp_rank, cp_size)):
        c0, c1 = chunk * L, (chunk + 1) * L
        for s, e in zip(starts, ends):
            a, b = max(s, c0), min(e, c1)
            if a < b:
                out.append((local * L + a - c0, local * L + b - c0, a, s))
    return out


def context_parallel_attention(q, k, v, document_starts_rows: list[list[int]] | None, *, scale: float,
                               cp_group) -> torch.Tensor:
    """q ``[b, h, 2L, d]``, k/v ``[b, groups, 2L, d]`` (this rank's chunks) -> ``[b, h, 2L, dv]``.

    ``document_starts_rows``: per row, the document starts of the whole row (packed rows), or None."""
    cp_rank, cp_size = dist.get_rank(cp_group), dist.get_world_size(cp_group)
    k_full, v_full = gather_sequence(k, cp_group), gather_sequence(v, cp_group)
    if k_full.shape[1] != q.shape[1]:  # GQA
        rep = q.shape[1] // k_full.shape[1]
        k_full, v_full = k_full.repeat_interleave(rep, dim=1), v_full.repeat_interleave(rep, dim=1)
    S = k_full.shape[2]
    if document_starts_rows is None:
        return _BlockAttention.apply(q, k_full, v_full, _segments(None, cp_rank, cp_size, S), scale)
    rows = [_BlockAttention.apply(q[r:r + 1], k_full[r:r + 1], v_full[r:r + 1],
                                  _segments(starts, cp_rank, cp_size, S), scale)
            for r, starts in enumerate(document_starts_rows)]
    return torch.cat(rows, dim=0)
