"""Monte Carlo checks of the reference chain verifiers against DESIGN.md section 1.

20,000 chains with random p and q on V=7, gamma=3 (q independent of p, or a noisy copy
of it): the step-1 acceptance is within 4 standard errors of alpha (sum min(p, q) for RS,
p(argmax q) for target-only), the mean number of accepted drafts within 4 standard errors
of E[L] (Eq. 12), and the first emitted token passes a chi-square test against p at
significance 0.001. The batched variants return exactly the per-chain results for B = 1
and pass the same checks.
"""

from __future__ import annotations

import math

import pytest
import torch

from bebop_megatron.speculative import (
    batched_rejection_sample,
    batched_target_only,
    chain_rejection_sample,
    chain_target_only,
    sample_drafts,
)

V, GAMMA, TRIALS = 7, 3, 20_000


def random_pq(seed: int, close: bool = False):
    """Independent p and q, or (``close``) a q that is a noisy copy of p (high alpha_TO)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(1.5 * torch.randn(GAMMA + 1, V, generator=g, dtype=torch.float64), -1)
    noise = torch.randn(GAMMA, V, generator=g, dtype=torch.float64)
    q = torch.softmax(p[:GAMMA].log() + 0.7 * noise if close else 1.5 * noise, -1)
    return p, q


def alphas(method, p, q):
    if method == "rs":
        return torch.minimum(p[:GAMMA], q).sum(-1)
    return p[:GAMMA].gather(-1, q.argmax(-1, keepdim=True))[:, 0]


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = counts.sum() * probs
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = len(probs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def run_chains(method: str, p, q, batched: bool, seed: int):
    """(num_accepted [T], first emitted token [T]) over TRIALS chains."""
    g = torch.Generator().manual_seed(seed)
    if batched:
        P, Q = p.expand(TRIALS, -1, -1), q.expand(TRIALS, -1, -1)
        if method == "rs":
            drafts = sample_drafts(Q, g)
            num, nxt = batched_rejection_sample(P, Q, drafts, g)
        else:
            drafts = q.argmax(-1).expand(TRIALS, -1)
            num, nxt = batched_target_only(P, Q, g)
        first = torch.where(num >= 1, drafts[:, 0], nxt)
        return num, first
    nums, firsts = [], []
    for _ in range(TRIALS):
        if method == "rs":
            drafts = sample_drafts(q[None], g)[0]
            n, nxt = chain_rejection_sample(p, q, drafts, g)
        else:
            drafts = q.argmax(-1)
            n, nxt = chain_target_only(p, q, g)
        nums.append(n)
        firsts.append(int(drafts[0]) if n >= 1 else nxt)
    return torch.tensor(nums), torch.tensor(firsts)


@pytest.mark.parametrize("close", [False, True], ids=["independent", "close"])
@pytest.mark.parametrize("batched", [False, True], ids=["per_chain", "batched"])
@pytest.mark.parametrize("method", ["rs", "target_only"])
def test_monte_carlo_acceptance_and_output_distribution(method, batched, close):
    p, q = random_pq(seed=11, close=close)
    alpha = alphas(method, p, q)
    num, first = run_chains(method, p, q, batched, seed=5)

    accepted_1 = (num >= 1).double()
    se = math.sqrt(float(alpha[0] * (1 - alpha[0])) / TRIALS)
    assert abs(float(accepted_1.mean()) - float(alpha[0])) < 4 * se, (float(accepted_1.mean()), float(alpha[0]))

    expected_len = float(alpha.cumprod(0).sum())  # Eq. 12
    se_len = float(num.double().std()) / math.sqrt(TRIALS)
    assert abs(float(num.double().mean()) - expected_len) < 4 * se_len, (float(num.double().mean()), expected_len)

    counts = torch.bincount(first, minlength=V).double()
    assert chi_square_pvalue(counts, p[0]) > 1e-3


def test_chi_square_detects_the_draft_distribution():
    # The test above has power: the first *drafted* token (distributed as q) fails it.
    p, q = random_pq(seed=11)
    drafts = sample_drafts(q.expand(TRIALS, -1, -1), torch.Generator().manual_seed(1))
    assert chi_square_pvalue(torch.bincount(drafts[:, 0], minlength=V).double(), p[0]) < 1e-3


@pytest.mark.parametrize("seed", range(8))
def test_batched_equals_per_chain(seed):
    p, q = random_pq(seed)
    drafts = sample_drafts(q[None], torch.Generator().manual_seed(seed))
    for per_chain, batched, args in (
        (chain_rejection_sample, batched_rejection_sample, (drafts,)),
        (chain_target_only, batched_target_only, ()),
    ):
        for stream in range(6):
            want = per_chain(p, q, *(a[0] for a in args), torch.Generator().manual_seed(100 * seed + stream))
            num, nxt = batched(p[None], q[None], *args, torch.Generator().manual_seed(100 * seed + stream))
            assert (int(num[0]), int(nxt[0])) == want


def test_identical_draft_is_always_accepted():
    p, _ = random_pq(seed=3)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        drafts = sample_drafts(p[None, :GAMMA], g)[0]
        assert chain_rejection_sample(p, p[:GAMMA], drafts, g)[0] == GAMMA


def test_shape_errors():
    p, q = random_pq(seed=0)
    with pytest.raises(ValueError, match="G\\+1 rows"):
        chain_rejection_sample(p[:GAMMA], q, q.argmax(-1))
    with pytest.raises(ValueError, match="must be"):
        batched_target_only(p, q)
