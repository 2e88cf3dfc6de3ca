"""Prompt lines of ``tools/speculative_generate.py`` and ``tools/generate_responses.py``
(``bebop_megatron.data.generate.read_prompts``): one rule for a data line's answer.

- speculative_generate takes a data file as its prompts (the held-out file of the README's
  command): the ``response`` of a ``prompt``/``response`` line and the trailing assistant
  message of a ``messages`` line are both dropped (the latter used to be refused);
- generate_responses refuses both (a carried ``response`` field made output lines with both
  ``messages`` and ``response``, which the trainer refuses as ambiguous).
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from bebop_megatron.data.errors import DataError
from bebop_megatron.data.generate import read_prompts
from tests.helpers.launch import REPO

HELD_OUT = REPO / "examples" / "data" / "tiny_valid.jsonl"


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_a_data_file_reads_as_its_prompts(tmp_path):
    user = {"role": "user", "content": "What is one plus two?"}
    rows = [{"prompt": "Count to two.", "response": "one, two.", "source": "s"},
            {"messages": [user, {"role": "assistant", "content": "Three."}]},
            {"messages": [{"role": "system", "content": "be brief"}, {"role": "assistant", "content": "x"},
                          user, {"role": "assistant", "content": "3"}]}]
    prompts = read_prompts(write_jsonl(tmp_path / "data.jsonl", rows), drop_response=True).prompts
    assert [p.messages for p in prompts] == [[{"role": "user", "content": "Count to two."}], [user],
                                             rows[2]["messages"][:3]]
    assert prompts[0].extra == {"source": "s"}
    # the same ids as the prompts alone: a data file and its prompts file name the same prompts
    alone = read_prompts(write_jsonl(tmp_path / "alone.jsonl", [{"prompt": "Count to two."}, {"messages": [user]}]))
    assert [p.id for p in alone.prompts] == [p.id for p in prompts[:2]]

    only = write_jsonl(tmp_path / "only.jsonl", [{"messages": [{"role": "assistant", "content": "hi"}]}])
    with pytest.raises(DataError, match=r"only\.jsonl:1: 'messages' holds only an assistant message"):
        read_prompts(only, drop_response=True)


def test_speculative_generate_reads_the_held_out_file_whole(monkeypatch):
    """The README's command (--prompts examples/data/tiny_valid.jsonl) stopped at its first
    `messages` line; the tool is stopped right after reading its prompts (no model needed)."""
    import bebop_megatron.data.generate as generate
    import bebop_megatron.speculative.session as session

    class Read(Exception):
        pass

    def read(*args, **kwargs):
        raise Read(generate.read_prompts.__wrapped__(*args, **kwargs))

    read.__wrapped__ = generate.read_prompts
    monkeypatch.setattr(generate, "read_prompts", read)
    monkeypatch.setattr(session, "resolve_checkpoint", lambda path: None)
    spec = importlib.util.spec_from_file_location("speculative_generate", REPO / "tools" / "speculative_generate.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    with pytest.raises(Read) as excinfo:
        tool.main(["--checkpoint", "unused", "--prompts", str(HELD_OUT)])
    prompt_set = excinfo.value.args[0]
    lines = [line for line in HELD_OUT.read_text().splitlines() if line.strip()]
    assert len(prompt_set.prompts) + prompt_set.num_duplicates == len(lines)  # repeated prompts are read once
    assert any("messages" in json.loads(line) for line in lines)
    assert all(p.messages[-1]["role"] == "user" for p in prompt_set.prompts)


@pytest.mark.parametrize("row, message", [
    ({"prompt": "a", "response": "b"}, "field 'response' is an answer: a prompts line has none"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, "nothing to respond to"),
])
def test_generate_responses_refuses_an_answer(tmp_path, row, message):
    path = write_jsonl(tmp_path / "p.jsonl", [row])
    with pytest.raises(DataError) as excinfo:
        read_prompts(path)
    assert str(excinfo.value).startswith(f"{path}:1: ") and message in str(excinfo.value)
