"""Shared fixtures for the data tests: a small local Hugging Face tokenizer and JSONL writers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

WORDS = ("hello world how are you the cat sat on mat i am fine thank what is two plus four "
         "tell me a story once upon time there was dog who ran far away end good night").split()
ROLE_TOKENS = ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
# Every message is "<|role|> content <|end|>"; the generation prompt is "<|assistant|>".
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def make_hf_tokenizer(path: Path) -> Path:
    """A word-level tokenizer that prepends <s>, with eos/pad tokens and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<s>", "</s>", *ROLE_TOKENS]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                 eos_token="</s>", additional_special_tokens=ROLE_TOKENS)
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory) -> Path:
    return make_hf_tokenizer(tmp_path_factory.mktemp("hf_tokenizer"))


def write_jsonl(path: Path, records) -> Path:
    """One line per record: dicts are JSON-encoded, str/bytes are written as they are."""
    with open(path, "wb") as f:
        for rec in records:
            if isinstance(rec, dict):
                rec = json.dumps(rec)
            f.write((rec.encode() if isinstance(rec, str) else rec) + b"\n")
    return path
