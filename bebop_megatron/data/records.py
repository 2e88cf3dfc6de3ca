"""Where training records come from, and the RL frameworks' rollout layouts.

A data file is read as a sequence of records (dicts), each turned into one document by
:func:`bebop_megatron.data.jsonl.encode_record`:

- JSONL: one record per line (``PATH:LINE`` in errors).
- Parquet (``.parquet``, or a file starting with ``PAR1``): one record per row, read one row
  group at a time (``PATH: row N`` in errors, N counted from 0); needs ``pyarrow``
  (``pip install 'bebop_megatron[parquet]'``).
- A torch file (``.pt``/``.pth``, or a zip archive): a slime rollout dump, ``{"rollout_id",
  "samples": [Sample.to_dict(), ...]}`` (``PATH: samples[N]`` in errors), loaded with
  ``weights_only=True``.

The layout of the records (``data.format``; ``auto`` decides per file from the first record):

- ``generic``: this project's lines: ``messages``, ``prompt``/``response``, ``text``,
  ``input_ids`` (+ ``loss_mask`` or ``labels``), ``prompt_ids``/``response_ids``.
- ``verl``: verl's rollout dumps (``trainer.rollout_data_dir``): ``{"input", "output", "score",
  "step", ...}`` with the decoded prompt and response texts (auto: ``input``/``output`` and
  ``step`` or ``score``). verl's Parquet datasets (``prompt`` as a list of messages) are generic
  records: with a ``response`` column they train as a conversation.
- ``openrlhf``: OpenRLHF's ``batch_inference`` output: ``{"input", "output"}`` (+ ``reward``),
  the prompt as rendered by the chat template (auto: ``input``/``output`` without ``step``).
- ``slime``: slime's saved rollout samples (``--save-debug-rollout-data``): ``tokens`` (prompt
  and response ids), ``response_length``, ``loss_mask`` over the response (None: all trained),
  ``rollout_log_probs`` (ignored). Auto: a torch file, or records with ``tokens`` and
  ``response_length``.

``verl`` and ``openrlhf`` records are text: the prompt is tokenized as it is (the tokenizer's
BOS is added unless the text already starts with it) and the response after it. ``slime``
records are token ids, taken as they are.
"""

from __future__ import annotations

from typing import Iterator, Optional

from bebop_megatron.config.layouts import FORMATS
from bebop_megatron.config.layouts import LAYOUTS
from bebop_megatron.data.errors import DataError, LineError

RAW_PROMPT = "__raw_prompt__"
"""Set on the records of the text dumps: the prompt is a rendered text that may start with BOS."""
KNOWN_COLUMNS = ("messages", "prompt", "response", "text", "input_ids", "prompt_ids", "response_ids", "input",
                 "output", "tokens")
PARQUET_MISSING = ("reading Parquet files needs pyarrow, which is not installed: pip install "
                   "'bebop_megatron[parquet]' (or pip install pyarrow)")


def file_kind(path: str) -> str:
    """``jsonl``, ``parquet`` or ``torch``: by extension, else by the first bytes."""
    lower = path.lower()
    if lower.endswith((".parquet", ".pq")):
        return "parquet"
    if lower.endswith((".pt", ".pth")):
        return "torch"
    if lower.endswith((".jsonl", ".json")):
        return "jsonl"
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return "jsonl"
    return {b"PAR1": "parquet", b"PK\x03\x04": "torch"}.get(head, "jsonl")


def _pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(PARQUET_MISSING) from None
    return pq


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())[:300] or type(err).__name__


def open_parquet(path: str):
    """A ``pyarrow.parquet.ParquetFile``; one :class:`DataError` line for a file that is not one
    (a corrupt footer) or has no column of a known layout."""
    pq = _pyarrow_parquet()
    try:
        pf = pq.ParquetFile(path)
    except Exception as err:  # ArrowInvalid (bad magic, corrupt footer), OSError
        raise DataError(f"{path}: not a readable Parquet file: {_one_line(err)}") from None
    names = pf.schema_arrow.names
    if not any(name in KNOWN_COLUMNS for name in names):
        raise DataError(f"{path}: no column of a known layout (columns: {', '.join(names) or 'none'}); expected "
                        "messages, prompt/response, text, input_ids, prompt_ids/response_ids, input/output or tokens")
    return pf


def iter_parquet(path: str) -> Iterator[dict]:
    """The rows of a Parquet file as dicts (null cells left out), one row group in memory at a time."""
    pf = open_parquet(path)
    for group in range(pf.num_row_groups):
        try:
            rows = pf.read_row_group(group).to_pylist()
        except Exception as err:
            raise DataError(f"{path}: cannot read row group {group}: {_one_line(err)}") from None
        for row in rows:
            yield {k: v for k, v in row.items() if v is not None}


def _text_start(path: str) -> str | None:
    """The first non-blank character of ``path`` when the file starts as UTF-8 text opening JSON
    (``{`` or ``[``), else None."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.reason != "unexpected end of data":  # not text (a character cut at the end of the read is)
            return None
        text = head[:err.start].decode("utf-8")
    start = text.lstrip("\ufeff \t\r\n")[:1]
    return start if start in ("{", "[") else None


def iter_torch(path: str) -> Iterator:
    """The ``samples`` of a slime rollout dump (a torch file)."""
    start = _text_start(path)
    if start is not None:  # torch.load's error advised weights_only=False (running the file's code)
        raise DataError(f"{path}: named like a torch file (a slime rollout dump) but it is text starting with "
                        f"'{start}' (JSON lines?); a file is read by its extension: rename it to .jsonl")
    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        reason = _one_line(err)
        if "weights_only" in reason:  # not torch's advice to load with weights_only=False: it runs the file's code
            reason = ("it is not a torch file, or it holds Python objects other than tensors, dicts, lists, strings "
                      "and numbers, which are not loaded (weights_only=True: a data file runs no code)")
        raise DataError(f"{path}: cannot load it as a torch file (a slime rollout dump): {reason}") from None
    samples = obj.get("samples") if isinstance(obj, dict) else None
    if not isinstance(samples, list):
        raise DataError(f"{path}: not a slime rollout dump (a dict with a 'samples' list, as slime's "
                        "--save-debug-rollout-data writes)")
    yield from samples


def detect(first, kind: str) -> str:
    """The layout of a file from its kind and first record (``data.format=auto``)."""
    if kind == "torch":
        return "slime"
    if isinstance(first, dict):
        if "tokens" in first and "response_length" in first:
            return "slime"
        if "input" in first and "output" in first:
            return "verl" if ("step" in first or "score" in first) else "openrlhf"
    return "generic"


def _require(obj: dict, key: str):
    if key not in obj:
        raise LineError("missing field", f"missing field {key!r}")
    return obj[key]


def to_generic(obj, layout: str):
    """A record of ``layout`` as a generic record; raises :class:`LineError`."""
    if layout == "generic" or not isinstance(obj, dict):
        return obj
    if layout in ("verl", "openrlhf"):
        return {"prompt": _require(obj, "input"), "response": _require(obj, "output"), RAW_PROMPT: True}
    assert layout == "slime", layout
    tokens, n = _require(obj, "tokens"), _require(obj, "response_length")
    if hasattr(tokens, "tolist"):
        tokens = tokens.tolist()
    if not isinstance(tokens, list):
        raise LineError("wrong type", f"field 'tokens' must be a list of integers, got {type(tokens).__name__}")
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= len(tokens):
        raise LineError("length mismatch", f"response_length={n!r} must be an integer in 1 .. len(tokens)={len(tokens)}")
    mask = obj.get("loss_mask")
    if mask is None:
        mask = [1] * n
    elif hasattr(mask, "tolist"):
        mask = mask.tolist()
    if not isinstance(mask, list):
        raise LineError("wrong type", f"field 'loss_mask' must be a list of 0/1, got {type(mask).__name__}")
    if len(mask) != n:
        raise LineError("length mismatch", f"'loss_mask' has {len(mask)} entries but response_length is {n}")
    return {"input_ids": tokens, "loss_mask": [0] * (len(tokens) - n) + list(mask)}


def resolve(fmt: str, first, kind: str) -> str:
    return detect(first, kind) if fmt == "auto" else fmt


def describe_layout(path: str, layout: str, fmt: str) -> str:
    how = "detected" if fmt == "auto" else f"data.format={fmt}"
    return f"{path}: {LAYOUTS[layout]} ({how})"


def location(path: str, kind: str, n: int) -> str:
    """How an error names record ``n`` (a 1-based line of a JSONL file, else a 0-based index)."""
    return {"jsonl": f"{path}:{n}", "parquet": f"{path}: row {n}", "torch": f"{path}: samples[{n}]"}[kind]


def unit(kind: str) -> str:
    return {"jsonl": "line", "parquet": "row", "torch": "sample"}[kind]


def check_format(fmt: Optional[str]) -> None:
    if fmt not in FORMATS:
        raise DataError(f"data.format={fmt!r} must be one of {', '.join(FORMATS)}")


__all__ = ["FORMATS", "RAW_PROMPT", "describe_layout", "detect", "file_kind", "iter_parquet", "iter_torch",
           "location", "open_parquet", "resolve", "to_generic", "unit"]
