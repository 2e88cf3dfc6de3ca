"""Functional entry points of the MTP objectives: e2e TV, per-step TV, forward KL, reverse KL,
and the cold-start objectives nla, e2e_nla, lk, e2e_lk (:mod:`bebop_megatron.losses.cold_start`).

Legend: K MTP steps, N positions, V_local this TP rank's vocabulary shard (rank r holds the
global columns ``r*V_local : (r+1)*V_local``; the shards have equal size, as Megatron pads
the vocabulary).

All objectives share one normaliser (DESIGN.md section 1): position t's chain holds its
K_t leading valid steps (a chain stops at its first invalid step), its loss L_t is divided
by K (e2e_nla's L_t = -log(E[L]_t / K) holds its 1/K inside the log), and
``reduction="mean"`` averages L_t over the positions with K_t >= 1 (a tensor
count, 0 loss when there is none, no host sync); ``reduction="sum"`` returns sum_t L_t so
the caller can divide by the count of the whole global batch.

Math is exact over the full vocabulary, max-subtracted, in float32 for bf16/fp16/fp32
logits and float64 for float64 logits, in chunks of ``chunk_tokens`` rows of the K x N
(step, position) rows; see ``functions.py`` for what backward saves. Invalid positions are
computed and masked out (no data-dependent shapes), so their rows too need at least one
finite logit (a row of -inf alone would put nan into the gradient).
"""

from __future__ import annotations

import torch

from bebop_megatron.losses.cold_start import DEFAULT_LK_ETA, check_lk_eta
from bebop_megatron.losses.functions import DEFAULT_CHUNK_TOKENS, DivergenceOptions, VocabDivergence
from bebop_megatron.losses.kernel_torch import STAT_KEYS, TV_KL
from bebop_megatron.losses.objectives import DISTRIBUTION_NAMES, NAMES, objective
from bebop_megatron.losses.vocab import masked_padded_vocab

ACCEPT_LEN_KEYS = ("accept_len_rs", "accept_len_to")

IMPLS = ("torch", "triton")
REDUCTIONS = ("mean", "sum")


def chain_mask(valid_KN: torch.Tensor) -> torch.Tensor:
    """Bool ``[K, N]``: step k is valid at t and so are all earlier steps of t's chain."""
    return (valid_KN != 0).to(torch.int8).cumprod(dim=0).bool()


def accept_length_rows(alpha_KN: torch.Tensor) -> torch.Tensor:
    """``[K, N]``: row g-1 is E[L](g) = sum_{j<=g} prod_{i<=j} alpha_i of each position (Eq. 12)."""
    return alpha_KN.cumprod(dim=0).cumsum(dim=0)


def chain_lengths(valid_KN: torch.Tensor) -> torch.Tensor:
    """LongTensor ``[N]``: K_t, the number of leading valid steps of each position's chain."""
    return chain_mask(valid_KN).sum(dim=0)


def _check_common(impl: str, target_temperature: float, draft_temperature: float, chunk_tokens: int) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    for name, tau in (("target_temperature", target_temperature), ("draft_temperature", draft_temperature)):
        if not tau > 0:
            raise ValueError(f"{name} must be > 0, got {tau!r}")
    if not (isinstance(chunk_tokens, int) and chunk_tokens >= 1):
        raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")


def _options(kind, valid, shape_KN, *, tp_group, target_temperature, draft_temperature, reduction,
             chunk_tokens, return_stats, grad_in_forward=False, impl, vocab_size=None) -> DivergenceOptions:
    """Checks shared by every entry point; the kernel options of the objective ``kind``."""
    _check_common(impl, target_temperature, draft_temperature, chunk_tokens)
    if vocab_size is not None and not (isinstance(vocab_size, int) and vocab_size >= 1):
        raise ValueError(f"vocab_size must be a positive int or None, got {vocab_size!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if tuple(valid.shape) != tuple(shape_KN):
        raise ValueError(f"valid must be [K, N] = {tuple(shape_KN)}, got {tuple(valid.shape)}")
    return DivergenceOptions(
        kind=objective(kind).kernel, target_temperature=float(target_temperature),
        draft_temperature=float(draft_temperature), tp_group=tp_group, chunk_tokens=chunk_tokens,
        with_stats=return_stats, grad_in_forward=grad_in_forward, impl=impl, vocab_size=vocab_size,
    )


def _objective(kind, draft_logits, target_logits, valid, *, reduction, return_stats, lk_eta=DEFAULT_LK_ETA,
               **options):
    if draft_logits.dim() != 3 or draft_logits.shape != target_logits.shape:
        raise ValueError(
            f"draft_logits and target_logits must both be [K, N, V_local], got {tuple(draft_logits.shape)} "
            f"and {tuple(target_logits.shape)}"
        )
    opts = _options(kind, valid, draft_logits.shape[:2], reduction=reduction, return_stats=return_stats, **options)
    # Megatron's padded columns out (a copy only when this shard has some).
    draft_logits = masked_padded_vocab(draft_logits, opts.vocab_size, opts.tp_group)
    target_logits = masked_padded_vocab(target_logits.detach(), opts.vocab_size, opts.tp_group)
    value_KN, stats_CKN = VocabDivergence.apply(draft_logits, target_logits, opts)
    return _combine(kind, value_KN, stats_CKN, valid, reduction, return_stats, lk_eta=lk_eta)


def _combine(kind, value_KN, stats_CKN, valid, reduction, return_stats, stat_keys=STAT_KEYS, lk_eta=DEFAULT_LK_ETA):
    """Per-row divergences (``[2, K, N]`` for the LK hybrids) -> the objective's loss (and per-step stat sums)."""
    chain_KN = chain_mask(valid)
    loss = objective(kind).loss(value_KN, chain_KN, lk_eta).sum()
    if reduction == "mean":
        num_positions = chain_KN[0].sum().to(loss.dtype)  # positions with K_t >= 1
        loss = loss / num_positions.clamp(min=1.0)
    if not return_stats:
        return loss
    sums_CK = torch.where(chain_KN, stats_CKN, 0.0).sum(-1)
    stats = dict(zip(stat_keys, sums_CK.unbind(0)))
    for name, key in zip(ACCEPT_LEN_KEYS, ("alpha_rs", "alpha_to")):
        # E[L](g) = sum_{j<=g} prod_{i<=j} alpha_i, per position, summed where its chain reaches g.
        accept_len_KN = torch.cumsum(torch.cumprod(stats_CKN[stat_keys.index(key)], dim=0), dim=0)
        stats[name] = torch.where(chain_KN, accept_len_KN, 0.0).sum(-1)
    stats["count"] = chain_KN.sum(-1).to(sums_CK.dtype)
    return loss, stats


_COMMON_DOC = """
    Args:
        draft_logits: ``[K, N, V_local]`` draft (MTP) logits, step k in row k; any float dtype.
        target_logits: ``[K, N, V_local]`` backbone logits already aligned to the draft's
            position (step k's target is the backbone at t + k); treated as detached.
        valid: bool ``[K, N]``; a chain stops at its first invalid step (later steps of that
            position are ignored even where ``valid`` is set).
        tp_group: the tensor-parallel group the vocabulary is sharded over (None: not sharded).
        target_temperature, draft_temperature: logits are divided by them before the softmax.
        reduction: "mean" (over positions with K_t >= 1; 0 when none) or "sum" (sum_t L_t).
        chunk_tokens: rows (positions, step after step) per kernel call: at most four
            (TV without stats) to six ``chunk_tokens x V_local`` compute-dtype buffers are
            alive at once, in forward and in backward, besides the gradient itself.
        return_stats: also return ``stats``, a dict of ``[K]`` sums over each step's
            valid-chain positions: ``alpha_rs`` (sum_v min(p, q)), ``alpha_to`` (p at the
            argmax of q, ties to the lowest global index), ``entropy_target`` H(p),
            ``entropy_draft`` H(q), ``kl`` KL(p||q), ``accept_len_rs`` / ``accept_len_to``
            (entry g-1: the expected accepted length E[L](g) = sum_{j<=g} prod_{i<=j}
            alpha_i of each position whose chain reaches g, with alpha_RS / alpha_TO) and
            ``count`` (positions). Sums, so callers can reduce them across micro-batches
            and ranks.
        grad_in_forward: compute d loss / d draft_logits during the forward and store it
            (one more logits-sized buffer) instead of recomputing the softmaxes in backward.
        impl: "torch" (chunked plain torch, the CPU default) or "triton" (the Triton kernels of
            ``kernel_triton``, tiled over the vocabulary; CUDA tensors).
        vocab_size: the model's real vocabulary; global columns ``>= vocab_size`` (Megatron's
            padding) get logit -inf in both distributions, i.e. the objective is that of
            ``logits[..., :vocab_size]`` (None: every column is a token).

    Returns the scalar loss in the compute dtype (float32, or float64 for float64 logits),
    differentiable w.r.t. ``draft_logits`` only; ``(loss, stats)`` with ``return_stats``.
    With ``tp_group``, every rank returns the same loss and its own shard of the gradient,
    equal to the TP=1 result on the concatenated shards.
"""

_EQUIVALENT_PREFIX = """
        p = torch.softmax(target_logits.double() / target_temperature, -1)  # [K, N, V] full vocabulary
        q = torch.softmax(draft_logits.double() / draft_temperature, -1)
        chain = valid.long().cumprod(0).bool()                              # K_t leading valid steps
        num = chain[0].sum()                                                # positions with K_t >= 1"""

_EQUIVALENT_SUFFIX = """
        loss = per_pos.sum() / num.clamp(min=1)  # reduction="mean"; per_pos.sum() for "sum"
"""


OBJECTIVE_KINDS = DISTRIBUTION_NAMES  # the unfused entry points' kinds
FUSED_KINDS = NAMES  # fused_linear_objective's kinds: also the data tokens' cross-entropy


def fused_linear_objective(kind, draft_hidden, backbone_hidden, weight, valid, *, labels=None, tp_group=None,
                           target_temperature=1.0, draft_temperature=1.0, reduction="mean",
                           chunk_tokens=DEFAULT_CHUNK_TOKENS, return_stats=False, impl="torch", vocab_size=None,
                           lk_eta=DEFAULT_LK_ETA, label_rows=False):
    """An objective computed from hidden states through the output projection, chunked.

    Plain-torch equivalent (what it computes, without ever holding all logits)::

        draft_logits = draft_hidden @ weight.T                      # [K, S, B, V_local]
        z = backbone_hidden @ weight.T                              # [S, B, V_local], detached
        target_logits = stack([z[k:] padded to S for k in 1..K])    # step k's target is z[s + k]
        valid = valid & (s + k < S)                                 # past the end: invalid
        OBJECTIVES[kind](draft_logits.flatten(1, 2), target_logits.flatten(1, 2), valid.flatten(1),
                         vocab_size=vocab_size, ...)

    ``draft_hidden``: ``[K, S, B, H]``, the K MTP steps' hidden states (row k-1 is step k);
    ``backbone_hidden``: ``[S, B, H]``, the frozen backbone's final hidden states (one
    tensor serves all K steps, shifted by k); ``weight``: ``[V_local, H]``, this TP rank's
    vocabulary shard of the (frozen) output layer; ``valid``: bool ``[K, S, B]``.
    ``labels`` (optional, ``[K, S, B]`` global token ids, step k's data token at s): adds
    ``top1`` to the stats, the count of positions where argmax q is the data token (ties
    to the lowest index), a by-product of the same pass.

    ``lk_eta``: eta of ``lk`` / ``e2e_lk`` (ignored by the other kinds).

    Kind ``ce`` (fused only; needs ``labels``): L_t = (1/K) sum_{k <= K_t} -log softmax(draft
    logits)[x_k], the cross-entropy of the raw draft logits (no temperature) at the data tokens,
    as Megatron's MTP loss; the statistics are still against the backbone, and ``stats`` also
    holds ``ce_sum`` (``[K]``, the per-step sums of that cross-entropy over the chains).

    ``label_rows`` (with ``labels`` and ``return_stats``): the stats also hold ``label_rows``,
    ``[2, K, S * B]`` per row: min(1, q(x) / p(x)) and 1[x = argmax q] at the data token x
    (the acceptance of an RS / greedy draft given the realized token, for the decode-exact
    forecast of :mod:`bebop_megatron.chain.decode_exact`; one more all-reduce per chunk).

    Differentiable w.r.t. ``draft_hidden`` only; under TP the returned gradient is this
    rank's partial sum. The gradient is computed during the forward (see
    :mod:`bebop_megatron.losses.fused` for the chunking, the memory bound and the cost).
    """
    import dataclasses

    from bebop_megatron.losses.fused import ACCEPT_RS_LABEL, TOP1, FusedLinearDivergence

    if kind not in FUSED_KINDS:
        raise ValueError(f"kind must be one of {FUSED_KINDS}, got {kind!r}")
    if draft_hidden.dim() != 4 or backbone_hidden.dim() != 3 or draft_hidden.shape[1:] != backbone_hidden.shape:
        raise ValueError(
            f"draft_hidden must be [K, S, B, H] and backbone_hidden [S, B, H], got {tuple(draft_hidden.shape)} "
            f"and {tuple(backbone_hidden.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != draft_hidden.shape[-1]:
        raise ValueError(f"weight must be [V_local, H={draft_hidden.shape[-1]}], got {tuple(weight.shape)}")
    K, S, B, _ = draft_hidden.shape
    if labels is not None and tuple(labels.shape) != (K, S, B):
        raise ValueError(f"labels must be [K, S, B] = {(K, S, B)}, got {tuple(labels.shape)}")
    opts = _options(
        kind, valid, (K, S, B), tp_group=tp_group, target_temperature=target_temperature,
        draft_temperature=draft_temperature, reduction=reduction, chunk_tokens=chunk_tokens,
        return_stats=return_stats, impl=impl, vocab_size=vocab_size,
    )
    lk_eta = check_lk_eta(lk_eta)
    if objective(kind).data_tokens:
        if labels is None:
            raise ValueError(f"kind {kind!r} needs labels (the data tokens)")
        opts = dataclasses.replace(opts, label_ce=True)  # the kernel for the statistics only
    if label_rows:
        if labels is None or not return_stats:
            raise ValueError("label_rows needs labels and return_stats=True")
        opts = dataclasses.replace(opts, label_accept=True)
    inside = torch.arange(S, device=valid.device)[None, :] + torch.arange(1, K + 1, device=valid.device)[:, None] < S
    valid_KN = (valid.bool() & inside[..., None]).flatten(1)
    value_KSB, stats_CKSB = FusedLinearDivergence.apply(
        draft_hidden, backbone_hidden.detach(), weight.detach(), labels, opts
    )
    keys = STAT_KEYS + ((TOP1,) if labels is not None else ()) + ((ACCEPT_RS_LABEL,) if label_rows else ())
    stats_CKN = stats_CKSB.flatten(2)
    result = _combine(kind, value_KSB.flatten(-2), stats_CKN, valid_KN, reduction, return_stats, keys, lk_eta=lk_eta)
    if objective(kind).data_tokens and return_stats:
        result[1]["ce_sum"] = torch.where(chain_mask(valid_KN), value_KSB.detach().flatten(-2), 0.0).sum(-1)
    if label_rows:
        result[1]["label_rows"] = stats_CKN[[keys.index(ACCEPT_RS_LABEL), keys.index(TOP1)]]
    return result


def _doc(summary: str, body: str) -> str:
    lead = "\n\n    Plain-torch equivalent (full logits materialised; differentiated w.r.t. draft_logits)::\n"
    return summary + lead + _EQUIVALENT_PREFIX + body + _EQUIVALENT_SUFFIX + _COMMON_DOC


def _entry_point(kind: str, name: str):
    """The public function of objective ``kind`` (all but the LK hybrids share one signature)."""

    def loss(draft_logits, target_logits, valid, *, tp_group=None, target_temperature=1.0,
             draft_temperature=1.0, reduction="mean", chunk_tokens=DEFAULT_CHUNK_TOKENS, return_stats=False,
             grad_in_forward=False, impl="torch", vocab_size=None):
        return _objective(kind, draft_logits, target_logits, valid, tp_group=tp_group,
                          target_temperature=target_temperature, draft_temperature=draft_temperature,
                          reduction=reduction, chunk_tokens=chunk_tokens, return_stats=return_stats,
                          grad_in_forward=grad_in_forward, impl=impl, vocab_size=vocab_size)

    loss.__name__ = loss.__qualname__ = name
    loss.__doc__ = objective(kind).doc  # the registry's line; the documented ones get their own below
    return loss


def _lk_entry_point(kind: str, name: str):
    """The public function of an LK hybrid: the shared signature plus ``lk_eta``."""

    def loss(draft_logits, target_logits, valid, *, tp_group=None, target_temperature=1.0,
             draft_temperature=1.0, reduction="mean", chunk_tokens=DEFAULT_CHUNK_TOKENS, return_stats=False,
             grad_in_forward=False, impl="torch", vocab_size=None, lk_eta=DEFAULT_LK_ETA):
        return _objective(kind, draft_logits, target_logits, valid, tp_group=tp_group,
                          target_temperature=target_temperature, draft_temperature=draft_temperature,
                          reduction=reduction, chunk_tokens=chunk_tokens, return_stats=return_stats,
                          grad_in_forward=grad_in_forward, impl=impl, vocab_size=vocab_size,
                          lk_eta=check_lk_eta(lk_eta))

    loss.__name__ = loss.__qualname__ = name
    loss.__doc__ = objective(kind).doc
    return loss


ENTRY_POINTS = {name: (_lk_entry_point if objective(name).kernel == TV_KL else _entry_point)(name, f"{name}_loss")
                for name in DISTRIBUTION_NAMES}
"""Every distribution objective of the registry -> its function ``(draft_logits, target_logits, valid, ...)``."""
# The documented names of the paper's and the cold-start objectives.
e2e_tv_loss, tv_loss = ENTRY_POINTS["e2e_tv"], ENTRY_POINTS["tv"]
forward_kl_loss, reverse_kl_loss = ENTRY_POINTS["kl"], ENTRY_POINTS["reverse_kl"]
nla_loss, e2e_nla_loss = ENTRY_POINTS["nla"], ENTRY_POINTS["e2e_nla"]
lk_loss, e2e_lk_loss = ENTRY_POINTS["lk"], ENTRY_POINTS["e2e_lk"]


e2e_tv_loss.__doc__ = _doc(
    """End-to-end TV loss (Eq. 13): 1 - the chain's per-step acceptance products, averaged over steps.

    Per position, L_t = (1/K) sum_{j=1..K_t} (1 - prod_{i<=j} (1 - d_TV(p_i, q_i))); equals
    Eq. 13 when K_t = K. prod_{i<=j} alpha_i is the term of the expected accepted length
    (Eq. 12), so earlier steps weigh more. d_TV is Eq. 10; its gradient Eq. 11; the chain
    rule through the products uses prefix/suffix products (no division by 1 - d_TV).""",
    """
        d = 1 - torch.minimum(p, q).sum(-1)                                 # Eq. 10, [K, N]
        acc = torch.where(chain, 1 - d, 0).cumprod(0)                       # prod_{i<=j} alpha_i (Eq. 12)
        per_pos = torch.where(chain, 1 - acc, 0).sum(0) / K                 # Eq. 13 per position""",
)
tv_loss.__doc__ = _doc(
    """Per-step TV loss (Eq. 10), averaged over each chain's valid steps with the shared normaliser.

    Per position, L_t = (1/K) sum_{k=1..K_t} d_TV(p_k, q_k) with d_TV = 1 - sum_v min(p, q)
    (Eq. 10) and gradient dL/dz_j = -q_j (1[q_j <= p_j] - S) / tau_d, S = sum_v 1[q_v <= p_v] q_v
    (Eq. 11, ties count as "<="). The mean is over positions with K_t >= 1, not over steps.""",
    """
        d = 1 - torch.minimum(p, q).sum(-1)                                 # Eq. 10, [K, N]
        per_pos = torch.where(chain, d, 0).sum(0) / K""",
)
forward_kl_loss.__doc__ = _doc(
    """Forward KL(p || q) per step (gradient (q - p) / tau_d, as soft cross-entropy), same normaliser.

    Per position, L_t = (1/K) sum_{k=1..K_t} KL(p_k || q_k).""",
    """
        d = (p * (p.log() - q.log())).sum(-1)                               # KL(p||q), 0 log 0 = 0
        per_pos = torch.where(chain, d, 0).sum(0) / K""",
)
reverse_kl_loss.__doc__ = _doc(
    """Reverse KL(q || p) per step (gradient q_j [log(q_j / p_j) - KL(q||p)] / tau_d), same normaliser.

    Per position, L_t = (1/K) sum_{k=1..K_t} KL(q_k || p_k).""",
    """
        d = (q * (q.log() - p.log())).sum(-1)                               # KL(q||p), 0 log 0 = 0
        per_pos = torch.where(chain, d, 0).sum(0) / K""",
)

nla_loss.__doc__ = _doc(
    """Negative log acceptance per step (LK^alpha): -log alpha_k, alpha_k = 1 - d_TV = sum_v min(p, q).

    Per position, L_t = (1/K) sum_{k=1..K_t} -log(max(alpha_k, 1e-6)); gradient (1/alpha) x the
    TV gradient (Eq. 11), large exactly where TV's vanishes. Below the floor the row is flat
    (see :mod:`bebop_megatron.losses.cold_start`).""",
    """
        alpha = torch.minimum(p, q).sum(-1).clamp(min=1e-6)                 # [K, N]
        per_pos = torch.where(chain, -alpha.log(), 0).sum(0) / K""",
)
e2e_nla_loss.__doc__ = _doc(
    """Chain-level negative log acceptance: -log(E[L]_t / K), E[L]_t of Eq. 12 over t's chain.

    Per position, L_t = -log(max(E[L]_t / K, 1e-6)), E[L]_t = sum_{j<=K_t} prod_{i<=j} alpha_i.""",
    """
        alpha = torch.where(chain, torch.minimum(p, q).sum(-1), 0)         # [K, N]
        accept = torch.where(chain, alpha.cumprod(0), 0).sum(0)             # E[L]_t (Eq. 12)
        per_pos = torch.where(chain[0], -(accept / K).clamp(min=1e-6).log(), 0)""",
)
lk_loss.__doc__ = _doc(
    """Adaptive KL/TV blend per step (LK^lambda): lam KL(p||q) + (1 - lam) d_TV, lam = exp(-eta sg(alpha)).

    Per position, L_t = (1/K) sum_{k=1..K_t} [lam_k KL_k + (1 - lam_k) d_TV_k] with alpha_k =
    1 - d_TV_k detached per row: KL's dense gradient while the overlap is low, TV's as it
    grows. ``lk_eta`` = 0 gives ``forward_kl_loss``, a large one ``tv_loss``.""",
    """
        d = 1 - torch.minimum(p, q).sum(-1)                                 # Eq. 10, [K, N]
        kl = (p * (p.log() - q.log())).sum(-1)                              # KL(p||q), 0 log 0 = 0
        lam = torch.exp(-lk_eta * (1 - d).detach())
        per_pos = torch.where(chain, lam * kl + (1 - lam) * d, 0).sum(0) / K""",
)
e2e_lk_loss.__doc__ = _doc(
    """Chain-level adaptive blend: lam_t (the kl objective's L_t) + (1 - lam_t) (Eq. 13's L_t),
    lam_t = exp(-eta sg(E[L]_t / K)). ``lk_eta`` = 0 gives ``forward_kl_loss``, a large one
    ``e2e_tv_loss``.""",
    """
        d = 1 - torch.minimum(p, q).sum(-1)                                 # Eq. 10, [K, N]
        kl = (p * (p.log() - q.log())).sum(-1)                              # KL(p||q), 0 log 0 = 0
        acc = torch.where(chain, 1 - d, 0).cumprod(0)                       # prod_{i<=j} alpha_i (Eq. 12)
        lam = torch.exp(-lk_eta * torch.where(chain, acc, 0).sum(0).detach() / K)
        e2e = torch.where(chain, 1 - acc, 0).sum(0) / K                     # Eq. 13 per position
        per_pos = lam * torch.where(chain, kl, 0).sum(0) / K + (1 - lam) * e2e""",
)


def tv_distance(draft_logits, target_logits, *, tp_group=None, target_temperature=1.0, draft_temperature=1.0,
                chunk_tokens=DEFAULT_CHUNK_TOKENS, grad_in_forward=False, impl="torch"):
    """Per-row d_TV(softmax(target / tau_t), softmax(draft / tau_d)) (Eq. 10), ``[N]``.

    Plain-torch equivalent (differentiated w.r.t. draft_logits; gradient Eq. 11)::

        p = torch.softmax(target_logits.double() / target_temperature, -1)  # [N, V] full vocabulary
        q = torch.softmax(draft_logits.double() / draft_temperature, -1)
        d = 1 - torch.minimum(p, q).sum(-1)                                 # = 0.5 * (p - q).abs().sum(-1)

    ``draft_logits``, ``target_logits``: ``[N, V_local]``, the vocabulary sharded across
    ``tp_group`` when given (every rank gets the same ``[N]``). Computed in float32
    (float64 for float64 logits) in chunks of ``chunk_tokens`` rows; no ``valid`` mask.
    """
    _check_common(impl, target_temperature, draft_temperature, chunk_tokens)
    if draft_logits.dim() != 2 or draft_logits.shape != target_logits.shape:
        raise ValueError(
            f"draft_logits and target_logits must both be [N, V_local], got {tuple(draft_logits.shape)} "
            f"and {tuple(target_logits.shape)}"
        )
    opts = DivergenceOptions(
        kind="tv", target_temperature=float(target_temperature), draft_temperature=float(draft_temperature),
        tp_group=tp_group, chunk_tokens=chunk_tokens, grad_in_forward=grad_in_forward, impl=impl,
    )
    value_KN, _ = VocabDivergence.apply(draft_logits[None], target_logits.detach()[None], opts)
    return value_KN[0]
