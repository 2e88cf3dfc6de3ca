"""Speculative decoding of one sequence, independent of the model: draft, verify, accept.

Legend: G gamma (drafted tokens per verification), V vocabulary.

A :class:`SpecModel` is anything with four methods on one sequence (the Megatron one is
:class:`bebop_megatron.speculative.megatron_model.MegatronSpecModel`; the tests use tables):

- ``prefill(prompt_ids) -> logits [V]``: run the target over the prompt (its cache now
  holds it) and return the logits of the first new token.
- ``draft(tokens, gamma, pick) -> (drafts [G], draft_logits [G, V])``: the MTP chain at the
  last position of ``tokens`` (the newest token is not yet in the target's cache); step
  k+1 is fed the token ``pick`` chose from step k's logits.
- ``verify(new_tokens) -> logits [len, V]``: append ``new_tokens`` to the target's cache
  in ONE forward; row i is the distribution of the token after ``new_tokens[i]``.
- ``keep(n)``: after a verification keep the first ``n`` of the tokens it appended.

One round (what vLLM / SGLang do with ``num_speculative_tokens = G``): the target proposes
nothing; the chain drafts G tokens; the target verifies ``[newest, d_1..d_G]`` in one
forward (rows 0..G-1 check the drafts, row G is the bonus distribution); acceptance is
rejection sampling (:func:`chain_rejection_sample`: drafts sampled from q, accepted with
min(1, p/q), resampled from norm(max(0, p - q)), a bonus token when all are accepted) or
target-only (:func:`chain_target_only`: greedy drafts accepted with p(draft)). Either way
every emitted token is distributed as the target's own sampling would give.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from bebop_megatron.chain.sampling import inverse_cdf, chain_rejection_sample, chain_target_only

MODES = ("rs", "to")


def probs_of(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in float64 (top-p off)."""
    return torch.softmax(logits.double() / temperature, dim=-1)


def sample_token(probs_V: torch.Tensor, generator: torch.Generator) -> int:
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=probs_V.device)
    return int(inverse_cdf(probs_V[None], u)[0])


@dataclass
class Round:
    """One verification: ``num_accepted`` of ``gamma`` drafts, and the per-step online
    acceptance probabilities (alpha_RS = sum min(p, q) or alpha_TO = p(argmax q)) of the
    drafts it actually verified, computed from the very p and q rows the round used."""

    start: int  # index of the newest token (not yet in the target's cache) when drafting began
    num_accepted: int
    online_alpha: list[float]


@dataclass
class Generation:
    prompt_len: int
    tokens: list[int]  # prompt + generated
    accepted: list[int] = field(default_factory=list)  # every accepted token, before the cut at max_new_tokens
    rounds: list[Round] = field(default_factory=list)
    target_forwards: int = 0  # verifications (the prefill is not counted)
    target_seconds: float = 0.0  # verifications only
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len:]


def _online_alpha(p_GV, q_GV, mode: str) -> list[float]:
    if mode == "rs":
        return torch.minimum(p_GV, q_GV).sum(-1).tolist()
    return p_GV.gather(-1, q_GV.argmax(-1, keepdim=True))[:, 0].tolist()


def speculative_generate(model, prompt_ids: list[int], *, gamma: int, temperature: float, max_new_tokens: int,
                         mode: str = "rs", generator: torch.Generator, stop_ids=()) -> Generation:
    """Generate up to ``max_new_tokens`` tokens (stopping after a token in ``stop_ids``) by
    speculative decoding with ``gamma`` drafts per target forward; see the module docstring.

    The first new token comes from the prefill (as in the engines). A round may emit tokens
    past ``max_new_tokens`` or a stop token; the output is cut there, the statistics keep
    every verification."""
    out = Generation(prompt_len=len(prompt_ids), tokens=list(prompt_ids))
    for _ in speculative_steps(model, out, gamma=gamma, temperature=temperature, max_new_tokens=max_new_tokens,
                               mode=mode, generator=generator, stop_ids=stop_ids):
        pass
    return out


def speculative_steps(model, out: Generation, *, gamma, temperature, max_new_tokens, mode, generator, stop_ids=()):
    """:func:`speculative_generate` as a generator filling ``out``: yields after the prefill and
    after every verification (so that :func:`lockstep` can interleave it with plain decoding)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    t0 = time.perf_counter()
    first = model.prefill(out.tokens[: out.prompt_len])
    out.prefill_seconds = time.perf_counter() - t0
    out.tokens.append(sample_token(probs_of(first, temperature), generator))
    yield

    def pick(logits_V):
        q = probs_of(logits_V, temperature)
        return sample_token(q, generator) if mode == "rs" else int(q.argmax())

    def done() -> bool:
        new = out.new_tokens
        return len(new) >= max_new_tokens or (bool(stop_ids) and any(t in stop_ids for t in new))

    while not done():
        start = len(out.tokens) - 1
        t0 = time.perf_counter()
        drafts, draft_logits = model.draft(out.tokens, gamma, pick)
        t1 = time.perf_counter()
        target_logits = model.verify([out.tokens[-1], *drafts])
        out.target_seconds += time.perf_counter() - t1
        out.draft_seconds += t1 - t0
        out.target_forwards += 1
        p, q = probs_of(target_logits, temperature), probs_of(draft_logits, temperature)
        if mode == "rs":
            num, nxt = chain_rejection_sample(p, q, torch.tensor(drafts), generator)
        else:
            num, nxt = chain_target_only(p, q, generator)
        model.keep(1 + num)
        out.rounds.append(Round(start, num, _online_alpha(p[:gamma], q, mode)[: num + 1]))
        out.tokens += [*drafts[:num], nxt]
        yield
    out.accepted = list(out.tokens)
    truncate_at_stop(out, max_new_tokens, stop_ids)


def autoregressive_generate(model, prompt_ids: list[int], *, temperature: float, max_new_tokens: int,
                            generator: torch.Generator, stop_ids=()) -> Generation:
    """Plain decoding with the same model and cache: one target forward per token (the baseline
    of the wall-time speed-up)."""
    out = Generation(prompt_len=len(prompt_ids), tokens=list(prompt_ids))
    for _ in autoregressive_steps(model, out, temperature=temperature, max_new_tokens=max_new_tokens,
                                  generator=generator, stop_ids=stop_ids):
        pass
    return out


def autoregressive_steps(model, out: Generation, *, temperature, max_new_tokens, generator, stop_ids=()):
    """:func:`autoregressive_generate` as a generator filling ``out``, one yield per forward."""
    t0 = time.perf_counter()
    logits = model.prefill(out.tokens[: out.prompt_len])
    out.prefill_seconds = time.perf_counter() - t0
    while True:
        out.tokens.append(sample_token(probs_of(logits, temperature), generator))
        yield
        new = out.new_tokens
        if len(new) >= max_new_tokens or new[-1] in stop_ids:
            break
        t0 = time.perf_counter()
        logits = model.verify([out.tokens[-1]])[0]
        out.target_seconds += time.perf_counter() - t0
        out.target_forwards += 1
    out.accepted = list(out.tokens)


def lockstep(*steps) -> None:
    """Advance several step generators in turn (one step each, round-robin) until all are done,
    so that a change of machine load during the run hits each of them alike."""
    live = list(steps)
    while live:
        for it in list(live):
            try:
                next(it)
            except StopIteration:
                live.remove(it)


def truncate_at_stop(out: Generation, max_new_tokens: int, stop_ids) -> None:
    new = out.new_tokens[:max_new_tokens]
    for i, t in enumerate(new):
        if t in stop_ids:
            new = new[: i + 1]
            break
    out.tokens = out.tokens[: out.prompt_len] + new
