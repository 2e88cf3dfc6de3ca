"""Triton chunk kernel (``impl="triton"``, CUDA) of the vocabulary-parallel divergences.

Same functions, signatures, results and saved rows as :mod:`kernel_torch` (the plain-torch
CPU default), computed in tiles over the vocabulary as in the Bebop paper's appendix F
(Algorithms 1 and 2), so no ``R x V`` temporary exists besides the gradient itself.

Legend: R rows of one chunk (any leading shape, flattened to ``R x V`` here), V this TP
rank's vocabulary shard (rank r holds the global columns ``r*V : (r+1)*V``), S vocabulary
splits of one row (consecutive column ranges handled by separate programs, so that a small
chunk still fills the GPU), BLOCK the tile width.

Three kernels, each program looping over BLOCK-wide tiles of one row's columns:

- A ``_softmax_stats_kernel`` (grid ``R x S``): online max and sum-exp of q (draft logits /
  draft_temperature) and p (target logits / target_temperature) over the split, and (with
  stats) the first maximal draft logit's index. As in kernel_torch the max is that of the
  *unscaled* logits and the sum is of ``exp((logits - max) / temperature)``, so the saved
  rows of the two implementations are interchangeable.
- B ``_parts_kernel`` (grid ``R x S``): with the row's global max and sum-exp, the partial
  sums over the split: d_TV = sum |p - q| / 2, S = sum q 1[q <= p] (ties count as "<="),
  KL(p||q), KL(q||p), H(p), H(q), as ``kind`` and ``with_stats`` need (0 log 0 = 0).
- C ``_grad_kernel`` (grid ``R x tiles``): ``scale_R`` x d value / d draft logits per
  element (Eq. 11 for TV: S q_j - q_j 1[q_j <= p_j]; q - p for kl;
  q_j [log(q_j / p_j) - KL(q||p)] for reverse_kl; times scale = 1 / draft_temperature in
  the forward), into a compute-dtype workspace view. B and C compute p and q with the same
  jitted helper, so the mask ``q <= p`` of the gradient is the one S was summed over.

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
import triton.language as tl

from bebop_megatron.losses.kernel_torch import (
    KINDS,
    SAVED_ROWS,
    STAT_KEYS,
    RowResult,
    Workspace,
    _all_reduce,
    compute_dtype,
)

# Tuning knobs (module attributes so tests can shrink them): the widest tile, and the
# number of vocabulary splits per row (None: enough programs for ~4 per SM on CUDA, 1 else).
BLOCK_V = 2048
SPLITS: int | None = None
PROGRAMS_PER_SM = 4

# B's partial sums, one slot each (B writes all of them; unused ones are 0).
_TV, _S, _KL, _RKL, _HP, _HQ = range(6)
_NUM_PARTS = 6
_KIND_IDS = {kind: i for i, kind in enumerate(KINDS)}  # tv 0, kl 1, reverse_kl 2
_NO_INDEX = torch.iinfo(torch.long).max


@triton.jit
def _shifted(ptr, cols, mask, max_, temperature):
    """(logits - max) / temperature in the compute dtype (that of ``max_``); -inf past V."""
    x = tl.load(ptr + cols, mask=mask, other=float("-inf")).to(max_.dtype)
    return (x - max_) / temperature


@triton.jit
def _probs(draft_ptr, target_ptr, cols, mask, max_q, sumexp_q, max_p, sumexp_p, t_q, t_p):
    """Shifted logits and normalised probabilities of one tile (the one helper of B and C)."""
    sq = _shifted(draft_ptr, cols, mask, max_q, t_q)
    sp = _shifted(target_ptr, cols, mask, max_p, t_p)
    q = tl.exp(sq) / sumexp_q
    p = tl.exp(sp) / sumexp_p
    return sq, sp, q, p


@triton.jit
def _softmax_stats_kernel(draft_ptr, target_ptr, temps_ptr, max_ptr, sumexp_ptr, arg_ptr, R, V,
                          stride_d, stride_t, tiles_per_split, BLOCK_V: tl.constexpr, WITH_ARG: tl.constexpr):
    """Kernel A: per (row, split), max of the unscaled logits and sum exp((x - max) / T) of
    q and p, and (WITH_ARG) the first index of the draft's max; outputs ``[2, R, S]``, ``[R, S]``."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    dt = max_ptr.dtype.element_ty
    t_q = tl.load(temps_ptr)
    t_p = tl.load(temps_ptr + 1)
    lo = split * tiles_per_split * BLOCK_V
    hi = tl.minimum(lo + tiles_per_split * BLOCK_V, V)
    draft_row = draft_ptr + row * stride_d
    target_row = target_ptr + row * stride_t
    m_q = tl.full((), float("-inf"), dt)
    m_p = tl.full((), float("-inf"), dt)
    s_q = tl.full((), 0.0, dt)
    s_p = tl.full((), 0.0, dt)
    a_q = lo
    for start in range(lo, hi, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < hi
        xq = tl.load(draft_row + cols, mask=mask, other=float("-inf")).to(dt)
        xp = tl.load(target_row + cols, mask=mask, other=float("-inf")).to(dt)
        if WITH_ARG:
            tile_max_q, tile_arg_q = tl.max(xq, 0, return_indices=True, return_indices_tie_break_left=True)
            a_q = tl.where(tile_max_q > m_q, start + tile_arg_q, a_q)  # strict: earlier tiles win ties
        else:
            tile_max_q = tl.max(xq, 0)
        new_q = tl.maximum(m_q, tile_max_q)
        new_p = tl.maximum(m_p, tl.max(xp, 0))
        # A max still at -inf (every logit so far -inf) shifts by 0 instead: no inf - inf.
        ref_q = tl.where(new_q == float("-inf"), 0.0, new_q)
        ref_p = tl.where(new_p == float("-inf"), 0.0, new_p)
        s_q = s_q * tl.exp((m_q - ref_q) / t_q) + tl.sum(tl.exp((xq - ref_q) / t_q), 0)
        s_p = s_p * tl.exp((m_p - ref_p) / t_p) + tl.sum(tl.exp((xp - ref_p) / t_p), 0)
        m_q = new_q
        m_p = new_p
    out = row * num_splits + split
    tl.store(max_ptr + out, m_q)
    tl.store(max_ptr + R * num_splits + out, m_p)
    tl.store(sumexp_ptr + out, s_q)
    tl.store(sumexp_ptr + R * num_splits + out, s_p)
    if WITH_ARG:
        tl.store(arg_ptr + out, a_q.to(tl.int64))


@triton.jit
def _parts_kernel(draft_ptr, target_ptr, temps_ptr, saved_ptr, stride_s, parts_ptr, R, V, stride_d, stride_t,
                  tiles_per_split, BLOCK_V: tl.constexpr, KIND: tl.constexpr, WITH_STATS: tl.constexpr):
    """Kernel B: per (row, split), the partial sums of the six slots (``[6, R, S]``)."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    dt = saved_ptr.dtype.element_ty
    t_q = tl.load(temps_ptr)
    t_p = tl.load(temps_ptr + 1)
    max_q = tl.load(saved_ptr + row)
    sumexp_q = tl.load(saved_ptr + stride_s + row)
    max_p = tl.load(saved_ptr + 2 * stride_s + row)
    sumexp_p = tl.load(saved_ptr + 3 * stride_s + row)
    lse_q = tl.log(sumexp_q)
    lse_p = tl.log(sumexp_p)
    lo = split * tiles_per_split * BLOCK_V
    hi = tl.minimum(lo + tiles_per_split * BLOCK_V, V)
    draft_row = draft_ptr + row * stride_d
    target_row = target_ptr + row * stride_t
    need_tv: tl.constexpr = (KIND == 0) or WITH_STATS
    need_kl: tl.constexpr = (KIND == 1) or WITH_STATS
    acc_tv = tl.zeros([BLOCK_V], dt)
    acc_s = tl.zeros([BLOCK_V], dt)
    acc_kl = tl.zeros([BLOCK_V], dt)
    acc_rkl = tl.zeros([BLOCK_V], dt)
    acc_hp = tl.zeros([BLOCK_V], dt)
    acc_hq = tl.zeros([BLOCK_V], dt)
    for start in range(lo, hi, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < hi
        sq, sp, q, p = _probs(draft_row, target_row, cols, mask, max_q, sumexp_q, max_p, sumexp_p, t_q, t_p)
        # Columns past the split load -inf logits: q = p = 0, and every term below is 0.
        if need_tv:
            acc_tv += tl.abs(p - q)  # Eq. 10: d_TV = sum |p - q| / 2
        if KIND == 0:
            acc_s += tl.where(q <= p, q, 0.0)  # S of Eq. 11, ties count as "<="
        logq = sq - lse_q
        logp = sp - lse_p
        # 0 log 0 = 0: terms with a zero weight are 0 (a log ratio of +inf with a positive weight stays).
        if need_kl:
            acc_kl += tl.where(p > 0, p * (logp - logq), 0.0)
        if KIND == 2:
            acc_rkl += tl.where(q > 0, q * (logq - logp), 0.0)
        if WITH_STATS:
            acc_hp += tl.where(p > 0, p * logp, 0.0)
            acc_hq += tl.where(q > 0, q * logq, 0.0)
    out = row * num_splits + split
    plane = R * num_splits
    tl.store(parts_ptr + out, 0.5 * tl.sum(acc_tv, 0))
    tl.store(parts_ptr + plane + out, tl.sum(acc_s, 0))
    tl.store(parts_ptr + 2 * plane + out, tl.sum(acc_kl, 0))
    tl.store(parts_ptr + 3 * plane + out, tl.sum(acc_rkl, 0))
    tl.store(parts_ptr + 4 * plane + out, -tl.sum(acc_hp, 0))
    tl.store(parts_ptr + 5 * plane + out, -tl.sum(acc_hq, 0))


@triton.jit
def _grad_kernel(draft_ptr, target_ptr, temps_ptr, saved_ptr, stride_s, scale_ptr, out_ptr, V,
                 stride_d, stride_t, stride_o, BLOCK_V: tl.constexpr, KIND: tl.constexpr):
    """Kernel C: ``scale_R`` x d value / d draft logits of one (row, tile)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    t_q = tl.load(temps_ptr)
    t_p = tl.load(temps_ptr + 1)
    max_q = tl.load(saved_ptr + row)
    sumexp_q = tl.load(saved_ptr + stride_s + row)
    max_p = tl.load(saved_ptr + 2 * stride_s + row)
    sumexp_p = tl.load(saved_ptr + 3 * stride_s + row)
    aux = tl.load(saved_ptr + 4 * stride_s + row)
    scale = tl.load(scale_ptr + row)
    sq, sp, q, p = _probs(draft_ptr + row * stride_d, target_ptr + row * stride_t, cols, mask,
                          max_q, sumexp_q, max_p, sumexp_p, t_q, t_p)
    if KIND == 0:
        g = q * aux - tl.where(q <= p, q, 0.0)  # Eq. 11: S q_j - q_j 1[q_j <= p_j]
    elif KIND == 1:
        g = q - p  # d KL(p||q) / dz
    else:
        logq = sq - tl.log(sumexp_q)
        logp = sp - tl.log(sumexp_p)
        g = q * (logq - logp - aux)  # q_j [log(q_j / p_j) - KL(q||p)]
        g = tl.where((q > 0) & (g == g), g, 0.0)  # 0 where q_j = 0 and, as kernel_torch, where nan (inf - inf)
    tl.store(out_ptr + row * stride_o + cols, (g * scale).to(out_ptr.dtype.element_ty), mask=mask)


def _interpreted() -> bool:
    return not isinstance(_grad_kernel, triton.runtime.JITFunction)


def _check(draft_RV: torch.Tensor, target_RV: torch.Tensor, kind: str) -> None:
    if kind not in _KIND_IDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
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


def _grad(draft2, target2, temps, saved_CR, scale_R, kind_id, tiles: _Tiles, out2) -> None:
    R, V = draft2.shape
    if R == 0 or V == 0:
        return
    with _on(draft2.device):
        _grad_kernel[(R, tiles.num_tiles)](
            draft2, target2, temps, saved_CR, saved_CR.stride(0), scale_R, out2, V,
            draft2.stride(0), target2.stride(0), out2.stride(0),
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
            _softmax_stats_kernel[(R, S)](
                draft2, target2, temps, max_2RS, sumexp_2RS, arg_RS, R, V, draft2.stride(0), target2.stride(0),
                tiles.tiles_per_split, BLOCK_V=tiles.block, WITH_ARG=with_stats, num_warps=tiles.num_warps,
            )
    local_max_2R = max_2RS.amax(-1)
    max_2R = _all_reduce(local_max_2R.clone(), dist.ReduceOp.MAX, tp_group)
    sharded = tp_group is not None and dist.get_world_size(tp_group) > 1
    if S == 1 and not sharded:
        sumexp_2R = sumexp_2RS[..., 0]
    else:  # rescale each split's sum to the global max: exp((max_split - max) / T); 0 for an all -inf split
        shift_2RS = max_2RS - max_2R[..., None]
        shift_2RS[0].div_(draft_temperature)
        shift_2RS[1].div_(target_temperature)
        factor_2RS = torch.where(max_2RS == -math.inf, 0.0, shift_2RS.exp_())
        sumexp_2R = _all_reduce((sumexp_2RS * factor_2RS).sum(-1), dist.ReduceOp.SUM, tp_group)
    saved = torch.empty((len(SAVED_ROWS), R), dtype=dtype, device=device)
    saved[:4].view(2, 2, R)[:, 0] = max_2R  # rows max_q, sumexp_q, max_p, sumexp_p
    saved[:4].view(2, 2, R)[:, 1] = sumexp_2R
    max_q, max_p = max_2R

    # Kernel B: per-split partial sums, then summed over splits and ranks.
    parts_6RS = torch.empty((_NUM_PARTS, R, S), dtype=dtype, device=device)
    if R > 0:
        with _on(device):
            _parts_kernel[(R, S)](
                draft2, target2, temps, saved, saved.stride(0), parts_6RS, R, V, draft2.stride(0),
                target2.stride(0), tiles.tiles_per_split, BLOCK_V=tiles.block, KIND=kind_id,
                WITH_STATS=with_stats, num_warps=tiles.num_warps,
            )
    parts_6R = parts_6RS[..., 0] if S == 1 else parts_6RS.sum(-1)
    parts: dict[str, torch.Tensor] = {}
    if kind == "tv" or with_stats:
        parts["tv"] = parts_6R[_TV]
    if kind == "tv":
        parts["aux"] = parts_6R[_S]
    if kind == "kl" or with_stats:
        parts["kl"] = parts_6R[_KL]
    if kind == "reverse_kl":
        parts["reverse_kl"] = parts["aux"] = parts_6R[_RKL]
    index = None
    if with_stats:
        parts["entropy_target"] = parts_6R[_HP]
        parts["entropy_draft"] = parts_6R[_HQ]
        # Vocabulary-parallel argmax of q: lowest global index among the splits and ranks holding the max.
        local_max_q = local_max_2R[0]
        local_arg = torch.where(max_2RS[0] == local_max_q[:, None], arg_RS, _NO_INDEX).amin(-1)
        start = V * (dist.get_rank(tp_group) if tp_group is not None else 0)
        index = torch.where(local_max_q == max_q, local_arg + start, _NO_INDEX)
        index = _all_reduce(index, dist.ReduceOp.MIN, tp_group)
        mine = (index >= start) & (index < start + V)
        logit = target2.gather(-1, (index - start).clamp_(0, max(V - 1, 0))[:, None]).squeeze(-1).to(dtype)
        shifted = logit - max_p
        if target_temperature != 1.0:
            shifted = shifted.div_(target_temperature)
        parts["alpha_to"] = torch.where(mine, shifted.exp_().div_(sumexp_2R[1]), 0.0)
    names = list(parts)
    sums = dict(zip(names, _all_reduce(torch.stack([parts[n] for n in names]), dist.ReduceOp.SUM, tp_group)))

    value = sums["tv" if kind == "tv" else kind]
    saved[4] = sums["aux"] if "aux" in sums else 0.0
    stats = None
    if with_stats:
        stats = torch.stack([
            1.0 - sums["tv"], sums["alpha_to"], sums["entropy_target"], sums["entropy_draft"], sums["kl"],
        ]).view(len(STAT_KEYS), *lead)
        index = index.view(lead)
    grad = None
    if with_grad:
        grad = ws.take("grad", draft_RV, dtype)
        scale = torch.full((R,), 1.0 / draft_temperature, dtype=dtype, device=device)
        _grad(draft2, target2, temps, saved, scale, kind_id, tiles, grad.view(R, V))
    return RowResult(value.view(lead), saved.view(len(SAVED_ROWS), *lead), stats, grad, argmax_R=index)


def grad_rows(draft_RV, target_RV, saved_CR, scale_R, *, kind, target_temperature, draft_temperature,
              ws: Workspace) -> torch.Tensor:
    """``scale_R`` x d value / d draft logits of one chunk (a workspace view), recomputed from
    the saved per-row scalars by kernel C alone, with no collective."""
    _check(draft_RV, target_RV, kind)
    dtype = compute_dtype(draft_RV.dtype, target_RV.dtype)
    device = draft_RV.device
    draft2, target2 = _rows(draft_RV), _rows(target_RV)
    R, V = draft2.shape
    saved = saved_CR.reshape(len(SAVED_ROWS), R).to(dtype)
    if saved.stride(-1) != 1 and R > 1:
        saved = saved.contiguous()
    scale = (scale_R / draft_temperature).reshape(R).to(dtype).contiguous()
    temps = _temperatures(draft_temperature, target_temperature, dtype, device)
    out = ws.take("grad", draft_RV, dtype)
    _grad(draft2, target2, temps, saved, scale, _KIND_IDS[kind], _Tiles(R, V, device), out.view(R, V))
    return out


__all__ = ["BLOCK_V", "SPLITS", "forward_rows", "grad_rows"]
