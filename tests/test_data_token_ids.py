"""Token-id records (issue 39 items 1 and 5): ``input_ids`` + ``loss_mask``/``labels`` and
``prompt_ids``/``response_ids`` train exactly as the text lines they came from, and bad ids get
one ``PATH:LINE: what is wrong`` line each. In process, byte tokenizer, no model."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from bebop_megatron.config import ConfigError, load_config
from bebop_megatron.data import ByteTokenizer, DataError, DataWarning, build_train_dataset
from bebop_megatron.data.jsonl import encode_record, read_jsonl
from tests.helpers.data import write_jsonl

TEXT = [
    {"prompt": "what is two plus two?", "response": "four."},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
                  {"role": "user", "content": "and?"}, {"role": "assistant", "content": "bye"}]},
    {"text": "once upon a time"},
    {"prompt": "q", "response": "a much longer answer than the prompt, so that it spans rows"},
] * 3


def as_token_ids(records, style: str) -> list[dict]:
    """The token-id lines the text lines tokenize to with the byte tokenizer (an independent
    encoding: the byte tokenizer's ids are the UTF-8 bytes, its specials fixed)."""
    tok, out = ByteTokenizer(), []
    for rec in records:
        ids, trained = encode_record(rec, tok, "response")
        if style == "loss_mask":
            out.append({"input_ids": ids, "loss_mask": trained, "logprobs": [-0.5] * len(ids)})
        elif style == "labels":
            out.append({"input_ids": ids, "labels": [i if t else -100 for i, t in zip(ids, trained)]})
        elif "prompt" in rec:  # prompt_ids / response_ids: the split is the text line's own
            head = tok.prefix_ids + tok.encode(rec["prompt"])
            assert ids[: len(head)] == head and not any(trained[: len(head)])
            out.append({"prompt_ids": head, "response_ids": ids[len(head):]})
        else:
            out.append({"input_ids": ids, "loss_mask": trained})
    return out


def test_byte_tokenizer_encoding_is_the_bytes():
    ids, trained = encode_record({"prompt": "ab", "response": "c"}, ByteTokenizer(), "response")
    B = ByteTokenizer
    assert ids == [B.BOS, 97, 98, 99, B.EOS] and trained == [0, 0, 0, 1, 1]


def config(path, seq_length: int = 24, extra=()):
    return load_config(None, [f"data.train_files=[{path}]", f"train.seq_length={seq_length}", "data.seed=5",
                              "model.vocab_size=512", *extra])


def rows(cfg) -> list[dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DataWarning)  # the long answer is truncated in both
        ds = build_train_dataset(cfg, log=lambda _: None, progress=False)
    return [ds.row(i) for i in range(2 * len(ds))]  # two epochs: the reshuffle too


@pytest.mark.parametrize("style", ["loss_mask", "labels", "prompt_response"])
@pytest.mark.parametrize("pack", ["true", "false"])
def test_token_id_lines_give_the_batches_of_their_text_lines(tmp_path, style, pack):
    text = write_jsonl(tmp_path / "text.jsonl", TEXT)
    ids = write_jsonl(tmp_path / "ids.jsonl", as_token_ids(TEXT, style))
    want, got = rows(config(text, extra=[f"data.pack={pack}"])), rows(config(ids, extra=[f"data.pack={pack}"]))
    assert len(want) == len(got) > 4
    for a, b in zip(want, got):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key
    assert sum(float(r["loss_mask"].sum()) for r in got) > 0


def test_token_ids_are_taken_as_they_are():
    # No BOS or EOS added (a truncated response has no EOS), input_ids alone are all trained,
    # ids win over text fields on the same line.
    B = ByteTokenizer
    assert encode_record({"input_ids": [5, 6, 7]}, B(), "response", 512) == ([5, 6, 7], [1, 1, 1])
    assert encode_record({"prompt_ids": [4], "response_ids": [5, 6]}, B(), "response", 512) == ([4, 5, 6], [0, 1, 1])
    rec = {"messages": [{"role": "user", "content": "x"}], "prompt_ids": [1, 2], "response_ids": [3, 4]}
    assert encode_record(rec, B(), "response", 512) == ([1, 2, 3, 4], [0, 0, 1, 1])
    assert encode_record({"input_ids": [5, 6, 7], "loss_mask": [0, 0, 1]}, B(), "all", 512)[1] == [1, 1, 1]


GOOD = {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}
# case -> (bad line, words the message must contain)
BAD = {
    "empty input_ids": ({"input_ids": [], "loss_mask": []}, "field 'input_ids' is empty"),
    "empty response_ids": ({"prompt_ids": [1], "response_ids": []}, "field 'response_ids' is empty"),
    "id out of range": ({"input_ids": [1, 512, 3]}, "input_ids[1]=512 is out of range: ids are 0 .. 511 "
                                                    "(model.vocab_size=512)"),
    "negative id": ({"prompt_ids": [1, -1], "response_ids": [2]}, "prompt_ids[1]=-1 is out of range"),
    "response id out of range": ({"prompt_ids": [1], "response_ids": [2, 9999]}, "response_ids[1]=9999"),
    "mask length mismatch": ({"input_ids": [1, 2, 3], "loss_mask": [0, 1]},
                             "'loss_mask' has 2 entries but 'input_ids' has 3"),
    "labels length mismatch": ({"input_ids": [1, 2, 3], "labels": [-100, 2]}, "'labels' has 2 entries but 'input_ids' has 3"),
    "shifted labels": ({"input_ids": [1, 2, 3], "labels": [2, 3, -100]}, "labels[0]=2 is neither -100 nor input_ids[0]=1"),
    "mask not 0/1": ({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 2]}, "loss_mask[2]=2 must be 0 or 1"),
    "id not an integer": ({"input_ids": [1, "2", 3]}, "input_ids[1] must be an integer, got string"),
    "ids not an array": ({"input_ids": "1 2 3"}, "field 'input_ids' must be an array of integers, got string"),
    "both mask and labels": ({"input_ids": [1, 2], "loss_mask": [1, 1], "labels": [1, 2]}, "both 'loss_mask' and 'labels'"),
    "both id formats": ({"input_ids": [1, 2], "response_ids": [1]}, "has both 'input_ids' and 'prompt_ids/response_ids'"),
    "missing response_ids": ({"prompt_ids": [1, 2]}, "missing field 'response_ids'"),
    # (issue 48 item 16) Token ids have neither tokenization nor a chat template: the message said to check them.
    "nothing trained": ({"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]},
                        "'loss_mask' is 0 everywhere: this line trains no token (1 marks the tokens to train)"),
    "labels all ignored": ({"input_ids": [1, 2, 3], "labels": [-100, -100, -100]},
                           "'labels' is -100 everywhere: this line trains no token"),
    "first token only": ({"input_ids": [1, 2, 3], "loss_mask": [1, 0, 0]},
                         "'loss_mask' marks only the first token, which is never trained (nothing before it "
                         "predicts it): this line trains no token"),
    "one token": ({"prompt_ids": [], "response_ids": [7]},
                  "'prompt_ids' + 'response_ids' holds a single token, and a row's first token is never trained"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_token_id_line_is_one_path_line_error(tmp_path, case):
    line, words = BAD[case]
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, "", line, GOOD])
    with pytest.raises(DataError) as err:
        read_jsonl(str(path), ByteTokenizer(), progress=False, vocab_size=512)
    message = str(err.value)
    assert message.startswith(f"{path}:3: ") and words in message and "\n" not in message, message
    assert "tokenization" not in message and "template" not in message, message


def test_bad_token_id_lines_are_skipped_and_counted(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [GOOD, BAD["id out of range"][0], BAD["empty input_ids"][0], GOOD])
    with pytest.warns(DataWarning, match=r"skipped 2 of 4 lines.*1 empty ids \(first: line 3\), "
                                         r"1 id out of range \(first: line 2\)"):
        docs = read_jsonl(str(path), ByteTokenizer(), on_error="skip", progress=False, vocab_size=512)
    assert len(docs) == 2


def test_ids_are_checked_against_model_vocab_size_in_the_builder(tmp_path):
    path = write_jsonl(tmp_path / "ids.jsonl", [GOOD, {"input_ids": [1, 600, 2]}])
    with pytest.raises(DataError, match=rf"^{path}:2: input_ids\[1\]=600 is out of range: ids are 0 .. 511 "
                                        r"\(model.vocab_size=512\)$"):
        build_train_dataset(config(path), log=lambda _: None, progress=False)
    # Within a larger model vocabulary the same line trains (the byte tokenizer's 263 ids do not bound them).
    cfg = load_config(None, [f"data.train_files=[{path}]", "train.seq_length=8", "model.vocab_size=1024"])
    assert len(build_train_dataset(cfg, log=lambda _: None, progress=False)) >= 1


def test_data_format_is_checked():
    with pytest.raises(ConfigError, match=r"data.format='nemo' must be one of auto, generic, verl, openrlhf, slime"):
        load_config(None, ["data.format=nemo"])


def test_fingerprint_covers_token_id_files_and_the_format_key(tmp_path):
    """Resume's data record (``common["train_data"]``) fingerprints the file's bytes, whatever its
    layout: a token-id file rewritten with other ids under the same name is noticed; a resume
    with another ``data.format`` is refused as a change of the data keys."""
    from bebop_megatron.training.fingerprint import data_record
    from bebop_megatron.training.resume import DATA_KEYS

    path = write_jsonl(tmp_path / "ids.jsonl", [GOOD])
    before = data_record([str(path)])
    write_jsonl(path, [{"input_ids": [1, 2, 4], "loss_mask": [0, 1, 1]}])  # same size, one id changed
    after = data_record([str(path)])
    assert set(before) == {str(path)} and before[str(path)] and before != after
    assert "data.format" in DATA_KEYS
    from omegaconf import OmegaConf

    from bebop_megatron.training.resume import compare_configs

    saved = OmegaConf.to_container(OmegaConf.structured(load_config(None, ["data.format=auto"])))
    refused, _ = compare_configs(saved, load_config(None, ["data.format=slime"]))
    assert refused == ["data.format 'auto' -> 'slime'"]


def test_retokenize_study_classifies_the_first_difference():
    """benchmarks/real_model/retokenize_study.py's classification, on hand-made id sequences
    (prompt of 3 ids; 9 is a special token)."""
    import importlib.util

    from tests.helpers.launch import REPO

    spec = importlib.util.spec_from_file_location("retokenize_study", REPO / "benchmarks" / "real_model" / "retokenize_study.py")
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    sampled, specials = [1, 2, 3, 4, 5, 9], {9}
    assert study.classify(sampled, 3, sampled + [7, 9], specials) == "round-trips"  # the template's tail after it
    assert study.classify(sampled, 3, [1, 2, 3, 45, 9], specials) == "boundary"  # 4 and 5 merged at the boundary
    assert study.classify(sampled, 3, [1, 2, 3, 4, 6, 9], specials) == "mid-text"
    assert study.classify(sampled, 3, [1, 2, 3, 4, 5, 8], specials) == "special"  # a dropped special token
    assert study.classify(sampled, 3, [1, 2, 8, 4, 5, 9], specials) == "prompt"
