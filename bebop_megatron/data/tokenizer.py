"""Tokenizers: the built-in byte-level tokenizer and local Hugging Face tokenizers.

Both offer the small interface the JSONL reader needs:

- ``vocab_size``: number of token ids (ids are ``0 .. vocab_size-1``); must not exceed
  ``model.vocab_size`` (:func:`check_vocab_size`). The model pads its embedding further
  to a multiple of ``make_vocab_size_divisible_by * TP``; the data never uses those ids.
- ``eos_id`` (ends every document), ``pad_id`` (fills packed rows; EOS when the HF
  tokenizer has no pad token), ``prefix_ids`` (BOS, when the tokenizer starts a sequence
  with one).
- ``encode(text) -> list[int]`` without special tokens, ``decode(ids) -> str``.
- ``encode_chat(messages) -> (ids, trained)``: one conversation in the tokenizer's chat
  format; ``trained[i]`` is 1 on assistant tokens (their content and end-of-turn marker).
"""

from __future__ import annotations

from typing import Optional, Union

from bebop_megatron.config.sources import tokenizer_dir_problem
from bebop_megatron.data.errors import DataError, LineError


class ByteTokenizer:
    """UTF-8 bytes (ids 0..255) plus special tokens, with a built-in chat format.

    A conversation is ``<|bos|>`` then, per message, ``<|role|> content-bytes <|end|>``;
    the assistant's content bytes and its ``<|end|>`` are the trained tokens.
    """

    SPECIALS = ("pad", "bos", "eos", "system", "user", "assistant", "end")
    PAD, BOS, EOS, SYSTEM, USER, ASSISTANT, END = range(256, 256 + len(SPECIALS))
    ROLES = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}

    name = "byte"
    vocab_size = 256 + len(SPECIALS)
    eos_id, pad_id, prefix_ids = EOS, PAD, [BOS]

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        out, run = [], bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            out.append(f"<|{self.SPECIALS[i - 256]}|>")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def encode_chat(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        ids, trained = [self.BOS], [0]
        for i, msg in enumerate(messages):
            marker = self.ROLES.get(msg["role"])
            if marker is None:
                raise LineError(
                    "unknown role",
                    f"messages[{i}].role={msg['role']!r} is not one of system, user, assistant "
                    "(the built-in byte tokenizer's chat format)",
                )
            body = self.encode(msg["content"]) + [self.END]
            ids += [marker] + body
            trained += [0] + [int(msg["role"] == "assistant")] * len(body)
        return ids, trained


class HFTokenizer:
    """A Hugging Face tokenizer from a local directory (no network), chat via its template.

    Assistant tokens are located by rendering prefixes of the conversation: message ``i``'s
    trained characters are those between ``render(messages[:i], add_generation_prompt=True)``
    and ``render(messages[:i+1])``, both of which must be prefixes of the full rendering.
    The full rendering is tokenized once (``add_special_tokens=False``, as
    ``apply_chat_template`` does); a token is trained when its characters overlap a span.
    """

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        problem = tokenizer_dir_problem(path)  # transformers would suggest installing sentencepiece
        if problem:
            raise DataError(f"data.tokenizer={path!r} {problem}")
        try:
            # trust_remote_code=False: transformers reads config.json for the model type and, for one naming
            # custom code (a MiMo export's auto_map), would ask "run the custom code? [y/N]"; the tokenizer
            # files need none (the importer reads config.json as plain JSON).
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        except Exception as err:  # OSError, ValueError, JSON errors: all mean "not a tokenizer dir"
            reason = " ".join(str(err).split())[:300] or type(err).__name__
            raise DataError(f"data.tokenizer={path!r}: cannot load a Hugging Face tokenizer: {reason}") from None
        if tok.eos_token_id is None:
            raise DataError(f"data.tokenizer={path!r}: the tokenizer has no eos_token (documents end with EOS)")
        self.tok = tok
        self.name = path
        self.vocab_size = len(tok)  # includes added tokens, unlike tok.vocab_size
        self.eos_id = int(tok.eos_token_id)
        self.pad_id = int(tok.pad_token_id) if tok.pad_token_id is not None else self.eos_id
        bos = tok.bos_token_id
        probe = tok.encode("a", add_special_tokens=True)
        self.prefix_ids = [int(bos)] if bos is not None and probe[:1] == [bos] else []

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        try:
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as err:  # jinja2 errors, raise_exception() in templates
            raise LineError("chat template error", f"the chat template failed: {err}") from None

    def encode_chat(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        if not self.tok.chat_template:
            raise DataError(f"data.tokenizer={self.name!r} has no chat_template; 'messages' lines need one")
        full = self._render(messages, False)
        spans = []
        for i, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            before = self._render(messages[:i], True) if i else _try_empty(self, full)
            upto = self._render(messages[: i + 1], False)
            if not (full.startswith(upto) and upto.startswith(before)):
                raise LineError(
                    "chat template not prefix-stable",
                    f"the chat template renders messages[:{i + 1}] differently inside the whole "
                    "conversation, so the assistant tokens cannot be located",
                )
            spans.append((len(before), len(upto)))
        if self.tok.is_fast:
            enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
            ids = list(enc["input_ids"])
            trained = [int(any(s < hi and max(e, s + 1) > lo for lo, hi in spans)) for s, e in enc["offset_mapping"]]
            return ids, trained
        # Slow tokenizers have no offsets: tokenize the pieces between span edges separately.
        ids, trained, edges = [], [], sorted({0, len(full), *(x for span in spans for x in span)})
        for lo, hi in zip(edges[:-1], edges[1:]):
            piece = self.encode(full[lo:hi])
            ids += piece
            trained += [int(any(a <= lo and hi <= b for a, b in spans))] * len(piece)
        return ids, trained


def _try_empty(tokenizer: HFTokenizer, full: str) -> str:
    """Rendering of no messages plus the generation prompt (assistant speaks first)."""
    try:
        return tokenizer._render([], True)
    except LineError:
        return ""


Tokenizer = Union[ByteTokenizer, HFTokenizer]


def tokenizer_from_dir(path: Optional[str]) -> Tokenizer:
    """The HF tokenizer in ``path`` (a local directory), or the byte tokenizer for None."""
    return ByteTokenizer() if path is None else HFTokenizer(path)


def describe(tokenizer: Tokenizer) -> str:
    if isinstance(tokenizer, ByteTokenizer):
        return "the built-in byte tokenizer"
    return f"the tokenizer in {tokenizer.name}"


def signature(tokenizer: Tokenizer) -> dict:
    """What must agree between an indexed dataset and the tokenizer of the run."""
    return {"vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id, "pad_id": tokenizer.pad_id}


def check_vocab_size(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Raise :class:`DataError` when the tokenizer's ids do not all fit ``model.vocab_size``."""
    check_fits(tokenizer.vocab_size, model_vocab_size, describe(tokenizer))


def check_fits(vocab_size: int, model_vocab_size: int, what: str) -> None:
    """``vocab_size`` ids (from ``what``: a tokenizer or an indexed dataset) fit the model."""
    if vocab_size > model_vocab_size:
        raise DataError(
            f"{what} has {vocab_size} tokens but model.vocab_size={model_vocab_size}; "
            f"set model.vocab_size >= {vocab_size}"
        )
