"""JSONL sources: one JSON object per line, tokenized into documents with a trained mask.

Accepted lines (other keys, e.g. ``id``, are ignored):

- ``{"messages": [{"role": ..., "content": ...}, ...]}``: a conversation in the tokenizer's
  chat format; the assistant messages (content and end-of-turn marker) are trained.
- ``{"prompt": ..., "response": ...}``: ``prefix + encode(prompt) + encode(response)``, the
  two strings tokenized separately so the mask boundary is exact; the response is trained.
- ``{"text": ...}``: ``prefix + encode(text)``, all trained.

``prefix`` is the tokenizer's BOS when it starts sequences with one. Every document ends
with EOS (added unless the rendering already ends with it); the EOS is trained when the
token before it is. With ``train_on="all"`` every token is trained.

``trained[i]`` says whether token ``i`` is a training *label*; packing turns it into the
per-input ``loss_mask`` (:mod:`bebop_megatron.data.packing`).

A bad line (not UTF-8, malformed JSON, not an object, unknown or ambiguous format, missing
or mistyped field, empty response/text, no assistant message, chat-template failure) raises
``DataError("PATH:LINE: what is wrong")`` with ``on_error="fail"``, or is skipped and
counted per reason with ``on_error="skip"`` (one summary warning per file). Blank lines are
ignored; a file with no JSON line at all is an error either way.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from tqdm import tqdm

from bebop_megatron.data.errors import (
    DataError, LineError, SkipReport, is_rank0, log_rank0, malformed_json, warn_rank0,
)
from bebop_megatron.data.tokenizer import Tokenizer

_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}


def _json_type(value) -> str:
    return "null" if value is None else _JSON_TYPES.get(type(value), type(value).__name__)


def _string_field(obj: dict, key: str, where: str = "") -> str:
    if key not in obj:
        raise LineError("missing field", f"{where}missing field {key!r}")
    value = obj[key]
    if not isinstance(value, str):
        raise LineError("wrong type", f"{where}field {key!r} must be a string, got {_json_type(value)}")
    return value


def _chat_messages(obj: dict) -> list[dict]:
    messages = obj["messages"]
    if not isinstance(messages, list):
        raise LineError("wrong type", f"field 'messages' must be an array, got {_json_type(messages)}")
    if not messages:
        raise LineError("no assistant message", "'messages' is empty")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise LineError("wrong type", f"messages[{i}] must be an object, got {_json_type(msg)}")
        _string_field(msg, "role", f"messages[{i}]: ")
        _string_field(msg, "content", f"messages[{i}]: ")
    assistant = [i for i, msg in enumerate(messages) if msg["role"] == "assistant"]
    if not assistant:
        raise LineError("no assistant message", "no assistant message in 'messages' (nothing to train on)")
    for i in assistant:
        if not messages[i]["content"].strip():
            raise LineError("empty response", f"messages[{i}] is an assistant message with empty content")
    return messages


def encode_record(obj, tokenizer: Tokenizer, train_on: str) -> tuple[list[int], list[int]]:
    """Token ids and trained flags of one parsed JSONL line; raises :class:`LineError`."""
    if not isinstance(obj, dict):
        raise LineError("not a JSON object", f"expected a JSON object, got {_json_type(obj)}")
    kinds = [k for k, keys in (("messages", ("messages",)), ("prompt/response", ("prompt", "response")),
                                ("text", ("text",))) if any(key in obj for key in keys)]
    if not kinds:
        raise LineError("unknown format", "no 'messages', 'prompt'/'response' or 'text' field")
    if len(kinds) > 1:
        raise LineError("ambiguous format", f"has both {kinds[0]!r} and {kinds[1]!r} fields; use one format per line")
    if kinds[0] == "messages":
        ids, trained = tokenizer.encode_chat(_chat_messages(obj))
    elif kinds[0] == "prompt/response":
        prompt, response = _string_field(obj, "prompt"), _string_field(obj, "response")
        if not response.strip():
            raise LineError("empty response", "field 'response' is empty")
        head, tail = tokenizer.prefix_ids + tokenizer.encode(prompt), tokenizer.encode(response)
        ids, trained = head + tail, [0] * len(head) + [1] * len(tail)
    else:
        text = _string_field(obj, "text")
        if not text.strip():
            raise LineError("empty text", "field 'text' is empty")
        ids = tokenizer.prefix_ids + tokenizer.encode(text)
        trained = [1] * len(ids)
    if not ids or ids[-1] != tokenizer.eos_id:
        ids, trained = ids + [tokenizer.eos_id], trained + [trained[-1] if trained else 1]
    if train_on == "all":
        trained = [1] * len(ids)
    elif not any(trained[1:]):
        raise LineError("nothing to train", "no trained token after tokenization (check the chat template)")
    return ids, trained


def _parse_line(raw: bytes):
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise LineError("invalid UTF-8", f"not valid UTF-8: byte 0x{raw[err.start]:02x} at column {err.start + 1}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise LineError("malformed JSON", malformed_json(err)) from None


@dataclass
class FileStats:
    num_lines: int = 0
    num_documents: int = 0
    num_tokens: int = 0
    num_trained: int = 0
    seconds: float = 0.0
    skipped: dict | None = None  # reason -> count


def tokenize_jsonl(
    path: str,
    tokenizer: Tokenizer,
    emit: Callable[[np.ndarray, np.ndarray], None],
    *,
    train_on: str = "response",
    on_error: str = "fail",
    log: Callable[[str], None] = log_rank0,
    progress: bool = True,
) -> FileStats:
    """Tokenize ``path`` line by line, calling ``emit(tokens_int32, trained_uint8)`` per document.

    Logs documents, tokens and tokens/s at the end; warns once with the skip summary.
    """
    stats, report = FileStats(), SkipReport(path)
    start = time.perf_counter()
    bar = tqdm(total=os.path.getsize(path), unit="B", unit_scale=True, desc=f"tokenizing {os.path.basename(path)}",
               disable=True if not (progress and is_rank0()) else None, leave=False)  # None: TTY only
    with open(path, "rb") as f, bar:
        for lineno, raw in enumerate(f, start=1):
            bar.update(len(raw))
            if lineno == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark
            if not raw.strip():
                continue
            stats.num_lines += 1
            try:
                ids, trained = encode_record(_parse_line(raw), tokenizer, train_on)
            except LineError as err:
                if on_error != "skip":
                    raise DataError(f"{path}:{lineno}: {err.message}") from None
                report.add(err.reason, lineno)
                continue
            except DataError as err:  # a setup problem (e.g. no chat template): fatal either way
                raise DataError(f"{path}:{lineno}: {err}") from None
            stats.num_documents += 1
            stats.num_tokens += len(ids)
            stats.num_trained += sum(trained[1:])
            emit(np.asarray(ids, dtype=np.int32), np.asarray(trained, dtype=np.uint8))
    stats.seconds = time.perf_counter() - start
    stats.skipped = dict(report.counts)
    if stats.num_lines == 0:
        raise DataError(f"{path}:1: the file has no JSON lines (it is empty or blank)")
    if report.total:
        warn_rank0(report.summary(stats.num_lines))
    if stats.num_documents == 0:
        raise DataError(f"{path}:1: no usable line (all {stats.num_lines} lines were skipped)")
    log(f"{path}: {stats.num_documents} documents, {stats.num_tokens} tokens ({stats.num_trained} trained) "
        f"in {stats.seconds:.2f} s ({stats.num_tokens / max(stats.seconds, 1e-9):,.0f} tokens/s)")
    return stats


@dataclass
class Documents:
    """Tokenized documents, concatenated: document ``j`` is ``tokens[offsets[j]:offsets[j+1]]``.

    ``tokens`` int32 [T], ``trained`` uint8 [T] (1: the token is trained as a label),
    ``offsets`` int64 [N+1]. Same ``lengths``/``get`` interface as the indexed source."""

    tokens: np.ndarray
    trained: np.ndarray
    offsets: np.ndarray
    name: str = ""

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def get(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.offsets[j], self.offsets[j + 1]
        return self.tokens[lo:hi], self.trained[lo:hi]


def read_jsonl(path: str, tokenizer: Tokenizer, **kwargs) -> Documents:
    """All documents of one JSONL file in memory (``kwargs`` as :func:`tokenize_jsonl`)."""
    tokens, trained = [], []

    def emit(t: np.ndarray, m: np.ndarray) -> None:
        tokens.append(t)
        trained.append(m)

    tokenize_jsonl(path, tokenizer, emit, **kwargs)
    offsets = np.zeros(len(tokens) + 1, dtype=np.int64)
    np.cumsum([len(t) for t in tokens], out=offsets[1:])
    return Documents(np.concatenate(tokens), np.concatenate(trained), offsets, name=path)
