"""The trainer on real data: packed rows, the validation pass, and clean data errors."""

from __future__ import annotations

import json
import random

import pytest

from bebop_megatron.config import ConfigError, load_config
from bebop_megatron.training.trainer import check_packing
from tests.helpers.data import write_jsonl
from tests.helpers.cli_batch import run_batch
from tests.helpers.launch import run_script

WORDS = "the cat sat on a mat and then it ran to the big red barn where a cow was eating hay".split()
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "train.seq_length=96"]


def documents(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    words = lambda lo, hi: " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))  # noqa: E731
    return [{"prompt": words(3, 8), "response": words(5, 20)} for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    return write_jsonl(root / "train.jsonl", documents(60, 0)), write_jsonl(root / "valid.jsonl", documents(12, 1))


def packed_case(train, nproc: int, extra=()) -> dict:
    proc = run_script("packed_case.py", [f"data.train_files=[{train}]", *SMALL, *extra], nproc=nproc)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def cli_args(args) -> list[str]:
    return ["parallel.tensor=1", "save.dir=null", *args]


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """The single-process cases of this file in one process (``tests/helpers/cli_batch.py``, each
    as its ``__main__`` runs it): ``packed_case.py`` (dense and Qwen hybrid) and the training
    runs of ``examples/pretrain_mtp.py``. A process each would import torch and Megatron again."""
    d = tmp_path_factory.mktemp("runs")
    train, valid = corpus
    bad = write_jsonl(d / "bad.jsonl", [*documents(2, 0), '{"prompt": "hi", "response": '])
    long_prompts = write_jsonl(d / "long_prompts.jsonl", truncated_documents(6))
    calls = {
        "packed_tp1": ("tests/helpers/packed_case.py", [f"data.train_files=[{train}]", *SMALL]),
        "packed_gdn": ("tests/helpers/packed_case.py", [f"data.train_files=[{train}]", *SMALL, *QWEN_HYBRID]),
        "jsonl_eval": ("examples/pretrain_mtp.py", cli_args([f"data.train_files=[{train}]",
                                                            f"data.valid_files=[{valid}]", "eval.interval=2",
                                                            "train.steps=4", "train.lr=3e-3", *SMALL])),
        "bad_line": ("examples/pretrain_mtp.py", cli_args([f"data.train_files=[{bad}]", *SMALL])),
        "truncated": ("examples/pretrain_mtp.py", cli_args([f"data.train_files=[{long_prompts}]", *SMALL,
                                                           "train.seq_length=16", "train.steps=1"])),
    }
    results = run_batch([{"tool": tool, "argv": argv} for tool, argv in calls.values()], d / "batch")
    return dict(zip(calls, results)), {"bad": bad, "long_prompts": long_prompts}


def case_result(proc) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def packed_tp1(runs):
    return case_result(runs[0]["packed_tp1"])


def test_packed_rows_equal_documents_alone(packed_tp1):
    r = packed_tp1
    assert r["documents"] >= 4
    packed, separate, unmasked = r["packed"], r["separate"], r["unmasked"]
    # Chains stop at document ends: the same positions count in both.
    assert packed["count"] == separate["count"]
    assert rel(packed["loss_sum"], separate["loss_sum"]) < 1e-5
    for key in ("alpha_rs", "accept_len_rs"):
        for a, b in zip(packed[key], separate[key]):
            assert rel(a, b) < 1e-5, key
    # Without the per-document mask attention crosses documents and the loss changes by far more.
    assert rel(unmasked["loss_sum"], separate["loss_sum"]) > 100 * max(rel(packed["loss_sum"], separate["loss_sum"]), 1e-7)


def test_packed_rows_tp2_sequence_parallel_equal_tp1(corpus, packed_tp1):
    r = packed_case(corpus[0], 2, ["parallel.tensor=2", "parallel.sequence_parallel=true"])
    assert r["packed"]["count"] == packed_tp1["packed"]["count"]
    assert rel(r["packed"]["loss_sum"], packed_tp1["packed"]["loss_sum"]) < 1e-5
    assert rel(r["packed"]["loss_sum"], r["separate"]["loss_sum"]) < 1e-5


QWEN_HYBRID = ["model.layer_types=[linear_attention,full_attention]", "model.attention_output_gate=true",
               "model.zero_centered_norms=true", "model.qk_layernorm=true", "model.kv_channels=16",
               "model.rotary_percent=0.25", "model.linear_key_head_dim=8", "model.linear_value_head_dim=8",
               "model.linear_num_key_heads=2", "model.linear_num_value_heads=4"]


def test_packed_rows_gated_deltanet_equal_documents_alone(runs):
    """Qwen3-Next / Qwen3.5 hybrid: the Gated DeltaNet restarts its convolution and recurrent
    state at every packed document (model/hybrid.py), so each document gets the loss it gets
    alone; without the per-document mask (state and attention cross documents) it does not."""
    r = case_result(runs[0]["packed_gdn"])
    packed, separate, unmasked = r["packed"], r["separate"], r["unmasked"]
    assert r["documents"] >= 4 and packed["count"] == separate["count"]
    assert rel(packed["loss_sum"], separate["loss_sum"]) < 1e-6
    for a, b in zip(packed["alpha_rs"], separate["alpha_rs"]):
        assert rel(a, b) < 1e-5
    assert rel(unmasked["loss_sum"], separate["loss_sum"]) > 100 * max(rel(packed["loss_sum"], separate["loss_sum"]), 1e-7)


def test_training_on_jsonl_with_periodic_evaluation(runs):
    proc = runs[0]["jsonl_eval"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    evals = [line for line in lines if line.startswith("eval ")]
    assert [line.split()[1] for line in evals] == ["2", "4"], proc.stdout
    losses = [float(line.split("|")[2].split()[1]) for line in evals]
    assert losses[1] < losses[0], evals  # the held-out loss falls while training
    assert all("alpha_TO [" in line and "E[L] RS [" in line for line in evals)


def test_bad_line_stops_before_training_with_path_and_line(runs):
    proc, bad = runs[0]["bad_line"], runs[1]["bad"]
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{bad}:3:" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and "step " not in proc.stdout


def test_packed_data_with_transformer_engine_is_refused():
    cfg = load_config(overrides=[])
    cfg.data.train_files = ["x.jsonl"]
    with pytest.raises(ConfigError, match="data.pack=false"):
        check_packing(cfg, use_te=True)
    check_packing(cfg, use_te=False)
    cfg.data.pack = False
    check_packing(cfg, use_te=True)


# ------------------------------------------------------------------ runs with nothing to train on (issue 26, item 4)


@pytest.mark.parametrize("seq_length", [1, 3])
def test_rows_no_longer_than_the_chain_are_refused(seq_length):
    with pytest.raises(ConfigError, match=f"train.seq_length={seq_length} must be > mtp.num_steps=3"):
        load_config(overrides=[f"train.seq_length={seq_length}", "mtp.num_steps=3"])
    assert load_config(overrides=["train.seq_length=4", "mtp.num_steps=3"]).train.seq_length == 4


def truncated_documents(n: int) -> list[dict]:
    """Prompts of 40+ bytes (the byte tokenizer): past a row of 16 tokens, so is every response."""
    return [{"prompt": " ".join(WORDS[i % 5:i % 5 + 12]), "response": "ok then"} for i in range(n)]


def test_data_with_no_trainable_position_is_refused(tmp_path):
    from bebop_megatron.data import DataError, build_train_dataset, check_trainable

    def dataset(records):
        path = write_jsonl(tmp_path / f"d{len(records)}.jsonl", records)
        cfg = load_config(overrides=[f"data.train_files=[{path}]", "train.seq_length=16", "mtp.num_steps=3"])
        return build_train_dataset(cfg, log=lambda *a, **k: None, progress=False)

    with pytest.raises(DataError, match="data.train_files: no position to train .* truncated away .4 documents"):
        check_trainable(dataset(truncated_documents(4)), "data.train_files")
    check_trainable(dataset([*truncated_documents(4), {"prompt": "hi", "response": "cat"}]), "data.train_files")


def test_run_on_truncated_responses_stops_before_the_model(runs):
    proc = runs[0]["truncated"]
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "data.train_files: no position to train the MTP heads on" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and "step " not in proc.stdout and "params" not in proc.stdout
