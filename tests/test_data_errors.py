"""Bad input: one ``PATH:LINE: what is wrong`` per case, ``on_error: skip`` counts, config checks, CLI."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

from bebop_megatron.config import ConfigError, load_config
from bebop_megatron.data import ByteTokenizer, DataError, DataWarning, HFTokenizer
from bebop_megatron.data.jsonl import read_jsonl, tokenize_jsonl
from tests.helpers.data import write_jsonl
from tests.helpers.launch import REPO

GOOD = [{"text": "fine"}, {"prompt": "q", "response": "a"}]
USER = {"role": "user", "content": "hi"}

# case -> (bad line, reason key counted by on_error=skip, words the message must contain)
BAD = {
    # the column in the line (the decoder's "line 2 column 1" counted the line's own newline)
    "malformed json": ('{"text": "a"', "malformed JSON",
                       "malformed JSON: Expecting ',' delimiter at column 13 (the end of the line)"),
    "trailing garbage": ('{"text": "a"} x', "malformed JSON", "malformed JSON: Extra data at column 15"),
    "missing comma": ('{"text": "a" "b": 1}', "malformed JSON", "malformed JSON: Expecting ',' delimiter at column 14"),
    "not an object": ("[1, 2]", "not a JSON object", "expected a JSON object, got array"),
    "unknown format": ('{"content": "a"}', "unknown format",
                       "no 'messages', 'prompt'/'response', 'text', 'input_ids' or 'prompt_ids'/'response_ids' field"),
    "two formats": ('{"text": "a", "prompt": "b", "response": "c"}', "ambiguous format", "has both"),
    "missing response": ('{"prompt": "a"}', "missing field", "missing field 'response'"),
    "missing prompt": ('{"response": "a"}', "missing field", "missing field 'prompt'"),
    "response not a string": ('{"prompt": "a", "response": 3}', "wrong type", "'response' must be a string, got number"),
    "text null": ('{"text": null}', "wrong type", "'text' must be a string, got null"),
    "messages not a list": ('{"messages": "hi"}', "wrong type", "'messages' must be an array, got string"),
    "message not an object": ('{"messages": ["hi"]}', "wrong type", "messages[0] must be an object"),
    "message without content": ('{"messages": [{"role": "user"}]}', "missing field", "messages[0]: missing field 'content'"),
    "content not a string": ('{"messages": [{"role": "assistant", "content": ["x"]}]}', "wrong type",
                             "messages[0]: field 'content' must be a string, got array"),
    "empty response": ('{"prompt": "a", "response": "  "}', "empty response", "'response' is empty"),
    "empty text": ('{"text": ""}', "empty text", "'text' is empty"),
    "empty messages": ('{"messages": []}', "no assistant message", "'messages' is empty"),
    "no assistant message": ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message",
                             "no assistant message"),
    "empty assistant message": ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}',
                                "empty response", "messages[1] is an assistant message with empty content"),
    "unknown role (byte chat format)": ('{"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", '
                                        '"content": "y"}]}', "unknown role", "messages[0].role='tool'"),
    "invalid utf-8": (b'{"text": "caf\xe9"}', "invalid UTF-8", "not valid UTF-8: byte 0xe9 at column 14"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_line_is_one_path_line_error(tmp_path, case):
    line, _, words = BAD[case]
    path = write_jsonl(tmp_path / "bad.jsonl", GOOD + ["", line] + GOOD)  # a blank line: line numbers count it
    with pytest.raises(DataError) as err:
        read_jsonl(str(path), ByteTokenizer(), progress=False)
    message = str(err.value)
    assert message.startswith(f"{path}:4: ") and words in message, message
    assert "\n" not in message


def test_skip_counts_every_reason_and_warns_once(tmp_path):
    lines = [BAD[c][0] for c in BAD]
    path = write_jsonl(tmp_path / "mixed.jsonl", [*GOOD, *lines, *GOOD])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        emitted = []
        stats = tokenize_jsonl(str(path), ByteTokenizer(), lambda t, m: emitted.append(t), on_error="skip",
                               progress=False, log=lambda s: None)
    expected = {}
    for _, reason, _ in BAD.values():
        expected[reason] = expected.get(reason, 0) + 1
    assert stats.skipped == expected
    assert stats.num_documents == len(emitted) == 2 * len(GOOD)
    assert stats.num_lines == 2 * len(GOOD) + len(BAD)
    ours = [w for w in caught if issubclass(w.category, DataWarning)]
    assert len(ours) == 1
    text = str(ours[0].message)
    assert f"skipped {len(BAD)} of {stats.num_lines} lines" in text
    assert "3 malformed JSON (first: line 3)" in text and "1 invalid UTF-8" in text


def test_chat_template_failures_are_line_errors(tmp_path, hf_dir):
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    raising = "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
    # Marks the last message, so a prefix renders differently than inside the whole conversation.
    unstable = "{% for m in messages %}{% if loop.last %}[last] {% endif %}"
    rest = auto.chat_template.split("{% for m in messages %}", 1)[1]
    good = {"messages": [USER, {"role": "assistant", "content": "fine"}]}
    tool = {"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "fine"}]}
    for name, head, bad, words in [("raising", raising, tool, "the chat template failed: no tools here"),
                                   ("unstable", unstable, good, "renders messages[:2] differently")]:
        auto.chat_template = head + rest
        auto.save_pretrained(str(tmp_path / name))
        path = write_jsonl(tmp_path / f"{name}.jsonl", [{"text": "hello"}, bad])
        with pytest.raises(DataError) as err:
            read_jsonl(str(path), HFTokenizer(str(tmp_path / name)), progress=False)
        assert str(err.value).startswith(f"{path}:2: ") and words in str(err.value), str(err.value)
    with pytest.warns(DataWarning, match="1 chat template error"):
        docs = read_jsonl(str(write_jsonl(tmp_path / "t.jsonl", [good, tool])), HFTokenizer(str(tmp_path / "raising")),
                          on_error="skip", progress=False)
    assert len(docs) == 1


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_blank_file_is_an_error_even_with_skip(tmp_path, content):
    path = tmp_path / "blank.jsonl"
    path.write_bytes(content)
    for on_error in ("fail", "skip"):
        with pytest.raises(DataError, match=rf"^{path}:1: the file has no JSON lines"):
            read_jsonl(str(path), ByteTokenizer(), on_error=on_error, progress=False)


def test_all_lines_skipped_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "allbad.jsonl", ["{", "[]"])
    with pytest.warns(DataWarning, match="skipped 2 of 2 lines"):
        with pytest.raises(DataError, match=rf"^{path}:1: no usable line \(all 2 lines were skipped\)"):
            read_jsonl(str(path), ByteTokenizer(), on_error="skip", progress=False)


def test_byte_order_mark_and_crlf_are_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "a"}\r\n{"text": "b"}\r\n')
    assert len(read_jsonl(str(path), ByteTokenizer(), progress=False)) == 2


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["data.train_files=[nope.jsonl]"], "data.train_files[0]='nope.jsonl': no such file"),
        (["data.valid_files=[nope.bin]"], "data.valid_files[0]='nope.bin': indexed dataset file 'nope.bin' not found"),
        (["data.train_on=prompt"], "data.train_on='prompt' must be one of response, all"),
        (["data.on_error=ignore"], "data.on_error='ignore' must be one of fail, skip"),
        (["data.overlong=wrap"], "data.overlong='wrap' must be one of truncate, drop"),
        (["data.tokenizer=/no/such/dir"], "data.tokenizer='/no/such/dir' is not a directory"),
        (["data.num_samples=0"], "data.num_samples=0 must be >= 1"),
    ],
)
def test_config_errors_name_the_field(overrides, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_config_source_entries(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", GOOD)
    cases = {
        f"[{{path: {a}, weight: 0}}]": "data.train_files[0].weight=0 must be a number > 0",
        f"[{{path: {a}, weight: abc}}]": "data.train_files[0].weight='abc' must be a number > 0",
        f"[{{path: {a}, weight: 1}}, {a}]": "data.train_files[1]: give a weight for every entry",
        f"[{{path: {a}, wieght: 1}}]": "data.train_files[0]: unknown key 'wieght'",
        "[{weight: 1}]": "data.train_files[0]: missing 'path'",
        f"[{tmp_path}]": "is a directory",
    }
    for value, words in cases.items():
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"data.train_files={value}"])
        assert words in str(err.value), (value, str(err.value))
    cfg = load_config(None, [f"data.train_files=[{{path: {a}, weight: 2}}, {{path: {a}, weight: 0.5}}]"])
    assert cfg.data.train_files[1] == {"path": str(a), "weight": 0.5}


# --------------------------------------------------------------------------- CLI


def _tool(*args, cwd=REPO):
    return subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_preprocess_cli_bad_input_is_one_line_and_exit_2(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", ['{"prompt": "a"}', *GOOD])
    proc = _tool("--input", str(path), "--output-prefix", str(tmp_path / "out"), "--no-progress")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {path}:1: missing field 'response'"], proc.stderr
    assert not list(tmp_path.glob("out*"))  # nothing half-written


def test_preprocess_cli_help_and_missing_input(tmp_path):
    proc = _tool("--help")
    assert proc.returncode == 0
    for flag in ("--input", "--output-prefix", "--tokenizer", "--train-on", "--on-error", "_lossmask"):
        assert flag in proc.stdout
    from bebop_megatron.data.preprocess import preprocess

    with pytest.raises(DataError, match=rf"^--input {tmp_path / 'none.jsonl'}: no such file$"):
        preprocess([str(tmp_path / "none.jsonl")], str(tmp_path / "o"))


def test_preprocess_cli_prefix_ending_in_slash_is_one_line(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", GOOD)
    prefix = f"{tmp_path / 'out'}/"  # it used to fail writing 'out/.partial.bin' with a traceback
    proc = _tool("--input", str(path), "--output-prefix", prefix, "--no-progress")
    assert proc.returncode == 2, proc.stderr
    example = tmp_path / "out" / "train"
    assert proc.stderr.splitlines() == [
        f"error: --output-prefix '{prefix}' ends in '/': it is the start of the file names, e.g. {example} writes "
        f"{example}.bin/.idx, {example}_lossmask.bin/.idx and {example}_meta.json"], proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_preprocess_unwritable_prefix_names_it_before_tokenizing(tmp_path):
    """Root ignores permission bits: a prefix under a file, and one on a read-only mount."""
    from bebop_megatron.data.preprocess import preprocess

    path = write_jsonl(tmp_path / "in.jsonl", GOOD)
    (tmp_path / "a_file").write_text("")
    prefix = str(tmp_path / "a_file" / "sub" / "train")
    with pytest.raises(DataError) as err:
        preprocess([str(path)], prefix, progress=False)
    assert str(err.value) == (f"--output-prefix {prefix}: cannot create the directory {tmp_path / 'a_file' / 'sub'}: "
                              f"{tmp_path / 'a_file'} is a file")
    with pytest.raises(DataError, match=r"^--output-prefix /proc/bebop/train: cannot write in /proc \("):
        preprocess([str(path)], "/proc/bebop/train", progress=False)


def test_preprocess_refuses_an_input_it_would_replace(tmp_path):
    """(issue 36 item 12) ``--input P.bin --output-prefix P --overwrite`` replaced its own input."""
    from bebop_megatron.data.preprocess import preprocess

    prefix = tmp_path / "train"
    for name in ("train.bin", "train_meta.json"):
        inputs = [str(write_jsonl(tmp_path / "in.jsonl", GOOD)), str(write_jsonl(tmp_path / name, GOOD))]
        before = (tmp_path / name).read_bytes()
        with pytest.raises(DataError) as err:
            preprocess(inputs, str(prefix), progress=False, overwrite=True)
        assert str(err.value) == (f"--input {inputs[1]} is one of the files --output-prefix {prefix} writes "
                                  f"({tmp_path / name}); choose another prefix")
        assert (tmp_path / name).read_bytes() == before
