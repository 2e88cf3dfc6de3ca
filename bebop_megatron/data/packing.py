"""Packing documents into rows of ``seq_length`` inputs, keeping document boundaries.

Legend: S = ``seq_length``. A row is a stream of S+1 token slots: inputs are slots 0..S-1
and labels slots 1..S (as the synthetic data's ``seq_length + 1`` tokens per sample).

The plan is computed from document lengths only, identically on every rank (no
communication, no token reads):

1. Documents with more than S+1 tokens are truncated to their first S+1 tokens or dropped
   (``overlong``); documents of one token (no label) are dropped. Both are counted in one
   summary warning.
2. Documents are drawn from *streams*: without weights, all sources form one stream (one
   corpus: several JSONL files and one indexed dataset made from them give the same rows);
   with weights, each source is a stream. A stream is an endless sequence of permutations
   of its documents seeded by ``(seed, stream, pass)``.
3. Epoch ``e`` takes ``count_s`` documents from stream ``s``: all of them without weights;
   with weights, the source's share of the total document count (largest remainder), so an
   up-weighted source repeats and a down-weighted one continues where the last epoch stopped.
   The streams are interleaved in an order shuffled by ``(seed, e)``.
4. Packing is greedy in that order: a document that does not fit in the row's remaining
   slots starts a new row (next fit), the rest of the row is padding. ``pack=False`` puts
   one document per row (then attention needs no per-document mask).

``shuffle=False`` (validation) keeps the file order: sources one after the other.

Row ``i`` is global over epochs (``len()`` is the row count of epoch 0); the per-epoch row
counts are computed in order as rows are asked for.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import numpy as np

from bebop_megatron.data.errors import DataError, log_rank0, warn_rank0

_SOURCE_TAG, _INTERLEAVE_TAG = 0, 1


class DocumentSource(Protocol):
    name: str

    @property
    def lengths(self) -> np.ndarray: ...

    def get(self, j: int) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass
class EpochPlan:
    sources: np.ndarray  # int64 [N]: source of the n-th document of the epoch
    documents: np.ndarray  # int64 [N]: its index within that source
    row_starts: np.ndarray  # int64 [R+1]: row r holds documents row_starts[r] .. row_starts[r+1]-1
    global_ids: np.ndarray  # int64 [N]: offsets[source] + document

    @property
    def num_rows(self) -> int:
        return len(self.row_starts) - 1



def epoch_counts(num_docs: Sequence[int], weights: Optional[Sequence[float]]) -> np.ndarray:
    """Documents per source per epoch: ``num_docs`` without weights, else the weighted shares
    of ``sum(num_docs)`` rounded by largest remainder (the total is kept exactly)."""
    num_docs = np.asarray(num_docs, dtype=np.int64)
    if weights is None:
        return num_docs
    share = np.asarray(weights, dtype=np.float64) / float(np.sum(weights)) * int(num_docs.sum())
    counts = np.floor(share).astype(np.int64)
    extra = int(num_docs.sum() - counts.sum())
    counts[np.argsort(-(share - counts), kind="stable")[:extra]] += 1
    return counts


def next_fit(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Row starts ``[R+1]`` of greedy in-order packing; every length must be <= ``capacity``."""
    starts, fill = [0], 0
    for k, n in enumerate(lengths.tolist()):
        if fill + n > capacity:
            starts.append(k)
            fill = 0
        fill += n
    starts.append(len(lengths))
    return np.asarray(starts, dtype=np.int64)


class PackedDataset:
    """Rows of packed documents from one or more sources (JSONL or indexed).

    ``row(i)`` returns numpy arrays, all [S]:

    - ``tokens`` int64: the inputs; ``pad_id`` on padding.
    - ``labels`` int64: ``labels[t] = tokens[t+1]`` of the same document (the row's extra
      slot S for the last position); ``pad_id`` where there is none (a document's last
      token, padding).
    - ``loss_mask`` float32: 1 where ``labels[t]`` is a trained token of t's document; 0 at
      each document's last input (its label would cross a boundary), on untrained labels
      (prompt tokens unless ``train_on=all``) and on padding.
    - ``position_ids`` int64: 0, 1, 2, ... restarting at each document; 0 on padding.
    - ``segment_ids`` int64: 0, 1, 2, ... per document within the row; -1 on padding.
    """

    def __init__(
        self,
        sources: Sequence[DocumentSource],
        seq_length: int,
        pad_id: int,
        *,
        weights: Optional[Sequence[float]] = None,
        seed: int = 0,
        overlong: str = "truncate",
        shuffle: bool = True,
        pack: bool = True,
        log: Callable[[str], None] = log_rank0,
        name: str = "data",
    ):
        assert overlong in ("truncate", "drop") and len(sources) > 0
        assert weights is None or len(weights) == len(sources)
        self.sources, self.seq_length, self.pad_id = list(sources), seq_length, pad_id
        self.seed, self.shuffle, self.pack, self.name = seed % 2**63, shuffle, pack, name
        capacity = seq_length + 1
        # Documents are numbered globally (source after source): global id = offsets[s] + j.
        all_lengths = [np.asarray(src.lengths, dtype=np.int64) for src in self.sources]
        self.offsets = np.cumsum([0] + [len(x) for x in all_lengths])
        lengths = np.concatenate(all_lengths)
        too_long, too_short = lengths > capacity, lengths < 2
        keep = ~too_short & (~too_long if overlong == "drop" else True)
        for s, src in enumerate(self.sources):
            if not keep[self.offsets[s] : self.offsets[s + 1]].any():
                raise DataError(f"{name}: {src.name} has no document of 2 to {capacity} tokens "
                                f"(train.seq_length={seq_length}, data.overlong={overlong})")
        self.lengths = np.minimum(lengths, capacity)  # tokens each document occupies in a row
        num_long, num_short = int(too_long.sum()), int(too_short.sum())
        self.num_truncated = num_long if overlong == "truncate" else 0
        self.num_dropped = (num_long if overlong == "drop" else 0) + num_short
        if num_long:
            action = f"truncated to {capacity}" if overlong == "truncate" else "dropped"
            warn_rank0(f"{name}: {num_long} of {len(lengths)} documents are longer than train.seq_length + 1 = "
                       f"{capacity} tokens (longest {int(lengths.max())}) and were {action} "
                       f"(data.overlong={overlong})")
        if num_short:
            warn_rank0(f"{name}: dropped {num_short} of {len(lengths)} documents of fewer than 2 tokens "
                       "(nothing to predict)")
        # Streams to draw from: one per source in a blend; without weights the sources are one
        # corpus (so several JSONL files and one indexed dataset made from them give the same rows).
        eligible = np.flatnonzero(keep)
        if weights is None:
            self.streams = [eligible]
        else:
            self.streams = [eligible[(eligible >= lo) & (eligible < hi)] for lo, hi in zip(self.offsets[:-1], self.offsets[1:])]
        self.counts = epoch_counts([len(x) for x in self.streams], weights)
        self._plans: OrderedDict[int, EpochPlan] = OrderedDict()
        self._epoch_starts = [0]  # global index of each planned epoch's first row
        first = self.plan(0)
        log(f"{name}: {len(eligible)} documents, {first.num_rows} rows of {seq_length} per epoch "
            f"({int(self.lengths[first.global_ids].sum())} tokens in {first.num_rows * seq_length} slots)")

    # ------------------------------------------------------------------ plan

    def _stream_docs(self, s: int, epoch: int) -> np.ndarray:
        """Global ids of stream ``s``'s documents in ``epoch``: a window of its permutation stream."""
        stream, count = self.streams[s], int(self.counts[s])
        n, lo = len(stream), epoch * count
        out = [np.zeros(0, dtype=np.int64)]
        for p in range(lo // n, (lo + count + n - 1) // n):
            order = np.random.default_rng([self.seed, _SOURCE_TAG, s, p]).permutation(n) if self.shuffle else np.arange(n)
            a, b = max(lo - p * n, 0), min(lo + count - p * n, n)
            out.append(stream[order[a:b]])
        return np.concatenate(out)

    def plan(self, epoch: int) -> EpochPlan:
        """Document order and row boundaries of ``epoch`` (cached; recent epochs only)."""
        if epoch in self._plans:
            self._plans.move_to_end(epoch)
            return self._plans[epoch]
        labels = np.repeat(np.arange(len(self.streams), dtype=np.int64), self.counts)
        if self.shuffle:
            labels = np.random.default_rng([self.seed, _INTERLEAVE_TAG, epoch]).permutation(labels)
        global_ids = np.empty(len(labels), dtype=np.int64)
        for s in range(len(self.streams)):
            global_ids[labels == s] = self._stream_docs(s, epoch)  # k-th slot of s gets its k-th document
        sources = np.searchsorted(self.offsets, global_ids, side="right") - 1
        if self.pack:
            row_starts = next_fit(self.lengths[global_ids], self.seq_length + 1)
        else:  # one document per row
            row_starts = np.arange(len(global_ids) + 1, dtype=np.int64)
        plan = EpochPlan(sources, global_ids - self.offsets[sources], row_starts, global_ids)
        self._plans[epoch] = plan
        if len(self._plans) > 2:
            self._plans.popitem(last=False)
        return plan

    def locate(self, i: int) -> tuple[int, int]:
        """Global row ``i`` -> ``(epoch, row within the epoch)``."""
        if i < 0:
            raise IndexError(f"row {i} < 0")
        while self._epoch_starts[-1] <= i:
            e = len(self._epoch_starts) - 1
            self._epoch_starts.append(self._epoch_starts[-1] + self.plan(e).num_rows)
        e = int(np.searchsorted(self._epoch_starts, i, side="right")) - 1
        return e, i - self._epoch_starts[e]

    # ------------------------------------------------------------------ rows

    def __len__(self) -> int:
        return self.plan(0).num_rows

    def row_documents(self, i: int) -> list[tuple[int, int]]:
        """``(source, document)`` pairs packed into global row ``i``, in order."""
        e, r = self.locate(i)
        plan = self.plan(e)
        lo, hi = plan.row_starts[r], plan.row_starts[r + 1]
        return list(zip(plan.sources[lo:hi].tolist(), plan.documents[lo:hi].tolist()))

    def row(self, i: int) -> dict[str, np.ndarray]:
        """The arrays of global row ``i`` (see the class docstring)."""
        S = self.seq_length
        stream = np.full(S + 1, self.pad_id, dtype=np.int64)
        trained = np.zeros(S + 1, dtype=bool)
        segment = np.full(S + 1, -1, dtype=np.int64)
        position = np.zeros(S + 1, dtype=np.int64)
        fill = 0
        for k, (s, d) in enumerate(self.row_documents(i)):
            tokens, mask = self.sources[s].get(d)
            n = min(len(tokens), S + 1)
            assert fill + n <= S + 1, "packing plan and document lengths disagree"
            stream[fill : fill + n] = tokens[:n]
            trained[fill : fill + n] = mask[:n] > 0
            segment[fill : fill + n] = k
            position[fill : fill + n] = np.arange(n)
            fill += n
        same_doc = (segment[1:] == segment[:-1]) & (segment[:-1] >= 0)
        labels = np.where(same_doc, stream[1:], self.pad_id)
        return {
            "tokens": stream[:S].copy(),
            "labels": labels,
            "loss_mask": (same_doc & trained[1:]).astype(np.float32),
            "position_ids": position[:S].copy(),
            "segment_ids": segment[:S].copy(),
        }
