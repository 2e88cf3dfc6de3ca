"""The ``data`` section's checks: value choices, the tokenizer directory and the source lists.

``data.train_files`` / ``data.valid_files`` entries are a path or ``{path, weight}``. A path
is a JSONL, Parquet or slime (``.pt``) file read record by record (kind ``jsonl``), or a Megatron indexed dataset given as ``PREFIX``, ``PREFIX.bin`` or
``PREFIX.idx`` (``PREFIX.bin`` and ``PREFIX.idx`` must both exist); a single entry may be given
without the list (:func:`single_source_as_list`). :func:`parse_sources`
turns the entries into :class:`SourceSpec` records; the data package reads them from there,
so the config check and the loader agree on what each entry is.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Optional

from bebop_megatron.config.errors import ConfigError
from bebop_megatron.config.layouts import FORMATS

TRAIN_ON = ("response", "all")
ON_ERROR = ("fail", "skip")
OVERLONG = ("truncate", "drop")


@dataclass(frozen=True)
class SourceSpec:
    path: str
    """The JSONL file, or the indexed dataset's prefix (without ``.bin``/``.idx``)."""
    kind: str
    """``jsonl`` or ``indexed``."""
    weight: Optional[float]
    """Blend weight (> 0), or None when the list has no weights."""
    field: str
    """Where it came from, for error messages: ``data.train_files[1]``."""


def _kind_and_path(path: str, where: str) -> tuple[str, str]:
    if path.endswith((".bin", ".idx")):
        prefix = path[:-4]
        missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(p)]
        if missing:
            raise ConfigError(f"{where}={path!r}: indexed dataset file {missing[0]!r} not found")
        return "indexed", prefix
    if os.path.isfile(path):
        return "jsonl", path
    if os.path.isfile(path + ".bin") and os.path.isfile(path + ".idx"):
        return "indexed", path
    if os.path.isdir(path):
        raise ConfigError(f"{where}={path!r} is a directory; give a JSONL file or an indexed-dataset prefix")
    halves = [os.path.isfile(path + ext) for ext in (".bin", ".idx")]
    if any(halves):  # one half of an indexed dataset
        missing, present = (".idx", ".bin") if halves[0] else (".bin", ".idx")
        raise ConfigError(f"{where}={path!r}: indexed dataset file {path + missing!r} not found "
                          f"({path + present} is there)")
    raise ConfigError(f"{where}={path!r}: no such file (nor {path}.bin/.idx)")


SOURCE_FIELDS = ("train_files", "valid_files")


def single_source_as_list(layer) -> None:
    """``data.train_files=PATH`` (or ``{path, weight}``) in a config layer: the list ``[PATH]``
    (OmegaConf refuses a scalar for a list field with 'AnyNode is not a ListConfig')."""
    from omegaconf import OmegaConf

    data = layer.get("data") if OmegaConf.is_dict(layer) else None
    if not OmegaConf.is_dict(data):
        return
    for name in SOURCE_FIELDS:
        value = data.get(name)
        if isinstance(value, str) and value:
            data[name] = [value]
        elif OmegaConf.is_dict(value):
            data[name] = [OmegaConf.to_container(value)]


def parse_sources(entries: Any, field: str) -> list[SourceSpec]:
    """Check a source list and resolve each entry's kind. Raises :class:`ConfigError`."""
    if entries is None:
        return []
    if isinstance(entries, (str, dict)) or not isinstance(entries, (list, tuple)):
        raise ConfigError(f"{field} must be a list of paths or {{path, weight}} entries, got {entries!r}")
    specs = []
    for i, entry in enumerate(entries):
        where = f"{field}[{i}]"
        weight = None
        if isinstance(entry, dict):
            unknown = sorted(set(entry) - {"path", "weight"})
            if unknown:
                raise ConfigError(f"{where}: unknown key {unknown[0]!r} (an entry has 'path' and 'weight')")
            if "path" not in entry:
                raise ConfigError(f"{where}: missing 'path'")
            path, weight = entry["path"], entry.get("weight")
            if weight is not None and (
                isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight)
                or weight <= 0
            ):
                raise ConfigError(f"{where}.weight={weight!r} must be a number > 0")
        else:
            path = entry
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{where}: path must be a non-empty string, got {path!r}")
        kind, resolved = _kind_and_path(path, where)
        specs.append(SourceSpec(resolved, kind, None if weight is None else float(weight), where))
    weighted = [s.weight is not None for s in specs]
    if any(weighted) and not all(weighted):
        first = specs[weighted.index(False)]
        raise ConfigError(f"{first.field}: give a weight for every entry of {field} or for none")
    return specs


def _is_tokenizer_file(name: str) -> bool:
    return name.startswith(("tokenizer", "vocab", "spiece", "sentencepiece", "special_tokens_map")) or \
        name == "merges.txt" or name.endswith((".model", ".tiktoken"))


def tokenizer_dir_problem(path: str) -> str | None:
    """What makes the directory ``path`` no Hugging Face tokenizer (None: it holds tokenizer files;
    whether they load is for transformers to say)."""
    if not os.path.isdir(path):
        return None
    names = os.listdir(path)
    if not any(_is_tokenizer_file(n) for n in names):
        what = "is an empty directory" if not names else "holds no tokenizer files"
        return (f"{what} (tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.* ...): give the directory "
                "of a Hugging Face tokenizer, e.g. a model's save_pretrained() output")
    return None


def validate_data(cfg) -> None:
    """The ``data`` part of :func:`bebop_megatron.config.validate`."""
    d = cfg.data
    for name, choices in (("train_on", TRAIN_ON), ("on_error", ON_ERROR), ("overlong", OVERLONG),
                          ("format", FORMATS)):
        value = getattr(d, name)
        if value not in choices:
            raise ConfigError(f"data.{name}={value!r} must be one of {', '.join(choices)}")
    if d.tokenizer is not None and not os.path.isdir(d.tokenizer):
        raise ConfigError(f"data.tokenizer={d.tokenizer!r} is not a directory (a local Hugging Face tokenizer)")
    problem = tokenizer_dir_problem(d.tokenizer) if d.tokenizer is not None else None
    if problem:
        raise ConfigError(f"data.tokenizer={d.tokenizer!r} {problem}")
    parse_sources(d.train_files, "data.train_files")
    parse_sources(d.valid_files, "data.valid_files")
    if not d.train_files and d.num_samples < 1:
        raise ConfigError(f"data.num_samples={d.num_samples!r} must be >= 1")
