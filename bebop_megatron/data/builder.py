"""Build a run's tokenizer and datasets from its config: the entry points for the trainer.

    tokenizer = load_tokenizer(cfg)  # raises DataError if it does not fit model.vocab_size
    train = build_train_dataset(cfg, tokenizer=tokenizer, log=log)
    valid = build_valid_dataset(cfg, tokenizer=tokenizer, log=log)  # None without valid_files
    steps = batch_iterator(train, start_sample=consumed_samples, global_batch_size=...,
                           micro_batch_size=..., dp_rank=..., dp_size=...)

Every rank calls these with the same config and gets the same datasets (no communication):
JSONL, Parquet and rollout-dump files are read on each rank (use ``tools/preprocess_data.py`` for large corpora);
indexed datasets are memory-mapped and only their lengths are read up front. User errors
(bad lines, a missing mask file, a tokenizer that does not match an indexed dataset or the
model) are :class:`DataError` (a ``ValueError``: one line, exit status 2 from the CLI),
raised before training starts.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import numpy as np

from bebop_megatron.config.sources import SourceSpec, parse_sources
from bebop_megatron.data.errors import DataError, log_rank0
from bebop_megatron.data.indexed import IndexedSource
from bebop_megatron.data.jsonl import read_jsonl
from bebop_megatron.data.packing import PackedDataset
from bebop_megatron.data.synthetic import MarkovDataset
from bebop_megatron.data.tokenizer import Tokenizer, check_vocab_size, describe, signature, tokenizer_from_dir

Log = Callable[[str], None]


def load_tokenizer(cfg) -> Tokenizer:
    """The tokenizer of ``cfg.data.tokenizer`` (a local HF directory; None: the byte tokenizer).

    Raises :class:`DataError` when it cannot be loaded or has more ids than
    ``cfg.model.vocab_size``."""
    tokenizer = tokenizer_from_dir(cfg.data.tokenizer)
    check_vocab_size(tokenizer, cfg.model.vocab_size)
    return tokenizer


def build_train_dataset(
    cfg, *, tokenizer: Optional[Tokenizer] = None, log: Log = log_rank0, progress: bool = True
) -> Union[MarkovDataset, PackedDataset]:
    """The training row dataset (see :mod:`bebop_megatron.data.batches`).

    Without ``data.train_files``: the synthetic :class:`MarkovDataset` (``data.num_samples``
    rows, wrapping around). Otherwise a :class:`PackedDataset` over the files, shuffled by
    ``data.seed`` with a new permutation per epoch; rows are global over epochs, so
    ``row(consumed_samples)`` is always the next unseen row. ``loss_mask`` and
    ``segment_ids`` of each row carry the trained tokens and document boundaries.
    ``tokenizer`` defaults to :func:`load_tokenizer`'s (unused for synthetic data)."""
    if not cfg.data.train_files:
        return MarkovDataset(
            num_samples=cfg.data.num_samples,
            seq_length=cfg.train.seq_length,
            vocab_size=cfg.model.vocab_size,
            branching=cfg.data.markov_branching,
            seed=cfg.data.seed,
            min_branching=cfg.data.markov_min_branching,
        )
    specs = parse_sources(cfg.data.train_files, "data.train_files")
    return _build_packed(cfg, specs, tokenizer, shuffle=True, name="train data", log=log, progress=progress)


def build_valid_dataset(
    cfg, *, tokenizer: Optional[Tokenizer] = None, log: Log = log_rank0, progress: bool = True
) -> Optional[PackedDataset]:
    """The validation row dataset, or None without ``data.valid_files``.

    Not shuffled: rows ``0 .. len()-1`` hold every document once, in file order."""
    if not cfg.data.valid_files:
        return None
    specs = parse_sources(cfg.data.valid_files, "data.valid_files")
    return _build_packed(cfg, specs, tokenizer, shuffle=False, name="valid data", log=log, progress=progress)


def build_synthetic_held_out(cfg, num_samples: int) -> MarkovDataset:
    """``num_samples`` held-out samples of the run's synthetic language: the same chain, the
    samples that come after its ``data.num_samples`` training samples."""
    d = cfg.data
    return MarkovDataset(num_samples, cfg.train.seq_length, cfg.model.vocab_size, d.markov_branching, d.seed,
                         min_branching=d.markov_min_branching, index_offset=d.num_samples)


def check_trainable(dataset, field: str, purpose: str = "train") -> None:
    """Refuse data on which no MTP step is ever valid (the run would train on nothing, loss 0).

    Step 1 at row position t needs the label of t+1 trained and in t's document, i.e. a
    trained token at index >= 2 of a document, inside the row (index <= seq_length). Stops at
    the first such document; only data without one is read in full."""
    if not isinstance(dataset, PackedDataset):
        return  # synthetic rows: every position is trained (train.seq_length > mtp.num_steps)
    S, offsets = dataset.seq_length, dataset.offsets
    truncated = 0
    for global_id in np.unique(np.concatenate(dataset.streams)):
        s = int(np.searchsorted(offsets, global_id, side="right")) - 1
        _, mask = dataset.sources[s].get(int(global_id - offsets[s]))
        if np.any(mask[2 : S + 1]):
            return
        truncated += bool(np.any(mask[S + 1 :]))
    if truncated:
        why = (f"every trained (response) token lies past the first train.seq_length + 1 = {S + 1} tokens of its "
               f"document and is truncated away ({truncated} documents: prompts longer than the row); raise "
               "train.seq_length or shorten the prompts")
    else:
        why = ("no document has a trained token after its first two (data.train_on=response with empty or "
               "one-token responses?)")
    raise DataError(f"{field}: no position to {purpose} the MTP heads on: {why}")


def _build_packed(cfg, specs: list[SourceSpec], tokenizer, *, shuffle, name, log, progress) -> PackedDataset:
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg)
    else:
        check_vocab_size(tokenizer, cfg.model.vocab_size)
    sources = [_open_source(spec, tokenizer, cfg, log, progress) for spec in specs]
    weights = [s.weight for s in specs] if specs[0].weight is not None else None
    return PackedDataset(
        sources, cfg.train.seq_length, tokenizer.pad_id, weights=weights, seed=cfg.data.seed,
        overlong=cfg.data.overlong, shuffle=shuffle, pack=cfg.data.pack, log=log, name=name,
    )


def _open_source(spec: SourceSpec, tokenizer: Tokenizer, cfg, log: Log, progress: bool):
    if spec.kind == "jsonl":
        return read_jsonl(spec.path, tokenizer, train_on=cfg.data.train_on, on_error=cfg.data.on_error,
                          log=log, progress=progress, vocab_size=cfg.model.vocab_size,
                          data_format=cfg.data.format)
    source = IndexedSource(spec.path, spec.field)
    written = {k: source.meta.get(k) for k in ("vocab_size", "eos_id", "pad_id")}
    if written != signature(tokenizer):
        raise DataError(
            f"{spec.field}: {spec.path} was tokenized with {source.meta.get('tokenizer')!r} ({written}) but this "
            f"run uses {describe(tokenizer)} ({signature(tokenizer)}); set data.tokenizer to the tokenizer "
            "given to tools/preprocess_data.py"
        )
    if cfg.data.train_on == "response" and source.meta.get("train_on") != "response":
        raise DataError(
            f"{spec.field}: {spec.path} stores the mask of --train-on {source.meta.get('train_on')}, not the "
            "response mask data.train_on=response needs; re-run tools/preprocess_data.py with --train-on response"
        )
    log(f"{spec.path}: indexed dataset, {len(source)} documents, {int(np.sum(source.lengths))} tokens")
    return _AllTrained(source) if cfg.data.train_on == "all" else source


class _AllTrained:
    """A source whose every token is trained (``data.train_on=all`` over a response mask)."""

    def __init__(self, source):
        self.source, self.name = source, source.name

    @property
    def lengths(self) -> np.ndarray:
        return self.source.lengths

    def get(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        tokens, _ = self.source.get(j)
        return tokens, np.ones(len(tokens), dtype=np.uint8)
