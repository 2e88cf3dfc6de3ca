"""Per-step acceptance statistics of MTP drafts against the backbone (DESIGN.md section 1).

Legend: K MTP steps, N positions, V_local this TP rank's vocabulary shard (rank r holds the
global columns ``r*V_local : (r+1)*V_local``), C stacked row quantities.

The softmax maths (max, sum-exp, min(p, q), entropies, KL, the vocabulary-parallel argmax
of q) is the loss kernel's (:func:`bebop_megatron.losses.kernel_torch.forward_rows`), run
without gradients; this module only masks by chain, sums and reduces. Plain-torch
equivalent of :func:`acceptance_stats` (full vocabulary, one process)::

    p = softmax(target_logits / tau_t, -1); q = softmax(draft_logits / tau_d, -1)   # [K, N, V]
    chain = valid.long().cumprod(0).bool()                   # step k counts where steps <= k are valid
    a_rs = minimum(p, q).sum(-1); a_to = p.gather(-1, q.argmax(-1, keepdim=True))[..., 0]
    mean_k(x) = where(chain, x, 0).sum(-1) / chain.sum(-1)   # per step, over the chains reaching it
    accept_len_rs = mean_k(a_rs.cumprod(0).cumsum(0))        # E[L](g), per position, then averaged (Eq. 12)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from bebop_megatron.losses import accept_length_rows, chain_mask
from bebop_megatron.losses.functions import DEFAULT_CHUNK_TOKENS, row_kernel
from bebop_megatron.losses.vocab import label_accept_rs, mask_padded_vocab_
from bebop_megatron.losses.kernel_torch import Workspace, compute_dtype

ROW_KEYS = ("alpha_rs", "alpha_to", "entropy_target", "entropy_draft", "kl")  # = losses.STAT_KEYS
STAT_KEYS = (*ROW_KEYS, "accept_len_rs", "accept_len_to")


def acceptance_rows(draft_logits, target_logits, *, tp_group=None, target_temperature=1.0, draft_temperature=1.0,
                    chunk_tokens=DEFAULT_CHUNK_TOKENS, impl="torch", vocab_size=None,
                    labels=None) -> dict[str, torch.Tensor]:
    """Per-row statistics ``[K, N]`` (``ROW_KEYS``) and ``argmax_draft`` (global index of argmax q,
    lowest on ties), computed without gradients in float32 (float64 for float64 logits).

    ``labels`` (global token ids, the logits' leading shape): also ``accept_rs_label``,
    min(1, q(x) / p(x)) at the realized token x, and ``accept_to_label``, 1[x = argmax q]: the
    probability that the draft there was accepted given x (the decode-exact forecast,
    :mod:`bebop_megatron.chain.decode_exact`).

    ``draft_logits``, ``target_logits``: ``[K, N, V_local]`` (any leading shape works), the
    vocabulary sharded over ``tp_group``; every rank returns the same values. ``vocab_size``:
    the model's real vocabulary; the statistics are those of ``logits[..., :vocab_size]``
    (Megatron's padded columns get logit -inf; None: every column is a token).
    """
    if draft_logits.shape != target_logits.shape or draft_logits.dim() < 2:
        raise ValueError(
            f"draft_logits and target_logits must have the same shape [..., V_local], got "
            f"{tuple(draft_logits.shape)} and {tuple(target_logits.shape)}"
        )
    for name, tau in (("target_temperature", target_temperature), ("draft_temperature", draft_temperature)):
        if not tau > 0:
            raise ValueError(f"{name} must be > 0, got {tau!r}")
    lead, V = draft_logits.shape[:-1], draft_logits.shape[-1]
    if labels is not None and tuple(labels.shape) != tuple(lead):
        raise ValueError(f"labels must have the logits' leading shape {tuple(lead)}, got {tuple(labels.shape)}")
    draft_RV, target_RV = draft_logits.reshape(-1, V), target_logits.reshape(-1, V)
    num_rows = draft_RV.shape[0]
    labels_R = None if labels is None else labels.reshape(-1).to(draft_RV.device)
    kernel = row_kernel(impl)
    dtype = compute_dtype(draft_logits.dtype, target_logits.dtype)
    stats_CR = draft_RV.new_empty((len(ROW_KEYS), num_rows), dtype=dtype)
    argmax_R = torch.empty(num_rows, dtype=torch.long, device=draft_RV.device)
    accept_R = None if labels is None else draft_RV.new_empty(num_rows, dtype=dtype)
    ws = Workspace()
    with torch.no_grad():
        for start in range(0, num_rows, chunk_tokens):
            rows = slice(start, min(start + chunk_tokens, num_rows))
            draft, target = draft_RV[rows], target_RV[rows]
            if vocab_size is not None:  # masked copies of this chunk; the caller's logits stay as they are
                draft = mask_padded_vocab_(draft.clone(), vocab_size, tp_group)
                target = mask_padded_vocab_(target.clone(), vocab_size, tp_group)
            out = kernel.forward_rows(
                draft, target, kind="tv", target_temperature=float(target_temperature),
                draft_temperature=float(draft_temperature), tp_group=tp_group, with_stats=True, with_grad=False,
                ws=ws,
            )
            stats_CR[:, rows] = out.stats_CR
            argmax_R[rows] = out.argmax_R
            if labels_R is not None:
                accept_R[rows] = label_accept_rs(draft, target, labels_R[rows], out.saved_CR,
                                                 target_temperature=float(target_temperature),
                                                 draft_temperature=float(draft_temperature), tp_group=tp_group)
    result = {name: row.view(lead) for name, row in zip(ROW_KEYS, stats_CR)}
    result["argmax_draft"] = argmax_R.view(lead)
    if labels_R is not None:
        result["accept_rs_label"] = accept_R.view(lead)
        result["accept_to_label"] = (argmax_R == labels_R).to(dtype).view(lead)
    return result


def accept_length_sums(alpha_KN: torch.Tensor, valid_KN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Expected accepted length per chain length g, summed over positions: ``(sums[K], counts[K])``.

    ``sums[g-1]`` = sum of E[L](g) (Eq. 12) over the positions whose chain reaches step g
    (``chain_mask(valid_KN)[g-1]``), ``counts[g-1]`` their number; ``sums / counts`` is
    E[L](g) averaged per position, never a product of averaged alphas. Sums, so callers
    can add micro-batches and reduce ranks before dividing. No host sync.
    """
    if alpha_KN.shape != valid_KN.shape or alpha_KN.dim() != 2:
        raise ValueError(f"alpha and valid must both be [K, N], got {tuple(alpha_KN.shape)} and {tuple(valid_KN.shape)}")
    chain_KN = chain_mask(valid_KN)
    # Zero past the chain's end so that a nan/garbage alpha of an invalid step cannot leak in.
    alpha_KN = torch.where(chain_KN, alpha_KN, 0.0)
    sums = torch.where(chain_KN, accept_length_rows(alpha_KN), 0.0).sum(-1)
    return sums, chain_KN.sum(-1).to(sums.dtype)


def acceptance_sums(rows: dict[str, torch.Tensor], valid_KN: torch.Tensor, labels_KN=None) -> dict[str, torch.Tensor]:
    """Chain-masked ``[K]`` sums of :func:`acceptance_rows` output, plus ``count`` (and ``top1``)."""
    chain_KN = chain_mask(valid_KN)
    sums = {name: torch.where(chain_KN, rows[name], 0.0).sum(-1) for name in ROW_KEYS}
    for name, key in (("accept_len_rs", "alpha_rs"), ("accept_len_to", "alpha_to")):
        sums[name], _ = accept_length_sums(rows[key], chain_KN)
    if labels_KN is not None:
        hits = (rows["argmax_draft"] == labels_KN.to(rows["argmax_draft"].device)) & chain_KN
        sums["top1"] = hits.sum(-1).to(sums["alpha_rs"].dtype)
    sums["count"] = chain_KN.sum(-1).to(sums["alpha_rs"].dtype)
    return sums


def reduce_sums(sums: dict[str, torch.Tensor], group) -> dict[str, torch.Tensor]:
    """All-reduce (SUM) every ``[K]`` entry over ``group`` in one collective."""
    if group is None or dist.get_world_size(group) == 1:
        return sums
    names = list(sums)
    stacked = torch.stack([sums[n] for n in names])
    dist.all_reduce(stacked, group=group)
    return dict(zip(names, stacked.unbind(0)))


def means_of(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-step means (sum / count, 0 where no chain reaches the step); ``count`` is kept."""
    count = sums["count"]
    out = {name: value / count.clamp(min=1) for name, value in sums.items() if name != "count"}
    out["count"] = count
    return out


def acceptance_stats(draft_logits, target_logits, valid, *, tp_group=None, dp_group=None, labels=None,
                     target_temperature=1.0, draft_temperature=1.0, chunk_tokens=DEFAULT_CHUNK_TOKENS,
                     impl="torch", vocab_size=None) -> dict[str, torch.Tensor]:
    """Per-MTP-step acceptance statistics, each a ``[K]`` tensor averaged over the positions
    whose chain reaches that step (see the module docstring for the plain-torch equivalent).

    Args:
        draft_logits, target_logits: ``[K, N, V_local]``; row k-1 holds step k's draft logits
            and its target (the backbone logits at t+k), the vocabulary sharded over ``tp_group``.
        valid: bool ``[K, N]``; a chain stops at its first invalid step.
        tp_group: the tensor-parallel group the vocabulary is sharded over.
        dp_group: sums and counts are all-reduced over it (data-parallel ranks holding other
            positions; do not include ranks holding other vocabulary shards of the same rows).
        labels: optional ``[K, N]`` global token ids (step k's data token); adds ``top1``.
        vocab_size: the model's real vocabulary (columns from it on are Megatron's padding,
            excluded); None: every column is a token.

    Returns ``alpha_rs`` (sum_v min(p, q)), ``alpha_to`` (p(argmax q), ties to the lowest
    index), ``entropy_target`` H(p), ``entropy_draft`` H(q), ``kl`` KL(p||q),
    ``accept_len_rs`` / ``accept_len_to`` (entry g-1: E[L](g) = sum_{j<=g} prod_{i<=j}
    alpha_i per position, averaged over positions whose chain reaches g), ``top1`` with
    ``labels``, and ``count`` (positions per step). Same values on every rank.
    """
    if draft_logits.dim() != 3 or draft_logits.shape != target_logits.shape:
        raise ValueError(
            f"draft_logits and target_logits must both be [K, N, V_local], got {tuple(draft_logits.shape)} "
            f"and {tuple(target_logits.shape)}"
        )
    if tuple(valid.shape) != tuple(draft_logits.shape[:2]):
        raise ValueError(f"valid must be [K, N] = {tuple(draft_logits.shape[:2])}, got {tuple(valid.shape)}")
    if labels is not None and tuple(labels.shape) != tuple(valid.shape):
        raise ValueError(f"labels must be [K, N] = {tuple(valid.shape)}, got {tuple(labels.shape)}")
    rows = acceptance_rows(draft_logits, target_logits, tp_group=tp_group, target_temperature=target_temperature,
                           draft_temperature=draft_temperature, chunk_tokens=chunk_tokens, impl=impl,
                           vocab_size=vocab_size)
    sums = acceptance_sums(rows, valid.to(draft_logits.device), labels)
    return means_of(reduce_sums(sums, dp_group))
