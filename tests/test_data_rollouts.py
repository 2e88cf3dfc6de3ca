"""Readers of the RL frameworks' rollout dumps (issue 39 item 3), each against a fixture this
project writes in that framework's layout (docs/data.md names the sources):

- verl's rollout dump (``trainer.rollout_data_dir``, ``RayPPOTrainer._dump_generations``): JSONL
  ``{"input", "output", "gts", "score", "step", ...reward extras}``, decoded texts.
- verl's Parquet datasets: ``data_source``, ``prompt`` (a list of ``{role, content}``), ``ability``,
  ``reward_model`` and ``extra_info`` structs (+ a ``response`` column to train on).
- OpenRLHF's ``openrlhf.cli.batch_inference`` output: JSONL ``{"input": rendered prompt, "output":
  text with the stop string}`` (+ ``reward`` after the reward model).
- slime's ``--save-debug-rollout-data`` file: ``torch.save({"rollout_id", "samples":
  [Sample.to_dict(), ...]})`` with ``tokens`` (prompt + response ids), ``response_length``,
  ``loss_mask`` (over the response, or None), ``rollout_log_probs``, ``status`` ...

Each is compared with the generic record it stands for (an independent path: the text or
token-id lines of tests/test_data_token_ids.py), and the detection is logged in one line.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bebop_megatron.config import load_config
from bebop_megatron.data import ByteTokenizer, DataError, HFTokenizer, build_train_dataset
from bebop_megatron.data.jsonl import read_jsonl
from tests.helpers.data import write_jsonl

B = ByteTokenizer


def same(a, b) -> bool:
    return all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("tokens", "trained", "offsets"))


def read(path, log=None, **kwargs):
    return read_jsonl(str(path), kwargs.pop("tokenizer", ByteTokenizer()), progress=False,
                      log=log if log is not None else (lambda _: None), **kwargs)


def verl_dump() -> list[dict]:
    return [{"input": f"user: what is {i} + {i}?\nassistant:", "output": f" it is {2 * i}.", "gts": str(2 * i),
             "score": float(i % 2), "step": 7, "acc": bool(i % 2)} for i in range(4)]


def test_verl_rollout_dump_reads_as_prompt_response(tmp_path):
    path = write_jsonl(tmp_path / "7.jsonl", verl_dump())
    lines = []
    got = read(path, log=lines.append)
    want = read(write_jsonl(tmp_path / "pr.jsonl", [{"prompt": r["input"], "response": r["output"]} for r in verl_dump()]))
    assert same(got, want)
    assert lines[0] == f"{path}: a verl rollout dump (input/output texts) (detected)"
    # An explicit data.format=generic reads it as this project's lines: no such field.
    with pytest.raises(DataError, match=rf"^{path}:1: no 'messages', 'prompt'/'response', 'text'"):
        read(path, data_format="generic")


def verl_parquet_rows(with_response: bool) -> list[dict]:
    rows = []
    for i in range(3):
        row = {"data_source": "openai/gsm8k",
               "prompt": [{"role": "user", "content": f"what is {i} + 1?"}],
               "ability": "math",
               "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
               "extra_info": {"split": "train", "index": i}}
        if with_response:
            row["response"] = f"it is {i + 1}"
        rows.append(row)
    return rows


def test_verl_parquet_dataset_trains_as_conversations(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed")
    import pyarrow as pa

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_parquet_rows(True)), str(path))
    want = [{"messages": [*r["prompt"], {"role": "assistant", "content": r["response"]}]} for r in verl_parquet_rows(True)]
    assert same(read(path), read(write_jsonl(tmp_path / "chat.jsonl", want)))
    # verl's RL prompt set (no responses): one line saying what to do.
    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist(verl_parquet_rows(False)), str(prompts))
    with pytest.raises(DataError) as err:
        read(prompts)
    assert str(err.value) == (f"{prompts}: row 0: missing field 'response' (a 'prompt' of messages without a response "
                              "is a prompt set: generate responses with tools/generate_responses.py)")


def test_openrlhf_batch_inference_output(tmp_path, hf_dir):
    tok = HFTokenizer(str(hf_dir))
    rendered = [tok._render([{"role": "user", "content": w}], True) for w in ("hello", "what is two")]
    dump = [{"input": rendered[0], "output": "fine thank you <|end|> </s>"},
            {"input": rendered[1], "output": "four", "reward": 0.5}]
    path = write_jsonl(tmp_path / "out.jsonl", dump)
    lines = []
    docs = read(path, log=lines.append, tokenizer=tok)
    assert lines[0] == f"{path}: an OpenRLHF batch_inference output (input/output texts) (detected)"
    for j, rec in enumerate(dump):
        head, tail = tok.encode(rec["input"]), tok.encode(rec["output"])
        assert head[0] == tok.prefix_ids[0]  # the rendered prompt has its BOS: not doubled
        want = head + tail + ([] if tail[-1] == tok.eos_id else [tok.eos_id])
        tokens, trained = docs.get(j)
        assert tokens.tolist() == want
        assert trained.tolist() == [0] * len(head) + [1] * (len(want) - len(head))


def slime_samples() -> list[dict]:
    samples = []
    for i in range(4):
        prompt, response = [B.BOS, 65 + i, 66], [67, 68 + i, 69, B.EOS]
        samples.append({
            "group_index": i // 2, "index": i, "prompt": "AB", "tokens": prompt + response, "response": "CDE",
            "response_length": len(response), "label": "x", "reward": 1.0,
            # a multi-turn sample masks a tool output inside the response; None: all trained
            "loss_mask": [1, 0, 1, 1] if i == 1 else None,
            "rollout_log_probs": [-0.5] * len(response), "status": "completed", "metadata": {},
            "spec_info": {"spec_accept_token_num": 0}, "prefix_cache_info": {"cached_tokens": 0},
        })
    return samples


def test_slime_rollout_dump(tmp_path):
    path = tmp_path / "rollout_3.pt"
    torch.save({"rollout_id": 3, "samples": slime_samples()}, path)
    lines = []
    got = read(path, log=lines.append)
    assert lines[0] == f"{path}: a slime rollout dump (tokens, response_length, loss_mask) (detected)"
    generic = []
    for s in slime_samples():
        p = len(s["tokens"]) - s["response_length"]
        generic.append({"input_ids": s["tokens"], "loss_mask": [0] * p + (s["loss_mask"] or [1] * s["response_length"])})
    assert same(got, read(write_jsonl(tmp_path / "ids.jsonl", generic)))
    assert got.get(1)[1].tolist() == [0, 0, 0, 1, 0, 1, 1]
    # Trains through the builder with data.format=slime named explicitly.
    cfg = load_config(None, [f"data.train_files=[{path}]", "train.seq_length=8", "data.format=slime"])
    assert len(build_train_dataset(cfg, log=lambda _: None, progress=False)) >= 2


@pytest.mark.parametrize("case", ["mask length", "response_length", "not a dump"])
def test_bad_slime_dump_is_one_line(tmp_path, case):
    path = tmp_path / "bad.pt"
    samples = slime_samples()
    if case == "mask length":
        samples[2]["loss_mask"] = [1, 1]
        words = f"{path}: samples[2]: 'loss_mask' has 2 entries but response_length is 4"
    elif case == "response_length":
        samples[0]["response_length"] = 99
        words = f"{path}: samples[0]: response_length=99 must be an integer in 1 .. len(tokens)=7"
    torch.save(samples if case == "not a dump" else {"rollout_id": 0, "samples": samples}, path)
    if case == "not a dump":
        words = f"{path}: not a slime rollout dump (a dict with a 'samples' list"
    with pytest.raises(DataError) as err:
        read(path)
    assert str(err.value).startswith(words) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("content, start", [(b'{"text": "hello"}\n{"text": "world"}\n', "{"),
                                            (b'\xef\xbb\xbf\n  [{"role": "user"}]\n', "[")])
def test_jsonl_named_pt_is_one_line_saying_it_is_text(tmp_path, content, start):
    """(issue 48 item 17) JSON lines in a file named x.pt: torch.load's error advised re-running with
    weights_only=False (which runs a file's code); now one line says the file is text."""
    path = tmp_path / "x.pt"
    path.write_bytes(content)
    with pytest.raises(DataError) as err:
        read(path)
    assert str(err.value) == (f"{path}: named like a torch file (a slime rollout dump) but it is text starting with "
                              f"'{start}' (JSON lines?); a file is read by its extension: rename it to .jsonl")
    path.write_bytes(b"\x80\x02not a torch file")  # neither text nor torch: still no weights_only advice
    with pytest.raises(DataError) as err:
        read(path)
    message = str(err.value)
    assert message.startswith(f"{path}: cannot load it as a torch file (a slime rollout dump): ") and \
        "weights_only=False" not in message and "\n" not in message, message
    path.rename(tmp_path / "x.jsonl")  # the way out the line gives: the same content trains as JSON lines
    (tmp_path / "x.jsonl").write_bytes(content.replace(b'[{"role": "user"}]', b'{"text": "hi"}'))
    assert len(read(tmp_path / "x.jsonl")) >= 1


def test_a_head_trains_from_token_ids_in_parquet_as_from_text(tmp_path):
    """End to end: the trainer (examples/pretrain_mtp.py, 3 steps, TP=1) on token-id records in a
    Parquet file logs the losses of the same run on the text lines they came from."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.helpers.cli_batch import run_batch
    from tests.helpers.launch import REPO
    from tests.test_data_token_ids import TEXT, as_token_ids

    text = write_jsonl(tmp_path / "text.jsonl", TEXT)
    ids = tmp_path / "ids.parquet"
    pq.write_table(pa.Table.from_pylist(as_token_ids(TEXT, "loss_mask")), ids)
    common = ["--config", str(REPO / "examples" / "configs" / "tiny_jsonl_cpu.yaml"), "parallel.tensor=1",
              "train.steps=3", "model.backbone_init=random", "data.valid_files=[]", "save.interval=0"]
    calls = [{"tool": "pretrain_mtp", "argv": [*common, f"data.train_files=[{path}]", f"save.dir={tmp_path / name}",
                                               f"logging.metrics_file={tmp_path / name}.jsonl"]}
             for name, path in (("text", text), ("ids", ids))]
    for proc in run_batch(calls, tmp_path / "batch"):
        assert proc.returncode == 0, proc.stderr[-3000:]
    losses = {name: [json.loads(line)["train/loss"] for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()
                     if "train/loss" in line] for name in ("text", "ids")}
    assert len(losses["text"]) == 3 and losses["ids"] == losses["text"]
