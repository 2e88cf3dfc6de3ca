"""A small synthetic dataset generated in code: sequences from a sparse Markov chain.

Each token has ``branching`` possible successors with fixed random probabilities, so the
next-token distribution has low, non-zero entropy and MTP heads can learn to draft it.
Sample ``i`` depends only on ``(seed, i)``: any rank, layout or resume point regenerates
exactly the same tokens.

Legend: B micro-batch, S sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, S] int64 inputs
    labels: torch.Tensor  # [B, S] int64, labels[:, t] = next token after tokens[:, t]
    loss_mask: torch.Tensor  # [B, S] float, 1 where labels[:, t] is trained on
    position_ids: torch.Tensor  # [B, S] int64
    sample_ids: torch.Tensor  # [B] int64, global sample index (for resume checks)
    segment_ids: torch.Tensor  # [B, S] int64, document of each position within its packed row
    # (0, 1, 2, ... in order; -1 on padding). Attention and MTP chains never cross documents.

    def to(self, device: torch.device) -> "Batch":
        return Batch(**{k: v.to(device, non_blocking=True) for k, v in vars(self).items()})


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


def make_batch(dataset: MarkovDataset, sample_ids: list[int]) -> Batch:
    seqs = torch.from_numpy(np.stack([dataset[i % len(dataset)] for i in sample_ids]))
    tokens, labels = seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()
    B, S = tokens.shape
    return Batch(
        tokens=tokens,
        labels=labels,
        loss_mask=torch.ones(B, S, dtype=torch.float32),
        position_ids=torch.arange(S).unsqueeze(0).expand(B, S).contiguous(),
        sample_ids=torch.tensor(sample_ids, dtype=torch.int64),
        segment_ids=torch.zeros(B, S, dtype=torch.int64),
    )


def batch_iterator(
    dataset: MarkovDataset,
    *,
    start_sample: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
) -> Iterator[list[Batch]]:
    """Yield, per optimizer step, this DP rank's micro-batches of the global batch.

    Global batch ``g`` covers samples ``[start + g*G, start + (g+1)*G)``; DP rank ``r`` takes
    the contiguous slice ``r*G/dp .. (r+1)*G/dp`` of it, split into micro-batches. The
    global order does not depend on the DP size, so a resumed run with another DP size
    continues with the next unseen sample.
    """
    per_rank = global_batch_size // dp_size
    step_start = start_sample
    while True:
        first = step_start + dp_rank * per_rank
        ids = list(range(first, first + per_rank))
        yield [make_batch(dataset, ids[i : i + micro_batch_size]) for i in range(0, per_rank, micro_batch_size)]
        step_start += global_batch_size
