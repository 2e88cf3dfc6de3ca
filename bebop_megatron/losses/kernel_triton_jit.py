"""The jitted Triton kernels of :mod:`kernel_triton` (launched, combined and documented there).

Three kernels, each program looping over BLOCK-wide tiles of one row's columns:

- A ``softmax_stats_kernel`` (grid ``R x S``): online max and sum-exp of q (draft logits /
  draft_temperature) and p (target logits / target_temperature) over the split, and (with
  stats) the first maximal draft logit's index. As in kernel_torch the max is that of the
  *unscaled* logits and the sum is of ``exp((logits - max) / temperature)``, so the saved
  rows of the two implementations are interchangeable.
- B ``parts_kernel`` (grid ``R x S``): with the row's global max and sum-exp, the partial
  sums over the split: d_TV = sum |p - q| / 2, S = sum q 1[q <= p] (ties count as "<="),
  KL(p||q), KL(q||p), H(p), H(q), as ``kind`` and ``with_stats`` need (0 log 0 = 0).
  Kind tv_kl: d_TV, S and KL(p||q) from the same p and q of each tile.
- C ``grad_kernel`` (grid ``R x tiles``): ``scale_R`` x d value / d draft logits per
  element (Eq. 11 for TV: S q_j - q_j 1[q_j <= p_j]; q - p for kl;
  q_j [log(q_j / p_j) - KL(q||p)] for reverse_kl; times scale = 1 / draft_temperature in
  the forward), into a compute-dtype workspace view. B and C compute p and q with the same
  jitted helper, so the mask ``q <= p`` of the gradient is the one S was summed over.
  Kind tv_kl, from one p and q per tile: ``TV_KL`` (the forward) writes the TV direction x
  scale row 0 and the KL direction x scale row 1 into two outputs; ``TV_KL_SUM`` (the
  backward) writes their sum into one.

Kind ids (``KIND``): tv 0, kl 1, reverse_kl 2, tv_kl 3 (``TV_KL``); 4 (``TV_KL_SUM``) is C's only.
"""

import triton
import triton.language as tl

# B's partial sums, one slot each (B writes all of them; unused ones are 0).
SLOT_TV, SLOT_S, SLOT_KL, SLOT_RKL, SLOT_HP, SLOT_HQ = range(6)
NUM_SLOTS = 6
TV_KL = 3  # kind id of tv_kl (B, and C with two outputs: the forward's TV and KL directions)
TV_KL_SUM = 4  # C only: scale_tv x TV direction + scale_kl x KL direction in one output (the backward)


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
def softmax_stats_kernel(draft_ptr, target_ptr, temps_ptr, max_ptr, sumexp_ptr, arg_ptr, R, V,
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
def parts_kernel(draft_ptr, target_ptr, temps_ptr, saved_ptr, stride_s, parts_ptr, R, V, stride_d, stride_t,
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
    need_tv: tl.constexpr = (KIND == 0) or (KIND == 3) or WITH_STATS
    need_s: tl.constexpr = (KIND == 0) or (KIND == 3)
    need_kl: tl.constexpr = (KIND == 1) or (KIND == 3) or WITH_STATS
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
        if need_s:
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
def grad_kernel(draft_ptr, target_ptr, temps_ptr, saved_ptr, stride_s, scale_ptr, stride_c, out_ptr, out_kl_ptr,
                V, stride_d, stride_t, stride_o, BLOCK_V: tl.constexpr, KIND: tl.constexpr):
    """Kernel C: ``scale_R`` x d value / d draft logits of one (row, tile). tv_kl: the KL
    direction's scale is ``stride_c`` past the TV one's (0: the same); ``out_kl_ptr`` (an
    output like ``out_ptr``) is written by ``TV_KL`` only."""
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
    dest = row * stride_o + cols
    if KIND == 0:
        g = (q * aux - tl.where(q <= p, q, 0.0)) * scale  # Eq. 11: S q_j - q_j 1[q_j <= p_j]
    elif KIND == 1:
        g = (q - p) * scale  # d KL(p||q) / dz
    elif KIND == 2:
        logq = sq - tl.log(sumexp_q)
        logp = sp - tl.log(sumexp_p)
        g = q * (logq - logp - aux)  # q_j [log(q_j / p_j) - KL(q||p)]
        g = tl.where((q > 0) & (g == g), g, 0.0) * scale  # 0 where q_j = 0 and, as kernel_torch, where nan
    else:  # tv_kl: both directions from this p and q
        g = (q * aux - tl.where(q <= p, q, 0.0)) * scale
        g_kl = (q - p) * tl.load(scale_ptr + stride_c + row)
        if KIND == 3:
            tl.store(out_kl_ptr + dest, g_kl.to(out_kl_ptr.dtype.element_ty), mask=mask)
        else:
            g = g + g_kl
    tl.store(out_ptr + dest, g.to(out_ptr.dtype.element_ty), mask=mask)
