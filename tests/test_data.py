"""The synthetic Markov-chain dataset and the DP-aware batch iterator (data/synthetic.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from bebop_megatron.data import MarkovDataset, batch_iterator
from bebop_megatron.data.synthetic import make_batch

V, S, BRANCHING = 37, 23, 3


def _dataset(seed: int = 7, num_samples: int = 100, seq_length: int = S, vocab: int = V, branching: int = BRANCHING):
    return MarkovDataset(num_samples=num_samples, seq_length=seq_length, vocab_size=vocab,
                         branching=branching, seed=seed)


def test_sample_depends_only_on_seed_and_index():
    a, b = _dataset(seed=7), _dataset(seed=7)
    for i in (0, 1, 5, 99):
        x = a[i]
        assert x.shape == (S + 1,) and x.dtype == np.int64
        assert np.array_equal(x, b[i])  # a fresh object regenerates it
        assert np.array_equal(x, a[i])  # and it is not stateful
    # Access order does not matter.
    fwd = [a[i] for i in range(10)]
    rev = [b[i] for i in reversed(range(10))][::-1]
    assert all(np.array_equal(x, y) for x, y in zip(fwd, rev))
    # Samples differ from each other and across seeds.
    assert not np.array_equal(a[0], a[1])
    other = _dataset(seed=8)
    assert sum(np.array_equal(a[i], other[i]) for i in range(20)) == 0
    assert not np.array_equal(a.successors, other.successors)


def test_tokens_in_range_and_transitions_allowed():
    ds = _dataset()
    assert ds.successors.shape == (V, BRANCHING)
    for row in ds.successors:
        assert len(set(row.tolist())) == BRANCHING  # distinct successors
    allowed = {tok: set(ds.successors[tok].tolist()) for tok in range(V)}
    for i in range(50):
        seq = ds[i]
        assert seq.min() >= 0 and seq.max() < V
        for t in range(S):
            assert int(seq[t + 1]) in allowed[int(seq[t])], (i, t)


def test_transition_frequencies_match_the_chain():
    # Independent check of the sampler: empirical successor frequencies match the
    # probabilities implied by cum_probs (chi-square-like bound, fixed seed).
    vocab, branching, seq_len, n = 6, 3, 200, 150
    ds = _dataset(seed=3, num_samples=n, seq_length=seq_len, vocab=vocab, branching=branching)
    probs = np.diff(np.concatenate([np.zeros((vocab, 1)), ds.cum_probs], axis=1), axis=1)
    assert np.allclose(probs.sum(axis=1), 1.0)
    counts = np.zeros((vocab, vocab))
    for i in range(n):
        seq = ds[i]
        np.add.at(counts, (seq[:-1], seq[1:]), 1)
    checked = 0
    for tok in range(vocab):
        total = counts[tok].sum()
        if total < 500:
            continue
        checked += 1
        for j, succ in enumerate(ds.successors[tok]):
            p = probs[tok, j]
            emp = counts[tok, succ] / total
            assert abs(emp - p) < 5 * np.sqrt(p * (1 - p) / total) + 1e-3, (tok, succ, emp, p)
        # Nothing outside the successor list.
        others = np.setdiff1d(np.arange(vocab), ds.successors[tok])
        assert counts[tok, others].sum() == 0
    assert checked >= vocab // 2


def test_branching_one_is_deterministic_chain():
    ds = _dataset(branching=1)
    seq = ds[4]
    for t in range(S):
        assert seq[t + 1] == ds.successors[seq[t], 0]


@pytest.mark.parametrize("branching", [0, V + 1])
def test_bad_branching_is_rejected(branching):
    with pytest.raises(ValueError, match="data.markov_branching"):
        _dataset(branching=branching)


def test_make_batch_shifts_labels_by_one():
    ds = _dataset()
    ids = [3, 0, 41]
    batch = make_batch(ds, ids)
    assert batch.tokens.shape == batch.labels.shape == batch.loss_mask.shape == (3, S)
    assert batch.tokens.dtype == batch.labels.dtype == torch.int64
    for row, i in enumerate(ids):
        seq = torch.from_numpy(ds[i])
        assert torch.equal(batch.tokens[row], seq[:-1])
        assert torch.equal(batch.labels[row], seq[1:])
    assert torch.equal(batch.labels[:, :-1], batch.tokens[:, 1:])
    assert torch.equal(batch.loss_mask, torch.ones(3, S))
    assert torch.equal(batch.position_ids, torch.arange(S).expand(3, S))
    assert batch.sample_ids.tolist() == ids


def test_make_batch_wraps_past_the_end():
    ds = _dataset(num_samples=10)
    batch = make_batch(ds, [12])
    assert torch.equal(batch.tokens[0], torch.from_numpy(ds[2][:-1]))
    assert batch.sample_ids.tolist() == [12]


def _step_ids(dataset, *, steps, gbs, mbs, dp_rank, dp_size, start=0):
    """Per optimizer step: the sample ids of this DP rank, and a check of each micro-batch."""
    it = batch_iterator(dataset, start_sample=start, global_batch_size=gbs, micro_batch_size=mbs,
                        dp_rank=dp_rank, dp_size=dp_size)
    out = []
    for micro_batches in itertools.islice(it, steps):
        assert len(micro_batches) == gbs // dp_size // mbs
        ids = []
        for mb in micro_batches:
            assert mb.tokens.shape == (mbs, dataset.seq_length)
            # The micro-batch's content is exactly the samples it claims.
            for row, i in enumerate(mb.sample_ids.tolist()):
                assert torch.equal(mb.tokens[row], torch.from_numpy(dataset[i][:-1]))
            ids += mb.sample_ids.tolist()
        out.append(ids)
    return out


@pytest.mark.parametrize("gbs, mbs", [(8, 2), (12, 3), (4, 2)])
def test_dp_split_covers_the_same_samples(gbs, mbs):
    ds = _dataset(num_samples=1000, seq_length=5)
    steps = 4
    single = _step_ids(ds, steps=steps, gbs=gbs, mbs=mbs, dp_rank=0, dp_size=1)
    r0 = _step_ids(ds, steps=steps, gbs=gbs, mbs=mbs, dp_rank=0, dp_size=2)
    r1 = _step_ids(ds, steps=steps, gbs=gbs, mbs=mbs, dp_rank=1, dp_size=2)
    for g in range(steps):
        # Independent reference: global step g covers [g*G, (g+1)*G).
        assert single[g] == list(range(g * gbs, (g + 1) * gbs))
        assert not set(r0[g]) & set(r1[g])
        assert sorted(r0[g] + r1[g]) == single[g]
        assert len(r0[g]) == len(r1[g]) == gbs // 2
    # No sample is seen twice over the run.
    flat = [i for step in r0 + r1 for i in step]
    assert len(flat) == len(set(flat))


@pytest.mark.parametrize("dp_before, dp_after", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_resume_continues_with_next_unseen_sample(dp_before, dp_after):
    ds = _dataset(num_samples=1000, seq_length=5)
    gbs, mbs, done = 8, 2, 3
    seen = set()
    for r in range(dp_before):
        for step in _step_ids(ds, steps=done, gbs=gbs, mbs=mbs, dp_rank=r, dp_size=dp_before):
            seen |= set(step)
    assert seen == set(range(done * gbs))
    consumed = done * gbs
    resumed = [_step_ids(ds, steps=2, gbs=gbs, mbs=mbs, dp_rank=r, dp_size=dp_after, start=consumed)
               for r in range(dp_after)]
    # Reference: an uninterrupted single-rank run's steps `done` and `done+1`.
    uninterrupted = _step_ids(ds, steps=done + 2, gbs=gbs, mbs=mbs, dp_rank=0, dp_size=1)
    for g in range(2):
        step_ids = sorted(i for rank in resumed for i in rank[g])
        assert step_ids == uninterrupted[done + g]
        assert not set(step_ids) & seen
    assert min(i for rank in resumed for i in rank[0]) == consumed
