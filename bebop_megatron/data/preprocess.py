"""Tokenize JSONL / Parquet / rollout-dump files once into an indexed dataset (the logic of ``tools/preprocess_data.py``).

The output is read back by ``data.train_files: [PREFIX]`` without re-tokenizing and gives
exactly the rows the JSONL files give with the same tokenizer, ``train_on`` and seed.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Callable, Optional, Sequence

import numpy as np

from bebop_megatron.data.errors import DataError, log_rank0
from bebop_megatron.data.indexed import META_SUFFIX, IndexedWriter, dataset_files
from bebop_megatron.data.jsonl import tokenize_jsonl
from bebop_megatron.data.tokenizer import describe, signature, tokenizer_from_dir


def preprocess(
    inputs: Sequence[str],
    output_prefix: str,
    *,
    tokenizer_dir: Optional[str] = None,
    train_on: str = "response",
    on_error: str = "fail",
    log: Callable[[str], None] = log_rank0,
    progress: bool = True,
    overwrite: bool = False,
    data_format: str = "auto",
) -> dict:
    """Write ``output_prefix`` (.bin/.idx, _lossmask.bin/.idx, _meta.json); returns the sidecar.

    Documents are stored in input order, one sequence each. Token-id records are checked
    against the tokenizer's ``vocab_size`` (the dataset records its signature): give the
    ``tokenizer_dir`` of the model the ids come from. Raises :class:`DataError` for
    bad input (``PATH:LINE: ...``) and leaves no partial output behind. A dataset already at
    ``output_prefix`` is replaced only with ``overwrite``."""
    for path in inputs:
        if not os.path.isfile(path):
            raise DataError(f"--input {path}: no such file")
    parent = check_output_prefix(output_prefix)
    outputs = {os.path.realpath(path): path for path in dataset_files(output_prefix)}
    for path in inputs:  # --overwrite would replace (truncate) the file being read
        if os.path.realpath(path) in outputs:
            raise DataError(f"--input {path} is one of the files --output-prefix {output_prefix} writes "
                            f"({outputs[os.path.realpath(path)]}); choose another prefix")
    existing = [path for path in dataset_files(output_prefix) if os.path.lexists(path)]
    if existing and not overwrite:  # silently, a run resuming on this prefix would go on with other data
        raise DataError(f"--output-prefix {output_prefix}: {existing[0]} already exists (a dataset written "
                        "earlier); pass --overwrite to replace it, or choose another prefix")
    tokenizer = tokenizer_from_dir(tokenizer_dir)
    writer: list[IndexedWriter] = []  # created at the first document: Megatron's import is slow

    def emit(tokens: np.ndarray, trained: np.ndarray) -> None:
        try:
            if not writer:
                os.makedirs(parent, exist_ok=True)
                writer.append(IndexedWriter(output_prefix, tokenizer.vocab_size))
            writer[0].add(tokens, trained)
        except OSError as err:  # e.g. no space left on device
            raise _write_error(output_prefix, err) from None

    start, files = time.perf_counter(), []
    try:
        for path in inputs:
            stats = tokenize_jsonl(path, tokenizer, emit, train_on=train_on, on_error=on_error, log=log,
                                   progress=progress, data_format=data_format)
            files.append({"path": path, "documents": stats.num_documents, "tokens": stats.num_tokens,
                          "trained_tokens": stats.num_trained, "skipped": stats.skipped})
        meta = {
            "tokenizer": tokenizer_dir or "byte",
            **signature(tokenizer),
            "train_on": train_on,
            "num_documents": sum(f["documents"] for f in files),
            "num_tokens": sum(f["tokens"] for f in files),
            "num_trained_tokens": sum(f["trained_tokens"] for f in files),
            "inputs": files,
        }
        try:
            writer[0].finalize(meta)
        except OSError as err:
            raise _write_error(output_prefix, err) from None
    except BaseException:
        if writer:
            writer[0].abort()
        raise
    seconds = time.perf_counter() - start
    log(f"wrote {output_prefix}.bin/.idx (+ _lossmask, {os.path.basename(output_prefix)}{META_SUFFIX}): "
        f"{meta['num_documents']} documents, {meta['num_tokens']} tokens with {describe(tokenizer)} in "
        f"{seconds:.2f} s ({meta['num_tokens'] / max(seconds, 1e-9):,.0f} tokens/s)")
    return meta


def check_output_prefix(prefix: str) -> str:
    """The directory the dataset files go to. Raises :class:`DataError` (one line naming
    ``--output-prefix``) when the prefix names a directory (``data/`` would write ``data/.bin``)
    or its directory cannot be created or written. Creates nothing."""
    if not prefix or prefix.endswith(("/", os.sep)):
        example = os.path.join(prefix or ".", "train")
        raise DataError(f"--output-prefix {prefix!r} ends in '/': it is the start of the file names, e.g. {example} "
                        f"writes {example}.bin/.idx, {example}_lossmask.bin/.idx and {example}{META_SUFFIX}")
    parent = os.path.dirname(os.path.abspath(prefix))
    existing = parent
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise DataError(f"--output-prefix {prefix}: cannot create the directory {parent}: {existing} is a file")
    try:
        with tempfile.TemporaryFile(dir=existing):  # the real test: permissions, read-only mounts, quotas
            pass
    except OSError as err:
        raise DataError(f"--output-prefix {prefix}: cannot write in {existing} ({err.strerror or err})") from None
    return parent


def _write_error(prefix: str, err: OSError) -> DataError:
    return DataError(f"--output-prefix {prefix}: cannot write {err.filename or prefix} ({err.strerror or err})")
