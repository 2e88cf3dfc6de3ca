"""What speculative decoding will measure, forecast from text alone: the decode-exact E[L].

Legend: K MTP steps, G gamma (drafts per verification, G <= K), B rows, S positions of a row.

Eq. 12 averaged over every position overstates real decoding: a verification starts only
after a rejection or a bonus token, and a rejected position's token is the resample from
(p - q)+, where the draft is weak, so the starts are harder than the average position
(DESIGN.md, "What decoding measures"). On text x sampled from the target p at temperature T
(on-policy responses at T; the output of any RS decoding at T is distributed as p), the
draft that proposed position j with step k was accepted, given the realized token x_j, with
probability

    RS: a_k = min(p(x_j), q_k(x_j)) / p(x_j)        TO (greedy drafts): a_k = 1[x_j = argmax q_k]

and, given the text, which step proposes each position is a Markov chain: so a forward
recursion over the positions gives the expected accepted drafts and verifications of the
text exactly, with no draft in the loop. Their pooled ratio is what decoding measures.

Positions are those of the training loss (:func:`bebop_megatron.chain.masks.chain_valid`):
the chain at t (the verification whose newest token is t+1, drafting from the hidden state
at t) has step k propose token t+k+1, valid while t+k is a trained token of t's document.
From the chain at t with mass m at step k:

- accepted (m a_k): step k+1 of the same chain when k < G and that step is valid (otherwise
  the text ends there and the mass leaves); for k = G the next token is the bonus t+G+2,
  whose chain is at t+G+1;
- rejected (m (1 - a_k)): token t+k+1 is the resample, whose chain is at t+k.

The first trained token of a run of trained labels (a response after its prompt) is the
prefill's sample, so its chain starts with mass 1. A chain whose step 1 is invalid (no room
for a draft: the text ends) starts no verification. ``may_start`` masks the chains at which
decoding would already have stopped (``tools/speculative_generate.py``: past
``--max-new-tokens`` or a stop token).
"""

from __future__ import annotations

import math

import numpy as np
import torch


def run_starts(loss_mask_BS: torch.Tensor, segment_ids_BS: torch.Tensor | None = None) -> torch.Tensor:
    """Bool ``[B, S]``: t is the first trained label of its run (label t trained, label t-1 not,
    or t-1 in another document): the chain at t drafts after the prefill's token t+1."""
    ok = loss_mask_BS > 0
    prev = torch.zeros_like(ok)
    prev[:, 1:] = ok[:, :-1]
    if segment_ids_BS is not None:
        prev[:, 1:] &= segment_ids_BS[:, 1:] == segment_ids_BS[:, :-1]
    return ok & ~prev


def decode_exact_rows(accept_GBS, chain_GBS, starts_BS, gamma: int, may_start_BS=None) -> tuple[np.ndarray, np.ndarray]:
    """Per chain position t (float64 ``[B, S]`` each): the expected accepted drafts of the
    verification drafting at t, and the probability that a verification drafts at t.

    ``accept_GBS``: ``[>=G, B, S]`` acceptance of step k at t given the realized token
    (``a_k`` of the module docstring); ``chain_GBS``: bool ``[>=G, B, S]``, step k valid at t
    and every earlier step too (:func:`bebop_megatron.losses.chain_mask`); ``starts_BS``:
    :func:`run_starts`; ``may_start_BS``: optional bool, False where decoding has stopped.
    Sums over positions give a text's expected accepted drafts and verifications; only the
    first ``gamma`` steps are used."""
    a = np.asarray(_numpy(accept_GBS)[:gamma], dtype=np.float64)
    chain = np.asarray(_numpy(chain_GBS)[:gamma], dtype=bool)
    if a.ndim != 3 or chain.shape != a.shape or a.shape[0] != gamma:
        raise ValueError(f"accept and chain must both be [>= gamma={gamma}, B, S], got {tuple(np.shape(accept_GBS))} "
                         f"and {tuple(np.shape(chain_GBS))}")
    a = np.where(chain, a, 0.0)
    G, B, S = a.shape
    start = np.zeros((B, S + G + 2))
    start[:, :S] = _numpy(starts_BS)
    may = np.ones((B, S), dtype=bool) if may_start_BS is None else np.asarray(_numpy(may_start_BS), dtype=bool)
    accepted = np.zeros((B, S))
    verifications = np.zeros((B, S))
    # Time-major copies: one contiguous [B] vector per (step, t).
    a_SGB = np.ascontiguousarray(a.transpose(2, 0, 1))
    chain_SGB = np.ascontiguousarray(chain.transpose(2, 0, 1))
    for t in range(S):
        mass = np.where(may[:, t] & chain_SGB[t, 0], start[:, t], 0.0)
        if not mass.any():
            continue
        verifications[:, t] = mass
        total = np.zeros(B)
        for k in range(G):
            acc = mass * a_SGB[t, k]
            total += acc
            start[:, t + k + 1] += mass - acc  # the resample is token t+k+2: its chain is at t+k+1
            if k + 1 < G:
                mass = np.where(chain_SGB[t, k + 1], acc, 0.0)
            else:
                start[:, t + G + 1] += acc  # the bonus token t+G+2: its chain is at t+G+1
        accepted[:, t] = total
    return accepted, verifications


def per_text_sums(values_BS: np.ndarray, segment_ids_BS, keep_BS=None) -> np.ndarray:
    """Sums of ``values_BS`` per text (row, document), in row order, documents in order of
    their id; ``keep_BS`` (bool) limits the texts to those with at least one kept position."""
    seg = np.asarray(_numpy(segment_ids_BS))
    keep = np.ones(seg.shape, dtype=bool) if keep_BS is None else np.asarray(_numpy(keep_BS), dtype=bool)
    out = []
    for b in range(seg.shape[0]):
        ids = np.unique(seg[b][keep[b] & (seg[b] >= 0)])
        for d in ids:
            out.append(values_BS[b][seg[b] == d].sum())
    return np.asarray(out, dtype=np.float64)


def ratio_interval(numerator, denominator, *, num_boot: int = 1000, seed: int = 0,
                   level: float = 0.95) -> tuple[float | None, list[float | None]]:
    """Pooled ratio sum(numerator) / sum(denominator) over texts and its bootstrap interval
    (texts resampled with replacement, percentile interval); None where undefined."""
    num = np.asarray(numerator, dtype=np.float64)
    den = np.asarray(denominator, dtype=np.float64)
    if num.shape != den.shape or num.ndim != 1:
        raise ValueError(f"numerator and denominator must be 1-D of one length, got {num.shape} and {den.shape}")
    total = den.sum()
    if not total > 0:
        return None, [None, None]
    ratio = float(num.sum() / total)
    if len(num) < 2:
        return ratio, [None, None]
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(num), size=(num_boot, len(num)))
    dens = den[picks].sum(1)
    ratios = num[picks].sum(1) / np.where(dens > 0, dens, np.nan)
    ratios = ratios[np.isfinite(ratios)]
    alpha = (1.0 - level) / 2
    lo, hi = np.quantile(ratios, [alpha, 1 - alpha]) if len(ratios) else (math.nan, math.nan)
    return ratio, [float(lo), float(hi)]


def _numpy(x):
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        return (x.double() if x.is_floating_point() else x).numpy()
    return np.asarray(x)


__all__ = ["decode_exact_rows", "per_text_sums", "ratio_interval", "run_starts"]
