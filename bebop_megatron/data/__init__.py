"""Training data: synthetic rows, JSONL / chat / indexed datasets, packing, masks, batches.

What the trainer uses (see :mod:`bebop_megatron.data.builder`):

- :func:`load_tokenizer` / :func:`check_vocab_size`: the run's tokenizer, checked against
  ``model.vocab_size``.
- :func:`build_train_dataset` / :func:`build_valid_dataset`: row datasets (synthetic or
  packed documents) with ``row(i)`` for any global row ``i``.
- :func:`check_trainable`: refuses data with no position an MTP step can train on.
- :func:`batch_iterator`: per optimizer step, this DP rank's micro-batches (:class:`Batch`)
  from ``start_sample = consumed_samples``; the order does not depend on the DP size.

User errors are :class:`DataError` (a ``ValueError``).
"""

from bebop_megatron.data.batches import Batch, attention_mask, batch_iterator, eval_batches, make_batch
from bebop_megatron.data.builder import build_train_dataset, build_valid_dataset, check_trainable, load_tokenizer
from bebop_megatron.data.errors import DataError, DataWarning
from bebop_megatron.data.packing import PackedDataset
from bebop_megatron.data.synthetic import MarkovDataset
from bebop_megatron.data.tokenizer import ByteTokenizer, HFTokenizer, check_vocab_size

__all__ = [
    "Batch", "ByteTokenizer", "DataError", "DataWarning", "HFTokenizer", "MarkovDataset", "PackedDataset",
    "attention_mask", "batch_iterator", "build_train_dataset", "check_trainable", "eval_batches", "build_valid_dataset", "check_vocab_size", "load_tokenizer",
    "make_batch",
]
