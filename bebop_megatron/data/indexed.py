"""Megatron indexed datasets with the loss mask stored alongside (``tools/preprocess_data.py``).

Files of one dataset ``PREFIX`` (one sequence per document, same order in both datasets):

- ``PREFIX.bin`` / ``PREFIX.idx``: token ids, written with Megatron-Core's
  ``IndexedDatasetBuilder`` (dtype ``uint16`` when the vocabulary has < 65500 ids, else ``int32``).
- ``PREFIX_lossmask.bin`` / ``.idx``: ``uint8`` trained flags, one per token (as
  ``Documents.trained`` of :mod:`bebop_megatron.data.jsonl`).
- ``PREFIX_meta.json``: the tokenizer's ``vocab_size``/``eos_id``/``pad_id``, the
  ``train_on`` the mask was written with, counts and the input files.

Reading uses Megatron-Core's ``IndexedDataset`` (memory-mapped); the packing plan needs only
``IndexedDataset.sequence_lengths``, so opening a large corpus reads no tokens.
"""

from __future__ import annotations

import json
import os
import struct
import warnings

import numpy as np
import torch

from bebop_megatron.data.errors import DataError

MASK_SUFFIX = "_lossmask"
META_SUFFIX = "_meta.json"
FORMAT = "bebop_megatron.indexed/1"


def dataset_files(prefix: str) -> list[str]:
    """Every file of the dataset at ``prefix``."""
    return [prefix + ".bin", prefix + ".idx", prefix + MASK_SUFFIX + ".bin", prefix + MASK_SUFFIX + ".idx",
            prefix + META_SUFFIX]


class IndexedWriter:
    """Writes a dataset under a temporary prefix; :meth:`finalize` moves it into place.

    An interrupted or failed run (bad input) leaves no half-written dataset at ``prefix``:
    call :meth:`abort` to remove the temporary files.
    """

    def __init__(self, prefix: str, vocab_size: int):
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

        self.prefix, self.tmp = prefix, prefix + ".partial"
        self.tokens = IndexedDatasetBuilder(self.tmp + ".bin", dtype=DType.optimal_dtype(vocab_size))
        self.mask = IndexedDatasetBuilder(self.tmp + MASK_SUFFIX + ".bin", dtype=np.uint8)

    def add(self, tokens: np.ndarray, trained: np.ndarray) -> None:
        """One document: token ids [n] and trained flags [n]."""
        assert tokens.shape == trained.shape and tokens.ndim == 1
        self.tokens.add_item(torch.from_numpy(tokens.astype(np.int64)))
        self.tokens.end_document()
        self.mask.add_item(torch.from_numpy(trained.astype(np.uint8)))
        self.mask.end_document()

    def finalize(self, meta: dict) -> None:
        self.tokens.finalize(self.tmp + ".idx")
        self.mask.finalize(self.tmp + MASK_SUFFIX + ".idx")
        with open(self.tmp + META_SUFFIX, "w") as f:
            json.dump({"format": FORMAT, **meta}, f, indent=2)
        for tmp, final in zip(dataset_files(self.tmp), dataset_files(self.prefix)):
            os.replace(tmp, final)

    def abort(self) -> None:
        for builder in (self.tokens, self.mask):
            builder.data_file.close()
        for path in dataset_files(self.tmp):
            if os.path.exists(path):
                os.remove(path)


_IDX_HEADER = b"MMIDIDX\x00\x00"  # Megatron-Core's index format, version 1
_IDX_FIXED = 34  # header 9, version 8, dtype code 1, sequence count 8, document count 8 bytes


def _check_index(prefix: str, where: str) -> None:
    """The ``.idx`` is whole: Megatron's reader fails on a truncated one with numpy's 'buffer is
    smaller than requested size' (no file named) and a noisy ``__del__``."""
    path = prefix + ".idx"
    with open(path, "rb") as f:
        head = f.read(_IDX_FIXED)
    fixed = len(head) == _IDX_FIXED and head[:9] == _IDX_HEADER and struct.unpack("<Q", head[9:17])[0] == 1
    num_sequences, num_documents = struct.unpack("<QQ", head[18:34]) if fixed else (0, 0)
    needed = _IDX_FIXED + 12 * num_sequences + 8 * num_documents  # lengths int32, pointers and documents int64
    if not fixed or os.path.getsize(path) < needed:
        raise DataError(f"{where}: {path} is truncated or not a Megatron index; re-run tools/preprocess_data.py")


def _open(indexed_dataset, prefix: str, where: str):
    """Megatron's ``IndexedDataset`` at ``prefix``, its files checked first (a truncated ``.bin``
    would fail at the first read past its end, after the model build, naming no file)."""
    _check_index(prefix, where)
    with warnings.catch_warnings():
        # Its index reader logs "on rank 0" and warns when no process group exists (tools, tests).
        warnings.filterwarnings("ignore", message="Could not determine rank")
        dataset = indexed_dataset(prefix)
    index = dataset.index
    needed = int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * index.dtype_size if len(index) else 0
    size = os.path.getsize(prefix + ".bin")
    if size < needed:
        raise DataError(f"{where}: {prefix}.bin is truncated ({size} bytes; its .idx needs {needed}); re-run "
                        "tools/preprocess_data.py")
    return dataset


class IndexedSource:
    """Documents of an indexed dataset: ``lengths`` (int [N]) and ``get(j) -> (tokens, trained)``.

    ``meta`` is the sidecar's content. Raises :class:`DataError` when the mask or sidecar
    is missing or does not match the tokens.
    """

    def __init__(self, prefix: str, where: str = "data.train_files"):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.name = prefix
        for path in dataset_files(prefix):
            if not os.path.isfile(path):
                raise DataError(f"{where}: {path} is missing; indexed datasets are written by "
                                "tools/preprocess_data.py (tokens, loss mask and a _meta.json sidecar)")
        try:
            with open(prefix + META_SUFFIX) as f:
                self.meta = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise DataError(f"{where}: cannot read {prefix + META_SUFFIX}: {err}") from None
        if not isinstance(self.meta, dict) or self.meta.get("format") != FORMAT:
            raise DataError(f"{where}: {prefix + META_SUFFIX} is not a {FORMAT} sidecar; re-run tools/preprocess_data.py")
        self.tokens = _open(IndexedDataset, prefix, where)
        self.mask = _open(IndexedDataset, prefix + MASK_SUFFIX, where)
        if not np.array_equal(self.tokens.sequence_lengths, self.mask.sequence_lengths):
            raise DataError(f"{where}: {prefix}{MASK_SUFFIX} does not match {prefix} (document lengths differ)")

    @property
    def lengths(self) -> np.ndarray:
        return self.tokens.sequence_lengths

    def __len__(self) -> int:
        return len(self.tokens)

    def get(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        return self.tokens[int(j)], self.mask[int(j)]
