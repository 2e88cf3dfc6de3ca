"""Tokenizers and JSONL formats (data/tokenizer.py, data/jsonl.py) against the tokenizer's own encoding."""

from __future__ import annotations

import numpy as np
import pytest

from bebop_megatron.config import ConfigError, load_config
from bebop_megatron.data import ByteTokenizer, DataError, HFTokenizer, check_vocab_size, load_tokenizer
from bebop_megatron.data.jsonl import read_jsonl
from tests.helpers.data import write_jsonl

CHAT = [
    {"role": "system", "content": "tell me a story"},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "i am fine"},
    {"role": "user", "content": "what is two plus two"},
    {"role": "assistant", "content": "four"},
]


def _auto(hf_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)


def _docs(tmp_path, records, tokenizer, **kwargs):
    docs = read_jsonl(str(write_jsonl(tmp_path / "d.jsonl", records)), tokenizer, progress=False, **kwargs)
    return [tuple(a.tolist() for a in docs.get(j)) for j in range(len(docs))]


@pytest.mark.parametrize("text", ["", "plain ascii", "ünïcödé ✓ 漢字 🙂", "tab\tnewline\n\"quotes\""])
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode([tok.BOS, *ids, tok.EOS]) == f"<|bos|>{text}<|eos|>"
    assert tok.vocab_size == 263 and len({tok.PAD, tok.BOS, tok.EOS, tok.END}) == 4


def test_byte_tokenizer_chat_format_and_mask(tmp_path):
    tok = ByteTokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    (ids, trained), = _docs(tmp_path, [{"messages": messages}], tok)
    b = tok
    # <bos> <user> h i <end> <assistant> y o <end> <eos>; trained: the assistant content, its <end>, EOS.
    assert ids == [b.BOS, b.USER, 104, 105, b.END, b.ASSISTANT, 121, 111, b.END, b.EOS]
    assert trained == [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]


def test_text_format_matches_tokenizer_and_trains_everything(tmp_path, hf_dir):
    auto = _auto(hf_dir)
    texts = ["once upon a time there was a dog", "good night"]
    docs = _docs(tmp_path, [{"text": t} for t in texts], HFTokenizer(str(hf_dir)))
    for (ids, trained), text in zip(docs, texts):
        assert ids == auto(text)["input_ids"] + [auto.eos_token_id]  # the tokenizer adds <s> itself
        assert ids[0] == auto.bos_token_id
        assert trained == [1] * len(ids)


def test_prompt_response_masks_the_prompt(tmp_path, hf_dir):
    auto = _auto(hf_dir)
    (ids, trained), = _docs(tmp_path, [{"prompt": "what is two plus two", "response": "four"}], HFTokenizer(str(hf_dir)))
    prompt = auto("what is two plus two")["input_ids"]  # with <s>
    response = auto("four", add_special_tokens=False)["input_ids"]
    assert ids == prompt + response + [auto.eos_token_id]
    assert trained == [0] * len(prompt) + [1] * (len(response) + 1)


def test_chat_trains_assistant_tokens_only(tmp_path, hf_dir):
    auto = _auto(hf_dir)
    (ids, trained), = _docs(tmp_path, [{"messages": CHAT, "id": 7}], HFTokenizer(str(hf_dir)))
    rendered = auto.apply_chat_template(CHAT, tokenize=False)
    assert ids == auto(rendered, add_special_tokens=False)["input_ids"] + [auto.eos_token_id]
    # Independent expectation, token by token: assistant content and its <|end|> are trained.
    expected = [("<s>", 0)]
    for m in CHAT:
        flag = int(m["role"] == "assistant")
        expected += [(f"<|{m['role']}|>", 0)] + [(w, flag) for w in m["content"].split()] + [("<|end|>", flag)]
    expected.append(("</s>", 1))
    assert list(zip(auto.convert_ids_to_tokens(ids), trained)) == expected


def test_train_on_all_trains_every_token(tmp_path, hf_dir):
    tok = HFTokenizer(str(hf_dir))
    records = [{"messages": CHAT}, {"prompt": "hello", "response": "world"}]
    all_docs = _docs(tmp_path, records, tok, train_on="all")
    resp_docs = _docs(tmp_path, records, tok, train_on="response")
    for (ids, trained), (ids_r, trained_r) in zip(all_docs, resp_docs):
        assert ids == ids_r and trained == [1] * len(ids) and 0 in trained_r


def test_chat_that_ends_with_a_user_turn_does_not_train_its_eos(tmp_path, hf_dir):
    messages = CHAT[:3] + [{"role": "user", "content": "thank you"}]
    (ids, trained), = _docs(tmp_path, [{"messages": messages}], HFTokenizer(str(hf_dir)))
    assert trained[-1] == 0 and sum(trained) == len("i am fine".split()) + 1


def test_existing_eos_is_not_doubled(tmp_path, hf_dir):
    (ids, _), = _docs(tmp_path, [{"text": "good night </s>"}], HFTokenizer(str(hf_dir)))
    assert ids[-2:] != [3, 3] and ids.count(_auto(hf_dir).eos_token_id) == 1


def test_vocab_size_check(hf_dir):
    check_vocab_size(ByteTokenizer(), 263)
    with pytest.raises(DataError, match=r"byte tokenizer has 263 tokens but model.vocab_size=200"):
        check_vocab_size(ByteTokenizer(), 200)
    tok = HFTokenizer(str(hf_dir))
    assert tok.vocab_size == len(_auto(hf_dir))
    with pytest.raises(DataError, match=rf"{tok.vocab_size} tokens but model.vocab_size=10; set model.vocab_size >= "):
        load_tokenizer(load_config(None, [f"data.tokenizer={hf_dir}", "model.vocab_size=10"]))
    assert load_tokenizer(load_config(None, [f"data.tokenizer={hf_dir}"])).vocab_size == tok.vocab_size


def test_unloadable_tokenizer_dir_is_one_line(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(DataError, match="cannot load a Hugging Face tokenizer") as err:
        HFTokenizer(str(tmp_path))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("contents, what", [({}, "is an empty directory"),
                                             ({"config.json": "{}"}, "holds no tokenizer files")])
def test_a_directory_without_tokenizer_files_says_so(tmp_path, contents, what):
    for name, text in contents.items():
        (tmp_path / name).write_text(text)
    expected = (f"data.tokenizer={str(tmp_path)!r} {what} (tokenizer.json, tokenizer_config.json, tokenizer.model, "
                "vocab.* ...): give the directory of a Hugging Face tokenizer, e.g. a model's save_pretrained() output")
    with pytest.raises(ConfigError) as err:  # at validation, not transformers' advice to install sentencepiece
        load_config(None, [f"data.tokenizer={tmp_path}"])
    assert str(err.value) == expected
    with pytest.raises(DataError) as err:  # the tools that load a tokenizer directly
        HFTokenizer(str(tmp_path))
    assert str(err.value) == expected


def test_tokenizer_without_chat_template_refuses_messages(tmp_path, hf_dir):
    auto = _auto(hf_dir)
    auto.chat_template = None
    auto.save_pretrained(str(tmp_path / "plain"))
    (tmp_path / "plain" / "chat_template.jinja").unlink(missing_ok=True)
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello"}, {"messages": CHAT}])
    with pytest.raises(DataError, match=rf"^{path}:2: .*no chat_template"):
        read_jsonl(str(path), HFTokenizer(str(tmp_path / "plain")), progress=False, on_error="skip")


def test_tokens_per_second_is_logged(tmp_path):
    lines = []
    read_jsonl(str(write_jsonl(tmp_path / "t.jsonl", [{"text": "abc"}] * 3)), ByteTokenizer(),
               progress=False, log=lines.append)
    assert len(lines) == 1 and "3 documents, 15 tokens" in lines[0] and "tokens/s" in lines[0]
    assert np.isfinite(float(lines[0].split("(")[-1].split()[0].replace(",", "")))


def test_an_export_with_custom_code_in_its_config_loads_without_asking(tmp_path, hf_dir, monkeypatch):
    """(issue 36 item 13) A MiMo export's config.json names custom code (``auto_map``, model_type
    ``mimo``): loading its tokenizer made transformers ask "Do you wish to run the custom code?
    [y/N]" (speculative_generate on a full export). The tokenizer files need no code."""
    import builtins
    import json
    import shutil

    export = tmp_path / "export"
    shutil.copytree(hf_dir, export)
    (export / "config.json").write_text(json.dumps({
        "architectures": ["MiMoForCausalLM"], "model_type": "mimo",
        "auto_map": {"AutoConfig": "configuration_mimo.MiMoConfig"}, "vocab_size": 96}))
    asked = []
    monkeypatch.setattr(builtins, "input", lambda prompt="": asked.append(prompt) or "n")
    tok = HFTokenizer(str(export))
    assert not asked
    text = "hello there"
    assert tok.encode(text) == HFTokenizer(str(hf_dir)).encode(text) == _auto(hf_dir).encode(text,
                                                                                            add_special_tokens=False)
