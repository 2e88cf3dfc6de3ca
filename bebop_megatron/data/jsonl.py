"""JSONL sources: one JSON object per line, tokenized into documents with a trained mask.

Accepted lines (other keys, e.g. ``id``, are ignored):

- ``{"messages": [{"role": ..., "content": ...}, ...]}``: a conversation in the tokenizer's
  chat format; the assistant messages (content and end-of-turn marker) are trained.
- ``{"prompt": ..., "response": ...}``: ``prefix + encode(prompt) + encode(response)``, the
  two strings tokenized separately so the mask boundary is exact; the response is trained.
- ``{"text": ...}``: ``prefix + encode(text)``, all trained.
- Token ids (:func:`encode_ids`, no tokenizer involved): ``{"input_ids", "loss_mask"}``,
  ``{"input_ids", "labels"}`` (-100: not trained), ``{"input_ids"}`` or ``{"prompt_ids",
  "response_ids"}``, taken as they are (no BOS/EOS added), ids checked against the model's
  vocabulary; they win over text fields on the same line.

The same records come from Parquet rows and the RL frameworks' rollout dumps
(:mod:`bebop_megatron.data.records`, ``data.format``).

``prefix`` is the tokenizer's BOS when it starts sequences with one. Every text document ends
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
from typing import Callable, Iterator, Optional

import numpy as np
from tqdm import tqdm

from bebop_megatron.data.errors import (
    DataError, LineError, SkipReport, is_rank0, log_rank0, malformed_json, warn_rank0,
)
from bebop_megatron.data.records import (
    RAW_PROMPT, check_format, describe_layout, file_kind, iter_parquet, iter_torch, location, resolve, to_generic, unit,
)
from bebop_megatron.data.tokenizer import Tokenizer, describe

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


_TEXT_KINDS = (("messages", ("messages",)), ("prompt/response", ("prompt", "response")), ("text", ("text",)))
_ID_KINDS = (("input_ids", ("input_ids",)), ("prompt_ids/response_ids", ("prompt_ids", "response_ids")))
IGNORED = -100
"""``labels`` value of a position that is not trained (the Hugging Face convention)."""


def _kinds(obj: dict, table) -> list[str]:
    return [k for k, keys in table if any(key in obj for key in keys)]


def _int_list(obj: dict, key: str, *, allow_empty: bool = False) -> list[int]:
    """``obj[key]`` as a list of ints; raises :class:`LineError` (missing, wrong type, empty)."""
    if key not in obj:
        raise LineError("missing field", f"missing field {key!r}")
    value = obj[key]
    if hasattr(value, "tolist"):  # numpy arrays and tensors (Parquet, torch dumps)
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise LineError("wrong type", f"field {key!r} must be an array of integers, got {_json_type(value)}")
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int):
            raise LineError("wrong type", f"{key}[{i}] must be an integer, got {_json_type(v)}")
    if not value and not allow_empty:
        raise LineError("empty ids", f"field {key!r} is empty")
    return list(value)


def _check_range(ids: list[int], key: str, vocab_size: Optional[int], vocab_what: str) -> None:
    if vocab_size is None:
        return
    for i, v in enumerate(ids):
        if not 0 <= v < vocab_size:
            raise LineError("id out of range", f"{key}[{i}]={v} is out of range: ids are 0 .. {vocab_size - 1} "
                                               f"({vocab_what}={vocab_size})")


def _mask_list(obj: dict, key: str, n: int, against: str) -> list[int]:
    mask = _int_list(obj, key, allow_empty=True)
    if len(mask) != n:
        raise LineError("length mismatch", f"{key!r} has {len(mask)} entries but {against!r} has {n}")
    bad = next((i for i, v in enumerate(mask) if v not in (0, 1)), None)
    if bad is not None:
        raise LineError("wrong type", f"{key}[{bad}]={mask[bad]} must be 0 or 1")
    return mask


def encode_ids(obj: dict, vocab_size: Optional[int] = None,
               vocab_what: str = "model.vocab_size") -> Optional[tuple[list[int], list[int]]]:
    """Token ids and trained flags of a token-id record, taken as they are (no BOS or EOS added:
    the ids are what the policy saw and emitted); None when ``obj`` has no id field.

    ``{"input_ids", "loss_mask"}`` (1: trained) or ``{"input_ids", "labels"}`` (``-100``: not
    trained, else equal to the input id at the same position: unshifted), or ``input_ids`` alone
    (all trained); ``{"prompt_ids", "response_ids"}``: the response is trained. Ids must lie in
    ``0 .. vocab_size-1``; ``logprobs`` and other keys are ignored."""
    kinds = _kinds(obj, _ID_KINDS)
    if not kinds:
        return None
    if len(kinds) > 1:
        raise LineError("ambiguous format", f"has both {kinds[0]!r} and {kinds[1]!r} fields; use one format per line")
    if kinds[0] == "input_ids":
        ids = _int_list(obj, "input_ids")
        _check_range(ids, "input_ids", vocab_size, vocab_what)
        if "loss_mask" in obj and "labels" in obj:
            raise LineError("ambiguous format", "has both 'loss_mask' and 'labels'; give one of them")
        if "loss_mask" in obj:
            trained = _mask_list(obj, "loss_mask", len(ids), "input_ids")
        elif "labels" in obj:
            labels = _int_list(obj, "labels", allow_empty=True)
            if len(labels) != len(ids):
                raise LineError("length mismatch", f"'labels' has {len(labels)} entries but 'input_ids' has {len(ids)}")
            for i, (label, tok) in enumerate(zip(labels, ids)):
                if label != IGNORED and label != tok:
                    raise LineError("labels not aligned", f"labels[{i}]={label} is neither -100 nor input_ids[{i}]={tok} "
                                                          "(labels are the input_ids with -100 where not trained, unshifted)")
            trained = [int(label != IGNORED) for label in labels]
        else:
            trained = [1] * len(ids)
    else:
        prompt = _int_list(obj, "prompt_ids", allow_empty=True)
        response = _int_list(obj, "response_ids")
        _check_range(prompt, "prompt_ids", vocab_size, vocab_what)
        _check_range(response, "response_ids", vocab_size, vocab_what)
        ids, trained = prompt + response, [0] * len(prompt) + [1] * len(response)
    return ids, trained


def encode_record(obj, tokenizer: Tokenizer, train_on: str, vocab_size: Optional[int] = None,
                  vocab_what: str = "model.vocab_size") -> tuple[list[int], list[int]]:
    """Token ids and trained flags of one parsed record; raises :class:`LineError`.

    Token-id fields (:func:`encode_ids`) take precedence over text fields on the same line
    (a line may carry both, e.g. ``tools/generate_responses.py``'s ``messages`` and ids)."""
    if not isinstance(obj, dict):
        raise LineError("not a JSON object", f"expected a JSON object, got {_json_type(obj)}")
    encoded = encode_ids(obj, vocab_size, vocab_what)
    if encoded is not None:
        ids, trained = encoded
    else:
        ids, trained = _encode_text(obj, tokenizer)
    if train_on == "all":
        trained = [1] * len(ids)
    elif not any(trained[1:]):
        if encoded is not None:  # token ids: no tokenization, no chat template; the line's own fields say why
            raise LineError("nothing to train", _ids_train_nothing(obj, trained))
        raise LineError("nothing to train", "no trained token after tokenization (check the chat template)")
    return ids, trained


def _ids_train_nothing(obj: dict, trained: list[int]) -> str:
    """Why a token-id line (:func:`encode_ids`) trains no token: a row's first token is never a
    target (no position before it predicts it)."""
    ids = "'input_ids'" if "input_ids" in obj else "'prompt_ids' + 'response_ids'"
    if len(trained) == 1:
        return f"{ids} holds a single token, and a row's first token is never trained (nothing before it predicts " \
               "it): this line trains no token"
    if any(trained):  # the first token alone
        marks = "'loss_mask' marks" if "loss_mask" in obj else "'labels' mark" if "labels" in obj else "the line marks"
        return f"{marks} only the first token, which is never trained (nothing before it predicts it): this line " \
               "trains no token"
    if "labels" in obj:
        return "'labels' is -100 everywhere: this line trains no token (the trained positions hold their input id)"
    return "'loss_mask' is 0 everywhere: this line trains no token (1 marks the tokens to train)"


def _encode_text(obj: dict, tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    kinds = _kinds(obj, _TEXT_KINDS)
    if not kinds:
        raise LineError("unknown format", "no 'messages', 'prompt'/'response', 'text', 'input_ids' or "
                                          "'prompt_ids'/'response_ids' field")
    if len(kinds) > 1:
        raise LineError("ambiguous format", f"has both {kinds[0]!r} and {kinds[1]!r} fields; use one format per line")
    if kinds[0] == "messages":
        ids, trained = tokenizer.encode_chat(_chat_messages(obj))
    elif kinds[0] == "prompt/response" and isinstance(obj.get("prompt"), list):
        if "response" not in obj:
            raise LineError("missing field", "missing field 'response' (a 'prompt' of messages without a response is "
                                             "a prompt set: generate responses with tools/generate_responses.py)")
        # A conversation's messages and the assistant's answer (a verl dataset's 'prompt' column).
        answer = {"role": "assistant", "content": _string_field(obj, "response")}
        ids, trained = tokenizer.encode_chat(_chat_messages({"messages": [*obj["prompt"], answer]}))
    elif kinds[0] == "prompt/response":
        prompt, response = _string_field(obj, "prompt"), _string_field(obj, "response")
        if not response.strip():
            raise LineError("empty response", "field 'response' is empty")
        head, tail = tokenizer.encode(prompt), tokenizer.encode(response)
        if not obj.get(RAW_PROMPT) or head[: len(tokenizer.prefix_ids)] != tokenizer.prefix_ids:
            head = tokenizer.prefix_ids + head
        ids, trained = head + tail, [0] * len(head) + [1] * len(tail)
    else:
        text = _string_field(obj, "text")
        if not text.strip():
            raise LineError("empty text", "field 'text' is empty")
        ids = tokenizer.prefix_ids + tokenizer.encode(text)
        trained = [1] * len(ids)
    if not ids or ids[-1] != tokenizer.eos_id:
        ids, trained = ids + [tokenizer.eos_id], trained + [trained[-1] if trained else 1]
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


def _jsonl_records(path: str, bar) -> Iterator[tuple[int, object]]:
    """``(line number, parsed record or LineError)`` per non-blank line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            bar.update(len(raw))
            if lineno == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark
            if not raw.strip():
                continue
            try:
                yield lineno, _parse_line(raw)
            except LineError as err:
                yield lineno, err


def tokenize_jsonl(
    path: str,
    tokenizer: Tokenizer,
    emit: Callable[[np.ndarray, np.ndarray], None],
    *,
    train_on: str = "response",
    on_error: str = "fail",
    log: Callable[[str], None] = log_rank0,
    progress: bool = True,
    vocab_size: Optional[int] = None,
    vocab_what: str = "model.vocab_size",
    data_format: str = "auto",
) -> FileStats:
    """Tokenize ``path`` record by record, calling ``emit(tokens_int32, trained_uint8)`` per document.

    ``path`` is a JSONL, Parquet or torch (slime) file and its records are read in
    ``data_format``'s layout (:mod:`bebop_megatron.data.records`; ``auto``: detected from the
    first record, logged in one line when not the generic one). Token ids are checked against
    ``vocab_size`` (``vocab_what`` names it in errors; None: the tokenizer's). Logs documents,
    tokens and tokens/s at the end; warns once with the skip summary.
    """
    check_format(data_format)
    kind = file_kind(path)
    if vocab_size is None:
        vocab_size, vocab_what = tokenizer.vocab_size, f"{describe(tokenizer)}'s vocab_size"
    stats, report = FileStats(), SkipReport(path, unit(kind))
    start = time.perf_counter()
    bar = tqdm(total=os.path.getsize(path), unit="B", unit_scale=True, desc=f"tokenizing {os.path.basename(path)}",
               disable=True if not (progress and is_rank0() and kind == "jsonl") else None, leave=False)  # None: TTY only
    if kind == "jsonl":
        items = _jsonl_records(path, bar)
    else:
        items = enumerate(iter_parquet(path) if kind == "parquet" else iter_torch(path))
    layout = None
    with bar:
        for n, obj in items:
            stats.num_lines += 1
            try:
                if isinstance(obj, LineError):
                    raise obj
                if layout is None:
                    layout = resolve(data_format, obj, kind)
                    if layout != "generic" or data_format != "auto":
                        log(describe_layout(path, layout, data_format))
                ids, trained = encode_record(to_generic(obj, layout), tokenizer, train_on, vocab_size,
                                             vocab_what)
            except LineError as err:
                if on_error != "skip":
                    raise DataError(f"{location(path, kind, n)}: {err.message}") from None
                report.add(err.reason, n)
                continue
            except DataError as err:  # a setup problem (e.g. no chat template): fatal either way
                raise DataError(f"{location(path, kind, n)}: {err}") from None
            stats.num_documents += 1
            stats.num_tokens += len(ids)
            stats.num_trained += sum(trained[1:])
            emit(np.asarray(ids, dtype=np.int32), np.asarray(trained, dtype=np.uint8))
    stats.seconds = time.perf_counter() - start
    stats.skipped = dict(report.counts)
    if stats.num_lines == 0:
        what = "JSON lines" if kind == "jsonl" else ("rows" if kind == "parquet" else "samples")
        raise DataError(f"{location(path, kind, 1 if kind == 'jsonl' else 0)}: the file has no {what} "
                        "(it is empty or blank)")
    if report.total:
        warn_rank0(report.summary(stats.num_lines))
    if stats.num_documents == 0:
        raise DataError(f"{location(path, kind, 1 if kind == 'jsonl' else 0)}: no usable {report.unit} "
                        f"(all {stats.num_lines} {report.unit}s were skipped)")
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
