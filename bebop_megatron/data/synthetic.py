"""A small synthetic dataset generated in code: sequences from a sparse Markov chain.

Each token has ``branching`` possible successors with fixed random probabilities, so the
next-token distribution has low, non-zero entropy and MTP heads can learn to draft it.
Sample ``i`` depends only on ``(seed, i)``: any rank, layout or resume point regenerates
exactly the same tokens.

Legend: S sequence length (a sample has S + 1 tokens: S inputs, S labels).
"""

from __future__ import annotations

import numpy as np

from bebop_megatron.data.batches import Batch, batch_iterator, make_batch  # noqa: F401 (re-exported)


class MarkovDataset:
    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, branching: int, seed: int):
        if branching < 1 or branching > vocab_size:
            raise ValueError(f"data.markov_branching={branching} must be in [1, model.vocab_size]")
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        rng = np.random.default_rng(seed)
        self.successors = np.stack(
            [rng.choice(vocab_size, size=branching, replace=False) for _ in range(vocab_size)]
        )
        probs = rng.dirichlet(np.full(branching, 0.5), size=vocab_size)
        self.cum_probs = np.cumsum(probs, axis=1)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        """``seq_length + 1`` tokens of sample ``index``."""
        rng = np.random.default_rng((self.seed, index))
        out = np.empty(self.seq_length + 1, dtype=np.int64)
        out[0] = rng.integers(self.vocab_size)
        u = rng.random(self.seq_length)
        for t in range(self.seq_length):
            row = self.cum_probs[out[t]]
            out[t + 1] = self.successors[out[t], min(int(np.searchsorted(row, u[t])), row.size - 1)]
        return out

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
