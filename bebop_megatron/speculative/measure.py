"""Measured acceptance of real speculative decoding next to its teacher-forced prediction (Eq. 12).

- ``measured_accept_len``: mean number of accepted drafts per verification (the bonus or
  resampled token not counted), with a 95% CLT interval ``ci95`` over verifications.
- per draft position i: ``attempts`` (verifications that reached draft i), ``accepted``,
  ``rate`` = accepted / attempts, and ``online_alpha``: the mean of alpha_i (sum min(p, q)
  for RS, p(argmax q) for TO) of the very p and q rows those verifications used. Each
  verification reaching draft i accepts it with probability exactly alpha_i, so ``rate``
  and ``online_alpha`` differ only by sampling noise (a martingale: ``rate_ci95``).
- ``predicted_accept_len``: Eq. 12, E[L](G) = sum_j prod_{i<=j} alpha_i, from the same
  model's teacher-forced alphas on the generated text, averaged over every position t of
  the generated text where the whole chain fits (what ``tools/eval_acceptance.py``
  reports on held-out text); ``predicted_accept_len_at_starts`` averages it over the
  positions where verifications actually started.
- ``predicted_accept_len_decode``: the decode-exact forecast
  (:mod:`bebop_megatron.chain.decode_exact`): expected accepted drafts over expected
  verifications, from the teacher-forced acceptance given each realized token of the whole
  emitted text, with decoding's own stopping rule (``--max-new-tokens``, the stop tokens).
  It needs no knowledge of where the verifications started and is exact in expectation;
  ``predicted_decode_ci95`` is a bootstrap interval over the texts, and
  ``expected_verifications`` stands next to the counted ``num_verifications``.

Real decoding differs from Eq. 12 because step k > 1 drafts from the drafted (and,
when it counts, accepted) tokens: under RS an accepted token is distributed as
min(p, q) / alpha, not as p, so step k sees the text the draft agrees with, while the
teacher-forced alpha_k averages over the target's text; and verifications start only
after a rejection or a bonus token, not at every position. For gamma = 1 the two agree in
expectation at the verification starts.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from bebop_megatron.losses import accept_length_rows
from bebop_megatron.chain.decode_exact import decode_exact_rows, ratio_interval
from bebop_megatron.speculative.decoding import probs_of


def mean_ci(values: list[float]) -> tuple[float, list[float]]:
    """Mean and 95% CLT interval (mean +- 1.96 s / sqrt(n), clipped to the range of the values:
    accepted lengths cannot be negative)."""
    n = len(values)
    if n == 0:
        return float("nan"), [float("nan"), float("nan")]
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / max(n - 1, 1)
    half = 1.96 * math.sqrt(var / n)
    return mean, [max(mean - half, min(values)), min(mean + half, max(values))]


def measured(generations, gamma: int) -> dict:
    """Measured statistics over the rounds of ``generations`` (a list of :class:`Generation`)."""
    rounds = [r for g in generations for r in g.rounds]
    lengths = [float(r.num_accepted) for r in rounds]
    mean, ci = mean_ci(lengths)
    per_pos = []
    for i in range(gamma):
        reach = [r for r in rounds if r.num_accepted >= i]
        hits = [float(r.num_accepted > i) for r in reach]
        gap = [h - r.online_alpha[i] for h, r in zip(hits, reach)]
        _, gap_ci = mean_ci(gap)
        rate = sum(hits) / len(hits) if hits else float("nan")
        online = sum(r.online_alpha[i] for r in reach) / len(reach) if reach else float("nan")
        per_pos.append({"position": i + 1, "attempts": len(reach), "accepted": int(sum(hits)), "rate": rate,
                        "online_alpha": online, "rate_minus_online_ci95": gap_ci})
    new_tokens = sum(len(g.new_tokens) for g in generations)
    forwards = sum(g.target_forwards for g in generations)
    emitted = sum(r.num_accepted + 1 for r in rounds)
    return {
        "num_verifications": len(rounds),
        "measured_accept_len": mean,
        "ci95": ci,
        "measured_se": (sum((x - mean) ** 2 for x in lengths) / max(len(lengths) - 1, 1) / max(len(lengths), 1)) ** 0.5,
        "per_position": per_pos,
        "tokens_per_target_forward": emitted / forwards if forwards else float("nan"),
        "new_tokens": new_tokens,
        "target_forwards": forwards,
        "wall_seconds": {
            "target": sum(g.target_seconds for g in generations),
            "draft": sum(g.draft_seconds for g in generations),
            "prefill": sum(g.prefill_seconds for g in generations),
        },
    }


def teacher_forced_alphas(spec_model, generation, gamma: int, temperature: float, mode: str,
                          chunk: int = 64) -> tuple[torch.Tensor, list[int]]:
    """Per position t (from prompt_len - 1: the first draft) the teacher-forced alpha_k(t),
    ``[G, N]``, and the positions t."""
    first = generation.prompt_len - 1
    draft, target = spec_model.teacher_forced_logits(generation.tokens, gamma, first, state_tokens=generation.accepted)
    if draft is None:
        return torch.zeros(gamma, 0, dtype=torch.float64), []
    alpha = torch.cat([_alpha_rows(draft[:, s: s + chunk], target[:, s: s + chunk], temperature, mode)[0]
                       for s in range(0, draft.shape[1], chunk)], dim=1)
    return alpha, list(range(first, first + alpha.shape[1]))


def _alpha_rows(draft, target, temperature, mode, labels=None):
    """alpha_k (RS: sum min(p, q); TO: p(argmax q)) of ``[G, n, V]`` logits, and with ``labels``
    (``[G, n]``) the acceptance given the realized token (RS: min(p, q)(x) / p(x); TO:
    1[x = argmax q]), float64."""
    q, p = probs_of(draft, temperature), probs_of(target, temperature)
    given = None
    if mode == "rs":
        alpha = torch.minimum(p, q).sum(-1)
        if labels is not None:
            px, qx = p.gather(-1, labels[..., None])[..., 0], q.gather(-1, labels[..., None])[..., 0]
            given = torch.where(px > 0, torch.minimum(px, qx) / px.clamp(min=1e-300), (qx > 0).double())
    else:
        argmax = q.argmax(-1, keepdim=True)
        alpha = p.gather(-1, argmax)[..., 0]
        if labels is not None:
            given = (argmax[..., 0] == labels).double()
    return alpha, given


def teacher_forced_rows(spec_model, generation, gamma: int, temperature: float, mode: str, *,
                        max_new_tokens: int | None = None, stop_ids=(), chunk: int = 64) -> dict:
    """Teacher-forced values of one generation: Eq. 12's alphas on the output (as
    :func:`teacher_forced_alphas`) and the decode-exact expected accepted drafts and
    verifications on every token the decoding accepted (before the cut at ``max_new_tokens``),
    the chains stopping where decoding stopped (``max_new_tokens`` new tokens, a stop token)."""
    text = generation.accepted or generation.tokens
    L, P = len(text), generation.prompt_len
    first = P - 1
    out = {"alpha": torch.zeros(gamma, 0, dtype=torch.float64), "positions": [], "accepted": 0.0,
           "verifications": 0.0}
    draft, target = spec_model.teacher_forced_logits(text, gamma, first, state_tokens=generation.accepted,
                                                     partial=True)
    if draft is None:
        return out
    N = draft.shape[1]  # chain positions t = first .. L-2
    t = torch.arange(first, first + N)
    k = torch.arange(1, gamma + 1)[:, None]
    label_pos = t[None] + k + 1  # step k at t proposes token t+k+1
    chain = label_pos <= L - 1  # [G, N]; cumulative by construction
    labels = torch.tensor(text)[label_pos.clamp(max=L - 1)]
    alphas, given = [], []
    for s in range(0, N, chunk):
        a, g = _alpha_rows(draft[:, s: s + chunk], target[:, s: s + chunk], temperature, mode, labels[:, s: s + chunk])
        alphas.append(a)
        given.append(g)
    alpha, given = torch.cat(alphas, 1), torch.cat(given, 1)
    # Eq. 12 on the output (cut at max_new_tokens): the positions where the whole chain fits.
    n_eq = max(0, len(generation.tokens) - 1 - gamma - first + 1)
    out["alpha"], out["positions"] = alpha[:, :n_eq], list(range(first, first + n_eq))
    # Decoding continues from newest token c = t+1 while fewer than max_new_tokens are out and no stop token.
    new = np.asarray(text[P:], dtype=np.int64)
    stopped = np.cumsum(np.isin(new, list(stop_ids))) > 0 if stop_ids else np.zeros(len(new), dtype=bool)
    may = np.zeros(N, dtype=bool)
    for i in range(N):
        c = first + i + 1
        n_out = c - P + 1
        may[i] = (max_new_tokens is None or n_out < max_new_tokens) and not stopped[c - P]
    starts = np.zeros((1, N), dtype=bool)
    starts[0, 0] = True
    acc, ver = decode_exact_rows(given[:, None].numpy(), chain[:, None].numpy(), starts, gamma, may[None])
    out["accepted"], out["verifications"] = float(acc.sum()), float(ver.sum())
    return out


def predicted(generations, rows, gamma: int) -> dict:
    """Eq. 12 and the decode-exact forecast from teacher-forced values on the generated texts
    (see the module docstring); ``rows[i]`` is :func:`teacher_forced_rows` of ``generations[i]``,
    computed right after it (so that the cached state is reused)."""
    all_len, start_len, kept = [], [], []
    decode, decode_ci = ratio_interval([r["accepted"] for r in rows], [r["verifications"] for r in rows])
    for g, r in zip(generations, rows):
        alpha, positions = r["alpha"], r["positions"]
        if not positions:
            continue
        e_len = accept_length_rows(alpha)[gamma - 1]  # E[L](G) per position
        all_len += e_len.tolist()
        kept.append(alpha)
        at = {t: i for i, t in enumerate(positions)}
        # Round.start is the newest token's index c; its chain is drafted at t = c - 1.
        start_len += [float(e_len[at[r.start - 1]]) for r in g.rounds if (r.start - 1) in at]
    mean, ci = mean_ci(all_len)
    at_starts, ci_starts = mean_ci(start_len)
    alpha = torch.cat(kept, dim=1) if kept else torch.zeros(gamma, 0)
    return {
        "predicted_accept_len": mean,
        "predicted_ci95": ci,
        "predicted_positions": len(all_len),
        "predicted_accept_len_at_starts": at_starts,
        "predicted_at_starts_ci95": ci_starts,
        "teacher_forced_alpha": alpha.mean(1).tolist() if alpha.shape[1] else [],
        "predicted_accept_len_decode": decode,
        "predicted_decode_ci95": decode_ci,
        "expected_verifications": sum(r["verifications"] for r in rows),
    }
