"""Micro-batches from any row dataset, split over data-parallel ranks in a resumable order.

A *row dataset* has ``seq_length``, ``__len__`` and ``row(i) -> dict`` of numpy arrays
``tokens``, ``labels``, ``position_ids``, ``segment_ids`` (int64 [S]) and ``loss_mask``
(float32 [S]) for any global row index ``i >= 0`` (rows past ``len()`` continue into the
next epoch or wrap around). :class:`~bebop_megatron.data.synthetic.MarkovDataset` and
:class:`~bebop_megatron.data.packing.PackedDataset` are row datasets.

Legend: B micro-batch, S sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol

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


class RowDataset(Protocol):
    seq_length: int

    def __len__(self) -> int: ...

    def row(self, i: int) -> dict[str, np.ndarray]: ...


_FIELDS = {"tokens": np.int64, "labels": np.int64, "loss_mask": np.float32, "position_ids": np.int64,
           "segment_ids": np.int64}


def make_batch(dataset: RowDataset, sample_ids: list[int]) -> Batch:
    """Stack rows ``sample_ids`` (global row indices, kept as ``Batch.sample_ids``)."""
    rows = [dataset.row(i) for i in sample_ids]
    fields = {k: torch.from_numpy(np.stack([r[k] for r in rows]).astype(dt, copy=False)) for k, dt in _FIELDS.items()}
    return Batch(sample_ids=torch.tensor(sample_ids, dtype=torch.int64), **fields)


def batch_iterator(
    dataset: RowDataset,
    *,
    start_sample: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
) -> Iterator[list[Batch]]:
    """Yield, per optimizer step, this DP rank's micro-batches of the global batch.

    Global batch ``g`` covers rows ``[start + g*G, start + (g+1)*G)``; DP rank ``r`` takes
    the contiguous slice ``r*G/dp .. (r+1)*G/dp`` of it, split into micro-batches. The
    global order does not depend on the DP size, so a run resumed from ``consumed_samples``
    with another DP size continues with the next unseen row (no repeats, no skips).
    """
    per_rank = global_batch_size // dp_size
    step_start = start_sample
    while True:
        first = step_start + dp_rank * per_rank
        ids = list(range(first, first + per_rank))
        yield [make_batch(dataset, ids[i : i + micro_batch_size]) for i in range(0, per_rank, micro_batch_size)]
        step_start += global_batch_size


def eval_batches(
    dataset: RowDataset,
    *,
    num_rows: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
) -> Iterator[list[Batch]]:
    """Rows ``0 .. num_rows-1`` once, in global batches split over DP ranks as in
    :func:`batch_iterator`. The last global batch is filled up with copies of row 0 whose
    ``loss_mask`` is zero, so every row counts exactly once and every rank runs the same
    number of micro-batches."""
    per_rank = global_batch_size // dp_size
    for step_start in range(0, num_rows, global_batch_size):
        first = step_start + dp_rank * per_rank
        ids = list(range(first, first + per_rank))
        micro = []
        for i in range(0, per_rank, micro_batch_size):
            chunk = ids[i : i + micro_batch_size]
            batch = make_batch(dataset, [j if j < num_rows else 0 for j in chunk])
            batch.loss_mask[torch.tensor([j >= num_rows for j in chunk])] = 0.0
            micro.append(batch)
        yield micro


def attention_mask(segment_ids_BS: torch.Tensor) -> torch.Tensor | None:
    """The attention of packed rows in O(S) memory: ``[B, S]`` bool, True where a document
    starts (position 0, every change of segment id, the padding after the last document).
    Attention is causal within each document (padding attends to padding). None when no row
    holds more than one document: then plain causal attention is the same.

    Both core attentions take it (``model/attention.py``): ``sdpa`` runs each document alone,
    ``unfused`` expands it to Megatron's ``[B, 1, S, S]`` mask (:func:`dense_attention_mask`).
    Segments are contiguous runs in every row the data pipeline builds."""
    if not bool((segment_ids_BS > 0).any()):
        return None
    starts_BS = torch.ones_like(segment_ids_BS, dtype=torch.bool)
    starts_BS[:, 1:] = segment_ids_BS[:, 1:] != segment_ids_BS[:, :-1]
    return starts_BS


def dense_attention_mask(starts_BS: torch.Tensor) -> torch.Tensor:
    """Megatron's boolean attention mask ``[B, 1, S, S]`` (True = masked) of
    :func:`attention_mask`'s document starts: causal and within the document (S^2 memory)."""
    S = starts_BS.shape[1]
    document_BS = starts_BS.long().cumsum(dim=1)
    causal_SS = torch.ones(S, S, dtype=torch.bool, device=starts_BS.device).tril_()
    same_BSS = document_BS[:, :, None] == document_BS[:, None, :]
    return ~(same_BSS & causal_SS)[:, None]


def document_starts(mask: torch.Tensor) -> list[list[int]]:
    """Per row, the positions where a document starts, from :func:`attention_mask`'s ``[B, S]``
    starts or from a ``[B, 1, S, S]`` mask (position i cannot attend to i - 1). Read once per
    mask (one host sync per micro-batch, shared by all layers)."""
    cached = getattr(mask, "_bebop_document_starts", None)
    if cached is None:
        if mask.dim() == 2:
            cut_BS = mask[:, 1:]  # [b, i] = a document starts at i + 1
        else:
            cut_BS = mask[:, 0].diagonal(offset=-1, dim1=-2, dim2=-1)  # [b, i] = mask[b, i + 1, i]
        cached = [[0] + [i + 1 for i in row.nonzero().flatten().tolist()] for row in cut_BS]
        mask._bebop_document_starts = cached
    return cached
