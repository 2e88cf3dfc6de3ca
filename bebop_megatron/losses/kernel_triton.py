"""Triton chunk kernel (``impl="triton"``, CUDA) of the vocabulary-parallel divergences.

Same functions, signatures, results and saved rows as :mod:`kernel_torch` (the plain-torch
CPU default), computed in tiles over the vocabulary as in the Bebop paper's appendix F
(Algorithms 1 and 2), so no ``R x V`` temporary exists besides the gradient itself.

Legend: R rows of one chunk (any leading shape, flattened to ``R x V`` here), V this TP
rank's vocabulary shard (rank r holds the global columns ``r*V : (r+1)*V``), S vocabulary
splits of one row (consecutive column ranges handled by separate programs, so that a small
chunk still fills the GPU), BLOCK the tile width.

Three kernels (:mod:`kernel_triton_jit`), each program looping over BLOCK-wide tiles of
one row's columns: A the softmax statistics (max, sum-exp, argmax), B the partial sums of
the divergences and stats, C the gradient.

Kind ``tv_kl`` (the LK hybrids), as in kernel_torch: B sums d_TV, S and KL(p||q) of a row
from the same p and q (value ``[2, R]``: d_TV, KL); with ``with_grad`` one launch of C
writes both directions (``grad_RV`` TV's, ``grad_kl_RV`` KL's, two ``R x V`` workspace
views); ``grad_rows`` takes a ``[2, R]`` scale and one launch of C writes
``scale_tv x TV direction + scale_kl x KL direction`` into one buffer.

Between the kernels (in torch, ``R``-sized): the splits' maxima and sum-exps are combined
(the sums rescaled by ``exp((max_split - max) / temperature)``), and so are B's partial sums.
Under tensor parallelism (``tp_group`` of world size > 1), as in kernel_torch, the max is
all-reduced (MAX) before the sum-exp is rescaled and all-reduced (SUM); B's partial sums
and p at the argmax of q are all-reduced (SUM) together; the vocabulary-parallel argmax of
q is the lowest global index among the ranks holding the max (all-reduce MIN). The
backward (``grad_rows``) runs kernel C alone from the saved rows, with no collective.

Compute dtype: float32 for bf16/fp16/fp32 logits, float64 when an input is float64
(``kernel_torch.compute_dtype``). Selected by ``impl="triton"``; runs on CUDA tensors, or
on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is
imported; that is how the CPU tests run it). Rows need at least one finite logit each, as
in kernel_torch.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import triton

from bebop_megatron.losses.kernel_torch import (
    KINDS,
    SAVED_ROWS,
    STAT_KEYS,
    TV_KL,
    RowResult,
    Workspace,
    all_reduce_,
    compute_dtype,
)
from bebop_megatron.losses.kernel_triton_jit import TV_KL as _TV_KL_ID
from bebop_megatron.losses.kernel_triton_jit import (  # the kernels stay reachable here (tests compile them)
    TV_KL_SUM,
    SLOT_HP,
    SLOT_HQ,
    SLOT_KL,
    NUM_SLOTS,
    SLOT_RKL,
    SLOT_S,
    SLOT_TV,
    grad_kernel,
    parts_kernel,
    softmax_stats_kernel,
)

# Tuning knobs (module attributes so tests can shrink them): the widest tile, and the
# number of vocabulary splits per row (None: enough programs for ~4 per SM on CUDA, 1 else).
BLOCK_V = 2048
SPLITS: int | None = None
PROGRAMS_PER_SM = 4

_KIND_IDS = {kind: i for i, kind in enumerate(KINDS)}  # tv 0, kl 1, reverse_kl 2
_KIND_IDS[TV_KL] = _TV_KL_ID  # 3
_NO_INDEX = torch.iinfo(torch.long).max


def _interpreted() -> bool:
    return not isinstance(grad_kernel, triton.runtime.JITFunction)


def _check(draft_RV: torch.Tensor, target_RV: torch.Tensor, kind: str) -> None:
    if kind not in _KIND_IDS:
        raise ValueError(f"kind must be one of {tuple(_KIND_IDS)}, got {kind!r}")
    if draft_RV.shape != target_RV.shape or draft_RV.dim() < 1:
        raise ValueError(f"draft and target logits must have one shape [..., V], got {tuple(draft_RV.shape)} "
                         f"and {tuple(target_RV.shape)}")
    if draft_RV.device != target_RV.device:
        raise ValueError(f"draft and target logits are on {draft_RV.device} and {target_RV.device}")
    if draft_RV.device.type != "cuda" and not _interpreted():
        raise ValueError(
            f"impl='triton' runs on CUDA tensors, got {draft_RV.device} ones (use impl='torch' on CPU, or set "
            "TRITON_INTERPRET=1 before importing triton to run the kernels in Triton's interpreter)"
        )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` -> ``R x V`` with unit column stride (a view when the layout allows)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _temperatures(draft_temperature: float, target_temperature: float, dtype, device) -> torch.Tensor:
    """``[tau_d, tau_t]`` as a compute-dtype device tensor (a float64 kernel needs float64 ones;
    filled in place, so no host-to-device copy and no synchronisation)."""
    temps = torch.empty(2, dtype=dtype, device=device)
    temps[0] = draft_temperature
    temps[1] = target_temperature
    return temps


_SM_COUNT: dict = {}


class _Tiles:
    """Tile width, warps and vocabulary splits of one ``R x V`` call."""

    def __init__(self, R: int, V: int, device: torch.device) -> None:
        self.block = max(16, min(BLOCK_V, triton.next_power_of_2(max(V, 1))))
        self.num_warps = 8 if self.block >= 2048 else 4
        self.num_tiles = max(1, triton.cdiv(V, self.block))
        splits = SPLITS
        if splits is None:
            splits = 1
            if device.type == "cuda" and R > 0:
                if device not in _SM_COUNT:
                    _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
                splits = triton.cdiv(PROGRAMS_PER_SM * _SM_COUNT[device], R)
        splits = max(1, min(int(splits), self.num_tiles))
        self.tiles_per_split = triton.cdiv(self.num_tiles, splits)
        self.splits = triton.cdiv(self.num_tiles, self.tiles_per_split)  # no empty split


def _on(device: torch.device):
    """Launch on ``device`` (Triton launches on the current CUDA device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _grad(draft2, target2, temps, saved_CR, scale_R, kind_id, tiles: _Tiles, out2, out_kl2=None) -> None:
    """Kernel C; ``scale_R`` is ``[R]``, or ``[2, R]`` (TV's, KL's) for tv_kl (``[R]``: both the same);
    ``out_kl2`` receives the KL direction (tv_kl in the forward)."""
    R, V = draft2.shape
    if R == 0 or V == 0:
        return
    stride_c = scale_R.stride(0) if scale_R.dim() == 2 else 0
    with _on(draft2.device):
        grad_kernel[(R, tiles.num_tiles)](
            draft2, target2, temps, saved_CR, saved_CR.stride(0), scale_R, stride_c, out2,
            out2 if out_kl2 is None else out_kl2, V, draft2.stride(0), target2.stride(0), out2.stride(0),
            BLOCK_V=tiles.block, KIND=kind_id, num_warps=tiles.num_warps,
        )


def forward_rows(draft_RV, target_RV, *, kind, target_temperature, draft_temperature, tp_group,
                 with_stats, with_grad, ws: Workspace) -> RowResult:
    """Full-vocabulary divergence of one chunk of rows; see the module docstring."""
    _check(draft_RV, target_RV, kind)
    dtype = compute_dtype(draft_RV.dtype, target_RV.dtype)
    device = draft_RV.device
    lead = draft_RV.shape[:-1]
    draft2, target2 = _rows(draft_RV), _rows(target_RV)
    R, V = draft2.shape
    tiles = _Tiles(R, V, device)
    S = tiles.splits
    temps = _temperatures(draft_temperature, target_temperature, dtype, device)
    kind_id = _KIND_IDS[kind]

    # Kernel A: per-split max and sum-exp of q and p (and the draft's first argmax).
    max_2RS = torch.empty((2, R, S), dtype=dtype, device=device)
    sumexp_2RS = torch.empty((2, R, S), dtype=dtype, device=device)
    arg_RS = torch.empty((R, S), dtype=torch.long, device=device) if with_stats else max_2RS
    if R > 0:
        with _on(device):
            softmax_stats_kernel[(R, S)](
                draft2, target2, temps, max_2RS, sumexp_2RS, arg_RS, R, V, draft2.stride(0), target2.stride(0),
                tiles.tiles_per_split, BLOCK_V=tiles.block, WITH_ARG=with_stats, num_warps=tiles.num_warps,
            )
    local_max_2R = max_2RS.amax(-1)
    max_2R = all_reduce_(local_max_2R.clone(), dist.ReduceOp.MAX, tp_group)
    sharded = tp_group is not None and dist.get_world_size(tp_group) > 1
    if S == 1 and not sharded:
        sumexp_2R = sumexp_2RS[..., 0]
    else:  # rescale each split's sum to the global max: exp((max_split - max) / T); 0 for an all -inf split
        shift_2RS = max_2RS - max_2R[..., None]
        shift_2RS[0].div_(draft_temperature)
        shift_2RS[1].div_(target_temperature)
        factor_2RS = torch.where(max_2RS == -math.inf, 0.0, shift_2RS.exp_())
        sumexp_2R = all_reduce_((sumexp_2RS * factor_2RS).sum(-1), dist.ReduceOp.SUM, tp_group)
    saved = torch.empty((len(SAVED_ROWS), R), dtype=dtype, device=device)
    saved[:4].view(2, 2, R)[:, 0] = max_2R  # rows max_q, sumexp_q, max_p, sumexp_p
    saved[:4].view(2, 2, R)[:, 1] = sumexp_2R
    max_q, max_p = max_2R

    # Kernel B: per-split partial sums, then summed over splits and ranks.
    parts_6RS = torch.empty((NUM_SLOTS, R, S), dtype=dtype, device=device)
    if R > 0:
        with _on(device):
            parts_kernel[(R, S)](
                draft2, target2, temps, saved, saved.stride(0), parts_6RS, R, V, draft2.stride(0),
                target2.stride(0), tiles.tiles_per_split, BLOCK_V=tiles.block, KIND=kind_id,
                WITH_STATS=with_stats, num_warps=tiles.num_warps,
            )
    parts_6R = parts_6RS[..., 0] if S == 1 else parts_6RS.sum(-1)
    parts: dict[str, torch.Tensor] = {}
    with_tv = kind in ("tv", TV_KL)
    if with_tv or with_stats:
        parts["tv"] = parts_6R[SLOT_TV]
    if with_tv:
        parts["aux"] = parts_6R[SLOT_S]
    if kind in ("kl", TV_KL) or with_stats:
        parts["kl"] = parts_6R[SLOT_KL]
    if kind == "reverse_kl":
        parts["reverse_kl"] = parts["aux"] = parts_6R[SLOT_RKL]
    index = None
    if with_stats:
        parts["entropy_target"] = parts_6R[SLOT_HP]
        parts["entropy_draft"] = parts_6R[SLOT_HQ]
        # Vocabulary-parallel argmax of q: lowest global index among the splits and ranks holding the max.
        local_max_q = local_max_2R[0]
        local_arg = torch.where(max_2RS[0] == local_max_q[:, None], arg_RS, _NO_INDEX).amin(-1)
        start = V * (dist.get_rank(tp_group) if tp_group is not None else 0)
        index = torch.where(local_max_q == max_q, local_arg + start, _NO_INDEX)
        index = all_reduce_(index, dist.ReduceOp.MIN, tp_group)
        mine = (index >= start) & (index < start + V)
        logit = target2.gather(-1, (index - start).clamp_(0, max(V - 1, 0))[:, None]).squeeze(-1).to(dtype)
        shifted = logit - max_p
        if target_temperature != 1.0:
            shifted = shifted.div_(target_temperature)
        parts["alpha_to"] = torch.where(mine, shifted.exp_().div_(sumexp_2R[1]), 0.0)
    names = list(parts)
    sums = dict(zip(names, all_reduce_(torch.stack([parts[n] for n in names]), dist.ReduceOp.SUM, tp_group)))

    if kind == TV_KL:
        value = torch.stack([sums["tv"], sums["kl"]])
    else:
        value = sums["tv" if kind == "tv" else kind]
    saved[4] = sums["aux"] if "aux" in sums else 0.0
    stats = None
    if with_stats:
        stats = torch.stack([
            1.0 - sums["tv"], sums["alpha_to"], sums["entropy_target"], sums["entropy_draft"], sums["kl"],
        ]).view(len(STAT_KEYS), *lead)
        index = index.view(lead)
    grad = grad_kl = None
    if with_grad:  # tv_kl: both directions from one pass, TV's in grad, KL's in grad_kl
        grad = ws.take("grad", draft_RV, dtype)
        grad_kl = ws.take("grad_kl", draft_RV, dtype) if kind == TV_KL else None
        scale = torch.full((R,), 1.0 / draft_temperature, dtype=dtype, device=device)
        _grad(draft2, target2, temps, saved, scale, kind_id, tiles, grad.view(R, V),
              None if grad_kl is None else grad_kl.view(R, V))
    return RowResult(value.view(*value.shape[:-1], *lead), saved.view(len(SAVED_ROWS), *lead), stats, grad,
                     argmax_R=index, grad_kl_RV=grad_kl)


def grad_rows(draft_RV, target_RV, saved_CR, scale_R, *, kind, target_temperature, draft_temperature,
              ws: Workspace) -> torch.Tensor:
    """``scale_R`` x d value / d draft logits of one chunk (a workspace view), recomputed from
    the saved per-row scalars by kernel C alone, with no collective. For ``tv_kl``, ``scale_R``
    is ``[2, ...]`` (TV's and KL's) and the result ``scale_tv x TV direction + scale_kl x KL
    direction``, from one pass."""
    _check(draft_RV, target_RV, kind)
    dtype = compute_dtype(draft_RV.dtype, target_RV.dtype)
    device = draft_RV.device
    draft2, target2 = _rows(draft_RV), _rows(target_RV)
    R, V = draft2.shape
    saved = saved_CR.reshape(len(SAVED_ROWS), R).to(dtype)
    if saved.stride(-1) != 1 and R > 1:
        saved = saved.contiguous()
    pair = kind == TV_KL
    scale = (scale_R / draft_temperature).reshape(*((2,) if pair else ()), R).to(dtype).contiguous()
    temps = _temperatures(draft_temperature, target_temperature, dtype, device)
    out = ws.take("grad", draft_RV, dtype)
    _grad(draft2, target2, temps, saved, scale, TV_KL_SUM if pair else _KIND_IDS[kind], _Tiles(R, V, device),
          out.view(R, V))
    return out


__all__ = ["BLOCK_V", "SPLITS", "forward_rows", "grad_rows"]
