"""A small synthetic dataset generated in code: sequences from a sparse Markov chain.

Each token has ``branching`` possible successors with fixed random probabilities, so the
next-token distribution has low, non-zero entropy and MTP heads can learn to draft it.
With ``min_branching`` the number of successors varies by state (log-uniform between
``min_branching`` and ``branching``), so the next-token entropy ranges from near 0 to about
ln(branching) nats across states, as on real text. :meth:`MarkovDataset.entropy_rate` is the
exact per-token entropy of the samples (what a perfect model's cross-entropy would be).
Sample ``i`` depends only on ``(seed, i)``: any rank, layout or resume point regenerates
exactly the same tokens.

Legend: S sequence length (a sample has S + 1 tokens: S inputs, S labels).
"""

from __future__ import annotations

import numpy as np

from bebop_megatron.data.batches import Batch, batch_iterator, make_batch  # noqa: F401 (re-exported)


class MarkovDataset:
    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, branching: int, seed: int,
                 min_branching: int | None = None, index_offset: int = 0):
        if branching < 1 or branching > vocab_size:
            raise ValueError(f"data.markov_branching={branching} must be in [1, model.vocab_size]")
        if min_branching is not None and not 1 <= min_branching <= branching:
            raise ValueError(f"data.markov_min_branching={min_branching} must be in [1, data.markov_branching]")
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.index_offset = index_offset  # held-out samples: indices past the training ones
        rng = np.random.default_rng(seed)
        if min_branching is None:  # every state has `branching` successors (the original stream)
            self.successors = np.stack(
                [rng.choice(vocab_size, size=branching, replace=False) for _ in range(vocab_size)]
            )
            probs = rng.dirichlet(np.full(branching, 0.5), size=vocab_size)
        else:
            log_counts = rng.uniform(np.log(min_branching), np.log(branching + 1), size=vocab_size)
            counts = np.minimum(np.exp(log_counts).astype(np.int64), branching)
            self.successors = np.zeros((vocab_size, branching), dtype=np.int64)
            probs = np.zeros((vocab_size, branching))
            for s, n in enumerate(counts):
                self.successors[s] = rng.choice(vocab_size, size=branching, replace=False)
                probs[s, :n] = rng.dirichlet(np.full(n, 0.5))
        self.probs = probs
        self.cum_probs = np.cumsum(probs, axis=1)
        if min_branching is not None:  # padded columns are never drawn: the last real one reaches 1
            for s, n in enumerate(counts):
                self.cum_probs[s, n - 1:] = 1.0

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        """``seq_length + 1`` tokens of sample ``index``."""
        rng = np.random.default_rng((self.seed, index + self.index_offset))
        out = np.empty(self.seq_length + 1, dtype=np.int64)
        out[0] = rng.integers(self.vocab_size)
        u = rng.random(self.seq_length)
        for t in range(self.seq_length):
            row = self.cum_probs[out[t]]
            out[t + 1] = self.successors[out[t], min(int(np.searchsorted(row, u[t])), row.size - 1)]
        return out

    def transition_matrix(self) -> np.ndarray:
        """``[V, V]`` float64: row s is the next-token distribution after token s."""
        P = np.zeros((self.vocab_size, self.vocab_size))
        np.add.at(P, (np.arange(self.vocab_size)[:, None], self.successors), self.probs)
        return P

    def entropy_rate(self) -> float:
        """Exact mean next-token entropy (nats) over the ``seq_length`` labels of a sample: the
        first token is uniform, then mu_{t+1} = mu_t P; mean over t of sum_s mu_t(s) H(P[s])."""
        P = self.transition_matrix()
        with np.errstate(divide="ignore", invalid="ignore"):
            H = -np.where(P > 0, P * np.log(P), 0.0).sum(1)
        mu = np.full(self.vocab_size, 1.0 / self.vocab_size)
        total = 0.0
        for _ in range(self.seq_length):
            total += float(mu @ H)
            mu = mu @ P
        return total / self.seq_length

    def row(self, index: int) -> dict[str, np.ndarray]:
        """Row ``index`` (wrapping past the end) in the format of :mod:`bebop_megatron.data.batches`:
        one document filling the row, every label trained."""
        seq = self[index % self.num_samples]
        S = self.seq_length
        return {
            "tokens": seq[:-1],
            "labels": seq[1:],
            "loss_mask": np.ones(S, dtype=np.float32),
            "position_ids": np.arange(S, dtype=np.int64),
            "segment_ids": np.zeros(S, dtype=np.int64),
        }
