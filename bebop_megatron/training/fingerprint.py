"""Which backbone and training data a run used: paths and cheap fingerprints of their files.

A training checkpoint holds the MTP weights only; the frozen backbone stays where
``model.backbone_checkpoint`` (or ``model.init_checkpoint``) names it. :func:`backbone_record`
is stored in every training checkpoint's common state (``common["backbone"]``); a resume
(``training/resume.py``) and an export (``tools/convert_to_hf.py --backbone``) compare it with
the backbone they are given, so heads are never paired with another model of the same shapes.

Reading a multi-GB checkpoint in full is too slow for a start-up check, so
:func:`fingerprint` (sha256) covers:

- the tensor index of torch's ``.metadata``: every tensor's name, dtype and global shape, and
  where each stored chunk lies (file, offset, length);
- each shard file's size and three 64 KiB samples of it (start, middle, end);
- 4 KiB from the middle of each of up to 64 stored tensors, spread evenly over the index.

Other weights of the same shapes (another model, seed or fine-tune) differ in the sampled
bytes; a copied or moved directory keeps its fingerprint (the path, save id and timestamps in
``.metadata`` are left out). Cost: unpickling ``.metadata`` plus about 200 KiB per shard file
and 256 KiB of tensor samples: milliseconds, also for a 1 TB checkpoint.

The training data (``data.train_files``) is recorded alike (:func:`data_record`, saved as
``common["train_data"]``), so that a resume notices a file rewritten under the same name
(``tools/preprocess_data.py --overwrite``, a regenerated JSONL): :func:`file_fingerprint`
hashes every byte of the file, streamed in blocks of :data:`DATA_BLOCK` (a sampled hash let a
same-size edit between the samples through). Cost: one sequential read and sha256 of each data
file at every start: 0.75 s per GB from the page cache on a 2-core AMD EPYC (sha256-bound; a
cold read adds the disk's read time; docs/production.md).
"""

from __future__ import annotations

import hashlib
import os

FILE_SAMPLE = 64 << 10
TENSOR_SAMPLE = 4 << 10
MAX_TENSOR_SAMPLES = 64
DATA_BLOCK = 1 << 20
_SAMPLED_ABOVE, _SAMPLES = 1 << 20, 16  # the sampled data fingerprint of checkpoints saved before


def fingerprint(path: str) -> str:
    """``sha256:<hex>`` of the checkpoint at ``path`` (see the module docstring). Raises
    ``OSError`` / ``ValueError`` when ``path`` is no readable distributed checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = FileSystemReader(path).read_metadata()
    except OSError:
        raise
    except Exception as err:  # a truncated pickle: EOFError, UnpicklingError, ...
        raise ValueError(f"{path}/.metadata is unreadable ({type(err).__name__})") from None
    digest = hashlib.sha256()
    for name, meta in sorted(metadata.state_dict_metadata.items()):
        if isinstance(meta, TensorStorageMetadata):
            digest.update(f"{name} {meta.properties.dtype} {tuple(meta.size)}\n".encode())
        else:
            digest.update(f"{name} bytes\n".encode())
    items = sorted(((index.fqn, tuple(index.offset or ()), info.relative_path, info.offset, info.length)
                    for index, info in (metadata.storage_data or {}).items()), key=lambda item: item[:2])
    for item in items:
        digest.update(f"{item}\n".encode())
    for name in sorted({item[2] for item in items}):
        file = os.path.join(path, name)
        size = os.path.getsize(file)
        digest.update(f"{name} {size}\n".encode())
        with open(file, "rb") as f:
            for start in sorted({0, max(0, size // 2 - FILE_SAMPLE // 2), max(0, size - FILE_SAMPLE)}):
                f.seek(start)
                digest.update(f.read(FILE_SAMPLE))
    step = max(1, len(items) // MAX_TENSOR_SAMPLES)
    for _, _, name, offset, length in items[::step][:MAX_TENSOR_SAMPLES]:
        with open(os.path.join(path, name), "rb") as f:
            f.seek(offset + max(0, length // 2 - TENSOR_SAMPLE // 2))
            digest.update(f.read(min(length, TENSOR_SAMPLE)))
    return "sha256:" + digest.hexdigest()


def backbone_record(backbone_checkpoint: str | None, init_checkpoint: str | None, seed: int) -> dict:
    """What a run's backbone is: ``{"path", "realpath", "fingerprint"}`` for the checkpoint it
    loads (``model.backbone_checkpoint``, else ``model.init_checkpoint``), or ``{"path": None,
    "seed": seed}`` for a randomly initialised one. ``fingerprint`` is None when the checkpoint
    cannot be read (loading it then fails with its own message)."""
    path = backbone_checkpoint or init_checkpoint
    if not path:
        return {"path": None, "seed": seed}
    try:
        value = fingerprint(path)
    except (OSError, ValueError):
        value = None
    return {"path": path, "realpath": os.path.realpath(path), "fingerprint": value}


def file_fingerprint(path: str) -> str:
    """``sha256:<hex>`` of one data file's size and every byte of it; raises ``OSError``."""
    digest = hashlib.sha256(f"{os.path.getsize(path)}\n".encode())
    with open(path, "rb") as f:
        while block := f.read(DATA_BLOCK):
            digest.update(block)
    return "sha256:" + digest.hexdigest()


def sampled_file_fingerprint(path: str) -> str:
    """The data fingerprint that older checkpoints recorded (a file over 1 MiB hashed by its
    size and 16 blocks of 64 KiB; smaller ones whole, as :func:`file_fingerprint` does): a
    resume accepts it from them, as they can tell no more. Raises ``OSError``."""
    size = os.path.getsize(path)
    if size <= _SAMPLED_ABOVE:
        return file_fingerprint(path)
    digest = hashlib.sha256(f"{size}\n".encode())
    with open(path, "rb") as f:
        for i in range(_SAMPLES):
            f.seek((size - FILE_SAMPLE) * i // (_SAMPLES - 1))
            digest.update(f.read(FILE_SAMPLE))
    return "sha256:" + digest.hexdigest()


def data_record(train_files) -> dict:
    """``{file: fingerprint}`` for every file ``data.train_files`` reads: a JSONL file, or the
    five files of an indexed dataset; ``{}`` for the synthetic data. A file that cannot be read
    gets None (reading the data then fails with its own message)."""
    from bebop_megatron.config.sources import parse_sources
    from bebop_megatron.data.indexed import dataset_files

    record = {}
    for spec in parse_sources(train_files, "data.train_files"):
        for path in dataset_files(spec.path) if spec.kind == "indexed" else [spec.path]:
            try:
                record[path] = file_fingerprint(path)
            except OSError:
                record[path] = None
    return record


def short(value: str | None) -> str:
    """A fingerprint as printed in messages (16 hex digits)."""
    return "none" if value is None else value.removeprefix("sha256:")[:16]
