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

Real decoding differs from the prediction because step k > 1 drafts from the drafted (and,
when it counts, accepted) tokens: under RS an accepted token is distributed as
min(p, q) / alpha, not as p, so step k sees the text the draft agrees with, while the
teacher-forced alpha_k averages over the target's text; and verifications start only
after a rejection or a bonus token, not at every position. For gamma = 1 the two agree in
expectation at the verification starts.
"""

from __future__ import annotations

import math

import torch

from bebop_megatron.losses import accept_length_rows
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
    rows = []
    for s in range(0, draft.shape[1], chunk):
        q, p = probs_of(draft[:, s: s + chunk], temperature), probs_of(target[:, s: s + chunk], temperature)
        if mode == "rs":
            rows.append(torch.minimum(p, q).sum(-1))
        else:
            rows.append(p.gather(-1, q.argmax(-1, keepdim=True))[..., 0])
    alpha = torch.cat(rows, dim=1)
    return alpha, list(range(first, first + alpha.shape[1]))


def predicted(generations, alphas, gamma: int) -> dict:
    """Eq. 12 from teacher-forced alphas on the generated texts (see the module docstring);
    ``alphas[i]`` is :func:`teacher_forced_alphas` of ``generations[i]``, computed right after it
    (so that the cached state is reused)."""
    all_len, start_len, kept = [], [], []
    for g, (alpha, positions) in zip(generations, alphas):
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
    }
